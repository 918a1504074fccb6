//! Atomics for the PV lock protocols: `core`'s normally, loom's under `--cfg loom`, so the
//! same lock code is model checked.
//!
//! Only the fields that take part in a wait/kick handshake use these; statistics counters use
//! `core` atomics always (they are not part of any protocol, and keeping them out of loom keeps
//! its state space small).

#[cfg(not(loom))]
pub use core::sync::atomic::{fence, AtomicU32, AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU8, AtomicUsize, Ordering};

/// One iteration of a spin-wait loop (PAUSE on x86; a yield point under loom).
#[inline(always)]
pub(crate) fn spin_loop() {
    #[cfg(not(loom))]
    core::hint::spin_loop();
    #[cfg(loom)]
    loom::hint::spin_loop();
}
