//! Serial console output, serialized across vCPUs by a spinlock.
//!
//! Numbers are printed with our own decimal routine: `core::fmt`'s integer formatting is
//! precompiled with SSE2, which KVM's emulator rejects.

use pvspin_guest::{SpinMutex, TasLock};
use pvspin_test_vm_proto::SERIAL_PORT;

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

    /// Appends a number in hexadecimal, `0x`-prefixed.
    pub fn hex(self, value: u64) -> Self {
        let mut line = self.text("0x");
        let mut started = false;
        for shift in (0..16).rev() {
            let digit = ((value >> (shift * 4)) & 0xf) as u8;
            if digit != 0 || started || shift == 0 {
                started = true;
                line = line.byte(if digit < 10 { b'0' + digit } else { b'a' + digit - 10 });
            }
        }
        line
    }

    /// Prints the line and a newline.
    pub fn print(self) {
        let _guard = CONSOLE.lock();
        self.print_unlocked();
    }

    /// Prints the line, taking the console lock if it comes within a bounded wait: for the
    /// exception handler and the end of the run, which may follow a vCPU that faulted while
    /// holding the lock (its own, or another's).
    pub fn print_bounded(self) {
        for _ in 0..100_000 {
            if let Some(_guard) = CONSOLE.try_lock() {
                self.print_unlocked();
                return;
            }
            core::hint::spin_loop();
        }
        self.print_unlocked();
    }

    fn print_unlocked(self) {
        for &byte in self.buf.iter().take(self.len) {
            outb(SERIAL_PORT, byte);
        }
        outb(SERIAL_PORT, b'\n');
    }
}

/// Output longer than a [`Line`] (the JSON result line), written as it is built, under the
/// console lock.
pub struct Stream {
    _guard: pvspin_guest::SpinMutexGuard<'static, TasLock, ()>,
}

impl Stream {
    /// Takes the console.
    pub fn new() -> Self {
        Self {
            _guard: CONSOLE.lock(),
        }
    }

    /// Writes text.
    pub fn text(&mut self, text: &str) -> &mut Self {
        for byte in text.bytes() {
            outb(SERIAL_PORT, byte);
        }
        self
    }

    /// Writes a number in decimal.
    pub fn num(&mut self, value: u64) -> &mut Self {
        let mut digits = [0u8; 20];
        let mut count = 0;
        let mut rest = value;
        for digit in digits.iter_mut() {
            *digit = b'0' + (rest % 10) as u8;
            count += 1;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        for &digit in digits.iter().take(count).rev() {
            outb(SERIAL_PORT, digit);
        }
        self
    }

    /// Writes `numerator / denominator` as a decimal with 9 fractional digits (integers
    /// only: the guest has no floats).
    pub fn ratio(&mut self, numerator: u64, denominator: u64) -> &mut Self {
        if denominator == 0 {
            return self.text("0.0");
        }
        let whole = numerator / denominator;
        let fraction = (u128::from(numerator % denominator) * 1_000_000_000
            / u128::from(denominator)) as u64;
        self.num(whole).text(".");
        let mut scale = 100_000_000;
        while scale > 0 {
            outb(SERIAL_PORT, b'0' + ((fraction / scale) % 10) as u8);
            scale /= 10;
        }
        self
    }
}
