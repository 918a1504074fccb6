//! pvspin over vhost-user on real KVM: the example VMM (`--pv-backend vhost-user:PATH`) with its
//! guest driving the pvspin virtio device, served by the real `pvspind` daemon over a real
//! Unix socket. Lock counts exact, 100,000 wait/kick pairs through the backend, the backend
//! killed and restarted mid-run, two VMs on one daemon (one of them killed), and the rules
//! the VMM names when it refuses.
//!
//! Every run is bounded three ways: the VMM's watchdog and timeout, [`with_watchdog`] around
//! each test, and a kill of every child process this test started when it ends.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use pvspin_integration_tests::{kvm_or_skip, with_watchdog};
use pvspin_test_vm::config::PvMode;
use pvspin_test_vm::{run, RunConfig, RunConfigError, RunError};
use pvspin_test_vm_proto::{LockKind, Workload};

/// The environment variable that turns this binary into `pvspind`: its arguments, separated by
/// `\x1f`. The daemon runs as a child process of this test binary ([`daemon_process`]), so it
/// is always the code under test (a separate `pvspind` binary could be a stale build), and
/// killing it is killing a real process.
const DAEMON_ARGS: &str = "PVSPIN_VHOST_TEST_DAEMON_ARGS";

/// The daemon child: `pvspind`'s process entry point, when [`DAEMON_ARGS`] is set; nothing
/// otherwise.
#[test]
fn daemon_process() {
    let Ok(args) = std::env::var(DAEMON_ARGS) else {
        return;
    };
    let args = std::iter::once("pvspind".to_string())
        .chain(args.split('\x1f').map(str::to_string))
        .collect::<Vec<_>>();
    let code = match pvspin_vhost::cli::main_process(args) {
        c if c == std::process::ExitCode::SUCCESS => 0,
        _ => 1,
    };
    #[allow(clippy::exit)] // the child's result is its exit code
    std::process::exit(code);
}

/// A scratch directory for sockets, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("pvspin-vhost-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the scratch directory");
        Self(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `pvspind`, killed when dropped.
struct Daemon {
    child: Child,
    control: PathBuf,
}

impl Daemon {
    fn start(sockets: &[&Path], control: &Path, max_vcpus: u32) -> Self {
        Self::start_with(sockets, control, max_vcpus, &[])
    }

    /// [`Self::start`] with more `pvspind` options.
    fn start_with(sockets: &[&Path], control: &Path, max_vcpus: u32, extra: &[&str]) -> Self {
        let mut args: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        for socket in sockets {
            args.push("--socket".into());
            args.push(socket.display().to_string());
        }
        args.extend([
            "--control".into(),
            control.display().to_string(),
            "--max-vcpus".into(),
            max_vcpus.to_string(),
        ]);
        let mut command = Command::new(std::env::current_exe().expect("the test binary"));
        command
            .args([
                "--exact",
                "daemon_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(DAEMON_ARGS, args.join("\x1f"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = command.spawn().expect("starting pvspind");
        let daemon = Self {
            child,
            control: control.to_path_buf(),
        };
        // Ready once every socket and the control socket exist (bounded).
        let start = Instant::now();
        while !(sockets.iter().all(|s| s.exists()) && control.exists()) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pvspind did not create its sockets within 10 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        daemon
    }

    /// The telemetry document in `format` (`json` or `prometheus`).
    fn telemetry(&self, format: &str) -> String {
        let mut stream = UnixStream::connect(&self.control).expect("connecting to --control");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        writeln!(stream, "{format}").expect("asking for telemetry");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("reading telemetry");
        text
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.telemetry("json")).expect("telemetry is JSON")
    }

    /// Kills the daemon with SIGKILL (a crash: no clean-up) and reaps it.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the daemon with SIGTERM; its exit status (bounded wait).
    fn terminate(mut self) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid with SIGTERM; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for pvspind") {
                return status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pvspind did not exit within 10 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kick wake-ups the daemon sent, over every VM it served (host-wide totals keep the VMs that
/// disconnected). Kicks to one vCPU that arrive between two of the daemon's wake-ups coalesce
/// into one (eventfd semantics, like KVM's `pv_unhalted`), so this is at most the guests'
/// count.
fn daemon_kicks(json: &serde_json::Value) -> u64 {
    json["host"]["totals"]["kicks"]
        .as_u64()
        .unwrap_or_else(|| panic!("no host.totals.kicks in {json}"))
}

fn lock_config(socket: &Path, lock: LockKind, pv: PvMode, vcpus: u32, user: bool) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock,
        // User mode runs natively: enough rounds that 4 vCPUs on 2 CPUs preempt holders. Kernel
        // mode is emulated (about 0.5 us an instruction): a few hundred rounds.
        iterations: if user { 30_000 } else { 300 },
        cs_work: if user { 1_000 } else { 20 },
        ncs_work: if user { 200 } else { 20 },
        pv,
        user_mode: user,
        vhost_user: Some(socket.to_path_buf()),
        watchdog_ms: 20_000,
        timeout_ms: 120_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

#[test]
fn lock_workload_counts_exactly_through_the_backend() {
    if kvm_or_skip("lock_workload_counts_exactly_through_the_backend").is_none() {
        return;
    }
    with_watchdog("vhost lock workload", Duration::from_secs(600), || {
        let scratch = Scratch::new("lock");
        let socket = scratch.path("vm.sock");
        let daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), 16);
        let mut halts = 0;
        for user in [true, false] {
            for lock in [LockKind::Ticket, LockKind::Queued] {
                for pv in [PvMode::Kick, PvMode::KickYield] {
                    for vcpus in [2, 4] {
                        let what = format!("{lock:?} {pv:?} x{vcpus} user={user}");
                        let config = lock_config(&socket, lock, pv, vcpus, user);
                        let report = run(&config).unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(
                            report.counter,
                            u64::from(vcpus) * config.iterations,
                            "{what}"
                        );
                        let frontend = report.vhost_user.expect("the frontend's counters");
                        assert_eq!(frontend.connects, 1, "{what}");
                        assert_eq!(frontend.backend_losses, 0, "{what}");
                        assert_eq!(frontend.start_failures, 0, "{what}");
                        halts += report.pv_halts;
                    }
                }
            }
        }
        assert!(
            halts > 0,
            "no waiter ever halted: the PV path was not exercised"
        );
        // The guests' kicks went through the daemon, and kick+yield's waiters told it whom
        // they wait for (what it does with that depends on its privileges: docs/pvspind.md).
        let json = daemon.json();
        assert!(daemon_kicks(&json) > 0, "{json}");
        assert!(
            json["host"]["totals"]["spin_notifications"].as_u64() > Some(0),
            "{json}"
        );
        assert_eq!(
            daemon.terminate().code(),
            Some(0),
            "SIGTERM ends pvspind cleanly"
        );
        assert!(!socket.exists(), "pvspind removes its socket");
    });
}

/// Direct kicks (`RunConfig::vhost_direct_kicks`): each kick queue's notification is an
/// ioeventfd on its vCPU's irqfd, so KVM delivers kicks and the daemon sees none, while it still
/// serves the hint pages. Counts exact on both locks, in user and kernel mode; the guests halted
/// and kicked, and no kick reached the daemon.
#[test]
fn direct_kicks_stay_in_kvm_and_the_daemon_serves_the_rest() {
    if kvm_or_skip("direct_kicks_stay_in_kvm_and_the_daemon_serves_the_rest").is_none() {
        return;
    }
    with_watchdog("vhost direct kicks", Duration::from_secs(600), || {
        let scratch = Scratch::new("direct");
        let socket = scratch.path("vm.sock");
        let daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), 4);
        let (mut halts, mut kicks) = (0, 0);
        for user in [true, false] {
            for lock in [LockKind::Ticket, LockKind::Queued] {
                let what = format!("{lock:?} user={user}");
                let mut config = lock_config(&socket, lock, PvMode::Kick, 4, user);
                config.vhost_direct_kicks = true;
                let report = run(&config).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(report.counter, 4 * config.iterations, "{what}");
                let frontend = report.vhost_user.expect("the frontend's counters");
                assert_eq!(
                    (frontend.connects, frontend.backend_losses),
                    (1, 0),
                    "{what}"
                );
                halts += report.pv_halts;
                kicks += report.pv_kicks;
            }
        }
        assert!(
            halts > 0 && kicks > 0,
            "no waiter halted and was kicked ({halts} halts, {kicks} kicks): the PV path was not exercised"
        );
        let json = daemon.json();
        assert_eq!(daemon_kicks(&json), 0, "kicks reached the daemon: {json}");
        assert!(
            json["host"]["totals"]["hint_page_registrations"].as_u64() >= Some(4),
            "the daemon no longer served the hint pages: {json}"
        );
    });
}

/// The daemon's most vCPUs per device, the ABI's 255 (`pvspin_vhost::config::
/// TRANSPORT_MAX_VCPUS`: 256 queues, every index vhost-user can name, none of them spin
/// queues), served to a 255-vCPU guest: all 256 queues set up, 255 hint pages registered
/// through the control queue, kicks past queue 63 (which vhost-user-backend's workers never
/// reached) delivered, counts exact, and spins reported on the control queue
/// (`OP_SPIN_NOTIFY`: no vCPU has a spin queue at this size).
#[test]
fn lock_workload_at_the_daemons_vcpu_limit() {
    const TEST: &str = "lock_workload_at_the_daemons_vcpu_limit";
    pvspin_integration_tests::kvm_required(TEST);
    let vcpus = pvspin_vhost::config::TRANSPORT_MAX_VCPUS;
    with_watchdog(TEST, Duration::from_secs(300), || {
        let scratch = Scratch::new("limit");
        let socket = scratch.path("vm.sock");
        let daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), vcpus);
        // Critical sections of a few microseconds (user mode runs natively): waiters queue
        // behind up to 254 others and halt, so kicks go through the daemon. (At 31 vCPUs, 100
        // acquisitions each once ran one vCPU after another on a quiet host, nobody waiting;
        // 1,000 each at 255 vCPUs take 70 s here, nearly every acquisition a halt.)
        let config = RunConfig {
            iterations: 200,
            cs_work: 20_000,
            watchdog_ms: 60_000,
            ..lock_config(&socket, LockKind::Queued, PvMode::KickYield, vcpus, true)
        };
        let start = Instant::now();
        let report = run(&config).unwrap_or_else(|e| panic!("{vcpus} vCPUs: {e}"));
        eprintln!(
            "{TEST}: {vcpus} vCPUs x {} in {:.1} s, {} halts",
            config.iterations,
            start.elapsed().as_secs_f64(),
            report.pv_halts
        );
        assert_eq!(report.counter, u64::from(vcpus) * config.iterations);
        assert!(report.pv_halts > 0 && report.pv_kicks > 0, "{report:?}");
        assert_eq!(report.per_vcpu.len(), vcpus as usize);
        for vcpu in &report.per_vcpu {
            assert_eq!(vcpu.acquisitions, config.iterations, "{vcpu:?}");
        }
        let frontend = report.vhost_user.expect("the frontend's counters");
        assert_eq!(frontend.connects, 1);
        assert_eq!(frontend.backend_losses, 0);
        assert_eq!(frontend.start_failures, 0);
        let json = daemon.json();
        assert_eq!(
            json["host"]["totals"]["hint_page_registrations"].as_u64(),
            Some(u64::from(vcpus)),
            "{json}"
        );
        assert!(daemon_kicks(&json) > 0, "{json}");
        // No vCPU has a spin queue at this size: every spin notification came through the
        // control queue. (The VM's per-vCPU counters leave the daemon's table with the VM.)
        let spins = json["host"]["totals"]["spin_notifications"].as_u64();
        eprintln!("{TEST}: {spins:?} spins reported on the control queue");
        assert!(spins > Some(0), "{json}");
        assert_eq!(
            json["host"]["totals"]["bad_inputs"].as_u64(),
            Some(0),
            "{json}"
        );
    });
}

/// The daemon runs pvspin's budget code: a 4-vCPU user-mode guest on this host's 2 CPUs
/// (issue 22's workload) halts about as often through pvspind as in process. Before (a fixed
/// notification window, no adaptation) nearly every acquisition through pvspind ended in a halt
/// and a kick while in process most spun through. With its defaults the daemon samples the
/// vCPU threads and takes wait reports but flags nobody `NOT_RUNNING` (opt-in,
/// `--flag-not-running`; `crates/pvspin-vhost/tests/daemon.rs` tests the flags).
///
/// The lock workload is bistable on a 2-CPU host: once waiters halt, each hand-over waits for
/// a wake-up and the next waiters halt too, in process as well (on a quiet machine most
/// in-process runs take 30,000-65,000 halts for 80,000 acquisitions, a few under 20,000;
/// through pvspind, whose kicks take a thread hop more, 50,000-80,000: `docs/benchmarks.md`
/// §11.2). So the bound is parity, not an absolute count: each attempt runs the in-process host
/// on the same workload, and pvspind's fewest halts over up to 8 attempts must not exceed 1.5x
/// the in-process runs' most plus 10% of the acquisitions. The fixed window of before failed
/// it whenever in process spun through (3,300-6,800 halts in process, 69,000-78,000 through
/// the daemon).
#[test]
fn budgets_adapt_through_the_daemon_so_guests_halt_as_in_process() {
    if kvm_or_skip("budgets_adapt_through_the_daemon_so_guests_halt_as_in_process").is_none() {
        return;
    }
    with_watchdog("vhost budgets", Duration::from_secs(900), || {
        let scratch = Scratch::new("budgets");
        let socket = scratch.path("vm.sock");
        // The daemon's defaults, as the parity benchmark runs it.
        let daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), 4);
        let config = |vhost: bool| RunConfig {
            vcpus: 4,
            workload: Workload::Lock,
            lock: LockKind::Ticket,
            iterations: 20_000,
            cs_work: 2_000,
            ncs_work: 2_000,
            pv: PvMode::Kick,
            user_mode: true,
            vhost_user: vhost.then(|| socket.clone()),
            watchdog_ms: 20_000,
            timeout_ms: 120_000,
            echo_console: false,
            ..RunConfig::default()
        };
        // Per attempt: (halts through pvspind, its guest seconds, halts in process, seconds).
        let mut attempts: Vec<(u64, f64, u64, f64)> = Vec::new();
        let acquisitions = 4 * config(true).iterations;
        let within = |attempts: &[(u64, f64, u64, f64)]| {
            let fewest = attempts.iter().map(|a| a.0).min().unwrap_or(u64::MAX);
            let most_in_process = attempts.iter().map(|a| a.2).max().unwrap_or(0);
            fewest <= most_in_process + most_in_process / 2 + acquisitions / 10
        };
        while attempts.len() < 8 && !within(&attempts) {
            let in_process = run(&config(false)).unwrap_or_else(|e| panic!("in process: {e}"));
            let report = run(&config(true)).unwrap_or_else(|e| panic!("through pvspind: {e}"));
            assert_eq!(report.counter, acquisitions);
            attempts.push((
                report.pv_halts,
                report.guest_seconds,
                in_process.pv_halts,
                in_process.guest_seconds,
            ));
        }
        let json = daemon.json();
        let totals = &json["host"]["totals"];
        assert!(
            within(&attempts),
            "through pvspind the guest halted far more than in process ({acquisitions} \
             acquisitions); (pvspind halts, seconds, in-process halts, seconds) per attempt: \
             {attempts:?}; daemon totals {totals}"
        );
        println!("budgets through pvspind: {attempts:#?}");
        // The budgets came from the guests' reports, and the sampler saw the vCPU threads (this
        // test's own, found by name through the peer pid) without flagging any: flags are
        // opt-in.
        assert!(totals["wait_reports"].as_u64() > Some(0), "{totals}");
        assert!(totals["sched_thread_reads"].as_u64() > Some(0), "{totals}");
        assert_eq!(totals["not_running_set"].as_u64(), Some(0), "{totals}");
    });
}

fn pingpong_config(socket: &Path, handoffs: u64, user: bool) -> RunConfig {
    RunConfig {
        vcpus: 2,
        workload: Workload::PingPong,
        iterations: handoffs,
        cs_work: 0,
        ncs_work: if user { 2_000 } else { 20 },
        pv: PvMode::Kick,
        user_mode: user,
        vhost_user: Some(socket.to_path_buf()),
        watchdog_ms: 10_000,
        timeout_ms: 300_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

#[test]
fn wait_kick_pairs_through_the_backend_lose_no_wakeup() {
    if kvm_or_skip("wait_kick_pairs_through_the_backend_lose_no_wakeup").is_none() {
        return;
    }
    with_watchdog("vhost wait/kick pairs", Duration::from_secs(600), || {
        let scratch = Scratch::new("pairs");
        let socket = scratch.path("vm.sock");
        let daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), 4);
        // 100,000 user-mode handoffs: each one is a kick through the backend and a wait. A lost
        // wake-up stops the ring and the VMM's watchdog fails the run.
        let report = run(&pingpong_config(&socket, 100_000, true))
            .unwrap_or_else(|e| panic!("user-mode ping-pong: {e}"));
        assert_eq!(report.counter, report.expected);
        // The last handoff needs no kick.
        assert!(report.pv_kicks >= 99_999, "kicks: {}", report.pv_kicks);
        // Kernel mode: `cli; hlt` woken by the REMRD MSI.
        let report = run(&pingpong_config(&socket, 2_000, false))
            .unwrap_or_else(|e| panic!("kernel-mode ping-pong: {e}"));
        assert_eq!(report.counter, report.expected);
        // A kick whose target saw the token while still spinning is only latched; when the
        // daemon's thread is descheduled such kicks to one vCPU coalesce. So the daemon sent
        // at most one wake-up per kick, and some.
        let kicks = daemon_kicks(&daemon.json());
        assert!(
            (1..=102_000).contains(&kicks),
            "the daemon sent {kicks} wake-ups for about 102,000 kicks"
        );
    });
}

#[test]
fn backend_killed_mid_run_the_guest_keeps_running_and_kicks_resume() {
    if kvm_or_skip("backend_killed_mid_run_the_guest_keeps_running_and_kicks_resume").is_none() {
        return;
    }
    with_watchdog("vhost backend restart", Duration::from_secs(600), || {
        let scratch = Scratch::new("restart");
        let socket = scratch.path("vm.sock");
        let control = scratch.path("control.sock");
        let daemon = Daemon::start(&[&socket], &control, 4);
        // In process (no seccomp). Long enough that the kill, the outage and the reconnection
        // fall inside the run on a much faster host too (here about 13 s in a debug build).
        let config = pingpong_config(&socket, 300_000, true);
        let vm = std::thread::spawn(move || run(&config));
        let daemon = kill_and_restart(daemon, &socket, &control, || vm.is_finished());
        let report = vm
            .join()
            .expect("the VMM thread")
            .unwrap_or_else(|e| panic!("ping-pong across a backend restart: {e}"));
        assert_eq!(report.counter, report.expected);
        let frontend = report.vhost_user.expect("the frontend's counters");
        assert!(frontend.backend_losses >= 1, "{frontend:?}");
        assert!(frontend.relayed_kicks > 0, "{frontend:?}");
        assert!(frontend.connects >= 2, "never reconnected: {frontend:?}");
        // The restarted daemon served kicks again.
        let kicks = daemon_kicks(&daemon.json());
        assert!(kicks > 0, "kicks did not resume through the new backend");

        // The same through the command line, whose threads run under seccomp filters
        // (`--seccomp enforce`): relaying and reconnecting need no syscall they lack.
        let args: Vec<String> = [
            "run",
            "--workload",
            "pingpong",
            "--pv",
            "kick",
            "--vcpus",
            "2",
            "--cs-mode",
            "user",
            "--iterations",
            "300000",
            "--cs-work",
            "0",
            "--ncs-work",
            "2000",
            "--quiet",
            "--pv-backend",
            &format!("vhost-user:{}", socket.display()),
        ]
        .map(str::to_string)
        .to_vec();
        let mut child = VmmChild::spawn(&args);
        let daemon = kill_and_restart(daemon, &socket, &control, || {
            child.0.try_wait().ok().flatten().is_some()
        });
        let (status, out) = child.finish("the VMM under seccomp across a backend restart");
        assert!(status.success(), "{out}");
        let report: serde_json::Value = out
            .lines()
            .find(|line| line.starts_with('{'))
            .and_then(|line| serde_json::from_str(line).ok())
            .unwrap_or_else(|| panic!("no JSON report in {out}"));
        let frontend = &report["vhost_user"];
        assert!(frontend["backend_losses"].as_u64() >= Some(1), "{frontend}");
        assert!(frontend["relayed_kicks"].as_u64() > Some(0), "{frontend}");
        assert!(frontend["connects"].as_u64() >= Some(2), "{frontend}");

        // The new backend knows none of the hint pages; the device's ConfigGeneration tells
        // the guest, which registers them again, and its spin notifications count again.
        let mut config = lock_config(&socket, LockKind::Ticket, PvMode::KickYield, 4, true);
        config.iterations = 60_000;
        let vm = std::thread::spawn(move || run(&config));
        let daemon = kill_and_restart(daemon, &socket, &control, || vm.is_finished());
        let report = vm
            .join()
            .expect("the VMM thread")
            .unwrap_or_else(|e| panic!("lock workload across a backend restart: {e}"));
        assert_eq!(report.counter, report.expected);
        let json = daemon.json();
        let totals = &json["host"]["totals"];
        assert!(
            totals["hint_page_registrations"].as_u64() >= Some(4),
            "the guest did not register its pages with the new backend: {json}"
        );
        assert!(totals["spin_notifications"].as_u64() > Some(0), "{json}");
    });
}

/// A request the lost backend took (its notification read) but never answered is still in
/// the ring past the used index the next backend starts from; with no notification left, the
/// next backend must still answer it. The guest's control queue depends on it: a request in
/// flight holds the queue, so the driver sends nothing that would notify it again, and its
/// hint pages are never registered with the new backend. The test plays the driver through
/// the device's registers and posts the request without notifying: to the backends, the same
/// as a notification the first one read before it died.
#[test]
fn a_request_the_lost_backend_took_is_answered_by_the_next() {
    const TEST: &str = "a_request_the_lost_backend_took_is_answered_by_the_next";
    let Some(kvm) = kvm_or_skip(TEST) else {
        return;
    };
    with_watchdog(TEST, Duration::from_secs(120), || {
        use event_manager::SubscriberOps;
        use pvspin_abi::virtio::{self, ControlRequest};
        use pvspin_test_vm::vhost::{BackendWatch, VhostPvspin};
        use vm_memory::{Bytes, GuestAddress};

        const BASE: u64 = 0xd000_0000;
        const DESC: u64 = 0x1_0000;
        const AVAIL: u64 = 0x1_1000;
        const USED: u64 = 0x1_2000;
        const REQUEST: u64 = 0x1_3000;
        const STATUS: u64 = 0x1_4000;
        let scratch = Scratch::new("taken");
        let socket = scratch.path("vm.sock");
        let control = scratch.path("control.sock");
        let daemon = Daemon::start(&[&socket], &control, 4);
        let vm = kvm.create_vm().expect("KVM_CREATE_VM");
        vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
        let memory = pvspin_test_vm::memory::create_shared(1 << 20).expect("guest memory");
        let device = VhostPvspin::connect(&socket, BASE, 1, memory.clone(), &vm, false)
            .expect("connecting to pvspind");
        let reg = |offset: u64, value: u32| device.write(BASE + offset, &value.to_le_bytes());
        let used_idx = || {
            memory
                .read_obj::<u16>(GuestAddress(USED + 2))
                .expect("used.idx")
        };

        // The driver: VERSION_1 only; the control queue (4 entries) only.
        reg(0x070, 1);
        reg(0x070, 1 | 2);
        reg(0x024, 1);
        reg(0x020, 1 << (virtio::F_VERSION_1 - 32));
        reg(0x070, 1 | 2 | 8);
        reg(0x030, u32::from(virtio::CONTROL_QUEUE));
        reg(0x038, 4);
        reg(0x080, DESC as u32);
        reg(0x090, AVAIL as u32);
        reg(0x0a0, USED as u32);
        reg(0x044, 1);
        reg(0x070, 1 | 2 | 8 | 4);
        assert_eq!(device.summary().start_failures, 0, "{:?}", device.summary());

        // One request (an op the device does not know: any answer will do), posted and not
        // notified.
        let request = ControlRequest {
            op: 0x7fff,
            vcpu: 0,
            gpa: 0,
            arg: 0,
        };
        memory
            .write_slice(&request.to_bytes(), GuestAddress(REQUEST))
            .expect("request");
        memory
            .write_obj(u32::MAX, GuestAddress(STATUS))
            .expect("status");
        let descriptor = |addr: u64, len: u32, flags: u16, next: u16| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&addr.to_le_bytes());
            bytes[8..12].copy_from_slice(&len.to_le_bytes());
            bytes[12..14].copy_from_slice(&flags.to_le_bytes());
            bytes[14..].copy_from_slice(&next.to_le_bytes());
            bytes
        };
        let request_len = ControlRequest::SIZE as u32;
        memory
            .write_slice(&descriptor(REQUEST, request_len, 1, 1), GuestAddress(DESC))
            .expect("descriptor 0");
        memory
            .write_slice(&descriptor(STATUS, 4, 2, 0), GuestAddress(DESC + 16))
            .expect("descriptor 1");
        memory
            .write_obj(0u16, GuestAddress(AVAIL + 4))
            .expect("avail.ring[0]");
        memory
            .write_obj(1u16, GuestAddress(AVAIL + 2))
            .expect("avail.idx");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            used_idx(),
            0,
            "the first backend answered without a notification"
        );

        // The backend dies; the VMM's event loop notices, and reconnects to the next one.
        let mut events =
            event_manager::EventManager::<Box<dyn event_manager::MutEventSubscriber + Send>>::new()
                .expect("event loop");
        events.add_subscriber(Box::new(
            BackendWatch::new(device.clone()).expect("the backend watch"),
        ));
        let run_until =
            |events: &mut event_manager::EventManager<_>, what: &str, done: &dyn Fn() -> bool| {
                let start = Instant::now();
                while !done() {
                    assert!(
                        start.elapsed() < Duration::from_secs(20),
                        "{what}: {:?}",
                        device.summary()
                    );
                    events.run_with_timeout(50).expect("event loop");
                }
            };
        daemon.kill();
        run_until(&mut events, "the loss was not noticed", &|| {
            device.summary().backend_losses == 1
        });
        let _ = std::fs::remove_file(&control);
        let daemon = Daemon::start(&[&socket], &control, 4);
        run_until(&mut events, "no reconnection", &|| {
            device.summary().connects == 2
        });

        let start = Instant::now();
        while used_idx() != 1 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the new backend never answered the request the lost one took: {:?}",
                device.summary()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let status: u32 = memory.read_obj(GuestAddress(STATUS)).expect("status");
        assert_eq!(status, virtio::STATUS_BAD_REQUEST);
        assert!(device.summary().replayed_notifications >= 1);
        drop(daemon);
    });
}

/// Kills `daemon` once it has served this guest 2,000 kicks (not after a fixed time:
/// the run's speed depends on the host), leaves the guest without a backend for 300 ms (the
/// frontend relays kicks and fails to reconnect every 100 ms), then starts a new daemon on the
/// same socket. `finished` says whether the run already ended, which would make the test
/// vacuous: it fails then.
fn kill_and_restart(
    daemon: Daemon,
    socket: &Path,
    control: &Path,
    mut finished: impl FnMut() -> bool,
) -> Daemon {
    let start = Instant::now();
    let before = daemon_kicks(&daemon.json());
    while daemon_kicks(&daemon.json()) < before + 2_000 && !finished() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the guest did not start kicking"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!finished(), "the run ended before the backend was killed");
    daemon.kill();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!finished(), "the run ended before the backend came back");
    let _ = std::fs::remove_file(control);
    Daemon::start(&[socket], control, 4)
}

/// The environment variable that turns this binary into the example VMM: its arguments,
/// separated by `\x1f`.
const CHILD_ARGS: &str = "PVSPIN_VHOST_TEST_VMM_ARGS";

/// The child: the example VMM's process entry point, when [`CHILD_ARGS`] is set; nothing
/// otherwise.
#[test]
fn vmm_process() {
    pvspin_integration_tests::run_vmm_child_if_asked(CHILD_ARGS);
}

/// A VMM child process running `args`, killed when dropped.
struct VmmChild(Child);

impl VmmChild {
    fn spawn(args: &[String]) -> Self {
        let child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "vmm_process", "--nocapture", "--test-threads=1"])
            .env(CHILD_ARGS, args.join("\x1f"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a VMM child");
        Self(child)
    }

    /// Waits (bounded) for the child; its status and output.
    fn finish(mut self, what: &str) -> (ExitStatus, String) {
        let start = Instant::now();
        while self
            .0
            .try_wait()
            .expect("waiting for a VMM child")
            .is_none()
        {
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "{what}: still running after 180 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = self.0.wait().expect("reaping a VMM child");
        let mut out = String::new();
        if let Some(mut stdout) = self.0.stdout.take() {
            let _ = stdout.read_to_string(&mut out);
        }
        if let Some(mut stderr) = self.0.stderr.take() {
            let _ = stderr.read_to_string(&mut out);
        }
        (status, out)
    }
}

impl Drop for VmmChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn vm_args(socket: &Path, iterations: u64) -> Vec<String> {
    [
        "run",
        "--workload",
        "lock",
        "--pv",
        "kick",
        "--vcpus",
        "2",
        "--cs-mode",
        "user",
        "--iterations",
        &iterations.to_string(),
        "--cs-work",
        "1000",
        "--ncs-work",
        "200",
        "--quiet",
        "--pv-backend",
        &format!("vhost-user:{}", socket.display()),
    ]
    .map(str::to_string)
    .to_vec()
}

#[test]
fn one_daemon_serves_two_vms_and_a_crashed_vm_costs_the_other_nothing() {
    if kvm_or_skip("one_daemon_serves_two_vms_and_a_crashed_vm_costs_the_other_nothing").is_none() {
        return;
    }
    with_watchdog("vhost two VMs", Duration::from_secs(600), || {
        let scratch = Scratch::new("two-vms");
        let (a, b) = (scratch.path("a.sock"), scratch.path("b.sock"));
        let daemon = Daemon::start(&[&a, &b], &scratch.path("control.sock"), 4);
        // Both at once, each under the example's seccomp filters (the CLI's default).
        // About 0.7 s each at native speed here: they overlap.
        let first = VmmChild::spawn(&vm_args(&a, 1_000_000));
        let second = VmmChild::spawn(&vm_args(&b, 1_000_000));
        let (status, out) = first.finish("VM a");
        assert!(status.success(), "VM a failed: {out}");
        let (status, out) = second.finish("VM b");
        assert!(status.success(), "VM b failed: {out}");
        let json = daemon.json();
        assert!(daemon_kicks(&json) > 0, "{json}");
        assert_eq!(
            json["host"]["connections_total"].as_u64(),
            Some(2),
            "{json}"
        );

        // A VM killed mid-run (no clean-up: its socket just closes) while the other runs.
        let victim = VmmChild::spawn(&vm_args(&a, 10_000_000));
        let mut survivor = VmmChild::spawn(&vm_args(&b, 2_000_000));
        // Kill the victim while both are connected and the survivor still runs.
        let start = Instant::now();
        while daemon.json()["host"]["connections_active"].as_u64() != Some(2) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the two VMs did not both connect"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            survivor
                .0
                .try_wait()
                .expect("polling the survivor")
                .is_none(),
            "the surviving VM ended before the other was killed"
        );
        drop(victim);
        let (status, out) = survivor.finish("the surviving VM");
        assert!(status.success(), "the surviving VM failed: {out}");
        // The killed VM's socket serves the next VM.
        let (status, out) = VmmChild::spawn(&vm_args(&a, 10_000)).finish("VM a again");
        assert!(
            status.success(),
            "a new VM on the killed VM's socket failed: {out}"
        );
        let prometheus = daemon.telemetry("prometheus");
        assert!(prometheus.contains("pvspin_"), "{prometheus}");
    });
}

#[test]
fn a_guest_that_notifies_in_a_loop_is_paced_and_changes_only_its_own_threads() {
    if kvm_or_skip("a_guest_that_notifies_in_a_loop_is_paced_and_changes_only_its_own_threads")
        .is_none()
    {
        return;
    }
    with_watchdog("vhost abuse", Duration::from_secs(300), || {
        let scratch = Scratch::new("abuse");
        let socket = scratch.path("vm.sock");
        // Boosts allowed where confined: this test's process shares its cgroup (with the
        // daemon, at least), so a confined daemon must refuse every one. The pacing limit is
        // the lowest the daemon takes (1,000 events a second), so that the guest exceeds it
        // however loaded the machine is (at the default 20,000 a loaded CI run once did not).
        let daemon = Daemon::start_with(
            &[&socket],
            &scratch.path("control.sock"),
            4,
            &["--yield", "confined", "--max-events-per-sec", "1000"],
        );
        // Every vCPU but 0 names vCPU 0 in a spin notification and kicks it, round after
        // round, as fast as its exits allow (about 200,000 notifications a second here).
        let config = RunConfig {
            vcpus: 2,
            workload: Workload::Abuse,
            iterations: 100_000,
            cs_work: 100,
            ncs_work: 0,
            pv: PvMode::KickYield,
            user_mode: true,
            vhost_user: Some(socket.clone()),
            watchdog_ms: 20_000,
            timeout_ms: 120_000,
            echo_console: false,
            ..RunConfig::default()
        };
        let report = run(&config).unwrap_or_else(|e| panic!("abusive guest: {e}"));
        assert_eq!(report.counter, report.expected);
        let json = daemon.json();
        let totals = &json["host"]["totals"];
        // The daemon's rate (1,000 events a second here) was reached: its worker thread slept
        // instead of serving every notification.
        assert!(totals["paced"].as_u64() > Some(0), "{json}");
        // Whatever it did to threads (deboosts need CAP_SYS_NICE to be undone), it boosted
        // none: the VMM is not alone in its own cpu cgroup, and it said so for the waits that
        // named another vCPU.
        assert_eq!(totals["boosts"].as_u64(), Some(0), "{json}");
        assert!(
            totals["boost_refused_unconfined"].as_u64() > Some(0),
            "{json}"
        );
    });
}

#[test]
fn the_vmm_names_the_rule_it_refuses() {
    if kvm_or_skip("the_vmm_names_the_rule_it_refuses").is_none() {
        return;
    }
    with_watchdog("vhost refusals", Duration::from_secs(120), || {
        let scratch = Scratch::new("refusals");
        let socket = scratch.path("vm.sock");
        // Run slots need the in-process userspace kick path.
        let mut config = lock_config(&socket, LockKind::Ticket, PvMode::Kick, 2, true);
        config.run_slots = Some(1);
        match run(&config) {
            Err(RunError::Config(RunConfigError::VhostUserNeeds)) => {}
            other => panic!("slots with vhost-user: {other:?}"),
        }
        // Direct kicks wire the vhost-user device's queues: not without one.
        let mut config = lock_config(&socket, LockKind::Ticket, PvMode::Kick, 2, true);
        config.vhost_user = None;
        config.vhost_direct_kicks = true;
        match run(&config) {
            Err(RunError::Config(RunConfigError::DirectKicksNeedVhostUser)) => {}
            other => panic!("direct kicks without vhost-user: {other:?}"),
        }
        // No backend listening: the setup error names the socket.
        let config = lock_config(&socket, LockKind::Ticket, PvMode::Kick, 2, true);
        match run(&config) {
            Err(err) => assert!(err.to_string().contains("vm.sock"), "{err}"),
            Ok(_) => panic!("a run without a backend succeeded"),
        }
        // A backend serving fewer vCPUs than the VM has is refused, naming both counts.
        let _daemon = Daemon::start(&[&socket], &scratch.path("control.sock"), 2);
        let config = lock_config(&socket, LockKind::Ticket, PvMode::Kick, 4, true);
        match run(&config) {
            Err(err) => assert!(
                err.to_string().contains("serves 2 vCPUs, the VM has 4"),
                "{err}"
            ),
            Ok(_) => panic!("a 4-vCPU VM ran on a 2-vCPU backend"),
        }
    });
}
