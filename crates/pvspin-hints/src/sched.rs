//! Thin, checked wrappers over the Linux scheduling calls the actuators use, on thread ids.
//!
//! Nice values and yields go through rustix. `sched_{get,set}scheduler`, `sched_getparam` and
//! `getrusage(RUSAGE_THREAD)` have no rustix or nix wrapper, so they stay `libc` calls; each
//! reports failure by its return value and reads `errno` only then.

use std::io;

/// The calling thread's kernel thread id.
pub fn current_tid() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// The thread `tid` names for the `*priority_process` calls: `None` (the caller) for 0, and
/// `ESRCH` for a negative id, which names no thread.
fn priority_target(tid: i32) -> io::Result<Option<rustix::process::Pid>> {
    if tid < 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(rustix::process::Pid::from_raw(tid))
}

/// A thread's nice value (`getpriority(PRIO_PROCESS, tid)`; on Linux a tid names one thread).
/// rustix returns the kernel's unambiguous answer, so no errno juggling for a nice of -1.
pub fn get_nice(tid: i32) -> io::Result<i32> {
    Ok(rustix::process::getpriority_process(priority_target(tid)?)?)
}

/// Sets a thread's nice value.
pub fn set_nice(tid: i32, nice: i32) -> io::Result<()> {
    Ok(rustix::process::setpriority_process(
        priority_target(tid)?,
        nice,
    )?)
}

/// A thread's scheduling policy and static priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedPolicy {
    /// `SCHED_OTHER`, `SCHED_FIFO`, ...
    pub policy: i32,
    /// The real-time priority (0 for the fair classes).
    pub priority: i32,
}

/// Reads a thread's policy and priority.
pub fn get_policy(tid: i32) -> io::Result<SchedPolicy> {
    // SAFETY: plain syscall wrapper with an integer argument.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, writable sched_param for the duration of the call.
    let r = unsafe { libc::sched_getparam(tid, &mut param) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SchedPolicy {
        policy,
        priority: param.sched_priority,
    })
}

/// Sets a thread's policy and priority.
pub fn set_policy(tid: i32, p: SchedPolicy) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: p.priority,
    };
    // SAFETY: `param` is a valid sched_param for the duration of the call.
    let r = unsafe { libc::sched_setscheduler(tid, p.policy, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's context switches so far (voluntary + involuntary).
pub fn thread_context_switches() -> u64 {
    // SAFETY: all-zero is a valid rusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the duration of the call.
    let r = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    if r != 0 {
        return 0;
    }
    u64::try_from(ru.ru_nvcsw).unwrap_or(0) + u64::try_from(ru.ru_nivcsw).unwrap_or(0)
}

/// `sched_yield()`, reporting whether the calling thread was actually descheduled (its
/// context-switch count moved): the "scheduled out" signal for the spin window.
pub fn yield_now() -> bool {
    let before = thread_context_switches();
    rustix::thread::sched_yield();
    thread_context_switches() != before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_round_trip_on_own_thread() {
        // Raising nice (lower priority) is always permitted; do it on a throwaway thread.
        std::thread::spawn(|| {
            let tid = current_tid();
            let n0 = get_nice(tid).unwrap();
            set_nice(tid, (n0 + 1).min(19)).unwrap();
            assert_eq!(get_nice(tid).unwrap(), (n0 + 1).min(19));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn bad_tids_are_errors_not_panics() {
        assert!(get_nice(-5).is_err());
        assert!(get_nice(i32::MAX).is_err());
        assert!(get_policy(i32::MAX).is_err());
        assert!(set_nice(i32::MAX, 0).is_err());
    }

    #[test]
    fn own_policy_is_fair_class() {
        let p = get_policy(current_tid()).unwrap();
        assert_eq!(p.policy, libc::SCHED_OTHER);
        assert_eq!(p.priority, 0);
    }

    #[test]
    fn yield_reports_without_panicking() {
        // Whether a switch happens depends on the machine's load; both answers are valid,
        // but the counter must never go backwards.
        let a = thread_context_switches();
        let _ = yield_now();
        assert!(thread_context_switches() >= a);
    }
}
