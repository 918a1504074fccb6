//! PV locks and the kick device on real guests: exact counters on every wake path, host and
//! guest agreeing on the kicks, and the no-lost-wakeups stress (a token ring of pv_wait /
//! pv_kick pairs with random delays; a lost wake-up stops the ring and the VMM's watchdog fails
//! the run instead of hanging).

use pvspin::KickPath;
use pvspin_integration_tests::kvm_or_skip;
use pvspin_test_vm::config::PvMode;
use pvspin_test_vm::{run, RunConfig, RunConfigError, RunError};
use pvspin_test_vm_proto::{LockKind, Workload};

const PATHS: [KickPath; 3] = [KickPath::InKernel, KickPath::SignalMsi, KickPath::Userspace];

fn pv_config(lock: LockKind, path: KickPath, vcpus: u32) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock,
        iterations: 80,
        // Long critical sections, short gaps and a tiny threshold: waiters halt even
        // without overcommit.
        cs_work: 40,
        ncs_work: 5,
        pv: PvMode::Kick,
        kick_path: path,
        spin_threshold: 4,
        watchdog_ms: 20_000,
        timeout_ms: 120_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

#[test]
fn pv_locks_count_exactly_on_every_kick_path() {
    if kvm_or_skip("pv_locks_count_exactly_on_every_kick_path").is_none() {
        return;
    }
    for lock in [LockKind::Ticket, LockKind::Queued] {
        for path in PATHS {
            let (mut halts, mut kicks) = (0, 0);
            for vcpus in [2, 4] {
                let config = pv_config(lock, path, vcpus);
                let report =
                    run(&config).unwrap_or_else(|err| panic!("{lock:?} {path:?} x{vcpus}: {err}"));
                let expected = u64::from(vcpus) * config.iterations;
                assert_eq!(report.counter, expected, "{lock:?} {path:?} x{vcpus}");
                halts += report.pv_halts;
                kicks += report.pv_kicks;
                match path {
                    // In-kernel kicks never exit to the VMM: no fallback was needed, and
                    // KVM's halt_wakeup stands in for the count, labeled as KVM's.
                    KickPath::InKernel => {
                        assert_eq!(report.host_kicks_in_userspace, Some(0));
                        assert!(
                            report.kvm_halt_wakeups.is_some(),
                            "{lock:?} {path:?}: KVM's halt_wakeup stands in for in-kernel kicks"
                        );
                    }
                    _ => {
                        assert_eq!(
                            report.host_kicks_in_userspace,
                            Some(report.pv_kicks),
                            "{lock:?} {path:?}: the host handled every kick the guest sent"
                        );
                        assert_eq!(report.kvm_halt_wakeups, None, "{lock:?} {path:?}");
                    }
                }
            }
            // Whether a given run halts depends on timing; over both runs some waiter must
            // have halted and been kicked, or the PV path was not exercised at all.
            assert!(
                halts > 0 && kicks > 0,
                "{lock:?} {path:?}: {halts} halts, {kicks} kicks"
            );
        }
    }
}

#[test]
fn pv_off_queued_lock_is_a_plain_mcs_lock() {
    if kvm_or_skip("pv_off_queued_lock_is_a_plain_mcs_lock").is_none() {
        return;
    }
    let config = RunConfig {
        pv: PvMode::Off,
        ..pv_config(LockKind::Queued, KickPath::InKernel, 4)
    };
    let report = run(&config).expect("queued lock without PV");
    assert_eq!(report.counter, 4 * config.iterations);
    assert_eq!((report.pv_halts, report.pv_kicks), (0, 0));
}

fn pingpong(path: KickPath, handoffs: u64) -> RunConfig {
    RunConfig {
        vcpus: 2,
        workload: Workload::PingPong,
        iterations: handoffs,
        cs_work: 0,
        ncs_work: 20,
        pv: PvMode::Kick,
        kick_path: path,
        watchdog_ms: 10_000,
        timeout_ms: 600_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

/// At least 100,000 wait/kick pairs on the in-kernel path (the default) and 20,000 on each of
/// the others, with random delays before each kick and each wait.
#[test]
fn no_lost_wakeups_under_a_pv_wait_kick_stress() {
    if kvm_or_skip("no_lost_wakeups_under_a_pv_wait_kick_stress").is_none() {
        return;
    }
    for (path, handoffs) in [
        (KickPath::InKernel, 100_000),
        (KickPath::SignalMsi, 20_000),
        (KickPath::Userspace, 20_000),
    ] {
        let report = run(&pingpong(path, handoffs)).unwrap_or_else(|err| panic!("{path:?}: {err}"));
        assert_eq!(report.counter, handoffs, "{path:?}");
        assert_eq!(
            report.pv_kicks,
            handoffs - 1,
            "{path:?}: one kick per handoff"
        );
        let latency = report.kick_to_wake.clone().expect("kick-to-wake samples");
        assert!(
            latency.samples > 0 && latency.p50_us > 0.0,
            "{path:?}: {latency:?}"
        );
        eprintln!("{}", report.summary_line());
    }
}

#[test]
fn pv_configuration_rules() {
    if kvm_or_skip("pv_configuration_rules").is_none() {
        return;
    }
    let tas = pv_config(LockKind::Tas, KickPath::InKernel, 2);
    assert!(matches!(
        run(&tas),
        Err(RunError::Config(RunConfigError::NoPvVariant))
    ));
    let no_pv = RunConfig {
        pv: PvMode::Off,
        ..pingpong(KickPath::InKernel, 10)
    };
    assert!(matches!(
        run(&no_pv),
        Err(RunError::Config(RunConfigError::PingPongNeedsPv))
    ));
}
