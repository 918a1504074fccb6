//! Run slots inside the embedding API: the policy (`pvspin_hints::slots`) driven from the
//! hooks, with the guest's critical sections read from its hint page and forced exits
//! through the VMM's interrupter.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;
use pvspin_hints::slots::{EnterOutcome, RunSlots, SlotConfig, SlotSignals, SlotStats};
use pvspin_hints::GuestPageMap;

use crate::hints::HintState;
use crate::kick::KickState;
use crate::VcpuInterrupter;

/// What the policy asks of the VM.
#[derive(Debug)]
struct Signals {
    hints: Option<Arc<HintState>>,
    kick: std::sync::OnceLock<Arc<KickState>>,
    interrupter: Arc<dyn VcpuInterrupter>,
}

impl SlotSignals for Signals {
    fn in_critical_section(&self, v: usize) -> bool {
        self.hints
            .as_ref()
            .and_then(|h| h.pages.get(v))
            .is_some_and(|page| page.guest_hints().cs_depth > 0)
    }

    fn preempt(&self, v: usize) {
        if let Some(kick) = self.kick.get() {
            kick.device.interrupt(u32::try_from(v).unwrap_or(u32::MAX));
        }
        self.interrupter.interrupt(v);
    }
}

/// KVM's steal-time MSR (`MSR_KVM_STEAL_TIME`): the area's GPA, bit 0 = enabled.
const MSR_KVM_STEAL_TIME: u32 = 0x4b56_4d03;
/// `struct kvm_steal_time`: the `preempted` byte's offset.
const STEAL_TIME_PREEMPTED: u64 = pvspin_track::steal::PREEMPTED_OFFSET as u64;
/// `KVM_VCPU_PREEMPTED`, the bit KVM sets when it deschedules a runnable vCPU (bit 1,
/// `KVM_VCPU_FLUSH_TLB`, is the guest's: it asks KVM to flush at the next entry).
const KVM_VCPU_PREEMPTED: u8 = pvspin_track::steal::KVM_VCPU_PREEMPTED;
/// While a vCPU's steal-time area is unknown, `MSR_KVM_STEAL_TIME` is read at one slot loss in
/// this many: a guest that never enables steal time must not cost an ioctl per exit.
const STEAL_TIME_READ_EVERY: u32 = 64;

/// The steal-time area's GPA in an `MSR_KVM_STEAL_TIME` value, if the guest enabled it
/// (64-byte aligned; bits 1..5 reserved).
pub(crate) fn steal_time_gpa(msr: u64) -> Option<u64> {
    (msr & 1 == 1).then_some(msr & !0x3f)
}

/// The run slots of one VM.
#[derive(Debug)]
pub(crate) struct SlotState {
    pub(crate) slots: RunSlots,
    signals: Signals,
    /// Guest memory (the hint pages' map), to show a waiting vCPU as preempted in its KVM
    /// steal-time area.
    memory: Option<Arc<dyn GuestPageMap>>,
    /// Per vCPU: its steal-time area's GPA + 1 (0: unknown or none).
    steal_time: Vec<AtomicU64>,
    /// Per vCPU: slot losses while its steal-time area was unknown (paces the MSR reads).
    steal_time_misses: Vec<AtomicU32>,
    /// Waits shown to the guest through the steal-time `preempted` byte.
    marks: AtomicU64,
}

impl SlotState {
    pub(crate) fn new(
        vcpus: usize,
        cfg: SlotConfig,
        hints: Option<Arc<HintState>>,
        memory: Option<Arc<dyn GuestPageMap>>,
        interrupter: Arc<dyn VcpuInterrupter>,
    ) -> Result<Self, pvspin_hints::SlotError> {
        Ok(Self {
            slots: RunSlots::new(vcpus, cfg)?,
            signals: Signals {
                hints,
                kick: std::sync::OnceLock::new(),
                interrupter,
            },
            memory,
            steal_time: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            steal_time_misses: (0..vcpus).map(|_| AtomicU32::new(0)).collect(),
            marks: AtomicU64::new(0),
        })
    }

    /// Where vCPU `v`'s steal-time area is (`None`: it has none).
    pub(crate) fn set_steal_time_gpa(&self, v: usize, gpa: Option<u64>) {
        if let Some(slot) = self.steal_time.get(v) {
            slot.store(gpa.map_or(0, |g| g.saturating_add(1)), Ordering::Relaxed);
        }
    }

    /// After a run that cost `v` its slot (the caller knows it will wait): learns its
    /// steal-time area from `MSR_KVM_STEAL_TIME`, so that the wait can be shown to the guest.
    /// One `KVM_GET_MSRS` while the area is unknown, then one in every
    /// [`STEAL_TIME_READ_EVERY`] losses until the guest enables it.
    pub(crate) fn learn_steal_time(&self, v: usize, vcpu: &VcpuFd) {
        let (Some(slot), Some(misses)) = (self.steal_time.get(v), self.steal_time_misses.get(v))
        else {
            return;
        };
        if self.memory.is_none() || slot.load(Ordering::Relaxed) != 0 {
            return;
        }
        // Only this vCPU's thread counts its misses.
        let miss = misses.load(Ordering::Relaxed);
        misses.store(miss.wrapping_add(1), Ordering::Relaxed);
        if miss % STEAL_TIME_READ_EVERY != 0 {
            return;
        }
        let entry = kvm_msr_entry {
            index: MSR_KVM_STEAL_TIME,
            ..Default::default()
        };
        let Ok(mut msrs) = Msrs::from_entries(&[entry]) else {
            return;
        };
        if vcpu.get_msrs(&mut msrs) == Ok(1) {
            if let Some(gpa) = steal_time_gpa(msrs.as_slice()[0].data) {
                slot.store(gpa.saturating_add(1), Ordering::Relaxed);
            }
        }
    }

    /// Shows vCPU `v` preempted to a guest that registered steal time: sets `preempted` if
    /// it is clear (the guest's own `vcpu_is_preempted`, as when KVM deschedules a runnable
    /// vCPU). KVM clears the byte when the vCPU next enters the guest (`record_steal_time`
    /// exchanges it for 0 and honours a `KVM_VCPU_FLUSH_TLB` the guest added meanwhile), so
    /// pvspin never clears it itself: a stale mark cannot outlive the wait.
    fn mark_preempted(&self, v: usize) {
        let (Some(memory), Some(slot)) = (&self.memory, self.steal_time.get(v)) else {
            return;
        };
        let Some(gpa) = slot.load(Ordering::Relaxed).checked_sub(1) else {
            return;
        };
        let byte = gpa + STEAL_TIME_PREEMPTED;
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

    /// Waits shown through the steal-time `preempted` byte.
    pub(crate) fn steal_time_marks(&self) -> u64 {
        self.marks.load(Ordering::Relaxed)
    }

    pub(crate) fn set_kick(&self, kick: Arc<KickState>) {
        let _ = self.signals.kick.set(kick);
    }

    /// Before `KVM_RUN`: waits for a slot, showing the guest meanwhile (hint page
    /// `NOT_RUNNING`) that this vCPU does not run.
    pub(crate) fn enter(&self, v: usize) -> EnterOutcome {
        let since = self.slots.now_ns();
        if let Some(outcome) = self.slots.try_enter(v, since, &self.signals) {
            return outcome;
        }
        let page = self.signals.hints.as_ref().and_then(|h| h.pages.get(v));
        if let Some(page) = page {
            page.set_not_running(true);
        }
        self.mark_preempted(v);
        let outcome = self.slots.enter(v, &self.signals);
        if let Some(page) = page {
            page.set_not_running(false);
        }
        outcome
    }

    /// After `KVM_RUN`: gives the slot up when due; returns whether `v` still holds it.
    pub(crate) fn exited(&self, v: usize) -> bool {
        self.slots.exited(v, &self.signals)
    }

    pub(crate) fn stats(&self) -> SlotStats {
        self.slots.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct NoInterrupter;
    impl VcpuInterrupter for NoInterrupter {
        fn interrupt(&self, _: usize) {}
    }

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

    /// A wait sets `preempted` only if it is clear, and never touches the guest's flush bit.
    #[test]
    fn a_waiting_vcpu_is_marked_preempted_once() {
        let map = Arc::new(pvspin_hints::BufferPageMap::new(2));
        let state = SlotState::new(
            2,
            SlotConfig::new(1),
            None,
            Some(map.clone()),
            Arc::new(NoInterrupter),
        )
        .unwrap();
        state.mark_preempted(1);
        assert_eq!(
            state.steal_time_marks(),
            0,
            "no area known: nothing written"
        );
        state.set_steal_time_gpa(1, Some(0x1040));
        let word = || map.word(0x1040 + 16).load(Ordering::Relaxed) as u8;
        state.mark_preempted(1);
        assert_eq!(word(), KVM_VCPU_PREEMPTED);
        assert_eq!(state.steal_time_marks(), 1);
        // KVM cleared it at entry; the guest's PV TLB flush bit alone is left alone.
        map.word(0x1040 + 16).store(2, Ordering::Relaxed);
        state.mark_preempted(1);
        assert_eq!(word(), 2);
        assert_eq!(state.steal_time_marks(), 1);
        state.set_steal_time_gpa(1, Some(0x9000));
        state.mark_preempted(1);
        assert_eq!(state.steal_time_marks(), 1, "outside guest memory: ignored");
    }
}
