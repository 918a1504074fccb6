//! The reference guest side of pvspin, `no_std` and allocation-free: plain and paravirtual
//! spinlocks over a small backend trait ([`PvOps`]), so the same lock code runs in bare-metal
//! guests (`crates/pvspin-test-vm/guest`) and on host threads in this crate's tests and loom
//! models.
//!
//! | item | what |
//! |---|---|
//! | [`TicketLock`], [`TasLock`] | plain spinlocks: fair FIFO tickets, test-and-test-and-set |
//! | [`BackoffTicketLock`] | tickets whose waiters back off in proportion to their place in the queue, with a unit the lock tunes itself ([`HandoverEstimate`]) |
//! | [`SpinMutex`], [`RawSpinLock`] | data guarded by any raw spinlock |
//! | [`PvTicketLock`], [`PvBackoffTicketLock`] | PV tickets: a waiter past the threshold halts; the unlocker kicks the halted holder of the next ticket |
//! | [`PvQueuedLock`] | PV MCS lock: the unlocker hands over, and kicks its successor only if it halted, only at unlock |
//! | [`StockQueuedLock`] | Linux's pv qspinlock as a stock KVM guest runs it (pending byte, one steal, `pv_wait_early`, `SLOW` locks kicked at unlock) |
//! | [`PvOps`], [`SpinConfig`], [`SpinBudget`], [`SpinWait`] | the backend contract (wait, kick, CPU id, spin notifications, time budgets), the spin threshold and the pre-wake depth |
//! | [`PvDomain`], [`PvStatic`], [`pv_static!`], [`StaticPv`] | the per-vCPU state of `N` vCPUs, no allocation; PV locks bound to a `static` domain are [`RawSpinLock`]s |
//! | [`PvDomain::cpu_stats`], [`PvDomain::total_stats`] | counters: slow paths, halts, spurious wake-ups, kicks, unlocks that needed no kick |
//! | [`x86`] | the x86-64 guest backend: [`x86::HaltPvOps`] (`cli; hlt` only while the value matches) around the guest's [`x86::PvPlatform`] |
//! | `host` (feature `test-utils`) | `host::HostPvOps`: host threads park on a latch that remembers early kicks and injects spurious wake-ups |
//!
//! An invalid [`SpinConfig`] or `N` in a `static` [`PvDomain`] is a compile-time error.
//! Nothing here uses floats or `core::fmt` number formatting, so guests built without SSE can
//! use every lock.
//!
//! The README has a guest's PV locks as a compiling example. `docs/guest-locks.md` in the
//! repository has the rest: what a backend over the pvspin ABI must do, why the halt/kick
//! handshake loses no wake-up (and the loom models that check it), spin notifications, the
//! hint page, the tests and benchmarks, and what is not implemented yet.
#![no_std]
#![deny(missing_docs)]

#[cfg(any(test, feature = "test-utils"))]
extern crate std;

mod backoff;
#[cfg(any(test, feature = "test-utils"))]
pub mod host;
#[cfg(all(test, loom))]
mod loom_tests;
mod mutex;
mod pv;
mod pv_queued;
mod pv_ticket;
mod sync;
mod tas;
mod ticket;
#[cfg(all(target_arch = "x86_64", not(loom)))]
pub mod x86;

pub use backoff::{BackoffTicketLock, HandoverEstimate, PvBackoffTicketLock};
pub use mutex::{SpinMutex, SpinMutexGuard};
pub use pv::{
    Pv, PvConfigError, PvCpu, PvDomain, PvOps, PvStatic, PvStats, PvStatsSnapshot, RawPvLock,
    SpinBudget, SpinConfig, SpinWait, StaticPv, MAX_CPUS, NODES_PER_CPU,
};
pub use pv_queued::{
    McsNode, PvQueuedLock, PvspinFlavor, QueuedFlavor, StockFlavor, StockQueuedLock,
};
pub use pv_ticket::PvTicketLock;
pub use sync::AtomicU8;
pub use tas::TasLock;
pub use ticket::TicketLock;

/// A [`PvTicketLock`] on the static domain `D`, usable in a [`SpinMutex`].
pub type StaticPvTicketLock<D> = StaticPv<PvTicketLock, D>;
/// A [`PvQueuedLock`] on the static domain `D`, usable in a [`SpinMutex`].
pub type StaticPvQueuedLock<D> = StaticPv<PvQueuedLock, D>;
/// A [`StockQueuedLock`] on the static domain `D`, usable in a [`SpinMutex`].
pub type StaticStockQueuedLock<D> = StaticPv<StockQueuedLock, D>;
/// A [`PvBackoffTicketLock`] on the static domain `D`, usable in a [`SpinMutex`].
pub type StaticPvBackoffTicketLock<D> = StaticPv<PvBackoffTicketLock, D>;

/// A raw spinlock: mutual exclusion without data.
///
/// # Safety
///
/// Implementors must guarantee mutual exclusion: between a `lock` (or successful `try_lock`)
/// and the matching `unlock`, no other caller's `lock` returns, and `unlock` publishes the
/// holder's writes to the next holder (release/acquire).
pub unsafe trait RawSpinLock {
    /// An unlocked lock, for statics.
    const UNLOCKED: Self;

    /// Spins until the lock is taken.
    fn lock(&self);

    /// Takes the lock if it is free; never spins.
    fn try_lock(&self) -> bool;

    /// Releases the lock.
    ///
    /// # Safety
    ///
    /// The caller must hold the lock.
    unsafe fn unlock(&self);

    /// Whether some caller holds the lock (a racy snapshot, for diagnostics).
    fn is_locked(&self) -> bool;
}

#[cfg(all(test, not(loom)))]
mod tests_common {
    use core::cell::UnsafeCell;
    use std::sync::Arc;
    use std::vec::Vec;

    use crate::host::{bind_current_thread, HostPvOps, HostStats};
    use crate::{PvDomain, PvOps, RawPvLock, RawSpinLock, SpinConfig, SpinMutex, SpinWait};

    /// The host backend plus spin notifications: a fixed window, every notification recorded.
    #[derive(Debug)]
    pub(crate) struct Notifying<const N: usize> {
        pub(crate) inner: HostPvOps<N>,
        window: u32,
        notes: std::sync::Mutex<Vec<SpinWait>>,
    }

    impl<const N: usize> Notifying<N> {
        pub(crate) fn new(window: u32) -> Self {
            Self {
                inner: HostPvOps::new(),
                window,
                notes: std::sync::Mutex::new(Vec::new()),
            }
        }

        pub(crate) fn notes(&self) -> Vec<SpinWait> {
            self.notes.lock().unwrap().clone()
        }
    }

    impl<const N: usize> PvOps for Notifying<N> {
        fn wait(&self, ptr: &crate::AtomicU8, val: u8) {
            self.inner.wait(ptr, val);
        }
        fn kick(&self, cpu: u32) {
            self.inner.kick(cpu);
        }
        fn cpu_id(&self) -> u32 {
            self.inner.cpu_id()
        }
        fn spin_window(&self) -> u32 {
            self.window
        }
        fn spin_notify(&self, wait: &SpinWait) {
            self.notes.lock().unwrap().push(*wait);
        }
    }

    /// The host backend with time budgets: a logical clock that advances one tick per read,
    /// fixed budgets, CPUs marked not running, and every notification and wait recorded.
    #[derive(Debug)]
    pub(crate) struct Timed<const N: usize> {
        pub(crate) inner: HostPvOps<N>,
        clock: std::sync::atomic::AtomicU64,
        budget: crate::SpinBudget,
        not_running: std::sync::atomic::AtomicU32,
        vcpus_fit: std::sync::atomic::AtomicBool,
        pub(crate) notes: std::sync::Mutex<Vec<SpinWait>>,
        pub(crate) waits: std::sync::Mutex<Vec<SpinWait>>,
        notifies_in_wait: bool,
    }

    impl<const N: usize> Timed<N> {
        pub(crate) fn new(budget: crate::SpinBudget, notifies_in_wait: bool) -> Self {
            Self {
                inner: HostPvOps::new(),
                clock: std::sync::atomic::AtomicU64::new(0),
                budget,
                not_running: std::sync::atomic::AtomicU32::new(0),
                vcpus_fit: std::sync::atomic::AtomicBool::new(false),
                notes: std::sync::Mutex::new(Vec::new()),
                waits: std::sync::Mutex::new(Vec::new()),
                notifies_in_wait,
            }
        }

        /// Clock reads so far (one per spin).
        pub(crate) fn ticks(&self) -> u64 {
            self.clock.load(std::sync::atomic::Ordering::Relaxed)
        }

        /// What [`PvOps::vcpus_fit`] answers (the host's `VCPUS_FIT`).
        pub(crate) fn set_vcpus_fit(&self, fit: bool) {
            self.vcpus_fit
                .store(fit, std::sync::atomic::Ordering::Relaxed);
        }

        /// Marks `cpu` (below 32) not running.
        pub(crate) fn set_not_running(&self, cpu: u32) {
            self.not_running
                .fetch_or(1 << cpu, std::sync::atomic::Ordering::Relaxed);
        }
    }

    impl<const N: usize> PvOps for Timed<N> {
        fn wait(&self, ptr: &crate::AtomicU8, val: u8) {
            self.inner.wait(ptr, val);
        }
        fn wait_for(&self, ptr: &crate::AtomicU8, val: u8, why: &SpinWait) {
            self.waits.lock().unwrap().push(*why);
            self.inner.wait(ptr, val);
        }
        fn wait_notifies(&self) -> bool {
            self.notifies_in_wait
        }
        fn kick(&self, cpu: u32) {
            self.inner.kick(cpu);
        }
        fn cpu_id(&self) -> u32 {
            self.inner.cpu_id()
        }
        fn spin_notify(&self, wait: &SpinWait) {
            self.notes.lock().unwrap().push(*wait);
        }
        fn now(&self) -> u64 {
            self.clock
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }
        fn spin_budget(&self) -> crate::SpinBudget {
            self.budget
        }
        fn is_not_running(&self, cpu: u32) -> bool {
            cpu < 32
                && self.not_running.load(std::sync::atomic::Ordering::Relaxed) & (1 << cpu) != 0
        }
        fn vcpus_fit(&self) -> bool {
            self.vcpus_fit.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// A holder (CPU 0, this thread) lets four waiters (CPUs 1..=4) queue one by one, each
    /// halting (`parked` says so, bounded wait) before the next queues, runs `before_unlock`
    /// and unlocks; returns the order in which the waiters took the lock.
    fn serve_four_halted_waiters<O, L>(
        domain: &Arc<PvDomain<O, 5>>,
        lock: &Arc<L>,
        parked: fn(&O, u32) -> u64,
        before_unlock: impl FnOnce(&L),
    ) -> Vec<u32>
    where
        O: PvOps + Send + Sync + 'static,
        L: RawPvLock + Send + Sync + 'static,
    {
        use std::sync::Mutex;
        let order = Arc::new(Mutex::new(Vec::new()));
        bind_current_thread(0);
        lock.lock(domain.pv());
        let mut threads = Vec::new();
        for id in 1..5u32 {
            threads.push({
                let (domain, lock, order) = (domain.clone(), lock.clone(), order.clone());
                std::thread::spawn(move || {
                    bind_current_thread(id);
                    lock.lock(domain.pv());
                    order.lock().unwrap().push(id);
                    // SAFETY: this thread holds the lock.
                    unsafe { lock.unlock(domain.pv()) };
                })
            });
            let mut tries = 0;
            while parked(domain.ops(), id) != 1 {
                tries += 1;
                assert!(tries < 20_000, "waiter {id} never halted");
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
        before_unlock(lock);
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        for thread in threads {
            thread.join().unwrap();
        }
        let order = order.lock().unwrap().clone();
        order
    }

    /// A holder (CPU 0) lets four waiters (CPUs 1..=4) queue one by one, each halting before
    /// the next queues, then unlocks: they must be served in queue order, each unlock kicking
    /// exactly the next waiter once. `queue_len`, for locks that count, is the lock's own
    /// racy count of holder and waiters.
    pub(crate) fn check_kick_order<L: RawPvLock + Send + Sync + 'static>(
        lock: L,
        queue_len: Option<fn(&L) -> u32>,
    ) {
        let config = SpinConfig {
            spin_threshold: 4,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<HostPvOps<5>, 5>> =
            Arc::new(PvDomain::new(HostPvOps::new(), config));
        let lock = Arc::new(lock);
        let order = serve_four_halted_waiters(&domain, &lock, HostPvOps::parked, |lock| {
            if let Some(queue_len) = queue_len {
                assert_eq!(queue_len(lock), 5);
            }
        });
        assert_eq!(order, [1, 2, 3, 4]);
        let stats = domain.total_stats();
        // Unlocks by 0, 1, 2, 3 kick 1, 2, 3, 4; the last unlock has no waiter and scans nothing.
        assert_eq!((stats.kicks, stats.halts), (4, 4), "{stats:?}");
        assert_eq!(domain.ops().stats().kicks, 4);
        for cpu in 1..5 {
            assert_eq!(domain.ops().kicks_to(cpu), 1, "cpu {cpu}");
        }
        assert_eq!(domain.ops().stats().timeouts, 0);
    }

    /// As [`check_kick_order`], with the host saying the vCPUs fit (`VCPUS_FIT`) or not and
    /// a pre-wake `depth`: with both, the first unlock finds the next owner and the `depth`
    /// waiters behind it halted and kicks them all (the pre-wake); every waiter is still
    /// served in queue order, and every kick is counted. Otherwise nothing is pre-woken.
    pub(crate) fn check_prewake<L: RawPvLock + Send + Sync + 'static>(
        lock: L,
        fit: bool,
        depth: u8,
    ) {
        let config = SpinConfig {
            spin_threshold: 4,
            halt: true,
            prewake: depth,
        };
        let ops = Timed::new(crate::SpinBudget::UNLIMITED, false);
        ops.set_vcpus_fit(fit);
        let domain: Arc<PvDomain<Timed<5>, 5>> = Arc::new(PvDomain::new(ops, config));
        let lock = Arc::new(lock);
        let order = serve_four_halted_waiters(
            &domain,
            &lock,
            |ops: &Timed<5>, id| ops.inner.parked(id),
            |_| {},
        );
        assert_eq!(order, [1, 2, 3, 4]);
        let stats = domain.total_stats();
        let host = domain.ops().inner.stats();
        assert_eq!(host.kicks, stats.kicks, "{stats:?}");
        assert_eq!(host.timeouts, 0);
        if fit && depth > 0 {
            // CPU 0's unlock kicks CPU 1 and then the `depth` CPUs behind it, but CPU 1 may
            // run, take the lock and unlock before CPU 0 gets to them (a loaded host), and then
            // CPU 1's unlock kicks the next owner and pre-wakes instead: some unlock
            // pre-woke, and every waiter was kicked. What follows depends on timing too (a
            // pre-woken CPU may halt again before its turn, and then is kicked again).
            assert!(stats.prewakes >= 1, "{stats:?}");
            for cpu in 1..5 {
                assert!(domain.ops().inner.kicks_to(cpu) >= 1, "cpu {cpu}");
            }
        } else {
            assert_eq!(
                (stats.prewakes, stats.kicks, stats.halts),
                (0, 4, 4),
                "{stats:?}"
            );
        }
    }

    /// `threads` threads each take the lock `rounds` times and do a torn read-modify-write
    /// inside; any overlap of two holders loses an update and fails the final count. Thread
    /// `i` is bound to CPU `i` of the host PV backend (ignored by non-PV locks).
    pub(crate) fn hammer<L: RawSpinLock + Send + Sync + 'static>(threads: usize, rounds: u64) {
        let mutex: Arc<SpinMutex<L, u64>> = Arc::new(SpinMutex::new(0));
        let workers: Vec<_> = (0..threads)
            .map(|cpu| {
                let mutex = mutex.clone();
                std::thread::spawn(move || {
                    bind_current_thread(u32::try_from(cpu).unwrap());
                    for round in 0..rounds {
                        let mut guard = mutex.lock();
                        let seen = core::hint::black_box(*guard);
                        torn_window(round);
                        *guard = seen + 1;
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert_eq!(*mutex.lock(), threads as u64 * rounds);
    }

    /// Widens the window in which a second holder would lose an update.
    fn torn_window(round: u64) {
        for _ in 0..(round % 32) {
            core::hint::black_box(());
        }
    }

    /// What a [`pv_hammer`] run did.
    #[derive(Debug)]
    #[allow(dead_code)] // fields are read through Debug in assertion messages
    pub(crate) struct HammerStats {
        pub slowpath: u64,
        pub halts: u64,
        pub spurious: u64,
        pub kicks: u64,
        pub no_kick: u64,
        pub backend_kicks: u64,
        pub injected_spurious: u64,
        pub backend: HostStats,
    }

    struct Guarded<L> {
        lock: L,
        value: UnsafeCell<u64>,
    }

    // SAFETY: `value` is only touched with `lock` held.
    unsafe impl<L: Sync> Sync for Guarded<L> {}

    /// [`hammer`] for a PV lock on a host-thread domain of 4 CPUs (`threads <= 4`), with a
    /// backend injecting a spurious wakeup every `spurious_every` waits (0: none). Also checks
    /// that no park timed out (a lost wakeup) and no CPU id was out of range.
    pub(crate) fn pv_hammer<L: RawPvLock + Send + Sync + 'static>(
        threads: usize,
        rounds: u64,
        config: SpinConfig,
        spurious_every: u64,
    ) -> HammerStats {
        assert!(threads <= 4);
        let domain: Arc<PvDomain<HostPvOps<4>, 4>> = Arc::new(PvDomain::new(
            HostPvOps::with_spurious_every(spurious_every),
            config,
        ));
        let guarded = Arc::new(Guarded {
            lock: L::UNLOCKED,
            value: UnsafeCell::new(0),
        });
        let start = Arc::new(std::sync::Barrier::new(threads));
        let workers: Vec<_> = (0..threads)
            .map(|cpu| {
                let (domain, guarded, start) = (domain.clone(), guarded.clone(), start.clone());
                std::thread::spawn(move || {
                    bind_current_thread(u32::try_from(cpu).unwrap());
                    start.wait();
                    for round in 0..rounds {
                        guarded.lock.lock(domain.pv());
                        // SAFETY: we hold the lock.
                        let seen = core::hint::black_box(unsafe { *guarded.value.get() });
                        torn_window(round);
                        // A holder that gives up its core now and then (a preempted lock
                        // holder) makes the others queue past the spin threshold and halt.
                        if round % 8 == 0 {
                            std::thread::yield_now();
                        }
                        // SAFETY: we hold the lock.
                        unsafe { *guarded.value.get() = seen + 1 };
                        // SAFETY: we hold the lock, on this thread.
                        unsafe { guarded.lock.unlock(domain.pv()) };
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert!(!guarded.lock.is_locked());
        // SAFETY: every worker has finished.
        assert_eq!(unsafe { *guarded.value.get() }, threads as u64 * rounds);
        let pv = domain.total_stats();
        let backend = domain.ops().stats();
        assert_eq!(backend.timeouts, 0, "lost wakeup: {backend:?}");
        assert_eq!(
            (backend.bad_kicks, backend.bad_waits),
            (0, 0),
            "{backend:?}"
        );
        assert_eq!(domain.bad_cpu_count(), 0);
        assert_eq!(pv.halts, backend.waits, "{pv:?} {backend:?}");
        std::eprintln!("pv_hammer: {pv:?} {backend:?}");
        HammerStats {
            slowpath: pv.slowpath,
            halts: pv.halts,
            spurious: pv.spurious,
            kicks: pv.kicks,
            no_kick: pv.no_kick,
            backend_kicks: backend.kicks,
            injected_spurious: backend.injected_spurious,
            backend,
        }
    }
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::host::HostPvOps;
    use crate::tests_common::hammer;
    use crate::{
        PvConfigError, PvDomain, SpinConfig, SpinMutex, StaticPvBackoffTicketLock,
        StaticPvQueuedLock, StaticPvTicketLock, StaticStockQueuedLock,
    };

    const TEST_CONFIG: SpinConfig = SpinConfig {
        spin_threshold: 8,
        halt: true,
        prewake: SpinConfig::DEFAULT_PREWAKE,
    };

    // How a guest declares its PV locks: one static domain, a marker naming it, static mutexes.
    static DOMAIN: PvDomain<HostPvOps<3>, 3> = PvDomain::new(HostPvOps::new(), TEST_CONFIG);
    crate::pv_static!(TestPv: HostPvOps<3> = DOMAIN);
    static COUNTER: SpinMutex<StaticPvQueuedLock<TestPv>, u64> = SpinMutex::new(0);

    #[test]
    fn static_domain_mutexes_exclude() {
        crate::host::bind_current_thread(0);
        *COUNTER.lock() += 1;
        assert_eq!(*COUNTER.lock(), 1);
        hammer::<StaticPvTicketLock<TestPv>>(3, 300);
        hammer::<StaticPvQueuedLock<TestPv>>(3, 300);
        hammer::<StaticStockQueuedLock<TestPv>>(3, 300);
        hammer::<StaticPvBackoffTicketLock<TestPv>>(3, 300);
        assert_eq!(DOMAIN.ops().stats().timeouts, 0);
        assert_eq!(DOMAIN.bad_cpu_count(), 0);
    }

    #[test]
    fn config_presets_are_valid_and_rules_are_enforced() {
        assert_eq!(SpinConfig::EMULATED.validate(), Ok(SpinConfig::EMULATED));
        assert_eq!(SpinConfig::HARDWARE.validate(), Ok(SpinConfig::HARDWARE));
        const {
            assert!(
                SpinConfig::EMULATED.spin_threshold * 100 < SpinConfig::HARDWARE.spin_threshold
            );
        }
        let zero = SpinConfig {
            spin_threshold: 0,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        assert_eq!(zero.validate(), Err(PvConfigError::ZeroSpinThreshold));
        let huge = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD + 1,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        assert_eq!(huge.validate(), Err(PvConfigError::SpinThresholdTooLarge));
        let deep = SpinConfig {
            prewake: SpinConfig::MAX_PREWAKE + 1,
            ..SpinConfig::EMULATED
        };
        assert_eq!(deep.validate(), Err(PvConfigError::PrewakeTooDeep));
        assert!(std::format!("{}", PvConfigError::PrewakeTooDeep).contains("MAX_PREWAKE (4)"));
        let off = SpinConfig {
            prewake: 0,
            ..SpinConfig::EMULATED
        };
        assert_eq!(off.validate(), Ok(off));
        let domain = PvDomain::<_, 1>::new(HostPvOps::<1>::new(), off);
        assert_eq!(domain.configure(deep), Err(PvConfigError::PrewakeTooDeep));
        assert_eq!(domain.config(), off, "a refused policy changes nothing");
        assert_eq!(
            PvDomain::<_, 1>::try_new(HostPvOps::<1>::new(), zero).unwrap_err(),
            PvConfigError::ZeroSpinThreshold
        );
        assert_eq!(
            PvDomain::<_, 0>::try_new(HostPvOps::<0>::new(), TEST_CONFIG).unwrap_err(),
            PvConfigError::NoCpus
        );
        assert!(std::format!("{}", PvConfigError::NoCpus).contains("at least 1 CPU"));
    }

    #[test]
    #[should_panic(expected = "spin_threshold must be at least 1")]
    fn invalid_config_panics_in_new() {
        let zero = SpinConfig {
            spin_threshold: 0,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let _ = PvDomain::<_, 1>::new(HostPvOps::<1>::new(), zero);
    }
}
