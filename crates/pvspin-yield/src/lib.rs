//! pvspin's spin-notification policy (the guest's SPIN and WAIT reports, not PAUSE exits:
//! KVM handles pause-loop exits in the kernel and never forwards them to the VMM).
//!
//! Takes a spin notification from a guest vCPU ([`SpinNotification`]), decides whom to yield
//! to ([`DirectedYield`]: the guest's holder hint first, KVM's `kvm_vcpu_on_spin` candidate
//! rules otherwise) and adapts each vCPU's spin window like KVM's PLE window
//! ([`SpinWindows`]). The decision is pure code over a small trait ([`VcpuView`], implemented
//! by `pvspin_track::VcpuBoard`), so it is unit-tested and fuzzed without KVM; acting on it is
//! `pvspin-hints`' actuators.
//!
//! On a notification, the vCPU's own thread (which just exited with it) does:
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
//! Cost (criterion, `cargo bench -p pvspin-yield -- --warm-up-time 1 --measurement-time 3`,
//! shared and loaded 2-CPU machine, medians): 27-53 ns per decision at 8, 64 and 1024 vCPUs
//! with the board's ready bitmap; with every vCPU's steal-time byte to read, 77 ns, 736 ns
//! and 525 ns (the last one capped by [`PolicyConfig::scan_budget`]).
//!
//! Time budgets (ABI 0.3, [`budget`]): per vCPU, how long a waiter spins before it waits
//! (KVM's halt-polling rule over the guests' wait reports) and before it notifies (KVM's PLE
//! rule, counting a notification useful only when its target was not running). The boost
//! trial ([`trial`]) decides, from the same wait reports, whether boosting a waited-for vCPU
//! the host sees running pays off.
//!
//! Not here: the wire format of notifications and windows (pvspin-abi), and acting on
//! decisions (pvspin-hints).
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
