//! Loom models of the halt/kick handshake: the real lock code over the loom-modelled
//! [`HostPvOps`] latch (a kick before the park is remembered; no timeouts, so a lost wakeup
//! leaves every thread blocked and loom reports a deadlock). Loom also reports two holders in
//! the critical section (a data race on the guarded cell).
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p pvspin-guest --release loom
//! ```
//!
//! The preemption bound defaults to 3 here; set `LOOM_MAX_PREEMPTIONS` to change it. The
//! eleven models without backoff take about 25 s on the development machine (after a first
//! build of loom, about a minute); all fifteen took 70 to 95 s on a busy one. Deeper runs also pass: the two-CPU models with `LOOM_MAX_PREEMPTIONS=6` (under a
//! second), the three-CPU models with `LOOM_MAX_PREEMPTIONS=4` (about 3 minutes).
//!
//! The models can fail: each of these mutations was checked to make loom report a deadlock
//! (a lost wakeup): the ticket waiter not re-checking `owner` after publishing Halted; the
//! ticket unlocker without its `fence(SeqCst)` (found with three CPUs); the ticket unlocker
//! skipping the scan when one more ticket is out; the queued waiter or the queued unlocker
//! without its fence; the bare handshake without the re-check; the host latch forgetting a
//! kick that arrived between the waiter's check and its park; the stock queued lock's
//! hand-over to a halted successor without marking the lock SLOW, or without its fence (both
//! found with three CPUs). The four stock models take about 60 s (the hybrid trylock's spin
//! adds interleavings). The three-CPU backoff models reach the backoff: a backoff spin phase
//! claiming the lock after any backoff, without reading `owner`, made loom report two
//! holders. The two `_prewake` models run the ticket and queued
//! locks over a backend that says the vCPUs fit (`VCPUS_FIT`), so that unlockers also kick the
//! waiter behind the new holder, and check that some execution did (about 3 minutes together
//! on a busy machine).

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use std::vec::Vec;

use crate::host::{bind_current_thread, HostPvOps};
use crate::pv::{PvDomain, PvOps, RawPvLock, SpinConfig};
use crate::sync::{fence, AtomicU8, Ordering};
use crate::{PvBackoffTicketLock, PvQueuedLock, PvTicketLock, StockQueuedLock};

/// The smallest threshold: one look at the lock, then the halt path.
const CONFIG: SpinConfig = SpinConfig {
    spin_threshold: 1,
    halt: true,
    prewake: SpinConfig::DEFAULT_PREWAKE,
};

fn builder() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = Some(3);
    }
    builder
}

const RUNNING: u8 = 0;
const HALTED: u8 = 1;

/// The bare handshake: the waiter publishes Halted, re-checks the condition and waits; the
/// releaser sets the condition and kicks if it sees Halted.
fn handshake(spurious_every: u64) {
    builder().check(move || {
        let ops: Arc<HostPvOps<2>> = Arc::new(HostPvOps::with_spurious_every(spurious_every));
        let released = Arc::new(AtomicU8::new(0));
        let state = Arc::new(AtomicU8::new(RUNNING));
        let waiter = {
            let (ops, released, state) = (ops.clone(), released.clone(), state.clone());
            loom::thread::spawn(move || {
                bind_current_thread(1);
                while released.load(Ordering::Acquire) == 0 {
                    state.store(HALTED, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    if released.load(Ordering::Acquire) != 0 {
                        break;
                    }
                    ops.wait(&state, HALTED);
                    state.store(RUNNING, Ordering::Relaxed);
                }
                state.store(RUNNING, Ordering::Relaxed);
            })
        };
        bind_current_thread(0);
        released.store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        if state
            .compare_exchange(HALTED, RUNNING, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            ops.kick(1);
        }
        waiter.join().unwrap();
    });
}

#[test]
fn loom_handshake_no_lost_wakeup() {
    handshake(0);
}

#[test]
fn loom_handshake_with_spurious_wakeups() {
    handshake(2);
}

/// A kick that reaches the latch before the wait is not lost: the wait returns.
#[test]
fn loom_kick_before_wait_is_remembered() {
    builder().check(|| {
        let ops: Arc<HostPvOps<2>> = Arc::new(HostPvOps::new());
        let state = Arc::new(AtomicU8::new(HALTED));
        let kicker = {
            let ops = ops.clone();
            loom::thread::spawn(move || ops.kick(1))
        };
        kicker.join().unwrap();
        bind_current_thread(1);
        ops.wait(&state, HALTED);
        assert_eq!(ops.stats().latched, 1);
    });
}

/// The host backend, saying the VM's vCPUs fit its CPUs (`VCPUS_FIT`): the PV locks'
/// unlockers then also pre-wake the waiter behind the new holder.
#[derive(Debug, Default)]
struct Fit<const N: usize>(HostPvOps<N>);

impl<const N: usize> PvOps for Fit<N> {
    fn wait(&self, ptr: &AtomicU8, val: u8) {
        self.0.wait(ptr, val);
    }
    fn kick(&self, cpu: u32) {
        self.0.kick(cpu);
    }
    fn cpu_id(&self) -> u32 {
        self.0.cpu_id()
    }
    fn vcpus_fit(&self) -> bool {
        true
    }
}

/// The backends the models run over: the host latch, alone or saying the vCPUs fit.
trait ModelOps: PvOps + Send + Sync + 'static {
    fn with_spurious_every(every: u64) -> Self;
    fn host(&self) -> &HostPvOps<3>;
}

impl ModelOps for HostPvOps<3> {
    fn with_spurious_every(every: u64) -> Self {
        HostPvOps::with_spurious_every(every)
    }
    fn host(&self) -> &HostPvOps<3> {
        self
    }
}

impl ModelOps for Fit<3> {
    fn with_spurious_every(every: u64) -> Self {
        Fit(HostPvOps::with_spurious_every(every))
    }
    fn host(&self) -> &HostPvOps<3> {
        &self.0
    }
}

/// `threads` CPUs each take `lock` once around a guarded increment.
fn lock_model<L: RawPvLock + Send + Sync + 'static>(
    threads: u32,
    spurious_every: u64,
    new: fn() -> L,
) {
    let prewoken = lock_model_over::<HostPvOps<3>, L>(threads, spurious_every, new);
    assert_eq!(prewoken, 0, "pre-wakes without VCPUS_FIT");
}

/// [`lock_model`] over backend `O`; returns in how many executions an unlocker pre-woke a
/// waiter.
fn lock_model_over<O: ModelOps, L: RawPvLock + Send + Sync + 'static>(
    threads: u32,
    spurious_every: u64,
    new: fn() -> L,
) -> u64 {
    // Outside loom's model: counts across its executions.
    let prewoken = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = prewoken.clone();
    builder().check(move || {
        let domain: Arc<PvDomain<O, 3>> = Arc::new(PvDomain::new(
            O::with_spurious_every(spurious_every),
            CONFIG,
        ));
        let lock = Arc::new(new());
        let value = Arc::new(UnsafeCell::new(0u32));
        let body = |cpu: u32, domain: &PvDomain<O, 3>, lock: &L, value: &UnsafeCell<u32>| {
            bind_current_thread(cpu);
            lock.lock(domain.pv());
            value.with_mut(|v| {
                // SAFETY: the lock is held; loom reports any concurrent access.
                unsafe { *v += 1 };
            });
            // SAFETY: this thread holds the lock.
            unsafe { lock.unlock(domain.pv()) };
        };
        let others: Vec<_> = (1..threads)
            .map(|cpu| {
                let (domain, lock, value) = (domain.clone(), lock.clone(), value.clone());
                loom::thread::spawn(move || body(cpu, &domain, &lock, &value))
            })
            .collect();
        body(0, &domain, &lock, &value);
        for other in others {
            other.join().unwrap();
        }
        assert!(!lock.is_locked());
        // SAFETY: every thread has finished.
        assert_eq!(value.with(|v| unsafe { *v }), threads);
        let stats = domain.total_stats();
        assert_eq!(stats.kicks, domain.ops().host().stats().kicks);
        // A kick needs a published Halted (it may race the halt itself).
        assert!(stats.kicks <= stats.slowpath);
        if stats.prewakes != 0 {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    prewoken.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn loom_pv_ticket_two_cpus() {
    lock_model(2, 0, PvTicketLock::new);
}

#[test]
fn loom_pv_ticket_two_cpus_spurious() {
    lock_model(2, 2, PvTicketLock::new);
}

#[test]
fn loom_pv_queued_two_cpus() {
    lock_model(2, 0, PvQueuedLock::new);
}

#[test]
fn loom_pv_queued_two_cpus_spurious() {
    lock_model(2, 2, PvQueuedLock::new);
}

#[test]
fn loom_pv_ticket_three_cpus() {
    lock_model(3, 0, PvTicketLock::new);
}

#[test]
fn loom_pv_queued_three_cpus() {
    lock_model(3, 0, PvQueuedLock::new);
}

// The pre-wake needs three CPUs: a holder, the next owner and the waiter behind it.
#[test]
fn loom_pv_ticket_three_cpus_prewake() {
    assert_ne!(lock_model_over::<Fit<3>, _>(3, 0, PvTicketLock::new), 0);
}

#[test]
fn loom_pv_queued_three_cpus_prewake() {
    assert_ne!(lock_model_over::<Fit<3>, _>(3, 0, PvQueuedLock::new), 0);
}

#[test]
fn loom_pv_ticket_three_cpus_spurious() {
    lock_model(3, 2, PvTicketLock::new);
}

#[test]
fn loom_pv_queued_three_cpus_spurious() {
    lock_model(3, 2, PvQueuedLock::new);
}

// The backoff ticket lock: the PV ticket lock's handshake with a different spin phase. With
// three CPUs the last waiter is two places from the head and backs off before its look.

#[test]
fn loom_pv_backoff_two_cpus() {
    lock_model(2, 0, PvBackoffTicketLock::new);
}

#[test]
fn loom_pv_backoff_two_cpus_spurious() {
    lock_model(2, 2, PvBackoffTicketLock::new);
}

#[test]
fn loom_pv_backoff_three_cpus() {
    lock_model(3, 0, PvBackoffTicketLock::new);
}

#[test]
fn loom_pv_backoff_three_cpus_spurious() {
    lock_model(3, 2, PvBackoffTicketLock::new);
}

// The stock flavor of the queued lock (Linux's pv qspinlock): the steal attempt, the queue
// head's SLOW mark and hash, the hand-over that hashes a halted successor instead of kicking
// it, and the unlock that kicks a SLOW lock's hashed head. With two CPUs the waiter is the
// queue head; with three the last one also waits on its node, behind a head that may be
// halted (pv_wait_early).

#[test]
fn loom_stock_queued_two_cpus() {
    lock_model(2, 0, StockQueuedLock::new_stock);
}

#[test]
fn loom_stock_queued_two_cpus_spurious() {
    lock_model(2, 2, StockQueuedLock::new_stock);
}

#[test]
fn loom_stock_queued_three_cpus() {
    lock_model(3, 0, StockQueuedLock::new_stock);
}

#[test]
fn loom_stock_queued_three_cpus_spurious() {
    lock_model(3, 2, StockQueuedLock::new_stock);
}
