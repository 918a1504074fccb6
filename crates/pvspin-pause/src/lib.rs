//! The pvspin pause-exit handler.
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
//! 3. `policy.decide(&view, &notification)` (or `decide_with` with a booster that reports
//!    failures);
//! 4. acts: `YieldTo(t, _)` boosts `t`'s thread and yields, `YieldSelf` yields, `Nothing`
//!    returns to the guest;
//! 5. if the actuator reports the thread was descheduled, `windows.on_scheduled_out(v)`.
#![deny(missing_docs)]

pub mod policy;
pub mod window;

pub use policy::{
    BadHintCounters, BoostOutcome, Decision, DirectedYield, HintStatus, Outcome, PolicyConfig,
    PolicyError, Reason, ScanStats, SpinNotification, StealTimeView, VcpuView,
};
pub use window::{grow_window, shrink_window, SpinWindows, WindowConfig, WindowError};

#[cfg(test)]
mod tests;
