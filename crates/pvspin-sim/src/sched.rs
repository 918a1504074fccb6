//! The host scheduler: a CFS-like fair scheduler per host CPU.
//!
//! Each CPU has a run queue ordered by virtual deadline, EEVDF's order: virtual runtime (ns of
//! CPU weighted by `1024 / weight`) plus the base slice weighted the same way, so equal weights
//! run in virtual-runtime order and a boosted (heavier) thread comes first. The running thread is charged at every tick (`CostModel::tick_ns`) and at every
//! switch; at a tick it yields its CPU once it ran its slice, `max(latency / nr_running,
//! min_granularity)`, to the leftmost queued thread. A thread that wakes is placed at
//! `max(its vruntime, min_vruntime - latency / 2)` (the sleeper credit of
//! `GENTLE_FAIR_SLEEPERS`) on its previous CPU if idle, else on an idle CPU, else on its
//! previous CPU (its vruntime made relative to the new CPU's `min_vruntime` when it moves, as
//! on every migration), and preempts the running thread when that one's vruntime is ahead by
//! more than the wake-up granularity. An idle CPU pulls the leftmost thread of the busiest queue
//! that is not cache-hot (`CostModel::migration_cost_ns`; by default any) when it falls idle
//! and at the tick of a CPU with threads queued (the nohz idle balance); every `balance_ns`
//! the busiest and idlest CPUs are evened out.
//!
//! cgroup CPU quota: the threads of a VM with a CPU limit share one group; once the group ran
//! its quota within a period, every member is throttled (taken off its CPU and queue) until
//! the period ends. Group scheduling's hierarchical weights are not modelled: every thread
//! has its own weight, as when VMs and hogs share one cgroup.

use std::collections::BTreeSet;

use crate::engine::{Ev, Sim};

/// A thread's scheduling state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TState {
    /// On a CPU.
    Running,
    /// In a run queue.
    Queued,
    /// Asleep.
    Blocked,
    /// Runnable, held by its group's quota.
    Throttled,
}

/// One host thread (a vCPU thread or a hog).
#[derive(Clone, Debug)]
pub(crate) struct Thread {
    pub(crate) weight: u32,
    pub(crate) vruntime: u64,
    pub(crate) cpu: u32,
    pub(crate) state: TState,
    pub(crate) exec_start: u64,
    pub(crate) slice_start: u64,
    /// CPU consumed in its current EEVDF slice ([`crate::CostModel::wakeup_after_slice`]): it
    /// runs protected until that reaches the base slice, across preemptions within the
    /// slice; a wake-up from sleep starts a new slice.
    pub(crate) slice_cpu: u64,
    pub(crate) group: Option<u32>,
    /// Its run-queue key while queued (virtual deadline).
    pub(crate) key: u64,
    /// CPU time received, ns.
    pub(crate) cpu_ns: u64,
}

impl Thread {
    pub(crate) fn new(group: Option<u32>, cpu: u32) -> Self {
        Self {
            weight: 1024,
            vruntime: 0,
            cpu,
            state: TState::Blocked,
            exec_start: 0,
            slice_start: 0,
            slice_cpu: 0,
            group,
            key: 0,
            cpu_ns: 0,
        }
    }
}

/// One host CPU: `rq` holds (virtual deadline, thread).
#[derive(Clone, Debug, Default)]
pub(crate) struct Cpu {
    pub(crate) curr: Option<u32>,
    pub(crate) rq: BTreeSet<(u64, u32)>,
    pub(crate) min_vruntime: u64,
    pub(crate) tick_armed: bool,
    /// This CPU's tick phase: ticks fire when `(now + phase) % tick_ns == 0`.
    pub(crate) tick_phase: u64,
    /// The thread that ran here last, until the CPU went idle: dispatching it again is no
    /// context switch (a thread preempted and picked again at once).
    pub(crate) last: Option<u32>,
}

/// A cgroup with a CPU quota.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    pub(crate) quota: u64,
    pub(crate) period: u64,
    pub(crate) used: u64,
    pub(crate) throttled: bool,
    pub(crate) members: Vec<u32>,
    /// Periods in which the group was throttled.
    pub(crate) throttled_periods: u64,
}

impl Group {
    pub(crate) fn new(quota: u64, period: u64) -> Self {
        Self {
            quota,
            period,
            used: 0,
            throttled: false,
            members: Vec::new(),
            throttled_periods: 0,
        }
    }
}

impl Sim {
    /// Thread `tid` becomes runnable.
    pub(crate) fn make_runnable(&mut self, tid: u32) {
        let t = &self.threads[tid as usize];
        if t.state != TState::Blocked {
            return;
        }
        if let Some(g) = t.group {
            if self.groups[g as usize].throttled {
                self.threads[tid as usize].state = TState::Throttled;
                return;
            }
        }
        let prev = t.cpu;
        self.threads[tid as usize].slice_cpu = 0;
        let cpu = if self.cpus[prev as usize].curr.is_none() {
            prev
        } else {
            self.idle
                .range(prev..)
                .next()
                .or_else(|| self.idle.iter().next())
                .copied()
                .unwrap_or(prev)
        };
        // Woken onto another CPU: its vruntime, relative to the old queue's, is made relative
        // to the new one's, as the kernel does when a task migrates (as pulls and balancing do
        // here); else a thread that ran on a busier queue would wait behind a hog far longer.
        let vr = self.threads[tid as usize].vruntime;
        let vr = if cpu == prev {
            vr
        } else {
            vr - self.cpus[prev as usize].min_vruntime.min(vr)
                + self.cpus[cpu as usize].min_vruntime
        };
        let credit = self.cpus[cpu as usize]
            .min_vruntime
            .saturating_sub(self.latency / 2);
        let t = &mut self.threads[tid as usize];
        t.vruntime = vr.max(credit);
        t.cpu = cpu;
        self.enqueue(cpu, tid, true);
    }

    /// Puts `tid` on `cpu`: runs it if the CPU is idle, else queues it (and preempts the
    /// running thread when `wakeup` and it is far enough ahead).
    fn enqueue(&mut self, cpu: u32, tid: u32, wakeup: bool) {
        self.threads[tid as usize].cpu = cpu;
        if self.cpus[cpu as usize].curr.is_none() {
            self.run_on(cpu, tid);
            return;
        }
        self.threads[tid as usize].state = TState::Queued;
        self.rq_insert(cpu, tid);
        if wakeup {
            let before = self.cpus[cpu as usize].curr;
            let onto_vcpu = before.is_some_and(|c| self.is_vcpu(c)) && self.is_vcpu(tid);
            self.check_preempt(cpu, tid);
            if onto_vcpu {
                self.wakeups_onto_vcpu.0 += 1;
                if self.cpus[cpu as usize].curr != before {
                    self.wakeups_onto_vcpu.1 += 1;
                }
            }
        }
    }

    /// Queues `tid` on `cpu` under its virtual deadline.
    fn rq_insert(&mut self, cpu: u32, tid: u32) {
        let t = &mut self.threads[tid as usize];
        t.key = t.vruntime + self.min_gran * 1024 / u64::from(t.weight);
        let key = t.key;
        self.cpus[cpu as usize].rq.insert((key, tid));
        self.queued_total += 1;
    }

    /// Wake-up preemption: the running thread leaves if `tid` is ahead by the granularity.
    fn check_preempt(&mut self, cpu: u32, tid: u32) {
        self.account(cpu);
        let Some(curr) = self.cpus[cpu as usize].curr else {
            return;
        };
        let c = &self.threads[curr as usize];
        let curr_key = c.vruntime + self.min_gran * 1024 / u64::from(c.weight);
        let woken_key = self.threads[tid as usize].key;
        // EEVDF: past its protected slice (CPU consumed since its slice began, across
        // preemptions) the running thread yields to an earlier deadline, and its next run
        // starts a new slice.
        let slice_used = self.cost.wakeup_after_slice != 0 && c.slice_cpu >= self.min_gran;
        if slice_used && curr_key > woken_key {
            self.threads[curr as usize].slice_cpu = 0;
            self.preempt_curr(cpu);
        } else if curr_key > woken_key + self.wakeup_gran {
            self.preempt_curr(cpu);
        }
    }

    /// Removes a queued thread from its run queue.
    pub(crate) fn dequeue(&mut self, tid: u32) {
        let t = &self.threads[tid as usize];
        if t.state == TState::Queued && self.cpus[t.cpu as usize].rq.remove(&(t.key, tid)) {
            self.queued_total -= 1;
        }
    }

    fn run_on(&mut self, cpu: u32, tid: u32) {
        let now = self.now;
        let c = &mut self.cpus[cpu as usize];
        c.curr = Some(tid);
        let switched = c.last.replace(tid) != Some(tid);
        self.idle.remove(&cpu);
        let arm = !c.tick_armed;
        c.tick_armed = true;
        let t = &mut self.threads[tid as usize];
        t.state = TState::Running;
        t.cpu = cpu;
        t.exec_start = now;
        t.slice_start = now;
        if arm {
            let t = self.next_tick(cpu);
            self.at(t, Ev::Tick(cpu));
        }
        if self.is_vcpu(tid) {
            self.vcpu_dispatched(tid, switched);
        } else if let Some(m) = self.watcher_vm(tid) {
            self.watcher_dispatched(m, switched);
        }
    }

    /// Charges the running thread of `cpu` up to now.
    pub(crate) fn account(&mut self, cpu: u32) {
        let now = self.now;
        let Some(curr) = self.cpus[cpu as usize].curr else {
            return;
        };
        let t = &mut self.threads[curr as usize];
        let delta = now.saturating_sub(t.exec_start);
        t.exec_start = now;
        t.cpu_ns += delta;
        t.slice_cpu += delta;
        t.vruntime += delta * 1024 / u64::from(t.weight);
        let vr = t.vruntime;
        if let Some(g) = t.group {
            self.groups[g as usize].used += delta;
        }
        let first = self.cpus[cpu as usize]
            .rq
            .first()
            .map_or(vr, |&(_, t)| self.threads[t as usize].vruntime);
        let c = &mut self.cpus[cpu as usize];
        c.min_vruntime = c.min_vruntime.max(first.min(vr));
    }

    /// Takes the running thread off `cpu` (the caller sets its new state).
    pub(crate) fn stop_running(&mut self, cpu: u32) -> Option<u32> {
        self.account(cpu);
        let curr = self.cpus[cpu as usize].curr.take()?;
        if self.is_vcpu(curr) {
            self.vcpu_descheduled(curr);
        } else if let Some(m) = self.watcher_vm(curr) {
            self.watcher_descheduled(m);
        }
        Some(curr)
    }

    pub(crate) fn preempt_curr(&mut self, cpu: u32) {
        if let Some(curr) = self.stop_running(cpu) {
            self.threads[curr as usize].state = TState::Queued;
            self.rq_insert(cpu, curr);
        }
        self.pick_next(cpu);
    }

    /// `cpu` has nothing running: the leftmost queued thread, else one pulled from the
    /// busiest CPU (the leftmost not cache-hot, [`crate::CostModel::migration_cost_ns`]),
    /// else idle.
    pub(crate) fn pick_next(&mut self, cpu: u32) {
        if let Some((_, tid)) = self.cpus[cpu as usize].rq.pop_first() {
            self.queued_total -= 1;
            self.run_on(cpu, tid);
            return;
        }
        if self.queued_total > 0 {
            let busiest = (0..self.cpus.len())
                .max_by_key(|&c| (self.cpus[c].rq.len(), std::cmp::Reverse(c)))
                .filter(|&c| !self.cpus[c].rq.is_empty());
            // A queued thread's `exec_start` is when it last ran.
            let hot = self.cost.migration_cost_ns;
            let cold = |t: &Thread| self.now.saturating_sub(t.exec_start) >= hot;
            let pick = busiest.and_then(|src| {
                self.cpus[src]
                    .rq
                    .iter()
                    .find(|&&(_, t)| cold(&self.threads[t as usize]))
                    .map(|&entry| (src, entry))
            });
            if let Some((src, entry)) = pick {
                self.cpus[src].rq.remove(&entry);
                self.queued_total -= 1;
                let tid = entry.1;
                let t = &mut self.threads[tid as usize];
                let vr = t.vruntime;
                t.vruntime =
                    vr - self.cpus[src].min_vruntime.min(vr) + self.cpus[cpu as usize].min_vruntime;
                self.run_on(cpu, tid);
                return;
            }
        }
        self.idle.insert(cpu);
        // The idle task runs: the next thread here is switched in.
        self.cpus[cpu as usize].last = None;
    }

    /// The scheduler tick of `cpu`.
    pub(crate) fn tick(&mut self, cpu: u32) {
        self.cpus[cpu as usize].tick_armed = false;
        let Some(curr) = self.cpus[cpu as usize].curr else {
            return;
        };
        self.account(cpu);
        if let Some(g) = self.threads[curr as usize].group {
            let gr = &self.groups[g as usize];
            if !gr.throttled && gr.used >= gr.quota {
                self.throttle(g);
            }
        }
        if self.cpus[cpu as usize].curr == Some(curr) {
            let c = &self.cpus[cpu as usize];
            if let Some(&(_, first)) = c.rq.first() {
                let first = self.threads[first as usize].vruntime;
                let nr = c.rq.len() as u64 + 1;
                // Slices vary with lag, interrupts and the kernel's own threads: +-50%.
                let base = (self.latency / nr).max(self.min_gran);
                let slice = self.rng.range(base / 2, base + base / 2);
                let t = &self.threads[curr as usize];
                if self.now.saturating_sub(t.slice_start) >= slice
                    || first + self.latency < t.vruntime
                {
                    self.threads[curr as usize].slice_cpu = 0;
                    self.preempt_curr(cpu);
                }
            }
        }
        // The nohz idle balance: a busy CPU's tick, with threads waiting on it, has an idle CPU
        // balance, which pulls one that is no longer cache-hot.
        if !self.cpus[cpu as usize].rq.is_empty() {
            if let Some(&idle) = self.idle.iter().next() {
                self.pick_next(idle);
            }
        }
        let c = &mut self.cpus[cpu as usize];
        if c.curr.is_some() && !c.tick_armed {
            c.tick_armed = true;
            let t = self.next_tick(cpu);
            self.at(t, Ev::Tick(cpu));
        }
    }

    /// The next tick of `cpu` after now.
    fn next_tick(&self, cpu: u32) -> u64 {
        let tick = self.cost.tick_ns.max(1);
        let phase = self.cpus[cpu as usize].tick_phase;
        self.now + tick - (self.now + phase) % tick
    }

    fn throttle(&mut self, g: u32) {
        self.groups[g as usize].throttled = true;
        self.groups[g as usize].throttled_periods += 1;
        let members = self.groups[g as usize].members.clone();
        for tid in members {
            match self.threads[tid as usize].state {
                TState::Running => {
                    let cpu = self.threads[tid as usize].cpu;
                    self.stop_running(cpu);
                    self.threads[tid as usize].state = TState::Throttled;
                    self.pick_next(cpu);
                }
                TState::Queued => {
                    self.dequeue(tid);
                    self.threads[tid as usize].state = TState::Throttled;
                }
                TState::Blocked | TState::Throttled => {}
            }
        }
    }

    /// A quota period ends: the group's runtime is refilled and its throttled threads return.
    pub(crate) fn period(&mut self, g: u32) {
        let gr = &mut self.groups[g as usize];
        gr.used = 0;
        let p = gr.period;
        if std::mem::take(&mut gr.throttled) {
            let members = gr.members.clone();
            for tid in members {
                if self.threads[tid as usize].state == TState::Throttled {
                    self.threads[tid as usize].state = TState::Blocked;
                    self.make_runnable(tid);
                }
            }
        }
        self.at(self.now + p, Ev::Period(g));
    }

    /// Evens out the busiest and the idlest CPU, a few threads at a time.
    pub(crate) fn balance(&mut self) {
        for _ in 0..8 {
            let nr = |c: &Cpu| c.rq.len() + usize::from(c.curr.is_some());
            let (mut hi, mut lo) = (0, 0);
            for c in 0..self.cpus.len() {
                if nr(&self.cpus[c]) > nr(&self.cpus[hi]) {
                    hi = c;
                }
                if nr(&self.cpus[c]) < nr(&self.cpus[lo]) {
                    lo = c;
                }
            }
            if nr(&self.cpus[hi]) < nr(&self.cpus[lo]) + 2 {
                return;
            }
            let Some((_, tid)) = self.cpus[hi].rq.pop_last() else {
                return;
            };
            self.queued_total -= 1;
            let t = &mut self.threads[tid as usize];
            let vr = t.vruntime;
            t.vruntime = vr - self.cpus[hi].min_vruntime.min(vr) + self.cpus[lo].min_vruntime;
            t.state = TState::Blocked;
            self.enqueue(lo as u32, tid, false);
        }
    }

    /// Changes a thread's weight (a nice boost and its end).
    pub(crate) fn set_weight(&mut self, tid: u32, weight: u32) {
        let state = self.threads[tid as usize].state;
        if state == TState::Running {
            let cpu = self.threads[tid as usize].cpu;
            self.account(cpu);
        }
        if state == TState::Queued {
            // Re-keyed under its new weight; a heavier thread may now preempt (the kernel's
            // prio_changed check after set_user_nice).
            self.dequeue(tid);
            self.threads[tid as usize].weight = weight.max(1);
            let cpu = self.threads[tid as usize].cpu;
            self.rq_insert(cpu, tid);
            if weight > 1024 {
                self.check_preempt(cpu, tid);
            }
        } else {
            self.threads[tid as usize].weight = weight.max(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SimConfig, Variant};

    /// CPU 1 falls idle while vCPU thread 0 waits on CPU 0 behind a hog; thread 0 last ran
    /// `ran_ago_ns` before. Whether CPU 1 pulls it.
    fn pulled(migration_cost_ns: u64, ran_ago_ns: u64) -> bool {
        let mut sim = waiting_behind_a_hog(migration_cost_ns, ran_ago_ns);
        sim.pick_next(1);
        let moved = sim.cpus[1].curr == Some(0);
        assert_eq!(moved, !sim.idle.contains(&1));
        assert_eq!(sim.queued_total, usize::from(!moved));
        moved
    }

    /// vCPU thread 0 queued on CPU 0 behind a running hog, last run `ran_ago_ns` ago; CPU 1
    /// has nothing to run (not yet marked idle).
    fn waiting_behind_a_hog(migration_cost_ns: u64, ran_ago_ns: u64) -> Sim {
        let v: Variant = "ticket:kick".parse().unwrap();
        let mut c = SimConfig::new(v, 2, 100);
        c.hogs = 1;
        c.cost.migration_cost_ns = migration_cost_ns;
        let mut sim = Sim::new(c).unwrap();
        sim.now = 10_000_000;
        let hog = 2;
        sim.threads[hog].state = TState::Running;
        sim.threads[hog].cpu = 0;
        sim.threads[hog].exec_start = sim.now;
        sim.threads[hog].slice_start = sim.now;
        sim.cpus[0].curr = Some(hog as u32);
        sim.idle.remove(&0);
        sim.threads[0].state = TState::Queued;
        sim.threads[0].cpu = 0;
        sim.threads[0].exec_start = sim.now - ran_ago_ns;
        sim.rq_insert(0, 0);
        sim.cpus[1].curr = None;
        sim
    }

    #[test]
    fn an_idle_cpu_leaves_a_cache_hot_thread_to_the_balance() {
        // The default pulls whatever waits.
        assert!(pulled(0, 100_000));
        // Linux's 0.5 ms: a thread that ran 0.1 ms ago stays, one that ran 1 ms ago moves.
        assert!(!pulled(500_000, 100_000));
        assert!(pulled(500_000, 1_000_000));
    }

    #[test]
    fn a_busy_cpus_tick_has_an_idle_cpu_pull_a_thread_gone_cold() {
        // Hot when CPU 1 fell idle: it stays idle.
        let mut sim = waiting_behind_a_hog(500_000, 100_000);
        sim.pick_next(1);
        assert!(sim.idle.contains(&1));
        // CPU 0's tick 0.1 ms later: still hot, still idle.
        sim.now += 100_000;
        sim.tick(0);
        assert!(sim.idle.contains(&1) && sim.cpus[1].curr.is_none());
        // Its tick a millisecond later (the hog just began a slice: it keeps CPU 0): cold now,
        // pulled.
        sim.now += 1_000_000;
        sim.threads[2].slice_start = sim.now;
        sim.tick(0);
        assert_eq!(sim.cpus[0].curr, Some(2));
        assert_eq!(sim.cpus[1].curr, Some(0));
        assert!(!sim.idle.contains(&1));
        assert_eq!(sim.queued_total, 0);
    }
}
