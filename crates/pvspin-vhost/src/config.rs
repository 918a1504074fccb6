//! What one backend serves: the number of vCPUs, the budgets it publishes in hint pages, and
//! how far it may go in yielding.

use std::time::Duration;

use pvspin_abi::virtio;
use pvspin_yield::{BudgetConfig, BudgetError};

/// The most vCPUs this daemon serves per device: the ABI's limit, 255.
///
/// The device's queue layout fits 256 queues at every size ([`virtio::spin_queues`]): the
/// most vhost-user can name (its vring-descriptor messages carry the index in 8 bits), and
/// pvspind's own transport ([`crate::transport`]) serves them all. (Up to 0.1 pvspind ran on
/// vhost-user-backend's daemon, whose worker masks reach queues 0..=63 only: 31 vCPUs.)
pub const TRANSPORT_MAX_VCPUS: u32 = virtio::MAX_VCPUS;

// `DaemonConfigError::AboveAbiLimit`'s message names the limit.
const _: () = assert!(virtio::MAX_VCPUS == 255);

/// Errors of a configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq, displaydoc::Display)]
pub enum DaemonConfigError {
    /// max_vcpus must be at least 1
    NoVcpus,
    /// max_vcpus {0} is above the ABI's limit of 255 (pvspin_abi::MAX_VCPUS: a kick is a REMRD
    /// MSI to the vCPU's 8-bit xAPIC ID and 0xFF is broadcast; x2APIC IDs are not supported)
    AboveAbiLimit(u32),
    /// budgets: {0}
    Budgets(#[from] BudgetError),
    /// max_events_per_sec must be at least 1000 (one event per 1 ms window), got {0}
    EventRate(u32),
    /// rule: the scheduler sampling period must be at least {MIN_SCHED_SAMPLE:?} (each sample reads
    /// /proc for every vCPU thread), got {0:?}
    SchedSample(Duration),
    /// rule: a worker priority is inherit, nice:N (-20 to 19) or fifo:P (1 to 99), got {0:?}
    WorkerPriority(
        /// The priority as the user typed it (`--worker-priority`).
        String,
    ),
    /// vCPU thread pattern {0:?} has no {{N}} placeholder for the vCPU index
    PatternWithoutIndex(
        /// The pattern as the user typed it (`--vcpu-thread-pattern`).
        String,
    ),
    /// rule: a VM gets at least one CPU (vm_cpus), got 0
    NoVmCpus,
    /// rule: NOT_RUNNING flags (flag_not_running) come from the scheduler sampler, which is off
    FlagsWithoutSampler,
}

/// The time budgets, in microseconds: where they start and their bounds. The daemon adapts
/// them per vCPU with pvspin's own rules (`pvspin_hints::PageBudgets`, as the in-process host
/// does) and publishes them in guest TSC cycles, with the TSC frequency the guest gives when it
/// registers its page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetsUs {
    /// Spinning before a SPIN notification, at start and after a useful notification.
    pub spin_window: u64,
    /// Ceiling of the spin window (useless notifications double it up to this).
    pub spin_window_max: u64,
    /// Spinning before waiting, at start.
    pub wait_after: u64,
    /// Floor of the wait-after budget.
    pub wait_after_min: u64,
    /// Ceiling of the wait-after budget.
    pub wait_after_max: u64,
}

impl Default for BudgetsUs {
    /// The in-process host's defaults (`pvspin_yield::BudgetConfig::default`).
    fn default() -> Self {
        let ns = BudgetConfig::default();
        Self {
            spin_window: ns.notify_after_ns / 1000,
            spin_window_max: ns.notify_after_max_ns / 1000,
            wait_after: ns.wait_after_ns / 1000,
            wait_after_min: ns.wait_after_min_ns / 1000,
            wait_after_max: ns.wait_after_max_ns / 1000,
        }
    }
}

impl BudgetsUs {
    /// The same budgets in nanoseconds (saturating), as pvspin's budget code takes them.
    pub fn to_config(&self) -> BudgetConfig {
        let ns = |us: u64| us.saturating_mul(1000);
        BudgetConfig {
            wait_after_ns: ns(self.wait_after),
            wait_after_min_ns: ns(self.wait_after_min),
            wait_after_max_ns: ns(self.wait_after_max),
            // pvspind gates no vCPUs with run slots.
            run_slots_wait_after_min_ns: 0,
            notify_after_ns: ns(self.spin_window),
            notify_after_max_ns: ns(self.spin_window_max),
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

/// The scheduling priority of the VM's queue worker thread (the thread that reads a kick
/// queue's eventfd and writes its call eventfd): under CPU contention its wake-up latency is
/// added to every kick. Its CPU is bounded by the VM's event rate
/// ([`BackendConfig::max_events_per_sec`]) whatever its priority.
///
/// At a normal priority the worker of a VM whose vCPUs keep both host CPUs busy can wait for a
/// CPU at every kick; `fifo:1` was tried against that and made 2-vCPU VMs beside co-tenants
/// collapse instead (`docs/pvspind.md`), and a short EEVDF slice or polling after each kick
/// gained little (`docs/benchmarks.md` §11.5).
///
/// The default is [`WorkerPriority::Inherit`]: real time only when the operator asks, since the
/// worker runs what guests send and at real-time priority that CPU time is taken from every
/// co-tenant's fair-class threads (bounded by the pacing, but taken all the same).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WorkerPriority {
    /// Leave the thread as created.
    #[default]
    Inherit,
    /// `setpriority` to this nice value (below the current one: `CAP_SYS_NICE` or
    /// `RLIMIT_NICE`).
    Nice(i32),
    /// `SCHED_FIFO` at this priority (1-99; `CAP_SYS_NICE` or `RLIMIT_RTPRIO`).
    Fifo(u8),
}

impl std::str::FromStr for WorkerPriority {
    type Err = DaemonConfigError;

    /// `inherit`, `nice:N` (-20..=19) or `fifo:P` (1..=99).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DaemonConfigError::WorkerPriority(s.to_owned());
        match s.split_once(':') {
            None if s == "inherit" => Ok(WorkerPriority::Inherit),
            Some(("nice", n)) => match n.parse::<i32>() {
                Ok(n) if (-20..=19).contains(&n) => Ok(WorkerPriority::Nice(n)),
                _ => Err(bad()),
            },
            Some(("fifo", p)) => match p.parse::<u8>() {
                Ok(p) if (1..=99).contains(&p) => Ok(WorkerPriority::Fifo(p)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

/// Default vCPU thread-name patterns: the example VMM's and QEMU's. `{N}` is the vCPU index.
pub const DEFAULT_THREAD_PATTERNS: [&str; 2] = ["vcpu{N}", "CPU {N}/KVM"];

/// Default of [`BackendConfig::max_events_per_sec`]. An event costs the daemon about 7 us of
/// CPU on the development hosts (`docs/benchmarks.md`, "Through the out-of-process backend"),
/// so a guest that notifies in a loop
/// makes it spend at most about 15% of one CPU.
pub const DEFAULT_MAX_EVENTS_PER_SEC: u32 = 20_000;

/// Default of [`BackendConfig::sched_sample`]: 1 ms, a quarter of the host's scheduler tick
/// on the development hosts (`HZ=250`), where holders are preempted for ticks.
pub const DEFAULT_SCHED_SAMPLE: Duration = Duration::from_millis(1);
/// The shortest sampling period accepted.
pub const MIN_SCHED_SAMPLE: Duration = Duration::from_micros(100);

/// Everything one backend (one frontend, one VM) is configured with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// vCPUs the device has queues for (`M` in [`pvspin_abi::virtio`]).
    pub max_vcpus: u32,
    /// Budgets: start values and bounds (adapted per vCPU, published in hint pages).
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
    /// How often the frontend's vCPU threads are sampled in `/proc` (`crate::sched`) and the
    /// wait reports taken from their hint pages; `None`: never (budgets then adapt at kicks
    /// only, and `NOT_RUNNING` stays 0). Sampling slows down 20-fold while the VM sends no
    /// notification, and always where no vCPU can be flagged (flags off, or the vCPUs fit).
    pub sched_sample: Option<Duration>,
    /// Whether sampled vCPUs that are descheduled get `NOT_RUNNING` in their hint pages, so
    /// that pvspin guests wait early instead of spinning behind them (never where the vCPUs
    /// fit their CPUs, [`Self::vcpus_fit`]). Off by default: at 2-16 vCPUs on 1-2 CPUs the
    /// flags were measured to cost 8-20% through the daemon, against no gain
    /// (`docs/benchmarks.md` §11.4-11.5).
    pub flag_not_running: bool,
    /// The VM's queue worker thread's priority, set when it handles its first event.
    pub worker_priority: WorkerPriority,
    /// The CPUs the VM gets (its affinity and CPU quota), if the operator says: the daemon then
    /// sets `VCPUS_FIT` (ABI 0.4) in the hint pages when the device's `max_vcpus` fit them, so
    /// pvspin guests keep spinning behind a just-kicked next owner instead of waiting early
    /// (no wake-up convoy at 2x/3x). `None`: never set, the safe side with more vCPUs than
    /// CPUs. The daemon counts the device's vCPUs, not the VM's: set `max_vcpus` to the VM's.
    pub vm_cpus: Option<u32>,
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
            sched_sample: Some(DEFAULT_SCHED_SAMPLE),
            flag_not_running: false,
            worker_priority: WorkerPriority::default(),
            vm_cpus: None,
        }
    }
}

impl BackendConfig {
    /// Checks the limits; a daemon refuses to start on an error.
    pub fn validate(&self) -> Result<(), DaemonConfigError> {
        if self.flag_not_running && self.sched_sample.is_none() {
            return Err(DaemonConfigError::FlagsWithoutSampler);
        }
        if self.max_vcpus == 0 {
            return Err(DaemonConfigError::NoVcpus);
        }
        if self.max_vcpus > virtio::MAX_VCPUS {
            return Err(DaemonConfigError::AboveAbiLimit(self.max_vcpus));
        }
        self.budgets.to_config().validate()?;
        if self.max_events_per_sec < 1000 {
            return Err(DaemonConfigError::EventRate(self.max_events_per_sec));
        }
        if let Some(period) = self.sched_sample.filter(|p| *p < MIN_SCHED_SAMPLE) {
            return Err(DaemonConfigError::SchedSample(period));
        }
        if let Some(p) = self.thread_patterns.iter().find(|p| !p.contains("{N}")) {
            return Err(DaemonConfigError::PatternWithoutIndex(p.clone()));
        }
        if self.vm_cpus == Some(0) {
            return Err(DaemonConfigError::NoVmCpus);
        }
        Ok(())
    }

    /// What the hint pages' `VCPUS_FIT` says: the device's vCPUs fit [`vm_cpus`](Self::vm_cpus).
    pub fn vcpus_fit(&self) -> bool {
        self.vm_cpus.is_some_and(|cpus| self.max_vcpus <= cpus)
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
        c.max_vcpus = TRANSPORT_MAX_VCPUS;
        assert_eq!(c.validate(), Ok(()));
        // vhost-user's 8-bit vring index: at most 256 queues.
        assert!(virtio::num_queues(TRANSPORT_MAX_VCPUS) <= 256);
        c.max_vcpus = 0;
        assert_eq!(c.validate(), Err(DaemonConfigError::NoVcpus));
        c.max_vcpus = 4;
        c.budgets.wait_after_max = 1;
        assert!(matches!(
            c.validate(),
            Err(DaemonConfigError::Budgets(BudgetError::WaitRange { .. }))
        ));
        c.budgets = BudgetsUs::default();
        c.budgets.wait_after_min = 0;
        assert!(c.validate().unwrap_err().to_string().contains("rule"));
        c.budgets = BudgetsUs::default();
        c.sched_sample = Some(Duration::from_micros(10));
        assert!(matches!(
            c.validate(),
            Err(DaemonConfigError::SchedSample(_))
        ));
        c.sched_sample = None;
        assert_eq!(c.validate(), Ok(()));
        c.flag_not_running = true;
        assert_eq!(c.validate(), Err(DaemonConfigError::FlagsWithoutSampler));
        assert!(c.validate().unwrap_err().to_string().contains("rule"));
        c.sched_sample = Some(DEFAULT_SCHED_SAMPLE);
        assert_eq!(c.validate(), Ok(()));
        c.budgets = BudgetsUs::default();
        c.thread_patterns.push("vcpu".into());
        assert!(matches!(
            c.validate(),
            Err(DaemonConfigError::PatternWithoutIndex(_))
        ));
        c.thread_patterns.pop();
        c.vm_cpus = Some(0);
        assert!(c.validate().unwrap_err().to_string().contains("rule"));
        c.max_vcpus = 16;
        c.vm_cpus = Some(16);
        assert_eq!(c.validate(), Ok(()));
        assert!(c.vcpus_fit());
        c.vm_cpus = Some(15);
        assert!(!c.vcpus_fit());
    }

    #[test]
    fn worker_priorities_parse_with_their_rule() {
        assert_eq!("inherit".parse(), Ok(WorkerPriority::Inherit));
        assert_eq!("nice:-10".parse(), Ok(WorkerPriority::Nice(-10)));
        assert_eq!("fifo:1".parse(), Ok(WorkerPriority::Fifo(1)));
        for bad in [
            "", "nice", "nice:-21", "fifo:0", "fifo:100", "rr:1", "nice:x",
        ] {
            let e = bad.parse::<WorkerPriority>().unwrap_err();
            assert!(e.to_string().contains("rule"), "{bad}: {e}");
        }
    }

    #[test]
    fn budgets_default_to_the_in_process_hosts() {
        // Everything but the floor under run slots, which pvspind does not have.
        let in_process = BudgetConfig {
            run_slots_wait_after_min_ns: 0,
            ..BudgetConfig::default()
        };
        assert_eq!(BudgetsUs::default().to_config(), in_process);
        let huge = BudgetsUs {
            spin_window_max: u64::MAX,
            ..BudgetsUs::default()
        };
        assert_eq!(huge.to_config().notify_after_max_ns, u64::MAX);
    }
}
