//! What "yield to vCPU X" means in userspace, where there is no `yield_to()`.
//!
//! * [`YieldOnly`]: the spinner's thread calls `sched_yield()`; X is not touched.
//! * [`BoostActuator::nice`]: X's thread gets a lower nice value (bounded, see [`BoostTracker`]), then
//!   the spinner yields.
//! * [`BoostActuator::fifo`]: X's thread becomes `SCHED_FIFO` at priority 1 (bounded), then the
//!   spinner yields. Refused at construction when the process may not do it.
//!
//! [`ActuatorOptions`] builds one from "yield", "nice" or "fifo", so an embedding VMM can
//! compare them from a command line; with `fallback` it steps down fifo -> nice -> yield when a
//! boost is not permitted instead of failing.
//!
//! The default ([`DEFAULT_ACTUATOR`]) is the nice boost, from the example VMM's guests
//! (`docs/benchmarks.md`, "Directed yield and the actuators"; lock workload, median guest
//! time against `--pv kick`, 5
//! interleaved runs per case): 4 vCPUs on 2 host CPUs, no hogs: yield -42%, nice -44%,
//! fifo -7%; with 2 hogs: yield +9%, nice -44%, fifo -30%; 8 vCPUs: yield -14%, nice -23%,
//! fifo -22%; 2 vCPUs with 4 hogs: yield +92%, nice +2%, fifo +7%. Nice was best or within
//! noise of the best in every case and never the worst; plain yield collapsed when hogs
//! outnumber vCPUs (the spinner yields to a hog, not to the holder).
//!
//! A host-thread stand-in (`examples/actuators.rs`: threads pinned to one CPU contending for
//! a lock that names its holder) gave, on the shared, loaded development machine, medians of
//! 3 runs in us of wall time per acquisition (4 threads: yield 7.6 / 14.7, nice 7.8 / 7.9,
//! fifo 5.5 / 7.0; 8 threads: yield 10.2, nice 15.2, fifo 7.0). FIFO came out ahead in
//! every run there, but the spread between identical runs is up to 2x and the lock is not a
//! guest's; with guests, a FIFO boost that lands on a thread that has meanwhile become a
//! spinner starves the holder until the deadline, which is the likely reason fifo trails
//! nice above.

use std::time::Duration;

use thiserror::Error;

use crate::boost::{BoostError, BoostKind, BoostResult, BoostTracker, ThreadStartHook};
use crate::sched::yield_now;

/// The actuator an embedding VMM should use unless it measured better: see the module docs.
pub const DEFAULT_ACTUATOR: &str = "nice";

/// Default boost deadline: a few host time slices' worth of lock hold time.
pub const DEFAULT_BOOST_DEADLINE: Duration = Duration::from_millis(2);
/// Default nice value of a nice boost ([`BoostActuator::nice`]).
pub const DEFAULT_BOOST_NICE: i32 = -10;

/// What one actuation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct YieldReport {
    /// The target was boosted (or its boost extended). `false` for [`YieldOnly`], when the
    /// target thread is unknown or gone, and when its own priority was already higher.
    pub boosted: bool,
    /// The spinner's thread was actually descheduled by its yield (its context-switch count
    /// moved): feed it to the spin window's `on_scheduled_out`.
    pub descheduled: bool,
}

/// Errors building an actuator.
#[derive(Debug, Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub enum ActuatorError {
    /// rule: actuator name must be one of yield, nice, fifo; got {0:?}
    UnknownName(
        /// The name as the user typed it: it matched no known name, so no type holds it.
        String,
    ),
    /// {0}
    ///
    /// The boost tracker refused (permission, configuration).
    Boost(#[from] BoostError),
}

/// A host-thread actuator. Shared by all vCPU threads of a VM.
pub trait Actuator: Send + Sync + std::fmt::Debug {
    /// "yield", "nice" or "fifo".
    fn name(&self) -> &'static str;
    /// On the spinner's thread: boost vCPU `target` (thread `tid`, 0 when unknown), then
    /// yield. Never fails: a boost that cannot be applied is reported as not boosted.
    fn yield_to(&self, target: usize, tid: i32) -> YieldReport;
    /// On the spinner's thread: an undirected yield.
    fn yield_self(&self) -> YieldReport {
        YieldReport {
            boosted: false,
            descheduled: yield_now(),
        }
    }
    /// On a waiter's thread that is about to park (a WAIT carries its notification): boost
    /// `target` without yielding, since parking gives the CPU away anyway. The default does
    /// nothing (an actuator without boosts has nothing to add to the park).
    fn boost(&self, target: usize, tid: i32) -> YieldReport {
        let _ = (target, tid);
        YieldReport {
            boosted: false,
            descheduled: false,
        }
    }
    /// On vCPU `v`'s own thread at each exit, and when it is kicked: end its boost.
    fn on_target_exit(&self, v: usize);
    /// Shutdown: end every boost (also done on drop).
    fn restore_all(&self);
}

/// `sched_yield()` only.
#[derive(Debug, Default, Clone, Copy)]
pub struct YieldOnly;

impl Actuator for YieldOnly {
    fn name(&self) -> &'static str {
        "yield"
    }
    fn yield_to(&self, _target: usize, _tid: i32) -> YieldReport {
        self.yield_self()
    }
    fn on_target_exit(&self, _v: usize) {}
    fn restore_all(&self) {}
}

fn boost_target(t: &BoostTracker, target: usize, tid: i32) -> bool {
    match t.boost(target, tid) {
        Ok(BoostResult::Applied | BoostResult::Extended) => true,
        Ok(BoostResult::AlreadyHigher) => false,
        Err(e) => {
            log::debug!("pvspin-hints: boost of vCPU {target} failed: {e}");
            false
        }
    }
}

fn boost_then_yield(t: &BoostTracker, target: usize, tid: i32) -> YieldReport {
    YieldReport {
        boosted: boost_target(t, target, tid),
        descheduled: yield_now(),
    }
}

/// A bounded boost of the target's thread (nice value or `SCHED_FIFO`, by its
/// [`BoostTracker`]'s kind), then a yield: [`BoostActuator::nice`] and [`BoostActuator::fifo`].
#[derive(Debug)]
pub struct BoostActuator {
    tracker: BoostTracker,
    name: &'static str,
}

impl BoostActuator {
    /// A nice-level boost: the target's thread gets nice value `nice` (-20..=19) for at most
    /// `deadline` (1 us..=100 ms).
    pub fn nice(n: usize, nice: i32, deadline: Duration) -> Result<Self, ActuatorError> {
        Ok(Self {
            tracker: BoostTracker::new(n, BoostKind::Nice(nice), deadline)?,
            name: "nice",
        })
    }

    /// A `SCHED_FIFO` boost at the lowest real-time priority (1) for at most `deadline`;
    /// refuses with `NotPermitted` when the process may not use real-time scheduling.
    pub fn fifo(n: usize, deadline: Duration) -> Result<Self, ActuatorError> {
        Ok(Self {
            tracker: BoostTracker::new(n, BoostKind::Fifo(1), deadline)?,
            name: "fifo",
        })
    }

    /// The tracker (statistics, `is_boosted`).
    pub fn tracker(&self) -> &BoostTracker {
        &self.tracker
    }
}

impl Actuator for BoostActuator {
    fn name(&self) -> &'static str {
        self.name
    }
    fn yield_to(&self, target: usize, tid: i32) -> YieldReport {
        boost_then_yield(&self.tracker, target, tid)
    }
    fn boost(&self, target: usize, tid: i32) -> YieldReport {
        YieldReport {
            boosted: boost_target(&self.tracker, target, tid),
            descheduled: false,
        }
    }
    fn on_target_exit(&self, v: usize) {
        self.tracker.restore(v);
    }
    fn restore_all(&self) {
        self.tracker.restore_all();
    }
}

/// What actuator to build ([`ActuatorOptions::build`]): its name ("yield", "nice", "fifo"),
/// for how many vCPUs, how long a boost may last, whether a boost the process may not apply
/// steps down instead of failing, and what runs first on the thread a boost actuator starts.
#[derive(Clone)]
pub struct ActuatorOptions<'a> {
    /// "yield", "nice" or "fifo".
    pub name: &'a str,
    /// How many vCPUs the actuator serves.
    pub vcpus: usize,
    /// The longest a boost lasts before its watchdog restores it.
    pub deadline: Duration,
    /// A boost that is not permitted steps down (fifo -> nice -> yield) with a warning
    /// instead of failing; unknown names and a failing `thread_start` still fail.
    pub fallback: bool,
    /// Run first on the helper thread a boost actuator starts (its deadline watchdog, see
    /// [`ThreadStartHook`]); `"yield"` starts no thread.
    pub thread_start: Option<ThreadStartHook>,
}

impl std::fmt::Debug for ActuatorOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActuatorOptions")
            .field("name", &self.name)
            .field("vcpus", &self.vcpus)
            .field("deadline", &self.deadline)
            .field("fallback", &self.fallback)
            .field("thread_start", &self.thread_start.is_some())
            .finish()
    }
}

impl<'a> ActuatorOptions<'a> {
    /// `name` for `vcpus` vCPUs: the default deadline, no step-down, no start hook.
    pub fn new(name: &'a str, vcpus: usize) -> Self {
        Self {
            name,
            vcpus,
            deadline: DEFAULT_BOOST_DEADLINE,
            fallback: false,
            thread_start: None,
        }
    }

    /// Builds the actuator.
    pub fn build(&self) -> Result<Box<dyn Actuator>, ActuatorError> {
        if !self.fallback {
            return self.build_exactly(self.name);
        }
        let name = self.name;
        let chain: &[&str] = match name {
            "fifo" => &["fifo", "nice", "yield"],
            "nice" => &["nice", "yield"],
            "yield" => &["yield"],
            other => return Err(ActuatorError::UnknownName(other.to_string())),
        };
        let mut last = None;
        for &c in chain {
            match self.build_exactly(c) {
                Ok(a) => {
                    if c != name {
                        log::warn!("pvspin-hints: {name} actuator refused, using {c}");
                    }
                    return Ok(a);
                }
                Err(e @ ActuatorError::Boost(BoostError::ThreadStart { .. })) => return Err(e),
                Err(e) => {
                    log::warn!("pvspin-hints: {c} actuator unavailable: {e}");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| ActuatorError::UnknownName(name.to_string())))
    }

    fn build_exactly(&self, name: &str) -> Result<Box<dyn Actuator>, ActuatorError> {
        let boost = |kind, name| -> Result<Box<dyn Actuator>, ActuatorError> {
            Ok(Box::new(BoostActuator {
                tracker: BoostTracker::with_thread_start(
                    self.vcpus,
                    kind,
                    self.deadline,
                    self.thread_start.clone(),
                )?,
                name,
            }))
        };
        match name {
            "yield" => Ok(Box::new(YieldOnly)),
            "nice" => boost(BoostKind::Nice(DEFAULT_BOOST_NICE), "nice"),
            "fifo" => boost(BoostKind::Fifo(1), "fifo"),
            other => Err(ActuatorError::UnknownName(other.to_string())),
        }
    }
}
