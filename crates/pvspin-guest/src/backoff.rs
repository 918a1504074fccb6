//! Ticket locks with proportional backoff: the lock the origin threads tried in guests before
//! paravirtual ticket locks (Rik van Riel's "make ticket spinlock proportional backoff w/ auto
//! tuning", 2013). It regressed under overcommit (kernbench -5 to -8 %, dbench -20 to -29 %
//! in four 32-vCPU guests on 32 cores): it is here to be measured against the PV locks.
//!
//! # Proportional backoff
//!
//! A waiter whose ticket is `distance = ticket - owner` places from the head of the queue has
//! `distance - 1` hand-overs to wait for before it is next in line. Instead of reading `owner`
//! every spin (every read pulls the lock's cache line away from the holder), it waits
//! `(distance - 1) * unit` spins, reads `owner` again, and repeats until it is next in line;
//! then it reads every spin, as a plain ticket lock does, so that it takes the lock as soon as it
//! is handed over.
//!
//! # Auto-tuning the unit
//!
//! `unit` is the lock's estimate of how many spins one hand-over takes ([`HandoverEstimate`]),
//! shared by its waiters and updated by them: a waiter that sees `owner` move by `k` after `s`
//! spins since it last saw it move records the sample `s / k`. The estimate is an EWMA in
//! fixed point (4 fraction bits, weight 1/8), integer-only (guests must stay free of SSE),
//! with every sample and the estimate clamped to [`HandoverEstimate::MIN_SPINS`] ..=
//! [`HandoverEstimate::MAX_SPINS`]. The first move a waiter sees is not sampled (its count
//! started at the waiter's arrival, not at a hand-over). A waiter that slept too long sees `owner`
//! reach its own ticket (a larger `k`), so the sample shrinks; one that woke too early sees
//! fewer moves than it waited for, so the sample grows: the estimate follows the hand-over time.
//! Updates are a plain load and store (a lost update among racing waiters costs one sample).
//!
//! Under overcommit the samples include the time a preempted holder or next waiter was off its
//! CPU, so the unit grows, and waiters sleep past their turn while the lock is free: the
//! regression the origin threads measured.
//!
//! # With PV
//!
//! [`PvBackoffTicketLock`] is [`PvTicketLock`]'s halt/kick handshake with a different spin
//! phase: its waiters back off as above, the backoff spins counting against the spin threshold,
//! then read every spin (with the PV ticket lock's spin notifications) for what is left of it,
//! then publish a halt and `pv_wait`; the unlocker kicks the halted next waiter as the PV ticket
//! lock does. The backoff also ends where a spin phase ends early: at the backend's time budget
//! ([`SpinBudget::wait_after`](crate::SpinBudget), checked after each delay) or when the CPU
//! waited for is known not to run ([`PvOps::is_not_running`]); the waiter then looks once more
//! and halts. When the backoff ends because the waiter is next in line, the polling phase
//! that follows starts its own time budget, so such a waiter spins for at most about two
//! budgets before it halts.

use core::cell::Cell;
use core::sync::atomic::{AtomicU32 as CoreAtomicU32, Ordering as CoreOrdering};

use crate::pv::{Pv, PvOps, RawPvLock, SpinWait};
use crate::pv_ticket::{PvTicketLock, TicketSpin};
use crate::sync::{AtomicU32, Ordering};
use crate::{RawSpinLock, TicketLock};

/// A lock's estimate of how many spins one hand-over (unlock to the next holder's unlock, as
/// its waiters see it) takes: the unit of proportional backoff. See the module docs of `backoff`.
///
/// A hint, not part of any handshake: `core` atomics (not modelled by loom), Relaxed.
#[derive(Debug)]
pub struct HandoverEstimate {
    /// Spins per hand-over, times `1 << FRACTION_BITS`.
    scaled: CoreAtomicU32,
}

impl HandoverEstimate {
    /// The smallest estimate, in spins.
    pub const MIN_SPINS: u32 = 1;
    /// The largest estimate, in spins: bounds how long a waiter can sleep past its turn.
    pub const MAX_SPINS: u32 = 1024;
    /// The estimate of a new lock, in spins.
    pub const INITIAL_SPINS: u32 = 16;
    /// Fraction bits of the fixed-point estimate (so that small estimates still move by
    /// less than one spin per sample).
    const FRACTION_BITS: u32 = 4;
    /// A sample weighs `1 / (1 << WEIGHT_SHIFT)` of the new estimate.
    const WEIGHT_SHIFT: u32 = 3;
    const MIN_SCALED: u32 = Self::MIN_SPINS << Self::FRACTION_BITS;
    const MAX_SCALED: u32 = Self::MAX_SPINS << Self::FRACTION_BITS;

    /// A new estimate of [`INITIAL_SPINS`](Self::INITIAL_SPINS).
    pub const fn new() -> Self {
        Self {
            scaled: CoreAtomicU32::new(Self::INITIAL_SPINS << Self::FRACTION_BITS),
        }
    }

    /// The current estimate, in spins per hand-over (within `MIN_SPINS ..= MAX_SPINS`).
    pub fn spins(&self) -> u32 {
        let scaled = self.scaled.load(CoreOrdering::Relaxed);
        (scaled >> Self::FRACTION_BITS).clamp(Self::MIN_SPINS, Self::MAX_SPINS)
    }

    /// Records that `handovers` hand-overs took `spins` spins (nothing if `handovers` is 0).
    pub fn record(&self, spins: u32, handovers: u32) {
        let Some(sample) = spins.checked_div(handovers) else {
            return;
        };
        let sample = sample.clamp(Self::MIN_SPINS, Self::MAX_SPINS) << Self::FRACTION_BITS;
        let old = self.scaled.load(CoreOrdering::Relaxed);
        // old + (sample - old) / 8, without going negative: both terms are at most
        // MAX_SCALED (2^14), so nothing overflows.
        let new = old - (old >> Self::WEIGHT_SHIFT) + (sample >> Self::WEIGHT_SHIFT);
        self.scaled.store(
            new.clamp(Self::MIN_SCALED, Self::MAX_SCALED),
            CoreOrdering::Relaxed,
        );
    }
}

impl Default for HandoverEstimate {
    fn default() -> Self {
        Self::new()
    }
}

/// Spins a waiter `distance` places from the head backs off before it looks again: one
/// `unit` per hand-over it must wait for before it is next in line (none when it is next).
pub(crate) const fn backoff_spins(distance: u32, unit: u32) -> u32 {
    distance.saturating_sub(1).saturating_mul(unit)
}

/// Spins `spins` times without touching memory.
#[inline]
fn delay(spins: u32) {
    for _ in 0..spins {
        // Not `sync::spin_loop`: no shared memory is read here, so under loom this is not a
        // scheduling point (the loads of `owner` around it are).
        core::hint::spin_loop();
    }
}

/// One wait for a ticket: what the waiter saw last and how long ago, for the estimate.
#[derive(Debug)]
pub(crate) struct BackoffWaiter<'a> {
    handover: &'a HandoverEstimate,
    ticket: u32,
    /// The owner this waiter saw last.
    seen_owner: u32,
    /// Spins since `seen_owner` was first seen.
    since_change: u32,
    /// Whether `since_change` started at a move of `owner` (else at the waiter's arrival,
    /// part of a hand-over only, not a sample).
    timing: bool,
}

impl<'a> BackoffWaiter<'a> {
    /// A waiter for `ticket` that has just seen `owner`.
    pub(crate) fn new(handover: &'a HandoverEstimate, ticket: u32, owner: u32) -> Self {
        Self {
            handover,
            ticket,
            seen_owner: owner,
            since_change: 0,
            timing: false,
        }
    }

    /// Notes that `owner` was read `spins` spins after the previous read; records a sample if it
    /// moved. Returns this waiter's distance from the head (0: it is served).
    pub(crate) fn observe(&mut self, owner: u32, spins: u32) -> u32 {
        self.since_change = self.since_change.saturating_add(spins);
        let moved = owner.wrapping_sub(self.seen_owner);
        if moved != 0 {
            if self.timing {
                self.handover.record(self.since_change, moved);
            }
            self.timing = true;
            self.seen_owner = owner;
            self.since_change = 0;
        }
        self.ticket.wrapping_sub(owner)
    }

    /// Backs off in proportion to the distance (re-read through `load_owner` after each
    /// delay) until this waiter is next in line or served, `budget` spins are spent, or
    /// `stop(spent)` (asked after each delay, with the spins spent so far) says to stop.
    /// Returns the spins spent.
    pub(crate) fn back_off(
        &mut self,
        load_owner: impl Fn() -> u32,
        budget: u32,
        stop: impl Fn(u32) -> bool,
    ) -> u32 {
        let mut spent = 0u32;
        let mut last_delay = 0u32;
        loop {
            let distance = self.observe(load_owner(), last_delay);
            let wanted = backoff_spins(distance, self.handover.spins());
            last_delay = wanted.min(budget - spent);
            if last_delay == 0 {
                return spent;
            }
            delay(last_delay);
            spent += last_delay;
            if stop(spent) {
                return spent;
            }
        }
    }
}

/// A fair (FIFO) ticket spinlock whose waiters back off in proportion to their distance from
/// the head of the queue, with an auto-tuned unit (see the module docs of `backoff`).
///
/// Like [`TicketLock`], it has no paravirtual slow path; [`PvBackoffTicketLock`] has one.
#[derive(Debug)]
pub struct BackoffTicketLock {
    ticket: TicketLock,
    handover: HandoverEstimate,
}

impl BackoffTicketLock {
    /// A new, unlocked lock.
    pub const fn new() -> Self {
        Self {
            ticket: TicketLock::new(),
            handover: HandoverEstimate::new(),
        }
    }

    /// How many callers hold or wait for the lock (a racy snapshot).
    pub fn queue_len(&self) -> u32 {
        self.ticket.queue_len()
    }

    /// The lock's current estimate of the spins per hand-over.
    pub fn handover_spins(&self) -> u32 {
        self.handover.spins()
    }

    /// Next in line: reads `owner` every spin until it serves `ticket`, so the hand-over is
    /// taken at once. Returns the spins.
    #[inline]
    fn poll_until_served(owner: &CoreAtomicU32, ticket: u32) -> u32 {
        let mut polls = 0u32;
        while owner.load(CoreOrdering::Acquire) != ticket {
            core::hint::spin_loop();
            polls = polls.saturating_add(1);
        }
        polls
    }
}

impl Default for BackoffTicketLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: the ticket discipline is `TicketLock`'s (one fetch_add per ticket; `owner` moves only
// in `unlock`, Release); `lock` returns only after an Acquire load saw `owner == ticket`. The
// backoff only delays the reads before it.
unsafe impl RawSpinLock for BackoffTicketLock {
    const UNLOCKED: Self = Self::new();

    fn lock(&self) {
        let owner = &self.ticket.owner;
        let ticket = self.ticket.next.fetch_add(1, CoreOrdering::Relaxed);
        let now = owner.load(CoreOrdering::Acquire);
        if now == ticket {
            return;
        }
        if ticket.wrapping_sub(now) == 1 {
            // Next in line on arrival: nothing to back off, and nothing to sample (the only
            // move it will see is the one to itself, whose start it did not see).
            Self::poll_until_served(owner, ticket);
            return;
        }
        let mut waiter = BackoffWaiter::new(&self.handover, ticket, now);
        waiter.back_off(|| owner.load(CoreOrdering::Relaxed), u32::MAX, |_| false);
        let polls = Self::poll_until_served(owner, ticket);
        waiter.observe(ticket, polls);
    }

    fn try_lock(&self) -> bool {
        self.ticket.try_lock()
    }

    unsafe fn unlock(&self) {
        // SAFETY: the caller holds the lock (this trait's contract).
        unsafe { self.ticket.unlock() };
    }

    fn is_locked(&self) -> bool {
        self.ticket.is_locked()
    }
}

/// Backoff spins between two checks of whether the CPU a PV waiter waits for runs.
const WAITED_FOR_CHECK_EVERY: u32 = 64;

/// The spin phase of [`PvBackoffTicketLock`]'s waiters.
struct ProportionalBackoff<'a> {
    handover: &'a HandoverEstimate,
}

impl TicketSpin for ProportionalBackoff<'_> {
    fn spin_phase<O: PvOps>(
        &self,
        pv: Pv<'_, O>,
        owner: &AtomicU32,
        ticket: u32,
        wait: impl Fn(u32) -> SpinWait,
    ) -> bool {
        let budget = pv.config.spin_threshold;
        // The backoff ends where a spin phase would: at the time budget (when the backend
        // keeps time), or when the CPU waited for is known not to run.
        let wait_after = pv.ops.spin_budget().wait_after;
        let start = if wait_after == u64::MAX {
            0
        } else {
            pv.ops.now()
        };
        let stopped = Cell::new(false);
        let asked_at = Cell::new(0u32);
        let stop = |spent: u32| {
            // Whom the waiter waits for is asked about every `WAITED_FOR_CHECK_EVERY` spins,
            // as the spin phase does: the answer may scan every CPU's slot.
            let ask = spent / WAITED_FOR_CHECK_EVERY != asked_at.get() / WAITED_FOR_CHECK_EVERY;
            if ask {
                asked_at.set(spent);
            }
            let waited_for_is_out =
                ask && wait(0).ahead.is_some_and(|cpu| pv.ops.is_not_running(cpu));
            // Without a time budget, no clock read (they cost emulated guests).
            let out_of_time =
                wait_after != u64::MAX && pv.ops.now().wrapping_sub(start) >= wait_after;
            stopped.set(waited_for_is_out || out_of_time);
            stopped.get()
        };
        let mut waiter = BackoffWaiter::new(self.handover, ticket, owner.load(Ordering::Relaxed));
        let spent = waiter.back_off(|| owner.load(Ordering::Relaxed), budget, stop);
        // Next in line (or out of budget): read every spin for the rest of the threshold,
        // with the PV ticket lock's spin notifications and time budget; once only if the
        // backoff used the whole budget or stopped, so that the waiter looks before it halts.
        let mut rest = pv;
        rest.config.spin_threshold = if stopped.get() {
            1
        } else {
            budget.saturating_sub(spent).max(1)
        };
        let polls = Cell::new(0u32);
        let served = rest.spin_phase(
            || {
                polls.set(polls.get().saturating_add(1));
                owner.load(Ordering::Acquire) == ticket
            },
            wait,
        );
        if served {
            waiter.observe(ticket, polls.get());
        }
        served
    }
}

/// [`BackoffTicketLock`] with [`PvTicketLock`]'s paravirtual slow path: waiters back off in
/// proportion to their distance from the head, then past the spin threshold publish a halt and
/// `pv_wait`; the unlocker kicks the halted next waiter. The same rules as [`PvTicketLock`]
/// apply (one waiting slot per vCPU, shared with the PV ticket locks).
#[derive(Debug)]
pub struct PvBackoffTicketLock {
    ticket: PvTicketLock,
    handover: HandoverEstimate,
}

impl PvBackoffTicketLock {
    /// A new, unlocked lock.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            ticket: PvTicketLock::new(),
            handover: HandoverEstimate::new(),
        }
    }

    /// A new, unlocked lock.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            ticket: PvTicketLock::new(),
            handover: HandoverEstimate::new(),
        }
    }

    /// How many callers hold or wait for the lock (a racy snapshot).
    pub fn queue_len(&self) -> u32 {
        self.ticket.queue_len()
    }

    /// The CPU that holds the lock, as recorded at its acquisition (a racy hint).
    pub fn holder_hint(&self) -> Option<u32> {
        self.ticket.holder_hint()
    }

    /// The lock's current estimate of the spins per hand-over.
    pub fn handover_spins(&self) -> u32 {
        self.handover.spins()
    }
}

impl Default for PvBackoffTicketLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method is `PvTicketLock`'s, whose contract holds for any spin strategy: a
// strategy returns `true` only right after an Acquire load saw `owner == ticket`, and the
// handshake, which alone decides the other returns, is unchanged.
unsafe impl RawPvLock for PvBackoffTicketLock {
    #[cfg(not(loom))]
    const UNLOCKED: Self = Self::new();

    fn lock<O: PvOps>(&self, pv: Pv<'_, O>) {
        let spin = ProportionalBackoff {
            handover: &self.handover,
        };
        self.ticket.lock_with(pv, &spin);
    }

    fn try_lock<O: PvOps>(&self, pv: Pv<'_, O>) -> bool {
        self.ticket.try_lock(pv)
    }

    unsafe fn unlock<O: PvOps>(&self, pv: Pv<'_, O>) {
        // SAFETY: the caller holds the lock, on this CPU (this trait's contract).
        unsafe { self.ticket.unlock(pv) };
    }

    fn is_locked(&self) -> bool {
        self.ticket.is_locked()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::vec::Vec;

    use super::*;
    use crate::host::bind_current_thread;
    use crate::pv::{PvDomain, SpinConfig};
    use crate::tests_common::{hammer, pv_hammer, Timed};

    fn small() -> SpinConfig {
        SpinConfig {
            spin_threshold: 4,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        }
    }

    /// An estimate of exactly `spins` (fed identical samples until it converged).
    fn estimate_of(spins: u32) -> HandoverEstimate {
        let estimate = HandoverEstimate::new();
        for _ in 0..200 {
            estimate.record(spins, 1);
        }
        assert_eq!(estimate.spins(), spins);
        estimate
    }

    #[test]
    fn delay_is_one_unit_per_waiter_ahead() {
        assert_eq!(backoff_spins(0, 10), 0, "served");
        assert_eq!(backoff_spins(1, 10), 0, "next in line reads every spin");
        assert_eq!(backoff_spins(2, 10), 10);
        assert_eq!(backoff_spins(5, 10), 40);
        assert_eq!(backoff_spins(u32::MAX, u32::MAX), u32::MAX, "saturates");
    }

    #[test]
    fn waiter_backs_off_in_proportion_to_its_distance() {
        let estimate = estimate_of(10);
        // Ticket 10, owner 6: three hand-overs to wait for, then (owner 8) one more.
        let owners = Cell::new([6u32, 8, 9].as_slice());
        let load = || {
            let (first, rest) = owners.get().split_first().expect("read once too often");
            owners.set(rest);
            *first
        };
        let mut waiter = BackoffWaiter::new(&estimate, 10, 6);
        let spent = waiter.back_off(load, u32::MAX, |_| false);
        assert_eq!(spent, 3 * 10 + 10);
        // Moves seen: 6 -> 8 (the first, not a sample), then 8 -> 9 after 10 spins: 10 per
        // hand-over, as estimated.
        assert_eq!(estimate.spins(), 10);
        assert!(owners.get().is_empty());
    }

    #[test]
    fn backoff_stops_at_its_budget() {
        let estimate = estimate_of(100);
        let mut waiter = BackoffWaiter::new(&estimate, 10, 0);
        assert_eq!(waiter.back_off(|| 0, 250, |_| false), 250);
        assert_eq!(waiter.back_off(|| 0, 0, |_| false), 0);
        // Asked to stop after its first delay (9 waiters ahead: 900 spins).
        assert_eq!(waiter.back_off(|| 0, u32::MAX, |_| true), 900);
        // Asked to stop once 2000 spins are spent: after three delays.
        assert_eq!(waiter.back_off(|| 0, u32::MAX, |spent| spent >= 2000), 2700);
    }

    #[test]
    fn estimate_follows_the_samples_and_stays_bounded() {
        let estimate = HandoverEstimate::new();
        assert_eq!(estimate.spins(), HandoverEstimate::INITIAL_SPINS);
        // Slower hand-overs: it grows towards them, one eighth of the gap per sample.
        estimate.record(400, 4);
        let after_one = estimate.spins();
        assert!(after_one > HandoverEstimate::INITIAL_SPINS && after_one < 100);
        let estimate = estimate_of(100);
        // Samples beyond the bounds count as the bounds.
        for _ in 0..200 {
            estimate.record(u32::MAX, 1);
        }
        assert_eq!(estimate.spins(), HandoverEstimate::MAX_SPINS);
        for _ in 0..200 {
            estimate.record(0, 7);
        }
        assert_eq!(estimate.spins(), HandoverEstimate::MIN_SPINS);
        // No hand-over seen: no sample.
        estimate.record(1000, 0);
        assert_eq!(estimate.spins(), HandoverEstimate::MIN_SPINS);
    }

    #[test]
    fn waiter_samples_only_whole_hand_overs() {
        let estimate = estimate_of(10);
        let mut waiter = BackoffWaiter::new(&estimate, 5, 0);
        // 300 spins before the first move: counted from the arrival, not a sample.
        assert_eq!(waiter.observe(1, 300), 4);
        assert_eq!(estimate.spins(), 10);
        // Then 2 hand-overs in 60 spins: 30 each, so the estimate grows.
        assert_eq!(waiter.observe(1, 20), 4);
        assert_eq!(waiter.observe(3, 40), 2);
        assert!(estimate.spins() > 10, "{}", estimate.spins());
    }

    #[test]
    fn try_lock_fails_while_held_and_succeeds_after() {
        let lock = BackoffTicketLock::new();
        assert!(lock.try_lock());
        assert!(lock.is_locked());
        assert!(!lock.try_lock());
        // SAFETY: we hold the lock.
        unsafe { lock.unlock() };
        assert!(!lock.is_locked());
        lock.lock();
        assert_eq!(lock.queue_len(), 1);
        // SAFETY: we hold the lock.
        unsafe { lock.unlock() };
    }

    #[test]
    fn excludes_under_contention() {
        hammer::<BackoffTicketLock>(3, 1_000);
    }

    #[test]
    fn estimate_stays_bounded_under_contention() {
        let lock = Arc::new(BackoffTicketLock::new());
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..2_000 {
                        lock.lock();
                        let spins = lock.handover_spins();
                        assert!((HandoverEstimate::MIN_SPINS..=HandoverEstimate::MAX_SPINS)
                            .contains(&spins));
                        // SAFETY: this thread holds the lock.
                        unsafe { lock.unlock() };
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert!(!lock.is_locked());
    }

    #[test]
    fn pv_excludes_and_halts_under_contention() {
        let stats = pv_hammer::<PvBackoffTicketLock>(3, 300, small(), 0);
        assert!(stats.halts > 0, "waiters never halted: {stats:?}");
        assert_eq!(stats.kicks, stats.backend_kicks);
    }

    #[test]
    fn pv_excludes_with_spurious_wakeups() {
        let stats = pv_hammer::<PvBackoffTicketLock>(4, 300, small(), 2);
        assert!(stats.injected_spurious > 0, "{stats:?}");
    }

    #[test]
    fn pv_without_halting_never_halts_or_kicks() {
        let config = SpinConfig {
            spin_threshold: 64,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let stats = pv_hammer::<PvBackoffTicketLock>(3, 300, config, 0);
        assert_eq!(
            (stats.slowpath, stats.halts, stats.kicks),
            (0, 0, 0),
            "{stats:?}"
        );
    }

    #[test]
    fn pv_backoff_ends_at_the_time_budget() {
        // No spin limit; the test clock ticks once per read. A waiter five places back whose
        // owner never moves backs off, looking at the clock and at whom it waits for after
        // each delay, until 200 ticks passed; then the phase looks once and ends.
        let budget = crate::SpinBudget {
            notify_after: u64::MAX,
            wait_after: 200,
        };
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: PvDomain<Timed<1>, 1> = PvDomain::new(Timed::new(budget, false), config);
        bind_current_thread(0);
        let handover = HandoverEstimate::new();
        let owner = AtomicU32::new(0);
        let looks = Cell::new(0u32);
        let wait = |spun| {
            looks.set(looks.get() + 1);
            SpinWait {
                lock: 0,
                waiting_for: None,
                next_owner: false,
                ahead: None,
                waking: false,
                spun,
            }
        };
        let spin = ProportionalBackoff {
            handover: &handover,
        };
        assert!(!spin.spin_phase(domain.pv(), &owner, 5, wait));
        // A backoff that ignored the clock would spin 2^24 times, then the phase would
        // end at the budget having asked whom it waits for only every 64 spins.
        assert!(looks.get() >= 150, "{}", looks.get());
        assert!(domain.ops().ticks() < 250, "{}", domain.ops().ticks());
    }

    #[test]
    fn pv_backoff_ends_when_the_holder_is_not_running() {
        // CPU 1 holds the lock and does not run; CPU 2 queues next in line and halts, then
        // CPU 0 two places back halts too. No time limit, and the spin limit is 2^24: only
        // "holder not running" ends the waits early.
        let budget = crate::SpinBudget {
            notify_after: u64::MAX,
            wait_after: u64::MAX - 1,
        };
        let ops = Timed::new(budget, true);
        ops.set_not_running(1);
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<Timed<3>, 3>> = Arc::new(PvDomain::new(ops, config));
        let lock = Arc::new(PvBackoffTicketLock::new());
        bind_current_thread(1);
        lock.lock(domain.pv());
        let mut waiters = Vec::new();
        for cpu in [2, 0] {
            let (domain2, lock2) = (domain.clone(), lock.clone());
            waiters.push(std::thread::spawn(move || {
                bind_current_thread(cpu);
                lock2.lock(domain2.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock2.unlock(domain2.pv()) };
            }));
            let mut tries = 0;
            while domain.ops().inner.parked(cpu) == 0 {
                tries += 1;
                assert!(tries < 50_000, "waiter on CPU {cpu} never halted");
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        for waiter in waiters {
            waiter.join().unwrap();
        }
        let waits = domain.ops().waits.lock().unwrap().clone();
        assert!(waits.iter().all(|w| w.waiting_for == Some(1)), "{waits:?}");
        // How CPU 0 got there, with the strategy alone: it asks whom it waits for once 64
        // spins are spent (four delays of 16), learns that CPU is out, and ends the phase after
        // one more look (a backoff that did not ask would spin 2^24 times and never ask).
        bind_current_thread(0);
        let handover = HandoverEstimate::new();
        let owner = AtomicU32::new(0);
        let asked = Cell::new(0u32);
        let wait = |spun| {
            asked.set(asked.get() + 1);
            SpinWait {
                lock: 0,
                waiting_for: Some(1),
                next_owner: false,
                ahead: Some(1),
                waking: false,
                spun,
            }
        };
        let spin = ProportionalBackoff {
            handover: &handover,
        };
        assert!(!spin.spin_phase(domain.pv(), &owner, 2, wait));
        assert_eq!(asked.get(), 1);
    }

    #[test]
    fn pv_unlocker_kicks_the_halted_waiters_in_ticket_order() {
        // The farther waiters back off before they halt; the order and the kicks are the
        // PV ticket lock's.
        crate::tests_common::check_kick_order(
            PvBackoffTicketLock::new(),
            Some(PvBackoffTicketLock::queue_len),
        );
    }
}
