//! Kick device costs on the host side.
//!
//! `cargo bench -p pvspin-kick --bench kick`. Groups:
//! - `decode`: the pure decoder on a valid kick and on a rejected write;
//! - `device`: `handle_pio_write` of a valid kick on the userspace path (latch) plus the
//!   consuming `try_take_kick`, and of a rejected write (counter + rate-limiter check);
//! - `wake_roundtrip`: two threads ping-pong through two `WakeLatch`es (two kick-to-wake hops
//!   per iteration), side by side: sleeping at once vs a bounded 50 us spin before sleeping
//!   (the userspace analogue of KVM halt polling).

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pvspin_abi::doorbell::DEFAULT_PORT;
use pvspin_kick::{decode, KickConfig, KickDevice, ParkOutcome, ParkPolicy, WakeLatch};

fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    let valid = 3u32.to_le_bytes();
    let bad = 99u32.to_le_bytes();
    g.bench_function("kick_valid", |b| {
        b.iter(|| decode(black_box(0), black_box(&valid), black_box(8)));
    });
    g.bench_function("kick_no_such_vcpu", |b| {
        b.iter(|| decode(black_box(0), black_box(&bad), black_box(8)));
    });
    g.finish();
}

fn bench_device(c: &mut Criterion) {
    let mut g = c.benchmark_group("device");
    let dev = KickDevice::userspace(KickConfig {
        nr_vcpus: 8,
        ..KickConfig::default()
    })
    .unwrap();
    let valid = 3u32.to_le_bytes();
    let bad = 99u32.to_le_bytes();
    g.bench_function("userspace_kick_and_take", |b| {
        b.iter(|| {
            black_box(dev.handle_pio_write(DEFAULT_PORT, black_box(&valid)));
            black_box(dev.try_take_kick(3).unwrap())
        });
    });
    g.bench_function("rejected_write", |b| {
        b.iter(|| black_box(dev.handle_pio_write(DEFAULT_PORT, black_box(&bad))));
    });
    g.finish();
}

fn roundtrip(c: &mut Criterion, name: &str, policy: ParkPolicy) {
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let ping = Arc::new(WakeLatch::new());
            let pong = Arc::new(WakeLatch::new());
            let stop = Arc::new(AtomicBool::new(false));
            let echo = {
                let (ping, pong, stop) = (ping.clone(), pong.clone(), stop.clone());
                thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        match ping.park(&policy) {
                            ParkOutcome::Shutdown => break,
                            o if o.kicked() => {
                                pong.kick();
                            }
                            _ => {}
                        }
                    }
                })
            };
            let start = Instant::now();
            for _ in 0..iters {
                ping.kick();
                let o = pong.park(&policy);
                assert!(o.kicked(), "{o:?}");
            }
            let elapsed = start.elapsed();
            stop.store(true, Ordering::Relaxed);
            ping.shutdown();
            echo.join().unwrap();
            elapsed
        });
    });
}

fn bench_wake(c: &mut Criterion) {
    let timeout = Some(Duration::from_secs(5));
    roundtrip(
        c,
        "wake_roundtrip/sleep",
        ParkPolicy {
            spin: Duration::ZERO,
            timeout,
        },
    );
    roundtrip(
        c,
        "wake_roundtrip/spin50us_then_sleep",
        ParkPolicy {
            spin: Duration::from_micros(50),
            timeout,
        },
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = bench_decode, bench_device, bench_wake
}
criterion_main!(benches);
