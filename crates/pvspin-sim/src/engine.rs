//! The event loop, the VMs' guests and their lock, and the VMM's pvspin hooks.
//!
//! Time is simulated nanoseconds; events are ordered by (time, sequence number), so a seed
//! fixes the run. A vCPU's guest makes progress only while its thread runs on a host CPU
//! (the `sched` module); each guest step (non-critical work, critical section, hand-over, an
//! exit's cost) is one pending event, cancelled by a token when the thread loses its CPU and
//! charged only for the time it ran.
//!
//! pvspin's policies are driven through their public APIs, unchanged: `RunSlots`
//! (`poll_enter`, `exited`, `leave`, `hand_over`, `prioritize`, `halt_changed` from a halt
//! watcher that polls `watch_set` every `halt_watch_interval`), `PageBudgets` (the wait budget
//! and notification window, adapted from each wait), `DirectedYield::decide` over a real
//! `VcpuBoard`, and `BoostTrial`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pvspin_hints::PageBudgets;
use pvspin_slots::{RunSlots, SlotClock, SlotConfig, SlotSignals, SlotStats, SlotWaker};
use pvspin_track::VcpuBoard;
use pvspin_yield::{
    BoostTrial, BudgetConfig, Decision, DirectedYield, PolicyConfig, SpinNotification, TrialConfig,
};
use thiserror::Error;

use crate::config::{ConfigError, Guest, KickPath, LockKind, PvMode, SimConfig};
use crate::cost::{CostModel, Span};
use crate::rng::SimRng;
use crate::sched::{Cpu, Group, TState, Thread};

/// Errors setting a simulation up.
#[derive(Debug, Error)]
pub enum SimError {
    /// The configuration breaks a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// pvspin's slot policy refused its configuration.
    #[error("run slots: {0}")]
    Slots(#[from] pvspin_slots::SlotError),
    /// pvspin's budgets refused their configuration.
    #[error("budgets: {0}")]
    Budgets(#[from] pvspin_yield::BudgetError),
    /// pvspin's directed-yield policy refused its configuration.
    #[error("directed yield: {0}")]
    Policy(#[from] pvspin_yield::PolicyError),
    /// pvspin's vCPU board refused the vCPU count.
    #[error("vCPU board: {0}")]
    Board(#[from] pvspin_track::BoardError),
}

/// What one VM did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmReport {
    /// When the last vCPU finished its iterations (None: not within the bound or duration).
    pub finish_ns: Option<u64>,
    /// Lock acquisitions (within the duration, for runs that end by time).
    pub acquisitions: u64,
    /// Acquisitions that found the lock taken (or others queued for it). Not the guests'
    /// `pv_slow_paths`, which count only the waits that went on to WAIT.
    pub contended: u64,
    /// Waits that blocked (halts or parks).
    pub halts: u64,
    /// Kicks sent (pre-wakes included).
    pub kicks: u64,
    /// Waits begun before the spin budget ran out, because what the waiter waits for does not
    /// run (the guests' `pv_wait_early` counter).
    pub early_waits: u64,
    /// Acquisitions of a free lock past a non-empty queue (the stock guest's steal).
    pub steals: u64,
    /// Kicks an unlocker sent to halted waiters behind the new holder (the pvspin guest's
    /// pre-wake, [`SimConfig::prewake`]); also counted in `kicks`.
    pub prewakes: u64,
    /// Directed-yield boosts.
    pub boosts: u64,
    /// Times two vCPUs were inside the critical section at once (must be 0).
    pub exclusion_violations: u64,
    /// The run slots' counters, with slots.
    pub slots: Option<SlotStats>,
    /// Polls of the slots' halt watcher (the VMM's `run_slots.watch_polls`).
    pub watch_polls: u64,
}

/// What a simulation did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Per VM.
    pub vms: Vec<VmReport>,
    /// Simulated time at the end.
    pub end_ns: u64,
    /// Events handled.
    pub events: u64,
    /// Whether every VM finished (runs that end by iterations).
    pub finished: bool,
    /// CPU time each host thread received, ns: the VMs' vCPU threads in order, then the hogs,
    /// then each VM's halt watcher (with slots on a path that halts in KVM).
    pub thread_cpu_ns: Vec<u64>,
    /// Quota periods in which each VM's group was throttled (empty without a CPU limit).
    pub throttled_periods: Vec<u64>,
    /// CPU time, ns, that host CPUs stood idle while a thread waited in another CPU's run
    /// queue: what [`crate::CostModel::migration_cost_ns`] decides (for a real run,
    /// `validation/idle-while-queued.py` reads it off `perf sched record`).
    pub idle_while_queued_ns: u64,
    /// Wake-ups of a vCPU thread onto a CPU where another vCPU thread ran, and how many of
    /// them preempted it at once (`validation/idle-while-queued.py` reads the host's: 73% of
    /// 1,231 in six runs of the stock guest at 4-16 vCPUs, docs/simulator.md, "Source K").
    pub wakeups_onto_vcpu: (u64, u64),
}

impl Report {
    /// Acquisitions over all VMs.
    pub fn acquisitions(&self) -> u64 {
        self.vms.iter().map(|v| v.acquisitions).sum()
    }

    /// The slowest VM's finish time (the bound when one did not finish), seconds.
    pub fn guest_seconds(&self) -> f64 {
        let ns = self
            .vms
            .iter()
            .map(|v| v.finish_ns.unwrap_or(self.end_ns))
            .max()
            .unwrap_or(0);
        ns as f64 / 1e9
    }
}

/// The simulation's clock, shared with the slot policy.
#[derive(Debug, Default)]
struct SimClock(Arc<AtomicU64>);

impl SlotClock for SimClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Collects grants, and waiters that became the queue's head, for the event loop.
#[derive(Debug, Default)]
struct Grants {
    granted: Arc<Mutex<Vec<usize>>>,
    heads: Arc<Mutex<Vec<usize>>>,
}

impl SlotWaker for Grants {
    fn granted(&self, v: usize) {
        lock(&self.granted).push(v);
    }

    fn new_head(&self, v: usize) {
        lock(&self.heads).push(v);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The guest state the slot policy reads, and the preemptions it asks for.
#[derive(Debug, Default)]
struct Signals {
    /// The vCPU whose guest says it is in a critical section (CS_DEPTH; none for stock).
    in_cs: Option<usize>,
    preempts: Mutex<Vec<usize>>,
}

impl SlotSignals for Signals {
    fn in_critical_section(&self, v: usize) -> bool {
        self.in_cs == Some(v)
    }
    fn preempt(&self, v: usize) {
        lock(&self.preempts).push(v);
    }
}

/// What a vCPU's guest (or its thread in the VMM) is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    /// Work between critical sections.
    Ncs,
    /// Taking the lock handed to it (or found free).
    Take,
    /// Inside the critical section.
    Cs,
    /// Spinning for the lock (until its budget's deadline with PV).
    Spin,
    /// The kicker's cost after a release.
    Kick,
    /// The unlocker, back in its guest after a kick, looks at the next waiter to pre-wake.
    Prewake,
    /// A WAIT's exit, before the thread blocks.
    WaitExit,
    /// Back from a wake-up, before the guest runs.
    Resume,
    /// A forced exit (the slot policy asked it to leave).
    SignalExit,
    /// `KVM_RUN` entered again on a vCPU whose halt inside KVM a signal ended: its guest runs
    /// if a kick came meanwhile, else it halts in KVM again.
    Reenter,
    /// Blocked until a kick.
    Halted,
    /// Blocked until a run slot.
    SlotWait,
    /// Finished its iterations.
    Done,
}

impl Act {
    fn timed(self) -> bool {
        matches!(
            self,
            Act::Ncs
                | Act::Take
                | Act::Cs
                | Act::Kick
                | Act::Prewake
                | Act::WaitExit
                | Act::Resume
                | Act::SignalExit
                | Act::Reenter
        )
    }
}

#[derive(Clone, Debug)]
struct Vcpu {
    vm: u32,
    idx: u32,
    act: Act,
    /// CPU time left of a timed act.
    left: u64,
    /// When the current running stretch of the act began.
    act_t0: u64,
    /// Validates the pending guest event.
    token: u64,
    /// Validates a pending wake-up or slot retry.
    wake_token: u64,
    acq: u64,
    spin_deadline: u64,
    /// When its thread last lost its CPU.
    off_cpu_at: u64,
    wait_t0: u64,
    kick_latched: bool,
    /// Blocked in KVM as the halt watcher's probe reads it: from the halt until the woken
    /// thread gets a CPU.
    halted_in_kvm: bool,
    signal_pending: bool,
    /// The act a forced exit or a slot wait interrupted.
    saved: Option<(Act, u64)>,
    /// Whether the thread is on a CPU.
    on_cpu: bool,
    boost_token: u64,
    /// When it began to wait for a slot.
    slot_since: u64,
    /// Backoff lock: it was two or more places from the head, so it sleeps between looks.
    backed_off: bool,
    /// Stock qspinlock: this queue head is hashed (it halted as the head, or was halted when
    /// the head was handed to it), so after its kick it spins until it gets the lock:
    /// `pv_wait(&locked, SLOW)` returns at once on a lock that is not `SLOW` again.
    hashed_head: bool,
    /// KVM's halt-polling window for this vCPU (grown and shrunk after each halt as KVM does).
    halt_poll_ns: u64,
    /// When its current halt began, and the host CPU it halted on if KVM polls there (no
    /// other thread was runnable on it: `single_task_running`).
    halt_t0: u64,
    poll_cpu: Option<u32>,
    /// Its thread is being switched onto its CPU until then: its guest runs after.
    busy_until: u64,
    /// Stock qspinlock: its MCS node's `state` is not `RUNNING`, from the `HALTED` stored
    /// before its WAIT's exit until its guest runs again after the wait (the `cmpxchg` back
    /// to `RUNNING`, or the head's next spin round), which `pv_wait_early` reads.
    waiting_mark: bool,
    /// Its last kick found KVM still polling: the thread never left its CPU, so running it
    /// again is no context switch.
    polled_wake: bool,
    /// A spinner switched in: its next guest event is its first look at the lock.
    look_pending: bool,
    /// Stock qspinlock with the hybrid trylock: it spins for the lock byte outside the queue
    /// (in [`LockState::spinners`]), stealing it when free and not pending.
    stealing: bool,
    /// pvspin guest: an unlocker kicked it since it last said it halts (its ticket wait slot
    /// says KICKED, its MCS node RUNNING), so no other unlocker kicks it for this wait.
    kicked: bool,
    /// The unlocker's pre-wake still to do: the waiters behind the new holder, the last one
    /// first, each with its acquisitions then (a waiter that took the lock since is no longer
    /// the one meant).
    prewake_pending: Vec<(u32, u64)>,
}

impl Vcpu {
    /// Whether its guest is in its WAIT, exiting to halt or halted, also while a signal that
    /// ended its halt has it out of `KVM_RUN` (its wait slot says HALTED: unlockers kick it).
    fn in_guest_wait(&self) -> bool {
        matches!(self.act, Act::Halted | Act::WaitExit | Act::Reenter)
            || matches!(self.saved, Some((Act::Reenter, _)))
    }
}

#[derive(Debug, Default)]
struct LockState {
    owner: Option<u32>,
    /// The owner is inside its critical section (not just handed the lock).
    in_cs: bool,
    queue: VecDeque<u32>,
    /// TAS spinners; the stock guest's hybrid trylock's stealers.
    spinners: Vec<u32>,
    /// Stock qspinlock: the pending bit. The queue head sets it while it spins for the lock
    /// and clears it when it takes the lock or stops to halt; while it is set nobody steals.
    /// A head whose thread is preempted mid-spin keeps it set, so a released lock stays free
    /// until that thread runs again (lock-waiter preemption).
    pending: bool,
    /// Backoff lock: the waiters' estimate of one hand-over, ns (an EWMA of the time between
    /// releases, as its waiters sample it, clamped to the unit's bounds).
    unit_ns: u64,
    last_release: u64,
}

struct Vm {
    base: u32,
    n: u32,
    lock: LockState,
    slots: Option<Rc<RunSlots>>,
    granted: Arc<Mutex<Vec<usize>>>,
    /// Waiters that became the slot queue's head: they ask again (the policy's timer waiter).
    heads: Arc<Mutex<Vec<usize>>>,
    clock: Arc<AtomicU64>,
    budgets: PageBudgets,
    policy: DirectedYield,
    board: VcpuBoard,
    trial: BoostTrial,
    /// The host's `VCPUS_FIT` for this VM: its vCPUs fit its entitlement (and its slots).
    vcpus_fit: bool,
    /// Waiters behind the new holder an unlocker pre-wakes (`SimConfig::prewake_depth`).
    prewake: usize,
    watch_armed: bool,
    watch_set: Vec<usize>,
    /// The halt watcher's host thread (with slots on a path that halts in KVM): a VMM thread
    /// that needs a CPU for each poll, like any other.
    watcher: Option<u32>,
    /// Validates the watcher's pending poll (a preempted poll starts again).
    watch_token: u64,
    done: u32,
    report: VmReport,
}

/// Events, ordered by time then sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Ev {
    Tick(u32),
    Guest(u32, u64),
    Wake(u32, u64),
    SlotRetry(u32, u64),
    SlotWake(u32, u64),
    SlotPoll(u32),
    WatchRun(u32, u64),
    Signal(u32),
    BoostEnd(u32, u64),
    Period(u32),
    Balance,
}

/// One simulation: build it with [`Sim::new`], run it with [`Sim::run`].
pub struct Sim {
    pub(crate) cfg: SimConfig,
    pub(crate) cost: CostModel,
    pub(crate) rng: SimRng,
    pub(crate) now: u64,
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    events: u64,
    pub(crate) threads: Vec<Thread>,
    pub(crate) cpus: Vec<Cpu>,
    pub(crate) idle: std::collections::BTreeSet<u32>,
    pub(crate) groups: Vec<Group>,
    pub(crate) queued_total: usize,
    /// Idle CPU time while threads were queued ([`Report::idle_while_queued_ns`]).
    idle_while_queued_ns: u64,
    /// [`Report::wakeups_onto_vcpu`].
    pub(crate) wakeups_onto_vcpu: (u64, u64),
    vcpus: Vec<Vcpu>,
    vms: Vec<Vm>,
    pub(crate) min_gran: u64,
    pub(crate) latency: u64,
    pub(crate) wakeup_gran: u64,
    cs_ns: u64,
    ncs_ns: u64,
    end_ns: u64,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("now", &self.now)
            .field("cfg", &self.cfg)
            .finish()
    }
}

fn draw(rng: &mut SimRng, s: Span) -> u64 {
    rng.range(s.lo, s.hi)
}

/// `nominal`, varied uniformly by up to `pct` percent either way (no draw without a spread,
/// so runs without one stay as they were).
fn jittered(rng: &mut SimRng, nominal: u64, pct: u64) -> u64 {
    let spread = nominal.saturating_mul(pct) / 100;
    if spread == 0 {
        return nominal;
    }
    rng.range(nominal - spread, nominal.saturating_add(spread))
}

impl Sim {
    /// Sets up the host, the VMs and pvspin's policies for `cfg`.
    pub fn new(cfg: SimConfig) -> Result<Self, SimError> {
        cfg.validate()?;
        let cost = cfg.cost.clone();
        let factor = CostModel::sched_factor(cfg.host_cpus);
        let nv = cfg.vms * cfg.vcpus;
        let mut threads = Vec::with_capacity(nv + cfg.hogs);
        let mut groups = Vec::new();
        let mut vms = Vec::with_capacity(cfg.vms);
        let mut vcpus = Vec::with_capacity(nv);
        let v = cfg.variant;
        for m in 0..cfg.vms {
            let group = cfg.cpu_limit.map(|l| {
                let quota = (l * cfg.quota_period_ns as f64) as u64;
                groups.push(Group::new(quota, cfg.quota_period_ns));
                (groups.len() - 1) as u32
            });
            let clock = Arc::new(AtomicU64::new(0));
            let granted = Arc::new(Mutex::new(Vec::new()));
            let heads = Arc::new(Mutex::new(Vec::new()));
            let slots = if v.slots {
                let mut sc = SlotConfig::new(cfg.slot_count());
                if let Some(ns) = cfg.slot_quantum_ns {
                    sc.quantum = Duration::from_nanos(ns);
                }
                if let Some(ns) = cfg.halt_watch_ns {
                    sc.halt_watch_interval = Duration::from_nanos(ns);
                }
                let s = RunSlots::with_clock(cfg.vcpus, sc, Box::new(SimClock(clock.clone())))?
                    .with_waker(Box::new(Grants {
                        granted: granted.clone(),
                        heads: heads.clone(),
                    }));
                Some(Rc::new(s))
            } else {
                None
            };
            let notify = v.pv == PvMode::KickYield;
            // As pvspin's builder: a VM with more vCPUs than run slots on the userspace path
            // has the higher budget floor.
            let gated = slots.as_ref().is_some_and(|s| s.config().slots < cfg.vcpus);
            let budget_config = if gated && v.path == KickPath::Userspace {
                BudgetConfig::default().for_run_slots()
            } else {
                BudgetConfig::default()
            };
            vms.push(Vm {
                base: (m * cfg.vcpus) as u32,
                n: cfg.vcpus as u32,
                lock: LockState::default(),
                slots,
                granted,
                heads,
                clock,
                budgets: PageBudgets::new(cfg.vcpus, budget_config, notify)?,
                policy: DirectedYield::new(PolicyConfig {
                    boost_running_hint: true,
                    ..PolicyConfig::default()
                })?,
                board: VcpuBoard::new(cfg.vcpus)?,
                trial: BoostTrial::new(TrialConfig::default()),
                vcpus_fit: cfg.vcpus_fit(),
                prewake: cfg.prewake_depth(),
                watch_armed: false,
                watch_set: Vec::new(),
                watcher: None,
                watch_token: 0,
                done: 0,
                report: VmReport::default(),
            });
            for i in 0..cfg.vcpus {
                let tid = threads.len();
                threads.push(Thread::new(group, (tid % cfg.host_cpus) as u32));
                if let Some(g) = group {
                    groups[g as usize].members.push(tid as u32);
                }
                vcpus.push(Vcpu {
                    vm: m as u32,
                    idx: i as u32,
                    act: Act::Ncs,
                    left: 0,
                    act_t0: 0,
                    token: 0,
                    wake_token: 0,
                    acq: 0,
                    spin_deadline: 0,
                    off_cpu_at: 0,
                    wait_t0: 0,
                    kick_latched: false,
                    halted_in_kvm: false,
                    signal_pending: false,
                    saved: None,
                    on_cpu: false,
                    boost_token: 0,
                    slot_since: 0,
                    backed_off: false,
                    hashed_head: false,
                    halt_poll_ns: 0,
                    halt_t0: 0,
                    poll_cpu: None,
                    busy_until: 0,
                    polled_wake: false,
                    look_pending: false,
                    waiting_mark: false,
                    kicked: false,
                    stealing: false,
                    prewake_pending: Vec::new(),
                });
            }
        }
        for _ in 0..cfg.hogs {
            let tid = threads.len();
            threads.push(Thread::new(None, (tid % cfg.host_cpus) as u32));
        }
        if v.slots && v.path.halts_in_kvm() {
            for (m, vm) in vms.iter_mut().enumerate() {
                let tid = threads.len();
                let group = cfg.cpu_limit.map(|_| m as u32);
                threads.push(Thread::new(group, (tid % cfg.host_cpus) as u32));
                if let Some(g) = group {
                    groups[g as usize].members.push(tid as u32);
                }
                vm.watcher = Some(tid as u32);
            }
        }
        let mut rng = SimRng::new(cfg.seed);
        // Host CPUs' ticks are not in step with each other or with the workload.
        let cpus = (0..cfg.host_cpus)
            .map(|_| Cpu {
                tick_phase: rng.range(0, cost.tick_ns.saturating_sub(1)),
                ..Cpu::default()
            })
            .collect();
        let idle = (0..cfg.host_cpus as u32).collect();
        let end_ns = cfg.duration_ns.unwrap_or(cfg.bound_ns);
        Ok(Self {
            rng,
            cs_ns: cost.work_ns(cfg.cs_work),
            ncs_ns: cost.work_ns(cfg.ncs_work),
            min_gran: cost.min_granularity_ns * factor,
            latency: cost.latency_ns * factor,
            wakeup_gran: cost.wakeup_granularity_ns * factor,
            cost,
            cfg,
            now: 0,
            heap: BinaryHeap::new(),
            seq: 0,
            events: 0,
            threads,
            cpus,
            idle,
            groups,
            queued_total: 0,
            idle_while_queued_ns: 0,
            wakeups_onto_vcpu: (0, 0),
            vcpus,
            vms,
            end_ns,
        })
    }

    pub(crate) fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, ev)));
    }

    /// Whether thread `tid` is a vCPU thread.
    pub(crate) fn is_vcpu(&self, tid: u32) -> bool {
        (tid as usize) < self.vcpus.len()
    }

    /// Runs to the end (every VM finished, the bound, or the duration) and reports.
    pub fn run(mut self) -> Report {
        self.start_all();
        self.run_loop();
        self.finish()
    }

    /// Puts every thread on the host at time 0.
    fn start_all(&mut self) {
        let nv = self.vcpus.len() as u32;
        for tid in 0..nv {
            let first = self.rng.range(0, self.ncs_ns);
            let vc = &mut self.vcpus[tid as usize];
            vc.act = Act::Ncs;
            vc.left = first;
        }
        for tid in 0..self.threads.len() as u32 {
            // Before its first KVM_RUN a vCPU asks for a slot; a halt watcher sleeps until it
            // is armed.
            if (tid < nv && !self.slot_enter(tid)) || self.watcher_vm(tid).is_some() {
                continue;
            }
            self.make_runnable(tid);
        }
        for g in 0..self.groups.len() as u32 {
            let p = self.groups[g as usize].period;
            self.at(p, Ev::Period(g));
        }
        let b = self.cost.balance_ns;
        self.at(b, Ev::Balance);
    }

    fn run_loop(&mut self) {
        let by_iterations = self.cfg.iterations.is_some();
        while let Some(Reverse((t, _, ev))) = self.heap.pop() {
            if t > self.end_ns {
                break;
            }
            if self.queued_total > 0 {
                let idle = self.idle.len() as u64;
                self.idle_while_queued_ns += t.saturating_sub(self.now) * idle;
            }
            self.now = t;
            self.events += 1;
            for vm in &self.vms {
                vm.clock.store(t, Ordering::Relaxed);
            }
            self.handle(ev);
            if by_iterations && self.vms.iter().all(|vm| vm.done == vm.n) {
                break;
            }
        }
    }

    /// One line per vCPU and the lock: for debugging a run that did not finish.
    pub fn state_dump(&self) -> String {
        let mut out = String::new();
        for (i, vm) in self.vms.iter().enumerate() {
            out += &format!(
                "vm {i}: owner {:?} in_cs {} queue {:?} spinners {:?}\n",
                vm.lock.owner, vm.lock.in_cs, vm.lock.queue, vm.lock.spinners
            );
            for v in vm.base..vm.base + vm.n {
                let vc = &self.vcpus[v as usize];
                let holds = vm
                    .slots
                    .as_ref()
                    .map(|s| (s.holds(vc.idx as usize), s.lent(vc.idx as usize)));
                out += &format!(
                    "  v{v}: {:?} left {} acq {} thread {:?} on_cpu {} kvm_halt {} latched {} saved {:?} slot(holds, lent) {:?}\n",
                    vc.act, vc.left, vc.acq, self.threads[v as usize].state, vc.on_cpu,
                    vc.halted_in_kvm, vc.kick_latched, vc.saved, holds
                );
            }
        }
        out
    }

    fn finish(mut self) -> Report {
        if std::env::var_os("PVSPIN_SIM_DUMP").is_some() {
            eprint!("{}", self.state_dump());
        }
        let by_iterations = self.cfg.iterations.is_some();
        if !by_iterations {
            self.now = self.end_ns;
        }
        for cpu in 0..self.cpus.len() as u32 {
            self.account(cpu);
        }
        let finished = self.vms.iter().all(|vm| vm.done == vm.n);
        let vms = self
            .vms
            .iter()
            .map(|vm| {
                let mut r = vm.report.clone();
                r.slots = vm.slots.as_ref().map(|s| s.stats());
                r
            })
            .collect();
        Report {
            vms,
            end_ns: self.now,
            events: self.events,
            finished,
            thread_cpu_ns: self.threads.iter().map(|t| t.cpu_ns).collect(),
            throttled_periods: self.groups.iter().map(|g| g.throttled_periods).collect(),
            idle_while_queued_ns: self.idle_while_queued_ns,
            wakeups_onto_vcpu: self.wakeups_onto_vcpu,
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Tick(cpu) => self.tick(cpu),
            Ev::Balance => {
                self.balance();
                let b = self.cost.balance_ns;
                self.at(self.now + b, Ev::Balance);
            }
            Ev::Period(g) => self.period(g),
            Ev::Guest(v, token) => {
                let vc = &self.vcpus[v as usize];
                if vc.token == token && vc.on_cpu {
                    self.step_done(v);
                }
            }
            Ev::Wake(v, token) => {
                if self.vcpus[v as usize].wake_token == token {
                    self.kick_wake(v);
                }
            }
            Ev::SlotRetry(v, token) => {
                let vc = &self.vcpus[v as usize];
                if vc.wake_token == token && vc.act == Act::SlotWait {
                    self.slot_retry(v);
                }
            }
            Ev::SlotWake(v, token) => {
                if self.vcpus[v as usize].wake_token == token
                    && self.threads[v as usize].state == TState::Blocked
                {
                    self.make_runnable(v);
                }
            }
            Ev::SlotPoll(m) => self.watch_due(m as usize),
            Ev::WatchRun(m, token) => {
                let m = m as usize;
                if self.vms[m].watch_token == token {
                    self.watch_run(m);
                }
            }
            Ev::Signal(v) => {
                // The signal lands: at once on a CPU, else when the thread next runs; a halt
                // inside KVM it ends at once.
                if self.vcpus[v as usize].act == Act::Halted && self.cfg.variant.path.halts_in_kvm()
                {
                    self.halt_interrupted(v);
                } else if self.vcpus[v as usize].on_cpu {
                    self.forced_exit(v);
                } else {
                    self.vcpus[v as usize].signal_pending = true;
                }
            }
            Ev::BoostEnd(tid, token) => {
                if self.vcpus[tid as usize].boost_token == token {
                    self.set_weight(tid, 1024);
                }
            }
        }
    }

    // ---- the guest's steps ----

    /// Schedules the pending event of a running vCPU's act.
    fn arm(&mut self, v: u32) {
        let now = self.now;
        let vc = &mut self.vcpus[v as usize];
        vc.token += 1;
        // A thread being switched in runs its guest once the switch is done.
        let t0 = now.max(vc.busy_until);
        vc.act_t0 = t0;
        let token = vc.token;
        let at = if vc.act.timed() {
            Some(t0 + vc.left)
        } else if vc.act == Act::Spin && vc.spin_deadline != u64::MAX {
            Some(vc.spin_deadline.max(t0))
        } else {
            None
        };
        if let Some(at) = at {
            self.at(at, Ev::Guest(v, token));
        }
    }

    /// Starts `act` for `left` ns on a running vCPU.
    fn start(&mut self, v: u32, act: Act, left: u64) {
        let vc = &mut self.vcpus[v as usize];
        vc.act = act;
        vc.left = left;
        if vc.on_cpu {
            self.arm(v);
        }
    }

    /// The thread of vCPU `v` got a CPU (called by the scheduler); `switched`: another
    /// thread (or the idle task) ran there before it, so it pays a context switch first,
    /// unless KVM was still polling its halt (it never left the CPU).
    pub(crate) fn vcpu_dispatched(&mut self, v: u32, switched: bool) {
        let now = self.now;
        let cs = self.cost.context_switch_ns;
        let vc = &mut self.vcpus[v as usize];
        vc.on_cpu = true;
        // KVM clears `blocking` when the woken thread runs.
        vc.halted_in_kvm = false;
        let polled = std::mem::take(&mut vc.polled_wake);
        vc.busy_until = if switched && !polled { now + cs } else { now };
        if std::mem::take(&mut vc.signal_pending) {
            // immediate_exit: KVM_RUN returns at once.
            let r = self.cost.resume_ns;
            self.interrupt(v, r);
            return;
        }
        // The stock guest's threshold counts spins (Linux's `SPIN_THRESHOLD` loops): a
        // spinner that lost its CPU goes on with the spins it had left. The pvspin guest's
        // budget is time (its TSC), which ran on meanwhile.
        if vc.act == Act::Spin
            && vc.spin_deadline != u64::MAX
            && self.cfg.variant.guest == Guest::Stock
        {
            vc.spin_deadline = vc
                .spin_deadline
                .saturating_add(now.saturating_sub(vc.off_cpu_at));
        }
        if vc.act == Act::Spin {
            if vc.busy_until > now {
                // It looks at the lock once it is switched in.
                vc.look_pending = true;
                vc.token += 1;
                vc.act_t0 = vc.busy_until;
                let (t, token) = (vc.busy_until, vc.token);
                self.at(t, Ev::Guest(v, token));
            } else {
                self.spin_check(v);
            }
        } else {
            self.arm(v);
        }
    }

    /// The thread of vCPU `v` lost its CPU: charge what it ran, cancel its event.
    pub(crate) fn vcpu_descheduled(&mut self, v: u32) {
        let now = self.now;
        let vc = &mut self.vcpus[v as usize];
        vc.on_cpu = false;
        vc.off_cpu_at = now;
        vc.look_pending = false;
        if vc.act.timed() {
            vc.left = vc.left.saturating_sub(now.saturating_sub(vc.act_t0));
        }
        vc.token += 1;
    }

    fn step_done(&mut self, v: u32) {
        let act = self.vcpus[v as usize].act;
        match act {
            Act::Ncs => self.acquire(v),
            Act::Take => {
                let m = self.vcpus[v as usize].vm as usize;
                let vm = &mut self.vms[m];
                if vm.lock.in_cs || vm.lock.owner != Some(v) {
                    vm.report.exclusion_violations += 1;
                }
                vm.lock.in_cs = true;
                let cs = self.section_ns(self.cs_ns);
                self.start(v, Act::Cs, cs);
            }
            Act::Cs => self.release(v),
            Act::Kick => {
                // Pre-wakes left: the guest goes on with them (after the exit, if it was one).
                if self.vcpus[v as usize].prewake_pending.is_empty() {
                    self.after_release(v);
                } else {
                    self.start(v, Act::Prewake, 0);
                }
                let vc = &self.vcpus[v as usize];
                if vc.act == Act::Done || self.cfg.variant.path == KickPath::InKernel {
                    return;
                }
                // The kick was an exit: the slot policy sees it.
                if !self.slot_exited(v) && !self.slot_enter(v) {
                    return;
                }
                self.vcpus[v as usize].saved = None;
            }
            // Switched in: it looks at the lock first (its budget may have run out meanwhile:
            // then it waits after this look); else the budget ran out: wait.
            Act::Spin if std::mem::take(&mut self.vcpus[v as usize].look_pending) => {
                self.spin_check(v);
            }
            Act::Spin => self.wait(v),
            Act::Prewake => self.prewake_next(v),
            Act::WaitExit => self.wait_exited(v),
            Act::Resume => self.spin_start(v),
            Act::SignalExit => {
                if self.slot_exited(v) || self.slot_enter(v) {
                    self.restore(v);
                }
            }
            Act::Reenter => self.reenter(v),
            Act::Halted | Act::SlotWait | Act::Done => {}
        }
    }

    /// Puts back the act a forced exit or a slot wait interrupted.
    fn restore(&mut self, v: u32) {
        match self.vcpus[v as usize].saved.take() {
            Some((Act::Spin, _)) => self.spin_start(v),
            Some((act, left)) => self.start(v, act, left),
            None => {
                let l = self.vcpus[v as usize].left;
                let a = self.vcpus[v as usize].act;
                self.start(v, a, l);
            }
        }
    }

    fn acquire(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let lk = &mut self.vms[m].lock;
        // A stock guest's fast path or a steal attempt takes a free lock unless a
        // queue head spins for it (pending).
        if lk.owner.is_none()
            && (self.cfg.variant.lock == LockKind::Tas
                || lk.queue.is_empty()
                || (self.cfg.variant.guest == Guest::Stock && !lk.pending))
        {
            let stole = !lk.queue.is_empty();
            lk.owner = Some(v);
            if stole {
                self.vms[m].report.steals += 1;
            }
            let t = self.cost.uncontended_ns;
            self.start(v, Act::Take, t);
            return;
        }
        self.vms[m].report.contended += 1;
        let lk = &mut self.vms[m].lock;
        // The hybrid trylock: others are queued and no head spins with pending set, so it
        // keeps trying to steal instead of queueing.
        let steals = self.cfg.variant.guest == Guest::Stock
            && self.cfg.variant.pv != PvMode::Off
            && self.cfg.stock_hybrid_trylock
            && !lk.queue.is_empty()
            && !lk.pending;
        if self.cfg.variant.lock == LockKind::Tas || steals {
            lk.spinners.push(v);
        } else {
            lk.queue.push_back(v);
        }
        if steals {
            let vc = &mut self.vcpus[v as usize];
            vc.stealing = true;
            vc.act = Act::Spin;
            vc.spin_deadline = u64::MAX;
            if vc.on_cpu {
                self.spin_check(v);
            }
            return;
        }
        // Two or more places from the head (a holder and a waiter ahead): backoff sleeps.
        let deep = lk.queue.len() >= 2;
        self.vcpus[v as usize].backed_off = self.cfg.variant.lock == LockKind::Backoff && deep;
        self.spin_start(v);
    }

    /// A spin phase begins (at the slow path's start, or after a wake-up).
    fn spin_start(&mut self, v: u32) {
        let var = self.cfg.variant;
        let deadline = match (var.pv, var.guest) {
            (PvMode::Off, _) => u64::MAX,
            // A hashed stock head spins round after round until it gets the lock.
            (_, Guest::Stock) if self.vcpus[v as usize].hashed_head => u64::MAX,
            // A stealer of the hybrid trylock never halts: it spins until it steals or queues.
            (_, Guest::Stock) if self.vcpus[v as usize].stealing => u64::MAX,
            (_, Guest::Stock) => self.now + self.cost.stock_spin_threshold * self.cost.pause_ns,
            _ => {
                let vc = &self.vcpus[v as usize];
                let b = self.vms[vc.vm as usize].budgets.budgets();
                self.now + b.wait_after_ns(vc.idx as usize)
            }
        };
        let vc = &mut self.vcpus[v as usize];
        // Its guest runs again: out of a wait, its node says RUNNING.
        vc.waiting_mark = false;
        vc.act = Act::Spin;
        vc.spin_deadline = deadline;
        if vc.on_cpu {
            self.spin_check(v);
        }
    }

    /// A spinning vCPU on a CPU looks at the lock: takes it if handed (or free), waits early
    /// if what it waits for does not run, else spins on.
    fn spin_check(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let var = self.cfg.variant;
        let h = self.cost.handoff_ns[lock_index(var.lock, var.guest)];
        if self.vcpus[v as usize].stealing {
            self.steal_check(v);
            return;
        }
        let lk = &mut self.vms[m].lock;
        if lk.owner == Some(v) && !lk.in_cs {
            let late = self.backoff_lateness(v);
            self.start(v, Act::Take, h + late);
            return;
        }
        if lk.owner.is_none() {
            let can_take = match var.lock {
                LockKind::Tas => true,
                _ => lk.queue.front() == Some(&v),
            };
            if can_take {
                lk.owner = Some(v);
                lk.spinners.retain(|&w| w != v);
                if lk.queue.front() == Some(&v) {
                    lk.queue.pop_front();
                    self.vcpus[v as usize].hashed_head = false;
                    self.stock_head_passed(m);
                }
                self.start(v, Act::Take, h);
                return;
            }
        }
        if var.guest == Guest::Stock && var.pv != PvMode::Off && lk.queue.front() == Some(&v) {
            // The queue head spins for the lock byte with pending set.
            let was = std::mem::replace(&mut lk.pending, true);
            if !was {
                self.stealers_look(m);
            }
        }
        if var.pv != PvMode::Off && self.waits_early(v) {
            self.vms[m].report.early_waits += 1;
            self.wait(v);
            return;
        }
        self.arm(v);
    }

    /// The stock queue head took the lock and passed the head to its successor
    /// (`next->locked = 1`): a successor spinning on a CPU starts its head spin at once, with
    /// a fresh threshold, and sets pending; any other sets it when it next runs.
    fn stock_head_passed(&mut self, m: usize) {
        let var = self.cfg.variant;
        if var.guest != Guest::Stock {
            return;
        }
        let next = self.vms[m].lock.queue.front().copied();
        let spinning = next.filter(|&n| {
            let vc = &self.vcpus[n as usize];
            vc.on_cpu && vc.act == Act::Spin && var.pv != PvMode::Off
        });
        self.vms[m].lock.pending = spinning.is_some();
        if spinning.is_some() || self.vms[m].lock.queue.is_empty() {
            self.stealers_look(m);
        }
        if let Some(n) = spinning {
            let vc = &mut self.vcpus[n as usize];
            if !vc.hashed_head {
                vc.spin_deadline = self.now + self.cost.stock_spin_threshold * self.cost.pause_ns;
            }
            self.arm(n);
        }
    }

    /// A stealer of the stock hybrid trylock on a CPU looks at the lock: takes it if free and
    /// not pending; queues if pending is set or the queue is empty; else spins on.
    fn steal_check(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let h = self.cost.handoff_ns[lock_index(self.cfg.variant.lock, self.cfg.variant.guest)];
        let lk = &mut self.vms[m].lock;
        if lk.owner.is_none() && !lk.pending {
            lk.owner = Some(v);
            lk.spinners.retain(|&w| w != v);
            if !lk.queue.is_empty() {
                self.vms[m].report.steals += 1;
            }
            self.vcpus[v as usize].stealing = false;
            self.start(v, Act::Take, h);
            return;
        }
        if lk.pending || lk.queue.is_empty() {
            lk.spinners.retain(|&w| w != v);
            lk.queue.push_back(v);
            self.vcpus[v as usize].stealing = false;
            self.spin_start(v);
            return;
        }
        self.arm(v);
    }

    /// Pending was set, or the queue emptied: the stealers on a CPU see it at their next look
    /// and queue (the others when they run again).
    fn stealers_look(&mut self, m: usize) {
        let stealers: Vec<u32> = self.vms[m].lock.spinners.clone();
        for w in stealers {
            let vc = &self.vcpus[w as usize];
            if vc.stealing && vc.on_cpu && vc.act == Act::Spin && vc.busy_until <= self.now {
                self.steal_check(w);
            }
        }
    }

    /// How late a backoff waiter takes a lock handed to it: a waiter that was two or more
    /// places back sleeps a unit (or more) between looks, so it notices its turn up to a unit
    /// late (drawn uniformly); one that was next in line from the start polls every spin.
    fn backoff_lateness(&mut self, v: u32) -> u64 {
        if !std::mem::take(&mut self.vcpus[v as usize].backed_off) {
            return 0;
        }
        let m = self.vcpus[v as usize].vm as usize;
        let unit = self.vms[m].lock.unit_ns;
        self.rng.range(0, unit)
    }

    /// The vCPU `v` waits for: the holder (ticket), the predecessor (queued).
    fn waited_for(&self, v: u32) -> Option<u32> {
        let m = self.vcpus[v as usize].vm as usize;
        let lk = &self.vms[m].lock;
        if self.cfg.variant.lock == LockKind::Queued {
            if let Some(p) = lk.queue.iter().position(|&w| w == v) {
                if p > 0 {
                    return Some(lk.queue[p - 1]);
                }
            }
        }
        lk.owner.filter(|&o| o != v)
    }

    /// The vCPU that `v`'s WAIT names to the host (what run slots prioritize and directed
    /// yield boosts): what it waits for, except that a pvspin MCS waiter deeper than the
    /// holder's successor names the holder (its predecessor is another waiter; naming it gave
    /// waiters' slots priority over the next owners', docs/benchmarks.md §12.6).
    fn named(&self, v: u32) -> Option<u32> {
        let m = self.vcpus[v as usize].vm as usize;
        let lk = &self.vms[m].lock;
        if self.cfg.queued_names_holder
            && self.cfg.variant.lock == LockKind::Queued
            && self.cfg.variant.guest == Guest::Pvspin
        {
            let deep = lk
                .queue
                .iter()
                .position(|&w| w == v)
                .is_some_and(|p| p >= 2);
            // No holder recorded (the guest's `holder` word is NONE): it names its predecessor.
            if let Some(owner) = lk.owner.filter(|&o| deep && o != v) {
                return Some(owner);
            }
        }
        self.waited_for(v)
    }

    /// pvspin guests wait at once when the hint page says the waited-for vCPU does not run
    /// (halted, or waiting for a slot); stock guests when its steal-time `preempted` byte is
    /// set (only run slots set it here: these hosts never do).
    fn waits_early(&self, v: u32) -> bool {
        let Some(w) = self.waited_for(v) else {
            return false;
        };
        let wa = self.vcpus[w as usize].act;
        match self.cfg.variant.guest {
            Guest::Pvspin => {
                // Today's guest: not behind a next owner that was handed the lock (kicked)
                // and is on its way to it, when the host says the VM's vCPUs fit its CPUs.
                let vm = &self.vms[self.vcpus[v as usize].vm as usize];
                let lk = &vm.lock;
                let waking = lk.owner == Some(w) && !lk.in_cs && wa == Act::Halted;
                let spin_on = waking && vm.vcpus_fit && !self.cfg.early_wait_behind_waking;
                matches!(wa, Act::Halted | Act::SlotWait) && !spin_on
            }
            Guest::Stock => {
                let vc = &self.vcpus[v as usize];
                let lk = &self.vms[vc.vm as usize].lock;
                if lk.queue.front() == Some(&v) {
                    // The head stops spinning when the holder's `preempted` byte is set
                    // (only slots set it here); a hashed head would only spin again.
                    wa == Act::SlotWait && !vc.hashed_head
                } else {
                    // `pv_wait_early`: the predecessor's node is not running (halted).
                    self.vcpus[w as usize].waiting_mark
                }
            }
        }
    }

    /// The spin budget ran out (or the waited-for vCPU does not run): WAIT.
    fn wait(&mut self, v: u32) {
        let var = self.cfg.variant;
        if var.guest == Guest::Pvspin {
            if let Some(w) = self.named(v) {
                let m = self.vcpus[v as usize].vm as usize;
                let local = (w - self.vms[m].base) as usize;
                if let Some(s) = self.vms[m].slots.clone() {
                    s.prioritize(local);
                }
                if var.pv == PvMode::KickYield {
                    self.directed_yield(v, w);
                }
            }
        }
        if var.guest == Guest::Stock {
            // The head clears pending before it hashes itself and halts.
            let lk = &mut self.vms[self.vcpus[v as usize].vm as usize].lock;
            if lk.queue.front() == Some(&v) {
                lk.pending = false;
            }
        }
        let vc = &mut self.vcpus[v as usize];
        // A backoff waiter stops backing off when it waits; woken, it looks at once.
        vc.backed_off = false;
        // Its wait slot (node) says HALTED again: unlockers may kick it.
        vc.kicked = false;
        vc.wait_t0 = self.now;
        vc.waiting_mark = var.guest == Guest::Stock;
        let t = draw(&mut self.rng, self.cost.wait_exit);
        self.start(v, Act::WaitExit, t);
        // A stock node's state says HALTED before the exit: its successor sees it now.
        if var.guest == Guest::Stock {
            self.not_running_now(v);
        }
    }

    /// The WAIT reached the VMM: back at once if the lock came or a kick is latched, else
    /// block until a kick.
    fn wait_exited(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let lk = &self.vms[m].lock;
        // The last look before halting (the PV handshake; for the qspinlock's queue head, the
        // cmpxchg that marks the lock SLOW fails on a free lock, and the head takes it).
        let handed = lk.owner == Some(v)
            || (lk.owner.is_none()
                && self.cfg.variant.guest == Guest::Stock
                && lk.queue.front() == Some(&v));
        let vc = &mut self.vcpus[v as usize];
        if handed || std::mem::take(&mut vc.kick_latched) {
            let r = self.cost.resume_ns;
            self.start(v, Act::Resume, r);
            return;
        }
        let path = self.cfg.variant.path;
        let local = vc.idx as usize;
        vc.act = Act::Halted;
        vc.wake_token += 1;
        self.vms[m].report.halts += 1;
        self.vms[m].board.on_halt(local);
        if path.halts_in_kvm() {
            self.halt_in_kvm(v);
        } else if let Some(s) = self.vms[m].slots.clone() {
            s.leave(local);
            self.drain(m);
        }
        self.block(v);
        self.not_running_now(v);
    }

    /// `v` stopped running (halted, or waits for a slot): spinners on a CPU that wait for it
    /// see that in their next look (the hint page's NOT_RUNNING for pvspin guests, the
    /// steal-time `preempted` byte that slots set for stock guests) and wait now.
    fn not_running_now(&mut self, v: u32) {
        if self.cfg.variant.pv == PvMode::Off {
            return;
        }
        let m = self.vcpus[v as usize].vm as usize;
        let lk = &self.vms[m].lock;
        // Who waits for `v`: every waiter of a ticket lock `v` holds; the successor of `v` in
        // a queued lock (the head, when `v` holds it). One pass, not one search per waiter.
        let waiters: Vec<u32> = match self.cfg.variant.lock {
            LockKind::Queued => {
                let next = if lk.owner == Some(v) {
                    lk.queue.front().copied()
                } else {
                    lk.queue
                        .iter()
                        .position(|&w| w == v)
                        .and_then(|p| lk.queue.get(p + 1).copied())
                };
                next.into_iter().collect()
            }
            _ if lk.owner == Some(v) => lk.queue.iter().copied().collect(),
            _ => Vec::new(),
        };
        for w in waiters {
            let vc = &self.vcpus[w as usize];
            if w != v && vc.on_cpu && vc.act == Act::Spin && self.waits_early(w) {
                self.vms[m].report.early_waits += 1;
                self.wait(w);
            }
        }
    }

    /// A kick's wake-up arrives: the thread becomes runnable.
    fn kick_wake(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let vc = &mut self.vcpus[v as usize];
        if vc.act != Act::Halted {
            return;
        }
        let local = vc.idx as usize;
        let waited = self.now.saturating_sub(vc.wait_t0);
        vc.act = Act::Resume;
        vc.left = self.cost.resume_ns;
        vc.wake_token += 1;
        let vm = &self.vms[m];
        vm.board.on_wake(local);
        if self.cfg.variant.guest == Guest::Pvspin {
            vm.budgets.budgets().on_wait(local, waited);
            if self.cfg.variant.pv == PvMode::KickYield {
                vm.trial.on_wait(waited);
            }
        }
        if !self.cfg.variant.path.halts_in_kvm() && self.vms[m].slots.is_some() {
            // Userspace path: out of the park, the vCPU asks for a slot before KVM_RUN.
            self.vcpus[v as usize].saved = Some((Act::Resume, self.cost.resume_ns));
            if !self.slot_enter(v) {
                return;
            }
            self.vcpus[v as usize].saved = None;
            self.vcpus[v as usize].act = Act::Resume;
        }
        self.make_runnable(v);
    }

    /// The critical section ended: release, kick a halted next owner.
    fn release(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let var = self.cfg.variant;
        let h = self.cost.handoff_ns[lock_index(var.lock, var.guest)];
        let vm = &mut self.vms[m];
        vm.lock.in_cs = false;
        vm.lock.owner = None;
        vm.report.acquisitions += 1;
        if var.lock == LockKind::Backoff {
            // The waiters' sample: the time between hand-overs, preemptions included.
            let (lo, hi) = self.cost.backoff_unit_spins;
            let (lo, hi) = (lo * self.cost.pause_ns, hi * self.cost.pause_ns);
            let sample = self.now.saturating_sub(vm.lock.last_release).clamp(lo, hi);
            let unit = vm.lock.unit_ns.clamp(lo, hi);
            vm.lock.unit_ns = (unit * 7 + sample) / 8;
            vm.lock.last_release = self.now;
        }
        self.vcpus[v as usize].acq += 1;
        let mut kicked = None;
        match var.lock {
            LockKind::Tas => self.hand_to_a_running_spinner(m, h),
            _ => {
                if let Some(&n) = vm.lock.queue.front() {
                    let na = self.vcpus[n as usize].act;
                    let n_on_cpu = self.vcpus[n as usize].on_cpu;
                    let blocked = self.vcpus[n as usize].in_guest_wait();
                    if var.guest == Guest::Stock && (blocked || !n_on_cpu) {
                        // The queue head takes a free lock when it runs; a newcomer may steal it
                        // first (unless it spins with pending set: then the lock waits for it). A
                        // halted head is kicked at this unlock (the lock was SLOW); it is hashed.
                        // Only the unlock that finds the lock SLOW kicks: once per halt (the
                        // kicked head, hashed, never halts again before it takes the lock).
                        if blocked && !self.vcpus[n as usize].hashed_head {
                            kicked = Some(n);
                            self.vcpus[n as usize].hashed_head = true;
                        }
                    } else {
                        vm.lock.queue.pop_front();
                        vm.lock.owner = Some(n);
                        // A stock head spinning on a CPU takes it (`trylock_clear_pending`).
                        self.vcpus[n as usize].hashed_head = false;
                        self.stock_head_passed(m);
                        if blocked {
                            // Not when a pre-wake kicked it already for this wait (its slot
                            // says KICKED, its node RUNNING): its wake-up is on the way.
                            if !self.vcpus[n as usize].kicked {
                                kicked = Some(n);
                            }
                        } else if n_on_cpu && na == Act::Spin {
                            let late = self.backoff_lateness(n);
                            self.start(n, Act::Take, h + late);
                        }
                    }
                }
            }
        }
        // The stock hybrid trylock: a stealer spinning on a CPU takes the free lock before a
        // queue head that is not there yet.
        if var.guest == Guest::Stock
            && self.vms[m].lock.owner.is_none()
            && !self.vms[m].lock.pending
        {
            self.hand_to_a_running_spinner(m, h);
        }
        // The pre-wake (`SimConfig::prewake`): the waiters behind the new holder, looked at
        // one by one after the new holder's kick, as the guest's unlocker does (each kick on
        // an exiting path is an exit, and the unlocker looks at the next waiter only when its
        // guest runs again).
        let depth = self.vms[m].prewake;
        if depth > 0 {
            let mut pending = std::mem::take(&mut self.vcpus[v as usize].prewake_pending);
            pending.clear();
            let queue = &self.vms[m].lock.queue;
            pending.extend(
                queue
                    .iter()
                    .take(depth)
                    .rev()
                    .map(|&w| (w, self.vcpus[w as usize].acq)),
            );
            self.vcpus[v as usize].prewake_pending = pending;
        }
        if let Some(n) = kicked.filter(|_| var.pv != PvMode::Off) {
            self.kick(v, n);
            self.start_kick(v);
            return;
        }
        self.prewake_next(v);
    }

    /// A free lock goes to a spinner on a CPU, drawn at random: a TAS spinner, or a stealer of
    /// the stock hybrid trylock that is past its switch-in (the one whose cmpxchg lands first).
    fn hand_to_a_running_spinner(&mut self, m: usize, h: u64) {
        let running: Vec<u32> = self.vms[m]
            .lock
            .spinners
            .iter()
            .copied()
            .filter(|&w| {
                let wc = &self.vcpus[w as usize];
                wc.on_cpu && wc.act == Act::Spin && (!wc.stealing || wc.busy_until <= self.now)
            })
            .collect();
        if running.is_empty() {
            return;
        }
        let w = running[self.rng.below(running.len())];
        let vm = &mut self.vms[m];
        vm.lock.owner = Some(w);
        vm.lock.spinners.retain(|&x| x != w);
        let vc = &mut self.vcpus[w as usize];
        if std::mem::take(&mut vc.stealing) && !vm.lock.queue.is_empty() {
            vm.report.steals += 1;
        }
        self.start(w, Act::Take, h);
    }

    /// The unlocker `v` pays its kick's cost (an exit on the exiting paths).
    fn start_kick(&mut self, v: u32) {
        let c = if self.cfg.variant.path == KickPath::InKernel {
            self.cost.kick_in_kernel
        } else {
            self.cost.kick_exit
        };
        let t = draw(&mut self.rng, c);
        self.start(v, Act::Kick, t);
    }

    /// The unlocker `v` pre-wakes the next waiter still halted for the wait it was in at the
    /// release (`cmpxchg(HALTED -> KICKED/RUNNING)` and a kick), if any is left; else its
    /// release is done.
    fn prewake_next(&mut self, v: u32) {
        while let Some((w, acq)) = self.vcpus[v as usize].prewake_pending.pop() {
            let wc = &self.vcpus[w as usize];
            if wc.acq != acq || wc.kicked || !wc.in_guest_wait() {
                continue;
            }
            let m = self.vcpus[v as usize].vm as usize;
            self.vms[m].report.prewakes += 1;
            self.kick(v, w);
            self.start_kick(v);
            return;
        }
        self.after_release(v);
    }

    fn after_release(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let vc = &mut self.vcpus[v as usize];
        if self.cfg.iterations.is_some_and(|k| vc.acq >= k) {
            vc.act = Act::Done;
            let local = vc.idx as usize;
            self.vms[m].done += 1;
            if self.vms[m].done == self.vms[m].n {
                self.vms[m].report.finish_ns = Some(self.now);
            }
            if let Some(s) = self.vms[m].slots.clone() {
                s.leave(local);
                self.drain(m);
            }
            self.block(v);
            return;
        }
        let t = self.section_ns(self.ncs_ns);
        self.start(v, Act::Ncs, t);
    }

    /// One section's length: `nominal`, varied by [`CostModel::work_jitter_pct`] (no draw
    /// without jitter, so runs without it stay as they were).
    fn section_ns(&mut self, nominal: u64) -> u64 {
        jittered(&mut self.rng, nominal, self.cost.work_jitter_pct)
    }

    /// `from` kicks `n`: the wake-up after the path's latency, or a latched kick.
    fn kick(&mut self, from: u32, n: u32) {
        let m = self.vcpus[from as usize].vm as usize;
        let var = self.cfg.variant;
        let base = self.vms[m].base;
        self.vms[m].report.kicks += 1;
        self.vms[m].board.kick((n - base) as usize);
        if var.path != KickPath::InKernel {
            if let Some(s) = self.vms[m].slots.clone() {
                s.hand_over((from - base) as usize, (n - base) as usize);
                self.drain(m);
                // A slot reserved for a vCPU out of `KVM_RUN` may put more holders than
                // slots: the policy wakes its watcher then.
                self.arm_watch(m);
            }
        }
        let polled = self.halt_polled(n);
        let vc = &mut self.vcpus[n as usize];
        vc.kicked = true;
        if vc.act == Act::Halted {
            // The measured kick-to-wake less what the woken thread pays on its CPU: the
            // resume, and the switch where the measurement included one. An unpolled wake
            // pays the switch when it gets a CPU; a polled one never left it.
            let p = var.path.index();
            let drawn = jittered(
                &mut self.rng,
                self.cost.kick_to_wake_ns[p],
                self.cost.kick_to_wake_jitter_pct,
            );
            let mut lat = drawn.saturating_sub(self.cost.resume_ns);
            if self.cost.kick_to_wake_switched[p] {
                lat = lat.saturating_sub(self.cost.context_switch_ns);
            }
            vc.polled_wake = polled;
            let token = vc.wake_token;
            self.at(self.now + lat, Ev::Wake(n, token));
        } else {
            vc.kick_latched = true;
        }
    }

    /// Whether KVM is still halt-polling for halted vCPU `n` now: it halted inside KVM with its
    /// CPU to itself, the window has not run out, and nothing else has run there since (a
    /// thread placed on that CPU ends the poll). Also adapts the window as KVM does after the
    /// block: grow (doubling from the first step) when the block was shorter than the limit,
    /// shrink (halving) when longer.
    fn halt_polled(&mut self, n: u32) -> bool {
        let vc = &self.vcpus[n as usize];
        if vc.act != Act::Halted || !self.cfg.variant.path.halts_in_kvm() {
            return false;
        }
        let blocked = self.now.saturating_sub(vc.halt_t0);
        let window = vc.halt_poll_ns;
        let polled = vc
            .poll_cpu
            .is_some_and(|c| blocked <= window && self.idle.contains(&c));
        let max = self.cost.halt_poll_max_ns;
        let next = if polled {
            window
        } else if window > 0 && blocked > max {
            window / 2
        } else if window < max && blocked < max {
            (window * 2).max(self.cost.halt_poll_grow_start_ns).min(max)
        } else {
            window
        };
        self.vcpus[n as usize].halt_poll_ns = next;
        polled
    }

    /// The host boosts the vCPU a WAIT names (pvspin's in-process directed yield).
    fn directed_yield(&mut self, v: u32, w: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let base = self.vms[m].base;
        let vm = &self.vms[m];
        let n = SpinNotification {
            spinner: (v - base) as usize,
            lock_id: 0,
            waiting_for: Some(w - base),
            spun: 0,
        };
        let out = vm.policy.decide(&vm.board, &n);
        let Decision::YieldTo(t, _) = out.decision else {
            return;
        };
        let running = vm.board.snapshot(t).is_some_and(|s| s.is_running());
        vm.budgets
            .on_notification((v - base) as usize, !running, None, 0);
        if running && !vm.trial.boosting() {
            return;
        }
        let tid = base + t as u32;
        self.vms[m].report.boosts += 1;
        let vc = &mut self.vcpus[tid as usize];
        vc.boost_token += 1;
        let token = vc.boost_token;
        let (bw, bn) = (self.cost.boost_weight, self.cost.boost_ns);
        self.set_weight(tid, bw);
        self.at(self.now + bn, Ev::BoostEnd(tid, token));
    }

    // ---- run slots ----

    fn signals(&self, m: usize) -> Signals {
        let lk = &self.vms[m].lock;
        let in_cs = match self.cfg.variant.guest {
            Guest::Pvspin => lk
                .owner
                .filter(|_| lk.in_cs)
                .map(|o| (o - self.vms[m].base) as usize),
            Guest::Stock => None,
        };
        Signals {
            in_cs,
            preempts: Mutex::new(Vec::new()),
        }
    }

    /// Before KVM_RUN: true when `v` holds a slot (or there are none); else it waits.
    fn slot_enter(&mut self, v: u32) -> bool {
        let m = self.vcpus[v as usize].vm as usize;
        let Some(s) = self.vms[m].slots.clone() else {
            return true;
        };
        let local = self.vcpus[v as usize].idx as usize;
        let sig = self.signals(m);
        let since = if self.vcpus[v as usize].act == Act::SlotWait {
            self.vcpus[v as usize].slot_since
        } else {
            self.now
        };
        self.vcpus[v as usize].slot_since = since;
        let r = s.poll_enter(local, since, &sig);
        self.apply(m, &sig);
        match r {
            Ok(_) => {
                self.vms[m].board.on_enter_run(local);
                true
            }
            Err(ns) => {
                let vc = &mut self.vcpus[v as usize];
                if vc.act != Act::SlotWait {
                    if vc.saved.is_none() {
                        vc.saved = Some((vc.act, vc.left));
                    }
                    vc.act = Act::SlotWait;
                }
                vc.wake_token += 1;
                let token = vc.wake_token;
                self.vms[m].board.park(local);
                self.at(self.now + ns.max(1_000), Ev::SlotRetry(v, token));
                self.arm_watch(m);
                if self.threads[v as usize].state == TState::Running {
                    self.block(v);
                }
                self.not_running_now(v);
                false
            }
        }
    }

    fn slot_retry(&mut self, v: u32) {
        if self.slot_enter(v) {
            self.slot_granted(v, 0);
        }
    }

    /// A waiting vCPU holds a slot now: its thread runs after `latency`.
    fn slot_granted(&mut self, v: u32, latency: u64) {
        let vc = &mut self.vcpus[v as usize];
        if vc.act != Act::SlotWait {
            return;
        }
        let m = vc.vm as usize;
        let local = vc.idx as usize;
        let since = vc.slot_since;
        if let Some(s) = self.vms[m].slots.clone() {
            // The woken thread's enter() looks once more: granted, and its wait is counted.
            let sig = self.signals(m);
            let _ = s.poll_enter(local, since, &sig);
        }
        let vc = &mut self.vcpus[v as usize];
        self.vms[m].board.unpark(local);
        self.vms[m].board.on_enter_run(local);
        let (act, left) = vc.saved.take().unwrap_or((Act::Spin, 0));
        vc.wake_token += 1;
        // Its KVM_RUN enters the guest again (the resume), then the guest goes on.
        let resume = self.cost.resume_ns;
        if act == Act::Spin {
            // Back in the guest, it looks at the lock again.
            vc.act = Act::Resume;
            vc.left = resume;
        } else {
            vc.act = act;
            vc.left = left + resume;
        }
        self.make_runnable_after(v, latency);
    }

    /// After an exit: false when `v` gave its slot up.
    fn slot_exited(&mut self, v: u32) -> bool {
        let m = self.vcpus[v as usize].vm as usize;
        let Some(s) = self.vms[m].slots.clone() else {
            return true;
        };
        let local = self.vcpus[v as usize].idx as usize;
        let sig = self.signals(m);
        let keep = s.exited(local, &sig);
        self.apply(m, &sig);
        keep
    }

    /// Carries out what a slot call asked: preemptions and grants.
    fn apply(&mut self, m: usize, sig: &Signals) {
        let pre = std::mem::take(&mut *lock(&sig.preempts));
        for h in pre {
            self.preempt(self.vms[m].base + h as u32);
        }
        self.drain(m);
    }

    fn drain(&mut self, m: usize) {
        let granted = std::mem::take(&mut *lock(&self.vms[m].granted));
        // The measured grant-to-guest less what the granted thread pays on its CPU (the
        // switch and the resume); `slot_wake_ns` itself paces the queue head's next look.
        let c = &self.cost;
        let lat = c.slot_wake_ns;
        let grant_lat = lat.saturating_sub(c.context_switch_ns + c.resume_ns).max(1);
        for g in granted {
            let v = self.vms[m].base + g as u32;
            self.slot_granted(v, grant_lat);
        }
        let heads = std::mem::take(&mut *lock(&self.vms[m].heads));
        for h in heads {
            let v = self.vms[m].base + h as u32;
            let vc = &self.vcpus[v as usize];
            if vc.act == Act::SlotWait {
                let token = vc.wake_token;
                self.at(self.now + lat, Ev::SlotRetry(v, token));
            }
        }
    }

    /// The slot policy asks `v` to leave KVM_RUN (the interrupter's signal).
    fn preempt(&mut self, v: u32) {
        let vc = &mut self.vcpus[v as usize];
        if vc.act == Act::Halted && self.cfg.variant.path.halts_in_kvm() {
            // Halted inside KVM (the watcher had not seen it yet): the signal ends the halt
            // and KVM_RUN returns to the VMM, which asks for a slot again.
            let t = draw(&mut self.rng, self.cost.forced_exit);
            self.at(self.now + t, Ev::Signal(v));
            return;
        }
        if matches!(
            vc.act,
            Act::Halted | Act::SlotWait | Act::Done | Act::SignalExit
        ) {
            return;
        }
        if vc.on_cpu {
            let t = draw(&mut self.rng, self.cost.forced_exit);
            self.at(self.now + t, Ev::Signal(v));
        } else {
            vc.signal_pending = true;
        }
    }

    fn forced_exit(&mut self, v: u32) {
        let vc = &self.vcpus[v as usize];
        if matches!(
            vc.act,
            Act::Halted | Act::SlotWait | Act::Done | Act::SignalExit
        ) {
            return;
        }
        // KVM_RUN returns to the VMM from guest user mode and (if the vCPU keeps its slot)
        // enters again: a userspace exit from CPL 3, as a WAIT's.
        let t = draw(&mut self.rng, self.cost.wait_exit);
        self.interrupt(v, t);
    }

    /// A signal ended `v`'s halt inside KVM: its thread wakes, `KVM_RUN` returns to the VMM
    /// (no exit from guest mode: the guest was halted), and the VMM's exit hooks decide on
    /// its slot; with one it enters `KVM_RUN` again ([`Act::Reenter`]).
    fn halt_interrupted(&mut self, v: u32) {
        let resume = self.cost.resume_ns;
        let vc = &mut self.vcpus[v as usize];
        // A kick on its way (its wake-up event) is in the LAPIC now: it ends the halt when
        // KVM_RUN enters again.
        if vc.kicked {
            vc.kick_latched = true;
        }
        vc.wake_token += 1;
        vc.halted_in_kvm = false;
        vc.saved = Some((Act::Reenter, resume));
        vc.act = Act::SignalExit;
        vc.left = resume;
        self.make_runnable(v);
    }

    /// `KVM_RUN` entered again after a signal ended `v`'s halt ([`Act::Reenter`]): a kick
    /// that came meanwhile wakes the guest at once; else it halts inside KVM again (the
    /// guest's HLT never ended, so no new halt is counted).
    fn reenter(&mut self, v: u32) {
        let vc = &mut self.vcpus[v as usize];
        vc.act = Act::Halted;
        if std::mem::take(&mut vc.kick_latched) {
            self.kick_wake(v);
            if self.vcpus[v as usize].on_cpu {
                self.arm(v);
            }
            return;
        }
        vc.wake_token += 1;
        self.halt_in_kvm(v);
        self.block(v);
    }

    /// `v` halts inside KVM: the watcher's probe sees it blocking from now, and KVM polls
    /// before it schedules the thread out only while nothing else is runnable on its CPU.
    fn halt_in_kvm(&mut self, v: u32) {
        let m = self.vcpus[v as usize].vm as usize;
        let cpu = self.threads[v as usize].cpu;
        let alone = self.threads[v as usize].state == TState::Running
            && self.cpus[cpu as usize].rq.is_empty();
        let vc = &mut self.vcpus[v as usize];
        vc.halted_in_kvm = true;
        vc.halt_t0 = self.now;
        vc.poll_cpu = alone.then_some(cpu);
        self.arm_watch(m);
    }

    /// Interrupts the running act for a forced exit handled after `cost` ns.
    fn interrupt(&mut self, v: u32, cost: u64) {
        let now = self.now;
        let vc = &mut self.vcpus[v as usize];
        if matches!(
            vc.act,
            Act::Halted | Act::SlotWait | Act::Done | Act::SignalExit
        ) {
            if vc.on_cpu && vc.act == Act::SignalExit {
                self.arm(v);
            }
            return;
        }
        if vc.act.timed() && vc.on_cpu {
            vc.left = vc.left.saturating_sub(now.saturating_sub(vc.act_t0));
        }
        vc.saved = Some((vc.act, vc.left));
        self.start(v, Act::SignalExit, cost);
    }

    fn arm_watch(&mut self, m: usize) {
        let Some(s) = self.vms[m].slots.clone() else {
            return;
        };
        if self.vms[m].watch_armed || !self.cfg.variant.path.halts_in_kvm() {
            return;
        }
        // As `RunSlots::wait_for_watch`: with nothing to watch (nobody waits for a slot, none
        // is lent, no more holders than slots) the watcher sleeps until the policy has some;
        // its 100-ms timeout wake-ups are left out.
        let mut set = std::mem::take(&mut self.vms[m].watch_set);
        s.watch_set(&mut set);
        let idle = set.is_empty();
        self.vms[m].watch_set = set;
        if idle {
            return;
        }
        self.vms[m].watch_armed = true;
        let i = self.vms[m]
            .slots
            .as_ref()
            .map_or(0, |s| s.config().halt_watch_interval.as_nanos() as u64);
        self.at(self.now + i, Ev::SlotPoll(m as u32));
    }

    /// The VM whose halt watcher thread `tid` is.
    pub(crate) fn watcher_vm(&self, tid: u32) -> Option<usize> {
        let first = self.vcpus.len() + self.cfg.hogs;
        let m = (tid as usize).checked_sub(first)?;
        (m < self.vms.len() && self.vms[m].watcher == Some(tid)).then_some(m)
    }

    /// The watcher's timer fired: its thread becomes runnable and polls once it runs.
    fn watch_due(&mut self, m: usize) {
        let Some(tid) = self.vms[m].watcher else {
            return self.slot_poll(m);
        };
        self.make_runnable(tid);
    }

    /// The watcher thread got a CPU: its poll is done after its switch and one `blocking`
    /// read per watched vCPU.
    pub(crate) fn watcher_dispatched(&mut self, m: usize, switched: bool) {
        let c = &self.cost;
        let reads = self.vms[m].watch_set.len().max(1) as u64;
        let t = if switched { c.context_switch_ns } else { 0 } + c.halt_probe_ns * reads;
        let vm = &mut self.vms[m];
        vm.watch_token += 1;
        let token = vm.watch_token;
        self.at(self.now + t, Ev::WatchRun(m as u32, token));
    }

    /// The watcher thread lost its CPU before its poll was done: it polls when it runs again.
    pub(crate) fn watcher_descheduled(&mut self, m: usize) {
        self.vms[m].watch_token += 1;
    }

    /// The watcher polled: it reports, re-arms its timer if needed, and sleeps.
    fn watch_run(&mut self, m: usize) {
        self.slot_poll(m);
        if let Some(tid) = self.vms[m].watcher {
            if self.threads[tid as usize].state == TState::Running {
                let cpu = self.threads[tid as usize].cpu;
                self.stop_running(cpu);
                self.threads[tid as usize].state = TState::Blocked;
                self.pick_next(cpu);
            }
        }
    }

    /// The halt watcher's poll: every watched vCPU's `blocking` state to the policy.
    fn slot_poll(&mut self, m: usize) {
        self.vms[m].watch_armed = false;
        let Some(s) = self.vms[m].slots.clone() else {
            return;
        };
        self.vms[m].report.watch_polls += 1;
        let mut set = std::mem::take(&mut self.vms[m].watch_set);
        s.watch_set(&mut set);
        let base = self.vms[m].base;
        for &local in &set {
            let halted = self.vcpus[(base + local as u32) as usize].halted_in_kvm;
            let sig = self.signals(m);
            s.halt_changed(local, halted, &sig);
            self.apply(m, &sig);
        }
        let any = !set.is_empty();
        self.vms[m].watch_set = set;
        if any {
            self.arm_watch(m);
        }
    }

    /// vCPU thread `v` blocks (halted, slot wait, done).
    fn block(&mut self, v: u32) {
        if self.threads[v as usize].state == TState::Running {
            let cpu = self.threads[v as usize].cpu;
            self.stop_running(cpu);
            self.threads[v as usize].state = TState::Blocked;
            self.pick_next(cpu);
        } else if self.threads[v as usize].state == TState::Queued {
            self.dequeue(v);
            self.threads[v as usize].state = TState::Blocked;
        } else if self.threads[v as usize].state == TState::Throttled {
            self.threads[v as usize].state = TState::Blocked;
        }
    }

    fn make_runnable_after(&mut self, v: u32, latency: u64) {
        if latency == 0 {
            self.make_runnable(v);
        } else {
            let token = self.vcpus[v as usize].wake_token;
            self.at(self.now + latency, Ev::SlotWake(v, token));
        }
    }
}

fn lock_index(lock: LockKind, guest: Guest) -> usize {
    match (lock, guest) {
        (_, Guest::Stock) => 3,
        (LockKind::Ticket | LockKind::Backoff, _) => 0,
        (LockKind::Tas, _) => 1,
        (LockKind::Queued, _) => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Variant;

    fn cfg(variant: &str, vcpus: usize, iterations: u64) -> SimConfig {
        let v: Variant = variant.parse().unwrap();
        let mut c = SimConfig::new(v, vcpus, iterations);
        c.cs_work = 5_000;
        c.ncs_work = 5_000;
        c
    }

    /// A thread woken onto another CPU (its own is busy, the other idle) carries its place in
    /// the old queue, not the old queue's clock: its vruntime moves by the difference of the
    /// two queues' `min_vruntime`, as the kernel's migration and the pulls here do.
    #[test]
    fn a_thread_woken_onto_another_cpu_keeps_its_lag_not_the_old_clock() {
        let mut sim = Sim::new(cfg("ticket:kick", 2, 100)).unwrap();
        // Thread 0 blocked, last on CPU 0, 1 ms ahead of CPU 0's minimum; thread 1 runs on
        // CPU 0; CPU 1 is idle, its clock far behind.
        sim.threads[0].state = TState::Blocked;
        sim.threads[0].cpu = 0;
        sim.threads[0].vruntime = 50_000_000;
        sim.threads[1].state = TState::Running;
        sim.threads[1].cpu = 0;
        sim.cpus[0].curr = Some(1);
        sim.cpus[0].min_vruntime = 49_000_000;
        sim.cpus[1].curr = None;
        sim.cpus[1].min_vruntime = 3_000_000;
        sim.idle.clear();
        sim.idle.insert(1);
        sim.make_runnable(0);
        assert_eq!(sim.threads[0].cpu, 1);
        // 1 ms ahead of its old queue's minimum, so 1 ms ahead of the new one's.
        assert_eq!(sim.threads[0].vruntime, 4_000_000);
    }

    /// The stock guest's 8 vCPUs on 2 CPUs, 500 acquisitions each, cs/ncs 15000, with the
    /// costs `edit` sets.
    fn stock_8_vcpus(edit: impl FnOnce(&mut CostModel)) -> Report {
        let mut c = cfg("queued:kick:in-kernel@stock", 8, 500);
        c.cs_work = 15_000;
        c.ncs_work = 15_000;
        edit(&mut c.cost);
        let r = Sim::new(c).unwrap().run();
        assert!(r.finished);
        r
    }

    /// With every idle CPU pulling at once (the default) no CPU stands idle while a thread
    /// waits; leaving cache-hot threads to the balance idles CPUs, as the hosts do, and the
    /// report counts it.
    #[test]
    fn idle_time_beside_a_waiting_thread_is_counted() {
        let idle = |ns: u64| stock_8_vcpus(|c| c.migration_cost_ns = ns).idle_while_queued_ns;
        assert_eq!(idle(0), 0);
        assert!(idle(u64::MAX) > 0);
    }

    /// Wake-ups of vCPU threads onto a CPU running another vCPU thread are counted, and those
    /// that preempted it are among them; with CFS's granularity off more of them preempt.
    #[test]
    fn wake_ups_onto_a_running_vcpu_are_counted() {
        let onto = |ns: u64| stock_8_vcpus(|c| c.wakeup_granularity_ns = ns).wakeups_onto_vcpu;
        let (cfs, none) = (onto(1_000_000), onto(0));
        assert!(cfs.0 > 0 && cfs.1 <= cfs.0, "{cfs:?}");
        assert!(none.1 <= none.0, "{none:?}");
        assert!(
            none.1 * cfs.0 > cfs.1 * none.0,
            "no granularity preempts a larger share: {none:?} against {cfs:?}"
        );
    }

    /// `wakeup_after_slice` (EEVDF): a thread that wakes preempts a running one past its
    /// protected slice whose deadline is later; without it (CFS) only by the granularity.
    #[test]
    fn a_waking_thread_preempts_a_thread_past_its_slice_only_under_the_eevdf_rule() {
        let preempted = |rule: u64, ran_ns: u64| {
            let mut c = cfg("ticket:kick", 2, 100);
            c.hogs = 1;
            c.cost.wakeup_after_slice = rule;
            let mut sim = Sim::new(c).unwrap();
            // Thread 1 runs on CPU 0 since `ran_ns` ago, its vruntime 0.1 ms past the
            // queue's minimum; thread 0 wakes there (CPU 1 busy too), placed with the
            // sleeper credit: its deadline is earlier, by less than the granularity.
            sim.now = 10_000_000;
            sim.threads[0].state = TState::Blocked;
            sim.threads[0].cpu = 0;
            sim.threads[0].vruntime = 0;
            sim.threads[1].state = TState::Running;
            sim.threads[1].cpu = 0;
            sim.threads[1].exec_start = sim.now;
            sim.threads[1].slice_start = sim.now - ran_ns;
            sim.threads[1].slice_cpu = ran_ns;
            sim.threads[1].vruntime = 49_100_000;
            sim.cpus[0].curr = Some(1);
            sim.cpus[0].min_vruntime = 49_000_000;
            sim.threads[2].state = TState::Running;
            sim.threads[2].cpu = 1;
            sim.cpus[1].curr = Some(2);
            sim.idle.clear();
            sim.make_runnable(0);
            sim.cpus[0].curr != Some(1)
        };
        let slice = 2 * CostModel::default().min_granularity_ns;
        assert!(preempted(1, slice));
        assert!(!preempted(1, slice / 2), "inside its protected slice");
        assert!(!preempted(0, slice), "CFS: not by the granularity");
    }

    /// Every variant, overcommitted: each acquisition counted once per vCPU and in total, no
    /// two vCPUs ever inside the critical section, every run finished (no lost wake-up: a
    /// qspinlock queue head once halted on a free lock here).
    #[test]
    fn every_acquisition_is_counted_exactly_and_exclusion_holds() {
        for variant in [
            "ticket:off",
            "tas:off",
            "queued:off",
            "backoff:off",
            "backoff:kick",
            "ticket:kick",
            "ticket:kick+yield",
            "queued:kick",
            "queued:kick+yield",
            "ticket:kick:signal-msi",
            "ticket:kick:userspace",
            "queued:kick:in-kernel@stock",
            "queued:kick/slots:in-kernel@stock",
            "queued:kick/slots:signal-msi@stock",
            "queued:kick/slots:userspace",
            "ticket:kick/slots:in-kernel",
            "ticket:kick+yield/slots:in-kernel",
            "ticket:kick/slots:userspace",
            "backoff:kick/slots:signal-msi",
        ] {
            for (vcpus, hogs, seed) in [(2, 2, 3), (5, 0, 3), (8, 1, 3), (16, 0, 1), (16, 0, 2)] {
                let mut c = cfg(variant, vcpus, 300);
                c.hogs = hogs;
                c.seed = seed;
                // A lost wake-up in the model shows as a run that reaches the bound.
                c.bound_ns = 20_000_000_000;
                let mut sim = Sim::new(c).unwrap();
                sim.start_all();
                sim.run_loop();
                assert!(
                    sim.vcpus.iter().all(|v| v.acq == 300),
                    "{variant} {vcpus}/{hogs}: per-vCPU counts {:?}",
                    sim.vcpus.iter().map(|v| v.acq).collect::<Vec<_>>()
                );
                let r = sim.finish();
                assert!(r.finished, "{variant} {vcpus}/{hogs} did not finish");
                assert_eq!(r.acquisitions(), 300 * vcpus as u64, "{variant}");
                assert_eq!(r.vms[0].exclusion_violations, 0, "{variant}");
            }
        }
    }

    #[test]
    fn work_jitter_keeps_the_mean_and_breaks_the_lock_step() {
        let run = |vcpus: usize, jitter: u64| {
            let mut c = cfg("ticket:kick", vcpus, 2_000);
            // Sections long against the 1-us hand-over, which alone would keep the lock step.
            (c.cs_work, c.ncs_work) = (50_000, 50_000);
            c.cost.work_jitter_pct = jitter;
            let r = Sim::new(c).unwrap().run();
            assert!(r.finished && r.vms[0].exclusion_violations == 0);
            r
        };
        // One vCPU: its time is its sections' sum, whose mean the jitter keeps.
        let (exact, varied) = (run(1, 0), run(1, 30));
        assert_ne!(exact.end_ns, varied.end_ns, "the sections vary");
        let ratio = varied.end_ns as f64 / exact.end_ns as f64;
        assert!((0.98..1.02).contains(&ratio), "mean kept: {ratio}");
        // Two vCPUs with equal sections: exact ones meet the lock taken every time; varied
        // ones often find it free.
        let (exact, varied) = (run(2, 0), run(2, 30));
        assert!(exact.vms[0].contended > 3_900, "{}", exact.vms[0].contended);
        assert!(
            varied.vms[0].contended < 3_000,
            "{}",
            varied.vms[0].contended
        );
    }

    /// The case that found a lost wake-up: the qspinlock's queue head halted on a free lock
    /// (its last look before halting must take a free lock, as the SLOW cmpxchg fails there).
    #[test]
    fn a_stock_queue_head_never_halts_on_a_free_lock() {
        for seed in [2, 3] {
            let v: Variant = "queued:kick/slots:in-kernel@stock".parse().unwrap();
            let mut c = SimConfig::new(v, 16, 5000);
            c.seed = seed;
            c.bound_ns = 5_000_000_000;
            let r = Sim::new(c).unwrap().run();
            assert!(
                r.finished,
                "seed {seed}: stuck at {} acquisitions",
                r.acquisitions()
            );
        }
    }

    /// The guest rule "no early wait behind a kicked next owner" applies only where the host
    /// says the VM's vCPUs fit its CPUs (`VCPUS_FIT`): it changes a 2-vCPU run beside hogs, and
    /// leaves a run of more vCPUs than CPUs as the guest without the rule runs it.
    #[test]
    fn the_early_wait_rule_applies_only_where_vcpus_fit() {
        let run = |vcpus: usize, hogs: usize, never_told: bool| {
            let mut c = cfg("ticket:kick", vcpus, 3_000);
            c.seed = 3;
            c.hogs = hogs;
            c.early_wait_behind_waking = never_told;
            let r = Sim::new(c).unwrap().run();
            assert!(r.finished);
            r
        };
        assert!(cfg("ticket:kick", 2, 1).vcpus_fit());
        assert_ne!(run(2, 4, false), run(2, 4, true));
        assert!(!cfg("ticket:kick", 4, 1).vcpus_fit());
        assert_eq!(run(4, 0, false), run(4, 0, true));
        // With run slots whose kicks hand a slot over, the slots count; in kernel, all vCPUs.
        assert!(cfg("ticket:kick/slots:userspace", 6, 1).vcpus_fit());
        assert!(!cfg("ticket:kick/slots:in-kernel", 6, 1).vcpus_fit());
    }

    /// `vcpus` vCPUs of `variant` on `host_cpus` CPUs with nothing scheduled: vCPU 0 holds
    /// the lock in its critical section, every other vCPU waits halted, in order.
    fn held_by_0_with_halted_waiters(
        variant: &str,
        vcpus: usize,
        host_cpus: usize,
        prewake: u8,
    ) -> Sim {
        let mut c = cfg(variant, vcpus, 100);
        c.host_cpus = host_cpus;
        c.prewake = prewake;
        let mut sim = Sim::new(c).unwrap();
        sim.vms[0].lock.owner = Some(0);
        sim.vms[0].lock.in_cs = true;
        sim.vcpus[0].act = Act::Cs;
        for w in 1..vcpus as u32 {
            sim.vms[0].lock.queue.push_back(w);
            sim.vcpus[w as usize].act = Act::Halted;
        }
        sim
    }

    /// vCPU `v` releases the lock and finishes its unlock (every kick it sends, in kernel).
    fn release_fully(sim: &mut Sim, v: u32) {
        sim.release(v);
        for _ in 0..10 {
            if !matches!(sim.vcpus[v as usize].act, Act::Kick | Act::Prewake) {
                return;
            }
            sim.step_done(v);
        }
        panic!("the unlock never ended");
    }

    /// The vCPUs a wake-up is on its way to.
    fn waking(sim: &Sim) -> Vec<u32> {
        let mut w: Vec<u32> = sim
            .heap
            .iter()
            .filter_map(|Reverse((_, _, ev))| match ev {
                Ev::Wake(v, _) => Some(*v),
                _ => None,
            })
            .collect();
        w.sort_unstable();
        w
    }

    /// A kick's wake-up lands after the path's p50 less the resume; with a spread, after a
    /// uniform draw within it, whose mean stays the p50's.
    #[test]
    fn a_kick_to_wake_varies_within_its_spread_and_keeps_its_p50() {
        let wake_after = |jitter: u64, kicks: usize| -> Vec<u64> {
            let mut sim = held_by_0_with_halted_waiters("ticket:kick", 2, 2, 0);
            sim.cost.kick_to_wake_jitter_pct = jitter;
            (0..kicks)
                .map(|_| {
                    sim.heap.clear();
                    sim.vcpus[1].act = Act::Halted;
                    sim.kick(0, 1);
                    let Reverse((at, _, _)) = *sim.heap.peek().expect("a wake-up");
                    at - sim.now
                })
                .collect()
        };
        let c = CostModel::default();
        let exact = c.kick_to_wake_ns[0] - c.resume_ns;
        assert!(wake_after(0, 50).iter().all(|&t| t == exact));
        let p50 = c.kick_to_wake_ns[0];
        let varied = wake_after(50, 2_000);
        let (lo, hi) = (p50 / 2 - c.resume_ns, p50 * 3 / 2 - c.resume_ns);
        assert!(varied.iter().all(|&t| (lo..=hi).contains(&t)), "{lo}..{hi}");
        assert!(varied.iter().any(|&t| t < exact - p50 / 4));
        assert!(varied.iter().any(|&t| t > exact + p50 / 4));
        let mean = varied.iter().sum::<u64>() as f64 / varied.len() as f64;
        assert!(
            (mean / exact as f64 - 1.0).abs() < 0.05,
            "mean {mean}, p50 {exact}"
        );
    }

    /// The pre-wake, as the guest's unlockers do it: when the host says the VM's vCPUs fit its
    /// CPUs, an unlock with the next owner and the waiters behind it halted kicks the owner and
    /// the next `prewake` (2) of them; not the one after; one kick when the vCPUs do not fit,
    /// or at depth 0. The next unlock does not kick a waiter pre-woken for the same wait again
    /// (its slot says KICKED, its node RUNNING). Both the PV ticket and the pvspin MCS lock.
    #[test]
    fn an_unlock_prewakes_the_halted_waiters_behind_the_next_owner_when_vcpus_fit() {
        for lock in ["ticket:kick", "queued:kick", "backoff:kick"] {
            // 5 vCPUs on 5 CPUs fit; on 4 they do not.
            let mut sim = held_by_0_with_halted_waiters(lock, 5, 5, 2);
            assert!(sim.cfg.vcpus_fit());
            release_fully(&mut sim, 0);
            let r = &sim.vms[0].report;
            assert_eq!((r.kicks, r.prewakes), (3, 2), "{lock}");
            assert_eq!(waking(&sim), [1, 2, 3], "{lock}");
            assert_eq!(sim.vcpus[0].act, Act::Ncs, "{lock}: the unlock ended");
            assert_eq!(sim.vms[0].lock.owner, Some(1));
            // 1 takes the lock before 2 and 3 have woken: 2 is the next owner, kicked already.
            sim.vms[0].lock.in_cs = true;
            sim.vcpus[1].act = Act::Cs;
            release_fully(&mut sim, 1);
            let r = &sim.vms[0].report;
            assert_eq!(
                (r.kicks, r.prewakes),
                (4, 3),
                "{lock}: 2 and 3 kicked twice"
            );
            assert_eq!(waking(&sim), [1, 2, 3, 4], "{lock}");

            let mut sim = held_by_0_with_halted_waiters(lock, 5, 4, 2);
            assert!(!sim.cfg.vcpus_fit());
            release_fully(&mut sim, 0);
            let r = &sim.vms[0].report;
            assert_eq!((r.kicks, r.prewakes), (1, 0), "{lock}: not fit");
            assert_eq!(waking(&sim), [1]);

            let mut sim = held_by_0_with_halted_waiters(lock, 5, 5, 0);
            release_fully(&mut sim, 0);
            let r = &sim.vms[0].report;
            assert_eq!((r.kicks, r.prewakes), (1, 0), "{lock}: depth 0");

            // A next owner still spinning: the halted waiters behind it are pre-woken anyway.
            let mut sim = held_by_0_with_halted_waiters(lock, 5, 5, 2);
            sim.vcpus[1].act = Act::Spin;
            release_fully(&mut sim, 0);
            let r = &sim.vms[0].report;
            assert_eq!((r.kicks, r.prewakes), (2, 2), "{lock}: owner spinning");
            assert_eq!(waking(&sim), [2, 3]);
        }
        // The stock guest never pre-wakes, nor a guest never told VCPUS_FIT.
        let mut sim = held_by_0_with_halted_waiters("queued:kick:in-kernel@stock", 5, 5, 2);
        release_fully(&mut sim, 0);
        assert_eq!(sim.vms[0].report.prewakes, 0);
        let mut c = cfg("ticket:kick", 5, 100);
        c.host_cpus = 5;
        c.early_wait_behind_waking = true;
        assert_eq!(c.prewake_depth(), 0);
    }

    /// On an exiting path each kick is an exit: with run slots the first kick hands the
    /// unlocker's slot to the next owner, and the unlocker pre-wakes the next waiter only once
    /// its guest runs again, after it gets a slot back.
    #[test]
    fn on_an_exiting_path_the_unlocker_prewakes_after_its_kick_exit() {
        let mut c = cfg("queued:kick/slots:userspace", 4, 100);
        c.slots = 1;
        let mut sim = Sim::new(c).unwrap();
        assert!(sim.cfg.vcpus_fit() && sim.vms[0].prewake == 2);
        assert!(sim.slot_enter(0), "the free slot");
        sim.vms[0].lock.owner = Some(0);
        sim.vms[0].lock.in_cs = true;
        sim.vcpus[0].act = Act::Cs;
        for w in 1..4 {
            sim.vms[0].lock.queue.push_back(w);
            sim.vcpus[w as usize].act = Act::Halted;
        }
        sim.release(0);
        assert_eq!(sim.vms[0].report.kicks, 1);
        assert_eq!(sim.vcpus[0].act, Act::Kick);
        sim.step_done(0);
        // Its slot went to vCPU 1 with the kick: it waits for one before it goes on.
        assert_eq!(sim.vcpus[0].act, Act::SlotWait);
        assert!(matches!(sim.vcpus[0].saved, Some((Act::Prewake, _))));
        assert_eq!(
            sim.vms[0].report.kicks, 1,
            "pre-woke before the exit returned"
        );
        // Back in its guest: it pre-wakes vCPU 2.
        sim.vcpus[0].saved = None;
        sim.vcpus[0].act = Act::Prewake;
        sim.step_done(0);
        let r = &sim.vms[0].report;
        assert_eq!((r.kicks, r.prewakes), (2, 1));
        assert_eq!(sim.vcpus[0].act, Act::Kick);
    }

    /// Whole runs with many more vCPUs than slots: the pre-wake acts, every acquisition is
    /// counted and exclusion holds; at depth 0, or for a guest never told, nothing is
    /// pre-woken; a guest never told runs the same with any depth.
    #[test]
    fn whole_runs_prewake_only_where_the_guest_is_told_vcpus_fit() {
        for variant in [
            "queued:kick/slots:userspace",
            "ticket:kick/slots:signal-msi",
        ] {
            let run = |prewake: u8, never_told: bool| {
                // cs/ncs 15000: long enough for the slots to rotate and waiters to halt.
                let mut c = SimConfig::new(variant.parse().unwrap(), 16, 2_000);
                c.prewake = prewake;
                c.early_wait_behind_waking = never_told;
                c.bound_ns = 20_000_000_000;
                let r = Sim::new(c).unwrap().run();
                assert!(r.finished, "{variant} prewake {prewake}");
                assert_eq!(r.acquisitions(), 16 * 2_000);
                assert_eq!(r.vms[0].exclusion_violations, 0);
                r
            };
            let on = run(2, false);
            assert!(on.vms[0].prewakes > 0, "{variant}: {:?}", on.vms[0]);
            assert!(on.vms[0].kicks >= on.vms[0].prewakes);
            assert_eq!(run(0, false).vms[0].prewakes, 0);
            assert_eq!(run(2, true), run(0, true), "{variant}: never told");
            assert_eq!(run(2, true).vms[0].prewakes, 0);
        }
    }

    /// A stock setup of 3 vCPUs with nothing scheduled: vCPU 2 holds the lock.
    fn stock_held_by_2() -> Sim {
        held_by(cfg("queued:kick:in-kernel@stock", 3, 100), 2)
    }

    /// A setup of `c` with nothing scheduled: vCPU `holder` is in its critical section.
    fn held_by(c: SimConfig, holder: u32) -> Sim {
        let mut sim = Sim::new(c).unwrap();
        sim.vms[0].lock.owner = Some(holder);
        sim.vms[0].lock.in_cs = true;
        sim.vcpus[holder as usize].act = Act::Cs;
        sim
    }

    /// A spinner preempted mid-phase: the stock guest's threshold counts spins, so its
    /// deadline moves by the time it was off its CPU; the pvspin guest's time budget does not.
    #[test]
    fn a_stock_spinner_keeps_its_spins_across_a_preemption_a_timed_one_does_not() {
        for (variant, moves) in [
            ("queued:kick:in-kernel@stock", true),
            ("ticket:kick:in-kernel", false),
        ] {
            let mut sim = held_by(cfg(variant, 3, 100), 2);
            sim.now = 1_000_000;
            sim.vcpus[0].act = Act::Spin;
            sim.vcpus[0].on_cpu = true;
            sim.vcpus[0].spin_deadline = 1_500_000;
            sim.vcpu_descheduled(0);
            sim.now = 3_000_000;
            sim.vcpu_dispatched(0, false);
            let expected = if moves { 3_500_000 } else { 1_500_000 };
            assert_eq!(sim.vcpus[0].spin_deadline, expected, "{variant}");
        }
    }

    /// Lock-waiter preemption of the qspinlock: a queue head that spun for the lock has set
    /// pending; preempted mid-spin it keeps it set, so the released lock stays free for it
    /// and a newcomer queues instead of stealing. It takes the lock when it runs again.
    #[test]
    fn a_preempted_stock_head_keeps_pending_and_the_lock_waits_for_it() {
        let mut sim = stock_held_by_2();
        sim.vms[0].lock.queue.push_back(0);
        sim.vcpus[0].act = Act::Spin;
        sim.vcpus[0].spin_deadline = u64::MAX;
        sim.vcpus[0].on_cpu = true;
        sim.spin_check(0);
        assert!(sim.vms[0].lock.pending, "a spinning head sets pending");
        sim.vcpu_descheduled(0);
        sim.release(2);
        assert_eq!(sim.vms[0].lock.owner, None);
        sim.acquire(1);
        assert_eq!(sim.vms[0].lock.owner, None, "a newcomer stole past pending");
        assert_eq!(sim.vms[0].lock.queue, [0, 1]);
        // vCPU 1 spins on a CPU behind it: taking the lock passes the head to 1, which
        // starts its head spin at once and sets pending.
        sim.vcpus[1].on_cpu = true;
        sim.vcpu_dispatched(0, false);
        assert_eq!(sim.vms[0].lock.owner, Some(0));
        assert_eq!(sim.vcpus[0].act, Act::Take);
        assert_eq!(sim.vms[0].lock.queue, [1]);
        assert!(sim.vms[0].lock.pending, "the new head spins with pending");
        // Had 1 not been on a CPU, pending would be clear until it runs.
        sim.vcpus[1].on_cpu = false;
        sim.stock_head_passed(0);
        assert!(!sim.vms[0].lock.pending);
        // A head that became head while descheduled never set pending: stealing is allowed.
        let mut sim = stock_held_by_2();
        sim.vms[0].lock.queue.push_back(0);
        sim.vcpus[0].act = Act::Spin;
        sim.release(2);
        sim.acquire(1);
        assert_eq!(sim.vms[0].lock.owner, Some(1));
    }

    /// The unlock that finds the lock SLOW kicks the halted head once; the head, hashed,
    /// spins until it gets the lock (no second halt), and a stealer's unlock kicks nobody.
    #[test]
    fn a_halted_stock_head_is_kicked_once_and_then_spins_for_the_lock() {
        let mut sim = stock_held_by_2();
        sim.vms[0].lock.queue.push_back(0);
        sim.vcpus[0].act = Act::Halted;
        sim.release(2);
        assert_eq!(sim.vms[0].report.kicks, 1);
        assert!(sim.vcpus[0].hashed_head);
        sim.acquire(1);
        assert_eq!(
            sim.vms[0].lock.owner,
            Some(1),
            "no pending while the head is halted"
        );
        sim.vcpus[1].act = Act::Cs;
        sim.vms[0].lock.in_cs = true;
        sim.release(1);
        assert_eq!(
            sim.vms[0].report.kicks, 1,
            "a LOCKED (not SLOW) unlock kicked"
        );
        sim.kick_wake(0);
        sim.spin_start(0);
        assert_eq!(
            sim.vcpus[0].spin_deadline,
            u64::MAX,
            "a hashed head halted again"
        );
    }

    /// The hybrid unfair trylock (`SimConfig::stock_hybrid_trylock`): an arrival that finds
    /// the lock held and a halted queue head spins outside the queue (never halting early
    /// behind the head) and takes the lock at the release; once a head spins with pending
    /// set, it queues. With one steal attempt it queues at once.
    #[test]
    fn a_stock_arrival_spins_to_steal_while_the_queue_head_is_halted() {
        for hybrid in [true, false] {
            let mut c = cfg("queued:kick:in-kernel@stock", 3, 100);
            c.stock_hybrid_trylock = hybrid;
            let mut sim = held_by(c, 2);
            sim.vms[0].lock.queue.push_back(0);
            sim.vcpus[0].act = Act::Halted;
            sim.vcpus[0].waiting_mark = true;
            sim.vcpus[1].on_cpu = true;
            sim.acquire(1);
            if !hybrid {
                assert_eq!(sim.vms[0].lock.queue, [0, 1]);
                assert_eq!(
                    sim.vcpus[1].act,
                    Act::WaitExit,
                    "no early wait behind the head"
                );
                continue;
            }
            assert_eq!(sim.vms[0].lock.queue, [0], "queued behind a halted head");
            assert!(sim.vcpus[1].stealing);
            assert_eq!(sim.vcpus[1].spin_deadline, u64::MAX, "a stealer would halt");
            sim.release(2);
            assert_eq!(
                sim.vms[0].lock.owner,
                Some(1),
                "the stealer did not take it"
            );
            assert_eq!(sim.vms[0].report.steals, 1);
            assert_eq!(sim.vms[0].report.kicks, 1, "the SLOW unlock kicks the head");
            // A head that spins with pending set makes the next arrival queue.
            let mut sim = stock_held_by_2();
            sim.vms[0].lock.queue.push_back(0);
            sim.vms[0].lock.pending = true;
            sim.vcpus[1].on_cpu = true;
            sim.acquire(1);
            assert_eq!(sim.vms[0].lock.queue, [0, 1]);
            assert!(!sim.vcpus[1].stealing);
        }
    }

    /// `pv_wait_early`: a stock node waiter stops spinning behind a halted predecessor; the
    /// queue head does not (it looks only at the holder's `preempted` byte).
    #[test]
    fn a_stock_node_waiter_waits_early_behind_a_halted_predecessor() {
        let mut sim = stock_held_by_2();
        sim.vms[0].lock.queue.extend([0, 1]);
        sim.vcpus[0].act = Act::Spin;
        sim.vcpus[1].act = Act::Spin;
        assert!(!sim.waits_early(1));
        sim.vcpus[0].act = Act::Halted;
        sim.vcpus[0].waiting_mark = true;
        assert!(sim.waits_early(1));
        // Woken, its node still says HALTED until its guest runs again.
        sim.vcpus[0].act = Act::Resume;
        assert!(
            sim.waits_early(1),
            "behind a woken predecessor not yet running"
        );
        sim.spin_start(0);
        assert!(!sim.waits_early(1), "behind a predecessor spinning again");
        // From the HALTED store before its WAIT's exit: a spinning successor waits at once.
        sim.vcpus[1].on_cpu = true;
        sim.vcpus[1].spin_deadline = u64::MAX;
        sim.wait(0);
        assert_eq!(
            sim.vcpus[1].act,
            Act::WaitExit,
            "kept spinning behind HALTED"
        );
        sim.vcpus[2].act = Act::Halted;
        assert!(!sim.waits_early(0));
        sim.vcpus[2].act = Act::SlotWait;
        assert!(sim.waits_early(0));
    }

    /// Today's pvspin MCS waiter (`SimConfig::queued_names_holder`): a waiter deeper than the
    /// holder's successor names the holder in its WAIT; the guest the validation measured
    /// named its predecessor.
    #[test]
    fn a_deep_queued_waiter_names_the_holder() {
        for today in [true, false] {
            let mut c = cfg("queued:kick/slots:userspace", 5, 100);
            c.queued_names_holder = today;
            let mut sim = held_by(c, 4);
            sim.vms[0].lock.queue.extend([0, 1, 2, 3]);
            // The successor and the one behind it name whom they wait for either way.
            assert_eq!(sim.named(0), Some(4));
            assert_eq!(sim.named(1), Some(0));
            assert_eq!(sim.named(3), Some(if today { 4 } else { 2 }));
            // What it waits for (its spin watches) stays its predecessor.
            assert_eq!(sim.waited_for(3), Some(2));
        }
    }

    /// KVM halt-polls only with the CPU to itself and within its window; a kick that finds
    /// no poll pays the unpolled wake-up; the window grows after a short block.
    #[test]
    fn a_kick_costs_more_when_kvm_did_not_poll() {
        let wake_at = |polling: bool| {
            let mut sim = stock_held_by_2();
            sim.vcpus[0].act = Act::Halted;
            sim.vcpus[0].halt_t0 = 0;
            sim.vcpus[0].halt_poll_ns = 50_000;
            sim.vcpus[0].poll_cpu = polling.then_some(0);
            sim.now = 20_000;
            sim.kick(2, 0);
            let t = sim
                .heap
                .iter()
                .find_map(|Reverse((t, _, ev))| matches!(ev, Ev::Wake(0, _)).then_some(*t));
            // Woken onto an idle CPU: when its guest runs again.
            sim.now = t.unwrap();
            sim.kick_wake(0);
            let cpu = sim.threads[0].cpu;
            assert_eq!(sim.cpus[cpu as usize].curr, Some(0));
            guest_event_at(&sim, 0).unwrap() - 20_000
        };
        let c = CostModel::default();
        // Polled: the measured kick-to-wake; not polled: a switch more (what section 2 of
        // benchmarks.md measured between the two).
        assert_eq!(wake_at(true), c.kick_to_wake_ns[0]);
        assert_eq!(wake_at(false), c.kick_to_wake_ns[0] + c.context_switch_ns);
        // Past the window: not polled, and the window grows (the block was short).
        let mut sim = stock_held_by_2();
        sim.vcpus[0].act = Act::Halted;
        sim.vcpus[0].halt_poll_ns = 10_000;
        sim.vcpus[0].poll_cpu = Some(0);
        sim.now = 30_000;
        assert!(!sim.halt_polled(0));
        assert_eq!(sim.vcpus[0].halt_poll_ns, 20_000);
        // A CPU that ran something else meanwhile ended the poll.
        sim.now = 10_000;
        sim.idle.remove(&0);
        assert!(!sim.halt_polled(0));
    }

    /// When the guest event of `v` fires next.
    fn guest_event_at(sim: &Sim, v: u32) -> Option<u64> {
        let token = sim.vcpus[v as usize].token;
        sim.heap
            .iter()
            .find_map(|Reverse((t, _, ev))| (*ev == Ev::Guest(v, token)).then_some(*t))
    }

    /// A vCPU thread switched onto a CPU runs its guest only after the switch: a queue head
    /// whose lock was released while it was preempted takes it a switch later, a timed act ends a switch
    /// later; a thread whose halt KVM was still polling, or one picked again on its own CPU,
    /// pays nothing.
    #[test]
    fn a_vcpu_switched_in_pays_the_context_switch_first() {
        let c = CostModel::default();
        let h = c.handoff_ns[lock_index(LockKind::Queued, Guest::Stock)];
        let mut sim = stock_held_by_2();
        sim.vms[0].lock.queue.push_back(0);
        sim.vcpus[0].act = Act::Spin;
        sim.vcpus[0].spin_deadline = u64::MAX;
        sim.release(2);
        assert_eq!(sim.vms[0].lock.owner, None, "free for the preempted head");
        sim.now = 1_000;
        sim.vcpu_dispatched(0, true);
        assert_eq!(
            sim.vms[0].lock.owner, None,
            "took it before it was switched in"
        );
        assert_eq!(guest_event_at(&sim, 0), Some(1_000 + c.context_switch_ns));
        // Its budget ran out while it was off the CPU: it still looks before it waits.
        sim.vcpus[0].spin_deadline = 500;
        sim.now = 1_000 + c.context_switch_ns;
        sim.step_done(0);
        assert_eq!(sim.vms[0].lock.owner, Some(0));
        assert_eq!(sim.vcpus[0].act, Act::Take);
        assert_eq!(guest_event_at(&sim, 0), Some(sim.now + h));
        // A timed act: its end moves by the switch, and the switch is not charged as work.
        let mut sim = stock_held_by_2();
        sim.vcpus[1].act = Act::Ncs;
        sim.vcpus[1].left = 2_000;
        sim.vcpu_dispatched(1, true);
        assert_eq!(guest_event_at(&sim, 1), Some(c.context_switch_ns + 2_000));
        sim.now = c.context_switch_ns + 500;
        sim.vcpu_descheduled(1);
        assert_eq!(sim.vcpus[1].left, 1_500);
        // Polled, or not switched: at once.
        sim.now = 50_000;
        sim.vcpus[1].polled_wake = true;
        sim.vcpu_dispatched(1, true);
        assert_eq!(guest_event_at(&sim, 1), Some(50_000 + 1_500));
        sim.vcpu_descheduled(1);
        sim.vcpu_dispatched(1, false);
        assert_eq!(guest_event_at(&sim, 1), Some(50_000 + 1_500));
    }

    /// The scheduler tells a vCPU whether it was switched in: not when the CPU picks the
    /// same thread again, yes after another thread or the idle task ran there.
    #[test]
    fn the_scheduler_counts_a_switch_only_between_threads() {
        let mut sim = Sim::new(cfg("ticket:off", 2, 10)).unwrap();
        sim.vcpus[0].act = Act::Ncs;
        sim.vcpus[0].left = 1_000_000;
        sim.make_runnable(0);
        assert_eq!(
            sim.vcpus[0].busy_until, sim.cost.context_switch_ns,
            "from idle"
        );
        // Preempted and picked again at once (nothing else queued): no switch.
        sim.now = 2_000_000;
        sim.preempt_curr(0);
        assert_eq!(sim.cpus[0].curr, Some(0));
        assert_eq!(sim.vcpus[0].busy_until, 2_000_000);
    }

    /// A forced exit (the slot policy's signal) of a vCPU running guest user code costs it a
    /// userspace exit from CPL 3 before the VMM decides, as a WAIT's exit does; the act it
    /// interrupted resumes with what it had left.
    #[test]
    fn a_forced_exit_costs_a_userspace_exit_from_guest_user_mode() {
        let c = CostModel::default();
        let mut sim = Sim::new(cfg("queued:kick/slots:userspace", 4, 10)).unwrap();
        sim.vcpus[1].act = Act::Ncs;
        sim.vcpus[1].left = 3_000;
        sim.vcpus[1].on_cpu = true;
        sim.arm(1);
        sim.now = 1_000;
        sim.forced_exit(1);
        assert_eq!(sim.vcpus[1].act, Act::SignalExit);
        assert_eq!(sim.vcpus[1].saved, Some((Act::Ncs, 2_000)));
        let at = guest_event_at(&sim, 1).unwrap() - 1_000;
        assert!(
            (c.wait_exit.lo..=c.wait_exit.hi).contains(&at),
            "the forced exit took {at} ns"
        );
    }

    /// The slot policy's signal to a vCPU halted inside KVM (the watcher had not seen the
    /// halt) ends the halt: `KVM_RUN` returns to the VMM, whose hooks decide on its slot (the
    /// host's in-kernel slot runs wait for a slot about once per preemption). Entering again,
    /// it runs if a kick came meanwhile, else halts in KVM again; meanwhile unlockers still
    /// see its guest in the WAIT.
    #[test]
    fn a_signal_ends_a_halt_inside_kvm_and_the_vcpu_enters_again() {
        let c = CostModel::default();
        let mut sim = Sim::new(cfg("ticket:kick/slots:in-kernel", 4, 10)).unwrap();
        let halt = |sim: &mut Sim| {
            let vc = &mut sim.vcpus[1];
            vc.act = Act::Halted;
            vc.halted_in_kvm = true;
            vc.kicked = true; // a kick's wake-up is on its way
        };
        halt(&mut sim);
        sim.preempt(1);
        let landed = sim
            .heap
            .iter()
            .find_map(|Reverse((t, _, ev))| matches!(ev, Ev::Signal(1)).then_some(*t));
        let at = landed.expect("the signal is sent to the halted vCPU");
        assert!((c.forced_exit.lo..=c.forced_exit.hi).contains(&at), "{at}");
        sim.now = at;
        sim.handle(Ev::Signal(1));
        let vc = &sim.vcpus[1];
        assert_eq!(vc.act, Act::SignalExit);
        assert_eq!(vc.saved, Some((Act::Reenter, c.resume_ns)));
        assert!(
            !vc.halted_in_kvm && vc.kick_latched,
            "the kick waits in the LAPIC"
        );
        assert!(vc.in_guest_wait(), "its guest is still in the WAIT");
        assert_ne!(
            sim.threads[1].state,
            TState::Blocked,
            "the signal woke the thread"
        );
        // Entering again with the kick pending: the guest runs.
        sim.vcpus[1].act = Act::Reenter;
        sim.reenter(1);
        assert_eq!(sim.vcpus[1].act, Act::Resume);
        // Without a kick: halted inside KVM again, no new halt counted.
        let halts = sim.vms[0].report.halts;
        sim.vcpus[1].act = Act::Reenter;
        sim.vcpus[1].kick_latched = false;
        sim.reenter(1);
        assert_eq!(sim.vcpus[1].act, Act::Halted);
        assert!(sim.vcpus[1].halted_in_kvm);
        assert_eq!(sim.threads[1].state, TState::Blocked);
        assert_eq!(sim.vms[0].report.halts, halts);
    }

    /// The halt watcher is a VMM thread: its poll happens when the host runs it, after its
    /// switch and one `blocking` read per watched vCPU, not when its timer fires; it sleeps
    /// again after the poll.
    #[test]
    fn the_halt_watcher_polls_only_when_it_gets_a_cpu() {
        let mut c = cfg("queued:kick/slots:in-kernel@stock", 4, 100);
        c.hogs = 2;
        let mut sim = Sim::new(c).unwrap();
        sim.start_all();
        let w = sim.vms[0].watcher.expect("a watcher with slots in KVM");
        assert_eq!(sim.watcher_vm(w), Some(0));
        assert_eq!(sim.threads[w as usize].state, TState::Blocked);
        assert!(sim.cpus.iter().all(|c| c.curr.is_some()), "both CPUs busy");
        let polls = |sim: &Sim| {
            sim.heap
                .iter()
                .filter(|Reverse((_, _, ev))| matches!(ev, Ev::WatchRun(0, _)))
                .count()
        };
        sim.watch_due(0);
        assert_eq!(sim.threads[w as usize].state, TState::Queued);
        assert_eq!(polls(&sim), 0, "polled without a CPU");
        let cpu = sim.threads[w as usize].cpu;
        sim.now = 5_000_000;
        sim.cpus[cpu as usize].rq.clear();
        sim.queued_total = 0;
        sim.threads[w as usize].state = TState::Blocked;
        sim.stop_running(cpu);
        sim.cpus[cpu as usize].curr = None;
        sim.make_runnable(w);
        assert_eq!(sim.cpus[cpu as usize].curr, Some(w));
        let token = sim.vms[0].watch_token;
        let at = sim
            .heap
            .iter()
            .find_map(|Reverse((t, _, ev))| (*ev == Ev::WatchRun(0, token)).then_some(*t));
        // One probe read per watched vCPU: the two holders, while two vCPUs wait for a slot.
        assert_eq!(sim.vms[0].watch_set.len(), 2);
        let cost = &sim.cost;
        assert_eq!(
            at,
            Some(5_000_000 + cost.context_switch_ns + 2 * cost.halt_probe_ns)
        );
        sim.now = at.unwrap();
        sim.watch_run(0);
        assert_eq!(sim.threads[w as usize].state, TState::Blocked);
        assert_ne!(sim.cpus[cpu as usize].curr, Some(w));
    }

    /// With as many slots as vCPUs nobody ever waits for one, so the watcher sleeps as
    /// `RunSlots::wait_for_watch` does; it used to wake after every halt inside KVM and take
    /// the CPU from a lock holder beside hogs (2 vCPUs at 2x: a 60-s convoy in some seeds).
    #[test]
    fn slots_that_never_act_change_nothing() {
        for seed in 1..=3 {
            let run = |variant: &str| {
                let mut c = cfg(variant, 2, 3_000);
                c.hogs = 2;
                c.seed = seed;
                c.cs_work = 15_000;
                c.ncs_work = 15_000;
                let r = Sim::new(c).unwrap().run();
                assert!(r.finished, "{variant} seed {seed}");
                (r.end_ns, r.vms[0].halts, r.vms[0].kicks)
            };
            assert_eq!(
                run("ticket:kick:in-kernel"),
                run("ticket:kick/slots:in-kernel"),
                "seed {seed}"
            );
        }
    }

    /// The slots' quantum and halt-watch interval reach the policy (the VMM's
    /// `--slot-quantum-us` and `--halt-watch-us`): a shorter quantum preempts more, a slower
    /// watcher polls less, and the watcher's polls are counted.
    #[test]
    fn slot_quantum_and_halt_watch_overrides_reach_the_policy() {
        let run = |quantum_us: u64, watch_us: u64| {
            let mut c = cfg("ticket:kick/slots:signal-msi", 8, 500);
            c.slot_quantum_ns = Some(quantum_us * 1000);
            c.halt_watch_ns = Some(watch_us * 1000);
            let r = Sim::new(c).unwrap().run();
            assert!(r.finished);
            let vm = &r.vms[0];
            (vm.slots.unwrap().preemptions, vm.watch_polls)
        };
        let (short, _) = run(1_000, 100);
        let (long, polls_fast) = run(32_000, 100);
        let (_, polls_slow) = run(32_000, 1_000);
        assert!(
            short > 2 * long,
            "preemptions: {short} at 1 ms, {long} at 32 ms"
        );
        assert!(polls_fast > 0);
        assert!(
            polls_slow < polls_fast,
            "polls: {polls_slow} every 1 ms, {polls_fast} every 100 us"
        );
        let mut bad = cfg("ticket:kick/slots:signal-msi", 8, 10);
        bad.slot_quantum_ns = Some(0);
        assert!(Sim::new(bad).is_err(), "a zero quantum is refused");
    }

    #[test]
    fn the_same_seed_gives_the_same_run_and_seeds_differ() {
        let mut c = cfg("ticket:kick+yield/slots:in-kernel", 6, 400);
        c.hogs = 1;
        let a = Sim::new(c.clone()).unwrap().run();
        let b = Sim::new(c.clone()).unwrap().run();
        assert_eq!(a, b);
        let differ = (2..6).any(|seed| {
            let mut d = c.clone();
            d.seed = seed;
            Sim::new(d).unwrap().run() != a
        });
        assert!(differ, "the seed changes nothing");
    }

    /// Always-runnable threads share the CPUs evenly; a heavier one gets its weight's share.
    #[test]
    fn the_scheduler_is_fair_by_weight() {
        // One VM of one TAS vCPU (alone: never blocks) and 3 hogs on 2 CPUs, 1 s.
        let mut c = cfg("tas:off", 1, 1);
        c.iterations = None;
        c.duration_ns = Some(1_000_000_000);
        c.hogs = 3;
        let r = Sim::new(c.clone()).unwrap().run();
        for (t, &ns) in r.thread_cpu_ns.iter().enumerate() {
            assert!(
                (450_000_000..=550_000_000).contains(&ns),
                "thread {t} got {ns} ns of 1 s with 4 threads on 2 CPUs"
            );
        }
        // One CPU, two hogs and the vCPU; hog 1 at twice the weight gets half the CPU.
        c.host_cpus = 1;
        c.hogs = 2;
        let mut sim = Sim::new(c).unwrap();
        sim.start_all();
        sim.set_weight(1, 2048);
        sim.run_loop();
        let r = sim.finish();
        let (v, heavy, light) = (r.thread_cpu_ns[0], r.thread_cpu_ns[1], r.thread_cpu_ns[2]);
        assert!(
            (450_000_000..=550_000_000).contains(&heavy),
            "heavy {heavy}"
        );
        assert!((200_000_000..=300_000_000).contains(&v), "vcpu {v}");
        assert!(
            (200_000_000..=300_000_000).contains(&light),
            "light {light}"
        );
    }

    /// A VM limited to half a CPU gets half a CPU, throttled every period.
    #[test]
    fn quota_throttles_the_vm_to_its_limit() {
        let mut c = cfg("tas:off", 2, 1);
        c.iterations = None;
        c.duration_ns = Some(1_000_000_000);
        c.cpu_limit = Some(0.5);
        let r = Sim::new(c.clone()).unwrap().run();
        let vm: u64 = r.thread_cpu_ns.iter().sum();
        assert!(
            (450_000_000..=560_000_000).contains(&vm),
            "a 0.5-CPU VM got {vm} ns of CPU in 1 s"
        );
        assert!(r.throttled_periods[0] >= 9, "{:?}", r.throttled_periods);
        // Without the limit it gets both CPUs.
        c.cpu_limit = None;
        let r = Sim::new(c).unwrap().run();
        let vm: u64 = r.thread_cpu_ns.iter().sum();
        assert!(vm > 1_900_000_000, "unlimited: {vm}");
    }

    /// Wake-up preemption: a vCPU that halts and is kicked runs before a hog finishes its
    /// slice, so PV beats plain spinning under overcommit.
    #[test]
    fn pv_kick_beats_spinning_under_overcommit() {
        let time = |variant: &str| {
            let mut c = cfg(variant, 4, 2000);
            c.seed = 5;
            Sim::new(c).unwrap().run().guest_seconds()
        };
        let (off, kick) = (time("ticket:off"), time("ticket:kick"));
        assert!(
            kick * 2.0 < off,
            "ticket:kick {kick} s against ticket:off {off} s"
        );
    }
}
