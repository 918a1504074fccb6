//! The guest image booted through PVH (`pvspin-vmm run --boot pvh`) on real /dev/kvm: the
//! boot vCPU at the ELF's PVH entry, the APs started by the guest with INIT-SIPI-SIPI from the
//! MADT, the workload from the kernel command line, the result line the guest prints, and the
//! ACPI power-off that ends the run. Every run is bounded by its watchdog and timeout.

use pvspin_integration_tests::kvm_or_skip;
use pvspin_test_vm::config::{BootMode, GuestKind, PvMode};
use pvspin_test_vm::{run, RunConfig, RunError};
use pvspin_test_vm_proto::pvh::RESULT_PREFIX;
use pvspin_test_vm_proto::{status, LockKind, Workload};

fn pvh_config(vcpus: u32) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock: LockKind::Ticket,
        iterations: 60,
        cs_work: 5,
        ncs_work: 5,
        watchdog_ms: 20_000,
        timeout_ms: 120_000,
        echo_console: false,
        boot: BootMode::Pvh,
        ..RunConfig::default()
    }
}

/// The JSON line the guest printed after [`RESULT_PREFIX`].
fn guest_result(console: &str) -> serde_json::Value {
    let line = console
        .lines()
        .find_map(|line| line.strip_prefix(RESULT_PREFIX))
        .unwrap_or_else(|| panic!("no result line in the console:\n{console}"));
    serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}"))
}

#[test]
fn pvh_boot_runs_the_lock_workload_on_every_vcpu_and_counts_exactly() {
    if kvm_or_skip("pvh_boot_runs_the_lock_workload_on_every_vcpu_and_counts_exactly").is_none() {
        return;
    }
    let cases = [
        pvh_config(2),
        RunConfig {
            lock: LockKind::Queued,
            pv: PvMode::Kick,
            ..pvh_config(4)
        },
        RunConfig {
            pv: PvMode::Kick,
            kick_path: pvspin::KickPath::SignalMsi,
            user_mode: true,
            ..pvh_config(3)
        },
        RunConfig {
            guest: GuestKind::Stock,
            lock: LockKind::Queued,
            pv: PvMode::Kick,
            ..pvh_config(2)
        },
        // Hint pages with time budgets, spin notifications and directed yield.
        RunConfig {
            pv: PvMode::KickYield,
            actuator: pvspin::ActuatorKind::Yield,
            ..pvh_config(2)
        },
    ];
    for config in cases {
        let what = pvspin_test_vm::pvh::guest_cmdline(&config, 0);
        let report = run(&config).unwrap_or_else(|err| panic!("{what}: {err}"));
        let expected = u64::from(config.vcpus) * config.iterations;
        assert_eq!(
            (report.counter, report.expected),
            (expected, expected),
            "{what}"
        );
        // Every vCPU ran its share: the APs came up through INIT-SIPI-SIPI.
        assert_eq!(report.per_vcpu.len(), config.vcpus as usize);
        for vcpu in &report.per_vcpu {
            assert_eq!(vcpu.acquisitions, config.iterations, "{what}: {vcpu}");
        }
        assert!(
            report.console.contains(&format!(
                "pvspin-guest: {} vCPUs up (CPU list: ACPI MADT)",
                config.vcpus
            )),
            "{what}: {}",
            report.console
        );
        assert!(report
            .console
            .contains("pvspin-guest: status 0 (success), powering off"));
        // The guest's own result line: the host's record, its keys in its order, with the
        // values the guest knows equal to the host's.
        let guest = guest_result(&report.console);
        let host: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        let keys = |v: &serde_json::Value| -> Vec<String> {
            v.as_object().unwrap().keys().cloned().collect()
        };
        assert_eq!(keys(&guest), keys(&host), "{what}");
        for key in [
            "workload",
            "lock",
            "vcpus",
            "iterations",
            "cs_work",
            "ncs_work",
            "counter",
            "expected",
            "elapsed_tsc",
            "tsc_khz",
            "acquisitions_per_sec",
            "guest",
            "pv",
            "pv_slow_paths",
            "pv_halts",
            "pv_kicks",
            "pv_spurious_wakeups",
            "pv_wait_early",
            "pv_preempted",
            "steal_time_registered",
            "cpuid",
        ] {
            assert_eq!(guest[key], host[key], "{what}: {key}");
        }
        let seconds = |v: &serde_json::Value| v["guest_seconds"].as_f64().unwrap();
        assert!(
            (seconds(&guest) - seconds(&host)).abs() < 1e-6,
            "{what}: {guest} vs {host}"
        );
        for (g, h) in guest["per_vcpu"]
            .as_array()
            .unwrap()
            .iter()
            .zip(host["per_vcpu"].as_array().unwrap())
        {
            assert_eq!(g["acquisitions"], h["acquisitions"], "{what}");
            assert_eq!(g["index"], h["index"], "{what}");
        }
    }
}

#[test]
fn pvh_guest_refuses_a_bad_command_line_and_powers_off_with_a_failure() {
    if kvm_or_skip("pvh_guest_refuses_a_bad_command_line_and_powers_off_with_a_failure").is_none() {
        return;
    }
    for (cmdline, status, says) in [
        (
            "vcpus=2 workload=sleep",
            status::BAD_PARAMS,
            "command line refused: workload: unknown value (in \"workload=sleep\")",
        ),
        (
            "vcpus=2 pv=kick lock=tas",
            status::BAD_PARAMS,
            "command line refused: rule: pv=kick needs lock=ticket",
        ),
        (
            "vcpus=2 hogs=4",
            status::BAD_PARAMS,
            "command line refused: word: unknown name (see docs/guest-programs.md for the names) (in \"hogs=4\")",
        ),
        (
            "vcpus=3",
            status::BOOT_FAILED,
            "vcpus= asks for more CPUs than the VMM lists in its ACPI MADT",
        ),
    ] {
        let config = RunConfig {
            workload: Workload::Hello,
            echo_console: false,
            pvh_cmdline: Some(cmdline.into()),
            ..pvh_config(2)
        };
        match run(&config) {
            Err(err @ RunError::GuestStatus { status: got, .. }) => {
                assert_eq!(got, status, "{cmdline}: {err}");
                // The guest said why on its console, and powered off (the run ended there).
                let text = err.to_string();
                assert!(text.contains(says), "{cmdline}: {text}");
                assert!(text.contains("powering off"), "{cmdline}: {text}");
            }
            other => panic!("{cmdline}: expected a failure status, got {other:?}"),
        }
    }
}

#[test]
fn pvh_boot_starts_every_ap_of_a_larger_vm() {
    if kvm_or_skip("pvh_boot_starts_every_ap_of_a_larger_vm").is_none() {
        return;
    }
    let vcpus = 16;
    let config = RunConfig {
        workload: Workload::Hello,
        mem_mib: 32,
        ..pvh_config(vcpus)
    };
    let report = run(&config).unwrap_or_else(|err| panic!("{err}"));
    assert!(
        report
            .console
            .contains(&format!("pvspin-guest: {vcpus} vCPUs up")),
        "{}",
        report.console
    );
    for index in 0..vcpus {
        let line = format!("hello from vCPU {index} of {vcpus}\n");
        assert!(
            report.console.contains(&line),
            "{line:?} in {}",
            report.console
        );
    }
    assert!(report.per_vcpu.iter().all(|vcpu| vcpu.heartbeat == 1));
}
