//! Bounded priority boosts of vCPU threads, always restored.
//!
//! A boost raises one vCPU thread's priority so that, when the spinner yields, the host
//! scheduler runs that thread next. Two kinds:
//! * [`BoostKind::Nice`]: `setpriority` to a lower nice value (needs `CAP_SYS_NICE` or
//!   `RLIMIT_NICE`);
//! * [`BoostKind::Fifo`]: `sched_setscheduler(SCHED_FIFO)` at a low real-time priority (needs
//!   `CAP_SYS_NICE` or `RLIMIT_RTPRIO`).
//!
//! The previous policy, priority and nice value are recorded at the first boost and restored:
//! by the target's own thread at its next exit or kick ([`BoostTracker::restore`]), by a
//! watchdog thread when the deadline passes, on every error path, by
//! [`BoostTracker::restore_all`], and on drop. A second boost of an already boosted thread
//! only extends the deadline.
//!
//! Threads: [`BoostTracker::new`] first probes the permission on a short-lived thread named
//! [`PROBE_THREAD_NAME`] (it exits before `new` returns), then starts the deadline watchdog,
//! named [`WATCHDOG_THREAD_NAME`], which lives as long as the tracker. A VMM that confines its
//! threads (seccomp) passes a [`ThreadStartHook`] to [`BoostTracker::with_thread_start`]: the
//! watchdog runs it before anything else, and a hook that fails stops the watchdog and fails
//! the constructor, so no helper thread runs unconfined.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::sched::{get_nice, get_policy, set_nice, set_policy, SchedPolicy};

/// Name of the deadline watchdog thread a [`BoostTracker`] starts (it lives as long as the
/// tracker).
pub const WATCHDOG_THREAD_NAME: &str = "pvspin-boost-wd";

/// Name of the short-lived thread [`probe`] starts and joins before it returns.
pub const PROBE_THREAD_NAME: &str = "pvspin-probe";

/// Runs first on each long-lived helper thread pvspin-hints starts, on that thread, with the
/// thread's name (today only [`WATCHDOG_THREAD_NAME`]); e.g. installs the VMM's seccomp filter
/// for that thread. An error stops the thread before it does anything else and fails the
/// constructor that started it ([`BoostError::ThreadStart`]).
pub type ThreadStartHook = Arc<dyn Fn(&str) -> io::Result<()> + Send + Sync>;

/// Longest deadline accepted: a boost is a nudge, not a new scheduling class.
pub const MAX_DEADLINE: Duration = Duration::from_millis(100);

/// How a boost raises a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoostKind {
    /// Set the thread's nice value to this (-20..=19), if lower than its own.
    Nice(i32),
    /// `SCHED_FIFO` at this real-time priority (1..=99).
    Fifo(i32),
}

/// Errors of the boost tracker.
#[derive(Debug, Error, displaydoc::Display)]
pub enum BoostError {
    /// rule: a boost tracker needs at least one vCPU
    NoVcpus,
    /// rule: boost deadline must be within 1 us..=100 ms, got {0:?}
    Deadline(Duration),
    /// rule: nice boost must be within -20..=19, got {0}
    NiceRange(i32),
    /// rule: SCHED_FIFO priority must be within 1..=99, got {0}
    FifoPriority(i32),
    /// the boost permission probe thread did not start within 5 s
    ProbeNotStarted,
    /// rule: {kind} boosts need CAP_SYS_NICE or a matching rlimit; probe failed: {err}
    NotPermitted {
        /// "nice" or "fifo".
        kind: &'static str,
        /// What the probe got.
        err: io::Error,
    },
    /// vCPU {0} is out of range
    NoSuchVcpu(usize),
    /// vCPU {0} has no thread id
    NoThread(usize),
    /// scheduling call failed: {0}
    Sched(#[from] io::Error),
    /// cannot start the boost watchdog: {0}
    Watchdog(io::Error),
    /// the start hook of helper thread {thread} failed: {err}
    ThreadStart {
        /// The thread's name.
        thread: &'static str,
        /// What the hook returned.
        err: io::Error,
    },
}

/// What [`BoostTracker::boost`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoostResult {
    /// The thread is now boosted.
    Applied,
    /// It was boosted already; the deadline was extended.
    Extended,
    /// Nothing to do: the thread's own priority is already at least the boost's.
    AlreadyHigher,
}

#[derive(Debug, Clone, Copy)]
struct Prev {
    policy: SchedPolicy,
    nice: i32,
}

#[derive(Debug)]
struct Active {
    tid: i32,
    prev: Prev,
    deadline: Instant,
}

/// Counters (monotonic).
#[derive(Debug, Default)]
pub struct BoostStats {
    /// Boosts applied.
    pub applied: AtomicU64,
    /// Boosts extended.
    pub extended: AtomicU64,
    /// Restored by the target's own exit or kick.
    pub restored_by_target: AtomicU64,
    /// Restored by the watchdog at the deadline.
    pub restored_by_deadline: AtomicU64,
    /// Restored at shutdown.
    pub restored_at_shutdown: AtomicU64,
    /// Scheduling calls that failed (apply or restore).
    pub errors: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    kind: BoostKind,
    deadline: Duration,
    slots: Box<[Mutex<Option<Active>>]>,
    boosted: Box<[AtomicBool]>,
    active: AtomicUsize,
    stop: Mutex<bool>,
    cv: Condvar,
    stats: BoostStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a boost ended.
#[derive(Debug, Clone, Copy)]
enum End {
    Target,
    Deadline,
    Shutdown,
}

impl Inner {
    fn apply(&self, tid: i32) -> Result<Option<Prev>, io::Error> {
        let prev = Prev {
            policy: get_policy(tid)?,
            nice: get_nice(tid)?,
        };
        match self.kind {
            BoostKind::Nice(n) => {
                if prev.policy.policy != libc::SCHED_OTHER || prev.nice <= n {
                    return Ok(None);
                }
                set_nice(tid, n)?;
            }
            BoostKind::Fifo(p) => {
                if prev.policy.policy == libc::SCHED_FIFO || prev.policy.policy == libc::SCHED_RR {
                    return Ok(None);
                }
                set_policy(
                    tid,
                    SchedPolicy {
                        policy: libc::SCHED_FIFO,
                        priority: p,
                    },
                )?;
            }
        }
        Ok(Some(prev))
    }

    fn undo(&self, a: &Active) {
        let r = match self.kind {
            BoostKind::Nice(_) => set_nice(a.tid, a.prev.nice),
            BoostKind::Fifo(_) => {
                set_policy(a.tid, a.prev.policy).and_then(|()| set_nice(a.tid, a.prev.nice))
            }
        };
        if let Err(e) = r {
            // ESRCH: the thread is gone, nothing left to restore.
            if e.raw_os_error() != Some(libc::ESRCH) {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                log::warn!("pvspin-hints: restoring thread {} failed: {e}", a.tid);
            }
        }
    }

    fn end(&self, v: usize, why: End, only_if_due: Option<Instant>) -> bool {
        let (Some(slot), Some(flag)) = (self.slots.get(v), self.boosted.get(v)) else {
            return false;
        };
        if !flag.load(Ordering::Acquire) {
            return false;
        }
        let mut g = lock(slot);
        let due = match (&*g, only_if_due) {
            (None, _) => false,
            (Some(a), Some(now)) => a.deadline <= now,
            (Some(_), None) => true,
        };
        if !due {
            return false;
        }
        let Some(a) = g.take() else { return false };
        self.undo(&a);
        flag.store(false, Ordering::Release);
        self.active.fetch_sub(1, Ordering::AcqRel);
        let c = match why {
            End::Target => &self.stats.restored_by_target,
            End::Deadline => &self.stats.restored_by_deadline,
            End::Shutdown => &self.stats.restored_at_shutdown,
        };
        c.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn watchdog(&self) {
        // A SCHED_FIFO target that keeps running would starve a fair-class watchdog on its
        // CPU: run it one real-time priority above the boost (permission was probed). It
        // only ever sleeps or restores.
        if let BoostKind::Fifo(p) = self.kind {
            let me = crate::sched::current_tid();
            let rt = SchedPolicy {
                policy: libc::SCHED_FIFO,
                priority: (p + 1).min(99),
            };
            if let Err(e) = set_policy(me, rt) {
                log::warn!("pvspin-hints: boost watchdog stays in the fair class: {e}");
            }
        }
        let tick = (self.deadline / 2).max(Duration::from_micros(200));
        let mut stop = lock(&self.stop);
        loop {
            if *stop {
                return;
            }
            // Idle: sleep long (bounded, to notice a lost wake-up); busy: tick.
            let wait = if self.active.load(Ordering::Acquire) == 0 {
                Duration::from_millis(50)
            } else {
                tick
            };
            stop = self
                .cv
                .wait_timeout(stop, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if *stop {
                return;
            }
            if self.active.load(Ordering::Acquire) > 0 {
                drop(stop);
                let now = Instant::now();
                for v in 0..self.slots.len() {
                    self.end(v, End::Deadline, Some(now));
                }
                stop = lock(&self.stop);
            }
        }
    }
}

/// Per-VM record of boosted vCPU threads, with a deadline watchdog.
#[derive(Debug)]
pub struct BoostTracker {
    inner: Arc<Inner>,
    watchdog: Option<JoinHandle<()>>,
}

impl BoostTracker {
    /// A tracker for `n` vCPUs whose boosts last at most `deadline` (1 us to 100 ms).
    ///
    /// Probes the permission with a real call on a throwaway thread and refuses with
    /// [`BoostError::NotPermitted`] when the process lacks it.
    pub fn new(n: usize, kind: BoostKind, deadline: Duration) -> Result<BoostTracker, BoostError> {
        Self::with_thread_start(n, kind, deadline, None)
    }

    /// [`new`](Self::new), with `start` run first on the watchdog thread (see
    /// [`ThreadStartHook`]); returns once the hook has succeeded, or with
    /// [`BoostError::ThreadStart`] once it failed and the thread has stopped. The probe thread
    /// does not run the hook: it is started and joined here, while the caller sets up.
    pub fn with_thread_start(
        n: usize,
        kind: BoostKind,
        deadline: Duration,
        start: Option<ThreadStartHook>,
    ) -> Result<BoostTracker, BoostError> {
        if n == 0 {
            return Err(BoostError::NoVcpus);
        }
        if deadline < Duration::from_micros(1) || deadline > MAX_DEADLINE {
            return Err(BoostError::Deadline(deadline));
        }
        match kind {
            BoostKind::Nice(n) if !(-20..=19).contains(&n) => return Err(BoostError::NiceRange(n)),
            BoostKind::Fifo(p) if !(1..=99).contains(&p) => {
                return Err(BoostError::FifoPriority(p))
            }
            _ => {}
        }
        probe(kind)?;
        let inner = Arc::new(Inner {
            kind,
            deadline,
            slots: (0..n).map(|_| Mutex::new(None)).collect(),
            boosted: (0..n).map(|_| AtomicBool::new(false)).collect(),
            active: AtomicUsize::new(0),
            stop: Mutex::new(false),
            cv: Condvar::new(),
            stats: BoostStats::default(),
        });
        let w = inner.clone();
        let (started_tx, started_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
        let watchdog = std::thread::Builder::new()
            .name(WATCHDOG_THREAD_NAME.into())
            .spawn(move || {
                let started = start.map_or(Ok(()), |hook| hook(WATCHDOG_THREAD_NAME));
                let ok = started.is_ok();
                let _ = started_tx.send(started);
                if ok {
                    w.watchdog();
                }
            })
            .map_err(BoostError::Watchdog)?;
        let started = started_rx.recv().unwrap_or_else(|_| {
            Err(io::Error::other(
                "the thread ended before reporting its start",
            ))
        });
        if let Err(err) = started {
            let _ = watchdog.join();
            return Err(BoostError::ThreadStart {
                thread: WATCHDOG_THREAD_NAME,
                err,
            });
        }
        Ok(BoostTracker {
            inner,
            watchdog: Some(watchdog),
        })
    }

    /// The kind of boost.
    pub fn kind(&self) -> BoostKind {
        self.inner.kind
    }

    /// Counters.
    pub fn stats(&self) -> &BoostStats {
        &self.inner.stats
    }

    /// Boosts vCPU `v`'s thread `tid` until its next exit/kick or the deadline.
    pub fn boost(&self, v: usize, tid: i32) -> Result<BoostResult, BoostError> {
        let inner = &*self.inner;
        let slot = inner.slots.get(v).ok_or(BoostError::NoSuchVcpu(v))?;
        if tid <= 0 {
            return Err(BoostError::NoThread(v));
        }
        let mut g = lock(slot);
        let deadline = Instant::now() + inner.deadline;
        if let Some(a) = g.as_mut() {
            if a.tid == tid {
                a.deadline = deadline;
                inner.stats.extended.fetch_add(1, Ordering::Relaxed);
                return Ok(BoostResult::Extended);
            }
            // The vCPU has a new thread: restore the old one first.
            if let Some(old) = g.take() {
                inner.undo(&old);
                inner.boosted[v].store(false, Ordering::Release);
                inner.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
        match inner.apply(tid) {
            Ok(None) => Ok(BoostResult::AlreadyHigher),
            Ok(Some(prev)) => {
                *g = Some(Active {
                    tid,
                    prev,
                    deadline,
                });
                inner.boosted[v].store(true, Ordering::Release);
                inner.active.fetch_add(1, Ordering::AcqRel);
                inner.stats.applied.fetch_add(1, Ordering::Relaxed);
                drop(g);
                inner.cv.notify_one();
                Ok(BoostResult::Applied)
            }
            Err(e) => {
                inner.stats.errors.fetch_add(1, Ordering::Relaxed);
                Err(BoostError::Sched(e))
            }
        }
    }

    /// Ends `v`'s boost, if any. Call on `v`'s own thread at each exit and when it is kicked;
    /// one atomic load when `v` is not boosted. Returns whether a boost was ended.
    pub fn restore(&self, v: usize) -> bool {
        self.inner.end(v, End::Target, None)
    }

    /// Ends boosts whose deadline has passed (the watchdog does this too).
    pub fn expire_due(&self) -> usize {
        let now = Instant::now();
        (0..self.inner.slots.len())
            .filter(|&v| self.inner.end(v, End::Deadline, Some(now)))
            .count()
    }

    /// Whether `v` is boosted now.
    pub fn is_boosted(&self, v: usize) -> bool {
        self.inner
            .boosted
            .get(v)
            .is_some_and(|b| b.load(Ordering::Acquire))
    }

    /// Ends every boost (shutdown). Also done on drop.
    pub fn restore_all(&self) {
        for v in 0..self.inner.slots.len() {
            self.inner.end(v, End::Shutdown, None);
        }
    }
}

impl Drop for BoostTracker {
    fn drop(&mut self) {
        *lock(&self.inner.stop) = true;
        self.inner.cv.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        self.restore_all();
    }
}

/// Tries `kind` on a throwaway thread (and undoes it) to learn whether it is permitted.
pub fn probe(kind: BoostKind) -> Result<(), BoostError> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel::<i32>();
    let t = std::thread::Builder::new()
        .name(PROBE_THREAD_NAME.into())
        .spawn(move || {
            let _ = tid_tx.send(crate::sched::current_tid());
            // Blocks (never spins) until told to go; bounded in case the sender is lost.
            let _ = rx.recv_timeout(Duration::from_secs(5));
        })
        .map_err(BoostError::Watchdog)?;
    let result = match tid_rx.recv_timeout(Duration::from_secs(5)) {
        Ok(tid) => probe_on(kind, tid),
        Err(_) => Err(BoostError::ProbeNotStarted),
    };
    let _ = tx.send(());
    let _ = t.join();
    result
}

fn probe_on(kind: BoostKind, tid: i32) -> Result<(), BoostError> {
    let prev = get_policy(tid)?;
    let nice = get_nice(tid)?;
    let (name, r) = match kind {
        BoostKind::Nice(n) => ("nice", set_nice(tid, n.min(nice - 1).max(-20))),
        BoostKind::Fifo(p) => (
            "fifo",
            set_policy(
                tid,
                SchedPolicy {
                    policy: libc::SCHED_FIFO,
                    priority: p,
                },
            ),
        ),
    };
    // Undo whatever happened (the thread is about to exit anyway).
    let _ = set_policy(tid, prev);
    let _ = set_nice(tid, nice);
    match r {
        Ok(()) => Ok(()),
        Err(err) if matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) => {
            Err(BoostError::NotPermitted { kind: name, err })
        }
        Err(err) => Err(BoostError::Sched(err)),
    }
}
