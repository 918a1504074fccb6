//! pvspin's one telemetry surface: [`crate::PvSpin::telemetry`] returns a [`VmTelemetry`]
//! snapshot of everything pvspin and KVM count for one VM, rendered as JSON
//! ([`VmTelemetry::to_json`]) or in the Prometheus text exposition format, version 0.0.4
//! ([`VmTelemetry::to_prometheus`]).
//!
//! Every counter means what its name says. What a configuration or a kick path cannot count
//! is absent (`None` in Rust, a missing key in JSON, no sample in Prometheus), never a 0; a
//! count that stands in for one pvspin cannot take is named after its source. The one such
//! case: a valid kick on the in-kernel path never leaves the kernel (ioeventfd, irqfd, MSI),
//! so pvspin cannot count it; KVM's per-vCPU `halt_wakeup` (wake-ups of the halted vCPU by a
//! kick *or any other interrupt*, read from the vCPU's stats fd) stands in, as
//! [`KickCounts::kvm_halt_wakeups`] and `source="kvm_halt_wakeup"`.
//!
//! Per-vCPU counts since the vCPU's `configure_vcpu` (KVM's cumulative stats as deltas from
//! then); VM-wide counts since the VM's `configure_vm`.
//!
//! # Prometheus families, and which configuration has them
//!
//! Per vCPU (label `vcpu`):
//!
//! | family | present |
//! |---|---|
//! | `pvspin_vcpu_runs_total`, `pvspin_vcpu_exits_total{kind}`, `pvspin_vcpu_run_seconds_total` | always (returns from `KVM_RUN` seen by the hooks, by [`ExitKind`], time inside `KVM_RUN`) |
//! | `pvspin_vcpu_configured` (gauge, 0 or 1), `pvspin_vcpu_runs_before_all_configured_total` | always: whether `configure_vcpu` ran for the vCPU, and its runs made before every vCPU was configured |
//! | `pvspin_kicks_total{path,source="pvspin"}` | with a kick device: every valid kick to the vCPU on the signal-msi and userspace paths; on the in-kernel path only the kicks that reached userspace anyway (delivered by the fallback MSI) |
//! | `pvspin_kick_wakeups_total{path="in_kernel",source="kvm_halt_wakeup"}` | in-kernel path, when KVM has a stats fd: KVM's `halt_wakeup`, an upper bound on the kicks that woke the vCPU from a halt (a kick to a vCPU that is not halted wakes nothing and is not counted) |
//! | `pvspin_rejected_guest_inputs_total{reason}` | with a kick device, per reason seen (doorbell rejects by [`crate::Reject::name`], `bad_hint_page`) |
//! | `pvspin_spin_notifications_total`, `pvspin_yields_attempted_total`, `pvspin_yields_successful_total` | with directed yield |
//! | `pvspin_kick_to_wake_latency_seconds` (histogram: `_bucket{le}`, `_sum`, `_count`) | userspace path only: there pvspin sees both the kick and the wake-up; on the other paths the wake-up happens inside KVM |
//! | `pvspin_budget_wait_after_seconds`, `pvspin_budget_notify_after_seconds` (gauges) | with hint pages; the second only with directed yield (without it the page says "never notify") |
//! | `kvm_vcpu_<stat>` | when KVM has vCPU stats fds (`KVM_GET_STATS_FD`) |
//!
//! Per VM:
//!
//! | family | present |
//! |---|---|
//! | `pvspin_kick_device_accesses_total{path}`, `pvspin_kick_device_kicks_in_userspace_total{path}`, `pvspin_kick_device_forwarded_total{path}`, `pvspin_kick_device_rejected_total{path,reason}` | with a kick device: doorbell accesses that exited to userspace ([`KickStats`]) |
//! | `pvspin_kick_device_msis_total{path,outcome}` | signal-msi path, and the in-kernel path's fallback (`outcome`: `delivered`, `not_delivered`, `failed`) |
//! | `pvspin_kick_device_in_kernel_missed_total` | in-kernel path: valid kicks that reached userspace because their ioeventfd missed them (not registered, or registered with a `u64` datamatch); pvspin's fallback still delivers each by `KVM_SIGNAL_MSI` (also counted in `pvspin_kick_device_msis_total`), at the cost of an exit |
//! | `pvspin_kick_device_latch_total{outcome}`, `pvspin_kick_device_parks_total{kind}` | userspace path (`outcome`: `woke_parked`, `latched`, `coalesced`; `kind`: `hlt`, `wait`) |
//! | `pvspin_directed_yield_notifications_total`, `pvspin_directed_yield_decisions_total{decision}`, `pvspin_directed_yield_<what>_total` (`boosted`, `descheduled`, `hint_not_ready`, `hint_self`, `window_reads`, `trial_skipped`) | with directed yield ([`DirectedYieldStats`]) |
//! | `pvspin_boost_trial_epochs_total{boosting}`, `pvspin_boost_trial_boosting`, `pvspin_boost_trial_mean_wait_seconds{boosting}` | with directed yield's boost trial; the mean once measured |
//! | `pvspin_hint_page_registrations_total`, `pvspin_hint_page_bad_registrations_total`, `pvspin_hint_wait_reports_total`, `pvspin_waits_total` | with hint pages ([`HintStats`]) |
//! | `pvspin_waits_kick_pending_total`, `pvspin_waits_timed_out_total` | with hint pages, userspace path only |
//! | `pvspin_run_slots`, `pvspin_run_slot_<what>_total` (`grants`, `waits`, `prioritized_grants`, `hand_overs`, `preemptions`, `extensions`, `steal_time_marks`, `lends`, `reclaims`, `watch_polls`, `watch_reads`, `watch_read_errors`), `pvspin_run_slot_max_wait_seconds`, `pvspin_run_slot_max_over_seconds`, `pvspin_run_slot_max_held` | with run slots ([`SlotTelemetry`]) |
//! | `kvm_vm_<stat>` | when KVM has a VM stats fd |
//! | `pvspin_adoption_problems_total{problem}` | one sample per adopter mistake found ([`crate::PvSpin::check`], `problem` = [`crate::ProblemKind::name`]); none when none was found |
//!
//! KVM stats: cumulative stats are counters (`_total`), instant and peak stats gauges,
//! histograms histograms. Stats in seconds are converted to seconds and named `..._seconds` (a
//! trailing `_ns` is dropped), stats in bytes are named `..._bytes`. KVM histograms have no
//! `_sum` (KVM does not report one). A bucket `[a, b)` of integer values becomes
//! `le = (b - 1) * scale`.

mod cell;
pub(crate) mod collect;
mod histogram;
mod prometheus;

use std::collections::BTreeMap;

use pvspin_kick::{KickPath, KickStats, Reject};
use pvspin_kvm::stats::Snapshot;
use serde::ser::SerializeMap;
use serde::Serialize;

use crate::{DirectedYieldStats, HintStats, Problem};

pub(crate) use cell::VcpuCounterCell;
pub use histogram::{LatencyHistogram, LATENCY_BOUNDS_NS};

/// Errors of the telemetry module.
#[derive(Debug, thiserror::Error, PartialEq, Eq, displaydoc::Display)]
pub enum TelemetryError {
    /// unknown telemetry format {0:?} (expected json or prometheus)
    UnknownFormat(
        /// The format as the user typed it: it matched no known name, so no type holds it.
        String,
    ),
}

/// Kinds of `KVM_RUN` outcomes pvspin counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExitKind {
    /// Port I/O (`KVM_EXIT_IO`).
    Io,
    /// MMIO (`KVM_EXIT_MMIO`).
    Mmio,
    /// `KVM_EXIT_HLT` (only without an in-kernel irqchip).
    Hlt,
    /// `KVM_RUN` returned `EINTR` (a signal or `immediate_exit`).
    Interrupted,
    /// `KVM_EXIT_SHUTDOWN`, `KVM_EXIT_FAIL_ENTRY`, `KVM_EXIT_INTERNAL_ERROR` or another error.
    Failure,
    /// Anything else.
    Other,
}

impl ExitKind {
    /// Every kind.
    pub const ALL: [ExitKind; 6] = [
        ExitKind::Io,
        ExitKind::Mmio,
        ExitKind::Hlt,
        ExitKind::Interrupted,
        ExitKind::Failure,
        ExitKind::Other,
    ];

    /// A short name, for reports and labels.
    pub fn name(self) -> &'static str {
        match self {
            ExitKind::Io => "io",
            ExitKind::Mmio => "mmio",
            ExitKind::Hlt => "hlt",
            ExitKind::Interrupted => "interrupted",
            ExitKind::Failure => "failure",
            ExitKind::Other => "other",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The kind of a `KVM_RUN` that returned with `kvm_run.exit_reason` = `reason`, for a VMM
    /// whose run loop does not see `kvm_ioctls::VcpuExit` (with
    /// [`VcpuHooks::handle_exit_kind`](crate::VcpuHooks::handle_exit_kind)). KVM sets
    /// `KVM_EXIT_INTR` when `KVM_RUN` returns `EINTR` (a signal, `immediate_exit`).
    pub fn from_exit_reason(reason: u32) -> ExitKind {
        use kvm_bindings as kb;
        match reason {
            kb::KVM_EXIT_IO => ExitKind::Io,
            kb::KVM_EXIT_MMIO => ExitKind::Mmio,
            kb::KVM_EXIT_HLT => ExitKind::Hlt,
            kb::KVM_EXIT_INTR => ExitKind::Interrupted,
            kb::KVM_EXIT_SHUTDOWN | kb::KVM_EXIT_FAIL_ENTRY | kb::KVM_EXIT_INTERNAL_ERROR => {
                ExitKind::Failure
            }
            _ => ExitKind::Other,
        }
    }
}

/// Returns from `KVM_RUN` by [`ExitKind`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExitCounts {
    /// [`ExitKind::Io`].
    pub io: u64,
    /// [`ExitKind::Mmio`].
    pub mmio: u64,
    /// [`ExitKind::Hlt`].
    pub hlt: u64,
    /// [`ExitKind::Interrupted`].
    pub interrupted: u64,
    /// [`ExitKind::Failure`].
    pub failure: u64,
    /// [`ExitKind::Other`].
    pub other: u64,
}

impl ExitCounts {
    fn from_array(a: [u64; ExitKind::ALL.len()]) -> Self {
        let [io, mmio, hlt, interrupted, failure, other] = a;
        Self {
            io,
            mmio,
            hlt,
            interrupted,
            failure,
            other,
        }
    }

    /// The count of one kind.
    pub fn get(&self, kind: ExitKind) -> u64 {
        match kind {
            ExitKind::Io => self.io,
            ExitKind::Mmio => self.mmio,
            ExitKind::Hlt => self.hlt,
            ExitKind::Interrupted => self.interrupted,
            ExitKind::Failure => self.failure,
            ExitKind::Other => self.other,
        }
    }

    /// All kinds together (saturating).
    pub fn total(&self) -> u64 {
        ExitKind::ALL
            .iter()
            .fold(0u64, |sum, &kind| sum.saturating_add(self.get(kind)))
    }
}

/// Kicks to one vCPU, each count named after what counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KickCounts {
    /// Counted by pvspin (`source="pvspin"`): kicks to this vCPU that pvspin delivered itself,
    /// having seen the doorbell write. On the signal-msi and userspace paths every valid kick;
    /// on the in-kernel path only the kicks that reached userspace anyway (the fallback MSI),
    /// since a valid in-kernel kick never exits.
    pub pvspin_delivered: u64,
    /// Counted by KVM (`source="kvm_halt_wakeup"`), in-kernel path only: the vCPU's
    /// `halt_wakeup` stat since `configure_vcpu`, its wake-ups from a halt by a kick or any
    /// other interrupt: the stand-in for the kicks pvspin cannot count there. `None` on the
    /// other paths and where KVM has no stats fd.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvm_halt_wakeups: Option<u64>,
}

/// One vCPU's spin notifications and the directed yields made for them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VcpuYieldCounts {
    /// Spin notifications this vCPU sent (SPIN, or the one a WAIT carries).
    pub spin_notifications: u64,
    /// Directed yields attempted on this vCPU's behalf.
    pub yields_attempted: u64,
    /// Directed yields that handed the CPU over (a boost, or this thread descheduled).
    pub yields_successful: u64,
}

/// pvspin's own counters for one vCPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PvspinVcpuCounters {
    /// Returns from `KVM_RUN` offered to [`crate::VcpuHooks::handle_exit`].
    pub runs: u64,
    /// Those returns by kind.
    pub exits: ExitCounts,
    /// Nanoseconds inside `KVM_RUN` (guest time plus exits and halts handled in KVM), from
    /// [`crate::VcpuHooks::before_run`] to `handle_exit`.
    pub run_ns: u64,
    /// Kicks to this vCPU; `None` without a kick device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kicks: Option<KickCounts>,
    /// Guest inputs from this vCPU that pvspin ignored, per reason: doorbell accesses by
    /// [`Reject::name`], `bad_hint_page` for a hint page outside guest RAM. Only reasons seen.
    pub rejected_guest_inputs: BTreeMap<String, u64>,
    /// Spin notifications and directed yields; `None` without directed yield.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directed_yield: Option<VcpuYieldCounts>,
    /// Kick-to-wake latency of this vCPU as the kicked one, userspace path only (pvspin sees
    /// both ends there; on the other paths the wake-up happens inside KVM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kick_to_wake_ns: Option<LatencyHistogram>,
    /// Whether the vCPU went through [`crate::PvSpin::configure_vcpu`] (a vCPU that runs
    /// without it has no hooks, and these counters stay 0).
    pub configured: bool,
    /// Runs of this vCPU's hooks made before every vCPU was configured
    /// ([`crate::ProblemKind::RunsBeforeAllConfigured`]): a count that keeps growing means a
    /// forgotten `configure_vcpu`.
    pub runs_before_all_configured: u64,
}

/// One vCPU's current spin budgets (hint pages), in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Budgets {
    /// Spin before waiting.
    pub wait_after_ns: u64,
    /// Spin before notifying; `None` without directed yield (the page says "never").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notify_after_ns: Option<u64>,
}

/// Everything known about one vCPU.
#[derive(Clone, Debug, Serialize)]
pub struct VcpuTelemetry {
    /// vCPU index.
    pub vcpu: u32,
    /// pvspin's counters.
    pub pvspin: PvspinVcpuCounters,
    /// The vCPU's spin budgets; `None` without hint pages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budgets: Option<Budgets>,
    /// KVM's stats of this vCPU (the change since `configure_vcpu`); `None` where KVM has no
    /// stats fd or it could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvm: Option<Snapshot>,
}

/// The kick device's counters, with the path that gives them their meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KickDeviceTelemetry {
    /// The wake path.
    pub path: KickPath,
    /// The device's counters. Fields documented for one path are 0 on the others; the
    /// renderings leave them out there.
    pub stats: KickStats,
}

impl KickDeviceTelemetry {
    /// The device counters that exist on this path, by their rendered name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let mut out = vec![
            ("accesses", s.accesses),
            ("kicks_in_userspace", s.kicks),
            ("forwarded", s.forwarded),
        ];
        match self.path {
            KickPath::Userspace => out.extend([
                ("woke_parked", s.woke_parked),
                ("latched", s.latched),
                ("coalesced", s.coalesced),
                ("hlt_parks", s.hlt_parks),
                ("wait_parks", s.wait_parks),
            ]),
            KickPath::SignalMsi | KickPath::InKernel => out.extend([
                ("msi_delivered", s.msi_delivered),
                ("msi_not_delivered", s.msi_not_delivered),
                ("msi_failed", s.msi_failed),
            ]),
        }
        if self.path == KickPath::InKernel {
            out.push(("in_kernel_missed", s.in_kernel_missed));
        }
        out
    }
}

impl Serialize for KickDeviceTelemetry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let counters = self.counters();
        let mut map = s.serialize_map(Some(counters.len() + 2))?;
        map.serialize_entry("path", self.path.name())?;
        for (name, value) in counters {
            map.serialize_entry(name, &value)?;
        }
        let rejected: BTreeMap<&str, u64> = Reject::ALL
            .iter()
            .map(|r| (r.name(), self.stats.rejected(*r)))
            .collect();
        map.serialize_entry("rejected", &rejected)?;
        map.end()
    }
}

/// Everything known about one VM: [`crate::PvSpin::telemetry`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct VmTelemetry {
    /// The kick device's counters; `None` without a kick device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kick: Option<KickDeviceTelemetry>,
    /// What directed yield decided and did; `None` without directed yield.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directed_yield: Option<DirectedYieldStats>,
    /// Hint-page and WAIT counters; `None` without hint pages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hints: Option<HintStats>,
    /// What the run slots did; `None` without run slots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_slots: Option<SlotTelemetry>,
    /// KVM's VM-wide stats (absolute); `None` where KVM has no stats fd.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvm_vm: Option<Snapshot>,
    /// The adopter mistakes found so far ([`crate::PvSpin::check`]); empty (and left out of
    /// the JSON) when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<Problem>,
    /// Per vCPU, in index order.
    pub vcpus: Vec<VcpuTelemetry>,
}

/// The run slots' counters ([`pvspin_slots::SlotStats`]) and their slot count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlotTelemetry {
    /// Slots.
    pub slots: usize,
    /// Slots granted.
    pub grants: u64,
    /// Grants that had to wait.
    pub waits: u64,
    /// Grants to a vCPU prioritized (kicked or named) while it waited.
    pub prioritized_grants: u64,
    /// Slots kickers handed to the vCPU they kicked.
    pub hand_overs: u64,
    /// Forced exits asked of holders.
    pub preemptions: u64,
    /// Critical-section extensions.
    pub extensions: u64,
    /// The longest wait for a slot, ns.
    pub max_wait_ns: u64,
    /// The most vCPUs that held slots at once.
    pub max_held: u64,
    /// Waits shown to the guest through its KVM steal-time `preempted` byte.
    pub steal_time_marks: u64,
    /// Slots of vCPUs halted inside KVM lent to waiters (in-kernel and signal-msi paths).
    pub lends: u64,
    /// vCPUs that KVM woke while their slot was lent, given a slot back at once.
    pub reclaims: u64,
    /// The longest run with more slot holders than slots, ns.
    pub max_over_ns: u64,
    /// The halt watcher's polls and `blocking` reads, and reads that failed.
    pub watch_polls: u64,
    /// `blocking` statistic reads.
    pub watch_reads: u64,
    /// `blocking` statistic reads that failed.
    pub watch_read_errors: u64,
}

impl SlotTelemetry {
    pub(crate) fn new(
        slots: usize,
        s: pvspin_slots::SlotStats,
        marks: u64,
        watch: Option<pvspin_slots::WatchStats>,
    ) -> Self {
        let w = watch.unwrap_or_default();
        Self {
            lends: s.lends,
            reclaims: s.reclaims,
            max_over_ns: s.max_over_ns,
            watch_polls: w.polls,
            watch_reads: w.reads,
            watch_read_errors: w.read_errors,
            slots,
            grants: s.grants,
            waits: s.waits,
            prioritized_grants: s.prioritized_grants,
            hand_overs: s.hand_overs,
            preemptions: s.preemptions,
            extensions: s.extensions,
            max_wait_ns: s.max_wait_ns,
            max_held: s.max_held,
            steal_time_marks: marks,
        }
    }
}

/// An output format of [`VmTelemetry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TelemetryFormat {
    /// [`VmTelemetry::to_json`].
    Json,
    /// [`VmTelemetry::to_prometheus`].
    Prometheus,
}

impl std::str::FromStr for TelemetryFormat {
    type Err = TelemetryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "json" => Ok(TelemetryFormat::Json),
            "prometheus" | "prom" => Ok(TelemetryFormat::Prometheus),
            other => Err(TelemetryError::UnknownFormat(other.to_owned())),
        }
    }
}

impl VmTelemetry {
    /// The kick path, when the VM has a kick device.
    pub fn kick_path(&self) -> Option<KickPath> {
        self.kick.map(|k| k.path)
    }

    /// Renders in `format`.
    pub fn render(&self, format: TelemetryFormat) -> String {
        match format {
            TelemetryFormat::Json => self.to_json(),
            TelemetryFormat::Prometheus => self.to_prometheus(),
        }
    }

    /// Writes the rendering to `path` (replacing it).
    pub fn write_to(&self, path: &std::path::Path, format: TelemetryFormat) -> std::io::Result<()> {
        std::fs::write(path, self.render(format))
    }

    /// Pretty JSON: the structure of [`VmTelemetry`], absent parts left out.
    pub fn to_json(&self) -> String {
        // Serializing plain structs and string-keyed maps cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Prometheus text exposition format (0.0.4): the families in the [module docs](self).
    pub fn to_prometheus(&self) -> String {
        prometheus::render(self)
    }
}

/// What the configuration can count (which counters a snapshot carries).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The kick device's path, when there is one.
    pub(crate) kick_path: Option<KickPath>,
    /// Directed yield is on.
    pub(crate) directed_yield: bool,
}

/// Serializes the boost trial's state (a `pvspin_yield` type without serde).
pub(crate) fn serialize_trial<S: serde::Serializer>(
    trial: &Option<pvspin_yield::TrialStats>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match trial {
        None => s.serialize_none(),
        Some(t) => {
            let mut map = s.serialize_map(None)?;
            map.serialize_entry("epochs_on", &t.epochs_on)?;
            map.serialize_entry("epochs_off", &t.epochs_off)?;
            map.serialize_entry("boosting", &t.boosting)?;
            if let Some(ns) = t.mean_wait_ns[0] {
                map.serialize_entry("mean_wait_ns_boosts_off", &ns)?;
            }
            if let Some(ns) = t.mean_wait_ns[1] {
                map.serialize_entry("mean_wait_ns_boosts_on", &ns)?;
            }
            map.end()
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
