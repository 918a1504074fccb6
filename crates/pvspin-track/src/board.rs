//! The per-vCPU board: one packed atomic word per vCPU, written mostly by the vCPU's own
//! thread and read lock-free (one load) by every other thread.
//!
//! Word layout (private; read it through [`VcpuSnapshot`]):
//! state (3 bits), CPL at the last exit (2 bits), CPL-known, preempted, preempted-in-kernel,
//! pending kick, spinning, directed-yield eligible. All of a vCPU's facts are in one `u32`, so a
//! reader sees a consistent set and a policy scanning 1024 vCPUs touches 4 KiB.
//!
//! "Preempted" here means *runnable but not on a CPU*, KVM's `ready`/`preempted` notion. A
//! userspace VMM can learn it three ways, and the board records each with the CPL of the vCPU's
//! last exit as "preempted in kernel", cached at the moment it is recorded:
//! 1. the VMM's own scheduler deschedules the vCPU thread ([`VcpuBoard::park`]): exact, the
//!    vCPU is outside `KVM_RUN` and its last CPL is its current one;
//! 2. KVM's steal-time `preempted` byte in guest memory, when the guest registered steal time
//!    ([`VcpuBoard::observe_steal_time`]): KVM sets it at `vcpu_put` on an involuntary
//!    deschedule; the CPL cached is the last exit's, which is the mode at preemption only if
//!    the guest did not change mode since its last exit (not observable from userspace);
//! 3. a thread that is runnable but off-CPU, seen in `/proc/<tid>/stat`: **not implemented**
//!    (racy and a few microseconds per read; the shared notes' kvm-pv-reference.md, "Notes
//!    for a userspace Rust VMM").
//!
//! Without any of them, a vCPU inside `KVM_RUN` reads as running, and the directed-yield policy
//! finds no candidate, exactly as KVM finds none among vCPUs that were never scheduled out.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use thiserror::Error;

use crate::steal::{read_preempted, GuestBytes};

const STATE_MASK: u32 = 0b111;
const CPL_SHIFT: u32 = 3;
const CPL_MASK: u32 = 0b11 << CPL_SHIFT;
const CPL_KNOWN: u32 = 1 << 5;
const PREEMPTED: u32 = 1 << 6;
const PREEMPTED_IN_KERNEL: u32 = 1 << 7;
const PENDING_KICK: u32 = 1 << 8;
const SPINNING: u32 = 1 << 9;
const DY_ELIGIBLE: u32 = 1 << 10;
const NO_GPA: u64 = u64::MAX;

/// Where a vCPU is, as its own thread (or the VMM's scheduler) last recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum VcpuState {
    /// Not started yet, or stopped for good.
    Stopped = 0,
    /// Inside `KVM_RUN` (running guest code, or preempted by the host there).
    InGuest = 1,
    /// Out of `KVM_RUN`, handling an exit on its thread.
    InVmm = 2,
    /// Blocked waiting for an event (guest HLT handled in userspace, or a pvspin wait).
    Halted = 3,
    /// Runnable, but descheduled by the VMM's own scheduler.
    Parked = 4,
}

impl VcpuState {
    #[inline]
    fn from_bits(bits: u32) -> VcpuState {
        match bits & STATE_MASK {
            1 => VcpuState::InGuest,
            2 => VcpuState::InVmm,
            3 => VcpuState::Halted,
            4 => VcpuState::Parked,
            _ => VcpuState::Stopped,
        }
    }
}

/// Errors of the board.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy, displaydoc::Display)]
pub enum BoardError {
    /// rule: a board has at least one vCPU
    Empty,
    /// rule: a board has at most 65535 vCPUs, asked for {0}
    TooMany(usize),
}

/// A consistent copy of one vCPU's facts (one atomic load).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct VcpuSnapshot(u32);

impl std::fmt::Debug for VcpuSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuSnapshot")
            .field("state", &self.state())
            .field("cpl", &self.cpl())
            .field("preempted", &self.is_preempted())
            .field("preempted_in_kernel", &self.preempted_in_kernel())
            .field("pending_kick", &self.has_pending_kick())
            .field("spinning", &self.is_spinning())
            .field("dy_eligible", &self.dy_eligible())
            .finish()
    }
}

impl VcpuSnapshot {
    /// Builds a snapshot by hand (policy tests, fuzzing).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn new(
        state: VcpuState,
        cpl: Option<u8>,
        preempted: bool,
        preempted_in_kernel: bool,
        pending_kick: bool,
        spinning: bool,
        dy_eligible: bool,
    ) -> VcpuSnapshot {
        let mut w = state as u32;
        if let Some(c) = cpl {
            w |= CPL_KNOWN | ((u32::from(c) & 3) << CPL_SHIFT);
        }
        for (on, bit) in [
            (preempted, PREEMPTED),
            (preempted_in_kernel, PREEMPTED_IN_KERNEL),
            (pending_kick, PENDING_KICK),
            (spinning, SPINNING),
            (dy_eligible, DY_ELIGIBLE),
        ] {
            if on {
                w |= bit;
            }
        }
        VcpuSnapshot(w)
    }

    /// Decodes a raw word (any `u32` is valid; unknown state bits read as `Stopped`).
    #[inline]
    pub fn from_raw(raw: u32) -> VcpuSnapshot {
        VcpuSnapshot(raw)
    }

    /// The raw word.
    #[inline]
    pub fn raw(self) -> u32 {
        self.0
    }

    /// The recorded state.
    #[inline]
    pub fn state(self) -> VcpuState {
        VcpuState::from_bits(self.0)
    }

    /// The CPL at the last exit, if the VMM reported one.
    #[inline]
    pub fn cpl(self) -> Option<u8> {
        if self.0 & CPL_KNOWN != 0 {
            Some(((self.0 & CPL_MASK) >> CPL_SHIFT) as u8)
        } else {
            None
        }
    }

    /// Whether the last exit was in guest kernel mode. An unknown CPL counts as kernel mode:
    /// like KVM for protected guests, a false positive is preferable to never yielding.
    #[inline]
    pub fn in_kernel(self) -> bool {
        self.cpl().is_none_or(|c| c == 0)
    }

    /// Runnable but not on a CPU (host-preempted inside `KVM_RUN`, or parked by the VMM).
    #[inline]
    pub fn is_preempted(self) -> bool {
        self.0 & PREEMPTED != 0
    }

    /// Whether it was in guest kernel mode when it was recorded preempted (meaningful only
    /// while [`is_preempted`](Self::is_preempted)).
    #[inline]
    pub fn preempted_in_kernel(self) -> bool {
        self.0 & PREEMPTED_IN_KERNEL != 0
    }

    /// A kick (wake-up) is pending and not consumed yet.
    #[inline]
    pub fn has_pending_kick(self) -> bool {
        self.0 & PENDING_KICK != 0
    }

    /// It is inside a spin-notification handler (KVM's `in_spin_loop`).
    #[inline]
    pub fn is_spinning(self) -> bool {
        self.0 & SPINNING != 0
    }

    /// Its directed-yield eligibility bit (KVM's `dy_eligible`).
    #[inline]
    pub fn dy_eligible(self) -> bool {
        self.0 & DY_ELIGIBLE != 0
    }

    /// Blocked waiting for an event.
    #[inline]
    pub fn is_halted(self) -> bool {
        self.state() == VcpuState::Halted
    }

    /// On a CPU and making progress: in the guest or in the VMM, and not recorded preempted.
    #[inline]
    pub fn is_running(self) -> bool {
        matches!(self.state(), VcpuState::InGuest | VcpuState::InVmm) && !self.is_preempted()
    }
}

/// The per-vCPU facts of one VM.
#[derive(Debug)]
pub struct VcpuBoard {
    words: Box<[AtomicU32]>,
    tids: Box<[AtomicI32]>,
    steal_gpas: Box<[AtomicU64]>,
    /// Bit v: vCPU v is ready (preempted, or halted with a pending kick). Kept in step with
    /// the words after every change, so a scan of 1024 vCPUs reads 16 words.
    ready_bits: Box<[AtomicU64]>,
    /// Bit v: vCPU v has a steal-time area (its preemption is only seen by reading it).
    steal_bits: Box<[AtomicU64]>,
}

#[inline]
fn ready_word(w: u32) -> bool {
    let s = VcpuSnapshot(w);
    s.is_preempted() || (s.is_halted() && s.has_pending_kick())
}

fn set_bit(bits: &[AtomicU64], v: usize, on: bool) {
    let Some(b) = bits.get(v / 64) else { return };
    let m = 1u64 << (v % 64);
    if (b.load(Ordering::Acquire) & m != 0) != on {
        if on {
            b.fetch_or(m, Ordering::AcqRel);
        } else {
            b.fetch_and(!m, Ordering::AcqRel);
        }
    }
}

/// The lowest set bit of `bits` in `from..to`.
#[inline]
fn next_set(
    bits: &[AtomicU64],
    from: usize,
    to: usize,
    also: Option<&[AtomicU64]>,
) -> Option<usize> {
    let mut i = from;
    while i < to {
        let wi = i / 64;
        let mut word = bits.get(wi)?.load(Ordering::Acquire);
        if let Some(a) = also {
            word |= a.get(wi).map_or(0, |x| x.load(Ordering::Acquire));
        }
        word &= !0u64 << (i % 64);
        if word != 0 {
            let found = wi * 64 + word.trailing_zeros() as usize;
            return (found < to).then_some(found);
        }
        i = (wi + 1) * 64;
    }
    None
}

impl VcpuBoard {
    /// A board for `n` vCPUs, all `Stopped`, CPL unknown, no steal time.
    pub fn new(n: usize) -> Result<VcpuBoard, BoardError> {
        if n == 0 {
            return Err(BoardError::Empty);
        }
        if n > usize::from(u16::MAX) {
            return Err(BoardError::TooMany(n));
        }
        Ok(VcpuBoard {
            words: (0..n).map(|_| AtomicU32::new(0)).collect(),
            tids: (0..n).map(|_| AtomicI32::new(0)).collect(),
            steal_gpas: (0..n).map(|_| AtomicU64::new(NO_GPA)).collect(),
            ready_bits: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            steal_bits: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Number of vCPUs.
    #[inline]
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Always false (a board has at least one vCPU); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// One vCPU's facts, or `None` for an index out of range.
    #[inline]
    pub fn snapshot(&self, v: usize) -> Option<VcpuSnapshot> {
        self.words
            .get(v)
            .map(|w| VcpuSnapshot(w.load(Ordering::Acquire)))
    }

    fn update(&self, v: usize, f: impl Fn(u32) -> u32) {
        if let Some(w) = self.words.get(v) {
            // Lock-free: retried only when another thread flipped a bit in between.
            let _ = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| Some(f(x)));
            self.sync_ready_bit(v);
        }
    }

    /// Brings `v`'s ready bit in line with its word. Two updaters racing could leave the bit
    /// stale; each re-checks the word after writing the bit, so the last one to finish fixes
    /// it (bounded: a stale bit only costs or misses one candidate until the next update).
    fn sync_ready_bit(&self, v: usize) {
        let Some(w) = self.words.get(v) else { return };
        for _ in 0..8 {
            let r = ready_word(w.load(Ordering::Acquire));
            set_bit(&self.ready_bits, v, r);
            if ready_word(w.load(Ordering::Acquire)) == r {
                return;
            }
        }
    }

    /// The lowest vCPU in `from..to` that may be ready: recorded ready, or (with
    /// `with_steal_time`) having a steal-time area whose byte has to be read to know. A
    /// superset: the caller confirms with [`snapshot`](Self::snapshot).
    #[inline]
    pub fn next_maybe_ready(&self, from: usize, to: usize, with_steal_time: bool) -> Option<usize> {
        let to = to.min(self.len());
        next_set(
            &self.ready_bits,
            from,
            to,
            with_steal_time.then_some(&*self.steal_bits),
        )
    }

    // ---- written by the vCPU's own thread ----

    /// Records the vCPU thread's id (for actuators). Call once from that thread.
    pub fn set_tid(&self, v: usize, tid: i32) {
        if let Some(t) = self.tids.get(v) {
            t.store(tid, Ordering::Release);
        }
    }

    /// The vCPU thread's id, 0 when unknown.
    #[inline]
    pub fn tid(&self, v: usize) -> i32 {
        self.tids.get(v).map_or(0, |t| t.load(Ordering::Acquire))
    }

    /// Just before `KVM_RUN`: in the guest, not preempted, kick consumed.
    pub fn on_enter_run(&self, v: usize) {
        self.update(v, |x| {
            (x & !(STATE_MASK | PREEMPTED | PREEMPTED_IN_KERNEL | PENDING_KICK))
                | VcpuState::InGuest as u32
        });
    }

    /// Just after `KVM_RUN` returned (any exit, `EINTR` included), with the CPL read from the
    /// sync registers (`None` when the VMM does not read it).
    pub fn on_exit(&self, v: usize, cpl: Option<u8>) {
        let cpl_bits = cpl.map_or(0, |c| CPL_KNOWN | ((u32::from(c) & 3) << CPL_SHIFT));
        self.update(v, |x| {
            (x & !(STATE_MASK | CPL_MASK | CPL_KNOWN | PREEMPTED | PREEMPTED_IN_KERNEL))
                | cpl_bits
                | VcpuState::InVmm as u32
        });
    }

    /// The vCPU blocks waiting for an event (a pending kick stays pending).
    pub fn on_halt(&self, v: usize) {
        self.update(v, |x| {
            (x & !(STATE_MASK | PREEMPTED | PREEMPTED_IN_KERNEL)) | VcpuState::Halted as u32
        });
    }

    /// The vCPU woke from a halt and consumed its kick.
    pub fn on_wake(&self, v: usize) {
        self.update(v, |x| {
            (x & !(STATE_MASK | PENDING_KICK)) | VcpuState::InVmm as u32
        });
    }

    /// The vCPU stopped for good (or has not started).
    pub fn on_stop(&self, v: usize) {
        self.update(v, |x| x & !(STATE_MASK | PREEMPTED | PREEMPTED_IN_KERNEL));
    }

    // ---- written by other threads ----

    /// A kick was sent to `v` (any thread).
    pub fn kick(&self, v: usize) {
        if let Some(w) = self.words.get(v) {
            w.fetch_or(PENDING_KICK, Ordering::AcqRel);
            self.sync_ready_bit(v);
        }
    }

    /// The VMM's scheduler descheduled `v` (it is outside `KVM_RUN`): preempted, with
    /// "preempted in kernel" cached from its last exit's CPL (unknown CPL counts as kernel).
    pub fn park(&self, v: usize) {
        self.update(v, |x| {
            let in_kernel = VcpuSnapshot(x).in_kernel();
            let mut n = (x & !STATE_MASK) | VcpuState::Parked as u32 | PREEMPTED;
            n = if in_kernel {
                n | PREEMPTED_IN_KERNEL
            } else {
                n & !PREEMPTED_IN_KERNEL
            };
            n
        });
    }

    /// The VMM's scheduler lets `v` run again (its thread will call
    /// [`on_enter_run`](Self::on_enter_run) next).
    pub fn unpark(&self, v: usize) {
        self.update(v, |x| {
            if VcpuState::from_bits(x) == VcpuState::Parked {
                (x & !(STATE_MASK | PREEMPTED | PREEMPTED_IN_KERNEL)) | VcpuState::InVmm as u32
            } else {
                x
            }
        });
    }

    /// Marks `v` spinning or not (its own thread, around a spin-notification handler).
    #[inline]
    pub fn set_spinning(&self, v: usize, spinning: bool) {
        if let Some(w) = self.words.get(v) {
            if spinning {
                w.fetch_or(SPINNING, Ordering::AcqRel);
            } else {
                w.fetch_and(!SPINNING, Ordering::AcqRel);
            }
        }
    }

    /// Sets `v`'s directed-yield eligibility bit.
    #[inline]
    pub fn set_dy_eligible(&self, v: usize, eligible: bool) {
        if let Some(w) = self.words.get(v) {
            if eligible {
                w.fetch_or(DY_ELIGIBLE, Ordering::AcqRel);
            } else {
                w.fetch_and(!DY_ELIGIBLE, Ordering::AcqRel);
            }
        }
    }

    /// Flips `v`'s eligibility bit and returns its previous value.
    #[inline]
    pub fn toggle_dy_eligible(&self, v: usize) -> bool {
        self.words
            .get(v)
            .is_some_and(|w| w.fetch_xor(DY_ELIGIBLE, Ordering::AcqRel) & DY_ELIGIBLE != 0)
    }

    /// Records where `v`'s steal-time area is (a GPA validated with
    /// [`steal_time_gpa`](crate::steal::steal_time_gpa)), or that it has none.
    pub fn set_steal_time_gpa(&self, v: usize, gpa: Option<u64>) {
        if let Some(g) = self.steal_gpas.get(v) {
            g.store(gpa.unwrap_or(NO_GPA), Ordering::Release);
            set_bit(&self.steal_bits, v, gpa.is_some());
        }
    }

    /// `v`'s steal-time area, if registered.
    #[inline]
    pub fn steal_time_gpa(&self, v: usize) -> Option<u64> {
        self.steal_gpas
            .get(v)
            .map(|g| g.load(Ordering::Acquire))
            .filter(|&g| g != NO_GPA)
    }

    /// Reads `v`'s steal-time `preempted` byte (when it has an area and is inside `KVM_RUN`)
    /// and records the result: on the transition to preempted, "preempted in kernel" is cached
    /// from the CPL of its last exit. Returns the updated snapshot. Any thread may call it.
    #[inline]
    pub fn observe_steal_time<M: GuestBytes + ?Sized>(
        &self,
        v: usize,
        mem: &M,
    ) -> Option<VcpuSnapshot> {
        let w = self.words.get(v)?;
        let cur = w.load(Ordering::Acquire);
        if VcpuState::from_bits(cur) != VcpuState::InGuest {
            return Some(VcpuSnapshot(cur));
        }
        let Some(gpa) = self.steal_time_gpa(v) else {
            return Some(VcpuSnapshot(cur));
        };
        let preempted = read_preempted(mem, gpa);
        if preempted == (cur & PREEMPTED != 0) {
            // Nothing changed (the common case): no read-modify-write.
            return Some(VcpuSnapshot(cur));
        }
        let r = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
            // Only a vCPU still in the same KVM_RUN is updated; an exit in between wins.
            if VcpuState::from_bits(x) != VcpuState::InGuest {
                return None;
            }
            let was = x & PREEMPTED != 0;
            match (was, preempted) {
                (false, true) => {
                    let k = if VcpuSnapshot(x).in_kernel() {
                        PREEMPTED_IN_KERNEL
                    } else {
                        0
                    };
                    Some(x | PREEMPTED | k)
                }
                (true, false) => Some(x & !(PREEMPTED | PREEMPTED_IN_KERNEL)),
                _ => None,
            }
        });
        Some(VcpuSnapshot(match r {
            Ok(_) => {
                self.sync_ready_bit(v);
                w.load(Ordering::Acquire)
            }
            Err(unchanged) => unchanged,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_rules() {
        assert_eq!(VcpuBoard::new(0).unwrap_err(), BoardError::Empty);
        assert_eq!(
            VcpuBoard::new(70_000).unwrap_err(),
            BoardError::TooMany(70_000)
        );
        assert_eq!(VcpuBoard::new(3).unwrap().len(), 3);
    }

    #[test]
    fn lifecycle_of_one_vcpu() {
        let b = VcpuBoard::new(2).unwrap();
        let s = b.snapshot(0).unwrap();
        assert_eq!(s.state(), VcpuState::Stopped);
        assert_eq!(s.cpl(), None);
        assert!(!s.is_running());
        b.on_enter_run(0);
        assert!(b.snapshot(0).unwrap().is_running());
        b.on_exit(0, Some(3));
        let s = b.snapshot(0).unwrap();
        assert_eq!(s.state(), VcpuState::InVmm);
        assert_eq!(s.cpl(), Some(3));
        assert!(!s.in_kernel());
        b.kick(0);
        b.on_halt(0);
        let s = b.snapshot(0).unwrap();
        assert!(s.is_halted() && s.has_pending_kick() && !s.is_running());
        b.on_wake(0);
        let s = b.snapshot(0).unwrap();
        assert!(!s.has_pending_kick() && s.is_running());
        // Other vCPU untouched.
        assert_eq!(b.snapshot(1).unwrap().raw(), 0);
        assert!(b.snapshot(2).is_none());
        b.on_stop(0);
        assert_eq!(b.snapshot(0).unwrap().state(), VcpuState::Stopped);
    }

    #[test]
    fn park_caches_cpl_of_last_exit() {
        let b = VcpuBoard::new(2).unwrap();
        b.on_exit(0, Some(0));
        b.park(0);
        let s = b.snapshot(0).unwrap();
        assert!(s.is_preempted() && s.preempted_in_kernel() && !s.is_running());
        b.unpark(0);
        b.on_exit(1, Some(3));
        b.park(1);
        let s = b.snapshot(1).unwrap();
        assert!(s.is_preempted() && !s.preempted_in_kernel());
        // Entering the guest clears the preempted facts.
        b.on_enter_run(1);
        let s = b.snapshot(1).unwrap();
        assert!(!s.is_preempted() && !s.preempted_in_kernel());
    }

    #[test]
    fn unpark_ignores_vcpus_that_are_not_parked() {
        let b = VcpuBoard::new(1).unwrap();
        b.on_halt(0);
        b.unpark(0);
        assert!(b.snapshot(0).unwrap().is_halted());
    }

    #[test]
    fn steal_time_marks_and_clears_preempted_with_cached_cpl() {
        let b = VcpuBoard::new(1).unwrap();
        let mut mem = vec![0u8; 4096];
        b.set_steal_time_gpa(0, Some(0x100));
        b.on_exit(0, Some(0));
        b.on_enter_run(0);
        assert!(!b
            .observe_steal_time(0, mem.as_slice())
            .unwrap()
            .is_preempted());
        mem[0x110] = 1;
        let s = b.observe_steal_time(0, mem.as_slice()).unwrap();
        assert!(s.is_preempted() && s.preempted_in_kernel() && !s.is_running());
        mem[0x110] = 0;
        let s = b.observe_steal_time(0, mem.as_slice()).unwrap();
        assert!(!s.is_preempted() && s.is_running());
    }

    #[test]
    fn steal_time_ignored_outside_kvm_run_or_without_area() {
        let b = VcpuBoard::new(1).unwrap();
        let mut mem = vec![0u8; 4096];
        mem[0x110] = 1;
        b.on_enter_run(0);
        assert!(!b
            .observe_steal_time(0, mem.as_slice())
            .unwrap()
            .is_preempted());
        b.set_steal_time_gpa(0, Some(0x100));
        b.on_exit(0, Some(3));
        assert!(!b
            .observe_steal_time(0, mem.as_slice())
            .unwrap()
            .is_preempted());
        b.on_enter_run(0);
        let s = b.observe_steal_time(0, mem.as_slice()).unwrap();
        assert!(s.is_preempted() && !s.preempted_in_kernel());
        assert!(b.observe_steal_time(5, mem.as_slice()).is_none());
    }

    #[test]
    fn unknown_cpl_counts_as_kernel() {
        let b = VcpuBoard::new(1).unwrap();
        b.on_exit(0, None);
        b.park(0);
        assert!(b.snapshot(0).unwrap().preempted_in_kernel());
    }

    #[test]
    fn eligibility_toggles_and_spinning_flag() {
        let b = VcpuBoard::new(1).unwrap();
        b.set_spinning(0, true);
        assert!(b.snapshot(0).unwrap().is_spinning());
        assert!(!b.toggle_dy_eligible(0));
        assert!(b.toggle_dy_eligible(0));
        assert!(!b.snapshot(0).unwrap().dy_eligible());
        b.set_dy_eligible(0, true);
        assert!(b.snapshot(0).unwrap().dy_eligible());
        b.set_spinning(0, false);
        assert!(!b.snapshot(0).unwrap().is_spinning());
        assert!(!b.toggle_dy_eligible(9));
    }

    #[test]
    fn ready_bitmap_follows_the_words() {
        let b = VcpuBoard::new(200).unwrap();
        assert_eq!(b.next_maybe_ready(0, 200, false), None);
        b.on_exit(130, Some(0));
        b.park(130);
        b.kick(7);
        assert_eq!(
            b.next_maybe_ready(0, 130, false),
            None,
            "kick alone is not ready"
        );
        b.on_halt(7);
        assert_eq!(b.next_maybe_ready(0, 200, false), Some(7));
        assert_eq!(b.next_maybe_ready(8, 200, false), Some(130));
        assert_eq!(b.next_maybe_ready(8, 130, false), None);
        assert_eq!(b.next_maybe_ready(131, 500, false), None);
        b.on_wake(7);
        b.on_enter_run(130);
        assert_eq!(b.next_maybe_ready(0, 200, false), None);
        b.set_steal_time_gpa(199, Some(0x40));
        assert_eq!(b.next_maybe_ready(0, 200, false), None);
        assert_eq!(b.next_maybe_ready(0, 200, true), Some(199));
        b.set_steal_time_gpa(199, None);
        assert_eq!(b.next_maybe_ready(0, 200, true), None);
        // Every bit agrees with its word after a random-ish walk.
        for i in 0..200usize {
            match i % 5 {
                0 => b.park(i),
                1 => b.on_halt(i),
                2 => {
                    b.on_halt(i);
                    b.kick(i);
                }
                3 => b.on_enter_run(i),
                _ => b.on_exit(i, Some(3)),
            }
        }
        let mut from = 0;
        let mut found = vec![];
        while let Some(v) = b.next_maybe_ready(from, 200, false) {
            found.push(v);
            from = v + 1;
        }
        let expect: Vec<usize> = (0..200)
            .filter(|&i| ready_word(b.snapshot(i).unwrap().raw()))
            .collect();
        assert_eq!(found, expect);
        assert_eq!(found.len(), 80);
    }

    #[test]
    fn tids_are_per_vcpu() {
        let b = VcpuBoard::new(2).unwrap();
        b.set_tid(1, 1234);
        assert_eq!(b.tid(0), 0);
        assert_eq!(b.tid(1), 1234);
        assert_eq!(b.tid(7), 0);
    }

    #[test]
    fn concurrent_readers_see_whole_words() {
        let b = std::sync::Arc::new(VcpuBoard::new(1).unwrap());
        let w = b.clone();
        let writer = std::thread::spawn(move || {
            for i in 0..20_000u32 {
                w.on_exit(0, Some(if i % 2 == 0 { 0 } else { 3 }));
                w.park(0);
                w.on_enter_run(0);
            }
        });
        for _ in 0..20_000 {
            let s = b.snapshot(0).unwrap();
            // Parked always carries preempted; preempted-in-kernel agrees with the CPL.
            if s.state() == VcpuState::Parked {
                assert!(s.is_preempted());
                assert_eq!(s.preempted_in_kernel(), s.cpl() == Some(0));
            }
            if s.state() == VcpuState::InGuest {
                assert!(!s.is_preempted());
            }
        }
        writer.join().unwrap();
    }
}
