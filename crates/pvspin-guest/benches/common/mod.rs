//! Shared by the benches: worker threads started together, each timed.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pvspin_guest::host::bind_current_thread;

/// Runs `work(cpu)` on `threads` threads (CPU ids `0..threads` for the PV locks) released
/// together; returns the span from the first start to the last end (measured in the workers,
/// since the main thread itself may be descheduled) and each worker's result.
pub fn together<T, F>(threads: u32, work: F) -> (Duration, Vec<T>)
where
    T: Send + 'static,
    F: Fn(u32) -> T + Send + Sync + 'static,
{
    let start = Arc::new(Barrier::new(threads as usize));
    let work = Arc::new(work);
    let workers: Vec<_> = (0..threads)
        .map(|cpu| {
            let (work, start) = (work.clone(), start.clone());
            std::thread::spawn(move || {
                bind_current_thread(cpu);
                start.wait();
                let began = Instant::now();
                let result = work(cpu);
                (began, Instant::now(), result)
            })
        })
        .collect();
    let spans: Vec<(Instant, Instant, T)> =
        workers.into_iter().map(|w| w.join().unwrap()).collect();
    let first = spans.iter().map(|s| s.0).min().unwrap();
    let last = spans.iter().map(|s| s.1).max().unwrap();
    (last - first, spans.into_iter().map(|s| s.2).collect())
}
