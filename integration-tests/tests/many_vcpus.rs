//! 255 vCPUs, the most pvspin's ABI and the example's guest protocol allow
//! (`pvspin_abi::MAX_VCPUS`), with every thread confined (`--seccomp enforce`): the greeting
//! workload and the PV queued lock in guest user mode, both exact.
//!
//! The VMM runs as a child process of this test binary, as in `seccomp.rs`: the child's only
//! test ([`vmm_process`]) calls the binary's entry point, which confines its calling thread
//! too. Each child is bounded by the VMM's own watchdog and timeout, by [`CHILD_LIMIT`] from
//! here, and the whole test by `with_watchdog`. The two runs take the machine's every core, so
//! they run one at a time ([`ONE_AT_A_TIME`]).

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use pvspin_integration_tests::{finish_child, kvm_required, run_vmm_child_if_asked, with_watchdog};

/// The environment variable that turns this binary into the example VMM: its arguments,
/// separated by `\x1f`.
const CHILD_ARGS: &str = "PVSPIN_MANY_VCPUS_TEST_VMM_ARGS";

/// The longest a child may run before it is killed and the test fails (the lock run took
/// about 20 s on two busy cores).
const CHILD_LIMIT: Duration = Duration::from_secs(180);

/// The vCPUs of every run here: the ABI's limit.
const VCPUS: u32 = pvspin_abi::MAX_VCPUS;

/// Lock acquisitions per vCPU.
const ITERATIONS: u64 = 8;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The child: the example VMM's process entry point, when [`CHILD_ARGS`] is set; nothing
/// otherwise.
#[test]
fn vmm_process() {
    run_vmm_child_if_asked(CHILD_ARGS);
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

/// Runs the VMM with `args` under `--seccomp enforce`, waits for it (killing it past
/// [`CHILD_LIMIT`]), checks it exited with 0 and not by a signal, and returns its stdout.
fn vmm_ok(test: &str, args: &[&str]) -> String {
    let vcpus = VCPUS.to_string();
    let mut all = vec!["run", "--seccomp", "enforce", "--vcpus", &vcpus];
    all.extend_from_slice(args);
    let what = all.join(" ");
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let start = Instant::now();
    let (status, stdout, stderr) = finish(spawn_vmm(&all), &what);
    eprintln!("{test}: {what}: {:.1} s", start.elapsed().as_secs_f64());
    assert_eq!(
        status.signal(),
        None,
        "{what}: killed by a signal (SIGSYS is {}: a syscall the filters do not allow)\n{stderr}",
        libc::SIGSYS
    );
    assert_eq!(status.code(), Some(0), "{what}\n{stdout}\n{stderr}");
    stdout
}

/// [`finish_child`] bounded by [`CHILD_LIMIT`].
fn finish(child: Child, what: &str) -> (ExitStatus, String, String) {
    finish_child(child, what, CHILD_LIMIT)
}

/// The run's JSON report (the last line of stdout).
fn report(stdout: &str) -> serde_json::Value {
    let line = stdout.lines().last().expect("a report line");
    serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}"))
}

/// This host's KVM must take 255 vCPUs: a test that cannot run them fails, it never skips.
fn kvm_with_room(test: &str) {
    let kvm = kvm_required(test);
    let max = kvm.get_max_vcpus();
    assert!(
        max >= VCPUS as usize,
        "{test}: KVM allows {max} vCPUs per VM here, the test needs {VCPUS}"
    );
}

#[test]
fn hello_on_255_vcpus_under_enforce() {
    const TEST: &str = "hello_on_255_vcpus_under_enforce";
    kvm_with_room(TEST);
    with_watchdog(TEST, CHILD_LIMIT + Duration::from_secs(60), || {
        // 255 vCPU threads on two host cores: under a heavy host load (a load average of 150
        // once) a vCPU may wait past the default 10 s watchdog for its turn.
        let stdout = vmm_ok(TEST, &["--workload", "hello", "--watchdog-ms", "60000"]);
        // Every vCPU greeted once, with its own index (the first greeting shares its line
        // with the child's libtest "test vmm_process ... ").
        let mut greeted = vec![0u32; VCPUS as usize];
        let tail = format!(" of {VCPUS}");
        let greeting = "hello from vCPU ";
        for line in stdout.lines() {
            if let Some(at) = line.find(greeting) {
                let rest = &line[at + greeting.len()..];
                let index: usize = rest
                    .strip_suffix(tail.as_str())
                    .and_then(|i| i.parse().ok())
                    .unwrap_or_else(|| panic!("a greeting of another form: {line:?}"));
                greeted[index] += 1;
            }
        }
        assert!(greeted.iter().all(|&n| n == 1), "{greeted:?}");
        let report = report(&stdout);
        assert_eq!(report["vcpus"], VCPUS);
        let per_vcpu = report["per_vcpu"].as_array().expect("per_vcpu");
        assert_eq!(per_vcpu.len(), VCPUS as usize);
        for (i, vcpu) in per_vcpu.iter().enumerate() {
            assert_eq!(vcpu["index"], i, "{vcpu}");
            assert_eq!(vcpu["heartbeat"], 1, "{vcpu}");
        }
    });
}

#[test]
fn pv_queued_lock_on_255_vcpus_under_enforce() {
    const TEST: &str = "pv_queued_lock_on_255_vcpus_under_enforce";
    kvm_with_room(TEST);
    with_watchdog(TEST, CHILD_LIMIT + Duration::from_secs(60), || {
        let iterations = ITERATIONS.to_string();
        // Critical sections of tens of microseconds in user mode (native speed here) and a
        // 10 us wait budget: a waiter halts whenever it finds the lock held (with 20000
        // units, 8 rounds and the default 50 us budget a run now and then had no halt at
        // all: each vCPU thread did its rounds within its host time slice). Kicks reach
        // vCPUs up to 254. With the default 10 s watchdog: the VMM used to start its vCPU
        // threads one by one, taking 14 s at 200 vCPUs on two cores, and the watchdog stopped
        // every such run (issue 19); the threads now start together.
        let stdout = vmm_ok(
            TEST,
            &[
                "--workload",
                "lock",
                "--pv",
                "kick",
                "--lock",
                "queued",
                "--cs-mode",
                "user",
                "--iterations",
                &iterations,
                "--cs-work",
                "100000",
                "--ncs-work",
                "5",
                "--wait-after-us",
                "10",
                "--wait-after-max-us",
                "10",
                "--quiet",
            ],
        );
        let expected = u64::from(VCPUS) * ITERATIONS;
        assert!(
            stdout.contains(&format!("counter {expected} == {expected}")),
            "{stdout}"
        );
        let report = report(&stdout);
        assert_eq!(report["counter"], expected);
        assert_eq!(report["expected"], expected);
        assert_eq!(report["pv"], "kick/in-kernel");
        let per_vcpu = report["per_vcpu"].as_array().expect("per_vcpu");
        assert_eq!(per_vcpu.len(), VCPUS as usize);
        for vcpu in per_vcpu {
            assert_eq!(vcpu["acquisitions"], ITERATIONS, "{vcpu}");
        }
        // Waiters halted and were kicked: the PV path ran across the 255 vCPUs.
        let halts = report["pv_halts"].as_u64().expect("pv_halts");
        let kicks = report["pv_kicks"].as_u64().expect("pv_kicks");
        assert!(halts > 0 && kicks > 0, "halts {halts}, kicks {kicks}");
        eprintln!("{TEST}: {halts} halts, {kicks} kicks");
    });
}
