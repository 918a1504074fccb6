//! `pvspin-sim`: run one simulation, check the simulator against measured runs, or sweep a grid
//! of host and VM sizes into CSV.

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use pvspin_sim::cost::CostError;
use pvspin_sim::measured::MeasuredRow;
use pvspin_sim::sweep::{self, Point};
use pvspin_sim::{CostModel, Sim, SimConfig, Variant};

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
        /// source,bound_s,guest_prewake,halts]; a median at bound_s is compared as a lower
        /// bound; guest_prewake (empty: the guest before `VCPUS_FIT`) is the measured guest's.
        #[arg(long)]
        measured: String,
        /// Seeds per row (the median is compared).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        /// Override the context-switch cost, ns (to test its sensitivity; the same as
        /// `--cost context_switch_ns=NS`).
        #[arg(long)]
        context_switch_ns: Option<u64>,
        /// The host's costs.
        #[command(flatten)]
        costs: CostArgs,
        /// Simulate today's pvspin guest (no early wait behind a kicked next owner, and the
        /// pre-wake, where the host says the VM's vCPUs fit its CPUs) in every row instead of
        /// the one each row measured (its guest_prewake column).
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
        /// The host's costs.
        #[command(flatten)]
        costs: CostArgs,
    },
}

/// The simulated host's costs: the defaults (the AMD development machines), then a cost file,
/// then single overrides.
#[derive(Args, Debug, Clone, Default)]
struct CostArgs {
    /// A cost file, one `name = value` per line (`#` comments); e.g. the Intel host's,
    /// `crates/pvspin-sim/validation/intel-kvm-pvm.costs`.
    #[arg(long)]
    costs: Option<String>,
    /// One cost, `name=value`, applied after --costs (repeatable; a wrong name lists the
    /// names).
    #[arg(long = "cost", value_name = "NAME=VALUE")]
    cost: Vec<String>,
}

impl CostArgs {
    fn model(&self) -> Result<CostModel, String> {
        let mut model = CostModel::default();
        if let Some(path) = &self.costs {
            model.apply_file(path).map_err(|e| match e {
                // It names the file already.
                CostError::Read { .. } => format!("--costs: {e}"),
                _ => format!("--costs {path}: {e}"),
            })?;
        }
        for one in &self.cost {
            model
                .apply_one(one)
                .map_err(|e| format!("--cost {one}: {e}"))?;
        }
        Ok(model)
    }
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
    /// Simulate the stock guest before 2026-12-02: one steal attempt at slow-path entry, not
    /// Linux's hybrid unfair trylock (the guest the validation's stock rows measured).
    #[arg(long)]
    stock_one_steal: bool,
    /// Run slots: the quantum in us, as the VMM's `--slot-quantum-us` (default: pvspin's
    /// `SlotConfig::new`, 8000).
    #[arg(long)]
    slot_quantum_us: Option<u64>,
    /// Run slots on the in-kernel and signal-msi paths: how often the halt watcher polls, in
    /// us, as the VMM's `--halt-watch-us` (default: pvspin's, 100).
    #[arg(long)]
    halt_watch_us: Option<u64>,
    /// The host's costs.
    #[command(flatten)]
    costs: CostArgs,
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
            costs,
        } => costs.model().and_then(|mut cost| {
            if let Some(ns) = context_switch_ns {
                cost.context_switch_ns = ns;
            }
            validate(&measured, seeds, &cost, current_guest, prewake)
        }),
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
            costs,
        } => (|| {
            let variants = parse_variants(&variants)?;
            let mut base = SimConfig::new(variants[0], 1, 1);
            base.cost = costs.model()?;
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
    let cost = a.costs.model()?;
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
            cfg.stock_hybrid_trylock = !a.stock_one_steal;
            cfg.slot_quantum_ns = a.slot_quantum_us.map(|us| us.saturating_mul(1000));
            cfg.halt_watch_ns = a.halt_watch_us.map(|us| us.saturating_mul(1000));
            cfg.cost = cost.clone();
            let start = std::time::Instant::now();
            let r = Sim::new(cfg).map_err(|e| e.to_string())?.run();
            let wall = start.elapsed().as_secs_f64();
            let halts: u64 = r.vms.iter().map(|v| v.halts).sum();
            let kicks: u64 = r.vms.iter().map(|v| v.kicks).sum();
            let prewakes: u64 = r.vms.iter().map(|v| v.prewakes).sum();
            let boosts: u64 = r.vms.iter().map(|v| v.boosts).sum();
            let bad: u64 = r.vms.iter().map(|v| v.exclusion_violations).sum();
            let early: u64 = r.vms.iter().map(|v| v.early_waits).sum();
            let steals: u64 = r.vms.iter().map(|v| v.steals).sum();
            let contended: u64 = r.vms.iter().map(|v| v.contended).sum();
            println!(
                "{variant} seed {seed}: {:.4} s simulated{}, {} acquisitions ({contended} contended), {halts} halts ({early} waits begun early), {kicks} kicks ({prewakes} pre-wakes), {steals} steals, {boosts} boosts, {bad} exclusion violations, {} events, wall {wall:.2} s",
                r.guest_seconds(),
                if r.finished || a.duration_ms.is_some() { "" } else { " (bound)" },
                r.acquisitions(),
                r.events,
            );
            // The host's own CPU time is the check against `time -v` of a real run: how much
            // of its CPUs the threads used, and so how long they stood idle.
            let busy_ns: u64 = r.thread_cpu_ns.iter().sum();
            let capacity_ns = r.end_ns.saturating_mul(a.host_cpus as u64).max(1);
            println!(
                "  host CPUs busy {:.3} of {:.3} CPU-s ({:.0}%), idle while a thread waited {:.3}; vCPU wake-ups onto a running vCPU {}, {} preempting it",
                busy_ns as f64 / 1e9,
                capacity_ns as f64 / 1e9,
                busy_ns as f64 * 100.0 / capacity_ns as f64,
                r.idle_while_queued_ns as f64 / 1e9,
                r.wakeups_onto_vcpu.0,
                r.wakeups_onto_vcpu.1
            );
            if let Some(v) = r.vms.first() {
                if let Some(s) = v.slots {
                    println!("  slots: {s:?}, halt watcher polls: {}", v.watch_polls);
                }
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

/// A simulated tail out of line: the slowest seed of a cell over the host's slowest run.
const TAIL_RULE: f64 = 1.5;

fn validate(
    path: &str,
    seeds: u64,
    cost: &CostModel,
    current_guest: bool,
    prewake: u8,
) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    println!("| vCPUs | hogs | limit | cs/ncs | variant | measured median s | simulated median s | sim/measured | within 25% | measured slowest s | simulated slowest s (sim/measured) | today's guest, no pre-wake: s (sim/measured) | today's guest, pre-wake {prewake}: s (sim/measured) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut hit, mut all) = (0, 0);
    // Cells whose slowest seed runs longer than the host's slowest run by more than
    // `TAIL_RULE`: a collapse the model has and the host did not show.
    let (mut tails_out, mut tails_out_by_source) =
        (0, std::collections::BTreeMap::<String, usize>::new());
    // Cells where today's guest pre-wakes: how many within 25% without and with it.
    let (mut told, mut told_off, mut told_on) = (0, 0, 0);
    // Rows measured with the pre-wake guest: (hit, all), and their halts, measured and simulated.
    let (mut pw_hit, mut pw_all) = (0, 0);
    let mut halts_rows = Vec::new();
    // Per source (the CSV's `source` column): (within 25%, all).
    let mut by_source = std::collections::BTreeMap::<String, (usize, usize)>::new();
    for (n, line) in text.lines().enumerate() {
        let Some(row) = MeasuredRow::parse(line).map_err(|e| format!("{path}:{}: {e}", n + 1))?
        else {
            continue;
        };
        let measured = row.median_s;
        let at_bound = row.at_bound();
        let config = |seed: u64, today: Option<u8>| {
            let mut cfg = row.config(seed, today);
            cfg.cost = row.cost(cost);
            cfg
        };
        // The median and the slowest guest seconds over the seeds, and the median of the VM's
        // halts.
        let median = |today: Option<u8>| -> Result<(f64, f64, u64), String> {
            let (mut times, mut halts) = (Vec::new(), Vec::new());
            for seed in 1..=seeds.max(1) {
                let r = Sim::new(config(seed, today))
                    .map_err(|e| e.to_string())?
                    .run();
                times.push(r.guest_seconds());
                halts.push(r.vms.iter().map(|v| v.halts).sum::<u64>());
            }
            times.sort_by(f64::total_cmp);
            halts.sort_unstable();
            let slowest = times[times.len() - 1];
            Ok((times[times.len() / 2], slowest, halts[halts.len() / 2]))
        };
        let within = |sim: f64| {
            let ratio = sim / measured;
            if at_bound {
                ratio >= 0.75
            } else {
                (0.75..=1.25).contains(&ratio)
            }
        };
        // The measured guest (the row's `guest_prewake`), or today's with `--current-guest`.
        let (sim, sim_slowest, sim_halts) = median(current_guest.then_some(prewake))?;
        let ratio = sim / measured;
        let tail_ratio = sim_slowest / row.slowest_s;
        let tail_out = !at_bound && tail_ratio > TAIL_RULE;
        if tail_out {
            tails_out += 1;
            *tails_out_by_source.entry(row.source.clone()).or_default() += 1;
        }
        let ok = within(sim);
        let gt = if at_bound { ">=" } else { "" };
        all += 1;
        hit += usize::from(ok);
        let src = by_source.entry(row.source.clone()).or_default();
        src.0 += usize::from(ok);
        src.1 += 1;
        if row.guest_prewake.is_some() {
            pw_all += 1;
            pw_hit += usize::from(ok);
        }
        if let Some(h) = row.halts {
            halts_rows.push((row.vcpus, row.variant, h, sim_halts));
        }
        // Today's guest pre-wakes where it is told `VCPUS_FIT`; it takes a third vCPU (a
        // holder, the next owner and one behind it) for the pre-wake to find anyone.
        let (mut off_cell, mut on_cell) = (String::new(), String::new());
        if row.vcpus >= 3 && config(1, Some(prewake)).prewake_depth() > 0 {
            let (off, on) = (median(Some(0))?.0, median(Some(prewake))?.0);
            told += 1;
            told_off += usize::from(within(off));
            told_on += usize::from(within(on));
            off_cell = format!("{off:.3} ({:.2})", off / measured);
            on_cell = format!("{on:.3} ({:.2})", on / measured);
        }
        let limit = row.cpu_limit.map_or(String::new(), |l| l.to_string());
        let cs = row.cs_work.unwrap_or(15_000);
        let variant = row.variant;
        let vcpus = row.vcpus;
        let hogs = row.hogs;
        println!(
            "| {vcpus} | {hogs} | {limit} | {cs} | `{variant}` | {gt}{measured:.3} | {sim:.3} | {ratio:.2} | {} | {:.3} | {sim_slowest:.3} ({tail_ratio:.2}){} | {off_cell} | {on_cell} |",
            if ok { "yes" } else { "**no**" },
            row.slowest_s,
            if tail_out { " **tail**" } else { "" }
        );
    }
    println!("\n{hit} of {all} cells within 25%");
    let sources: Vec<String> = by_source
        .iter()
        .map(|(s, (h, a))| format!("{} {h} of {a}", if s.is_empty() { "-" } else { s }))
        .collect();
    println!("by source: {}", sources.join(", "));
    let tails: Vec<String> = tails_out_by_source
        .iter()
        .map(|(s, n)| format!("{} {n}", if s.is_empty() { "-" } else { s }))
        .collect();
    println!(
        "slowest of {seeds} seeds more than {TAIL_RULE}x the measured slowest: {tails_out} cells{}",
        if tails.is_empty() {
            String::new()
        } else {
            format!(" ({})", tails.join(", "))
        }
    );
    println!(
        "where today's guest pre-wakes ({told} cells): {told_off} within 25% without the pre-wake, {told_on} with it"
    );
    if pw_all > 0 {
        println!("rows measured with the pre-wake guest: {pw_hit} of {pw_all} within 25%");
    }
    if !halts_rows.is_empty() {
        println!("\n| vCPUs | variant | measured halts (median) | simulated halts (median) | sim/measured |");
        println!("|---|---|---|---|---|");
        for (vcpus, variant, measured, sim) in halts_rows {
            println!(
                "| {vcpus} | `{variant}` | {measured} | {sim} | {:.2} |",
                sim as f64 / measured.max(1) as f64
            );
        }
    }
    Ok(())
}
