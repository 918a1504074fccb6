//! The halt watcher: run slots for guests that halt inside KVM.
//!
//! With an in-kernel LAPIC a guest's `HLT` (and a stock guest's pv_wait) blocks inside
//! `KVM_RUN`, and a `KVM_HC_KICK_CPU` or an interrupt wakes it there: the VMM sees neither. The
//! watcher sees both through a [`HaltProbe`] (pvspin's reads KVM's per-vCPU binary statistic
//! `blocking` with one `pread`, from any thread, without an exit) and tells the policy
//! ([`RunSlots::halt_changed`]): a halted holder lends its slot to a waiter, and a vCPU that KVM
//! woke takes one back at once.
//!
//! It polls only while that can matter ([`RunSlots::watch_set`]: someone waits for a slot, or
//! a slot is lent), once per `SlotConfig::halt_watch_interval`, and otherwise sleeps on a
//! condition variable. Its cost and reaction time are measured in `docs/benchmarks.md`.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use pvspin_hints::ThreadStartHook;

use crate::policy::{RunSlots, SlotSignals};

/// The watcher thread's name.
pub const WATCHER_THREAD_NAME: &str = "pvspin-slot-watch";

/// Tells whether a vCPU blocks inside KVM.
pub trait HaltProbe: Send + Sync {
    /// Whether vCPU `v` blocks inside KVM now; `None` when that cannot be read (counted).
    fn halted(&self, v: usize) -> Option<bool>;
}

/// Errors starting the watcher.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum WatchError {
    /// cannot start the run-slot halt watcher thread: {0}
    Spawn(#[source] io::Error),
    /// the thread start hook failed on {WATCHER_THREAD_NAME:}: {0}
    ThreadStart(#[source] io::Error),
}

/// The watcher's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    /// Polls of the watched vCPUs.
    pub polls: u64,
    /// Probe reads.
    pub reads: u64,
    /// Probe reads that failed.
    pub read_errors: u64,
}

#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    polls: AtomicU64,
    reads: AtomicU64,
    read_errors: AtomicU64,
}

/// A running halt watcher; stopped and joined on drop (or when the slots shut down).
#[derive(Debug)]
pub struct HaltWatcher {
    slots: Arc<RunSlots>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl HaltWatcher {
    /// Starts the watcher of `slots`, reading halts with `probe` and forcing vCPUs out of
    /// `KVM_RUN` through `signals`. `start` runs first on the new thread (a VMM installs its
    /// seccomp filter there); returns once it succeeded.
    pub fn spawn(
        slots: Arc<RunSlots>,
        probe: Arc<dyn HaltProbe>,
        signals: Arc<dyn SlotSignals>,
        start: Option<ThreadStartHook>,
    ) -> Result<Self, WatchError> {
        let shared = Arc::new(Shared::default());
        let (s, sh) = (slots.clone(), shared.clone());
        let (started_tx, started_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
        let thread = std::thread::Builder::new()
            .name(WATCHER_THREAD_NAME.into())
            .spawn(move || {
                let started = start.map_or(Ok(()), |hook| hook(WATCHER_THREAD_NAME));
                let ok = started.is_ok();
                let _ = started_tx.send(started);
                if ok {
                    watch(&s, &*probe, &*signals, &sh);
                }
            })
            .map_err(WatchError::Spawn)?;
        let started = started_rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("the thread ended before it started")));
        if let Err(err) = started {
            let _ = thread.join();
            return Err(WatchError::ThreadStart(err));
        }
        Ok(Self {
            slots,
            shared,
            thread: Some(thread),
        })
    }

    /// The counters.
    pub fn stats(&self) -> WatchStats {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WatchStats {
            polls: ld(&self.shared.polls),
            reads: ld(&self.shared.reads),
            read_errors: ld(&self.shared.read_errors),
        }
    }
}

impl Drop for HaltWatcher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.slots.wake_watcher();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The watcher's loop: poll while something is to be watched, sleep otherwise.
fn watch(slots: &RunSlots, probe: &dyn HaltProbe, signals: &dyn SlotSignals, sh: &Shared) {
    let interval = slots.config().halt_watch_interval;
    let mut set = Vec::with_capacity(slots.vcpus());
    let mut logged_error = false;
    while !sh.stop.load(Ordering::Acquire) {
        if !slots.wait_for_watch(Duration::from_millis(100)) {
            return;
        }
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        slots.watch_set(&mut set);
        for &v in &set {
            sh.reads.fetch_add(1, Ordering::Relaxed);
            match probe.halted(v) {
                Some(halted) => slots.halt_changed(v, halted, signals),
                None => {
                    sh.read_errors.fetch_add(1, Ordering::Relaxed);
                    if !logged_error {
                        logged_error = true;
                        log::error!(
                            "pvspin run slots: cannot read whether vCPU {v} halts in KVM; \
                             its slot is not lent while that lasts (counted in read_errors)"
                        );
                    }
                }
            }
        }
        sh.polls.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::SlotConfig;
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Probe(Mutex<Vec<bool>>);
    impl HaltProbe for Probe {
        fn halted(&self, v: usize) -> Option<bool> {
            self.0.lock().unwrap().get(v).copied()
        }
    }

    #[derive(Debug, Default)]
    struct Preempts(Mutex<Vec<usize>>);
    impl SlotSignals for Preempts {
        fn in_critical_section(&self, _: usize) -> bool {
            false
        }
        fn preempt(&self, v: usize) {
            self.0.lock().unwrap().push(v);
        }
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Real threads: a holder halts in "KVM", the watcher lends its slot to the parked waiter;
    /// the holder wakes, takes a slot back and the borrower is asked to leave.
    #[test]
    fn the_watcher_lends_a_halted_holders_slot_and_reclaims_it() {
        let slots = Arc::new(RunSlots::new(2, SlotConfig::new(1)).unwrap());
        let probe = Arc::new(Probe(Mutex::new(vec![false, false])));
        let signals = Arc::new(Preempts::default());
        let watcher =
            HaltWatcher::spawn(slots.clone(), probe.clone(), signals.clone(), None).unwrap();
        assert!(matches!(
            slots.enter(0, &*signals),
            crate::EnterOutcome::Granted { .. }
        ));
        let s1 = slots.clone();
        let sig1 = signals.clone();
        let waiter = std::thread::spawn(move || s1.enter(1, &*sig1));
        probe.0.lock().unwrap()[0] = true;
        assert!(matches!(
            waiter.join().unwrap(),
            crate::EnterOutcome::Granted { .. }
        ));
        assert!(slots.lent(0) && slots.holds(1));
        probe.0.lock().unwrap()[0] = false;
        eventually("vCPU 0 takes a slot back", || slots.holds(0));
        eventually("vCPU 1 is asked to leave", || {
            signals.0.lock().unwrap().contains(&1)
        });
        assert!(!slots.exited(1, &*signals), "the borrower leaves");
        let stats = slots.stats();
        assert_eq!((stats.lends, stats.reclaims), (1, 1));
        assert!(stats.max_over_ns > 0);
        assert!(watcher.stats().polls > 0);
        drop(watcher);
    }

    #[test]
    fn a_failing_start_hook_is_reported() {
        let slots = Arc::new(RunSlots::new(2, SlotConfig::new(1)).unwrap());
        let hook: ThreadStartHook = Arc::new(|_| Err(io::Error::other("no filter")));
        let err = HaltWatcher::spawn(
            slots,
            Arc::new(Probe::default()),
            Arc::new(Preempts::default()),
            Some(hook),
        )
        .unwrap_err();
        assert!(matches!(err, WatchError::ThreadStart(_)), "{err}");
    }
}
