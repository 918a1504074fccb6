//! Side by side, on host threads: the three actuators under lock-holder preemption.
//!
//! A stand-in for the real measurement with the example VMM's guests: `threads` threads, all
//! pinned to one CPU (so the lock holder is regularly preempted), take a test-and-set lock
//! that records its holder; a waiter spins `spin` times, then asks the actuator to yield to
//! the holder (the guest's hint), exactly as a vCPU's notification would. The holder ends its
//! boost after each release (its "next exit"). Reports wall time and CPU time per
//! acquisition, median of `reps` runs. Every wait is bounded by a wall-clock limit.
//!
//! `cargo run --release -p pvspin-hints --example actuators -- [threads] [acq] [spin] [reps] [cs]`

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pvspin_hints::sched::current_tid;
use pvspin_hints::{Actuator, ActuatorOptions};

const FREE: u32 = u32::MAX;
const LIMIT: Duration = Duration::from_secs(20);

fn work(n: u32) -> u32 {
    let mut x = 1u32;
    for i in 0..n {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
    }
    x
}

fn pin_to_cpu0() {
    let mut set = rustix::thread::CpuSet::new();
    set.set(0);
    rustix::thread::sched_setaffinity(None, &set).expect("sched_setaffinity");
}

fn cpu_seconds() -> f64 {
    // SAFETY: all-zero is a valid rusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is valid and writable for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

struct Run {
    wall_us: f64,
    cpu_us: f64,
    yields: u64,
    timed_out: bool,
}

fn run(act: &Arc<dyn Actuator>, threads: usize, acq: u32, spin: u32, cs: u32) -> Run {
    let lock = Arc::new(AtomicU32::new(FREE));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..threads).map(|_| AtomicI32::new(0)).collect());
    let abort = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(threads + 1));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|me| {
            let (lock, tids, abort, start, act) = (
                lock.clone(),
                tids.clone(),
                abort.clone(),
                start.clone(),
                act.clone(),
            );
            std::thread::spawn(move || {
                pin_to_cpu0();
                tids[me].store(current_tid(), Ordering::Release);
                start.wait();
                let mut yields = 0u64;
                for _ in 0..acq {
                    let mut spun = 0;
                    loop {
                        if lock
                            .compare_exchange(FREE, me as u32, Ordering::Acquire, Ordering::Relaxed)
                            .is_ok()
                        {
                            break;
                        }
                        if abort.load(Ordering::Relaxed) {
                            return yields;
                        }
                        spun += 1;
                        if spun >= spin {
                            spun = 0;
                            let h = lock.load(Ordering::Relaxed);
                            if (h as usize) < tids.len() && h as usize != me {
                                act.yield_to(h as usize, tids[h as usize].load(Ordering::Acquire));
                            } else {
                                act.yield_self();
                            }
                            yields += 1;
                        }
                        std::hint::spin_loop();
                    }
                    work(cs);
                    lock.store(FREE, Ordering::Release);
                    act.on_target_exit(me);
                    work(cs);
                }
                act.on_target_exit(me);
                yields
            })
        })
        .collect();
    let c0 = cpu_seconds();
    start.wait();
    let t1 = Instant::now();
    // The watchdog of the run itself: bounded.
    let mut timed_out = false;
    while !handles.iter().all(|h| h.is_finished()) {
        if t0.elapsed() > LIMIT {
            abort.store(true, Ordering::Relaxed);
            timed_out = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let wall = t1.elapsed().as_secs_f64();
    let yields = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    act.restore_all();
    let total = f64::from(acq) * threads as f64;
    Run {
        wall_us: wall * 1e6 / total,
        cpu_us: (cpu_seconds() - c0) * 1e6 / total,
        yields,
        timed_out,
    }
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = args.first().copied().unwrap_or(4) as usize;
    let acq = args.get(1).copied().unwrap_or(5000);
    let spin = args.get(2).copied().unwrap_or(16);
    let reps = args.get(3).copied().unwrap_or(3).max(1) as usize;
    let cs = args.get(4).copied().unwrap_or(3000);
    println!(
        "{threads} threads pinned to CPU 0, {acq} acquisitions each, spin {spin}, \
         critical section {cs} steps, median of {reps}"
    );
    for name in ["yield", "nice", "fifo"] {
        let act: Arc<dyn Actuator> = match ActuatorOptions::new(name, threads).build() {
            Ok(a) => Arc::from(a),
            Err(e) => {
                println!("{name:>5}: refused: {e}");
                continue;
            }
        };
        let mut runs: Vec<Run> = (0..reps)
            .map(|_| run(&act, threads, acq, spin, cs))
            .collect();
        runs.sort_by(|a, b| a.wall_us.total_cmp(&b.wall_us));
        let m = &runs[reps / 2];
        println!(
            "{name:>5}: {:.2} us wall/acq, {:.2} us CPU/acq, {} yields{}",
            m.wall_us,
            m.cpu_us,
            m.yields,
            if runs.iter().any(|r| r.timed_out) {
                " (a run TIMED OUT)"
            } else {
                ""
            }
        );
    }
}
