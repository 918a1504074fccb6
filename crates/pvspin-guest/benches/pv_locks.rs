//! Plain ticket lock vs the PV locks on host threads (parking stands for halting).
//!
//! `cargo bench -p pvspin-guest --features test-utils --bench pv_locks`
//!
//! `uncontended`: one lock/unlock pair on one thread (the fast-path cost of the PV locks). The
//! contended comparison is the `oversubscribed` bench (its tail matters, not its median).
//!
//! The development machines are shared and noisy: read medians, compare within one run.

use criterion::{criterion_group, criterion_main, Criterion};
use pvspin_guest::host::{bind_current_thread, HostPvOps};
use pvspin_guest::{
    PvDomain, PvQueuedLock, PvTicketLock, RawPvLock, RawSpinLock, SpinConfig, TicketLock,
};

type Domain = PvDomain<HostPvOps<4>, 4>;

fn config() -> SpinConfig {
    SpinConfig {
        spin_threshold: 256,
        halt: true,
        prewake: SpinConfig::DEFAULT_PREWAKE,
    }
}

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("uncontended");
    bind_current_thread(0);
    let domain = Domain::new(HostPvOps::new(), config());
    let plain = TicketLock::new();
    group.bench_function("ticket", |b| {
        b.iter(|| {
            plain.lock();
            // SAFETY: we hold the lock.
            unsafe { plain.unlock() };
        });
    });
    let pv_ticket = PvTicketLock::new();
    group.bench_function("pv_ticket", |b| {
        b.iter(|| {
            pv_ticket.lock(domain.pv());
            // SAFETY: we hold the lock.
            unsafe { pv_ticket.unlock(domain.pv()) };
        });
    });
    let pv_queued = PvQueuedLock::new();
    group.bench_function("pv_queued", |b| {
        b.iter(|| {
            pv_queued.lock(domain.pv());
            // SAFETY: we hold the lock.
            unsafe { pv_queued.unlock(domain.pv()) };
        });
    });
    group.finish();
}

criterion_group!(benches, uncontended);
criterion_main!(benches);
