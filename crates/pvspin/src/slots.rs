//! Run slots inside the embedding API: the policy (`pvspin_slots`) driven from the hooks, with
//! the guest's critical sections read from its hint page, forced exits through the VMM's
//! interrupter and, on the in-kernel and signal-msi paths, halts inside KVM seen through KVM's
//! per-vCPU `blocking` statistic by the halt watcher.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;
use pvspin_hints::GuestPageMap;
use pvspin_kvm::stats::{StatValue, StatsFd};
use pvspin_slots::steal::MSR_KVM_STEAL_TIME;
use pvspin_slots::{
    EnterOutcome, HaltProbe, HaltWatcher, RunSlots, SlotConfig, SlotSignals, SlotStats,
    StealTimeMarks, WatchStats,
};

use crate::hints::HintState;
use crate::kick::KickState;
use crate::VcpuInterrupter;

/// The KVM statistic that says a vCPU blocks in KVM's halt (an instant boolean).
pub(crate) const BLOCKING_STAT: &str = "blocking";

/// What the policy asks of the VM.
#[derive(Debug)]
struct Signals {
    hints: Option<Arc<HintState>>,
    kick: OnceLock<Arc<KickState>>,
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

/// Per vCPU, KVM's `blocking` statistic, opened at `configure_vcpu`.
#[derive(Debug)]
struct KvmBlocking(Vec<OnceLock<StatValue>>);

impl HaltProbe for KvmBlocking {
    fn halted(&self, v: usize) -> Option<bool> {
        self.0.get(v)?.get()?.read().ok().map(|b| b != 0)
    }
}

/// The run slots of one VM.
#[derive(Debug)]
pub(crate) struct SlotState {
    pub(crate) slots: Arc<RunSlots>,
    signals: Arc<Signals>,
    marks: StealTimeMarks,
    /// On the MSI paths: what the halt watcher reads.
    blocking: Option<Arc<KvmBlocking>>,
    watcher: Mutex<Option<HaltWatcher>>,
    /// The watcher's counters when it stopped.
    watch_final: Mutex<Option<WatchStats>>,
}

impl SlotState {
    /// `halts_in_kvm`: the VM's halts stay inside KVM (in-kernel LAPIC), so a halt watcher is
    /// started (`start` runs first on its thread).
    pub(crate) fn new(
        vcpus: usize,
        cfg: SlotConfig,
        hints: Option<Arc<HintState>>,
        memory: Option<Arc<dyn GuestPageMap>>,
        interrupter: Arc<dyn VcpuInterrupter>,
        halts_in_kvm: bool,
        start: Option<pvspin_hints::ThreadStartHook>,
    ) -> Result<Self, crate::ConfigError> {
        let slots = Arc::new(RunSlots::new(vcpus, cfg)?);
        let signals = Arc::new(Signals {
            hints,
            kick: OnceLock::new(),
            interrupter,
        });
        let (blocking, watcher) = if halts_in_kvm {
            let blocking = Arc::new(KvmBlocking((0..vcpus).map(|_| OnceLock::new()).collect()));
            let watcher =
                HaltWatcher::spawn(slots.clone(), blocking.clone(), signals.clone(), start)?;
            (Some(blocking), Some(watcher))
        } else {
            (None, None)
        };
        Ok(Self {
            slots,
            signals,
            marks: StealTimeMarks::new(vcpus, memory),
            blocking,
            watcher: Mutex::new(watcher),
            watch_final: Mutex::new(None),
        })
    }

    /// On the MSI paths, opens vCPU `v`'s `blocking` statistic for the halt watcher; refused,
    /// naming the rule, where KVM has none.
    pub(crate) fn open_vcpu(&self, v: usize, vcpu: &VcpuFd) -> Result<(), crate::ConfigError> {
        let Some(blocking) = &self.blocking else {
            return Ok(());
        };
        let no_stat = || crate::ConfigError::RunSlotsNeedBlockingStat;
        let fd = StatsFd::for_vcpu(vcpu).map_err(|_| no_stat())?;
        let reader = fd
            .value_reader(BLOCKING_STAT)
            .ok_or_else(no_stat)?
            .map_err(|_| no_stat())?;
        if let Some(cell) = blocking.0.get(v) {
            let _ = cell.set(reader);
        }
        Ok(())
    }

    /// Where vCPU `v`'s steal-time area is (`None`: it has none).
    pub(crate) fn set_steal_time_gpa(&self, v: usize, gpa: Option<u64>) {
        self.marks.set_gpa(v, gpa);
    }

    /// After a run that cost `v` its slot (the caller knows it will wait): learns its
    /// steal-time area from `MSR_KVM_STEAL_TIME` (paced by [`StealTimeMarks::wants_msr`]),
    /// so that the wait can be shown to the guest.
    pub(crate) fn learn_steal_time(&self, v: usize, vcpu: &VcpuFd) {
        if !self.marks.wants_msr(v) {
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
            self.marks.learn_from_msr(v, msrs.as_slice()[0].data);
        }
    }

    /// Waits shown through the steal-time `preempted` byte.
    pub(crate) fn steal_time_marks(&self) -> u64 {
        self.marks.marks()
    }

    pub(crate) fn set_kick(&self, kick: Arc<KickState>) {
        let _ = self.signals.kick.set(kick);
    }

    /// Before `KVM_RUN`: waits for a slot, showing the guest meanwhile (hint page
    /// `NOT_RUNNING`, steal-time `preempted`) that this vCPU does not run.
    pub(crate) fn enter(&self, v: usize) -> EnterOutcome {
        let since = self.slots.now_ns();
        if let Some(outcome) = self.slots.try_enter(v, since, &*self.signals) {
            return outcome;
        }
        let page = self.signals.hints.as_ref().and_then(|h| h.pages.get(v));
        if let Some(page) = page {
            page.set_not_running(true);
        }
        self.marks.mark_preempted(v);
        let outcome = self.slots.enter(v, &*self.signals);
        if let Some(page) = page {
            page.set_not_running(false);
        }
        outcome
    }

    /// After `KVM_RUN`: gives the slot up when due; returns whether `v` still holds it.
    pub(crate) fn exited(&self, v: usize) -> bool {
        self.slots.exited(v, &*self.signals)
    }

    pub(crate) fn stats(&self) -> SlotStats {
        self.slots.stats()
    }

    /// The halt watcher's counters, on the MSI paths.
    pub(crate) fn watch_stats(&self) -> Option<WatchStats> {
        let running = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(HaltWatcher::stats);
        running.or(*self
            .watch_final
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Stops the halt watcher (at shutdown; the slots stop it too), keeping its counters.
    pub(crate) fn stop_watcher(&self) {
        let watcher = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(watcher) = watcher {
            *self
                .watch_final
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(watcher.stats());
        }
    }
}
