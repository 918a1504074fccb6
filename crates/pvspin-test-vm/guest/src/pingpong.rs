//! The ping-pong workload: a token goes around the ring of vCPUs; each handoff is one pv_kick
//! and one pv_wait. A lost wake-up stops the ring (the VMM's watchdog then fails the run).

use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use pvspin_guest::{AtomicU8, PvOps};
use pvspin_test_vm_proto::{BootParams, MAX_PV_VCPUS, MAX_SAMPLES};

use crate::arch::rdtsc;
use crate::pv::PV;

/// `TOKEN[i] == 1`: vCPU `i` holds the token (its pv_wait condition).
static TOKEN: [AtomicU8; MAX_PV_VCPUS as usize] = [const { AtomicU8::new(0) }; MAX_PV_VCPUS as usize];
/// Guest TSC right before the kick that handed vCPU `i` the token.
static KICKED_AT: [AtomicU64; MAX_PV_VCPUS as usize] =
    [const { AtomicU64::new(0) }; MAX_PV_VCPUS as usize];
static HANDOFFS: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU8 = AtomicU8::new(0);
static WAITS: AtomicU64 = AtomicU64::new(0);
static KICKS: AtomicU64 = AtomicU64::new(0);
/// Kick-to-wake latencies (TSC cycles) of waits that halted before their kick came.
pub static SAMPLES: [AtomicU32; MAX_SAMPLES] = [const { AtomicU32::new(0) }; MAX_SAMPLES];
pub static SAMPLE_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Handoffs made so far.
pub fn handoffs() -> u64 {
    HANDOFFS.load(Ordering::Acquire)
}

/// Totals for the report: (waits that halted or tried to, kicks sent).
pub fn totals() -> (u64, u64) {
    (WAITS.load(Ordering::Relaxed), KICKS.load(Ordering::Relaxed))
}

/// A small per-vCPU pseudo-random sequence (xorshift): random delays, no floats.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs this vCPU's part; returns when the ring has made `boot.iterations` handoffs.
pub fn run(vcpu: u32, boot: &BootParams, heartbeat: impl Fn()) {
    let ops = PV.ops();
    let next_index = (vcpu + 1) % boot.vcpus.max(1);
    // `get`, not indexing: a bounds-check panic would drag SSE code (core::fmt) into the image.
    let (Some(my_token), Some(my_stamp), Some(next_token), Some(next_stamp)) = (
        TOKEN.get(vcpu as usize),
        KICKED_AT.get(vcpu as usize),
        TOKEN.get(next_index as usize),
        KICKED_AT.get(next_index as usize),
    ) else {
        return;
    };
    let mut random = Random(0x9e37_79b9_7f4a_7c15 ^ ((u64::from(vcpu) + 1) * 0x2545_f491_4f6c_dd1d));
    if vcpu == 0 {
        my_token.store(1, Ordering::Release);
    }
    loop {
        // Wait for the token (or the end).
        let mut halted_since = None;
        let mut woke = 0;
        while my_token.load(Ordering::Acquire) == 0 && DONE.load(Ordering::Acquire) == 0 {
            let started = rdtsc();
            halted_since.get_or_insert(started);
            WAITS.fetch_add(1, Ordering::Relaxed);
            ops.wait(my_token, 0);
            woke = rdtsc();
        }
        if DONE.load(Ordering::Acquire) != 0 {
            return;
        }
        let kicked_at = my_stamp.load(Ordering::Acquire);
        if let Some(since) = halted_since {
            // Only a kick that came after the waiter started waiting measures a wake-up.
            if kicked_at > since && woke > kicked_at {
                let slot = SAMPLE_COUNT.fetch_add(1, Ordering::Relaxed);
                if let Some(sample) = SAMPLES.get(slot) {
                    sample.store(u32::try_from(woke - kicked_at).unwrap_or(u32::MAX), Ordering::Relaxed);
                }
            }
        }
        my_token.store(0, Ordering::Relaxed);
        heartbeat();
        if HANDOFFS.fetch_add(1, Ordering::AcqRel) + 1 >= boot.iterations {
            DONE.store(1, Ordering::Release);
            for target in 0..boot.vcpus {
                if target != vcpu {
                    ops.kick(target);
                }
            }
            return;
        }
        // A random delay: short ones kick a vCPU that may not have halted yet (the host
        // must remember the kick), long ones kick a halted one.
        let delay = boot.cs_work + random.next() % boot.ncs_work.saturating_add(1);
        for unit in 0..delay {
            core::hint::black_box(unit);
        }
        next_token.store(1, Ordering::Release);
        // The token store must be visible before the kick (`docs/abi.md`, "`pv_wait(ptr, val)`").
        core::sync::atomic::fence(Ordering::SeqCst);
        KICKS.fetch_add(1, Ordering::Relaxed);
        // Stamped right before the doorbell write, as the C probe does. A waiter that sees
        // the token before this store reads an older stamp and takes no sample; one that
        // halted is woken only by the write below, after the stamp.
        next_stamp.store(rdtsc(), Ordering::Release);
        ops.kick(next_index);
        // And a random delay before waiting: the token may come back before this vCPU halts
        // (with 2 vCPUs the round trip is one wake-up), so its kick must be remembered.
        let delay = random.next() % boot.ncs_work.saturating_add(1);
        for unit in 0..delay {
            core::hint::black_box(unit);
        }
    }
}
