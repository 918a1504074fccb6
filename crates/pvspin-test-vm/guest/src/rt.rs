//! What a freestanding binary must provide itself: the memory routines the compiler calls, a
//! panic handler, and the personality symbol the precompiled `core` refers to.

use core::arch::asm;

use pvspin_test_vm_proto::status;

/// `rep movsb` cannot call back into `memcpy`, unlike a Rust loop the compiler may turn into one.
#[no_mangle]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees both ranges are valid for `n` bytes and do not overlap.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dest => _, inout("rsi") src => _,
             options(nostack, preserves_flags));
    }
    dest
}

/// Copies backwards when the destination starts inside the source.
#[no_mangle]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize) <= (src as usize) || (dest as usize) >= (src as usize).wrapping_add(n) {
        // SAFETY: forward copy is correct when dest does not start inside src.
        return unsafe { memcpy(dest, src, n) };
    }
    // SAFETY: the caller guarantees both ranges are valid; with DF set, rep movsb copies from
    // the last byte down, which is correct for this overlap; DF is cleared again.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dest.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack));
    }
    dest
}

/// Fills `n` bytes with `value`.
#[no_mangle]
pub unsafe extern "C" fn memset(dest: *mut u8, value: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range is valid for `n` bytes.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dest => _, in("al") value as u8,
             options(nostack, preserves_flags));
    }
    dest
}

/// Compares `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: the caller guarantees both ranges are valid for `n` bytes.
        let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// `memcmp` when only equality matters.
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}

/// The precompiled `core` references this even with `panic = "abort"`; it is never called.
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // No formatting: core::fmt uses SSE. Report a distinct status and stop.
    crate::exit(status::PANIC)
}
