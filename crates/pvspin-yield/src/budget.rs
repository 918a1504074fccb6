//! Time budgets (ABI 0.3): how long a waiter spins before it waits, and before it sends a
//! spin notification, per vCPU, in nanoseconds (the host publishes them to the guest's hint
//! page in TSC cycles).
//!
//! Spin counts do not transfer between hosts or privilege levels: one spin is about 30 ns of
//! native guest code and a few microseconds of emulated guest kernel code on the development
//! machines, so 0.2's window of 16 spins was well under a microsecond at native speed and
//! every brief wait became an exit. Budgets in time mean the same thing everywhere.
//!
//! **Spin before waiting** adapts like KVM's halt polling (`kvm-pv-reference.md`), from how
//! long each wait lasted: a wait that the ceiling would have covered ended by a kick soon
//! enough that spinning through it costs less than the exit and the wake-up, so the budget
//! doubles (up to the ceiling); a longer wait means the waited-for vCPU was not running (the
//! holder was preempted), where waiting earlier saves CPU for it, so the budget halves (down
//! to the floor). On an idle host waits are rare and short, the budget climbs to its ceiling
//! and waiters stop leaving their spin; under overcommit waits last host time slices and
//! waiters give their CPU up early.
//!
//! **Spin before notifying** adapts like KVM's PLE window, from whether the notification
//! helped: one that found its target not running (preempted, parked, halted) and acted resets
//! the window to its base; any other doubles it (up to the ceiling), so a spinner whose
//! notifications lead nowhere notifies less and less. Unlike 0.2's windows, the spinner's own
//! deschedule (which the actuator's yield itself causes) is not taken as proof that
//! notifying helped.

use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

/// Invalid budget configuration; each names the rule.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy, displaydoc::Display)]
pub enum BudgetError {
    /// rule: wait budget needs 1 <= min ({min} ns) <= start ({start} ns) <= max ({max} ns)
    WaitRange {
        /// Floor.
        min: u64,
        /// Start.
        start: u64,
        /// Ceiling.
        max: u64,
    },
    /// rule: notification window needs 1 <= base ({base} ns) <= max ({max} ns)
    NotifyRange {
        /// Base.
        base: u64,
        /// Ceiling.
        max: u64,
    },
    /// rule: budgets need at least one vCPU
    NoVcpus,
}

/// Budget parameters, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// Spin before waiting, at start.
    pub wait_after_ns: u64,
    /// Its floor.
    pub wait_after_min_ns: u64,
    /// Its ceiling, also the wait length that decides growing or shrinking.
    pub wait_after_max_ns: u64,
    /// The wait budget's floor where the VM's vCPUs are gated by run slots
    /// ([`for_run_slots`](Self::for_run_slots)), at most the ceiling; 0 keeps
    /// `wait_after_min_ns` there too.
    pub run_slots_wait_after_min_ns: u64,
    /// Spin before a notification, at start and after a useful one.
    pub notify_after_ns: u64,
    /// Its ceiling.
    pub notify_after_max_ns: u64,
}

impl Default for BudgetConfig {
    /// Measured on the development machines (`docs/benchmarks.md`, "Native speed: WAIT, time
    /// budgets and the hint page"): a wait costs one exit
    /// (36-48 us from guest user mode, about 7 us from kernel mode) plus a wake-up (about
    /// 30 us), so spinning 50 us first loses little when the wait was needed and avoids most
    /// waits that were not; preempted holders stay off a CPU for host time slices (ms), far
    /// above the 1 ms ceiling. Under run slots the floor is 100 us
    /// ([`for_run_slots`](Self::for_run_slots); `docs/benchmarks.md` §14.11).
    fn default() -> Self {
        Self {
            wait_after_ns: 50_000,
            wait_after_min_ns: 2_000,
            wait_after_max_ns: 1_000_000,
            run_slots_wait_after_min_ns: 100_000,
            notify_after_ns: 100_000,
            notify_after_max_ns: 4_000_000,
        }
    }
}

impl BudgetConfig {
    /// Checks the rules.
    pub fn validate(&self) -> Result<(), BudgetError> {
        let (min, start, max) = (
            self.wait_after_min_ns,
            self.wait_after_ns,
            self.wait_after_max_ns,
        );
        if min == 0 || min > start || start > max {
            return Err(BudgetError::WaitRange { min, start, max });
        }
        if self.notify_after_ns == 0 || self.notify_after_ns > self.notify_after_max_ns {
            return Err(BudgetError::NotifyRange {
                base: self.notify_after_ns,
                max: self.notify_after_max_ns,
            });
        }
        Ok(())
    }

    /// The budgets of a VM whose vCPUs are gated by run slots (`pvspin-slots`) on a kick path
    /// that hands the kicker's slot to the kicked vCPU and parks waiters in the VMM (pvspin
    /// applies it on the userspace path, with more vCPUs than slots): the wait budget's floor
    /// raised to `run_slots_wait_after_min_ns` (at most the ceiling, so a VMM that lowers the
    /// ceiling needs no second setting), and its start to at least that floor.
    ///
    /// Why: under run slots a waiter that waits gives its slot up, and the vCPU that gets the
    /// slot next joins the lock's queue behind it, halted too before long; with more vCPUs
    /// than slots the queue then holds dozens of halted waiters, each hand-over is a wake-up,
    /// and every wait lasts far past the ceiling. The halving rule then takes every budget
    /// to its floor, so that even a waiter behind a running holder waits: a convoy that feeds
    /// itself (with the 2 us floor, about 30,000 waits per 80,000 acquisitions at 255 vCPUs on 2
    /// slots). A holder that does not run is visible there without the budget (the host marks
    /// parked vCPUs `NOT_RUNNING`, and waiters stop spinning behind them), so the floor costs
    /// little: it keeps a waiter spinning through the hand-overs of a running holder. Where
    /// a kicked vCPU wakes inside KVM and runs beyond the slots (signal-msi), the same floor
    /// made 64 vCPUs eleven times slower: not there.
    pub fn for_run_slots(&self) -> Self {
        let floor = self
            .wait_after_min_ns
            .max(self.run_slots_wait_after_min_ns)
            .min(self.wait_after_max_ns);
        Self {
            wait_after_min_ns: floor,
            wait_after_ns: self.wait_after_ns.max(floor),
            ..*self
        }
    }
}

/// The halt-polling rule for the wait budget: `current` after a wait of `waited_ns`.
/// The ABI's rule (`pvspin_abi::hint::adapt_wait_after`, which guests may apply too), in ns.
pub fn adapt_wait_after(current: u64, waited_ns: u64, cfg: &BudgetConfig) -> u64 {
    pvspin_abi::hint::adapt_wait_after(
        current,
        waited_ns,
        cfg.wait_after_min_ns,
        cfg.wait_after_max_ns,
    )
}

/// The PLE rule for the notification window: `current` after a notification that was
/// `useful` or not.
pub fn adapt_notify_after(current: u64, useful: bool, cfg: &BudgetConfig) -> u64 {
    if useful {
        cfg.notify_after_ns
    } else {
        current
            .saturating_mul(2)
            .clamp(cfg.notify_after_ns, cfg.notify_after_max_ns)
    }
}

/// Per-vCPU budgets, updated lock-free by each vCPU's own thread.
#[derive(Debug)]
pub struct SpinBudgets {
    cfg: BudgetConfig,
    wait_after: Box<[AtomicU64]>,
    notify_after: Box<[AtomicU64]>,
}

impl SpinBudgets {
    /// Budgets for `n` vCPUs, all at their start values.
    pub fn new(n: usize, cfg: BudgetConfig) -> Result<Self, BudgetError> {
        cfg.validate()?;
        if n == 0 {
            return Err(BudgetError::NoVcpus);
        }
        let all = |v: u64| (0..n).map(|_| AtomicU64::new(v)).collect();
        Ok(Self {
            cfg,
            wait_after: all(cfg.wait_after_ns),
            notify_after: all(cfg.notify_after_ns),
        })
    }

    /// The configuration.
    pub fn config(&self) -> BudgetConfig {
        self.cfg
    }

    /// `v`'s spin before waiting (the start value for an index out of range).
    pub fn wait_after_ns(&self, v: usize) -> u64 {
        self.wait_after
            .get(v)
            .map_or(self.cfg.wait_after_ns, |a| a.load(Ordering::Relaxed))
    }

    /// `v`'s spin before notifying (the base for an index out of range).
    pub fn notify_after_ns(&self, v: usize) -> u64 {
        self.notify_after
            .get(v)
            .map_or(self.cfg.notify_after_ns, |a| a.load(Ordering::Relaxed))
    }

    fn update(cell: Option<&AtomicU64>, fallback: u64, f: impl Fn(u64) -> u64) -> u64 {
        match cell {
            Some(a) => {
                let old = a
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(f(x)))
                    .unwrap_or_else(|x| x);
                f(old)
            }
            None => fallback,
        }
    }

    /// A wait of `v` lasted `waited_ns`; returns its new wait budget.
    pub fn on_wait(&self, v: usize, waited_ns: u64) -> u64 {
        let cfg = self.cfg;
        Self::update(self.wait_after.get(v), cfg.wait_after_ns, |x| {
            adapt_wait_after(x, waited_ns, &cfg)
        })
    }

    /// A notification of `v` was acted on usefully or not; returns its new window.
    pub fn on_notification(&self, v: usize, useful: bool) -> u64 {
        let cfg = self.cfg;
        Self::update(self.notify_after.get(v), cfg.notify_after_ns, |x| {
            adapt_notify_after(x, useful, &cfg)
        })
    }
}

/// Nanoseconds to TSC cycles at `tsc_khz` (saturating; `u64::MAX` stays "never").
pub fn ns_to_tsc(ns: u64, tsc_khz: u32) -> u64 {
    if ns == u64::MAX {
        return u64::MAX;
    }
    let cycles = u128::from(ns) * u128::from(tsc_khz) / 1_000_000;
    u64::try_from(cycles).unwrap_or(u64::MAX)
}

/// TSC cycles at `tsc_khz` to nanoseconds (saturating; 0 kHz gives 0).
pub fn tsc_to_ns(cycles: u64, tsc_khz: u32) -> u64 {
    if tsc_khz == 0 {
        return 0;
    }
    let ns = u128::from(cycles) * 1_000_000 / u128::from(tsc_khz);
    u64::try_from(ns).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_waits_grow_long_waits_shrink_within_bounds() {
        let cfg = BudgetConfig::default();
        let b = SpinBudgets::new(2, cfg).unwrap();
        assert_eq!(b.wait_after_ns(0), 50_000);
        // A kick 30 us into the wait: spinning would have been cheaper.
        assert_eq!(b.on_wait(0, 30_000), 100_000);
        for _ in 0..20 {
            b.on_wait(0, 10_000);
        }
        assert_eq!(b.wait_after_ns(0), cfg.wait_after_max_ns);
        // The holder was preempted for a host time slice: wait earlier.
        assert_eq!(b.on_wait(0, 3_000_000), 500_000);
        for _ in 0..20 {
            b.on_wait(0, 3_000_000);
        }
        assert_eq!(b.wait_after_ns(0), cfg.wait_after_min_ns);
        assert_eq!(b.wait_after_ns(1), 50_000, "budgets are per vCPU");
        assert_eq!(b.on_wait(9, 1), 50_000, "an unknown vCPU changes nothing");
    }

    #[test]
    fn useless_notifications_back_off_and_useful_ones_reset() {
        let cfg = BudgetConfig::default();
        let b = SpinBudgets::new(1, cfg).unwrap();
        assert_eq!(b.on_notification(0, false), 200_000);
        for _ in 0..10 {
            b.on_notification(0, false);
        }
        assert_eq!(b.notify_after_ns(0), cfg.notify_after_max_ns);
        assert_eq!(b.on_notification(0, true), cfg.notify_after_ns);
    }

    #[test]
    fn config_rules_are_named() {
        let bad = BudgetConfig {
            wait_after_min_ns: 0,
            ..BudgetConfig::default()
        };
        assert!(matches!(bad.validate(), Err(BudgetError::WaitRange { .. })));
        let bad = BudgetConfig {
            wait_after_ns: 2_000_000,
            ..BudgetConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("start"));
        let bad = BudgetConfig {
            notify_after_max_ns: 1,
            ..BudgetConfig::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(BudgetError::NotifyRange { .. })
        ));
        assert_eq!(
            SpinBudgets::new(0, BudgetConfig::default()).unwrap_err(),
            BudgetError::NoVcpus
        );
    }

    #[test]
    fn run_slots_raise_the_floor_and_the_start_only() {
        let cfg = BudgetConfig::default();
        let slots = cfg.for_run_slots();
        assert_eq!(slots.wait_after_min_ns, 100_000);
        assert_eq!(
            slots.wait_after_ns, 100_000,
            "the start is raised to the floor"
        );
        assert_eq!(slots.wait_after_max_ns, cfg.wait_after_max_ns);
        slots.validate().unwrap();
        // Long waits halve the budget down to the raised floor, not below.
        let b = SpinBudgets::new(1, slots).unwrap();
        for _ in 0..20 {
            b.on_wait(0, 50_000_000);
        }
        assert_eq!(b.wait_after_ns(0), 100_000);
        // A higher plain floor or start wins; 0 keeps the plain floor.
        let high = BudgetConfig {
            wait_after_min_ns: 200_000,
            wait_after_ns: 400_000,
            ..cfg
        };
        assert_eq!(high.for_run_slots().wait_after_min_ns, 200_000);
        assert_eq!(high.for_run_slots().wait_after_ns, 400_000);
        let off = BudgetConfig {
            run_slots_wait_after_min_ns: 0,
            ..cfg
        };
        assert_eq!(off.for_run_slots(), off);
        // A ceiling below the floor caps it: still a valid configuration.
        let low = BudgetConfig {
            wait_after_ns: 10_000,
            wait_after_max_ns: 10_000,
            ..cfg
        };
        low.validate().unwrap();
        assert_eq!(low.for_run_slots().wait_after_min_ns, 10_000);
        low.for_run_slots().validate().unwrap();
    }

    #[test]
    fn tsc_conversions_round_trip_and_saturate() {
        assert_eq!(ns_to_tsc(1_000, 2_600_000), 2_600);
        assert_eq!(tsc_to_ns(2_600, 2_600_000), 1_000);
        assert_eq!(ns_to_tsc(u64::MAX, 1), u64::MAX);
        assert_eq!(ns_to_tsc(u64::MAX - 1, 4_000_000), u64::MAX);
        assert_eq!(tsc_to_ns(5, 0), 0);
    }
}
