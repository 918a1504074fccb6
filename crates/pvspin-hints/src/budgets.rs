//! The host side of ABI 0.3's time budgets: adapting each vCPU's budgets from what the guest
//! reports in its hint page, and publishing them there. One implementation for both hosts:
//! the in-process one (`pvspin`, which takes wait reports at the vCPU's exits) and the
//! out-of-process one (`pvspind`, which takes them when it delivers a kick to the vCPU, when
//! the vCPU notifies, and at each of its scheduler samples).
//!
//! The rules are `pvspin_yield::SpinBudgets`' (KVM's halt-polling rule for the wait budget,
//! its PLE rule for the notification window); this module converts between the guest's TSC
//! cycles and nanoseconds and writes the host line in the ABI's order (fields, then
//! `HOST_SEQ` with release ordering).
//!
//! A guest whose TSC frequency is unknown (0 kHz) gets no time budgets: spin window
//! `u64::MAX` (never notify), wait budget and bounds 0, and its wait reports are taken (so each
//! is counted once) but adapt nothing.

use pvspin_yield::{ns_to_tsc, tsc_to_ns, BudgetConfig, BudgetError, SpinBudgets};

use crate::page::HintPage;

/// Per-vCPU budgets of one VM as the host publishes them in hint pages.
#[derive(Debug)]
pub struct PageBudgets {
    budgets: SpinBudgets,
    notify: bool,
}

/// What the host line of a page says, in TSC cycles (what [`PageBudgets::publish`] writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TscBudgets {
    /// `SPIN_WINDOW_TSC`: spin before a notification (`u64::MAX`: never notify).
    pub spin_window: u64,
    /// `WAIT_AFTER_TSC`: spin before waiting.
    pub wait_after: u64,
    /// `WAIT_AFTER_MIN_TSC`.
    pub wait_after_min: u64,
    /// `WAIT_AFTER_MAX_TSC`.
    pub wait_after_max: u64,
}

impl PageBudgets {
    /// Budgets for `vcpus` vCPUs at their start values. `notify`: whether the host acts on spin
    /// notifications (directed yield); without it the published window is `u64::MAX`, so guests
    /// never notify.
    pub fn new(vcpus: usize, cfg: BudgetConfig, notify: bool) -> Result<Self, BudgetError> {
        Ok(Self {
            budgets: SpinBudgets::new(vcpus, cfg)?,
            notify,
        })
    }

    /// The budgets, in nanoseconds.
    pub fn budgets(&self) -> &SpinBudgets {
        &self.budgets
    }

    /// Whether spin notifications are on.
    pub fn notify(&self) -> bool {
        self.notify
    }

    /// The configuration.
    pub fn config(&self) -> BudgetConfig {
        self.budgets.config()
    }

    /// `v`'s budgets in cycles of a `tsc_khz` guest TSC.
    pub fn tsc(&self, v: usize, tsc_khz: u32) -> TscBudgets {
        if tsc_khz == 0 {
            return TscBudgets {
                spin_window: u64::MAX,
                wait_after: 0,
                wait_after_min: 0,
                wait_after_max: 0,
            };
        }
        let cfg = self.budgets.config();
        TscBudgets {
            spin_window: if self.notify {
                ns_to_tsc(self.budgets.notify_after_ns(v), tsc_khz).max(1)
            } else {
                u64::MAX
            },
            wait_after: ns_to_tsc(self.budgets.wait_after_ns(v), tsc_khz),
            wait_after_min: ns_to_tsc(cfg.wait_after_min_ns, tsc_khz),
            wait_after_max: ns_to_tsc(cfg.wait_after_max_ns, tsc_khz),
        }
    }

    /// Writes `v`'s budgets and the TSC frequency to `page`, then bumps `HOST_SEQ`.
    pub fn publish(&self, v: usize, page: HintPage, tsc_khz: u32) {
        let b = self.tsc(v, tsc_khz);
        page.publish_budgets(b.spin_window, b.wait_after, tsc_khz);
    }

    /// `v` registered `page`: writes the wait budget's bounds and `v`'s budgets.
    pub fn on_register(&self, v: usize, page: HintPage, tsc_khz: u32) {
        let b = self.tsc(v, tsc_khz);
        page.publish_wait_bounds(b.wait_after_min, b.wait_after_max);
        page.publish_budgets(b.spin_window, b.wait_after, tsc_khz);
    }

    /// Takes `v`'s wait report from `page`, if there is one: adapts `v`'s wait budget and
    /// republishes it when it changed. Returns the reported wait in ns (`None`: no report, or
    /// no known frequency).
    pub fn on_wait_report(&self, v: usize, page: HintPage, tsc_khz: u32) -> Option<u64> {
        let cycles = page.take_last_wait()?;
        if tsc_khz == 0 {
            return None;
        }
        let ns = tsc_to_ns(cycles, tsc_khz);
        let before = self.budgets.wait_after_ns(v);
        if self.budgets.on_wait(v, ns) != before {
            self.publish(v, page, tsc_khz);
        }
        Some(ns)
    }

    /// A spin notification of `v` was `useful` (its target was not running) or not: adapts
    /// `v`'s notification window and republishes it to `page` when it changed. Returns the
    /// window in ns.
    pub fn on_notification(
        &self,
        v: usize,
        useful: bool,
        page: Option<HintPage>,
        tsc_khz: u32,
    ) -> u64 {
        let before = self.budgets.notify_after_ns(v);
        let after = self.budgets.on_notification(v, useful);
        if after != before {
            if let Some(page) = page {
                self.publish(v, page, tsc_khz);
            }
        }
        after
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use pvspin_abi::hint;

    use super::*;
    use crate::page::{BufferPageMap, HintPages};

    const KHZ: u32 = 1_000_000; // 1 GHz: cycles == ns

    fn rig(notify: bool) -> (Arc<BufferPageMap>, HintPages, PageBudgets) {
        let map = Arc::new(BufferPageMap::new(3));
        let pages = HintPages::new(map.clone(), 2);
        let b = PageBudgets::new(2, BudgetConfig::default(), notify).unwrap();
        (map, pages, b)
    }

    fn host_seq(map: &BufferPageMap, page_gpa: usize) -> u32 {
        map.word(page_gpa + hint::HOST_SEQ).load(Ordering::Relaxed) as u32
    }

    #[test]
    fn registration_publishes_bounds_and_budgets() {
        let (map, pages, b) = rig(true);
        let page = pages.register(1, 1).unwrap().unwrap();
        b.on_register(1, page, KHZ);
        let cfg = BudgetConfig::default();
        assert_eq!(page.budgets(), (cfg.notify_after_ns, cfg.wait_after_ns));
        assert_eq!(
            map.word(0x1000 + hint::WAIT_AFTER_MIN_TSC)
                .load(Ordering::Relaxed),
            cfg.wait_after_min_ns
        );
        assert_eq!(host_seq(&map, 0x1000), 1);
        // Without notifications the window is "never"; without a frequency, no budgets.
        let (_, pages, quiet) = rig(false);
        let page = pages.register(0, 2).unwrap().unwrap();
        quiet.on_register(0, page, KHZ);
        assert_eq!(page.budgets().0, u64::MAX);
        quiet.on_register(0, page, 0);
        assert_eq!(page.budgets(), (u64::MAX, 0));
    }

    #[test]
    fn wait_reports_adapt_and_republish_only_on_change() {
        let (map, pages, b) = rig(true);
        let page = pages.register(0, 1).unwrap().unwrap();
        b.on_register(0, page, KHZ);
        assert_eq!(b.on_wait_report(0, page, KHZ), None, "no report yet");
        map.word(0x1000 + hint::LAST_WAIT_TSC)
            .store(30_000, Ordering::Relaxed);
        assert_eq!(b.on_wait_report(0, page, KHZ), Some(30_000));
        assert_eq!(page.budgets().1, 100_000, "a short wait doubles the budget");
        assert_eq!(host_seq(&map, 0x1000), 2);
        // At the ceiling, short waits change nothing: nothing is published.
        for _ in 0..10 {
            map.word(0x1000 + hint::LAST_WAIT_TSC)
                .store(1, Ordering::Relaxed);
            b.on_wait_report(0, page, KHZ);
        }
        let seq = host_seq(&map, 0x1000);
        map.word(0x1000 + hint::LAST_WAIT_TSC)
            .store(1, Ordering::Relaxed);
        b.on_wait_report(0, page, KHZ);
        assert_eq!(host_seq(&map, 0x1000), seq);
        // A report without a known frequency is taken and adapts nothing.
        map.word(0x1000 + hint::LAST_WAIT_TSC)
            .store(u64::MAX, Ordering::Relaxed);
        assert_eq!(b.on_wait_report(0, page, 0), None);
        assert_eq!(page.take_last_wait(), None);
        assert_eq!(b.budgets().wait_after_ns(0), 1_000_000);
    }

    #[test]
    fn useless_notifications_widen_the_published_window() {
        let (_, pages, b) = rig(true);
        let page = pages.register(0, 1).unwrap().unwrap();
        b.on_register(0, page, KHZ);
        assert_eq!(b.on_notification(0, false, Some(page), KHZ), 200_000);
        assert_eq!(page.budgets().0, 200_000);
        assert_eq!(b.on_notification(0, true, Some(page), KHZ), 100_000);
        assert_eq!(page.budgets().0, 100_000);
        // No page: the budget still adapts.
        assert_eq!(b.on_notification(1, false, None, KHZ), 200_000);
    }
}
