//! ABI 0.3 on real guests: PV locks whose waiters wait with the doorbell's WAIT command (guest
//! user mode, where `hlt` faults, and kernel mode by choice), time budgets from the hint page,
//! and the no-lost-wakeups stress of user-mode wait/kick pairs on every kick path. Guest user
//! mode runs natively on the development hosts, so these are the runs closest to hardware
//! speed. Every run has the VMM's watchdog: a lost wake-up fails, it does not hang.

use pvspin::KickPath;
use pvspin_integration_tests::kvm_or_skip;
use pvspin_test_vm::config::{BudgetMode, PvMode, WaitMode};
use pvspin_test_vm::{run, RunConfig, RunConfigError, RunError};
use pvspin_test_vm_proto::{LockKind, Workload};

const PATHS: [KickPath; 3] = [KickPath::InKernel, KickPath::SignalMsi, KickPath::Userspace];

fn user_lock(lock: LockKind, pv: PvMode, path: KickPath, vcpus: u32) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock,
        // About 0.1-0.3 s per run at native speed: long enough that 4 vCPUs on 2 host CPUs
        // are descheduled many times.
        iterations: 50_000,
        cs_work: 1_000,
        ncs_work: 200,
        pv,
        kick_path: path,
        user_mode: true,
        watchdog_ms: 20_000,
        timeout_ms: 120_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

#[test]
fn user_mode_pv_locks_count_exactly_on_every_kick_path() {
    if kvm_or_skip("user_mode_pv_locks_count_exactly_on_every_kick_path").is_none() {
        return;
    }
    for lock in [LockKind::Ticket, LockKind::Queued] {
        for pv in [PvMode::Kick, PvMode::KickYield] {
            for path in PATHS {
                let mut waits = 0;
                for vcpus in [2, 4] {
                    let config = user_lock(lock, pv, path, vcpus);
                    let report = run(&config)
                        .unwrap_or_else(|e| panic!("{lock:?} {pv:?} {path:?} x{vcpus}: {e}"));
                    assert_eq!(
                        report.counter,
                        u64::from(vcpus) * config.iterations,
                        "{lock:?} {pv:?} {path:?} x{vcpus}"
                    );
                    waits += report.pv_halts;
                }
                // Four vCPUs on two host CPUs: some waiter's holder is always descheduled,
                // so WAIT must have been used (or the PV path was not exercised).
                assert!(waits > 0, "{lock:?} {pv:?} {path:?}: no waiter ever waited");
            }
        }
    }
}

/// The ping-pong token ring in user mode: every handoff is one WAIT and one KICK.
fn user_pingpong(path: KickPath, handoffs: u64) -> RunConfig {
    RunConfig {
        vcpus: 2,
        workload: Workload::PingPong,
        iterations: handoffs,
        cs_work: 0,
        ncs_work: 2_000,
        pv: PvMode::Kick,
        kick_path: path,
        user_mode: true,
        watchdog_ms: 10_000,
        timeout_ms: 300_000,
        echo_console: false,
        ..RunConfig::default()
    }
}

/// 100,000 user-mode wait/kick pairs on the in-kernel path (the kicker never exits; the
/// waiter's WAIT is KVM's own halt), 20,000 on each other path. The 1,000,000-pair run is in
/// docs/benchmarks.md.
#[test]
fn user_mode_wait_kick_pairs_lose_no_wakeup() {
    if kvm_or_skip("user_mode_wait_kick_pairs_lose_no_wakeup").is_none() {
        return;
    }
    for (path, handoffs) in [
        (KickPath::InKernel, 100_000),
        (KickPath::SignalMsi, 20_000),
        (KickPath::Userspace, 20_000),
    ] {
        let report =
            run(&user_pingpong(path, handoffs)).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert_eq!(report.counter, handoffs, "{path:?}");
        assert!(report.pv_halts > 0, "{path:?}: nobody waited");
        assert!(report.pv_kicks >= handoffs - 1, "{path:?}");
    }
}

#[test]
fn kernel_mode_waiters_can_wait_through_the_doorbell() {
    if kvm_or_skip("kernel_mode_waiters_can_wait_through_the_doorbell").is_none() {
        return;
    }
    for path in PATHS {
        let config = RunConfig {
            iterations: 60,
            cs_work: 40,
            ncs_work: 5,
            wait: WaitMode::Doorbell,
            user_mode: false,
            vcpus: 3,
            ..user_lock(LockKind::Ticket, PvMode::Kick, path, 3)
        };
        let report = run(&config).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert_eq!(report.counter, 3 * config.iterations, "{path:?}");
    }
}

#[test]
fn spin_count_budgets_of_abi_0_2_still_work() {
    if kvm_or_skip("spin_count_budgets_of_abi_0_2_still_work").is_none() {
        return;
    }
    for pv in [PvMode::Kick, PvMode::KickYield] {
        let config = RunConfig {
            iterations: 60,
            cs_work: 40,
            ncs_work: 5,
            spin_threshold: 4,
            budgets: BudgetMode::Spins,
            user_mode: false,
            ..user_lock(LockKind::Queued, pv, KickPath::InKernel, 3)
        };
        let report = run(&config).unwrap_or_else(|e| panic!("{pv:?}: {e}"));
        assert_eq!(report.counter, 3 * config.iterations, "{pv:?}");
        assert!(report.pv_halts > 0, "{pv:?}: threshold 4 spins must halt");
    }
}

#[test]
fn user_mode_cannot_use_hlt() {
    let config = RunConfig {
        wait: WaitMode::Hlt,
        ..user_lock(LockKind::Ticket, PvMode::Kick, KickPath::InKernel, 2)
    };
    assert!(matches!(
        run(&config),
        Err(RunError::Config(RunConfigError::UserModeCannotHalt))
    ));
}

/// ABI 0.4's `VCPUS_FIT`: a waiter keeps spinning behind a just-kicked next owner only when
/// the host says the VM's vCPUs fit its CPUs (`--vm-cpus`). Told they do not, the guest never
/// does; told they do (4 vCPUs, which halt on the development hosts' 2 CPUs), it does.
#[test]
fn waiters_spin_behind_a_kicked_owner_only_when_told_the_vcpus_fit() {
    if kvm_or_skip("waiters_spin_behind_a_kicked_owner_only_when_told_the_vcpus_fit").is_none() {
        return;
    }
    let with = |cpus: usize| {
        let config = RunConfig {
            vm_cpus: Some(cpus),
            ..user_lock(LockKind::Ticket, PvMode::Kick, KickPath::InKernel, 4)
        };
        let report = run(&config).unwrap_or_else(|e| panic!("--vm-cpus {cpus}: {e}"));
        assert_eq!(report.counter, 4 * config.iterations, "--vm-cpus {cpus}");
        report
    };
    let crowded = with(2);
    assert_eq!(crowded.pv_behind_waking, 0, "not told: never");
    // Whether a waiter meets a kicked owner is timing; three tries make a miss very unlikely.
    let told: Vec<u64> = (0..3)
        .map(|_| with(4))
        .map(|r| r.pv_behind_waking)
        .take_while(|&n| n == 0)
        .collect();
    assert!(
        told.len() < 3,
        "told the vCPUs fit, no waiter ever kept spinning"
    );
    assert!(matches!(
        run(&RunConfig {
            vm_cpus: Some(0),
            ..user_lock(LockKind::Ticket, PvMode::Kick, KickPath::InKernel, 2)
        }),
        Err(RunError::Refused(text)) if text.contains("at least one CPU")
    ));
}

/// `VCPUS_FIT` under run slots: on the userspace path a kick hands the kicker's slot to the
/// kicked vCPU, so what runs at once is the slots, and 2 slots fit this host's 2 CPUs however
/// many vCPUs there are: 6 vCPUs are told so, and waiters keep spinning behind a kicked next
/// owner. On the in-kernel path KVM runs a kicked vCPU beyond the slots: not told.
#[test]
fn waiters_behind_a_kicked_owner_keep_spinning_under_userspace_run_slots() {
    if kvm_or_skip("waiters_behind_a_kicked_owner_keep_spinning_under_userspace_run_slots")
        .is_none()
    {
        return;
    }
    let with = |path: KickPath| {
        let config = RunConfig {
            run_slots: Some(2),
            vm_cpus: Some(2),
            ..user_lock(LockKind::Ticket, PvMode::Kick, path, 6)
        };
        let report = run(&config).unwrap_or_else(|e| panic!("{path:?}, 2 slots: {e}"));
        assert_eq!(report.counter, 6 * config.iterations, "{path:?}");
        report.pv_behind_waking
    };
    assert_eq!(with(KickPath::InKernel), 0, "in kernel: not told");
    // Whether a waiter meets a kicked owner is timing; three tries make a miss very unlikely.
    assert!(
        nonzero_in_three_tries(|| with(KickPath::Userspace)),
        "userspace slots: no waiter ever kept spinning behind a kicked owner"
    );
}

/// Whether `count` is non-zero in one of at most three runs (for counts whose occurrence in
/// one run is timing).
fn nonzero_in_three_tries(mut count: impl FnMut() -> u64) -> bool {
    (0..3).any(|_| count() != 0)
}

/// 32 vCPUs on 2 run slots on `path`, with critical sections of a few us, as the size
/// benchmarks (docs/benchmarks.md §12.5): long enough that waiters far back in a queue of 32
/// halt.
fn crowded_slots(lock: LockKind, path: KickPath) -> RunConfig {
    RunConfig {
        run_slots: Some(2),
        vm_cpus: Some(2),
        iterations: 500,
        cs_work: 15_000,
        ncs_work: 15_000,
        ..user_lock(lock, PvMode::Kick, path, 32)
    }
}

/// The pre-wake under run slots: with 32 vCPUs on 2 userspace slots (`VCPUS_FIT` told) most
/// waiters halt, and unlockers also kick the halted waiter behind the new owner; on the
/// in-kernel path (not told) they never do. Both PV locks; every acquisition counted.
#[test]
fn unlockers_prewake_the_waiter_behind_the_next_owner_only_when_told() {
    if kvm_or_skip("unlockers_prewake_the_waiter_behind_the_next_owner_only_when_told").is_none() {
        return;
    }
    for lock in [LockKind::Ticket, LockKind::Queued] {
        let with = |path: KickPath| {
            let config = crowded_slots(lock, path);
            let report = run(&config).unwrap_or_else(|e| panic!("{lock:?} {path:?}: {e}"));
            assert_eq!(report.counter, 32 * config.iterations, "{lock:?} {path:?}");
            assert!(report.pv_prewakes <= report.pv_kicks, "{lock:?} {path:?}");
            report.pv_prewakes
        };
        assert_eq!(with(KickPath::InKernel), 0, "{lock:?}, in kernel: not told");
        // Whether a waiter halts behind a halted next owner is timing; three tries.
        assert!(
            nonzero_in_three_tries(|| with(KickPath::Userspace)),
            "{lock:?}, userspace slots: no pre-wake in three runs"
        );
    }
}

/// The wait budget's floor under userspace run slots (`BudgetConfig::for_run_slots`): with 32
/// vCPUs on 2 slots most waiters halt and their waits last many hand-overs, which halves
/// budgets; no vCPU's budget may end below the 100 us floor. With the floor off
/// (`slot_wait_after_min_us: Some(0)`) the same runs take some budget below it (else this
/// workload would not show the floor at all). Both PV locks; every acquisition counted.
#[test]
fn userspace_run_slots_keep_the_wait_budget_at_its_floor() {
    if kvm_or_skip("userspace_run_slots_keep_the_wait_budget_at_its_floor").is_none() {
        return;
    }
    let lowest_budget = |lock: LockKind, floor_us: Option<u64>| {
        let config = RunConfig {
            slot_wait_after_min_us: floor_us,
            ..crowded_slots(lock, KickPath::Userspace)
        };
        let report = run(&config).unwrap_or_else(|e| panic!("{lock:?} {floor_us:?}: {e}"));
        assert_eq!(
            report.counter,
            32 * config.iterations,
            "{lock:?} {floor_us:?}"
        );
        let telemetry = report.telemetry.expect("pvspin's telemetry");
        let budgets: Vec<u64> = telemetry
            .vcpus
            .iter()
            .map(|v| v.budgets.expect("hint pages: budgets").wait_after_ns)
            .collect();
        assert_eq!(budgets.len(), 32);
        budgets.into_iter().min().unwrap()
    };
    for lock in [LockKind::Ticket, LockKind::Queued] {
        assert!(
            lowest_budget(lock, None) >= 100_000,
            "{lock:?}: a budget below the run slots' floor"
        );
        // Whether a budget falls below 100 us without the floor is timing; three tries.
        assert!(
            (0..3).any(|_| lowest_budget(lock, Some(0)) < 100_000),
            "{lock:?}: without the floor no budget ever fell below 100 us"
        );
    }
}
