//! Adopter's mistakes, made on purpose against real KVM (issue 18, parts 4 and 5): each one
//! failed silently before; each test asserts the error naming the rule, or the problem pvspin
//! counted and [`PvSpin::check`] lists. `docs/embedding.md`, "Adopter's mistakes", is the
//! table these follow. Every guest runs a few instructions and then writes a done port; every
//! wait is bounded (the watchdog aborts a hang).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_bindings::{kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQ_ROUTING_MSI};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use pvspin::{
    ConfigError, Error, ExitOutcome, KickOptions, KickPath, Placement, PlanRequest, Problem,
    ProblemKind, PvSpin, RouteFault, SignalCollision, VcpuHooks,
};
use pvspin_integration_tests::{kvm_required, with_watchdog, TestVm};
use pvspin_kvm::irqchip;

const MEM_SIZE: usize = 1 << 20;
const CODE_AT: u64 = 0x1000;
const DONE_PORT: u16 = 0x610;
const DOORBELL: u16 = 0x0a40;
const LIMIT: Duration = Duration::from_secs(60);

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

/// Real-mode guest at `CODE_AT`: kicks vCPU `target` (a 4-byte `OUT` to the doorbell), writes
/// the done port, halts.
fn kick_guest(t: &TestVm, target: u32) {
    let [lo, hi] = DOORBELL.to_le_bytes();
    let [t0, t1, t2, t3] = target.to_le_bytes();
    let [d0, d1] = DONE_PORT.to_le_bytes();
    t.write(
        CODE_AT,
        &[
            0xba, lo, hi, // mov dx, DOORBELL
            0x66, 0xb8, t0, t1, t2, t3, // mov eax, target
            0x66, 0xef, // out dx, eax (KICK)
            0xba, d0, d1,   // mov dx, DONE_PORT
            0xee, // out dx, al
            0xf4, 0xeb, 0xfd, // hlt; jmp back to hlt
        ],
    );
}

fn real_mode(vcpu: &VcpuFd) {
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    let regs = kvm_bindings::kvm_regs {
        rip: CODE_AT,
        rflags: 2,
        rsp: 0xf000,
        ..Default::default()
    };
    vcpu.set_regs(&regs).unwrap();
}

fn cpuid_set(kvm: &Kvm, pvspin: &PvSpin, index: usize, vcpu: &VcpuFd) {
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    pvspin.edit_cpuid(index, &mut cpuid).expect("edit_cpuid");
    vcpu.set_cpuid2(&cpuid).expect("KVM_SET_CPUID2");
}

fn apply_routes(vm: &VmFd, routes: &[kvm_irq_routing_entry]) {
    let table = KvmIrqRouting::from_entries(routes).unwrap();
    vm.set_gsi_routing(&table).expect("KVM_SET_GSI_ROUTING");
}

/// A VM with pvspin on `path`, configured up to its vCPUs (the irqchip on the MSI paths; the
/// in-kernel wiring at GSIs 40.. with its routes applied and checked, unless `wire` is false).
fn vm_on(kvm: &Kvm, path: KickPath, vcpus: usize, wire: bool) -> (TestVm, PvSpin) {
    let t = TestVm::new(kvm, MEM_SIZE);
    let pvspin = pvspin_for(path, vcpus);
    pvspin.configure_vm(kvm, &t.vm).expect("configure_vm");
    if path != KickPath::Userspace {
        t.vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
    }
    if path == KickPath::InKernel && wire {
        let gsis: Vec<u32> = (40..).take(vcpus).collect();
        let wiring = pvspin.set_kick_gsis(&gsis).expect("set_kick_gsis");
        let mut routes = irqchip::default_irqchip_routes();
        routes.extend(wiring.routes().unwrap());
        apply_routes(&t.vm, &routes);
        pvspin.check_routes(&routes).expect("the merged table");
        wiring.register(&t.vm).expect("register");
    }
    (t, pvspin)
}

/// Runs `vcpu` with its hooks (every exit offered to them) until the guest writes the done
/// port; returns the doorbell writes the hooks handled.
fn run_to_done(vcpu: &mut VcpuFd, hooks: &mut VcpuHooks) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut handled = 0;
    loop {
        assert!(
            Instant::now() < deadline,
            "the guest never wrote the done port"
        );
        hooks.before_run();
        let mut exit = vcpu.run();
        if hooks.handle_exit(&mut exit) == ExitOutcome::Handled {
            handled += 1;
        }
        let done = match &exit {
            Ok(VcpuExit::IoOut(DONE_PORT, _)) => true,
            Ok(VcpuExit::IoOut(..) | VcpuExit::IoIn(..)) => false,
            Err(e) if e.errno() == libc::EINTR => false,
            other => panic!("unexpected exit {other:?}"),
        };
        drop(exit);
        hooks.after_run(vcpu);
        if done {
            return handled;
        }
    }
}

fn found(problems: &[Problem], kind: ProblemKind) -> &Problem {
    problems
        .iter()
        .find(|p| p.kind == kind)
        .unwrap_or_else(|| panic!("{kind:?} not among {problems:#?}"))
}

fn config_err(err: Error) -> ConfigError {
    match err {
        Error::Config(c) => {
            assert!(c.to_string().starts_with("rule: "), "{c}");
            c
        }
        other => panic!("expected a named rule, got {other}"),
    }
}

/// (a) The VMM rebuilds its GSI routing table without pvspin's kick routes (or reuses a kick
/// GSI): in-kernel kicks would wake nobody. `check_routes` names the vCPUs, counts it, and
/// `check` lists it; the merged table passes.
#[test]
fn dropped_or_changed_kick_routes_are_named() {
    const NAME: &str = "dropped_or_changed_kick_routes_are_named";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let (t, pvspin) = vm_on(&kvm, KickPath::InKernel, 2, true);
        let wiring = pvspin.kick_wiring().unwrap();
        let kick_routes = wiring.routes().unwrap();
        // A rebuild from the VMM's own routes only.
        let own = irqchip::default_irqchip_routes();
        apply_routes(&t.vm, &own);
        let err = config_err(pvspin.check_routes(&own).unwrap_err());
        let ConfigError::KickRoutes { faults } = &err else {
            panic!("{err}")
        };
        assert_eq!(
            faults,
            &[
                RouteFault::Missing { vcpu: 0, gsi: 40 },
                RouteFault::Missing { vcpu: 1, gsi: 41 }
            ]
        );
        assert!(err.to_string().contains("vCPU 1: GSI 41 missing"), "{err}");
        // A rebuild that gives GSI 41 to a device of the VMM's.
        let mut reused = own.clone();
        reused.push(kick_routes[0]);
        let mut device = kvm_irq_routing_entry {
            gsi: 41,
            type_: KVM_IRQ_ROUTING_MSI,
            ..Default::default()
        };
        device.u.msi.address_lo = 0xfee0_0000;
        device.u.msi.data = 0x41;
        reused.push(device);
        apply_routes(&t.vm, &reused);
        let err = config_err(pvspin.check_routes(&reused).unwrap_err());
        assert!(
            matches!(&err, ConfigError::KickRoutes { faults } if faults == &[RouteFault::Changed { vcpu: 1, gsi: 41 }]),
            "{err}"
        );
        // Merged again: passes.
        let mut merged = own;
        merged.extend(kick_routes);
        apply_routes(&t.vm, &merged);
        pvspin.check_routes(&merged).expect("merged");
        let problems = pvspin.check();
        let p = found(&problems, ProblemKind::KickRoutesMissing);
        assert_eq!((p.count, p.vcpus.as_slice()), (2, &[1][..]), "{p}");
        assert!(pvspin
            .telemetry()
            .to_prometheus()
            .contains("pvspin_adoption_problems_total{problem=\"kick_routes_missing\"} 2\n"));
    });
}

/// (b) KVM vCPU ids that are not 0..n-1: the vCPU's LAPIC has another APIC ID than its index,
/// so MSI kicks would go elsewhere. `configure_vcpu` refuses it on both MSI paths.
#[test]
fn vcpu_ids_that_are_not_their_indexes_are_refused() {
    const NAME: &str = "vcpu_ids_that_are_not_their_indexes_are_refused";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        for path in [KickPath::InKernel, KickPath::SignalMsi] {
            let (t, pvspin) = vm_on(&kvm, path, 2, true);
            // KVM ids 0 and 2 for pvspin's vCPUs 0 and 1.
            let mut vcpus: Vec<VcpuFd> = [0u64, 2]
                .iter()
                .map(|&id| t.vm.create_vcpu(id).unwrap())
                .collect();
            for (i, v) in vcpus.iter().enumerate() {
                cpuid_set(&kvm, &pvspin, i, v);
            }
            pvspin.configure_vcpu(0, &mut vcpus[0]).expect("vCPU 0");
            let err = config_err(pvspin.configure_vcpu(1, &mut vcpus[1]).unwrap_err());
            assert!(
                matches!(
                    err,
                    ConfigError::ApicId {
                        index: 1,
                        apic_id: 2
                    }
                ),
                "{path:?}: {err}"
            );
            assert!(err.to_string().contains("KVM_CREATE_VCPU(1)"), "{err}");
        }
    });
}

/// (c) `configure_vcpu` forgotten for vCPU 1 on every path: vCPU 0's runs are counted, the
/// forgotten vCPU is listed, telemetry shows it unconfigured, and a kick to it (on the paths
/// where kicks reach userspace) is counted.
#[test]
fn a_forgotten_configure_vcpu_is_counted_and_listed() {
    const NAME: &str = "a_forgotten_configure_vcpu_is_counted_and_listed";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        for path in KickPath::ALL {
            let (t, pvspin) = vm_on(&kvm, path, 2, true);
            kick_guest(&t, 1);
            let mut vcpu0 = t.vm.create_vcpu(0).unwrap();
            let vcpu1 = t.vm.create_vcpu(1).unwrap();
            cpuid_set(&kvm, &pvspin, 0, &vcpu0);
            cpuid_set(&kvm, &pvspin, 1, &vcpu1);
            real_mode(&vcpu0);
            let (mut hooks, _) = pvspin.configure_vcpu(0, &mut vcpu0).expect("vCPU 0");
            // vCPU 1 is never configured: the mistake.
            let handled = run_to_done(&mut vcpu0, &mut hooks);
            let problems = pvspin.check();
            let missing = found(&problems, ProblemKind::VcpusNotConfigured);
            assert_eq!((missing.count, missing.vcpus.as_slice()), (1, &[1][..]));
            let early = found(&problems, ProblemKind::RunsBeforeAllConfigured);
            // Every run of vCPU 0: the done port's, and the kick's where it exits.
            let runs = if path == KickPath::InKernel { 1 } else { 2 };
            assert!(
                early.count >= runs && early.vcpus == [0],
                "{path:?}: {early}"
            );
            let t0 = pvspin.telemetry();
            assert!(t0.vcpus[0].pvspin.configured && !t0.vcpus[1].pvspin.configured);
            assert_eq!(t0.vcpus[0].pvspin.runs_before_all_configured, early.count);
            if path == KickPath::InKernel {
                // The kick never left the kernel.
                assert_eq!(handled, 0, "{path:?}");
            } else {
                let kicks = found(&problems, ProblemKind::KicksToUnconfiguredVcpu);
                assert_eq!(kicks.count, 1, "{path:?}");
            }
            if path == KickPath::SignalMsi {
                // The kick MSI to the unconfigured vCPU: KVM's map was never rebuilt.
                let s = t0.kick.unwrap().stats;
                eprintln!(
                    "{NAME}: signal-msi kick to the unconfigured vCPU: {} delivered, {} to nobody",
                    s.msi_delivered, s.msi_not_delivered
                );
            }
            for p in &problems {
                eprintln!("{NAME}: {path:?}: {p}");
            }
        }
    });
}

/// (d) A VMM whose bus dispatches the doorbell on another thread than the vCPU's: the access
/// is ignored (the kick wakes nobody), counted, and listed.
#[test]
fn a_doorbell_accessed_without_hooks_is_counted_and_listed() {
    const NAME: &str = "a_doorbell_accessed_without_hooks_is_counted_and_listed";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let (t, pvspin) = vm_on(&kvm, KickPath::Userspace, 1, true);
        kick_guest(&t, 0);
        let mut vcpu = t.vm.create_vcpu(0).unwrap();
        cpuid_set(&kvm, &pvspin, 0, &vcpu);
        real_mode(&vcpu);
        let (mut hooks, _) = pvspin.configure_vcpu(0, &mut vcpu).unwrap();
        let pio = pvspin.doorbell_pio().unwrap();
        // The VMM's device thread.
        let (tx, rx) = mpsc::channel::<(u64, Vec<u8>)>();
        let (done_tx, done_rx) = mpsc::channel::<bool>();
        let device_pio = pio.clone();
        let device = std::thread::spawn(move || {
            for (offset, data) in rx {
                done_tx.send(device_pio.write(offset, &data)).unwrap();
            }
            let mut read = [0u8; 4];
            assert!(device_pio.read(4, &mut read));
            read
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                Instant::now() < deadline,
                "the guest never wrote the done port"
            );
            hooks.before_run();
            let mut exit = vcpu.run();
            let done = match &mut exit {
                Ok(VcpuExit::IoOut(port, data))
                    if (pio.base()..pio.base() + pio.len()).contains(port) =>
                {
                    tx.send((u64::from(*port - pio.base()), data.to_vec()))
                        .unwrap();
                    assert!(done_rx.recv_timeout(Duration::from_secs(5)).unwrap());
                    false
                }
                Ok(VcpuExit::IoOut(DONE_PORT, _)) => true,
                other => panic!("unexpected exit {other:?}"),
            };
            drop(exit);
            hooks.after_run(&vcpu);
            if done {
                break;
            }
        }
        drop(tx);
        assert_eq!(
            device.join().unwrap(),
            [0xff; 4],
            "reads without hooks read all ones"
        );
        let problems = pvspin.check();
        assert_eq!(found(&problems, ProblemKind::DoorbellWithoutHooks).count, 2);
        assert_eq!(pio.unattributed(), 2);
        let tel = pvspin.telemetry();
        assert_eq!(tel.kick.unwrap().stats.kicks, 0, "the kick reached nobody");
        assert!(tel
            .problems
            .iter()
            .any(|p| p.kind == ProblemKind::DoorbellWithoutHooks));
    });
}

/// In-kernel path: kick eventfds not registered, or registered with a `u64` datamatch (an
/// 8-byte ioeventfd a 4-byte `OUT` never matches). At `configure_vcpu` that is refused naming
/// the rule; if the VMM re-registers them that way later, every kick exits: counted, logged,
/// listed.
#[test]
fn kick_eventfds_registered_wrong_are_refused_or_counted() {
    const NAME: &str = "kick_eventfds_registered_wrong_are_refused_or_counted";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let (t, pvspin) = vm_on(&kvm, KickPath::InKernel, 1, false);
        kick_guest(&t, 0);
        let wiring = pvspin.set_kick_gsis(&[40]).unwrap();
        let mut routes = irqchip::default_irqchip_routes();
        routes.extend(wiring.routes().unwrap());
        apply_routes(&t.vm, &routes);
        let mut vcpu = t.vm.create_vcpu(0).unwrap();
        cpuid_set(&kvm, &pvspin, 0, &vcpu);
        real_mode(&vcpu);
        // Nothing registered.
        let err = config_err(pvspin.configure_vcpu(0, &mut vcpu).unwrap_err());
        assert!(
            matches!(err, ConfigError::KickIrqfd { index: 0, gsi: 40 }),
            "{err}"
        );
        // The VMM's own calls: irqfds right, ioeventfds with a u64 datamatch.
        for (fd, gsi) in wiring.irqfds() {
            t.vm.register_irqfd(fd, gsi).unwrap();
        }
        for ev in wiring.ioevents() {
            t.vm.register_ioevent(ev.eventfd, &ev.address, u64::from(ev.datamatch))
                .unwrap();
        }
        let err = config_err(pvspin.configure_vcpu(0, &mut vcpu).unwrap_err());
        assert!(
            matches!(
                err,
                ConfigError::KickIoeventfd {
                    index: 0,
                    port: DOORBELL
                }
            ),
            "{err}"
        );
        // Right: 4 bytes.
        let swap = |four: bool| {
            for ev in wiring.ioevents() {
                let (old, new) = (u64::from(ev.datamatch), ev.datamatch);
                if four {
                    t.vm.unregister_ioevent(ev.eventfd, &ev.address, old)
                        .unwrap();
                    t.vm.register_ioevent(ev.eventfd, &ev.address, new).unwrap();
                } else {
                    t.vm.unregister_ioevent(ev.eventfd, &ev.address, new)
                        .unwrap();
                    t.vm.register_ioevent(ev.eventfd, &ev.address, old).unwrap();
                }
            }
        };
        swap(true);
        let (mut hooks, _) = pvspin
            .configure_vcpu(0, &mut vcpu)
            .expect("registered right");
        // Later the VMM re-registers them with the u64 datamatch: the kick exits.
        swap(false);
        assert_eq!(
            run_to_done(&mut vcpu, &mut hooks),
            1,
            "the kick reached userspace"
        );
        let problems = pvspin.check();
        let p = found(&problems, ProblemKind::KicksMissedIoeventfd);
        assert_eq!((p.count, p.vcpus.as_slice()), (1, &[0][..]), "{p}");
        assert!(p.rule.contains("u64"), "{p}");
        assert_eq!(pvspin.telemetry().kick.unwrap().stats.in_kernel_missed, 1);
    });
}

/// The in-kernel path without an irqchip: named at `set_kick_gsis`, before KVM's bare
/// `KVM_IRQFD: Invalid argument`.
#[test]
fn the_in_kernel_path_without_an_irqchip_is_named() {
    const NAME: &str = "the_in_kernel_path_without_an_irqchip_is_named";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let t = TestVm::new(&kvm, MEM_SIZE);
        let pvspin = pvspin_for(KickPath::InKernel, 2);
        pvspin.configure_vm(&kvm, &t.vm).unwrap();
        let err = config_err(pvspin.set_kick_gsis(&[40, 41]).unwrap_err());
        assert!(
            matches!(
                err,
                ConfigError::NoIrqchip {
                    call: "PvSpin::set_kick_gsis"
                }
            ),
            "{err}"
        );
        // With the irqchip, the same call goes through.
        t.vm.create_irq_chip().unwrap();
        pvspin.set_kick_gsis(&[40, 41]).expect("with an irqchip");
    });
}

/// `configure_vm` after the vCPUs exist: KVM is asked, and the rule named (without a plan it
/// used to pass; with a dedicated plan it said "(0 exist)").
#[test]
fn configure_vm_after_the_vcpus_is_refused() {
    const NAME: &str = "configure_vm_after_the_vcpus_is_refused";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        for plan in [false, true] {
            let t = TestVm::new(&kvm, MEM_SIZE);
            let _vcpus: Vec<VcpuFd> = (0..4).map(|i| t.vm.create_vcpu(i).unwrap()).collect();
            let mut builder = PvSpin::builder()
                .vcpus(4)
                .interrupter(Arc::new(NoInterrupter));
            if plan {
                builder = builder.paravirt(PlanRequest::new(Placement::Dedicated, 4));
            }
            let pvspin = builder.build().unwrap();
            let err = pvspin.configure_vm(&kvm, &t.vm).unwrap_err();
            assert!(!err.to_string().contains("(0 exist)"), "{err}");
            let err = config_err(err);
            assert!(
                matches!(err, ConfigError::VmAfterVcpus),
                "plan {plan}: {err}"
            );
        }
        // Before any vCPU it passes.
        let t = TestVm::new(&kvm, MEM_SIZE);
        pvspin_for(KickPath::Userspace, 1)
            .configure_vm(&kvm, &t.vm)
            .expect("before the vCPUs");
        // The plan's own message no longer claims a count KVM did not give.
        let caps = pvspin_kvm::plan::HostCaps::probe(&kvm, &t.vm).unwrap();
        let dedicated =
            pvspin_kvm::plan::Plan::new(&PlanRequest::new(Placement::Dedicated, 1), &caps).unwrap();
        if !dedicated.disable_exits.is_empty() {
            let _vcpu = t.vm.create_vcpu(0).unwrap();
            let e = pvspin_kvm::plan::apply_vm(&dedicated, &t.vm, 0).unwrap_err();
            assert!(e.to_string().contains("the VM already has vCPUs"), "{e}");
        }
    });
}

/// Registering the wiring twice: KVM's EBUSY, named; the first registration stays intact.
#[test]
fn registering_the_wiring_twice_is_named() {
    const NAME: &str = "registering_the_wiring_twice_is_named";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let (t, pvspin) = vm_on(&kvm, KickPath::InKernel, 1, true);
        let wiring = pvspin.kick_wiring().unwrap();
        let err = config_err(wiring.register(&t.vm).unwrap_err());
        assert!(matches!(err, ConfigError::WiringRegisteredTwice), "{err}");
        let mut vcpu = t.vm.create_vcpu(0).unwrap();
        cpuid_set(&kvm, &pvspin, 0, &vcpu);
        pvspin
            .configure_vcpu(0, &mut vcpu)
            .expect("the first registration is intact");
    });
}

extern "C" fn foreign_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The interrupt signal shared with another handler (a VMM's own vCPU kick signal): warned
/// about, reported by the interrupter, listed by `check`. The default is not SIGRTMIN, which
/// Firecracker, Cloud Hypervisor and crosvm use.
#[test]
fn an_interrupt_signal_shared_with_another_handler_is_reported() {
    const NAME: &str = "an_interrupt_signal_shared_with_another_handler_is_reported";
    let kvm = kvm_required(NAME);
    with_watchdog(NAME, LIMIT, || {
        let rtmin = vmm_sys_util::signal::SIGRTMIN();
        assert_ne!(pvspin::interrupt::default_signal(), rtmin);
        // A handler was there first.
        let before = rtmin + 7;
        vmm_sys_util::signal::register_signal_handler(before, foreign_handler).unwrap();
        let had = pvspin::SignalInterrupter::with_signal(1, before).unwrap();
        assert_eq!(
            had.collision(),
            Some(SignalCollision::HadHandler { signal: before })
        );
        // A handler installed afterwards replaces pvspin's.
        let after = rtmin + 8;
        let replaced = pvspin::SignalInterrupter::with_signal(1, after).unwrap();
        assert_eq!(replaced.collision(), None);
        vmm_sys_util::signal::register_signal_handler(after, foreign_handler).unwrap();
        assert_eq!(
            replaced.collision(),
            Some(SignalCollision::Replaced { signal: after })
        );
        for (interrupter, signal) in [(had, before), (replaced, after)] {
            let pvspin = PvSpin::builder()
                .vcpus(1)
                .interrupter(interrupter)
                .kick(KickOptions::new(KickPath::Userspace))
                .build()
                .unwrap();
            let t = TestVm::new(&kvm, MEM_SIZE);
            pvspin.configure_vm(&kvm, &t.vm).unwrap();
            let problems = pvspin.check();
            let p = found(&problems, ProblemKind::InterruptSignalShared);
            assert_eq!(p.signal, Some(signal), "{p}");
            assert!(p.rule.contains("SIGRTMIN"), "{p}");
        }
    });
}
