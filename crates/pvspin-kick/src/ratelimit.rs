//! Log-once-per-interval limiting, per key, with an injectable clock.
//!
//! A guest can write bad doorbell values millions of times a second; the host logs the first
//! of each kind, then at most one line per key per interval, saying how many were suppressed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A monotonic clock in nanoseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Nanoseconds since an arbitrary fixed origin; never decreases.
    fn now_ns(&self) -> u64;
}

/// The real monotonic clock.
#[derive(Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock the caller moves by hand (tests, fuzzing; feature `test-utils`).
#[cfg(any(test, feature = "test-utils"))]
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

#[cfg(any(test, feature = "test-utils"))]
impl ManualClock {
    /// A clock at `ns`.
    pub fn new(ns: u64) -> Self {
        Self {
            now: AtomicU64::new(ns),
        }
    }

    /// Moves the clock forward by `ns`.
    pub fn advance(&self, ns: u64) {
        self.now.fetch_add(ns, Ordering::Relaxed);
    }
}

#[cfg(any(test, feature = "test-utils"))]
impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
}

/// Per-key limiter: [`RateLimiter::check`] says yes the first time for a key, then at most once
/// per interval.
#[derive(Debug)]
pub struct RateLimiter<C: Clock> {
    clock: C,
    interval_ns: u64,
    /// Per key: time of the last allowed line plus one (0 = never logged).
    last: Box<[AtomicU64]>,
    /// Per key: events suppressed since the last allowed line.
    suppressed: Box<[AtomicU64]>,
}

impl<C: Clock> RateLimiter<C> {
    /// A limiter for keys `0..keys`, allowing one line per key per `interval_ns`.
    pub fn new(clock: C, keys: usize, interval_ns: u64) -> Self {
        Self {
            clock,
            interval_ns,
            last: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            suppressed: (0..keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Records one event for `key`. Returns `Some(n)` when the caller should log now, `n` being
    /// the number of events of this key suppressed since the last line; `None` when it should
    /// stay quiet. An unknown key is always quiet. Safe to call from many threads: of
    /// concurrent callers at most one gets `Some` per interval.
    pub fn check(&self, key: usize) -> Option<u64> {
        let (Some(last), Some(suppressed)) = (self.last.get(key), self.suppressed.get(key)) else {
            return None;
        };
        let now = self.clock.now_ns().saturating_add(1);
        let prev = last.load(Ordering::Relaxed);
        let due = prev == 0 || now.saturating_sub(prev) >= self.interval_ns;
        if due
            && last
                .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(suppressed.swap(0, Ordering::Relaxed));
        }
        suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn first_event_logs_then_once_per_interval() {
        let clock = Arc::new(ManualClock::new(0));
        let rl = RateLimiter::new(clock.clone(), 2, 1_000);
        assert_eq!(rl.check(0), Some(0));
        assert_eq!(rl.check(0), None);
        assert_eq!(rl.check(0), None);
        clock.advance(999);
        assert_eq!(rl.check(0), None);
        clock.advance(1);
        assert_eq!(rl.check(0), Some(3));
        assert_eq!(rl.check(0), None);
        clock.advance(5_000);
        assert_eq!(rl.check(0), Some(1));
    }

    #[test]
    fn keys_are_independent_and_unknown_keys_are_quiet() {
        let clock = Arc::new(ManualClock::new(42));
        let rl = RateLimiter::new(clock, 2, 1_000);
        assert_eq!(rl.check(0), Some(0));
        assert_eq!(rl.check(1), Some(0));
        assert_eq!(rl.check(0), None);
        assert_eq!(rl.check(1), None);
        assert_eq!(rl.check(2), None);
        assert_eq!(rl.check(usize::MAX), None);
    }

    #[test]
    fn concurrent_callers_log_once_per_interval() {
        let clock = Arc::new(ManualClock::new(0));
        let rl = Arc::new(RateLimiter::new(clock, 1, u64::MAX));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let rl = rl.clone();
                std::thread::spawn(move || (0..1000).filter(|_| rl.check(0).is_some()).count())
            })
            .collect();
        let logged: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(logged, 1);
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let c = MonotonicClock::new();
        let a = c.now_ns();
        std::thread::sleep(std::time::Duration::from_millis(1));
        assert!(c.now_ns() > a);
    }
}
