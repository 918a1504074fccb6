//! Atomics for the PV lock protocols: `core`'s normally, loom's under `--cfg loom`, so the
//! same lock code is model checked.
//!
//! Only the fields that take part in a wait/kick handshake use these; statistics counters use
//! `core` atomics always (they are not part of any protocol, and keeping them out of loom keeps
//! its state space small).

#[cfg(all(not(loom), not(target_arch = "x86_64")))]
use core::sync::atomic::fence;
#[cfg(not(loom))]
pub use core::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// One iteration of a spin-wait loop (PAUSE on x86; a yield point under loom).
#[inline(always)]
pub(crate) fn spin_loop() {
    #[cfg(not(loom))]
    core::hint::spin_loop();
    #[cfg(loom)]
    loom::hint::spin_loop();
}

/// A full (SeqCst) fence: the store-load barrier of the halt/kick handshake.
///
/// On x86-64 outside loom it is a locked OR of 0 into the word at the stack pointer (Linux's
/// `smp_mb()` on x86 is the same kind of instruction), not `fence(SeqCst)`, which LLVM lowers
/// to MFENCE when SSE2 is enabled: guests on these machines run every instruction through
/// KVM's emulator, which does not handle every SSE2 instruction.
#[inline(always)]
pub(crate) fn full_fence() {
    #[cfg(loom)]
    fence(Ordering::SeqCst);
    #[cfg(all(not(loom), target_arch = "x86_64"))]
    // SAFETY: the locked OR of 0 leaves the stack word unchanged; a locked instruction is a full
    // memory barrier on x86, and asm without `nomem` is a compiler barrier, so this orders every
    // earlier memory access before every later one, as `fence(SeqCst)` does.
    unsafe {
        core::arch::asm!("lock or dword ptr [rsp], 0");
    }
    #[cfg(all(not(loom), not(target_arch = "x86_64")))]
    fence(Ordering::SeqCst);
}
