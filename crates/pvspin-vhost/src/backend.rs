//! The vhost-user backend of the pvspin virtio device: kicks, spin notifications, the
//! control queue and the configuration space, for one frontend; the time budgets it adapts
//! and publishes in the hint pages, and the scheduler sampler that sets `NOT_RUNNING` there.
//!
//! **Budgets** are pvspin's own (`pvspin_hints::PageBudgets`, the code the in-process host
//! runs): a vCPU's wait report (`LAST_WAIT_TSC`) is taken when the daemon delivers a kick to
//! that vCPU (the report of its previous wait: each wait normally ends with a kick, so each
//! report is seen), when the vCPU sends a spin notification, and at every scheduler sample;
//! a spin notification is useful when the vCPU it waits for was, at the last sample, runnable
//! but descheduled. Spin notifications are on (published window finite) unless the yield
//! mode is `off`, as in process, where they are on only with directed yield.
//!
//! **NOT_RUNNING** ([`PvspinBackend::sample_once`], `crate::sched`): each sample reads every
//! registered vCPU's thread in `/proc` and sets the flag exactly for the threads that are
//! runnable but have been off their CPU for at least a whole sample period (a descheduled
//! holder, which its waiters should not spin on; not one preempted for microseconds by the
//! sampler or the daemon's worker themselves). A blocked thread (halted in KVM) does not get
//! it: its page already says it waits. A vCPU that sends a spin notification is running, so
//! that clears its flag at once. The flag is a sample, one to two periods late (the ABI's
//! "set before the host stops running the vCPU" holds only in process); every flag the daemon
//! set is cleared when it forgets the page. Where the VM's vCPUs fit its CPUs
//! ([`BackendConfig::vcpus_fit`]) no vCPU is flagged: a descheduled one was preempted by
//! another tenant, so waiting early behind it only turns hand-overs into wake-ups (as in
//! process, where only vCPUs the VMM parks are flagged).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pvspin_abi::doorbell::{SpinNotify, SHARED_PAGE_SIZE};
use pvspin_abi::hint;
use pvspin_abi::virtio::{self, ControlRequest, QueueRole};
use pvspin_hints::sched as thread_sched;
use pvspin_hints::{HintPage, HintPages, PageBudgets};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserVirtioFeatures;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap,
};

use crate::config::{BackendConfig, WorkerPriority, YieldMode};
use crate::sched::{ProcSched, Reads, RunState, SchedSource, ThreadWatch};
use crate::telemetry::{BadInput, DaemonVmTelemetry};
use crate::yield_policy::{ProcThreads, ThreadActions, YieldPolicy};

/// The guest memory type the backend works on.
pub type BackendMemory = GuestMemoryAtomic<GuestMemoryMmap<()>>;
/// The vring type the backend works on.
pub type Vring = VringRwLock<BackendMemory>;

/// Largest queue the backend accepts (control queue; kick and spin queues need 1).
pub const MAX_QUEUE_SIZE: usize = 256;
/// Most descriptors of one control chain the backend walks (a valid one has 2).
const MAX_CHAIN_DESCRIPTORS: usize = 4;

/// The virtio feature bits the device offers.
pub const DEVICE_FEATURES: u64 = (1 << virtio::F_VERSION_1)
    | (1 << virtio::F_SPIN_NOTIFY)
    | (1 << virtio::F_HINT_PAGES)
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// Errors of the backend.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum BackendError {
    /// invalid configuration: {0}
    Config(#[from] crate::config::DaemonConfigError),
}

/// The thread actions a backend uses (boxed so tests and the fuzz target can fake them).
pub type BoxedActions = Box<dyn ThreadActions>;
/// Where the scheduler sampler reads the vCPU threads (boxed so tests can fake `/proc`).
pub type BoxedSched = Box<dyn SchedSource>;

#[derive(Debug)]
struct DeviceState {
    acked_features: u64,
    memory: Option<BackendMemory>,
}

/// The hint pages: mapped over the current guest memory, the address and TSC frequency each
/// vCPU registered with. Every host write to a page happens under this lock, so no write
/// lands in a page after its unregistration returned.
#[derive(Debug)]
struct Hints {
    pages: Option<HintPages>,
    gpas: Vec<Option<u64>>,
    tsc_khz: Vec<u32>,
}

impl Hints {
    fn page(&self, v: usize) -> Option<HintPage> {
        self.pages.as_ref()?.get(v)
    }

    fn khz(&self, v: usize) -> u32 {
        self.tsc_khz.get(v).copied().unwrap_or(0)
    }

    /// Forgets `v`'s page, first clearing a `NOT_RUNNING` this host set there.
    fn unregister(&mut self, v: usize) {
        if let Some(page) = self.page(v) {
            if page.not_running() {
                page.set_not_running(false);
            }
        }
        if let Some(pages) = &self.pages {
            let _ = pages.register_gpa(v, 0);
        }
        if let Some(gpa) = self.gpas.get_mut(v) {
            *gpa = None;
        }
    }
}

/// The scheduler sampler's memory (one pass at a time).
struct Sampler {
    source: BoxedSched,
    /// Per vCPU: the watched thread and its history.
    threads: Vec<(Option<u32>, ThreadWatch)>,
    rescanned_at: Option<Instant>,
    /// `Inner::activity` at the last pass, and when it last moved.
    activity: u64,
    active_at: Instant,
}

/// How often the vCPU threads may be looked up by name while a registered vCPU has none.
const THREAD_RESCAN_EVERY: Duration = Duration::from_millis(100);
/// A VM without a queue notification for this long is sampled 20 times less often.
const SAMPLER_IDLE_AFTER: Duration = Duration::from_millis(100);
const SAMPLER_IDLE_FACTOR: u32 = 20;

/// How long the sampler sleeps after a pass of period `period`, and whether a notification
/// should wake it earlier: 20 times `period` while the VM is `idle` (woken by its next
/// notification), and always where no pass can flag a vCPU (`sample_once`: flags off, or the
/// VM's vCPUs fit its CPUs): passes there only take wait reports and tell whether
/// notifications are useful, and each one takes a CPU from the VM's vCPUs (measured with
/// 1-ms passes: 1.2-1.5x slower at 2x host overcommit), so notifications do not wake it either.
fn sampler_pause(config: &BackendConfig, period: Duration, idle: bool) -> (Duration, bool) {
    let flags = flags_not_running(config);
    if idle || !flags {
        (period * SAMPLER_IDLE_FACTOR, idle && flags)
    } else {
        (period, false)
    }
}

/// Whether sampler passes set `NOT_RUNNING` for descheduled vCPUs: only when asked, and never
/// where the VM's vCPUs fit its CPUs. There a descheduled vCPU was preempted by another tenant,
/// not by its own VM's spinners: a waiter that waited early would give its CPU to that tenant
/// and make the next hand-over a wake-up. The in-process host does not flag such vCPUs either.
fn flags_not_running(config: &BackendConfig) -> bool {
    config.flag_not_running && !config.vcpus_fit()
}

/// What one sampler pass did (for tests and the fuzz target).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SamplePass {
    /// vCPU threads read.
    pub threads: u32,
    /// Files read.
    pub reads: Reads,
    /// vCPUs whose page got `NOT_RUNNING` in this pass.
    pub set: u32,
    /// vCPUs whose page had it cleared.
    pub cleared: u32,
}

struct Inner {
    config: BackendConfig,
    telemetry: Arc<DaemonVmTelemetry>,
    state: Mutex<DeviceState>,
    hints: Mutex<Hints>,
    /// pvspin's budget adaptation, per vCPU (shared with the telemetry).
    budgets: Arc<PageBudgets>,
    /// Each vCPU thread as last sampled (`RunState` as u8).
    run_state: Box<[AtomicU8]>,
    /// Each vCPU thread descheduled for at least a whole sample period: what `NOT_RUNNING`
    /// says, and what makes a spin notification about it useful.
    descheduled: Box<[AtomicBool]>,
    /// The frontend's pid, 0 when unknown.
    peer: AtomicU32,
    /// Queue notifications handled: the sampler's idle detection.
    activity: AtomicU64,
    /// The sampler sleeps long (idle VM): a notification wakes it.
    sampler_idle: AtomicBool,
    sampler_thread: Mutex<Option<std::thread::Thread>>,
    sampler: Mutex<Sampler>,
    yields: Mutex<YieldPolicy<BoxedActions>>,
    /// Wakes the restore timer when a new deadline exists or the backend stops.
    timer: Condvar,
    stopping: AtomicBool,
    /// The VM's event rate: the time its handled events have used up.
    pacing: Mutex<Pacing>,
}

/// The event rate as a token bucket (GCRA): `earned` is when the events handled so far would
/// have been paid for at the VM's rate. An event conforms while `earned` is at most
/// [`PACING_BURST`] ahead of now.
#[derive(Debug)]
struct Pacing {
    earned: Instant,
}

/// How far ahead of its rate a VM may run: bursts of 10 ms worth of events (200 at the
/// default rate) are handled at once, so a VM whose average stays below the rate is never
/// paced by its bursts.
const PACING_BURST: Duration = Duration::from_millis(10);
/// What a paced VM's worker sleeps for at least: until 1 ms worth of events may be handled.
const PACING_RESUME: Duration = Duration::from_millis(1);

/// The pvspin device backend for one frontend. Cheap to clone (shared state): the transport's
/// request handler, its queue worker, the restore timer and the sampler each hold one.
#[derive(Clone)]
pub struct PvspinBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PvspinBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PvspinBackend")
            .field("vm", &self.inner.telemetry.vm())
            .field("max_vcpus", &self.inner.config.max_vcpus)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// Whether this worker thread's priority was set (or tried).
    static PRIORITY_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets the calling worker thread's priority once (at its first event). A failure is logged,
/// once.
fn set_worker_priority(priority: WorkerPriority, vm: &str) {
    if priority == WorkerPriority::Inherit || PRIORITY_SET.with(|s| s.replace(true)) {
        return;
    }
    let result = match priority {
        WorkerPriority::Inherit => return,
        WorkerPriority::Nice(nice) => thread_sched::set_nice(thread_sched::current_tid(), nice),
        WorkerPriority::Fifo(p) => thread_sched::set_policy(
            thread_sched::current_tid(),
            thread_sched::SchedPolicy {
                policy: libc::SCHED_FIFO,
                priority: i32::from(p),
            },
        ),
    };
    match result {
        Ok(()) => log::info!("{vm}: queue worker thread at {priority:?}"),
        Err(err) => {
            log::warn!("{vm}: queue worker thread stays at its priority: {priority:?}: {err}");
        }
    }
}

/// The calling thread's CPU time, ns (what the sampler's reads cost, without the time other
/// threads ran meanwhile).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the control queue did in one pass (for tests and the fuzz target).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlPass {
    /// Chains returned to the driver.
    pub chains: usize,
    /// Whether the queue's call eventfd was signalled.
    pub signalled: bool,
}

impl PvspinBackend {
    /// A backend acting on the real threads of the frontend (procfs, setpriority).
    pub fn new(
        config: BackendConfig,
        telemetry: Arc<DaemonVmTelemetry>,
    ) -> Result<Self, BackendError> {
        let actions = Box::new(ProcThreads::new(config.thread_patterns.clone()));
        let sched = Box::new(ProcSched::new(config.thread_patterns.clone()));
        Self::with_actions(config, telemetry, actions, sched)
    }

    /// A backend acting through `actions` and sampling the vCPU threads through `sched`.
    pub fn with_actions(
        config: BackendConfig,
        telemetry: Arc<DaemonVmTelemetry>,
        actions: BoxedActions,
        sched: BoxedSched,
    ) -> Result<Self, BackendError> {
        config.validate()?;
        let policy = YieldPolicy::new(
            config.yield_mode,
            config.nice_step,
            config.adjust_for,
            actions,
        );
        let n = config.max_vcpus as usize;
        let budgets = Arc::new(
            PageBudgets::new(
                n,
                config.budgets.to_config(),
                config.yield_mode != YieldMode::Off,
            )
            .map_err(crate::config::DaemonConfigError::from)?,
        );
        telemetry.set_budgets(budgets.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                state: Mutex::new(DeviceState {
                    acked_features: 0,
                    memory: None,
                }),
                hints: Mutex::new(Hints {
                    pages: None,
                    gpas: vec![None; n],
                    tsc_khz: vec![0; n],
                }),
                budgets,
                run_state: (0..n).map(|_| AtomicU8::new(0)).collect(),
                descheduled: (0..n).map(|_| AtomicBool::new(false)).collect(),
                peer: AtomicU32::new(0),
                activity: AtomicU64::new(0),
                sampler_idle: AtomicBool::new(false),
                sampler_thread: Mutex::new(None),
                sampler: Mutex::new(Sampler {
                    source: sched,
                    threads: vec![(None, ThreadWatch::default()); n],
                    rescanned_at: None,
                    activity: 0,
                    active_at: Instant::now(),
                }),
                config,
                telemetry,
                yields: Mutex::new(policy),
                timer: Condvar::new(),
                stopping: AtomicBool::new(false),
                pacing: Mutex::new(Pacing {
                    earned: Instant::now(),
                }),
            }),
        })
    }

    /// The VM's counters.
    pub fn telemetry(&self) -> &Arc<DaemonVmTelemetry> {
        &self.inner.telemetry
    }

    /// The configuration.
    pub fn config(&self) -> &BackendConfig {
        &self.inner.config
    }

    /// Sets the frontend's pid (from its peer credentials; `None` when unknown).
    pub fn set_peer_pid(&self, pid: Option<u32>) {
        self.inner.telemetry.set_peer_pid(pid);
        self.inner.peer.store(pid.unwrap_or(0), Ordering::Relaxed);
        lock(&self.inner.yields).set_peer(pid);
    }

    /// The hint page registered for `vcpu`, if any.
    pub fn hint_page(&self, vcpu: u32) -> Option<u64> {
        lock(&self.inner.hints)
            .gpas
            .get(vcpu as usize)
            .copied()
            .flatten()
    }

    /// The budgets (ns) the backend adapts and publishes.
    pub fn budgets(&self) -> &PageBudgets {
        &self.inner.budgets
    }

    /// Whether vCPU `vcpu`'s thread has been descheduled (runnable, off its CPU) for at least
    /// a whole sample period: what its page's `NOT_RUNNING` says.
    pub fn descheduled(&self, vcpu: u32) -> bool {
        self.inner
            .descheduled
            .get(vcpu as usize)
            .is_some_and(|d| d.load(Ordering::Relaxed))
    }

    /// vCPU `vcpu`'s thread as last sampled.
    pub fn run_state(&self, vcpu: u32) -> RunState {
        self.inner
            .run_state
            .get(vcpu as usize)
            .map_or(RunState::Unknown, |s| {
                RunState::from_u8(s.load(Ordering::Relaxed))
            })
    }

    /// How many thread priorities the backend has changed now.
    pub fn adjusted_threads(&self) -> usize {
        lock(&self.inner.yields).adjusted()
    }

    /// Forgets hint pages and acked features and restores every changed priority (device
    /// reset, frontend gone).
    pub fn forget(&self) {
        lock(&self.inner.state).acked_features = 0;
        {
            let mut h = lock(&self.inner.hints);
            for v in 0..h.gpas.len() {
                h.unregister(v);
            }
        }
        lock(&self.inner.yields).restore_all(&self.inner.telemetry);
    }

    /// Restores every priority change whose deadline passed; returns how long until the next
    /// one (for the restore timer).
    pub fn expire_adjustments(&self, now: Instant) -> Option<Duration> {
        let mut y = lock(&self.inner.yields);
        y.expire(now, &self.inner.telemetry);
        y.next_deadline().map(|d| d.saturating_duration_since(now))
    }

    /// Runs the restore timer until [`Self::stop`]: sleeps until the next deadline (never
    /// spins), restores what is due. Run it on a thread of its own.
    pub fn run_restore_timer(&self) {
        let mut y = lock(&self.inner.yields);
        while !self.inner.stopping.load(Ordering::Acquire) {
            let now = Instant::now();
            y.expire(now, &self.inner.telemetry);
            let wait = y
                .next_deadline()
                .map(|d| {
                    d.saturating_duration_since(now)
                        .max(Duration::from_micros(100))
                })
                .unwrap_or(Duration::from_secs(1));
            y = self
                .inner
                .timer
                .wait_timeout(y, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        y.restore_all(&self.inner.telemetry);
    }

    /// Stops the restore timer (it restores everything on its way out) and forgets the
    /// device state.
    pub fn stop(&self) {
        self.inner.stopping.store(true, Ordering::Release);
        // `forget` takes the lock the timer waits under, so the timer is either waiting (and
        // woken next) or sees `stopping` before it waits: no lost wake-up.
        self.forget();
        self.inner.timer.notify_all();
        if let Some(t) = lock(&self.inner.sampler_thread).as_ref() {
            t.unpark();
        }
    }

    /// Runs the scheduler sampler until [`Self::stop`]: a pass ([`Self::sample_once`]) every
    /// [`BackendConfig::sched_sample`], 20 times less often while the VM sends no
    /// notification (a notification wakes it) and always where its vCPUs fit its CPUs
    /// ([`BackendConfig::vcpus_fit`]). Sleeps between passes, never spins. Returns at
    /// once when sampling is off. Run it on a thread of its own.
    pub fn run_sched_sampler(&self) {
        let Some(period) = self.inner.config.sched_sample else {
            return;
        };
        *lock(&self.inner.sampler_thread) = Some(std::thread::current());
        while !self.inner.stopping.load(Ordering::Acquire) {
            let now = Instant::now();
            self.sample_once(now);
            let idle = {
                let mut s = lock(&self.inner.sampler);
                let activity = self.inner.activity.load(Ordering::Relaxed);
                if activity != s.activity {
                    s.activity = activity;
                    s.active_at = now;
                }
                now.saturating_duration_since(s.active_at) >= SAMPLER_IDLE_AFTER
            };
            let (pause, wake_on_activity) = sampler_pause(&self.inner.config, period, idle);
            self.inner
                .sampler_idle
                .store(wake_on_activity, Ordering::Relaxed);
            std::thread::park_timeout(pause);
        }
        self.clear_not_running();
    }

    /// One sampler pass: reads every registered vCPU's thread (looking the threads up by name
    /// when one is missing, at most every 100 ms), records where it is, sets `NOT_RUNNING` in
    /// the pages of the descheduled ones and clears it elsewhere, and takes the wait reports.
    pub fn sample_once(&self, now: Instant) -> SamplePass {
        let mut pass = SamplePass::default();
        let pid = self.inner.peer.load(Ordering::Relaxed);
        let registered: Vec<bool> = lock(&self.inner.hints)
            .gpas
            .iter()
            .map(Option::is_some)
            .collect();
        // Per vCPU: where its thread is, and whether it has been descheduled for a whole period.
        let mut states = vec![(RunState::Unknown, false); registered.len()];
        if pid != 0 {
            let mut s = lock(&self.inner.sampler);
            let s = &mut *s;
            let missing = registered
                .iter()
                .zip(&s.threads)
                .any(|(r, (tid, _))| *r && tid.is_none());
            let due = s
                .rescanned_at
                .is_none_or(|at| now.saturating_duration_since(at) >= THREAD_RESCAN_EVERY);
            if missing && due {
                s.rescanned_at = Some(now);
                let found = s.source.vcpu_threads(pid).unwrap_or_default();
                for (v, slot) in s.threads.iter_mut().enumerate() {
                    let Some(&tid) = found.get(&(v as u32)) else {
                        continue;
                    };
                    if slot.0.is_none() && s.source.watch(pid, tid, v as u32) {
                        *slot = (Some(tid), ThreadWatch::default());
                    }
                }
            }
            let start = thread_cpu_ns();
            for (v, slot) in s.threads.iter_mut().enumerate() {
                let (Some(tid), true) = (slot.0, registered[v]) else {
                    continue;
                };
                pass.threads += 1;
                match slot.1.sample(&mut *s.source, tid, &mut pass.reads) {
                    Ok(state) => {
                        states[v] = (
                            state,
                            state == RunState::Preempted && slot.1.descheduled_samples() >= 2,
                        );
                    }
                    Err(_) => {
                        // Gone (or its id reused): look it up again.
                        s.source.forget(tid);
                        *slot = (None, ThreadWatch::default());
                    }
                }
            }
            let ns = thread_cpu_ns().saturating_sub(start);
            self.inner
                .telemetry
                .sched_pass(pass.threads, pass.reads, ns);
        }
        let flag_descheduled = flags_not_running(&self.inner.config);
        let h = lock(&self.inner.hints);
        for (v, &(state, descheduled)) in states.iter().enumerate() {
            if let Some(cell) = self.inner.run_state.get(v) {
                cell.store(state as u8, Ordering::Relaxed);
            }
            if let Some(cell) = self.inner.descheduled.get(v) {
                cell.store(descheduled, Ordering::Relaxed);
            }
            let Some(page) = h.page(v) else { continue };
            self.take_wait_report(v, page, h.khz(v));
            let want = descheduled && flag_descheduled;
            if page.not_running() != want {
                page.set_not_running(want);
                if want {
                    pass.set += 1;
                    self.inner.telemetry.not_running_set(v as u32);
                } else {
                    pass.cleared += 1;
                }
            }
        }
        pass
    }

    /// Clears every `NOT_RUNNING` flag (the sampler stops).
    fn clear_not_running(&self) {
        let h = lock(&self.inner.hints);
        for v in 0..h.gpas.len() {
            if let Some(page) = h.page(v).filter(HintPage::not_running) {
                page.set_not_running(false);
            }
        }
    }

    /// Takes `v`'s wait report from `page` into its budget (counted). Call with the hints
    /// lock held.
    fn take_wait_report(&self, v: usize, page: HintPage, khz: u32) {
        if self.inner.budgets.on_wait_report(v, page, khz).is_some() {
            self.inner.telemetry.wait_report();
        }
    }

    /// A notification arrived: counts it for the sampler, and wakes an idle sampler.
    fn note_activity(&self) {
        self.inner.activity.fetch_add(1, Ordering::Relaxed);
        if self.inner.sampler_idle.load(Ordering::Relaxed)
            && self.inner.sampler_idle.swap(false, Ordering::Relaxed)
        {
            if let Some(t) = lock(&self.inner.sampler_thread).as_ref() {
                t.unpark();
            }
        }
    }

    fn acked(&self, bit: u32) -> bool {
        lock(&self.inner.state).acked_features & (1 << bit) != 0
    }

    /// The configuration space bytes `offset..offset + size` (empty when outside).
    pub fn config_read(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = virtio::config::encode(self.inner.config.max_vcpus);
        let start = offset as usize;
        match start.checked_add(size as usize) {
            Some(end) if end <= space.len() => space[start..end].to_vec(),
            _ => {
                self.inner.telemetry.bad_input(
                    BadInput::ConfigRead,
                    format_args!("config read of {size} bytes at {offset}"),
                );
                Vec::new()
            }
        }
    }

    /// Counts one handled event at `now`. Once the VM is more than 10 ms worth of events
    /// ahead of its rate ([`BackendConfig::max_events_per_sec`]), returns how long its worker
    /// thread should sleep: until 1 ms worth of events may be handled again. Over any
    /// interval T the VM gets at most rate x (T + 10 ms) events handled.
    pub fn pace(&self, now: Instant) -> Option<Duration> {
        let rate = u64::from(self.inner.config.max_events_per_sec.max(1));
        let interval = Duration::from_nanos((1_000_000_000 / rate).max(1));
        let mut pacing = lock(&self.inner.pacing);
        pacing.earned = pacing.earned.max(now) + interval;
        let ahead = pacing.earned.saturating_duration_since(now);
        if ahead <= PACING_BURST {
            return None;
        }
        self.inner.telemetry.paced();
        Some(ahead - PACING_BURST + PACING_RESUME)
    }

    /// Handles a notification on queue `queue`. Returns whether a call eventfd was
    /// signalled. Never fails on guest input: bad input is counted.
    pub fn handle_queue_event(&self, queue: usize, vrings: &[Vring]) -> io::Result<bool> {
        let tel = &self.inner.telemetry;
        self.note_activity();
        let (Some(role), Some(vring)) = (
            virtio::queue_role(self.inner.config.max_vcpus, queue),
            vrings.get(queue),
        ) else {
            tel.event_unknown_queue();
            return Ok(false);
        };
        match role {
            QueueRole::Kick(vcpu) => Ok(self.kick(vcpu, vring)),
            QueueRole::Spin(vcpu) => {
                self.spin(vcpu);
                Ok(false)
            }
            QueueRole::Control => Ok(self.process_control(vring).signalled),
        }
    }

    fn kick(&self, vcpu: u32, vring: &Vring) -> bool {
        let tel = &self.inner.telemetry;
        let set_up = {
            let v = vring.get_ref();
            v.get_queue().ready() && v.get_call().is_some()
        };
        if !set_up {
            tel.kick_unset_queue();
            return false;
        }
        // No EVENT_IDX is offered, so there is no suppression to honour: the call is the kick.
        match vring.signal_used_queue() {
            Ok(()) => {
                tel.kick(vcpu);
                // The kicked vCPU's previous wait has been reported by now (this kick ends its
                // current one): one report per wait.
                let h = lock(&self.inner.hints);
                if let Some(page) = h.page(vcpu as usize) {
                    self.take_wait_report(vcpu as usize, page, h.khz(vcpu as usize));
                }
                true
            }
            Err(err) => {
                log::debug!("{}: signalling kick queue of vCPU {vcpu}: {err}", tel.vm());
                tel.kick_unset_queue();
                false
            }
        }
    }

    fn spin(&self, vcpu: u32) {
        let tel = &self.inner.telemetry;
        let v = vcpu as usize;
        let h = lock(&self.inner.hints);
        let Some(page) = h.page(v) else {
            tel.spin_without_page();
            return;
        };
        // One read of each guest field.
        let guest = page.guest_hints();
        // The ABI: a notifying vCPU has said in its page that it spins (or waits). An event
        // without that is a stray notify: acting on it would deboost a vCPU that waits for
        // nothing.
        if guest.spin_state != hint::SPIN_SPINNING && guest.spin_state != hint::SPIN_WAITING {
            tel.spin_not_spinning();
            return;
        }
        tel.spin_notification(vcpu);
        // The notifier is running: whatever the last sample said, its flag goes now.
        if let Some(cell) = self.inner.run_state.get(v) {
            cell.store(RunState::Running as u8, Ordering::Relaxed);
        }
        if let Some(cell) = self.inner.descheduled.get(v) {
            cell.store(false, Ordering::Relaxed);
        }
        if page.not_running() {
            page.set_not_running(false);
        }
        let khz = h.khz(v);
        self.take_wait_report(v, page, khz);
        let target = match SpinNotify::decode(guest.waiting_for).waiting_for {
            Some(t) if u32::from(t) < self.inner.config.max_vcpus && u32::from(t) != vcpu => {
                Some(u32::from(t))
            }
            Some(t) => {
                tel.bad_input(
                    BadInput::SpinTarget,
                    format_args!("vCPU {vcpu} waits for vCPU {t}"),
                );
                None
            }
            None => None,
        };
        // Useful (in-process: "its target was not running"): the waited-for vCPU has been
        // descheduled for at least a sample period.
        let useful = target.is_some_and(|t| self.descheduled(t));
        if useful {
            tel.useful_notification();
        }
        if self.inner.budgets.notify() {
            self.inner
                .budgets
                .on_notification(v, useful, Some(page), khz);
        }
        drop(h);
        let mut y = lock(&self.inner.yields);
        y.on_spin(vcpu, target, Instant::now(), tel);
        drop(y);
        self.inner.timer.notify_all();
    }

    /// Processes the control queue: at most one queue's worth of chains per call.
    pub fn process_control(&self, vring: &Vring) -> ControlPass {
        let tel = &self.inner.telemetry;
        let Some(memory) = lock(&self.inner.state).memory.clone() else {
            tel.bad_input(
                BadInput::Ring,
                format_args!("control queue event before SET_MEM_TABLE"),
            );
            return ControlPass::default();
        };
        let mem = memory.memory();
        let mut pass = ControlPass::default();
        {
            let mut v = vring.get_mut();
            let queue = v.get_queue_mut();
            if !queue.ready() {
                tel.bad_input(BadInput::Ring, format_args!("control queue not ready"));
                return pass;
            }
            let cap = usize::from(queue.size()).max(1);
            while pass.chains < cap {
                let Some(chain) = queue.pop_descriptor_chain(&*mem) else {
                    break;
                };
                let head = chain.head_index();
                let descriptors: Vec<_> = chain.take(MAX_CHAIN_DESCRIPTORS + 1).collect();
                let used_len = self.control_chain(&descriptors, &mem);
                if let Err(err) = queue.add_used(&*mem, head, used_len) {
                    tel.bad_input(BadInput::Ring, format_args!("control add_used: {err}"));
                    break;
                }
                pass.chains += 1;
            }
        }
        if pass.chains > 0 {
            pass.signalled = vring.signal_used_queue().is_ok();
        }
        pass
    }

    /// Handles one control chain; returns the used length (4 when a status was written).
    fn control_chain(
        &self,
        descriptors: &[virtio_queue::desc::split::Descriptor],
        mem: &GuestMemoryMmap<()>,
    ) -> u32 {
        let tel = &self.inner.telemetry;
        tel.control_request();
        let status_at = descriptors
            .last()
            .filter(|d| d.is_write_only() && d.len() >= 4)
            .map(|d| d.addr());
        let request = match descriptors {
            [req, status]
                if !req.is_write_only()
                    && req.len() as usize == ControlRequest::SIZE
                    && status.is_write_only()
                    && status.len() >= 4 =>
            {
                let mut bytes = [0u8; ControlRequest::SIZE];
                mem.read_slice(&mut bytes, req.addr())
                    .ok()
                    .and_then(|()| ControlRequest::from_bytes(&bytes))
            }
            _ => None,
        };
        let status = match request {
            Some(r) => self.control_request(&r, mem),
            None => {
                tel.bad_input(
                    BadInput::ControlChain,
                    format_args!("control chain of {} descriptors", descriptors.len()),
                );
                virtio::STATUS_BAD_REQUEST
            }
        };
        let Some(at) = status_at else { return 0 };
        match mem.write_obj(status.to_le(), at) {
            Ok(()) => 4,
            Err(err) => {
                tel.bad_input(
                    BadInput::Ring,
                    format_args!("writing control status: {err}"),
                );
                0
            }
        }
    }

    /// Executes one well-formed control request; returns its status.
    fn control_request(&self, r: &ControlRequest, mem: &GuestMemoryMmap<()>) -> u32 {
        match r.op {
            virtio::OP_REGISTER_HINT_PAGE => self.register_hint_page(r, mem),
            virtio::OP_SPIN_NOTIFY => self.control_spin(r),
            op => {
                let tel = &self.inner.telemetry;
                tel.bad_input(BadInput::ControlOp, format_args!("op {op}"));
                virtio::STATUS_BAD_REQUEST
            }
        }
    }

    /// What every control op checks first: the driver acked the features it `needs` (named,
    /// for the log), and its vCPU is one of the device's. `Err` holds the status to answer.
    fn control_checks(&self, r: &ControlRequest, needs: &[(&str, u32)]) -> Result<(), u32> {
        let tel = &self.inner.telemetry;
        if let Some((name, _)) = needs.iter().find(|(_, bit)| !self.acked(*bit)) {
            tel.bad_input(
                BadInput::ControlUnsupported,
                format_args!("op {}: {name} not acked", r.op),
            );
            return Err(virtio::STATUS_UNSUPPORTED);
        }
        if r.vcpu >= self.inner.config.max_vcpus {
            tel.bad_input(BadInput::ControlVcpu, format_args!("vCPU {}", r.vcpu));
            return Err(virtio::STATUS_BAD_VCPU);
        }
        Ok(())
    }

    /// [`virtio::OP_SPIN_NOTIFY`]: a spin report from a vCPU without a spin queue (above 127
    /// vCPUs), handled as a notification of its spin queue would be. It gives a vCPU nothing
    /// it could not do before: its spin queue (where it has one) says the same, and what the
    /// device acts on is in the hint page, which the guest writes anyway.
    fn control_spin(&self, r: &ControlRequest) -> u32 {
        let tel = &self.inner.telemetry;
        if let Err(status) =
            self.control_checks(r, &[("F_SPIN_NOTIFY", virtio::F_SPIN_NOTIFY), HINT_PAGES])
        {
            return status;
        }
        if r.gpa != 0 || r.arg != 0 {
            tel.bad_input(
                BadInput::ControlOp,
                format_args!("spin report with gpa {:#x}, arg {}", r.gpa, r.arg),
            );
            return virtio::STATUS_BAD_REQUEST;
        }
        self.spin(r.vcpu);
        virtio::STATUS_OK
    }

    /// [`virtio::OP_REGISTER_HINT_PAGE`].
    fn register_hint_page(&self, r: &ControlRequest, mem: &GuestMemoryMmap<()>) -> u32 {
        let tel = &self.inner.telemetry;
        if let Err(status) = self.control_checks(r, &[HINT_PAGES]) {
            return status;
        }
        let v = r.vcpu as usize;
        if r.gpa == 0 {
            lock(&self.inner.hints).unregister(v);
            tel.registration(false);
            return virtio::STATUS_OK;
        }
        if r.gpa % SHARED_PAGE_SIZE != 0
            || !mem.check_range(GuestAddress(r.gpa), SHARED_PAGE_SIZE as usize)
        {
            tel.bad_input(BadInput::ControlAddress, format_args!("page {:#x}", r.gpa));
            return virtio::STATUS_BAD_ADDRESS;
        }
        // A frequency that does not fit the field is no frequency a guest has: unknown.
        let khz = u32::try_from(r.arg).unwrap_or(0);
        let mut h = lock(&self.inner.hints);
        let previous = h.page(v);
        let registered = h.pages.as_ref().map(|p| p.register_gpa(v, r.gpa));
        let page = match registered {
            Some(Ok(Some(page))) => page,
            Some(Err(err)) => {
                tel.bad_input(
                    BadInput::ControlAddress,
                    format_args!("page {:#x}: {err}", r.gpa),
                );
                return virtio::STATUS_BAD_ADDRESS;
            }
            _ => {
                tel.bad_input(
                    BadInput::ControlAddress,
                    format_args!("page {:#x}: no memory table", r.gpa),
                );
                return virtio::STATUS_BAD_ADDRESS;
            }
        };
        // The page it replaces keeps no flag of ours.
        if let Some(old) = previous.filter(HintPage::not_running) {
            old.set_not_running(false);
        }
        // The host line: no stale flag (a previous backend's), the layout (written by the
        // registration), bounds, budgets, TSC frequency, then HOST_SEQ with release ordering.
        page.set_not_running(false);
        self.inner.budgets.on_register(v, page, khz);
        h.gpas[v] = Some(r.gpa);
        h.tsc_khz[v] = khz;
        drop(h);
        tel.registration(true);
        virtio::STATUS_OK
    }

    /// Replaces the guest memory (SET_MEM_TABLE). Hint pages stay registered by address and
    /// are read through the new memory.
    pub fn set_memory(&self, memory: BackendMemory) {
        let map: Arc<GuestMemoryMmap<()>> = memory.memory().into_inner();
        lock(&self.inner.state).memory = Some(memory);
        let mut h = lock(&self.inner.hints);
        let pages = HintPages::new(map, h.gpas.len());
        pages.set_vcpus_fit(self.inner.config.vcpus_fit());
        for v in 0..h.gpas.len() {
            let Some(gpa) = h.gpas[v] else { continue };
            if let Err(err) = pages.register_gpa(v, gpa) {
                self.inner.telemetry.bad_input(
                    BadInput::HintRead,
                    format_args!("vCPU {v} page {gpa:#x} after a memory change: {err}"),
                );
                h.gpas[v] = None;
            }
        }
        h.pages = Some(pages);
    }

    /// Records the features the driver acked.
    pub fn set_acked_features(&self, features: u64) {
        lock(&self.inner.state).acked_features = features;
    }
}

/// The hint-page feature, named for control ops' refusals.
const HINT_PAGES: (&str, u32) = ("F_HINT_PAGES", virtio::F_HINT_PAGES);

/// What the transport ([`crate::transport`]) asks of the device.
impl PvspinBackend {
    /// Number of virtqueues of the device ([`virtio::num_queues`]).
    pub fn num_queues(&self) -> usize {
        self.inner.config.num_queues()
    }

    /// The virtio feature bits the device offers ([`DEVICE_FEATURES`]).
    pub fn features(&self) -> u64 {
        DEVICE_FEATURES
    }

    /// The vhost-user protocol features the device offers: configuration reads, multiple
    /// queues, reply acks.
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    /// A device reset: forgets hint pages and acked features, restores priorities.
    pub fn reset_device(&self) {
        self.forget();
    }

    /// Handles one notification on `queue` on the worker thread: the worker's priority
    /// ([`BackendConfig::worker_priority`]), the queue's work, then the VM's event rate (the
    /// worker sleeps, never spins, while the VM is over it: its notifications wait in their
    /// eventfds).
    pub fn handle_notification(&self, queue: usize, vrings: &[Vring]) -> io::Result<()> {
        set_worker_priority(self.inner.config.worker_priority, self.inner.telemetry.vm());
        let result = self.handle_queue_event(queue, vrings).map(|_| ());
        if let Some(pause) = self.pace(Instant::now()) {
            std::thread::sleep(pause);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::{FromRawFd, IntoRawFd};

    use pvspin_abi::virtio::{
        ControlRequest, OP_REGISTER_HINT_PAGE, STATUS_BAD_ADDRESS, STATUS_BAD_REQUEST,
        STATUS_BAD_VCPU, STATUS_OK, STATUS_UNSUPPORTED,
    };
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::config::YieldMode;
    use crate::testing::{control_chain, DriverQueue, FakeSched, DESC_F_WRITE};
    use crate::yield_policy::tests::FakeThreads;
    use virtio_queue::desc::split::Descriptor;

    const MEM_SIZE: u64 = 0x10_0000;
    const REQ_AT: u64 = 0x8000;
    const STATUS_AT: u64 = 0x9000;
    const PAGE: u64 = 0x2_0000;
    const ALL_FEATURES: u64 = DEVICE_FEATURES;

    struct Rig {
        backend: PvspinBackend,
        mem: BackendMemory,
        vrings: Vec<Vring>,
        calls: Vec<Option<EventFd>>,
        sched: FakeSched,
    }

    impl Rig {
        fn new(mode: YieldMode, confined: bool, acked: u64) -> Self {
            Self::with_vm_cpus(mode, confined, acked, None)
        }

        fn with_vm_cpus(mode: YieldMode, confined: bool, acked: u64, vm_cpus: Option<u32>) -> Self {
            Self::with_config(
                BackendConfig {
                    max_vcpus: 4,
                    yield_mode: mode,
                    vm_cpus,
                    flag_not_running: true,
                    ..BackendConfig::default()
                },
                confined,
                acked,
            )
        }

        fn with_config(config: BackendConfig, confined: bool, acked: u64) -> Self {
            let tel = Arc::new(DaemonVmTelemetry::new("t", "/t", 4));
            let sched = FakeSched::new(7, 4);
            let backend = PvspinBackend::with_actions(
                config,
                tel,
                Box::new(FakeThreads::new(7, 4, confined)),
                Box::new(sched.clone()),
            )
            .unwrap();
            backend.set_peer_pid(Some(7));
            let mem = GuestMemoryAtomic::new(
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
            );
            backend.set_memory(mem.clone());
            backend.set_acked_features(acked);
            let n = backend.num_queues();
            let vrings = (0..n)
                .map(|_| Vring::new(mem.clone(), MAX_QUEUE_SIZE as u16).unwrap())
                .collect();
            Self {
                backend,
                mem,
                vrings,
                calls: (0..n).map(|_| None).collect(),
                sched,
            }
        }

        /// The guest's memory: the same mappings the backend reads, for the drivers' queues.
        fn guest(&self) -> GuestMemoryMmap {
            (*self.mem.memory()).clone()
        }

        fn set_up<'m>(
            &mut self,
            mem: &'m GuestMemoryMmap,
            q: usize,
            base: u64,
            size: u16,
        ) -> DriverQueue<'m, GuestMemoryMmap> {
            let ring = DriverQueue::new(mem, GuestAddress(base), size);
            let v = &self.vrings[q];
            v.set_queue_size(size);
            let mock = ring.mock();
            v.set_queue_info(
                mock.desc_table_addr().0,
                mock.avail_addr().0,
                mock.used_addr().0,
            )
            .unwrap();
            v.set_queue_ready(true);
            let call = EventFd::new(EFD_NONBLOCK).unwrap();
            // SAFETY: the clone's descriptor is fresh and owned by the File from here on.
            let file = unsafe { File::from_raw_fd(call.try_clone().unwrap().into_raw_fd()) };
            v.set_call(Some(file));
            self.calls[q] = Some(call);
            ring
        }

        fn signalled(&self, q: usize) -> bool {
            self.calls[q].as_ref().is_some_and(|c| c.read().is_ok())
        }

        /// Posts `descs`, runs the control queue, returns (status word, used len).
        fn post(
            &mut self,
            ring: &DriverQueue<GuestMemoryMmap>,
            descs: &[Descriptor],
        ) -> (u32, u32) {
            let m = self.mem.memory();
            m.write_obj(0xdead_beefu32, GuestAddress(STATUS_AT))
                .unwrap();
            let before = ring.used_idx().unwrap();
            ring.add_chain(descs).unwrap();
            let pass = self.backend.process_control(&self.vrings[0]);
            assert_eq!(pass.chains, 1);
            assert!(pass.signalled && self.signalled(0));
            assert_eq!(ring.used_idx().unwrap(), before.wrapping_add(1));
            let len = ring.used_elem(before).unwrap().len();
            (m.read_obj(GuestAddress(STATUS_AT)).unwrap(), len)
        }

        fn request(&mut self, ring: &DriverQueue<GuestMemoryMmap>, r: ControlRequest) -> u32 {
            self.mem
                .memory()
                .write_slice(&r.to_bytes(), GuestAddress(REQ_AT))
                .unwrap();
            let (status, len) = self.post(ring, &good_chain());
            assert_eq!(len, 4);
            status
        }

        fn host<T: vm_memory::AtomicAccess>(&self, off: usize) -> T {
            self.at(PAGE, off)
        }

        /// A field of the page at `page`.
        fn at<T: vm_memory::AtomicAccess>(&self, page: u64, off: usize) -> T {
            self.mem
                .memory()
                .load(GuestAddress(page + off as u64), Ordering::Acquire)
                .unwrap()
        }

        /// The guest stores `value` at field `off` of the page at `page`.
        fn guest_store<T: vm_memory::AtomicAccess>(&self, page: u64, off: usize, value: T) {
            self.mem
                .memory()
                .store(value, GuestAddress(page + off as u64), Ordering::Release)
                .unwrap();
        }
    }

    fn good_chain() -> [Descriptor; 2] {
        control_chain(REQ_AT, STATUS_AT)
    }

    fn register(vcpu: u32, gpa: u64, khz: u64) -> ControlRequest {
        ControlRequest {
            op: OP_REGISTER_HINT_PAGE,
            vcpu,
            gpa,
            arg: khz,
        }
    }

    #[test]
    fn registration_writes_the_host_line() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        assert_eq!(rig.request(&ring, register(2, PAGE, 2_000_000)), STATUS_OK);
        assert_eq!(rig.backend.hint_page(2), Some(PAGE));
        assert_eq!(rig.host::<u32>(hint::LAYOUT), hint::LAYOUT_VERSION);
        // The in-process defaults at 2 GHz: 100 us, 50 us, 2 us, 1 ms.
        assert_eq!(rig.host::<u64>(hint::SPIN_WINDOW_TSC), 200_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_TSC), 100_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_MIN_TSC), 4_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_MAX_TSC), 2_000_000);
        assert_eq!(rig.host::<u32>(hint::TSC_KHZ), 2_000_000);
        assert_eq!(rig.host::<u32>(hint::HOST_SEQ), 1);
        // Unknown frequency: no time budgets, and the sequence moves on.
        assert_eq!(rig.request(&ring, register(2, PAGE, 0)), STATUS_OK);
        assert_eq!(rig.host::<u64>(hint::SPIN_WINDOW_TSC), u64::MAX);
        assert_eq!(rig.host::<u32>(hint::HOST_SEQ), 2);
        // gpa 0 unregisters.
        assert_eq!(rig.request(&ring, register(2, 0, 0)), STATUS_OK);
        assert_eq!(rig.backend.hint_page(2), None);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(
            (s.hint_page_registrations, s.hint_page_unregistrations),
            (2, 1)
        );
    }

    #[test]
    fn registration_says_whether_the_vcpus_fit() {
        // (vm_cpus, VCPUS_FIT) for a 4-vCPU device.
        for (vm_cpus, fit) in [(None, false), (Some(2), false), (Some(4), true)] {
            let mut rig = Rig::with_vm_cpus(YieldMode::Deboost, false, ALL_FEATURES, vm_cpus);
            let mem = rig.guest();
            let ring = rig.set_up(&mem, 0, 0x1000, 8);
            rig.guest_store(PAGE, hint::HOST_FLAGS, u32::MAX);
            assert_eq!(rig.request(&ring, register(1, PAGE, 2_000_000)), STATUS_OK);
            let flags = rig.host::<u32>(hint::HOST_FLAGS);
            assert_eq!(flags & hint::VCPUS_FIT != 0, fit, "{vm_cpus:?}");
            assert_eq!(flags & !hint::VCPUS_FIT, 0, "nothing the guest left");
        }
    }

    #[test]
    fn bad_requests_get_their_status() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        let cases = [
            (register(4, PAGE, 1), STATUS_BAD_VCPU),
            (register(u32::MAX, PAGE, 1), STATUS_BAD_VCPU),
            (register(0, PAGE + 8, 1), STATUS_BAD_ADDRESS),
            (register(0, MEM_SIZE, 1), STATUS_BAD_ADDRESS),
            (register(0, !0xfff, 1), STATUS_BAD_ADDRESS),
            (
                ControlRequest {
                    op: 9,
                    ..register(0, PAGE, 1)
                },
                STATUS_BAD_REQUEST,
            ),
        ];
        for (req, want) in cases {
            assert_eq!(rig.request(&ring, req), want, "{req:?}");
        }
        // The last page of memory is fine.
        assert_eq!(
            rig.request(&ring, register(0, MEM_SIZE - 4096, 1)),
            STATUS_OK
        );
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.bad_inputs["control_vcpu"], 2);
        assert_eq!(s.bad_inputs["control_address"], 3);
        assert_eq!(s.bad_inputs["control_op"], 1);

        let mut no_pages = Rig::new(YieldMode::Deboost, false, 1 << virtio::F_VERSION_1);
        let mem = no_pages.guest();
        let ring = no_pages.set_up(&mem, 0, 0x1000, 8);
        assert_eq!(
            no_pages.request(&ring, register(0, PAGE, 1)),
            STATUS_UNSUPPORTED
        );
        assert_eq!(no_pages.backend.hint_page(0), None);
    }

    #[test]
    fn malformed_chains_are_rejected() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        rig.mem
            .memory()
            .write_slice(&register(0, PAGE, 1).to_bytes(), GuestAddress(REQ_AT))
            .unwrap();
        let [req, status] = good_chain();
        let changed = |mut d: Descriptor, change: fn(&mut Descriptor)| {
            change(&mut d);
            d
        };
        let short = changed(req, |d| d.set_len(23));
        let long = changed(req, |d| d.set_len(25));
        let writable_req = changed(req, |d| d.set_flags(DESC_F_WRITE));
        let tiny_status = changed(status, |d| d.set_len(3));
        let readable_status = changed(status, |d| d.set_flags(0));
        // A status can be written: BAD_REQUEST, used length 4.
        for chain in [
            vec![short, status],
            vec![long, status],
            vec![writable_req, status],
            vec![req, req, status],
            vec![status],
        ] {
            assert_eq!(
                rig.post(&ring, &chain),
                (STATUS_BAD_REQUEST, 4),
                "{chain:?}"
            );
        }
        // No status can be written: the chain comes back with used length 0, memory untouched.
        for chain in [
            vec![req, tiny_status],
            vec![req, readable_status],
            vec![req],
        ] {
            assert_eq!(rig.post(&ring, &chain), (0xdead_beef, 0), "{chain:?}");
        }
        // A request buffer outside memory is a bad chain too.
        let outside = changed(req, |d| d.set_addr(MEM_SIZE + 0x1000));
        assert_eq!(rig.post(&ring, &[outside, status]), (STATUS_BAD_REQUEST, 4));
        assert_eq!(rig.backend.hint_page(0), None);
        assert_eq!(
            rig.backend.telemetry().bad_inputs(BadInput::ControlChain),
            9
        );
    }

    #[test]
    fn control_work_per_event_is_bounded() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 4);
        // The driver claims 1000 chains are available: one pass takes at most a queue's worth.
        // virtio-queue itself refuses an available index more than a queue ahead, so this
        // checks that guard as this backend uses it; the backend's own per-pass cap
        // (`process_control`) is a second guard this test cannot reach.
        ring.mock().avail().idx().store(1000u16.to_le());
        for i in 0..4u16 {
            ring.write_desc(i, Descriptor::new(STATUS_AT, 4, DESC_F_WRITE, 0))
                .unwrap();
        }
        let pass = rig.backend.process_control(&rig.vrings[0]);
        assert!(pass.chains <= 4, "{pass:?}");
    }

    #[test]
    fn kicks_signal_their_own_queue_only() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let k1 = virtio::kick_queue(4, 1).unwrap() as usize;
        let k2 = virtio::kick_queue(4, 2).unwrap() as usize;
        rig.set_up(&rig.guest(), k1, 0x4000, 1);
        rig.set_up(&rig.guest(), k2, 0x6000, 1);
        assert!(rig.backend.handle_queue_event(k1, &rig.vrings).unwrap());
        assert!(rig.signalled(k1));
        assert!(!rig.signalled(k2));
        // vCPU 3's kick queue is not set up: counted, nothing signalled.
        let k3 = virtio::kick_queue(4, 3).unwrap() as usize;
        assert!(!rig.backend.handle_queue_event(k3, &rig.vrings).unwrap());
        // No such queue.
        assert!(!rig.backend.handle_queue_event(999, &rig.vrings).unwrap());
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.kicks, vec![0, 1, 0, 0]);
        assert_eq!((s.kicks_unset_queue, s.events_unknown_queue), (1, 1));
    }

    fn spin_rig(mode: YieldMode, confined: bool, waiting_for: Option<u16>) -> Rig {
        let mut rig = Rig::new(mode, confined, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        assert_eq!(rig.request(&ring, register(0, PAGE, 1_000_000)), STATUS_OK);
        let n = SpinNotify {
            waiting_for,
            next_owner: false,
            spun_bucket: 3,
            lock_hash: 5,
        };
        rig.mem
            .memory()
            .store(
                n.encode(),
                GuestAddress(PAGE + hint::WAITING_FOR as u64),
                Ordering::Release,
            )
            .unwrap();
        let s0 = virtio::spin_queue(4, 0).unwrap() as usize;
        // Not yet marked spinning in the page: ignored (what the enable-time pass looks like).
        assert!(!rig.backend.handle_queue_event(s0, &rig.vrings).unwrap());
        let s = rig.backend.telemetry().snapshot();
        assert_eq!((s.spins_not_spinning, s.deboosts), (1, 0));
        rig.mem
            .memory()
            .store(
                hint::SPIN_SPINNING,
                GuestAddress(PAGE + hint::SPIN_STATE as u64),
                Ordering::Release,
            )
            .unwrap();
        assert!(!rig.backend.handle_queue_event(s0, &rig.vrings).unwrap());
        rig
    }

    #[test]
    fn spin_notifications_reach_the_yield_policy() {
        let rig = spin_rig(YieldMode::Confined, true, Some(2));
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.spin_notifications, vec![1, 0, 0, 0]);
        assert_eq!((s.deboosts, s.boosts), (1, 1));
        assert_eq!(rig.backend.adjusted_threads(), 2);
        // Reset forgets the pages and restores the threads.
        rig.backend.forget();
        assert_eq!(rig.backend.hint_page(0), None);
        assert_eq!(rig.backend.adjusted_threads(), 0);
        assert_eq!(rig.backend.telemetry().snapshot().restores, 2);

        let refused = spin_rig(YieldMode::Confined, false, Some(2));
        let s = refused.backend.telemetry().snapshot();
        assert_eq!(
            (s.deboosts, s.boosts, s.boost_refused_unconfined),
            (1, 0, 1)
        );

        let out_of_range = spin_rig(YieldMode::Confined, true, Some(9));
        let s = out_of_range.backend.telemetry().snapshot();
        assert_eq!((s.deboosts, s.boosts), (1, 0));
        assert_eq!(s.bad_inputs["spin_target"], 1);

        // vCPU 1 has no page: counted and ignored.
        let s1 = virtio::spin_queue(4, 1).unwrap() as usize;
        out_of_range
            .backend
            .handle_queue_event(s1, &out_of_range.vrings)
            .unwrap();
        assert_eq!(
            out_of_range
                .backend
                .telemetry()
                .snapshot()
                .spins_without_page,
            1
        );
    }

    fn spin_report(vcpu: u32) -> ControlRequest {
        ControlRequest {
            op: virtio::OP_SPIN_NOTIFY,
            vcpu,
            gpa: 0,
            arg: 0,
        }
    }

    /// A spin report on the control queue (a vCPU without a spin queue) does what a
    /// notification of the vCPU's spin queue does; bad ones are refused by name and counted.
    #[test]
    fn spin_reports_on_the_control_queue_act_as_spin_queue_notifications() {
        let mut rig = Rig::new(YieldMode::Confined, true, ALL_FEATURES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        assert_eq!(rig.request(&ring, register(0, PAGE, 1_000_000)), STATUS_OK);
        let waits_for_2 = SpinNotify {
            waiting_for: Some(2),
            next_owner: false,
            spun_bucket: 3,
            lock_hash: 5,
        };
        rig.guest_store(PAGE, hint::WAITING_FOR, waits_for_2.encode());
        // Not marked spinning in the page: ignored, as on a spin queue.
        assert_eq!(rig.request(&ring, spin_report(0)), STATUS_OK);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!((s.spins_not_spinning, s.deboosts), (1, 0));
        rig.guest_store(PAGE, hint::SPIN_STATE, hint::SPIN_SPINNING);
        assert_eq!(rig.request(&ring, spin_report(0)), STATUS_OK);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.spin_notifications, vec![1, 0, 0, 0]);
        assert_eq!((s.deboosts, s.boosts), (1, 1));

        // vCPU 1 has no page: counted as a spin without a page, as on its spin queue.
        assert_eq!(rig.request(&ring, spin_report(1)), STATUS_OK);
        assert_eq!(rig.backend.telemetry().snapshot().spins_without_page, 1);

        assert_eq!(rig.request(&ring, spin_report(4)), STATUS_BAD_VCPU);
        let mut with_gpa = spin_report(0);
        with_gpa.gpa = PAGE;
        assert_eq!(rig.request(&ring, with_gpa), STATUS_BAD_REQUEST);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(
            (s.bad_inputs["control_vcpu"], s.bad_inputs["control_op"]),
            (1, 1)
        );
        assert_eq!(s.spin_notifications, vec![1, 0, 0, 0]);

        // Without spin notifications negotiated the op is unsupported.
        let mut rig = Rig::new(YieldMode::Confined, true, 1 << virtio::F_HINT_PAGES);
        let mem = rig.guest();
        let ring = rig.set_up(&mem, 0, 0x1000, 8);
        assert_eq!(rig.request(&ring, spin_report(0)), STATUS_UNSUPPORTED);
    }

    const PAGE2: u64 = 0x2_1000;
    const PAGE3: u64 = 0x2_2000;

    /// A rig with pages registered (1 GHz guest TSC: cycles are ns) for vCPUs 0..=2, at
    /// PAGE, PAGE2, PAGE3, and every kick and spin queue of vCPUs 0..=2 set up.
    fn budget_rig(mode: YieldMode) -> Rig {
        let mut rig = Rig::new(mode, false, ALL_FEATURES);
        let mem = rig.guest();
        set_up_budgets(&mut rig, &mem);
        rig
    }

    /// Sets up [`budget_rig`]'s pages and queues on `rig`; returns its control ring.
    fn set_up_budgets<'m>(
        rig: &mut Rig,
        mem: &'m GuestMemoryMmap,
    ) -> DriverQueue<'m, GuestMemoryMmap> {
        let ring = rig.set_up(mem, 0, 0x1000, 8);
        for (v, page) in [(0, PAGE), (1, PAGE2), (2, PAGE3)] {
            assert_eq!(rig.request(&ring, register(v, page, 1_000_000)), STATUS_OK);
            let k = virtio::kick_queue(4, v).unwrap() as usize;
            rig.set_up(&rig.guest(), k, 0x4000 + u64::from(v) * 0x1000, 1);
        }
        ring
    }

    fn flag(rig: &Rig, page: u64) -> bool {
        rig.at::<u32>(page, hint::HOST_FLAGS) & hint::NOT_RUNNING != 0
    }

    /// vCPU `v` (page `page`) notifies that it spins, waiting for `target`.
    fn notify(rig: &Rig, v: u32, page: u64, target: u16) {
        let n = SpinNotify {
            waiting_for: Some(target),
            next_owner: false,
            spun_bucket: 3,
            lock_hash: 5,
        };
        rig.guest_store(page, hint::WAITING_FOR, n.encode());
        rig.guest_store(page, hint::SPIN_STATE, hint::SPIN_SPINNING);
        let q = virtio::spin_queue(4, v).unwrap() as usize;
        rig.backend.handle_queue_event(q, &rig.vrings).unwrap();
    }

    fn kick(rig: &Rig, v: u32) {
        let k = virtio::kick_queue(4, v).unwrap() as usize;
        assert!(rig.backend.handle_queue_event(k, &rig.vrings).unwrap());
        assert!(rig.signalled(k));
    }

    #[test]
    fn kicks_take_wait_reports_into_the_published_budget() {
        let rig = budget_rig(YieldMode::Deboost);
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 50_000);
        assert_eq!(rig.at::<u32>(PAGE2, hint::HOST_SEQ), 1);
        // No report yet: a kick changes nothing.
        kick(&rig, 1);
        assert_eq!(rig.at::<u32>(PAGE2, hint::HOST_SEQ), 1);
        // The guest reports a 30 us wait (a kick soon after it halted): the budget doubles,
        // as in process, and the page says so.
        rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, 30_000u64);
        kick(&rig, 1);
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 100_000);
        assert_eq!(rig.at::<u32>(PAGE2, hint::HOST_SEQ), 2);
        assert_eq!(rig.at::<u64>(PAGE2, hint::LAST_WAIT_TSC), 0, "taken once");
        // A wait of 3 ms (its holder was descheduled): it halves.
        rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, 3_000_000u64);
        kick(&rig, 1);
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 50_000);
        // Reports are also taken at the vCPU's notifications and at samples.
        rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, 1_000u64);
        notify(&rig, 1, PAGE2, 0);
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 100_000);
        rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, 1_000u64);
        rig.backend.sample_once(Instant::now());
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 200_000);
        // Whatever the guest reports, the budget stays within its bounds.
        let reports = [u64::MAX, 1].into_iter().chain([u64::MAX; 8]);
        for report in reports {
            rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, report);
            kick(&rig, 1);
            let b = rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC);
            assert!((2_000..=1_000_000).contains(&b), "{b}");
        }
        assert_eq!(rig.backend.budgets().budgets().wait_after_ns(1), 2_000);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.wait_reports, 14);
        assert_eq!(s.wait_after_ns[1], 2_000);
        assert_eq!(s.wait_after_ns[0], 50_000, "budgets are per vCPU");
    }

    #[test]
    fn notification_window_backs_off_unless_the_target_is_descheduled() {
        let rig = budget_rig(YieldMode::Deboost);
        assert_eq!(rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), 100_000);
        // vCPU 2 runs: notifying about it is useless, the window doubles (published).
        rig.sched.running(2);
        rig.backend.sample_once(Instant::now());
        notify(&rig, 0, PAGE, 2);
        assert_eq!(rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), 200_000);
        notify(&rig, 0, PAGE, 2);
        assert_eq!(rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), 400_000);
        // vCPU 2 is descheduled while runnable for a whole period: the next notification is
        // useful, the window goes back to its base.
        rig.sched.preempted(2);
        rig.backend.sample_once(Instant::now());
        assert_eq!(rig.backend.run_state(2), RunState::Preempted);
        assert!(!rig.backend.descheduled(2), "one sample is not a period");
        rig.backend.sample_once(Instant::now());
        assert!(rig.backend.descheduled(2));
        notify(&rig, 0, PAGE, 2);
        assert_eq!(rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), 100_000);
        // Halted (blocked) is not descheduled: useless.
        rig.sched.blocked(2);
        rig.backend.sample_once(Instant::now());
        notify(&rig, 0, PAGE, 2);
        assert_eq!(rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), 200_000);
        for _ in 0..10 {
            notify(&rig, 0, PAGE, 2);
        }
        assert_eq!(
            rig.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC),
            4_000_000,
            "ceiling"
        );
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.useful_spin_notifications, 1);
        assert_eq!(s.spin_window_ns.unwrap()[0], 4_000_000);

        // With --yield off guests are told never to notify, as in process without directed
        // yield, and a notification anyway adapts nothing.
        let off = budget_rig(YieldMode::Off);
        assert_eq!(off.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), u64::MAX);
        notify(&off, 0, PAGE, 2);
        assert_eq!(off.at::<u64>(PAGE, hint::SPIN_WINDOW_TSC), u64::MAX);
        assert_eq!(off.backend.telemetry().snapshot().spin_window_ns, None);
    }

    #[test]
    fn the_sampler_flags_descheduled_vcpus_only() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mem = rig.guest();
        let ring = set_up_budgets(&mut rig, &mem);
        let flag = |rig: &Rig, page: u64| flag(rig, page);
        rig.sched.running(0);
        rig.sched.preempted(1);
        rig.sched.blocked(2);
        rig.sched.preempted(3); // no page: not read
        let pass = rig.backend.sample_once(Instant::now());
        assert_eq!((pass.threads, pass.set, pass.cleared), (3, 0, 0));
        assert_eq!(
            (pass.reads.stat, pass.reads.status),
            (3, 2),
            "first reads: stat, and status for the runnable ones"
        );
        assert!(
            !flag(&rig, PAGE2),
            "descheduled for less than a period so far"
        );
        // Nothing moved: vCPU 1 has been off its CPU for a whole period now; schedstat only
        // (and stat for the blocked one).
        let pass = rig.backend.sample_once(Instant::now());
        assert_eq!((pass.set, pass.cleared), (1, 0));
        assert!(!flag(&rig, PAGE) && flag(&rig, PAGE2) && !flag(&rig, PAGE3));
        assert_eq!(
            (pass.reads.schedstat, pass.reads.stat, pass.reads.status),
            (3, 1, 0)
        );
        assert!(flag(&rig, PAGE2));
        // It runs again: cleared at the next sample.
        rig.sched.running(1);
        let pass = rig.backend.sample_once(Instant::now());
        assert_eq!((pass.set, pass.cleared), (0, 1));
        assert!(!flag(&rig, PAGE2));
        // Descheduled again, then it notifies: it runs, so its flag goes at once.
        rig.sched.preempted(1);
        rig.backend.sample_once(Instant::now());
        rig.backend.sample_once(Instant::now());
        assert!(flag(&rig, PAGE2));
        notify(&rig, 1, PAGE2, 0);
        assert!(!flag(&rig, PAGE2));
        assert_eq!(rig.backend.run_state(1), RunState::Running);
        assert!(!rig.backend.descheduled(1));
        // What /proc shows of a thread that ran.
        rig.sched.running(1);
        // A guest that scribbles the flag gets it corrected at the next sample.
        rig.guest_store(PAGE, hint::HOST_FLAGS, u32::MAX);
        rig.backend.sample_once(Instant::now());
        assert!(!flag(&rig, PAGE));
        // A thread that exits is looked up again (not before 100 ms).
        rig.sched.remove(FakeSched::TID_BASE + 2);
        let pass = rig.backend.sample_once(Instant::now());
        assert_eq!(rig.backend.run_state(2), RunState::Unknown);
        assert_eq!(pass.threads, 3);
        assert_eq!(rig.backend.sample_once(Instant::now()).threads, 2);
        // Unregistering and forgetting leave no flag of ours behind.
        rig.sched.preempted(0);
        rig.sched.preempted(1);
        rig.backend.sample_once(Instant::now());
        rig.backend.sample_once(Instant::now());
        assert!(flag(&rig, PAGE) && flag(&rig, PAGE2));
        assert_eq!(rig.request(&ring, register(0, 0, 0)), STATUS_OK);
        assert!(!flag(&rig, PAGE));
        rig.backend.forget();
        assert!(!flag(&rig, PAGE2));
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.not_running_set, vec![1, 3, 0, 0]);
        assert_eq!(
            (s.sched.passes, s.sched.thread_reads),
            (10, 27),
            "{:?}",
            s.sched
        );
    }

    #[test]
    fn the_sampler_slows_down_when_idle_or_where_it_flags_nobody() {
        let ms = Duration::from_millis(1);
        let mut config = BackendConfig {
            max_vcpus: 4,
            ..BackendConfig::default()
        };
        // Flags off (the default): passes only take wait reports, at the idle rate.
        assert_eq!(sampler_pause(&config, ms, false), (ms * 20, false));
        assert_eq!(sampler_pause(&config, ms, true), (ms * 20, false));
        config.flag_not_running = true;
        assert_eq!(sampler_pause(&config, ms, false), (ms, false));
        assert_eq!(sampler_pause(&config, ms, true), (ms * 20, true));
        config.vm_cpus = Some(2);
        assert_eq!(
            sampler_pause(&config, ms, false),
            (ms, false),
            "4 vCPUs, 2 CPUs"
        );
        config.vm_cpus = Some(4);
        assert_eq!(sampler_pause(&config, ms, false), (ms * 20, false));
        assert_eq!(sampler_pause(&config, ms, true), (ms * 20, false));
    }

    #[test]
    fn the_sampler_flags_nothing_where_the_vcpus_fit() {
        let mut rig = Rig::with_vm_cpus(YieldMode::Deboost, false, ALL_FEATURES, Some(4));
        let mem = rig.guest();
        set_up_budgets(&mut rig, &mem);
        rig.sched.running(0);
        rig.sched.preempted(1);
        rig.sched.blocked(2);
        rig.backend.sample_once(Instant::now());
        let pass = rig.backend.sample_once(Instant::now());
        // Seen descheduled (spin notifications about it are still useful), not flagged.
        assert!(rig.backend.descheduled(1));
        assert_eq!((pass.set, pass.cleared), (0, 0));
        assert!(!flag(&rig, PAGE2));
        // A guest that scribbles the flag still gets it corrected.
        rig.guest_store(PAGE2, hint::HOST_FLAGS, u32::MAX);
        rig.backend.sample_once(Instant::now());
        assert!(!flag(&rig, PAGE2));
        assert_eq!(
            rig.backend.telemetry().snapshot().not_running_set,
            vec![0; 4]
        );
    }

    #[test]
    fn by_default_the_sampler_takes_wait_reports_and_flags_nobody() {
        let config = BackendConfig {
            max_vcpus: 4,
            ..BackendConfig::default()
        };
        assert!(!config.flag_not_running);
        let mut rig = Rig::with_config(config, false, ALL_FEATURES);
        let mem = rig.guest();
        set_up_budgets(&mut rig, &mem);
        rig.sched.preempted(1);
        rig.backend.sample_once(Instant::now());
        let pass = rig.backend.sample_once(Instant::now());
        assert!(rig.backend.descheduled(1), "still seen descheduled");
        assert_eq!((pass.threads, pass.set), (3, 0));
        assert!(!flag(&rig, PAGE2));
        // A wait report on a page is taken by a pass, with no kick or notification.
        rig.guest_store(PAGE2, hint::LAST_WAIT_TSC, 30_000u64);
        rig.backend.sample_once(Instant::now());
        assert_eq!(rig.at::<u64>(PAGE2, hint::WAIT_AFTER_TSC), 100_000);
        assert_eq!(rig.at::<u64>(PAGE2, hint::LAST_WAIT_TSC), 0, "taken");
    }

    #[test]
    fn without_a_peer_nothing_is_read() {
        let rig = budget_rig(YieldMode::Deboost);
        rig.backend.set_peer_pid(None);
        rig.sched.preempted(1);
        let pass = rig.backend.sample_once(Instant::now());
        assert_eq!((pass.threads, pass.set), (0, 0));
        assert_eq!(rig.at::<u32>(PAGE2, hint::HOST_FLAGS), 0);
    }

    #[test]
    fn a_new_memory_table_remaps_the_pages() {
        let rig = budget_rig(YieldMode::Deboost);
        // The same layout again (a frontend that resends its table): pages stay registered
        // and are reached through the new mapping.
        let again = GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
        );
        rig.backend.set_memory(again.clone());
        assert_eq!(rig.backend.hint_page(1), Some(PAGE2));
        again
            .memory()
            .store(
                30_000u64,
                GuestAddress(PAGE2 + hint::LAST_WAIT_TSC as u64),
                Ordering::Release,
            )
            .unwrap();
        rig.backend.sample_once(Instant::now());
        let wait: u64 = again
            .memory()
            .load(
                GuestAddress(PAGE2 + hint::WAIT_AFTER_TSC as u64),
                Ordering::Acquire,
            )
            .unwrap();
        assert_eq!(wait, 100_000);
        // A table without the pages: they are dropped, counted.
        let small = GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x2_0000)]).unwrap(),
        );
        rig.backend.set_memory(small);
        assert_eq!(rig.backend.hint_page(0), None);
        assert_eq!(rig.backend.telemetry().bad_inputs(BadInput::HintRead), 3);
    }

    #[test]
    fn a_vm_past_its_event_rate_is_paused_until_it_may_go_on() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        let t0 = Instant::now() + Duration::from_millis(5);
        // Default rate 20,000 a second (50 us an event), bursts of 10 ms: 200 events at one
        // instant are handled, the 201st pauses until 1 ms worth may go.
        for _ in 0..200 {
            assert_eq!(rig.backend.pace(t0), None);
        }
        let pause = rig.backend.pace(t0).unwrap();
        assert_eq!(pause, Duration::from_micros(1_050));
        assert_eq!(rig.backend.telemetry().snapshot().paced, 1);
        // After the pause, 20 more (1 ms worth), then paced again.
        let t1 = t0 + pause;
        for _ in 0..20 {
            assert_eq!(rig.backend.pace(t1), None);
        }
        assert!(rig.backend.pace(t1).is_some());
        // A VM at its rate or below is never paced, however bursty within 10 ms.
        let t2 = t1 + Duration::from_secs(1);
        for i in 0..10_000u32 {
            let at = t2 + Duration::from_micros(u64::from(i / 100) * 5_000);
            assert_eq!(rig.backend.pace(at), None, "event {i}");
        }
        assert_eq!(rig.backend.telemetry().snapshot().paced, 2);
        let refused = BackendConfig {
            max_events_per_sec: 999,
            ..BackendConfig::default()
        };
        assert!(refused.validate().is_err());
    }

    #[test]
    fn config_reads_are_bounds_checked() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        let full = rig.backend.config_read(0, virtio::config::SIZE as u32);
        assert_eq!(full, virtio::config::encode(4).to_vec());
        assert_eq!(rig.backend.config_read(8, 4), 5u32.to_le_bytes().to_vec());
        for (off, size) in [(0, 17), (16, 1), (15, 2), (u32::MAX, 4), (4, u32::MAX)] {
            assert!(
                rig.backend.config_read(off, size).is_empty(),
                "{off} {size}"
            );
        }
        assert_eq!(rig.backend.config_read(16, 0), Vec::<u8>::new());
        assert_eq!(rig.backend.telemetry().bad_inputs(BadInput::ConfigRead), 5);
    }

    #[test]
    fn offers_the_device_features_and_queues() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        let f = rig.backend.features();
        assert_ne!(f & (1 << virtio::F_VERSION_1), 0);
        assert_ne!(f & (1 << virtio::F_SPIN_NOTIFY), 0);
        assert_ne!(f & (1 << virtio::F_HINT_PAGES), 0);
        assert_eq!(rig.backend.num_queues(), 9);
        assert!(rig
            .backend
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    }
}
