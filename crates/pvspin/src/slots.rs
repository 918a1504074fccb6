//! Run slots inside the embedding API: the policy (`pvspin_hints::slots`) driven from the
//! hooks, with the guest's critical sections read from its hint page and forced exits
//! through the VMM's interrupter.

use std::sync::Arc;

use pvspin_hints::slots::{EnterOutcome, RunSlots, SlotConfig, SlotSignals, SlotStats};

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

/// The run slots of one VM.
#[derive(Debug)]
pub(crate) struct SlotState {
    pub(crate) slots: RunSlots,
    signals: Signals,
}

impl SlotState {
    pub(crate) fn new(
        vcpus: usize,
        cfg: SlotConfig,
        hints: Option<Arc<HintState>>,
        interrupter: Arc<dyn VcpuInterrupter>,
    ) -> Result<Self, pvspin_hints::SlotError> {
        Ok(Self {
            slots: RunSlots::new(vcpus, cfg)?,
            signals: Signals {
                hints,
                kick: std::sync::OnceLock::new(),
                interrupter,
            },
        })
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
        let outcome = self.slots.enter(v, &self.signals);
        if let Some(page) = page {
            page.set_not_running(false);
        }
        outcome
    }

    pub(crate) fn exited(&self, v: usize) {
        self.slots.exited(v, &self.signals);
    }

    pub(crate) fn stats(&self) -> SlotStats {
        self.slots.stats()
    }
}
