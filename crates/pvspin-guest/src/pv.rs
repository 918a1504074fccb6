//! The paravirtual slow path shared by the PV locks: the backend trait ([`PvOps`]), the spin
//! policy ([`SpinConfig`]), the per-vCPU state ([`PvDomain`]) and the glue that lets a PV lock
//! live in a `static` [`SpinMutex`](crate::SpinMutex) ([`PvStatic`], [`StaticPv`]).

use core::fmt;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU64, AtomicU8 as CoreAtomicU8, Ordering as CoreOrdering};

use crate::pv_queued::McsNode;
use crate::pv_ticket::TicketWaitSlot;
use crate::sync::{spin_loop, AtomicU64 as SyncU64, AtomicU8, Ordering as SyncOrdering};
#[cfg(not(loom))]
use crate::RawSpinLock;

/// The hardware side of pv_wait / pv_kick: what a PV lock needs from its platform.
///
/// Implementations:
/// - the guest's, over the pvspin ABI: see [`crate::x86::HaltPvOps`] for `wait` and the
///   crate docs for `kick` (a doorbell write, encoded by the embedding guest);
/// - `host::HostPvOps` (feature `std`): host threads park and are unparked, for
///   tests; under `--cfg loom` it is loom-modelled.
///
/// The lock algorithms rely on exactly these guarantees:
/// - `wait(ptr, val)` returns at the latest after a `kick` of this CPU that happens after the
///   caller stored `val` in `*ptr` (a kick that arrives before the halt is remembered, like
///   KVM's `pv_unhalted`); it may return at any time for no reason (spurious wakeup); it does
///   not block at all if `*ptr != val` when it checks.
/// - `kick(cpu)` makes `cpu`'s current or next `wait` return. Kicking a running CPU is harmless
///   (its next `wait` may return at once). It must not block for long.
/// - `cpu_id()` is this CPU's index in the [`PvDomain`] (`0..N`), stable while a lock is held or
///   awaited.
pub trait PvOps: Sync {
    /// Halts this CPU unless `*ptr != val`; returns on a kick, or spuriously.
    fn wait(&self, ptr: &AtomicU8, val: u8);

    /// Wakes `cpu` from its current `wait`, or makes its next `wait` return at once.
    fn kick(&self, cpu: u32);

    /// This CPU's index in the domain, `0..N`.
    fn cpu_id(&self) -> u32;

    /// How many spins a waiter does before it tells the host ([`spin_notify`](Self::spin_notify)).
    /// `u32::MAX` (the default) never notifies. A guest over pvspin's ABI returns the window
    /// the host published (read once at boot and again after each notification).
    fn spin_window(&self) -> u32 {
        u32::MAX
    }

    /// Called by a waiter that spun [`spin_window`](Self::spin_window) times (or
    /// [`SpinBudget::notify_after`] ticks) without getting the lock, and before it halts if it
    /// did not notify during that spin phase (unless [`wait_notifies`](Self::wait_notifies)).
    /// The guest over pvspin's ABI writes the SPIN doorbell (the host may yield to
    /// `wait.waiting_for`). Must not block. The default does nothing.
    fn spin_notify(&self, _wait: &SpinWait) {}

    /// [`wait`](Self::wait), told what the caller waits for. A backend whose wait is itself a
    /// notification (pvspin's WAIT command carries a `SpinNotify`) uses `why`; the default
    /// ignores it.
    fn wait_for(&self, ptr: &AtomicU8, val: u8, why: &SpinWait) {
        let _ = why;
        self.wait(ptr, val);
    }

    /// Whether [`wait_for`](Self::wait_for) already tells the host what [`spin_notify`]
    /// would, so a waiter does not notify separately right before it waits. Default: no.
    ///
    /// [`spin_notify`]: Self::spin_notify
    fn wait_notifies(&self) -> bool {
        false
    }

    /// A monotonic clock in the unit of [`spin_budget`](Self::spin_budget) (guests: the TSC).
    /// The default, a clock that never moves, leaves the iteration limits
    /// ([`SpinConfig::spin_threshold`], [`spin_window`](Self::spin_window)) as the only ones.
    fn now(&self) -> u64 {
        0
    }

    /// How long this CPU's waiters spin, in [`now`](Self::now) ticks: before notifying and
    /// before waiting (pvspin's hint page publishes both, in TSC cycles). Default: unlimited
    /// (iteration limits only).
    fn spin_budget(&self) -> SpinBudget {
        SpinBudget::UNLIMITED
    }

    /// Whether `cpu` is known not to be running (waiting, or not run by the host: pvspin's
    /// hint page). A waiter whose lock waits on such a CPU stops spinning early, as Linux's
    /// owner-spinning locks do with `vcpu_is_preempted` (its pv qspinlock did too, in
    /// `pv_wait_early`, until that was reverted). Default: never known.
    fn is_not_running(&self, cpu: u32) -> bool {
        let _ = cpu;
        false
    }

    /// Whether the host says this VM's vCPUs fit the CPUs it gets (pvspin's hint page
    /// `VCPUS_FIT`, ABI 0.4): a vCPU kicked awake then gets a CPU without queueing behind this
    /// VM's other vCPUs, so a waiter behind a just-kicked next owner ([`SpinWait::waking`])
    /// keeps spinning instead of waiting early. Default: not known (wait early).
    fn vcpus_fit(&self) -> bool {
        false
    }

    /// Whether KVM says `cpu`'s vCPU is preempted: Linux's `vcpu_is_preempted`, which a stock
    /// KVM guest reads from bit 0 of the `preempted` byte of `cpu`'s steal-time area (offset 16
    /// of `struct kvm_steal_time`, registered with `MSR_KVM_STEAL_TIME`). Only the
    /// [stock flavor](crate::StockFlavor) of the queued lock asks, at its queue head (see
    /// there). Default: never preempted, as on a host without steal time.
    fn vcpu_is_preempted(&self, cpu: u32) -> bool {
        let _ = cpu;
        false
    }
}

/// Spin budgets in [`PvOps::now`] ticks. `u64::MAX` is unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinBudget {
    /// Spin this long since the last notification before notifying.
    pub notify_after: u64,
    /// Spin this long in one spin phase before waiting.
    pub wait_after: u64,
}

impl SpinBudget {
    /// No time limits.
    pub const UNLIMITED: Self = Self {
        notify_after: u64::MAX,
        wait_after: u64::MAX,
    };
}

/// What a waiter tells the host when it spun past its window: see [`PvOps::spin_notify`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinWait {
    /// The lock's address (a lock id for the host; pvspin's ABI sends a hash of it).
    pub lock: usize,
    /// The CPU the waiter waits for, if known, as the host is told (a boost or a run slot
    /// for it can end the wait): the ticket lock's holder (recorded at acquisition), or the
    /// queued lock's predecessor when that is the holder or gets the lock next, and the
    /// holder otherwise.
    pub waiting_for: Option<u32>,
    /// `waiting_for` is the CPU that gets the lock next (the queued lock's predecessor when it
    /// is not the holder), not the holder.
    pub next_owner: bool,
    /// The CPU that must run before this wait can end, if known: the spin phase ends early
    /// when it is known not to run. The same as `waiting_for` but for a queued waiter deep in
    /// the queue, whose predecessor (another waiter) is this CPU: it names the holder to the
    /// host, since a boost of a waiter that does not hold the lock ends nobody's wait, and
    /// with pvspin's run slots those boosts gave waiting waiters the slots the lock's next
    /// owners needed (docs/benchmarks.md §12.6).
    pub ahead: Option<u32>,
    /// `ahead` was woken by an unlocker (kicked) and has not run since: it is on its
    /// way to the lock, so "not running" says nothing about how long the wait lasts. When the
    /// host says the VM's vCPUs fit its CPUs ([`PvOps::vcpus_fit`]), the waiter then spins its
    /// whole budget instead of waiting early, so that a waiter that halted once does not make
    /// every later waiter halt behind it (a wake-up convoy). With more vCPUs than CPUs it
    /// waits early as before: spinning would take the CPU the kicked owner needs.
    pub waking: bool,
    /// Spins since the previous notification of this wait (or since it started).
    pub spun: u32,
}

/// Errors of PV lock configuration; each names the rule that was broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PvConfigError {
    /// `spin_threshold` was 0.
    ZeroSpinThreshold,
    /// `spin_threshold` was above [`SpinConfig::MAX_SPIN_THRESHOLD`].
    SpinThresholdTooLarge,
    /// `prewake` was above [`SpinConfig::MAX_PREWAKE`].
    PrewakeTooDeep,
    /// The domain had no CPUs.
    NoCpus,
    /// The domain had more than [`MAX_CPUS`] CPUs.
    TooManyCpus,
}

impl PvConfigError {
    /// The broken rule, as a static string (no number formatting, so usable in guests).
    pub const fn rule(self) -> &'static str {
        match self {
            Self::ZeroSpinThreshold => "spin_threshold must be at least 1",
            Self::SpinThresholdTooLarge => {
                "spin_threshold must be at most SpinConfig::MAX_SPIN_THRESHOLD (2^24)"
            }
            Self::PrewakeTooDeep => "prewake must be at most SpinConfig::MAX_PREWAKE (4)",
            Self::NoCpus => "a PV domain must have at least 1 CPU",
            Self::TooManyCpus => "a PV domain must have at most MAX_CPUS (4096) CPUs",
        }
    }
}

// Hand-written rather than thiserror: the workspace's thiserror has its `std` feature on, and
// this crate must build for bare-metal guests.
impl fmt::Display for PvConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.rule())
    }
}

impl core::error::Error for PvConfigError {}

/// The most vCPUs a [`PvDomain`] may have.
pub const MAX_CPUS: usize = 4096;

/// Words of a domain's halted-CPU bitmap: one bit per CPU (loom models stay within 64 CPUs,
/// and each loom atomic costs the model).
const HALTED_WORDS: usize = if cfg!(loom) { 1 } else { MAX_CPUS / 64 };

/// When a waiter stops spinning and halts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinConfig {
    /// Spin iterations (one load and one PAUSE each) before a waiter publishes itself halted
    /// and calls `pv_wait`; after a spurious wakeup it spins this much again.
    pub spin_threshold: u32,
    /// Whether waiters halt at all. `false` turns the PV locks into plain spinning locks (the
    /// unlocker then never scans or kicks), for side-by-side comparisons.
    pub halt: bool,
    /// The pre-wake's depth: how many halted waiters queued behind the new holder an unlocker
    /// also kicks, nearest first, while the host says the VM's vCPUs fit its CPUs
    /// ([`PvOps::vcpus_fit`]; `guest-locks.md`, "The pre-wake"). 0 turns it off.
    pub prewake: u8,
}

impl SpinConfig {
    /// The largest accepted `spin_threshold`.
    pub const MAX_SPIN_THRESHOLD: u32 = 1 << 24;

    /// The deepest accepted pre-wake ([`SpinConfig::prewake`]): each level may cost an
    /// unlock one more kick.
    pub const MAX_PREWAKE: u8 = 4;

    /// The default pre-wake depth (`docs/benchmarks.md` §14.3 compares 1 and 2).
    pub const DEFAULT_PREWAKE: u8 = 2;

    /// For guests whose every instruction is emulated (about 0.5 us each, the development
    /// machines): 128 spins, a few hundred microseconds, about the cost of one halt and kick.
    pub const EMULATED: Self = Self {
        spin_threshold: 128,
        halt: true,
        prewake: Self::DEFAULT_PREWAKE,
    };

    /// For hardware-virtualized guests: Linux's `SPIN_THRESHOLD` (`1 << 15`).
    pub const HARDWARE: Self = Self {
        spin_threshold: 1 << 15,
        halt: true,
        prewake: Self::DEFAULT_PREWAKE,
    };

    /// Checks the rules; returns the config unchanged when it follows them.
    pub const fn validate(self) -> Result<Self, PvConfigError> {
        if self.spin_threshold == 0 {
            Err(PvConfigError::ZeroSpinThreshold)
        } else if self.spin_threshold > Self::MAX_SPIN_THRESHOLD {
            Err(PvConfigError::SpinThresholdTooLarge)
        } else if self.prewake > Self::MAX_PREWAKE {
            Err(PvConfigError::PrewakeTooDeep)
        } else {
            Ok(self)
        }
    }
}

impl Default for SpinConfig {
    fn default() -> Self {
        Self::EMULATED
    }
}

/// Slow-path event counters of one vCPU (written only by that vCPU).
#[derive(Debug, Default)]
pub struct PvStats {
    slowpath: AtomicU64,
    halts: AtomicU64,
    spurious: AtomicU64,
    kicks: AtomicU64,
    no_kick: AtomicU64,
    wait_early: AtomicU64,
    preempted: AtomicU64,
    behind_waking: AtomicU64,
    prewakes: AtomicU64,
}

impl PvStats {
    const fn new() -> Self {
        Self {
            slowpath: AtomicU64::new(0),
            halts: AtomicU64::new(0),
            spurious: AtomicU64::new(0),
            kicks: AtomicU64::new(0),
            no_kick: AtomicU64::new(0),
            wait_early: AtomicU64::new(0),
            preempted: AtomicU64::new(0),
            behind_waking: AtomicU64::new(0),
            prewakes: AtomicU64::new(0),
        }
    }

    #[inline]
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, CoreOrdering::Relaxed);
    }

    pub(crate) fn slowpath(&self) {
        Self::bump(&self.slowpath);
    }
    pub(crate) fn halt(&self) {
        Self::bump(&self.halts);
    }
    pub(crate) fn spurious(&self) {
        Self::bump(&self.spurious);
    }
    pub(crate) fn kick(&self) {
        Self::bump(&self.kicks);
    }
    pub(crate) fn no_kick(&self) {
        Self::bump(&self.no_kick);
    }
    pub(crate) fn wait_early(&self) {
        Self::bump(&self.wait_early);
    }
    pub(crate) fn preempted(&self) {
        Self::bump(&self.preempted);
    }
    pub(crate) fn behind_waking(&self) {
        Self::bump(&self.behind_waking);
    }
    pub(crate) fn prewake(&self) {
        Self::bump(&self.prewakes);
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> PvStatsSnapshot {
        let load = |c: &AtomicU64| c.load(CoreOrdering::Relaxed);
        PvStatsSnapshot {
            slowpath: load(&self.slowpath),
            halts: load(&self.halts),
            spurious: load(&self.spurious),
            kicks: load(&self.kicks),
            no_kick: load(&self.no_kick),
            wait_early: load(&self.wait_early),
            preempted: load(&self.preempted),
            behind_waking: load(&self.behind_waking),
            prewakes: load(&self.prewakes),
        }
    }
}

/// Slow-path event counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvStatsSnapshot {
    /// Waits that spun past the threshold (entered the halt path).
    pub slowpath: u64,
    /// `pv_wait` calls (halt attempts; the backend may return without halting).
    pub halts: u64,
    /// Returns from `pv_wait` that did not find the lock handed over (spurious wakeups, or a
    /// kick meant for an earlier wait).
    pub spurious: u64,
    /// Kicks sent by unlockers on this vCPU.
    pub kicks: u64,
    /// Contended unlocks that found the next waiter running, so sent no kick (the stock
    /// queued lock: queue-head hand-overs to a running successor).
    pub no_kick: u64,
    /// Waits begun early. Stock queued lock: node waits that stopped spinning and halted
    /// early because the predecessor's node was not running (Linux's `pv_wait_early`).
    /// pvspin locks with time budgets (since 2026-12-03): spin phases that ended before their
    /// budget because the CPU waited for was known not to run ([`PvOps::is_not_running`]).
    pub wait_early: u64,
    /// Stock queued lock: preemptions that cut a queue head's spin short, of the vCPU that
    /// handed it the queue head (the holder, unless the lock was stolen;
    /// [`PvOps::vcpu_is_preempted`]). Counted once however many rounds in a row it cuts short
    /// (until 2026-12 each round counted: millions per run).
    pub preempted: u64,
    /// pvspin locks: spin phases that found the vCPU waited for not running but just kicked
    /// ([`SpinWait::waking`]) while the host said the VM's vCPUs fit its CPUs
    /// ([`PvOps::vcpus_fit`]), and so kept spinning instead of waiting early.
    pub behind_waking: u64,
    /// pvspin locks: kicks an unlocker sent to halted waiters queued behind the new holder
    /// (the pre-wake, [`SpinConfig::prewake`], only while the host says the VM's vCPUs fit its
    /// CPUs, [`PvOps::vcpus_fit`]); also counted in `kicks`. The woken waiter finds the lock still
    /// held, so each also shows as a spurious wakeup, or as a halt more if it waits again.
    pub prewakes: u64,
}

impl PvStatsSnapshot {
    /// The element-wise sum (saturating).
    pub const fn add(self, other: Self) -> Self {
        Self {
            slowpath: self.slowpath.saturating_add(other.slowpath),
            halts: self.halts.saturating_add(other.halts),
            spurious: self.spurious.saturating_add(other.spurious),
            kicks: self.kicks.saturating_add(other.kicks),
            no_kick: self.no_kick.saturating_add(other.no_kick),
            wait_early: self.wait_early.saturating_add(other.wait_early),
            preempted: self.preempted.saturating_add(other.preempted),
            behind_waking: self.behind_waking.saturating_add(other.behind_waking),
            prewakes: self.prewakes.saturating_add(other.prewakes),
        }
    }
}

/// MCS nodes per vCPU: how many [`PvQueuedLock`](crate::PvQueuedLock)s one vCPU may hold or
/// wait for at once (nesting, like Linux's four per-CPU qnodes).
pub const NODES_PER_CPU: usize = 4;

/// The PV state of one vCPU: its ticket-lock waiting slot, its MCS nodes and its counters.
#[derive(Debug)]
#[repr(align(64))]
pub struct PvCpu {
    pub(crate) ticket: TicketWaitSlot,
    pub(crate) nodes: [McsNode; NODES_PER_CPU],
    /// Bitmask of free `nodes`; touched only by this vCPU (atomic so that an interrupt
    /// handler on this vCPU cannot take the same node).
    free_nodes: CoreAtomicU8,
    pub(crate) stats: PvStats,
}

const ALL_NODES_FREE: u8 = (1 << NODES_PER_CPU) - 1;

impl PvCpu {
    #[cfg(not(loom))]
    const fn new() -> Self {
        Self {
            ticket: TicketWaitSlot::new(),
            nodes: [const { McsNode::new() }; NODES_PER_CPU],
            free_nodes: CoreAtomicU8::new(ALL_NODES_FREE),
            stats: PvStats::new(),
        }
    }

    #[cfg(loom)]
    fn new() -> Self {
        Self {
            ticket: TicketWaitSlot::new(),
            nodes: core::array::from_fn(|_| McsNode::new()),
            free_nodes: CoreAtomicU8::new(ALL_NODES_FREE),
            stats: PvStats::new(),
        }
    }

    /// Takes a free MCS node; `None` when all [`NODES_PER_CPU`] are in use.
    pub(crate) fn alloc_node(&self) -> Option<usize> {
        let mut free = self.free_nodes.load(CoreOrdering::Relaxed);
        loop {
            if free == 0 {
                return None;
            }
            let index = free.trailing_zeros() as usize;
            match self.free_nodes.compare_exchange_weak(
                free,
                free & !(1 << index),
                CoreOrdering::Relaxed,
                CoreOrdering::Relaxed,
            ) {
                Ok(_) => return Some(index),
                Err(now) => free = now,
            }
        }
    }

    /// Returns a node taken with `alloc_node`.
    pub(crate) fn free_node(&self, index: usize) {
        self.free_nodes.fetch_or(1 << index, CoreOrdering::Relaxed);
    }

    /// This vCPU's counters.
    pub fn stats(&self) -> PvStatsSnapshot {
        self.stats.snapshot()
    }
}

/// Everything the PV locks of one guest share: the backend, the spin policy and the per-vCPU
/// state of `N` vCPUs (no allocation; put it in a `static`).
///
/// Every PV lock must always be used with the same domain.
#[derive(Debug)]
pub struct PvDomain<O, const N: usize> {
    ops: O,
    /// The spin policy, changeable at run time ([`PvDomain::configure`]): a guest learns its
    /// thresholds at boot. Not part of any handshake, so plain `core` atomics.
    spin_threshold: core::sync::atomic::AtomicU32,
    halt: core::sync::atomic::AtomicBool,
    prewake: core::sync::atomic::AtomicU8,
    cpus: [PvCpu; N],
    /// Slow-path entries by a CPU whose id was not below `N` (it spins instead of halting).
    bad_cpu: AtomicU64,
    /// One bit per CPU that published a halt on a PV ticket lock and has not come back
    /// (Linux's old pv ticketlock kept the same set, `waiting_cpus`): an unlocker looks at the
    /// wait slots of these CPUs only, so an unlock reads `N / 64` words and the slots of the
    /// halted, not all `N` slots (part of the halt/kick handshake, so loom atomics under loom).
    halted: [SyncU64; HALTED_WORDS],
}

impl<O, const N: usize> PvDomain<O, N> {
    const fn check(config: SpinConfig) -> Result<(), PvConfigError> {
        if N == 0 {
            return Err(PvConfigError::NoCpus);
        }
        if N > MAX_CPUS || N > HALTED_WORDS * 64 {
            return Err(PvConfigError::TooManyCpus);
        }
        match config.validate() {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A domain for `N` vCPUs.
    ///
    /// # Panics
    ///
    /// If `config` or `N` breaks a rule of [`PvConfigError`]; in a `static` initializer that
    /// is a compile-time error. [`PvDomain::try_new`] returns the error instead.
    #[cfg(not(loom))]
    pub const fn new(ops: O, config: SpinConfig) -> Self {
        if let Err(e) = Self::check(config) {
            panic!("{}", e.rule());
        }
        Self {
            ops,
            spin_threshold: core::sync::atomic::AtomicU32::new(config.spin_threshold),
            halt: core::sync::atomic::AtomicBool::new(config.halt),
            prewake: core::sync::atomic::AtomicU8::new(config.prewake),
            cpus: [const { PvCpu::new() }; N],
            bad_cpu: AtomicU64::new(0),
            halted: [const { SyncU64::new(0) }; HALTED_WORDS],
        }
    }

    /// A domain for `N` vCPUs (under loom, whose atomics are not `const`).
    #[cfg(loom)]
    pub fn new(ops: O, config: SpinConfig) -> Self {
        if let Err(e) = Self::check(config) {
            panic!("{}", e.rule());
        }
        Self {
            ops,
            spin_threshold: core::sync::atomic::AtomicU32::new(config.spin_threshold),
            halt: core::sync::atomic::AtomicBool::new(config.halt),
            prewake: core::sync::atomic::AtomicU8::new(config.prewake),
            cpus: core::array::from_fn(|_| PvCpu::new()),
            bad_cpu: AtomicU64::new(0),
            halted: core::array::from_fn(|_| SyncU64::new(0)),
        }
    }

    /// Like [`PvDomain::new`], but returns the broken rule instead of panicking.
    pub fn try_new(ops: O, config: SpinConfig) -> Result<Self, PvConfigError> {
        Self::check(config)?;
        Ok(Self::new(ops, config))
    }

    /// The view the PV lock methods take.
    pub fn pv(&self) -> Pv<'_, O> {
        Pv {
            ops: &self.ops,
            config: self.config(),
            cpus: &self.cpus,
            bad_cpu: &self.bad_cpu,
            halted: &self.halted[..N.div_ceil(64)],
        }
    }

    /// The backend.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// The spin policy.
    pub fn config(&self) -> SpinConfig {
        SpinConfig {
            spin_threshold: self.spin_threshold.load(CoreOrdering::Relaxed),
            halt: self.halt.load(CoreOrdering::Relaxed),
            prewake: self.prewake.load(CoreOrdering::Relaxed),
        }
    }

    /// Replaces the spin policy (e.g. with thresholds the guest learned at boot). Lock
    /// operations already under way finish with the policy they started with; both are safe.
    pub fn configure(&self, config: SpinConfig) -> Result<(), PvConfigError> {
        let config = config.validate()?;
        self.spin_threshold
            .store(config.spin_threshold, CoreOrdering::Relaxed);
        self.halt.store(config.halt, CoreOrdering::Relaxed);
        self.prewake.store(config.prewake, CoreOrdering::Relaxed);
        Ok(())
    }

    /// The counters of vCPU `cpu`, if it exists.
    pub fn cpu_stats(&self, cpu: u32) -> Option<PvStatsSnapshot> {
        self.cpus.get(cpu as usize).map(PvCpu::stats)
    }

    /// The counters summed over all vCPUs.
    pub fn total_stats(&self) -> PvStatsSnapshot {
        self.cpus
            .iter()
            .fold(PvStatsSnapshot::default(), |sum, cpu| sum.add(cpu.stats()))
    }

    /// Slow-path entries by a CPU whose id was out of range (it spun instead of halting, or,
    /// for the queued lock, panicked).
    pub fn bad_cpu_count(&self) -> u64 {
        self.bad_cpu.load(CoreOrdering::Relaxed)
    }
}

/// A borrowed view of a [`PvDomain`]: what the PV lock methods take. Cheap to copy.
#[derive(Debug)]
pub struct Pv<'a, O> {
    pub(crate) ops: &'a O,
    pub(crate) config: SpinConfig,
    pub(crate) cpus: &'a [PvCpu],
    bad_cpu: &'a AtomicU64,
    /// The domain's halted-CPU bitmap, the words that hold its `N` CPUs.
    pub(crate) halted: &'a [SyncU64],
}

impl<O> Clone for Pv<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O> Copy for Pv<'_, O> {}

impl<O: PvOps> Pv<'_, O> {
    /// One spin phase of a waiter: until `done()`, for at most `spin_threshold` spins and
    /// [`SpinBudget::wait_after`] ticks, calling [`PvOps::spin_notify`] each time the spins
    /// since the last notification reach [`PvOps::spin_window`] or the ticks reach
    /// [`SpinBudget::notify_after`] (both re-read after each notification). Without a clock
    /// (spin counts), also once more at the end if the phase did not notify and the wait will
    /// not tell the host itself (the waiter is about to halt). The phase also ends early when the CPU the waiter waits for
    /// is known not to run ([`PvOps::is_not_running`]): spinning cannot end before it runs;
    /// not when that CPU was just kicked ([`SpinWait::waking`]) and the VM's vCPUs fit its
    /// CPUs ([`PvOps::vcpus_fit`]), since it is about to run.
    /// `wait(spun)` describes the wait. Returns whether `done()` became true.
    #[inline]
    pub(crate) fn spin_phase(
        &self,
        done: impl Fn() -> bool,
        wait: impl Fn(u32) -> SpinWait,
    ) -> bool {
        /// Spins between checks of whether the waited-for CPU runs (each check may scan).
        const RUNNING_CHECK_EVERY: u32 = 64;
        let mut window = self.ops.spin_window();
        let mut budget = self.ops.spin_budget();
        if budget == SpinBudget::UNLIMITED {
            // No clock (ABI 0.2 spin counts, host tests, loom): the plain loop, which in
            // emulated guest code costs a fraction of the timed one per spin.
            return self.spin_phase_counted(done, wait, window);
        }
        let start = self.ops.now();
        let mut last_notify = start;
        let mut since = 0u32;
        let mut counted_behind_waking = false;
        for spins in 0..self.config.spin_threshold {
            if done() {
                return true;
            }
            spin_loop();
            since += 1;
            let now = self.ops.now();
            if since >= window || now.wrapping_sub(last_notify) >= budget.notify_after {
                self.ops.spin_notify(&wait(since));
                since = 0;
                window = self.ops.spin_window();
                budget = self.ops.spin_budget();
                last_notify = self.ops.now();
            }
            if now.wrapping_sub(start) >= budget.wait_after {
                break;
            }
            if spins % RUNNING_CHECK_EVERY == RUNNING_CHECK_EVERY - 1 {
                let now_waiting = wait(since);
                if let Some(cpu) = now_waiting.ahead {
                    let about_to_run = now_waiting.waking && self.ops.vcpus_fit();
                    if self.ops.is_not_running(cpu) {
                        if !about_to_run {
                            // Counted so that a host can tell early waits from spent budgets.
                            if let Some((_, me)) = self.this_cpu() {
                                me.stats.wait_early();
                            }
                            break;
                        }
                        if !counted_behind_waking {
                            counted_behind_waking = true;
                            if let Some((_, me)) = self.this_cpu() {
                                me.stats.behind_waking();
                            }
                        }
                    }
                }
            }
        }
        // With time budgets a notification before waiting is sent only when its window
        // elapsed (above): the host's window adaptation then also governs it, so on an idle
        // host, where notifying cannot help, waiters stop notifying. (Spin counts, 0.2,
        // notify once before every halt: `spin_phase_counted`.)
        false
    }

    /// [`spin_phase`](Self::spin_phase) with spin counts only.
    #[inline]
    fn spin_phase_counted(
        &self,
        done: impl Fn() -> bool,
        wait: impl Fn(u32) -> SpinWait,
        mut window: u32,
    ) -> bool {
        let mut since = 0u32;
        let mut notified = false;
        for _ in 0..self.config.spin_threshold {
            if done() {
                return true;
            }
            spin_loop();
            since += 1;
            if since >= window {
                self.ops.spin_notify(&wait(since));
                notified = true;
                since = 0;
                window = self.ops.spin_window();
            }
        }
        if !notified && window != u32::MAX && !self.ops.wait_notifies() {
            self.ops.spin_notify(&wait(since));
        }
        false
    }

    /// Marks CPU `id` (below `N`) halted on a PV ticket lock, after its wait slot says so.
    /// SeqCst: the halt/kick handshake orders it before the waiter's re-check of `owner`.
    pub(crate) fn mark_halted(&self, id: u32) {
        let (word, bit) = (id as usize / 64, id % 64);
        if let Some(word) = self.halted.get(word) {
            word.fetch_or(1 << bit, SyncOrdering::SeqCst);
        }
    }

    /// Clears CPU `id`'s halted bit: it runs again.
    pub(crate) fn clear_halted(&self, id: u32) {
        let (word, bit) = (id as usize / 64, id % 64);
        if let Some(word) = self.halted.get(word) {
            word.fetch_and(!(1 << bit), SyncOrdering::Relaxed);
        }
    }

    /// Whether some CPU of the domain is marked halted (after the unlocker's fence).
    pub(crate) fn any_halted(&self) -> bool {
        self.halted
            .iter()
            .any(|word| word.load(SyncOrdering::Acquire) != 0)
    }

    /// This CPU's id and state, or `None` (counted) if the backend's id is out of range.
    pub(crate) fn this_cpu(&self) -> Option<(u32, &PvCpu)> {
        let id = self.ops.cpu_id();
        match self.cpus.get(id as usize) {
            Some(cpu) => Some((id, cpu)),
            None => {
                self.bad_cpu.fetch_add(1, CoreOrdering::Relaxed);
                None
            }
        }
    }
}

/// A PV lock: like [`RawSpinLock`], but its methods take the [`Pv`] domain view.
///
/// # Safety
///
/// Same contract as [`RawSpinLock`], for callers that always pass the same domain.
pub unsafe trait RawPvLock {
    /// An unlocked lock, for statics.
    #[cfg(not(loom))]
    const UNLOCKED: Self;

    /// Waits (spinning, then halting) until the lock is taken.
    fn lock<O: PvOps>(&self, pv: Pv<'_, O>);

    /// Takes the lock if it is free; never waits.
    fn try_lock<O: PvOps>(&self, pv: Pv<'_, O>) -> bool;

    /// Releases the lock, kicking the next waiter if it halted.
    ///
    /// # Safety
    ///
    /// The caller must hold the lock, on this CPU.
    unsafe fn unlock<O: PvOps>(&self, pv: Pv<'_, O>);

    /// Whether some caller holds the lock (a racy snapshot, for diagnostics).
    fn is_locked(&self) -> bool;
}

/// Names a `static` [`PvDomain`] at the type level, so that a PV lock can implement
/// [`RawSpinLock`] (whose methods take no domain) through [`StaticPv`]. Usually implemented
/// with [`pv_static!`](crate::pv_static).
pub trait PvStatic: 'static {
    /// The backend.
    type Ops: PvOps + 'static;
    /// The domain.
    fn pv() -> Pv<'static, Self::Ops>;
}

/// Implements [`PvStatic`] for a new marker type naming a `static` [`PvDomain`]:
/// `pv_static!(pub GuestPv: MyOps = MY_DOMAIN);`
#[macro_export]
macro_rules! pv_static {
    ($vis:vis $name:ident : $ops:ty = $domain:path) => {
        /// Marker type naming a static PV domain.
        #[derive(Debug)]
        $vis struct $name;
        impl $crate::PvStatic for $name {
            type Ops = $ops;
            fn pv() -> $crate::Pv<'static, $ops> {
                $domain.pv()
            }
        }
    };
}

/// A PV lock bound to the static domain `D`: a [`RawSpinLock`], so it works in a
/// [`SpinMutex`](crate::SpinMutex).
pub struct StaticPv<L, D> {
    lock: L,
    _domain: PhantomData<fn() -> D>,
}

impl<L: fmt::Debug, D> fmt::Debug for StaticPv<L, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticPv")
            .field("lock", &self.lock)
            .finish()
    }
}

impl<L, D> StaticPv<L, D> {
    /// The PV lock.
    pub fn inner(&self) -> &L {
        &self.lock
    }
}

#[cfg(not(loom))]
// SAFETY: every method forwards to `L` with the one domain `D::pv()`, so `L`'s contract holds.
unsafe impl<L: RawPvLock, D: PvStatic> RawSpinLock for StaticPv<L, D> {
    const UNLOCKED: Self = Self {
        lock: L::UNLOCKED,
        _domain: PhantomData,
    };

    fn lock(&self) {
        self.lock.lock(D::pv());
    }

    fn try_lock(&self) -> bool {
        self.lock.try_lock(D::pv())
    }

    unsafe fn unlock(&self) {
        // SAFETY: the caller holds the lock (this trait's contract).
        unsafe { self.lock.unlock(D::pv()) };
    }

    fn is_locked(&self) -> bool {
        self.lock.is_locked()
    }
}
