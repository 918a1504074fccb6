//! The example VMM's stock guest mode (`--guest stock`) on real /dev/kvm: a guest that uses
//! only what Linux's pv qspinlock uses on KVM (a kick, a halt inside KVM, steal time), on the
//! same host a pvspin-aware guest gets. Its lock counts are exact on the in-kernel and
//! signal-msi kick paths, in kernel and user mode, with 2 and 4 vCPUs; pvspin's telemetry
//! shows no pvspin-ABI traffic from it (no hint-page registrations, no spin notifications, no
//! doorbell access but KICK and, in user mode, WAIT); a pvspin-aware guest on the same host
//! does register its hint pages, so the check is not vacuous.
//!
//! These tests fail, not skip, without /dev/kvm. Every run is bounded by the VMM's own
//! watchdog and timeout, and a test watchdog aborts the process if a run still hangs. Kernel
//! mode is emulated here (about 0.5 us per guest instruction): the iteration counts are small.

use std::time::Duration;

use pvspin::KickPath;
use pvspin_integration_tests::{kvm_required, with_watchdog};
use pvspin_test_vm::config::{GuestKind, PvMode};
use pvspin_test_vm::{run, RunConfig, RunConfigError, RunError, RunReport};
use pvspin_test_vm_proto::{LockKind, Workload};

/// The longest a whole test may take before its watchdog aborts the process.
const TEST_BOUND: Duration = Duration::from_secs(600);

/// A stock guest's PV lock run, small enough for emulated kernel mode; a tiny spin threshold
/// and long critical sections make waiters halt and unlockers kick even without overcommit.
/// User mode runs natively, where one vCPU can do all its acquisitions in one host time slice
/// without ever meeting another: long critical sections, enough of them that each vCPU spans
/// several slices, and two busy host threads, so lock holders get preempted mid-section.
fn stock(path: KickPath, user_mode: bool, vcpus: u32) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock: LockKind::Queued,
        guest: GuestKind::Stock,
        pv: PvMode::Kick,
        kick_path: path,
        user_mode,
        iterations: if user_mode { 50_000 } else { 60 },
        cs_work: if user_mode { 1_000 } else { 40 },
        ncs_work: 5,
        hogs: if user_mode { 2 } else { 0 },
        stock_spin_threshold: 4,
        watchdog_ms: 20_000,
        timeout_ms: 120_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

fn run_ok(config: &RunConfig, what: &str) -> RunReport {
    let report = run(config).unwrap_or_else(|err| panic!("{what}: {err}"));
    let expected = u64::from(config.vcpus) * config.iterations;
    assert_eq!(report.counter, expected, "{what}: lost updates");
    let per_vcpu: u64 = report.per_vcpu.iter().map(|vcpu| vcpu.acquisitions).sum();
    assert_eq!(per_vcpu, expected, "{what}: per-vCPU acquisitions");
    report
}

/// What pvspin counted of the guest's use of its ABI: nothing but KICKs and (user mode)
/// WAITs, no hint page, no spin notification, nothing ignored.
fn assert_no_pvspin_abi_traffic(report: &RunReport, config: &RunConfig, what: &str) {
    let telemetry = report.telemetry.as_ref().expect("telemetry");
    // The host offered hint pages (the same host as for a pvspin-aware guest)...
    let hints = telemetry.hints.expect("the host offers hint pages");
    // ...and the stock guest registered none and reported no wait through one.
    assert_eq!(
        (
            hints.registrations,
            hints.bad_registrations,
            hints.wait_reports
        ),
        (0, 0, 0),
        "{what}: {hints:?}"
    );
    // No directed yield on the host, so no spin notification could act; and none was sent:
    // a SPIN (or a window read) would be an access rejected as "not enabled".
    assert!(telemetry.directed_yield.is_none(), "{what}");
    let kick = telemetry.kick.expect("kick device");
    assert_eq!(kick.path, config.kick_path, "{what}");
    let stats = kick.stats;
    assert_eq!(stats.rejected_total(), 0, "{what}: {stats:?}");
    // Every doorbell access that exited was a KICK (signal-msi) or a WAIT (user mode): the
    // forwarded commands are exactly the WAITs the host handled.
    assert_eq!(stats.forwarded, hints.waits, "{what}: {stats:?} {hints:?}");
    assert_eq!(stats.accesses, stats.kicks + stats.forwarded, "{what}");
    if !config.user_mode {
        // Kernel mode halts with hlt: not one WAIT.
        assert_eq!(hints.waits, 0, "{what}");
    } else {
        // A WAIT per halt that found the lock still taken (a halt may return at once).
        assert!(hints.waits <= report.pv_halts, "{what}: {hints:?}");
    }
    for vcpu in &telemetry.vcpus {
        assert!(
            vcpu.pvspin.rejected_guest_inputs.is_empty(),
            "{what}: vCPU {}: {:?}",
            vcpu.vcpu,
            vcpu.pvspin.rejected_guest_inputs
        );
        assert!(vcpu.pvspin.directed_yield.is_none(), "{what}");
        // With the in-kernel irqchip a halt stays in KVM.
        assert_eq!(vcpu.pvspin.exits.hlt, 0, "{what}");
    }
    // The kicks: in-kernel ones never exit; on signal-msi the host delivered every one.
    match config.kick_path {
        KickPath::InKernel => assert_eq!(report.host_kicks_in_userspace, Some(0), "{what}"),
        _ => assert_eq!(
            report.host_kicks_in_userspace,
            Some(report.pv_kicks),
            "{what}: the host handled every kick the guest sent"
        ),
    }
    assert!(report.pv_kicks <= report.pv_slow_paths, "{what}");
    // The guest registered steal time (KVM offers it): its preempted bytes were live.
    assert_eq!(
        report.steal_time_registered,
        Some(config.vcpus),
        "{what}: every vCPU registered its steal-time area"
    );
    assert_eq!(report.guest, "stock", "{what}");
}

#[test]
fn stock_guest_counts_exactly_without_pvspin_abi_traffic() {
    let test = "stock_guest_counts_exactly_without_pvspin_abi_traffic";
    kvm_required(test);
    with_watchdog(test, TEST_BOUND, || {
        for path in [KickPath::InKernel, KickPath::SignalMsi] {
            for user_mode in [false, true] {
                let (mut halts, mut kicks) = (0, 0);
                for vcpus in [2, 4] {
                    let config = stock(path, user_mode, vcpus);
                    let what = format!("stock {path:?} user {user_mode} x{vcpus}");
                    let report = run_ok(&config, &what);
                    assert_no_pvspin_abi_traffic(&report, &config, &what);
                    halts += report.pv_halts;
                    kicks += report.pv_kicks;
                    eprintln!(
                        "{what}: {} slow paths, {} halts, {} kicks, {} spurious, {} early, {} preempted",
                        report.pv_slow_paths,
                        report.pv_halts,
                        report.pv_kicks,
                        report.pv_spurious_wakeups,
                        report.pv_wait_early,
                        report.pv_preempted
                    );
                }
                // Over both runs some waiter must have halted and been kicked, or the PV path
                // was not exercised at all.
                assert!(
                    halts > 0 && kicks > 0,
                    "stock {path:?} user {user_mode}: {halts} halts, {kicks} kicks"
                );
            }
        }
    });
}

/// The contrast: the same host, a pvspin-aware guest, registers a hint page per vCPU, so the
/// zero counts above are the stock guest's doing.
#[test]
fn pvspin_guest_on_the_same_host_does_use_the_abi() {
    let test = "pvspin_guest_on_the_same_host_does_use_the_abi";
    kvm_required(test);
    with_watchdog(test, TEST_BOUND, || {
        let config = RunConfig {
            guest: GuestKind::Pvspin,
            spin_threshold: 4,
            ..stock(KickPath::InKernel, false, 2)
        };
        let report = run_ok(&config, "pvspin guest");
        let hints = report
            .telemetry
            .as_ref()
            .and_then(|t| t.hints)
            .expect("hints");
        assert_eq!(hints.registrations, 2, "{hints:?}");
        assert_eq!(report.guest, "pvspin");
        assert_eq!(report.steal_time_registered, None);
    });
}

#[test]
fn stock_guest_without_pv_runs_plain_locks() {
    let test = "stock_guest_without_pv_runs_plain_locks";
    kvm_required(test);
    with_watchdog(test, TEST_BOUND, || {
        for lock in [LockKind::Queued, LockKind::Ticket] {
            for vcpus in [2, 4] {
                let config = RunConfig {
                    lock,
                    pv: PvMode::Off,
                    ..stock(KickPath::InKernel, false, vcpus)
                };
                let what = format!("stock {lock:?} pv off x{vcpus}");
                let report = run_ok(&config, &what);
                assert_eq!(
                    (report.pv_slow_paths, report.pv_halts, report.pv_kicks),
                    (0, 0, 0),
                    "{what}"
                );
                assert!(report.telemetry.as_ref().is_some_and(|t| t.kick.is_none()));
            }
        }
    });
}

#[test]
fn stock_guest_refusals_reach_the_caller() {
    let test = "stock_guest_refusals_reach_the_caller";
    kvm_required(test);
    with_watchdog(test, TEST_BOUND, || {
        let refused = |config: RunConfig| match run(&config) {
            Err(RunError::Config(err)) => err,
            other => panic!(
                "expected a refusal, got {:?}",
                other.map(|r| r.summary_line())
            ),
        };
        assert_eq!(
            refused(stock(KickPath::Userspace, false, 2)),
            RunConfigError::StockGuestNeedsInKernelLapic
        );
        assert_eq!(
            refused(RunConfig {
                lock: LockKind::Ticket,
                ..stock(KickPath::InKernel, false, 2)
            }),
            RunConfigError::StockGuestNoPvLock
        );
    });
}

/// Run slots with a stock guest (issue 17): halts and kicks stay inside KVM, so the slots see
/// them only through KVM's `blocking` statistic (the halt watcher). Lock counts stay exact on
/// the in-kernel and signal-msi paths, in kernel and user mode; halted holders' slots were lent;
/// every `blocking` read worked; the guest still used no pvspin ABI; and vCPUs waiting for a
/// slot were shown to it through its steal-time `preempted` byte.
#[test]
fn stock_guest_under_run_slots_counts_exactly() {
    let test = "stock_guest_under_run_slots_counts_exactly";
    kvm_required(test);
    with_watchdog(test, TEST_BOUND, || {
        for path in [KickPath::InKernel, KickPath::SignalMsi] {
            for user_mode in [false, true] {
                let config = RunConfig {
                    run_slots: Some(2),
                    ..stock(path, user_mode, 4)
                };
                let what = format!("stock + 2 slots, {path:?} user {user_mode} x4");
                let report = run_ok(&config, &what);
                assert_no_pvspin_abi_traffic(&report, &config, &what);
                let slots = report.run_slots.expect("slot telemetry");
                assert!(slots.lends > 0, "{what}: no slot lent: {slots:?}");
                assert!(slots.waits > 0, "{what}: nobody waited: {slots:?}");
                assert_eq!(slots.watch_read_errors, 0, "{what}: {slots:?}");
                assert!(
                    slots.steal_time_marks > 0,
                    "{what}: no wait shown to the guest: {slots:?}"
                );
                eprintln!("{what}: {slots:?}");
            }
        }
    });
}
