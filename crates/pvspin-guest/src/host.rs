//! A [`PvOps`] backend for host threads (feature `std`, and this crate's tests): each "CPU" is
//! a thread bound with [`bind_current_thread`]; `wait` parks it on a per-CPU latch that
//! remembers a kick arriving before the park (KVM's `pv_unhalted`), `kick` sets the latch and
//! unparks. It can inject spurious wakeups. Under `--cfg loom` it is built from loom's mutex
//! and condition variable, so the loom model checks the locks against this exact latch.

use core::cell::Cell;
use core::sync::atomic::{AtomicU64, Ordering as CoreOrdering};

use crate::pv::PvOps;
use crate::sync::{AtomicU8, Ordering};

#[cfg(loom)]
use loom::sync::{Condvar, Mutex};
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex};

#[cfg(loom)]
loom::thread_local! {
    static CURRENT_CPU: Cell<u32> = Cell::new(u32::MAX);
}
#[cfg(not(loom))]
std::thread_local! {
    static CURRENT_CPU: Cell<u32> = const { Cell::new(u32::MAX) };
}

/// Makes the calling thread CPU `cpu` for every [`HostPvOps`].
pub fn bind_current_thread(cpu: u32) {
    CURRENT_CPU.with(|current| current.set(cpu));
}

/// How long a parked thread waits for a kick before it gives up and counts a timeout (outside
/// loom). Long enough that a timeout means a lost wakeup, not a slow machine.
#[cfg(not(loom))]
pub const PARK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug)]
struct HostCpu {
    /// The kick latch.
    kicked: Mutex<bool>,
    unpark: Condvar,
    parks: AtomicU64,
    kicks_in: AtomicU64,
}

impl HostCpu {
    #[cfg(not(loom))]
    const fn new() -> Self {
        Self {
            kicked: Mutex::new(false),
            unpark: Condvar::new(),
            parks: AtomicU64::new(0),
            kicks_in: AtomicU64::new(0),
        }
    }

    #[cfg(loom)]
    fn new() -> Self {
        Self {
            kicked: Mutex::new(false),
            unpark: Condvar::new(),
            parks: AtomicU64::new(0),
            kicks_in: AtomicU64::new(0),
        }
    }
}

/// Counters of a [`HostPvOps`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// `wait` calls.
    pub waits: u64,
    /// Waits that blocked (the condition held and no kick was latched).
    pub parks: u64,
    /// Waits that returned at once because of a latched kick.
    pub latched: u64,
    /// Spurious wakeups injected.
    pub injected_spurious: u64,
    /// `kick` calls.
    pub kicks: u64,
    /// Kicks naming a CPU that does not exist (ignored).
    pub bad_kicks: u64,
    /// Waits called by a thread not bound to a CPU of this backend (returned at once).
    pub bad_waits: u64,
    /// Parks that ended by [`PARK_TIMEOUT`] instead of a kick (a lost wakeup).
    pub timeouts: u64,
}

/// The host-thread backend for `N` CPUs.
#[derive(Debug)]
pub struct HostPvOps<const N: usize> {
    cpus: [HostCpu; N],
    /// Every `spurious_every`-th wait returns at once (0: never).
    spurious_every: u64,
    waits: AtomicU64,
    latched: AtomicU64,
    injected_spurious: AtomicU64,
    kicks: AtomicU64,
    bad_kicks: AtomicU64,
    bad_waits: AtomicU64,
    timeouts: AtomicU64,
}

impl<const N: usize> HostPvOps<N> {
    /// A backend without injected spurious wakeups.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self::with_spurious_every(0)
    }

    /// A backend whose every `every`-th `wait` returns at once (0: never).
    #[cfg(not(loom))]
    pub const fn with_spurious_every(every: u64) -> Self {
        Self {
            cpus: [const { HostCpu::new() }; N],
            spurious_every: every,
            waits: AtomicU64::new(0),
            latched: AtomicU64::new(0),
            injected_spurious: AtomicU64::new(0),
            kicks: AtomicU64::new(0),
            bad_kicks: AtomicU64::new(0),
            bad_waits: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
        }
    }

    /// A backend without injected spurious wakeups.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self::with_spurious_every(0)
    }

    /// A backend whose every `every`-th `wait` returns at once (0: never).
    #[cfg(loom)]
    pub fn with_spurious_every(every: u64) -> Self {
        Self {
            cpus: core::array::from_fn(|_| HostCpu::new()),
            spurious_every: every,
            waits: AtomicU64::new(0),
            latched: AtomicU64::new(0),
            injected_spurious: AtomicU64::new(0),
            kicks: AtomicU64::new(0),
            bad_kicks: AtomicU64::new(0),
            bad_waits: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
        }
    }

    /// The counters.
    pub fn stats(&self) -> HostStats {
        let load = |c: &AtomicU64| c.load(CoreOrdering::Relaxed);
        HostStats {
            waits: load(&self.waits),
            parks: self.cpus.iter().map(|c| load(&c.parks)).sum(),
            latched: load(&self.latched),
            injected_spurious: load(&self.injected_spurious),
            kicks: load(&self.kicks),
            bad_kicks: load(&self.bad_kicks),
            bad_waits: load(&self.bad_waits),
            timeouts: load(&self.timeouts),
        }
    }

    /// How many times CPU `cpu` has parked (0 for an unknown CPU).
    pub fn parked(&self, cpu: u32) -> u64 {
        self.cpus
            .get(cpu as usize)
            .map_or(0, |c| c.parks.load(CoreOrdering::Relaxed))
    }

    /// How many kicks CPU `cpu` has received (0 for an unknown CPU).
    pub fn kicks_to(&self, cpu: u32) -> u64 {
        self.cpus
            .get(cpu as usize)
            .map_or(0, |c| c.kicks_in.load(CoreOrdering::Relaxed))
    }

    #[cfg(not(loom))]
    fn park<'a>(
        &self,
        cpu: &'a HostCpu,
        kicked: std::sync::MutexGuard<'a, bool>,
    ) -> std::sync::MutexGuard<'a, bool> {
        let (kicked, result) = cpu
            .unpark
            .wait_timeout_while(kicked, PARK_TIMEOUT, |kicked| !*kicked)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if result.timed_out() {
            self.timeouts.fetch_add(1, CoreOrdering::Relaxed);
        }
        kicked
    }

    #[cfg(loom)]
    fn park<'a>(
        &self,
        cpu: &'a HostCpu,
        mut kicked: loom::sync::MutexGuard<'a, bool>,
    ) -> loom::sync::MutexGuard<'a, bool> {
        // No timeout: a lost wakeup leaves every thread blocked, which loom reports.
        while !*kicked {
            kicked = cpu.unpark.wait(kicked).unwrap();
        }
        kicked
    }
}

impl<const N: usize> Default for HostPvOps<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> PvOps for HostPvOps<N> {
    fn wait(&self, ptr: &AtomicU8, val: u8) {
        let count = self.waits.fetch_add(1, CoreOrdering::Relaxed) + 1;
        let Some(cpu) = self.cpus.get(self.cpu_id() as usize) else {
            self.bad_waits.fetch_add(1, CoreOrdering::Relaxed);
            return;
        };
        if self.spurious_every != 0 && count % self.spurious_every == 0 {
            self.injected_spurious.fetch_add(1, CoreOrdering::Relaxed);
            return;
        }
        // The guest's `cli; cmp; hlt`: the condition is checked first, and a kick may land
        // between the check and the park (the halt); only the latch keeps it from being lost,
        // as KVM's `pv_unhalted` does for the guest.
        if ptr.load(Ordering::SeqCst) != val {
            return;
        }
        let mut kicked = cpu
            .kicked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if *kicked {
            self.latched.fetch_add(1, CoreOrdering::Relaxed);
        } else {
            cpu.parks.fetch_add(1, CoreOrdering::Relaxed);
            kicked = self.park(cpu, kicked);
        }
        *kicked = false;
    }

    fn kick(&self, cpu: u32) {
        self.kicks.fetch_add(1, CoreOrdering::Relaxed);
        let Some(target) = self.cpus.get(cpu as usize) else {
            self.bad_kicks.fetch_add(1, CoreOrdering::Relaxed);
            return;
        };
        target.kicks_in.fetch_add(1, CoreOrdering::Relaxed);
        let mut kicked = target
            .kicked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *kicked = true;
        target.unpark.notify_one();
    }

    fn cpu_id(&self) -> u32 {
        CURRENT_CPU.with(Cell::get)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn kick_before_wait_is_remembered() {
        let ops: HostPvOps<2> = HostPvOps::new();
        bind_current_thread(1);
        let state = AtomicU8::new(1);
        ops.kick(1);
        // Would park for PARK_TIMEOUT (and count a timeout) if the kick were forgotten.
        ops.wait(&state, 1);
        let stats = ops.stats();
        assert_eq!((stats.latched, stats.parks, stats.timeouts), (1, 0, 0));
        // The latch is consumed: an unrelated wait whose condition is false returns at once.
        state.store(0, Ordering::SeqCst);
        ops.wait(&state, 1);
        assert_eq!(ops.stats().parks, 0);
    }

    #[test]
    fn wait_returns_at_once_when_condition_changed() {
        let ops: HostPvOps<1> = HostPvOps::new();
        bind_current_thread(0);
        ops.wait(&AtomicU8::new(0), 1);
        assert_eq!(ops.stats().parks, 0);
    }

    #[test]
    fn kick_wakes_a_parked_thread() {
        let ops: Arc<HostPvOps<2>> = Arc::new(HostPvOps::new());
        let state = Arc::new(AtomicU8::new(1));
        let waiter = {
            let (ops, state) = (ops.clone(), state.clone());
            std::thread::spawn(move || {
                bind_current_thread(1);
                ops.wait(&state, 1);
            })
        };
        let mut tries = 0;
        while ops.parked(1) == 0 {
            tries += 1;
            assert!(tries < 20_000, "waiter never parked");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        ops.kick(1);
        waiter.join().unwrap();
        assert_eq!(ops.stats().timeouts, 0);
        assert_eq!(ops.kicks_to(1), 1);
    }

    #[test]
    fn bad_cpus_are_counted_and_ignored() {
        let ops: HostPvOps<2> = HostPvOps::new();
        ops.kick(2);
        ops.kick(u32::MAX);
        bind_current_thread(7);
        ops.wait(&AtomicU8::new(1), 1);
        let stats = ops.stats();
        assert_eq!((stats.bad_kicks, stats.bad_waits, stats.parks), (2, 1, 0));
    }

    #[test]
    fn injects_spurious_wakeups() {
        let ops: HostPvOps<1> = HostPvOps::with_spurious_every(1);
        bind_current_thread(0);
        ops.wait(&AtomicU8::new(1), 1);
        assert_eq!(ops.stats().injected_spurious, 1);
        assert_eq!(ops.stats().parks, 0);
    }
}
