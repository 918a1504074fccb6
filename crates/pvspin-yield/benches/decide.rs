//! Decision cost per notification at 8, 64 and 1024 vCPUs.
//!
//! Board shapes: "all_running" (no candidate at all), "one_ready_last_in_order" (the only
//! ready vCPU is the last in round-robin order), "mixed" (a quarter of the vCPUs preempted,
//! some halted, some spinning), "hint" (the guest names a preempted vCPU) and
//! "steal_time_full_scan" (every vCPU has a steal-time area, none preempted: one guest-memory
//! byte read per vCPU examined, up to the scan budget).
//!
//! `cargo bench -p pvspin-yield -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pvspin_track::VcpuBoard;
use pvspin_yield::{DirectedYield, PolicyConfig, SpinNotification, StealTimeView};

fn worst(n: usize) -> VcpuBoard {
    let b = VcpuBoard::new(n).unwrap();
    for v in 0..n {
        b.on_exit(v, Some(0));
        b.on_enter_run(v);
    }
    b
}

fn mixed(n: usize) -> VcpuBoard {
    let b = VcpuBoard::new(n).unwrap();
    for v in 0..n {
        b.on_exit(v, Some(if v % 3 == 0 { 3 } else { 0 }));
        match v % 8 {
            0 | 1 => b.park(v),
            2 => b.on_halt(v),
            3 => b.set_spinning(v, true),
            _ => b.on_enter_run(v),
        }
    }
    b
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    for n in [8usize, 64, 1024] {
        let b = worst(n);
        let p = DirectedYield::new(PolicyConfig::default()).unwrap();
        let note = SpinNotification {
            spinner: 0,
            lock_id: 1,
            waiting_for: None,
            spun: 16,
        };
        g.bench_with_input(BenchmarkId::new("all_running", n), &n, |bch, _| {
            bch.iter(|| p.decide(std::hint::black_box(&b), &note));
        });
        b.on_exit(n - 1, Some(0));
        b.park(n - 1);
        g.bench_with_input(
            BenchmarkId::new("one_ready_last_in_order", n),
            &n,
            |bch, _| {
                // Reset the round robin so the only candidate is always the last one examined.
                bch.iter(|| {
                    let p = DirectedYield::new(PolicyConfig::default()).unwrap();
                    p.decide(std::hint::black_box(&b), &note)
                });
            },
        );
        let m = mixed(n);
        let note_m = SpinNotification { spinner: 4, ..note };
        g.bench_with_input(BenchmarkId::new("mixed", n), &n, |bch, _| {
            bch.iter(|| p.decide(std::hint::black_box(&m), &note_m));
        });
        // Every vCPU registered steal time and none is preempted: the scan must read every
        // vCPU's byte in guest memory (the worst case of the steal-time view).
        let st = worst(n);
        let mem = vec![0u8; n * 64];
        for v in 0..n {
            st.set_steal_time_gpa(v, Some(v as u64 * 64));
        }
        g.bench_with_input(BenchmarkId::new("steal_time_full_scan", n), &n, |bch, _| {
            let view = StealTimeView {
                board: &st,
                mem: mem.as_slice(),
            };
            bch.iter(|| p.decide(std::hint::black_box(&view), &note));
        });
        let hint = SpinNotification {
            waiting_for: Some((n - 1) as u32),
            ..note
        };
        g.bench_with_input(BenchmarkId::new("hint", n), &n, |bch, _| {
            bch.iter(|| p.decide(std::hint::black_box(&b), &hint));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
