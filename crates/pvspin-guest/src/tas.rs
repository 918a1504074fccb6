//! A test-and-test-and-set spinlock.

use core::sync::atomic::{AtomicBool, Ordering};

use crate::RawSpinLock;

/// An unfair spinlock: whoever sees it free first and swaps wins.
///
/// Unfairness makes it tolerant of waiter preemption (any running waiter can take a free lock)
/// but not of holder preemption.
#[derive(Debug)]
pub struct TasLock {
    locked: AtomicBool,
}

impl TasLock {
    /// A new, unlocked lock.
    pub const fn new() -> Self {
        Self {
            locked: AtomicBool::new(false),
        }
    }
}

impl Default for TasLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: `swap(true)` is atomic, so exactly one caller sees `false` while the lock is free;
// `unlock` stores `false` with Release, paired with the winner's Acquire swap.
unsafe impl RawSpinLock for TasLock {
    const UNLOCKED: Self = Self::new();

    fn lock(&self) {
        loop {
            if !self.locked.swap(true, Ordering::Acquire) {
                return;
            }
            // Spin on a plain load so waiters share the cache line instead of bouncing it.
            while self.locked.load(Ordering::Relaxed) {
                core::hint::spin_loop();
            }
        }
    }

    fn try_lock(&self) -> bool {
        !self.locked.swap(true, Ordering::Acquire)
    }

    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::tests_common::hammer;

    #[test]
    fn try_lock_fails_while_held() {
        let lock = TasLock::new();
        assert!(lock.try_lock());
        assert!(!lock.try_lock());
        assert!(lock.is_locked());
        // SAFETY: we hold the lock.
        unsafe { lock.unlock() };
        assert!(!lock.is_locked());
    }

    #[test]
    fn excludes_under_contention() {
        hammer::<TasLock>(3, 3_000);
    }
}
