//! `pvspin-vmm bench --suite NAME`: one command per table of `docs/benchmarks.md`.
//!
//! A suite is a list of tables. Each table is one `pvspin-vmm bench` (a child process of this
//! binary, so `--vms` and the progress bar work as they do by hand) whose runs go to
//! `OUT/TABLE.jsonl` (`report` reads them), its stdout to `OUT/TABLE.txt` and its plot to
//! `OUT/TABLE.svg`. A table whose rows cannot share one `bench` (two builds for A/B, two
//! pvspind daemons, the C probe beside pvspin) has several arms, run round by round (every arm
//! once per round, `--runs 1` each) so noise spreads over all of them, and merged into one
//! JSON-lines file per arm. Some suites also run pvspind daemons for their tables, the
//! co-tenant beside a VM (confinement), or draw one figure over several tables (time per
//! acquisition against vCPUs). `OUT/suite.txt` records the machine, the load and every
//! command.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench::{median_of, Variant};
use crate::cli::{BenchArgs, Cli};
use crate::saved::Record;

/// Why a suite failed.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    /// No suite of that name.
    #[error("no suite {0:?}; `--suite list` lists them")]
    Unknown(String),
    /// A suite needs an option it was not given.
    #[error("rule: --suite {suite} needs {what}")]
    Needs {
        /// The suite.
        suite: &'static str,
        /// What it needs.
        what: &'static str,
    },
    /// A planned bench command is not one `bench` accepts (a bug in the suite).
    #[error("table {table}: {message}")]
    Plan {
        /// The table.
        table: String,
        /// What is wrong.
        message: String,
    },
    /// A file or process could not be used.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A child process failed or printed what it should not.
    #[error("{0}")]
    Child(String),
    /// Saved runs could not be read back.
    #[error(transparent)]
    Report(#[from] crate::saved::ReportError),
    /// A plot could not be made.
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
}

impl SuiteError {
    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| SuiteError::Io { what, source }
    }
}

/// What the suite runs with: the command line's suite options.
#[derive(Clone, Debug, Default)]
pub struct SuiteOptions {
    /// Runs per case (`None`: each table's own, 1 with `quick`).
    pub runs: Option<u32>,
    /// Scaled down for smoke tests.
    pub quick: bool,
    /// `ab`: the builds.
    pub build_a: Option<PathBuf>,
    /// `ab`: see `build_a`.
    pub build_b: Option<PathBuf>,
    /// `ab`: the bench arguments both builds run (empty: the suite's).
    pub extra: Vec<String>,
    /// `kick-latency`: the C probes' directory.
    pub probes: Option<PathBuf>,
    /// `--max-host-steal` and `--steal-retries`, passed on to every bench of the suite.
    pub steal_bound: Option<(f64, u32)>,
}

impl SuiteOptions {
    /// The bench arguments of `steal_bound` (none without one).
    fn steal_args(&self) -> Vec<String> {
        self.steal_bound.map_or(Vec::new(), |(percent, retries)| {
            vec![
                "--max-host-steal".into(),
                percent.to_string(),
                "--steal-retries".into(),
                retries.to_string(),
            ]
        })
    }

    /// `full`, or `quick` with `--quick`, as an argument.
    fn n(&self, full: u64, quick: u64) -> String {
        if self.quick { quick } else { full }.to_string()
    }

    /// Runs per case of a table whose own count is `full`.
    fn runs(&self, full: u32) -> u32 {
        self.runs.unwrap_or(if self.quick { 1 } else { full })
    }
}

/// Which binary a bench arm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    /// This pvspin-vmm.
    This,
    /// `--build-a`.
    A,
    /// `--build-b`.
    B,
}

/// A pvspind a table needs; `{sockets}` in its arguments is the suite's socket directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Daemon {
    /// Its name (its control socket is `{sockets}/NAME-control.sock`).
    pub name: &'static str,
    /// Its arguments.
    pub args: Vec<String>,
}

/// One case of the C probe `e2b_doorbell`, beside the bench variant of the same index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeCase {
    /// The row's name.
    pub label: &'static str,
    /// The probe's mode (`irqfd`, `msi`, `user`).
    pub mode: &'static str,
    /// Its halt-poll argument (ns, `-1`: none).
    pub poll: &'static str,
    /// Its user-spin argument (ns), if any.
    pub spin: Option<&'static str>,
}

/// One arm of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arm {
    /// `BINARY bench ARGS`.
    Bench {
        /// Which build.
        binary: Binary,
        /// Its name among the table's arms (its file is `TABLE-LABEL.jsonl`); empty: its
        /// number.
        label: &'static str,
        /// `bench`'s arguments without `--runs`, `--json-out`, `--plot`.
        args: Vec<String>,
    },
    /// The C probe, one run per case and round.
    Probe {
        /// Its cases.
        cases: Vec<ProbeCase>,
        /// Samples per run.
        samples: u32,
    },
}

/// What a table prints after its bench tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Summary {
    /// Nothing more.
    None,
    /// Ping-pong: guest time per handoff and waits per handoff, per variant.
    PerHandoff,
    /// The probe's p50 beside pvspin's, per case.
    Probe,
    /// A against B (`report --ab`).
    Ab,
}

/// One confinement case: a VM's arguments beside the co-tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfinementCase {
    /// The row's name.
    pub name: &'static str,
    /// The VM's `run` arguments beside the common ones.
    pub args: Vec<&'static str>,
    /// The co-tenant's threads pinned one per CPU.
    pub pinned: bool,
    /// The row it is compared with (its index).
    pub baseline: usize,
}

/// One step of a suite.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// A table.
    Table {
        /// File stem of its outputs.
        name: String,
        /// What it reproduces.
        what: String,
        /// Runs per case.
        runs: u32,
        /// One bench, or several run round by round.
        arms: Vec<Arm>,
        /// Daemons running while it runs.
        daemons: Vec<Daemon>,
        /// What it prints after the tables.
        summary: Summary,
    },
    /// A co-tenant's throughput beside VMs (`docs/benchmarks.md` §8.3, §10.3).
    Confinement {
        /// File stem of its outputs.
        name: String,
        /// What it reproduces.
        what: String,
        /// Runs per case, interleaved.
        runs: u32,
        /// Its cases.
        cases: Vec<ConfinementCase>,
        /// How long each VM runs, ms.
        vm_ms: u64,
        /// How long the co-tenant runs, ms.
        cotenant_ms: u64,
    },
    /// One figure (and the tables again) over earlier tables' runs, e.g. against vCPUs.
    Combine {
        /// File stem of its outputs.
        name: String,
        /// What it shows.
        what: String,
        /// The tables.
        inputs: Vec<String>,
    },
    /// pvspind against in process, per row (`docs/benchmarks.md` §11).
    Parity {
        /// File stem of its outputs.
        name: String,
        /// The tables.
        inputs: Vec<String>,
    },
}

impl Step {
    /// Its file stem.
    pub fn name(&self) -> &str {
        match self {
            Step::Table { name, .. }
            | Step::Confinement { name, .. }
            | Step::Combine { name, .. }
            | Step::Parity { name, .. } => name,
        }
    }
}

/// A suite: its name, what it reproduces, its steps.
#[derive(Clone, Copy, Debug)]
pub struct Suite {
    /// `--suite NAME`.
    pub name: &'static str,
    /// The tables of `docs/benchmarks.md` it reproduces.
    pub reproduces: &'static str,
    plan: fn(&SuiteOptions) -> Result<Vec<Step>, SuiteError>,
}

impl Suite {
    /// Its steps with `options`.
    pub fn plan(&self, options: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
        (self.plan)(options)
    }
}

/// Every suite.
pub const SUITES: &[Suite] = &[
    Suite {
        name: "seed",
        reproduces: "§7.1: the seed experiment at native speed, 2 vCPUs at 1x/2x/3x (0/2/4 hogs), every lock with and without PV",
        plan: seed,
    },
    Suite {
        name: "seed-kernel",
        reproduces: "§1 and §7.3: the same in guest kernel mode (emulated on the development hosts), ABI 0.2 spin counts beside time budgets",
        plan: seed_kernel,
    },
    Suite {
        name: "overcommit",
        reproduces: "§7.2: in-VM overcommit, 4, 6, 8, 16 vCPUs on the host's CPUs, no hogs, and time per acquisition against vCPUs",
        plan: overcommit,
    },
    Suite {
        name: "actuators",
        reproduces: "§3: directed yield's actuators (yield, nice, fifo), 4 and 8 vCPUs, and 2 vCPUs with hogs, kernel mode",
        plan: actuators,
    },
    Suite {
        name: "short-cs",
        reproduces: "§7.8: short critical sections at 1x, what PV costs, 11 interleaved runs",
        plan: short_cs,
    },
    Suite {
        name: "convoy",
        reproduces: "§14: the wake-up convoy at 2x/3x, guests told VCPUS_FIT beside guests told nothing (/cpus=1), 11 runs, tails; and the same rule with more vCPUs than CPUs",
        plan: convoy,
    },
    Suite {
        name: "kick-latency",
        reproduces: "§2: kick-to-wake per wake path with and without halt polling (with --probes DIR: beside the C probe e2b_doorbell), and §7.4: per path at native speed",
        plan: kick_latency,
    },
    Suite {
        name: "slots",
        reproduces: "§8.1, §8.2, §8.4: run slots against the host scheduler, user and kernel mode, and two VMs side by side",
        plan: slots,
    },
    Suite {
        name: "stock-slots",
        reproduces: "§10: stock guests (Linux's pv qspinlock, halts inside KVM) with and without run slots, 4-16 vCPUs, a 1-CPU quota, hogs, kernel mode",
        plan: stock_slots,
    },
    Suite {
        name: "size",
        reproduces: "§12: run slots against kick at 4, 32, 64, 128 and 255 vCPUs, the same acquisitions in all at every size, every thread confined, then 4 vCPUs again for drift",
        plan: size,
    },
    Suite {
        name: "confinement",
        reproduces: "§8.3 and §10.3: a co-tenant's throughput beside an abusive guest, boosts confined or not, pinned co-tenants",
        plan: confinement,
    },
    Suite {
        name: "vhost",
        reproduces: "§9.1, §9.2, §9.4: pvspind over vhost-user beside the in-process paths: kick-to-wake (paced and unpaced daemon), the 2x/3x lock table, two VMs on one daemon",
        plan: vhost,
    },
    Suite {
        name: "vhost-parity",
        reproduces: "§11: pvspind against in process at native speed, 4, 6, 8 vCPUs and 2 vCPUs at 1x/2x/3x, with the summary per row",
        plan: vhost_parity,
    },
    Suite {
        name: "ab",
        reproduces: "§7.3, §7.8: two builds side by side (--build-a OLD --build-b NEW), alternating round by round, each first every other round; bench arguments after `--` (default: kernel-mode kick and kick+yield at 0 and 2 hogs)",
        plan: ab,
    },
];

/// The suite named `name`.
pub fn find(name: &str) -> Result<&'static Suite, SuiteError> {
    SUITES
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| SuiteError::Unknown(name.to_string()))
}

fn args(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_string).collect()
}

fn bench(text: &str) -> Vec<Arm> {
    vec![Arm::Bench {
        binary: Binary::This,
        label: "",
        args: args(text),
    }]
}

fn table(name: &str, what: &str, runs: u32, arms: Vec<Arm>) -> Step {
    Step::Table {
        name: name.to_string(),
        what: what.to_string(),
        runs,
        arms,
        daemons: Vec::new(),
        summary: Summary::None,
    }
}

const NATIVE_LOCKS: &str = "ticket:off,tas:off,backoff:off,backoff:kick,ticket:kick,ticket:kick+yield,queued:kick,queued:kick+yield";

fn seed(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    Ok(vec![table(
        "seed",
        "2 vCPUs at 1x, 2x, 3x, user mode (§7.1)",
        o.runs(5),
        bench(&format!(
            "--cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 --hogs 0,2,4 \
             --timeout-ms {} --variants {NATIVE_LOCKS},queued:off",
            o.n(300_000, 3000),
            o.n(60_000, 10_000)
        )),
    )])
}

fn seed_kernel(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    Ok(vec![table(
        "seed-kernel",
        "2 vCPUs at 1x, 2x, 3x, kernel mode (§7.3, the table of §1)",
        o.runs(5),
        bench(&format!(
            "--vcpus 2 --iterations {} --hogs 0,2,4 --timeout-ms {} --variants \
             ticket:off,ticket:kick/spins,ticket:kick,ticket:kick+yield/spins,ticket:kick+yield,\
             queued:kick/spins,queued:kick,queued:kick+yield,backoff:off,backoff:kick",
            o.n(1000, 40),
            o.n(120_000, 20_000)
        )),
    )])
}

fn overcommit(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    let mut steps: Vec<Step> = [4, 6, 8, 16]
        .iter()
        .map(|v| {
            table(
                &format!("vcpus-{v}"),
                &format!("{v} vCPUs on the host's CPUs, no hogs, user mode (§7.2)"),
                o.runs(5),
                bench(&format!(
                    "--cs-mode user --vcpus {v} --iterations {} --cs-work 5000 --ncs-work 5000 \
                     --hogs 0 --timeout-ms {} --variants {NATIVE_LOCKS}",
                    o.n(25_000, 300),
                    o.n(20_000, 10_000)
                )),
            )
        })
        .collect();
    steps.push(combine(
        "overcommit",
        "time per acquisition against vCPUs (§7.2)",
        &steps,
    ));
    Ok(steps)
}

fn convoy(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    Ok(vec![
        table(
            "convoy-2x-3x",
            "2 vCPUs at 1x, 2x, 3x, user mode, told VCPUS_FIT or not (/cpus=1) (§14)",
            o.runs(11),
            bench(&format!(
                "--cs-mode user --vcpus 2 --iterations {} --cs-work 15000 --ncs-work 15000 \
                 --hogs 0,2,4 --timeout-ms {} --variants ticket:kick/cpus=1,ticket:kick,\
                 ticket:kick+yield/cpus=1,ticket:kick+yield,ticket:kick/slots/cpus=1,\
                 ticket:kick/slots,queued:kick/cpus=1,queued:kick,queued:kick:in-kernel@stock,\
                 queued:kick/slots:in-kernel@stock",
                o.n(50_000, 2000),
                o.n(60_000, 10_000)
            )),
        ),
        table(
            "convoy-vcpus-6",
            "6 vCPUs on 2 CPUs, user mode: not told (the default) against forced /cpus=6 (§14)",
            o.runs(5),
            bench(&format!(
                "--cs-mode user --vcpus 6 --iterations {} --cs-work 15000 --ncs-work 15000 \
                 --hogs 0 --timeout-ms {} --variants ticket:kick,ticket:kick/cpus=6,queued:kick,\
                 queued:kick/cpus=6",
                o.n(13_333, 500),
                o.n(60_000, 10_000)
            )),
        ),
    ])
}

fn combine(name: &str, what: &str, tables: &[Step]) -> Step {
    Step::Combine {
        name: name.to_string(),
        what: what.to_string(),
        inputs: tables.iter().map(|t| t.name().to_string()).collect(),
    }
}

fn actuators(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    const EACH: &str = "ticket:kick,ticket:kick+yield:in-kernel:yield,ticket:kick+yield:in-kernel:nice,ticket:kick+yield:in-kernel:fifo";
    let rows = |vcpus: u32, iterations: String, hogs: &str, queued: bool| {
        format!(
            "--vcpus {vcpus} --iterations {iterations} --cs-work 40 --ncs-work 40 --hogs {hogs} \
             --variants {EACH}{}",
            if queued {
                ",queued:kick,queued:kick+yield:in-kernel:yield"
            } else {
                ""
            }
        )
    };
    Ok(vec![
        table(
            "vcpus-4",
            "4 vCPUs, 0 and 2 hogs, kernel mode (§3)",
            o.runs(5),
            bench(&rows(4, o.n(500, 20), "0,2", true)),
        ),
        table(
            "vcpus-8",
            "8 vCPUs, no hogs, kernel mode (§3)",
            o.runs(5),
            bench(&rows(8, o.n(250, 10), "0", true)),
        ),
        table(
            "vcpus-2-hogs",
            "2 vCPUs, 2 and 4 hogs, kernel mode (§3)",
            o.runs(5),
            bench(&rows(2, o.n(1000, 40), "2,4", false)),
        ),
    ])
}

fn short_cs(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    Ok(vec![table(
        "short-cs",
        "2 vCPUs at 1x, critical sections of tens of ns, user mode (§7.8)",
        o.runs(11),
        bench(&format!(
            "--cs-mode user --vcpus 2 --iterations {} --hogs 0 --variants \
             ticket:off,ticket:kick,ticket:kick+yield,queued:off,queued:kick,queued:kick+yield",
            o.n(2_000_000, 20_000)
        )),
    )])
}

/// The probe's delay loop iteration is 2 instructions, a ping-pong work unit about 4: the
/// probe's delay of 20 blocks its waiter about as long as `--cs-work 10`.
const PROBE_DELAY: u32 = 20;

fn kick_latency(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    let samples = if o.quick { 40 } else { 400 };
    let mut arms = bench(&format!(
        "--workload pingpong --pv kick --vcpus 2 --iterations {} --cs-work {} --ncs-work 0 \
         --hogs 0 --variants ticket:kick/poll=0:in-kernel,ticket:kick/poll=200000:in-kernel,\
         ticket:kick/poll=0:signal-msi,ticket:kick/poll=200000:signal-msi,\
         ticket:kick/park=0:userspace,ticket:kick/park=50:userspace",
        samples + 1,
        PROBE_DELAY / 2
    ));
    let case = |label, mode, poll, spin| ProbeCase {
        label,
        mode,
        poll,
        spin,
    };
    if o.probes.is_some() {
        arms.push(Arm::Probe {
            cases: vec![
                case("in-kernel, no halt polling", "irqfd", "0", None),
                case("in-kernel, halt polling 200 us", "irqfd", "200000", None),
                case("signal-msi, no halt polling", "msi", "0", None),
                case("signal-msi, halt polling 200 us", "msi", "200000", None),
                case("userspace, no spin", "user", "-1", None),
                case("userspace, spin 50 us", "user", "-1", Some("50000")),
            ],
            samples,
        });
    }
    let mut steps = vec![Step::Table {
        name: "kernel".into(),
        what: "kick-to-wake per path, with and without halt polling, kernel mode (§2)".into(),
        runs: o.runs(5),
        summary: if o.probes.is_some() {
            Summary::Probe
        } else {
            Summary::PerHandoff
        },
        arms,
        daemons: Vec::new(),
    }];
    steps.push(Step::Table {
        name: "user".into(),
        what: "kick-to-wake per path at native speed, user mode (§7.4)".into(),
        runs: o.runs(5),
        arms: bench(&format!(
            "--workload pingpong --pv kick --cs-mode user --vcpus 2 --iterations {} --cs-work 0 \
             --ncs-work 2000 --hogs 0 --variants \
             ticket:kick:in-kernel,ticket:kick:signal-msi,ticket:kick:userspace",
            o.n(20_000, 2000)
        )),
        daemons: Vec::new(),
        summary: Summary::PerHandoff,
    });
    Ok(steps)
}

fn slots(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    const VARIANTS: &str = "ticket:kick:in-kernel,ticket:kick+yield:in-kernel,ticket:kick:userspace,ticket:kick/slots:userspace";
    let mut steps = Vec::new();
    for v in [4u64, 6, 8] {
        steps.push(table(
            &format!("user-{v}"),
            &format!("{v} vCPUs on the host's CPUs, user mode (§8.1)"),
            o.runs(5),
            bench(&format!(
                "--cs-mode user --vcpus {v} --iterations {} --cs-work 5000 --ncs-work 5000 \
                 --hogs 0 --timeout-ms 30000 --variants {VARIANTS}",
                o.n(80_000 / v, 1200 / v)
            )),
        ));
    }
    steps.push(table(
        "user-2",
        "2 vCPUs at 1x, 2x, 3x, user mode (§8.1)",
        o.runs(5),
        bench(&format!(
            "--cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 \
             --hogs 0,2,4 --timeout-ms 30000 --variants {VARIANTS}",
            o.n(300_000, 3000)
        )),
    ));
    // The 2-vCPU table has hogs, the others do not: the figure against vCPUs leaves it out.
    let user = steps[..3].to_vec();
    steps.push(combine(
        "user",
        "run slots: time per acquisition against vCPUs, user mode (§8.1)",
        &user,
    ));
    let mut kernel = Vec::new();
    for v in [4u64, 6, 8] {
        kernel.push(table(
            &format!("kernel-{v}"),
            &format!("{v} vCPUs on the host's CPUs, kernel mode (§8.2)"),
            o.runs(3),
            bench(&format!(
                "--vcpus {v} --iterations {} --hogs 0 --timeout-ms 60000 --variants {VARIANTS}",
                o.n(2400 / v, 120 / v)
            )),
        ));
    }
    kernel.push(table(
        "kernel-2",
        "2 vCPUs at 1x, 2x, 3x, kernel mode (§8.2)",
        o.runs(3),
        bench(&format!(
            "--vcpus 2 --iterations {} --hogs 0,2,4 --timeout-ms 60000 --variants {VARIANTS}",
            o.n(1000, 40)
        )),
    ));
    steps.extend(kernel.iter().cloned());
    steps.push(combine(
        "kernel",
        "run slots: time per acquisition against vCPUs, kernel mode (§8.2)",
        &kernel[..3],
    ));
    steps.push(table(
        "vms",
        "two 2-vCPU VMs side by side, separate processes (§8.4)",
        o.runs(5),
        bench(&format!(
            "--vms 2 --cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 \
             --hogs 0 --timeout-ms 30000 --variants ticket:kick:in-kernel,ticket:kick/slots:userspace",
            o.n(300_000, 3000)
        )),
    ));
    Ok(steps)
}

fn stock_slots(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    const STOCK: &str = "queued:kick:in-kernel@stock,queued:kick/slots:in-kernel@stock,queued:kick/slots:signal-msi@stock";
    const AWARE: &str = "queued:kick/slots:userspace@pvspin,ticket:kick:in-kernel@pvspin,ticket:kick/slots:in-kernel@pvspin";
    const WORK: &str = "--cs-mode user --cs-work 15000 --ncs-work 15000 --timeout-ms 60000";
    let per_case = |v: u64| o.n(80_000 / v, 1600 / v);
    let mut vcpus = Vec::new();
    for v in [4u64, 6, 8, 16] {
        vcpus.push(table(
            &format!("vcpus-{v}"),
            &format!("{v} vCPUs on the host's CPUs, user mode (§10)"),
            o.runs(5),
            bench(&format!(
                "{WORK} --vcpus {v} --iterations {} --hogs 0 --variants {STOCK},{AWARE}",
                per_case(v)
            )),
        ));
    }
    let mut steps = vcpus.clone();
    steps.push(combine(
        "vcpus",
        "stock and pvspin-aware guests with and without slots: time per acquisition against vCPUs (§10)",
        &vcpus,
    ));
    for v in [4u64, 8] {
        steps.push(table(
            &format!("quota1-vcpus-{v}"),
            &format!("{v} vCPUs under a 1-CPU quota in the VM's own cpu cgroup (§10)"),
            o.runs(5),
            bench(&format!(
                "{WORK} --cpu-limit 1 --vcpus {v} --iterations {} --hogs 0 --variants {STOCK},{AWARE}",
                per_case(v)
            )),
        ));
    }
    steps.push(table(
        "hogs",
        "2 vCPUs at 1x, 2x, 3x, the stock guest with and without slots (§10)",
        o.runs(5),
        bench(&format!(
            "{WORK} --vcpus 2 --iterations {} --hogs 0,2,4 --variants {STOCK}",
            o.n(40_000, 800)
        )),
    ));
    for v in [4u64, 8] {
        steps.push(table(
            &format!("kernel-vcpus-{v}"),
            &format!("{v} vCPUs, the stock guest in kernel mode (§10)"),
            o.runs(5),
            bench(&format!(
                "--vcpus {v} --iterations {} --hogs 0 --timeout-ms 120000 --variants {STOCK}",
                o.n(2400 / v, 120 / v)
            )),
        ));
    }
    Ok(steps)
}

fn size(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    const VARIANTS: &str =
        "ticket:kick:in-kernel,ticket:kick/slots:userspace,queued:kick/slots:userspace";
    // The same acquisitions in all at every size. The watchdog allows 60 s without progress:
    // with 255 vCPU threads on two cores that other jobs also load, a vCPU can wait past the
    // default 10 s for its turn. (Most stops at 64-255 vCPUs came from the VMM starting its
    // vCPU threads one by one; they now start together.)
    let total: u64 = if o.quick { 2560 } else { 25_600 };
    let mut steps = Vec::new();
    for (name, v) in [
        ("vcpus-4", 4u64),
        ("vcpus-32", 32),
        ("vcpus-64", 64),
        ("vcpus-128", 128),
        ("vcpus-255", 255),
        ("vcpus-4-again", 4),
    ] {
        steps.push(table(
            name,
            &format!("{v} vCPUs on the host's CPUs, user mode, every thread confined (§12)"),
            o.runs(5),
            bench(&format!(
                "--seccomp enforce --cs-mode user --vcpus {v} --iterations {} --cs-work 5000 \
                 --ncs-work 5000 --hogs 0 --timeout-ms 120000 --watchdog-ms 60000 --variants {VARIANTS}",
                total / v
            )),
        ));
    }
    let sizes = steps[..5].to_vec();
    steps.push(combine(
        "vcpus",
        "run slots and kick at size: time per acquisition against vCPUs (§12)",
        &sizes,
    ));
    Ok(steps)
}

fn confinement(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    const ABUSE: [&str; 4] = ["--workload", "abuse", "--pv", "kick+yield"];
    const CGROUP: [&str; 3] = ["--vm-cgroup", "--seccomp", "off"];
    let case = |name, parts: &[&[&'static str]], pinned, baseline| ConfinementCase {
        name,
        args: parts.concat(),
        pinned,
        baseline,
    };
    let burn: &[&str] = &["--workload", "burn"];
    Ok(vec![Step::Confinement {
        name: "confinement".into(),
        what: "a co-tenant (2 busy threads) beside a 2-vCPU VM, user mode (§8.3, §10.3)".into(),
        runs: o.runs(5),
        cases: vec![
            case("spin-only guest", &[burn], false, 0),
            case(
                "abusive guest, boosts confined (default)",
                &[&ABUSE],
                false,
                0,
            ),
            case(
                "abusive guest, boosts unconfined",
                &[&ABUSE, &["--boosts", "unconfined"]],
                false,
                0,
            ),
            case("spin-only guest, --vm-cgroup", &[burn, &CGROUP], false, 3),
            case(
                "abusive guest, --vm-cgroup (nice boosts inside it)",
                &[&ABUSE, &CGROUP],
                false,
                3,
            ),
            case(
                "pinned co-tenant: spin-only guest, --vm-cgroup (no directed yield)",
                &[burn, &CGROUP],
                true,
                5,
            ),
            case(
                "pinned co-tenant: abusive guest, --vm-cgroup, boosts confined",
                &[&ABUSE, &CGROUP],
                true,
                5,
            ),
            case(
                "pinned co-tenant: abusive guest, --vm-cgroup, yield only",
                &[&ABUSE, &["--actuator", "yield"], &CGROUP],
                true,
                5,
            ),
        ],
        vm_ms: if o.quick { 900 } else { 2800 },
        cotenant_ms: if o.quick { 500 } else { 2000 },
    }])
}

fn daemon(name: &'static str, extra: &str) -> Daemon {
    Daemon {
        name,
        args: args(&format!(
            "--socket {{sockets}}/{name}.sock --control {{sockets}}/{name}-control.sock {extra}"
        )),
    }
}

fn vhost(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    let paced = daemon("paced", "--max-vcpus 4");
    // The same daemon without its per-VM event pacing: what the pacing costs a guest that
    // kicks this often.
    let unpaced = daemon("unpaced", "--max-vcpus 4 --max-events-per-sec 10000000");
    let latency = |mode: &str, handoffs: String| {
        let common = format!(
            "--workload pingpong --pv kick --vcpus 2 --iterations {handoffs} --cs-work 10 \
             --ncs-work 0 --hogs 0 {mode}"
        );
        vec![
            Arm::Bench {
                binary: Binary::This,
                label: "paced",
                args: args(&format!(
                    "{common} --pv-backend vhost-user:{{sockets}}/paced.sock --variants \
                     ticket:kick:in-kernel,ticket:kick:signal-msi,ticket:kick:userspace,\
                     ticket:kick/vhost:in-kernel"
                )),
            },
            Arm::Bench {
                binary: Binary::This,
                label: "unpaced",
                args: args(&format!(
                    "{common} --pv-backend vhost-user:{{sockets}}/unpaced.sock --variants \
                     ticket:kick/vhost:in-kernel"
                )),
            },
        ]
    };
    let with_daemons = |name: &str, what: &str, arms, daemons: Vec<Daemon>, summary| Step::Table {
        name: name.to_string(),
        what: what.to_string(),
        runs: o.runs(5),
        arms,
        daemons,
        summary,
    };
    Ok(vec![
        with_daemons(
            "latency-user",
            "kick-to-wake in process and through pvspind (paced; second table: unpaced), user mode (§9.1)",
            latency("--cs-mode user", o.n(20_000, 500)),
            vec![paced.clone(), unpaced.clone()],
            Summary::PerHandoff,
        ),
        with_daemons(
            "latency-kernel",
            "kick-to-wake in process and through pvspind (paced; second table: unpaced), kernel mode (§9.1)",
            latency("", o.n(1000, 50)),
            vec![paced.clone(), unpaced],
            Summary::PerHandoff,
        ),
        with_daemons(
            "lock",
            "2 vCPUs at 1x, 2x, 3x, in process and through pvspind, user mode (§9.2)",
            bench(&format!(
                "--cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 \
                 --hogs 0,2,4 --timeout-ms 30000 --pv-backend vhost-user:{{sockets}}/paced.sock \
                 --variants ticket:off,ticket:kick,ticket:kick/vhost,queued:kick,\
                 queued:kick/vhost,ticket:kick+yield,ticket:kick+yield/vhost",
                o.n(300_000, 3000)
            )),
            vec![paced],
            Summary::None,
        ),
        with_daemons(
            "vms",
            "two 2-vCPU VMs on one pvspind, a socket each (§9.4)",
            bench(&format!(
                "--vms 2 --cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 \
                 --hogs 0 --timeout-ms 30000 --pv-backend vhost-user:{{sockets}}/vm{{vm}}.sock \
                 --variants ticket:kick,ticket:kick/vhost",
                o.n(300_000, 3000)
            )),
            vec![Daemon {
                name: "two-vms",
                args: args(
                    "--socket {sockets}/vm0.sock --socket {sockets}/vm1.sock \
                     --control {sockets}/two-vms-control.sock --max-vcpus 4",
                ),
            }],
            Summary::None,
        ),
    ])
}

fn vhost_parity(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    // The daemon's defaults (the kick worker at the daemon's own priority), as a user starts
    // it: `SCHED_FIFO` workers made 2-vCPU runs with co-tenant hogs collapse, and did not help
    // at 4-8 vCPUs on a quiet machine (docs/benchmarks.md, pvspind at parity).
    let d = daemon("parity", "--max-vcpus 8");
    // At 2 vCPUs the VM's vCPUs fit the 2 CPUs: in process pvspin says so (VCPUS_FIT), and
    // the daemon says it when told the CPUs and given the VM's vCPU count.
    let d2 = daemon("parity2", "--max-vcpus 2 --vm-cpus 2");
    // In process, through pvspind, and through pvspind with kicks kept in KVM by the frontend.
    const VARIANTS: &str = "ticket:kick,ticket:kick/vhost,ticket:kick/direct,queued:kick,\
                            queued:kick/vhost,queued:kick/direct";
    let step_with = |d: &Daemon, name: String, what: String, text: String| Step::Table {
        name,
        what,
        runs: o.runs(5),
        arms: bench(&text),
        daemons: vec![d.clone()],
        summary: Summary::None,
    };
    let step = |name, what, text| step_with(&d, name, what, text);
    let mut steps = Vec::new();
    for v in [4, 6, 8] {
        steps.push(step(
            format!("vcpus-{v}"),
            format!("{v} vCPUs, in process and through pvspind, issue 22's workload (§11)"),
            format!(
                "--cs-mode user --vcpus {v} --iterations {} --cs-work 2000 --ncs-work 2000 \
                 --hogs 0 --timeout-ms 60000 --pv-backend vhost-user:{{sockets}}/parity.sock \
                 --variants {VARIANTS}",
                o.n(20_000, 400)
            ),
        ));
    }
    let many = steps.clone();
    steps.push(combine(
        "vcpus",
        "pvspind and in process: time per acquisition against vCPUs (§11)",
        &many,
    ));
    steps.push(step_with(
        &d2,
        "vcpus-2".into(),
        "2 vCPUs at 1x, 2x, 3x, in process and through pvspind (§11)".into(),
        format!(
            "--cs-mode user --vcpus 2 --iterations {} --cs-work 5000 --ncs-work 5000 \
             --hogs 0,2,4 --timeout-ms 60000 --pv-backend vhost-user:{{sockets}}/parity2.sock \
             --variants {VARIANTS}",
            o.n(300_000, 3000)
        ),
    ));
    steps.push(Step::Parity {
        name: "parity".into(),
        inputs: ["vcpus-4", "vcpus-6", "vcpus-8", "vcpus-2"]
            .map(String::from)
            .into(),
    });
    Ok(steps)
}

fn ab(o: &SuiteOptions) -> Result<Vec<Step>, SuiteError> {
    let args = if o.extra.is_empty() {
        args(&format!(
            "--iterations {} --hogs 0,2 --variants ticket:kick,ticket:kick+yield",
            o.n(1000, 40)
        ))
    } else {
        o.extra.clone()
    };
    Ok(vec![Step::Table {
        name: "ab".into(),
        what: "build A against build B, alternating round by round (each starts every other round)"
            .into(),
        runs: o.runs(5),
        arms: vec![
            Arm::Bench {
                binary: Binary::A,
                label: "a",
                args: args.clone(),
            },
            Arm::Bench {
                binary: Binary::B,
                label: "b",
                args,
            },
        ],
        daemons: Vec::new(),
        summary: Summary::Ab,
    }])
}

/// The variants `args` (a bench command line) compares, in `--variants` syntax; checks that
/// `bench` accepts the command and every variant's configuration.
pub fn check_bench_args(args: &[String]) -> Result<Vec<String>, String> {
    let resolved: Vec<String> = args
        .iter()
        .map(|a| a.replace("{sockets}", "/run/pvspin-suite"))
        .collect();
    let cli = <Cli as clap::Parser>::try_parse_from(
        ["pvspin-vmm", "bench"]
            .into_iter()
            .map(String::from)
            .chain(resolved),
    )
    .map_err(|err| err.to_string())?;
    let crate::cli::CliCommand::Bench(bench) = cli.command else {
        return Err("not a bench".into());
    };
    let base = bench.vm.config(0);
    for variant in &bench.variants {
        for hogs in &bench.hogs {
            variant
                .config(&base, *hogs)
                .validate(u32::MAX)
                .map_err(|err| format!("{}: {err}", variant.name()))?;
        }
        if variant.vhost && base.vhost_user.is_none() {
            return Err(format!("{} needs --pv-backend", variant.name()));
        }
    }
    Ok(bench.variants.iter().map(Variant::name).collect())
}

/// `bench --suite`: the suite named in `args`, or the list; returns the exit code.
pub fn command(args: &BenchArgs, out: &mut dyn Write) -> i32 {
    let Some(name) = args.suite.as_deref() else {
        return 2;
    };
    if name == "list" {
        let _ = writeln!(
            out,
            "suites (pvspin-vmm bench --suite NAME [--quick] [--runs N] [--out DIR] [--dry-run]):"
        );
        for suite in SUITES {
            let _ = writeln!(out, "  {:<13} {}", suite.name, suite.reproduces);
        }
        return 0;
    }
    // The suite sets every bench option; refuse the bench-level ones it would ignore.
    let ignored = [
        (!args.variants.is_empty(), "--variants"),
        (args.hogs != [0, 2, 4], "--hogs"),
        (args.vms != 1, "--vms"),
        (
            args.json_out.is_some(),
            "--json-out (the suite writes --out DIR)",
        ),
        (args.plot.is_some(), "--plot (the suite writes --out DIR)"),
    ];
    if let Some((_, option)) = ignored.iter().find(|(given, _)| *given) {
        eprintln!("pvspin-vmm bench --suite: rule: the suite sets the bench's options; {option} is not taken with it");
        return 2;
    }
    if !args.suite_args.is_empty() && name != "ab" {
        eprintln!(
            "pvspin-vmm bench --suite: rule: bench arguments after `--` are for --suite ab only"
        );
        return 2;
    }
    let options = SuiteOptions {
        runs: args.runs,
        quick: args.quick,
        build_a: args.build_a.clone(),
        build_b: args.build_b.clone(),
        extra: args.suite_args.clone(),
        probes: args.probes.clone(),
        steal_bound: args
            .max_host_steal
            .map(|percent| (percent, args.steal_retries)),
    };
    let result = find(name).and_then(|suite| {
        let steps = suite.plan(&options)?;
        let dir = args
            .out
            .clone()
            .unwrap_or_else(|| Path::new("bench-out").join(suite.name));
        if args.dry_run {
            dry_run(suite, &steps, &dir, &options, out)
        } else {
            let runner = Runner {
                suite,
                dir,
                options,
                pvspind: args.pvspind.clone(),
            };
            runner.run(&steps, out)
        }
    });
    match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("pvspin-vmm bench --suite: {err}");
            match err {
                SuiteError::Unknown(_) | SuiteError::Needs { .. } | SuiteError::Plan { .. } => 2,
                _ => 1,
            }
        }
    }
}

fn binary_name(binary: Binary) -> &'static str {
    match binary {
        Binary::This => "pvspin-vmm",
        Binary::A => "$BUILD_A",
        Binary::B => "$BUILD_B",
    }
}

/// The outputs of an arm: `NAME.jsonl`, or `NAME-K.jsonl` / `NAME-a.jsonl` with several.
fn arm_file(name: &str, k: usize, arms: &[Arm]) -> String {
    match arms.get(k) {
        _ if arms.len() == 1 => format!("{name}.jsonl"),
        Some(Arm::Bench { label, .. }) if !label.is_empty() => format!("{name}-{label}.jsonl"),
        _ => format!("{name}-{}.jsonl", k + 1),
    }
}

/// `--dry-run`: per step what it runs, with the variants of each bench.
fn dry_run(
    suite: &Suite,
    steps: &[Step],
    dir: &Path,
    options: &SuiteOptions,
    out: &mut dyn Write,
) -> Result<(), SuiteError> {
    let mut text = format!(
        "suite {}: {}\noutput: {}\n",
        suite.name,
        suite.reproduces,
        dir.display()
    );
    for step in steps {
        match step {
            Step::Table {
                name,
                what,
                runs,
                arms,
                daemons,
                ..
            } => {
                let _ = writeln!(text, "table {name}: {what}; {runs} runs per case");
                for d in daemons {
                    let _ = writeln!(text, "  daemon {}: pvspind {}", d.name, d.args.join(" "));
                }
                for (k, arm) in arms.iter().enumerate() {
                    match arm {
                        Arm::Bench { binary, args, .. } => {
                            let variants =
                                check_bench_args(args).map_err(|message| SuiteError::Plan {
                                    table: name.clone(),
                                    message,
                                })?;
                            let file = dir.join(arm_file(name, k, arms));
                            let runs = if arms.len() > 1 {
                                format!("--runs 1 (x{runs}, round by round with the other arms)")
                            } else {
                                format!(
                                    "--runs {runs} --plot {}",
                                    dir.join(format!("{name}.svg")).display()
                                )
                            };
                            let _ = writeln!(
                                text,
                                "  $ {} bench {} {runs} --json-out {}{}",
                                binary_name(*binary),
                                args.join(" "),
                                file.display(),
                                options
                                    .steal_args()
                                    .iter()
                                    .fold(String::new(), |all, arg| all + " " + arg)
                            );
                            let _ = writeln!(text, "    variants: {}", variants.join(" "));
                        }
                        Arm::Probe { cases, samples } => {
                            let probes = options
                                .probes
                                .as_deref()
                                .map_or("$PROBES".into(), |p| p.display().to_string());
                            for c in cases {
                                let _ = writeln!(
                                    text,
                                    "  $ {probes}/e2b_doorbell {} 0 {samples} {PROBE_DELAY} {} 0{}    # {}",
                                    c.mode,
                                    c.poll,
                                    c.spin.map_or(String::new(), |s| format!(" {s}")),
                                    c.label
                                );
                            }
                        }
                    }
                }
            }
            Step::Confinement {
                name,
                what,
                runs,
                cases,
                vm_ms,
                cotenant_ms,
            } => {
                let _ = writeln!(text, "table {name}: {what}; {runs} runs per case");
                for c in cases {
                    let _ = writeln!(
                        text,
                        "  $ pvspin-vmm run {} {} & sleep 0.3; pvspin-vmm cotenant --threads 2 --ms {cotenant_ms}{}    # {}",
                        confinement_common(*vm_ms).join(" "),
                        c.args.join(" "),
                        if c.pinned { " --pin" } else { "" },
                        c.name
                    );
                }
            }
            Step::Combine { name, what, inputs } => {
                let _ = writeln!(
                    text,
                    "figure {name}: {what}\n  $ pvspin-vmm report {} --plot {}",
                    inputs
                        .iter()
                        .map(|i| dir.join(format!("{i}.jsonl")).display().to_string())
                        .collect::<Vec<_>>()
                        .join(" "),
                    dir.join(format!("{name}.svg")).display()
                );
            }
            Step::Parity { name, inputs } => {
                let _ = writeln!(
                    text,
                    "summary {name}: pvspind over in process per row, from {}",
                    inputs.join(", ")
                );
            }
        }
    }
    out.write_all(text.as_bytes())
        .map_err(SuiteError::io("writing stdout"))
}

fn confinement_common(vm_ms: u64) -> Vec<String> {
    args(&format!(
        "--vcpus 2 --cs-mode user --iterations 100000000 --cs-work 5000 --ncs-work 0 --quiet \
         --timeout-ms {vm_ms} --watchdog-ms {}",
        vm_ms + 1000
    ))
}

/// Runs a suite's steps.
struct Runner {
    suite: &'static Suite,
    dir: PathBuf,
    options: SuiteOptions,
    pvspind: Option<PathBuf>,
}

/// The machine as the docs quote it: date, CPUs, kernel, load.
fn machine() -> String {
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M:%S UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{date}; {} CPUs ({model}); Linux {}; load average {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel.trim(),
        load()
    )
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// A running pvspind, stopped when dropped.
struct RunningDaemon {
    name: &'static str,
    child: std::process::Child,
    control: PathBuf,
}

impl RunningDaemon {
    /// pvspind's telemetry document (`json` on its control socket).
    fn telemetry(&self) -> Result<serde_json::Value, SuiteError> {
        let what = format!("pvspind {}: telemetry", self.name);
        let mut stream = std::os::unix::net::UnixStream::connect(&self.control)
            .map_err(SuiteError::io(what.clone()))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(SuiteError::io(what.clone()))?;
        stream
            .write_all(b"json\n")
            .map_err(SuiteError::io(what.clone()))?;
        let mut text = String::new();
        stream
            .read_to_string(&mut text)
            .map_err(SuiteError::io(what.clone()))?;
        serde_json::from_str(&text).map_err(|err| SuiteError::Child(format!("{what}: {err}")))
    }
}

impl Drop for RunningDaemon {
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: signals our own child, which has not been waited for yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let start = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) {
            if start.elapsed() > Duration::from_secs(10) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn resolve(args: &[String], sockets: &Path) -> Vec<String> {
    args.iter()
        .map(|a| a.replace("{sockets}", &sockets.to_string_lossy()))
        .collect()
}

impl Runner {
    fn binary(&self, binary: Binary) -> Result<PathBuf, SuiteError> {
        let needs = |what| SuiteError::Needs {
            suite: self.suite.name,
            what,
        };
        match binary {
            Binary::This => {
                std::env::current_exe().map_err(SuiteError::io("finding this executable"))
            }
            Binary::A => self.options.build_a.clone().ok_or(needs("--build-a PATH")),
            Binary::B => self.options.build_b.clone().ok_or(needs("--build-b PATH")),
        }
    }

    fn pvspind(&self) -> Result<PathBuf, SuiteError> {
        if let Some(path) = &self.pvspind {
            return Ok(path.clone());
        }
        let beside = self.binary(Binary::This)?.with_file_name("pvspind");
        if beside.exists() {
            Ok(beside)
        } else {
            Err(SuiteError::Needs {
                suite: self.suite.name,
                what: "pvspind: --pvspind PATH, or pvspind beside pvspin-vmm (cargo build --release -p pvspin-vhost)",
            })
        }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    fn write(&self, file: &str, text: &str) -> Result<(), SuiteError> {
        let path = self.path(file);
        std::fs::write(&path, text).map_err(SuiteError::io(format!("writing {}", path.display())))
    }

    fn run(&self, steps: &[Step], out: &mut dyn Write) -> Result<(), SuiteError> {
        // Check every bench command, build and daemon before spending minutes on the first
        // tables.
        for step in steps {
            if let Step::Table {
                name,
                arms,
                daemons,
                ..
            } = step
            {
                if !daemons.is_empty() {
                    self.pvspind()?;
                }
                for arm in arms {
                    if let Arm::Bench { binary, .. } = arm {
                        self.binary(*binary)?;
                    }
                    if let Arm::Bench {
                        args,
                        binary: Binary::This,
                        ..
                    } = arm
                    {
                        check_bench_args(args).map_err(|message| SuiteError::Plan {
                            table: name.clone(),
                            message,
                        })?;
                    }
                }
            }
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(SuiteError::io(format!("creating {}", self.dir.display())))?;
        let sockets = std::env::temp_dir().join(format!("pvspin-suite-{}", std::process::id()));
        let mut log = format!(
            "pvspin-vmm bench --suite {}{}{}: {}\nstart: {}\n",
            self.suite.name,
            if self.options.quick { " --quick" } else { "" },
            self.options
                .runs
                .map_or(String::new(), |r| format!(" --runs {r}")),
            self.suite.reproduces,
            machine()
        );
        let _ = write!(out, "{log}");
        let mut failed = Vec::new();
        for step in steps {
            let started = Instant::now();
            let result = match step {
                Step::Table {
                    name,
                    what,
                    runs,
                    arms,
                    daemons,
                    summary,
                } => {
                    let _ = writeln!(out, "\n== {name}: {what}");
                    let _ = out.flush();
                    std::fs::create_dir_all(&sockets)
                        .map_err(SuiteError::io("creating the socket directory"))
                        .and_then(|()| {
                            self.table(name, *runs, arms, daemons, *summary, &sockets, &mut log)
                        })
                }
                Step::Confinement {
                    name,
                    what,
                    runs,
                    cases,
                    vm_ms,
                    cotenant_ms,
                } => {
                    let _ = writeln!(out, "\n== {name}: {what}");
                    let _ = out.flush();
                    self.confinement(name, *runs, cases, *vm_ms, *cotenant_ms, &mut log)
                }
                Step::Combine { name, what, inputs } => {
                    let _ = writeln!(out, "\n== {name}: {what}");
                    self.combine(name, inputs, &mut log)
                }
                Step::Parity { name, inputs } => {
                    let _ = writeln!(out, "\n== {name}: pvspind over in process, per row");
                    self.parity(name, inputs)
                }
            };
            let _ = std::fs::remove_dir_all(&sockets);
            match result {
                Ok(text) => {
                    let _ = write!(out, "{text}");
                    let _ = writeln!(
                        log,
                        "{}: done in {:.0} s, load average {}",
                        step.name(),
                        started.elapsed().as_secs_f64(),
                        load()
                    );
                }
                Err(err) => {
                    let _ = writeln!(out, "{}: FAILED: {err}", step.name());
                    let _ = writeln!(log, "{}: FAILED: {err}", step.name());
                    failed.push(step.name().to_string());
                }
            }
            self.write("suite.txt", &log)?;
            let _ = out.flush();
        }
        let end = format!("end: {}\n", machine());
        log.push_str(&end);
        self.write("suite.txt", &log)?;
        let _ = write!(out, "\n{end}files: {}\n", self.dir.display());
        if failed.is_empty() {
            Ok(())
        } else {
            Err(SuiteError::Child(format!("failed: {}", failed.join(", "))))
        }
    }

    /// Starts `daemons`; waits for their sockets.
    fn start_daemons(
        &self,
        daemons: &[Daemon],
        sockets: &Path,
    ) -> Result<Vec<RunningDaemon>, SuiteError> {
        let mut running = Vec::new();
        for d in daemons {
            let args = resolve(&d.args, sockets);
            let child = Command::new(self.pvspind()?)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(SuiteError::io(format!("starting pvspind {}", d.name)))?;
            let control = sockets.join(format!("{}-control.sock", d.name));
            let mut wanted: Vec<PathBuf> = args
                .windows(2)
                .filter(|w| w[0] == "--socket")
                .map(|w| PathBuf::from(&w[1]))
                .collect();
            wanted.push(control.clone());
            let daemon = RunningDaemon {
                name: d.name,
                child,
                control,
            };
            let start = Instant::now();
            while !wanted.iter().all(|p| p.exists()) {
                if start.elapsed() > Duration::from_secs(10) {
                    return Err(SuiteError::Child(format!(
                        "pvspind {} did not open its sockets within 10 s",
                        d.name
                    )));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            running.push(daemon);
        }
        Ok(running)
    }

    /// Runs `binary bench args`; returns its stdout.
    fn bench_child(
        &self,
        binary: Binary,
        args: &[String],
        tail: &[String],
        log: &mut String,
    ) -> Result<String, SuiteError> {
        let exe = self.binary(binary)?;
        let _ = writeln!(
            log,
            "$ {} bench {} {}",
            exe.display(),
            args.join(" "),
            tail.join(" ")
        );
        let output = Command::new(&exe)
            .arg("bench")
            .args(args)
            .args(tail)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(SuiteError::io(format!("running {}", exe.display())))?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() {
            return Err(SuiteError::Child(format!(
                "{} bench {}: {}\n{stdout}",
                exe.display(),
                args.join(" "),
                output.status
            )));
        }
        Ok(stdout)
    }

    #[allow(clippy::too_many_arguments)]
    fn table(
        &self,
        name: &str,
        runs: u32,
        arms: &[Arm],
        daemons: &[Daemon],
        summary: Summary,
        sockets: &Path,
        log: &mut String,
    ) -> Result<String, SuiteError> {
        let running = self.start_daemons(daemons, sockets)?;
        let json = |k: usize| self.path(&arm_file(name, k, arms));
        let svg = self.path(&format!("{name}.svg"));
        let mut text;
        let mut probe_p50: Vec<Vec<f64>> = Vec::new();
        if let [Arm::Bench { binary, args, .. }] = arms {
            let tail: Vec<String> = [
                "--runs".to_string(),
                runs.to_string(),
                "--json-out".into(),
                json(0).to_string_lossy().into_owned(),
                "--plot".into(),
                svg.to_string_lossy().into_owned(),
            ]
            .into_iter()
            .chain(self.options.steal_args())
            .collect();
            text = self.bench_child(*binary, &resolve(args, sockets), &tail, log)?;
        } else {
            let parts = self.dir.join(format!(".{name}-rounds"));
            std::fs::create_dir_all(&parts)
                .map_err(SuiteError::io(format!("creating {}", parts.display())))?;
            let probes = match arms.iter().any(|a| matches!(a, Arm::Probe { .. })) {
                true => Some(self.build_probes()?),
                false => None,
            };
            let mut files: Vec<Vec<PathBuf>> = vec![Vec::new(); arms.len()];
            for round in 0..runs {
                // The arms' order rotates round by round, as `bench` rotates its cases: no
                // arm always runs first.
                for k in (0..arms.len()).map(|i| (i + round as usize) % arms.len()) {
                    let arm = &arms[k];
                    match arm {
                        Arm::Bench { binary, args, .. } => {
                            let part = parts.join(format!("arm{k}-round{round}.jsonl"));
                            let tail: Vec<String> = [
                                "--runs".to_string(),
                                "1".into(),
                                "--quiet".into(),
                                "--json-out".into(),
                                part.to_string_lossy().into_owned(),
                            ]
                            .into_iter()
                            .chain(self.options.steal_args())
                            .collect();
                            self.bench_child(*binary, &resolve(args, sockets), &tail, log)?;
                            files[k].push(part);
                        }
                        Arm::Probe { cases, samples } => {
                            let dir = probes.as_ref().map(|p| p.path()).unwrap_or(Path::new("."));
                            let mut row = Vec::new();
                            for case in cases {
                                row.push(run_probe(dir, case, *samples)?);
                            }
                            probe_p50.push(row);
                        }
                    }
                }
                eprintln!(
                    "pvspin-vmm bench --suite: {name}: round {}/{runs} done",
                    round + 1
                );
            }
            for (k, parts) in files.iter().enumerate() {
                if !parts.is_empty() {
                    merge_rounds(parts, &json(k), runs)?;
                }
            }
            let _ = std::fs::remove_dir_all(&parts);
            let benches: Vec<PathBuf> = (0..arms.len())
                .filter(|k| matches!(arms[*k], Arm::Bench { .. }))
                .map(json)
                .collect();
            let mut buffer = Vec::new();
            if summary == Summary::Ab {
                crate::saved::report(&[], Some(&benches), Some(&svg), &mut buffer)?;
            } else {
                crate::saved::report(&benches, None, Some(&svg), &mut buffer)?;
            }
            text = String::from_utf8_lossy(&buffer).into_owned();
        }
        match summary {
            Summary::PerHandoff => {
                for (k, arm) in arms.iter().enumerate() {
                    if matches!(arm, Arm::Bench { .. }) {
                        text.push_str(&per_handoff(&json(k))?);
                    }
                }
            }
            Summary::Probe => {
                if let Some(Arm::Probe { cases, samples }) =
                    arms.iter().find(|a| matches!(a, Arm::Probe { .. }))
                {
                    let probe_json: String = probe_p50
                        .iter()
                        .enumerate()
                        .flat_map(|(round, row)| {
                            cases.iter().zip(row).map(move |(c, p50)| {
                                format!(
                                    "{}\n",
                                    serde_json::json!({"record": "probe", "round": round,
                                        "case": c.label, "mode": c.mode, "samples": samples,
                                        "p50_us": p50})
                                )
                            })
                        })
                        .collect();
                    self.write(&format!("{name}-probe.jsonl"), &probe_json)?;
                    text.push_str(&per_handoff(&json(0))?);
                    text.push_str(&probe_summary(&json(0), cases, &probe_p50)?);
                }
            }
            Summary::None | Summary::Ab => {}
        }
        for daemon in &running {
            // The table stands without the daemon's counters.
            let telemetry = match daemon.telemetry() {
                Ok(telemetry) => telemetry,
                Err(err) => {
                    let _ = writeln!(text, "pvspind {}: no telemetry: {err}", daemon.name);
                    continue;
                }
            };
            self.write(
                &format!("{name}-pvspind-{}.json", daemon.name),
                &format!("{telemetry:#}\n"),
            )?;
            let totals = &telemetry["host"]["totals"];
            let _ = writeln!(text, "pvspind {} host-wide totals: {totals}", daemon.name);
            if let (Some(reads), Some(ns)) = (
                totals["sched_thread_reads"].as_f64(),
                totals["sched_read_ns"].as_f64(),
            ) {
                if reads > 0.0 {
                    let _ = writeln!(
                        text,
                        "scheduler sampler: {reads} vCPU thread reads, {:.2} us of CPU per vCPU per read",
                        ns / reads / 1000.0
                    );
                }
            }
        }
        drop(running);
        self.write(&format!("{name}.txt"), &text)?;
        Ok(text)
    }

    /// Builds the C probes in a temporary copy of `--probes`.
    fn build_probes(&self) -> Result<TempDir, SuiteError> {
        let source = self.options.probes.clone().ok_or(SuiteError::Needs {
            suite: self.suite.name,
            what: "--probes DIR",
        })?;
        let dir =
            TempDir(std::env::temp_dir().join(format!("pvspin-probes-{}", std::process::id())));
        copy_dir(&source, dir.path())?;
        let status = Command::new("sh")
            .arg("build.sh")
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(SuiteError::io("building the probes"))?;
        if !status.success() {
            return Err(SuiteError::Child(format!(
                "{}/build.sh: {status}",
                source.display()
            )));
        }
        Ok(dir)
    }

    fn confinement(
        &self,
        name: &str,
        runs: u32,
        cases: &[ConfinementCase],
        vm_ms: u64,
        cotenant_ms: u64,
        log: &mut String,
    ) -> Result<String, SuiteError> {
        let exe = self.binary(Binary::This)?;
        let common = confinement_common(vm_ms);
        let mut units = vec![Vec::new(); cases.len()];
        let mut cpus = vec![Vec::new(); cases.len()];
        let mut records = String::new();
        for run in 0..runs {
            for (k, case) in cases.iter().enumerate() {
                let vm = Command::new(&exe)
                    .arg("run")
                    .args(&common)
                    .args(&case.args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(SuiteError::io("starting the VM"))?;
                std::thread::sleep(Duration::from_millis(300));
                let mut cotenant = Command::new(&exe);
                cotenant.args([
                    "cotenant",
                    "--threads",
                    "2",
                    "--ms",
                    &cotenant_ms.to_string(),
                ]);
                if case.pinned {
                    cotenant.arg("--pin");
                }
                let output = cotenant
                    .output()
                    .map_err(SuiteError::io("running the co-tenant"))?;
                let (status, cpu) = crate::bench::wait_with_rusage(vm.id())
                    .map_err(|err| SuiteError::Child(err.to_string()))?;
                let line = String::from_utf8_lossy(&output.stdout);
                let per_sec = line
                    .lines()
                    .last()
                    .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .and_then(|v| v["units_per_sec"].as_f64())
                    .ok_or_else(|| SuiteError::Child(format!("co-tenant printed {line:?}")))?;
                let vm_cpus = cpu / (vm_ms as f64 / 1000.0);
                units[k].push(per_sec);
                cpus[k].push(vm_cpus);
                let _ = writeln!(
                    records,
                    "{}",
                    serde_json::json!({"record": "confinement", "case": case.name, "run": run,
                        "pinned": case.pinned, "vm_args": case.args, "cotenant_units_per_sec": per_sec,
                        "vm_cpus": vm_cpus, "vm_status": status})
                );
                eprintln!(
                    "run {} {}: co-tenant {:.3} G units/s, VM {vm_cpus:.2} CPUs",
                    run + 1,
                    case.name,
                    per_sec / 1e9
                );
            }
        }
        let _ = writeln!(
            log,
            "$ {} run {} CASE & sleep 0.3; {} cotenant --threads 2 --ms {cotenant_ms} [--pin]",
            exe.display(),
            common.join(" "),
            exe.display()
        );
        self.write(&format!("{name}.jsonl"), &records)?;
        let mut text = format!(
            "| case | co-tenant, G units/s (median of {runs}) | against the arm without directed \
             yield (median of the {runs} ratios, min-max) | VM's CPUs (median) |\n|---|---|---|---|\n"
        );
        let mut ratios_per_case = Vec::new();
        for (k, case) in cases.iter().enumerate() {
            let ratios: Vec<f64> = units[k]
                .iter()
                .zip(&units[case.baseline])
                .map(|(a, b)| a / b)
                .collect();
            let (lo, hi) = ratios.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), r| {
                (lo.min(*r), hi.max(*r))
            });
            let _ = writeln!(
                text,
                "| {} | {:.3} | {:.2} ({lo:.2}-{hi:.2}) | {:.2} |",
                case.name,
                median_of(&units[k]) / 1e9,
                median_of(&ratios),
                median_of(&cpus[k])
            );
            ratios_per_case.push((case.name.to_string(), ratios));
        }
        let svg = crate::plot::render_ratios(
            "Confinement: a co-tenant's throughput beside a VM",
            &format!(
                "co-tenant (2 busy threads, {cotenant_ms} ms) beside a 2-vCPU VM in user mode; {runs} \
                 interleaved runs per case; each run's co-tenant throughput over the same run's baseline arm without directed yield (cases 1, 4, 6); above 1: the co-tenant got more"
            ),
            "co-tenant's throughput / its baseline's (ratio)",
            &ratios_per_case,
        )?;
        crate::plot::write(&self.path(&format!("{name}.svg")), &svg)?;
        self.write(&format!("{name}.txt"), &text)?;
        Ok(text)
    }

    fn combine(
        &self,
        name: &str,
        inputs: &[String],
        log: &mut String,
    ) -> Result<String, SuiteError> {
        let files: Vec<PathBuf> = inputs
            .iter()
            .map(|i| self.path(&format!("{i}.jsonl")))
            .filter(|p| p.exists())
            .collect();
        let svg = self.path(&format!("{name}.svg"));
        let _ = writeln!(
            log,
            "$ pvspin-vmm report {} --plot {}",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(" "),
            svg.display()
        );
        crate::saved::report(&files, None, Some(&svg), &mut std::io::sink())?;
        Ok(format!("{}\n", svg.display()))
    }

    fn parity(&self, name: &str, inputs: &[String]) -> Result<String, SuiteError> {
        let mut tables = Vec::new();
        for input in inputs {
            let path = self.path(&format!("{input}.jsonl"));
            if path.exists() {
                tables.extend(crate::saved::load(&path).map_err(crate::saved::ReportError::from)?);
            }
        }
        let text = parity_table(&tables);
        self.write(&format!("{name}.txt"), &text)?;
        Ok(text)
    }
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), SuiteError> {
    std::fs::create_dir_all(to).map_err(SuiteError::io(format!("creating {}", to.display())))?;
    let entries =
        std::fs::read_dir(from).map_err(SuiteError::io(format!("reading {}", from.display())))?;
    for entry in entries {
        let entry = entry.map_err(SuiteError::io(format!("reading {}", from.display())))?;
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target).map_err(SuiteError::io(format!(
                "copying {}",
                entry.path().display()
            )))?;
        }
    }
    Ok(())
}

/// One run of the probe; its kick-to-wake p50 in us.
fn run_probe(dir: &Path, case: &ProbeCase, samples: u32) -> Result<f64, SuiteError> {
    let mut command = Command::new(dir.join("e2b_doorbell"));
    command
        .args([
            case.mode,
            "0",
            &samples.to_string(),
            &PROBE_DELAY.to_string(),
            case.poll,
            "0",
        ])
        .current_dir(dir);
    if let Some(spin) = case.spin {
        command.arg(spin);
    }
    let output = command
        .output()
        .map_err(SuiteError::io("running e2b_doorbell"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .filter(|l| l.contains("kick->wake latency"))
        .find_map(|l| {
            let rest = &l[l.find("p50=")? + 4..];
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            rest[..end].parse().ok()
        })
        .ok_or_else(|| SuiteError::Child(format!("no latency in the probe's output:\n{text}")))
}

/// Joins the per-round files of one arm (`--runs 1` each) into one bench of `runs` runs.
fn merge_rounds(parts: &[PathBuf], out: &Path, runs: u32) -> Result<(), SuiteError> {
    let mut text = String::new();
    for (round, part) in parts.iter().enumerate() {
        let saved = std::fs::read_to_string(part)
            .map_err(SuiteError::io(format!("reading {}", part.display())))?;
        for line in saved.lines().filter(|l| !l.trim().is_empty()) {
            let mut record: Record = serde_json::from_str(line)
                .map_err(|err| SuiteError::Child(format!("{}: {err}", part.display())))?;
            match &mut record {
                Record::Bench(header) => {
                    if round > 0 {
                        continue;
                    }
                    header.runs = runs;
                    header.title = header
                        .title
                        .replace(", 1 runs per case", &format!(", {runs} runs per case"));
                }
                Record::Run(run) => run.run = round as u32,
            }
            let _ = writeln!(
                text,
                "{}",
                serde_json::to_string(&record).unwrap_or_default()
            );
        }
    }
    std::fs::write(out, text).map_err(SuiteError::io(format!("writing {}", out.display())))
}

/// Per variant of the ping-pong benches in `path`: the median guest time per handoff and
/// how often the waiter had to wait (a waiter that saw the token while spinning needed no
/// wake-up, and its kick-to-wake sample is short).
fn per_handoff(path: &Path) -> Result<String, SuiteError> {
    let saved = std::fs::read_to_string(path)
        .map_err(SuiteError::io(format!("reading {}", path.display())))?;
    let mut iterations = 1.0;
    let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for line in saved.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<Record>(line) {
            Ok(Record::Bench(header)) => iterations = header.iterations.max(1) as f64,
            Ok(Record::Run(run)) => {
                let Some(report) = &run.report else { continue };
                let k = match rows.iter().position(|r| r.0 == run.variant) {
                    Some(k) => k,
                    None => {
                        rows.push((run.variant.clone(), Vec::new(), Vec::new()));
                        rows.len() - 1
                    }
                };
                rows[k].1.push(run.guest_seconds * 1e6 / iterations);
                rows[k]
                    .2
                    .push(report["pv_halts"].as_f64().unwrap_or(0.0) / iterations);
            }
            Err(err) => return Err(SuiteError::Child(format!("{}: {err}", path.display()))),
        }
    }
    let mut text = String::from("per handoff, medians of the runs:\n");
    let base = rows.first().map_or(1.0, |r| median_of(&r.1));
    for (variant, us, waits) in &rows {
        let _ = writeln!(
            text,
            "    {variant:<40} {:8.1} us/handoff ({:.2}x the first)  {:.2} waits/handoff",
            median_of(us),
            median_of(us) / base.max(f64::MIN_POSITIVE),
            median_of(waits)
        );
    }
    Ok(text)
}

/// The probe's p50 beside pvspin's per case: the bench's variants in the probe cases' order.
fn probe_summary(
    path: &Path,
    cases: &[ProbeCase],
    probe: &[Vec<f64>],
) -> Result<String, SuiteError> {
    let tables = crate::saved::load(path).map_err(crate::saved::ReportError::from)?;
    let Some(table) = tables.first() else {
        return Ok(String::new());
    };
    let mut text = format!(
        "kick-to-wake, guest TSC, us; median over rounds of each run's p50; probe delay \
         {PROBE_DELAY}, pvspin --cs-work {}\n{:34} {:>12} {:>11} {:>6} {:>11}  pvspin p50 per round\n",
        PROBE_DELAY / 2,
        "case",
        "C probe p50",
        "pvspin p50",
        "ratio",
        "pvspin p99"
    );
    for (i, case) in cases.iter().enumerate() {
        let Some(result) = table.cases.get(i) else {
            continue;
        };
        let probe_median = median_of(
            &probe
                .iter()
                .filter_map(|r| r.get(i).copied())
                .collect::<Vec<_>>(),
        );
        let p50s: Vec<f64> = result.kick_to_wake.iter().map(|l| l.p50_us).collect();
        let p99s: Vec<f64> = result.kick_to_wake.iter().map(|l| l.p99_us).collect();
        let ours = median_of(&p50s);
        let _ = writeln!(
            text,
            "{:34} {probe_median:12.1} {ours:11.1} {:6.2} {:11.1}  {}",
            case.label,
            ours / probe_median.max(f64::MIN_POSITIVE),
            median_of(&p99s),
            p50s.iter()
                .map(|p| format!("{p:.1}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(text)
}

/// pvspind against in process per (vCPUs, hogs, lock): each `X/vhost` variant beside the same
/// variant without `/vhost`.
pub fn parity_table(tables: &[crate::bench::BenchTable]) -> String {
    let mut text = String::from(
        "| vCPUs | hogs | pvspind variant | in process: median (slowest) | pvspind: median (slowest) \
         | ratio of medians | ratio of slowest |\n|---|---|---|---|---|---|---|\n",
    );
    for table in tables {
        for vhost in table.cases.iter().filter(|c| c.variant.vhost) {
            let in_process = Variant {
                vhost: false,
                vhost_direct: false,
                ..vhost.variant
            };
            let Some(inp) = table
                .cases
                .iter()
                .find(|c| c.hogs == vhost.hogs && c.variant == in_process)
            else {
                continue;
            };
            let mark = |c: &crate::bench::CaseResult| if c.timed_out > 0 { ">" } else { "" };
            let _ = writeln!(
                text,
                "| {} | {} | {} | {:.3} s ({}{:.3}) | {:.3} s ({}{:.3}) | **{:.2}x** | {:.2}x |",
                table.vcpus,
                vhost.hogs,
                vhost.variant.name(),
                inp.median(),
                mark(inp),
                inp.slowest(),
                vhost.median(),
                mark(vhost),
                vhost.slowest(),
                vhost.median() / inp.median().max(f64::MIN_POSITIVE),
                vhost.slowest() / inp.slowest().max(f64::MIN_POSITIVE)
            );
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench_variants(step: &Step) -> Vec<Vec<String>> {
        let Step::Table { arms, name, .. } = step else {
            return Vec::new();
        };
        arms.iter()
            .filter_map(|a| match a {
                Arm::Bench { args, .. } => {
                    Some(check_bench_args(args).unwrap_or_else(|e| panic!("{name}: {e}")))
                }
                Arm::Probe { .. } => None,
            })
            .collect()
    }

    fn all_options() -> SuiteOptions {
        SuiteOptions {
            probes: Some("probes".into()),
            ..SuiteOptions::default()
        }
    }

    #[test]
    fn every_suite_plans_commands_bench_accepts_full_and_quick() {
        for suite in SUITES {
            for quick in [false, true] {
                let options = SuiteOptions {
                    quick,
                    ..all_options()
                };
                let steps = suite.plan(&options).unwrap();
                assert!(!steps.is_empty(), "{}", suite.name);
                let mut names = Vec::new();
                for step in &steps {
                    assert!(
                        !names.contains(&step.name()),
                        "{}: two {}",
                        suite.name,
                        step.name()
                    );
                    names.push(step.name());
                    for variants in bench_variants(step) {
                        assert!(!variants.is_empty(), "{}: {}", suite.name, step.name());
                    }
                    if let Step::Combine { inputs, .. } | Step::Parity { inputs, .. } = step {
                        for input in inputs {
                            assert!(names.contains(&input.as_str()), "{}: {input}", suite.name);
                        }
                    }
                }
                let mut dry = Vec::new();
                dry_run(suite, &steps, Path::new("out"), &options, &mut dry).unwrap();
                assert!(!dry.is_empty());
            }
        }
    }

    #[test]
    fn a_steal_bound_reaches_every_bench_of_the_suite() {
        let suite = find("convoy").unwrap();
        let options = SuiteOptions {
            steal_bound: Some((5.0, 2)),
            ..SuiteOptions::default()
        };
        let steps = suite.plan(&options).unwrap();
        let mut dry = Vec::new();
        dry_run(suite, &steps, Path::new("out"), &options, &mut dry).unwrap();
        let dry = String::from_utf8(dry).unwrap();
        let benches = dry.lines().filter(|l| l.contains(" bench ")).count();
        assert!(benches > 0, "{dry}");
        assert_eq!(
            dry.matches("--max-host-steal 5 --steal-retries 2").count(),
            benches,
            "{dry}"
        );
    }

    #[test]
    fn quick_scales_iterations_and_runs_down_and_runs_override() {
        let iterations = |step: &Step| {
            let Step::Table { arms, runs, .. } = step else {
                panic!("a table")
            };
            let Arm::Bench { args, .. } = &arms[0] else {
                panic!("a bench")
            };
            let i = args.iter().position(|a| a == "--iterations").unwrap();
            (args[i + 1].parse::<u64>().unwrap(), *runs)
        };
        let seed = find("seed").unwrap();
        let full = seed.plan(&SuiteOptions::default()).unwrap();
        let quick = seed
            .plan(&SuiteOptions {
                quick: true,
                ..SuiteOptions::default()
            })
            .unwrap();
        assert_eq!(iterations(&full[0]), (300_000, 5));
        assert_eq!(iterations(&quick[0]), (3000, 1));
        let three = seed
            .plan(&SuiteOptions {
                quick: true,
                runs: Some(3),
                ..SuiteOptions::default()
            })
            .unwrap();
        assert_eq!(iterations(&three[0]).1, 3);
        let short = find("short-cs")
            .unwrap()
            .plan(&SuiteOptions::default())
            .unwrap();
        assert_eq!(iterations(&short[0]), (2_000_000, 11));
    }

    /// The tables each suite reproduces: their names and variants as `docs/benchmarks.md`
    /// gives them.
    #[test]
    fn suites_hold_the_published_variants() {
        let plan = |name: &str| find(name).unwrap().plan(&all_options()).unwrap();
        let variants = |steps: &[Step], table: &str| {
            let step = steps.iter().find(|s| s.name() == table).unwrap();
            bench_variants(step)
        };
        let seed = plan("seed");
        assert_eq!(
            variants(&seed, "seed")[0],
            [
                "ticket:off",
                "tas:off",
                "backoff:off",
                "backoff:kick:in-kernel",
                "ticket:kick:in-kernel",
                "ticket:kick+yield:in-kernel",
                "queued:kick:in-kernel",
                "queued:kick+yield:in-kernel",
                "queued:off"
            ]
        );
        let overcommit = plan("overcommit");
        let names: Vec<&str> = overcommit.iter().map(Step::name).collect();
        assert_eq!(
            names,
            ["vcpus-4", "vcpus-6", "vcpus-8", "vcpus-16", "overcommit"]
        );
        let latency = plan("kick-latency");
        assert_eq!(
            variants(&latency, "kernel")[0],
            [
                "ticket:kick/poll=0:in-kernel",
                "ticket:kick/poll=200000:in-kernel",
                "ticket:kick/poll=0:signal-msi",
                "ticket:kick/poll=200000:signal-msi",
                "ticket:kick/park=0:userspace",
                "ticket:kick/park=50:userspace"
            ]
        );
        let Step::Table { arms, summary, .. } = &latency[0] else {
            panic!("a table")
        };
        assert_eq!(*summary, Summary::Probe);
        assert!(matches!(&arms[1], Arm::Probe { cases, .. } if cases.len() == 6));
        let stock = plan("stock-slots");
        assert_eq!(
            variants(&stock, "vcpus-16")[0],
            [
                "queued:kick:in-kernel@stock",
                "queued:kick/slots:in-kernel@stock",
                "queued:kick/slots:signal-msi@stock",
                "queued:kick/slots:userspace@pvspin",
                "ticket:kick:in-kernel@pvspin",
                "ticket:kick/slots:in-kernel@pvspin"
            ]
        );
        assert_eq!(variants(&stock, "hogs")[0].len(), 3);
        let slots = plan("slots");
        assert_eq!(
            variants(&slots, "vms")[0],
            ["ticket:kick:in-kernel", "ticket:kick/slots:userspace"]
        );
        let vhost = plan("vhost");
        let latency_user = variants(&vhost, "latency-user");
        assert_eq!(
            latency_user,
            [
                vec![
                    "ticket:kick:in-kernel",
                    "ticket:kick:signal-msi",
                    "ticket:kick:userspace",
                    "ticket:kick/vhost:in-kernel"
                ],
                vec!["ticket:kick/vhost:in-kernel"]
            ]
        );
        let parity = plan("vhost-parity");
        assert_eq!(
            variants(&parity, "vcpus-2")[0],
            [
                "ticket:kick:in-kernel",
                "ticket:kick/vhost:in-kernel",
                "ticket:kick/vhost/direct:in-kernel",
                "queued:kick:in-kernel",
                "queued:kick/vhost:in-kernel",
                "queued:kick/vhost/direct:in-kernel"
            ]
        );
        let Step::Confinement { cases, .. } = &plan("confinement")[0] else {
            panic!("confinement")
        };
        assert_eq!(cases.len(), 8);
        assert!(cases
            .iter()
            .all(|c| cases[c.baseline].args.contains(&"burn")));
        let ab = plan("ab");
        let Step::Table { arms, summary, .. } = &ab[0] else {
            panic!("a table")
        };
        assert_eq!(*summary, Summary::Ab);
        assert!(matches!(
            arms[..],
            [
                Arm::Bench {
                    binary: Binary::A,
                    ..
                },
                Arm::Bench {
                    binary: Binary::B,
                    ..
                }
            ]
        ));
        // Bench arguments after `--` replace the A/B default.
        let custom = find("ab")
            .unwrap()
            .plan(&SuiteOptions {
                extra: args("--cs-mode user --iterations 100 --hogs 0 --variants ticket:kick"),
                ..SuiteOptions::default()
            })
            .unwrap();
        assert_eq!(variants(&custom, "ab")[1], ["ticket:kick:in-kernel"]);
    }

    #[test]
    fn rounds_merge_into_one_bench_and_parity_pairs_rows() {
        let dir = std::env::temp_dir().join(format!("pvspin-suite-merge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/bench-lock-user-2vcpu.jsonl");
        // The fixture ran 2 runs; keep run 0 of it as each "round".
        let round: String = std::fs::read_to_string(&fixture)
            .unwrap()
            .lines()
            .filter(|l| !l.contains("\"run\":1,"))
            .map(|l| format!("{}\n", l.replace(", 2 runs per case", ", 1 runs per case")))
            .collect();
        let parts: Vec<PathBuf> = (0..3)
            .map(|r| {
                let p = dir.join(format!("r{r}.jsonl"));
                std::fs::write(&p, &round).unwrap();
                p
            })
            .collect();
        let merged = dir.join("merged.jsonl");
        merge_rounds(&parts, &merged, 3).unwrap();
        let tables = crate::saved::load(&merged).unwrap();
        assert_eq!(tables.len(), 1);
        assert!(
            tables[0].title.contains(", 3 runs per case"),
            "{}",
            tables[0].title
        );
        assert!(tables[0].cases.iter().all(|c| c.seconds.len() == 3));
        // Parity: a `/vhost` twin of every variant, twice as slow.
        let mut table = tables[0].clone();
        let twins: Vec<_> = table
            .cases
            .iter()
            .filter(|c| c.variant.pv != pvspin_test_vm::config::PvMode::Off)
            .map(|c| crate::bench::CaseResult {
                variant: Variant {
                    vhost: true,
                    ..c.variant
                },
                seconds: c.seconds.iter().map(|s| s * 2.0).collect(),
                ..c.clone()
            })
            .collect();
        table.cases.extend(twins);
        let text = parity_table(&[table]);
        let rows: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows.iter().all(|r| r.contains("**2.00x** | 2.00x")),
            "{text}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
