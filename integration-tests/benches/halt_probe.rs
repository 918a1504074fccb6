//! How a VMM can tell that a vCPU is halted inside KVM (in-kernel LAPIC), measured on real
//! KVM: what one look costs and how soon it shows a wake-up. The run slots' halt watcher uses
//! the first; this benchmark is why.
//!
//! * `blocking`: KVM's per-vCPU binary statistic (an instant boolean), one 8-byte `pread` of
//!   the vCPU's stats fd (`pvspin_kvm::stats::StatValue`);
//! * all stats: one `pread` of the whole data block and its decoding (what a watcher that wants
//!   `halt_wait_ns` or `halt_wakeup` too would read; both are cumulative, so telling "halted
//!   now" from them needs two reads);
//! * `/proc` state: `/proc/self/task/TID/stat`, opened, read and parsed for the state field
//!   (`S` while blocked in KVM, but also while parked on any other wait, so it cannot tell a
//!   halt from a VMM-side wait).
//!
//! The guest (real mode, in-kernel irqchip, interrupts off) counts down a short loop and halts;
//! a REMRD MSI (`KVM_SIGNAL_MSI`, KVM's PV kick) wakes it. Reaction: from the MSI to the first
//! look that shows the vCPU running again.
//!
//! Run: `cargo bench -p pvspin-integration-tests --bench halt_probe` (needs /dev/kvm).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use pvspin_integration_tests::{kvm_required, with_watchdog, TestVm};
use pvspin_kvm::stats::StatsFd;

/// `start: mov cx, 0xffff; loop $; hlt; jmp start` (16-bit).
const GUEST: &[u8] = &[0xb9, 0xff, 0xff, 0xe2, 0xfe, 0xf4, 0xeb, 0xf8];
const CODE_AT: u64 = 0x1000;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn proc_state(path: &str) -> Option<u8> {
    let text = std::fs::read_to_string(path).ok()?;
    // The state follows the command name's closing parenthesis.
    let rest = &text[text.rfind(')')? + 2..];
    rest.bytes().next()
}

fn time_per_call(iterations: u32, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(iterations)
}

fn main() {
    let kvm: Kvm = kvm_required("halt_probe");
    with_watchdog("halt_probe", Duration::from_secs(120), || run(&kvm));
    // The vCPU thread stays in KVM_RUN (halted, interrupts off): end the process here.
    #[allow(clippy::exit)]
    std::process::exit(0);
}

fn run(kvm: &Kvm) {
    let test = TestVm::new(kvm, 0x10000);
    pvspin_kvm::irqchip::create_irqchip(&test.vm).expect("irqchip");
    test.write(CODE_AT, GUEST);
    let mut vcpu = test.vm.create_vcpu(0).expect("vCPU");
    let mut sregs = vcpu.get_sregs().expect("sregs");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).expect("set sregs");
    let mut regs = vcpu.get_regs().expect("regs");
    regs.rip = CODE_AT;
    regs.rflags = 2; // interrupts off: only a PV kick ends the halt
    vcpu.set_regs(&regs).expect("set regs");
    // KVM builds its APIC-ID map (which the MSI needs) when a LAPIC is written.
    pvspin_kvm::irqchip::refresh_lapic(&vcpu).expect("LAPIC refresh");
    let stats = StatsFd::for_vcpu(&vcpu).expect("KVM_GET_STATS_FD");
    let blocking = stats
        .value_reader("blocking")
        .expect("this KVM has the `blocking` statistic")
        .expect("stats fd");
    let tid = Arc::new(AtomicI32::new(0));
    let t = tid.clone();
    std::thread::spawn(move || {
        // SAFETY: gettid has no arguments and cannot fail.
        t.store(unsafe { libc::gettid() }, Ordering::Release);
        loop {
            let _ = vcpu.run();
        }
    });
    while tid.load(Ordering::Acquire) == 0 {
        std::thread::yield_now();
    }
    let proc_path = format!("/proc/self/task/{}/stat", tid.load(Ordering::Acquire));
    let halted = |limit: Duration| {
        let start = Instant::now();
        while blocking.read().expect("read") == 0 {
            assert!(start.elapsed() < limit, "the guest never halted");
            std::hint::spin_loop();
        }
    };
    halted(Duration::from_secs(10));

    println!("halt probes on a vCPU halted in KVM (in-kernel LAPIC), real KVM");
    println!("cost of one look, mean over many:");
    let b = time_per_call(200_000, || {
        std::hint::black_box(blocking.read().expect("read"));
    });
    let all = time_per_call(20_000, || {
        std::hint::black_box(stats.read().expect("read"));
    });
    let proc = time_per_call(20_000, || {
        std::hint::black_box(proc_state(&proc_path));
    });
    println!("  `blocking` (one 8-byte pread)        {b:8.0} ns");
    println!("  every stat (pread of the data block) {all:8.0} ns");
    println!("  /proc/self/task/TID/stat state       {proc:8.0} ns");

    // Reaction to a wake-up: MSI, then look until the vCPU shows running. KVM's cumulative
    // `halt_exits` (counted when the vCPU halts) tells whether it already halted again: a
    // wake-up whose run ended before any look saw it is counted as missed. (`halt_wakeup`
    // would not do: the waker counts it, before the woken thread runs.)
    let halts = stats
        .value_reader("halt_exits")
        .expect("this KVM has the `halt_exits` statistic")
        .expect("stats fd");
    let rounds = 300;
    let mut by_stat = Vec::with_capacity(rounds);
    let mut by_proc = Vec::with_capacity(rounds);
    let (mut missed_stat, mut missed_proc) = (0, 0);
    for round in 0..rounds {
        halted(Duration::from_secs(10));
        // Let the thread settle in the halt.
        std::thread::sleep(Duration::from_micros(200));
        let before = halts.read().expect("read");
        let start = Instant::now();
        let delivered = pvspin_kvm::irqchip::signal_remrd(&test.vm, 0).expect("KVM_SIGNAL_MSI");
        assert!(delivered, "the REMRD MSI reached no vCPU");
        let by_blocking = round % 2 == 0;
        let seen = loop {
            let running = if by_blocking {
                blocking.read().expect("read") == 0
            } else {
                proc_state(&proc_path) == Some(b'R')
            };
            if running {
                break true;
            }
            if halts.read().expect("read") > before {
                // It woke and halted again between two looks.
                break false;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "no wake-up at all"
            );
        };
        let ns = start.elapsed().as_nanos() as u64;
        match (by_blocking, seen) {
            (true, true) => by_stat.push(ns),
            (true, false) => missed_stat += 1,
            (false, true) => by_proc.push(ns),
            (false, false) => missed_proc += 1,
        }
    }
    println!("  missed (woke and halted again between two looks): `blocking` {missed_stat}, /proc {missed_proc}");
    by_stat.sort_unstable();
    by_proc.sort_unstable();
    println!("reaction: from the kick (REMRD MSI) to the first look that shows it running:");
    for (name, v) in [("`blocking`", &by_stat), ("/proc state", &by_proc)] {
        println!(
            "  {name:12} p50 {:6} ns  p90 {:6} ns  p99 {:6} ns  max {:6} ns  ({} rounds)",
            percentile(v, 0.5),
            percentile(v, 0.9),
            percentile(v, 0.99),
            v[v.len() - 1],
            v.len()
        );
    }
}
