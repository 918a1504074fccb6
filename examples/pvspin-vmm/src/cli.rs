//! Command line of `pvspin-vmm`.

use std::ffi::OsString;

use clap::{Args, Parser, Subcommand, ValueEnum};
use pvspin_kvm::guest::UnknownGuestKernel;
use pvspin_test_vm_proto::{LockKind, Workload};

use crate::bench::{self, BenchOptions};
use pvspin_test_vm::config::{GuestKind, RunConfig, STOCK_SPIN_THRESHOLD};
use pvspin_test_vm::vmm;

/// Runs pvspin guest workloads on /dev/kvm.
#[derive(Debug, Parser)]
#[command(name = "pvspin-vmm", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: CliCommand,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum CliCommand {
    /// Runs one VM and prints a summary line and a JSON line.
    Run(Box<RunArgs>),
    /// Runs the lock workload repeatedly at several overcommit levels and prints a table.
    ///
    /// Variants run side by side, interleaved run by run. Progress goes to stderr (a bar with
    /// the case, variant, run and the time left, when stderr is a terminal and without
    /// --quiet), the table alone to stdout (per row: mean (sd), median, slowest run, the
    /// change against the first variant, T/T1x, every run; for lock runs also the runs net of
    /// the host's speed, from each run's guest-timed sections), every run's record to --json-out
    /// (`report` prints the table again from it); --plot draws the table as SVG. --suite NAME
    /// runs every table of one part of docs/benchmarks.md instead (--suite list).
    Bench(Box<BenchArgs>),
    /// Prints saved benches' tables again, or two benches side by side, without running VMs.
    ///
    /// Reads what `bench --json-out` wrote and prints each bench's table as `bench` printed
    /// it; `--ab A B` puts two saved benches side by side with B/A per row; `--plot` draws
    /// them as SVG (with several vCPU counts among the files: time per acquisition against
    /// vCPUs).
    Report(ReportArgs),
    /// A co-tenant for benchmarks: busy threads for a fixed time, then one JSON line with the
    /// work they got done (`bench --suite confinement` runs it beside a VM).
    #[command(hide = true)]
    Cotenant(CotenantArgs),
    /// Writes the guest program's ELF (the image `run` boots) to a file, for other VMMs.
    ///
    /// The image boots in any VMM with x86 PVH boot (Cloud Hypervisor's --kernel, QEMU's
    /// -kernel, Firecracker); its parameters come from the kernel command line, which
    /// `guest-cmdline` prints (docs/guest-programs.md).
    GuestImage(GuestImageArgs),
    /// Prints the kernel command line that gives a PVH-booted guest the workload these
    /// options describe (the names are `run`'s: `vcpus=2 workload=lock lock=ticket ...`).
    GuestCmdline(Box<GuestCmdlineArgs>),
}

/// Options of `guest-image`.
#[derive(Clone, Debug, Args)]
pub struct GuestImageArgs {
    /// Where to write the ELF.
    #[arg(long, value_name = "PATH")]
    pub out: std::path::PathBuf,
}

/// Options of `guest-cmdline`.
#[derive(Clone, Debug, Args)]
pub struct GuestCmdlineArgs {
    /// The run options the command line describes (host-only ones are not in it).
    #[command(flatten)]
    pub vm: VmArgs,
    /// The guest TSC's rate in kHz, when the other VMM does not tell the guest through CPUID
    /// (0: leave it to CPUID).
    #[arg(long, default_value_t = 0)]
    pub tsc_khz: u64,
}

/// Options of `report`.
#[derive(Clone, Debug, Args)]
pub struct ReportArgs {
    /// Files `bench --json-out` wrote: each bench in them printed as the table `bench` printed.
    #[arg(value_name = "RUNS.jsonl", required_unless_present = "ab")]
    pub files: Vec<std::path::PathBuf>,
    /// Two saved benches side by side (A/B): per row, each one's median and slowest run, and
    /// B's median over A's. Files holding several benches are paired bench by bench.
    #[arg(long, num_args = 2, value_names = ["A.jsonl", "B.jsonl"], conflicts_with = "files")]
    pub ab: Option<Vec<std::path::PathBuf>>,
    /// Draw the tables as an SVG plot: per bench, time over own 1x per hog count; with
    /// several vCPU counts among the benches, time per acquisition against vCPUs; for ping-pong
    /// benches, kick-to-wake percentiles per variant.
    #[arg(long, value_name = "PATH.svg")]
    pub plot: Option<std::path::PathBuf>,
}

/// Options of `cotenant`.
#[derive(Clone, Debug, Args)]
pub struct CotenantArgs {
    /// Busy threads.
    #[arg(long, default_value_t = 2)]
    pub threads: u32,
    /// How long they run, in ms.
    #[arg(long, default_value_t = 3000)]
    pub ms: u64,
    /// Pin busy thread i to CPU i (modulo the CPUs this process may use), as co-tenants
    /// pinned to cores are.
    #[arg(long)]
    pub pin: bool,
}

/// Pins the calling thread to the `i`-th CPU of this process's affinity mask.
fn pin_to_nth_cpu(i: usize) {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; the size matches the set passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0
    {
        return;
    }
    // SAFETY: `set` was filled by the kernel; CPU_ISSET only reads it.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    let Some(&cpu) = cpus.get(i % cpus.len().max(1)) else {
        return;
    };
    // SAFETY: as above.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE; CPU_SET writes inside `one`.
    unsafe { libc::CPU_SET(cpu, &mut one) };
    // SAFETY: pid 0 is the calling thread; the size matches the set passed.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) };
}

/// Runs `threads` busy threads for `ms` and returns the work units they did per second.
pub fn cotenant(args: &CotenantArgs) -> f64 {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let start = std::time::Instant::now();
    let pin = args.pin;
    let threads: Vec<_> = (0..args.threads)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                if pin {
                    pin_to_nth_cpu(i as usize);
                }
                let mut units = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        units = std::hint::black_box(units.wrapping_add(1));
                    }
                }
                units
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(args.ms));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let units: u64 = threads.into_iter().filter_map(|t| t.join().ok()).sum();
    units as f64 / start.elapsed().as_secs_f64()
}

/// Guest workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkloadArg {
    /// Every vCPU takes one shared lock (the lock-holder-preemption experiment).
    Lock,
    /// Every vCPU prints a greeting.
    Hello,
    /// vCPU 0 spins forever (shows the watchdog).
    Spin,
    /// The last vCPU triple-faults (shows fault reporting).
    Fault,
    /// The last vCPU executes VMCALL (faults, since pvspin turns FIX_HYPERCALL_INSN off).
    Hypercall,
    /// vCPU 0 executes CPUID for --cpuid-leaves and reports what it saw.
    Cpuid,
    /// A token goes around the vCPUs --iterations times, one pv_kick and one pv_wait per
    /// handoff; --cs-work units plus a random 0..=--ncs-work before each kick, a random
    /// 0..=--ncs-work before each wait; reports kick-to-wake latency.
    Pingpong,
    /// Every vCPU computes --iterations x (--cs-work + --ncs-work) units without exiting.
    Burn,
    /// A hostile guest (needs --pv kick+yield): vCPU 0 computes without exiting, the others
    /// keep naming it in SPIN notifications and scribble on their hint pages.
    Abuse,
}

impl From<WorkloadArg> for Workload {
    fn from(arg: WorkloadArg) -> Self {
        match arg {
            WorkloadArg::Lock => Workload::Lock,
            WorkloadArg::Hello => Workload::Hello,
            WorkloadArg::Spin => Workload::Spin,
            WorkloadArg::Fault => Workload::Fault,
            WorkloadArg::Hypercall => Workload::Hypercall,
            WorkloadArg::Cpuid => Workload::Cpuid,
            WorkloadArg::Pingpong => Workload::PingPong,
            WorkloadArg::Burn => Workload::Burn,
            WorkloadArg::Abuse => Workload::Abuse,
        }
    }
}

/// Guest locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LockArg {
    /// Fair FIFO ticket lock.
    Ticket,
    /// Unfair test-and-test-and-set lock.
    Tas,
    /// MCS queued lock (each waiter spins on its own node).
    Queued,
    /// Ticket lock whose waiters back off in proportion to their place in the queue, with an
    /// auto-tuned unit (what the origin threads tried before PV ticket locks).
    Backoff,
}

/// Which guest the guest program behaves as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GuestArg {
    /// pvspin-aware: pvspin's PV locks, hint pages, time budgets, spin notifications.
    Pvspin,
    /// A stock Linux guest on KVM: Linux's pv qspinlock (--lock queued), halts in KVM (hlt; in
    /// user mode the doorbell's WAIT without a notification, the stand-in for hlt), kicks with
    /// the doorbell's KICK on the in-kernel or signal-msi path (KVM_HC_KICK_CPU's stand-in),
    /// reads its predecessor's KVM steal-time preempted byte at the queue head; nothing else
    /// of pvspin's ABI.
    Stock,
}

impl From<GuestArg> for GuestKind {
    fn from(arg: GuestArg) -> Self {
        match arg {
            GuestArg::Pvspin => GuestKind::Pvspin,
            GuestArg::Stock => GuestKind::Stock,
        }
    }
}

/// Guest privilege level of the lock workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CsModeArg {
    /// CPL 0.
    Kernel,
    /// CPL 3.
    User,
}

/// How PV waiters wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WaitArg {
    /// `hlt` in kernel mode, the doorbell's WAIT command in user mode.
    Auto,
    /// `hlt` (kernel mode only).
    Hlt,
    /// The doorbell's WAIT command (ABI 0.3), in either mode.
    Doorbell,
}

/// Unit of the guest's spin budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BudgetArg {
    /// Time, from the hint page, adapted by host and guest (ABI 0.3).
    Time,
    /// Spin counts: --spin-threshold and the SPIN register's window (ABI 0.2).
    Spins,
}

/// Paravirtual locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PvArg {
    /// Plain spinning.
    Off,
    /// Halt past the spin threshold; the unlocker kicks the next waiter (pvspin's doorbell).
    Kick,
    /// As kick, plus spin notifications past the host's spin window and directed yield.
    #[value(name = "kick+yield")]
    KickYield,
}

/// `--actuator`: pvspin's own names (`ActuatorKind`'s `FromStr`), listed with their help.
fn actuator_parser() -> impl clap::builder::TypedValueParser<Value = pvspin::ActuatorKind> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    use pvspin::ActuatorKind;
    let help = |kind| match kind {
        ActuatorKind::Yield => "sched_yield() only",
        ActuatorKind::Nice => "Bounded nice boost of the target's thread, then yield",
        ActuatorKind::Fifo => {
            "Bounded SCHED_FIFO boost of the target's thread, then yield (needs privilege)"
        }
    };
    let values = ActuatorKind::ALL.map(|kind| PossibleValue::new(kind.as_str()).help(help(kind)));
    PossibleValuesParser::new(values).try_map(|name| name.parse::<ActuatorKind>())
}

/// What the seccomp filters do with a syscall a thread does not need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SeccompArg {
    /// Kill the process (SIGSYS).
    Enforce,
    /// Allow it and log it in the kernel's audit log.
    Log,
    /// No filters.
    Off,
}

impl From<SeccompArg> for pvspin_test_vm::config::SeccompMode {
    fn from(arg: SeccompArg) -> Self {
        match arg {
            SeccompArg::Enforce => pvspin_test_vm::config::SeccompMode::Enforce,
            SeccompArg::Log => pvspin_test_vm::config::SeccompMode::Log,
            SeccompArg::Off => pvspin_test_vm::config::SeccompMode::Off,
        }
    }
}

/// Kick wake paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KickPathArg {
    /// ioeventfd + irqfd to a REMRD MSI: no exit to the VMM.
    InKernel,
    /// The doorbell exits; the VMM sends the REMRD MSI with KVM_SIGNAL_MSI.
    SignalMsi,
    /// No in-kernel irqchip: halts exit and park the vCPU thread on a latch.
    Userspace,
}

impl From<KickPathArg> for pvspin::KickPath {
    fn from(arg: KickPathArg) -> Self {
        match arg {
            KickPathArg::InKernel => pvspin::KickPath::InKernel,
            KickPathArg::SignalMsi => pvspin::KickPath::SignalMsi,
            KickPathArg::Userspace => pvspin::KickPath::Userspace,
        }
    }
}

impl From<LockArg> for LockKind {
    fn from(arg: LockArg) -> Self {
        match arg {
            LockArg::Ticket => LockKind::Ticket,
            LockArg::Tas => LockKind::Tas,
            LockArg::Queued => LockKind::Queued,
            LockArg::Backoff => LockKind::Backoff,
        }
    }
}

/// Options of one VM run.
#[derive(Clone, Debug, Args)]
pub struct VmArgs {
    /// Number of vCPUs.
    #[arg(long, default_value_t = 2)]
    pub vcpus: u32,
    /// Guest workload.
    #[arg(long, value_enum, default_value_t = WorkloadArg::Lock)]
    pub workload: WorkloadArg,
    /// Lock taken by the lock workload [default: ticket; with --guest stock: queued, Linux's
    /// pv qspinlock, the one lock a stock guest has a PV version of].
    #[arg(long, value_enum)]
    pub lock: Option<LockArg>,
    /// Paravirtual locks.
    #[arg(long, value_enum, default_value_t = PvArg::Off)]
    pub pv: PvArg,
    /// What the guest is: pvspin-aware, or a stock Linux guest (with --pv kick: --lock queued,
    /// --kick-path in-kernel or signal-msi).
    #[arg(long, value_enum, default_value_t = GuestArg::Pvspin)]
    pub guest: GuestArg,
    /// How a kick wakes a halted vCPU (with --pv kick).
    #[arg(long, value_enum, default_value_t = KickPathArg::InKernel)]
    pub kick_path: KickPathArg,
    /// What directed yield does (with --pv kick+yield).
    #[arg(long, value_parser = actuator_parser(), default_value_t = pvspin::ActuatorKind::Nice)]
    pub actuator: pvspin::ActuatorKind,
    /// PV locks: spins before a waiter halts (about 0.5 us each in emulated kernel mode). A
    /// pvspin-aware guest with `--budgets spins` (default 128; with time budgets only a cap);
    /// a stock guest (default 32768, Linux's SPIN_THRESHOLD).
    #[arg(long)]
    pub spin_threshold: Option<u32>,
    /// PV waiters: how they wait.
    #[arg(long, value_enum, default_value_t = WaitArg::Auto)]
    pub wait: WaitArg,
    /// PV waiters: spin budgets in time (hint page, adaptive) or in spins.
    #[arg(long, value_enum, default_value_t = BudgetArg::Time)]
    pub budgets: BudgetArg,
    /// Time budgets: how long a waiter spins before it waits, at start, in us.
    #[arg(long)]
    pub wait_after_us: Option<u64>,
    /// Time budgets: the ceiling of that budget, in us.
    #[arg(long)]
    pub wait_after_max_us: Option<u64>,
    /// Time budgets: the floor of that budget, in us (pvspin's default: 2).
    #[arg(long)]
    pub wait_after_min_us: Option<u64>,
    /// Time budgets: the floor of that budget with run slots (--sched slots), in us; 0: the
    /// plain floor (pvspin's default: 100).
    #[arg(long)]
    pub slot_wait_after_min_us: Option<u64>,
    /// Directed yield (--pv kick+yield): how long a boost lasts at most, in us.
    #[arg(long)]
    pub boost_deadline_us: Option<u64>,
    /// KVM's halt-polling limit for this VM in ns (0: no polling; default: the host's).
    #[arg(long)]
    pub halt_poll_ns: Option<u32>,
    /// Userspace kick path: spin this long on the latch before sleeping.
    #[arg(long, default_value_t = 0)]
    pub park_spin_us: u64,
    /// Lock and ping-pong workloads: guest kernel mode (CPL 0) or user mode (CPL 3; PV
    /// waiters wait with the doorbell's WAIT command there).
    #[arg(long, value_enum, default_value_t = CsModeArg::Kernel)]
    pub cs_mode: CsModeArg,
    /// Lock acquisitions per vCPU.
    #[arg(long, default_value_t = 2000)]
    pub iterations: u64,
    /// Work units inside each critical section (a unit is a few guest instructions).
    #[arg(long, default_value_t = 40)]
    pub cs_work: u64,
    /// Work units between critical sections.
    #[arg(long, default_value_t = 40)]
    pub ncs_work: u64,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 16)]
    pub mem_mib: u64,
    /// A running vCPU without progress for this long fails the run.
    #[arg(long, default_value_t = 10_000)]
    pub watchdog_ms: u64,
    /// Upper bound on the whole run.
    #[arg(long, default_value_t = 300_000)]
    pub timeout_ms: u64,
    /// Do not copy the guest's console to stdout (`bench`, which never does: no progress bar on
    /// stderr either).
    #[arg(long)]
    pub quiet: bool,
    /// Where the vCPUs run: pvspin then applies KVM's paravirt plan for that placement
    /// (CPUID 0x40000001, exit disabling, halt polling) and prints it, or refuses.
    #[arg(long, value_parser = parse_placement)]
    pub placement: Option<pvspin::Placement>,
    /// With --placement: which Linux guest kernels the plan must be right for (`unknown`: all;
    /// `legacy`: before upstream 960550503965; `modern`: with it). See docs/stock-guests.md.
    #[arg(long, value_parser = parse_guest_kernel, default_value = "unknown")]
    pub guest_kernel: pvspin::GuestKernel,
    /// CPUID leaves the `cpuid` workload reports (decimal or 0x-hex, at most 4).
    #[arg(long, value_delimiter = ',', value_parser = parse_u32, default_value = "0x40000000,0x40000001")]
    pub cpuid_leaves: Vec<u32>,
    /// Seccomp filters on every thread of the run (vCPUs, hogs, pvspin's boost watchdog, the
    /// VMM thread after setup, the main thread of `run`): what a syscall a thread does not
    /// need does.
    #[arg(long, value_enum, default_value_t = SeccompArg::Enforce)]
    pub seccomp: SeccompArg,
    /// Test aid: vCPU 0's thread makes a forbidden syscall once its filter is installed.
    #[arg(long, hide = true)]
    pub seccomp_violation: bool,
    /// Directed yield's boosts: only when they stay inside the VM's CPU share (the VMM alone
    /// in its own cpu cgroup, see --vm-cgroup; otherwise a plain yield), or always (a guest
    /// can then raise its VM's share over co-tenants).
    #[arg(long, value_enum, default_value_t = BoostsArg::Confined)]
    pub boosts: BoostsArg,
    /// Who decides which vCPUs run: the host scheduler alone (`default`), or pvspin's run
    /// slots (`slots`: at most --slots vCPUs in guest code at once, lock holders and kicked
    /// vCPUs first; any kick path: on in-kernel and signal-msi, halts inside KVM are seen
    /// through KVM's `blocking` statistic).
    #[arg(long, value_enum, default_value_t = SchedArg::Default)]
    pub sched: SchedArg,
    /// With --sched slots: how many (0: the CPUs this process may use).
    #[arg(long, default_value_t = 0)]
    pub slots: u32,
    /// With --sched slots: the quantum in us (default: pvspin's `SlotConfig::new`, 8000).
    #[arg(long)]
    pub slot_quantum_us: Option<u64>,
    /// With --sched slots on the in-kernel and signal-msi paths: how often the halt watcher
    /// reads whether vCPUs block in KVM, in us (default: pvspin's, 100).
    #[arg(long)]
    pub halt_watch_us: Option<u64>,
    /// The CPUs pvspin tells the guest this VM gets (`VCPUS_FIT` in its hint pages: whether
    /// what it runs at once fits them: its vCPUs, or its run slots on the userspace and
    /// signal-msi paths). Default: what this process may use (affinity and CPU limit).
    #[arg(long, value_name = "N")]
    pub vm_cpus: Option<usize>,
    /// Run the VMM in a cpu cgroup of its own (created under its current one, removed at the
    /// end; needs write access to the cgroup filesystem). `bench`, or `run --seccomp off`.
    #[arg(long)]
    pub vm_cgroup: bool,
    /// Put the VM under a CPU limit of C CPUs (e.g. 1 or 1.5): the VMM's own cpu cgroup, as
    /// --vm-cgroup makes, with a CFS bandwidth quota (`cpu.max`, or v1 `cpu.cfs_quota_us`).
    /// Run slots size their count from it by default. No --hogs (the hogs are threads of this
    /// process and would share the limit).
    #[arg(long, value_name = "C")]
    pub cpu_limit: Option<f64>,
    /// Who serves PV kicks: `in-process` (pvspin linked into this VMM, the doorbell) or
    /// `vhost-user:PATH` (the pvspin virtio device, served by a vhost-user backend such as
    /// `pvspind --socket PATH`; the guest finds it on virtio-mmio).
    #[arg(long, default_value = "in-process", value_parser = parse_pv_backend)]
    pub pv_backend: PvBackendArg,
    /// With `--pv-backend vhost-user`: kicks stay in KVM. Each kick queue's notification is
    /// an ioeventfd on the eventfd that is its vCPU's irqfd, so no backend thread runs per
    /// kick; the backend serves the rest and sees no kick.
    #[arg(long)]
    pub vhost_direct_kicks: bool,
    /// How the guest boots: `direct` (every vCPU in 64-bit mode at the ELF entry, the
    /// example's own boot parameters) or `pvh` (as any PVH VMM boots it: start info, kernel
    /// command line, ACPI MADT, APs started by the guest with INIT-SIPI-SIPI, ACPI power-off;
    /// needs an in-kernel LAPIC: not --kick-path userspace, not vhost-user).
    #[arg(long, value_enum, default_value_t = BootArg::Direct)]
    pub boot: BootArg,
    /// Test aid for --boot pvh: this kernel command line instead of the one the options
    /// describe.
    #[arg(long, hide = true)]
    pub pvh_cmdline: Option<String>,
}

/// How the guest boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BootArg {
    /// The example's own protocol.
    Direct,
    /// PVH boot.
    Pvh,
}

/// Who serves PV kicks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PvBackendArg {
    /// pvspin in this process.
    InProcess,
    /// A vhost-user backend at this socket.
    VhostUser(std::path::PathBuf),
}

/// A `--pv-backend` that is neither form.
#[derive(Debug, thiserror::Error)]
#[error("expected `in-process` or `vhost-user:PATH`")]
pub struct PvBackendError;

fn parse_pv_backend(text: &str) -> Result<PvBackendArg, PvBackendError> {
    if text == "in-process" {
        return Ok(PvBackendArg::InProcess);
    }
    match text.strip_prefix("vhost-user:") {
        Some(path) if !path.is_empty() => Ok(PvBackendArg::VhostUser(path.into())),
        _ => Err(PvBackendError),
    }
}

/// Who decides which vCPUs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SchedArg {
    /// The host scheduler.
    Default,
    /// pvspin's run slots.
    Slots,
}

/// Whether directed yield's boosts must be confined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BoostsArg {
    /// Only inside the VM's own cpu cgroup.
    Confined,
    /// Always (pvspin::Confinement::Unconfined).
    Unconfined,
}

fn parse_placement(text: &str) -> Result<pvspin::Placement, pvspin::PlanError> {
    text.parse()
}

fn parse_guest_kernel(text: &str) -> Result<pvspin::GuestKernel, UnknownGuestKernel> {
    text.parse()
}

/// A command-line number that is not a 32-bit decimal or `0x` hexadecimal number.
#[derive(Debug, thiserror::Error)]
#[error("{text:?} is not a 32-bit number: {source}")]
pub struct NumberError {
    /// The text given.
    pub text: String,
    /// Why it does not parse.
    #[source]
    pub source: std::num::ParseIntError,
}

fn parse_u32(text: &str) -> Result<u32, NumberError> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|source| NumberError {
        text: text.to_owned(),
        source,
    })
}

/// Options of `run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// VM options.
    #[command(flatten)]
    pub vm: VmArgs,
    /// Busy host threads competing with the vCPUs for host CPUs.
    #[arg(long, default_value_t = 0)]
    pub hogs: u32,
    /// After the run, print pvspin's and KVM's per-vCPU counters.
    #[arg(long)]
    pub stats: bool,
    /// Format of --stats and --stats-file.
    #[arg(long, value_enum, default_value_t = StatsFormatArg::Json)]
    pub stats_format: StatsFormatArg,
    /// Also write the counters to this file.
    #[arg(long)]
    pub stats_file: Option<std::path::PathBuf>,
}

/// Formats of the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StatsFormatArg {
    /// One JSON document.
    Json,
    /// Prometheus text exposition format.
    Prometheus,
}

impl From<StatsFormatArg> for pvspin::TelemetryFormat {
    fn from(arg: StatsFormatArg) -> Self {
        match arg {
            StatsFormatArg::Json => pvspin::TelemetryFormat::Json,
            StatsFormatArg::Prometheus => pvspin::TelemetryFormat::Prometheus,
        }
    }
}

/// `--max-host-steal`: a percentage from 0 to 100.
fn parse_steal_percent(text: &str) -> Result<f64, String> {
    match text.trim_end_matches('%').parse::<f64>() {
        Ok(percent) if (0.0..=100.0).contains(&percent) => Ok(percent),
        _ => Err(format!(
            "{text:?}: the steal bound is a percentage of the host's CPU time, from 0 to 100"
        )),
    }
}

/// `bench --runs` when not given.
pub const DEFAULT_RUNS: u32 = 5;

/// Options of `bench`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// VM options.
    #[command(flatten)]
    pub vm: VmArgs,
    /// Hog counts to compare, one case each.
    #[arg(long, value_delimiter = ',', default_value = "0,2,4")]
    pub hogs: Vec<u32>,
    /// Runs per case (cases are interleaved run by run, so noise spreads evenly) [default: 5;
    /// with --suite: each table's own, 1 with --quick].
    #[arg(long)]
    pub runs: Option<u32>,
    /// Variants to compare side by side, `lock:pv[/option...][:kick-path[:actuator]][@guest]`
    /// (e.g. `ticket:off,ticket:kick,queued:kick:userspace`; options `spins`, `time`, `hlt`,
    /// `doorbell`, `slots`, `vhost`, `poll=NS` (halt polling), `park=US` (userspace spin); `@stock` or `@pvspin` picks the guest, default --guest,
    /// so `queued:kick@pvspin,queued:kick@stock` compares a pvspin-aware and a stock guest in
    /// one table); the first is the baseline. Default: the one --lock/--pv/--kick-path/--guest
    /// describe.
    #[arg(long, value_delimiter = ',', value_parser = crate::bench::Variant::parse)]
    pub variants: Vec<crate::bench::Variant>,
    /// VMs per run: each its own process, all running the same case at once (co-tenants and
    /// host-wide overcommit measured, not assumed); a case's hogs run in the first VM.
    #[arg(long, default_value_t = 1)]
    pub vms: u32,
    /// Write every run's record to this file as JSON lines, as each run finishes: first the
    /// bench's header (title, vCPUs, hog counts, variants, command line), then per run its
    /// variant, case, run index, command line and full report (`pvspin-vmm report` prints the
    /// table again from it). stdout gets the table only.
    #[arg(long, value_name = "PATH")]
    pub json_out: Option<std::path::PathBuf>,
    /// Count only runs during which the hypervisor below this host took at most PERCENT of
    /// its CPU time (steal in /proc/stat; nested hosts lose CPU to it at times, and a PV
    /// waiter more than a spinner): a run over it is saved as discarded and run again in its
    /// place, at most --steal-retries times [default: every run counts].
    #[arg(long, value_name = "PERCENT", value_parser = parse_steal_percent)]
    pub max_host_steal: Option<f64>,
    /// With --max-host-steal: how many times one run is tried again before it counts anyway
    /// (the table says how many runs were).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 3,
        requires = "max_host_steal"
    )]
    pub steal_retries: u32,
    /// Draw the table as an SVG plot: each variant's time over its own time at 1x per hog
    /// count, every run shown (ping-pong: kick-to-wake percentiles per variant).
    #[arg(long, value_name = "PATH.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// Run a named suite instead: every table of one part of docs/benchmarks.md, each a bench
    /// of its own (or several, round by round), its runs, table and plot written to --out
    /// (`TABLE.jsonl`, `TABLE.txt`, `TABLE.svg`, and `suite.txt` with the machine, the load and
    /// every command). The suite sets every other bench option. `--suite list` lists them.
    #[arg(long, value_name = "NAME")]
    pub suite: Option<String>,
    /// With --suite: where its files go [default: bench-out/NAME].
    #[arg(long, value_name = "DIR", requires = "suite")]
    pub out: Option<std::path::PathBuf>,
    /// With --suite: scaled down (fewer iterations, 1 run per case unless --runs) for smoke
    /// tests; its numbers are not the published ones.
    #[arg(long, requires = "suite")]
    pub quick: bool,
    /// With --suite: print each table's commands and variants; run nothing.
    #[arg(long, requires = "suite")]
    pub dry_run: bool,
    /// With --suite vhost or vhost-parity: the pvspind binary [default: beside this one].
    #[arg(long, value_name = "PATH", requires = "suite")]
    pub pvspind: Option<std::path::PathBuf>,
    /// With --suite ab: build A (e.g. the previous main's pvspin-vmm).
    #[arg(long, value_name = "PATH", requires = "suite")]
    pub build_a: Option<std::path::PathBuf>,
    /// With --suite ab: build B, run alternately with A, round by round.
    #[arg(long, value_name = "PATH", requires = "suite")]
    pub build_b: Option<std::path::PathBuf>,
    /// With --suite kick-latency: the C probes' directory (`e2b_doorbell`, built with its
    /// `build.sh` in a temporary copy), run round by round beside pvspin's ping-pong.
    #[arg(long, value_name = "DIR", requires = "suite")]
    pub probes: Option<std::path::PathBuf>,
    /// With --suite ab: the bench arguments both builds run (after `--`), in place of the
    /// suite's.
    #[arg(last = true, value_name = "BENCH ARGS", requires = "suite")]
    pub suite_args: Vec<String>,
    /// Internal: this process is VM `--child-vm` of a multi-VM run of case `--child-case`.
    #[arg(long, hide = true, requires = "child_vm")]
    pub child_case: Option<usize>,
    /// Internal: see `--child-case`.
    #[arg(long, hide = true)]
    pub child_vm: Option<u32>,
}

impl VmArgs {
    /// The run configuration these options describe.
    pub fn config(&self, hogs: u32) -> RunConfig {
        RunConfig {
            vcpus: self.vcpus,
            workload: self.workload.into(),
            lock: self.lock.map_or(
                match self.guest {
                    GuestArg::Stock => LockKind::Queued,
                    GuestArg::Pvspin => LockKind::Ticket,
                },
                Into::into,
            ),
            iterations: self.iterations,
            cs_work: self.cs_work,
            ncs_work: self.ncs_work,
            hogs,
            mem_mib: self.mem_mib,
            watchdog_ms: self.watchdog_ms,
            timeout_ms: self.timeout_ms,
            echo_console: !self.quiet,
            cpuid_leaves: std::array::from_fn(|i| self.cpuid_leaves.get(i).copied().unwrap_or(0)),
            placement: self.placement,
            guest_kernel: self.guest_kernel,
            pv: match self.pv {
                PvArg::Off => pvspin_test_vm::config::PvMode::Off,
                PvArg::Kick => pvspin_test_vm::config::PvMode::Kick,
                PvArg::KickYield => pvspin_test_vm::config::PvMode::KickYield,
            },
            kick_path: self.kick_path.into(),
            guest: self.guest.into(),
            spin_threshold: self.spin_threshold.unwrap_or(128),
            stock_spin_threshold: self.spin_threshold.unwrap_or(STOCK_SPIN_THRESHOLD),
            actuator: self.actuator,
            halt_poll_ns: self.halt_poll_ns,
            park_spin_us: self.park_spin_us,
            user_mode: self.cs_mode == CsModeArg::User,
            wait: match self.wait {
                WaitArg::Auto => pvspin_test_vm::config::WaitMode::Auto,
                WaitArg::Hlt => pvspin_test_vm::config::WaitMode::Hlt,
                WaitArg::Doorbell => pvspin_test_vm::config::WaitMode::Doorbell,
            },
            budgets: match self.budgets {
                BudgetArg::Time => pvspin_test_vm::config::BudgetMode::Time,
                BudgetArg::Spins => pvspin_test_vm::config::BudgetMode::Spins,
            },
            wait_after_us: self.wait_after_us,
            wait_after_max_us: self.wait_after_max_us,
            wait_after_min_us: self.wait_after_min_us,
            slot_wait_after_min_us: self.slot_wait_after_min_us,
            boost_deadline_us: self.boost_deadline_us,
            seccomp: self.seccomp.into(),
            seccomp_violation: self.seccomp_violation,
            run_slots: (self.sched == SchedArg::Slots).then_some(self.slots),
            slot_quantum_us: self.slot_quantum_us,
            halt_watch_us: self.halt_watch_us,
            vm_cpus: self.vm_cpus,
            vhost_user: match &self.pv_backend {
                PvBackendArg::InProcess => None,
                PvBackendArg::VhostUser(path) => Some(path.clone()),
            },
            vhost_direct_kicks: self.vhost_direct_kicks,
            confinement: match self.boosts {
                BoostsArg::Confined => pvspin::Confinement::Auto,
                BoostsArg::Unconfined => pvspin::Confinement::Unconfined,
            },
            boot: match self.boot {
                BootArg::Direct => pvspin_test_vm::config::BootMode::Direct,
                BootArg::Pvh => pvspin_test_vm::config::BootMode::Pvh,
            },
            pvh_cmdline: self.pvh_cmdline.clone(),
        }
    }
}

/// Runs the command line `args` (program name first); returns the process exit code:
/// 0 success, 1 the guest or the host failed, 2 invalid options. The calling thread is left
/// unconfined (the run's own threads get filters per `--seccomp`); see [`main_process`].
pub fn main_with_args<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_cli(args, false)
}

/// [`main_with_args`] for the process's main thread (the binary): with `--seccomp` on, `run`
/// also confines the calling thread once the VM's thread has started
/// ([`vmm::run_and_confine_caller`]). `bench` cannot: it starts a new VM after each run.
pub fn main_process<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_cli(args, true)
}

fn run_cli<I, T>(args: I, confine_caller: bool) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let command: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => {
            let code = err.exit_code();
            let _ = err.print();
            return code;
        }
    };
    let vm_args = match &cli.command {
        CliCommand::Bench(args) if args.suite.is_some() => {
            let mut stdout = std::io::stdout().lock();
            return crate::suite::command(args, &mut stdout);
        }
        CliCommand::Run(args) => &args.vm,
        CliCommand::Bench(args) => &args.vm,
        CliCommand::Report(args) => {
            let mut stdout = std::io::stdout().lock();
            return report_command(args, &mut stdout);
        }
        CliCommand::Cotenant(args) => {
            print_stdout(&format!("{{\"units_per_sec\":{:.0}}}", cotenant(args)));
            return 0;
        }
        CliCommand::GuestImage(args) => {
            return match std::fs::write(&args.out, vmm::GUEST_IMAGE) {
                Ok(()) => 0,
                Err(err) => {
                    eprintln!("pvspin-vmm: cannot write {}: {err}", args.out.display());
                    1
                }
            };
        }
        CliCommand::GuestCmdline(args) => {
            let config = args.vm.config(0);
            if let Err(err) = config.validate(u32::MAX) {
                eprintln!("pvspin-vmm: {err}");
                return 2;
            }
            print_stdout(&pvspin_test_vm::pvh::guest_cmdline(&config, args.tsc_khz));
            return 0;
        }
    };
    let _cgroup = if vm_args.vm_cgroup || vm_args.cpu_limit.is_some() {
        if matches!(cli.command, CliCommand::Run(_)) && vm_args.seccomp != SeccompArg::Off {
            eprintln!(
                "pvspin-vmm: rule: run --vm-cgroup and --cpu-limit need --seccomp off (leaving \
                 the cgroup at the end needs file-system calls the confined main thread may not \
                 make)"
            );
            return 2;
        }
        let hogs = match &cli.command {
            CliCommand::Run(args) => args.hogs,
            CliCommand::Bench(args) => args.hogs.iter().copied().max().unwrap_or(0),
            CliCommand::Cotenant(_)
            | CliCommand::Report(_)
            | CliCommand::GuestImage(_)
            | CliCommand::GuestCmdline(_) => 0,
        };
        if vm_args.cpu_limit.is_some() && hogs > 0 {
            eprintln!(
                "pvspin-vmm: rule: --cpu-limit takes no --hogs (the hog threads would share the \
                 VM's quota)"
            );
            return 2;
        }
        match pvspin_test_vm::cgroup::VmCgroup::enter() {
            Ok(cgroup) => {
                if let Some(cpus) = vm_args.cpu_limit {
                    if let Err(err) = cgroup.limit(cpus) {
                        eprintln!("pvspin-vmm: --cpu-limit: {err}");
                        return if matches!(err, pvspin_test_vm::cgroup::CgroupError::CpuLimit(_)) {
                            2
                        } else {
                            1
                        };
                    }
                }
                Some(cgroup)
            }
            Err(err) => {
                eprintln!("pvspin-vmm: --vm-cgroup: {err}");
                return 1;
            }
        }
    } else {
        None
    };
    match cli.command {
        CliCommand::Cotenant(_)
        | CliCommand::Report(_)
        | CliCommand::GuestImage(_)
        | CliCommand::GuestCmdline(_) => 0,
        CliCommand::Run(args) => match if confine_caller {
            vmm::run_and_confine_caller(&args.vm.config(args.hogs))
        } else {
            vmm::run(&args.vm.config(args.hogs))
        } {
            Ok(report) => {
                for line in &report.plan {
                    print_stdout(&format!("pvspin {line}"));
                }
                print_stdout(&format!("{}\n{}", report.summary_line(), report.to_json()));
                print_telemetry(&args, &report)
            }
            Err(err) => {
                eprintln!("pvspin-vmm: {err}");
                err.exit_code()
            }
        },
        CliCommand::Bench(args) => {
            let mut stdout = std::io::stdout().lock();
            bench_command(&args, command, &mut stdout, vmm::run)
        }
    }
}

/// `bench`: runs the cases with `runner`, then writes the table to `stdout` (and nothing else
/// there); returns the exit code.
pub fn bench_command<R>(
    args: &BenchArgs,
    command: Vec<String>,
    stdout: &mut dyn std::io::Write,
    runner: R,
) -> i32
where
    R: FnMut(&RunConfig) -> Result<pvspin_test_vm::RunReport, vmm::RunError>,
{
    let child = args.child_case.zip(args.child_vm);
    let options = BenchOptions {
        hogs: args.hogs.clone(),
        runs: args.runs.unwrap_or(DEFAULT_RUNS),
        variants: args.variants.clone(),
        vms: args.vms.max(1),
        child,
        json_out: args.json_out.clone().filter(|_| child.is_none()),
        progress: child.is_none()
            && !args.vm.quiet
            && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        command,
        steal_bound: args.max_host_steal.map(|percent| bench::StealBound {
            max_share: percent / 100.0,
            retries: args.steal_retries,
        }),
    };
    match bench::run_with(&args.vm, &options, runner) {
        Ok(_) if options.child.is_some() => 0,
        Ok(table) => {
            // A closed stdout (`| head`) is not an error worth a failed bench.
            let _ = writeln!(stdout, "{table}");
            let Some(path) = &args.plot else {
                return 0;
            };
            let labelled = crate::plot::Labelled {
                label: None,
                table: &table,
            };
            match crate::plot::render_svg(&[labelled])
                .and_then(|svg| crate::plot::write(path, &svg))
            {
                Ok(()) => 0,
                Err(err) => {
                    eprintln!("pvspin-vmm: --plot: {err}");
                    1
                }
            }
        }
        Err(err) => {
            eprintln!("pvspin-vmm: {err}");
            err.exit_code()
        }
    }
}

/// `report`: writes the saved benches' tables to `stdout`; returns the exit code (1 when a file
/// cannot be read or is not what `bench --json-out` writes).
pub fn report_command(args: &ReportArgs, stdout: &mut dyn std::io::Write) -> i32 {
    match crate::saved::report(
        &args.files,
        args.ab.as_deref(),
        args.plot.as_deref(),
        stdout,
    ) {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("pvspin-vmm report: {err}");
            1
        }
    }
}

/// `--stats` and `--stats-file`; returns the exit code.
fn print_telemetry(args: &RunArgs, report: &pvspin_test_vm::RunReport) -> i32 {
    let Some(telemetry) = &report.telemetry else {
        return 0;
    };
    let format = args.stats_format.into();
    if args.stats {
        print_stdout(telemetry.render(format).trim_end());
    }
    if let Some(path) = &args.stats_file {
        if let Err(err) = telemetry.write_to(path, format) {
            eprintln!("pvspin-vmm: cannot write {}: {err}", path.display());
            return 1;
        }
    }
    0
}

/// Prints a line; a closed stdout (`| head`) is not an error worth a panic.
pub(crate) fn print_stdout(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantum_help_names_pvspins_default() {
        use clap::CommandFactory;
        let default_us = pvspin::SlotConfig::new(1).quantum.as_micros().to_string();
        let cli = Cli::command();
        let run = cli.find_subcommand("run").expect("run");
        let quantum = run
            .get_arguments()
            .find(|a| a.get_id() == "slot_quantum_us")
            .expect("--slot-quantum-us");
        let help = quantum.get_help().expect("help").to_string();
        assert!(help.contains(&format!(", {default_us})")), "{help}");
    }

    #[test]
    fn usage_errors_exit_with_2() {
        assert_eq!(
            main_with_args(["pvspin-vmm", "run", "--workload", "nope"]),
            2
        );
        assert_eq!(main_with_args(["pvspin-vmm", "run", "--vcpus", "-1"]), 2);
        assert_eq!(main_with_args(["pvspin-vmm", "frobnicate"]), 2);
    }

    #[test]
    fn guest_option_and_its_spin_threshold_default() {
        let parse = |args: &[&str]| {
            let cli = Cli::try_parse_from(["pvspin-vmm", "run"].iter().chain(args)).unwrap();
            let CliCommand::Run(args) = cli.command else {
                panic!("expected run")
            };
            args.vm.config(0)
        };
        let pvspin = parse(&[]);
        assert_eq!(pvspin.guest, GuestKind::Pvspin);
        assert_eq!(pvspin.guest_spin_threshold(), 128);
        let stock = parse(&["--guest", "stock", "--pv", "kick", "--lock", "queued"]);
        assert_eq!(stock.guest, GuestKind::Stock);
        assert_eq!(stock.guest_spin_threshold(), 1 << 15);
        assert_eq!(stock.validate(8), Ok(()));
        // Without --lock: the ticket lock for a pvspin guest, the pv qspinlock for a stock one.
        assert_eq!(pvspin.lock, LockKind::Ticket);
        let stock_default = parse(&["--guest", "stock", "--pv", "kick"]);
        assert_eq!(stock_default.lock, LockKind::Queued);
        assert_eq!(stock_default.validate(8), Ok(()));
        let set = parse(&["--guest", "stock", "--spin-threshold", "64"]);
        assert_eq!((set.guest_spin_threshold(), set.spin_threshold), (64, 64));
        // A refused stock run is a usage error (exit code 2), before /dev/kvm is opened.
        assert_eq!(
            main_with_args([
                "pvspin-vmm",
                "run",
                "--guest",
                "stock",
                "--pv",
                "kick",
                "--lock",
                "ticket",
                "--seccomp",
                "off",
            ]),
            2
        );
    }

    /// A directory of its own for a test's files.
    fn scratch(test: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pvspin-vmm-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn bench_stdout_is_the_table_alone_and_saved_runs_give_it_again() {
        let dir = scratch("bench-stdout");
        let json = dir.join("runs.jsonl");
        let cli = Cli::try_parse_from([
            "pvspin-vmm",
            "bench",
            "--hogs",
            "0,2",
            "--runs",
            "3",
            "--variants",
            "ticket:off,ticket:kick",
            "--json-out",
            json.to_str().unwrap(),
        ])
        .unwrap();
        let CliCommand::Bench(args) = cli.command else {
            panic!("expected bench")
        };
        let command: Vec<String> = ["pvspin-vmm", "bench", "--made-up"]
            .map(String::from)
            .into();
        let mut runs = 0;
        let mut stdout = Vec::new();
        let code = bench_command(&args, command.clone(), &mut stdout, |config| {
            runs += 1;
            if runs == 7 {
                // A collapse: a result, recorded as its bound.
                return Err(vmm::RunError::Timeout {
                    limit_ms: 2500,
                    states: vmm::VcpuStates::default(),
                });
            }
            Ok(pvspin_test_vm::RunReport::made_up(
                config,
                f64::from(runs) * 0.125 + f64::from(config.hogs),
            ))
        });
        assert_eq!(code, 0);
        assert_eq!(runs, 12);
        let stdout = String::from_utf8(stdout).unwrap();
        // The table and nothing else: no run's JSON line.
        assert!(
            stdout.lines().all(|l| !l.trim_start().starts_with('{')),
            "{stdout}"
        );
        assert!(stdout.starts_with("lock workload on 2 vCPUs"), "{stdout}");
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("case ")).collect();
        assert_eq!(rows.len(), 4, "{stdout}");
        // Each round starts one case later: ticket:off at 0 hogs ran 1st, 8th and 11th (0.125,
        // 1.0 and 1.375 s), and the 7th run, stopped by its bound, was ticket:kick at 2 hogs.
        // Tails beside medians.
        assert!(
            rows[0].contains("median 1.0000  slowest 1.3750"),
            "{stdout}"
        );
        assert!(rows[3].contains("(1 stopped by the bound)"), "{stdout}");
        // Every run's record, in the order run, with its variant, case, run index and command
        // line.
        let saved = std::fs::read_to_string(&json).unwrap();
        let records: Vec<crate::saved::Record> = saved
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len(), 13);
        let crate::saved::Record::Bench(header) = &records[0] else {
            panic!("header first: {saved}")
        };
        assert_eq!(header.variants, ["ticket:off", "ticket:kick:in-kernel"]);
        assert_eq!(header.command, command);
        for (i, record) in records[1..].iter().enumerate() {
            let crate::saved::Record::Run(run) = record else {
                panic!("run records after the header: {saved}")
            };
            assert_eq!(
                (run.case_index, run.run as usize),
                ((i % 4 + i / 4) % 4, i / 4)
            );
            assert_eq!(run.command, command);
            assert_eq!(run.timed_out, i == 6);
            assert_eq!(run.report.is_some(), i != 6);
        }
        let crate::saved::Record::Run(run) = &records[4] else {
            unreachable!()
        };
        assert_eq!(
            (run.variant.as_str(), run.hogs),
            ("ticket:kick:in-kernel", 2)
        );
        assert_eq!(run.case, "2x (2 hogs)");
        // Read back, the saved runs give the very same table.
        let tables = crate::saved::load(&json).unwrap();
        assert_eq!(tables.len(), 1);
        assert_eq!(format!("{}\n", tables[0]), stdout);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_steal_bound_is_a_percentage_and_retries_need_it() {
        let parse =
            |value: &str| Cli::try_parse_from(["pvspin-vmm", "bench", "--max-host-steal", value]);
        let CliCommand::Bench(args) = parse("5%").unwrap().command else {
            panic!("expected bench")
        };
        assert_eq!((args.max_host_steal, args.steal_retries), (Some(5.0), 3));
        let err = parse("150").unwrap_err().to_string();
        assert!(
            err.contains("a percentage of the host's CPU time, from 0 to 100"),
            "{err}"
        );
        assert!(parse("-1").is_err());
        assert!(
            Cli::try_parse_from(["pvspin-vmm", "bench", "--steal-retries", "2"]).is_err(),
            "--steal-retries without a bound"
        );
    }

    #[test]
    fn parses_bench_hog_lists() {
        let cli =
            Cli::try_parse_from(["pvspin-vmm", "bench", "--hogs", "0,2,4", "--runs", "3"]).unwrap();
        let CliCommand::Bench(args) = cli.command else {
            panic!("expected bench")
        };
        assert_eq!(args.hogs, [0, 2, 4]);
        assert_eq!(args.vm.config(2).hogs, 2);
    }
}
