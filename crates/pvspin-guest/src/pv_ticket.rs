//! The PV ticket lock: a ticket lock whose waiters halt past the spin threshold and whose
//! unlocker kicks the halted waiter holding the next ticket (like Linux's old pv ticketlock
//! and `kvm_unlock_kick`).
//!
//! # The halt/kick handshake
//!
//! Waiter for ticket `t` on CPU `c`, past the threshold:
//! 1. write slot[c] = {lock, t}, then `slot[c].state = HALTED` (Release);
//! 2. `fence(SeqCst)`; if `owner == t`: set RUNNING, it owns the lock;
//! 3. `pv_wait(&slot[c].state, HALTED)`; set RUNNING; if `owner == t` it owns the lock, else
//!    (spurious) spin again.
//!
//! Unlocker: `owner = t` (Release); `fence(SeqCst)`; if some CPU drew ticket `t` (`next != t`)
//! and some CPU of the domain is marked halted (a bitmap, one bit per CPU, that waiters set
//! after step 1, before the fence, and clear when they run again: Linux's old pv ticketlock
//! kept the same set), look at the slots of the marked CPUs only for one that is HALTED on
//! {lock, t}; `cmpxchg(HALTED -> KICKED)` and kick it. So an unlock reads `N / 64` words and
//! the slots of the halted CPUs, not all `N` slots.
//!
//! The two fences order "waiter publishes HALTED, then reads owner" against "unlocker writes
//! owner, then reads the slot": at least one side sees the other's write, so either the waiter
//! does not wait or the unlocker kicks it. A kick that lands between the waiter's re-check and
//! its halt is remembered by the backend ([`PvOps`](crate::PvOps) contract). The loom model in
//! `loom_tests.rs` checks this.
//!
//! # The pre-wake
//!
//! When the host says the VM's vCPUs fit the CPUs it gets ([`PvOps::vcpus_fit`]: a kicked
//! vCPU runs without queueing behind this VM's others, as with pvspin's run slots), the
//! unlocker also kicks the halted waiters of tickets `t + 1 ..= t + d`, those behind the new
//! owner (`d` is [`SpinConfig::prewake`], default 2). With more waiters than CPUs most
//! waiters halt, and a kick at unlock time puts a whole wake-up into every hand-over (a convoy
//! that, once started, lasts the run); kicked a hand-over or two early, a waiter spins by the
//! time the lock reaches it, and the unlocks after that find their new owner spinning. It is a kick only: the woken waiter finds the lock still held
//! (a spurious wakeup, or a halt more if it spins out its budget), and the handshake above
//! stays what makes the lock correct. Counted in
//! [`PvStatsSnapshot::prewakes`](crate::PvStatsSnapshot). Without `VCPUS_FIT` a woken waiter
//! would take a CPU the holder may need, so there is no pre-wake.
//!
//! `fence(SeqCst)` here means `sync::full_fence`: loom's fence under loom, a locked OR on
//! x86-64 (no MFENCE, an SSE2 instruction that KVM's emulator may not handle).

use core::sync::atomic::{AtomicU32 as HintU32, Ordering as HintOrdering};

use crate::pv::{Pv, PvOps, RawPvLock, SpinConfig, SpinWait};
use crate::sync::{full_fence, AtomicU32, AtomicU8, AtomicUsize, Ordering};

/// How a PV ticket waiter spends one spin phase: the part of its wait before the halt
/// handshake. The handshake (publish Halted, fence, re-check, `pv_wait`) and the unlocker's
/// kick are the lock's and the same for every strategy, so a lock that only waits differently
/// (the backoff ticket lock) reuses them instead of repeating them.
pub(crate) trait TicketSpin {
    /// Spins until `owner` serves `ticket` or the phase's budget (`pv.config.spin_threshold`
    /// spins) is spent; `wait` describes the wait for spin notifications. Returns `true` only
    /// right after an Acquire load of `owner` saw `ticket`.
    fn spin_phase<O: PvOps>(
        &self,
        pv: Pv<'_, O>,
        owner: &AtomicU32,
        ticket: u32,
        wait: impl Fn(u32) -> SpinWait,
    ) -> bool;
}

/// The PV ticket lock's own strategy: look at `owner` once per spin.
#[derive(Debug)]
pub(crate) struct PollEverySpin;

impl TicketSpin for PollEverySpin {
    #[inline]
    fn spin_phase<O: PvOps>(
        &self,
        pv: Pv<'_, O>,
        owner: &AtomicU32,
        ticket: u32,
        wait: impl Fn(u32) -> SpinWait,
    ) -> bool {
        pv.spin_phase(|| owner.load(Ordering::Acquire) == ticket, wait)
    }
}

/// The waiter runs (or has not published a wait).
pub(crate) const RUNNING: u8 = 0;
/// The waiter is halted, or about to halt, waiting for `ticket` of `lock`.
pub(crate) const HALTED: u8 = 1;
/// An unlocker has kicked the waiter (it is waking up).
pub(crate) const KICKED: u8 = 2;

/// One vCPU's "halted waiting for ticket t of lock L" record.
#[derive(Debug)]
pub(crate) struct TicketWaitSlot {
    lock: AtomicUsize,
    ticket: AtomicU32,
    state: AtomicU8,
}

impl TicketWaitSlot {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Self {
        Self {
            lock: AtomicUsize::new(0),
            ticket: AtomicU32::new(0),
            state: AtomicU8::new(RUNNING),
        }
    }

    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        Self {
            lock: AtomicUsize::new(0),
            ticket: AtomicU32::new(0),
            state: AtomicU8::new(RUNNING),
        }
    }
}

/// A fair (FIFO) ticket lock with a paravirtual slow path.
///
/// Waiters spin [`SpinConfig::spin_threshold`](crate::SpinConfig) times, then publish that they
/// halt waiting for their ticket and `pv_wait`. The unlocker kicks the vCPU holding the next
/// ticket only if it published a halt, so an uncontended or briefly contended unlock costs no
/// kick. Each vCPU waits for at most one PV ticket lock at a time (one waiting slot per vCPU);
/// do not take one from an interrupt handler that can interrupt a waiting vCPU.
///
/// A vCPU whose id is not below the domain's `N` never halts: it spins (counted in
/// [`PvDomain::bad_cpu_count`](crate::PvDomain::bad_cpu_count)).
///
/// # Layout
///
/// 16 bytes, aligned to 16, so its words never straddle two cache lines (a hand-over then
/// moves one line). Put the data the lock guards on the same line when it is small and
/// written in every critical section: a lock and its value that straddle two lines move both
/// on every hand-over: in the example guest that made the PV ticket lock 26-35% slower at 1x
/// than a plain ticket lock that happened to share a line with its value (docs/benchmarks.md
/// §14.4).
#[derive(Debug)]
#[repr(C, align(16))]
pub struct PvTicketLock {
    /// The next ticket to hand out.
    next: AtomicU32,
    /// The ticket being served; only the holder writes it.
    owner: AtomicU32,
    /// The holder's CPU id + 1, 0 when unknown or free: a hint for spin notifications, not
    /// part of the handshake (a `core` atomic, so loom does not model it).
    holder: HintU32,
}

impl PvTicketLock {
    /// A new, unlocked lock.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            next: AtomicU32::new(0),
            owner: AtomicU32::new(0),
            holder: HintU32::new(0),
        }
    }

    /// A new, unlocked lock.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            next: AtomicU32::new(0),
            owner: AtomicU32::new(0),
            holder: HintU32::new(0),
        }
    }

    /// The CPU that holds the lock, as recorded at its acquisition (a racy hint).
    pub fn holder_hint(&self) -> Option<u32> {
        self.holder.load(HintOrdering::Relaxed).checked_sub(1)
    }

    /// How many callers hold or wait for the lock (a racy snapshot).
    pub fn queue_len(&self) -> u32 {
        let next = self.next.load(Ordering::Relaxed);
        next.wrapping_sub(self.owner.load(Ordering::Relaxed))
    }

    fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// Takes the lock, spending each spin phase of a contended wait as `spin` says.
    #[inline]
    pub(crate) fn lock_with<O: PvOps, S: TicketSpin>(&self, pv: Pv<'_, O>, spin: &S) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        if self.owner.load(Ordering::Acquire) != ticket {
            self.lock_slow(pv, ticket, spin);
        }
        self.record_holder(pv);
    }

    #[cold]
    fn lock_slow<O: PvOps, S: TicketSpin>(&self, pv: Pv<'_, O>, ticket: u32, spin: &S) {
        // One lookup (a bad CPU id counts once per slow path).
        let this = pv.this_cpu();
        let me = if pv.config.halt { this } else { None };
        // Publish {lock, ticket} in this CPU's slot now (state stays RUNNING, so no unlocker
        // acts on it), so that other waiters can name this CPU as the next owner once the
        // lock is released to it: if it is preempted meanwhile (a host time slice, a run
        // slot taken away), they wait early and their WAIT names it, and the host runs it
        // sooner. Until 2026-12-03 only with spin-count notifications on; with time budgets
        // (whose window reads as "never") a preempted next owner was unnamed unless it had
        // halted, and its waiters spun their whole budget and halted naming nobody.
        let my_id = this.map(|(id, cpu)| {
            cpu.ticket.lock.store(self.id(), Ordering::Relaxed);
            cpu.ticket.ticket.store(ticket, Ordering::Relaxed);
            id
        });
        let wait = |spun| {
            let (waiting_for, next_owner) = match self.holder_hint() {
                Some(holder) => (Some(holder), false),
                None => (self.next_owner_hint(pv, my_id), true),
            };
            // The next owner an unlocker kicked runs soon: not a reason to halt behind it.
            let waking = next_owner
                && waiting_for.is_some_and(|cpu| {
                    pv.cpus
                        .get(cpu as usize)
                        .is_some_and(|c| c.ticket.state.load(Ordering::Relaxed) == KICKED)
                });
            SpinWait {
                lock: self.id(),
                waiting_for,
                next_owner: next_owner && waiting_for.is_some(),
                ahead: waiting_for,
                waking,
                spun,
            }
        };
        loop {
            if spin.spin_phase(pv, &self.owner, ticket, wait) {
                return;
            }
            let Some((id, cpu)) = me else {
                continue;
            };
            cpu.stats.slowpath();
            let slot = &cpu.ticket;
            slot.lock.store(self.id(), Ordering::Relaxed);
            slot.ticket.store(ticket, Ordering::Relaxed);
            slot.state.store(HALTED, Ordering::Release);
            // Marked after the slot says HALTED: an unlocker that sees the bit sees the slot.
            pv.mark_halted(id);
            full_fence();
            if self.owner.load(Ordering::Acquire) == ticket {
                slot.state.store(RUNNING, Ordering::Relaxed);
                pv.clear_halted(id);
                return;
            }
            cpu.stats.halt();
            pv.ops.wait_for(&slot.state, HALTED, &wait(0));
            slot.state.store(RUNNING, Ordering::Relaxed);
            pv.clear_halted(id);
            if self.owner.load(Ordering::Acquire) == ticket {
                return;
            }
            cpu.stats.spurious();
        }
    }

    /// The CPU whose published slot holds the ticket being served (the lock was released to
    /// it and it has not recorded itself holder yet), other than `me`. A racy hint.
    fn next_owner_hint<O: PvOps>(&self, pv: Pv<'_, O>, me: Option<u32>) -> Option<u32> {
        let owner = self.owner.load(Ordering::Relaxed);
        let id = self.id();
        let found = pv.cpus.iter().position(|cpu| {
            cpu.ticket.lock.load(Ordering::Relaxed) == id
                && cpu.ticket.ticket.load(Ordering::Relaxed) == owner
        })?;
        // `found < N <= MAX_CPUS`, so it fits.
        let found = found as u32;
        (Some(found) != me).then_some(found)
    }

    #[inline]
    fn record_holder<O: PvOps>(&self, pv: Pv<'_, O>) {
        let id = pv.ops.cpu_id();
        self.holder
            .store(id.saturating_add(1), HintOrdering::Relaxed);
    }

    /// Kicks the halted waiter of ticket `served`, the new owner, and the halted waiters of
    /// the `prewake` tickets after it (module docs, "The pre-wake"). One scan finds them all.
    #[cold]
    fn kick_next<O: PvOps>(&self, pv: Pv<'_, O>, served: u32, prewake: u8) {
        let id = self.id();
        // found[k]: the CPU halted for ticket `served + k`.
        let mut found = [None; 1 + SpinConfig::MAX_PREWAKE as usize];
        let wanted = 1 + usize::from(prewake.min(SpinConfig::MAX_PREWAKE));
        let mut missing = wanted;
        // Only the CPUs marked halted: their slots, not all N.
        'scan: for (word_index, word) in pv.halted.iter().enumerate() {
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let index = word_index * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let Some(slot) = pv.cpus.get(index).map(|cpu| &cpu.ticket) else {
                    continue;
                };
                if slot.state.load(Ordering::Acquire) != HALTED
                    || slot.lock.load(Ordering::Relaxed) != id
                {
                    continue;
                }
                let behind = slot.ticket.load(Ordering::Relaxed).wrapping_sub(served) as usize;
                // Exactly one CPU holds each ticket.
                if behind < wanted && found[behind].is_none() {
                    found[behind] = Some(index);
                    missing -= 1;
                    if missing == 0 {
                        break 'scan;
                    }
                }
            }
        }
        let Some((_, me)) = pv.this_cpu() else {
            // Counted as a bad CPU; the kicks are still due.
            for (k, index) in found.iter().enumerate() {
                if let Some(index) = *index {
                    Self::kick_slot(pv, index, served.wrapping_add(k as u32));
                }
            }
            return;
        };
        let mut any = false;
        for (k, index) in found.iter().enumerate() {
            let Some(index) = *index else { continue };
            if Self::kick_slot(pv, index, served.wrapping_add(k as u32)) {
                any = true;
                me.stats.kick();
                if k > 0 {
                    me.stats.prewake();
                }
            }
        }
        if !any {
            me.stats.no_kick();
        }
    }

    /// Kicks the CPU of wait slot `index` if it still waits halted for `ticket` of this lock.
    fn kick_slot<O: PvOps>(pv: Pv<'_, O>, index: usize, ticket: u32) -> bool {
        let Some(slot) = pv.cpus.get(index).map(|cpu| &cpu.ticket) else {
            return false;
        };
        // The scan's loads were not one snapshot: the waiter may have woken and moved on to
        // another wait since. A kick of a wait other than the one meant only wakes it
        // spuriously (it re-checks); re-reading the ticket narrows that window.
        if slot.ticket.load(Ordering::Relaxed) != ticket
            || slot
                .state
                .compare_exchange(HALTED, KICKED, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        // `index < N <= MAX_CPUS`, so it fits.
        pv.ops.kick(index as u32);
        true
    }
}

impl Default for PvTicketLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: tickets are drawn with one atomic fetch_add, so each is unique; only the caller whose
// ticket equals `owner` returns from `lock` (every return path has just read `owner == ticket`
// with Acquire), and `owner` moves on only in `unlock` (Release).
unsafe impl RawPvLock for PvTicketLock {
    #[cfg(not(loom))]
    const UNLOCKED: Self = Self::new();

    fn lock<O: PvOps>(&self, pv: Pv<'_, O>) {
        self.lock_with(pv, &PollEverySpin);
    }

    fn try_lock<O: PvOps>(&self, pv: Pv<'_, O>) -> bool {
        let owner = self.owner.load(Ordering::Relaxed);
        let taken = self
            .next
            .compare_exchange(
                owner,
                owner.wrapping_add(1),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok();
        if taken {
            self.record_holder(pv);
        }
        taken
    }

    unsafe fn unlock<O: PvOps>(&self, pv: Pv<'_, O>) {
        self.holder.store(0, HintOrdering::Relaxed);
        let served = self.owner.load(Ordering::Relaxed).wrapping_add(1);
        self.owner.store(served, Ordering::Release);
        if !pv.config.halt {
            return;
        }
        full_fence();
        // Nobody has drawn ticket `served` yet: whoever draws it will see `owner == served`
        // (the fences order our `owner` store before its re-check), so nobody needs a kick.
        // Nobody marked halted: the same fences order our `owner` store against a waiter's
        // mark, so a waiter that is not marked yet re-checks `owner` after it is, and does
        // not halt. This keeps the slot scan off every contended unlock that needs no kick
        // (at native speed, most of them).
        if self.next.load(Ordering::Relaxed) != served {
            if pv.any_halted() {
                let prewake = if pv.ops.vcpus_fit() {
                    pv.config.prewake
                } else {
                    0
                };
                self.kick_next(pv, served, prewake);
            } else if let Some((_, me)) = pv.this_cpu() {
                me.stats.no_kick();
            }
        }
    }

    fn is_locked(&self) -> bool {
        self.queue_len() != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn the_lock_fits_in_one_cache_line_wherever_it_is_placed() {
        assert_eq!(core::mem::size_of::<PvTicketLock>(), 16);
        assert_eq!(core::mem::align_of::<PvTicketLock>(), 16);
        // 16-aligned and 16 bytes: never across a 64-byte boundary, in any array or struct.
        let locks: [PvTicketLock; 8] = core::array::from_fn(|_| PvTicketLock::new());
        for lock in &locks {
            let start = lock as *const PvTicketLock as usize;
            assert_eq!(start / 64, (start + 15) / 64);
        }
    }
    use crate::host::{bind_current_thread, HostPvOps};
    use crate::pv::{PvDomain, SpinConfig};
    use crate::tests_common::pv_hammer;

    fn small() -> SpinConfig {
        SpinConfig {
            spin_threshold: 4,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        }
    }

    #[test]
    fn spin_policy_can_be_replaced_at_run_time() {
        let domain: PvDomain<HostPvOps<2>, 2> = PvDomain::new(HostPvOps::new(), small());
        let plain = SpinConfig {
            spin_threshold: 7,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        domain.configure(plain).unwrap();
        assert_eq!(domain.config(), plain);
        assert_eq!(domain.pv().config, plain);
        let zero = SpinConfig {
            spin_threshold: 0,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        assert!(domain.configure(zero).is_err());
        assert_eq!(domain.config(), plain, "a refused policy changes nothing");
    }

    #[test]
    fn uncontended_lock_halts_and_kicks_nothing() {
        let domain: PvDomain<HostPvOps<2>, 2> = PvDomain::new(HostPvOps::new(), small());
        bind_current_thread(0);
        let lock = PvTicketLock::new();
        for _ in 0..10 {
            lock.lock(domain.pv());
            assert!(lock.is_locked());
            assert!(!lock.try_lock(domain.pv()));
            // SAFETY: we hold the lock.
            unsafe { lock.unlock(domain.pv()) };
        }
        assert!(!lock.is_locked());
        assert_eq!(domain.total_stats(), Default::default());
        assert_eq!(domain.ops().stats().kicks, 0);
    }

    #[test]
    fn excludes_and_halts_under_contention() {
        let stats = pv_hammer::<PvTicketLock>(3, 300, small(), 0);
        assert!(stats.halts > 0, "waiters never halted: {stats:?}");
        assert_eq!(stats.kicks, stats.backend_kicks);
    }

    #[test]
    fn excludes_with_spurious_wakeups() {
        let stats = pv_hammer::<PvTicketLock>(3, 300, small(), 2);
        assert!(stats.injected_spurious > 0, "{stats:?}");
        assert!(stats.spurious > 0, "{stats:?}");
    }

    #[test]
    fn unlocker_kicks_only_halted_waiter_in_ticket_order() {
        crate::tests_common::check_kick_order(PvTicketLock::new(), Some(PvTicketLock::queue_len));
    }

    #[test]
    fn unlocker_prewakes_the_waiters_behind_the_next_owner_only_when_vcpus_fit() {
        for depth in [1, 2, SpinConfig::MAX_PREWAKE] {
            crate::tests_common::check_prewake(PvTicketLock::new(), true, depth);
        }
        crate::tests_common::check_prewake(PvTicketLock::new(), true, 0);
        crate::tests_common::check_prewake(PvTicketLock::new(), false, 2);
    }

    #[test]
    fn running_waiter_is_not_kicked() {
        // A waiter that never halts (huge threshold) is never kicked.
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<HostPvOps<2>, 2>> =
            Arc::new(PvDomain::new(HostPvOps::new(), config));
        let lock = Arc::new(PvTicketLock::new());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let waiter = spawn_taker(&domain, &lock, 1);
        while lock.queue_len() != 2 {
            std::thread::yield_now();
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        waiter.join().unwrap();
        let stats = domain.total_stats();
        // The waiter spins up to 2^24 times first; only a badly starved main thread lets it
        // reach the halt path, and then exactly one kick is right.
        if stats.slowpath == 0 {
            assert_eq!((stats.kicks, stats.no_kick), (0, 1), "{stats:?}");
        } else {
            assert_eq!((stats.kicks, stats.no_kick), (1, 0), "{stats:?}");
        }
        assert_eq!(domain.ops().stats().kicks, stats.kicks);
    }

    /// A thread on CPU `cpu` that takes `lock` once and releases it.
    fn spawn_taker<O: PvOps + Send + Sync + 'static, const N: usize>(
        domain: &Arc<PvDomain<O, N>>,
        lock: &Arc<PvTicketLock>,
        cpu: u32,
    ) -> std::thread::JoinHandle<()> {
        let (domain, lock) = (domain.clone(), lock.clone());
        std::thread::spawn(move || {
            bind_current_thread(cpu);
            lock.lock(domain.pv());
            // SAFETY: this thread holds the lock.
            unsafe { lock.unlock(domain.pv()) };
        })
    }

    /// The unlocker finds a halted waiter through the halted-CPU bitmap, also past the first
    /// word, and the waiter clears its bit when it runs again.
    #[test]
    fn a_halted_waiter_is_found_through_its_bit_past_the_first_word() {
        const WAITER: u32 = 137;
        let domain: Arc<PvDomain<HostPvOps<200>, 200>> =
            Arc::new(PvDomain::new(HostPvOps::new(), small()));
        let lock = Arc::new(PvTicketLock::new());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let waiter = spawn_taker(&domain, &lock, WAITER);
        let mut tries = 0;
        while domain.ops().parked(WAITER) == 0 {
            tries += 1;
            assert!(tries < 20_000, "the waiter never halted");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let words: std::vec::Vec<u64> = domain
            .pv()
            .halted
            .iter()
            .map(|w| w.load(Ordering::SeqCst))
            .collect();
        assert_eq!(
            words,
            [0, 0, 1 << (WAITER - 128), 0],
            "one word per 64 CPUs"
        );
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        waiter.join().unwrap();
        assert_eq!(domain.ops().kicks_to(WAITER), 1);
        assert!(domain
            .pv()
            .halted
            .iter()
            .all(|w| w.load(Ordering::SeqCst) == 0));
        assert_eq!(domain.ops().stats().timeouts, 0);
    }

    #[test]
    fn unlock_kicks_only_the_waiter_of_this_lock() {
        // CPU 1 halts on lock B and CPU 2 on lock A, both for ticket 1: unlocking A must kick
        // CPU 2 only, though CPU 1's slot holds the same ticket number.
        let domain: Arc<PvDomain<HostPvOps<3>, 3>> =
            Arc::new(PvDomain::new(HostPvOps::new(), small()));
        let (a, b) = (Arc::new(PvTicketLock::new()), Arc::new(PvTicketLock::new()));
        bind_current_thread(0);
        a.lock(domain.pv());
        b.lock(domain.pv());
        let spawn_waiter = |cpu: u32, lock: &Arc<PvTicketLock>| {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(cpu);
                lock.lock(domain.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        let on_b = spawn_waiter(1, &b);
        let on_a = spawn_waiter(2, &a);
        let mut tries = 0;
        while domain.ops().parked(1) == 0 || domain.ops().parked(2) == 0 {
            tries += 1;
            assert!(tries < 20_000, "waiters never halted");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        // SAFETY: the main thread holds `a`.
        unsafe { a.unlock(domain.pv()) };
        on_a.join().unwrap();
        assert_eq!(domain.ops().kicks_to(2), 1);
        assert_eq!(
            domain.ops().kicks_to(1),
            0,
            "woke the waiter of another lock"
        );
        // SAFETY: the main thread holds `b`.
        unsafe { b.unlock(domain.pv()) };
        on_b.join().unwrap();
        assert_eq!(domain.ops().kicks_to(1), 1);
        assert_eq!(domain.ops().stats().timeouts, 0);
    }

    #[test]
    fn waiter_notifies_naming_the_holder_then_halts() {
        use crate::tests_common::Notifying;
        let domain: Arc<PvDomain<Notifying<2>, 2>> = Arc::new(PvDomain::new(
            Notifying::new(4),
            SpinConfig {
                spin_threshold: 10,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            },
        ));
        let lock = Arc::new(PvTicketLock::new());
        bind_current_thread(1);
        lock.lock(domain.pv());
        assert_eq!(lock.holder_hint(), Some(1));
        let waiter = {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(0);
                lock.lock(domain.pv());
                assert_eq!(lock.holder_hint(), Some(0));
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        let mut tries = 0;
        while domain.ops().inner.parked(0) == 0 {
            tries += 1;
            assert!(tries < 20_000, "the waiter never halted");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        assert_eq!(lock.holder_hint(), None, "cleared at unlock");
        waiter.join().unwrap();
        let notes = domain.ops().notes();
        // Threshold 10, window 4: notified after 4 and 8 spins, not again before halting.
        assert!(notes.len() >= 2, "{notes:?}");
        // With notifications on, the waiter published {lock, ticket} before halting.
        assert_eq!(
            domain.pv().cpus[0].ticket.lock.load(Ordering::Relaxed),
            &*lock as *const PvTicketLock as usize
        );
        for n in &notes[..2] {
            assert_eq!(n.lock, &*lock as *const PvTicketLock as usize);
            assert_eq!(n.waiting_for, Some(1));
            assert!(!n.next_owner);
            assert_eq!(n.spun, 4);
        }
    }

    /// Holds the lock on CPU 1 while a waiter on CPU 0 spins with `ops`; returns once the
    /// waiter halted, then releases and joins it.
    fn wait_behind_holder(
        ops: crate::tests_common::Timed<2>,
    ) -> Arc<PvDomain<crate::tests_common::Timed<2>, 2>> {
        let domain = Arc::new(PvDomain::new(
            ops,
            SpinConfig {
                spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            },
        ));
        let lock = Arc::new(PvTicketLock::new());
        bind_current_thread(1);
        lock.lock(domain.pv());
        let waiter = {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(0);
                lock.lock(domain.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        let mut tries = 0;
        while domain.ops().inner.parked(0) == 0 {
            tries += 1;
            assert!(tries < 50_000, "the waiter never halted");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        waiter.join().unwrap();
        domain
    }

    #[test]
    fn time_budgets_end_the_spin_and_notify_in_ticks() {
        use crate::tests_common::Timed;
        // Notify every 10 ticks, wait after 35: three notifications, then the wait, which
        // names the holder.
        let budget = crate::SpinBudget {
            notify_after: 10,
            wait_after: 35,
        };
        let domain = wait_behind_holder(Timed::new(budget, false));
        let notes = domain.ops().notes.lock().unwrap().clone();
        let waits = domain.ops().waits.lock().unwrap().clone();
        assert!((3..=4).contains(&notes.len()), "{notes:?}");
        assert!(notes.iter().all(|n| n.waiting_for == Some(1)));
        assert_eq!(waits.first().map(|w| w.waiting_for), Some(Some(1)));
        // A wait that notifies itself: no separate notification before it.
        let budget = crate::SpinBudget {
            notify_after: u64::MAX,
            wait_after: 20,
        };
        let domain = wait_behind_holder(Timed::new(budget, true));
        assert!(domain.ops().notes.lock().unwrap().is_empty());
        assert!(!domain.ops().waits.lock().unwrap().is_empty());
        // A spent budget is not an early wait.
        assert_eq!(domain.cpu_stats(0).unwrap().wait_early, 0);
    }

    #[test]
    fn a_waiter_stops_spinning_when_its_holder_is_not_running() {
        use crate::tests_common::Timed;
        // Budgets far beyond the test's patience: only "holder not running" ends the spin.
        let ops = Timed::new(
            crate::SpinBudget {
                notify_after: u64::MAX,
                wait_after: u64::MAX - 1,
            },
            true,
        );
        ops.set_not_running(1);
        let domain = wait_behind_holder(ops);
        let waits = domain.ops().waits.lock().unwrap().clone();
        assert_eq!(waits.first().map(|w| w.waiting_for), Some(Some(1)));
        // It checks every 64 spins: it gave up after the first check, not after 2^24 spins.
        assert!(
            domain.ops().ticks() < 1_000,
            "{} spins",
            domain.ops().ticks()
        );
        // Counted as an early wait, so that a host can tell it from a spent budget.
        assert!(domain.cpu_stats(0).unwrap().wait_early >= 1);
    }

    /// The lock was released to ticket 1, drawn by CPU 1, whose slot is in `state`; CPU 1 does
    /// not run. CPU 2 draws ticket 2 and waits (budget: 4,000 ticks), the host saying whether
    /// the VM's vCPUs fit its CPUs. Returns the ticks spent before it halted.
    fn ticks_behind_a_next_owner_in(state: u8, vcpus_fit: bool) -> u64 {
        use crate::tests_common::Timed;
        let ops = Timed::new(
            crate::SpinBudget {
                notify_after: u64::MAX,
                wait_after: 4_000,
            },
            true,
        );
        ops.set_not_running(1);
        ops.set_vcpus_fit(vcpus_fit);
        let domain: Arc<PvDomain<Timed<3>, 3>> = Arc::new(PvDomain::new(
            ops,
            SpinConfig {
                spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            },
        ));
        let lock = Arc::new(PvTicketLock::new());
        lock.next.store(2, Ordering::Relaxed);
        lock.owner.store(1, Ordering::Relaxed);
        let slot = &domain.pv().cpus[1].ticket;
        slot.lock.store(lock.id(), Ordering::Relaxed);
        slot.ticket.store(1, Ordering::Relaxed);
        slot.state.store(state, Ordering::Relaxed);
        let waiter = {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(2);
                lock.lock(domain.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        let mut tries = 0;
        while domain.ops().inner.parked(2) == 0 {
            tries += 1;
            assert!(tries < 50_000, "the waiter never halted");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let ticks = domain.ops().ticks();
        // CPU 1 takes its ticket and releases it, which kicks the waiter.
        bind_current_thread(1);
        slot.state.store(RUNNING, Ordering::Relaxed);
        // SAFETY: ticket 1, which `owner` serves, is CPU 1's, and this thread is CPU 1 now.
        unsafe { lock.unlock(domain.pv()) };
        waiter.join().unwrap();
        let behind_waking = domain.total_stats().behind_waking;
        assert_eq!(
            behind_waking,
            u64::from(state == KICKED && vcpus_fit),
            "spin phases counted as kept spinning behind a waking owner"
        );
        ticks
    }

    #[test]
    fn a_waiter_halts_early_behind_a_kicked_next_owner_only_when_crowded() {
        // A next owner that is not running because it was preempted: waiting early is right.
        let preempted = ticks_behind_a_next_owner_in(RUNNING, true);
        assert!(preempted < 1_000, "{preempted} ticks");
        // One that is not running because an unlocker just kicked it is about to run when the
        // VM's vCPUs fit its CPUs: the waiter spins its budget (no wake-up convoy behind one
        // halt).
        let kicked = ticks_behind_a_next_owner_in(KICKED, true);
        assert!(kicked >= 4_000, "{kicked} ticks");
        // With more vCPUs than CPUs (or a host that does not say) the spinner would take the
        // CPU the kicked owner needs: it waits early.
        let crowded = ticks_behind_a_next_owner_in(KICKED, false);
        assert!(crowded < 1_000, "{crowded} ticks");
    }

    #[test]
    fn a_released_but_untaken_lock_names_its_next_owner() {
        use crate::tests_common::Notifying;
        let domain: PvDomain<Notifying<3>, 3> = PvDomain::new(Notifying::new(4), small());
        let lock = PvTicketLock::new();
        // CPU 1 drew ticket 1 and published it; the holder (ticket 0) released: owner = 1.
        lock.next.store(3, Ordering::Relaxed);
        lock.owner.store(1, Ordering::Relaxed);
        let slot = &domain.pv().cpus[1].ticket;
        slot.lock.store(lock.id(), Ordering::Relaxed);
        slot.ticket.store(1, Ordering::Relaxed);
        assert_eq!(lock.holder_hint(), None);
        assert_eq!(lock.next_owner_hint(domain.pv(), Some(2)), Some(1));
        // Never names the asker itself, nor a CPU waiting on another lock.
        assert_eq!(lock.next_owner_hint(domain.pv(), Some(1)), None);
        let other = PvTicketLock::new();
        other.owner.store(1, Ordering::Relaxed);
        assert_eq!(other.next_owner_hint(domain.pv(), Some(2)), None);
    }

    #[test]
    fn without_halting_it_is_a_plain_ticket_lock() {
        let config = SpinConfig {
            spin_threshold: 1,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let stats = pv_hammer::<PvTicketLock>(3, 100, config, 0);
        assert_eq!(
            (stats.slowpath, stats.halts, stats.kicks),
            (0, 0, 0),
            "{stats:?}"
        );
    }

    #[test]
    fn tickets_wrap_around() {
        let domain: PvDomain<HostPvOps<1>, 1> = PvDomain::new(HostPvOps::new(), small());
        bind_current_thread(0);
        let lock = PvTicketLock {
            next: AtomicU32::new(u32::MAX),
            owner: AtomicU32::new(u32::MAX),
            holder: HintU32::new(0),
        };
        for _ in 0..4 {
            lock.lock(domain.pv());
            // SAFETY: we hold the lock.
            unsafe { lock.unlock(domain.pv()) };
        }
        assert_eq!(lock.owner.load(Ordering::Relaxed), 3);
        assert!(!lock.is_locked());
    }
}
