//! Serial console output, serialized across vCPUs by a spinlock.
//!
//! Numbers are printed with our own decimal routine: `core::fmt`'s integer formatting is
//! precompiled with SSE2, which KVM's emulator rejects.

use pvspin_guest::{SpinMutex, TasLock};
use pvspin_vmm_proto::SERIAL_PORT;

use crate::arch::outb;

static CONSOLE: SpinMutex<TasLock, ()> = SpinMutex::new(());

/// Builds one line and prints it atomically with respect to other vCPUs.
pub struct Line {
    buf: [u8; 160],
    len: usize,
}

impl Line {
    /// An empty line.
    pub const fn new() -> Self {
        Self {
            buf: [0; 160],
            len: 0,
        }
    }

    /// Appends one byte (dropped past the buffer's end).
    pub fn byte(mut self, byte: u8) -> Self {
        // `get_mut`, not indexing: a bounds-check panic would drag `core::fmt` (SSE) in.
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
        self
    }

    /// Appends text.
    pub fn text(self, text: &str) -> Self {
        text.bytes().fold(self, Self::byte)
    }

    /// Appends a number in decimal.
    pub fn num(self, mut value: u64) -> Self {
        let mut digits = [0u8; 20];
        let mut count = 0;
        for digit in digits.iter_mut() {
            *digit = b'0' + (value % 10) as u8;
            count += 1;
            value /= 10;
            if value == 0 {
                break;
            }
        }
        digits.iter().take(count).rev().copied().fold(self, Self::byte)
    }

    /// Prints the line and a newline.
    pub fn print(self) {
        let _guard = CONSOLE.lock();
        for &byte in self.buf.iter().take(self.len) {
            outb(SERIAL_PORT, byte);
        }
        outb(SERIAL_PORT, b'\n');
    }
}
