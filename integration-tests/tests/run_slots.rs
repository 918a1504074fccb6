//! Run slots on real guests: never more vCPUs in guest code than slots, kicked vCPUs get the
//! slot of their kicker, every lock count exact, in guest user mode (native speed) and
//! kernel mode, and a configuration the slots cannot serve is refused naming the rule.

use std::time::Duration;

use pvspin::KickPath;
use pvspin_integration_tests::{kvm_or_skip, with_watchdog};
use pvspin_test_vm::config::PvMode;
use pvspin_test_vm::{run, RunConfig, RunConfigError};
use pvspin_test_vm_proto::{LockKind, Workload};

fn slots_config(vcpus: u32, slots: u32, lock: LockKind, user_mode: bool) -> RunConfig {
    RunConfig {
        vcpus,
        workload: Workload::Lock,
        lock,
        pv: PvMode::Kick,
        kick_path: KickPath::Userspace,
        run_slots: Some(slots),
        user_mode,
        iterations: if user_mode { 20_000 } else { 300 },
        cs_work: if user_mode { 5000 } else { 40 },
        ncs_work: if user_mode { 5000 } else { 40 },
        echo_console: false,
        timeout_ms: 60_000,
        ..RunConfig::default()
    }
}

#[test]
fn slots_are_never_exceeded_and_kicked_vcpus_get_one() {
    if kvm_or_skip("slots_are_never_exceeded_and_kicked_vcpus_get_one").is_none() {
        return;
    }
    with_watchdog(
        "slots_are_never_exceeded_and_kicked_vcpus_get_one",
        Duration::from_secs(240),
        || {
            for (vcpus, slots, lock, user_mode) in [
                (4, 1, LockKind::Ticket, true),
                (4, 2, LockKind::Ticket, true),
                (6, 2, LockKind::Queued, true),
                (3, 1, LockKind::Ticket, false),
            ] {
                let name = format!("{vcpus} vCPUs, {slots} slots, {lock:?}, user {user_mode}");
                let report = run(&slots_config(vcpus, slots, lock, user_mode))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(report.counter, report.expected, "{name}");
                let stats = report.run_slots.expect("slot stats");
                assert_eq!(stats.slots, slots as usize, "{name}");
                assert!(stats.max_held <= u64::from(slots), "{name}: {stats:?}");
                assert!(stats.max_held >= 1, "{name}: {stats:?}");
                // Kicks happened, and kicked vCPUs got slots from their kickers or first in
                // line.
                assert!(report.pv_kicks > 0, "{name}: no kicks");
                assert!(
                    stats.hand_overs + stats.prioritized_grants > 0,
                    "{name}: {stats:?}"
                );
            }
        },
    );
}

/// A guest that registered KVM steal time (the example guest does with kick+yield) sees a
/// vCPU waiting for a slot as preempted: pvspin learns the area from MSR_KVM_STEAL_TIME and
/// sets its `preempted` byte, which KVM clears at the next entry.
#[test]
fn waits_for_a_slot_are_shown_through_steal_time() {
    if kvm_or_skip("waits_for_a_slot_are_shown_through_steal_time").is_none() {
        return;
    }
    with_watchdog(
        "waits_for_a_slot_are_shown_through_steal_time",
        Duration::from_secs(120),
        || {
            let config = RunConfig {
                pv: PvMode::KickYield,
                ..slots_config(4, 2, LockKind::Ticket, true)
            };
            let report = run(&config).expect("run");
            assert_eq!(report.counter, report.expected);
            let stats = report.run_slots.expect("slot stats");
            assert!(stats.waits > 0, "{stats:?}");
            assert!(stats.steal_time_marks > 0, "{stats:?}");
        },
    );
}

#[test]
fn slots_need_a_kick_path() {
    let config = RunConfig {
        pv: PvMode::Off,
        ..slots_config(4, 2, LockKind::Ticket, true)
    };
    // The configuration's own check (what `run` does first once /dev/kvm is open): this
    // test needs no KVM.
    assert_eq!(
        config.validate(u32::MAX),
        Err(RunConfigError::SlotsNeedKicks)
    );
    // In the library, slots without a kick path do not compile (`PvSpinBuilder<NoKick>` has
    // no `run_slots`); a slot count it cannot serve is refused naming the rule.
    #[derive(Debug)]
    struct NoInterrupter;
    impl pvspin::VcpuInterrupter for NoInterrupter {
        fn interrupt(&self, _: usize) {}
    }
    let err = pvspin::PvSpin::builder()
        .vcpus(4)
        .interrupter(std::sync::Arc::new(NoInterrupter))
        .kick(pvspin::KickOptions::new(KickPath::InKernel))
        .run_slots(pvspin::SlotConfig::new(5))
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("rule: run slots must be between 1"),
        "{err}"
    );
}

/// Run slots where halts and kicks stay inside KVM (in-kernel and signal-msi paths, in-kernel
/// LAPIC): the halt watcher reads each watched vCPU's `blocking` statistic, lends a halted
/// holder's slot to a waiter, and gives a vCPU that KVM woke a slot back at once. Lock counts
/// are exact; slots were lent; every `blocking` read worked; and more vCPUs held slots than
/// there are slots only briefly (the policy tests check the bound on a controlled clock; here
/// the host is shared, so the check is that it never stuck).
#[test]
fn slots_lend_the_slot_of_a_vcpu_halted_in_kvm() {
    if kvm_or_skip("slots_lend_the_slot_of_a_vcpu_halted_in_kvm").is_none() {
        return;
    }
    with_watchdog(
        "slots_lend_the_slot_of_a_vcpu_halted_in_kvm",
        Duration::from_secs(300),
        || {
            for (vcpus, slots, path, lock, user_mode) in [
                (4, 1, KickPath::InKernel, LockKind::Ticket, true),
                (4, 2, KickPath::InKernel, LockKind::Queued, true),
                (4, 2, KickPath::SignalMsi, LockKind::Ticket, true),
                (3, 1, KickPath::InKernel, LockKind::Ticket, false),
            ] {
                let name =
                    format!("{vcpus} vCPUs, {slots} slots, {path:?}, {lock:?}, user {user_mode}");
                let config = RunConfig {
                    kick_path: path,
                    ..slots_config(vcpus, slots, lock, user_mode)
                };
                let report = run(&config).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(report.counter, report.expected, "{name}");
                let stats = report.run_slots.expect("slot stats");
                assert_eq!(stats.slots, slots as usize, "{name}");
                assert!(stats.lends > 0, "{name}: no slot lent: {stats:?}");
                assert!(
                    stats.watch_polls > 0 && stats.watch_reads > 0,
                    "{name}: {stats:?}"
                );
                assert_eq!(stats.watch_read_errors, 0, "{name}: {stats:?}");
                // Never stuck over the slots. The time itself depends on how soon the holder
                // asked to leave gets a CPU, which on a shared host running other tests beside
                // this one can take a while: the bound is measured in the benchmarks.
                assert!(
                    stats.max_over_ns < 1_000_000_000,
                    "{name}: more holders than slots for {} ms: {stats:?}",
                    stats.max_over_ns / 1_000_000
                );
            }
        },
    );
}

/// A VMM that parks a vCPU thread in a wait of its own (the example parks a user-mode guest's
/// finished vCPUs) calls `VcpuHooks::before_vmm_park`: the vCPU gives its slot up at once, so
/// another vCPU gets it without waiting for the parked one's quantum (which would never end:
/// a parked vCPU never exits again), and the parked vCPU asks for a slot again at its next
/// `before_run`. One slot, two vCPUs on a real VM; the hooks are called directly.
#[test]
fn a_vcpu_the_vmm_parks_gives_its_slot_up() {
    const TEST: &str = "a_vcpu_the_vmm_parks_gives_its_slot_up";
    let Some(kvm) = kvm_or_skip(TEST) else {
        return;
    };
    with_watchdog(TEST, Duration::from_secs(60), || {
        let interrupter = pvspin::SignalInterrupter::new(2).expect("interrupter");
        let pvspin = std::sync::Arc::new(
            pvspin::PvSpin::builder()
                .vcpus(2)
                .interrupter(interrupter)
                .kick(pvspin::KickOptions::new(KickPath::Userspace))
                .run_slots(pvspin::SlotConfig::new(1))
                .build()
                .expect("pvspin"),
        );
        let vm = kvm.create_vm().expect("KVM_CREATE_VM");
        pvspin::simple::setup_vm(&pvspin, &kvm, &vm).expect("setup_vm");
        let supported = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .expect("KVM_GET_SUPPORTED_CPUID");
        let mut vcpus = Vec::new();
        let mut hooks = Vec::new();
        for i in 0..2 {
            let mut vcpu = vm.create_vcpu(i as u64).expect("KVM_CREATE_VCPU");
            let mut cpuid = supported.clone();
            let (h, _) = pvspin::simple::configure_vcpu(&pvspin, i, &mut vcpu, &mut cpuid)
                .expect("configure_vcpu");
            vcpus.push(vcpu);
            hooks.push(h);
        }
        let mut hooks1 = hooks.pop().expect("vCPU 1's hooks");
        let mut hooks0 = hooks.pop().expect("vCPU 0's hooks");
        // vCPU 0 runs, exits (nobody waits: it keeps its slot), and the VMM parks it.
        hooks0.before_run();
        hooks0.after_run_with_cpl(Some(3));
        hooks0.before_vmm_park();
        // vCPU 1 gets the slot on another thread; bounded here, released by shutdown if not.
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            hooks1.before_run();
            let _ = tx.send(());
            hooks1.after_run_with_cpl(Some(3));
            hooks1.before_vmm_park();
            hooks1
        });
        let got = rx.recv_timeout(Duration::from_secs(10));
        if got.is_err() {
            pvspin.shutdown();
        }
        let _hooks1 = worker.join().expect("vCPU 1's thread");
        assert!(
            got.is_ok(),
            "vCPU 1 never got the slot the parked vCPU 0 held"
        );
        // Both parked now: vCPU 0 gets a slot again at its next before_run, without waiting.
        hooks0.before_run();
        let slots = pvspin.telemetry().run_slots.expect("slot telemetry");
        assert_eq!(slots.grants, 3, "{slots:?}");
        assert_eq!(slots.waits, 0, "nobody waited: {slots:?}");
        assert_eq!(slots.preemptions, 0, "nobody was forced out: {slots:?}");
        drop(vcpus);
    });
}
