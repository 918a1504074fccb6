//! One run: create the VM, start the vCPU and hog threads, watch them from an event loop,
//! and report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pvspin::PvSpin;
use pvspin_test_vm_proto::{BootParams, LockKind, Workload, BOOT_MAGIC, BOOT_VERSION};
use vm_memory::GuestAddress;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::config::{BootMode, PvMode, RunConfig, RunConfigError};
use crate::devices::{ConsoleSink, IoBus};
use crate::memory::{self, MemoryError, VmMemory};
use crate::report::{RunReport, VcpuReport};
use crate::seccomp::{Filters, VmmThread};
use crate::vcpu::{VcpuEnd, VcpuKicker, VcpuRunner, VcpuShared};
use crate::vhost::VhostPvspin;

/// The guest program, built by this crate's build script.
pub static GUEST_IMAGE: &[u8] = include_bytes!(env!("PVSPIN_GUEST_ELF"));

/// How often the watchdog looks at the vCPUs.
const WATCHDOG_TICK: Duration = Duration::from_millis(50);

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Invalid configuration (exit code 2).
    #[error("invalid configuration: {0}")]
    Config(#[from] RunConfigError),
    /// The host could not set the VM up.
    #[error("setting up the VM: {0}")]
    Setup(String),
    /// pvspin refused the configuration (exit code 2).
    #[error("pvspin refused the configuration: {0}")]
    Refused(String),
    /// Guest memory could not be prepared.
    #[error("preparing guest memory: {0}")]
    Memory(#[from] MemoryError),
    /// The guest crashed or KVM could not run it.
    #[error("vCPU {vcpu} failed: {reason}\n{states}")]
    GuestFault {
        /// The vCPU that failed.
        vcpu: u32,
        /// What happened.
        reason: String,
        /// Every vCPU's state.
        states: VcpuStates,
    },
    /// The guest ended the run with a failure status.
    #[error("the guest reported failure status {status} ({meaning})\n{states}{console_tail}")]
    GuestStatus {
        /// The status written to the exit port.
        status: u32,
        /// What it means.
        meaning: &'static str,
        /// Every vCPU's state.
        states: VcpuStates,
        /// The guest console's last lines, when it was not echoed (`--quiet`): the guest says
        /// there why it failed. Empty, or a newline and the lines.
        console_tail: String,
    },
    /// A running vCPU made no progress for too long.
    #[error("watchdog: vCPU {vcpu} made no progress for {silent_ms} ms (limit {limit_ms} ms); the VM was stopped\n{states}")]
    Watchdog {
        /// The first silent vCPU.
        vcpu: u32,
        /// How long it was silent.
        silent_ms: u64,
        /// The limit.
        limit_ms: u64,
        /// Every vCPU's state.
        states: VcpuStates,
    },
    /// The run took longer than its bound.
    #[error("the run exceeded its {limit_ms} ms bound; the VM was stopped\n{states}")]
    Timeout {
        /// The bound.
        limit_ms: u64,
        /// Every vCPU's state.
        states: VcpuStates,
    },
}

impl RunError {
    /// The process exit code for this error: 2 for invalid configuration, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Config(_) | RunError::Refused(_) => 2,
            _ => 1,
        }
    }
}

/// Per-vCPU states at the end of a failed run, one line each.
#[derive(Debug, Default)]
pub struct VcpuStates(pub Vec<VcpuReport>);

impl std::fmt::Display for VcpuStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, vcpu) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "  {vcpu}")?;
        }
        Ok(())
    }
}

/// How the run ended, decided by the first vCPU or watchdog to see it.
#[derive(Clone, Debug)]
enum Ending {
    GuestExit(u32),
    Fault { vcpu: u32, reason: String },
    Watchdog { vcpu: u32, silent_ms: u64 },
    Timeout,
}

/// What vCPU threads and event subscribers share.
struct RunControl {
    ending: Mutex<Option<Ending>>,
    ended: EventFd,
    /// Lets the vCPUs run, all together.
    start: StartGate,
}

impl RunControl {
    /// No ending yet.
    fn new() -> Result<Self, RunError> {
        Ok(Self {
            ending: Mutex::new(None),
            ended: EventFd::new(libc::EFD_NONBLOCK)
                .map_err(|err| RunError::Setup(format!("eventfd: {err}")))?,
            start: StartGate::default(),
        })
    }

    /// Records the ending; the first one wins.
    fn end(&self, ending: Ending) {
        let mut slot = self.ending.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(ending);
            if let Err(err) = self.ended.write(1) {
                log::error!("cannot signal the end of the run: {err}");
            }
        }
    }

    fn ending(&self) -> Option<Ending> {
        self.ending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Wakes the event loop when the run ends.
struct EndWatcher {
    control: Arc<RunControl>,
}

impl MutEventSubscriber for EndWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(err) = ops.add(Events::new(&self.control.ended, EventSet::IN)) {
            log::error!("cannot watch the end-of-run event: {err:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.control.ended.read();
    }
}

/// Watches every vCPU's progress on a timer and ends the run when one stalls.
struct Watchdog {
    timer: TimerFd,
    control: Arc<RunControl>,
    memory: VmMemory,
    vcpus: Vec<Arc<VcpuShared>>,
    /// Per vCPU: heartbeat and exits last seen, and when they last changed (empty until the
    /// vCPUs start).
    last_progress: Vec<(u64, u64, Instant)>,
    limit: Duration,
    timeout: Duration,
}

impl Watchdog {
    fn check(&mut self) {
        let Some(started) = self.control.start.opened_at() else {
            return;
        };
        if self.last_progress.is_empty() {
            self.last_progress = vec![(0, 0, started); self.vcpus.len()];
        }
        let now = Instant::now();
        if now.duration_since(started) > self.timeout {
            self.control.end(Ending::Timeout);
            return;
        }
        for (vcpu, last) in self.vcpus.iter().zip(self.last_progress.iter_mut()) {
            let slot = memory::read_slot(&self.memory, vcpu.index).unwrap_or_default();
            let exits = vcpu.exits.load(Ordering::Relaxed);
            // A vCPU that finished its share may halt inside KVM (in-kernel irqchip), where it
            // still looks Running: its finish stamp says it is done, not stuck.
            if (slot.heartbeat, exits) != (last.0, last.1)
                || slot.finish_tsc != 0
                || vcpu.state() != crate::vcpu::VcpuRunState::Running
            {
                *last = (slot.heartbeat, exits, now);
                continue;
            }
            let silent = now.duration_since(last.2);
            if silent > self.limit {
                self.control.end(Ending::Watchdog {
                    vcpu: vcpu.index,
                    silent_ms: u64::try_from(silent.as_millis()).unwrap_or(u64::MAX),
                });
                return;
            }
        }
    }
}

impl MutEventSubscriber for Watchdog {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(err) = self.timer.reset(WATCHDOG_TICK, Some(WATCHDOG_TICK)) {
            log::error!("cannot arm the watchdog timer: {err}");
        }
        if let Err(err) = ops.add(Events::new(&self.timer, EventSet::IN)) {
            log::error!("cannot watch the watchdog timer: {err:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.timer.wait();
        self.check();
    }
}

/// Forwards the VMM's stdin to the guest's UART, when stdin is a terminal.
struct ConsoleInput {
    bus: Arc<IoBus>,
}

impl MutEventSubscriber for ConsoleInput {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(err) = ops.add(Events::new_raw(libc::STDIN_FILENO, EventSet::IN)) {
            log::warn!("console input disabled: cannot watch stdin: {err:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let mut buf = [0u8; 64];
        // SAFETY: reads at most buf.len() bytes into our own buffer from stdin.
        let read = unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
        match usize::try_from(read) {
            Ok(0) | Err(_) => {
                // End of input or an error: stop watching, or the loop would spin on it.
                let _ = ops.remove(events);
            }
            Ok(len) => {
                let taken = self.bus.enqueue_input(&buf[..len]);
                if taken < len {
                    log::debug!(
                        "console input: {} bytes dropped (UART FIFO full)",
                        len - taken
                    );
                }
            }
        }
    }
}

/// Busy host threads: the CPU hogs of the original overcommit experiments.
struct Hogs {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Option<()>>>,
}

impl Hogs {
    fn start(count: u32, filters: Option<&Filters>) -> Result<Self, RunError> {
        let mut hogs = Self {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        for i in 0..count {
            let stop = hogs.stop.clone();
            let filter = filters.map(|f| (f.program(VmmThread::Hog), VmmThread::Hog));
            let thread = spawn_confined(format!("hog{i}"), filter, move || {
                let mut spins = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        spins = std::hint::black_box(spins.wrapping_add(1));
                    }
                }
            });
            match thread {
                Ok(thread) => hogs.threads.push(thread),
                Err(err) => {
                    hogs.stop();
                    return Err(RunError::Setup(format!("hog thread {i}: {err}")));
                }
            }
        }
        Ok(hogs)
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Why [`spawn_confined`] could not start its thread.
#[derive(Debug, thiserror::Error)]
enum SpawnError {
    /// The thread could not be created.
    #[error("cannot start the thread: {0}")]
    Thread(#[source] std::io::Error),
    /// Its seccomp filter could not be installed (the thread ended without running).
    #[error("{0}")]
    Filter(#[from] crate::seccomp::InstallError),
    /// The thread ended before saying whether its filter is in place.
    #[error("the thread ended before it started")]
    Ended,
}

/// Starts thread `name` running `f`, with `filter` (a seccomp program and whose it is)
/// installed first, on the thread; returns once the filter is in place. When it cannot be
/// installed the thread ends without running `f`, and this returns why.
fn spawn_confined<T: Send + 'static>(
    name: String,
    filter: Option<(Arc<seccompiler::BpfProgram>, VmmThread)>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<Option<T>>, SpawnError> {
    let (started_tx, started_rx) =
        std::sync::mpsc::sync_channel::<Result<(), crate::seccomp::InstallError>>(1);
    let thread = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            let started = filter.map_or(Ok(()), |(program, thread)| {
                crate::seccomp::install(&program, thread)
            });
            let ok = started.is_ok();
            let _ = started_tx.send(started);
            ok.then(f)
        })
        .map_err(SpawnError::Thread)?;
    match started_rx.recv() {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(err)) => {
            let _ = thread.join();
            Err(err.into())
        }
        Err(_) => {
            let _ = thread.join();
            Err(SpawnError::Ended)
        }
    }
}

fn setup_err(what: &str) -> impl FnOnce(kvm_ioctls::Error) -> RunError + '_ {
    move |err| RunError::Setup(format!("{what}: {err}"))
}

/// The boot parameters the test guest reads for `config` (`tsc_khz`: the vCPUs' TSC
/// frequency, 0 when unknown).
pub fn boot_params(config: &RunConfig, tsc_khz: u64) -> BootParams {
    BootParams {
        magic: BOOT_MAGIC,
        version: BOOT_VERSION,
        workload: config.workload as u32,
        lock: config.lock as u32,
        vcpus: config.vcpus,
        iterations: config.iterations,
        cs_work: config.cs_work,
        ncs_work: config.ncs_work,
        tsc_khz,
        cpuid_leaves: config.cpuid_leaves,
        pv: match config.pv {
            PvMode::Off => pvspin_test_vm_proto::PV_OFF,
            PvMode::Kick => pvspin_test_vm_proto::PV_KICK,
            PvMode::KickYield => pvspin_test_vm_proto::PV_KICK_YIELD,
        },
        spin_threshold: config.guest_spin_threshold(),
        user_mode: u32::from(config.user_mode),
        pv_flags: config.pv_flags(),
        virtio_mmio_base: 0,
        result: Default::default(),
    }
}

/// Runs one VM with `config` to its end.
///
/// With `config.seccomp` on, the VM runs on a thread of its own, `vmm`, which sets it up,
/// starts the vCPU and hog threads (each installs its filter first), installs its own filter
/// and runs the event loop to the end; pvspin's boost watchdog gets its filter from pvspin
/// (`crate::seccomp`). The calling thread only waits, unconfined; see
/// [`run_and_confine_caller`].
pub fn run(config: &RunConfig) -> Result<RunReport, RunError> {
    run_inner(config, false)
}

/// [`run`] for a thread that has nothing left to set up, such as the binary's main thread:
/// with `config.seccomp` on, the calling thread installs its own filter
/// (`crate::seccomp::VmmThread::Main`: wait, print, write the statistics file) as soon as
/// the `vmm` thread has started, and keeps it.
pub fn run_and_confine_caller(config: &RunConfig) -> Result<RunReport, RunError> {
    run_inner(config, true)
}

fn run_inner(config: &RunConfig, confine_caller: bool) -> Result<RunReport, RunError> {
    // Every rule but KVM's vCPU limit, before /dev/kvm is opened (checked again with it).
    config.validate(u32::MAX)?;
    let filters = Filters::new(config.seccomp, config.vhost_user.is_some())
        .map_err(|err| RunError::Setup(format!("building the seccomp filters: {err}")))?;
    let Some(filters) = filters else {
        return run_vm(config, None);
    };
    let vm_config = config.clone();
    let vm_filters = filters.clone();
    let thread = std::thread::Builder::new()
        .name("vmm".into())
        .spawn(move || run_vm(&vm_config, Some(&vm_filters)))
        .map_err(|err| RunError::Setup(format!("cannot start the VMM thread: {err}")))?;
    let confined = if confine_caller {
        filters.apply(VmmThread::Main)
    } else {
        Ok(())
    };
    let result = thread
        .join()
        .unwrap_or_else(|_| Err(RunError::Setup("the VMM thread panicked".into())));
    confined.map_err(|err| RunError::Setup(err.to_string()))?;
    result
}

/// One VM on the calling thread; with `filters`, every thread of the run is confined (the
/// calling thread after setup).
///
/// Each step is a helper below, called in the order KVM and pvspin need: open KVM, load the
/// guest into fresh memory, create the VM and build pvspin for it, configure the VM (pvspin's
/// part before any vCPU exists), register the memory, attach the vhost-user device, create and
/// configure the vCPUs, write the boot data; then set up the event loop, start the hog and
/// vCPU threads, confine this thread, run to the end, stop and join, and report.
fn run_vm(config: &RunConfig, filters: Option<&Filters>) -> Result<RunReport, RunError> {
    let (kvm, signal) = open_kvm(config)?;
    // Declared before `vm`: the memory KVM maps is dropped after the VM.
    let guest = load_guest(config)?;
    let vm = kvm.create_vm().map_err(setup_err("KVM_CREATE_VM"))?;
    let shared: Vec<Arc<VcpuShared>> = (0..config.vcpus)
        .map(|i| Arc::new(VcpuShared::new(i, signal.clone())))
        .collect();
    let pvspin = build_pvspin(config, &guest.memory, &shared, filters)?;
    let mut plan = configure_vm(config, &kvm, &vm, &pvspin)?;
    // SAFETY: `guest`, which owns the memory, is declared before `vm` and so outlives it.
    unsafe { register_memory(&vm, &guest.memory, config.mem_bytes()) }?;
    let virtio = attach_vhost_user(config, &vm, &guest.memory)?;
    let vcpus = create_vcpus(config, &kvm, &vm, &pvspin, guest.entry, &mut plan)?;
    prepare_aps(config, &vcpus, virtio.is_some())?;
    let tsc_khz = vcpus
        .first()
        .and_then(|(vcpu, _)| vcpu.get_tsc_khz().ok())
        .map_or(0, u64::from);
    write_boot_data(config, &guest.memory, tsc_khz, virtio.is_some())?;

    let console = ConsoleSink::new(config.echo_console);
    let bus = Arc::new(
        IoBus::new(console.clone())
            .with_virtio(virtio.clone())
            .with_pvh(config.boot == BootMode::Pvh),
    );
    let control = Arc::new(RunControl::new()?);
    let mut events = event_loop(&control, virtio.as_ref())?;
    attach_watchdog(&mut events, config, &control, &guest.memory, &shared)?;
    attach_console_input(&mut events, &bus);

    let hogs = Hogs::start(config.hogs, filters)?;
    let stopping = Arc::new(AtomicBool::new(false));
    let threads = start_vcpu_threads(config, filters, vcpus, &shared, &bus, &control, &stopping);
    // The run, and the watchdog's clock, start when the vCPUs do, all together.
    let started = control.start.open(control.ending().is_none());
    // Setup is over: from here on this thread only runs the event loop, stops and joins the
    // threads, and reports.
    confine_vmm_thread(filters, &control);
    run_to_end(&mut events, &control);
    let wall = started.elapsed();
    let vcpu_fds = stop_vcpus(&stopping, &pvspin, &shared, threads);
    hogs.stop();
    let (findings, reports) = collect_findings(config, pvspin, &guest.memory, &shared);
    drop(vcpu_fds);

    check_ending(config, control.ending(), &reports, &console)?;
    let params = memory::read_boot_params(&guest.memory).unwrap_or_default();
    let mut report = RunReport::new(
        config,
        &params,
        tsc_khz,
        wall,
        reports,
        console.captured(),
        &bus,
    );
    report.plan = plan;
    report.kick_to_wake =
        crate::report::LatencySummary::from_guest(&guest.memory, &params, tsc_khz);
    report.vhost_user = virtio.as_ref().map(|device| device.summary());
    findings.add_to(&mut report);
    Ok(report)
}

/// Opens `/dev/kvm`, checks the configuration against KVM's vCPU limit and installs the
/// signal that takes a vCPU thread out of `KVM_RUN`.
fn open_kvm(config: &RunConfig) -> Result<(Kvm, Arc<pvspin::SignalInterrupter>), RunError> {
    let kvm = Kvm::new().map_err(setup_err("opening /dev/kvm"))?;
    let kvm_max_vcpus = u32::try_from(kvm.get_max_vcpus()).unwrap_or(u32::MAX);
    config.validate(kvm_max_vcpus)?;
    let signal = pvspin::SignalInterrupter::new(config.vcpus as usize)
        .map_err(|err| RunError::Setup(format!("installing the vCPU interrupt signal: {err}")))?;
    Ok((kvm, signal))
}

/// Where the vCPUs start.
#[derive(Clone, Copy, Debug)]
enum BootEntry {
    /// The direct boot: every vCPU at the ELF entry, in long mode.
    Direct(u64),
    /// PVH: the boot vCPU at the image's PVH entry; the APs wait for the guest's SIPIs.
    Pvh(u64),
}

/// Guest memory with the guest program loaded.
struct LoadedGuest {
    memory: VmMemory,
    entry: BootEntry,
}

/// Owns guest memory: creates it (shared with the vhost-user backend when there is one),
/// writes the direct boot's page tables and loads the guest program.
fn load_guest(config: &RunConfig) -> Result<LoadedGuest, RunError> {
    let memory = if config.vhost_user.is_some() {
        memory::create_shared(config.mem_bytes())?
    } else {
        memory::create(config.mem_bytes())?
    };
    let pvh = config.boot == BootMode::Pvh;
    if !pvh {
        memory::write_tables(&memory)?;
    }
    let image = memory::load(&memory, GUEST_IMAGE)?;
    let entry = match (pvh, image.pvh_entry) {
        (false, _) => BootEntry::Direct(image.entry),
        (true, Some(entry)) => BootEntry::Pvh(entry),
        (true, None) => {
            return Err(RunError::Setup(
                "the guest image has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)".into(),
            ))
        }
    };
    Ok(LoadedGuest { memory, entry })
}

/// Owns pvspin's configuration: builds pvspin for this VM, with the in-process kick device
/// (and what rides on it) when the guest kicks and no vhost-user backend serves it.
fn build_pvspin(
    config: &RunConfig,
    memory: &VmMemory,
    shared: &[Arc<VcpuShared>],
    filters: Option<&Filters>,
) -> Result<PvSpin, RunError> {
    let mut builder = PvSpin::builder()
        .vcpus(config.vcpus as usize)
        .interrupter(Arc::new(VcpuKicker::new(shared.to_vec())));
    if let Some(filters) = filters {
        builder = builder.helper_thread_filter(filters.program(VmmThread::BoostWatchdog));
    }
    if let Some(placement) = config.placement {
        let mut request = pvspin::PlanRequest::new(placement, config.vcpus);
        request.guest_kernel = config.guest_kernel;
        request.host_cpus = std::thread::available_parallelism()
            .ok()
            .and_then(|n| u32::try_from(n.get()).ok());
        builder = builder.paravirt(request);
    }
    // With a vhost-user backend pvspin's in-process kick device stays off: the guest kicks
    // through the virtio device, and this VMM only wires its queues (crate::vhost). A stock
    // guest (`--guest stock`) gets the same host as a pvspin-aware one: it just uses none of
    // the hint pages or budgets offered.
    let built = if config.pv.kicks() && config.vhost_user.is_none() {
        with_kick_device(builder, config, memory).build()
    } else {
        builder.build()
    };
    built.map_err(|err| RunError::Refused(err.to_string()))
}

/// pvspin's in-process kick device and what rides on it: hint pages and WAIT always,
/// directed yield with `--pv kick-yield`, run slots with `--sched slots`.
fn with_kick_device(
    builder: pvspin::PvSpinBuilder,
    config: &RunConfig,
    memory: &VmMemory,
) -> pvspin::PvSpinBuilder<pvspin::WithKick> {
    let mut kicked = builder
        .kick(pvspin::KickOptions {
            park_spin: Duration::from_micros(config.park_spin_us),
            ..pvspin::KickOptions::new(config.kick_path)
        })
        .hint_pages(pvspin::HintOptions {
            memory: Arc::new(memory.clone()),
            budgets: config.budget_config(),
        })
        .pv_wait(pvspin::WaitOptions::default())
        // Before any thread is confined: the entitlement reads /proc and the cgroup tree.
        .vm_cpus(config.vm_cpus.unwrap_or_else(pvspin::entitled_cpus));
    if config.pv == PvMode::KickYield {
        let mut options = pvspin::DirectedYieldOptions {
            actuator: config.actuator,
            confinement: config.confinement.clone(),
            ..pvspin::DirectedYieldOptions::default()
        };
        if let Some(us) = config.boost_deadline_us {
            options.boost_deadline = Duration::from_micros(us);
        }
        // Steal-time bytes are read through the hint pages' memory: one memory for pvspin.
        kicked = kicked.directed_yield(options);
    }
    // `RunConfig::validate` refuses slots without pvspin's in-process kick device.
    if config.run_slots.is_some() {
        kicked = kicked.run_slots(slot_config(config));
    }
    kicked
}

/// The run slots `--sched slots` asks for.
fn slot_config(config: &RunConfig) -> pvspin::SlotConfig {
    // Before any thread is confined: the entitlement reads /proc and the cgroup tree.
    let mut slots = pvspin::SlotConfig::new(config_slots(config));
    if let Some(us) = config.slot_quantum_us {
        slots.quantum = Duration::from_micros(us);
        slots.cs_extension = slots.cs_extension.min(slots.quantum);
    }
    if let Some(us) = config.halt_watch_us {
        slots.halt_watch_interval = Duration::from_micros(us);
    }
    slots
}

/// Owns the VM-wide setup, done before any vCPU exists: pvspin's part (its placement plan,
/// its kick path's irqchip), the PVH boot's irqchip, where the guest's steal-time areas are,
/// KVM's halt polling. Returns the plan's lines for the report.
fn configure_vm(
    config: &RunConfig,
    kvm: &Kvm,
    vm: &VmFd,
    pvspin: &PvSpin,
) -> Result<Vec<String>, RunError> {
    let vm_setup = pvspin::simple::setup_vm(pvspin, kvm, vm).map_err(pvspin_error)?;
    // PVH: the guest starts its APs with INIT-SIPI-SIPI through KVM's in-kernel LAPIC, which
    // the in-kernel and signal-msi kick paths (pvspin) and the vhost-user device create anyway.
    let irqchip_made_elsewhere = (config.pv.kicks()
        && config.vhost_user.is_none()
        && config.kick_path != pvspin::KickPath::Userspace)
        || config.vhost_user.is_some();
    if config.boot == BootMode::Pvh && !irqchip_made_elsewhere {
        create_irqchip(vm)?;
    }
    // Where the guest registers its steal-time areas (it does when KVM offers them). With run
    // slots the test VM leaves it to pvspin, which reads MSR_KVM_STEAL_TIME as a VMM that
    // does not know its guest's layout would.
    if config.pv == PvMode::KickYield && config.run_slots.is_none() && config.vhost_user.is_none() {
        for index in 0..config.vcpus {
            pvspin.set_steal_time_gpa(
                index as usize,
                Some(pvspin_test_vm_proto::steal_time_addr(index)),
            );
        }
    }
    if let Some(max_ns) = config.halt_poll_ns {
        let mut cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_HALT_POLL,
            ..Default::default()
        };
        cap.args[0] = u64::from(max_ns);
        vm.enable_cap(&cap)
            .map_err(setup_err("KVM_ENABLE_CAP(HALT_POLL)"))?;
    }
    let mut plan = Vec::new();
    if let Some((placement, applied)) = &vm_setup.plan {
        plan.push(format!("plan: {placement}"));
        plan.push(format!("applied to the VM: {applied}"));
    }
    Ok(plan)
}

/// Creates KVM's in-kernel irqchip (LAPICs, IOAPIC, PIC).
fn create_irqchip(vm: &VmFd) -> Result<(), RunError> {
    pvspin_kvm::irqchip::create_irqchip(vm)
        .map_err(|err| RunError::Setup(format!("creating the in-kernel irqchip: {err}")))
}

/// Maps all of guest memory into the VM as slot 0.
///
/// # Safety
///
/// `memory` must stay mapped for as long as `vm` exists: the caller drops `vm` first.
unsafe fn register_memory(vm: &VmFd, memory: &VmMemory, bytes: u64) -> Result<(), RunError> {
    let host_addr = vm_memory::GuestMemoryBackend::get_host_address(memory, GuestAddress(0))
        .map_err(|err| RunError::Setup(format!("guest memory has no host mapping: {err}")))?
        as u64;
    let mem_region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: bytes,
        userspace_addr: host_addr,
        flags: 0,
    };
    // SAFETY: the region is `memory`'s mmap of `bytes` bytes, which the caller keeps mapped
    // for as long as the VM exists (this function's contract).
    unsafe { vm.set_user_memory_region(mem_region) }
        .map_err(setup_err("KVM_SET_USER_MEMORY_REGION"))
}

/// Owns the vhost-user device (`--vhost-user PATH`): an in-kernel irqchip (its kick queues
/// are irqfds routed to REMRD MSIs), then the link to the backend and the wiring.
fn attach_vhost_user(
    config: &RunConfig,
    vm: &VmFd,
    memory: &VmMemory,
) -> Result<Option<Arc<VhostPvspin>>, RunError> {
    let Some(path) = &config.vhost_user else {
        return Ok(None);
    };
    create_irqchip(vm)?;
    VhostPvspin::connect(
        path,
        pvspin_test_vm_proto::VIRTIO_MMIO_ADDR,
        config.vcpus,
        memory.clone(),
        vm,
        config.vhost_direct_kicks,
    )
    .map(Some)
    .map_err(|err| RunError::Setup(err.to_string()))
}

/// Owns vCPU creation: each vCPU with pvspin's part (CPUID, MSRs, its exit hooks) and its
/// boot registers. Adds what pvspin applied to vCPU 0 to `plan`.
fn create_vcpus(
    config: &RunConfig,
    kvm: &Kvm,
    vm: &VmFd,
    pvspin: &PvSpin,
    entry: BootEntry,
    plan: &mut Vec<String>,
) -> Result<Vec<(VcpuFd, pvspin::VcpuHooks)>, RunError> {
    let supported_cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(setup_err("KVM_GET_SUPPORTED_CPUID"))?;
    let mut vcpus = Vec::new();
    for index in 0..config.vcpus {
        let mut vcpu = vm
            .create_vcpu(u64::from(index))
            .map_err(setup_err("KVM_CREATE_VCPU"))?;
        let mut cpuid = supported_cpuid.clone();
        let (hooks, applied) =
            pvspin::simple::configure_vcpu(pvspin, index as usize, &mut vcpu, &mut cpuid)
                .map_err(pvspin_error)?;
        if let (Some(applied), 0) = (applied, index) {
            plan.push(format!(
                "applied to vCPU 0 (and likewise the others): {applied}"
            ));
        }
        set_boot_registers(&vcpu, index, entry)?;
        vcpus.push((vcpu, hooks));
    }
    Ok(vcpus)
}

/// Sets vCPU `index`'s registers for the boot: every vCPU at the direct boot's entry, or
/// only the boot vCPU at the PVH entry (the APs stay in KVM's wait-for-SIPI).
fn set_boot_registers(vcpu: &VcpuFd, index: u32, entry: BootEntry) -> Result<(), RunError> {
    let sregs = vcpu.get_sregs().map_err(setup_err("KVM_GET_SREGS"))?;
    let (sregs, regs) = match entry {
        BootEntry::Pvh(_) if index != 0 => return Ok(()),
        BootEntry::Pvh(entry) => (
            crate::pvh::entry_sregs(sregs),
            crate::pvh::entry_regs(entry),
        ),
        BootEntry::Direct(entry) => (
            memory::initial_sregs(sregs, index),
            memory::initial_regs(index, entry),
        ),
    };
    vcpu.set_sregs(&sregs).map_err(setup_err("KVM_SET_SREGS"))?;
    vcpu.set_regs(&regs).map_err(setup_err("KVM_SET_REGS"))
}

/// Readies the APs once every vCPU exists: the LAPIC refresh that lets MSIs and SIPIs find
/// their vCPUs, then, in the direct boot, every AP started at once (under PVH the guest
/// starts them).
fn prepare_aps(
    config: &RunConfig,
    vcpus: &[(VcpuFd, pvspin::VcpuHooks)],
    has_virtio: bool,
) -> Result<(), RunError> {
    let pvh = config.boot == BootMode::Pvh;
    if let (true, Some((last, _))) = (has_virtio || pvh, vcpus.last()) {
        // KVM maps APIC IDs to vCPUs once all exist; rewriting a LAPIC rebuilds the map, so
        // the kick queues' MSIs and the guest's INIT-SIPI-SIPI find their vCPUs.
        pvspin_kvm::irqchip::refresh_lapic(last)
            .map_err(|err| RunError::Setup(format!("refreshing the LAPIC: {err}")))?;
    }
    if !pvh {
        pvspin::simple::start_aps(vcpus.iter().map(|(vcpu, _)| vcpu)).map_err(pvspin_error)?;
    }
    Ok(())
}

/// Owns what the guest reads at boot: under PVH the start info, its command line and the
/// firmware tables (the guest takes its workload from the command line); in the direct boot
/// the boot parameters and the vCPUs' progress slots.
fn write_boot_data(
    config: &RunConfig,
    memory: &VmMemory,
    tsc_khz: u64,
    has_virtio: bool,
) -> Result<(), RunError> {
    if config.boot == BootMode::Pvh {
        let cmdline = config
            .pvh_cmdline
            .clone()
            .unwrap_or_else(|| crate::pvh::guest_cmdline(config, tsc_khz));
        crate::pvh::write_boot_data(memory, config.mem_bytes(), &cmdline, config.vcpus)
            .map_err(|err| RunError::Setup(err.to_string()))
    } else {
        let mut params = boot_params(config, tsc_khz);
        if has_virtio {
            params.virtio_mmio_base = pvspin_test_vm_proto::VIRTIO_MMIO_ADDR;
        }
        Ok(memory::write_boot_params(memory, &params, config.vcpus)?)
    }
}

/// The run's event loop.
type EventLoop = EventManager<Box<dyn MutEventSubscriber + Send>>;

/// Creates the run's event loop, watching the end of the run and, with a vhost-user device,
/// its backend.
fn event_loop(
    control: &Arc<RunControl>,
    virtio: Option<&Arc<VhostPvspin>>,
) -> Result<EventLoop, RunError> {
    let mut events: EventLoop =
        EventManager::new().map_err(|err| RunError::Setup(format!("event manager: {err:?}")))?;
    if let Some(device) = virtio {
        let watch = crate::vhost::BackendWatch::new(device.clone())
            .map_err(|err| RunError::Setup(format!("timerfd: {err}")))?;
        events.add_subscriber(Box::new(watch));
    }
    events.add_subscriber(Box::new(EndWatcher {
        control: control.clone(),
    }));
    Ok(events)
}

/// Attaches the watchdog, which ends the run when a vCPU stalls or the run outlasts its
/// bound, counting from when the vCPUs start.
fn attach_watchdog(
    events: &mut EventLoop,
    config: &RunConfig,
    control: &Arc<RunControl>,
    memory: &VmMemory,
    shared: &[Arc<VcpuShared>],
) -> Result<(), RunError> {
    events.add_subscriber(Box::new(Watchdog {
        timer: TimerFd::new().map_err(|err| RunError::Setup(format!("timerfd: {err}")))?,
        control: control.clone(),
        memory: memory.clone(),
        vcpus: shared.to_vec(),
        last_progress: Vec::new(),
        limit: Duration::from_millis(config.watchdog_ms),
        timeout: Duration::from_millis(config.timeout_ms),
    }));
    Ok(())
}

/// Attaches the console's input (stdin to the guest's UART), when stdin is a terminal.
fn attach_console_input(events: &mut EventLoop, bus: &Arc<IoBus>) {
    // SAFETY: isatty only inspects the descriptor.
    if unsafe { libc::isatty(libc::STDIN_FILENO) } == 1 {
        events.add_subscriber(Box::new(ConsoleInput { bus: bus.clone() }));
    }
}

/// Holds every vCPU thread until all of them exist, then lets them go together.
///
/// Started one by one, the first vCPUs ran (and spun in the guest's start barrier) while this
/// thread was still creating the rest; it got a shrinking share of the host's CPUs, creating
/// 200 vCPU threads on 2 CPUs took 14 s, and the watchdog (which this thread runs) first
/// looked after that, finding the last vCPUs "silent" since before their threads existed
/// (issue 19). Cloud Hypervisor starts its vCPU threads behind a barrier too.
#[derive(Debug, Default)]
struct StartGate {
    state: Mutex<GateState>,
    changed: std::sync::Condvar,
}

#[derive(Clone, Copy, Debug, Default)]
enum GateState {
    /// The vCPU threads wait.
    #[default]
    Closed,
    /// The vCPUs run, since this instant.
    Open(Instant),
    /// The run ended before it started: the threads end without running their vCPUs.
    Cancelled,
}

impl StartGate {
    /// Opens the gate, letting the vCPUs run when `run`, or ending their threads; returns when
    /// it opened.
    fn open(&self, run: bool) -> Instant {
        let now = Instant::now();
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = if run {
            GateState::Open(now)
        } else {
            GateState::Cancelled
        };
        self.changed.notify_all();
        now
    }

    /// When the vCPUs started, if they did.
    fn opened_at(&self) -> Option<Instant> {
        match *self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            GateState::Open(at) => Some(at),
            GateState::Closed | GateState::Cancelled => None,
        }
    }

    /// Waits until the gate opens; whether the vCPU may run.
    fn wait(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = self
            .changed
            .wait_while(state, |state| matches!(state, GateState::Closed))
            .unwrap_or_else(PoisonError::into_inner);
        matches!(*state, GateState::Open(_))
    }
}

/// A vCPU thread; it hands its vCPU back when it ends (`None` if it never ran).
type VcpuThreadHandle = JoinHandle<Option<VcpuFd>>;

/// Owns the vCPU threads: starts one per vCPU, each confined by its seccomp filter before it
/// runs. A thread that cannot start ends the run as its vCPU's fault, and no further thread
/// is started.
fn start_vcpu_threads(
    config: &RunConfig,
    filters: Option<&Filters>,
    vcpus: Vec<(VcpuFd, pvspin::VcpuHooks)>,
    shared: &[Arc<VcpuShared>],
    bus: &Arc<IoBus>,
    control: &Arc<RunControl>,
    stopping: &Arc<AtomicBool>,
) -> Vec<VcpuThreadHandle> {
    let mut threads = Vec::new();
    for ((vcpu, hooks), shared) in vcpus.into_iter().zip(shared) {
        let runner = VcpuRunner {
            vcpu,
            hooks,
            shared: shared.clone(),
            bus: bus.clone(),
            stopping: stopping.clone(),
        };
        let filter = filters.map(|f| (f.program(VmmThread::Vcpu), VmmThread::Vcpu));
        let violation = config.seccomp_violation && shared.index == 0;
        match spawn_vcpu_thread(runner, filter, violation, control.clone()) {
            Ok(thread) => threads.push(thread),
            Err(err) => {
                control.end(Ending::Fault {
                    vcpu: shared.index,
                    reason: format!("its thread: {err}"),
                });
                break;
            }
        }
    }
    threads
}

/// Starts the thread of `runner`'s vCPU, which ends the run when its guest exits or faults;
/// with `violation` it makes a forbidden system call first (`--seccomp-violation`).
fn spawn_vcpu_thread(
    runner: VcpuRunner,
    filter: Option<(Arc<seccompiler::BpfProgram>, VmmThread)>,
    violation: bool,
    control: Arc<RunControl>,
) -> Result<VcpuThreadHandle, SpawnError> {
    spawn_confined(format!("vcpu{}", runner.shared.index), filter, move || {
        if violation {
            crate::seccomp::violate();
        }
        if !control.start.wait() {
            return runner.vcpu;
        }
        runner.run(|vcpu, end| match end {
            VcpuEnd::GuestExit(status) => control.end(Ending::GuestExit(*status)),
            VcpuEnd::Fault(reason) => control.end(Ending::Fault {
                vcpu,
                reason: reason.clone(),
            }),
            VcpuEnd::Stopped => {}
        })
    })
}

/// Confines this thread with its own filter now that setup is over; a failure ends the run.
fn confine_vmm_thread(filters: Option<&Filters>, control: &RunControl) {
    if let Some(filters) = filters {
        if let Err(err) = filters.apply(VmmThread::Vmm) {
            control.end(Ending::Fault {
                vcpu: 0,
                reason: err.to_string(),
            });
        }
    }
}

/// Runs the event loop until a vCPU, the watchdog or a failure of the loop ends the run.
fn run_to_end(events: &mut EventLoop, control: &RunControl) {
    while control.ending().is_none() {
        if let Err(err) = events.run_with_timeout(200) {
            log::error!("event loop: {err:?}");
            control.end(Ending::Fault {
                vcpu: 0,
                reason: format!("the VMM's event loop failed: {err:?}"),
            });
        }
    }
}

/// Stops every vCPU (each leaves KVM_RUN or its halt) and pvspin's threads, then joins the
/// vCPU threads; returns the vCPUs. Kicks happen only before the joins, so every kicked
/// thread still exists.
fn stop_vcpus(
    stopping: &AtomicBool,
    pvspin: &PvSpin,
    shared: &[Arc<VcpuShared>],
    threads: Vec<VcpuThreadHandle>,
) -> Vec<VcpuFd> {
    stopping.store(true, Ordering::Release);
    pvspin.shutdown();
    for vcpu in shared {
        vcpu.kick();
    }
    let mut vcpu_fds = Vec::new();
    for thread in threads {
        match thread.join() {
            Ok(vcpu) => vcpu_fds.extend(vcpu),
            Err(_) => log::error!("a vCPU thread panicked"),
        }
    }
    vcpu_fds
}

/// What pvspin and guest memory tell after the run, for the report.
struct Findings {
    telemetry: pvspin::VmTelemetry,
    actuator: Option<String>,
    steal_time_registered: Option<u32>,
}

impl Findings {
    /// Fills `report`'s pvspin fields.
    fn add_to(self, report: &mut RunReport) {
        let telemetry = self.telemetry;
        report.steal_time_registered = self.steal_time_registered;
        report.host_kicks_in_userspace = telemetry.kick.map(|kick| kick.stats.kicks);
        report.kvm_halt_wakeups = telemetry
            .vcpus
            .iter()
            .map(|v| v.pvspin.kicks.and_then(|k| k.kvm_halt_wakeups))
            .sum();
        report.directed_yield = telemetry
            .directed_yield
            .map(|stats| crate::report::YieldSummary {
                actuator: self.actuator.unwrap_or_default(),
                notifications: stats.notifications,
                yield_to_hint: stats.yield_to_hint,
                yield_to_candidate: stats.yield_to_candidate,
                yield_self: stats.yield_self,
                boosted: stats.boosted,
                descheduled: stats.descheduled,
            });
        report.run_slots = telemetry.run_slots;
        report.telemetry = Some(telemetry);
    }
}

/// Owns the end of pvspin, once the vCPU threads are joined: reads its telemetry and every
/// vCPU's report, prints the problems pvspin found with how this VMM adopted it
/// (`PvSpin::check`) and logs directed yield's work; then drops pvspin.
fn collect_findings(
    config: &RunConfig,
    pvspin: PvSpin,
    memory: &VmMemory,
    shared: &[Arc<VcpuShared>],
) -> (Findings, Vec<VcpuReport>) {
    let telemetry = pvspin.telemetry();
    for problem in &telemetry.problems {
        eprintln!("pvspin-vmm: pvspin found a problem: {problem}");
    }
    let actuator = pvspin.actuator_name().map(str::to_string);
    if let Some(stats) = &telemetry.directed_yield {
        for index in 0..config.vcpus {
            let gpa = GuestAddress(pvspin_test_vm_proto::steal_time_addr(index));
            let steal: u64 = vm_memory::Bytes::read_obj(memory, gpa).unwrap_or(0);
            let version: u32 =
                vm_memory::Bytes::read_obj(memory, GuestAddress(gpa.0 + 8)).unwrap_or(0);
            log::debug!("vCPU {index} steal time: {steal} ns (version {version})");
        }
        log::info!(
            "directed yield ({} actuator): {stats:?}",
            actuator.as_deref().unwrap_or("-")
        );
    }
    let reports: Vec<VcpuReport> = shared
        .iter()
        .map(|vcpu| {
            let counters = telemetry.vcpus.get(vcpu.index as usize).map(|t| &t.pvspin);
            VcpuReport::collect(vcpu, memory, counters)
        })
        .collect();
    // pvspin's threads end here, before the caller closes the vCPUs.
    drop(pvspin);
    let findings = Findings {
        telemetry,
        actuator,
        steal_time_registered: steal_time_registered(config, memory),
    };
    (findings, reports)
}

/// How many vCPUs of a stock guest registered their steal-time areas (`None` for the
/// test guest). KVM bumps an area's version at each update, so a non-zero version says
/// KVM kept it (and its `preempted` byte) current.
fn steal_time_registered(config: &RunConfig, memory: &VmMemory) -> Option<u32> {
    (config.guest == crate::config::GuestKind::Stock).then(|| {
        (0..config.vcpus)
            .filter(|&index| {
                let gpa = GuestAddress(pvspin_test_vm_proto::steal_time_addr(index) + 8);
                vm_memory::Bytes::read_obj::<u32>(memory, gpa).is_ok_and(|version| version != 0)
            })
            .count() as u32
    })
}

/// The error for how the run ended (a timeout when nothing recorded an ending); `Ok` when
/// the guest exited with its OK status.
fn check_ending(
    config: &RunConfig,
    ending: Option<Ending>,
    reports: &[VcpuReport],
    console: &ConsoleSink,
) -> Result<(), RunError> {
    let states = VcpuStates(reports.to_vec());
    Err(match ending.unwrap_or(Ending::Timeout) {
        Ending::GuestExit(pvspin_test_vm_proto::status::OK) => return Ok(()),
        Ending::GuestExit(status) => RunError::GuestStatus {
            status,
            meaning: status_meaning(status),
            states,
            console_tail: if config.echo_console {
                String::new()
            } else {
                console_tail(&console.captured(), 4)
            },
        },
        Ending::Fault { vcpu, reason } => RunError::GuestFault {
            vcpu,
            reason,
            states,
        },
        Ending::Watchdog { vcpu, silent_ms } => RunError::Watchdog {
            vcpu,
            silent_ms,
            limit_ms: config.watchdog_ms,
            states,
        },
        Ending::Timeout => RunError::Timeout {
            limit_ms: config.timeout_ms,
            states,
        },
    })
}

/// The slot count `--sched slots --slots N` means (0: the CPUs this process may use).
fn config_slots(config: &RunConfig) -> usize {
    match config.run_slots {
        Some(0) => pvspin::entitled_cpus().min(config.vcpus as usize),
        Some(n) => n as usize,
        None => 0,
    }
}

/// Sorts pvspin's setup errors: refusals of the configuration (exit code 2) from failures.
#[allow(clippy::needless_pass_by_value)] // a `map_err` adapter: it receives the error by value
fn pvspin_error(err: pvspin::Error) -> RunError {
    match err {
        pvspin::Error::Config(_)
        | pvspin::Error::Plan(pvspin::PlanError::Kvm { .. } | pvspin::PlanError::Quirk(_)) => {
            RunError::Setup(format!("pvspin: {err}"))
        }
        pvspin::Error::Plan(_) => RunError::Refused(err.to_string()),
        _ => RunError::Setup(format!("pvspin: {err}")),
    }
}

/// The last `lines` lines of the guest's console, after a newline, for error messages.
fn console_tail(console: &str, lines: usize) -> String {
    let all: Vec<&str> = console.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    tail.iter()
        .map(|line| format!("\n  guest: {line}"))
        .collect()
}

fn status_meaning(status: u32) -> &'static str {
    pvspin_test_vm_proto::status::meaning(status)
}

/// Names for the CLI and reports.
pub fn workload_name(workload: Workload) -> &'static str {
    match workload {
        Workload::Hello => "hello",
        Workload::Lock => "lock",
        Workload::Spin => "spin",
        Workload::Fault => "fault",
        Workload::Hypercall => "hypercall",
        Workload::Cpuid => "cpuid",
        Workload::PingPong => "pingpong",
        Workload::Burn => "burn",
        Workload::Abuse => "abuse",
    }
}

/// Names for the CLI and reports.
pub fn lock_name(lock: LockKind) -> &'static str {
    match lock {
        LockKind::Ticket => "ticket",
        LockKind::Tas => "tas",
        LockKind::Queued => "queued",
        LockKind::Backoff => "backoff",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts `count` threads that wait at `gate` and report whether they may run.
    fn waiters(gate: &Arc<StartGate>, count: usize) -> Vec<JoinHandle<bool>> {
        (0..count)
            .map(|_| {
                let gate = gate.clone();
                std::thread::spawn(move || gate.wait())
            })
            .collect()
    }

    #[test]
    fn the_start_gate_holds_every_thread_until_it_opens() {
        let gate = Arc::new(StartGate::default());
        let threads = waiters(&gate, 8);
        std::thread::sleep(Duration::from_millis(20));
        assert!(threads.iter().all(|t| !t.is_finished()));
        assert!(
            gate.opened_at().is_none(),
            "closed: the watchdog's clock has not started"
        );
        let opened = gate.open(true);
        assert_eq!(gate.opened_at(), Some(opened));
        assert!(threads.into_iter().all(|t| t.join().unwrap()));
        // A thread that comes late finds it open.
        assert!(gate.wait());
    }

    #[test]
    fn a_cancelled_start_ends_the_threads_without_running_their_vcpus() {
        let gate = Arc::new(StartGate::default());
        let threads = waiters(&gate, 4);
        gate.open(false);
        assert!(threads.into_iter().all(|t| !t.join().unwrap()));
        assert!(gate.opened_at().is_none());
        assert!(!gate.wait());
    }
}
