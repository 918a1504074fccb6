//! pvspin vCPU scheduler hints: host-thread actuators, the guest's hint pages, confinement.
//!
//! Userspace has no `yield_to()`: the actuators give a spinning vCPU's thread three ways to
//! favour the vCPU it waits for, and every priority boost is bounded and restored.
//!
//! | module | what |
//! |---|---|
//! | [`actuator`] | [`YieldOnly`] and [`BoostActuator`] (nice or `SCHED_FIFO` boost, then yield), built by name with [`ActuatorOptions`]; the default, [`DEFAULT_ACTUATOR`] |
//! | [`boost`] | [`BoostTracker`]: every boost ends at its deadline, on the target's next exit or kick, on errors, at shutdown and on drop |
//! | [`sched`] | the Linux calls on thread ids (nice, `SCHED_FIFO`, `sched_yield`, [`sched::current_tid`]) |
//! | [`page`] | the guest's hint pages (ABI 0.3): mapped once through the VMM's guest memory ([`GuestPageMap`]), read and written without exits |
//! | [`confine`] | whether priority boosts stay inside the VM's CPU share (its own cpu cgroup) |
//! | [`proc`] | the one parser of `/proc` and cgroup files (thread `schedstat`/`stat`/`status`, cpu cgroup, CFS quota) |
//!
//! What the embedding VMM calls: each vCPU thread registers its [`sched::current_tid`]
//! (pvspin-track's board keeps it); on a `YieldTo(x)` decision the spinner's thread calls
//! [`Actuator::yield_to`]`(x, tid_of_x)`; on `YieldSelf`, [`Actuator::yield_self`]; every
//! vCPU thread calls [`Actuator::on_target_exit`]`(v)` after each return from `KVM_RUN` and
//! when it is woken by a kick; the VMM calls [`Actuator::restore_all`] at shutdown.
//!
//! Helper threads: a boost actuator's [`BoostTracker`] starts one deadline watchdog thread
//! (`pvspin-boost-wd`) per VM; a [`ThreadStartHook`] given to the `*_with_start` builders runs
//! first on it (a VMM installs its seccomp filter there). This crate has no seccomp
//! dependency: `pvspin::seccomp` lists what the thread needs.
//!
//! [`page`] maps the guest's hint pages (ABI 0.3) and reads and writes them without exits;
//! [`budgets`] adapts each vCPU's time budgets from the guest's reports there and publishes
//! them (the one implementation the in-process host and `pvspind` share).
//!
//! [`confine`] says whether priority boosts stay inside the VM's CPU share. The three
//! actuators were compared with the example VMM's guests (`docs/benchmarks.md`, "Directed
//! yield and the actuators, vCPUs overcommitted inside the VM"; summed up in [`actuator`]'s
//! docs). The run-slot scheduler is the crate `pvspin-slots`. **Not implemented yet:**
//! affinity actuators.
#![deny(missing_docs)]

#[cfg(not(loom))]
pub mod actuator;
#[cfg(not(loom))]
pub mod boost;
#[cfg(not(loom))]
pub mod budgets;
pub mod confine;
#[cfg(not(loom))]
pub mod page;
pub mod proc;
#[cfg(not(loom))]
pub mod sched;

#[cfg(not(loom))]
pub use actuator::{
    Actuator, ActuatorError, ActuatorOptions, BoostActuator, YieldOnly, YieldReport,
    DEFAULT_ACTUATOR,
};
#[cfg(not(loom))]
pub use boost::{BoostError, BoostKind, BoostResult, BoostTracker, ThreadStartHook};
#[cfg(not(loom))]
pub use budgets::{PageBudgets, TscBudgets};
pub use confine::{Confinement, NotConfinedReason, Verdict};
#[cfg(all(not(loom), any(test, feature = "test-utils")))]
pub use page::BufferPageMap;
#[cfg(not(loom))]
pub use page::{GuestHints, GuestPageMap, HintPage, HintPages, RegisterError};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(all(test, not(loom)))]
mod tests;
