//! What one backend serves: the number of vCPUs, the budgets it publishes in hint pages, and
//! how far it may go in yielding.

use std::time::Duration;

use pvspin_abi::virtio;

/// The most vCPUs this daemon serves per device: `1 + 2 * 31 = 63` queues.
///
/// `vhost-user-backend` (0.24) hands each worker thread the queues of a 64-bit mask whose bit
/// `i` is queue `i` itself, not the `i`-th queue of that thread, so no queue past index 63 can
/// be served by any worker, however many workers
/// (`VhostUserBackend::queues_per_thread`); a device with more queues even makes it panic
/// (in a debug build) or alias queue `i` to `i % 64` (release) when it builds the workers.
/// Past that, vhost-user itself names a vring in 8 bits in `SET_VRING_KICK`, `SET_VRING_CALL`
/// and `SET_VRING_ERR` (bit 8 is the "no descriptor" flag), so no vhost-user device has more
/// than 256 queues: with this device's `1 + 2 * M` layout, M <= 127. Serving the ABI's 255
/// would need a queue layout of at most 256 queues as well as a transport without the mask.
pub const TRANSPORT_MAX_VCPUS: u32 = 31;

/// The most vCPUs any vhost-user device with the `1 + 2 * M` queue layout can have:
/// vhost-user's vring-descriptor messages carry the vring index in 8 bits (256 queues).
pub const VHOST_USER_MAX_VCPUS: u32 = 127;

/// Errors of a configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// No vCPUs.
    #[error("max_vcpus must be at least 1")]
    NoVcpus,
    /// More vCPUs than the device ABI allows.
    #[error(
        "max_vcpus {0} is above the ABI's limit of {max} (pvspin_abi::MAX_VCPUS: a kick is a REMRD MSI to the vCPU's 8-bit xAPIC ID and 0xFF is broadcast; x2APIC IDs are not supported)",
        max = virtio::MAX_VCPUS
    )]
    AboveAbiLimit(u32),
    /// More vCPUs than the vhost-user transport of this daemon serves.
    #[error(
        "max_vcpus {0} is above this daemon's limit of {TRANSPORT_MAX_VCPUS}: the device needs 1 + 2 * max_vcpus queues and vhost-user-backend's worker masks reach queue indices 0..=63 only (vhost-user itself caps a device at 256 queues, 127 vCPUs)"
    )]
    AboveTransportLimit(u32),
    /// The wait budgets are not ordered `min <= wait_after <= max`.
    #[error("wait budgets must satisfy min ({min}) <= wait-after ({wait_after}) <= max ({max}) microseconds")]
    BudgetOrder {
        /// Floor, microseconds.
        min: u64,
        /// Initial budget, microseconds.
        wait_after: u64,
        /// Ceiling, microseconds.
        max: u64,
    },
    /// A notification rate too small to carry one event per millisecond window.
    #[error("max_events_per_sec must be at least 1000 (one event per 1 ms window), got {0}")]
    EventRate(u32),
    /// A vCPU thread-name pattern without the `{N}` placeholder.
    #[error("vCPU thread pattern {0:?} has no {{N}} placeholder for the vCPU index")]
    PatternWithoutIndex(String),
}

/// The time budgets published in hint pages, in microseconds (converted to guest TSC cycles
/// with the TSC frequency the guest gives at registration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetsUs {
    /// Spinning before a SPIN notification.
    pub spin_window: u64,
    /// Spinning before waiting (the initial wait-after budget).
    pub wait_after: u64,
    /// Floor of the wait-after budget.
    pub wait_after_min: u64,
    /// Ceiling of the wait-after budget.
    pub wait_after_max: u64,
}

impl Default for BudgetsUs {
    fn default() -> Self {
        Self {
            spin_window: 20,
            wait_after: 50,
            wait_after_min: 5,
            wait_after_max: 1000,
        }
    }
}

/// The budgets in guest TSC cycles, as written to a hint page's host line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetsTsc {
    /// [`pvspin_abi::hint::SPIN_WINDOW_TSC`].
    pub spin_window: u64,
    /// [`pvspin_abi::hint::WAIT_AFTER_TSC`].
    pub wait_after: u64,
    /// [`pvspin_abi::hint::WAIT_AFTER_MIN_TSC`].
    pub wait_after_min: u64,
    /// [`pvspin_abi::hint::WAIT_AFTER_MAX_TSC`].
    pub wait_after_max: u64,
}

/// `us` microseconds in cycles of a `tsc_khz` kHz clock, saturating.
pub fn us_to_tsc(us: u64, tsc_khz: u64) -> u64 {
    let cycles = u128::from(us) * u128::from(tsc_khz) / 1000;
    u64::try_from(cycles).unwrap_or(u64::MAX)
}

impl BudgetsUs {
    /// The budgets for a guest whose TSC runs at `tsc_khz` kHz. An unknown frequency (0)
    /// publishes no time budgets: the spin window is `u64::MAX` (never notify) and the wait
    /// budgets 0, so the guest keeps its own defaults.
    pub fn to_tsc(&self, tsc_khz: u64) -> BudgetsTsc {
        if tsc_khz == 0 {
            return BudgetsTsc {
                spin_window: u64::MAX,
                wait_after: 0,
                wait_after_min: 0,
                wait_after_max: 0,
            };
        }
        BudgetsTsc {
            spin_window: us_to_tsc(self.spin_window, tsc_khz).max(1),
            wait_after: us_to_tsc(self.wait_after, tsc_khz),
            wait_after_min: us_to_tsc(self.wait_after_min, tsc_khz),
            wait_after_max: us_to_tsc(self.wait_after_max, tsc_khz),
        }
    }
}

/// How far the backend may act on a spin notification.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum YieldMode {
    /// Count notifications, change no thread.
    Off,
    /// Deboost the spinner's thread for a bounded time (never raises anyone's priority).
    #[default]
    Deboost,
    /// Also boost the waited-for vCPU's thread, when the frontend process is alone in its own
    /// cpu cgroup (so a boost only moves CPU between the VM's own threads).
    Confined,
}

/// Default vCPU thread-name patterns: the example VMM's and QEMU's. `{N}` is the vCPU index.
pub const DEFAULT_THREAD_PATTERNS: [&str; 2] = ["vcpu{N}", "CPU {N}/KVM"];

/// Default of [`BackendConfig::max_events_per_sec`]. An event costs the daemon about 7 us of
/// CPU on the development hosts (`docs/benchmarks.md`, "Through the out-of-process backend"),
/// so a guest that notifies in a loop
/// makes it spend at most about 15% of one CPU.
pub const DEFAULT_MAX_EVENTS_PER_SEC: u32 = 20_000;

/// Everything one backend (one frontend, one VM) is configured with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// vCPUs the device has queues for (`M` in [`pvspin_abi::virtio`]).
    pub max_vcpus: u32,
    /// Budgets published at hint-page registration.
    pub budgets: BudgetsUs,
    /// What a spin notification may do to host threads.
    pub yield_mode: YieldMode,
    /// vCPU thread-name patterns, `{N}` standing for the index.
    pub thread_patterns: Vec<String>,
    /// How long a deboost or boost lasts before the backend restores the thread's priority.
    pub adjust_for: Duration,
    /// How much a deboost raises (and a boost lowers) a thread's nice value.
    pub nice_step: i32,
    /// The most queue notifications per second the backend handles for this VM; past it,
    /// the VM's worker thread sleeps to the end of the current millisecond. Kicks that arrive
    /// meanwhile wait in their eventfds and coalesce (remembered, not lost), so a guest that
    /// notifies in a loop gets at most this many wake-ups of the daemon's CPU: what the
    /// daemon spends on a VM is bounded, whatever the guest writes.
    pub max_events_per_sec: u32,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            max_vcpus: 16,
            budgets: BudgetsUs::default(),
            yield_mode: YieldMode::default(),
            thread_patterns: DEFAULT_THREAD_PATTERNS
                .iter()
                .map(|p| p.to_string())
                .collect(),
            adjust_for: Duration::from_millis(1),
            nice_step: 5,
            max_events_per_sec: DEFAULT_MAX_EVENTS_PER_SEC,
        }
    }
}

impl BackendConfig {
    /// Checks the limits; a daemon refuses to start on an error.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_vcpus == 0 {
            return Err(ConfigError::NoVcpus);
        }
        if self.max_vcpus > virtio::MAX_VCPUS {
            return Err(ConfigError::AboveAbiLimit(self.max_vcpus));
        }
        if self.max_vcpus > TRANSPORT_MAX_VCPUS {
            return Err(ConfigError::AboveTransportLimit(self.max_vcpus));
        }
        let b = &self.budgets;
        if !(b.wait_after_min <= b.wait_after && b.wait_after <= b.wait_after_max) {
            return Err(ConfigError::BudgetOrder {
                min: b.wait_after_min,
                wait_after: b.wait_after,
                max: b.wait_after_max,
            });
        }
        if self.max_events_per_sec < 1000 {
            return Err(ConfigError::EventRate(self.max_events_per_sec));
        }
        if let Some(p) = self.thread_patterns.iter().find(|p| !p.contains("{N}")) {
            return Err(ConfigError::PatternWithoutIndex(p.clone()));
        }
        Ok(())
    }

    /// Number of virtqueues of the device.
    pub fn num_queues(&self) -> usize {
        virtio::num_queues(self.max_vcpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_refused_with_their_rule() {
        let mut c = BackendConfig::default();
        assert_eq!(c.validate(), Ok(()));
        c.max_vcpus = virtio::MAX_VCPUS + 1;
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("MAX_VCPUS"), "{e}");
        assert!(e.to_string().contains("xAPIC"), "{e}");
        c.max_vcpus = TRANSPORT_MAX_VCPUS + 1;
        assert_eq!(c.validate(), Err(ConfigError::AboveTransportLimit(32)));
        // vhost-user's 8-bit vring index: at most 256 queues.
        assert!(virtio::num_queues(VHOST_USER_MAX_VCPUS) <= 256);
        assert!(virtio::num_queues(VHOST_USER_MAX_VCPUS + 1) > 256);
        c.max_vcpus = 0;
        assert_eq!(c.validate(), Err(ConfigError::NoVcpus));
        c.max_vcpus = 4;
        c.budgets.wait_after_max = 1;
        assert!(matches!(c.validate(), Err(ConfigError::BudgetOrder { .. })));
        c.budgets = BudgetsUs::default();
        c.thread_patterns.push("vcpu".into());
        assert!(matches!(
            c.validate(),
            Err(ConfigError::PatternWithoutIndex(_))
        ));
    }

    #[test]
    fn budgets_convert_with_the_guest_tsc() {
        let b = BudgetsUs::default();
        let t = b.to_tsc(2_000_000); // 2 GHz: 2000 cycles per microsecond
        assert_eq!(t.spin_window, 40_000);
        assert_eq!(t.wait_after, 100_000);
        assert_eq!(t.wait_after_max, 2_000_000);
        assert_eq!(b.to_tsc(0).spin_window, u64::MAX);
        assert_eq!(us_to_tsc(u64::MAX, u64::MAX), u64::MAX);
    }
}
