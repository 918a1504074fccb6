//! Who runs, seen from outside the VMM: whether each vCPU thread of the frontend is on a CPU,
//! waiting for one (runnable but descheduled: preempted), or blocked (halted in KVM, or
//! waiting in the VMM), from `/proc/<pid>/task/<tid>/` read at a bounded rate.
//!
//! What procfs gives, and what it does not (Linux 6.x, `CONFIG_SCHED_INFO`, which every
//! kernel with `CONFIG_TASK_DELAY_ACCT` or `CONFIG_SCHEDSTATS` has):
//!
//! - `schedstat`: run time (`se.sum_exec_runtime`), run-queue wait (`sched_info.run_delay`) and
//!   switch-ins (`sched_info.pcount`). The run time of a thread on a CPU advances only at
//!   scheduler ticks (4 ms at `HZ=250`) and at switches; the wait is charged when the thread
//!   is switched in, **not while it waits**. So "its wait grew and its run time did not"
//!   between two reads does not find a thread that is waiting now: it finds one that waited
//!   and has run since.
//! - `status`: the state (`R` is running *or* runnable) and the switch-outs
//!   (`voluntary_ctxt_switches + nonvoluntary_ctxt_switches`).
//!
//! Every switch-in adds one to `pcount` and every switch-out one to the two switch counts,
//! from 0 at thread creation, so a thread in state `R` is **on a CPU when it has been switched
//! in once more than out**, and runnable but descheduled when both counts are equal. The two
//! files are read one after the other, not atomically: a switch between the reads gives the
//! wrong answer for that sample (or counts that match neither case: unknown), which the next
//! sample corrects.
//!
//! Cost (CPU time per read, development hosts, descriptors kept open and re-read with
//! `pread`): `schedstat` 0.6 us, `stat` 2.3 us, `status` 6.8 us. So `schedstat` is read every
//! sample, and the others only when needed: a thread whose `schedstat` did not move since the
//! previous sample (no switch, no tick) is still where it was, except that a blocked one may
//! have been woken (`stat` says whether it is runnable now); a thread whose `schedstat` moved
//! gets `stat`, and `status` only if it is runnable. The backend counts the reads and their
//! CPU time (`sched` in its telemetry). The files are parsed by [`pvspin_hints::proc`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use pvspin_hints::proc;

use crate::yield_policy::{ProcThreads, ThreadActions};

pub use pvspin_hints::proc::{SchedStat, TaskState};

/// Where a vCPU thread is, as last sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum RunState {
    /// Not sampled, gone, or the counts did not match (a switch between the reads).
    #[default]
    Unknown = 0,
    /// On a CPU.
    Running = 1,
    /// Runnable but not on a CPU: the host scheduler descheduled it.
    Preempted = 2,
    /// Not runnable: halted in KVM, or waiting in the VMM.
    Blocked = 3,
}

impl RunState {
    /// From its `repr(u8)` value (anything else: unknown).
    pub fn from_u8(v: u8) -> Self {
        match v {
            1 => RunState::Running,
            2 => RunState::Preempted,
            3 => RunState::Blocked,
            _ => RunState::Unknown,
        }
    }

    /// The classification of a thread in `state` with `switches_in` (schedstat) and
    /// `switches_out` (status).
    pub fn classify(state: TaskState, switches_in: u64, switches_out: u64) -> Self {
        match state {
            TaskState::Runnable if switches_in == switches_out.wrapping_add(1) => RunState::Running,
            TaskState::Runnable if switches_in == switches_out => RunState::Preempted,
            TaskState::Runnable | TaskState::Gone => RunState::Unknown,
            TaskState::Blocked => RunState::Blocked,
        }
    }
}

/// Where the sampler reads threads from: procfs ([`ProcSched`]) or a fake.
pub trait SchedSource: Send {
    /// The frontend's vCPU threads: vCPU index -> thread id.
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>>;
    /// Starts watching `tid` as vCPU `vcpu` of `pid`; false if it is not (any more) that thread.
    fn watch(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool;
    /// The thread's `schedstat`.
    fn schedstat(&mut self, tid: u32) -> io::Result<SchedStat>;
    /// The thread's state (`stat`).
    fn state(&mut self, tid: u32) -> io::Result<TaskState>;
    /// The thread's state and switch-outs (`status`).
    fn switches(&mut self, tid: u32) -> io::Result<(TaskState, u64)>;
    /// Stops watching `tid` (gone, or no longer a vCPU).
    fn forget(&mut self, tid: u32);
}

impl<T: SchedSource + ?Sized> SchedSource for Box<T> {
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>> {
        (**self).vcpu_threads(pid)
    }
    fn watch(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        (**self).watch(pid, tid, vcpu)
    }
    fn schedstat(&mut self, tid: u32) -> io::Result<SchedStat> {
        (**self).schedstat(tid)
    }
    fn state(&mut self, tid: u32) -> io::Result<TaskState> {
        (**self).state(tid)
    }
    fn switches(&mut self, tid: u32) -> io::Result<(TaskState, u64)> {
        (**self).switches(tid)
    }
    fn forget(&mut self, tid: u32) {
        (**self).forget(tid);
    }
}

/// One vCPU thread's sampling memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadWatch {
    last: Option<(SchedStat, RunState)>,
    /// Consecutive samples that found it descheduled without a switch-in in between.
    descheduled: u32,
}

/// What one sample of one thread cost: files read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    /// `schedstat` reads.
    pub schedstat: u32,
    /// `stat` reads.
    pub stat: u32,
    /// `status` reads.
    pub status: u32,
}

impl ThreadWatch {
    /// Samples `tid`: `schedstat` always; `stat` or `status` only when needed (module docs).
    /// An error means the thread is gone (or unreadable).
    pub fn sample(
        &mut self,
        src: &mut dyn SchedSource,
        tid: u32,
        reads: &mut Reads,
    ) -> io::Result<RunState> {
        reads.schedstat += 1;
        let now = src.schedstat(tid)?;
        let state = match self.last {
            // No switch and no tick since the last sample: a thread on a CPU is still there,
            // a descheduled one was not switched in.
            Some((then, s @ (RunState::Running | RunState::Preempted))) if then == now => s,
            // Not switched in since: if it is runnable now, it was woken and waits for a CPU.
            Some((then, RunState::Blocked)) if then == now => {
                reads.stat += 1;
                match src.state(tid)? {
                    TaskState::Runnable => RunState::Preempted,
                    TaskState::Blocked => RunState::Blocked,
                    TaskState::Gone => RunState::Unknown,
                }
            }
            // It moved: `stat` says whether it is blocked; only a runnable thread needs the
            // switch counts of the (three times dearer) `status`.
            _ => {
                reads.stat += 1;
                match src.state(tid)? {
                    TaskState::Blocked => RunState::Blocked,
                    TaskState::Gone => RunState::Unknown,
                    TaskState::Runnable => {
                        reads.status += 1;
                        let (state, out) = src.switches(tid)?;
                        RunState::classify(state, now.switches_in, out)
                    }
                }
            }
        };
        let switched_in = self
            .last
            .is_none_or(|(then, _)| then.switches_in != now.switches_in);
        self.descheduled = match state {
            RunState::Preempted if self.descheduled > 0 && !switched_in => self.descheduled + 1,
            RunState::Preempted => 1,
            _ => 0,
        };
        self.last = Some((now, state));
        Ok(state)
    }

    /// How many consecutive samples, this one included, found the thread descheduled without
    /// it being switched in between. At 2 it has been off its CPU for at least a whole sample
    /// period: not a moment's preemption by a thread that runs for microseconds (the sampler
    /// itself, the daemon's worker), which is over before a guest could use the news.
    pub fn descheduled_samples(&self) -> u32 {
        self.descheduled
    }

    /// Forgets the history (a new thread).
    pub fn reset(&mut self) {
        self.last = None;
        self.descheduled = 0;
    }
}

/// The three files of one watched thread, kept open (re-read with `pread` at offset 0, which
/// makes procfs generate them anew). An open file stays bound to its thread: once the thread
/// exits, reads fail, even if its id is reused.
#[derive(Debug)]
struct ThreadFiles {
    schedstat: File,
    stat: File,
    status: File,
}

/// The real source: `/proc/<pid>/task/<tid>/{schedstat,stat,status}` of threads named by the
/// vCPU patterns.
#[derive(Debug)]
pub struct ProcSched {
    threads: ProcThreads,
    proc_root: PathBuf,
    open: HashMap<u32, ThreadFiles>,
}

impl ProcSched {
    /// vCPU threads named by `patterns`, on this machine's `/proc`.
    pub fn new(patterns: Vec<String>) -> Self {
        Self {
            threads: ProcThreads::new(patterns),
            proc_root: PathBuf::from("/proc"),
            open: HashMap::new(),
        }
    }

    fn files(&mut self, tid: u32) -> io::Result<&ThreadFiles> {
        self.open
            .get(&tid)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
}

/// A file whose text did not parse, as the sampler's I/O error.
fn invalid_data(err: proc::ParseError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, err)
}

/// Reads a whole small procfs file from offset 0 into `buf`; the text.
fn pread_text<'a>(file: &File, buf: &'a mut [u8]) -> io::Result<&'a str> {
    let n = file.read_at(buf, 0)?;
    if n == 0 {
        // A thread that exited reads as empty.
        return Err(io::ErrorKind::NotFound.into());
    }
    std::str::from_utf8(&buf[..n]).map_err(|_| io::ErrorKind::InvalidData.into())
}

impl SchedSource for ProcSched {
    fn vcpu_threads(&mut self, pid: u32) -> io::Result<BTreeMap<u32, u32>> {
        self.threads.vcpu_threads(pid)
    }

    fn watch(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        self.open.remove(&tid);
        let dir = self
            .proc_root
            .join(pid.to_string())
            .join("task")
            .join(tid.to_string());
        let open = |name: &str| File::open(dir.join(name));
        let files = match (open("schedstat"), open("stat"), open("status")) {
            (Ok(schedstat), Ok(stat), Ok(status)) => ThreadFiles {
                schedstat,
                stat,
                status,
            },
            _ => return false,
        };
        // Checked after opening: the open files name this thread for as long as they live.
        if !self.threads.is_vcpu_thread(pid, tid, vcpu) {
            return false;
        }
        self.open.insert(tid, files);
        true
    }

    fn schedstat(&mut self, tid: u32) -> io::Result<SchedStat> {
        let mut buf = [0u8; 128];
        let text = pread_text(&self.files(tid)?.schedstat, &mut buf)?;
        proc::parse_schedstat(text).map_err(invalid_data)
    }

    fn state(&mut self, tid: u32) -> io::Result<TaskState> {
        let mut buf = [0u8; 1024];
        let text = pread_text(&self.files(tid)?.stat, &mut buf)?;
        proc::parse_stat_state(text).map_err(invalid_data)
    }

    fn switches(&mut self, tid: u32) -> io::Result<(TaskState, u64)> {
        let mut buf = [0u8; 4096];
        let text = pread_text(&self.files(tid)?.status, &mut buf)?;
        proc::parse_status_switches(text).map_err(invalid_data)
    }

    fn forget(&mut self, tid: u32) {
        self.open.remove(&tid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeSched;

    #[test]
    fn switch_counts_tell_on_cpu_from_descheduled() {
        use RunState::*;
        assert_eq!(RunState::classify(TaskState::Runnable, 5, 4), Running);
        assert_eq!(RunState::classify(TaskState::Runnable, 5, 5), Preempted);
        assert_eq!(RunState::classify(TaskState::Runnable, 5, 7), Unknown);
        assert_eq!(RunState::classify(TaskState::Blocked, 5, 5), Blocked);
        assert_eq!(RunState::classify(TaskState::Gone, 5, 4), Unknown);
        for s in [Unknown, Running, Preempted, Blocked] {
            assert_eq!(RunState::from_u8(s as u8), s);
        }
        assert_eq!(RunState::from_u8(200), Unknown);
    }

    #[test]
    fn status_is_read_only_when_schedstat_moved() {
        let mut src = FakeSched::new(7, 1);
        let tid = FakeSched::TID_BASE;
        let mut w = ThreadWatch::default();
        let mut reads = Reads::default();
        // First sample: the full read.
        src.set(tid, TaskState::Runnable, 10, 9);
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Running
        );
        assert_eq!((reads.schedstat, reads.stat, reads.status), (1, 1, 1));
        // Nothing moved: still running, schedstat only.
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Running
        );
        assert_eq!((reads.schedstat, reads.status), (2, 1));
        // Switched out (its run time moved): descheduled while runnable.
        src.set(tid, TaskState::Runnable, 10, 10);
        src.add_run(tid, 500);
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Preempted
        );
        assert_eq!(reads.status, 2);
        assert_eq!(w.descheduled_samples(), 1);
        // It stays descheduled: no switch-in, no read of status.
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Preempted
        );
        assert_eq!(reads.status, 2);
        assert_eq!(w.descheduled_samples(), 2, "a whole period off its CPU");
        // Switched in, ran, blocked (halted): stat suffices.
        src.set(tid, TaskState::Blocked, 11, 11);
        src.add_run(tid, 500);
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Blocked
        );
        assert_eq!((reads.stat, reads.status), (3, 2));
        // Woken, not yet run: schedstat unchanged, stat says runnable.
        src.set(tid, TaskState::Runnable, 11, 11);
        assert_eq!(
            w.sample(&mut src, tid, &mut reads).unwrap(),
            RunState::Preempted
        );
        assert_eq!((reads.stat, reads.status), (4, 2));
        assert_eq!(w.descheduled_samples(), 1);
        // Switched in and out again between two samples: the count starts over.
        src.set(tid, TaskState::Runnable, 12, 12);
        src.add_run(tid, 500);
        w.sample(&mut src, tid, &mut reads).unwrap();
        assert_eq!(w.descheduled_samples(), 1);
        // Gone: an error.
        src.remove(tid);
        assert!(w.sample(&mut src, tid, &mut reads).is_err());
    }

    /// The rule on this machine's real threads: a thread reading its own files is on a CPU, a
    /// thread parked on a channel is blocked.
    #[test]
    fn real_threads_are_classified() {
        let pid = std::process::id();
        let mut src = ProcSched::new(vec!["pvspin-sched-{N}".into()]);
        let me = pvspin_hints::sched::current_tid() as u32;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let parked = std::thread::Builder::new()
            .name("pvspin-sched-1".into())
            .spawn(move || {
                tid_tx
                    .send(pvspin_hints::sched::current_tid() as u32)
                    .unwrap();
                let _ = rx.recv();
            })
            .unwrap();
        let other = tid_rx.recv().unwrap();
        // This test thread has a libtest name: watch it by opening its files directly.
        let dir = PathBuf::from(format!("/proc/{pid}/task/{me}"));
        src.open.insert(
            me,
            ThreadFiles {
                schedstat: File::open(dir.join("schedstat")).unwrap(),
                stat: File::open(dir.join("stat")).unwrap(),
                status: File::open(dir.join("status")).unwrap(),
            },
        );
        let mut reads = Reads::default();
        // On a loaded host (the other tests of this binary run beside it) this thread can be
        // descheduled between two reads and rightly read as preempted: it must read as
        // running in at least one of a few samples, and never as blocked.
        let states: Vec<RunState> = (0..20)
            .map(|_| {
                ThreadWatch::default()
                    .sample(&mut src, me, &mut reads)
                    .unwrap()
            })
            .collect();
        assert!(states.contains(&RunState::Running), "{states:?}");
        assert!(!states.contains(&RunState::Blocked), "{states:?}");
        assert!(src.watch(pid, other, 1));
        assert!(!src.watch(pid, other, 2), "the name says vCPU 1");
        assert!(src.watch(pid, other, 1));
        // Parked on the channel: blocked, however often it is asked (bounded wait for the
        // thread to reach its park).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut w = ThreadWatch::default();
        while w.sample(&mut src, other, &mut reads).unwrap() != RunState::Blocked {
            assert!(std::time::Instant::now() < deadline, "never blocked");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            src.vcpu_threads(pid).unwrap().get(&1),
            Some(&other),
            "found by name"
        );
        tx.send(()).unwrap();
        parked.join().unwrap();
        // Its files stay bound to it: once it exited, reads fail.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while w.sample(&mut src, other, &mut reads).is_ok() {
            assert!(std::time::Instant::now() < deadline, "reads after exit");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
