//! Arbitrary boards and spin notifications against the directed-yield policy.
//!
//! Invariants: the decision never names the spinner, a running vCPU, or an index out of
//! range; the booster is asked at most once per vCPU plus the hint and reports at most
//! `max_failures` failures; the spinner leaves with its spinning and eligibility bits clear;
//! the round-robin position stays in range; no more vCPUs are examined than the budget allows.
#![no_main]

use std::cell::Cell;

use libfuzzer_sys::fuzz_target;
use pvspin_track::{VcpuSnapshot, VcpuState};
use pvspin_yield::{
    BoostOutcome, Decision, DirectedYield, PolicyConfig, Reason, SpinNotification, VcpuView,
};

struct View(Vec<Cell<u32>>);

const SPINNING: u32 = 1 << 9;
const DY_ELIGIBLE: u32 = 1 << 10;

impl VcpuView for View {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn snapshot(&self, v: usize) -> VcpuSnapshot {
        VcpuSnapshot::from_raw(self.0[v].get())
    }
    fn set_spinning(&self, v: usize, s: bool) {
        let w = self.0[v].get();
        self.0[v].set(if s { w | SPINNING } else { w & !SPINNING });
    }
    fn set_dy_eligible(&self, v: usize, e: bool) {
        let w = self.0[v].get();
        self.0[v].set(if e { w | DY_ELIGIBLE } else { w & !DY_ELIGIBLE });
    }
    fn toggle_dy_eligible(&self, v: usize) -> bool {
        let w = self.0[v].get();
        self.0[v].set(w ^ DY_ELIGIBLE);
        w & DY_ELIGIBLE != 0
    }
}

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | (u16::from(self.u8()) << 8)
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | (u32::from(self.u16()) << 16)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let n = usize::from(b.u16() % 300);
    let flags = b.u8();
    let cfg = PolicyConfig {
        use_hint: flags & 1 != 0,
        kernel_mode_filter: flags & 2 != 0,
        yield_self_when_no_candidate: flags & 4 != 0,
        max_failures: u32::from(b.u8() % 5) + 1,
        scan_budget: match b.u8() {
            0 => u32::MAX,
            x => u32::from(x),
        },
        boost_running_hint: flags & 8 != 0,
    };
    let policy = DirectedYield::new(cfg).unwrap();
    let view = View((0..n).map(|_| Cell::new(b.u32())).collect());
    for _round in 0..4 {
        let spinner = usize::from(b.u16()) % (n + 2);
        let waiting_for = match b.u8() % 3 {
            0 => None,
            1 => Some(u32::from(b.u16()) % (n as u32 + 3)),
            _ => Some(b.u32()),
        };
        let note = SpinNotification {
            spinner,
            lock_id: u64::from(b.u32()),
            waiting_for,
            spun: u64::from(b.u32()),
        };
        let script = b.u32();
        let mut asked = 0usize;
        let mut failures = 0u32;
        let out = policy.decide_with(&view, &note, |t| {
            assert!(
                t < n && t != spinner,
                "asked about {t} (n {n}, spinner {spinner})"
            );
            // Only the hinted vCPU may be running, and only with boost_running_hint.
            let hinted = waiting_for == u32::try_from(t).ok();
            assert!(
                !view.snapshot(t).is_running() || (cfg.boost_running_hint && hinted),
                "asked about running {t}"
            );
            let r = match (script >> (asked % 16 * 2)) & 3 {
                0 => BoostOutcome::Boosted,
                1 => BoostOutcome::NotBoosted,
                _ => {
                    failures += 1;
                    BoostOutcome::NothingElseRunnable
                }
            };
            asked += 1;
            r
        });
        assert!(asked <= n + 1, "asked {asked} times for {n} vCPUs");
        assert!(failures <= cfg.max_failures);
        assert!(out.stats.examined <= cfg.scan_budget);
        assert!(out.stats.examined as usize <= n);
        assert_eq!(out.stats.failures, failures);
        if let Decision::YieldTo(t, reason) = out.decision {
            assert!(t < n && t != spinner);
            let hint_ok = cfg.boost_running_hint && reason == Reason::Hint;
            assert!(!view.snapshot(t).is_running() || hint_ok);
            assert!(
                view.snapshot(t).state() != VcpuState::Stopped || view.snapshot(t).is_preempted()
            );
        }
        if spinner < n && n >= 2 {
            let s = view.snapshot(spinner);
            assert!(!s.is_spinning() && !s.dy_eligible());
        }
        if n > 0 {
            assert!(policy.last_boosted() < n);
        }
    }
});
