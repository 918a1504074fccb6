//! pvspin run slots: at most S of a VM's vCPUs run guest code at once; lock holders and kicked
//! vCPUs go first, and the others wait on the VMM's own waits instead of spinning in the host's
//! run queue.
//!
//! | module | what |
//! |---|---|
//! | [`policy`] | the slot policy ([`RunSlots`]): quantum, critical-section extension, priority for kicked vCPUs, hand-over, lending the slot of a vCPU halted inside KVM, the wait bound |
//! | [`watch`] | the halt watcher ([`HaltWatcher`]): sees halts and wake-ups that stay inside KVM (in-kernel LAPIC, stock guests) through a [`HaltProbe`] |
//! | [`quota`] | the VM's CPU entitlement (affinity, cgroup `cpu.max` / CFS quota): the default slot count |
//! | [`steal`] | shows a parked vCPU to the guest through KVM's steal-time `preempted` byte |
//!
//! The policy is pure code over two small traits ([`SlotSignals`], [`SlotClock`]); KVM stays in
//! the embedding crate (`pvspin`). Its synchronisation is checked by loom models:
//! `RUSTFLAGS="--cfg loom" cargo test -p pvspin-slots --release --lib loom`.
#![deny(missing_docs)]

pub mod policy;
#[cfg(not(loom))]
pub mod quota;
#[cfg(not(loom))]
pub mod steal;
mod sync;
#[cfg(not(loom))]
pub mod watch;

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub use policy::{
    EnterOutcome, MonotonicSlotClock, RunSlots, SlotClock, SlotConfig, SlotError, SlotSignals,
    SlotStats, SlotWaker, DEFAULT_HALT_WATCH_INTERVAL,
};
#[cfg(not(loom))]
pub use quota::entitled_cpus;
#[cfg(not(loom))]
pub use steal::StealTimeMarks;
pub use sync::LockStats;
#[cfg(not(loom))]
pub use watch::{HaltProbe, HaltWatcher, WatchError, WatchStats};
