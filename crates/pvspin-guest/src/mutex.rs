//! Data guarded by a raw spinlock.

use core::cell::UnsafeCell;
use core::ops::{Deref, DerefMut};

use crate::RawSpinLock;

/// A value guarded by the spinlock `L`.
#[derive(Debug)]
pub struct SpinMutex<L, T> {
    lock: L,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out one `&mut T` at a time, so sharing the mutex across threads is
// sound whenever `T` may move between threads.
unsafe impl<L: RawSpinLock + Sync, T: Send> Sync for SpinMutex<L, T> {}

impl<L: RawSpinLock, T> SpinMutex<L, T> {
    /// A new, unlocked mutex holding `value`.
    pub const fn new(value: T) -> Self {
        Self {
            lock: L::UNLOCKED,
            value: UnsafeCell::new(value),
        }
    }

    /// Spins until the lock is taken, then returns a guard that releases it on drop.
    pub fn lock(&self) -> SpinMutexGuard<'_, L, T> {
        self.lock.lock();
        SpinMutexGuard { mutex: self }
    }

    /// Takes the lock if it is free.
    pub fn try_lock(&self) -> Option<SpinMutexGuard<'_, L, T>> {
        // `then`, not `then_some`: a guard built eagerly would unlock on drop.
        self.lock.try_lock().then(|| SpinMutexGuard { mutex: self })
    }

    /// The raw lock, for diagnostics.
    pub fn raw(&self) -> &L {
        &self.lock
    }
}

/// Holds a [`SpinMutex`] locked; unlocks it when dropped.
#[derive(Debug)]
pub struct SpinMutexGuard<'a, L: RawSpinLock, T> {
    mutex: &'a SpinMutex<L, T>,
}

impl<L: RawSpinLock, T> Deref for SpinMutexGuard<'_, L, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while the lock is held, so no `&mut T` aliases this.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<L: RawSpinLock, T> DerefMut for SpinMutexGuard<'_, L, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard exists only while the lock is held, and `&mut self` makes this the
        // only reference derived from it.
        unsafe { &mut *self.mutex.value.get() }
    }
}

impl<L: RawSpinLock, T> Drop for SpinMutexGuard<'_, L, T> {
    fn drop(&mut self) {
        // SAFETY: the guard is proof that this caller holds the lock.
        unsafe { self.mutex.lock.unlock() };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{TasLock, TicketLock};

    #[test]
    fn guard_releases_on_drop() {
        let mutex: SpinMutex<TicketLock, u32> = SpinMutex::new(1);
        {
            let mut guard = mutex.lock();
            *guard += 1;
            assert!(mutex.try_lock().is_none());
        }
        assert_eq!(*mutex.try_lock().unwrap(), 2);
        let tas: SpinMutex<TasLock, u32> = SpinMutex::new(0);
        drop(tas.lock());
        assert!(!tas.raw().is_locked());
    }
}
