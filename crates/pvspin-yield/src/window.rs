//! The adaptive per-vCPU spin window: how long a guest spins before it notifies the host.
//!
//! KVM's PLE window is the model (the shared notes' kvm-pv-reference.md, "Pause-loop exiting
//! (PLE) / pause filtering: window adaptation"), with its exact formulas:
//! * `grow(val)`: `modifier < 1` resets to `base`; `modifier < base` multiplies, otherwise
//!   adds; capped at `max`;
//! * `shrink(val)`: `modifier < 1` resets to `base`; `modifier < base` divides, otherwise
//!   subtracts; floored at `base` (KVM floors at `base` in both callers).
//!
//! KVM grows the window on **every** PLE exit (`handle_pause`) and shrinks it when the vCPU
//! is loaded again after having been **scheduled out** (`vmx_vcpu_load` with
//! `scheduled_out`). So a spinner whose exits lead nowhere (no candidate, the directed yield
//! did not deschedule it: the host is not overcommitted) exits less and less often, and a
//! spinner that does get descheduled (overcommit: yielding helps) keeps a short window.
//!
//! pvspin's mapping, one to one:
//! * [`SpinWindows::on_notification`] = KVM's PLE exit: call it for every spin notification;
//! * [`SpinWindows::on_scheduled_out`] = KVM's load after `scheduled_out`: call it when the
//!   spinner's thread was actually descheduled while handling the notification (the actuator
//!   reports it, from the thread's context-switch counters), or when the VMM's scheduler
//!   parked the vCPU and lets it run again.
//!
//! The unit is the guest's: spin iterations before notifying (the ABI's window). KVM's VMX
//! default (4096 TSC cycles) does not transfer; the defaults here come from the E9 probe on
//! these machines (the shared notes' kvm-on-these-machines.md, "Directed yield from
//! userspace": notifying after 16 spins halves the CPU time,
//! after 256 most of the gain is lost): base 16, grow x2, shrink 0 (reset), max 4096.

use std::sync::atomic::{AtomicU32, Ordering};

use thiserror::Error;

/// Invalid window configuration.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy, displaydoc::Display)]
pub enum WindowError {
    /// rule: spin window base must be at least 1
    ZeroBase,
    /// rule: spin window max ({max}) must be at least base ({base})
    MaxBelowBase {
        /// The base.
        base: u32,
        /// The max.
        max: u32,
    },
    /// rule: spin windows need at least one vCPU
    NoVcpus,
}

/// Window parameters, KVM's four knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    /// Starting window and floor (KVM `ple_window`).
    pub base: u32,
    /// Grow modifier (KVM `ple_window_grow`): 0 resets, `< base` multiplies, else adds.
    pub grow: u32,
    /// Shrink modifier (KVM `ple_window_shrink`): 0 resets, `< base` divides, else subtracts.
    pub shrink: u32,
    /// Ceiling (KVM `ple_window_max`).
    pub max: u32,
}

impl Default for WindowConfig {
    fn default() -> Self {
        WindowConfig {
            base: 16,
            grow: 2,
            shrink: 0,
            max: 4096,
        }
    }
}

impl WindowConfig {
    /// Checks the rules: `base >= 1`, `max >= base`.
    pub fn validate(&self) -> Result<(), WindowError> {
        if self.base == 0 {
            return Err(WindowError::ZeroBase);
        }
        if self.max < self.base {
            return Err(WindowError::MaxBelowBase {
                base: self.base,
                max: self.max,
            });
        }
        Ok(())
    }
}

/// KVM's `__grow_ple_window`.
pub fn grow_window(val: u32, base: u32, modifier: u32, max: u32) -> u32 {
    if modifier < 1 {
        return base;
    }
    let new = if modifier < base {
        u64::from(val) * u64::from(modifier)
    } else {
        u64::from(val) + u64::from(modifier)
    };
    u32::try_from(new.min(u64::from(max))).unwrap_or(max)
}

/// KVM's `__shrink_ple_window` (with `min == base`).
pub fn shrink_window(val: u32, base: u32, modifier: u32, min: u32) -> u32 {
    if modifier < 1 {
        return base;
    }
    let new = if modifier < base {
        val / modifier
    } else {
        val.saturating_sub(modifier)
    };
    new.max(min)
}

/// One adaptive window per vCPU, updated lock-free.
#[derive(Debug)]
pub struct SpinWindows {
    cfg: WindowConfig,
    windows: Box<[AtomicU32]>,
}

impl SpinWindows {
    /// Windows for `n` vCPUs, all at `cfg.base`.
    pub fn new(n: usize, cfg: WindowConfig) -> Result<SpinWindows, WindowError> {
        cfg.validate()?;
        if n == 0 {
            return Err(WindowError::NoVcpus);
        }
        Ok(SpinWindows {
            cfg,
            windows: (0..n).map(|_| AtomicU32::new(cfg.base)).collect(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> WindowConfig {
        self.cfg
    }

    /// `v`'s current window (`base` for an index out of range).
    pub fn get(&self, v: usize) -> u32 {
        self.windows
            .get(v)
            .map_or(self.cfg.base, |w| w.load(Ordering::Relaxed))
    }

    fn update(&self, v: usize, f: impl Fn(u32) -> u32) -> u32 {
        match self.windows.get(v) {
            Some(w) => {
                let old = w
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(f(x)))
                    .unwrap_or_else(|x| x);
                f(old)
            }
            None => self.cfg.base,
        }
    }

    /// A spin notification from `v` (KVM: a PLE exit): grow. Returns the new window.
    pub fn on_notification(&self, v: usize) -> u32 {
        let c = self.cfg;
        self.update(v, |x| grow_window(x, c.base, c.grow, c.max))
    }

    /// `v` was descheduled and runs again (KVM: vcpu_load after `scheduled_out`): shrink.
    /// Returns the new window.
    pub fn on_scheduled_out(&self, v: usize) -> u32 {
        let c = self.cfg;
        self.update(v, |x| shrink_window(x, c.base, c.shrink, c.base))
    }

    /// Back to `base`.
    pub fn reset(&self, v: usize) {
        if let Some(w) = self.windows.get(v) {
            w.store(self.cfg.base, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_vmx_sequence_doubles_then_caps() {
        let mut v = 4096;
        let mut seq = vec![];
        for _ in 0..4 {
            v = grow_window(v, 4096, 2, u32::MAX);
            seq.push(v);
        }
        assert_eq!(seq, [8192, 16384, 32768, 65536]);
        assert_eq!(grow_window(u32::MAX - 1, 4096, 2, u32::MAX), u32::MAX);
    }

    #[test]
    fn kvm_svm_sequence() {
        let mut v = 3000;
        let mut seq = vec![];
        for _ in 0..6 {
            v = grow_window(v, 3000, 2, 65535);
            seq.push(v);
        }
        assert_eq!(seq, [6000, 12000, 24000, 48000, 65535, 65535]);
    }

    #[test]
    fn modifier_rules() {
        // 0 resets, < base multiplies/divides, >= base adds/subtracts.
        assert_eq!(grow_window(100, 16, 0, 1000), 16);
        assert_eq!(grow_window(100, 16, 3, 1000), 300);
        assert_eq!(grow_window(100, 16, 50, 1000), 150);
        assert_eq!(shrink_window(100, 16, 0, 16), 16);
        assert_eq!(shrink_window(100, 16, 3, 16), 33);
        assert_eq!(shrink_window(100, 16, 50, 16), 50);
        assert_eq!(shrink_window(20, 16, 50, 16), 16);
        assert_eq!(shrink_window(20, 16, 4, 16), 16);
    }

    #[test]
    fn config_rules() {
        assert_eq!(
            WindowConfig {
                base: 0,
                ..Default::default()
            }
            .validate(),
            Err(WindowError::ZeroBase)
        );
        assert_eq!(
            WindowConfig {
                base: 10,
                max: 5,
                ..Default::default()
            }
            .validate(),
            Err(WindowError::MaxBelowBase { base: 10, max: 5 })
        );
        assert!(WindowConfig::default().validate().is_ok());
        assert_eq!(
            SpinWindows::new(0, WindowConfig::default()).unwrap_err(),
            WindowError::NoVcpus
        );
    }

    #[test]
    fn per_vcpu_grow_and_reset_on_scheduled_out() {
        let w = SpinWindows::new(2, WindowConfig::default()).unwrap();
        assert_eq!(w.on_notification(0), 32);
        assert_eq!(w.on_notification(0), 64);
        assert_eq!(w.get(1), 16);
        assert_eq!(w.on_scheduled_out(0), 16);
        for _ in 0..20 {
            w.on_notification(1);
        }
        assert_eq!(w.get(1), 4096);
        w.reset(1);
        assert_eq!(w.get(1), 16);
        assert_eq!(w.on_notification(9), 16);
    }

    #[test]
    fn shrink_by_division_stays_above_base() {
        let cfg = WindowConfig {
            base: 16,
            grow: 2,
            shrink: 2,
            max: 4096,
        };
        let w = SpinWindows::new(1, cfg).unwrap();
        for _ in 0..3 {
            w.on_notification(0);
        }
        assert_eq!(w.get(0), 128);
        assert_eq!(w.on_scheduled_out(0), 64);
        for _ in 0..10 {
            w.on_scheduled_out(0);
        }
        assert_eq!(w.get(0), 16);
    }
}
