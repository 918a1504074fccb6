//! Directed yield from outside the VMM: what a spin notification may do to the frontend's
//! vCPU threads, and undoing it.
//!
//! The rules, which keep a guest from gaining anything it does not have without pvspin:
//!
//! - Only threads of the frontend's own process (the pid of the connection's peer
//!   credentials) whose names match a vCPU pattern are touched, and a thread id is re-checked
//!   against its name before every change (thread ids are reused).
//! - A **deboost** (nice + step, at most 19) of the spinner's own thread is always allowed: it
//!   only lowers the VM's own priority. It lasts [`crate::config::BackendConfig::adjust_for`];
//!   a notification while it lasts extends it by that much from now, nothing stacks.
//! - A **boost** (nice - step) of the waited-for vCPU's thread is allowed only in
//!   [`YieldMode::Confined`] and only while the frontend process is alone in its own cpu
//!   cgroup, where a nice change moves CPU only between the VM's own threads. A boost is not
//!   extended: the next one needs the previous one restored.
//! - Every change is restored at its deadline, at device reset and at disconnect, unless
//!   someone else changed the thread's nice value in between (then theirs is kept).
//!
//! The policy is pure over a [`ThreadActions`] implementation: [`ProcThreads`] uses procfs and
//! pvspin-hints' `sched::set_nice`, tests use a fake.
//!
//! Why not pvspin-hints' `BoostTracker`: it boosts the threads of its own process, in
//! vCPU-index slots fixed at start, and restores from its own watchdog thread. Here the threads
//! belong to another process, are found and re-checked by name before every change (thread ids
//! are reused), include deboosts of the spinner, and are restored only if nobody else changed
//! them meanwhile, from the backend's restore timer. The shared part, the nice calls, is reused.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pvspin_hints::confine::{
    check_at, Confinement, IoCause, NotConfinedReason, ReadAction, Verdict,
};
use pvspin_hints::proc;

use crate::config::YieldMode;
use crate::telemetry::{DaemonVmTelemetry, YieldSkip};

/// How often the vCPU thread list may be re-read when a vCPU's thread is not in it.
const THREAD_RESCAN_EVERY: Duration = Duration::from_millis(100);
/// How long a confinement verdict is trusted.
const CONFINEMENT_TTL: Duration = Duration::from_secs(1);
/// Most tasks read from `/proc/<pid>/task` in one scan.
const MAX_TASKS_SCANNED: usize = 4096;
/// The nice range.
const NICE_MIN: i32 = -20;
const NICE_MAX: i32 = 19;

/// The thread operations the policy needs; one frontend process at a time.
pub trait ThreadActions: Send {
    /// The frontend's vCPU threads: vCPU index → thread id.
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>>;
    /// Whether `tid` is still vCPU `vcpu`'s thread in process `pid`.
    fn is_vcpu_thread(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool;
    /// The thread's nice value.
    fn nice(&mut self, pid: u32, tid: u32) -> io::Result<i32>;
    /// Sets the thread's nice value.
    fn set_nice(&mut self, tid: u32, nice: i32) -> io::Result<()>;
    /// Whether boosts in process `pid` stay inside its own CPU share.
    fn confinement(&mut self, pid: u32) -> Verdict;
    /// Whether this process may set a nice value as low as `nice` (`CAP_SYS_NICE` or
    /// `RLIMIT_NICE`). A deboost is made only when its restore is possible.
    fn may_lower_to(&mut self, nice: i32) -> bool;
}

impl<T: ThreadActions + ?Sized> ThreadActions for Box<T> {
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>> {
        (**self).vcpu_threads(pid)
    }
    fn is_vcpu_thread(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        (**self).is_vcpu_thread(pid, tid, vcpu)
    }
    fn nice(&mut self, pid: u32, tid: u32) -> io::Result<i32> {
        (**self).nice(pid, tid)
    }
    fn set_nice(&mut self, tid: u32, nice: i32) -> io::Result<()> {
        (**self).set_nice(tid, nice)
    }
    fn confinement(&mut self, pid: u32) -> Verdict {
        (**self).confinement(pid)
    }
    fn may_lower_to(&mut self, nice: i32) -> bool {
        (**self).may_lower_to(nice)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Deboost,
    Boost,
}

#[derive(Clone, Copy, Debug)]
struct Adjustment {
    vcpu: u32,
    original: i32,
    set_to: i32,
    until: Instant,
    change: Change,
}

/// What one spin notification did (for tests and logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpinOutcome {
    /// The spinner's thread was deboosted (or its deboost extended).
    pub deboosted: bool,
    /// The waited-for vCPU's thread was boosted.
    pub boosted: bool,
    /// A boost was refused: the frontend is not confined.
    pub boost_refused: bool,
}

/// The directed-yield policy for one frontend.
pub struct YieldPolicy<A: ThreadActions> {
    mode: YieldMode,
    step: i32,
    adjust_for: Duration,
    actions: A,
    pid: Option<u32>,
    threads: BTreeMap<u32, u32>,
    threads_read_at: Option<Instant>,
    adjusted: BTreeMap<u32, Adjustment>,
    confined: Option<(bool, Instant)>,
}

impl<A: ThreadActions> std::fmt::Debug for YieldPolicy<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("YieldPolicy")
            .field("mode", &self.mode)
            .field("pid", &self.pid)
            .field("adjusted", &self.adjusted.len())
            .finish_non_exhaustive()
    }
}

impl<A: ThreadActions> YieldPolicy<A> {
    /// A policy acting through `actions`; no frontend pid yet.
    pub fn new(mode: YieldMode, step: i32, adjust_for: Duration, actions: A) -> Self {
        Self {
            mode,
            step: step.clamp(0, NICE_MAX - NICE_MIN),
            adjust_for,
            actions,
            pid: None,
            threads: BTreeMap::new(),
            threads_read_at: None,
            adjusted: BTreeMap::new(),
            confined: None,
        }
    }

    /// Sets the frontend's pid (`None`: unknown, nothing is ever changed).
    pub fn set_peer(&mut self, pid: Option<u32>) {
        self.pid = pid;
        self.threads.clear();
        self.threads_read_at = None;
        self.confined = None;
    }

    /// The thread actions (for tests).
    pub fn actions(&self) -> &A {
        &self.actions
    }

    /// How many thread priorities are changed now.
    pub fn adjusted(&self) -> usize {
        self.adjusted.len()
    }

    /// The earliest restore deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.adjusted.values().map(|a| a.until).min()
    }

    fn thread_of(&mut self, pid: u32, vcpu: u32, now: Instant) -> Option<u32> {
        if let Some(tid) = self.threads.get(&vcpu) {
            return Some(*tid);
        }
        let stale = self
            .threads_read_at
            .is_none_or(|at| now.saturating_duration_since(at) >= THREAD_RESCAN_EVERY);
        if stale {
            self.threads_read_at = Some(now);
            self.threads = self.actions.vcpu_threads(pid).unwrap_or_default();
        }
        self.threads.get(&vcpu).copied()
    }

    fn is_confined(&mut self, pid: u32, now: Instant) -> bool {
        match self.confined {
            Some((yes, at)) if now.saturating_duration_since(at) < CONFINEMENT_TTL => yes,
            _ => {
                let verdict = self.actions.confinement(pid);
                // Only "confined" allows boosts here: the daemon never accepts unconfined ones.
                let yes = matches!(verdict, Verdict::Confined { .. });
                if !yes {
                    log::debug!("pid {pid}: boosts refused: {verdict:?}");
                }
                self.confined = Some((yes, now));
                yes
            }
        }
    }

    /// Acts on a spin notification from `spinner` waiting for `waiting_for` (already checked
    /// to be another vCPU below `max_vcpus`, or `None`).
    pub fn on_spin(
        &mut self,
        spinner: u32,
        waiting_for: Option<u32>,
        now: Instant,
        tel: &DaemonVmTelemetry,
    ) -> SpinOutcome {
        let mut out = SpinOutcome::default();
        if self.mode == YieldMode::Off {
            return out;
        }
        let Some(pid) = self.pid else {
            tel.yield_skipped(YieldSkip::NoPeer);
            return out;
        };
        out.deboosted = self.deboost(pid, spinner, now, tel);
        if self.mode == YieldMode::Confined {
            if let Some(holder) = waiting_for.filter(|h| *h != spinner) {
                if self.is_confined(pid, now) {
                    out.boosted = self.boost(pid, holder, now, tel);
                } else {
                    tel.boost_refused_unconfined();
                    out.boost_refused = true;
                }
            }
        }
        out
    }

    fn deboost(&mut self, pid: u32, vcpu: u32, now: Instant, tel: &DaemonVmTelemetry) -> bool {
        let Some(tid) = self.thread_of(pid, vcpu, now) else {
            tel.yield_skipped(YieldSkip::NoThread);
            return false;
        };
        if let Some(a) = self.adjusted.get_mut(&tid) {
            if a.change == Change::Deboost {
                a.until = now + self.adjust_for;
            }
            tel.yield_skipped(YieldSkip::AlreadyAdjusted);
            return a.change == Change::Deboost;
        }
        self.change(pid, vcpu, tid, self.step, Change::Deboost, now, tel)
    }

    fn boost(&mut self, pid: u32, vcpu: u32, now: Instant, tel: &DaemonVmTelemetry) -> bool {
        let Some(tid) = self.thread_of(pid, vcpu, now) else {
            tel.yield_skipped(YieldSkip::NoThread);
            return false;
        };
        if let Some(a) = self.adjusted.get(&tid).copied() {
            if a.change == Change::Deboost {
                // The holder is itself deboosted: ending that is the boost it may have.
                self.restore_one(tid, a, tel);
                return true;
            }
            tel.yield_skipped(YieldSkip::AlreadyAdjusted);
            return false;
        }
        self.change(pid, vcpu, tid, -self.step, Change::Boost, now, tel)
    }

    #[allow(clippy::too_many_arguments)]
    fn change(
        &mut self,
        pid: u32,
        vcpu: u32,
        tid: u32,
        delta: i32,
        change: Change,
        now: Instant,
        tel: &DaemonVmTelemetry,
    ) -> bool {
        if !self.actions.is_vcpu_thread(pid, tid, vcpu) {
            // The thread went away (or its id was reused): forget the map.
            self.threads.clear();
            tel.yield_skipped(YieldSkip::NoThread);
            return false;
        }
        let Ok(original) = self.actions.nice(pid, tid) else {
            tel.yield_skipped(YieldSkip::ActionFailed);
            return false;
        };
        let set_to = (original + delta).clamp(NICE_MIN, NICE_MAX);
        if set_to == original {
            tel.yield_skipped(YieldSkip::ActionFailed);
            return false;
        }
        // The lower of the two values must be reachable: the boost itself, or a deboost's
        // restore (a deboost that could not be undone would outlast its deadline).
        if !self.actions.may_lower_to(set_to.min(original)) {
            tel.yield_skipped(YieldSkip::NoPrivilege);
            return false;
        }
        if let Err(err) = self.actions.set_nice(tid, set_to) {
            log::debug!("setpriority({tid}, {set_to}): {err}");
            tel.yield_skipped(YieldSkip::ActionFailed);
            return false;
        }
        self.adjusted.insert(
            tid,
            Adjustment {
                vcpu,
                original,
                set_to,
                until: now + self.adjust_for,
                change,
            },
        );
        match change {
            Change::Deboost => tel.deboost(),
            Change::Boost => tel.boost(),
        }
        true
    }

    fn restore_one(&mut self, tid: u32, a: Adjustment, tel: &DaemonVmTelemetry) {
        self.adjusted.remove(&tid);
        let Some(pid) = self.pid else { return };
        // Put the old value back only if the thread is still ours and nobody else changed it.
        if self.actions.is_vcpu_thread(pid, tid, a.vcpu)
            && self.actions.nice(pid, tid).ok() == Some(a.set_to)
            && self.actions.set_nice(tid, a.original).is_ok()
        {
            tel.restore();
        }
    }

    /// Restores every change whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Instant, tel: &DaemonVmTelemetry) {
        let due: Vec<(u32, Adjustment)> = self
            .adjusted
            .iter()
            .filter(|(_, a)| a.until <= now)
            .map(|(t, a)| (*t, *a))
            .collect();
        for (tid, a) in due {
            self.restore_one(tid, a, tel);
        }
    }

    /// Restores every change (device reset, disconnect, shutdown).
    pub fn restore_all(&mut self, tel: &DaemonVmTelemetry) {
        let all: Vec<(u32, Adjustment)> = self.adjusted.iter().map(|(t, a)| (*t, *a)).collect();
        for (tid, a) in all {
            self.restore_one(tid, a, tel);
        }
    }
}

/// Whether thread name `name` matches `pattern` (`{N}` standing for a decimal vCPU index),
/// and the index.
pub fn match_thread_name(pattern: &str, name: &str) -> Option<u32> {
    let (prefix, suffix) = pattern.split_once("{N}")?;
    let digits = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if digits.is_empty() || digits.len() > 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The real thread actions: `/proc/<pid>/task/*/comm` names, nice values from
/// `/proc/<pid>/task/<tid>/stat`, `setpriority(PRIO_PROCESS, tid)`, and the cgroup check of
/// `pvspin_hints::confine`.
#[derive(Clone, Debug)]
pub struct ProcThreads {
    patterns: Vec<String>,
    proc_root: PathBuf,
    cgroup_root: PathBuf,
}

impl ProcThreads {
    /// Threads named by `patterns`, on this machine's `/proc` and `/sys/fs/cgroup`.
    pub fn new(patterns: Vec<String>) -> Self {
        Self {
            patterns,
            proc_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from(proc::CGROUP_ROOT),
        }
    }

    fn task_dir(&self, pid: u32) -> PathBuf {
        self.proc_root.join(pid.to_string()).join("task")
    }

    fn vcpu_of(&self, comm: &str) -> Option<u32> {
        let name = comm.trim_end_matches('\n');
        self.patterns
            .iter()
            .find_map(|p| match_thread_name(p, name))
    }
}

fn read_small(path: &Path) -> io::Result<String> {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path)?
        .take(4096)
        .read_to_string(&mut s)?;
    Ok(s)
}

/// Whether this process has `CAP_SYS_NICE` in its effective set (read once: asked at every
/// priority change).
fn has_cap_sys_nice() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(read_cap_sys_nice)
}

fn read_cap_sys_nice() -> bool {
    const CAP_SYS_NICE: u32 = 23;
    read_small(Path::new("/proc/self/status"))
        .ok()
        .and_then(|status| proc::parse_status_cap_eff(&status).ok())
        .is_some_and(|caps| caps & (1 << CAP_SYS_NICE) != 0)
}

impl ThreadActions for ProcThreads {
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>> {
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir(self.task_dir(pid))?.take(MAX_TASKS_SCANNED) {
            let Ok(entry) = entry else { continue };
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Ok(comm) = read_small(&entry.path().join("comm")) {
                if let Some(vcpu) = self.vcpu_of(&comm) {
                    out.entry(vcpu).or_insert(tid);
                }
            }
        }
        Ok(out)
    }

    fn is_vcpu_thread(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        read_small(&self.task_dir(pid).join(tid.to_string()).join("comm"))
            .ok()
            .and_then(|c| self.vcpu_of(&c))
            == Some(vcpu)
    }

    fn nice(&mut self, pid: u32, tid: u32) -> io::Result<i32> {
        let stat = read_small(&self.task_dir(pid).join(tid.to_string()).join("stat"))?;
        proc::parse_stat_nice(&stat).map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))
    }

    fn set_nice(&mut self, tid: u32, nice: i32) -> io::Result<()> {
        let tid = i32::try_from(tid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
        pvspin_hints::sched::set_nice(tid, nice)
    }

    fn may_lower_to(&mut self, nice: i32) -> bool {
        if has_cap_sys_nice() {
            return true;
        }
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid rlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut limit) } != 0 {
            return false;
        }
        // RLIMIT_NICE's ceiling is 20 - rlim_cur, expressed as the lowest nice value allowed.
        let lowest = if limit.rlim_cur == libc::RLIM_INFINITY {
            NICE_MIN
        } else {
            20 - i32::try_from(limit.rlim_cur.min(40)).unwrap_or(0)
        };
        nice >= lowest
    }

    fn confinement(&mut self, pid: u32) -> Verdict {
        let path = self.proc_root.join(pid.to_string()).join("cgroup");
        match read_small(&path) {
            Ok(text) => check_at(&Confinement::Auto, &text, pid, &self.cgroup_root),
            Err(err) => Verdict::NotConfined {
                reason: NotConfinedReason::Unreadable {
                    action: ReadAction::Reading,
                    cause: IoCause::from(&err),
                    path,
                },
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Threads of one fake process: vCPU i is thread 100 + i, all at nice 0.
    #[derive(Debug, Default)]
    pub(crate) struct FakeThreads {
        pub nice: BTreeMap<u32, i32>,
        pub confined: bool,
        pub pid: u32,
        pub calls: Vec<(u32, i32)>,
        pub lowest: i32,
    }

    impl FakeThreads {
        pub(crate) fn new(pid: u32, vcpus: u32, confined: bool) -> Self {
            Self {
                nice: (0..vcpus).map(|v| (100 + v, 0)).collect(),
                confined,
                pid,
                calls: Vec::new(),
                lowest: NICE_MIN,
            }
        }
    }

    impl ThreadActions for FakeThreads {
        fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>> {
            if pid != self.pid {
                return Err(io::ErrorKind::NotFound.into());
            }
            Ok(self.nice.keys().map(|t| (t - 100, *t)).collect())
        }
        fn is_vcpu_thread(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
            pid == self.pid && self.nice.contains_key(&tid) && tid == 100 + vcpu
        }
        fn nice(&mut self, _pid: u32, tid: u32) -> io::Result<i32> {
            self.nice
                .get(&tid)
                .copied()
                .ok_or(io::ErrorKind::NotFound.into())
        }
        fn set_nice(&mut self, tid: u32, nice: i32) -> io::Result<()> {
            assert!(
                self.nice.contains_key(&tid),
                "touched a thread that is not the VM's"
            );
            self.calls.push((tid, nice));
            self.nice.insert(tid, nice);
            Ok(())
        }
        fn may_lower_to(&mut self, nice: i32) -> bool {
            nice >= self.lowest
        }
        fn confinement(&mut self, _pid: u32) -> Verdict {
            if self.confined {
                Verdict::Confined {
                    cgroup: "/sys/fs/cgroup/vm".into(),
                }
            } else {
                Verdict::NotConfined {
                    reason: NotConfinedReason::RootCgroup,
                }
            }
        }
    }

    fn tel() -> DaemonVmTelemetry {
        DaemonVmTelemetry::new("t", "/t", 4)
    }

    #[test]
    fn deboost_is_bounded_and_restored() {
        let t = tel();
        let ms = Duration::from_millis(1);
        let mut p = YieldPolicy::new(YieldMode::Deboost, 5, ms, FakeThreads::new(7, 4, true));
        let now = Instant::now();
        // No pid: nothing happens.
        assert_eq!(p.on_spin(0, Some(1), now, &t), SpinOutcome::default());
        p.set_peer(Some(7));
        let o = p.on_spin(0, Some(1), now, &t);
        assert!(o.deboosted && !o.boosted && !o.boost_refused);
        assert_eq!(p.actions().nice[&100], 5);
        // Again while it lasts: extended, not stacked.
        assert!(p.on_spin(0, Some(1), now + ms / 2, &t).deboosted);
        assert_eq!(p.actions().nice[&100], 5);
        assert_eq!(p.next_deadline(), Some(now + ms / 2 + ms));
        p.expire(now + ms, &t);
        assert_eq!(p.actions().nice[&100], 5, "restored before its deadline");
        p.expire(now + 2 * ms, &t);
        assert_eq!(p.actions().nice[&100], 0);
        assert_eq!(p.adjusted(), 0);
        let s = t.snapshot();
        assert_eq!((s.deboosts, s.boosts, s.restores), (1, 0, 1));
    }

    #[test]
    fn boost_needs_confinement_mode_and_cgroup() {
        let t = tel();
        let ms = Duration::from_millis(1);
        let now = Instant::now();
        let mut unconfined =
            YieldPolicy::new(YieldMode::Confined, 5, ms, FakeThreads::new(7, 4, false));
        unconfined.set_peer(Some(7));
        let o = unconfined.on_spin(0, Some(2), now, &t);
        assert!(o.deboosted && !o.boosted && o.boost_refused);
        assert_eq!(unconfined.actions().nice[&102], 0);
        assert_eq!(t.snapshot().boost_refused_unconfined, 1);

        let mut confined =
            YieldPolicy::new(YieldMode::Confined, 5, ms, FakeThreads::new(7, 4, true));
        confined.set_peer(Some(7));
        let o = confined.on_spin(0, Some(2), now, &t);
        assert!(o.deboosted && o.boosted);
        assert_eq!(confined.actions().nice[&102], -5);
        // A second boost while the first lasts is refused (no stacking).
        assert!(!confined.on_spin(1, Some(2), now, &t).boosted);
        assert_eq!(confined.actions().nice[&102], -5);
        confined.restore_all(&t);
        assert!(confined.actions().nice.values().all(|n| *n == 0));

        let mut deboost_only =
            YieldPolicy::new(YieldMode::Deboost, 5, ms, FakeThreads::new(7, 4, true));
        deboost_only.set_peer(Some(7));
        assert!(!deboost_only.on_spin(0, Some(2), now, &t).boosted);
        let mut off = YieldPolicy::new(YieldMode::Off, 5, ms, FakeThreads::new(7, 4, true));
        off.set_peer(Some(7));
        assert_eq!(off.on_spin(0, Some(2), now, &t), SpinOutcome::default());
        assert!(off.actions().calls.is_empty());
    }

    #[test]
    fn unknown_threads_and_foreign_changes_are_left_alone() {
        let t = tel();
        let ms = Duration::from_millis(1);
        let now = Instant::now();
        let mut p = YieldPolicy::new(YieldMode::Deboost, 5, ms, FakeThreads::new(7, 2, true));
        p.set_peer(Some(7));
        // vCPU 3 has no thread.
        assert!(!p.on_spin(3, None, now, &t).deboosted);
        assert!(p.on_spin(1, None, now, &t).deboosted);
        // Someone else renices the thread: the restore keeps their value.
        p.actions.nice.insert(101, 10);
        p.restore_all(&t);
        assert_eq!(p.actions().nice[&101], 10);
        // Nice is clamped: a thread at 19 cannot be deboosted further.
        p.actions.nice.insert(100, 19);
        assert!(!p.on_spin(0, None, now, &t).deboosted);
    }

    #[test]
    fn nothing_is_changed_that_could_not_be_undone() {
        let t = tel();
        let now = Instant::now();
        // Nice may not go below 0: a deboost (0 -> 5) could not be restored, a boost not made.
        let mut fake = FakeThreads::new(7, 4, true);
        fake.lowest = 0;
        let mut p = YieldPolicy::new(YieldMode::Confined, 5, Duration::from_millis(1), fake);
        p.set_peer(Some(7));
        assert_eq!(
            p.on_spin(0, Some(1), now, &t),
            SpinOutcome {
                deboosted: true,
                boosted: false,
                boost_refused: false
            }
        );
        // The deboost from 0 restores to 0, which is allowed; the boost to -5 is not.
        assert_eq!(p.actions().nice[&101], 0);
        assert_eq!(t.snapshot().yield_skipped["no_privilege"], 1);
        p.actions.lowest = 10;
        p.restore_all(&t);
        assert!(!p.on_spin(2, None, now, &t).deboosted);
        assert!(p.actions().calls.iter().all(|(tid, _)| *tid != 102));
    }

    #[test]
    fn thread_names_match_patterns() {
        assert_eq!(match_thread_name("vcpu{N}", "vcpu12"), Some(12));
        assert_eq!(match_thread_name("CPU {N}/KVM", "CPU 3/KVM"), Some(3));
        assert_eq!(match_thread_name("vcpu{N}", "vcpu"), None);
        assert_eq!(match_thread_name("vcpu{N}", "vcpu1x"), None);
        assert_eq!(match_thread_name("vcpu{N}", "vcpu-1"), None);
        assert_eq!(match_thread_name("vcpu{N}", "vcpu9999999"), None);
        assert_eq!(match_thread_name("vcpu", "vcpu1"), None);
    }

    #[test]
    fn proc_threads_reads_this_process() {
        let mut p = ProcThreads::new(vec!["pvspin-t{N}".into()]);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("pvspin-t3".into())
            .spawn(move || {
                // The name is set by the new thread itself: scan only once it runs.
                ready_tx.send(()).unwrap();
                let _ = rx.recv();
            })
            .unwrap();
        ready_rx.recv().unwrap();
        let pid = std::process::id();
        let threads = p.vcpu_threads(pid).unwrap();
        let tid = threads[&3];
        assert!(p.is_vcpu_thread(pid, tid, 3));
        assert!(!p.is_vcpu_thread(pid, tid, 4));
        let n = p.nice(pid, tid).unwrap();
        // Raising one's own nice needs no privilege.
        if n < 19 {
            p.set_nice(tid, n + 1).unwrap();
            assert_eq!(p.nice(pid, tid).unwrap(), n + 1);
        }
        tx.send(()).unwrap();
        h.join().unwrap();
    }
}
