//! Rule-by-rule tests of the directed-yield policy, over hand-built states.

use std::cell::{Cell, RefCell};

use pvspin_track::{VcpuBoard, VcpuSnapshot, VcpuState};

use crate::*;

/// A hand-built view: one snapshot per vCPU, bits written back in place.
struct Hand {
    v: Vec<Cell<VcpuSnapshot>>,
    log: RefCell<Vec<String>>,
}

fn snap(state: VcpuState, cpl: u8) -> VcpuSnapshot {
    VcpuSnapshot::new(state, Some(cpl), false, false, false, false, false)
}

fn running(cpl: u8) -> VcpuSnapshot {
    snap(VcpuState::InGuest, cpl)
}

fn preempted(in_kernel: bool) -> VcpuSnapshot {
    let cpl = if in_kernel { 0 } else { 3 };
    VcpuSnapshot::new(
        VcpuState::InGuest,
        Some(cpl),
        true,
        in_kernel,
        false,
        false,
        false,
    )
}

fn with(s: VcpuSnapshot, f: impl Fn(&mut Parts)) -> VcpuSnapshot {
    let mut p = Parts {
        state: s.state(),
        cpl: s.cpl(),
        preempted: s.is_preempted(),
        in_kernel: s.preempted_in_kernel(),
        kick: s.has_pending_kick(),
        spinning: s.is_spinning(),
        eligible: s.dy_eligible(),
    };
    f(&mut p);
    VcpuSnapshot::new(
        p.state,
        p.cpl,
        p.preempted,
        p.in_kernel,
        p.kick,
        p.spinning,
        p.eligible,
    )
}

struct Parts {
    state: VcpuState,
    cpl: Option<u8>,
    preempted: bool,
    in_kernel: bool,
    kick: bool,
    spinning: bool,
    eligible: bool,
}

impl Hand {
    fn new(v: Vec<VcpuSnapshot>) -> Hand {
        Hand {
            v: v.into_iter().map(Cell::new).collect(),
            log: RefCell::new(vec![]),
        }
    }
    fn get(&self, i: usize) -> VcpuSnapshot {
        self.v[i].get()
    }
}

impl VcpuView for Hand {
    fn len(&self) -> usize {
        self.v.len()
    }
    fn snapshot(&self, v: usize) -> VcpuSnapshot {
        self.v[v].get()
    }
    fn set_spinning(&self, v: usize, spinning: bool) {
        self.log
            .borrow_mut()
            .push(format!("spinning {v} {spinning}"));
        self.v[v].set(with(self.v[v].get(), |p| p.spinning = spinning));
    }
    fn set_dy_eligible(&self, v: usize, eligible: bool) {
        self.v[v].set(with(self.v[v].get(), |p| p.eligible = eligible));
    }
    fn toggle_dy_eligible(&self, v: usize) -> bool {
        let old = self.v[v].get();
        self.v[v].set(with(old, |p| p.eligible = !old.dy_eligible()));
        old.dy_eligible()
    }
}

fn note(spinner: usize, waiting_for: Option<u32>) -> SpinNotification {
    SpinNotification {
        spinner,
        lock_id: 7,
        waiting_for,
        spun: 16,
    }
}

fn policy() -> DirectedYield {
    DirectedYield::new(PolicyConfig::default()).unwrap()
}

#[test]
fn config_rule_max_failures() {
    let cfg = PolicyConfig {
        max_failures: 0,
        ..Default::default()
    };
    assert_eq!(
        DirectedYield::new(cfg).unwrap_err(),
        PolicyError::ZeroFailures
    );
}

#[test]
fn config_rule_scan_budget() {
    let cfg = PolicyConfig {
        scan_budget: 0,
        ..Default::default()
    };
    assert_eq!(
        DirectedYield::new(cfg).unwrap_err(),
        PolicyError::ZeroBudget
    );
}

#[test]
fn rule2_scan_budget_bounds_work_and_round_robin_continues() {
    let p = DirectedYield::new(PolicyConfig {
        scan_budget: 3,
        ..Default::default()
    })
    .unwrap();
    let mut v = vec![running(0); 10];
    v[8] = preempted(true);
    let h = Hand::new(v);
    // Scan order from last_boosted 0: 1 2 3 | 4 5 6 | 7 8 -> found on the third decision.
    for _ in 0..2 {
        let o = p.decide(&h, &note(0, None));
        assert_eq!(o.decision, Decision::YieldSelf(Reason::NoCandidate));
        assert!(o.stats.budget_exhausted);
        assert_eq!(o.stats.examined, 3);
    }
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldTo(8, Reason::Candidate));
    assert!(!o.stats.budget_exhausted);
}

#[test]
fn rule0_too_few_vcpus_and_bad_spinner() {
    let p = policy();
    let one = Hand::new(vec![running(0)]);
    assert_eq!(
        p.decide(&one, &note(0, None)).decision,
        Decision::Nothing(Reason::TooFewVcpus)
    );
    let two = Hand::new(vec![running(0), preempted(true)]);
    assert_eq!(
        p.decide(&two, &note(2, None)).decision,
        Decision::Nothing(Reason::InvalidSpinner)
    );
    assert!(
        two.log.borrow().is_empty(),
        "no bit written for a bad spinner"
    );
}

#[test]
fn rule1_hint_wins_over_round_robin_and_filters() {
    let p = policy();
    // vCPU 1 would be the scan's first pick; the hint names 3, preempted in user mode, which
    // the kernel-mode filter would reject in a scan.
    let h = Hand::new(vec![
        running(0),
        preempted(true),
        running(0),
        preempted(false),
    ]);
    let o = p.decide(&h, &note(0, Some(3)));
    assert_eq!(o.decision, Decision::YieldTo(3, Reason::Hint));
    assert_eq!(o.hint, HintStatus::Used);
    assert_eq!(p.last_boosted(), 3);
}

#[test]
fn rule1_hint_halted_with_kick_is_ready() {
    let p = policy();
    let h = Hand::new(vec![
        running(0),
        preempted(true),
        with(snap(VcpuState::Halted, 0), |p| p.kick = true),
    ]);
    assert_eq!(
        p.decide(&h, &note(0, Some(2))).decision,
        Decision::YieldTo(2, Reason::Hint)
    );
}

#[test]
fn rule1_running_hint_is_boosted_only_when_configured() {
    let h = Hand::new(vec![
        running(0),
        running(0),
        snap(VcpuState::Halted, 0),
        preempted(true),
    ]);
    let kvm_like = policy();
    let o = kvm_like.decide(&h, &note(0, Some(1)));
    assert_eq!(o.hint, HintStatus::NotReady);
    assert_eq!(o.decision, Decision::YieldTo(3, Reason::Candidate));
    let trusting = DirectedYield::new(PolicyConfig {
        boost_running_hint: true,
        ..Default::default()
    })
    .unwrap();
    let o = trusting.decide(&h, &note(0, Some(1)));
    assert_eq!(
        (o.hint, o.decision),
        (HintStatus::Used, Decision::YieldTo(1, Reason::Hint))
    );
    // A halted vCPU without a kick is still not boosted.
    let o = trusting.decide(&h, &note(0, Some(2)));
    assert_eq!(o.hint, HintStatus::NotReady);
}

#[test]
fn rule1_bad_hints_fall_through_to_scan() {
    let p = policy();
    let h = Hand::new(vec![running(0), preempted(true), running(0)]);
    for (hint, status) in [
        (99, HintStatus::OutOfRange),
        (u32::MAX, HintStatus::OutOfRange),
        (0, HintStatus::SelfHint),
        (2, HintStatus::NotReady),
    ] {
        let o = p.decide(&h, &note(0, Some(hint)));
        assert_eq!(o.hint, status, "hint {hint}");
        assert_eq!(o.decision, Decision::YieldTo(1, Reason::Candidate));
    }
    let bad = p.bad_hints();
    assert_eq!(
        bad.out_of_range.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    assert_eq!(bad.self_hint.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[test]
fn rule1_hints_can_be_disabled() {
    let p = DirectedYield::new(PolicyConfig {
        use_hint: false,
        ..Default::default()
    })
    .unwrap();
    let h = Hand::new(vec![running(0), preempted(true), preempted(true)]);
    let o = p.decide(&h, &note(0, Some(2)));
    assert_eq!(o.hint, HintStatus::None);
    assert_eq!(o.decision, Decision::YieldTo(1, Reason::Candidate));
}

#[test]
fn rule1_hint_not_boosted_falls_through() {
    let p = policy();
    let h = Hand::new(vec![running(0), preempted(true), preempted(true)]);
    let o = p.decide_with(&h, &note(0, Some(2)), |t| {
        if t == 2 {
            BoostOutcome::NotBoosted
        } else {
            BoostOutcome::Boosted
        }
    });
    assert_eq!(o.hint, HintStatus::NotBoosted);
    assert_eq!(o.decision, Decision::YieldTo(1, Reason::Candidate));
}

#[test]
fn rule2_skip_self_even_when_self_looks_ready() {
    let p = policy();
    // The spinner's own word says preempted (stale); it must never be picked.
    let h = Hand::new(vec![preempted(true), running(0)]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldSelf(Reason::NoCandidate));
    assert_eq!(o.stats.running, 1);
}

#[test]
fn rule2_skip_running() {
    let p = policy();
    let h = Hand::new(vec![
        running(0),
        running(0),
        snap(VcpuState::InVmm, 0),
        preempted(true),
    ]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldTo(3, Reason::Candidate));
    assert_eq!(o.stats.running, 2);
}

#[test]
fn rule2_skip_halted_without_kick_take_halted_with_kick() {
    let p = policy();
    let h = Hand::new(vec![
        running(0),
        snap(VcpuState::Halted, 0),
        with(snap(VcpuState::Halted, 3), |p| p.kick = true),
    ]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldTo(2, Reason::Candidate));
    assert_eq!(o.stats.halted_no_kick, 1);
}

#[test]
fn rule2_skip_not_ready() {
    let p = policy();
    let h = Hand::new(vec![running(0), snap(VcpuState::Stopped, 0)]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldSelf(Reason::NoCandidate));
    assert_eq!(o.stats.not_ready, 1);
}

#[test]
fn rule2_parked_counts_as_preempted() {
    let b = VcpuBoard::new(3).unwrap();
    b.on_enter_run(0);
    b.on_exit(0, Some(0));
    b.on_exit(2, Some(0));
    b.park(2);
    let p = policy();
    assert_eq!(
        p.decide(&b, &note(0, None)).decision,
        Decision::YieldTo(2, Reason::Candidate)
    );
}

#[test]
fn rule2_kernel_mode_filter() {
    let p = policy();
    // Spinner in kernel: user-mode preempted vCPU 1 is skipped, kernel-mode 2 taken.
    let h = Hand::new(vec![running(0), preempted(false), preempted(true)]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldTo(2, Reason::Candidate));
    assert_eq!(o.stats.user_mode, 1);
    // Spinner in user mode: no filter, 1 is taken (round robin starts after 2 now).
    let h = Hand::new(vec![running(3), preempted(false), preempted(true)]);
    assert_eq!(
        p.decide(&h, &note(0, None)).decision,
        Decision::YieldTo(1, Reason::Candidate)
    );
}

#[test]
fn rule2_kernel_filter_exempts_pending_kick() {
    let p = policy();
    let h = Hand::new(vec![running(0), with(preempted(false), |p| p.kick = true)]);
    assert_eq!(
        p.decide(&h, &note(0, None)).decision,
        Decision::YieldTo(1, Reason::Candidate)
    );
}

#[test]
fn rule2_kernel_filter_can_be_disabled() {
    let p = DirectedYield::new(PolicyConfig {
        kernel_mode_filter: false,
        ..Default::default()
    })
    .unwrap();
    let h = Hand::new(vec![running(0), preempted(false)]);
    assert_eq!(
        p.decide(&h, &note(0, None)).decision,
        Decision::YieldTo(1, Reason::Candidate)
    );
}

#[test]
fn rule2_unknown_spinner_cpl_counts_as_kernel() {
    let p = policy();
    let me = VcpuSnapshot::new(VcpuState::InVmm, None, false, false, false, false, false);
    let h = Hand::new(vec![me, preempted(false)]);
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.stats.user_mode, 1);
}

#[test]
fn rule2_eligibility_alternates_for_spinning_candidates() {
    let p = policy();
    let spinning_preempted = with(preempted(true), |p| p.spinning = true);
    let h = Hand::new(vec![running(0), spinning_preempted]);
    // First look: not eligible (bit clear), bit flips to set.
    let o = p.decide(&h, &note(0, None));
    assert_eq!(o.decision, Decision::YieldSelf(Reason::NoCandidate));
    assert_eq!(o.stats.ineligible, 1);
    assert!(h.get(1).dy_eligible());
    // Second look: eligible, bit flips back.
    assert_eq!(
        p.decide(&h, &note(0, None)).decision,
        Decision::YieldTo(1, Reason::Candidate)
    );
    assert!(!h.get(1).dy_eligible());
    // A non-spinning candidate's bit is never touched.
    let h = Hand::new(vec![running(0), preempted(true)]);
    p.decide(&h, &note(0, None));
    assert!(!h.get(1).dy_eligible());
}

#[test]
fn rule2_spinner_marked_spinning_during_and_not_eligible_after() {
    let p = policy();
    let h = Hand::new(vec![
        with(running(0), |p| p.eligible = true),
        preempted(true),
    ]);
    let mut seen_spinning = false;
    p.decide_with(&h, &note(0, None), |_| {
        seen_spinning = h.get(0).is_spinning();
        BoostOutcome::Boosted
    });
    assert!(seen_spinning);
    assert!(!h.get(0).is_spinning());
    assert!(!h.get(0).dy_eligible());
}

#[test]
fn rule2_round_robin_stores_index_not_counter() {
    let p = policy();
    // 5 vCPUs, 1, 3 and 4 ready; spinner 2. Start after last_boosted (0): 1.
    let h = Hand::new(vec![
        running(0),
        preempted(true),
        running(0),
        preempted(true),
        preempted(true),
    ]);
    let picks: Vec<_> = (0..4)
        .map(|_| match p.decide(&h, &note(2, None)).decision {
            Decision::YieldTo(v, _) => v,
            d => panic!("{d:?}"),
        })
        .collect();
    // Storing the loop counter instead would give 1, 3 (i=1 stored -> start 2), 3, ...
    assert_eq!(picks, [1, 3, 4, 1]);
    assert_eq!(p.last_boosted(), 1);
}

#[test]
fn rule3_not_boosted_moves_on() {
    let p = policy();
    let h = Hand::new(vec![running(0), preempted(true), preempted(true)]);
    let o = p.decide_with(&h, &note(0, None), |t| {
        if t == 1 {
            BoostOutcome::NotBoosted
        } else {
            BoostOutcome::Boosted
        }
    });
    assert_eq!(o.decision, Decision::YieldTo(2, Reason::Candidate));
    assert_eq!(o.stats.not_boosted, 1);
}

#[test]
fn rule3_failures_are_bounded() {
    let p = policy();
    let mut v = vec![running(0)];
    v.extend((0..10).map(|_| preempted(true)));
    let h = Hand::new(v);
    let mut asked = 0;
    let o = p.decide_with(&h, &note(0, None), |_| {
        asked += 1;
        BoostOutcome::NothingElseRunnable
    });
    assert_eq!(o.decision, Decision::Nothing(Reason::FailuresExhausted));
    assert_eq!(asked, 3);
    assert_eq!(o.stats.failures, 3);
    // The hint's failure counts too.
    let mut asked = 0;
    let o = p.decide_with(&h, &note(0, Some(5)), |_| {
        asked += 1;
        BoostOutcome::NothingElseRunnable
    });
    assert_eq!(asked, 3);
    assert_eq!(o.decision, Decision::Nothing(Reason::FailuresExhausted));
}

#[test]
fn rule4_no_candidate_yield_self_or_nothing() {
    let h = Hand::new(vec![running(0), running(0)]);
    assert_eq!(
        policy().decide(&h, &note(0, None)).decision,
        Decision::YieldSelf(Reason::NoCandidate)
    );
    let p = DirectedYield::new(PolicyConfig {
        yield_self_when_no_candidate: false,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        p.decide(&h, &note(0, None)).decision,
        Decision::Nothing(Reason::NoCandidate)
    );
}

#[test]
fn steal_time_view_sees_host_preemption() {
    let b = VcpuBoard::new(2).unwrap();
    let mut mem = vec![0u8; 4096];
    b.on_exit(0, Some(0));
    b.on_exit(1, Some(0));
    b.on_enter_run(1);
    b.set_steal_time_gpa(1, Some(0x200));
    let p = policy();
    {
        let view = StealTimeView {
            board: &b,
            mem: mem.as_slice(),
        };
        assert_eq!(
            p.decide(&view, &note(0, None)).decision,
            Decision::YieldSelf(Reason::NoCandidate)
        );
    }
    mem[0x210] = 1;
    let view = StealTimeView {
        board: &b,
        mem: mem.as_slice(),
    };
    assert_eq!(
        p.decide(&view, &note(0, Some(1))).decision,
        Decision::YieldTo(1, Reason::Hint)
    );
}

#[test]
fn board_bitmap_scan_decides_like_a_full_scan() {
    // The same states as a board (ready bitmap) and as a hand view (every index examined):
    // every spinner, hint and round-robin position must give the same decision.
    let n = 150;
    let b = VcpuBoard::new(n).unwrap();
    for i in 0..n {
        b.on_exit(i, Some(if i % 7 == 0 { 3 } else { 0 }));
        match i % 9 {
            0 | 4 => b.park(i),
            1 => b.on_halt(i),
            2 => {
                b.on_halt(i);
                b.kick(i);
            }
            3 => {
                b.park(i);
                b.set_spinning(i, true);
            }
            5 => b.on_stop(i),
            _ => b.on_enter_run(i),
        }
    }
    let hand = Hand::new((0..n).map(|i| b.snapshot(i).unwrap()).collect());
    let pb = policy();
    let ph = policy();
    for round in 0..400usize {
        let spinner = (round * 37) % n;
        let hint = (round % 3 == 0).then_some(((round * 11) % (n + 5)) as u32);
        let nb = pb.decide(&b, &note(spinner, hint));
        let nh = ph.decide(&hand, &note(spinner, hint));
        assert_eq!(nb.decision, nh.decision, "round {round}");
        assert_eq!(nb.hint, nh.hint);
        assert!(nb.stats.examined <= nh.stats.examined);
    }
}

#[test]
fn concurrent_spinners_and_state_changes_keep_the_invariants() {
    // Four vCPU threads each alternate between changing their own state and deciding as a
    // spinner on one shared board and policy. Bounded: a fixed number of rounds. A fifth vCPU
    // stays preempted in kernel mode throughout, so every decision has a candidate however
    // the threads interleave (a loaded host may run them one after another).
    let n = 5;
    let threads_n = 4;
    let b = std::sync::Arc::new(VcpuBoard::new(n).unwrap());
    b.on_exit(4, Some(0));
    b.park(4);
    let p = std::sync::Arc::new(policy());
    let threads: Vec<_> = (0..threads_n)
        .map(|me| {
            let (b, p) = (b.clone(), p.clone());
            std::thread::spawn(move || {
                let mut yielded_to = 0u32;
                for round in 0..5_000usize {
                    b.on_exit(me, Some(if round % 3 == 0 { 3 } else { 0 }));
                    match (round + me) % 4 {
                        0 => b.park(me),
                        1 => {
                            b.unpark(me);
                            b.on_enter_run(me);
                        }
                        2 => b.on_halt(me),
                        _ => b.kick((me + 1) % threads_n),
                    }
                    b.on_exit(me, Some(0));
                    let o = p.decide(&*b, &note(me, Some((round % (n + 1)) as u32)));
                    if let Decision::YieldTo(t, _) = o.decision {
                        assert!(t < n && t != me);
                        yielded_to += 1;
                    }
                    assert!(p.last_boosted() < n);
                }
                yielded_to
            })
        })
        .collect();
    let total: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(
        total > 0,
        "some decision must have found a parked or kicked vCPU"
    );
}
