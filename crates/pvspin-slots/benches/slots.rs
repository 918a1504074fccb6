//! Run slots by size (issue 19): the host CPU of one slot decision at 2, 16, 64 and 255 vCPUs,
//! and the state mutex's hold time and contention in a vCPU storm at 64 and 255 vCPUs.
//!
//! `cargo bench -p pvspin-slots --bench slots -- decision` (without the counters' clock
//! reads) and `cargo bench -p pvspin-slots --features lock-stats --bench slots -- storm`
//! (`PVSPIN_STORM_MS` sets a storm's length, 1000 ms by default).
//!
//! **Decisions** (criterion, one thread, a frozen clock so that no quantum ends): `S =
//! ceil(n/2)` slots (2x overcommit), every slot held and the other vCPUs queued, except
//! `exit_free` (`S = n`, nobody waits).
//!
//! * `exit_free`: a holder's `exited` + `enter` with nobody waiting (every exit of a VM whose
//!   vCPUs fit its slots);
//! * `exit_in_quantum`: the same while others wait, quantum not over (most exits of an
//!   overcommitted VM);
//! * `poll_waiting`: a queued vCPU's timed re-check (`try_enter` that keeps waiting);
//! * `rotate`: the longest holder blocks (`leave`: the queue's head gets its slot) and asks
//!   again (`try_enter`: it queues at the back);
//! * `hand_over`: a holder kicks the queue's head (`hand_over`) and asks again;
//! * `kick_last`: the queue's last vCPU is kicked (`prioritize`: it moves to the front) and the
//!   longest holder blocks, handing it the slot, and asks again;
//! * `lend_reclaim`: the halt watcher sees a holder halt inside KVM (its slot lent to the
//!   head) and wake (it takes a slot back; another holder is asked to leave), that holder
//!   exits and asks again.
//!
//! **Storm** (`lock-stats`): `n` threads on real time, 2 slots (this host's CPUs), a 100 us
//! quantum (the shortest allowed: the most hand-overs), each thread looping `enter`, a short
//! run (about 2 us, cut short when asked to leave), `exited`; one exit in 8 blocks (`leave`, 20
//! us asleep) and one in 16 kicks a random vCPU (`hand_over`); a watcher thread reports
//! random halts and wake-ups (`halt_changed`) as fast as it can. Prints the mutex's
//! acquisitions, the share that found it held, mean and longest hold, mean wait.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use pvspin_slots::{EnterOutcome, RunSlots, SlotClock, SlotConfig, SlotSignals};

const SIZES: [usize; 4] = [2, 16, 64, 255];

/// A clock that never moves: no quantum ends during a decision benchmark.
struct Frozen;
impl SlotClock for Frozen {
    fn now_ns(&self) -> u64 {
        1_000_000
    }
}

/// Records the last vCPU asked to leave; nobody is in a critical section.
#[derive(Default)]
struct Recorder {
    preempted: AtomicUsize,
}
impl SlotSignals for Recorder {
    fn in_critical_section(&self, _: usize) -> bool {
        false
    }
    fn preempt(&self, v: usize) {
        self.preempted.store(v, Ordering::Relaxed);
    }
}

/// The first vCPU from `from` (wrapping) that holds a slot.
fn holder_from(s: &RunSlots, n: usize, from: usize) -> usize {
    (0..n)
        .map(|i| (from + i) % n)
        .find(|&v| s.holds(v))
        .expect("a holder")
}

/// The first vCPU from `from` (wrapping) that holds no slot.
fn waiter_from(s: &RunSlots, n: usize, from: usize) -> usize {
    (0..n)
        .map(|i| (from + i) % n)
        .find(|&v| !s.holds(v))
        .expect("a waiter")
}

/// `n` vCPUs on `slots` slots, vCPUs `0..slots` holding (in that grant order) and the others
/// queued in index order.
fn full(n: usize, slots: usize, sig: &Recorder) -> (RunSlots, VecDeque<usize>, VecDeque<usize>) {
    let s = RunSlots::with_clock(n, SlotConfig::new(slots), Box::new(Frozen)).expect("config");
    for v in 0..n {
        let got = s.try_enter(v, 0, sig);
        assert_eq!(got.is_some(), v < slots, "vCPU {v}");
    }
    (s, (0..slots).collect(), (slots..n).collect())
}

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for n in SIZES {
        let sig = Recorder::default();
        let slots = n.div_ceil(2);
        g.bench_with_input(BenchmarkId::new("exit_free", n), &n, |b, &n| {
            let (s, _, _) = full(n, n, &sig);
            let mut v = 0;
            b.iter(|| {
                assert!(s.exited(v, &sig));
                assert!(matches!(s.enter(v, &sig), EnterOutcome::Granted { .. }));
                v = (v + 1) % n;
            });
        });
        g.bench_with_input(BenchmarkId::new("exit_in_quantum", n), &n, |b, _| {
            let (s, _, _) = full(n, slots, &sig);
            let mut v = 0;
            b.iter(|| {
                assert!(s.exited(v, &sig));
                assert!(matches!(s.enter(v, &sig), EnterOutcome::Granted { .. }));
                v = (v + 1) % slots;
            });
        });
        g.bench_with_input(BenchmarkId::new("poll_waiting", n), &n, |b, &n| {
            let (s, _, _) = full(n, slots, &sig);
            b.iter(|| assert!(s.try_enter(n - 1, 0, &sig).is_none()));
        });
        g.bench_with_input(BenchmarkId::new("rotate", n), &n, |b, _| {
            let (s, mut holders, mut queue) = full(n, slots, &sig);
            b.iter(|| {
                let h = holders.pop_front().expect("a holder");
                s.leave(h);
                holders.push_back(queue.pop_front().expect("a waiter"));
                assert!(s.try_enter(h, 0, &sig).is_none());
                queue.push_back(h);
            });
        });
        g.bench_with_input(BenchmarkId::new("hand_over", n), &n, |b, _| {
            let (s, mut holders, mut queue) = full(n, slots, &sig);
            b.iter(|| {
                let h = holders.pop_front().expect("a holder");
                let w = queue.pop_front().expect("a waiter");
                assert!(s.hand_over(h, w));
                holders.push_back(w);
                assert!(s.try_enter(h, 0, &sig).is_none());
                queue.push_back(h);
            });
        });
        // Kicks and wake-ups overtake waiters, which age: the policy then orders the queue
        // itself, so these two find a holder by asking (outside the timed part).
        g.bench_with_input(BenchmarkId::new("kick_last", n), &n, |b, &n| {
            let (s, _, _) = full(n, slots, &sig);
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut next = 0;
                for _ in 0..iters {
                    let h = holder_from(&s, n, next);
                    let w = waiter_from(&s, n, h + 1);
                    next = h + 1;
                    let start = Instant::now();
                    s.prioritize(w);
                    s.leave(h);
                    let queued = s.try_enter(h, 0, &sig).is_none();
                    timed += start.elapsed();
                    assert!(queued);
                }
                timed
            });
        });
        g.bench_with_input(BenchmarkId::new("lend_reclaim", n), &n, |b, &n| {
            let (s, _, _) = full(n, slots, &sig);
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut next = 0;
                for _ in 0..iters {
                    let h = holder_from(&s, n, next);
                    next = h + 1;
                    let start = Instant::now();
                    // It halts inside KVM: its slot goes to the head of the queue; KVM wakes
                    // it: it takes a slot back, and a holder is asked to leave, which it does
                    // at its next exit, then asks again.
                    s.halt_changed(h, true, &sig);
                    s.halt_changed(h, false, &sig);
                    let victim = sig.preempted.load(Ordering::Relaxed);
                    let kept = s.exited(victim, &sig);
                    let queued = s.try_enter(victim, 0, &sig).is_none();
                    timed += start.elapsed();
                    assert!(!kept && queued, "vCPU {victim}");
                }
                timed
            });
        });
    }
    g.finish();
}

/// Asks to leave through a per-vCPU flag the storm's "run" polls.
struct StormSignals {
    leave: Vec<AtomicBool>,
}
impl SlotSignals for StormSignals {
    fn in_critical_section(&self, _: usize) -> bool {
        false
    }
    fn preempt(&self, v: usize) {
        if let Some(flag) = self.leave.get(v) {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

/// A small xorshift: the storm's choices, seeded per thread.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn spin_for(d: Duration, until: &AtomicBool) {
    let start = Instant::now();
    while start.elapsed() < d && !until.load(Ordering::Relaxed) {
        std::hint::spin_loop();
    }
}

fn storm(n: usize, length: Duration) {
    let cfg = SlotConfig {
        quantum: Duration::from_micros(100),
        cs_extension: Duration::from_micros(50),
        halt_watch_interval: Duration::from_micros(10),
        ..SlotConfig::new(2)
    };
    let s = Arc::new(RunSlots::new(n, cfg).expect("config"));
    let sig = Arc::new(StormSignals {
        leave: (0..n).map(|_| AtomicBool::new(false)).collect(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for v in 0..n {
        let (s, sig, stop, ops) = (s.clone(), sig.clone(), stop.clone(), ops.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (v as u64 + 1));
            while !stop.load(Ordering::Relaxed) {
                if s.enter(v, &*sig) == EnterOutcome::Shutdown {
                    break;
                }
                spin_for(Duration::from_micros(2), &sig.leave[v]);
                sig.leave[v].store(false, Ordering::Relaxed);
                let held = s.exited(v, &*sig);
                match rng.below(16) {
                    0 | 1 => {
                        s.leave(v);
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    2 if held => {
                        let _ = s.hand_over(v, rng.below(n as u64) as usize);
                    }
                    _ => {}
                }
                ops.fetch_add(1, Ordering::Relaxed);
            }
            s.leave(v);
        }));
    }
    let watcher = {
        let (s, sig, stop) = (s.clone(), sig.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(0x2545_f491_4f6c_dd1d);
            let mut set = Vec::new();
            let mut halted = vec![false; n];
            while !stop.load(Ordering::Relaxed) {
                s.watch_set(&mut set);
                for &v in &set {
                    if rng.below(4) == 0 {
                        halted[v] = !halted[v];
                        s.halt_changed(v, halted[v], &*sig);
                    }
                }
                std::thread::sleep(Duration::from_micros(10));
            }
        })
    };
    let start = Instant::now();
    std::thread::sleep(length);
    stop.store(true, Ordering::Relaxed);
    s.shutdown();
    for t in threads {
        t.join().expect("a storm thread");
    }
    watcher.join().expect("the watcher");
    let secs = start.elapsed().as_secs_f64();
    let l = s.lock_stats();
    let st = s.stats();
    let per = |x: u64, by: u64| x as f64 / by.max(1) as f64;
    println!(
        "storm/{n}: {:.0} slot ops/s (enter+exited), {:.0} mutex acquisitions/s, {:.1}% contended, \
         hold mean {:.0} ns max {:.1} us, wait mean {:.0} ns per contended acquisition, \
         {:.1}% of the time held; grants {} hand-overs {} lends {} max wait {:.1} ms",
        per(ops.load(Ordering::Relaxed), 1) / secs,
        l.acquisitions as f64 / secs,
        100.0 * per(l.contended, l.acquisitions),
        per(l.hold_ns, l.acquisitions),
        l.max_hold_ns as f64 / 1e3,
        per(l.wait_ns, l.contended),
        100.0 * l.hold_ns as f64 / 1e9 / secs,
        st.grants,
        st.hand_overs,
        st.lends,
        st.max_wait_ns as f64 / 1e6,
    );
    // The state must still be consistent: at most the slots held (woken vCPUs aside).
    assert!(st.max_held <= 2 + n as u64, "{st:?}");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    let wants = |name: &str| filter.is_none_or(|f| name.contains(f.as_str()));
    if wants("decision") {
        let mut c = Criterion::default()
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(20)
            .configure_from_args();
        decisions(&mut c);
        c.final_summary();
    }
    if wants("storm") && !cfg!(feature = "lock-stats") {
        println!("storm: needs --features lock-stats (it reads the mutex's counters)");
    } else if wants("storm") {
        let ms = std::env::var("PVSPIN_STORM_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        for n in [64, 255] {
            storm(n, Duration::from_millis(ms));
        }
    }
}
