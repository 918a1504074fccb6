//! How fast this run's work units ran: the lock workload times one non-critical section in
//! [`NCS_SAMPLE_EVERY`] per vCPU into one histogram, whose median and trimmed mean go into
//! the result.
//!
//! The development hosts switch between about one speed and half of it within seconds
//! (`docs/benchmarks.md` §14.15), so a benchmark's time mixes the lock's behaviour with the
//! host's. The same `work(ncs_work)` timed in the run itself separates them; a section the host
//! preempted is an outlier the median ignores while fewer than half are. Sampling keeps the
//! `rdtsc`s and the shared histogram's cache lines off all but a sixteenth of the iterations.

use core::sync::atomic::{AtomicU32, Ordering};

use pvspin_test_vm_proto::timing;
pub use pvspin_test_vm_proto::NCS_SAMPLE_EVERY;

static HISTOGRAM: [AtomicU32; timing::BUCKETS] = [const { AtomicU32::new(0) }; timing::BUCKETS];

/// Counts one timed section of `ticks` TSC cycles.
pub fn record(ticks: u64) {
    // `get`, not indexing: a bounds-check panic would pull `core::fmt` (and its SSE) into the
    // image; `bucket` never leaves the range.
    if let Some(count) = HISTOGRAM.get(timing::bucket(ticks)) {
        count.fetch_add(1, Ordering::Relaxed);
    }
}

fn counts() -> impl Iterator<Item = u64> + Clone {
    HISTOGRAM
        .iter()
        .map(|count| u64::from(count.load(Ordering::Relaxed)))
}

/// `(median, trimmed mean, samples)` of the sections recorded so far, in TSC cycles
/// (`RunResult::ncs_median_tsc`, `ncs_mean_tsc`).
pub fn summary() -> (u64, u64, u64) {
    let (median, samples) = timing::median(counts());
    let (mean, _) = timing::trimmed_mean(counts(), pvspin_test_vm_proto::NCS_MEAN_CAP);
    (median, mean, samples)
}
