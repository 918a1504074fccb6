//! The three kick paths against real KVM, with a tiny real-mode guest.
//!
//! vCPU1 (the waiter) reports "ready" with an `OUT`, then does `cli; hlt`, then reports "woke".
//! vCPU0 (the kicker) writes the doorbell, then reports "kicked". The host checks that a valid
//! kick wakes vCPU1 on every path, and that a kick naming a vCPU that does not exist, or a
//! kick of the wrong width, wakes nobody. Every wait on a guest is bounded; a watchdog stops the
//! vCPU threads with a signal (KVM_RUN returns EINTR) and, on the userspace path, the latch's
//! shutdown. Skips (prints SKIPPED) when /dev/kvm cannot be opened.

// The loom build only has the latch (`--lib loom`), not the device these tests drive.
#![cfg(not(loom))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use pvspin_abi::doorbell::DEFAULT_PORT;
use pvspin_integration_tests::{kvm_or_skip, TestVm};
use pvspin_kick::{KickConfig, KickDevice, ParkOutcome, Reject};
use pvspin_kvm::irqchip;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

const MEM_SIZE: usize = 0x10000;
const KICKER_32: u64 = 0x1000;
const KICKER_8: u64 = 0x1040;
const WAITER: u64 = 0x1100;
const TARGET_GPA: usize = 0x2000;
const PORT_READY: u16 = 0x600;
const PORT_WOKE: u16 = 0x601;
const PORT_KICKED: u16 = 0x602;
const NR_VCPUS: u32 = 2;
const ROUNDS_GPA: usize = 0x2004;
const SPURIOUS_GPA: usize = 0x2010;
const ORDER_GPA: usize = 0x2014;
const ACK_GPA: usize = 0x2018;
const PINGPONG: u64 = 0x3000;
const PINGPONG_KICKER: u64 = PINGPONG;
const PINGPONG_WAITER: u64 = PINGPONG + 0x36;

/// `integration-tests/tests/guest/pingpong.S`, assembled (the file says how). Many rounds of: the waiter
/// publishes `ready`, halts (`cli; hlt`) and, once woken by the kick of its round, acks; the
/// kicker waits for `ready`, writes `kicked`, rings the doorbell and waits for the ack. With
/// order 1 the waiter halts only after the kick's `OUT` has completed (kick before halt).
const PINGPONG_CODE: [u8; 116] = [
    0x66, 0x31, 0xc9, 0x66, 0x41, 0x66, 0x3b, 0x0e, 0x04, 0x20, 0x77, 0x23, 0x66, 0x39, 0x0e, 0x08,
    0x20, 0x75, 0xf9, 0x66, 0x89, 0x0e, 0x0c, 0x20, 0x66, 0xa1, 0x00, 0x20, 0xba, 0x40, 0x0a, 0x66,
    0xef, 0x66, 0x89, 0x0e, 0x1c, 0x20, 0x66, 0x39, 0x0e, 0x18, 0x20, 0x75, 0xf9, 0xeb, 0xd4, 0xba,
    0x02, 0x06, 0xee, 0xf4, 0xeb, 0xfd, 0x66, 0x31, 0xc9, 0x66, 0x41, 0x66, 0x3b, 0x0e, 0x04, 0x20,
    0x77, 0x2b, 0x66, 0x89, 0x0e, 0x08, 0x20, 0x66, 0x83, 0x3e, 0x14, 0x20, 0x00, 0x74, 0x07, 0x66,
    0x39, 0x0e, 0x1c, 0x20, 0x75, 0xf9, 0xfa, 0xf4, 0x66, 0x39, 0x0e, 0x0c, 0x20, 0x74, 0x07, 0x66,
    0xff, 0x06, 0x10, 0x20, 0xeb, 0xf0, 0x66, 0x89, 0x0e, 0x18, 0x20, 0xeb, 0xcc, 0xba, 0x01, 0x06,
    0xee, 0xf4, 0xeb, 0xfd,
];

fn guest_code(mem: &mut [u8]) {
    assert_eq!(
        DEFAULT_PORT, 0x0a40,
        "pingpong.S hard-codes the doorbell port"
    );
    let [lo, hi] = DEFAULT_PORT.to_le_bytes();
    let kicker32 = [
        0xba, lo, hi, // mov dx, DEFAULT_PORT
        0x66, 0xa1, 0x00, 0x20, // mov eax, [0x2000]
        0x66, 0xef, // out dx, eax
        0xba, 0x02, 0x06, // mov dx, 0x602
        0xee, // out dx, al
        0xf4, 0xeb, 0xfd, // hlt; jmp back to hlt
    ];
    let kicker8 = [
        0xba, lo, hi, // mov dx, DEFAULT_PORT
        0xa0, 0x00, 0x20, // mov al, [0x2000]
        0xee, // out dx, al (a one-byte kick: wrong width)
        0xba, 0x02, 0x06, // mov dx, 0x602
        0xee, // out dx, al
        0xf4, 0xeb, 0xfd, // hlt; jmp
    ];
    let waiter = [
        0xba, 0x00, 0x06, // mov dx, 0x600
        0xee, // out dx, al     (ready)
        0xfa, // cli
        0xf4, // hlt            (pv_wait)
        0xba, 0x01, 0x06, // mov dx, 0x601
        0xee, // out dx, al     (woke)
        0xf4, 0xeb, 0xfd, // hlt; jmp
    ];
    for (at, code) in [
        (KICKER_32, &kicker32[..]),
        (KICKER_8, &kicker8[..]),
        (WAITER, &waiter[..]),
        (PINGPONG, &PINGPONG_CODE[..]),
    ] {
        let at = usize::try_from(at).unwrap();
        mem[at..at + code.len()].copy_from_slice(code);
    }
}

extern "C" fn on_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

struct Guest {
    vm: VmFd,
    vcpus: Vec<VcpuFd>,
    mem: GuestMemoryMmap<()>,
}

/// A guest-written little-endian `u32` (0 if `gpa` is outside guest memory).
fn read_u32(mem: &GuestMemoryMmap<()>, gpa: usize) -> u32 {
    mem.read_obj(GuestAddress(gpa as u64)).unwrap_or(0)
}

fn make_guest(kvm: &Kvm, irqchip_on: bool, entries: [u64; 2], data: &[(usize, u32)]) -> Guest {
    let TestVm { vm, memory: mem } = TestVm::new(kvm, MEM_SIZE);
    let mut bytes = vec![0u8; MEM_SIZE];
    guest_code(&mut bytes);
    for (gpa, v) in data {
        bytes[*gpa..*gpa + 4].copy_from_slice(&v.to_le_bytes());
    }
    mem.write_slice(&bytes, GuestAddress(0))
        .expect("guest code");
    if irqchip_on {
        irqchip::create_irqchip(&vm).expect("irqchip");
    }
    let mut vcpus = Vec::new();
    for id in 0..NR_VCPUS {
        let vcpu = vm.create_vcpu(u64::from(id)).expect("KVM_CREATE_VCPU");
        let mut sregs = vcpu.get_sregs().expect("sregs");
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs).expect("set sregs");
        let regs = kvm_bindings::kvm_regs {
            rip: entries[usize::try_from(id).unwrap()],
            rflags: 2,
            rsp: 0xf000 - u64::from(id) * 0x400,
            ..Default::default()
        };
        vcpu.set_regs(&regs).expect("set regs");
        vcpus.push(vcpu);
    }
    if irqchip_on {
        irqchip::finish_vcpus(&vcpus, true).expect("MP state and LAPIC refresh");
    }
    Guest { vm, vcpus, mem }
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    Woke,
    Kicked,
    Stopped,
    Other(String),
}

/// Runs a vCPU until it reports its end, or until `stop` is set and a signal or the latch's
/// shutdown interrupts it.
fn run_vcpu(
    mut vcpu: VcpuFd,
    id: u32,
    dev: &KickDevice,
    stop: &AtomicBool,
    ready: &mpsc::Sender<()>,
) -> End {
    loop {
        if stop.load(Ordering::SeqCst) {
            return End::Stopped;
        }
        match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                if dev.handle_pio_write(port, data) != pvspin_kick::PioOutcome::NotMine {
                    continue;
                }
                match port {
                    PORT_READY => {
                        let _ = ready.send(());
                    }
                    PORT_WOKE => return End::Woke,
                    PORT_KICKED => return End::Kicked,
                    p => return End::Other(format!("vcpu{id}: OUT to {p:#x}")),
                }
            }
            Ok(VcpuExit::Hlt) => match dev.handle_hlt(id) {
                Ok(ParkOutcome::Shutdown) => return End::Stopped,
                Ok(_) => {}
                Err(e) => return End::Other(format!("vcpu{id}: HLT exit: {e}")),
            },
            Ok(other) => return End::Other(format!("vcpu{id}: exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) => return End::Other(format!("vcpu{id}: KVM_RUN: {e}")),
        }
    }
}

struct Running {
    handles: Vec<(u32, JoinHandle<(End, Instant)>)>,
    stop: Arc<AtomicBool>,
    dev: Arc<KickDevice>,
}

impl Running {
    /// Waits up to `limit` for `vcpu`'s thread to end on its own.
    fn wait(&mut self, vcpu: u32, limit: Duration) -> Option<(End, Instant)> {
        let start = Instant::now();
        while start.elapsed() < limit {
            let i = self.handles.iter().position(|(v, _)| *v == vcpu)?;
            if self.handles[i].1.is_finished() {
                let (_, h) = self.handles.remove(i);
                return Some(h.join().expect("vcpu thread panicked"));
            }
            thread::sleep(Duration::from_millis(2));
        }
        None
    }

    /// Stops every remaining vCPU thread: stop flag, latch shutdown, then a signal every 10 ms
    /// until the thread ends (bounded).
    fn stop_all(&mut self) -> Vec<(u32, (End, Instant))> {
        self.stop.store(true, Ordering::SeqCst);
        self.dev.shutdown();
        let mut out = Vec::new();
        for (v, h) in self.handles.drain(..) {
            let start = Instant::now();
            while !h.is_finished() {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "vcpu{v} thread does not stop"
                );
                let _ = h.kill(SIGRTMIN());
                thread::sleep(Duration::from_millis(10));
            }
            out.push((v, h.join().expect("vcpu thread panicked")));
        }
        out
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.handles.is_empty() && !thread::panicking() {
            self.stop_all();
        } else if !self.handles.is_empty() {
            // Panicking: still release the threads, but never panic again.
            self.stop.store(true, Ordering::SeqCst);
            self.dev.shutdown();
            for (_, h) in &self.handles {
                let _ = h.kill(SIGRTMIN());
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Path {
    InKernel,
    SignalMsi,
    Userspace,
}

struct Outcome {
    waiter: End,
    kicker: End,
    dev: Arc<KickDevice>,
    /// From the kicker thread's start to the waiter thread's end (or the watchdog's stop).
    elapsed: Duration,
    /// Dropped last: the VM (held by a signal-msi device) must go before its memory.
    mem: GuestMemoryMmap<()>,
}

/// Runs one scenario: the waiter starts (and, for the simple guest, reports ready: 50 ms
/// later) the kicker starts.
/// Waits up to 30 s for the kicker and then up to `wake_limit` for the waiter before the
/// watchdog stops what is left.
fn scenario(
    kvm: &Kvm,
    path: Path,
    entries: [u64; 2],
    data: &[(usize, u32)],
    park_timeout: Option<Duration>,
    wake_limit: Duration,
) -> Outcome {
    register_signal_handler(SIGRTMIN(), on_signal).expect("signal handler");
    let irq = !matches!(path, Path::Userspace);
    let Guest { vm, mut vcpus, mem } = make_guest(kvm, irq, entries, data);
    let cfg = KickConfig {
        nr_vcpus: NR_VCPUS,
        park_timeout,
        ..KickConfig::default()
    };
    let vm = Arc::new(vm);
    let mut _routes = None;
    let dev = Arc::new(match path {
        Path::InKernel => {
            let d = KickDevice::in_kernel(cfg, None).unwrap();
            let targets: Vec<irqchip::KickTarget> = (0..NR_VCPUS)
                .map(|i| irqchip::KickTarget {
                    datamatch: i,
                    apic_id: i,
                })
                .collect();
            _routes = Some(
                irqchip::KickRoutes::register(
                    &vm,
                    DEFAULT_PORT + pvspin_abi::doorbell::KICK_OFFSET,
                    &targets,
                    irqchip::FIRST_FREE_GSI,
                    &[],
                )
                .expect("in-kernel kick setup"),
            );
            d
        }
        Path::SignalMsi => {
            KickDevice::signal_msi(cfg, Arc::new(pvspin::VmMsiSink::new(&vm).unwrap())).unwrap()
        }
        Path::Userspace => KickDevice::userspace(cfg).unwrap(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::channel();
    let waiter_fd = vcpus.pop().unwrap();
    let kicker_fd = vcpus.pop().unwrap();
    let mut running = Running {
        handles: Vec::new(),
        stop: stop.clone(),
        dev: dev.clone(),
    };
    {
        let (dev, stop, tx) = (dev.clone(), stop.clone(), ready_tx.clone());
        running.handles.push((
            1,
            thread::spawn(move || (run_vcpu(waiter_fd, 1, &dev, &stop, &tx), Instant::now())),
        ));
    }
    // The simple waiter reports ready with an OUT; the ping-pong guests synchronise in memory.
    if entries[1] == WAITER {
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("waiter never reported ready");
        // Give the waiter time to reach its HLT (a few emulated instructions), so this is
        // mostly a kick during the halt; a kick before it must work too (it is latched).
        thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    {
        let (dev, stop) = (dev.clone(), stop.clone());
        running.handles.push((
            0,
            thread::spawn(move || {
                (
                    run_vcpu(kicker_fd, 0, &dev, &stop, &ready_tx),
                    Instant::now(),
                )
            }),
        ));
    }
    let kicker = running.wait(0, Duration::from_secs(30));
    let waiter = match running.wait(1, wake_limit) {
        Some(e) => e,
        None => running
            .stop_all()
            .into_iter()
            .find(|(v, _)| *v == 1)
            .map(|(_, e)| e)
            .unwrap(),
    };
    let (waiter, waiter_end) = waiter;
    let elapsed = waiter_end.saturating_duration_since(started);
    let kicker = match kicker {
        Some((e, _)) => e,
        None => running.stop_all().pop().map(|(_, (e, _))| e).unwrap(),
    };
    drop(running);
    Outcome {
        waiter,
        kicker,
        dev,
        elapsed,
        mem,
    }
}

fn check_valid_kick_wakes(name: &str, path: Path) {
    let Some(kvm) = kvm_or_skip(name) else {
        return;
    };
    let o = scenario(
        &kvm,
        path,
        [KICKER_32, WAITER],
        &[(TARGET_GPA, 1)],
        Some(Duration::from_secs(1)),
        Duration::from_secs(5),
    );
    assert_eq!(o.kicker, End::Kicked, "{path:?}");
    assert_eq!(o.waiter, End::Woke, "{path:?}");
    let s = o.dev.stats();
    assert_eq!(s.rejected_total(), 0, "{s:?}");
    match path {
        // The kick never reached userspace.
        Path::InKernel => assert_eq!((s.accesses, s.kicks), (0, 0), "{s:?}"),
        Path::SignalMsi => assert_eq!((s.kicks, s.msi_delivered), (1, 1), "{s:?}"),
        Path::Userspace => {
            assert_eq!(s.kicks, 1, "{s:?}");
            assert_eq!(s.woke_parked + s.latched, 1, "{s:?}");
        }
    }
}

fn check_bad_kick_wakes_nobody(name: &str, path: Path, entry: u64, target: u32, why: Reject) {
    let Some(kvm) = kvm_or_skip(name) else {
        return;
    };
    let o = scenario(
        &kvm,
        path,
        [entry, WAITER],
        &[(TARGET_GPA, target)],
        Some(Duration::from_secs(1)),
        Duration::from_millis(300),
    );
    assert_eq!(o.kicker, End::Kicked, "{path:?}");
    assert_eq!(o.waiter, End::Stopped, "{path:?}: the waiter must not wake");
    let s = o.dev.stats();
    assert_eq!(s.rejected(why), 1, "{s:?}");
    assert_eq!(s.kicks, 0, "{s:?}");
    assert_eq!(s.msi_delivered + s.woke_parked + s.latched, 0, "{s:?}");
}

#[test]
fn in_kernel_kick_wakes_halted_vcpu() {
    check_valid_kick_wakes("in_kernel_kick_wakes_halted_vcpu", Path::InKernel);
}

#[test]
fn signal_msi_kick_wakes_halted_vcpu() {
    check_valid_kick_wakes("signal_msi_kick_wakes_halted_vcpu", Path::SignalMsi);
}

#[test]
fn userspace_kick_wakes_halted_vcpu() {
    check_valid_kick_wakes("userspace_kick_wakes_halted_vcpu", Path::Userspace);
}

#[test]
fn in_kernel_kick_of_missing_vcpu_wakes_nobody() {
    check_bad_kick_wakes_nobody(
        "in_kernel_kick_of_missing_vcpu_wakes_nobody",
        Path::InKernel,
        KICKER_32,
        5,
        Reject::NoSuchVcpu,
    );
}

#[test]
fn signal_msi_kick_of_missing_vcpu_wakes_nobody() {
    check_bad_kick_wakes_nobody(
        "signal_msi_kick_of_missing_vcpu_wakes_nobody",
        Path::SignalMsi,
        KICKER_32,
        0xffff_ffff,
        Reject::NoSuchVcpu,
    );
}

#[test]
fn userspace_kick_of_missing_vcpu_wakes_nobody() {
    check_bad_kick_wakes_nobody(
        "userspace_kick_of_missing_vcpu_wakes_nobody",
        Path::Userspace,
        KICKER_32,
        2,
        Reject::NoSuchVcpu,
    );
}

#[test]
fn in_kernel_one_byte_kick_wakes_nobody() {
    check_bad_kick_wakes_nobody(
        "in_kernel_one_byte_kick_wakes_nobody",
        Path::InKernel,
        KICKER_8,
        1,
        Reject::WrongWidth,
    );
}

/// Many rounds of halt and kick. With no park timeout, a lost wake-up hangs the waiter until
/// the watchdog, and the test fails.
fn check_pingpong(name: &str, path: Path, kick_before_halt: bool) {
    let Some(kvm) = kvm_or_skip(name) else {
        return;
    };
    let rounds = 300;
    let o = scenario(
        &kvm,
        path,
        [PINGPONG_KICKER, PINGPONG_WAITER],
        &[
            (TARGET_GPA, 1),
            (ROUNDS_GPA, rounds),
            (ORDER_GPA, u32::from(kick_before_halt)),
        ],
        None,
        Duration::from_secs(30),
    );
    let acked = read_u32(&o.mem, ACK_GPA);
    assert_eq!(
        o.kicker,
        End::Kicked,
        "{path:?}: kicker (acked {acked} rounds)"
    );
    assert_eq!(
        o.waiter,
        End::Woke,
        "{path:?}: waiter (acked {acked} rounds)"
    );
    assert_eq!(acked, rounds);
    let spurious = read_u32(&o.mem, SPURIOUS_GPA);
    let s = o.dev.stats();
    eprintln!(
        "{name}: {rounds} rounds in {:?} ({:.1} us per round), {spurious} spurious wakes, {s:?}",
        o.elapsed,
        o.elapsed.as_secs_f64() * 1e6 / f64::from(rounds)
    );
    assert_eq!(s.rejected_total(), 0, "{s:?}");
    let rounds = u64::from(rounds);
    match path {
        Path::InKernel => assert_eq!(s.accesses, 0, "{s:?}"),
        Path::SignalMsi => assert_eq!((s.kicks, s.msi_delivered), (rounds, rounds), "{s:?}"),
        Path::Userspace => {
            assert_eq!(s.kicks, rounds, "{s:?}");
            assert_eq!(s.woke_parked + s.latched, rounds, "{s:?}");
            assert_eq!(s.coalesced, 0, "{s:?}");
            if kick_before_halt {
                // Every kick came before the HLT exit, so it was latched, never woke a sleeper.
                assert_eq!(s.latched, rounds, "{s:?}");
            }
        }
    }
}

#[test]
fn in_kernel_pingpong_kick_during_halt() {
    check_pingpong("in_kernel_pingpong_kick_during_halt", Path::InKernel, false);
}

#[test]
fn in_kernel_pingpong_kick_before_halt() {
    check_pingpong("in_kernel_pingpong_kick_before_halt", Path::InKernel, true);
}

#[test]
fn signal_msi_pingpong_kick_during_halt() {
    check_pingpong(
        "signal_msi_pingpong_kick_during_halt",
        Path::SignalMsi,
        false,
    );
}

#[test]
fn signal_msi_pingpong_kick_before_halt() {
    check_pingpong(
        "signal_msi_pingpong_kick_before_halt",
        Path::SignalMsi,
        true,
    );
}

#[test]
fn userspace_pingpong_kick_during_halt() {
    check_pingpong(
        "userspace_pingpong_kick_during_halt",
        Path::Userspace,
        false,
    );
}

#[test]
fn userspace_pingpong_kick_before_halt() {
    check_pingpong("userspace_pingpong_kick_before_halt", Path::Userspace, true);
}

/// The VM-stage ordering rules are named, not a bare errno: the irqchip (MSI kick paths) must
/// come before the first vCPU, and pvspin does not create a second one.
#[test]
fn irqchip_ordering_rules_are_named() {
    let Some(kvm) = kvm_or_skip("irqchip_ordering_rules_are_named") else {
        return;
    };
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let _vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    let err = irqchip::create_irqchip(&vm).unwrap_err();
    assert!(matches!(err, irqchip::IrqchipError::AfterVcpus), "{err}");
    assert!(err.to_string().contains("before the first KVM_CREATE_VCPU"));
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    irqchip::create_irqchip(&vm).expect("first irqchip");
    let err = irqchip::create_irqchip(&vm).unwrap_err();
    assert!(matches!(err, irqchip::IrqchipError::Exists), "{err}");
}
