//! Plain ticket locks (without and with proportional backoff) vs the PV locks with more threads
//! than cores (parking stands for halting).
//!
//! `cargo bench -p pvspin-guest --features test-utils --bench oversubscribed`
//!
//! `THREADS` threads each take the lock `ROUNDS` times around a short critical section (or
//! until `DEADLINE`); one batch is timed from the first worker's start to the last worker's
//! end, `BATCHES` times per lock, all locks interleaved in one run; the result is the time per
//! lock/unlock pair. A plain ticket lock's waiters spin through their time slices while
//! the thread holding the next ticket is descheduled (lock-waiter preemption), so its batches
//! have a long tail; the PV locks' waiters park past the threshold and give the core back.
//! The PV locks use `SpinConfig::HARDWARE` (host threads run at hardware speed). Prints median
//! and max per lock, and how many batches the deadline cut short.
//! The development machines are shared and noisy: compare within one run.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pvspin_guest::host::HostPvOps;
use pvspin_guest::{
    BackoffTicketLock, PvBackoffTicketLock, PvDomain, PvQueuedLock, PvTicketLock, RawPvLock,
    RawSpinLock, SpinConfig, TicketLock,
};

mod common;

const THREADS: u32 = 4;
const ROUNDS: u32 = 5_000;
const BATCHES: usize = 5;
const DEADLINE: Duration = Duration::from_secs(2);

type Domain = PvDomain<HostPvOps<4>, 4>;
type Take = Arc<dyn Fn() + Send + Sync>;
type Maker = (&'static str, fn() -> Take);

fn critical_section() {
    for i in 0..50u32 {
        black_box(i);
    }
}

/// One batch: from the first worker's start to the last worker's end, and the lock/unlock
/// pairs done. Workers stop early at `DEADLINE` after their start, so a pathological batch is
/// bounded.
fn batch(take: &Take) -> (Duration, u64) {
    let take = take.clone();
    let (span, done) = common::together(THREADS, move |_| {
        let began = Instant::now();
        let mut done = 0u64;
        while done < u64::from(ROUNDS) && began.elapsed() < DEADLINE {
            take();
            done += 1;
        }
        done
    });
    (span, done.iter().sum())
}

fn plain<L: RawSpinLock + Send + Sync + 'static>(lock: L) -> Take {
    let lock = Arc::new(lock);
    Arc::new(move || {
        lock.lock();
        critical_section();
        // SAFETY: this thread holds the lock.
        unsafe { lock.unlock() };
    })
}

fn pv<L: RawPvLock + Send + Sync + 'static>(lock: L) -> Take {
    // Host threads run at hardware speed.
    let config = SpinConfig::HARDWARE;
    let domain = Arc::new(Domain::new(HostPvOps::new(), config));
    let lock = Arc::new(lock);
    Arc::new(move || {
        lock.lock(domain.pv());
        critical_section();
        // SAFETY: this thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
    })
}

fn main() {
    let makers: [Maker; 5] = [
        ("ticket", || plain(TicketLock::new())),
        ("backoff", || plain(BackoffTicketLock::new())),
        ("pv_ticket", || pv(PvTicketLock::new())),
        ("pv_backoff", || pv(PvBackoffTicketLock::new())),
        ("pv_queued", || pv(PvQueuedLock::new())),
    ];
    // Nanoseconds per lock/unlock pair, per batch; batches cut short by the deadline.
    let mut per_op: Vec<Vec<u128>> = vec![Vec::new(); makers.len()];
    let mut cut: Vec<usize> = vec![0; makers.len()];
    for _ in 0..BATCHES {
        for (index, (_, make)) in makers.iter().enumerate() {
            let (elapsed, ops) = batch(&make());
            per_op[index].push(elapsed.as_nanos() / u128::from(ops.max(1)));
            if ops < u64::from(THREADS * ROUNDS) {
                cut[index] += 1;
            }
        }
    }
    println!(
        "{THREADS} threads x {ROUNDS} rounds per batch (deadline {DEADLINE:?}), {} cores, \
         ns per lock/unlock pair",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for (((name, _), mut samples), cut) in makers.iter().zip(per_op).zip(cut) {
        samples.sort_unstable();
        println!(
            "{name:>10}: batches {}  median {:>8}  max {:>8}  cut by deadline {cut}",
            samples.len(),
            samples[samples.len() / 2],
            samples[samples.len() - 1],
        );
    }
}
