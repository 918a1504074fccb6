//! Whether boosting a waited-for vCPU that the host sees running pays off, decided by trying.
//!
//! A host that cannot see preemption inside `KVM_RUN` (no steal-time `preempted` flag, as on
//! the development machines) can only guess whether the vCPU a waiter names is descheduled.
//! Boosting it anyway (`PolicyConfig::boost_running_hint`) helps when it is (the holder gets
//! its CPU back sooner) and hurts when it is not: a boost outlives the critical section (the
//! host does not see the release), so the boosted vCPU keeps its CPU from the next owner it
//! just kicked. Which effect wins depends on the workload and the host's load, so
//! [`BoostTrial`] measures it: waits are grouped in epochs; each epoch runs with boosts of
//! running targets on or off; the mean wait (the guests' own reports: how long a waiter waited
//! before it got what it waited for) of each setting is kept as a moving average, and the
//! better setting is used, the other tried again every few epochs.

use std::sync::Mutex;

/// Trial parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrialConfig {
    /// Waits per epoch.
    pub epoch_waits: u32,
    /// Every this many epochs, the setting that is not the better one is tried again.
    pub explore_every: u32,
}

impl Default for TrialConfig {
    fn default() -> Self {
        Self {
            epoch_waits: 64,
            explore_every: 8,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    boost: bool,
    epoch: u64,
    waits: u32,
    sum_ns: u128,
    /// Moving averages of the mean wait, per setting (`[off, on]`); `None` until measured.
    avg_ns: [Option<u64>; 2],
    epochs_on: u64,
    epochs_off: u64,
}

/// The boost trial of one VM. See the module docs.
#[derive(Debug)]
pub struct BoostTrial {
    cfg: TrialConfig,
    state: Mutex<State>,
}

/// What the trial did so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrialStats {
    /// Epochs run with boosts of running targets on.
    pub epochs_on: u64,
    /// Epochs run with them off.
    pub epochs_off: u64,
    /// The current setting.
    pub boosting: bool,
    /// Mean wait with boosts off and on, ns (moving averages).
    pub mean_wait_ns: [Option<u64>; 2],
}

impl BoostTrial {
    /// A trial that starts with boosts on.
    pub fn new(cfg: TrialConfig) -> Self {
        let cfg = TrialConfig {
            epoch_waits: cfg.epoch_waits.max(1),
            explore_every: cfg.explore_every.max(2),
        };
        Self {
            cfg,
            state: Mutex::new(State {
                boost: true,
                ..State::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a running target is boosted now.
    pub fn boosting(&self) -> bool {
        self.lock().boost
    }

    /// A waiter reports a wait of `ns`.
    pub fn on_wait(&self, ns: u64) {
        let mut s = self.lock();
        s.waits += 1;
        s.sum_ns += u128::from(ns);
        if s.waits < self.cfg.epoch_waits {
            return;
        }
        let mean = u64::try_from(s.sum_ns / u128::from(s.waits)).unwrap_or(u64::MAX);
        let arm = usize::from(s.boost);
        s.avg_ns[arm] = Some(match s.avg_ns[arm] {
            // Weight 1/4 for the new epoch: settles in a few epochs, follows a change of load.
            Some(avg) => avg - avg / 4 + mean / 4,
            None => mean,
        });
        if s.boost {
            s.epochs_on += 1;
        } else {
            s.epochs_off += 1;
        }
        s.epoch += 1;
        s.waits = 0;
        s.sum_ns = 0;
        let better_on = match s.avg_ns {
            [Some(off), Some(on)] => on <= off,
            // Try the unmeasured setting next.
            [None, _] => false,
            [_, None] => true,
        };
        let explore = s.epoch % u64::from(self.cfg.explore_every) == 0;
        s.boost = better_on != explore;
    }

    /// What the trial did so far.
    pub fn stats(&self) -> TrialStats {
        let s = self.lock();
        TrialStats {
            epochs_on: s.epochs_on,
            epochs_off: s.epochs_off,
            boosting: s.boost,
            mean_wait_ns: s.avg_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(trial: &BoostTrial, epochs: usize, wait_on: u64, wait_off: u64) {
        for _ in 0..epochs * 8 {
            let ns = if trial.boosting() { wait_on } else { wait_off };
            trial.on_wait(ns);
        }
    }

    #[test]
    fn settles_on_the_setting_with_shorter_waits_and_keeps_trying_the_other() {
        let cfg = TrialConfig {
            epoch_waits: 8,
            explore_every: 4,
        };
        let t = BoostTrial::new(cfg);
        // Boosting makes waits longer (the many-vCPU case): it ends up off most epochs.
        run(&t, 40, 900, 300);
        let s = t.stats();
        assert!(s.epochs_off > 2 * s.epochs_on, "{s:?}");
        assert!(s.epochs_on >= 10, "the other setting is still tried: {s:?}");
        // The load changes and boosting now helps: the trial follows.
        let before = t.stats();
        run(&t, 40, 100, 800);
        let s = t.stats();
        assert!(
            s.epochs_on - before.epochs_on > 2 * (s.epochs_off - before.epochs_off),
            "{s:?}"
        );
    }

    #[test]
    fn starts_boosting_and_measures_both_settings_early() {
        let t = BoostTrial::new(TrialConfig {
            epoch_waits: 2,
            explore_every: 4,
        });
        assert!(t.boosting());
        run(&t, 1, 5, 5);
        let s = t.stats();
        assert!(
            s.mean_wait_ns[0].is_some() && s.mean_wait_ns[1].is_some(),
            "{s:?}"
        );
        // Degenerate parameters are clamped, never divide by zero.
        let z = BoostTrial::new(TrialConfig {
            epoch_waits: 0,
            explore_every: 0,
        });
        z.on_wait(1);
        assert_eq!(z.stats().epochs_on, 1);
    }
}
