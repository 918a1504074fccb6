//! Issue 19's part 4 on host threads: two threads hand a lock back and forth around short
//! sections (no overcommit, so nobody halts), the plain ticket lock against the PV ticket lock
//! and against the two halves of what the PV unlock adds.
//!
//! `cargo bench -p pvspin-guest --features test-utils --bench pair_1x` (`PAIR_1X_BATCHES=N`
//! for more than 21 batches per variant)
//!
//! Variants, interleaved batch by batch:
//! - `ticket`: the plain `TicketLock` (its unlock is one plain store on x86-64).
//! - `ticket+drain`: the same, with one locked read-modify-write of a thread-local word after
//!   the unlock: the store-buffer drain that the PV unlock's halt/kick handshake needs (its
//!   `full_fence`), and nothing else.
//! - `pv_ticket`: `PvTicketLock` with halting on (`SpinConfig::HARDWARE`).
//! - `pv_ticket/no-halt`: `PvTicketLock` with halting off: the unlock skips the fence and the
//!   waiter never publishes a halt; the rest of the PV code runs.
//! - `pv_ticket/timed`: `PvTicketLock` whose waiters spin against a time budget read off the
//!   TSC, as the example guest's do (hint-page budgets: an `RDTSC` per spin); the others spin
//!   counted spins (the host's `PvOps` has no clock).
//!
//! Each batch: both threads take the lock `ROUNDS` times; the time per acquisition is the
//! batch's span over all acquisitions. Prints the median and slowest per variant, and the
//! median of the per-round ratios to `ticket` (runs a few milliseconds apart). The guest's
//! lock workload at cs/ncs 40 runs the same pattern natively in a VM (docs/benchmarks.md §14.4).
//! The development machines are shared and noisy: compare within one run.

use std::hint::black_box;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use pvspin_guest::host::HostPvOps;
use pvspin_guest::{
    AtomicU8, PvDomain, PvOps, PvTicketLock, RawPvLock, RawSpinLock, SpinBudget, SpinConfig,
    TicketLock,
};

mod common;

const THREADS: u32 = 2;
const ROUNDS: u32 = 1_000_000;
/// Batches per variant; `PAIR_1X_BATCHES` overrides.
const BATCHES: usize = 21;

/// The host's `PvOps` with a TSC clock and a time budget, as the example guest's.
struct Timed(HostPvOps<2>);

impl PvOps for Timed {
    fn wait(&self, ptr: &AtomicU8, val: u8) {
        self.0.wait(ptr, val);
    }

    fn kick(&self, cpu: u32) {
        self.0.kick(cpu);
    }

    fn cpu_id(&self) -> u32 {
        self.0.cpu_id()
    }

    fn now(&self) -> u64 {
        // SAFETY: RDTSC reads the time-stamp counter; it has no other effect.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    fn spin_budget(&self) -> SpinBudget {
        // About the guest's default wait budget (tens of microseconds of TSC cycles).
        SpinBudget {
            notify_after: u64::MAX,
            wait_after: 100_000,
        }
    }
}

type Take = Arc<dyn Fn() + Send + Sync>;
type Maker = (&'static str, fn() -> Take);

/// A few nanoseconds of work, inside and between critical sections.
fn work() {
    for i in 0..8u32 {
        black_box(i);
    }
}

thread_local! {
    /// The word the `ticket+drain` variant's locked instruction writes: this thread's own.
    static DRAIN: AtomicU32 = const { AtomicU32::new(0) };
}

/// One batch: from the first worker's start to the last worker's end; ns per acquisition.
fn batch(take: &Take) -> f64 {
    let take = take.clone();
    let (span, _) = common::together(THREADS, move |_| {
        for _ in 0..ROUNDS {
            take();
        }
    });
    span.as_nanos() as f64 / f64::from(THREADS * ROUNDS)
}

fn plain(drain: bool) -> Take {
    let lock = Arc::new(TicketLock::new());
    Arc::new(move || {
        lock.lock();
        work();
        // SAFETY: this thread holds the lock.
        unsafe { lock.unlock() };
        if drain {
            DRAIN.with(|word| word.fetch_or(1, Ordering::SeqCst));
        }
        work();
    })
}

fn pv(halt: bool) -> Take {
    let config = SpinConfig {
        halt,
        ..SpinConfig::HARDWARE
    };
    pv_with(HostPvOps::<2>::new(), config)
}

fn pv_timed() -> Take {
    pv_with(Timed(HostPvOps::new()), SpinConfig::HARDWARE)
}

fn pv_with<O: PvOps + Send + 'static>(ops: O, config: SpinConfig) -> Take {
    let domain = Arc::new(PvDomain::<O, 2>::new(ops, config));
    let lock = Arc::new(PvTicketLock::new());
    Arc::new(move || {
        lock.lock(domain.pv());
        work();
        // SAFETY: this thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        work();
    })
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let makers: [Maker; 5] = [
        ("ticket", || plain(false)),
        ("ticket+drain", || plain(true)),
        ("pv_ticket", || pv(true)),
        ("pv_ticket/no-halt", || pv(false)),
        ("pv_ticket/timed", pv_timed),
    ];
    let batches = std::env::var("PAIR_1X_BATCHES")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(BATCHES)
        .max(1);
    let mut per_op: Vec<Vec<f64>> = vec![Vec::new(); makers.len()];
    for round in 0..batches {
        // Rotate which variant goes first, so none always follows the same one.
        for k in 0..makers.len() {
            let index = (round + k) % makers.len();
            per_op[index].push(batch(&(makers[index].1)()));
        }
    }
    println!(
        "{THREADS} threads x {ROUNDS} acquisitions per batch, {batches} batches per variant, \
         interleaved; ns per acquisition"
    );
    let base = per_op[0].clone();
    for ((name, _), samples) in makers.iter().zip(&per_op) {
        let mut ratios: Vec<f64> = samples.iter().zip(&base).map(|(s, b)| s / b).collect();
        let slowest = samples.iter().copied().fold(0.0, f64::max);
        let mut sorted = samples.clone();
        println!(
            "{name:>18}: median {:>6.2}  slowest {slowest:>6.2}  per-round ratio to ticket {:.3}",
            median(&mut sorted),
            median(&mut ratios),
        );
    }
}
