//! `pvspin-vmm bench`: the overcommit experiment. Each variant (lock, PV mode, kick path) runs
//! at each overcommit level (hog count) several times, interleaved run by run so that noise
//! on a shared machine spreads evenly; the table gives mean (sd), median, the slowest run and
//! the ratio to the first variant (the BASE row of the original PV-spinlock tables). Progress
//! goes to stderr, the table to stdout, every run's record to `--json-out` (JSON lines, read
//! back by `pvspin-vmm report`, see [`crate::saved`]).

use std::fmt;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use pvspin_test_vm_proto::LockKind;

use crate::cli::VmArgs;
use crate::saved::{BenchHeader, JsonLines, Record, RunRecord, VmRecord};
use pvspin_test_vm::config::{GuestKind, PvMode, RunConfig};
use pvspin_test_vm::report::{LatencySummary, RunReport};
use pvspin_test_vm::vmm::{self, RunError};

/// One configuration to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// Guest lock.
    pub lock: LockKind,
    /// PV mode.
    pub pv: PvMode,
    /// Kick path (with PV on).
    pub kick_path: pvspin::KickPath,
    /// Directed-yield actuator (with `kick+yield`).
    pub actuator: pvspin::ActuatorKind,
    /// How waiters wait (`None`: the run's `--wait`).
    pub wait: Option<pvspin_test_vm::config::WaitMode>,
    /// Budget unit (`None`: the run's `--budgets`).
    pub budgets: Option<pvspin_test_vm::config::BudgetMode>,
    /// Run slots (`/slots`; `None`: the run's `--sched`).
    pub slots: Option<bool>,
    /// Kicks through the vhost-user backend of the bench's `--pv-backend` (`/vhost`); the
    /// other variants run pvspin in process, so both sit side by side in one table.
    pub vhost: bool,
    /// With `vhost`: kicks stay in KVM (`/direct`, which implies `/vhost`;
    /// `RunConfig::vhost_direct_kicks`).
    pub vhost_direct: bool,
    /// The guest (`@stock`, `@pvspin`; `None`: the run's `--guest`), so stock and
    /// pvspin-aware guests sit side by side in one table.
    pub guest: Option<GuestKind>,
    /// KVM's halt-polling limit in ns (`/poll=N`; `None`: the run's `--halt-poll-ns`), so
    /// wake paths with and without halt polling sit side by side in one table.
    pub halt_poll_ns: Option<u32>,
    /// Spin on the userspace path's latch before sleeping, in us (`/park=N`; `None`: the
    /// run's `--park-spin-us`).
    pub park_spin_us: Option<u64>,
    /// The CPUs pvspin tells the guest the VM gets (`/cpus=N`, `VCPUS_FIT`; `None`: the run's
    /// `--vm-cpus`), so guests told their vCPUs fit and guests told nothing sit side by side.
    pub vm_cpus: Option<usize>,
    /// The run slots' quantum in us (`/quantum=US`; `None`: the run's `--slot-quantum-us`).
    pub slot_quantum_us: Option<u64>,
    /// How many run slots (`/slots=N`, which also turns them on; `None`: the run's `--slots`).
    pub slot_count: Option<u32>,
}

/// A bench variant that does not parse: the whole text, and what is wrong in it.
#[derive(Debug, thiserror::Error)]
#[error("{text:?}: {fault}")]
pub struct VariantError {
    /// The variant as given.
    pub text: String,
    /// What is wrong.
    pub fault: VariantFault,
}

impl VariantError {
    fn new(text: &str, fault: VariantFault) -> Self {
        Self {
            text: text.to_owned(),
            fault,
        }
    }
}

/// What is wrong in a bench variant ([`VariantError`]).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum VariantFault {
    /// A guest other than `@stock` or `@pvspin`.
    #[error("unknown guest {0:?} (stock, pvspin)")]
    UnknownGuest(String),
    /// An unknown `/option`.
    #[error(
        "unknown option {0:?} (spins, time, hlt, doorbell, slots, vhost, direct, poll=NS, park=US, cpus=N, \
         quantum=US, slots=N)"
    )]
    UnknownOption(String),
    /// `/poll=`, `/park=`, `/cpus=`, `/quantum=` or `/slots=` without a number.
    #[error("{0} needs a number, not {1:?}")]
    NotANumber(&'static str, String),
    /// An unknown lock (or none).
    #[error("unknown lock {0:?} (ticket, tas, queued, backoff)")]
    UnknownLock(Option<String>),
    /// An unknown PV mode.
    #[error("unknown pv mode {0:?} (off, kick, kick+yield)")]
    UnknownPvMode(String),
    /// An unknown kick path.
    #[error("unknown kick path {0:?} (in-kernel, signal-msi, userspace)")]
    UnknownKickPath(String),
    /// An actuator without `kick+yield`.
    #[error("an actuator needs kick+yield")]
    ActuatorNeedsYield,
    /// An unknown actuator.
    #[error(transparent)]
    UnknownActuator(pvspin::ParseActuatorError),
    /// Something after the actuator.
    #[error("unexpected {0:?}")]
    Unexpected(String),
    /// Options on a variant without PV.
    #[error("wait, budget, slot, vhost, poll, park, cpus and quantum options need a PV mode")]
    OptionsNeedPv,
}

impl Variant {
    /// `lock:pv[/option...][:path[:actuator]][@guest]`, e.g. `ticket:off`,
    /// `queued:kick:userspace`, `ticket:kick/spins` (ABI 0.2 spin budgets),
    /// `ticket:kick/doorbell` (WAIT in kernel mode), `ticket:kick/hlt`, `queued:kick@stock`
    /// (a stock Linux guest's pv qspinlock), `queued:kick:signal-msi@pvspin`.
    pub fn parse(text: &str) -> Result<Self, VariantError> {
        let (variant, guest) = match text.rsplit_once('@') {
            Some((variant, "stock")) => (variant, Some(GuestKind::Stock)),
            Some((variant, "pvspin")) => (variant, Some(GuestKind::Pvspin)),
            Some((_, other)) => {
                return Err(VariantError::new(
                    text,
                    VariantFault::UnknownGuest(other.to_owned()),
                ))
            }
            None => (text, None),
        };
        let mut parsed = Self::parse_variant(text, variant)?;
        parsed.guest = guest;
        Ok(parsed)
    }

    /// [`parse`](Self::parse) without the guest; `text` is the whole variant, for messages.
    fn parse_variant(text: &str, variant: &str) -> Result<Self, VariantError> {
        let fault = |fault| VariantError::new(text, fault);
        let (text_base, options) = match variant.split_once('/') {
            Some((base, rest)) => {
                // Options sit on the pv part: split them off up to the next ':'.
                let (opts, tail) = rest.split_once(':').unwrap_or((rest, ""));
                let base = if tail.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}:{tail}")
                };
                (base, Some(opts.to_string()))
            }
            None => (variant.to_string(), None),
        };
        let (mut wait, mut budgets, mut slots, mut vhost) = (None, None, None, false);
        let mut vhost_direct = false;
        let (mut halt_poll_ns, mut park_spin_us, mut vm_cpus) = (None, None, None);
        let (mut slot_quantum_us, mut slot_count) = (None, None);
        let number = |opt: &'static str, value: &str| {
            value
                .parse::<u32>()
                .map_err(|_| fault(VariantFault::NotANumber(opt, value.to_owned())))
        };
        for opt in options.iter().flat_map(|o| o.split('/')) {
            if let Some(value) = opt.strip_prefix("poll=") {
                halt_poll_ns = Some(number("poll=", value)?);
                continue;
            }
            if let Some(value) = opt.strip_prefix("park=") {
                park_spin_us = Some(u64::from(number("park=", value)?));
                continue;
            }
            if let Some(value) = opt.strip_prefix("cpus=") {
                vm_cpus = Some(number("cpus=", value)? as usize);
                continue;
            }
            if let Some(value) = opt.strip_prefix("quantum=") {
                slot_quantum_us = Some(u64::from(number("quantum=", value)?));
                continue;
            }
            if let Some(value) = opt.strip_prefix("slots=") {
                slot_count = Some(number("slots=", value)?);
                slots = Some(true);
                continue;
            }
            match opt {
                "spins" => budgets = Some(pvspin_test_vm::config::BudgetMode::Spins),
                "time" => budgets = Some(pvspin_test_vm::config::BudgetMode::Time),
                "hlt" => wait = Some(pvspin_test_vm::config::WaitMode::Hlt),
                "doorbell" => wait = Some(pvspin_test_vm::config::WaitMode::Doorbell),
                "slots" => slots = Some(true),
                "vhost" => vhost = true,
                "direct" => (vhost, vhost_direct) = (true, true),
                other => return Err(fault(VariantFault::UnknownOption(other.to_owned()))),
            }
        }
        let mut parts = text_base.split(':');
        let lock = match parts.next() {
            Some("ticket") => LockKind::Ticket,
            Some("tas") => LockKind::Tas,
            Some("queued") => LockKind::Queued,
            Some("backoff") => LockKind::Backoff,
            other => return Err(fault(VariantFault::UnknownLock(other.map(str::to_owned)))),
        };
        let pv = match parts.next().unwrap_or("off") {
            "off" => PvMode::Off,
            "kick" => PvMode::Kick,
            "kick+yield" => PvMode::KickYield,
            other => return Err(fault(VariantFault::UnknownPvMode(other.to_owned()))),
        };
        let kick_path = match parts.next().unwrap_or("in-kernel") {
            "in-kernel" => pvspin::KickPath::InKernel,
            "signal-msi" => pvspin::KickPath::SignalMsi,
            "userspace" => pvspin::KickPath::Userspace,
            other => return Err(fault(VariantFault::UnknownKickPath(other.to_owned()))),
        };
        let actuator = match parts.next() {
            None => pvspin::ActuatorKind::default(),
            Some(_) if pv != PvMode::KickYield => {
                return Err(fault(VariantFault::ActuatorNeedsYield))
            }
            Some(name) => name
                .parse()
                .map_err(|e| fault(VariantFault::UnknownActuator(e)))?,
        };
        if let Some(extra) = parts.next() {
            return Err(fault(VariantFault::Unexpected(extra.to_owned())));
        }
        let wake_options = halt_poll_ns.is_some()
            || park_spin_us.is_some()
            || vm_cpus.is_some()
            || slot_quantum_us.is_some();
        if pv == PvMode::Off
            && (wait.is_some() || budgets.is_some() || slots.is_some() || vhost || wake_options)
        {
            return Err(fault(VariantFault::OptionsNeedPv));
        }
        Ok(Self {
            lock,
            pv,
            kick_path,
            actuator,
            wait,
            budgets,
            slots,
            vhost,
            vhost_direct,
            guest: None,
            halt_poll_ns,
            park_spin_us,
            vm_cpus,
            slot_quantum_us,
            slot_count,
        })
    }

    fn options_suffix(&self) -> String {
        let mut s = String::new();
        match self.budgets {
            Some(pvspin_test_vm::config::BudgetMode::Spins) => s.push_str("/spins"),
            Some(pvspin_test_vm::config::BudgetMode::Time) => s.push_str("/time"),
            None => {}
        }
        match self.wait {
            Some(pvspin_test_vm::config::WaitMode::Hlt) => s.push_str("/hlt"),
            Some(pvspin_test_vm::config::WaitMode::Doorbell) => s.push_str("/doorbell"),
            Some(pvspin_test_vm::config::WaitMode::Auto) | None => {}
        }
        match (self.slots, self.slot_count) {
            (Some(true), Some(n)) => s.push_str(&format!("/slots={n}")),
            (Some(true), None) => s.push_str("/slots"),
            _ => {}
        }
        if self.vhost {
            s.push_str("/vhost");
        }
        if self.vhost_direct {
            s.push_str("/direct");
        }
        if let Some(ns) = self.halt_poll_ns {
            s.push_str(&format!("/poll={ns}"));
        }
        if let Some(us) = self.park_spin_us {
            s.push_str(&format!("/park={us}"));
        }
        if let Some(cpus) = self.vm_cpus {
            s.push_str(&format!("/cpus={cpus}"));
        }
        if let Some(us) = self.slot_quantum_us {
            s.push_str(&format!("/quantum={us}"));
        }
        s
    }

    /// The name `parse` accepts.
    pub fn name(&self) -> String {
        let guest = self
            .guest
            .map_or(String::new(), |g| format!("@{}", g.name()));
        format!("{}{guest}", self.name_without_guest())
    }

    fn name_without_guest(&self) -> String {
        let lock = vmm::lock_name(self.lock);
        match self.pv {
            PvMode::Off => format!("{lock}:off"),
            PvMode::Kick | PvMode::KickYield => {
                let path = match self.kick_path {
                    pvspin::KickPath::InKernel => "in-kernel",
                    pvspin::KickPath::SignalMsi => "signal-msi",
                    pvspin::KickPath::Userspace => "userspace",
                };
                let pv = if self.pv == PvMode::KickYield {
                    "kick+yield"
                } else {
                    "kick"
                };
                let pv = format!("{pv}{}", self.options_suffix());
                if self.pv == PvMode::KickYield && self.actuator != pvspin::ActuatorKind::default()
                {
                    format!("{lock}:{pv}:{path}:{}", self.actuator)
                } else {
                    format!("{lock}:{pv}:{path}")
                }
            }
        }
    }

    /// `base` with this variant's lock and PV settings and `hogs` hog threads.
    pub fn config(&self, base: &RunConfig, hogs: u32) -> RunConfig {
        RunConfig {
            lock: self.lock,
            pv: self.pv,
            kick_path: self.kick_path,
            actuator: self.actuator,
            wait: self.wait.unwrap_or(base.wait),
            budgets: self.budgets.unwrap_or(base.budgets),
            run_slots: match self.slots {
                Some(true) => Some(self.slot_count.or(base.run_slots).unwrap_or(0)),
                _ => base.run_slots,
            },
            vhost_user: if self.vhost {
                base.vhost_user.clone()
            } else {
                None
            },
            vhost_direct_kicks: self.vhost && (self.vhost_direct || base.vhost_direct_kicks),
            guest: self.guest.unwrap_or(base.guest),
            halt_poll_ns: self.halt_poll_ns.or(base.halt_poll_ns),
            park_spin_us: self.park_spin_us.unwrap_or(base.park_spin_us),
            vm_cpus: self.vm_cpus.or(base.vm_cpus),
            slot_quantum_us: self.slot_quantum_us.or(base.slot_quantum_us),
            hogs,
            ..base.clone()
        }
    }
}

/// What to compare.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// One case per hog count.
    pub hogs: Vec<u32>,
    /// Runs per case and variant.
    pub runs: u32,
    /// Variants; empty: the one the VM options describe.
    pub variants: Vec<Variant>,
    /// VMs per run, each its own process running the same case at once (1: in this process).
    pub vms: u32,
    /// In a child process of a multi-VM run: which case, and which VM of it.
    pub child: Option<(usize, u32)>,
    /// Where every run's JSON record goes (JSON lines: the bench's header first, then one line
    /// per run as it finishes); `pvspin-vmm report` reads it back.
    pub json_out: Option<PathBuf>,
    /// A progress bar on stderr (the caller decides: off when stderr is not a terminal).
    pub progress: bool,
    /// The command line, recorded with every run.
    pub command: Vec<String>,
    /// Runs to try again when the host's own hypervisor took too much of its CPU during them
    /// (`--max-host-steal`); `None`: every run counts.
    pub steal_bound: Option<StealBound>,
}

/// When a run counts despite the host's steal time (`--max-host-steal`, `--steal-retries`).
///
/// On a nested host (a cloud VM, a sandbox under Firecracker) the hypervisor below takes CPU
/// from the whole host at times, and every variant running then is slowed by it, some more
/// than others (a PV waiter halts, a spinner does not). A run over the bound is recorded as
/// discarded and run again in its place, so the interleaving of the cases stays as it was.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StealBound {
    /// The largest share of the host's CPU time (0 to 1) the hypervisor below may take during
    /// a run that counts.
    pub max_share: f64,
    /// How many times one run is tried again; the last try counts whatever its steal, and is
    /// counted as kept over the bound.
    pub retries: u32,
}

impl StealBound {
    /// Whether a run that saw `steal` (a share of the host's CPU time) is over the bound; a
    /// run whose steal could not be read is not.
    pub fn exceeded_by(&self, steal: Option<f64>) -> bool {
        steal.is_some_and(|s| s > self.max_share)
    }
}

/// Why a bench failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A run failed (a run stopped by its bound is a result, not this).
    #[error(transparent)]
    Run(#[from] RunError),
    /// `--json-out` could not be written.
    #[error("writing {}: {source}", path.display())]
    JsonOut {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl BenchError {
    /// The process exit code: 2 for an invalid configuration, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            BenchError::Run(err) => err.exit_code(),
            BenchError::JsonOut { .. } => 1,
        }
    }
}

/// One variant's results at one hog count.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Hog threads.
    pub hogs: u32,
    /// Which variant.
    pub variant: Variant,
    /// Guest seconds of each run; a run stopped by its bound (`--timeout-ms`) counts as the
    /// bound, and is counted in `timed_out` (its statistics are then lower bounds).
    pub seconds: Vec<f64>,
    /// Runs stopped by the bound.
    pub timed_out: u32,
    /// Multi-VM runs: per VM, its guest seconds in each run.
    pub per_vm_seconds: Vec<Vec<f64>>,
    /// Multi-VM runs: per VM, the host CPU seconds its process used in each run.
    pub per_vm_cpu: Vec<Vec<f64>>,
    /// Ping-pong runs: each run's kick-to-wake latency.
    pub kick_to_wake: Vec<LatencySummary>,
    /// Each run's share of the host's CPU time that the hypervisor below took (steal time in
    /// `/proc/stat`), `None` where it could not be read; in step with `seconds`.
    pub host_steal: Vec<Option<f64>>,
    /// Runs discarded and tried again because the host's steal passed `--max-host-steal`.
    pub rerun_for_steal: u32,
    /// Runs kept although over `--max-host-steal`, their retries spent.
    pub kept_over_steal: u32,
    /// Each run's non-critical section as its guest timed it, in ns (the lock workload's
    /// `ncs_mean_tsc`: how fast the host ran that run); `None` where not reported (other
    /// workloads, multi-VM runs, runs stopped by the bound, older saved runs). In step with
    /// `seconds`.
    pub section_ns: Vec<Option<f64>>,
}

/// A guest-timed section in ns, from its TSC cycles and the TSC's kHz (`None` for 0 of either).
pub(crate) fn section_ns(tsc: u64, tsc_khz: u64) -> Option<f64> {
    (tsc > 0 && tsc_khz > 0).then(|| tsc as f64 * 1e6 / tsc_khz as f64)
}

/// The median of `values` (0 for none).
pub(crate) fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

impl CaseResult {
    /// A case without runs yet.
    pub fn new(hogs: u32, variant: Variant) -> Self {
        Self {
            hogs,
            variant,
            seconds: Vec::new(),
            timed_out: 0,
            per_vm_seconds: Vec::new(),
            per_vm_cpu: Vec::new(),
            kick_to_wake: Vec::new(),
            host_steal: Vec::new(),
            rerun_for_steal: 0,
            kept_over_steal: 0,
            section_ns: Vec::new(),
        }
    }

    /// Adds the runs of `tried` (a scratch case of the same variant and hogs) to this one.
    fn absorb(&mut self, tried: CaseResult) {
        self.seconds.extend(tried.seconds);
        self.timed_out += tried.timed_out;
        for (per_vm, tried_per_vm) in [
            (&mut self.per_vm_seconds, tried.per_vm_seconds),
            (&mut self.per_vm_cpu, tried.per_vm_cpu),
        ] {
            if per_vm.len() < tried_per_vm.len() {
                per_vm.resize(tried_per_vm.len(), Vec::new());
            }
            for (all, new) in per_vm.iter_mut().zip(tried_per_vm) {
                all.extend(new);
            }
        }
        self.kick_to_wake.extend(tried.kick_to_wake);
        self.host_steal.extend(tried.host_steal);
        self.section_ns.extend(tried.section_ns);
    }

    /// Mean of the runs.
    pub fn mean(&self) -> f64 {
        self.seconds.iter().sum::<f64>() / self.seconds.len().max(1) as f64
    }

    /// Sample standard deviation of the runs.
    pub fn sd(&self) -> f64 {
        if self.seconds.len() < 2 {
            return 0.0;
        }
        let mean = self.mean();
        let var = self.seconds.iter().map(|s| (s - mean).powi(2)).sum::<f64>()
            / (self.seconds.len() - 1) as f64;
        var.sqrt()
    }

    /// Median of the runs.
    pub fn median(&self) -> f64 {
        median_of(&self.seconds)
    }

    /// The slowest run (0 for none): the tail the median hides.
    pub fn slowest(&self) -> f64 {
        self.seconds.iter().copied().fold(0.0, f64::max)
    }

    /// The runs net of the host's speed, where every run reported it ([`Self::section_ns`]):
    /// each run's time over its own section time, scaled to the runs' median section, so
    /// `(median, slowest)` read as seconds at one speed. The development hosts switch
    /// between about one speed and half of it within seconds (`docs/benchmarks.md` §14.15);
    /// this tells a tail of the lock from a slow stretch of the host.
    pub fn net_of_speed(&self) -> Option<(f64, f64)> {
        let sections: Vec<f64> = self.section_ns.iter().copied().collect::<Option<_>>()?;
        if sections.is_empty()
            || sections.len() != self.seconds.len()
            || sections.iter().any(|&s| s <= 0.0)
        {
            return None;
        }
        let typical = median_of(&sections);
        let net: Vec<f64> = self
            .seconds
            .iter()
            .zip(&sections)
            .map(|(s, section)| s * typical / section)
            .collect();
        Some((median_of(&net), net.iter().copied().fold(0.0, f64::max)))
    }

    /// The host's steal during the runs, where it was read and any was seen: (median, most,
    /// the slowest run's if read). Nested hosts lose CPU to the hypervisor below at times;
    /// this tells a slow run that lost it from one that did not.
    pub fn host_steal_summary(&self) -> Option<(f64, f64, Option<f64>)> {
        let read: Vec<f64> = self.host_steal.iter().flatten().copied().collect();
        let most = read.iter().copied().fold(0.0, f64::max);
        if read.is_empty() || most < 0.001 {
            return None;
        }
        let slowest = self
            .seconds
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .and_then(|(i, _)| self.host_steal.get(i).copied().flatten());
        Some((median_of(&read), most, slowest))
    }

    /// Per percentile (min, p50, p90, p99, max), the median over the runs' kick-to-wake
    /// latencies in us; `None` without samples.
    pub fn kick_to_wake_medians(&self) -> Option<[f64; 5]> {
        if self.kick_to_wake.is_empty() {
            return None;
        }
        Some(std::array::from_fn(|i| {
            median_of(
                &self
                    .kick_to_wake
                    .iter()
                    .map(|l| l.percentiles()[i])
                    .collect::<Vec<_>>(),
            )
        }))
    }
}

/// The finished table.
#[derive(Clone, Debug)]
pub struct BenchTable {
    /// What ran.
    pub title: String,
    /// The guest workload (`lock`, `pingpong`, ...).
    pub workload: String,
    /// vCPUs per VM.
    pub vcpus: u32,
    /// VMs per run.
    pub vms: u32,
    /// Host CPUs.
    pub host_cpus: usize,
    /// Acquisitions per vCPU (`pingpong`: handoffs in all).
    pub iterations: u64,
    /// Per hog count, per variant (the first variant is the baseline).
    pub cases: Vec<CaseResult>,
}

impl BenchTable {
    /// Host load of a case with `hogs` hog threads: runnable threads (vCPUs of every VM and
    /// hogs) over host CPUs.
    pub fn load(&self, hogs: u32) -> f64 {
        f64::from(self.vcpus * self.vms.max(1) + hogs) / self.host_cpus.max(1) as f64
    }

    /// The case's name in the table, e.g. `2x (2 hogs)`.
    pub fn case_label(&self, hogs: u32) -> String {
        format!("{:.0}x ({hogs} hogs)", self.load(hogs))
    }

    /// The median of `variant` at 0 hogs, if the table has it and it is not 0.
    pub fn own_1x_median(&self, variant: &Variant) -> Option<f64> {
        self.cases
            .iter()
            .find(|c| c.hogs == 0 && c.variant == *variant)
            .map(CaseResult::median)
            .filter(|m| *m > 0.0)
    }
}

#[cfg(test)]
impl BenchTable {
    /// A table of `cases` for tests: 2 vCPUs per VM on 2 host CPUs.
    pub(crate) fn for_tests(vms: u32, iterations: u64, cases: Vec<CaseResult>) -> Self {
        Self {
            title: "t".into(),
            workload: "lock".into(),
            vcpus: 2,
            vms,
            host_cpus: 2,
            iterations,
            cases,
        }
    }
}

impl fmt::Display for BenchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.title)?;
        writeln!(
            f,
            "guest seconds, less is better; mean (sd), median, slowest run, the median's change against the first \
             variant, and the median over the same variant's median at 0 hogs (T1x); '>' marks runs stopped by the bound"
        )?;
        let mut baseline = None;
        for case in &self.cases {
            if baseline.map(|(hogs, _)| hogs) != Some(case.hogs) {
                baseline = Some((case.hogs, case.median()));
            }
            let base = baseline.map_or(case.median(), |(_, median)| median);
            let change = if base > 0.0 {
                format!("{:+.1}%", (case.median() / base - 1.0) * 100.0)
            } else {
                "n/a".into()
            };
            let t1x = self
                .own_1x_median(&case.variant)
                .map_or("n/a".into(), |m| format!("{:.2}", case.median() / m));
            let bound = if case.timed_out > 0 { ">" } else { "" };
            writeln!(
                f,
                "case {:<12} {:<34} {bound}{:>9.4} ({:.4})  median {bound}{:.4}  slowest {bound}{:.4}  {change:>7}  T/T1x {t1x:>6}  runs: {}{}",
                self.case_label(case.hogs),
                case.variant.name(),
                case.mean(),
                case.sd(),
                case.median(),
                case.slowest(),
                case.seconds
                    .iter()
                    .map(|s| format!("{s:.4}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                if case.timed_out > 0 {
                    format!(" ({} stopped by the bound)", case.timed_out)
                } else {
                    String::new()
                }
            )?;
            if let Some((median, slowest)) = case.net_of_speed() {
                writeln!(
                    f,
                    "    net of the host's speed (each run over its own guest-timed section, at the runs' median speed): median {median:.4}  slowest {slowest:.4}  slowest/median {:.2} (as run: {:.2})",
                    slowest / median.max(f64::MIN_POSITIVE),
                    case.slowest() / case.median().max(f64::MIN_POSITIVE)
                )?;
            }
            if let Some([min, p50, p90, p99, max]) = case.kick_to_wake_medians() {
                let worst = case
                    .kick_to_wake
                    .iter()
                    .map(|l| l.max_us)
                    .fold(0.0, f64::max);
                writeln!(
                    f,
                    "    kick-to-wake us, median of the runs: min {min:.1}  p50 {p50:.1}  p90 {p90:.1}  p99 {p99:.1}  max {max:.1}; worst run's max {worst:.1}"
                )?;
            }
            if let Some((median, most, slowest)) = case.host_steal_summary() {
                let slowest = slowest.map_or(String::new(), |s| {
                    format!("; the slowest run's {:.1}%", s * 100.0)
                });
                writeln!(
                    f,
                    "    host CPU taken by the hypervisor below (steal) during the runs: median {:.1}%, most {:.1}%{slowest}",
                    median * 100.0,
                    most * 100.0
                )?;
            }
            if case.rerun_for_steal > 0 || case.kept_over_steal > 0 {
                writeln!(
                    f,
                    "    runs tried again because the host's steal passed --max-host-steal: {}; kept over it, retries spent: {}",
                    case.rerun_for_steal, case.kept_over_steal
                )?;
            }
            let total_cpu: f64 = case.per_vm_cpu.iter().map(|c| median_of(c)).sum();
            for (i, (secs, cpu)) in case.per_vm_seconds.iter().zip(&case.per_vm_cpu).enumerate() {
                let share = if total_cpu > 0.0 {
                    median_of(cpu) / total_cpu
                } else {
                    0.0
                };
                writeln!(
                    f,
                    "    VM {i}: guest seconds median {:.4}, host CPU seconds median {:.3} ({:.0}% of the VMs' CPU time)",
                    median_of(secs),
                    median_of(cpu),
                    share * 100.0
                )?;
            }
        }
        Ok(())
    }
}

/// The progress bar on stderr: case, variant and run, with the time left.
struct Progress(Option<ProgressBar>);

impl Progress {
    fn new(shown: bool, runs: u64) -> Self {
        if !shown || runs == 0 {
            return Self(None);
        }
        // Runs are interleaved, so every round of runs costs about the same: the time left is
        // the time so far per run finished, times the runs left (steadier than a moving rate).
        let left = |state: &ProgressState, w: &mut dyn fmt::Write| {
            let done = state.pos();
            let total = state.len().unwrap_or(done);
            let text = if done == 0 {
                "?".to_string()
            } else {
                let secs = state.elapsed().as_secs_f64() / done as f64 * (total - done) as f64;
                format_duration(secs)
            };
            let _ = w.write_str(&text);
        };
        let style = ProgressStyle::with_template(
            "{bar:20.cyan/blue} {pos}/{len} runs [{elapsed}, ~{left} left] {wide_msg}",
        )
        .map_or_else(
            |_| ProgressStyle::default_bar(),
            |s| s.with_key("left", left),
        )
        .progress_chars("=> ");
        let bar = ProgressBar::with_draw_target(Some(runs), ProgressDrawTarget::stderr());
        bar.set_style(style);
        bar.enable_steady_tick(std::time::Duration::from_secs(1));
        Self(Some(bar))
    }

    /// Names the run now starting.
    fn start(&self, case: &str, variant: &str, run: u32, runs: u32) {
        if let Some(bar) = &self.0 {
            bar.set_message(format!("{case} {variant}, run {}/{runs}", run + 1));
        }
    }

    fn finished_one(&self) {
        if let Some(bar) = &self.0 {
            bar.inc(1);
        }
    }

    /// A line on stderr that does not tear the bar.
    fn note(&self, text: &str) {
        match &self.0 {
            Some(bar) => bar.suspend(|| eprintln!("{text}")),
            None => eprintln!("{text}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// The host's CPU time so far, from the first line of `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostCpuTimes {
    /// Time the hypervisor below ran something else while this host's CPUs wanted to run.
    steal: u64,
    /// All of it: user, nice, system, idle, iowait, irq, softirq and steal.
    total: u64,
}

impl HostCpuTimes {
    /// Now; `None` where `/proc/stat` cannot be read or has no steal column.
    pub(crate) fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        (fields.len() == 8).then(|| Self {
            steal: fields[7],
            total: fields.iter().sum(),
        })
    }

    fn share_until(self, later: Self) -> Option<f64> {
        let total = later.total.checked_sub(self.total)?;
        let steal = later.steal.checked_sub(self.steal)?;
        (total > 0).then(|| steal as f64 / total as f64)
    }
}

/// `secs` as `1h02m`, `3m05s` or `42s`.
fn format_duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// In `--pv-backend vhost-user:PATH` of a multi-VM bench: the VM's index (each VM needs a socket
/// of its own).
pub const VM_PLACEHOLDER: &str = "{vm}";

/// One run of case `k` as `vms` VMs at once, each a child process of this one running the same
/// command line with `--child-case k --child-vm i`. The run's time is the slowest VM's. Returns
/// each VM's record.
fn run_vms(
    k: usize,
    case: &mut CaseResult,
    vms: u32,
    timeout_ms: u64,
    progress: &Progress,
) -> Result<Vec<VmRecord>, RunError> {
    let exe = std::env::current_exe()
        .map_err(|e| RunError::Setup(format!("finding this executable: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for i in 0..vms {
        let child = std::process::Command::new(&exe)
            .args(&args)
            .args(["--child-case", &k.to_string(), "--child-vm", &i.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| RunError::Setup(format!("starting VM {i}: {e}")))?;
        children.push(child);
    }
    case.per_vm_seconds.resize(vms as usize, Vec::new());
    case.per_vm_cpu.resize(vms as usize, Vec::new());
    let mut slowest: f64 = 0.0;
    let mut stopped = false;
    let mut records = Vec::new();
    for (i, mut child) in children.into_iter().enumerate() {
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        }
        let (status, cpu) = wait_with_rusage(child.id())?;
        let report = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        let seconds = match (status, &report) {
            (0, Some(report)) => report["guest_seconds"].as_f64().unwrap_or(0.0),
            _ => {
                // A VM stopped by its bound (or failed): record the bound, as single-VM runs do.
                progress.note(&format!(
                    "pvspin-vmm bench: {} VM {i} ended with status {status}",
                    case.variant.name()
                ));
                stopped = true;
                timeout_ms as f64 / 1000.0
            }
        };
        case.per_vm_seconds[i].push(seconds);
        case.per_vm_cpu[i].push(cpu);
        slowest = slowest.max(seconds);
        records.push(VmRecord {
            vm: i as u32,
            status,
            guest_seconds: seconds,
            cpu_seconds: cpu,
            report,
        });
    }
    case.seconds.push(slowest);
    case.section_ns.push(None);
    if stopped {
        case.timed_out += 1;
    }
    Ok(records)
}

/// Waits for child `pid`; returns its exit status (or 128 + signal) and the CPU seconds it used.
pub(crate) fn wait_with_rusage(pid: u32) -> Result<(i32, f64), RunError> {
    let mut status = 0;
    // SAFETY: rusage is plain data, written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = libc::pid_t::try_from(pid).map_err(|_| RunError::Setup("bad pid".into()))?;
    // SAFETY: waits for our own child; both out-pointers are valid for the call.
    let ret = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if ret != pid {
        return Err(RunError::Setup(format!(
            "waiting for VM process {pid}: {}",
            std::io::Error::last_os_error()
        )));
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok((code, secs(usage.ru_utime) + secs(usage.ru_stime)))
}

/// Runs every case `runs` times, interleaved; every run's record goes to `--json-out` as it
/// finishes. Prints nothing on stdout (but for a multi-VM run's child, whose report the parent
/// reads there).
pub fn run(vm: &VmArgs, options: &BenchOptions) -> Result<BenchTable, BenchError> {
    run_with(vm, options, vmm::run)
}

/// [`run`] with `runner` in place of [`vmm::run`] for the runs in this process (tests feed it
/// made-up reports).
pub fn run_with<R>(vm: &VmArgs, options: &BenchOptions, runner: R) -> Result<BenchTable, BenchError>
where
    R: FnMut(&RunConfig) -> Result<RunReport, RunError>,
{
    run_with_host_times(vm, options, runner, HostCpuTimes::read)
}

/// [`run_with`], reading the host's CPU times with `host_times` around every run.
fn run_with_host_times<R, H>(
    vm: &VmArgs,
    options: &BenchOptions,
    mut runner: R,
    mut host_times: H,
) -> Result<BenchTable, BenchError>
where
    R: FnMut(&RunConfig) -> Result<RunReport, RunError>,
    H: FnMut() -> Option<HostCpuTimes>,
{
    let base = RunConfig {
        echo_console: false,
        ..vm.config(0)
    };
    let variants = if options.variants.is_empty() {
        vec![Variant {
            lock: base.lock,
            pv: base.pv,
            kick_path: base.kick_path,
            actuator: base.actuator,
            wait: None,
            budgets: None,
            slots: None,
            vhost: base.vhost_user.is_some(),
            vhost_direct: false,
            guest: None,
            halt_poll_ns: None,
            park_spin_us: None,
            vm_cpus: None,
            slot_quantum_us: None,
            slot_count: None,
        }]
    } else {
        options.variants.clone()
    };
    if let Some(variant) = variants
        .iter()
        .find(|v| v.vhost && base.vhost_user.is_none())
    {
        return Err(RunError::Refused(format!(
            "variant {} needs the backend's socket: --pv-backend vhost-user:PATH",
            variant.name()
        ))
        .into());
    }
    let cases: Vec<CaseResult> = options
        .hogs
        .iter()
        .flat_map(|&hogs| {
            variants
                .iter()
                .map(move |&variant| CaseResult::new(hogs, variant))
        })
        .collect();
    // Check every configuration before spending minutes on the first ones.
    for case in &cases {
        case.variant
            .config(&base, case.hogs)
            .validate(u32::MAX)
            .map_err(RunError::from)?;
    }
    // A vhost-user socket serves one VM at a time: VMs run side by side need one each.
    let vhost_variant = cases.iter().any(|c| c.variant.vhost);
    if let (true, true, Some(path)) = (options.vms > 1, vhost_variant, &base.vhost_user) {
        if !path.to_string_lossy().contains(VM_PLACEHOLDER) {
            return Err(RunError::Refused(format!(
                "--vms {} with vhost-user variants needs a socket per VM: put {VM_PLACEHOLDER} in the \
                 --pv-backend path (replaced by the VM's index), and serve each with pvspind",
                options.vms
            ))
            .into());
        }
    }
    if let Some((k, vm_index)) = options.child {
        let case = cases
            .get(k)
            .ok_or(RunError::Refused(format!("no case {k}")))?;
        // The case's hogs belong to the first VM only.
        let hogs = if vm_index == 0 { case.hogs } else { 0 };
        let mut config = case.variant.config(&base, hogs);
        config.vhost_user = config.vhost_user.map(|path| {
            path.to_string_lossy()
                .replace(VM_PLACEHOLDER, &vm_index.to_string())
                .into()
        });
        let report = runner(&config)?;
        // The parent reads this line from the pipe.
        crate::cli::print_stdout(&report.to_json());
        return Ok(BenchTable {
            title: String::new(),
            workload: String::new(),
            vcpus: vm.vcpus,
            vms: 1,
            host_cpus: 0,
            iterations: vm.iterations,
            cases: Vec::new(),
        });
    }
    let workload = vmm::workload_name(base.workload);
    let mut table = BenchTable {
        title: format!(
            "{}{workload} workload on {} vCPUs ({} mode{}), {} {} each, cs {} ncs {}, {} runs per case, interleaved",
            if options.vms > 1 {
                format!("{} VMs at once, separate processes, each: ", options.vms)
            } else {
                String::new()
            },
            vm.vcpus,
            if base.user_mode { "user" } else { "kernel" },
            vm.cpu_limit
                .map_or(String::new(), |cpus| format!(", under a {cpus}-CPU limit")),
            vm.iterations,
            if workload == "pingpong" { "handoffs" } else { "acquisitions" },
            vm.cs_work,
            vm.ncs_work,
            options.runs
        ),
        workload: workload.to_string(),
        vcpus: vm.vcpus,
        vms: options.vms.max(1),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        iterations: vm.iterations,
        cases,
    };
    let mut json = match &options.json_out {
        Some(path) => Some(JsonLines::create(path)?),
        None => None,
    };
    if let Some(json) = &mut json {
        json.write(&Record::Bench(BenchHeader::new(&table, options)))?;
    }
    let labels: Vec<String> = table
        .cases
        .iter()
        .map(|c| table.case_label(c.hogs))
        .collect();
    let progress = Progress::new(
        options.progress,
        u64::from(options.runs) * table.cases.len() as u64,
    );
    let count = table.cases.len();
    for run in 0..options.runs {
        // Each round starts one case later than the last: a case that always ran first (or
        // right after the same neighbour) would carry whatever that position costs on a
        // machine into every one of its runs (docs/benchmarks.md §12.6).
        for k in (0..count).map(|i| (i + run as usize) % count) {
            let case = &mut table.cases[k];
            let name = case.variant.name();
            progress.start(&labels[k], &name, run, options.runs);
            for attempt in 0.. {
                let mut tried = CaseResult::new(case.hogs, case.variant);
                let steal_before = host_times();
                let mut record = RunRecord {
                    variant: name.clone(),
                    hogs: case.hogs,
                    case: labels[k].clone(),
                    case_index: k,
                    run,
                    guest_seconds: 0.0,
                    timed_out: false,
                    vms: Vec::new(),
                    command: options.command.clone(),
                    report: None,
                    host_steal: None,
                    discarded_for_steal: false,
                    over_steal_bound: false,
                };
                if options.vms > 1 {
                    record.vms = run_vms(k, &mut tried, options.vms, vm.timeout_ms, &progress)?;
                } else {
                    match runner(&tried.variant.config(&base, tried.hogs)) {
                        Ok(report) => {
                            tried.seconds.push(report.guest_seconds);
                            tried
                                .section_ns
                                .push(section_ns(report.ncs_mean_tsc, report.tsc_khz));
                            tried.kick_to_wake.extend(report.kick_to_wake.clone());
                            record.report = serde_json::to_value(&report).ok();
                        }
                        // A collapse is a result, not an error: record the bound.
                        Err(RunError::Timeout { limit_ms, .. }) => {
                            progress.note(&format!(
                                "pvspin-vmm bench: {} with {} hogs stopped by its {limit_ms} ms bound",
                                record.variant, tried.hogs
                            ));
                            tried.seconds.push(limit_ms as f64 / 1000.0);
                            tried.section_ns.push(None);
                            tried.timed_out += 1;
                        }
                        Err(err) => return Err(err.into()),
                    }
                }
                record.timed_out = tried.timed_out > 0;
                record.guest_seconds = tried.seconds.last().copied().unwrap_or(0.0);
                record.host_steal = steal_before
                    .zip(host_times())
                    .and_then(|(before, after)| before.share_until(after));
                tried.host_steal.push(record.host_steal);
                let over = options
                    .steal_bound
                    .filter(|bound| bound.exceeded_by(record.host_steal));
                if let Some(bound) = over {
                    if attempt < bound.retries {
                        progress.note(&format!(
                            "pvspin-vmm bench: {} with {} hogs, run {}: the host lost {:.1}% of its CPU to steal (bound {:.1}%); running it again",
                            record.variant,
                            tried.hogs,
                            run + 1,
                            record.host_steal.unwrap_or(0.0) * 100.0,
                            bound.max_share * 100.0
                        ));
                        record.discarded_for_steal = true;
                        case.rerun_for_steal += 1;
                        if let Some(json) = &mut json {
                            json.write(&Record::Run(record))?;
                        }
                        continue;
                    }
                    record.over_steal_bound = true;
                    case.kept_over_steal += 1;
                }
                case.absorb(tried);
                if let Some(json) = &mut json {
                    json.write(&Record::Run(record))?;
                }
                break;
            }
            progress.finished_one();
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(hogs: u32, variant: &str, seconds: &[f64]) -> CaseResult {
        CaseResult {
            seconds: seconds.to_vec(),
            ..CaseResult::new(hogs, Variant::parse(variant).unwrap())
        }
    }

    #[test]
    fn runs_net_of_the_hosts_speed() {
        // The slow run ran at half speed: net of it, it is as fast as the first; the third
        // is slower at full speed, and stays the slowest.
        let mut c = case(0, "ticket:kick", &[1.0, 2.0, 1.1]);
        c.section_ns = vec![Some(10_000.0), Some(20_000.0), Some(10_000.0)];
        let (median, slowest) = c.net_of_speed().unwrap();
        assert!((median - 1.0).abs() < 1e-9, "{median}");
        assert!((slowest - 1.1).abs() < 1e-9, "{slowest}");
        let table = BenchTable::for_tests(1, 10, vec![c.clone()]);
        assert!(
            table
                .to_string()
                .contains("slowest/median 1.10 (as run: 1.82)"),
            "{table}"
        );
        // A run without its speed: no line.
        c.section_ns[1] = None;
        assert_eq!(c.net_of_speed(), None);
        assert_eq!(section_ns(0, 2_000_000), None);
        assert_eq!(section_ns(20_000, 2_000_000), Some(10_000.0));
    }

    #[test]
    fn host_steal_is_read_from_proc_stat_and_summarized() {
        let before = HostCpuTimes::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n").unwrap();
        assert_eq!(
            before,
            HostCpuTimes {
                steal: 35,
                total: 1000
            }
        );
        let after = HostCpuTimes::parse("cpu  150 0 60 860 10 0 5 115 0 0\n").unwrap();
        assert_eq!(before.share_until(after), Some(0.4));
        assert_eq!(
            after.share_until(before),
            None,
            "the counters never go back"
        );
        assert_eq!(
            HostCpuTimes::parse("cpu  1 2 3 4\n"),
            None,
            "no steal column"
        );
        let mut c = case(0, "ticket:off", &[1.0, 3.0, 2.0]);
        assert_eq!(c.host_steal_summary(), None, "not read");
        c.host_steal = vec![Some(0.0), Some(0.0), None];
        assert_eq!(c.host_steal_summary(), None, "none seen");
        c.host_steal = vec![Some(0.02), Some(0.2), Some(0.1)];
        assert_eq!(c.host_steal_summary(), Some((0.1, 0.2, Some(0.2))));
        let table = BenchTable::for_tests(1, 1, vec![c]);
        let text = table.to_string();
        assert!(
            text.contains(
                "(steal) during the runs: median 10.0%, most 20.0%; the slowest run's 20.0%"
            ),
            "{text}"
        );
    }

    #[test]
    fn runs_over_the_steal_bound_are_run_again_and_saved_as_discarded() {
        let dir = std::env::temp_dir().join(format!("pvspin-steal-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("runs.jsonl");
        let cli = <crate::cli::Cli as clap::Parser>::try_parse_from([
            "pvspin-vmm",
            "bench",
            "--hogs",
            "0",
            "--variants",
            "ticket:off,ticket:kick",
        ])
        .unwrap();
        let crate::cli::CliCommand::Bench(args) = cli.command else {
            panic!("expected bench")
        };
        let options = BenchOptions {
            hogs: vec![0],
            runs: 2,
            variants: args.variants.clone(),
            vms: 1,
            child: None,
            json_out: Some(json.clone()),
            progress: false,
            command: Vec::new(),
            steal_bound: Some(StealBound {
                max_share: 0.1,
                retries: 2,
            }),
        };
        // Steal per try, in the order run (round 1 starts with the second case): off clean;
        // kick over the bound, then clean; kick over it three times, kept at the third, its
        // two retries spent; off clean.
        let mut steal_per_try = [0.0, 0.5, 0.05, 0.3, 0.3, 0.3, 0.0].into_iter();
        let mut clock = HostCpuTimes { steal: 0, total: 0 };
        let mut reads = 0;
        let mut runs = 0;
        let table = run_with_host_times(
            &args.vm,
            &options,
            |config| {
                runs += 1;
                Ok(RunReport::made_up(config, f64::from(runs)))
            },
            || {
                // Even reads end a try: 100 ticks, of which this try's share stolen.
                reads += 1;
                if reads % 2 == 0 {
                    let share = steal_per_try.next().expect("no more tries than scripted");
                    clock.total += 100;
                    clock.steal += (share * 100.0) as u64;
                }
                Some(clock)
            },
        )
        .unwrap();
        assert_eq!(runs, 7);
        let off = &table.cases[0];
        let kick = &table.cases[1];
        assert_eq!(off.seconds, [1.0, 7.0]);
        assert_eq!((off.rerun_for_steal, off.kept_over_steal), (0, 0));
        assert_eq!(kick.seconds, [3.0, 6.0]);
        assert_eq!((kick.rerun_for_steal, kick.kept_over_steal), (3, 1));
        assert_eq!(kick.host_steal, [Some(0.05), Some(0.3)]);
        let text = table.to_string();
        assert!(
            text.contains("steal passed --max-host-steal: 3; kept over it, retries spent: 1"),
            "{text}"
        );
        // Saved, the discarded tries are marked, and the table reads back the same.
        let saved = std::fs::read_to_string(&json).unwrap();
        assert_eq!(
            saved.matches("\"discarded_for_steal\":true").count(),
            3,
            "{saved}"
        );
        assert_eq!(
            saved.matches("\"over_steal_bound\":true").count(),
            1,
            "{saved}"
        );
        let tables = crate::saved::load(&json).unwrap();
        assert_eq!(tables[0].to_string(), text);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn statistics() {
        let c = case(0, "ticket:off", &[1.0, 2.0, 3.0, 10.0]);
        assert!((c.mean() - 4.0).abs() < 1e-12);
        assert!((c.median() - 2.5).abs() < 1e-12);
        assert!((case(0, "tas", &[1.0, 2.0, 3.0]).sd() - 1.0).abs() < 1e-12);
        assert_eq!(case(0, "tas", &[5.0]).sd(), 0.0);
    }

    #[test]
    fn variants_round_trip_and_refuse_garbage() {
        for name in [
            "ticket:off",
            "queued:kick:userspace",
            "ticket:kick:signal-msi",
            "ticket:kick+yield:in-kernel",
            "queued:kick+yield:userspace",
            "backoff:off",
            "backoff:kick:in-kernel",
        ] {
            assert_eq!(Variant::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            Variant::parse("ticket:kick").unwrap().name(),
            "ticket:kick:in-kernel"
        );
        assert!(Variant::parse("mcs:off").is_err());
        assert!(Variant::parse("ticket:maybe").is_err());
        assert!(Variant::parse("ticket:kick:carrier-pigeon").is_err());
        assert!(Variant::parse("ticket:off:in-kernel:x").is_err());
    }

    #[test]
    fn variants_pick_the_guest_and_stock_rules_apply_per_variant() {
        for name in [
            "queued:kick:in-kernel@stock",
            "queued:kick:signal-msi@pvspin",
            "ticket:off@stock",
            "queued:kick/spins:in-kernel@stock",
        ] {
            assert_eq!(Variant::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            Variant::parse("queued:kick@stock").unwrap().name(),
            "queued:kick:in-kernel@stock"
        );
        assert!(Variant::parse("queued:kick@linux").is_err());
        assert!(Variant::parse("queued:kick:userspace@").is_err());
        let base = RunConfig::default();
        let stock = Variant::parse("queued:kick@stock").unwrap();
        let pvspin = Variant::parse("queued:kick@pvspin").unwrap();
        let default = Variant::parse("queued:kick").unwrap();
        assert_eq!(stock.config(&base, 0).guest, GuestKind::Stock);
        assert_eq!(pvspin.config(&base, 0).guest, GuestKind::Pvspin);
        let stock_base = RunConfig {
            guest: GuestKind::Stock,
            ..base.clone()
        };
        assert_eq!(default.config(&stock_base, 0).guest, GuestKind::Stock);
        // One table, both guests, each with its own spin threshold.
        assert_eq!(stock.config(&base, 2).guest_spin_threshold(), 1 << 15);
        assert_eq!(pvspin.config(&base, 2).guest_spin_threshold(), 128);
        assert_eq!(stock.config(&base, 2).validate(8), Ok(()));
        // A stock guest has no PV ticket lock and needs the in-kernel LAPIC.
        for refused in ["ticket:kick@stock", "queued:kick:userspace@stock"] {
            let variant = Variant::parse(refused).unwrap();
            assert!(variant.config(&base, 0).validate(8).is_err(), "{refused}");
        }
    }

    #[test]
    fn table_labels_overcommit_and_compares_with_the_first_variant() {
        let table = BenchTable::for_tests(
            1,
            10,
            vec![
                case(0, "ticket:off", &[1.0]),
                case(0, "ticket:kick", &[0.5]),
                case(4, "ticket:off", &[3.0]),
                case(4, "ticket:kick", &[0.3]),
            ],
        );
        let text = table.to_string();
        assert!(text.contains("case 1x (0 hogs)"), "{text}");
        assert!(text.contains("case 3x (4 hogs)"), "{text}");
        assert!(text.contains("-50.0%"), "{text}");
        assert!(text.contains("-90.0%"), "{text}");
        // T/T1x: each variant against its own 0-hog median.
        assert!(text.contains("T/T1x   3.00"), "{text}");
        assert!(text.contains("T/T1x   0.60"), "{text}");
    }

    #[test]
    fn multi_vm_cases_count_every_vm_and_show_each_share() {
        let mut c = case(0, "ticket:kick", &[2.0]);
        c.per_vm_seconds = vec![vec![2.0], vec![1.5]];
        c.per_vm_cpu = vec![vec![3.0], vec![1.0]];
        let table = BenchTable::for_tests(2, 10, vec![c]);
        let text = table.to_string();
        assert!(text.contains("case 2x (0 hogs)"), "{text}");
        assert!(text.contains("VM 0: guest seconds median 2.0000"), "{text}");
        assert!(text.contains("(75% of the VMs' CPU time)"), "{text}");
        assert!(text.contains("(25% of the VMs' CPU time)"), "{text}");
    }
}
