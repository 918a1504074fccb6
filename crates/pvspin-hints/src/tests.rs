//! Boosts on real threads. The targets only ever block on a channel (bounded waits), so a
//! real-time boost cannot starve anything, and they exit when their test ends, taking any
//! boost with them.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sched::{current_tid, get_nice, get_policy};
use crate::*;

enum Cmd {
    Restore(usize),
    Quit,
}

/// A thread that blocks on commands; `Restore(v)` runs `restore(v)` on it.
struct Target {
    tid: i32,
    tx: Sender<Cmd>,
    done: Receiver<bool>,
    handle: Option<JoinHandle<()>>,
}

impl Target {
    fn spawn(restore: Arc<dyn Fn(usize) -> bool + Send + Sync>) -> Target {
        let (tx, rx) = channel::<Cmd>();
        let (tid_tx, tid_rx) = channel();
        let (done_tx, done) = channel();
        let handle = std::thread::spawn(move || {
            tid_tx.send(current_tid()).unwrap();
            while let Ok(cmd) = rx.recv_timeout(Duration::from_secs(10)) {
                match cmd {
                    Cmd::Restore(v) => {
                        let _ = done_tx.send(restore(v));
                    }
                    Cmd::Quit => break,
                }
            }
        });
        let tid = tid_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        Target {
            tid,
            tx,
            done,
            handle: Some(handle),
        }
    }

    fn restore_on_target(&self, v: usize) -> bool {
        self.tx.send(Cmd::Restore(v)).unwrap();
        self.done.recv_timeout(Duration::from_secs(5)).unwrap()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Quit);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// `CAP_SYS_NICE` (`linux/capability.h`): what nice and SCHED_FIFO boosts of another thread
/// need (or `RLIMIT_NICE` / `RLIMIT_RTPRIO` that allow them).
const CAP_SYS_NICE: u32 = 23;

/// Whether the calling thread's effective capability set holds `CAP_SYS_NICE` (`capget(2)`;
/// libc has the syscall number but not the wrapper).
fn has_cap_sys_nice() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget reads the header and, for version 3, writes two `Data` (the kernel's
    // `__user_cap_data_struct`, same layout); both live across the call.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
    data[(CAP_SYS_NICE / 32) as usize].effective & (1 << (CAP_SYS_NICE % 32)) != 0
}

/// The gate of these tests in the test tally.
const GATE: &str = "cap_sys_nice";

/// Records in the test tally that `test` ran or was skipped (the format of
/// `pvspin_integration_tests::record`: one file `<gate>--<test>` under
/// `$PVSPIN_TEST_TALLY_DIR` holding `ran` or `skipped<TAB><reason>`; `.ci/run` prints the
/// counts). A no-op without the variable.
fn tally(test: &str, skipped: Option<&str>) {
    let Some(dir) = std::env::var_os("PVSPIN_TEST_TALLY_DIR") else {
        return;
    };
    let name: String = format!("{GATE}--{test}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let line = match skipped {
        None => "ran\n".to_owned(),
        Some(reason) => format!("skipped\t{}\n", reason.replace('\n', " ")),
    };
    let path = std::path::Path::new(&dir).join(name);
    if let Err(err) = std::fs::write(&path, line) {
        panic!("{test}: writing the test tally {}: {err}", path.display());
    }
}

/// Skips `test` (printed and counted in the tally) when this process may not apply `what`
/// because it lacks `CAP_SYS_NICE`; with the capability a refusal is a failure.
fn skip_without_cap(test: &str, what: &str, err: &dyn std::fmt::Display) {
    if has_cap_sys_nice() {
        panic!("{test}: {what} refused although the process has CAP_SYS_NICE: {err}");
    }
    let reason = format!(
        "{what}: this process lacks CAP_SYS_NICE and no rlimit allows them instead ({err})"
    );
    eprintln!("SKIPPED {test}: {reason}");
    tally(test, Some(&reason));
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

/// A tracker for `test`, or `None` (skipped, counted) when the process may not boost.
fn tracker(test: &str, kind: BoostKind, deadline: Duration) -> Option<Arc<BoostTracker>> {
    match BoostTracker::new(2, kind, deadline) {
        Ok(t) => {
            tally(test, None);
            Some(Arc::new(t))
        }
        Err(e @ BoostError::NotPermitted { .. }) => {
            skip_without_cap(test, &format!("{kind:?} boosts"), &e);
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

fn restorer(t: &Arc<BoostTracker>) -> Arc<dyn Fn(usize) -> bool + Send + Sync> {
    let t = t.clone();
    Arc::new(move |v| t.restore(v))
}

#[test]
fn config_rules() {
    let d = Duration::from_millis(2);
    for (n, kind, dl) in [
        (0, BoostKind::Nice(-5), d),
        (1, BoostKind::Nice(-21), d),
        (1, BoostKind::Fifo(0), d),
        (1, BoostKind::Fifo(100), d),
        (1, BoostKind::Nice(-5), Duration::ZERO),
        (1, BoostKind::Nice(-5), Duration::from_secs(1)),
    ] {
        assert!(
            matches!(
                BoostTracker::new(n, kind, dl),
                Err(BoostError::NoVcpus
                    | BoostError::Deadline(_)
                    | BoostError::NiceRange(_)
                    | BoostError::FifoPriority(_))
            ),
            "{n} {kind:?} {dl:?}"
        );
    }
    assert!(matches!(
        ActuatorOptions::new("sched_ext", 1).build(),
        Err(ActuatorError::UnknownName(_))
    ));
    assert!(matches!(
        ActuatorOptions {
            fallback: true,
            ..ActuatorOptions::new("bogus", 1)
        }
        .build(),
        Err(ActuatorError::UnknownName(_))
    ));
}

#[test]
fn nice_boost_applies_and_target_exit_restores() {
    let Some(t) = tracker(
        "nice_boost_applies_and_target_exit_restores",
        BoostKind::Nice(-7),
        Duration::from_millis(100),
    ) else {
        return;
    };
    let target = Target::spawn(restorer(&t));
    let before = get_nice(target.tid).unwrap();
    assert_eq!(t.boost(1, target.tid).unwrap(), BoostResult::Applied);
    assert_eq!(get_nice(target.tid).unwrap(), -7);
    assert!(t.is_boosted(1));
    assert_eq!(t.boost(1, target.tid).unwrap(), BoostResult::Extended);
    assert!(target.restore_on_target(1));
    assert_eq!(get_nice(target.tid).unwrap(), before);
    assert!(!t.is_boosted(1));
    assert!(!target.restore_on_target(1), "second restore is a no-op");
    assert_eq!(
        t.stats()
            .restored_by_target
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn fifo_boost_applies_and_restores_policy_and_nice() {
    let Some(t) = tracker(
        "fifo_boost_applies_and_restores_policy_and_nice",
        BoostKind::Fifo(1),
        Duration::from_millis(100),
    ) else {
        return;
    };
    let target = Target::spawn(restorer(&t));
    // A non-default nice must survive the FIFO round trip.
    crate::sched::set_nice(target.tid, 3).unwrap();
    assert_eq!(t.boost(0, target.tid).unwrap(), BoostResult::Applied);
    let p = get_policy(target.tid).unwrap();
    assert_eq!((p.policy, p.priority), (libc::SCHED_FIFO, 1));
    assert!(target.restore_on_target(0));
    let p = get_policy(target.tid).unwrap();
    assert_eq!((p.policy, p.priority), (libc::SCHED_OTHER, 0));
    assert_eq!(get_nice(target.tid).unwrap(), 3);
}

#[test]
fn deadline_restores_without_the_target() {
    let Some(t) = tracker(
        "deadline_restores_without_the_target",
        BoostKind::Fifo(1),
        Duration::from_millis(3),
    ) else {
        return;
    };
    let target = Target::spawn(restorer(&t));
    assert_eq!(t.boost(0, target.tid).unwrap(), BoostResult::Applied);
    assert!(wait_until(Duration::from_secs(2), || {
        get_policy(target.tid).unwrap().policy == libc::SCHED_OTHER
    }));
    assert!(!t.is_boosted(0));
    assert_eq!(
        t.stats()
            .restored_by_deadline
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn deadline_holds_against_a_busy_fifo_target() {
    // The worst case: the boosted thread never blocks and never exits. If the watchdog
    // shares its CPU, only a watchdog that outranks the boost can end it (on a machine with
    // more CPUs the scheduler may run the watchdog elsewhere, so this bounds the restore
    // time either way rather than proving the priority). The target's own loop is bounded
    // by wall time, so nothing can stay real-time past the test.
    let Some(t) = tracker(
        "deadline_holds_against_a_busy_fifo_target",
        BoostKind::Fifo(1),
        Duration::from_millis(3),
    ) else {
        return;
    };
    let (tid_tx, tid_rx) = channel();
    let (go_tx, go_rx) = channel::<()>();
    let busy = std::thread::spawn(move || {
        pin_to_cpu(0);
        tid_tx.send(current_tid()).unwrap();
        let _ = go_rx.recv_timeout(Duration::from_secs(5));
        let t0 = Instant::now();
        let mut restored_after = None;
        while t0.elapsed() < Duration::from_millis(500) {
            if restored_after.is_none()
                && get_policy(current_tid()).unwrap().policy == libc::SCHED_OTHER
            {
                restored_after = Some(t0.elapsed());
            }
            std::hint::spin_loop();
        }
        restored_after
    });
    let tid = tid_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(t.boost(0, tid).unwrap(), BoostResult::Applied);
    go_tx.send(()).unwrap();
    let restored_after = busy.join().unwrap().expect("still SCHED_FIFO after 500 ms");
    assert!(
        restored_after < Duration::from_millis(200),
        "restored after {restored_after:?}"
    );
}

fn pin_to_cpu(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).unwrap();
}

#[test]
fn drop_restores() {
    let Some(t) = tracker(
        "drop_restores",
        BoostKind::Fifo(1),
        Duration::from_millis(100),
    ) else {
        return;
    };
    let target = Target::spawn(Arc::new(|_| false));
    assert_eq!(t.boost(1, target.tid).unwrap(), BoostResult::Applied);
    assert_eq!(get_policy(target.tid).unwrap().policy, libc::SCHED_FIFO);
    drop(t);
    assert_eq!(get_policy(target.tid).unwrap().policy, libc::SCHED_OTHER);
}

#[test]
fn restore_all_and_errors_leave_nothing_boosted() {
    let Some(t) = tracker(
        "restore_all_and_errors_leave_nothing_boosted",
        BoostKind::Nice(-5),
        Duration::from_millis(100),
    ) else {
        return;
    };
    assert!(matches!(t.boost(5, 1), Err(BoostError::NoSuchVcpu(5))));
    assert!(matches!(t.boost(0, 0), Err(BoostError::NoThread(0))));
    assert!(matches!(t.boost(0, i32::MAX), Err(BoostError::Sched(_))));
    assert!(!t.is_boosted(0));
    let a = Target::spawn(Arc::new(|_| false));
    let b = Target::spawn(Arc::new(|_| false));
    // The process's own nice (a test run under `nice` starts above 0).
    let before = get_nice(a.tid).unwrap();
    t.boost(0, a.tid).unwrap();
    t.boost(1, b.tid).unwrap();
    t.restore_all();
    assert_eq!(get_nice(a.tid).unwrap(), before);
    assert_eq!(get_nice(b.tid).unwrap(), before);
    assert!(!t.is_boosted(0) && !t.is_boosted(1));
}

#[test]
fn new_thread_for_a_vcpu_restores_the_old_one() {
    let Some(t) = tracker(
        "new_thread_for_a_vcpu_restores_the_old_one",
        BoostKind::Nice(-5),
        Duration::from_millis(100),
    ) else {
        return;
    };
    let a = Target::spawn(Arc::new(|_| false));
    let b = Target::spawn(Arc::new(|_| false));
    let before = get_nice(a.tid).unwrap();
    t.boost(0, a.tid).unwrap();
    assert_eq!(t.boost(0, b.tid).unwrap(), BoostResult::Applied);
    assert_eq!(get_nice(a.tid).unwrap(), before);
    assert_eq!(get_nice(b.tid).unwrap(), -5);
}

#[test]
fn already_higher_is_left_alone() {
    let Some(t) = tracker(
        "already_higher_is_left_alone",
        BoostKind::Nice(-5),
        Duration::from_millis(100),
    ) else {
        return;
    };
    let a = Target::spawn(Arc::new(|_| false));
    crate::sched::set_nice(a.tid, -8).unwrap();
    assert_eq!(t.boost(0, a.tid).unwrap(), BoostResult::AlreadyHigher);
    assert!(!t.is_boosted(0));
    assert_eq!(get_nice(a.tid).unwrap(), -8);
}

#[test]
fn actuators_by_name_boost_and_restore() {
    for name in ["yield", "nice", "fifo"] {
        let test = format!("actuators_by_name_boost_and_restore/{name}");
        let act: Arc<dyn Actuator> = match ActuatorOptions::new(name, 2).build() {
            Ok(a) => {
                if name != "yield" {
                    tally(&test, None);
                }
                Arc::from(a)
            }
            Err(e) if name != "yield" => {
                skip_without_cap(&test, &format!("the {name} actuator"), &e);
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(act.name(), name);
        let a2 = act.clone();
        let target = Target::spawn(Arc::new(move |v| {
            a2.on_target_exit(v);
            true
        }));
        let before = get_nice(target.tid).unwrap();
        let r = act.yield_to(1, target.tid);
        assert_eq!(r.boosted, name != "yield", "{name}");
        target.restore_on_target(1);
        assert_eq!(get_nice(target.tid).unwrap(), before, "{name}");
        assert_eq!(
            get_policy(target.tid).unwrap().policy,
            libc::SCHED_OTHER,
            "{name}"
        );
        // Unknown thread: no boost, no panic.
        assert!(!act.yield_to(0, 0).boosted);
        act.restore_all();
    }
}

#[test]
fn fallback_gives_fifo_when_permitted() {
    let test = "fallback_gives_fifo_when_permitted";
    let a = ActuatorOptions {
        fallback: true,
        ..ActuatorOptions::new("fifo", 1)
    }
    .build()
    .unwrap();
    if has_cap_sys_nice() {
        assert_eq!(a.name(), "fifo");
        tally(test, None);
    } else if a.name() == "fifo" {
        // Permitted by RLIMIT_RTPRIO instead.
        tally(test, None);
    } else {
        skip_without_cap(
            test,
            "the fifo actuator",
            &format!("fell back to {}", a.name()),
        );
    }
}

#[test]
fn start_hook_runs_first_on_the_watchdog_thread() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook: ThreadStartHook = {
        let seen = seen.clone();
        Arc::new(move |name: &str| {
            let own = std::thread::current().name().map(str::to_string);
            seen.lock().unwrap().push((name.to_string(), own));
            Ok(())
        })
    };
    let kind = BoostKind::Nice(-3);
    let d = Duration::from_millis(2);
    let test = "start_hook_runs_first_on_the_watchdog_thread";
    match BoostTracker::with_thread_start(2, kind, d, Some(hook)) {
        Ok(_) => tally(test, None),
        Err(e @ BoostError::NotPermitted { .. }) => {
            skip_without_cap(test, "nice boosts", &e);
            return;
        }
        Err(e) => panic!("{e}"),
    }
    let name = boost::WATCHDOG_THREAD_NAME.to_string();
    assert_eq!(*seen.lock().unwrap(), [(name.clone(), Some(name))]);
}

#[test]
fn failing_start_hook_fails_the_constructor_without_stepping_down() {
    let hook: ThreadStartHook = Arc::new(|_: &str| Err(std::io::Error::other("no filter")));
    let d = Duration::from_millis(2);
    match BoostTracker::with_thread_start(1, BoostKind::Nice(-3), d, Some(hook.clone())) {
        Err(BoostError::ThreadStart { thread, err }) => {
            tally(
                "failing_start_hook_fails_the_constructor_without_stepping_down",
                None,
            );
            assert_eq!(thread, boost::WATCHDOG_THREAD_NAME);
            assert_eq!(err.to_string(), "no filter");
        }
        Err(e @ BoostError::NotPermitted { .. }) => {
            skip_without_cap(
                "failing_start_hook_fails_the_constructor_without_stepping_down",
                "nice boosts",
                &e,
            );
            return;
        }
        other => panic!("expected ThreadStart, got {other:?}"),
    }
    // A permission problem steps down to yield; a failing hook does not.
    assert!(matches!(
        ActuatorOptions {
            deadline: d,
            fallback: true,
            thread_start: Some(hook.clone()),
            ..ActuatorOptions::new("nice", 1)
        }
        .build(),
        Err(ActuatorError::Boost(BoostError::ThreadStart { .. }))
    ));
    // `yield` starts no thread, so the hook never runs.
    let a = ActuatorOptions {
        deadline: d,
        fallback: true,
        thread_start: Some(hook.clone()),
        ..ActuatorOptions::new("yield", 1)
    }
    .build()
    .unwrap();
    assert_eq!(a.name(), "yield");
}

#[test]
fn capget_reports_this_process() {
    // The effective set is what the kernel checks; /proc says the same.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = crate::proc::parse_status_cap_eff(&status).unwrap();
    assert_eq!(has_cap_sys_nice(), eff & (1 << CAP_SYS_NICE) != 0);
}
