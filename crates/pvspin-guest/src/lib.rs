//! The reference guest side of pvspin, `no_std`.
//!
//! The same code runs in two places: inside guest programs (bare-metal x86-64, see
//! `examples/pvspin-vmm/guest`) and on host threads in this crate's unit tests, so the lock
//! algorithms are tested natively before they ever run in a VM.
//!
//! What exists now:
//! - [`TicketLock`]: a fair FIFO spinlock (the lock whose waiters suffer most from lock-holder
//!   and lock-waiter preemption).
//! - [`TasLock`]: an unfair test-and-test-and-set lock.
//! - [`SpinMutex`]: data guarded by either.
//!
//! Both spin plainly (PAUSE in a loop); they have no paravirtual slow path yet. **Not
//! implemented yet:** pv_wait / pv_kick over the pvspin ABI, the PV ticket and PV queued
//! (MCS) locks, spin notifications and hint-page writes.
//!
//! Guest code must not use SSE (KVM's emulator rejects it on emulating hosts), so nothing here
//! uses floats or `core::fmt` number formatting.
#![no_std]
#![deny(missing_docs)]

#[cfg(test)]
extern crate std;

mod mutex;
mod tas;
mod ticket;

pub use mutex::{SpinMutex, SpinMutexGuard};
pub use tas::TasLock;
pub use ticket::TicketLock;

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

#[cfg(test)]
mod tests_common {
    use std::sync::Arc;
    use std::vec::Vec;

    use crate::{RawSpinLock, SpinMutex};

    /// `threads` threads each take the lock `rounds` times and do a torn read-modify-write
    /// inside; any overlap of two holders loses an update and fails the final count.
    pub(crate) fn hammer<L: RawSpinLock + Send + Sync + 'static>(threads: usize, rounds: u64) {
        let mutex: Arc<SpinMutex<L, u64>> = Arc::new(SpinMutex::new(0));
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let mutex = mutex.clone();
                std::thread::spawn(move || {
                    for round in 0..rounds {
                        let mut guard = mutex.lock();
                        let seen = core::hint::black_box(*guard);
                        // Widen the window in which a second holder would lose this update.
                        for _ in 0..(round % 32) {
                            core::hint::black_box(());
                        }
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
}
