//! Showing a parked vCPU to a stock guest: KVM's steal-time `preempted` byte.
//!
//! A vCPU that waits for a run slot does not run, as if the host had descheduled it. Linux
//! guests read that from the `preempted` byte of the vCPU's steal-time area
//! (`vcpu_is_preempted`: mutex, rwsem and `osq_lock` owner spinning, the scheduler's idle-CPU
//! choice, PV TLB flush; `docs/stock-guests.md`). [`StealTimeMarks`] sets the byte when a vCPU
//! starts to wait; KVM clears it when the vCPU next enters the guest (`record_steal_time`
//! exchanges it for 0), so a stale mark cannot outlive the wait and pvspin never clears it.
//!
//! Where each vCPU's area is comes from `MSR_KVM_STEAL_TIME`, which only the VMM can read (a
//! vCPU ioctl): [`StealTimeMarks::wants_msr`] paces those reads and
//! [`StealTimeMarks::learn_from_msr`] records what one returned.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use pvspin_hints::GuestPageMap;

/// KVM's steal-time MSR (`MSR_KVM_STEAL_TIME`): the area's GPA, bit 0 = enabled.
pub const MSR_KVM_STEAL_TIME: u32 = 0x4b56_4d03;
/// `struct kvm_steal_time`: the `preempted` byte's offset.
const PREEMPTED_OFFSET: u64 = pvspin_track::steal::PREEMPTED_OFFSET as u64;
/// `KVM_VCPU_PREEMPTED`, the bit KVM sets when it deschedules a runnable vCPU (bit 1,
/// `KVM_VCPU_FLUSH_TLB`, is the guest's: it asks KVM to flush at the next entry).
const KVM_VCPU_PREEMPTED: u8 = pvspin_track::steal::KVM_VCPU_PREEMPTED;
/// While a vCPU's steal-time area is unknown, `MSR_KVM_STEAL_TIME` is read at one slot loss in
/// this many: a guest that never enables steal time must not cost an ioctl per exit.
pub const MSR_READ_EVERY: u32 = 64;

/// The steal-time area's GPA in an `MSR_KVM_STEAL_TIME` value, if the guest enabled it
/// (64-byte aligned; bits 1..5 reserved).
pub fn steal_time_gpa(msr: u64) -> Option<u64> {
    (msr & 1 == 1).then_some(msr & !0x3f)
}

/// Per vCPU, where its steal-time area is, and the marks set in it.
pub struct StealTimeMarks {
    /// Guest memory; `None`: nothing is ever marked.
    memory: Option<Arc<dyn GuestPageMap>>,
    /// Per vCPU: its steal-time area's GPA + 1 (0: unknown or none).
    gpa: Vec<AtomicU64>,
    /// Per vCPU: slot losses while its area was unknown (paces the MSR reads).
    misses: Vec<AtomicU32>,
    /// Waits shown to the guest.
    marks: AtomicU64,
}

impl std::fmt::Debug for StealTimeMarks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StealTimeMarks")
            .field("vcpus", &self.gpa.len())
            .field("memory", &self.memory.is_some())
            .field("marks", &self.marks())
            .finish()
    }
}

impl StealTimeMarks {
    /// Marks for `vcpus` vCPUs in `memory` (`None`: marks nothing).
    pub fn new(vcpus: usize, memory: Option<Arc<dyn GuestPageMap>>) -> Self {
        Self {
            memory,
            gpa: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            misses: (0..vcpus).map(|_| AtomicU32::new(0)).collect(),
            marks: AtomicU64::new(0),
        }
    }

    /// Where vCPU `v`'s steal-time area is (`None`: it has none).
    pub fn set_gpa(&self, v: usize, gpa: Option<u64>) {
        if let Some(slot) = self.gpa.get(v) {
            slot.store(gpa.map_or(0, |g| g.saturating_add(1)), Ordering::Relaxed);
        }
    }

    /// Whether the VMM should read vCPU `v`'s `MSR_KVM_STEAL_TIME` now, at a slot loss: at the
    /// first one while the area is unknown, then at one in [`MSR_READ_EVERY`]. Called on `v`'s
    /// own thread only.
    pub fn wants_msr(&self, v: usize) -> bool {
        let (Some(slot), Some(misses)) = (self.gpa.get(v), self.misses.get(v)) else {
            return false;
        };
        if self.memory.is_none() || slot.load(Ordering::Relaxed) != 0 {
            return false;
        }
        // Only this vCPU's thread counts its misses.
        let miss = misses.load(Ordering::Relaxed);
        misses.store(miss.wrapping_add(1), Ordering::Relaxed);
        miss % MSR_READ_EVERY == 0
    }

    /// Records what `MSR_KVM_STEAL_TIME` of vCPU `v` held.
    pub fn learn_from_msr(&self, v: usize, msr: u64) {
        if let Some(gpa) = steal_time_gpa(msr) {
            self.set_gpa(v, Some(gpa));
        }
    }

    /// Shows vCPU `v` preempted: sets `preempted` if it is clear, as KVM does when it
    /// deschedules a runnable vCPU. Leaves the guest's `KVM_VCPU_FLUSH_TLB` request alone.
    pub fn mark_preempted(&self, v: usize) {
        let (Some(memory), Some(slot)) = (&self.memory, self.gpa.get(v)) else {
            return;
        };
        let Some(gpa) = slot.load(Ordering::Relaxed).checked_sub(1) else {
            return;
        };
        let byte = gpa + PREEMPTED_OFFSET;
        let page = byte & !(pvspin_abi::doorbell::SHARED_PAGE_SIZE - 1);
        let Some(base) = memory.host_page(page) else {
            return;
        };
        let offset = usize::try_from(byte - page).unwrap_or(0);
        // SAFETY: `host_page` returned a mapping of the whole 4 KiB page that stays mapped
        // while the map lives (the `GuestPageMap` contract), and `offset` < 4096.
        let ptr = unsafe { base.as_ptr().add(offset) };
        // SAFETY: `ptr` is a valid byte of guest memory (above); the guest and KVM access it
        // with atomic operations too.
        let preempted = unsafe { AtomicU8::from_ptr(ptr) };
        if preempted
            .compare_exchange(0, KVM_VCPU_PREEMPTED, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.marks.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits shown through the `preempted` byte.
    pub fn marks(&self) -> u64 {
        self.marks.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_time_msr_values() {
        assert_eq!(steal_time_gpa(0), None);
        assert_eq!(steal_time_gpa(0x1_2340), None, "not enabled");
        assert_eq!(steal_time_gpa(0x1_2341), Some(0x1_2340));
        assert_eq!(
            steal_time_gpa(0x1_2343),
            Some(0x1_2340),
            "reserved bits ignored"
        );
    }

    #[test]
    fn msr_reads_are_paced_while_the_area_is_unknown() {
        let map = Arc::new(pvspin_hints::BufferPageMap::new(1));
        let marks = StealTimeMarks::new(1, Some(map));
        let reads = (0..2 * MSR_READ_EVERY)
            .filter(|_| marks.wants_msr(0))
            .count();
        assert_eq!(reads, 2);
        marks.learn_from_msr(0, 0x1041);
        assert!(!marks.wants_msr(0), "known: never again");
        assert!(
            !StealTimeMarks::new(1, None).wants_msr(0),
            "no memory: never"
        );
    }

    /// A wait sets `preempted` only if it is clear, and never touches the guest's flush bit.
    #[test]
    fn a_waiting_vcpu_is_marked_preempted_once() {
        let map = Arc::new(pvspin_hints::BufferPageMap::new(2));
        let marks = StealTimeMarks::new(2, Some(map.clone()));
        marks.mark_preempted(1);
        assert_eq!(marks.marks(), 0, "no area known: nothing written");
        marks.set_gpa(1, Some(0x1040));
        let word = || map.word(0x1040 + 16).load(Ordering::Relaxed) as u8;
        marks.mark_preempted(1);
        assert_eq!(word(), KVM_VCPU_PREEMPTED);
        assert_eq!(marks.marks(), 1);
        // KVM cleared it at entry; the guest's PV TLB flush bit alone is left alone.
        map.word(0x1040 + 16).store(2, Ordering::Relaxed);
        marks.mark_preempted(1);
        assert_eq!(word(), 2);
        assert_eq!(marks.marks(), 1);
        marks.set_gpa(1, Some(0x9000));
        marks.mark_preempted(1);
        assert_eq!(marks.marks(), 1, "outside guest memory: ignored");
    }
}
