//! The cost model: every time the simulator charges, in one struct, each with its source.
//!
//! `docs/benchmarks.md` is the repository's measured page; `kvm-on-these-machines.md` is the
//! project guide's probe report (the shared notes, not part of the repository), cited by
//! heading. Ranges are drawn uniformly per event from the seeded generator. Values marked
//! *calibrated* were fitted once to the 1x rows of the validation (`docs/simulator.md`) and
//! then left alone for every other cell; values marked *estimate* have no measurement here.
//!
//! The defaults are one host's (the AMD development machines). Another host is described by
//! overriding some of them by name ([`CostModel::set`], [`CostModel::apply`]; `pvspin-sim
//! --costs FILE` and `--cost NAME=VALUE`); `validation/intel-kvm-pvm.costs` is the Intel host's,
//! each value with the command that measured it.

use thiserror::Error;

/// A closed range of nanoseconds, drawn uniformly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Lowest value.
    pub lo: u64,
    /// Highest value.
    pub hi: u64,
}

impl Span {
    /// `lo..=hi` ns.
    pub const fn new(lo: u64, hi: u64) -> Self {
        Self { lo, hi }
    }

    /// Exactly `ns`.
    pub const fn fixed(ns: u64) -> Self {
        Self { lo: ns, hi: ns }
    }
}

/// What things cost on the simulated host (defaults: the development machines, guest user
/// mode, which runs natively there).
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Picoseconds per guest work unit (a 4-instruction loop iteration). Source:
    /// `docs/benchmarks.md`, "Run slots for guests that halt inside KVM, and stock guests", "cs/ncs 15000 (about 2.7 us each)": 2.7 us / 15000 = 180 ps.
    pub work_unit_ps: u64,
    /// From a release to the next owner running its critical section, when that owner spins
    /// on a CPU: the lock word's cache-line transfer and the workload's own bookkeeping per
    /// acquisition, per lock kind (ticket, TAS, queued, stock qspinlock). *Calibrated* on the
    /// 1x rows: `docs/benchmarks.md`, "Run slots for guests that halt inside KVM, and stock guests", "2 vCPUs, 0/2/4 hogs" 0 hogs (0.296 s for 80,000
    /// acquisitions of 2.7 us = 1.0 us over the critical section each) and "Two vCPUs at 1x, 2x, 3x"'s 1x rows
    /// (the MCS lock 10-17% slower than the ticket lock per acquisition).
    pub handoff_ns: [u64; 4],
    /// Taking a free lock without contention (one atomic on a local cache line). *Estimate.*
    pub uncontended_ns: u64,
    /// A WAIT from guest user mode: the exit to the VMM and back into `KVM_RUN`, paid by the
    /// waiter before it blocks. A forced exit (the slot policy's signal, once it lands) costs
    /// the vCPU the same: `KVM_RUN` returns to the VMM from guest user mode. Source: kvm-on-these-machines.md, "Guest user mode (CPL 3) runs natively", "`out` → userspace exit
    /// and back, from CPL 3 (quiet): 36-48 us".
    pub wait_exit: Span,
    /// The kicker's cost on the in-kernel path (an `out` matched by an ioeventfd, no exit).
    /// Source: kvm-on-these-machines.md, "Guest user mode (CPL 3) runs natively", "`out` → ioeventfd from CPL 3: 3.7-5.1 us".
    pub kick_in_kernel: Span,
    /// The kicker's cost on the signal-msi and userspace paths (a userspace exit). Source:
    /// kvm-on-these-machines.md, "Guest user mode (CPL 3) runs natively", 36-48 us.
    pub kick_exit: Span,
    /// Kick to woken guest, p50, per path (in-kernel, signal-msi, userspace), on an idle CPU.
    /// Source: `docs/benchmarks.md`, "Kick-to-wake at native speed, per path" (16.7, 27.8, 43.0
    /// us). The ping-pong's waiter halts in KVM on an otherwise idle CPU and is woken within
    /// KVM's poll window on the two irqchip paths, so those two include no context switch;
    /// the userspace path parks the thread in the VMM, so its 43 us include one. The simulator
    /// splits each into the wake-up (the thread becomes runnable), the switch onto a CPU
    /// ([`CostModel::context_switch_ns`], unless the halt was still polling) and
    /// [`CostModel::resume_ns`] of CPU.
    pub kick_to_wake_ns: [u64; 3],
    /// Whether each path's [`CostModel::kick_to_wake_ns`] includes a context switch (the
    /// userspace path's park; the two irqchip paths were measured polled).
    pub kick_to_wake_switched: [bool; 3],
    /// How much one kick-to-wake varies, in percent of the path's p50
    /// ([`CostModel::kick_to_wake_ns`]): each wake-up takes a uniform draw within
    /// `p50 * (1 +- pct/100)`. 0 (the default): every wake-up takes exactly the p50, so
    /// vCPUs that hand a lock over by kicks can stay in lock step. The hosts' spread is wide:
    /// `pvspin-vmm run --workload pingpong` on the AMD host of source K, in-kernel p50
    /// 24.7-26.5 us, p90 38.2-38.8, min 2.8-13.8; a uniform draw within +-50% has its p90
    /// at 1.4x the p50 (docs/simulator.md, "Source K").
    pub kick_to_wake_jitter_pct: u64,
    /// KVM's halt-polling limit and the window's first step (`halt_poll_ns`,
    /// `halt_poll_ns_grow_start`). Source: kvm-on-these-machines.md, "KVM_CAP_HALT_POLL":
    /// module defaults 200000 and 10000 ns, grow 2, shrink 2 (the VMM keeps the host's).
    pub halt_poll_max_ns: u64,
    /// See [`CostModel::halt_poll_max_ns`].
    pub halt_poll_grow_start_ns: u64,
    /// CPU a woken vCPU thread spends before its guest runs again (`KVM_RUN` entry). Source:
    /// kvm-on-these-machines.md, "E4: exit costs", "`KVM_RUN` with immediate_exit preset: 5.0-5.2 us".
    pub resume_ns: u64,
    /// From the interrupter's signal to its landing on a vCPU that runs on a CPU (the guest
    /// runs on meanwhile; then it pays [`CostModel::wait_exit`]). Source:
    /// kvm-on-these-machines.md, "E5: forcing a vCPU out of KVM_RUN", p50 of the spinning and halted rows: 17.5-25.5 us.
    pub forced_exit: Span,
    /// From a run-slot grant to the granted vCPU's guest running on an idle CPU (a futex wake
    /// of a thread parked on a condition variable, its switch in and its `KVM_RUN` entry).
    /// Source: kvm-on-these-machines.md, "E2/E3: HLT and hypercalls", "user (futex)"
    /// kick-to-wake p50 33-49 us, less the kicker's exit (about 20 us of it): 15 us. The
    /// simulator charges the switch and the resume on the CPU and the rest as the wake-up.
    pub slot_wake_ns: u64,
    /// The halt watcher's read of one vCPU's `blocking` statistic (one 8-byte `pread`).
    /// Source: `docs/benchmarks.md`, "How the VMM sees a halt inside KVM": 270-300 ns.
    pub halt_probe_ns: u64,
    /// One `pause` iteration of a spin loop at native speed. Source: kvm-on-these-machines.md,
    /// "Guest user mode (CPL 3) runs natively", "one `pause; dec; jnz` about 26-30 ns".
    pub pause_ns: u64,
    /// The stock guest's spins before it halts (Linux's `SPIN_THRESHOLD`, `1 << 15`).
    pub stock_spin_threshold: u64,
    /// The backoff lock's unit bounds, in spins: `HandoverEstimate::MIN_SPINS` and
    /// `MAX_SPINS` of `pvspin-guest` (1 and 1024), each spin [`CostModel::pause_ns`].
    pub backoff_unit_spins: (u64, u64),
    /// How long a directed-yield boost lasts at most. Source: `pvspin-vmm --help`, "--actuator
    /// nice: nice -10 boost of the waited-for vCPU's thread for at most 2 ms".
    pub boost_ns: u64,
    /// The boosted thread's CFS weight: nice -10 (Linux `sched_prio_to_weight[10]` = 9548).
    pub boost_weight: u32,
    /// The host scheduler tick. Fedora's kernel configuration: `CONFIG_HZ=1000`.
    pub tick_ns: u64,
    /// CFS minimum granularity before scaling: 0.75 ms (`sysctl_sched_min_granularity`, and
    /// EEVDF's `sysctl_sched_base_slice`), times `1 + ilog2(min(cpus, 8))` as the kernel does.
    pub min_granularity_ns: u64,
    /// Latency target before scaling: a slice is `max(latency / nr_running, min_granularity)`.
    /// CFS's `sysctl_sched_latency` was 6 ms; the hosts here run Linux 6.18, whose EEVDF gives
    /// every task the base slice whatever the queue length, so the default is the base slice
    /// (0.75 ms), which makes every slice the minimum granularity. With 6 ms the validation
    /// moved by at most 0.3x per cell, 33 instead of 31 of 63 cells in range
    /// (`docs/simulator.md`).
    pub latency_ns: u64,
    /// CFS wake-up preemption granularity before scaling: 1 ms (`sysctl_sched_wakeup_granularity`).
    pub wakeup_granularity_ns: u64,
    /// EEVDF's wake-up rule beside CFS's granularity (1: on, 0: off): a thread that wakes also
    /// preempts a running thread that has used up its protected slice (the base slice,
    /// [`CostModel::min_granularity_ns`] scaled, of CPU consumed since its slice began, across
    /// preemptions within it; a wake-up from sleep begins a new one) and whose virtual
    /// deadline is later. Linux 6.6 and later, the hosts here (6.18), do this at the
    /// wake-up; CFS left such a thread running until the next tick, 4 ms at `HZ=250`.
    pub wakeup_after_slice: u64,
    /// How long after it last ran a queued thread is cache-hot, which an idle CPU does not
    /// pull at once (Linux's `sysctl_sched_migration_cost`, 0.5 ms; its newly idle balance
    /// skips such threads): a CPU left with nothing to run pulls the leftmost thread of the
    /// busiest queue that last ran at least this long ago, else stays idle until a wake-up or
    /// the next balance (every [`CostModel::balance_ns`]). 0, the default, pulls any thread at
    /// once, what the model always did. The hosts here stand idle: with 8 vCPUs on 2 CPUs a
    /// CPU stood idle 57 times in 0.94 s while a vCPU thread waited on the other CPU, 0.2 s in
    /// all, 3.7 ms at the median, up to 12 ms (`perf sched record`, docs/simulator.md,
    /// "Source K").
    pub migration_cost_ns: u64,
    /// Switching a vCPU thread onto a host CPU (from another thread or from idle), before its
    /// guest runs: the scheduler's switch and KVM's `vcpu_load` on this nested host. Source:
    /// `docs/benchmarks.md`, "Kick-to-wake latency, side by side with the C probe", pvspin p50
    /// without and with halt polling of 200 us: in-kernel 21.7 and 12.5 us, signal-msi 25.9
    /// and 16.8 us; a polled halt never leaves its CPU, an unpolled one is switched out and
    /// back in: 9.2 and 9.1 us. The same order as "pvspind at parity"'s `perf` of the daemon's
    /// worker (46% of 19 us per kick in `finish_task_switch`, about 8.7 us a switch).
    pub context_switch_ns: u64,
    /// How much one critical or non-critical section's length varies, in percent of its
    /// nominal length: each lasts a uniform draw within `nominal * (1 +- pct/100)`, so the mean
    /// stays. 0 (the default): every section lasts exactly its nominal time, as the AMD
    /// validation assumed. Real sections vary with the cache, interrupts and the other CPU's
    /// load; without it two vCPUs that alternate on a lock stay in lock step forever.
    pub work_jitter_pct: u64,
    /// How often idle and busy CPUs balance their run queues. Linux balances busy CPUs every
    /// few ticks; *estimate*: 4 ms.
    pub balance_ns: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            work_unit_ps: 180,
            handoff_ns: [1_000, 700, 1_200, 1_200],
            uncontended_ns: 40,
            wait_exit: Span::new(36_000, 48_000),
            kick_in_kernel: Span::new(3_700, 5_100),
            kick_exit: Span::new(36_000, 48_000),
            kick_to_wake_ns: [16_700, 27_800, 43_000],
            kick_to_wake_switched: [false, false, true],
            kick_to_wake_jitter_pct: 0,
            halt_poll_max_ns: 200_000,
            halt_poll_grow_start_ns: 10_000,
            resume_ns: 5_000,
            forced_exit: Span::new(17_500, 25_500),
            slot_wake_ns: 15_000,
            halt_probe_ns: 300,
            pause_ns: 28,
            stock_spin_threshold: 1 << 15,
            backoff_unit_spins: (1, 1024),
            boost_ns: 2_000_000,
            boost_weight: 9548,
            tick_ns: 1_000_000,
            min_granularity_ns: 750_000,
            latency_ns: 750_000,
            wakeup_granularity_ns: 1_000_000,
            wakeup_after_slice: 0,
            migration_cost_ns: 0,
            context_switch_ns: 9_200,
            balance_ns: 4_000_000,
            work_jitter_pct: 0,
        }
    }
}

/// A cost override the model cannot take; each names the rule.
#[derive(Debug, Error)]
pub enum CostError {
    /// Rule: an override is `name = value` (a file: one per line, `#` starts a comment).
    #[error("rule: a cost override is `name = value`, got {0:?}")]
    Syntax(String),
    /// Rule: the name is one of [`CostModel::NAMES`].
    #[error("rule: no cost is named {0:?}; the names are {names}", names = CostModel::NAMES.join(", "))]
    Unknown(String),
    /// Rule: a value is a whole number of the field's unit, or `lo..hi` with lo <= hi for a
    /// range.
    #[error("rule: {name} takes {expects}, got {value:?}")]
    Value {
        /// The cost's name.
        name: String,
        /// What it takes.
        expects: &'static str,
        /// What it got.
        value: String,
    },
    /// Rule: a cost file is readable.
    #[error("cost file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// Rule: every line of a cost file is an override the model takes.
    #[error("line {line}: {source}")]
    Line {
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        source: Box<CostError>,
    },
}

impl CostModel {
    /// The names [`CostModel::set`] takes: the fields, with the per-lock and per-path tables
    /// named by their entry (`handoff_ns.ticket`, `kick_to_wake_ns.signal_msi`).
    pub const NAMES: &'static [&'static str] = &[
        "work_unit_ps",
        "handoff_ns.ticket",
        "handoff_ns.tas",
        "handoff_ns.queued",
        "handoff_ns.stock",
        "uncontended_ns",
        "wait_exit",
        "kick_in_kernel",
        "kick_exit",
        "kick_to_wake_ns.in_kernel",
        "kick_to_wake_ns.signal_msi",
        "kick_to_wake_ns.userspace",
        "kick_to_wake_jitter_pct",
        "halt_poll_max_ns",
        "halt_poll_grow_start_ns",
        "resume_ns",
        "forced_exit",
        "slot_wake_ns",
        "halt_probe_ns",
        "pause_ns",
        "stock_spin_threshold",
        "boost_ns",
        "tick_ns",
        "min_granularity_ns",
        "latency_ns",
        "wakeup_granularity_ns",
        "wakeup_after_slice",
        "migration_cost_ns",
        "context_switch_ns",
        "balance_ns",
        "work_jitter_pct",
    ];

    /// Sets one cost by name ([`CostModel::NAMES`]): a whole number (above 0 for
    /// `work_unit_ps`, `tick_ns` and `balance_ns`; at most 100 for `work_jitter_pct`), or for the drawn ranges
    /// (`wait_exit`, `kick_in_kernel`, `kick_exit`, `forced_exit`) `lo..hi` or one number.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), CostError> {
        let value = value.trim();
        let bad = |expects: &'static str| CostError::Value {
            name: name.to_string(),
            expects,
            value: value.to_string(),
        };
        let num = || -> Result<u64, CostError> {
            value
                .replace('_', "")
                .parse()
                .map_err(|_| bad("a whole number"))
        };
        // A cost the model divides by or steps with: zero would stall or skip it.
        let positive = || -> Result<u64, CostError> {
            num().and_then(|n| {
                if n == 0 {
                    Err(bad("a whole number above 0"))
                } else {
                    Ok(n)
                }
            })
        };
        // A bounded whole number: a switch (0 or 1) or a percent.
        let at_most = |max: u64, expects: &'static str| -> Result<u64, CostError> {
            num().and_then(|n| if n > max { Err(bad(expects)) } else { Ok(n) })
        };
        let span = || -> Result<Span, CostError> {
            let expects = "a whole number or lo..hi with lo <= hi";
            let n = |s: &str| s.trim().replace('_', "").parse::<u64>();
            match value.split_once("..") {
                None => n(value).map(Span::fixed).map_err(|_| bad(expects)),
                Some((lo, hi)) => match (n(lo), n(hi)) {
                    (Ok(lo), Ok(hi)) if lo <= hi => Ok(Span::new(lo, hi)),
                    _ => Err(bad(expects)),
                },
            }
        };
        match name {
            "work_unit_ps" => self.work_unit_ps = positive()?,
            "handoff_ns.ticket" => self.handoff_ns[0] = num()?,
            "handoff_ns.tas" => self.handoff_ns[1] = num()?,
            "handoff_ns.queued" => self.handoff_ns[2] = num()?,
            "handoff_ns.stock" => self.handoff_ns[3] = num()?,
            "uncontended_ns" => self.uncontended_ns = num()?,
            "wait_exit" => self.wait_exit = span()?,
            "kick_in_kernel" => self.kick_in_kernel = span()?,
            "kick_exit" => self.kick_exit = span()?,
            "kick_to_wake_ns.in_kernel" => self.kick_to_wake_ns[0] = num()?,
            "kick_to_wake_ns.signal_msi" => self.kick_to_wake_ns[1] = num()?,
            "kick_to_wake_ns.userspace" => self.kick_to_wake_ns[2] = num()?,
            "kick_to_wake_jitter_pct" => {
                self.kick_to_wake_jitter_pct = at_most(100, "a whole percent from 0 to 100")?;
            }
            "halt_poll_max_ns" => self.halt_poll_max_ns = num()?,
            "halt_poll_grow_start_ns" => self.halt_poll_grow_start_ns = num()?,
            "resume_ns" => self.resume_ns = num()?,
            "forced_exit" => self.forced_exit = span()?,
            "slot_wake_ns" => self.slot_wake_ns = num()?,
            "halt_probe_ns" => self.halt_probe_ns = num()?,
            "pause_ns" => self.pause_ns = num()?,
            "stock_spin_threshold" => self.stock_spin_threshold = num()?,
            "boost_ns" => self.boost_ns = num()?,
            "tick_ns" => self.tick_ns = positive()?,
            "min_granularity_ns" => self.min_granularity_ns = num()?,
            "latency_ns" => self.latency_ns = num()?,
            "wakeup_granularity_ns" => self.wakeup_granularity_ns = num()?,
            "wakeup_after_slice" => self.wakeup_after_slice = at_most(1, "0 (off) or 1 (on)")?,
            "migration_cost_ns" => self.migration_cost_ns = num()?,
            "context_switch_ns" => self.context_switch_ns = num()?,
            "balance_ns" => self.balance_ns = positive()?,
            "work_jitter_pct" => {
                self.work_jitter_pct = at_most(100, "a whole percent from 0 to 100")?;
            }
            _ => return Err(CostError::Unknown(name.to_string())),
        }
        Ok(())
    }

    /// Applies one `name = value` override (`name=value` on the command line).
    pub fn apply_one(&mut self, line: &str) -> Result<(), CostError> {
        let (name, value) = line
            .split_once('=')
            .ok_or_else(|| CostError::Syntax(line.to_string()))?;
        let name = name.trim();
        if name.is_empty() || value.trim().is_empty() {
            return Err(CostError::Syntax(line.to_string()));
        }
        self.set(name, value)
    }

    /// Applies a cost file: one `name = value` per line; blank lines and `#` comments
    /// (whole-line or after the value) are skipped. A bad line is named and nothing of the
    /// file is applied.
    pub fn apply(&mut self, text: &str) -> Result<(), CostError> {
        let mut next = self.clone();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            next.apply_one(line).map_err(|e| CostError::Line {
                line: n + 1,
                source: Box::new(e),
            })?;
        }
        *self = next;
        Ok(())
    }

    /// Reads and applies a cost file ([`CostModel::apply`]); an error names the line, and the
    /// caller the file.
    pub fn apply_file(&mut self, path: &str) -> Result<(), CostError> {
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Read {
            path: path.to_string(),
            source,
        })?;
        self.apply(&text)
    }

    /// The kernel's tunable scaling factor for `cpus` CPUs: `1 + ilog2(min(cpus, 8))`.
    pub fn sched_factor(cpus: usize) -> u64 {
        let c = cpus.clamp(1, 8) as u64;
        1 + u64::from(c.ilog2())
    }

    /// Nanoseconds of `units` guest work units.
    pub fn work_ns(&self, units: u64) -> u64 {
        units.saturating_mul(self.work_unit_ps) / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_numbers_hold() {
        let c = CostModel::default();
        assert_eq!(c.work_ns(15_000), 2_700, "15000 units are about 2.7 us");
        assert_eq!(CostModel::sched_factor(2), 2);
        assert_eq!(CostModel::sched_factor(1), 1);
        assert_eq!(CostModel::sched_factor(256), 4);
        assert!(c.wait_exit.lo <= c.wait_exit.hi);
    }

    #[test]
    fn every_name_is_settable_and_sets_its_field() {
        for name in CostModel::NAMES {
            let mut c = CostModel::default();
            // A switch takes 0 or 1 (its default 0).
            let value = if *name == "wakeup_after_slice" {
                "1"
            } else {
                "7"
            };
            c.set(name, value).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_ne!(c, CostModel::default(), "{name} changed nothing");
        }
    }

    #[test]
    fn a_cost_file_overrides_by_name_and_keeps_the_rest() {
        let mut c = CostModel::default();
        c.apply(
            "# the Intel host\n\nwork_unit_ps = 500  # burn\nkick_to_wake_ns.signal_msi = 24_900\nwait_exit = 40000..52000\nforced_exit = 20000\n",
        )
        .unwrap();
        let mut want = CostModel {
            work_unit_ps: 500,
            wait_exit: Span::new(40_000, 52_000),
            forced_exit: Span::fixed(20_000),
            ..CostModel::default()
        };
        want.kick_to_wake_ns[1] = 24_900;
        assert_eq!(c, want);
    }

    #[test]
    fn a_bad_override_is_refused_by_rule_and_changes_nothing() {
        let mut c = CostModel::default();
        let e = c.apply_one("work_unit_ps 500").unwrap_err();
        assert!(matches!(e, CostError::Syntax(_)), "{e}");
        let e = c.apply_one("work_unit = 500").unwrap_err();
        assert!(matches!(e, CostError::Unknown(_)), "{e}");
        assert!(
            e.to_string().contains("work_unit_ps"),
            "the names are listed: {e}"
        );
        let e = c.apply_one("work_unit_ps = -3").unwrap_err();
        assert!(matches!(e, CostError::Value { .. }), "{e}");
        let e = c.apply_one("tick_ns = 0").unwrap_err();
        assert!(e.to_string().contains("above 0"), "{e}");
        let e = c.apply_one("wakeup_after_slice = 2").unwrap_err();
        assert!(e.to_string().contains("0 (off) or 1 (on)"), "{e}");
        let e = c.apply_one("work_jitter_pct = 101").unwrap_err();
        assert!(e.to_string().contains("0 to 100"), "{e}");
        let e = c.apply_one("wait_exit = 9..3").unwrap_err();
        assert!(e.to_string().contains("lo <= hi"), "{e}");
        let e = c.apply("resume_ns = 1\nnope = 2\n").unwrap_err();
        assert!(matches!(e, CostError::Line { line: 2, .. }), "{e}");
        assert_eq!(c, CostModel::default(), "nothing of a bad file applies");
        let e = c.apply_file("/nonexistent/x.costs").unwrap_err();
        assert!(matches!(e, CostError::Read { .. }), "{e}");
    }
}
