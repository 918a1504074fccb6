//! The synchronisation primitives of the run slots: loom's under `cfg(loom)`, std's otherwise;
//! and the slots' state mutex, which with the `lock-stats` feature counts how it is used
//! ([`LockStats`]: the benches measure hold time and contention with it).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

use std::ops::{Deref, DerefMut};

/// How the run slots' state mutex was used, summed since the slots were made. Counted only
/// with the `lock-stats` feature (off by default: two clock reads per acquisition); all zero
/// without it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockStats {
    /// Acquisitions (a condition-variable wake-up that retakes the mutex counts as one).
    pub acquisitions: u64,
    /// Acquisitions that found the mutex held by another thread and had to wait.
    pub contended: u64,
    /// Time spent waiting for the mutex, ns (not the time parked on a condition variable).
    pub wait_ns: u64,
    /// Time the mutex was held, ns.
    pub hold_ns: u64,
    /// The longest it was held at once, ns.
    pub max_hold_ns: u64,
}

#[cfg(all(feature = "lock-stats", not(loom)))]
#[derive(Debug, Default)]
struct Counters {
    acquisitions: AtomicU64,
    contended: AtomicU64,
    wait_ns: AtomicU64,
    hold_ns: AtomicU64,
    max_hold_ns: AtomicU64,
}

/// A mutex that counts its use with the `lock-stats` feature; a plain mutex otherwise.
#[derive(Debug)]
pub(crate) struct StatMutex<T> {
    inner: Mutex<T>,
    #[cfg(all(feature = "lock-stats", not(loom)))]
    counters: Counters,
}

/// The guard of a [`StatMutex`]: the hold time runs from the acquisition to the drop (or to
/// a condition-variable wait, which releases the mutex).
pub(crate) struct StatGuard<'a, T> {
    guard: Option<MutexGuard<'a, T>>,
    owner: &'a StatMutex<T>,
    #[cfg(all(feature = "lock-stats", not(loom)))]
    since: std::time::Instant,
}

impl<T> StatMutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
            #[cfg(all(feature = "lock-stats", not(loom)))]
            counters: Counters::default(),
        }
    }

    /// Locks, ignoring poisoning: the state stays consistent at every unlock (no method
    /// panics with it half-updated), so a panicked vCPU thread must not stop the others.
    #[cfg(not(all(feature = "lock-stats", not(loom))))]
    pub(crate) fn lock(&self) -> StatGuard<'_, T> {
        #[cfg(not(loom))]
        let guard = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        #[cfg(loom)]
        let guard = self.inner.lock().unwrap();
        StatGuard {
            guard: Some(guard),
            owner: self,
        }
    }

    /// Locks (see the plain build's), counting whether it had to wait and for how long.
    #[cfg(all(feature = "lock-stats", not(loom)))]
    pub(crate) fn lock(&self) -> StatGuard<'_, T> {
        let guard = match self.inner.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                let start = std::time::Instant::now();
                let guard = self
                    .inner
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                self.counters.contended.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .wait_ns
                    .fetch_add(elapsed_ns(start), Ordering::Relaxed);
                guard
            }
        };
        self.acquired(guard)
    }

    #[cfg(all(feature = "lock-stats", not(loom)))]
    fn acquired<'a>(&'a self, guard: MutexGuard<'a, T>) -> StatGuard<'a, T> {
        self.counters.acquisitions.fetch_add(1, Ordering::Relaxed);
        StatGuard {
            guard: Some(guard),
            owner: self,
            since: std::time::Instant::now(),
        }
    }

    /// The counters so far (zero without the `lock-stats` feature).
    pub(crate) fn stats(&self) -> LockStats {
        #[cfg(all(feature = "lock-stats", not(loom)))]
        {
            let c = &self.counters;
            let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
            LockStats {
                acquisitions: ld(&c.acquisitions),
                contended: ld(&c.contended),
                wait_ns: ld(&c.wait_ns),
                hold_ns: ld(&c.hold_ns),
                max_hold_ns: ld(&c.max_hold_ns),
            }
        }
        #[cfg(not(all(feature = "lock-stats", not(loom))))]
        LockStats::default()
    }
}

#[cfg(all(feature = "lock-stats", not(loom)))]
fn elapsed_ns(since: std::time::Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl<'a, T> StatGuard<'a, T> {
    /// Ends the hold and hands the std guard out (for a condition-variable wait).
    fn release(mut self) -> MutexGuard<'a, T> {
        self.record_hold();
        self.guard
            .take()
            .expect("a guard holds its lock until released")
    }

    #[cfg(all(feature = "lock-stats", not(loom)))]
    fn record_hold(&self) {
        let held = elapsed_ns(self.since);
        let c = &self.owner.counters;
        c.hold_ns.fetch_add(held, Ordering::Relaxed);
        c.max_hold_ns.fetch_max(held, Ordering::Relaxed);
    }

    #[cfg(not(all(feature = "lock-stats", not(loom))))]
    fn record_hold(&self) {}

    /// The mutex was retaken after a condition-variable wait.
    #[cfg(not(all(feature = "lock-stats", not(loom))))]
    fn retaken(owner: &'a StatMutex<T>, guard: MutexGuard<'a, T>) -> Self {
        Self {
            guard: Some(guard),
            owner,
        }
    }

    #[cfg(all(feature = "lock-stats", not(loom)))]
    fn retaken(owner: &'a StatMutex<T>, guard: MutexGuard<'a, T>) -> Self {
        owner.acquired(guard)
    }

    /// Waits on `cv` (at most `timeout` outside loom, which has no timeouts), releasing the
    /// mutex meanwhile.
    pub(crate) fn wait(self, cv: &Condvar, timeout: std::time::Duration) -> Self {
        let owner = self.owner;
        let guard = self.release();
        #[cfg(not(loom))]
        let guard = cv
            .wait_timeout(guard, timeout)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
        #[cfg(loom)]
        let guard = {
            let _ = timeout;
            cv.wait(guard).unwrap()
        };
        Self::retaken(owner, guard)
    }

    /// Waits on `cv` while `condition` holds, at most `timeout` (not under loom).
    #[cfg(not(loom))]
    pub(crate) fn wait_while(
        self,
        cv: &Condvar,
        timeout: std::time::Duration,
        condition: impl FnMut(&mut T) -> bool,
    ) -> Self {
        let owner = self.owner;
        let guard = self.release();
        let (guard, _) = cv
            .wait_timeout_while(guard, timeout, condition)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Self::retaken(owner, guard)
    }
}

impl<T> Deref for StatGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard
            .as_deref()
            .expect("a guard holds its lock until released")
    }
}

impl<T> DerefMut for StatGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard
            .as_deref_mut()
            .expect("a guard holds its lock until released")
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for StatGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.guard.as_deref().fmt(f)
    }
}

impl<T> Drop for StatGuard<'_, T> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            self.record_hold();
        }
    }
}
