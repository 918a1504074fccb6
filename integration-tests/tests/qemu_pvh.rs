//! The example guest in a VMM nobody here wrote: QEMU boots the same PVH image that
//! `pvspin-vmm run --boot pvh` boots (`-kernel` with its Xen PVH note, `-append` with
//! `guest-cmdline`'s words), on real /dev/kvm. The guest starts its APs from QEMU's ACPI MADT,
//! prints its result line on QEMU's 16550 and powers off through ACPI, which ends QEMU.
//! Without PV (QEMU has no pvspin device). Every run is bounded: QEMU is killed past its time.
//!
//! Gated on the `qemu` tool: where `qemu-system-x86_64` is missing the test records itself as
//! skipped in the tally (`.ci/run` installs QEMU when it can and prints the count), and fails
//! where it is installed and the boot does not work.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pvspin_integration_tests::{kvm_or_skip, record};
use pvspin_test_vm::config::PvMode;
use pvspin_test_vm::RunConfig;
use pvspin_test_vm_proto::pvh::RESULT_PREFIX;
use pvspin_test_vm_proto::{LockKind, Workload};

const QEMU: &str = "qemu-system-x86_64";

/// Runs QEMU with `args`, killing it past `limit`; returns its exit status and console.
fn qemu(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(QEMU)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("starting {QEMU}: {err}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for QEMU") {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    (status, out)
}

#[test]
fn qemu_boots_the_pvh_guest_and_it_counts_exactly() {
    let test = "qemu_boots_the_pvh_guest_and_it_counts_exactly";
    if kvm_or_skip(test).is_none() {
        return;
    }
    if Command::new(QEMU).arg("--version").output().is_err() {
        let reason = format!("{QEMU} is not installed");
        eprintln!("SKIPPED {test}: {reason}");
        record("qemu", test, Some(&reason));
        return;
    }
    record("qemu", test, None);
    let dir = std::env::temp_dir().join(format!("pvspin-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("guest.elf");
    std::fs::write(&image, pvspin_test_vm::vmm::GUEST_IMAGE).unwrap();
    for (vcpus, lock) in [
        (1, LockKind::Ticket),
        (2, LockKind::Ticket),
        (4, LockKind::Queued),
    ] {
        let config = RunConfig {
            vcpus,
            workload: Workload::Lock,
            lock,
            pv: PvMode::Off,
            iterations: 2000,
            user_mode: true,
            ..RunConfig::default()
        };
        let cmdline = pvspin_test_vm::pvh::guest_cmdline(&config, 0);
        let smp = vcpus.to_string();
        // The default CPU model, with the TSC frequency in CPUID 0x40000010 for the guest's
        // timing (`-cpu host` trips on an MSR this nested host refuses, a QEMU matter).
        let args = [
            "-accel",
            "kvm",
            "-cpu",
            "qemu64,+invtsc,vmware-cpuid-freq=on",
            "-m",
            "256",
            "-smp",
            &smp,
            "-kernel",
            image.to_str().unwrap(),
            "-append",
            &cmdline,
            "-serial",
            "stdio",
            "-display",
            "none",
            "-nodefaults",
            "-no-reboot",
        ];
        let (status, console) = qemu(&args, Duration::from_secs(120));
        assert_eq!(
            status,
            Some(0),
            "{vcpus} vCPUs: QEMU ended {status:?}:\n{console}"
        );
        assert!(
            console.contains(&format!("{vcpus} vCPUs up")),
            "{vcpus} vCPUs:\n{console}"
        );
        let line = console
            .lines()
            .find_map(|line| line.strip_prefix(RESULT_PREFIX))
            .unwrap_or_else(|| panic!("{vcpus} vCPUs: no result line:\n{console}"));
        let result: serde_json::Value = serde_json::from_str(line).unwrap();
        let expected = u64::from(vcpus) * config.iterations;
        assert_eq!(result["counter"], expected, "{line}");
        assert_eq!(result["expected"], expected, "{line}");
        assert_ne!(result["tsc_khz"], 0, "{line}");
        assert!(console.contains("status 0 (success)"), "{console}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
