//! Hint pages and time budgets inside the embedding API (ABI 0.3): the per-VM state the hooks
//! share, and what the hooks do with SHARED_PAGE registrations, WAIT commands and the
//! guest's wait reports.
//!
//! Per exit of vCPU `v` with a registered page: the guest's report of its last wait
//! (`LAST_WAIT_TSC`, taken once) adapts `v`'s wait budget, and a changed budget is published
//! back to the page in TSC cycles (`pvspin_hints::PageBudgets`, the code `pvspind` runs too).
//! Nothing here adds an ioctl or an exit: the page is read and written in place.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pvspin_hints::{GuestPageMap, HintPages, PageBudgets, RegisterError};
use pvspin_yield::BudgetConfig;

use crate::ConfigError;

/// How the embedding VMM configures hint pages ([`crate::PvSpinBuilder::hint_pages`]).
#[derive(Debug, Clone)]
pub struct HintOptions {
    /// How pvspin reaches guest pages: usually the VMM's `vm_memory::GuestMemoryMmap`.
    pub memory: Arc<dyn GuestPageMap>,
    /// The budgets published to each page, and their adaptation; with run slots on the
    /// userspace path and more vCPUs than slots, [`BudgetConfig::for_run_slots`] of them.
    pub budgets: BudgetConfig,
}

/// How the embedding VMM configures the WAIT command ([`crate::PvSpinBuilder::pv_wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitOptions {
    /// Userspace kick path: the longest one WAIT parks the vCPU thread (a timeout is a
    /// spurious wake-up for the guest, which re-checks and waits again). On the in-kernel and
    /// signal-msi paths a WAIT is KVM's own halt (`KVM_MP_STATE_HALTED`), which a kick, any
    /// interrupt the guest accepts, or the VMM's interrupt (signal and `immediate_exit`) ends.
    pub timeout: Duration,
}

impl Default for WaitOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(50),
        }
    }
}

/// Counters of hint pages and WAIT, over all vCPUs (part of [`crate::PvSpin::telemetry`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HintStats {
    /// SHARED_PAGE registrations accepted (unregistrations included).
    pub registrations: u64,
    /// Registrations refused (the frame is not guest RAM): guest input, ignored.
    pub bad_registrations: u64,
    /// Wait reports taken from pages (each adapted a wait budget).
    pub wait_reports: u64,
    /// WAIT commands handled.
    pub waits: u64,
    /// WAITs that ended at once because a kick was already pending: userspace path only
    /// (`None` on the others, where KVM's halt takes a pending kick unseen).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waits_kick_pending: Option<u64>,
    /// WAITs that ended by their timeout: userspace path only (`None` on the others, where
    /// a WAIT has no timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waits_timed_out: Option<u64>,
}

#[derive(Debug, Default)]
struct Counters {
    registrations: AtomicU64,
    bad_registrations: AtomicU64,
    wait_reports: AtomicU64,
    waits: AtomicU64,
    waits_kick_pending: AtomicU64,
    waits_timed_out: AtomicU64,
}

/// The per-VM hint-page state.
#[derive(Debug)]
pub(crate) struct HintState {
    pub(crate) pages: HintPages,
    /// The budgets, and whether spin notifications are on (else the published spin window
    /// is "never").
    pub(crate) budgets: PageBudgets,
    /// The guest TSC frequency, learned from the first vCPU (`KVM_GET_TSC_KHZ`).
    tsc_khz: AtomicU32,
    counters: Counters,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl HintState {
    /// `run_slots`: the VM's vCPUs are gated by run slots on the userspace kick path, whose
    /// budgets have a higher floor ([`BudgetConfig::for_run_slots`]).
    pub(crate) fn new(
        options: &HintOptions,
        vcpus: usize,
        notify: bool,
        run_slots: bool,
    ) -> Result<Self, ConfigError> {
        // The embedder's configuration is checked as given, so an error names its values.
        options.budgets.validate().map_err(ConfigError::HintPages)?;
        let config = if run_slots {
            options.budgets.for_run_slots()
        } else {
            options.budgets
        };
        let budgets = PageBudgets::new(vcpus, config, notify).map_err(ConfigError::HintPages)?;
        Ok(Self {
            pages: HintPages::new(options.memory.clone(), vcpus),
            budgets,
            tsc_khz: AtomicU32::new(0),
            counters: Counters::default(),
        })
    }

    pub(crate) fn set_tsc_khz(&self, khz: u32) {
        let _ = self
            .tsc_khz
            .compare_exchange(0, khz, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub(crate) fn tsc_khz(&self) -> u32 {
        self.tsc_khz.load(Ordering::Relaxed)
    }

    /// SHARED_PAGE from `v`.
    pub(crate) fn register(&self, v: usize, pfn: u32) -> Result<(), RegisterError> {
        match self.pages.register(v, pfn) {
            Ok(page) => {
                bump(&self.counters.registrations);
                if let Some(page) = page {
                    self.budgets.on_register(v, page, self.tsc_khz());
                }
                Ok(())
            }
            Err(e) => {
                bump(&self.counters.bad_registrations);
                Err(e)
            }
        }
    }

    /// At an exit of `v`: takes its wait report, adapts and republishes its budget. Returns
    /// the reported wait in ns, if there was one.
    pub(crate) fn on_exit(&self, v: usize) -> Option<u64> {
        let page = self.pages.get(v)?;
        let ns = self.budgets.on_wait_report(v, page, self.tsc_khz())?;
        bump(&self.counters.wait_reports);
        Some(ns)
    }

    /// A spin notification of `v` was acted on usefully (its target was not running) or not.
    pub(crate) fn on_notification(&self, v: usize, useful: bool) {
        self.budgets
            .on_notification(v, useful, self.pages.get(v), self.tsc_khz());
    }

    pub(crate) fn note_wait(&self, kick_pending: bool, timed_out: bool) {
        bump(&self.counters.waits);
        if kick_pending {
            bump(&self.counters.waits_kick_pending);
        }
        if timed_out {
            bump(&self.counters.waits_timed_out);
        }
    }

    /// The counters; `userspace`: the VM's kick path is the userspace one (the only one
    /// that sees how a WAIT ends).
    pub(crate) fn stats(&self, userspace: bool) -> HintStats {
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HintStats {
            registrations: ld(&c.registrations),
            bad_registrations: ld(&c.bad_registrations),
            wait_reports: ld(&c.wait_reports),
            waits: ld(&c.waits),
            waits_kick_pending: userspace.then(|| ld(&c.waits_kick_pending)),
            waits_timed_out: userspace.then(|| ld(&c.waits_timed_out)),
        }
    }

    /// vCPU `v`'s budgets now.
    pub(crate) fn budgets(&self, v: usize) -> crate::telemetry::Budgets {
        let b = self.budgets.budgets();
        crate::telemetry::Budgets {
            wait_after_ns: b.wait_after_ns(v),
            notify_after_ns: self.budgets.notify().then(|| b.notify_after_ns(v)),
        }
    }
}
