//! A ticket spinlock: each waiter draws a ticket and waits until it is served.

use core::sync::atomic::{AtomicU32, Ordering};

use crate::RawSpinLock;

/// A fair (FIFO) spinlock.
///
/// Fairness is what makes it fragile in a VM: when the vCPU whose ticket is next is preempted,
/// the lock stays free and every later waiter spins (lock-waiter preemption).
#[derive(Debug)]
pub struct TicketLock {
    /// The next ticket to hand out.
    pub(crate) next: AtomicU32,
    /// The ticket being served; only the holder writes it.
    pub(crate) owner: AtomicU32,
}

impl TicketLock {
    /// A new, unlocked lock.
    pub const fn new() -> Self {
        Self {
            next: AtomicU32::new(0),
            owner: AtomicU32::new(0),
        }
    }

    /// How many callers hold or wait for the lock (a racy snapshot).
    pub fn queue_len(&self) -> u32 {
        let next = self.next.load(Ordering::Relaxed);
        next.wrapping_sub(self.owner.load(Ordering::Relaxed))
    }
}

impl Default for TicketLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: a ticket is drawn with one atomic fetch_add, so each is unique; only the caller whose
// ticket equals `owner` returns from `lock`, and `owner` moves on only in `unlock` (Release,
// paired with the waiter's Acquire load).
unsafe impl RawSpinLock for TicketLock {
    const UNLOCKED: Self = Self::new();

    fn lock(&self) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        while self.owner.load(Ordering::Acquire) != ticket {
            core::hint::spin_loop();
        }
    }

    fn try_lock(&self) -> bool {
        let owner = self.owner.load(Ordering::Relaxed);
        self.next
            .compare_exchange(
                owner,
                owner.wrapping_add(1),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    unsafe fn unlock(&self) {
        // Only the holder writes `owner`, so a plain load and store suffice.
        let served = self.owner.load(Ordering::Relaxed);
        self.owner.store(served.wrapping_add(1), Ordering::Release);
    }

    fn is_locked(&self) -> bool {
        self.queue_len() != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::tests_common::hammer;

    #[test]
    fn try_lock_fails_while_held_and_succeeds_after() {
        let lock = TicketLock::new();
        assert!(!lock.is_locked());
        assert!(lock.try_lock());
        assert!(lock.is_locked());
        assert!(!lock.try_lock());
        // SAFETY: we hold the lock.
        unsafe { lock.unlock() };
        assert!(!lock.is_locked());
        assert!(lock.try_lock());
    }

    #[test]
    fn tickets_wrap_around() {
        let lock = TicketLock {
            next: AtomicU32::new(u32::MAX),
            owner: AtomicU32::new(u32::MAX),
        };
        for _ in 0..4 {
            lock.lock();
            // SAFETY: we hold the lock.
            unsafe { lock.unlock() };
        }
        assert_eq!(lock.owner.load(Ordering::Relaxed), 3);
        assert!(!lock.is_locked());
    }

    #[test]
    fn counts_waiters() {
        let lock = TicketLock::new();
        lock.lock();
        lock.next.fetch_add(2, Ordering::Relaxed); // two waiters drew tickets
        assert_eq!(lock.queue_len(), 3);
    }

    #[test]
    fn excludes_under_contention() {
        // Host threads are preempted while holding the lock too, so keep this small.
        hammer::<TicketLock>(3, 1_000);
    }

    #[test]
    fn serves_in_ticket_order() {
        use std::sync::Arc;
        use std::vec::Vec;

        // The holder lets waiters queue one at a time, then checks they are served in order.
        let lock = Arc::new(TicketLock::new());
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        lock.lock();
        let mut threads = Vec::new();
        for id in 0..4usize {
            while lock.queue_len() != u32::try_from(id + 1).unwrap() {
                std::thread::yield_now();
            }
            let (waiter_lock, order) = (lock.clone(), order.clone());
            threads.push(std::thread::spawn(move || {
                waiter_lock.lock();
                order.lock().unwrap().push(id);
                // SAFETY: this thread holds the lock.
                unsafe { waiter_lock.unlock() };
            }));
            while lock.queue_len() != u32::try_from(id + 2).unwrap() {
                std::thread::yield_now();
            }
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock() };
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3]);
    }
}
