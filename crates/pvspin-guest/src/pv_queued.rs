//! The PV queued (MCS) lock, in two flavors.
//!
//! [`PvspinFlavor`] (the default, [`PvQueuedLock`]): waiters queue on per-vCPU nodes and spin
//! on their own node; past the threshold they mark the node Halted and `pv_wait`; the unlocker
//! hands the lock to its successor and kicks it only if the successor's node says Halted, and
//! only at unlock time (the pv qspinlock's `vcpu_running` / `vcpu_halted` states, without its
//! lock word and hash). Its waiters tell the host what they wait for (spin notifications,
//! pvspin's hint-page budgets).
//!
//! [`StockFlavor`] ([`StockQueuedLock`]): Linux's pv qspinlock as a stock KVM guest runs it
//! (`kernel/locking/qspinlock_paravirt.h`), with nothing of pvspin's ABI beyond a kick and a
//! halt. See [the stock flavor](#the-stock-flavor) below.
//!
//! # The halt/kick handshake (pvspin flavor)
//!
//! Waiter, past the threshold: `node.state = HALTED`; `fence(SeqCst)`; if `node.locked` it owns
//! the lock (state back to RUNNING); else `pv_wait(&node.state, HALTED)`, state back to RUNNING,
//! and if still not `locked`, spin again (spurious wakeup).
//!
//! Unlocker with a successor: `succ.locked = 1` (Release); `fence(SeqCst)`; if `succ.state ==
//! HALTED` and `cmpxchg(HALTED -> RUNNING)` succeeds, kick the successor's vCPU.
//!
//! Same argument as the ticket lock: the fences make at least one side see the other's write;
//! a kick racing the halt is remembered by the backend. Checked by the loom model.
//!
//! Pre-wake, as the ticket lock's: while the host says the VM's vCPUs fit its CPUs
//! ([`PvOps::vcpus_fit`]), the unlocker also kicks the [`SpinConfig::prewake`] nodes after the
//! successor where they say Halted (`cmpxchg(HALTED -> RUNNING)`), so that they spin by the
//! time the lock reaches them.
//!
//! No lock stealing and no pending bit (Linux's hybrid unfair trylock): strictly FIFO, so a
//! preempted or halted successor delays everyone behind it until it runs; that is what the
//! kick (and the host's directed yield) are for. The holder keeps its node until unlock, so a
//! vCPU may hold or await at most [`NODES_PER_CPU`](crate::NODES_PER_CPU) queued locks at once.
//!
//! # The stock flavor
//!
//! A lock byte (`locked`: 0, `LOCKED` or `SLOW`, Linux's `_Q_LOCKED_VAL` / `_Q_SLOW_VAL`), a
//! pending byte and an MCS tail, as Linux's qspinlock word, kept in separate atomics (every
//! transition that must be atomic touches one of them only; the checks that read two, such as
//! the steal's "not locked and not pending", are racy in Linux too). With halting on
//! ([`SpinConfig::halt`](crate::SpinConfig)):
//!
//! - Fast path: take the lock byte when the whole lock is clear. Then, after taking a node,
//!   the hybrid unfair trylock (current Linux's `pv_hybrid_queued_unfair_trylock`): steal
//!   the lock byte if it is neither locked nor pending, and keep trying while others are
//!   queued and pending is clear; queue only once the queue is empty or a queue head spins
//!   with pending set. (Until 2026-12 this was one attempt, as the older
//!   `pv_queued_spin_steal_lock`, which let arrivals queue and halt early behind a halted
//!   queue; docs/benchmarks.md §14.5.)
//! - Node wait (`pv_wait_node`): spin on the node's `locked` up to the threshold; every 256th
//!   spin, from the first, look at the predecessor's node and stop spinning at once if it is
//!   not running (`pv_wait_early`: halted, or a halted queue head); then `state = HALTED`,
//!   full fence, re-check, `pv_wait(&state, HALTED)`, and `cmpxchg(HALTED -> RUNNING)`, which
//!   keeps `HASHED` if the hand-over set it.
//! - Queue head (`pv_wait_head_or_lock`): set pending and spin on the lock byte up to the
//!   threshold; then clear pending, and the first time only, hash itself (the lock's `holder`
//!   word names the head's node, standing in for Linux's lock hash table) and exchange the
//!   lock byte for `SLOW` (a free lock is taken instead); `state = HASHED`;
//!   `pv_wait(&locked, SLOW)`. Later rounds only spin and re-wait: after the first, the lock
//!   byte is `SLOW` only if the head set it, so a head that waited once (or was hashed at the
//!   hand-over) spins until it gets the lock, as in Linux.
//! - Hand-over (`pv_kick_node`): the new holder passes the queue head to its successor
//!   (`succ.locked = 1`), full fence, and if `cmpxchg(succ.state, HALTED -> HASHED)` succeeds,
//!   marks the lock `SLOW` and hashes the successor, without a kick: the successor stays halted
//!   until this holder's unlock kicks it (no wake/sleep cycle).
//! - Unlock: `cmpxchg(locked, LOCKED -> 0)`; if it found `SLOW`: unhash, release the lock byte,
//!   kick the hashed node's vCPU. Only a `SLOW` lock is kicked; a kick of a vCPU that is not
//!   halted any more is latched and ends its next halt early (a spurious wakeup).
//!
//! One departure, and where it is: the queue head also reads, every 256th spin from the
//! first, [`PvOps::vcpu_is_preempted`] of the vCPU that handed it the queue head (its MCS
//! predecessor, which holds the lock unless it was stolen; a head that found the queue empty
//! knows no vCPU and reads nothing), and stops spinning when that vCPU is preempted. Linux's pv
//! qspinlock reads no `vcpu_is_preempted` (an upstream version checked the predecessor in
//! `pv_wait_early`; it was reverted for a regression under overcommit, and current kernels
//! check only the node state); a stock kernel reads it where it spins on an owner:
//! `osq_lock` (the predecessor's vCPU) and `mutex_spin_on_owner` / rwsem owner spinning (the
//! owner's vCPU), which stop spinning when it is preempted. The queue head spinning on the
//! lock holder is this lock's owner-spinning, so it follows them; the node wait follows
//! current Linux. Counted in [`PvStatsSnapshot::preempted`](crate::PvStatsSnapshot).
//!
//! With halting off the stock flavor is a plain qspinlock: no steal, no pending, no halts.
//! The holder gives its node back when it takes the lock (as Linux), so nesting is bounded by
//! the locks a vCPU awaits at once, not by those it holds.

use core::marker::PhantomData;

use crate::pv::{Pv, PvCpu, PvOps, RawPvLock, SpinConfig, SpinWait, NODES_PER_CPU};
use crate::sync::{full_fence, spin_loop, AtomicU32, AtomicU8, Ordering};

/// The node's vCPU is running (spinning, or not waiting).
const RUNNING: u8 = 0;
/// The node's vCPU is halted, or about to halt, in `pv_wait`.
const HALTED: u8 = 1;
/// Stock flavor: halted with the lock hashed on its behalf (Linux's `vcpu_hashed`): set by the
/// hand-over to a halted successor, and by a queue head about to halt.
const HASHED: u8 = 2;

/// Stock flavor lock byte: held (Linux's `_Q_LOCKED_VAL`).
const LOCKED: u8 = 1;
/// Stock flavor lock byte: held, and a halted queue head is hashed (`_Q_SLOW_VAL`): the
/// unlocker must kick it.
const SLOW: u8 = 3;

/// Stock flavor: spins between looks at the predecessor (Linux's `PV_PREV_CHECK_MASK + 1`).
const PREV_CHECK_EVERY: u32 = 256;

/// "No node": an empty queue, or no successor yet.
const NONE: u32 = 0;

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::PvspinFlavor {}
    impl Sealed for super::StockFlavor {}
}

/// Which protocol a [`PvQueuedLock`] runs: [`PvspinFlavor`] or [`StockFlavor`] (sealed).
pub trait QueuedFlavor: sealed::Sealed + 'static {
    /// Whether this is [`StockFlavor`].
    const STOCK: bool;
}

/// pvspin's queued lock: FIFO MCS, the holder hands over to its successor and kicks it if it
/// halted; waiters send spin notifications and follow the host's budgets.
#[derive(Debug)]
pub enum PvspinFlavor {}

impl QueuedFlavor for PvspinFlavor {
    const STOCK: bool = false;
}

/// Linux's pv qspinlock as a stock KVM guest runs it: lock byte, pending byte and MCS tail,
/// the hybrid unfair trylock, `pv_wait_early`, the queue head's `SLOW` mark and hash, kicks at
/// unlock only; no spin notifications, budgets or hint pages. The protocol, step by step, is
/// in the docs of this crate's `src/pv_queued.rs` ("The stock flavor"), a private module.
#[derive(Debug)]
pub enum StockFlavor {}

impl QueuedFlavor for StockFlavor {
    const STOCK: bool = true;
}

/// One MCS queue node. Each vCPU owns [`NODES_PER_CPU`] of them inside its
/// [`PvCpu`](crate::PvCpu).
#[derive(Debug)]
pub struct McsNode {
    /// The successor's node code, or `NONE`.
    next: AtomicU32,
    /// Set to 1 by the predecessor when it hands the lock (stock flavor: the queue head) over.
    locked: AtomicU8,
    /// `RUNNING`, `HALTED` or (stock flavor) `HASHED`.
    state: AtomicU8,
}

impl McsNode {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Self {
        Self {
            next: AtomicU32::new(NONE),
            locked: AtomicU8::new(0),
            state: AtomicU8::new(RUNNING),
        }
    }

    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        Self {
            next: AtomicU32::new(NONE),
            locked: AtomicU8::new(0),
            state: AtomicU8::new(RUNNING),
        }
    }
}

/// Node code: `cpu * NODES_PER_CPU + index + 1` (0 is `NONE`); fits since `N <= MAX_CPUS`.
fn encode(cpu: u32, index: usize) -> u32 {
    cpu * NODES_PER_CPU as u32 + index as u32 + 1
}

fn decode(code: u32) -> (u32, usize) {
    let raw = code - 1;
    (
        raw / NODES_PER_CPU as u32,
        (raw % NODES_PER_CPU as u32) as usize,
    )
}

/// A fair (FIFO) MCS queued lock with a paravirtual slow path; with [`StockFlavor`], Linux's
/// pv qspinlock ([`StockQueuedLock`]).
///
/// Each waiter spins on its own node (no cache-line bouncing between waiters). The unlocker
/// kicks only a successor that marked itself halted, so a contended unlock to a spinning
/// successor costs no kick. The lock must be released on the vCPU that took it (its node lives
/// in that vCPU's [`PvCpu`](crate::PvCpu)).
///
/// # Panics
///
/// `lock` and `try_lock` panic if the backend's CPU id is not below the domain's `N`, or if
/// this vCPU already holds or awaits [`NODES_PER_CPU`](crate::NODES_PER_CPU) queued locks.
///
/// # Layout
///
/// 16 bytes, aligned to 16: its words never straddle two cache lines, as for
/// [`PvTicketLock`](crate::PvTicketLock).
#[derive(Debug)]
#[repr(C, align(16))]
pub struct PvQueuedLock<F = PvspinFlavor> {
    /// The last queued node's code, or `NONE` (pvspin flavor: `NONE` when free).
    tail: AtomicU32,
    /// Pvspin flavor: the holder's node code; written and read by the holder (waiters read it
    /// racily, as a hint for spin notifications). Stock flavor: the hash entry, the node code
    /// of the halted queue head the unlocker of a `SLOW` lock kicks, or `NONE`.
    holder: AtomicU32,
    /// Stock flavor: the lock byte (0, `LOCKED`, `SLOW`).
    locked: AtomicU8,
    /// Stock flavor: 1 while the queue head spins on the lock byte (no stealing then).
    pending: AtomicU8,
    _flavor: PhantomData<fn() -> F>,
}

/// Linux's pv qspinlock, as a stock KVM guest runs it: [`PvQueuedLock`] with [`StockFlavor`].
pub type StockQueuedLock = PvQueuedLock<StockFlavor>;

/// `slice[index]` with a message that formats nothing: an indexing panic formats the index
/// with `core::fmt`, whose precompiled code uses SSE, which KVM's emulator rejects, so guest
/// images must not contain it. Codes come from this lock's own words, so a miss is a bug.
fn at<T>(slice: &[T], index: usize) -> &T {
    match slice.get(index) {
        Some(item) => item,
        None => panic!("PvQueuedLock: a node code names no node (corrupt lock word)"),
    }
}

impl PvQueuedLock {
    /// A new, unlocked lock (pvspin flavor).
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self::unlocked()
    }

    /// A new, unlocked lock (pvspin flavor).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self::unlocked()
    }
}

impl StockQueuedLock {
    /// A new, unlocked lock (stock flavor).
    #[cfg(not(loom))]
    pub const fn new_stock() -> Self {
        Self::unlocked()
    }

    /// A new, unlocked lock (stock flavor).
    #[cfg(loom)]
    pub fn new_stock() -> Self {
        Self::unlocked()
    }
}

impl<F: QueuedFlavor> PvQueuedLock<F> {
    #[cfg(not(loom))]
    const fn unlocked() -> Self {
        Self {
            tail: AtomicU32::new(NONE),
            holder: AtomicU32::new(NONE),
            locked: AtomicU8::new(0),
            pending: AtomicU8::new(0),
            _flavor: PhantomData,
        }
    }

    #[cfg(loom)]
    fn unlocked() -> Self {
        Self {
            tail: AtomicU32::new(NONE),
            holder: AtomicU32::new(NONE),
            locked: AtomicU8::new(0),
            pending: AtomicU8::new(0),
            _flavor: PhantomData,
        }
    }

    /// Takes a fresh node of this CPU; panics as documented on the type.
    fn prepare<'a, O: PvOps>(pv: &Pv<'a, O>) -> (&'a PvCpu, usize, u32) {
        let Some((id, cpu)) = pv.this_cpu() else {
            panic!("PvQueuedLock: cpu_id() is not below the PvDomain's CPU count");
        };
        let Some(index) = cpu.alloc_node() else {
            panic!("PvQueuedLock: this vCPU holds or awaits NODES_PER_CPU queued locks already");
        };
        let node = at(&cpu.nodes, index);
        node.next.store(NONE, Ordering::Relaxed);
        node.locked.store(0, Ordering::Relaxed);
        node.state.store(RUNNING, Ordering::Relaxed);
        // Erase the borrow of `pv` itself: the CPU lives as long as the domain.
        let cpu: &'a PvCpu = at(pv.cpus, id as usize);
        (cpu, index, encode(id, index))
    }

    fn node<'a, O>(pv: &Pv<'a, O>, code: u32) -> &'a McsNode {
        let (cpu, index) = decode(code);
        at(&at(pv.cpus, cpu as usize).nodes, index)
    }

    /// What a waiter behind node `prev` tells the host, and what its spin phase watches
    /// (`ahead`: always `prev`'s CPU). The host hears of `prev`'s CPU when it holds the lock or
    /// gets it next (the holder's successor, or handed the lock: `locked`, the owner on its
    /// way, kicked if it had halted), where a boost helps; the `holder` word may still name
    /// the waiter itself then (the new holder has not recorded itself), so it is no target.
    /// Deeper in the queue `prev` is another waiter, and the host hears of the holder: with
    /// run slots, naming waiters gave their slots priority over the next owners' (a convoy at
    /// 255 vCPUs, docs/benchmarks.md §12.6). Also what its WAIT names.
    fn spin_wait<O: PvOps>(&self, pv: &Pv<'_, O>, prev: u32, spun: u32) -> SpinWait {
        // `holder` is the holder's own word, `next` and `locked` other vCPUs': racy reads are
        // fine for a hint. Until the new holder records itself the word names the previous
        // one, which may be this waiter (it unlocked and queued again): never a target.
        let holder = self.holder.load(Ordering::Relaxed);
        let waking = Self::node(pv, prev).locked.load(Ordering::Relaxed) != 0;
        let prev_is_next = holder == prev
            || waking
            || holder == NONE
            || decode(holder).0 == pv.ops.cpu_id()
            || Self::node(pv, holder).next.load(Ordering::Relaxed) == prev;
        let ahead = decode(prev).0;
        let (waiting_for, next_owner) = if prev_is_next {
            (ahead, holder != prev)
        } else {
            // Deep in the queue: the host is told of the holder (`SpinWait::ahead`).
            (decode(holder).0, false)
        };
        SpinWait {
            lock: self as *const Self as usize,
            waiting_for: Some(waiting_for),
            next_owner,
            ahead: Some(ahead),
            waking,
            spun,
        }
    }

    #[cold]
    fn wait_for_handoff<O: PvOps>(&self, pv: Pv<'_, O>, cpu: &PvCpu, node: &McsNode, prev: u32) {
        loop {
            if pv.spin_phase(
                || node.locked.load(Ordering::Acquire) != 0,
                |spun| self.spin_wait(&pv, prev, spun),
            ) {
                return;
            }
            if !pv.config.halt {
                continue;
            }
            cpu.stats.slowpath();
            node.state.store(HALTED, Ordering::Relaxed);
            full_fence();
            if node.locked.load(Ordering::Acquire) != 0 {
                node.state.store(RUNNING, Ordering::Relaxed);
                return;
            }
            cpu.stats.halt();
            pv.ops
                .wait_for(&node.state, HALTED, &self.spin_wait(&pv, prev, 0));
            node.state.store(RUNNING, Ordering::Relaxed);
            if node.locked.load(Ordering::Acquire) != 0 {
                return;
            }
            cpu.stats.spurious();
        }
    }

    fn lock_pvspin<O: PvOps>(&self, pv: Pv<'_, O>) {
        let (cpu, index, code) = Self::prepare(&pv);
        let prev = self.tail.swap(code, Ordering::AcqRel);
        if prev != NONE {
            Self::node(&pv, prev).next.store(code, Ordering::Release);
            self.wait_for_handoff(pv, cpu, at(&cpu.nodes, index), prev);
        }
        self.holder.store(code, Ordering::Relaxed);
    }

    fn try_lock_pvspin<O: PvOps>(&self, pv: Pv<'_, O>) -> bool {
        if self.tail.load(Ordering::Relaxed) != NONE {
            return false;
        }
        let (cpu, index, code) = Self::prepare(&pv);
        if self
            .tail
            .compare_exchange(NONE, code, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.holder.store(code, Ordering::Relaxed);
            true
        } else {
            cpu.free_node(index);
            false
        }
    }

    /// # Safety
    ///
    /// The caller holds the lock (pvspin flavor).
    unsafe fn unlock_pvspin<O: PvOps>(&self, pv: Pv<'_, O>) {
        let code = self.holder.load(Ordering::Relaxed);
        let (id, index) = decode(code);
        let cpu = at(pv.cpus, id as usize);
        let node = at(&cpu.nodes, index);
        let mut next = node.next.load(Ordering::Acquire);
        if next == NONE {
            if self
                .tail
                .compare_exchange(code, NONE, Ordering::Release, Ordering::Relaxed)
                .is_ok()
            {
                cpu.free_node(index);
                return;
            }
            // A successor swapped the tail and is about to link itself behind us.
            next = Self::wait_for_next(node);
        }
        let successor = Self::node(&pv, next);
        successor.locked.store(1, Ordering::Release);
        // Our node is no longer referenced by anyone.
        cpu.free_node(index);
        if !pv.config.halt {
            return;
        }
        full_fence();
        let mut any = Self::kick_if_halted(&pv, successor, next);
        if any {
            cpu.stats.kick();
        }
        if pv.ops.vcpus_fit() {
            // The pre-wake (module docs): the waiters behind the new holder, too. Racy reads:
            // a node may have moved on to another wait since, and its waiter then only wakes
            // spuriously and re-checks.
            let mut node = successor;
            for _ in 0..pv.config.prewake.min(SpinConfig::MAX_PREWAKE) {
                let behind = node.next.load(Ordering::Acquire);
                if behind == NONE {
                    break;
                }
                node = Self::node(&pv, behind);
                if Self::kick_if_halted(&pv, node, behind) {
                    any = true;
                    cpu.stats.kick();
                    cpu.stats.prewake();
                }
            }
        }
        if !any {
            cpu.stats.no_kick();
        }
    }

    /// Kicks the vCPU of node `code` if the node says it halted (pvspin flavor).
    fn kick_if_halted<O: PvOps>(pv: &Pv<'_, O>, node: &McsNode, code: u32) -> bool {
        if node.state.load(Ordering::Relaxed) == HALTED
            && node
                .state
                .compare_exchange(HALTED, RUNNING, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            pv.ops.kick(decode(code).0);
            return true;
        }
        false
    }

    /// Waits for the successor that swapped the tail behind `node` to link itself.
    fn wait_for_next(node: &McsNode) -> u32 {
        loop {
            let next = node.next.load(Ordering::Acquire);
            if next != NONE {
                return next;
            }
            spin_loop();
        }
    }

    // The stock flavor (module docs).

    /// Takes the lock byte if the whole lock is clear (Linux's `queued_spin_trylock`).
    fn stock_try_lock(&self) -> bool {
        self.tail.load(Ordering::Relaxed) == NONE
            && self.pending.load(Ordering::Relaxed) == 0
            && self
                .locked
                .compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Linux's hybrid unfair trylock at slow-path entry (`pv_hybrid_queued_unfair_trylock`):
    /// takes the lock byte when it is free and no queue head spins for it (pending), and keeps
    /// trying as long as others are queued and pending is clear; it gives up (to queue) only
    /// when the queue is empty or a queue head sets pending. So while the queue's head is
    /// halted or not running, arrivals spin for the lock instead of queueing behind it.
    fn stock_steal(&self) -> bool {
        loop {
            let pending = self.pending.load(Ordering::Relaxed) != 0;
            if !pending
                && self.locked.load(Ordering::Relaxed) == 0
                && self
                    .locked
                    .compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return true;
            }
            if pending || self.tail.load(Ordering::Relaxed) == NONE {
                return false;
            }
            spin_loop();
        }
    }

    /// The queue head's try (`trylock_clear_pending`): takes a free lock byte, then clears
    /// pending (while the byte is taken, nobody can steal it).
    fn stock_head_try(&self) -> bool {
        if self.locked.load(Ordering::Relaxed) == 0
            && self
                .locked
                .compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            self.pending.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }

    fn lock_stock<O: PvOps>(&self, pv: Pv<'_, O>) {
        if !self.stock_try_lock() {
            self.lock_stock_slow(pv);
        }
    }

    #[cold]
    fn lock_stock_slow<O: PvOps>(&self, pv: Pv<'_, O>) {
        let (cpu, index, code) = Self::prepare(&pv);
        let halt = pv.config.halt;
        if halt && self.stock_steal() {
            cpu.free_node(index);
            return;
        }
        let node = at(&cpu.nodes, index);
        let prev = self.tail.swap(code, Ordering::AcqRel);
        if prev != NONE {
            let pred = Self::node(&pv, prev);
            pred.next.store(code, Ordering::Release);
            self.stock_wait_node(pv, cpu, node, pred);
        }
        // The queue head: wait for the lock byte.
        let pred_cpu = (prev != NONE).then(|| decode(prev).0);
        self.stock_wait_head(pv, cpu, node, code, pred_cpu);
        // Holding the lock: give the queue head to the successor, if any.
        if self
            .tail
            .compare_exchange(code, NONE, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            let next = Self::wait_for_next(node);
            let successor = Self::node(&pv, next);
            successor.locked.store(1, Ordering::Release);
            if halt {
                self.stock_kick_node(cpu, successor, next);
            }
        }
        cpu.free_node(index);
    }

    /// `pv_wait_node`: spins on `node.locked`, halts past the threshold or as soon as the
    /// predecessor's node says it is not running. Returns once the queue head is ours.
    fn stock_wait_node<O: PvOps>(
        &self,
        pv: Pv<'_, O>,
        cpu: &PvCpu,
        node: &McsNode,
        pred: &McsNode,
    ) {
        loop {
            let mut early = false;
            for spins in 0..pv.config.spin_threshold {
                if node.locked.load(Ordering::Acquire) != 0 {
                    return;
                }
                // A racy look at a node its vCPU may already reuse: a hint, as in Linux.
                if pv.config.halt
                    && spins % PREV_CHECK_EVERY == 0
                    && pred.state.load(Ordering::Relaxed) != RUNNING
                {
                    early = true;
                    break;
                }
                spin_loop();
            }
            if !pv.config.halt {
                continue;
            }
            cpu.stats.slowpath();
            if early {
                cpu.stats.wait_early();
            }
            node.state.store(HALTED, Ordering::Relaxed);
            full_fence();
            let waited = node.locked.load(Ordering::Acquire) == 0;
            if waited {
                cpu.stats.halt();
                pv.ops.wait(&node.state, HALTED);
            }
            // A hand-over that found us halted set HASHED: keep it, the head must not hash
            // again.
            let _ =
                node.state
                    .compare_exchange(HALTED, RUNNING, Ordering::Relaxed, Ordering::Relaxed);
            if node.locked.load(Ordering::Acquire) != 0 {
                return;
            }
            if waited {
                cpu.stats.spurious();
            }
        }
    }

    /// `pv_wait_head_or_lock`: the queue head spins for the lock byte, then marks the lock
    /// `SLOW`, hashes itself and halts until the unlocker kicks it. Returns holding the lock.
    /// `pred_cpu`: the vCPU that handed over the queue head, whose preemption ends the spin.
    fn stock_wait_head<O: PvOps>(
        &self,
        pv: Pv<'_, O>,
        cpu: &PvCpu,
        node: &McsNode,
        code: u32,
        pred_cpu: Option<u32>,
    ) {
        if !pv.config.halt {
            // A plain qspinlock's head: nobody steals, nobody marks the lock slow.
            while !self.stock_head_try() {
                spin_loop();
            }
            return;
        }
        // Hashed already by the hand-over (which also marked the lock SLOW).
        let mut hashed = node.state.load(Ordering::Relaxed) == HASHED;
        // Whether the last round was cut short too: a hashed head re-enters its spin at once
        // while the vCPU stays preempted, and that is one preemption seen, not one per round.
        let mut was_preempted = false;
        loop {
            node.state.store(RUNNING, Ordering::Relaxed);
            self.pending.store(1, Ordering::Relaxed);
            let mut preempted = false;
            for spins in 0..pv.config.spin_threshold {
                if self.stock_head_try() {
                    return;
                }
                if spins % PREV_CHECK_EVERY == 0 {
                    if let Some(pred) = pred_cpu {
                        if pv.ops.vcpu_is_preempted(pred) {
                            preempted = true;
                            break;
                        }
                    }
                }
                spin_loop();
            }
            self.pending.store(0, Ordering::Relaxed);
            if preempted && !was_preempted {
                cpu.stats.preempted();
            }
            was_preempted = preempted;
            if !hashed {
                hashed = true;
                cpu.stats.slowpath();
                // Hash before marking SLOW: an unlocker that sees SLOW finds the entry.
                self.holder.store(code, Ordering::Relaxed);
                if self.locked.swap(SLOW, Ordering::AcqRel) == 0 {
                    // The lock was free: it is ours. Back to LOCKED, unhashed.
                    self.locked.store(LOCKED, Ordering::Relaxed);
                    self.holder.store(NONE, Ordering::Relaxed);
                    return;
                }
            }
            node.state.store(HASHED, Ordering::Relaxed);
            // `pv_wait(&locked, SLOW)` returns at once unless the lock is SLOW: after the
            // unlock that kicked this head, only a stealer holds it (as LOCKED), and the head
            // spins again. Only a wait that can halt is counted (and made).
            if self.locked.load(Ordering::Relaxed) == SLOW {
                cpu.stats.halt();
                pv.ops.wait(&self.locked, SLOW);
                // Stolen meanwhile, or a spurious wake-up: spin (and re-wait) again.
                if self.locked.load(Ordering::Relaxed) != 0 {
                    cpu.stats.spurious();
                }
            }
        }
    }

    /// `pv_kick_node`: after handing the queue head to `successor` (code `next`), if it is
    /// halted, mark it hashed, the lock `SLOW` and hash it, so this holder's unlock kicks it;
    /// no kick now.
    fn stock_kick_node(&self, cpu: &PvCpu, successor: &McsNode, next: u32) {
        full_fence();
        if successor
            .state
            .compare_exchange(HALTED, HASHED, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            // Only this vCPU (the holder) reads these back, at its unlock.
            self.locked.store(SLOW, Ordering::Relaxed);
            self.holder.store(next, Ordering::Relaxed);
        } else {
            cpu.stats.no_kick();
        }
    }

    /// # Safety
    ///
    /// The caller holds the lock (stock flavor).
    unsafe fn unlock_stock<O: PvOps>(&self, pv: Pv<'_, O>) {
        match self
            .locked
            .compare_exchange(LOCKED, 0, Ordering::Release, Ordering::Acquire)
        {
            Ok(_) => {}
            Err(SLOW) => {
                // The CAS read SLOW with Acquire: the hash entry written before it is seen.
                let code = self.holder.swap(NONE, Ordering::Relaxed);
                self.locked.store(0, Ordering::Release);
                if code != NONE {
                    pv.ops.kick(decode(code).0);
                    if let Some((_, cpu)) = pv.this_cpu() {
                        cpu.stats.kick();
                    }
                }
            }
            Err(_) => panic!("StockQueuedLock: unlock of a lock that is not held"),
        }
    }
}

impl<F> Default for PvQueuedLock<F>
where
    F: QueuedFlavor,
{
    fn default() -> Self {
        Self::unlocked()
    }
}

// SAFETY: pvspin flavor: the tail swap orders the queue; only the caller that swapped into an
// empty queue or whose predecessor set its `locked` (Release, read with Acquire) returns from
// `lock`, and a holder hands over to exactly one successor (or empties the queue with a
// Release cmpxchg that the next swapper reads with Acquire). Stock flavor: the lock is the
// `locked` byte, taken only by a compare-exchange from 0 (Acquire) or by the queue head's
// exchange that found 0 (AcqRel), and released by a Release compare-exchange or store of 0.
unsafe impl<F: QueuedFlavor> RawPvLock for PvQueuedLock<F> {
    #[cfg(not(loom))]
    const UNLOCKED: Self = Self::unlocked();

    fn lock<O: PvOps>(&self, pv: Pv<'_, O>) {
        if F::STOCK {
            self.lock_stock(pv);
        } else {
            self.lock_pvspin(pv);
        }
    }

    fn try_lock<O: PvOps>(&self, pv: Pv<'_, O>) -> bool {
        if F::STOCK {
            self.stock_try_lock()
        } else {
            self.try_lock_pvspin(pv)
        }
    }

    unsafe fn unlock<O: PvOps>(&self, pv: Pv<'_, O>) {
        if F::STOCK {
            // SAFETY: the caller holds the lock (this trait's contract).
            unsafe { self.unlock_stock(pv) };
        } else {
            // SAFETY: as above.
            unsafe { self.unlock_pvspin(pv) };
        }
    }

    fn is_locked(&self) -> bool {
        self.tail.load(Ordering::Relaxed) != NONE
            || (F::STOCK && self.locked.load(Ordering::Relaxed) != 0)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::vec::Vec;

    use super::*;
    use crate::host::{bind_current_thread, HostPvOps};
    use crate::pv::{PvDomain, SpinConfig};

    #[test]
    fn both_flavors_fit_in_one_cache_line() {
        for (size, align) in [
            (
                core::mem::size_of::<PvQueuedLock>(),
                core::mem::align_of::<PvQueuedLock>(),
            ),
            (
                core::mem::size_of::<StockQueuedLock>(),
                core::mem::align_of::<StockQueuedLock>(),
            ),
        ] {
            assert_eq!((size, align), (16, 16));
        }
    }
    use crate::sync::AtomicU8;
    use crate::tests_common::pv_hammer;

    fn small() -> SpinConfig {
        SpinConfig {
            spin_threshold: 4,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        }
    }

    #[test]
    fn node_codes_round_trip() {
        for cpu in [0, 1, 7, 4095] {
            for index in 0..NODES_PER_CPU {
                let code = encode(cpu, index);
                assert_ne!(code, NONE);
                assert_eq!(decode(code), (cpu, index));
            }
        }
    }

    #[test]
    fn uncontended_and_nested_locks_use_and_free_nodes() {
        let domain: PvDomain<HostPvOps<1>, 1> = PvDomain::new(HostPvOps::new(), small());
        bind_current_thread(0);
        let locks: [PvQueuedLock; NODES_PER_CPU] = core::array::from_fn(|_| PvQueuedLock::new());
        for _ in 0..3 {
            for lock in &locks {
                lock.lock(domain.pv());
                assert!(lock.is_locked());
            }
            // Not in LIFO order: the holder's node is found through the lock.
            for lock in &locks {
                // SAFETY: we hold every lock.
                unsafe { lock.unlock(domain.pv()) };
                assert!(!lock.is_locked());
            }
        }
        assert!(locks[0].try_lock(domain.pv()));
        assert!(!locks[0].try_lock(domain.pv()));
        // SAFETY: we hold it.
        unsafe { locks[0].unlock(domain.pv()) };
        assert_eq!(domain.total_stats(), Default::default());
    }

    #[test]
    #[should_panic(expected = "NODES_PER_CPU")]
    fn too_deep_nesting_panics() {
        let domain: PvDomain<HostPvOps<1>, 1> = PvDomain::new(HostPvOps::new(), small());
        bind_current_thread(0);
        let locks: [PvQueuedLock; NODES_PER_CPU + 1] =
            core::array::from_fn(|_| PvQueuedLock::new());
        for lock in &locks {
            lock.lock(domain.pv());
        }
    }

    #[test]
    #[should_panic(expected = "cpu_id")]
    fn out_of_range_cpu_panics() {
        let domain: PvDomain<HostPvOps<1>, 1> = PvDomain::new(HostPvOps::new(), small());
        bind_current_thread(3);
        PvQueuedLock::new().lock(domain.pv());
    }

    #[test]
    fn excludes_and_halts_under_contention() {
        let stats = pv_hammer::<PvQueuedLock>(3, 300, small(), 0);
        assert!(stats.halts > 0, "waiters never halted: {stats:?}");
        assert_eq!(stats.kicks, stats.backend_kicks);
    }

    #[test]
    fn excludes_with_spurious_wakeups() {
        let stats = pv_hammer::<PvQueuedLock>(3, 300, small(), 2);
        assert!(stats.injected_spurious > 0, "{stats:?}");
        assert!(stats.spurious > 0, "{stats:?}");
    }

    #[test]
    fn without_halting_it_is_a_plain_mcs_lock() {
        let config = SpinConfig {
            spin_threshold: 1,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let stats = pv_hammer::<PvQueuedLock>(3, 100, config, 0);
        assert_eq!(
            (stats.slowpath, stats.halts, stats.kicks),
            (0, 0, 0),
            "{stats:?}"
        );
    }

    #[test]
    fn unlocker_kicks_only_halted_successor_in_queue_order() {
        crate::tests_common::check_kick_order(PvQueuedLock::new(), None);
    }

    #[test]
    fn unlocker_prewakes_the_waiters_behind_the_successor_only_when_vcpus_fit() {
        for depth in [1, 2, SpinConfig::MAX_PREWAKE] {
            crate::tests_common::check_prewake(PvQueuedLock::new(), true, depth);
        }
        crate::tests_common::check_prewake(PvQueuedLock::new(), true, 0);
        crate::tests_common::check_prewake(PvQueuedLock::new(), false, 2);
    }

    /// CPU 0 takes a queued lock and CPUs 1..N queue behind it in order, each until it
    /// halted; returns what the waiters told the host by then, and the lock's address.
    fn notes_of_waiters_in_order<const N: usize>() -> (Vec<SpinWait>, usize) {
        use crate::tests_common::Notifying;
        let domain: Arc<PvDomain<Notifying<N>, N>> = Arc::new(PvDomain::new(
            Notifying::new(4),
            SpinConfig {
                spin_threshold: 8,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            },
        ));
        let lock = Arc::new(PvQueuedLock::new());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let mut threads = Vec::new();
        for cpu in 1..N as u32 {
            let (d, l) = (domain.clone(), lock.clone());
            threads.push(std::thread::spawn(move || {
                bind_current_thread(cpu);
                l.lock(d.pv());
                // SAFETY: this thread holds the lock.
                unsafe { l.unlock(d.pv()) };
            }));
            // Queue in order: wait until this waiter halted.
            let mut tries = 0;
            while domain.ops().inner.parked(cpu) == 0 {
                tries += 1;
                assert!(tries < 20_000, "waiter {cpu} never halted");
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
        let notes = domain.ops().notes();
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        for thread in threads {
            thread.join().unwrap();
        }
        (notes, &*lock as *const PvQueuedLock as usize)
    }

    #[test]
    fn waiters_name_their_predecessor_and_whether_it_holds() {
        let (notes, lock) = notes_of_waiters_in_order::<3>();
        // CPU 1 waits behind the holder (CPU 0); CPU 2 behind CPU 1, the next owner.
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(0) && !n.next_owner && n.spun == 4));
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(1) && n.next_owner && n.spun == 4));
        assert!(notes.iter().all(|n| n.lock == lock));
    }

    #[test]
    fn a_waiter_deep_in_the_queue_names_the_holder_and_watches_its_predecessor() {
        let (notes, _) = notes_of_waiters_in_order::<4>();
        // CPU 3 waits behind CPU 2, itself a waiter: the host hears of the holder (CPU 0), a
        // boost of CPU 2 would end nobody's wait; its spin phase still watches CPU 2.
        assert!(
            notes.iter().any(|n| n.waiting_for == Some(0)
                && n.ahead == Some(2)
                && !n.next_owner
                && n.spun == 4),
            "{notes:?}"
        );
        // CPU 2 waits behind the next owner (CPU 1), CPU 1 behind the holder: both named.
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(1) && n.ahead == Some(1) && n.next_owner));
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(0) && n.ahead == Some(0) && !n.next_owner));
        assert!(notes.iter().all(|n| n.waiting_for != Some(2)), "{notes:?}");
    }

    #[test]
    fn running_successor_is_not_kicked() {
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<HostPvOps<2>, 2>> =
            Arc::new(PvDomain::new(HostPvOps::new(), config));
        let lock = Arc::new(PvQueuedLock::new());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let waiter = {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(1);
                lock.lock(domain.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        // Wait until the waiter has linked itself behind our node.
        let mut tries = 0;
        while domain.pv().cpus[0].nodes[0].next.load(Ordering::Acquire) == NONE {
            tries += 1;
            assert!(tries < 2_000_000, "waiter never queued");
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

    // The stock flavor.

    /// The host backend plus a settable `vcpu_is_preempted`.
    #[derive(Debug)]
    struct Preempting<const N: usize> {
        inner: HostPvOps<N>,
        preempted: std::sync::atomic::AtomicU32,
    }

    impl<const N: usize> Preempting<N> {
        fn new() -> Self {
            Self::with_spurious_every(0)
        }

        /// Every `every`-th wait returns at once (0: never), as [`HostPvOps`]'s.
        fn with_spurious_every(every: u64) -> Self {
            Self {
                inner: HostPvOps::with_spurious_every(every),
                preempted: std::sync::atomic::AtomicU32::new(0),
            }
        }
    }

    impl<const N: usize> PvOps for Preempting<N> {
        fn wait(&self, ptr: &AtomicU8, val: u8) {
            self.inner.wait(ptr, val);
        }
        fn kick(&self, cpu: u32) {
            self.inner.kick(cpu);
        }
        fn cpu_id(&self) -> u32 {
            self.inner.cpu_id()
        }
        fn vcpu_is_preempted(&self, cpu: u32) -> bool {
            cpu < 32 && self.preempted.load(std::sync::atomic::Ordering::Relaxed) & (1 << cpu) != 0
        }
        fn spin_window(&self) -> u32 {
            // A stock guest must never ask: a window of 1 would notify at every spin.
            1
        }
        fn spin_notify(&self, _wait: &SpinWait) {
            panic!("a stock lock sent a spin notification");
        }
    }

    /// Waits (bounded) until `cond` holds.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let mut tries = 0;
        while !cond() {
            tries += 1;
            assert!(tries < 50_000, "{what}");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    #[test]
    fn stock_excludes_and_halts_under_contention() {
        let stats = pv_hammer::<StockQueuedLock>(4, 300, small(), 0);
        assert!(stats.halts > 0, "waiters never halted: {stats:?}");
        assert_eq!(stats.kicks, stats.backend_kicks);
    }

    #[test]
    fn stock_excludes_with_spurious_wakeups() {
        let stats = pv_hammer::<StockQueuedLock>(3, 300, small(), 2);
        assert!(stats.injected_spurious > 0, "{stats:?}");
    }

    #[test]
    fn stock_without_halting_is_a_plain_qspinlock() {
        let config = SpinConfig {
            spin_threshold: 1,
            halt: false,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let stats = pv_hammer::<StockQueuedLock>(3, 100, config, 0);
        assert_eq!(
            (stats.slowpath, stats.halts, stats.kicks),
            (0, 0, 0),
            "{stats:?}"
        );
    }

    #[test]
    fn stock_uncontended_takes_no_node_and_try_lock_works() {
        let domain: PvDomain<Preempting<1>, 1> = PvDomain::new(Preempting::new(), small());
        bind_current_thread(0);
        let locks: [StockQueuedLock; NODES_PER_CPU + 1] =
            core::array::from_fn(|_| StockQueuedLock::new_stock());
        // The fast path holds no node: more locks than nodes at once.
        for lock in &locks {
            lock.lock(domain.pv());
            assert!(lock.is_locked());
            assert!(!lock.try_lock(domain.pv()));
        }
        for lock in &locks {
            // SAFETY: we hold every lock.
            unsafe { lock.unlock(domain.pv()) };
            assert!(!lock.is_locked());
        }
        assert!(locks[0].try_lock(domain.pv()));
        // SAFETY: we hold it.
        unsafe { locks[0].unlock(domain.pv()) };
        assert_eq!(domain.total_stats(), Default::default());
        assert_eq!(domain.cpu_stats(0).unwrap().kicks, 0);
    }

    /// The queue head marks the lock SLOW and halts; the unlock kicks it. The hand-over to a
    /// halted successor (which waited early: its predecessor was a halted head) hashes it
    /// without a kick; that holder's unlock kicks it. Two kicks, both at unlock.
    /// Linux's hybrid unfair trylock: while the queue's head is halted (pending clear), an
    /// arrival spins for the lock byte instead of queueing behind it (and halting early).
    #[test]
    fn stock_arrivals_spin_for_the_lock_while_the_queue_head_is_halted() {
        let domain: Arc<PvDomain<Preempting<3>, 3>> = Arc::new(PvDomain::new(
            Preempting::new(),
            SpinConfig {
                spin_threshold: 8,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            },
        ));
        let lock = Arc::new(StockQueuedLock::new_stock());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let spawn = |cpu: u32| {
            let (d, l) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(cpu);
                l.lock(d.pv());
                // SAFETY: this thread holds the lock.
                unsafe { l.unlock(d.pv()) };
            })
        };
        let head = spawn(1);
        eventually("the queue head never halted", || {
            domain.ops().inner.parked(1) == 1
        });
        assert_eq!(lock.locked.load(Ordering::SeqCst), SLOW);
        let tail = lock.tail.load(Ordering::SeqCst);
        let arrival = spawn(2);
        // A one-shot steal would have queued 2 behind the halted head at once (and halted it
        // early there); the hybrid trylock keeps it spinning for the lock byte.
        for _ in 0..50 {
            std::thread::sleep(std::time::Duration::from_micros(200));
            assert_eq!(lock.tail.load(Ordering::SeqCst), tail, "2 queued");
            assert_eq!(domain.ops().inner.parked(2), 0, "2 halted");
        }
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        head.join().unwrap();
        arrival.join().unwrap();
        assert!(!lock.is_locked());
        let stats = domain.total_stats();
        // CPU 0's unlock kicked the hashed head; 2 (stealer or queued behind a spinning head)
        // never halted.
        assert_eq!(domain.ops().inner.kicks_to(1), 1, "{stats:?}");
        assert_eq!(domain.cpu_stats(2).unwrap().halts, 0, "{stats:?}");
        assert_eq!(domain.cpu_stats(2).unwrap().wait_early, 0, "{stats:?}");
        assert_eq!(domain.ops().inner.stats().timeouts, 0);
    }

    /// A hand-over to a halted successor marks the lock SLOW and hashes it, without a kick;
    /// the holder's unlock kicks it. The successor queued while a head spun with pending set
    /// (only then does an arrival queue behind others), and halted early behind a head that
    /// halted.
    #[test]
    fn stock_handover_to_a_halted_successor_defers_the_kick_to_unlock() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Mutex;
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<Preempting<4>, 4>> =
            Arc::new(PvDomain::new(Preempting::new(), config));
        let lock = Arc::new(StockQueuedLock::new_stock());
        let order = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(AtomicBool::new(false));
        bind_current_thread(0);
        lock.lock(domain.pv());
        let spawn = |cpu: u32| {
            let (d, l, o, r) = (domain.clone(), lock.clone(), order.clone(), release.clone());
            std::thread::spawn(move || {
                bind_current_thread(cpu);
                l.lock(d.pv());
                o.lock().unwrap().push(cpu);
                while cpu == 1 && !r.load(std::sync::atomic::Ordering::SeqCst) {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                // SAFETY: this thread holds the lock.
                unsafe { l.unlock(d.pv()) };
            })
        };
        let queued_behind = |cpu: usize| {
            domain.pv().cpus[cpu]
                .nodes
                .iter()
                .any(|n| n.next.load(Ordering::SeqCst) != NONE)
        };
        let first = spawn(1);
        eventually("1 never became the queue head", || {
            lock.pending.load(Ordering::SeqCst) == 1
        });
        let second = spawn(2);
        eventually("2 never queued behind 1", || queued_behind(1));
        let third = spawn(3);
        eventually("3 never queued behind 2", || queued_behind(2));
        domain
            .ops()
            .preempted
            .store(1 << 1, std::sync::atomic::Ordering::SeqCst);
        // 1 takes the lock and hands the queue head to 2, which sees 1 preempted, marks the
        // lock SLOW and halts; 3 sees 2's node not running and halts early.
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        eventually("2 never halted", || domain.ops().inner.parked(2) == 1);
        eventually("3 never halted", || domain.ops().inner.parked(3) == 1);
        assert_eq!(domain.cpu_stats(3).unwrap().wait_early, 1);
        release.store(true, std::sync::atomic::Ordering::SeqCst);
        for t in [first, second, third] {
            t.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [1, 2, 3]);
        assert!(!lock.is_locked());
        let stats = domain.total_stats();
        // 1's unlock kicked the head (2); 2 handed the head to halted 3 without a kick, and
        // kicked it at its unlock.
        assert_eq!(domain.cpu_stats(1).unwrap().kicks, 1, "{stats:?}");
        assert_eq!(domain.cpu_stats(2).unwrap().kicks, 1, "{stats:?}");
        assert_eq!(domain.ops().inner.kicks_to(2), 1);
        assert_eq!(domain.ops().inner.kicks_to(3), 1);
        assert_eq!(domain.ops().inner.stats().timeouts, 0);
    }

    /// A running queue head is not kicked, and a lock that is not SLOW is released without a
    /// kick.
    #[test]
    fn stock_running_head_is_not_kicked() {
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
            prewake: SpinConfig::DEFAULT_PREWAKE,
        };
        let domain: Arc<PvDomain<Preempting<2>, 2>> =
            Arc::new(PvDomain::new(Preempting::new(), config));
        let lock = Arc::new(StockQueuedLock::new_stock());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let waiter = {
            let (domain, lock) = (domain.clone(), lock.clone());
            std::thread::spawn(move || {
                bind_current_thread(1);
                lock.lock(domain.pv());
                // SAFETY: this thread holds the lock.
                unsafe { lock.unlock(domain.pv()) };
            })
        };
        eventually("the waiter never queued", || {
            lock.pending.load(Ordering::SeqCst) == 1
        });
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        waiter.join().unwrap();
        let stats = domain.total_stats();
        // The head spins up to 2^24 times; only a badly starved main thread lets it halt.
        if stats.slowpath == 0 {
            assert_eq!((stats.kicks, stats.halts), (0, 0), "{stats:?}");
        } else {
            assert_eq!(stats.kicks, 1, "{stats:?}");
        }
        assert_eq!(domain.ops().inner.stats().kicks, stats.kicks);
    }

    /// Thread 1 holds the lock and stays preempted; thread 2, the queue head it handed over to,
    /// spins behind it. Until `release`, 1 keeps the lock; the caller's unlock (the main
    /// thread held the lock first) hands it to 1.
    struct PreemptedHolder {
        domain: Arc<PvDomain<Preempting<3>, 3>>,
        lock: Arc<StockQueuedLock>,
        release: Arc<std::sync::atomic::AtomicBool>,
        threads: [std::thread::JoinHandle<()>; 2],
    }

    impl PreemptedHolder {
        fn new(spurious_every: u64) -> Self {
            let config = SpinConfig {
                spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
                halt: true,
                prewake: SpinConfig::DEFAULT_PREWAKE,
            };
            let domain = Arc::new(PvDomain::new(
                Preempting::with_spurious_every(spurious_every),
                config,
            ));
            let lock = Arc::new(StockQueuedLock::new_stock());
            let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
            bind_current_thread(0);
            lock.lock(domain.pv());
            let holder = {
                let (d, l, r) = (domain.clone(), lock.clone(), release.clone());
                std::thread::spawn(move || {
                    bind_current_thread(1);
                    l.lock(d.pv());
                    while !r.load(std::sync::atomic::Ordering::SeqCst) {
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                    // SAFETY: this thread holds the lock.
                    unsafe { l.unlock(d.pv()) };
                })
            };
            eventually("1 never became the queue head", || {
                lock.pending.load(Ordering::SeqCst) == 1
            });
            let waiter = {
                let (d, l) = (domain.clone(), lock.clone());
                std::thread::spawn(move || {
                    bind_current_thread(2);
                    l.lock(d.pv());
                    // SAFETY: this thread holds the lock.
                    unsafe { l.unlock(d.pv()) };
                })
            };
            eventually("2 never queued behind 1", || {
                domain.pv().cpus[1]
                    .nodes
                    .iter()
                    .any(|n| n.next.load(Ordering::SeqCst) != NONE)
            });
            domain
                .ops()
                .preempted
                .store(1 << 1, std::sync::atomic::Ordering::SeqCst);
            Self {
                domain,
                lock,
                release,
                threads: [holder, waiter],
            }
        }

        /// Lets 1 unlock and both threads finish.
        fn finish(self) -> Arc<PvDomain<Preempting<3>, 3>> {
            self.release
                .store(true, std::sync::atomic::Ordering::SeqCst);
            for thread in self.threads {
                thread.join().unwrap();
            }
            assert!(!self.lock.is_locked());
            self.domain
        }
    }

    /// The queue head stops spinning when the vCPU that handed it the queue head (the holder)
    /// is preempted, marks the lock SLOW and halts; the holder's unlock kicks it.
    #[test]
    fn stock_head_stops_spinning_when_the_holder_is_preempted() {
        let scene = PreemptedHolder::new(0);
        let (domain, lock) = (&scene.domain, &scene.lock);
        // 1 takes the lock and hands the queue head to 2, which sees 1 preempted.
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        eventually("2 never halted", || domain.ops().inner.parked(2) == 1);
        assert_eq!(domain.cpu_stats(2).unwrap().preempted, 1);
        assert_eq!(lock.locked.load(Ordering::SeqCst), SLOW);
        let domain = scene.finish();
        assert_eq!(domain.cpu_stats(1).unwrap().kicks, 1);
        assert_eq!(domain.ops().inner.kicks_to(2), 1);
        assert_eq!(domain.ops().inner.stats().timeouts, 0);
    }

    /// A head whose wait keeps returning (here every wait is spurious) while the holder stays
    /// preempted goes round its loop again and again, each round cut short at once: one
    /// preemption seen, counted once.
    #[test]
    fn stock_head_counts_a_long_preemption_once() {
        let scene = PreemptedHolder::new(1);
        let domain = &scene.domain;
        // SAFETY: the main thread holds the lock.
        unsafe { scene.lock.unlock(domain.pv()) };
        eventually("2 never went round 100 times", || {
            domain.cpu_stats(2).unwrap().spurious >= 100
        });
        assert_eq!(domain.cpu_stats(2).unwrap().preempted, 1);
        let domain = scene.finish();
        assert_eq!(domain.cpu_stats(2).unwrap().preempted, 1);
    }
}
