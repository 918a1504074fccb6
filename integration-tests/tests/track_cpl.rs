//! pvspin-track's CPL-from-sync-registers against a real guest: a hand-assembled long-mode
//! program OUTs at CPL 0, `iretq`s to CPL 3 (IOPL 3, so port I/O stays legal) and OUTs again.
//! The CPL pvspin-track reports at each exit comes from `kvm_run.s.regs.sregs` only; a
//! `KVM_GET_SREGS` afterwards cross-checks it.

use kvm_bindings::kvm_segment;
use kvm_ioctls::VcpuExit;
use pvspin_integration_tests::TestVm;
use pvspin_track::{cpl, VcpuBoard};

const MEM_SIZE: usize = 0x20_0000;
const PML4: usize = 0x2000;
const PDPT: usize = 0x3000;
const PD: usize = 0x4000;
const GDT: usize = 0x5000;
const CODE: usize = 0x1_0000;
const KSTACK: u64 = 0x8000;
const USTACK: u32 = 0x9000;
const PORT: u16 = 0x3f8;

/// The guest program, assembled by hand.
fn program() -> Vec<u8> {
    let mut c = vec![
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0xb0, 0x4c, // mov al, 'L'
        0xee, // out dx, al              (exit 1, CPL 0)
        0x6a, 0x1b, // push 0x1b             (user SS: GDT[3] | RPL 3)
        0x68, // push imm32 (user RSP)
    ];
    c.extend_from_slice(&USTACK.to_le_bytes());
    c.extend_from_slice(&[0x68, 0x02, 0x30, 0x00, 0x00]); // push 0x3002 (RFLAGS: IOPL 3)
    c.extend_from_slice(&[0x6a, 0x23]); // push 0x23 (user CS: GDT[4] | RPL 3)
    c.push(0x68); // push imm32 (user RIP)
    let user_rip_at = c.len();
    c.extend_from_slice(&[0; 4]);
    c.extend_from_slice(&[0x48, 0xcf]); // iretq
    let user = (CODE + c.len()) as u32;
    c[user_rip_at..user_rip_at + 4].copy_from_slice(&user.to_le_bytes());
    c.extend_from_slice(&[
        0xb0, 0x55, // mov al, 'U'
        0xee, // out dx, al              (exit 2, CPL 3)
        0xeb, 0xfb, // jmp back to the mov: OUTs at CPL 3 forever (the cost measurement)
    ]);
    c
}

fn seg(selector: u16, type_: u8, dpl: u8, l: u8, db: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl,
        db,
        s: 1,
        l,
        g: 1,
        ..Default::default()
    }
}

/// A VM with the program loaded and one vCPU at its first instruction, in long mode.
struct Guest {
    vcpu: Option<kvm_ioctls::VcpuFd>,
    _vm: TestVm,
}

fn guest(kvm: &kvm_ioctls::Kvm) -> Guest {
    let test_vm = TestVm::new(kvm, MEM_SIZE);
    // Identity map of the first 2 MiB, user-accessible (P | RW | US, PS on the PD entry).
    test_vm.write(PML4 as u64, &(0x7 | PDPT as u64).to_le_bytes());
    test_vm.write(PDPT as u64, &(0x7 | PD as u64).to_le_bytes());
    test_vm.write(PD as u64, &0x87u64.to_le_bytes());
    // GDT: null, kernel code, kernel data, user data (DPL 3), user code (DPL 3, 64-bit).
    for (i, d) in [
        0,
        0x00af_9a00_0000_ffffu64,
        0x00cf_9200_0000_ffff,
        0x00cf_f200_0000_ffff,
        0x00af_fa00_0000_ffff,
    ]
    .into_iter()
    .enumerate()
    {
        test_vm.write((GDT + 8 * i) as u64, &d.to_le_bytes());
    }
    test_vm.write(CODE as u64, &program());
    let vm = &test_vm.vm;

    let vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cr3 = PML4 as u64;
    sregs.cr4 = 1 << 5; // PAE
    sregs.cr0 = 1 | 2 | 0x20 | 0x1_0000 | (1 << 31); // PE MP NE WP PG
    sregs.efer = (1 << 8) | (1 << 10); // LME LMA
    sregs.cs = seg(0x08, 11, 0, 1, 0);
    let data = seg(0x10, 3, 0, 0, 1);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.gdt.base = GDT as u64;
    sregs.gdt.limit = 5 * 8 - 1;
    vcpu.set_sregs(&sregs).unwrap();
    let mut regs = vcpu.get_regs().unwrap();
    regs.rip = CODE as u64;
    regs.rsp = KSTACK;
    regs.rflags = 2;
    vcpu.set_regs(&regs).unwrap();
    Guest {
        vcpu: Some(vcpu),
        _vm: test_vm,
    }
}

#[test]
fn cpl_from_sync_regs_matches_guest_mode() {
    let Some(kvm) = pvspin_integration_tests::kvm_or_skip("cpl_from_sync_regs_matches_guest_mode")
    else {
        return;
    };
    cpl::check_sync_sregs(&kvm).expect("KVM_CAP_SYNC_REGS with sregs");
    let mut g = guest(&kvm);
    let vcpu = g.vcpu.as_mut().unwrap();
    cpl::enable_sync_sregs(vcpu);
    let board = VcpuBoard::new(1).unwrap();

    let mut seen = vec![];
    for _ in 0..2 {
        board.on_enter_run(0);
        let exit = match vcpu.run().unwrap() {
            VcpuExit::IoOut(port, data) => (port, data.to_vec()),
            other => panic!("unexpected exit {other:?}"),
        };
        // The measurement: sync registers only.
        let c = cpl::cpl_from_sync_regs(vcpu);
        board.on_exit(0, Some(c));
        // Cross-check with the ioctl pvspin-track avoids.
        let real = vcpu.get_sregs().unwrap();
        assert_eq!(
            cpl::cpl_from_sregs(&real),
            c,
            "sync regs disagree with KVM_GET_SREGS"
        );
        assert_eq!(real.cs.dpl, c);
        seen.push((exit, board.snapshot(0).unwrap().cpl()));
    }
    assert_eq!(
        seen,
        [((PORT, vec![b'L']), Some(0)), ((PORT, vec![b'U']), Some(3)),]
    );
}

/// Cost of knowing the CPL at each exit: plain exits, exits with `KVM_SYNC_X86_SREGS`, and
/// exits followed by a `KVM_GET_SREGS` ioctl. A measurement, not a check: run it with
/// `cargo test -p pvspin-integration-tests --test track_cpl -- --ignored --nocapture`.
#[test]
#[ignore = "measurement; prints medians"]
fn measure_cpl_cost_per_exit() {
    let Some(kvm) = pvspin_integration_tests::kvm_or_skip("measure_cpl_cost_per_exit") else {
        return;
    };
    const EXITS: usize = 3000;
    const ROUNDS: usize = 5;
    let mut g = guest(&kvm);
    let vcpu = g.vcpu.as_mut().unwrap();
    // Reach the CPL-3 loop first.
    for _ in 0..2 {
        assert!(matches!(vcpu.run().unwrap(), VcpuExit::IoOut(..)));
    }
    let run = |vcpu: &mut kvm_ioctls::VcpuFd, mode: u8| -> f64 {
        let t = std::time::Instant::now();
        let mut sum = 0u32;
        for _ in 0..EXITS {
            assert!(matches!(vcpu.run().unwrap(), VcpuExit::IoOut(..)));
            sum += u32::from(match mode {
                0 => 0,
                1 => cpl::cpl_from_sync_regs(vcpu),
                _ => cpl::cpl_from_sregs(&vcpu.get_sregs().unwrap()),
            });
        }
        if mode != 0 {
            assert_eq!(sum, 3 * EXITS as u32);
        }
        t.elapsed().as_secs_f64() * 1e6 / EXITS as f64
    };
    let med = |vcpu: &mut kvm_ioctls::VcpuFd, mode: u8| {
        let mut v: Vec<f64> = (0..ROUNDS).map(|_| run(vcpu, mode)).collect();
        v.sort_by(f64::total_cmp);
        v[ROUNDS / 2]
    };
    let plain = med(vcpu, 0);
    let ioctl = med(vcpu, 2);
    cpl::enable_sync_sregs(vcpu);
    let sync = med(vcpu, 1);
    // The two reads alone, without the exits around them.
    let per = |f: &mut dyn FnMut() -> u8| {
        let t = std::time::Instant::now();
        let mut sum = 0u32;
        for _ in 0..EXITS {
            sum += u32::from(f());
        }
        assert_eq!(sum, 3 * EXITS as u32);
        t.elapsed().as_secs_f64() * 1e6 / EXITS as f64
    };
    let read_sync = per(&mut || cpl::cpl_from_sync_regs(vcpu));
    let read_ioctl = per(&mut || cpl::cpl_from_sregs(&vcpu.get_sregs().unwrap()));
    println!("us per read alone: sync regs {read_sync:.3}, KVM_GET_SREGS {read_ioctl:.3}");
    println!(
        "us per exit (median of {ROUNDS} x {EXITS}): plain {plain:.2}, sync sregs {sync:.2}, \
         KVM_GET_SREGS per exit {ioctl:.2}"
    );
}
