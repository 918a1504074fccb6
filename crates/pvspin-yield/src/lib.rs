//! pvspin's spin-notification policy (the guest's SPIN and WAIT reports, not PAUSE exits:
//! KVM handles pause-loop exits in the kernel and never forwards them to the VMM).
//!
//! | module | what |
//! |---|---|
//! | [`policy`] | [`DirectedYield`]: whom a spinner yields to, the guest's holder hint first, KVM's `kvm_vcpu_on_spin` candidate rules otherwise, over a [`VcpuView`] (`pvspin_track::VcpuBoard`, or [`StealTimeView`] with guest steal time) |
//! | [`window`] | [`SpinWindows`]: each vCPU's spin window, adapted like KVM's PLE window |
//! | [`budget`] | time budgets (ABI 0.3): how long a waiter spins before it waits (KVM's halt-polling rule) and before it notifies (KVM's PLE rule, a notification counting only when its target was not running) |
//! | [`trial`] | [`BoostTrial`]: whether boosting a waited-for vCPU that the host sees running pays off |
//!
//! The decisions are pure code, unit-tested and fuzzed without KVM; acting on them is
//! `pvspin-hints`' actuators, and the wire format is `pvspin-abi`'s. On a notification, the
//! vCPU's own thread (which just exited with it) does:
//! 1. `board.on_exit(v, Some(cpl))` (pvspin-track), as after every exit;
//! 2. `windows.on_notification(v)`, and publishes the new window to the guest;
//! 3. `policy.decide(&view, &notification)`, where `view` is the `VcpuBoard` itself, or a
//!    [`StealTimeView`] over the board and guest memory when guests register steal time (or
//!    `decide_with` and a booster that reports per-candidate failures);
//! 4. acts (pvspin-hints): `YieldTo(t, _)` -> `actuator.yield_to(t, board.tid(t))`,
//!    `YieldSelf` -> `actuator.yield_self()`, `Nothing` -> straight back to the guest;
//! 5. if the actuator's report says the thread was descheduled,
//!    `windows.on_scheduled_out(v)` (KVM's shrink on reload after `scheduled_out`), and
//!    publishes the window again.
//!
//! A decision's cost is bounded by [`PolicyConfig::scan_budget`]; measured at 8, 64 and 1024
//! vCPUs with `cargo bench -p pvspin-yield` (`docs/benchmarks.md`, "Micro-benchmarks of the
//! host-side pieces").
#![deny(missing_docs)]

pub mod budget;
pub mod policy;
pub mod trial;
pub mod window;

pub use budget::{
    adapt_notify_after, adapt_wait_after, ns_to_tsc, tsc_to_ns, BudgetConfig, BudgetError,
    SpinBudgets,
};
pub use policy::{
    BadHintCounters, BoostOutcome, Decision, DirectedYield, HintStatus, Outcome, PolicyConfig,
    PolicyError, Reason, ScanStats, SpinNotification, StealTimeView, VcpuView,
};
pub use trial::{BoostTrial, TrialConfig, TrialStats};
pub use window::{grow_window, shrink_window, SpinWindows, WindowConfig, WindowError};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(test)]
mod tests;
