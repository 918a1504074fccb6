//! Adoption by a VMM that owns its VM-wide state: the minimal VMM's workloads on every kick
//! path, the ordering rules `configure_vcpu` names, and the ready interrupter, on real KVM.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, KVM_MP_STATE_UNINITIALIZED};
use kvm_ioctls::{Kvm, VcpuFd};
use pvspin::{ConfigError, Error, KickOptions, KickPath, PvSpin};
use pvspin_integration_tests::{kvm_or_skip, with_watchdog, TestVm};

const MEM_SIZE: usize = 1 << 20;
const CODE_AT: u64 = 0x1000;

#[derive(Debug)]
struct NoInterrupter;
impl pvspin::VcpuInterrupter for NoInterrupter {
    fn interrupt(&self, _: usize) {}
}

fn pvspin_for(path: KickPath, vcpus: usize) -> PvSpin {
    PvSpin::builder()
        .vcpus(vcpus)
        .interrupter(Arc::new(NoInterrupter))
        .kick(KickOptions::new(path))
        .build()
        .expect("build")
}

/// The message of a configuration error that names a rule.
fn rule(err: &Error) -> String {
    match err {
        Error::Config(config) if config.to_string().starts_with("rule: ") => config.to_string(),
        other => panic!("expected a named rule, got {other}"),
    }
}

fn cpuid_set(kvm: &Kvm, pvspin: &PvSpin, index: usize, vcpu: &VcpuFd) {
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    pvspin.edit_cpuid(index, &mut cpuid).expect("edit_cpuid");
    vcpu.set_cpuid2(&cpuid).expect("KVM_SET_CPUID2");
}

/// The minimal VMM (its own irqchip, routes, CPUID and AP start-up) passes the lock and
/// ping-pong workloads, kernel and user mode, on every kick path.
#[test]
fn minimal_vmm_passes_its_workloads_on_every_kick_path() {
    if kvm_or_skip("minimal_vmm_passes_its_workloads_on_every_kick_path").is_none() {
        return;
    }
    with_watchdog(
        "minimal_vmm_passes_its_workloads_on_every_kick_path",
        Duration::from_secs(300),
        || {
            for (path, workload, user_mode) in minimal_vmm::default_runs() {
                let name = minimal_vmm::run_name(path, workload, user_mode);
                let summary = minimal_vmm::run(path, workload, user_mode)
                    .unwrap_or_else(|err| panic!("{name}: {err}"));
                assert!(summary.starts_with("guest: counter"), "{name}: {summary}");
            }
        },
    );
}

/// Every ordering rule that ties a vCPU to the configuration is refused with its name.
#[test]
fn configure_vcpu_names_each_rule_it_checks() {
    let Some(kvm) = kvm_or_skip("configure_vcpu_names_each_rule_it_checks") else {
        return;
    };
    with_watchdog(
        "configure_vcpu_names_each_rule_it_checks",
        Duration::from_secs(60),
        || {
            // The userspace path with the VMM's irqchip: HLT would never reach pvspin.
            let t = TestVm::new(&kvm, MEM_SIZE);
            let pvspin = pvspin_for(KickPath::Userspace, 1);
            pvspin.configure_vm(&kvm, &t.vm).unwrap();
            t.vm.create_irq_chip().unwrap();
            let mut vcpu = t.vm.create_vcpu(0).unwrap();
            cpuid_set(&kvm, &pvspin, 0, &vcpu);
            let err = pvspin.configure_vcpu(0, &mut vcpu).unwrap_err();
            assert!(
                rule(&err).contains("userspace kick path needs HLT exits"),
                "{err}"
            );

            // The MSI paths without an irqchip.
            for path in [KickPath::InKernel, KickPath::SignalMsi] {
                let t = TestVm::new(&kvm, MEM_SIZE);
                let pvspin = pvspin_for(path, 1);
                pvspin.configure_vm(&kvm, &t.vm).unwrap();
                let mut vcpu = t.vm.create_vcpu(0).unwrap();
                cpuid_set(&kvm, &pvspin, 0, &vcpu);
                let err = pvspin.configure_vcpu(0, &mut vcpu).unwrap_err();
                assert!(
                    rule(&err).contains("need an in-kernel LAPIC"),
                    "{path:?}: {err}"
                );
            }

            // The in-kernel path: GSIs first, then a CPUID from edit_cpuid.
            let t = TestVm::new(&kvm, MEM_SIZE);
            let pvspin = pvspin_for(KickPath::InKernel, 2);
            pvspin.configure_vm(&kvm, &t.vm).unwrap();
            t.vm.create_irq_chip().unwrap();
            let mut vcpu0 = t.vm.create_vcpu(0).unwrap();
            cpuid_set(&kvm, &pvspin, 0, &vcpu0);
            let err = pvspin.configure_vcpu(0, &mut vcpu0).unwrap_err();
            assert!(rule(&err).contains("PvSpin::set_kick_gsis"), "{err}");
            for (bad, why) in [
                (vec![40], "one GSI per vCPU"),
                (vec![40, 40], "given twice"),
                (vec![40, 5000], "below KVM's 4096"),
            ] {
                let err = pvspin.set_kick_gsis(&bad).unwrap_err();
                assert!(err.to_string().contains(why), "{bad:?}: {err}");
            }
            let wiring = pvspin.set_kick_gsis(&[40, 41]).unwrap();
            wiring.register(&t.vm).unwrap();
            assert_eq!(wiring.routes().unwrap().len(), 2);
            assert!(
                pvspin.set_kick_gsis(&[42, 43]).is_err(),
                "GSIs are set once"
            );
            // A CPUID the VMM set without pvspin's edit.
            let mut vcpu1 = t.vm.create_vcpu(1).unwrap();
            let plain = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
            vcpu1.set_cpuid2(&plain).unwrap();
            let err = pvspin.configure_vcpu(1, &mut vcpu1).unwrap_err();
            assert!(
                matches!(err, Error::Config(ConfigError::Cpuid { index: 1, .. })),
                "{err}"
            );
            assert!(err.to_string().contains("PvSpin::edit_cpuid"), "{err}");
            // Right order: both configure, and pvspin changes no MP state (the AP still waits
            // for its SIPI).
            pvspin.configure_vcpu(0, &mut vcpu0).expect("vCPU 0");
            cpuid_set(&kvm, &pvspin, 1, &vcpu1);
            pvspin.configure_vcpu(1, &mut vcpu1).expect("vCPU 1");
            assert_eq!(
                vcpu1.get_mp_state().unwrap().mp_state,
                KVM_MP_STATE_UNINITIALIZED
            );
            let err = pvspin.configure_vcpu(1, &mut vcpu1).unwrap_err();
            assert!(err.to_string().contains("already configured"), "{err}");
            wiring.unregister(&t.vm);
        },
    );
}

/// The ready interrupter gets a vCPU out of a guest that never exits, and an interrupt that
/// arrives before `KVM_RUN` makes the next run return at once.
#[test]
fn signal_interrupter_ends_a_run_that_never_exits() {
    let Some(kvm) = kvm_or_skip("signal_interrupter_ends_a_run_that_never_exits") else {
        return;
    };
    with_watchdog(
        "signal_interrupter_ends_a_run_that_never_exits",
        Duration::from_secs(60),
        || {
            let t = TestVm::new(&kvm, MEM_SIZE);
            t.write(CODE_AT, &[0xeb, 0xfe]); // jmp $
            let mut vcpu = t.vm.create_vcpu(0).unwrap();
            let mut sregs = vcpu.get_sregs().unwrap();
            sregs.cs.base = 0;
            sregs.cs.selector = 0;
            vcpu.set_sregs(&sregs).unwrap();
            let mut regs = vcpu.get_regs().unwrap();
            regs.rip = CODE_AT;
            regs.rflags = 2;
            vcpu.set_regs(&regs).unwrap();
            let interrupter = pvspin::SignalInterrupter::new(1).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let remote = interrupter.clone();
            let thread = std::thread::spawn(move || {
                let me = remote.attach(0).unwrap();
                assert!(remote.attach(0).is_err(), "one thread per vCPU");
                tx.send(()).unwrap();
                let start = Instant::now();
                let first = me.run(&mut vcpu).map(|_| ()).unwrap_err().errno();
                let first_took = start.elapsed();
                // An interrupt before the run: this one returns without running the guest.
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
                let start = Instant::now();
                let second = me.run(&mut vcpu).map(|_| ()).unwrap_err().errno();
                (first, first_took, second, start.elapsed())
            });
            rx.recv().unwrap();
            std::thread::sleep(Duration::from_millis(200));
            pvspin::VcpuInterrupter::interrupt(&*interrupter, 0);
            rx.recv().unwrap();
            pvspin::VcpuInterrupter::interrupt(&*interrupter, 0);
            let (first, first_took, second, second_took) = thread.join().unwrap();
            assert_eq!(first, libc::EINTR);
            assert!(first_took >= Duration::from_millis(150), "{first_took:?}");
            assert_eq!(second, libc::EINTR);
            assert!(second_took < Duration::from_millis(100), "{second_took:?}");
            // The thread is gone: interrupting it now is a no-op, not a signal to a dead thread.
            pvspin::VcpuInterrupter::interrupt(&*interrupter, 0);
        },
    );
}
