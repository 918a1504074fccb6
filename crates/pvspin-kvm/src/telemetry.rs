//! One telemetry snapshot per VM: pvspin's own per-vCPU counters merged with KVM's binary
//! statistics, rendered as JSON ([`VmTelemetry::to_json`]) or in the Prometheus text exposition
//! format, version 0.0.4 ([`VmTelemetry::to_prometheus`]).
//!
//! Prometheus families:
//! * `pvspin_kicks_total{vcpu,path}`: kicks delivered to the vCPU, per wake path;
//! * `pvspin_spin_notifications_total{vcpu}`, `pvspin_yields_attempted_total{vcpu}`,
//!   `pvspin_yields_successful_total{vcpu}`;
//! * `pvspin_rejected_guest_inputs_total{vcpu,reason}`;
//! * `pvspin_kick_to_wake_latency_seconds{vcpu}`: histogram (`_bucket{le}`, `_sum`, `_count`);
//! * `kvm_vcpu_<stat>{vcpu}` and `kvm_vm_<stat>`: every KVM stat. Cumulative stats are counters
//!   (`_total`), instant and peak stats gauges, histograms histograms. Stats in seconds are
//!   converted to seconds and named `..._seconds` (a trailing `_ns` is dropped), stats in bytes
//!   are named `..._bytes`. KVM histograms have no `_sum` (KVM does not report one). A bucket
//!   `[a, b)` of integer values becomes `le = (b - 1) * scale`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::ser::SerializeStruct;
use serde::Serialize;

use crate::stats::{Snapshot, StatBase, StatKind, StatUnit};

/// The wake paths of a kick (see `pvspin-kick`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KickPath {
    /// ioeventfd + irqfd to a REMRD MSI, no userspace exit.
    InKernel,
    /// A userspace exit, then `KVM_SIGNAL_MSI`.
    SignalMsi,
    /// No in-kernel irqchip: a userspace latch and park/unpark.
    Userspace,
}

impl KickPath {
    /// All paths.
    pub const ALL: [KickPath; 3] = [KickPath::InKernel, KickPath::SignalMsi, KickPath::Userspace];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            KickPath::InKernel => "in_kernel",
            KickPath::SignalMsi => "signal_msi",
            KickPath::Userspace => "userspace",
        }
    }
}

/// Kicks per path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KickCounts {
    /// In-kernel path.
    pub in_kernel: u64,
    /// Signal-MSI path.
    pub signal_msi: u64,
    /// Userspace path.
    pub userspace: u64,
}

impl KickCounts {
    /// The count of `path`.
    pub fn get(&self, path: KickPath) -> u64 {
        match path {
            KickPath::InKernel => self.in_kernel,
            KickPath::SignalMsi => self.signal_msi,
            KickPath::Userspace => self.userspace,
        }
    }

    /// Counts one kick on `path` (saturating).
    pub fn record(&mut self, path: KickPath) {
        let c = match path {
            KickPath::InKernel => &mut self.in_kernel,
            KickPath::SignalMsi => &mut self.signal_msi,
            KickPath::Userspace => &mut self.userspace,
        };
        *c = c.saturating_add(1);
    }

    /// All paths together.
    pub fn total(&self) -> u64 {
        self.in_kernel
            .saturating_add(self.signal_msi)
            .saturating_add(self.userspace)
    }
}

/// Upper bounds (inclusive, ns) of [`LatencyHistogram`]'s buckets; one more bucket is open.
pub const LATENCY_BOUNDS_NS: [u64; 16] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    1_000_000_000,
];

/// A fixed-bucket latency histogram in ns (bounds [`LATENCY_BOUNDS_NS`], plus `+Inf`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: [u64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: u64,
    count: u64,
}

impl LatencyHistogram {
    /// An empty histogram.
    pub fn new() -> LatencyHistogram {
        LatencyHistogram::default()
    }

    fn bucket_of(ns: u64) -> usize {
        LATENCY_BOUNDS_NS
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(LATENCY_BOUNDS_NS.len())
    }

    /// Records one latency (saturating counts).
    pub fn record(&mut self, ns: u64) {
        let i = Self::bucket_of(ns);
        self.counts[i] = self.counts[i].saturating_add(1);
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.count = self.count.saturating_add(1);
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a = a.saturating_add(b);
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.count = self.count.saturating_add(other.count);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of samples, ns.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Per-bucket (not cumulative) counts with their inclusive upper bound (`None` = `+Inf`).
    pub fn buckets(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        LATENCY_BOUNDS_NS
            .iter()
            .map(|&b| Some(b))
            .chain(std::iter::once(None))
            .zip(self.counts.iter().copied())
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1); `None` if empty or in the
    /// open bucket.
    pub fn quantile_upper_bound_ns(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (bound, c) in self.buckets() {
            seen = seen.saturating_add(c);
            if seen >= rank {
                return bound;
            }
        }
        None
    }
}

impl Serialize for LatencyHistogram {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("LatencyHistogram", 4)?;
        st.serialize_field("bounds_ns", &LATENCY_BOUNDS_NS)?;
        st.serialize_field("counts", &self.counts)?;
        st.serialize_field("sum_ns", &self.sum_ns)?;
        st.serialize_field("count", &self.count)?;
        st.end()
    }
}

/// pvspin's own counters for one vCPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PvspinVcpuCounters {
    /// Kicks delivered to this vCPU, per path.
    pub kicks: KickCounts,
    /// Spin notifications this vCPU sent.
    pub spin_notifications: u64,
    /// Directed yields attempted on this vCPU's behalf.
    pub yields_attempted: u64,
    /// Directed yields that handed the CPU over.
    pub yields_successful: u64,
    /// Kick-to-wake latency of this vCPU (as the kicked one).
    pub kick_to_wake_ns: LatencyHistogram,
    /// Guest inputs rejected, per reason.
    pub rejected_guest_inputs: BTreeMap<String, u64>,
}

impl PvspinVcpuCounters {
    /// Counts one rejected guest input (saturating).
    pub fn reject(&mut self, reason: &str) {
        let c = self
            .rejected_guest_inputs
            .entry(reason.to_owned())
            .or_insert(0);
        *c = c.saturating_add(1);
    }
}

/// Thread-safe recorder of one vCPU's pvspin counters: vCPU and device threads record with
/// relaxed atomics, a stats thread takes [`VcpuCounterCell::snapshot`]s.
#[derive(Debug, Default)]
pub struct VcpuCounterCell {
    kicks: [AtomicU64; 3],
    spin_notifications: AtomicU64,
    yields_attempted: AtomicU64,
    yields_successful: AtomicU64,
    latency: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    latency_sum_ns: AtomicU64,
    latency_count: AtomicU64,
    rejected: Mutex<BTreeMap<&'static str, u64>>,
}

impl VcpuCounterCell {
    /// A cell with every counter at 0.
    pub fn new() -> VcpuCounterCell {
        VcpuCounterCell::default()
    }

    /// Counts one kick delivered on `path`.
    pub fn record_kick(&self, path: KickPath) {
        let i = match path {
            KickPath::InKernel => 0,
            KickPath::SignalMsi => 1,
            KickPath::Userspace => 2,
        };
        self.kicks[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one spin notification.
    pub fn record_spin_notification(&self) {
        self.spin_notifications.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one directed-yield attempt and whether it succeeded.
    pub fn record_yield(&self, successful: bool) {
        self.yields_attempted.fetch_add(1, Ordering::Relaxed);
        if successful {
            self.yields_successful.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records one kick-to-wake latency.
    pub fn record_kick_to_wake_ns(&self, ns: u64) {
        self.latency[LatencyHistogram::bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one rejected guest input (rare: takes a lock).
    pub fn reject(&self, reason: &'static str) {
        let mut m = self.rejected.lock().unwrap_or_else(|e| e.into_inner());
        let c = m.entry(reason).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// The counters now (each read is atomic; the set is not one atomic cut).
    pub fn snapshot(&self) -> PvspinVcpuCounters {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut counts = [0u64; LATENCY_BOUNDS_NS.len() + 1];
        for (c, a) in counts.iter_mut().zip(&self.latency) {
            *c = ld(a);
        }
        PvspinVcpuCounters {
            kicks: KickCounts {
                in_kernel: ld(&self.kicks[0]),
                signal_msi: ld(&self.kicks[1]),
                userspace: ld(&self.kicks[2]),
            },
            spin_notifications: ld(&self.spin_notifications),
            yields_attempted: ld(&self.yields_attempted),
            yields_successful: ld(&self.yields_successful),
            kick_to_wake_ns: LatencyHistogram {
                counts,
                sum_ns: ld(&self.latency_sum_ns),
                count: ld(&self.latency_count),
            },
            rejected_guest_inputs: self
                .rejected
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
        }
    }
}

/// Everything known about one vCPU.
#[derive(Clone, Debug, Serialize)]
pub struct VcpuTelemetry {
    /// vCPU index.
    pub vcpu: u32,
    /// pvspin's counters.
    pub pvspin: PvspinVcpuCounters,
    /// KVM's stats of this vCPU (absolute, or a delta), if read.
    pub kvm: Option<Snapshot>,
}

/// Everything known about one VM.
#[derive(Clone, Debug, Default, Serialize)]
pub struct VmTelemetry {
    /// KVM's VM-wide stats, if read.
    pub kvm_vm: Option<Snapshot>,
    /// Per vCPU.
    pub vcpus: Vec<VcpuTelemetry>,
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
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "json" => Ok(TelemetryFormat::Json),
            "prometheus" | "prom" => Ok(TelemetryFormat::Prometheus),
            other => Err(format!(
                "unknown telemetry format {other:?} (expected json or prometheus)"
            )),
        }
    }
}

impl VmTelemetry {
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

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain structs and string-keyed maps cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Prometheus text exposition format (0.0.4).
    pub fn to_prometheus(&self) -> String {
        let mut out = Families::default();
        for v in &self.vcpus {
            let vl = [("vcpu", v.vcpu.to_string())];
            let p = &v.pvspin;
            for path in KickPath::ALL {
                out.sample(
                    "pvspin_kicks_total",
                    "counter",
                    "Kicks delivered to the vCPU, per wake path.",
                    "",
                    &[
                        ("vcpu", v.vcpu.to_string()),
                        ("path", path.name().to_owned()),
                    ],
                    &p.kicks.get(path).to_string(),
                );
            }
            for (name, help, value) in [
                (
                    "pvspin_spin_notifications_total",
                    "Spin notifications the vCPU sent.",
                    p.spin_notifications,
                ),
                (
                    "pvspin_yields_attempted_total",
                    "Directed yields attempted for the vCPU.",
                    p.yields_attempted,
                ),
                (
                    "pvspin_yields_successful_total",
                    "Directed yields that handed the CPU over.",
                    p.yields_successful,
                ),
            ] {
                out.sample(name, "counter", help, "", &vl, &value.to_string());
            }
            for (reason, n) in &p.rejected_guest_inputs {
                out.sample(
                    "pvspin_rejected_guest_inputs_total",
                    "counter",
                    "Guest inputs rejected, per reason.",
                    "",
                    &[("vcpu", v.vcpu.to_string()), ("reason", reason.clone())],
                    &n.to_string(),
                );
            }
            let fam = "pvspin_kick_to_wake_latency_seconds";
            let help = "Kick-to-wake latency of the kicked vCPU.";
            let mut cum = 0u64;
            for (bound, c) in p.kick_to_wake_ns.buckets() {
                cum = cum.saturating_add(c);
                let le = bound.map_or_else(|| "+Inf".to_owned(), |b| fmt_f64(b as f64 / 1e9));
                out.sample(
                    fam,
                    "histogram",
                    help,
                    "_bucket",
                    &[("vcpu", v.vcpu.to_string()), ("le", le)],
                    &cum.to_string(),
                );
            }
            out.sample(
                fam,
                "histogram",
                help,
                "_sum",
                &vl,
                &fmt_f64(p.kick_to_wake_ns.sum_ns() as f64 / 1e9),
            );
            out.sample(
                fam,
                "histogram",
                help,
                "_count",
                &vl,
                &p.kick_to_wake_ns.count().to_string(),
            );
        }
        if let Some(s) = &self.kvm_vm {
            kvm_samples(&mut out, "kvm_vm_", s, &[]);
        }
        for v in &self.vcpus {
            if let Some(s) = &v.kvm {
                kvm_samples(&mut out, "kvm_vcpu_", s, &[("vcpu", v.vcpu.to_string())]);
            }
        }
        out.render()
    }
}

/// Families in first-seen order, so every family's samples come out together.
#[derive(Default)]
struct Families {
    order: Vec<String>,
    by_name: BTreeMap<String, (String, String, Vec<String>)>,
}

impl Families {
    fn sample(
        &mut self,
        family: &str,
        typ: &str,
        help: &str,
        suffix: &str,
        labels: &[(&str, String)],
        value: &str,
    ) {
        let entry = self.by_name.entry(family.to_owned()).or_insert_with(|| {
            self.order.push(family.to_owned());
            (typ.to_owned(), help.to_owned(), Vec::new())
        });
        if entry.0 != typ {
            log::warn!(
                "telemetry: metric family {family} seen as {} and {typ}; sample dropped",
                entry.0
            );
            return;
        }
        let mut line = format!("{family}{suffix}");
        if !labels.is_empty() {
            line.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                let _ = write!(line, "{k}=\"{}\"", escape_label(v));
            }
            line.push('}');
        }
        let _ = write!(line, " {value}");
        entry.2.push(line);
    }

    fn render(&self) -> String {
        let mut s = String::new();
        for name in &self.order {
            let (typ, help, lines) = &self.by_name[name];
            let _ = writeln!(s, "# HELP {name} {}", escape_help(help));
            let _ = writeln!(s, "# TYPE {name} {typ}");
            for l in lines {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

fn sanitize(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        s.push('_');
    }
    s
}

fn fmt_f64(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else if v.is_nan() {
        "NaN".to_owned()
    } else {
        format!("{v}")
    }
}

fn kvm_samples(out: &mut Families, prefix: &str, snap: &Snapshot, labels: &[(&str, String)]) {
    for st in snap.iter() {
        let d = st.desc;
        let mut base = format!("{prefix}{}", sanitize(&d.name));
        // Divide by 10^-e rather than multiply by 10^e: 3 / 1e9 prints as 0.000000003.
        let scale = |v: f64| match d.base {
            StatBase::Pow10 if d.exponent < 0 => v / 10f64.powi(-i32::from(d.exponent)),
            _ => v * d.scale(),
        };
        let scaled = match d.unit {
            StatUnit::Seconds => {
                if let Some(b) = base.strip_suffix("_ns") {
                    base = b.to_owned();
                }
                base.push_str("_seconds");
                true
            }
            StatUnit::Bytes => {
                if !base.ends_with("_bytes") {
                    base.push_str("_bytes");
                }
                true
            }
            _ => false,
        };
        let val = |v: u64| {
            if scaled {
                fmt_f64(scale(v as f64))
            } else {
                v.to_string()
            }
        };
        let help = format!(
            "KVM stat {} ({:?}, unit {:?}).",
            escape_help(&d.name),
            d.kind,
            d.unit
        );
        match d.kind {
            StatKind::Cumulative => {
                let fam = format!("{base}_total");
                let v = st.values.first().copied().unwrap_or(0);
                out.sample(&fam, "counter", &help, "", labels, &val(v));
            }
            StatKind::LinearHist | StatKind::LogHist => {
                let mut cum = 0u64;
                for (bound, c) in d.bucket_upper_bounds().into_iter().zip(st.values) {
                    cum = cum.saturating_add(*c);
                    // Integer values: [a, b) is <= b - 1.
                    let le = bound.map_or_else(
                        || "+Inf".to_owned(),
                        |b| {
                            let raw = b.saturating_sub(1) as f64;
                            fmt_f64(if scaled { scale(raw) } else { raw })
                        },
                    );
                    let mut l = labels.to_vec();
                    l.push(("le", le));
                    out.sample(&base, "histogram", &help, "_bucket", &l, &cum.to_string());
                }
                out.sample(
                    &base,
                    "histogram",
                    &help,
                    "_count",
                    labels,
                    &cum.to_string(),
                );
            }
            StatKind::Instant | StatKind::Peak | StatKind::Unknown(_) => {
                let v = st.values.first().copied().unwrap_or(0);
                out.sample(&base, "gauge", &help, "", labels, &val(v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{parse, tests::image};
    use kvm_bindings::{
        KVM_STATS_BASE_POW10, KVM_STATS_TYPE_CUMULATIVE, KVM_STATS_TYPE_INSTANT,
        KVM_STATS_TYPE_LOG_HIST, KVM_STATS_UNIT_BOOLEAN, KVM_STATS_UNIT_SECONDS,
    };
    use std::collections::HashMap;

    fn kvm_snapshot(exits: u64) -> Snapshot {
        let ns = KVM_STATS_UNIT_SECONDS | KVM_STATS_BASE_POW10;
        let (h, d, data) = image(
            48,
            &[
                ("exits", KVM_STATS_TYPE_CUMULATIVE, 0, &[exits], 0),
                ("halt_exits", KVM_STATS_TYPE_CUMULATIVE, 0, &[3], 0),
                (
                    "halt_wait_ns",
                    KVM_STATS_TYPE_CUMULATIVE | ns,
                    -9,
                    &[2_000_000_000],
                    0,
                ),
                (
                    "blocking",
                    KVM_STATS_TYPE_INSTANT | KVM_STATS_UNIT_BOOLEAN,
                    0,
                    &[1],
                    0,
                ),
                (
                    "halt_wait_hist",
                    KVM_STATS_TYPE_LOG_HIST | ns,
                    -9,
                    &[1, 0, 2, 4],
                    0,
                ),
            ],
        );
        parse(&h, &d, &data).unwrap()
    }

    fn sample_vm() -> VmTelemetry {
        let mut vcpus = Vec::new();
        for i in 0..2u32 {
            let mut p = PvspinVcpuCounters::default();
            p.kicks.record(KickPath::InKernel);
            p.kicks.record(KickPath::Userspace);
            p.kicks.record(KickPath::Userspace);
            p.spin_notifications = 7 + u64::from(i);
            p.yields_attempted = 5;
            p.yields_successful = 2;
            for ns in [500, 1_500, 40_000, 3_000_000_000] {
                p.kick_to_wake_ns.record(ns);
            }
            p.reject("doorbell target \"out of range\"\n");
            p.reject("doorbell target \"out of range\"\n");
            vcpus.push(VcpuTelemetry {
                vcpu: i,
                pvspin: p,
                kvm: Some(kvm_snapshot(100 + u64::from(i))),
            });
        }
        VmTelemetry {
            kvm_vm: Some(kvm_snapshot(1)),
            vcpus,
        }
    }

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.quantile_upper_bound_ns(0.5), None);
        for ns in [0, 1_000, 1_001, 2_000, 9_999_999_999] {
            h.record(ns);
        }
        let b: Vec<_> = h.buckets().collect();
        assert_eq!(b[0], (Some(1_000), 2));
        assert_eq!(b[1], (Some(2_000), 2));
        assert_eq!(b.last().copied(), Some((None, 1)));
        assert_eq!(h.count(), 5);
        assert_eq!(h.sum_ns(), 1_000 + 1_001 + 2_000 + 9_999_999_999);
        assert_eq!(h.quantile_upper_bound_ns(0.4), Some(1_000));
        assert_eq!(h.quantile_upper_bound_ns(0.5), Some(2_000));
        assert_eq!(h.quantile_upper_bound_ns(1.0), None);
        let mut m = h;
        m.merge(&h);
        assert_eq!(m.count(), 10);
    }

    #[test]
    fn json_round_trips() {
        let t = sample_vm();
        let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        let v0 = &v["vcpus"][0];
        assert_eq!(v0["vcpu"], 0);
        assert_eq!(v0["pvspin"]["kicks"]["userspace"], 2);
        assert_eq!(v0["pvspin"]["spin_notifications"], 7);
        assert_eq!(v0["pvspin"]["kick_to_wake_ns"]["count"], 4);
        assert_eq!(
            v0["pvspin"]["kick_to_wake_ns"]["counts"]
                .as_array()
                .unwrap()
                .len(),
            LATENCY_BOUNDS_NS.len() + 1
        );
        assert_eq!(v0["kvm"]["exits"]["value"], 100);
        assert_eq!(v["vcpus"][1]["kvm"]["exits"]["value"], 101);
        assert_eq!(v["kvm_vm"]["halt_wait_hist"]["buckets"][3], 4);
    }

    /// A strict reader of the text format: returns (family -> type, samples).
    #[allow(clippy::type_complexity)]
    fn parse_prometheus(
        text: &str,
    ) -> (
        HashMap<String, String>,
        Vec<(String, Vec<(String, String)>, f64)>,
    ) {
        let mut types = HashMap::new();
        let mut helps = HashMap::new();
        let mut samples = Vec::new();
        let mut current: Option<String> = None;
        let mut finished: Vec<String> = Vec::new();
        for line in text.lines() {
            assert!(!line.is_empty(), "empty line");
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').unwrap();
                assert!(
                    helps.insert(name.to_owned(), ()).is_none(),
                    "HELP twice: {name}"
                );
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, typ) = rest.split_once(' ').unwrap();
                assert!(
                    ["counter", "gauge", "histogram"].contains(&typ),
                    "type {typ}"
                );
                assert!(helps.contains_key(name), "TYPE before HELP for {name}");
                assert!(types.insert(name.to_owned(), typ.to_owned()).is_none());
                if let Some(c) = current.replace(name.to_owned()) {
                    finished.push(c);
                }
                continue;
            }
            assert!(!line.starts_with('#'), "stray comment {line}");
            // name{labels} value
            let name_end = line.find(['{', ' ']).unwrap();
            let name = &line[..name_end];
            assert!(name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'));
            assert!(!name.chars().next().unwrap().is_ascii_digit());
            let mut rest = &line[name_end..];
            let mut labels = Vec::new();
            if let Some(r) = rest.strip_prefix('{') {
                let mut r = r;
                loop {
                    let eq = r.find('=').unwrap();
                    let key = r[..eq].to_owned();
                    r = &r[eq + 1..];
                    assert!(r.starts_with('"'));
                    let mut val = String::new();
                    let mut chars = r[1..].char_indices();
                    let end;
                    loop {
                        let (i, c) = chars.next().expect("unterminated label");
                        match c {
                            '\\' => {
                                let (_, e) = chars.next().unwrap();
                                val.push(match e {
                                    'n' => '\n',
                                    '\\' => '\\',
                                    '"' => '"',
                                    other => panic!("bad escape \\{other}"),
                                });
                            }
                            '"' => {
                                end = i + 2;
                                break;
                            }
                            '\n' => panic!("raw newline"),
                            c => val.push(c),
                        }
                    }
                    labels.push((key, val));
                    r = &r[end..];
                    if let Some(x) = r.strip_prefix(',') {
                        r = x;
                    } else {
                        r = r.strip_prefix('}').expect("labels end");
                        break;
                    }
                }
                rest = r;
            }
            let value = rest.strip_prefix(' ').expect("space before value");
            let v: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().expect("numeric value"),
            };
            // The sample belongs to the current family.
            let fam = current.as_deref().expect("sample before TYPE");
            let typ = &types[fam];
            let ok = match typ.as_str() {
                "histogram" => [
                    format!("{fam}_bucket"),
                    format!("{fam}_sum"),
                    format!("{fam}_count"),
                ]
                .contains(&name.to_owned()),
                _ => name == fam,
            };
            assert!(ok, "sample {name} outside its family {fam}");
            assert!(!finished.contains(&fam.to_owned()));
            samples.push((name.to_owned(), labels, v));
        }
        (types, samples)
    }

    #[test]
    fn prometheus_follows_the_format_rules() {
        let text = sample_vm().to_prometheus();
        let (types, samples) = parse_prometheus(&text);
        for (fam, typ) in &types {
            if typ == "counter" {
                assert!(fam.ends_with("_total"), "counter {fam}");
            }
        }
        let find = |name: &str, want: &[(&str, &str)]| -> Vec<f64> {
            samples
                .iter()
                .filter(|(n, l, _)| {
                    n == name
                        && want
                            .iter()
                            .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
                })
                .map(|s| s.2)
                .collect()
        };
        assert_eq!(
            find(
                "pvspin_kicks_total",
                &[("vcpu", "1"), ("path", "userspace")]
            ),
            vec![2.0]
        );
        assert_eq!(
            find("pvspin_spin_notifications_total", &[("vcpu", "1")]),
            vec![8.0]
        );
        assert_eq!(
            find(
                "pvspin_rejected_guest_inputs_total",
                &[("reason", "doorbell target \"out of range\"\n")]
            ),
            vec![2.0, 2.0]
        );
        assert_eq!(find("kvm_vcpu_exits_total", &[("vcpu", "1")]), vec![101.0]);
        assert_eq!(find("kvm_vm_exits_total", &[]), vec![1.0]);
        assert_eq!(
            find("kvm_vcpu_halt_wait_seconds_total", &[("vcpu", "0")]),
            vec![2.0]
        );
        assert_eq!(find("kvm_vcpu_blocking", &[("vcpu", "0")]), vec![1.0]);
        assert_eq!(types["kvm_vcpu_blocking"], "gauge");

        // Histograms: buckets cumulative with increasing le, +Inf == _count.
        for fam in [
            "pvspin_kick_to_wake_latency_seconds",
            "kvm_vcpu_halt_wait_hist_seconds",
        ] {
            assert_eq!(types[fam], "histogram");
            for vcpu in ["0", "1"] {
                let buckets: Vec<_> = samples
                    .iter()
                    .filter(|(n, l, _)| {
                        *n == format!("{fam}_bucket")
                            && l.iter().any(|(k, v)| k == "vcpu" && v == vcpu)
                    })
                    .map(|(_, l, v)| {
                        let le = &l.iter().find(|(k, _)| k == "le").unwrap().1;
                        let le: f64 = if le == "+Inf" {
                            f64::INFINITY
                        } else {
                            le.parse().unwrap()
                        };
                        (le, *v)
                    })
                    .collect();
                assert!(buckets.len() > 2);
                for w in buckets.windows(2) {
                    assert!(w[0].0 < w[1].0, "le not increasing in {fam}");
                    assert!(w[0].1 <= w[1].1, "buckets not cumulative in {fam}");
                }
                let last = buckets.last().unwrap();
                assert!(last.0.is_infinite());
                let count = find(&format!("{fam}_count"), &[("vcpu", vcpu)]);
                assert_eq!(count, vec![last.1]);
            }
        }
        assert_eq!(
            find(
                "pvspin_kick_to_wake_latency_seconds_bucket",
                &[("vcpu", "0"), ("le", "0.000001")]
            ),
            vec![1.0]
        );
        let sum = find("pvspin_kick_to_wake_latency_seconds_sum", &[("vcpu", "0")]);
        assert!((sum[0] - 3.000042).abs() < 1e-9, "{sum:?}");
        // KVM log histogram: [0,1) -> le 0, [1,2) -> le 1e-9, [2,4) -> le 3e-9.
        assert_eq!(
            find(
                "kvm_vcpu_halt_wait_hist_seconds_bucket",
                &[("vcpu", "0"), ("le", "0.000000003")]
            ),
            vec![3.0]
        );
    }

    #[test]
    fn empty_telemetry_renders_nothing_wrong() {
        let t = VmTelemetry::default();
        assert_eq!(t.to_prometheus(), "");
        let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        assert!(v["vcpus"].as_array().unwrap().is_empty());
    }

    #[test]
    fn counter_cell_snapshots_what_threads_recorded() {
        let cell = std::sync::Arc::new(VcpuCounterCell::new());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let cell = std::sync::Arc::clone(&cell);
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        cell.record_kick(KickPath::ALL[(t + i as usize) % 3]);
                        cell.record_spin_notification();
                        cell.record_yield(i % 2 == 0);
                        cell.record_kick_to_wake_ns(i * 1_000);
                    }
                    cell.reject("bad target");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = cell.snapshot();
        assert_eq!(s.kicks.total(), 400);
        assert_eq!(s.spin_notifications, 400);
        assert_eq!(s.yields_attempted, 400);
        assert_eq!(s.yields_successful, 200);
        assert_eq!(s.kick_to_wake_ns.count(), 400);
        assert_eq!(
            s.kick_to_wake_ns.sum_ns(),
            4 * 1_000 * (0..100).sum::<u64>()
        );
        let mut h = LatencyHistogram::new();
        for i in 0..100u64 {
            h.record(i * 1_000);
        }
        let mut h4 = LatencyHistogram::new();
        for _ in 0..4 {
            h4.merge(&h);
        }
        assert_eq!(s.kick_to_wake_ns, h4);
        assert_eq!(s.rejected_guest_inputs.get("bad target"), Some(&4));
    }

    #[test]
    fn formats_parse_and_files_are_written() {
        assert_eq!("json".parse(), Ok(TelemetryFormat::Json));
        assert_eq!("prometheus".parse(), Ok(TelemetryFormat::Prometheus));
        assert!("xml".parse::<TelemetryFormat>().is_err());
        let t = sample_vm();
        let path =
            std::env::temp_dir().join(format!("pvspin-kvm-telemetry-{}.prom", std::process::id()));
        t.write_to(&path, TelemetryFormat::Prometheus).unwrap();
        let back = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(back, t.to_prometheus());
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize("a-b.c"), "a_b_c");
        assert_eq!(sanitize(""), "_");
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
