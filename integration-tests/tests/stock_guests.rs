//! Issue 12 on real /dev/kvm: the paravirt plan for stock Linux guests. Tiny real-mode guests
//! execute CPUID and report what they got with OUT; every rule's refusal is checked against the
//! real host; the quirk mask the VMM set is kept across pvspin's `KVM_CAP_DISABLE_QUIRKS2`
//! calls, observed through the one quirk a guest can see here (FIX_HYPERCALL_INSN: a
//! wrong-vendor hypercall raises #UD with it off, and is rewritten, or loops on emulating hosts,
//! with it on).
//!
//! These tests fail, not skip, without /dev/kvm. Every guest run is bounded: CPUID guests only
//! execute CPUID and OUT (at most a few exits), the hypercall probe is interrupted with a signal
//! after 1 s, and a watchdog aborts the test process if a run still hangs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_cpuid_entry2, kvm_enable_cap, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use pvspin_integration_tests::{kvm_required, with_watchdog, TestVm};
use pvspin_kvm::guest::{
    guest_outcome, GuestCpuid, GuestKernel, GuestLockChoice, KernelLine, LinuxGuest,
};
use pvspin_kvm::plan::{
    apply_vcpu, apply_vm, plan_for_vcpu, ExitFlags, HostCaps, Placement, Plan, PlanError,
    PlanRequest, PvFeatures, HYPERVISOR_BIT, KVM_SIGNATURE,
};
use pvspin_kvm::quirks::FIX_HYPERCALL_INSN;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

const MEM_SIZE: usize = 0x10000;
const CODE_AT: u64 = 0x1000;
/// `KVM_X86_QUIRK_LINT0_REENABLED`: a quirk the VMM disables that the guest cannot observe.
const LINT0_REENABLED: u64 = 1 << 0;

fn real_mode(vcpu: &VcpuFd) {
    let mut sregs = vcpu.get_sregs().expect("get sregs");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).expect("set sregs");
    let mut regs = vcpu.get_regs().expect("get regs");
    regs.rip = CODE_AT;
    regs.rax = 0;
    regs.rflags = 2;
    vcpu.set_regs(&regs).expect("set regs");
}

/// Real-mode guest: reports CPUID.1:ECX (port 0x10), 0x40000000.EBX (0x11), 0x40000001.EAX
/// (0x12) and .EDX (0x13), and the pvspin signature leaf's EBX (0x14), then OUTs to 0x1f. No HLT,
/// so it ends the same with or without an in-kernel irqchip.
const CPUID_GUEST: &[u8] = &[
    0x66, 0xb8, 0x01, 0x00, 0x00, 0x00, // mov eax, 1
    0x66, 0x31, 0xc9, // xor ecx, ecx
    0x0f, 0xa2, // cpuid
    0x66, 0x89, 0xc8, // mov eax, ecx
    0x66, 0xe7, 0x10, // out 0x10, eax
    0x66, 0xb8, 0x00, 0x00, 0x00, 0x40, // mov eax, 0x40000000
    0x66, 0x31, 0xc9, 0x0f, 0xa2, // xor ecx, ecx; cpuid
    0x66, 0x89, 0xd8, // mov eax, ebx
    0x66, 0xe7, 0x11, // out 0x11, eax
    0x66, 0xb8, 0x01, 0x00, 0x00, 0x40, // mov eax, 0x40000001
    0x66, 0x31, 0xc9, 0x0f, 0xa2, // xor ecx, ecx; cpuid
    0x66, 0xe7, 0x12, // out 0x12, eax
    0x66, 0x89, 0xd0, // mov eax, edx
    0x66, 0xe7, 0x13, // out 0x13, eax
    0x66, 0xb8, 0x00, 0x02, 0x00, 0x40, // mov eax, 0x40000200
    0x66, 0x31, 0xc9, 0x0f, 0xa2, // xor ecx, ecx; cpuid
    0x66, 0x89, 0xd8, // mov eax, ebx
    0x66, 0xe7, 0x14, // out 0x14, eax
    0xe6, 0x1f, // out 0x1f, al: done
];

/// What the CPUID guest reported.
#[derive(Debug, Default, PartialEq, Eq)]
struct GuestView {
    leaf1_ecx: u32,
    signature_ebx: u32,
    features_eax: u32,
    hints_edx: u32,
    pvspin_ebx: u32,
}

fn run_cpuid_guest(vcpu: &mut VcpuFd) -> GuestView {
    let mut view = GuestView::default();
    for _ in 0..8 {
        match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                let mut b = [0u8; 4];
                b[..data.len()].copy_from_slice(data);
                let v = u32::from_le_bytes(b);
                match port {
                    0x10 => view.leaf1_ecx = v,
                    0x11 => view.signature_ebx = v,
                    0x12 => view.features_eax = v,
                    0x13 => view.hints_edx = v,
                    0x14 => view.pvspin_ebx = v,
                    0x1f => return view,
                    p => panic!("unexpected OUT to {p:#x}"),
                }
            }
            other => panic!("CPUID guest: unexpected exit {other:?}"),
        }
    }
    panic!("CPUID guest did not finish: {view:?}");
}

fn host(kvm: &Kvm) -> HostCaps {
    let vm = kvm.create_vm().expect("create VM");
    HostCaps::probe(kvm, &vm).expect("probe host")
}

/// A VM with one vCPU in real mode at the CPUID guest; `irqchip` creates the in-kernel one.
fn cpuid_vm(kvm: &Kvm, irqchip: bool, before_vcpu: impl FnOnce(&VmFd)) -> (TestVm, VcpuFd) {
    let t = TestVm::new(kvm, MEM_SIZE);
    t.write(CODE_AT, CPUID_GUEST);
    if irqchip {
        t.vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
    }
    before_vcpu(&t.vm);
    let vcpu = t.vm.create_vcpu(0).expect("create vCPU");
    real_mode(&vcpu);
    (t, vcpu)
}

fn supported(kvm: &Kvm) -> CpuId {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .expect("KVM_GET_SUPPORTED_CPUID")
}

/// The lock every line of the guest-kernel table picks for what this guest read.
fn locks(view: &GuestView, cpus: u32) -> Vec<(KernelLine, GuestLockChoice)> {
    let cpuid = GuestCpuid {
        pv_features: PvFeatures(view.features_eax),
        realtime: view.hints_edx & 1 == 1,
        possible_cpus: cpus,
        mwait: false,
    };
    KernelLine::ALL
        .into_iter()
        .map(|line| (line, guest_outcome(LinuxGuest::base(line), &cpuid).lock))
        .collect()
}

/// Every placement, guest family and irqchip setting the plan accepts: the guest reads the
/// resolved plan back, sees the hypervisor bit and the KVM signature, and no kernel of the
/// declared family is left with test-and-set on dedicated vCPUs.
#[test]
fn guest_reads_back_the_plan_for_each_placement_and_guest_kernel() {
    let kvm = kvm_required("guest_reads_back_the_plan_for_each_placement_and_guest_kernel");
    let caps = host(&kvm);
    with_watchdog("guest_reads_back_the_plan", Duration::from_secs(60), || {
        for placement in Placement::ALL {
            for guest in GuestKernel::ALL {
                for irqchip in [true, false] {
                    let mut request = PlanRequest::new(placement, 4);
                    request.guest_kernel = guest;
                    let plan = Plan::new(&request, &caps).expect("plan");
                    let (t, mut vcpu) = cpuid_vm(&kvm, irqchip, |vm| {
                        apply_vm(&plan, vm, 0).expect("VM stage");
                    });
                    let mut cpuid = supported(&kvm);
                    let what = format!("{placement}, {guest} guest, irqchip {irqchip}");
                    let resolved = plan_for_vcpu(&plan, &vcpu);
                    let applied = apply_vcpu(&plan, &vcpu, &mut cpuid);
                    if placement == Placement::Dedicated && guest != GuestKernel::Modern && !irqchip
                    {
                        // Legacy guests need PV_UNHALT, which needs the in-kernel LAPIC.
                        let e = applied.expect_err(&what);
                        assert!(
                            matches!(e, PlanError::RealtimeWithoutPvUnhalt { .. }),
                            "{what}: {e}"
                        );
                        continue;
                    }
                    let resolved = resolved.expect(&what);
                    let applied = applied.expect(&what);
                    assert_eq!(applied.lapic_in_kernel, irqchip, "{what}");
                    let view = run_cpuid_guest(&mut vcpu);
                    eprintln!("{what}: {view:x?}");
                    drop(t);
                    assert_ne!(view.leaf1_ecx & HYPERVISOR_BIT, 0, "{what}");
                    assert_eq!(view.signature_ebx, KVM_SIGNATURE[0], "{what}");
                    assert_eq!(view.features_eax, applied.cpuid.eax, "{what}");
                    assert_eq!(
                        view.features_eax & PvFeatures::MANAGED.0,
                        resolved.pv_features.0,
                        "{what}"
                    );
                    let f = PvFeatures(view.features_eax);
                    let dedicated = placement == Placement::Dedicated;
                    assert_eq!(view.hints_edx, u32::from(dedicated), "{what}");
                    // POLL_CONTROL exactly where cpuidle-haltpoll loads (REALTIME).
                    assert_eq!(f.contains(PvFeatures::POLL_CONTROL), dedicated, "{what}");
                    // PV_UNHALT only with an in-kernel LAPIC and HLT exits enabled.
                    let hlt_off = resolved.disable_exits.contains(ExitFlags::HLT);
                    assert_eq!(
                        f.contains(PvFeatures::PV_UNHALT),
                        irqchip && !hlt_off,
                        "{what}"
                    );
                    let table = locks(&view, 4);
                    if dedicated {
                        for (line, lock) in &table {
                            let family = LinuxGuest::base(*line).family();
                            let covered = guest == GuestKernel::Unknown || family == guest;
                            if covered {
                                assert_eq!(
                                    *lock,
                                    GuestLockChoice::NativeQspinlock,
                                    "{what}: {line:?}"
                                );
                            }
                        }
                    } else if irqchip {
                        assert!(
                            table
                                .iter()
                                .all(|(_, l)| *l == GuestLockChoice::PvQspinlock),
                            "{what}: {table:?}"
                        );
                    }
                }
            }
        }
    });
}

/// Without an in-kernel irqchip there is nowhere for a kick to go: `KVM_GET_LAPIC` fails and
/// the REMRD MSI that `KVM_HC_KICK_CPU` sends (here through `KVM_SIGNAL_MSI`) is refused. So
/// PV_UNHALT is refused when explicit, dropped when a default.
#[test]
fn pv_unhalt_needs_an_in_kernel_lapic_on_the_real_host() {
    let kvm = kvm_required("pv_unhalt_needs_an_in_kernel_lapic_on_the_real_host");
    let caps = host(&kvm);
    with_watchdog(
        "pv_unhalt_needs_an_in_kernel_lapic",
        Duration::from_secs(30),
        || {
            let (t, vcpu) = cpuid_vm(&kvm, false, |_| {});
            assert!(vcpu.get_lapic().is_err(), "no in-kernel LAPIC");
            let remrd = kvm_bindings::kvm_msi {
                address_lo: 0xfee0_0000,
                data: 0x300,
                ..Default::default()
            };
            assert!(
                t.vm.signal_msi(remrd).is_err(),
                "a REMRD kick has no in-kernel LAPIC to reach"
            );
            drop((t, vcpu));
            let (t, vcpu) = cpuid_vm(&kvm, true, |_| {});
            assert!(vcpu.get_lapic().is_ok());
            drop((t, vcpu));

            let mut request = PlanRequest::new(Placement::Shared, 1);
            request.pv_features = Some(PvFeatures::PV_UNHALT.union(PvFeatures::STEAL_TIME));
            let plan = Plan::new(&request, &caps).unwrap();
            let (_t, vcpu) = cpuid_vm(&kvm, false, |vm| {
                apply_vm(&plan, vm, 0).unwrap();
            });
            let e = apply_vcpu(&plan, &vcpu, &mut supported(&kvm)).unwrap_err();
            assert!(matches!(e, PlanError::PvUnhaltNeedsInKernelLapic), "{e}");
            assert!(e
                .to_string()
                .starts_with("rule: PV_UNHALT needs an in-kernel LAPIC"));
            request.lapic_in_kernel = Some(false);
            assert!(matches!(
                Plan::new(&request, &caps).unwrap_err(),
                PlanError::PvUnhaltNeedsInKernelLapic
            ));
        },
    );
}

/// The CPUID rules: a VMM CPUID that hides the hypervisor is refused (or exposed on request),
/// one without KVM leaves gets them with the host's unmanaged bits, or is refused when the
/// VMM said never to add them.
#[test]
fn cpuid_rules_on_the_real_host() {
    let kvm = kvm_required("cpuid_rules_on_the_real_host");
    let caps = host(&kvm);
    with_watchdog(
        "cpuid_rules_on_the_real_host",
        Duration::from_secs(30),
        || {
            let without_kvm_leaves = || {
                let entries: Vec<kvm_cpuid_entry2> = supported(&kvm)
                    .as_slice()
                    .iter()
                    .filter(|e| !(0x4000_0000..0x4001_0000).contains(&e.function))
                    .copied()
                    .collect();
                CpuId::from_entries(&entries).unwrap()
            };
            let hidden = |mut c: CpuId| {
                for e in c.as_mut_slice() {
                    if e.function == 1 {
                        e.ecx &= !HYPERVISOR_BIT;
                    }
                }
                c
            };
            let request = PlanRequest::new(Placement::Shared, 1);
            let plan = Plan::new(&request, &caps).unwrap();

            // Hidden on purpose: refused, and nothing is installed.
            let (_t, vcpu) = cpuid_vm(&kvm, true, |_| {});
            let e = apply_vcpu(&plan, &vcpu, &mut hidden(supported(&kvm))).unwrap_err();
            assert!(matches!(e, PlanError::HypervisorHidden), "{e}");
            assert!(e.to_string().starts_with("rule:"));

            // Exposed on request: the guest sees the bit and the KVM leaves.
            let mut forced = request.clone();
            forced.add_kvm_leaves = Some(true);
            let forced = Plan::new(&forced, &caps).unwrap();
            let (_t, mut vcpu) = cpuid_vm(&kvm, true, |_| {});
            let mut cpuid = hidden(without_kvm_leaves());
            let applied = apply_vcpu(&forced, &vcpu, &mut cpuid).unwrap();
            assert!(applied.cpuid.added && applied.cpuid.hypervisor_bit_set);
            let view = run_cpuid_guest(&mut vcpu);
            assert_ne!(view.leaf1_ecx & HYPERVISOR_BIT, 0);
            assert_eq!(view.signature_ebx, KVM_SIGNATURE[0]);

            // Missing KVM leaves (hypervisor bit set): added, with the host's other bits.
            let (_t, mut vcpu) = cpuid_vm(&kvm, true, |_| {});
            let mut cpuid = without_kvm_leaves();
            let applied = apply_vcpu(&plan, &vcpu, &mut cpuid).unwrap();
            assert!(applied.cpuid.added && !applied.cpuid.hypervisor_bit_set);
            let view = run_cpuid_guest(&mut vcpu);
            let unmanaged = caps.pv_features.0 & !PvFeatures::MANAGED.0;
            assert_ne!(unmanaged, 0, "the host offers kvmclock and friends");
            assert_eq!(view.features_eax & !PvFeatures::MANAGED.0, unmanaged);
            assert_eq!(
                view.features_eax & PvFeatures::MANAGED.0,
                plan.pv_features.0
            );

            // Never add: refused.
            let mut never = request.clone();
            never.add_kvm_leaves = Some(false);
            let never = Plan::new(&never, &caps).unwrap();
            let (_t, vcpu) = cpuid_vm(&kvm, true, |_| {});
            let e = apply_vcpu(&never, &vcpu, &mut without_kvm_leaves()).unwrap_err();
            assert!(matches!(e, PlanError::KvmLeavesMissing), "{e}");
        },
    );
}

#[derive(Debug)]
struct NoInterrupter;
impl pvspin::VcpuInterrupter for NoInterrupter {
    fn interrupt(&self, _: usize) {}
}

/// With the kick on, pvspin's own leaf is added after the plan's edit: a VMM CPUID without KVM
/// leaves gets them (it used to be refused with NoKvmLeaf), and the guest sees both.
#[test]
fn kick_leaf_and_added_kvm_leaves_coexist() {
    let kvm = kvm_required("kick_leaf_and_added_kvm_leaves_coexist");
    with_watchdog(
        "kick_leaf_and_added_kvm_leaves_coexist",
        Duration::from_secs(30),
        || {
            let pvspin = pvspin::PvSpin::builder()
                .vcpus(1)
                .interrupter(Arc::new(NoInterrupter))
                .paravirt(PlanRequest::new(Placement::Overcommitted, 1))
                .kick(pvspin::KickOptions::new(pvspin::KickPath::InKernel))
                .build()
                .expect("build");
            let t = TestVm::new(&kvm, MEM_SIZE);
            t.write(CODE_AT, CPUID_GUEST);
            let setup = pvspin::simple::setup_vm(&pvspin, &kvm, &t.vm).expect("setup_vm");
            assert!(setup.hypercall_quirk_disabled);
            let mut vcpu = t.vm.create_vcpu(0).unwrap();
            let entries: Vec<kvm_cpuid_entry2> = supported(&kvm)
                .as_slice()
                .iter()
                .filter(|e| !(0x4000_0000..0x4001_0000).contains(&e.function))
                .copied()
                .collect();
            let mut cpuid = CpuId::from_entries(&entries).unwrap();
            let (_hooks, applied) =
                pvspin::simple::configure_vcpu(&pvspin, 0, &mut vcpu, &mut cpuid)
                    .expect("configure_vcpu with a CPUID without KVM leaves");
            let applied = applied.expect("plan applied");
            assert!(applied.cpuid.added && applied.lapic_in_kernel);
            real_mode(&vcpu);
            let view = run_cpuid_guest(&mut vcpu);
            assert_eq!(view.signature_ebx, KVM_SIGNATURE[0]);
            assert_eq!(view.pvspin_ebx, pvspin_abi::cpuid::SIGNATURE_EBX);
            assert!(PvFeatures(view.features_eax).contains(PvFeatures::PV_UNHALT));
            pvspin.shutdown();
        },
    );
}

extern "C" fn on_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Whether FIX_HYPERCALL_INSN is disabled on a VM, seen by a guest: a real-mode guest with a
/// #UD handler (IVT vector 6) executes the hypercall instruction the quirk governs there: the
/// wrong vendor's (VMCALL on AMD, VMMCALL on Intel) under hardware virtualization, VMCALL
/// under the `kvm_pvm` module whatever the CPU (these machines: KVM's emulator takes VMMCALL
/// in protected mode only, so in real mode it is #UD with the quirk on or off). #UD means the
/// quirk is off. With it on, KVM rewrites the instruction and the guest continues (hardware
/// virtualization) or loops on it (emulating hosts; interrupted after 1 s).
fn hypercall_faults(kvm: &Kvm, t: &TestVm) -> bool {
    let amd = supported(kvm)
        .as_slice()
        .iter()
        .find(|e| e.function == 0)
        .is_some_and(|e| {
            e.ebx == u32::from_le_bytes(*b"Auth") || e.ebx == u32::from_le_bytes(*b"Hygo")
        });
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    let insn: [u8; 3] = if amd || pvm {
        [0x0f, 0x01, 0xc1]
    } else {
        [0x0f, 0x01, 0xd9]
    };
    t.write(0x18, &[0x00, 0x20, 0x00, 0x00]); // IVT[6] = 0000:2000
    t.write(0x2000, &[0xe6, 0x11, 0xf4]); // out 0x11, al; hlt
    let mut code = insn.to_vec();
    code.extend_from_slice(&[0xe6, 0x10, 0xf4]); // out 0x10, al; hlt
    t.write(CODE_AT, &code);
    let mut vcpu = t.vm.create_vcpu(0).expect("create vCPU");
    real_mode(&vcpu);
    let stop = AtomicBool::new(false);
    let tid = AtomicU64::new(0);
    std::thread::scope(|s| {
        let runner = s.spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            tid.store(unsafe { libc::pthread_self() } as u64, Ordering::SeqCst);
            loop {
                match vcpu.run() {
                    Ok(VcpuExit::IoOut(0x11, _)) => return Some(true),
                    Ok(VcpuExit::IoOut(0x10, _)) => return Some(false),
                    Err(e) if e.errno() == libc::EINTR => {
                        if stop.load(Ordering::SeqCst) {
                            return None;
                        }
                    }
                    other => panic!("hypercall probe: unexpected exit {other:?}"),
                }
            }
        });
        let start = Instant::now();
        while !runner.is_finished() && start.elapsed() < Duration::from_millis(1000) {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::SeqCst);
        while !runner.is_finished() {
            let thread = tid.load(Ordering::SeqCst) as libc::pthread_t;
            // SAFETY: `thread` is the runner, alive until it finishes (checked above); the
            // signal has a no-op handler installed without SA_RESTART.
            unsafe { libc::pthread_kill(thread, SIGRTMIN()) };
            std::thread::sleep(Duration::from_millis(10));
        }
        // Looping on the hypercall (None) or continuing past it: the quirk is on.
        runner.join().expect("probe thread").unwrap_or(false)
    })
}

fn disable_quirks2(vm: &VmFd, mask: u64) {
    let mut cap = kvm_enable_cap {
        cap: kvm_bindings::KVM_CAP_DISABLE_QUIRKS2,
        ..Default::default()
    };
    cap.args[0] = mask;
    vm.enable_cap(&cap).expect("KVM_CAP_DISABLE_QUIRKS2");
}

fn pvspin_with(
    builder: impl FnOnce(pvspin::PvSpinBuilder) -> pvspin::PvSpinBuilder,
) -> pvspin::PvSpin {
    builder(
        pvspin::PvSpin::builder()
            .vcpus(1)
            .interrupter(Arc::new(NoInterrupter)),
    )
    .build()
    .expect("build")
}

/// The host's KVM_CAP_DISABLE_QUIRKS2 semantics (probed: replace before 9966b7822b3f, add
/// after), and pvspin keeping the VMM's mask in both orders.
#[test]
fn quirk_masks_set_by_the_vmm_are_kept() {
    let kvm = kvm_required("quirk_masks_set_by_the_vmm_are_kept");
    register_signal_handler(SIGRTMIN(), on_signal).expect("signal handler");
    let caps = host(&kvm);
    assert_ne!(caps.disableable_quirks & FIX_HYPERCALL_INSN, 0, "{caps:?}");
    assert_ne!(caps.disableable_quirks & LINT0_REENABLED, 0, "{caps:?}");
    with_watchdog(
        "quirk_masks_set_by_the_vmm_are_kept",
        Duration::from_secs(60),
        || {
            // The probe sees the quirk: on by default, off after disabling it.
            let t = TestVm::new(&kvm, MEM_SIZE);
            assert!(
                !hypercall_faults(&kvm, &t),
                "FIX_HYPERCALL_INSN is on by default"
            );
            let t = TestVm::new(&kvm, MEM_SIZE);
            disable_quirks2(&t.vm, FIX_HYPERCALL_INSN);
            assert!(hypercall_faults(&kvm, &t), "disabled: #UD");

            // The host's semantics: a second call that does not name the quirk.
            let t = TestVm::new(&kvm, MEM_SIZE);
            disable_quirks2(&t.vm, FIX_HYPERCALL_INSN);
            disable_quirks2(&t.vm, LINT0_REENABLED);
            let accumulates = hypercall_faults(&kvm, &t);
            eprintln!(
                "host KVM_CAP_DISABLE_QUIRKS2 {}",
                if accumulates {
                    "adds to the disabled set (9966b7822b3f or later)"
                } else {
                    "replaces the disabled set (before 9966b7822b3f)"
                }
            );

            // pvspin after the VMM: the VMM's quirks are part of what pvspin writes.
            for paravirt in [false, true] {
                let pvspin = pvspin_with(|b| {
                    let b = b.vmm_disabled_quirks(LINT0_REENABLED);
                    if paravirt {
                        b.paravirt(PlanRequest::new(Placement::Shared, 1))
                    } else {
                        b
                    }
                });
                let t = TestVm::new(&kvm, MEM_SIZE);
                disable_quirks2(&t.vm, LINT0_REENABLED);
                let setup = pvspin.configure_vm(&kvm, &t.vm).expect("configure_vm");
                assert_eq!(setup.disabled_quirks, LINT0_REENABLED | FIX_HYPERCALL_INSN);
                assert!(setup.hypercall_quirk_disabled);
                assert!(hypercall_faults(&kvm, &t), "paravirt {paravirt}");

                // The VMM after pvspin, including pvspin's mask: FIX_HYPERCALL_INSN stays off on
                // both kinds of host.
                let t = TestVm::new(&kvm, MEM_SIZE);
                let setup = pvspin_with(|b| b).configure_vm(&kvm, &t.vm).unwrap();
                disable_quirks2(&t.vm, setup.disabled_quirks | LINT0_REENABLED);
                assert!(hypercall_faults(&kvm, &t));
            }

            // The VMM disabled FIX_HYPERCALL_INSN itself and asks pvspin to keep its hands off:
            // pvspin writes nothing, and the VMM's setting stands.
            let pvspin = pvspin_with(|b| {
                b.keep_hypercall_quirk(true)
                    .vmm_disabled_quirks(FIX_HYPERCALL_INSN)
            });
            let t = TestVm::new(&kvm, MEM_SIZE);
            disable_quirks2(&t.vm, FIX_HYPERCALL_INSN);
            let setup = pvspin.configure_vm(&kvm, &t.vm).unwrap();
            assert_eq!(setup.disabled_quirks, 0);
            assert!(setup.hypercall_quirk_disabled, "by the VMM");
            assert!(hypercall_faults(&kvm, &t));

            // keep_hypercall_quirk(true) is honoured with a plan too (it used to be ignored).
            let pvspin = pvspin_with(|b| {
                b.keep_hypercall_quirk(true)
                    .paravirt(PlanRequest::new(Placement::Shared, 1))
            });
            let t = TestVm::new(&kvm, MEM_SIZE);
            let setup = pvspin.configure_vm(&kvm, &t.vm).unwrap();
            assert!(!setup.hypercall_quirk_disabled);
            let (plan, _) = setup.plan.as_ref().unwrap();
            assert!(!plan.disable_fix_hypercall_quirk);
            assert!(!hypercall_faults(&kvm, &t), "quirk kept on");

            // A VMM quirk the host cannot disable is refused, naming the rule.
            let pvspin = pvspin_with(|b| b.vmm_disabled_quirks(1 << 40));
            let t = TestVm::new(&kvm, MEM_SIZE);
            let e = pvspin.configure_vm(&kvm, &t.vm).unwrap_err();
            assert!(
                e.to_string().contains("rule: host KVM cannot disable"),
                "{e}"
            );
            let pvspin = pvspin_with(|b| {
                b.vmm_disabled_quirks(1 << 40)
                    .paravirt(PlanRequest::new(Placement::Shared, 1))
            });
            let t = TestVm::new(&kvm, MEM_SIZE);
            let e = pvspin.configure_vm(&kvm, &t.vm).unwrap_err();
            assert!(
                e.to_string().contains("rule: host cannot disable quirk"),
                "{e}"
            );
        },
    );
}

/// The remaining refusals against the real host's capabilities: the builder's (the plan's
/// vCPU count must be the VM's; keep_hypercall_quirk(true) must not contradict the request),
/// STEAL_TIME dependants, the placement fit, and KVM leaves next to a foreign hypervisor's.
#[test]
fn remaining_refusals_name_the_rule() {
    let kvm = kvm_required("remaining_refusals_name_the_rule");
    let caps = host(&kvm);
    let e = pvspin::PvSpin::builder()
        .vcpus(2)
        .interrupter(Arc::new(NoInterrupter))
        .paravirt(PlanRequest::new(Placement::Shared, 3))
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("rule: the paravirt plan's vCPU count"),
        "{e}"
    );
    let mut request = PlanRequest::new(Placement::Shared, 2);
    request.disable_fix_hypercall_quirk = Some(true);
    let e = pvspin::PvSpin::builder()
        .vcpus(2)
        .interrupter(Arc::new(NoInterrupter))
        .keep_hypercall_quirk(true)
        .paravirt(request)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().starts_with("rule: keep_hypercall_quirk"),
        "{e}"
    );

    let mut request = PlanRequest::new(Placement::Overcommitted, 2);
    request.pv_features = Some(PvFeatures::PV_TLB_FLUSH.union(PvFeatures::PV_UNHALT));
    let e = Plan::new(&request, &caps).unwrap_err();
    assert!(matches!(e, PlanError::NeedsStealTime { .. }), "{e}");

    let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let mut request = PlanRequest::new(Placement::Dedicated, host_cpus + 1);
    request.host_cpus = Some(host_cpus);
    let e = Plan::new(&request, &caps).unwrap_err();
    assert!(matches!(e, PlanError::PlacementDoesNotFit { .. }), "{e}");

    // Hyper-V's signature at 0x40000000 and no KVM signature anywhere.
    let plan = Plan::new(&PlanRequest::new(Placement::Shared, 1), &caps).unwrap();
    let mut entries: Vec<kvm_cpuid_entry2> = supported(&kvm)
        .as_slice()
        .iter()
        .filter(|e| !(0x4000_0000..0x4001_0000).contains(&e.function))
        .copied()
        .collect();
    entries.push(kvm_cpuid_entry2 {
        function: 0x4000_0000,
        eax: 0x4000_0005,
        ebx: u32::from_le_bytes(*b"Micr"),
        ecx: u32::from_le_bytes(*b"osof"),
        edx: u32::from_le_bytes(*b"t Hv"),
        ..Default::default()
    });
    let (_t, vcpu) = cpuid_vm(&kvm, true, |_| {});
    let e = apply_vcpu(&plan, &vcpu, &mut CpuId::from_entries(&entries).unwrap()).unwrap_err();
    assert!(matches!(e, PlanError::NoKvmLeaf), "{e}");
    assert!(e.to_string().starts_with("rule:"));
}
