//! `pvspin-sim`: run one simulation, check the simulator against measured runs, or sweep a grid
//! of host and VM sizes into CSV.

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use pvspin_sim::sweep::{self, Point};
use pvspin_sim::{Sim, SimConfig, Variant};

#[derive(Parser, Debug)]
#[command(
    name = "pvspin-sim",
    about = "Deterministic simulator of pvspin on big hosts"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Simulate one configuration per variant (and per seed) and print what it did.
    Run(RunArgs),
    /// Simulate every row of a CSV of measured runs and compare (target: within 25%).
    Validate {
        /// CSV: hogs,vcpus,iterations,variant,median_s,slowest_s[,cpu_limit,cs_work,ncs_work,
        /// source,bound_s]; a median at bound_s is compared as a lower bound.
        #[arg(long)]
        measured: String,
        /// Seeds per row (the median is compared).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Override the context-switch cost, ns (to test its sensitivity).
        #[arg(long)]
        context_switch_ns: Option<u64>,
        /// Simulate today's pvspin guest (no early wait behind a kicked next owner, and the
        /// pre-wake, where the host says the VM's vCPUs fit its CPUs) instead of the one the
        /// measurements ran.
        #[arg(long)]
        current_guest: bool,
        /// The pre-wake depth of today's guest: for the cells where it is told `VCPUS_FIT`,
        /// also simulated with it without and with the pre-wake (two more columns; the
        /// measured guest predates both).
        #[arg(long, default_value_t = pvspin_guest::SpinConfig::DEFAULT_PREWAKE)]
        prewake: u8,
    },
    /// Simulate a grid of host CPUs, VMs and vCPUs for each variant; write CSV.
    Sweep {
        /// Output file.
        #[arg(long)]
        out: String,
        /// Simulated milliseconds per point.
        #[arg(long, default_value_t = 200)]
        duration_ms: u64,
        /// Host CPU counts.
        #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
        host_cpus: Vec<usize>,
        /// Total vCPU counts (split evenly over the VMs).
        #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
        total_vcpus: Vec<usize>,
        /// VM counts.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        vms: Vec<usize>,
        /// Variants.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "ticket:kick,ticket:kick+yield,ticket:kick/slots,queued:kick:in-kernel@stock,queued:kick/slots:signal-msi@stock"
        )]
        variants: Vec<String>,
        /// Work units inside / between critical sections.
        #[arg(long, default_value_t = 15_000)]
        cs_work: u64,
        /// Work units between critical sections.
        #[arg(long, default_value_t = 15_000)]
        ncs_work: u64,
        /// The seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Also run every point with each VM limited to its share of the host (cgroup quota
        /// of host CPUs / VMs), which sizes the run slots to it.
        #[arg(long)]
        fair_share: bool,
        /// Simulate a pvspin guest that is never told `VCPUS_FIT` (ABI 0.3 hosts; it always
        /// waits early behind a kicked next owner): the validated one. By default the guest
        /// keeps spinning there when its VM's vCPUs fit its CPUs (docs/simulator.md).
        #[arg(long)]
        early_wait_behind_waking: bool,
        /// The pvspin guest's pre-wake depth (0 turns it off; it acts only where the guest is
        /// told `VCPUS_FIT`).
        #[arg(long, default_value_t = pvspin_guest::SpinConfig::DEFAULT_PREWAKE)]
        prewake: u8,
    },
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Host CPUs.
    #[arg(long, default_value_t = 2)]
    host_cpus: usize,
    /// VMs (each with its own lock).
    #[arg(long, default_value_t = 1)]
    vms: usize,
    /// vCPUs per VM.
    #[arg(long, default_value_t = 2)]
    vcpus: usize,
    /// CPU hogs beside the VMs.
    #[arg(long, default_value_t = 0)]
    hogs: usize,
    /// Variants, as `pvspin-vmm bench --variants` names them.
    #[arg(long, value_delimiter = ',', default_value = "ticket:kick")]
    variant: Vec<String>,
    /// Work units inside a critical section.
    #[arg(long, default_value_t = 15_000)]
    cs_work: u64,
    /// Work units between critical sections.
    #[arg(long, default_value_t = 15_000)]
    ncs_work: u64,
    /// Acquisitions per vCPU (the run ends when all are done).
    #[arg(long)]
    iterations: Option<u64>,
    /// Simulated milliseconds (instead of iterations).
    #[arg(long)]
    duration_ms: Option<u64>,
    /// Each VM's CPU limit (cgroup quota), in CPUs.
    #[arg(long)]
    cpu_limit: Option<f64>,
    /// Run slots per VM (0: the VM's entitlement).
    #[arg(long, default_value_t = 0)]
    slots: usize,
    /// First seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seeds to run (seed, seed+1, ...).
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// Stop unfinished runs here, simulated ms.
    #[arg(long, default_value_t = 60_000)]
    bound_ms: u64,
    /// Simulate a pvspin guest that is never told `VCPUS_FIT` (ABI 0.3 hosts; it always waits
    /// early behind a kicked next owner): the validated one. By default the guest keeps
    /// spinning there when its VM's vCPUs fit its CPUs (docs/simulator.md).
    #[arg(long)]
    early_wait_behind_waking: bool,
    /// The pvspin guest's pre-wake depth (0 turns it off; it acts only where the guest is
    /// told `VCPUS_FIT`).
    #[arg(long, default_value_t = pvspin_guest::SpinConfig::DEFAULT_PREWAKE)]
    prewake: u8,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run(a) => run(&a),
        Cmd::Validate {
            measured,
            seeds,
            context_switch_ns,
            current_guest,
            prewake,
        } => validate(&measured, seeds, context_switch_ns, current_guest, prewake),
        Cmd::Sweep {
            out,
            duration_ms,
            host_cpus,
            total_vcpus,
            vms,
            variants,
            cs_work,
            ncs_work,
            seed,
            fair_share,
            early_wait_behind_waking,
            prewake,
        } => (|| {
            let variants = parse_variants(&variants)?;
            let mut base = SimConfig::new(variants[0], 1, 1);
            base.cs_work = cs_work;
            base.ncs_work = ncs_work;
            base.seed = seed;
            base.early_wait_behind_waking = early_wait_behind_waking;
            base.prewake = prewake;
            base.validate().map_err(|e| e.to_string())?;
            let mut f = std::fs::File::create(&out).map_err(|e| format!("{out}: {e}"))?;
            writeln!(f, "{}", sweep::HEADER).map_err(|e| e.to_string())?;
            for &h in &host_cpus {
                for &t in &total_vcpus {
                    for &m in &vms {
                        if t % m != 0 {
                            continue;
                        }
                        let shares: &[bool] = if fair_share && m > 1 {
                            &[false, true]
                        } else {
                            &[false]
                        };
                        for &share in shares {
                            for &variant in &variants {
                                let p = Point {
                                    host_cpus: h,
                                    vms: m,
                                    vcpus: t / m,
                                    variant,
                                    fair_share: share,
                                };
                                let row = sweep::row(&base, &p, duration_ms * 1_000_000)
                                    .map_err(|e| e.to_string())?;
                                eprintln!("{row}");
                                writeln!(f, "{row}").map_err(|e| e.to_string())?;
                            }
                        }
                    }
                }
            }
            Ok(())
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pvspin-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_variants(v: &[String]) -> Result<Vec<Variant>, String> {
    v.iter()
        .map(|s| s.parse::<Variant>().map_err(|e| e.to_string()))
        .collect()
}

fn run(a: &RunArgs) -> Result<(), String> {
    for variant in parse_variants(&a.variant)? {
        let mut times = Vec::new();
        for seed in a.seed..a.seed + a.seeds.max(1) {
            let mut cfg = SimConfig::new(variant, a.vcpus, a.iterations.unwrap_or(1));
            cfg.host_cpus = a.host_cpus;
            cfg.vms = a.vms;
            cfg.hogs = a.hogs;
            cfg.cs_work = a.cs_work;
            cfg.ncs_work = a.ncs_work;
            cfg.iterations = a.iterations;
            cfg.duration_ns = a.duration_ms.map(|ms| ms * 1_000_000);
            if cfg.iterations.is_none() && cfg.duration_ns.is_none() {
                cfg.iterations = Some(10_000);
            }
            cfg.cpu_limit = a.cpu_limit;
            cfg.slots = a.slots;
            cfg.seed = seed;
            cfg.bound_ns = a.bound_ms * 1_000_000;
            cfg.early_wait_behind_waking = a.early_wait_behind_waking;
            cfg.prewake = a.prewake;
            let start = std::time::Instant::now();
            let r = Sim::new(cfg).map_err(|e| e.to_string())?.run();
            let wall = start.elapsed().as_secs_f64();
            let halts: u64 = r.vms.iter().map(|v| v.halts).sum();
            let kicks: u64 = r.vms.iter().map(|v| v.kicks).sum();
            let prewakes: u64 = r.vms.iter().map(|v| v.prewakes).sum();
            let boosts: u64 = r.vms.iter().map(|v| v.boosts).sum();
            let bad: u64 = r.vms.iter().map(|v| v.exclusion_violations).sum();
            println!(
                "{variant} seed {seed}: {:.4} s simulated{}, {} acquisitions, {halts} halts, {kicks} kicks ({prewakes} pre-wakes), {boosts} boosts, {bad} exclusion violations, {} events, wall {wall:.2} s",
                r.guest_seconds(),
                if r.finished || a.duration_ms.is_some() { "" } else { " (bound)" },
                r.acquisitions(),
                r.events,
            );
            if let Some(s) = r.vms.first().and_then(|v| v.slots) {
                println!("  slots: {s:?}");
            }
            times.push(r.guest_seconds());
        }
        if times.len() > 1 {
            times.sort_by(f64::total_cmp);
            println!(
                "{variant}: median {:.4} s, slowest {:.4} s over {} seeds",
                times[times.len() / 2],
                times[times.len() - 1],
                times.len()
            );
        }
    }
    Ok(())
}

fn validate(
    path: &str,
    seeds: u64,
    context_switch_ns: Option<u64>,
    current_guest: bool,
    prewake: u8,
) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    println!("| vCPUs | hogs | limit | cs/ncs | variant | measured median s | simulated median s | sim/measured | within 25% | today's guest, no pre-wake: s (sim/measured) | today's guest, pre-wake {prewake}: s (sim/measured) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut hit, mut all) = (0, 0);
    // Cells where today's guest pre-wakes: how many within 25% without and with it.
    let (mut told, mut told_off, mut told_on) = (0, 0, 0);
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("hogs") {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 6 {
            return Err(format!(
                "{path}:{}: want hogs,vcpus,iterations,variant,median_s,slowest_s",
                n + 1
            ));
        }
        let num = |i: usize| {
            f[i].trim()
                .parse::<f64>()
                .map_err(|e| format!("{path}:{}: {e}", n + 1))
        };
        let (hogs, vcpus, iters) = (num(0)? as usize, num(1)? as usize, num(2)? as u64);
        let variant: Variant = f[3]
            .trim()
            .parse()
            .map_err(|e: pvspin_sim::ConfigError| e.to_string())?;
        let measured = num(4)?;
        // A measured median at the bench's bound (`--timeout-ms`) is a lower bound only.
        let bound = f
            .get(10)
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|&b| b > 0.0);
        let at_bound = bound.is_some_and(|b| measured >= b);
        let config = |seed: u64, today: bool, prewake: u8| {
            let mut cfg = SimConfig::new(variant, vcpus, iters);
            cfg.hogs = hogs;
            cfg.seed = seed;
            // The measurements ran the guest before the convoy fix and the pre-wake (all of
            // them predate both): it is never told `VCPUS_FIT`.
            cfg.early_wait_behind_waking = !today;
            cfg.prewake = prewake;
            if let Some(l) = f.get(6).and_then(|s| s.trim().parse::<f64>().ok()) {
                cfg.cpu_limit = Some(l);
            }
            if let Some(c) = f.get(7).and_then(|s| s.trim().parse::<u64>().ok()) {
                cfg.cs_work = c;
            }
            if let Some(c) = f.get(8).and_then(|s| s.trim().parse::<u64>().ok()) {
                cfg.ncs_work = c;
            }
            cfg.bound_ns = 60_000_000_000;
            if let Some(b) = bound {
                cfg.bound_ns = (b * 1e9) as u64;
            }
            if let Some(ns) = context_switch_ns {
                cfg.cost.context_switch_ns = ns;
            }
            cfg
        };
        let median = |today: bool, prewake: u8| -> Result<f64, String> {
            let mut times = Vec::new();
            for seed in 1..=seeds.max(1) {
                let cfg = config(seed, today, prewake);
                let r = Sim::new(cfg).map_err(|e| e.to_string())?.run();
                times.push(r.guest_seconds());
            }
            times.sort_by(f64::total_cmp);
            Ok(times[times.len() / 2])
        };
        let within = |sim: f64| {
            let ratio = sim / measured;
            if at_bound {
                ratio >= 0.75
            } else {
                (0.75..=1.25).contains(&ratio)
            }
        };
        let sim = median(current_guest, prewake)?;
        let ratio = sim / measured;
        let ok = within(sim);
        let gt = if at_bound { ">=" } else { "" };
        all += 1;
        hit += usize::from(ok);
        // Today's guest pre-wakes where it is told `VCPUS_FIT`; it takes a third vCPU (a
        // holder, the next owner and one behind it) for the pre-wake to find anyone.
        let (mut off_cell, mut on_cell) = (String::new(), String::new());
        if vcpus >= 3 && config(1, true, prewake).prewake_depth() > 0 {
            let (off, on) = (median(true, 0)?, median(true, prewake)?);
            told += 1;
            told_off += usize::from(within(off));
            told_on += usize::from(within(on));
            off_cell = format!("{off:.3} ({:.2})", off / measured);
            on_cell = format!("{on:.3} ({:.2})", on / measured);
        }
        let limit = f.get(6).map_or("", |s| s.trim());
        let cs = f.get(7).map_or("15000", |s| s.trim());
        println!(
            "| {vcpus} | {hogs} | {limit} | {cs} | `{variant}` | {gt}{measured:.3} | {sim:.3} | {ratio:.2} | {} | {off_cell} | {on_cell} |",
            if ok { "yes" } else { "**no**" }
        );
    }
    println!("\n{hit} of {all} cells within 25%");
    println!(
        "where today's guest pre-wakes ({told} cells): {told_off} within 25% without the pre-wake, {told_on} with it"
    );
    Ok(())
}
