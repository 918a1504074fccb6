//! The PV queued (MCS) lock: waiters queue on per-vCPU nodes and spin on their own node; past
//! the threshold they mark the node Halted and `pv_wait`; the unlocker hands the lock to its
//! successor and kicks it only if the successor's node says Halted, and only at unlock time
//! (the pv qspinlock's `vcpu_running` / `vcpu_halted` states, without its lock word and hash).
//!
//! # The halt/kick handshake
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
//! # Not done (on purpose)
//!
//! No lock stealing and no pending bit (Linux's hybrid unfair trylock): strictly FIFO, so a
//! preempted or halted successor delays everyone behind it until it runs; that is what the
//! kick (and the host's directed yield) are for. The holder keeps its node until unlock, so a
//! vCPU may hold or await at most [`NODES_PER_CPU`](crate::NODES_PER_CPU) queued locks at once.

use crate::pv::{Pv, PvCpu, PvOps, RawPvLock, SpinWait, NODES_PER_CPU};
use crate::sync::{full_fence, spin_loop, AtomicU32, AtomicU8, Ordering};

/// The node's vCPU is running (spinning, or not waiting).
const RUNNING: u8 = 0;
/// The node's vCPU is halted, or about to halt, in `pv_wait`.
const HALTED: u8 = 1;

/// "No node": an empty queue, or no successor yet.
const NONE: u32 = 0;

/// One MCS queue node. Each vCPU owns [`NODES_PER_CPU`] of them inside its
/// [`PvCpu`](crate::PvCpu).
#[derive(Debug)]
pub struct McsNode {
    /// The successor's node code, or `NONE`.
    next: AtomicU32,
    /// Set to 1 by the predecessor when it hands the lock over.
    locked: AtomicU8,
    /// `RUNNING` or `HALTED`.
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

/// A fair (FIFO) MCS queued lock with a paravirtual slow path.
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
#[derive(Debug)]
pub struct PvQueuedLock {
    /// The last queued node's code, or `NONE` when free.
    tail: AtomicU32,
    /// The holder's node code; written and read by the holder (waiters read it racily, as a
    /// hint for spin notifications).
    holder: AtomicU32,
}

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
    /// A new, unlocked lock.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            tail: AtomicU32::new(NONE),
            holder: AtomicU32::new(NONE),
        }
    }

    /// A new, unlocked lock.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            tail: AtomicU32::new(NONE),
            holder: AtomicU32::new(NONE),
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

    /// What a waiter behind node `prev` tells the host: it waits for `prev`'s CPU, which is
    /// the holder or, when the holder's node is another, the next owner before it. Also what
    /// its WAIT names: `prev` is the vCPU that gets the lock next, often just kicked and not
    /// running yet, where a boost helps; the `holder` word may still name the waiter itself
    /// then (the new holder has not recorded itself), so it is no target.
    fn spin_wait(&self, prev: u32, spun: u32) -> SpinWait {
        SpinWait {
            lock: self as *const Self as usize,
            waiting_for: Some(decode(prev).0),
            // `holder` is the holder's own word; a racy read is fine for a hint.
            next_owner: self.holder.load(Ordering::Relaxed) != prev,
            spun,
        }
    }

    #[cold]
    fn wait_for_handoff<O: PvOps>(&self, pv: Pv<'_, O>, cpu: &PvCpu, node: &McsNode, prev: u32) {
        loop {
            if pv.spin_phase(
                || node.locked.load(Ordering::Acquire) != 0,
                |spun| self.spin_wait(prev, spun),
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
                .wait_for(&node.state, HALTED, &self.spin_wait(prev, 0));
            node.state.store(RUNNING, Ordering::Relaxed);
            if node.locked.load(Ordering::Acquire) != 0 {
                return;
            }
            cpu.stats.spurious();
        }
    }
}

impl Default for PvQueuedLock {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: the tail swap orders the queue; only the caller that swapped into an empty queue or
// whose predecessor set its `locked` (Release, read with Acquire) returns from `lock`, and a
// holder hands over to exactly one successor (or empties the queue with a Release cmpxchg that
// the next swapper reads with Acquire).
unsafe impl RawPvLock for PvQueuedLock {
    #[cfg(not(loom))]
    const UNLOCKED: Self = Self::new();

    fn lock<O: PvOps>(&self, pv: Pv<'_, O>) {
        let (cpu, index, code) = Self::prepare(&pv);
        let prev = self.tail.swap(code, Ordering::AcqRel);
        if prev != NONE {
            Self::node(&pv, prev).next.store(code, Ordering::Release);
            self.wait_for_handoff(pv, cpu, at(&cpu.nodes, index), prev);
        }
        self.holder.store(code, Ordering::Relaxed);
    }

    fn try_lock<O: PvOps>(&self, pv: Pv<'_, O>) -> bool {
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

    unsafe fn unlock<O: PvOps>(&self, pv: Pv<'_, O>) {
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
            loop {
                next = node.next.load(Ordering::Acquire);
                if next != NONE {
                    break;
                }
                spin_loop();
            }
        }
        let successor = Self::node(&pv, next);
        successor.locked.store(1, Ordering::Release);
        // Our node is no longer referenced by anyone.
        cpu.free_node(index);
        if !pv.config.halt {
            return;
        }
        full_fence();
        if successor.state.load(Ordering::Relaxed) == HALTED
            && successor
                .state
                .compare_exchange(HALTED, RUNNING, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            pv.ops.kick(decode(next).0);
            cpu.stats.kick();
        } else {
            cpu.stats.no_kick();
        }
    }

    fn is_locked(&self) -> bool {
        self.tail.load(Ordering::Relaxed) != NONE
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::vec::Vec;

    use super::*;
    use crate::host::{bind_current_thread, HostPvOps};
    use crate::pv::{PvDomain, SpinConfig};
    use crate::tests_common::pv_hammer;

    fn small() -> SpinConfig {
        SpinConfig {
            spin_threshold: 4,
            halt: true,
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
    fn waiters_name_their_predecessor_and_whether_it_holds() {
        use crate::tests_common::Notifying;
        let domain: Arc<PvDomain<Notifying<3>, 3>> = Arc::new(PvDomain::new(
            Notifying::new(4),
            SpinConfig {
                spin_threshold: 8,
                halt: true,
            },
        ));
        let lock = Arc::new(PvQueuedLock::new());
        bind_current_thread(0);
        lock.lock(domain.pv());
        let mut threads = Vec::new();
        for cpu in 1..3u32 {
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
        // SAFETY: the main thread holds the lock.
        unsafe { lock.unlock(domain.pv()) };
        for thread in threads {
            thread.join().unwrap();
        }
        let notes = domain.ops().notes();
        // CPU 1 waits behind the holder (CPU 0); CPU 2 behind CPU 1, the next owner.
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(0) && !n.next_owner && n.spun == 4));
        assert!(notes
            .iter()
            .any(|n| n.waiting_for == Some(1) && n.next_owner && n.spun == 4));
        assert!(notes
            .iter()
            .all(|n| n.lock == &*lock as *const PvQueuedLock as usize));
    }

    #[test]
    fn running_successor_is_not_kicked() {
        let config = SpinConfig {
            spin_threshold: SpinConfig::MAX_SPIN_THRESHOLD,
            halt: true,
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
}
