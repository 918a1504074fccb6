//! Spin notifications and directed yield inside the embedding API: the per-VM state the
//! hooks share (the board of vCPU facts, the policy, the spin windows, the actuator) and the
//! handler of one notification.
//!
//! Per exit, on the vCPU's own thread (see [`crate::VcpuHooks`]): `before_run` records the
//! thread id once and `board.on_enter_run`; `after_run` reads the CPL from `kvm_run`'s sync
//! registers (enabled once per vCPU in `configure_vcpu`, no ioctl per exit),
//! `board.on_exit(v, cpl)`, ends a boost of this vCPU (`actuator.on_target_exit`), then handles
//! a SPIN notification that arrived with this exit: `windows.on_notification`,
//! `policy.decide(board, ..)`, `actuator.yield_to` / `yield_self`, and
//! `windows.on_scheduled_out` when the yield descheduled the thread. A 32-bit `IN` of the SPIN
//! register is answered with the vCPU's current window in `handle_exit`.

use std::sync::atomic::{AtomicU64, Ordering};

use pvspin_abi::doorbell::{spun_bucket_floor, SpinNotify};
use pvspin_hints::confine::{Confinement, Verdict};
use pvspin_hints::{Actuator, GuestPageMap};
use pvspin_track::{GuestBytes, VcpuBoard};
use pvspin_yield::{
    BoostTrial, Decision, DirectedYield, HintStatus, PolicyConfig, Reason, SpinNotification,
    SpinWindows, TrialConfig, TrialStats, WindowConfig,
};

/// Guest memory as pvspin reads it: the same [`GuestPageMap`] that hint pages take (a
/// `vm_memory::GuestMemoryMmap` is one), shared between vCPU threads.
pub type StealTimeMemory = std::sync::Arc<dyn GuestPageMap>;

/// Steal-time bytes read through the VMM's page map.
#[derive(Clone, Debug)]
pub(crate) struct PageBytes(pub(crate) StealTimeMemory);

impl GuestBytes for PageBytes {
    #[inline]
    fn read_u8(&self, gpa: u64) -> Option<u8> {
        self.0.read_u8(gpa)
    }
}

use crate::{ConfigError, ParseActuatorError};

/// What "yield to vCPU X" does ([`DirectedYieldOptions::actuator`]); the actuators
/// `pvspin_hints::actuator` builds. Parsed from and printed as its name (`yield`, `nice`,
/// `fifo`), the spelling of a VMM's command line or config file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActuatorKind {
    /// `sched_yield` only; X is not touched.
    Yield,
    /// A bounded nice boost of X's thread, then yield (steps down to `Yield` with
    /// [`DirectedYieldOptions::fallback`] when the process may not lower a nice value). The
    /// default: `pvspin_hints::DEFAULT_ACTUATOR`, chosen from measurements there.
    #[default]
    Nice,
    /// A bounded `SCHED_FIFO` boost of X's thread, then yield; needs real-time scheduling
    /// privilege.
    Fifo,
}

impl ActuatorKind {
    /// Every actuator, weakest first (the order `fallback` steps down in, reversed).
    pub const ALL: [ActuatorKind; 3] =
        [ActuatorKind::Yield, ActuatorKind::Nice, ActuatorKind::Fifo];

    /// Its name: `yield`, `nice` or `fifo` (what `pvspin_hints::ActuatorOptions` and
    /// [`crate::PvSpin::actuator_name`] use).
    pub const fn as_str(self) -> &'static str {
        match self {
            ActuatorKind::Yield => "yield",
            ActuatorKind::Nice => "nice",
            ActuatorKind::Fifo => "fifo",
        }
    }
}

impl std::fmt::Display for ActuatorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ActuatorKind {
    type Err = ParseActuatorError;

    fn from_str(name: &str) -> Result<Self, ParseActuatorError> {
        (ActuatorKind::ALL.into_iter())
            .find(|kind| kind.as_str() == name)
            .ok_or_else(|| ParseActuatorError::UnknownName(name.to_owned()))
    }
}

/// How the embedding VMM configures spin notifications and directed yield.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectedYieldOptions {
    /// What "yield to vCPU X" does: [`ActuatorKind::Yield`] (`sched_yield` only),
    /// [`ActuatorKind::Nice`] (bounded nice boost of X's thread, then yield) or
    /// [`ActuatorKind::Fifo`] (bounded `SCHED_FIFO` boost, then yield; needs real-time
    /// scheduling privilege). See `pvspin_hints::actuator`.
    pub actuator: ActuatorKind,
    /// When the actuator is not permitted (fifo or nice without privilege): `false` refuses
    /// the configuration naming the rule; `true` steps down fifo -> nice -> yield with a
    /// warning ([`crate::PvSpin::actuator_name`] says which one is used).
    pub fallback: bool,
    /// The decision's rules (hint first, KVM's candidate scan, kernel-mode filter, ...).
    pub policy: PolicyConfig,
    /// The adaptive per-vCPU spin window the guest reads (KVM's PLE window knobs).
    pub windows: WindowConfig,
    /// How long a boost lasts at most (it also ends at the target's next exit or kick).
    pub boost_deadline: std::time::Duration,
    /// Whether boosts stay inside the VM's CPU share (`pvspin_hints::confine`): with
    /// [`Confinement::Auto`] a nice boost is used only when this process is alone in its own
    /// cpu cgroup, and `SCHED_FIFO` only with [`Confinement::Unconfined`]. A boost that would
    /// not be confined steps down to a plain yield with `fallback` (the reason is logged and
    /// in [`crate::PvSpin::boost_confinement`]), and is refused naming the rule without it.
    pub confinement: Confinement,
}

impl Default for DirectedYieldOptions {
    /// The `nice` actuator (stepping down to `yield` without the privilege to lower a nice
    /// value), KVM's window knobs as `pvspin-yield` sets them, and KVM's policy
    /// except that a hinted vCPU the board sees running is boosted too
    /// ([`PolicyConfig::boost_running_hint`]): the hooks cannot see a vCPU thread preempted
    /// inside `KVM_RUN`, so without it every hint would read "not ready".
    fn default() -> Self {
        Self {
            actuator: ActuatorKind::default(),
            fallback: true,
            policy: PolicyConfig {
                boost_running_hint: true,
                ..PolicyConfig::default()
            },
            windows: WindowConfig::default(),
            boost_deadline: pvspin_hints::actuator::DEFAULT_BOOST_DEADLINE,
            confinement: Confinement::Auto,
        }
    }
}

/// What the directed-yield handler did, summed over all vCPUs (part of
/// [`crate::PvSpin::telemetry`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DirectedYieldStats {
    /// SPIN notifications handled (valid ones; bad writes are the kick device's rejects).
    pub notifications: u64,
    /// Decisions to yield to the vCPU the guest named.
    pub yield_to_hint: u64,
    /// Decisions to yield to a vCPU found by the candidate scan.
    pub yield_to_candidate: u64,
    /// Undirected yields (no candidate).
    pub yield_self: u64,
    /// Decisions to do nothing.
    pub nothing: u64,
    /// Actuations that boosted the target's thread.
    pub boosted: u64,
    /// Actuations after which the spinner's thread had been descheduled (the window shrinks).
    pub descheduled: u64,
    /// Hints naming a vCPU that was not ready (running, halted without a kick): normal.
    pub hint_not_ready: u64,
    /// Hints naming the spinner itself (a guest bug; counted, logged once, ignored).
    pub hint_self: u64,
    /// Spin-window reads answered.
    pub window_reads: u64,
    /// Boosts of a running target left out because the boost trial found them not paying
    /// off (`pvspin_yield::trial`).
    pub trial_skipped: u64,
    /// The boost trial, when `boost_running_hint` is on.
    #[serde(
        serialize_with = "crate::telemetry::serialize_trial",
        skip_serializing_if = "Option::is_none"
    )]
    pub trial: Option<TrialStats>,
}

#[derive(Debug, Default)]
struct Counters {
    notifications: AtomicU64,
    yield_to_hint: AtomicU64,
    yield_to_candidate: AtomicU64,
    yield_self: AtomicU64,
    nothing: AtomicU64,
    boosted: AtomicU64,
    descheduled: AtomicU64,
    hint_not_ready: AtomicU64,
    window_reads: AtomicU64,
    trial_skipped: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What handling one notification did, for the hooks' telemetry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Handled {
    pub(crate) decision: Decision,
    /// `Some(successful)` when a yield was attempted: successful = the target was boosted or
    /// the spinner's thread was descheduled.
    pub(crate) yielded: Option<bool>,
    /// The decision named a target the board saw not running (preempted, parked, halted
    /// with a kick pending): the notification could help. The spinner's own deschedule does
    /// not count (its yield causes it).
    pub(crate) useful: bool,
}

/// The per-VM directed-yield state, shared by every vCPU thread.
#[derive(Debug)]
pub(crate) struct YieldState {
    pub(crate) board: VcpuBoard,
    pub(crate) policy: DirectedYield,
    pub(crate) windows: SpinWindows,
    pub(crate) actuator: Box<dyn Actuator>,
    /// With it, candidates' steal-time areas are read as they are examined, so a vCPU the
    /// host preempted inside `KVM_RUN` reads as ready (and preempted in kernel or user mode).
    pub(crate) mem: Option<PageBytes>,
    /// With `boost_running_hint`: whether boosting a target the board sees running pays
    /// off, tried epoch by epoch from the guests' wait reports (hint pages).
    trial: Option<BoostTrial>,
    counters: Counters,
    /// Whether boosts stay inside the VM's share, as found when the actuator was chosen.
    pub(crate) confinement: Verdict,
}

/// The actuator `options` ask for, stepped down (with `fallback`) or refused when its boosts
/// would not stay inside the VM's share (`verdict`).
fn confined_actuator(
    options: &DirectedYieldOptions,
    verdict: &Verdict,
) -> Result<ActuatorKind, ConfigError> {
    let name = options.actuator;
    let allowed = match name {
        ActuatorKind::Fifo => verdict.allows_fifo(),
        ActuatorKind::Nice => verdict.allows_nice(),
        ActuatorKind::Yield => true,
    };
    if allowed {
        return Ok(name);
    }
    let fifo_reason = "SCHED_FIFO preempts every fair-class task on its CPU, whatever the cgroup";
    let why: &dyn std::fmt::Display = match verdict {
        Verdict::NotConfined { reason } => reason,
        _ => &fifo_reason,
    };
    if !options.fallback {
        return Err(match verdict {
            Verdict::NotConfined { .. } => ConfigError::BoostNotConfined {
                name,
                verdict: verdict.clone(),
            },
            _ => ConfigError::FifoNotConfined { name },
        });
    }
    let step = if name == ActuatorKind::Fifo && verdict.allows_nice() {
        ActuatorKind::Nice
    } else {
        ActuatorKind::Yield
    };
    log::warn!("pvspin: the {name} actuator's boosts would not be confined ({why}); using {step}");
    Ok(step)
}

impl YieldState {
    /// Validates `options` for `vcpus` vCPUs and builds the actuator; `start` runs first on
    /// the helper thread a boost actuator starts.
    pub(crate) fn new(
        options: &DirectedYieldOptions,
        vcpus: usize,
        start: Option<&pvspin_hints::ThreadStartHook>,
    ) -> Result<Self, ConfigError> {
        let verdict = pvspin_hints::confine::check(&options.confinement);
        let name = confined_actuator(options, &verdict)?;
        let deadline = options.boost_deadline;
        let actuator = pvspin_hints::ActuatorOptions {
            deadline,
            fallback: options.fallback,
            thread_start: start.cloned(),
            ..pvspin_hints::ActuatorOptions::new(name.as_str(), vcpus)
        }
        .build()
        .map_err(|source| ConfigError::Actuator { name, source })?;
        let mut state = Self::with_actuator(options, vcpus, actuator)?;
        state.confinement = verdict;
        Ok(state)
    }

    /// Like [`new`](Self::new) with a given actuator (tests inject a recording one).
    pub(crate) fn with_actuator(
        options: &DirectedYieldOptions,
        vcpus: usize,
        actuator: Box<dyn Actuator>,
    ) -> Result<Self, ConfigError> {
        Ok(Self {
            board: VcpuBoard::new(vcpus).map_err(ConfigError::DirectedYieldBoard)?,
            policy: DirectedYield::new(options.policy).map_err(ConfigError::DirectedYieldPolicy)?,
            windows: SpinWindows::new(vcpus, options.windows)
                .map_err(ConfigError::DirectedYieldWindows)?,
            actuator,
            mem: None,
            trial: options
                .policy
                .boost_running_hint
                .then(|| BoostTrial::new(TrialConfig::default())),
            counters: Counters::default(),
            confinement: Verdict::Unconfined,
        })
    }

    /// The window vCPU `v` reads from the SPIN register.
    pub(crate) fn read_window(&self, v: usize) -> u32 {
        bump(&self.counters.window_reads);
        self.windows
            .get(v)
            .max(pvspin_abi::doorbell::SPIN_WINDOW_MIN)
    }

    /// Handles a SPIN notification from vCPU `me`, on `me`'s thread, after the board has its
    /// CPL for this exit. The notification's `waiting_for` is already range-checked by the
    /// kick device.
    pub(crate) fn on_notification(&self, me: usize, n: SpinNotify) -> Handled {
        self.handle(me, n, false)
    }

    /// A notification that came with a WAIT: the same decision, but the waiter parks next,
    /// so a yield of its own thread is pointless: a directed decision only boosts, an
    /// undirected one does nothing.
    pub(crate) fn on_wait_notification(&self, me: usize, n: SpinNotify) -> Handled {
        self.handle(me, n, true)
    }

    fn handle(&self, me: usize, n: SpinNotify, parking: bool) -> Handled {
        let c = &self.counters;
        bump(&c.notifications);
        self.windows.on_notification(me);
        let notification = SpinNotification {
            spinner: me,
            lock_id: u64::from(n.lock_hash),
            waiting_for: n.waiting_for.map(u32::from),
            spun: u64::from(spun_bucket_floor(n.spun_bucket)),
        };
        let outcome = match &self.mem {
            Some(mem) => self.policy.decide(
                &pvspin_yield::StealTimeView {
                    board: &self.board,
                    mem,
                },
                &notification,
            ),
            None => self.policy.decide(&self.board, &notification),
        };
        if outcome.hint == HintStatus::NotReady {
            bump(&c.hint_not_ready);
        }
        // The target as the board sees it now, read once: not running means the notification
        // could help; running means only the boost trial decides whether to boost it.
        let target_running = match outcome.decision {
            Decision::YieldTo(target, _) => self.board.snapshot(target).map(|s| s.is_running()),
            _ => None,
        };
        let useful = target_running == Some(false);
        let running_target = target_running == Some(true);
        let trial_off = running_target && self.trial.as_ref().is_some_and(|t| !t.boosting());
        let report = match outcome.decision {
            Decision::YieldTo(..) if trial_off => {
                bump(&c.trial_skipped);
                None
            }
            Decision::YieldTo(target, reason) => {
                bump(if reason == Reason::Hint {
                    &c.yield_to_hint
                } else {
                    &c.yield_to_candidate
                });
                let tid = self.board.tid(target);
                Some(if parking {
                    self.actuator.boost(target, tid)
                } else {
                    self.actuator.yield_to(target, tid)
                })
            }
            Decision::YieldSelf(_) => {
                bump(&c.yield_self);
                (!parking).then(|| self.actuator.yield_self())
            }
            Decision::Nothing(_) => {
                bump(&c.nothing);
                None
            }
        };
        if let Some(r) = report {
            if r.boosted {
                bump(&c.boosted);
            }
            if r.descheduled {
                bump(&c.descheduled);
                self.windows.on_scheduled_out(me);
            }
        }
        Handled {
            decision: outcome.decision,
            yielded: report.map(|r| r.boosted || r.descheduled),
            useful,
        }
    }

    /// A guest's wait report (ns), for the boost trial.
    pub(crate) fn on_wait_report(&self, ns: u64) {
        if let Some(t) = &self.trial {
            t.on_wait(ns);
        }
    }

    pub(crate) fn stats(&self) -> DirectedYieldStats {
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DirectedYieldStats {
            notifications: ld(&c.notifications),
            yield_to_hint: ld(&c.yield_to_hint),
            yield_to_candidate: ld(&c.yield_to_candidate),
            yield_self: ld(&c.yield_self),
            nothing: ld(&c.nothing),
            boosted: ld(&c.boosted),
            descheduled: ld(&c.descheduled),
            hint_not_ready: ld(&c.hint_not_ready),
            hint_self: self.policy.bad_hints().self_hint.load(Ordering::Relaxed),
            window_reads: ld(&c.window_reads),
            trial_skipped: ld(&c.trial_skipped),
            trial: self.trial.as_ref().map(BoostTrial::stats),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actuator_kinds_parse_their_own_names_and_nothing_else() {
        for kind in ActuatorKind::ALL {
            assert_eq!(kind.to_string().parse::<ActuatorKind>(), Ok(kind));
        }
        let names = ActuatorKind::ALL.map(ActuatorKind::as_str);
        assert_eq!(names, ["yield", "nice", "fifo"]);
        for bad in ["", "Nice", "nice ", "teleport"] {
            assert_eq!(
                bad.parse::<ActuatorKind>(),
                Err(ParseActuatorError::UnknownName(bad.to_owned()))
            );
        }
        // The default is the one pvspin-hints measured and names.
        assert_eq!(
            ActuatorKind::default().as_str(),
            pvspin_hints::DEFAULT_ACTUATOR
        );
        assert_eq!(
            DirectedYieldOptions::default().actuator,
            ActuatorKind::default()
        );
    }

    #[test]
    fn an_unconfined_boost_steps_down_or_is_refused_naming_its_kind() {
        let not_confined = Verdict::NotConfined {
            reason: pvspin_hints::confine::NotConfinedReason::RootCgroup,
        };
        let options = |actuator, fallback| DirectedYieldOptions {
            actuator,
            fallback,
            ..DirectedYieldOptions::default()
        };
        let stepped = confined_actuator(&options(ActuatorKind::Fifo, true), &not_confined);
        assert_eq!(stepped.unwrap(), ActuatorKind::Yield);
        let kept = confined_actuator(&options(ActuatorKind::Yield, false), &not_confined);
        assert_eq!(kept.unwrap(), ActuatorKind::Yield);
        let err = confined_actuator(&options(ActuatorKind::Nice, false), &not_confined);
        match err.unwrap_err() {
            err @ ConfigError::BoostNotConfined { name, .. } => {
                assert_eq!(name, ActuatorKind::Nice);
                assert!(err
                    .to_string()
                    .starts_with(r#"directed yield actuator "nice": rule:"#));
            }
            other => panic!("{other}"),
        }
    }
}
