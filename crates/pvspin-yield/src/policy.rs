//! The directed-yield decision: whom a spinning vCPU should yield to.
//!
//! Order of the rules (the shared notes' kvm-pv-reference.md, "Directed yield:
//! `kvm_vcpu_on_spin`" and the candidate filter in "Notes for a userspace Rust VMM", plus the
//! guest's hint):
//! 0. fewer than two vCPUs, or a spinner index out of range: nothing;
//! 1. **the guest's hint**: the vCPU the spinner waits for (the holder, or the next owner of a
//!    fair lock), if it is in range, not the spinner, and *ready* (preempted, or halted with a
//!    pending kick; or running, with [`PolicyConfig::boost_running_hint`]). It bypasses the kernel-mode filter and the eligibility alternation: the
//!    guest knows better than any heuristic. A hint naming a running vCPU falls through to 2;
//! 2. **KVM's candidate scan**, round robin from the vCPU after the last one boosted (the
//!    vCPU *index* is stored, not the loop counter: the v6.13 bug), skipping:
//!    self; running vCPUs; halted vCPUs without a pending kick; vCPUs that are not ready
//!    (stopped); if the spinner is in kernel mode, preempted vCPUs that were preempted in user
//!    mode and have no pending kick; vCPUs that are themselves spinning, every other time they
//!    are examined (their eligibility bit flips);
//! 3. each candidate goes to the booster; "boosted" ends the scan; "not boosted" moves on;
//!    "nothing else runnable" counts a failure, and `max_failures` of them end the scan;
//! 4. no candidate: yield the spinner's own thread (configurable), or nothing when the
//!    failures showed nobody else can run.
//!
//! During the decision the spinner is marked spinning; afterwards its eligibility bit is
//! cleared, so its next spin episode starts "not eligible", as in KVM.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use pvspin_track::{VcpuBoard, VcpuSnapshot};
use thiserror::Error;

/// A spin notification, in plain Rust (the wire format is the ABI crate's business).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpinNotification {
    /// The vCPU that spins (the one whose thread handles the notification).
    pub spinner: usize,
    /// The guest's lock id (for statistics; the policy does not use it).
    pub lock_id: u64,
    /// The vCPU the guest says it waits for, if it knows (untrusted).
    pub waiting_for: Option<u32>,
    /// How long it spun, in the guest's units (untrusted; for statistics).
    pub spun: u64,
}

/// What the policy reads and the few bits it writes.
pub trait VcpuView {
    /// Number of vCPUs.
    fn len(&self) -> usize;
    /// Whether there are no vCPUs.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// One vCPU's facts; only called with `v < len()`.
    fn snapshot(&self, v: usize) -> VcpuSnapshot;
    /// The lowest index in `from..to` that may be ready (runnable, not on a CPU); a superset
    /// is fine, the policy confirms with [`snapshot`](Self::snapshot). The default returns
    /// every index; a board with a ready bitmap skips 64 vCPUs per word.
    #[inline]
    fn next_candidate(&self, from: usize, to: usize) -> Option<usize> {
        (from < to).then_some(from)
    }
    /// Marks `v` spinning or not.
    fn set_spinning(&self, v: usize, spinning: bool);
    /// Sets `v`'s eligibility bit.
    fn set_dy_eligible(&self, v: usize, eligible: bool);
    /// Flips `v`'s eligibility bit, returning the previous value.
    fn toggle_dy_eligible(&self, v: usize) -> bool;
}

impl VcpuView for VcpuBoard {
    #[inline]
    fn len(&self) -> usize {
        VcpuBoard::len(self)
    }
    #[inline]
    fn snapshot(&self, v: usize) -> VcpuSnapshot {
        VcpuBoard::snapshot(self, v).unwrap_or(VcpuSnapshot::from_raw(0))
    }
    #[inline]
    fn next_candidate(&self, from: usize, to: usize) -> Option<usize> {
        self.next_maybe_ready(from, to, false)
    }
    fn set_spinning(&self, v: usize, spinning: bool) {
        VcpuBoard::set_spinning(self, v, spinning);
    }
    fn set_dy_eligible(&self, v: usize, eligible: bool) {
        VcpuBoard::set_dy_eligible(self, v, eligible);
    }
    fn toggle_dy_eligible(&self, v: usize) -> bool {
        VcpuBoard::toggle_dy_eligible(self, v)
    }
}

/// A board whose candidates' steal-time areas are read from guest memory as they are
/// examined (one byte each), so host preemption inside `KVM_RUN` is seen.
#[derive(Debug)]
pub struct StealTimeView<'a, M: ?Sized> {
    /// The board.
    pub board: &'a VcpuBoard,
    /// Guest memory.
    pub mem: &'a M,
}

impl<M: pvspin_track::GuestBytes + ?Sized> VcpuView for StealTimeView<'_, M> {
    fn len(&self) -> usize {
        self.board.len()
    }
    #[inline]
    fn snapshot(&self, v: usize) -> VcpuSnapshot {
        self.board
            .observe_steal_time(v, self.mem)
            .unwrap_or(VcpuSnapshot::from_raw(0))
    }
    #[inline]
    fn next_candidate(&self, from: usize, to: usize) -> Option<usize> {
        self.board.next_maybe_ready(from, to, true)
    }
    fn set_spinning(&self, v: usize, spinning: bool) {
        self.board.set_spinning(v, spinning);
    }
    fn set_dy_eligible(&self, v: usize, eligible: bool) {
        self.board.set_dy_eligible(v, eligible);
    }
    fn toggle_dy_eligible(&self, v: usize) -> bool {
        self.board.toggle_dy_eligible(v)
    }
}

/// What the booster reports for one candidate (KVM's `kvm_vcpu_yield_to` result).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoostOutcome {
    /// The candidate was boosted (KVM: `> 0`): the scan ends.
    Boosted,
    /// It could not be boosted (KVM: 0): try the next one.
    NotBoosted,
    /// Nothing else can run anyway (KVM: `-ESRCH`): counts as a failure.
    NothingElseRunnable,
}

/// Why the policy decided what it decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The guest named the vCPU and it was ready.
    Hint,
    /// Found by the candidate scan.
    Candidate,
    /// The scan found nobody.
    NoCandidate,
    /// The booster reported `max_failures` "nothing else runnable".
    FailuresExhausted,
    /// Fewer than two vCPUs.
    TooFewVcpus,
    /// The spinner index is out of range.
    InvalidSpinner,
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Boost this vCPU and yield the spinner.
    YieldTo(usize, Reason),
    /// Yield the spinner's own thread (undirected).
    YieldSelf(Reason),
    /// Do nothing; the guest spins on.
    Nothing(Reason),
}

/// What was wrong with the guest's hint, if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintStatus {
    /// No hint given, or hints are disabled.
    None,
    /// Used.
    Used,
    /// Names a vCPU that does not exist (counted; the scan runs).
    OutOfRange,
    /// Names the spinner itself (counted; the scan runs).
    SelfHint,
    /// Names a vCPU that is not ready (running, halted without a kick, stopped).
    NotReady,
    /// Ready, but the booster did not boost it.
    NotBoosted,
}

/// Counters of one decision, per skip rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScanStats {
    /// vCPUs examined (self included); a view with a ready bitmap skips the others unseen.
    pub examined: u32,
    /// Skipped: running.
    pub running: u32,
    /// Skipped: halted without a pending kick.
    pub halted_no_kick: u32,
    /// Skipped: not ready (stopped, or not recorded preempted).
    pub not_ready: u32,
    /// Skipped by the kernel-mode filter.
    pub user_mode: u32,
    /// Skipped: spinning and not eligible this time.
    pub ineligible: u32,
    /// Booster said "not boosted".
    pub not_boosted: u32,
    /// Booster said "nothing else runnable".
    pub failures: u32,
    /// The scan stopped at `scan_budget` vCPUs examined.
    pub budget_exhausted: bool,
}

/// A decision with its explanation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The decision.
    pub decision: Decision,
    /// The hint's fate.
    pub hint: HintStatus,
    /// Per-rule counters.
    pub stats: ScanStats,
}

/// Invalid policy configuration.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy, displaydoc::Display)]
pub enum PolicyError {
    /// rule: max_failures must be at least 1 (KVM uses 3)
    ZeroFailures,
    /// rule: scan_budget must be at least 1 (u32::MAX for no limit)
    ZeroBudget,
}

/// Policy knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Use the guest's `waiting_for` hint first.
    pub use_hint: bool,
    /// Apply the kernel-mode filter when the spinner is in kernel mode (KVM's
    /// `yield_to_kernel_mode`).
    pub kernel_mode_filter: bool,
    /// When no candidate is found, yield the spinner's thread anyway (E9: an undirected yield
    /// after a short spin halves CPU time under overcommit).
    pub yield_self_when_no_candidate: bool,
    /// "Nothing else runnable" answers before giving up (KVM: 3).
    pub max_failures: u32,
    /// At most this many vCPUs examined per decision (KVM: unlimited, `u32::MAX`). Bounds the
    /// cost when every vCPU must be looked at (all have steal-time areas, whose bytes are
    /// read one by one); the next decision continues the round robin where this one stopped.
    /// Default 64: about 0.7 us with steal-time reads on the loaded development machine, so
    /// a decision stays under 1 us at any vCPU count. vCPUs the board's ready bitmap skips
    /// are not examined and do not count.
    pub scan_budget: u32,
    /// Rule 1 also accepts a hinted vCPU that the view says is *running* (in the guest or in
    /// the VMM, not recorded preempted). For hosts that cannot see a vCPU thread preempted
    /// inside `KVM_RUN` (no steal time, no VMM scheduler): there "running" may well be
    /// "preempted by another host thread", and boosting the vCPU the guest waits for is what
    /// helps it. Off by default (KVM yields only to ready vCPUs). A hinted vCPU that is halted
    /// without a kick, or stopped, is still refused.
    pub boost_running_hint: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            use_hint: true,
            kernel_mode_filter: true,
            yield_self_when_no_candidate: true,
            max_failures: 3,
            scan_budget: 64,
            boost_running_hint: false,
        }
    }
}

/// Ready: runnable but not on a CPU (KVM's `ready`).
#[inline]
fn is_ready(s: VcpuSnapshot) -> bool {
    s.is_preempted() || (s.is_halted() && s.has_pending_kick())
}

/// Counts of guest hints the policy could not use because they were malformed (a guest bug
/// or a hostile guest; each kind is logged once). Hints naming a vCPU that is merely not
/// ready are normal and only reported in [`Outcome::hint`].
#[derive(Debug, Default)]
pub struct BadHintCounters {
    /// Hints naming a vCPU index that does not exist.
    pub out_of_range: AtomicU64,
    /// Hints naming the spinner itself.
    pub self_hint: AtomicU64,
    logged_out_of_range: AtomicBool,
    logged_self_hint: AtomicBool,
}

/// The per-VM directed-yield policy. Shared by all vCPU threads (`&self`, lock-free).
#[derive(Debug)]
pub struct DirectedYield {
    cfg: PolicyConfig,
    last_boosted: AtomicUsize,
    bad_hints: BadHintCounters,
}

impl DirectedYield {
    /// A policy with `cfg`.
    pub fn new(cfg: PolicyConfig) -> Result<DirectedYield, PolicyError> {
        if cfg.max_failures == 0 {
            return Err(PolicyError::ZeroFailures);
        }
        if cfg.scan_budget == 0 {
            return Err(PolicyError::ZeroBudget);
        }
        Ok(DirectedYield {
            cfg,
            last_boosted: AtomicUsize::new(0),
            bad_hints: BadHintCounters::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> PolicyConfig {
        self.cfg
    }

    /// Malformed hints seen so far.
    pub fn bad_hints(&self) -> &BadHintCounters {
        &self.bad_hints
    }

    fn count_bad_hint(&self, spinner: usize, hint: u32, status: HintStatus) {
        let b = &self.bad_hints;
        let (count, logged) = match status {
            HintStatus::OutOfRange => (&b.out_of_range, &b.logged_out_of_range),
            HintStatus::SelfHint => (&b.self_hint, &b.logged_self_hint),
            _ => return,
        };
        count.fetch_add(1, Ordering::Relaxed);
        if !logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "pvspin-yield: vCPU {spinner} sent an unusable hint {hint} ({status:?}); \
                 counted, logged once"
            );
        }
    }

    /// Whether a hinted vCPU in state `s` may be boosted (rule 1).
    fn hint_acceptable(&self, s: VcpuSnapshot) -> bool {
        is_ready(s) || (self.cfg.boost_running_hint && s.is_running())
    }

    /// The index of the last vCPU boosted (the scan starts after it).
    pub fn last_boosted(&self) -> usize {
        self.last_boosted.load(Ordering::Relaxed)
    }

    /// Decides without feedback: the first candidate counts as boosted. Pure over `view`
    /// (apart from the spinning and eligibility bits and the round-robin position).
    pub fn decide<V: VcpuView + ?Sized>(&self, view: &V, n: &SpinNotification) -> Outcome {
        self.decide_with(view, n, |_| BoostOutcome::Boosted)
    }

    /// Decides, asking `boost` about each candidate in turn (KVM's loop around
    /// `kvm_vcpu_yield_to`).
    pub fn decide_with<V, B>(&self, view: &V, n: &SpinNotification, mut boost: B) -> Outcome
    where
        V: VcpuView + ?Sized,
        B: FnMut(usize) -> BoostOutcome,
    {
        let mut out = Outcome {
            decision: Decision::Nothing(Reason::TooFewVcpus),
            hint: HintStatus::None,
            stats: ScanStats::default(),
        };
        let nr = view.len();
        if nr < 2 {
            return out;
        }
        let me = n.spinner;
        if me >= nr {
            out.decision = Decision::Nothing(Reason::InvalidSpinner);
            return out;
        }
        view.set_spinning(me, true);
        out.decision = self.scan(view, me, nr, n.waiting_for, &mut boost, &mut out);
        view.set_spinning(me, false);
        view.set_dy_eligible(me, false);
        out
    }

    fn scan<V, B>(
        &self,
        view: &V,
        me: usize,
        nr: usize,
        hint: Option<u32>,
        boost: &mut B,
        out: &mut Outcome,
    ) -> Decision
    where
        V: VcpuView + ?Sized,
        B: FnMut(usize) -> BoostOutcome,
    {
        let mut failures = 0u32;
        if let (true, Some(h)) = (self.cfg.use_hint, hint) {
            let h = h as usize;
            out.hint = if h >= nr {
                HintStatus::OutOfRange
            } else if h == me {
                HintStatus::SelfHint
            } else if !self.hint_acceptable(view.snapshot(h)) {
                HintStatus::NotReady
            } else {
                match boost(h) {
                    BoostOutcome::Boosted => {
                        out.hint = HintStatus::Used;
                        self.last_boosted.store(h, Ordering::Relaxed);
                        return Decision::YieldTo(h, Reason::Hint);
                    }
                    BoostOutcome::NotBoosted => {}
                    BoostOutcome::NothingElseRunnable => {
                        failures += 1;
                        out.stats.failures += 1;
                    }
                }
                HintStatus::NotBoosted
            };
            self.count_bad_hint(me, hint.unwrap_or(0), out.hint);
            if failures >= self.cfg.max_failures {
                return Decision::Nothing(Reason::FailuresExhausted);
            }
        }
        let me_in_kernel = view.snapshot(me).in_kernel();
        let start = (self.last_boosted.load(Ordering::Relaxed) % nr) + 1;
        let st = &mut out.stats;
        // Round robin without a division per step: start..nr, then 0..start.
        'scan: for (lo, hi) in [(start, nr), (0, start.min(nr))] {
            let mut i = lo;
            while let Some(idx) = view.next_candidate(i, hi) {
                if idx < i || idx >= hi {
                    break; // a view outside its contract: stop rather than loop
                }
                if st.examined >= self.cfg.scan_budget {
                    // Continue from `idx` next time.
                    let before = idx.checked_sub(1).unwrap_or(nr - 1);
                    self.last_boosted.store(before, Ordering::Relaxed);
                    st.budget_exhausted = true;
                    break 'scan;
                }
                i = idx + 1;
                st.examined += 1;
                if idx == me {
                    continue;
                }
                let s = view.snapshot(idx);
                if s.is_running() {
                    st.running += 1;
                    continue;
                }
                if s.is_halted() && !s.has_pending_kick() {
                    st.halted_no_kick += 1;
                    continue;
                }
                if !is_ready(s) {
                    st.not_ready += 1;
                    continue;
                }
                if self.cfg.kernel_mode_filter
                    && me_in_kernel
                    && s.is_preempted()
                    && !s.has_pending_kick()
                    && !s.preempted_in_kernel()
                {
                    st.user_mode += 1;
                    continue;
                }
                if s.is_spinning() && !view.toggle_dy_eligible(idx) {
                    st.ineligible += 1;
                    continue;
                }
                match boost(idx) {
                    BoostOutcome::Boosted => {
                        // Store the index, not the loop counter (KVM v6.13's bug).
                        self.last_boosted.store(idx, Ordering::Relaxed);
                        return Decision::YieldTo(idx, Reason::Candidate);
                    }
                    BoostOutcome::NotBoosted => st.not_boosted += 1,
                    BoostOutcome::NothingElseRunnable => {
                        st.failures += 1;
                        failures += 1;
                        if failures >= self.cfg.max_failures {
                            return Decision::Nothing(Reason::FailuresExhausted);
                        }
                    }
                }
            }
        }
        if self.cfg.yield_self_when_no_candidate {
            Decision::YieldSelf(Reason::NoCandidate)
        } else {
            Decision::Nothing(Reason::NoCandidate)
        }
    }
}
