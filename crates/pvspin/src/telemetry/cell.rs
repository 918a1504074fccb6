//! The per-vCPU recorder the hooks write and [`crate::PvSpin::telemetry`] reads.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::histogram::{LatencyHistogram, BUCKETS};
use super::{ExitCounts, ExitKind, KickCounts, PvspinVcpuCounters, Shape, VcpuYieldCounts};

/// One vCPU's pvspin counters: its own thread records runs, exits, notifications and
/// rejects; any vCPU thread records a kick on its target. Relaxed atomics: a reader wants
/// recent values, not one consistent cut across counters.
#[derive(Debug, Default)]
pub(crate) struct VcpuCounterCell {
    runs: AtomicU64,
    exits: [AtomicU64; ExitKind::ALL.len()],
    run_ns: AtomicU64,
    kicks: AtomicU64,
    spin_notifications: AtomicU64,
    yields_attempted: AtomicU64,
    yields_successful: AtomicU64,
    latency: [AtomicU64; BUCKETS],
    latency_sum_ns: AtomicU64,
    latency_count: AtomicU64,
    rejected: Mutex<BTreeMap<&'static str, u64>>,
}

impl VcpuCounterCell {
    /// A cell with every counter at 0.
    pub(crate) fn new() -> VcpuCounterCell {
        VcpuCounterCell::default()
    }

    /// Counts one return from `KVM_RUN` of `kind` after `ns` inside it.
    pub(crate) fn record_run(&self, kind: ExitKind, ns: u64) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        self.exits[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.run_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Counts one kick pvspin delivered to this vCPU.
    pub(crate) fn record_kick(&self) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one spin notification.
    pub(crate) fn record_spin_notification(&self) {
        self.spin_notifications.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one directed-yield attempt and whether it succeeded.
    pub(crate) fn record_yield(&self, successful: bool) {
        self.yields_attempted.fetch_add(1, Ordering::Relaxed);
        if successful {
            self.yields_successful.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records one kick-to-wake latency.
    pub(crate) fn record_kick_to_wake_ns(&self, ns: u64) {
        self.latency[LatencyHistogram::bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one rejected guest input (rare: takes a lock).
    pub(crate) fn reject(&self, reason: &'static str) {
        let mut m = self
            .rejected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let c = m.entry(reason).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// The counters now, shaped by what the configuration can count: counters of parts that
    /// are off, or of a path that cannot count them, are `None`. `kvm_halt_wakeups` is the
    /// stand-in for in-kernel kicks (KVM's `halt_wakeup` since `configure_vcpu`).
    pub(crate) fn snapshot(
        &self,
        shape: Shape,
        kvm_halt_wakeups: Option<u64>,
    ) -> PvspinVcpuCounters {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let exits: [u64; ExitKind::ALL.len()] = std::array::from_fn(|i| ld(&self.exits[i]));
        let kicks = shape.kick_path.map(|path| KickCounts {
            pvspin_delivered: ld(&self.kicks),
            kvm_halt_wakeups: kvm_halt_wakeups.filter(|_| path == pvspin_kick::KickPath::InKernel),
        });
        let kick_to_wake_ns =
            (shape.kick_path == Some(pvspin_kick::KickPath::Userspace)).then(|| LatencyHistogram {
                counts: std::array::from_fn(|i| ld(&self.latency[i])),
                sum_ns: ld(&self.latency_sum_ns),
                count: ld(&self.latency_count),
            });
        PvspinVcpuCounters {
            runs: ld(&self.runs),
            exits: ExitCounts::from_array(exits),
            run_ns: ld(&self.run_ns),
            kicks,
            rejected_guest_inputs: self
                .rejected
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
            directed_yield: shape.directed_yield.then(|| VcpuYieldCounts {
                spin_notifications: ld(&self.spin_notifications),
                yields_attempted: ld(&self.yields_attempted),
                yields_successful: ld(&self.yields_successful),
            }),
            kick_to_wake_ns,
            // Filled in by `PvSpin::telemetry`, which knows the VM's setup.
            configured: false,
            runs_before_all_configured: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvspin_kick::KickPath;

    fn shape(path: KickPath) -> Shape {
        Shape {
            kick_path: Some(path),
            directed_yield: true,
        }
    }

    #[test]
    fn counter_cell_snapshots_what_threads_recorded() {
        let cell = std::sync::Arc::new(VcpuCounterCell::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let cell = std::sync::Arc::clone(&cell);
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        cell.record_kick();
                        cell.record_spin_notification();
                        cell.record_yield(i % 2 == 0);
                        cell.record_kick_to_wake_ns(i * 1_000);
                        cell.record_run(ExitKind::ALL[(i % 6) as usize], 10);
                    }
                    cell.reject("bad target");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = cell.snapshot(shape(KickPath::Userspace), Some(7));
        let kicks = s.kicks.unwrap();
        assert_eq!(kicks.pvspin_delivered, 400);
        assert_eq!(
            kicks.kvm_halt_wakeups, None,
            "KVM's stand-in is for in-kernel only"
        );
        let dy = s.directed_yield.unwrap();
        assert_eq!(dy.spin_notifications, 400);
        assert_eq!(dy.yields_attempted, 400);
        assert_eq!(dy.yields_successful, 200);
        assert_eq!((s.runs, s.run_ns, s.exits.total()), (400, 4000, 400));
        assert_eq!(s.exits.get(ExitKind::Hlt), 4 * 17);
        let k2w = s.kick_to_wake_ns.unwrap();
        assert_eq!(k2w.count(), 400);
        assert_eq!(k2w.sum_ns(), 4 * 1_000 * (0..100).sum::<u64>());
        let mut h = LatencyHistogram::new();
        for i in 0..100u64 {
            h.record(i * 1_000);
        }
        let mut h4 = LatencyHistogram::new();
        for _ in 0..4 {
            h4.merge(&h);
        }
        assert_eq!(k2w, h4);
        assert_eq!(s.rejected_guest_inputs.get("bad target"), Some(&4));
    }

    #[test]
    fn what_a_path_cannot_count_is_absent() {
        let cell = VcpuCounterCell::new();
        cell.record_kick();
        // In-kernel: pvspin's count (fallbacks only) and KVM's stand-in; no kick-to-wake.
        let s = cell.snapshot(shape(KickPath::InKernel), Some(1930));
        let kicks = s.kicks.unwrap();
        assert_eq!(
            (kicks.pvspin_delivered, kicks.kvm_halt_wakeups),
            (1, Some(1930))
        );
        assert!(s.kick_to_wake_ns.is_none());
        // In-kernel without KVM stats: the stand-in is absent, not 0.
        let s = cell.snapshot(shape(KickPath::InKernel), None);
        assert_eq!(s.kicks.unwrap().kvm_halt_wakeups, None);
        // Signal-msi: every kick is pvspin's; the wake happens in KVM, no latency.
        let s = cell.snapshot(shape(KickPath::SignalMsi), Some(5));
        assert_eq!(s.kicks.unwrap().kvm_halt_wakeups, None);
        assert!(s.kick_to_wake_ns.is_none());
        // No kick device, no directed yield: no kick or yield counters at all.
        let s = cell.snapshot(Shape::default(), Some(5));
        assert!(s.kicks.is_none() && s.directed_yield.is_none() && s.kick_to_wake_ns.is_none());
    }
}
