//! Seccomp: the example VMM runs every workload, kick path and PV mode with its threads
//! confined (`--seccomp enforce`), every thread it and pvspin start is confined, a forbidden
//! syscall kills it; and pvspin's published rules let pvspin's own calls through while they
//! stop anything else.
//!
//! The VMM runs in a child process: this test binary re-executes itself, and the child's only
//! test ([`vmm_process`]) calls the binary's entry point (`pvspin_vmm::cli::main_process`),
//! which confines its calling thread too. Every child is bounded by the VMM's own watchdog and
//! timeout and, from here, by [`CHILD_LIMIT`].

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pvspin::seccomp::{self, ThreadKind};
use pvspin_integration_tests::{finish_child, kvm_or_skip};
use seccompiler::SeccompAction;

/// The environment variable that turns this binary into the example VMM: its arguments,
/// separated by `\x1f`.
const CHILD_ARGS: &str = "PVSPIN_SECCOMP_TEST_VMM_ARGS";

/// The longest a child may run before it is killed and the test fails.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

/// Small runs: every guest instruction may be emulated.
const QUICK: [&str; 7] = [
    "--iterations",
    "20",
    "--cs-work",
    "5",
    "--ncs-work",
    "5",
    "--quiet",
];

/// The child: the example VMM's process entry point, when [`CHILD_ARGS`] is set; nothing
/// otherwise.
#[test]
fn vmm_process() {
    pvspin_integration_tests::run_vmm_child_if_asked(CHILD_ARGS);
}

fn spawn_vmm(args: &[&str]) -> Child {
    Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "vmm_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ARGS, args.join("\x1f"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the VMM child")
}

/// [`finish_child`] bounded by [`CHILD_LIMIT`].
fn finish(child: Child, what: &str) -> (ExitStatus, String, String) {
    finish_child(child, what, CHILD_LIMIT)
}

/// Runs the VMM with `args` and checks it exited with `code`; returns its stdout.
fn vmm(args: &[&str], code: i32) -> String {
    let what = args.join(" ");
    let (status, stdout, stderr) = finish(spawn_vmm(args), &what);
    assert_eq!(
        status.signal(),
        None,
        "{what}: killed by a signal (SIGSYS is {}: a syscall the filters do not allow)\n{stderr}",
        libc::SIGSYS
    );
    assert_eq!(status.code(), Some(code), "{what}\n{stdout}\n{stderr}");
    stdout
}

fn with_quick<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["run", "--seccomp", "enforce"];
    all.extend_from_slice(args);
    all.extend_from_slice(&QUICK);
    all
}

#[test]
fn every_workload_runs_under_enforce() {
    if kvm_or_skip("every_workload_runs_under_enforce").is_none() {
        return;
    }
    for (args, code) in [
        (&["--workload", "lock"][..], 0),
        (&["--workload", "hello"], 0),
        (&["--workload", "cpuid"], 0),
        (
            &["--workload", "pingpong", "--pv", "kick", "--vcpus", "3"],
            0,
        ),
        (&["--workload", "fault"], 1),
        (&["--workload", "hypercall"], 1),
        (&["--workload", "spin", "--watchdog-ms", "300"], 1),
        (&["--workload", "lock", "--lock", "tas", "--hogs", "1"], 0),
        (
            &["--workload", "lock", "--lock", "backoff", "--pv", "kick"],
            0,
        ),
        (&["--workload", "lock", "--vcpus", "0"], 2),
    ] {
        let stdout = vmm(&with_quick(args), code);
        if code == 0 && args[1] == "lock" {
            assert!(stdout.contains("counter"), "{args:?}: {stdout}");
        }
    }
    // The main thread writes the statistics file under its own filter.
    let file = std::env::temp_dir().join(format!("pvspin-seccomp-{}.json", std::process::id()));
    let path = file.to_str().expect("a UTF-8 temporary path");
    vmm(
        &with_quick(&["--workload", "hello", "--stats", "--stats-file", path]),
        0,
    );
    let stats = std::fs::read_to_string(&file).expect("the statistics file");
    let _ = std::fs::remove_file(&file);
    assert!(stats.contains("vcpus"), "{stats}");
}

#[test]
fn pv_locks_run_under_enforce_on_every_kick_path() {
    if kvm_or_skip("pv_locks_run_under_enforce_on_every_kick_path").is_none() {
        return;
    }
    for path in ["in-kernel", "signal-msi", "userspace"] {
        for pv in ["kick", "kick+yield"] {
            let base = ["--pv", pv, "--kick-path", path, "--vcpus", "3"];
            for extra in [
                &["--lock", "ticket"][..],
                &["--lock", "queued"],
                &["--cs-mode", "user"],
                &["--wait", "doorbell"],
            ] {
                let mut args = base.to_vec();
                args.extend_from_slice(extra);
                let stdout = vmm(&with_quick(&args), 0);
                assert!(stdout.contains("counter 60 == 60"), "{args:?}: {stdout}");
            }
        }
        vmm(
            &with_quick(&[
                "--workload",
                "pingpong",
                "--pv",
                "kick",
                "--kick-path",
                path,
            ]),
            0,
        );
        // Every actuator, with hogs: boosts of other vCPU threads, pvspin's watchdog thread.
        for actuator in ["yield", "nice", "fifo"] {
            let args = [
                "--pv",
                "kick+yield",
                "--kick-path",
                path,
                "--actuator",
                actuator,
                "--boosts",
                "unconfined",
                "--vcpus",
                "4",
                "--hogs",
                "2",
            ];
            vmm(&with_quick(&args), 0);
        }
    }
}

#[test]
fn bench_runs_under_enforce() {
    if kvm_or_skip("bench_runs_under_enforce").is_none() {
        return;
    }
    let stdout = vmm(
        &[
            "bench",
            "--seccomp",
            "enforce",
            "--runs",
            "1",
            "--hogs",
            "0,1",
            "--iterations",
            "20",
            "--variants",
            "ticket:off,ticket:kick,ticket:kick+yield:userspace:nice,queued:kick:signal-msi",
        ],
        0,
    );
    assert!(stdout.contains("case 2x (1 hogs)"), "{stdout}");
}

#[test]
fn a_forbidden_syscall_on_a_vcpu_thread_kills_the_vmm() {
    if kvm_or_skip("a_forbidden_syscall_on_a_vcpu_thread_kills_the_vmm").is_none() {
        return;
    }
    let violate = |mode: &str| {
        let args = [
            "run",
            "--seccomp",
            mode,
            "--seccomp-violation",
            "--workload",
            "hello",
            "--quiet",
        ];
        finish(spawn_vmm(&args), mode)
    };
    let (status, _, stderr) = violate("enforce");
    assert_eq!(status.signal(), Some(libc::SIGSYS), "{status:?}\n{stderr}");
    assert!(stderr.contains("socket(2)"), "{stderr}");
    // The same run without the violation, and with it under `log` and `off`, succeeds.
    vmm(&with_quick(&["--workload", "hello"]), 0);
    for mode in ["log", "off"] {
        let (status, _, stderr) = violate(mode);
        assert_eq!(status.code(), Some(0), "{mode}: {status:?}\n{stderr}");
    }
}

/// The names and seccomp modes (`Seccomp:` in `/proc/PID/task/TID/status`: 2 is a filter) of
/// a process's threads.
fn thread_modes(pid: u32) -> BTreeMap<String, Vec<u32>> {
    let mut modes: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return modes;
    };
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        if let (Some(name), Some(mode)) = (field("Name:"), field("Seccomp:")) {
            let name = name
                .trim_end_matches(|c: char| c.is_ascii_digit())
                .to_string();
            modes
                .entry(name)
                .or_default()
                .push(mode.parse().unwrap_or(0));
        }
    }
    modes
}

#[test]
fn every_thread_the_vmm_and_pvspin_start_is_confined() {
    if kvm_or_skip("every_thread_the_vmm_and_pvspin_start_is_confined").is_none() {
        return;
    }
    // vCPU 0 spins until the watchdog stops the run: time to look at the threads.
    let args = [
        "run",
        "--seccomp",
        "enforce",
        "--workload",
        "spin",
        "--watchdog-ms",
        "3000",
        "--pv",
        "kick+yield",
        "--actuator",
        "nice",
        "--boosts",
        "unconfined",
        "--hogs",
        "1",
        "--quiet",
    ];
    let child = spawn_vmm(&args);
    let pid = child.id();
    let expected = ["vmm", "vcpu", "hog", "pvspin-boost-wd", "vmm_process"];
    let start = Instant::now();
    let mut modes = thread_modes(pid);
    while start.elapsed() < Duration::from_secs(20)
        && !(expected.iter().all(|name| modes.contains_key(*name))
            && modes.get("vmm").is_some_and(|m| m == &[2]))
    {
        std::thread::sleep(Duration::from_millis(20));
        modes = thread_modes(pid);
    }
    let (status, _, stderr) = finish(child, "spin");
    assert_eq!(
        status.code(),
        Some(1),
        "the watchdog ends the run\n{stderr}"
    );
    // `vmm_process` is the libtest thread that plays the binary's main thread.
    for name in expected {
        let seen = modes
            .get(name)
            .unwrap_or_else(|| panic!("no {name} thread: {modes:?}"));
        assert!(seen.iter().all(|&m| m == 2), "{name} unconfined: {modes:?}");
    }
    assert_eq!(modes["vcpu"].len(), 2, "{modes:?}");
}

/// Runs `f` on a new thread confined by `filter` (mismatch: `EPERM`), and waits for the thread
/// to end: a thread that cannot exit under the filter fails the test instead of hanging it.
fn on_confined_thread<T: Send + 'static>(
    filter: seccompiler::BpfProgram,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let thread = std::thread::spawn(move || {
        seccompiler::apply_filter(&filter).expect("installing the filter");
        f()
    });
    let start = Instant::now();
    while !thread.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the confined thread did not end: its exit is not allowed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    thread.join().expect("the confined thread")
}

fn errno_of(ret: libc::c_long) -> i32 {
    if ret == -1 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    } else {
        0
    }
}

fn program(kind: ThreadKind) -> seccompiler::BpfProgram {
    let mut rules = seccomp::baseline_rules().expect("baseline");
    seccomp::merge_into(&mut rules, kind).expect("pvspin's rules");
    seccomp::compile(rules, SeccompAction::Errno(libc::EPERM as u32)).expect("compiles")
}

#[test]
fn vcpu_rules_allow_pvspins_calls_and_stop_others() {
    let results = on_confined_thread(program(ThreadKind::Vcpu), || {
        let kvm = |request: libc::c_ulong| {
            // SAFETY: fd -1 is never valid, so the kernel returns EBADF without reading the
            // (null) argument; under the filter the call may not reach the kernel at all.
            errno_of(unsafe { libc::ioctl(-1, request as _, std::ptr::null_mut::<u8>()) }.into())
        };
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
        // SAFETY: `usage` is writable for one rusage.
        let thread_usage =
            errno_of(unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) }.into());
        // SAFETY: as above.
        let self_usage =
            errno_of(unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) }.into());
        // SAFETY: plain syscall wrappers with integer arguments.
        let tid = unsafe { libc::gettid() };
        let nice = own_nice(tid);
        // SAFETY: as above; sets this thread's nice value to what it is.
        let set_nice = errno_of(
            unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) }.into(),
        );
        // SAFETY: as above; PRIO_PGRP is not pvspin's and must be refused.
        let set_group = errno_of(unsafe { libc::setpriority(libc::PRIO_PGRP, 0, nice) }.into());
        // SAFETY: sched_yield has no preconditions.
        let yielded = errno_of(unsafe { libc::sched_yield() }.into());
        // SAFETY: socket takes no pointers; a descriptor is closed below.
        let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        let socket_errno = errno_of(socket.into());
        if socket >= 0 {
            // SAFETY: our own new descriptor.
            unsafe { libc::close(socket) };
        }
        let path = c"/dev/null";
        // SAFETY: a valid NUL-terminated path; a descriptor would be leaked only on failure of
        // the filter, which the assertion reports.
        let open = errno_of(unsafe { libc::openat(libc::AT_FDCWD, path.as_ptr(), 0) }.into());
        [
            ("KVM_SET_MP_STATE", kvm(0x4004_ae99)),
            ("KVM_SIGNAL_MSI", kvm(0x4020_aea5)),
            ("KVM_RUN", kvm(0xae80)),
            ("getrusage(RUSAGE_THREAD)", thread_usage),
            ("getrusage(RUSAGE_SELF)", self_usage),
            ("setpriority(PRIO_PROCESS)", set_nice),
            ("setpriority(PRIO_PGRP)", set_group),
            ("sched_yield", yielded),
            ("socket", socket_errno),
            ("openat", open),
        ]
    });
    let results: BTreeMap<_, _> = results.into_iter().collect();
    let expected = BTreeMap::from([
        // pvspin's requests reach the kernel (which refuses the bad fd)...
        ("KVM_SET_MP_STATE", libc::EBADF),
        ("KVM_SIGNAL_MSI", libc::EBADF),
        // ...and KVM_RUN, which the ready interrupter's `VcpuThread::run` issues.
        ("KVM_RUN", libc::EBADF),
        ("getrusage(RUSAGE_THREAD)", 0),
        ("getrusage(RUSAGE_SELF)", libc::EPERM),
        ("setpriority(PRIO_PROCESS)", 0),
        ("setpriority(PRIO_PGRP)", libc::EPERM),
        ("sched_yield", 0),
        ("socket", libc::EPERM),
        ("openat", libc::EPERM),
    ]);
    assert_eq!(results, expected);
}

/// This thread's nice value (`getpriority` is allowed on vCPU threads).
fn own_nice(tid: i32) -> i32 {
    // SAFETY: plain syscall wrapper with integer arguments (-1 is a valid nice value; the
    // test only writes it back).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) }
}

#[test]
fn watchdog_and_control_rules_stop_what_they_do_not_need() {
    for kind in [ThreadKind::BoostWatchdog, ThreadKind::Control] {
        let (ioctl, socket, yielded) = on_confined_thread(program(kind), || {
            // SAFETY: see vcpu_rules_allow_pvspins_calls_and_stop_others.
            let ioctl = errno_of(
                unsafe { libc::ioctl(-1, 0x4020_aea5 as _, std::ptr::null_mut::<u8>()) }.into(),
            );
            // SAFETY: socket takes no pointers; a descriptor is closed.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            let socket = errno_of(fd.into());
            if fd >= 0 {
                // SAFETY: our own new descriptor.
                unsafe { libc::close(fd) };
            }
            // SAFETY: sched_yield has no preconditions.
            let yielded = errno_of(unsafe { libc::sched_yield() }.into());
            (ioctl, socket, yielded)
        });
        assert_eq!(
            (ioctl, socket, yielded),
            (libc::EPERM, libc::EPERM, libc::EPERM),
            "{kind}"
        );
    }
}

#[test]
fn pvspin_confines_its_boost_watchdog_with_the_vmms_filter() {
    const TEST: &str = "pvspin_confines_its_boost_watchdog_with_the_vmms_filter";
    #[derive(Debug)]
    struct NoInterrupter;
    impl pvspin::VcpuInterrupter for NoInterrupter {
        fn interrupt(&self, _: usize) {}
    }
    let build = |filter: seccompiler::BpfProgram| {
        pvspin::PvSpin::builder()
            .vcpus(2)
            .interrupter(Arc::new(NoInterrupter))
            .kick(pvspin::KickOptions::new(pvspin::KickPath::Userspace))
            .directed_yield(pvspin::DirectedYieldOptions {
                actuator: pvspin::ActuatorKind::Nice,
                fallback: false,
                // The watchdog exists only with a boost; confinement is tested elsewhere.
                confinement: pvspin::Confinement::Unconfined,
                ..pvspin::DirectedYieldOptions::default()
            })
            .helper_thread_filter(Arc::new(filter))
            .build()
    };
    let pvspin = match build(program(ThreadKind::BoostWatchdog)) {
        Ok(pvspin) => pvspin,
        Err(pvspin::ConfigError::Actuator { source, .. })
            if source.to_string().contains("CAP_SYS_NICE") =>
        {
            let reason = source.to_string();
            eprintln!("SKIPPED {TEST}: nice boosts are not permitted here: {reason}");
            pvspin_integration_tests::record("cap_sys_nice", TEST, Some(&reason));
            return;
        }
        Err(err) => panic!("{err}"),
    };
    pvspin_integration_tests::record("cap_sys_nice", TEST, None);
    let confined = thread_modes(std::process::id())
        .remove("pvspin-boost-wd")
        .expect("the watchdog thread runs");
    assert!(confined.contains(&2), "{confined:?}");
    drop(pvspin);
    // A filter that cannot be installed (an empty program) stops the thread and the build,
    // without stepping down to another actuator.
    let err = build(Vec::new()).expect_err("the watchdog's filter cannot be installed");
    let text = err.to_string();
    assert!(text.contains("pvspin-boost-wd"), "{text}");
}
