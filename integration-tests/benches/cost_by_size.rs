//! What pvspin costs the host by VM size (issue 19): 2, 16, 64 and 255 vCPUs on real KVM VMs.
//! pvspin's hooks and device are called directly with synthetic exits (the vCPUs never run),
//! so each number is pvspin's own host CPU, without the guest or the VM exit around it.
//!
//! `cargo bench -p pvspin-integration-tests --bench cost_by_size` (needs /dev/kvm; a filter
//! such as `-- exit` runs one group; `footprint` prints memory and file descriptors).
//!
//! * `exit/other/N`: one exit pvspin does not handle (a serial-port write) through
//!   `before_run` + `handle_exit` + `after_run`, the part every exit pays, with every feature
//!   on: userspace kick path, hint pages, WAIT, directed yield (`yield` actuator) and run
//!   slots (`S = N`: nobody waits, the 256-CPU-host case);
//! * `exit/spin/N`: the same with a SPIN notification naming another vCPU (directed yield's
//!   decision and its action, the hint-page budget update);
//! * `kick/userspace/N`: vCPU a's exit writing KICK for vCPU b, then b's exit writing WAIT,
//!   which returns at once (the kick was latched first): the host CPU of one kick delivered
//!   and consumed on the userspace path, slot given up and taken again included;
//! * `kick/signal-msi/N`: vCPU a's exit writing KICK: pvspin sends the REMRD MSI to b's
//!   in-kernel LAPIC (`KVM_SIGNAL_MSI`);
//! * `kick/in-kernel/N`: the in-kernel path's eventfd signalled from the host (what KVM does
//!   on the guest's write, minus the exit): irqfd, MSI into b's LAPIC;
//! * `telemetry/snapshot/N` and `telemetry/prometheus/N`: `PvSpin::telemetry()` (every
//!   vCPU's counters and KVM stats fds, one `pread` each) and it rendered as Prometheus text;
//! * `setup/N`: pvspin's part of a VM's setup, full configuration on the in-kernel path:
//!   `build`, `simple::setup_vm` (quirks, kick device, irqchip, routes, eventfds) and for every
//!   vCPU `edit_cpuid`, `KVM_SET_CPUID2` and `configure_vcpu`; `KVM_CREATE_VM` and
//!   `KVM_CREATE_VCPU` are the VMM's and not timed;
//! * `footprint`: resident memory and open file descriptors added per vCPU by a VM with that
//!   configuration, against the same VM without pvspin.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use pvspin::{
    DirectedYieldOptions, HintOptions, KickOptions, KickPath, PvSpin, SignalInterrupter,
    SlotConfig, TelemetryFormat, VcpuHooks, WaitOptions,
};
use pvspin_abi::doorbell::{SpinNotify, DEFAULT_PORT, KICK_OFFSET, SHARED_PAGE_OFFSET};
use pvspin_abi::doorbell::{SPIN_OFFSET, WAIT_OFFSET};
use pvspin_integration_tests::{kvm_required, with_watchdog};
use pvspin_test_vm::memory::VmMemory;

const SIZES: [usize; 4] = [2, 16, 64, 255];

/// Guest RAM: the hint pages from 1 MiB, one per vCPU.
const MEM_BYTES: u64 = 2 << 20;
const FIRST_HINT_PFN: u32 = 0x100;

/// What a bench VM has of pvspin.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// Kick on `path`, hint pages, WAIT, directed yield and run slots.
    Full(KickPath),
    /// Kick on `path` only.
    Kick(KickPath),
    /// No pvspin at all (the footprint's baseline).
    Bare,
}

struct BenchVm {
    pvspin: Option<PvSpin>,
    hooks: Vec<VcpuHooks>,
    vcpus: Vec<VcpuFd>,
    _mem: VmMemory,
    _vm: VmFd,
}

fn builder(n: usize, shape: Shape, mem: &VmMemory) -> Option<PvSpin> {
    let interrupter = SignalInterrupter::new(n).expect("interrupter");
    let base = PvSpin::builder().vcpus(n).interrupter(interrupter);
    let built = match shape {
        Shape::Bare => return None,
        Shape::Kick(path) => base.kick(KickOptions::new(path)).build(),
        Shape::Full(path) => base
            .kick(KickOptions::new(path))
            .hint_pages(HintOptions {
                memory: Arc::new(mem.clone()),
                budgets: pvspin::BudgetConfig::default(),
            })
            .pv_wait(WaitOptions::default())
            .directed_yield(DirectedYieldOptions {
                actuator: pvspin::ActuatorKind::Yield,
                ..DirectedYieldOptions::default()
            })
            .run_slots(SlotConfig::new(n))
            .build(),
    };
    Some(built.expect("pvspin configuration"))
}

/// A VM of `n` vCPUs with pvspin as `shape`; returns it and the time pvspin's setup took.
fn make_vm(kvm: &Kvm, n: usize, shape: Shape) -> (BenchVm, Duration) {
    let mem = pvspin_test_vm::memory::create(MEM_BYTES).expect("guest memory");
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let mut timed = Duration::ZERO;
    let start = Instant::now();
    let pvspin = builder(n, shape, &mem);
    if let Some(p) = &pvspin {
        pvspin::simple::setup_vm(p, kvm, &vm).expect("setup_vm");
    }
    timed += start.elapsed();
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .expect("KVM_GET_SUPPORTED_CPUID");
    let mut vcpus = Vec::with_capacity(n);
    let mut hooks = Vec::with_capacity(n);
    for i in 0..n {
        let mut vcpu = vm.create_vcpu(i as u64).expect("KVM_CREATE_VCPU");
        if let Some(p) = &pvspin {
            let mut cpuid = supported.clone();
            let start = Instant::now();
            let (h, _) =
                pvspin::simple::configure_vcpu(p, i, &mut vcpu, &mut cpuid).expect("vCPU setup");
            timed += start.elapsed();
            hooks.push(h);
        }
        vcpus.push(vcpu);
    }
    let mut bench = BenchVm {
        pvspin,
        hooks,
        vcpus,
        _mem: mem,
        _vm: vm,
    };
    if matches!(shape, Shape::Full(_)) {
        // Each guest registers its hint page at boot.
        for v in 0..n {
            let pfn = FIRST_HINT_PFN + v as u32;
            bench.exit(v, DEFAULT_PORT + SHARED_PAGE_OFFSET, pfn);
        }
        let problems = bench.pvspin.as_ref().map(PvSpin::check).unwrap_or_default();
        assert!(problems.is_empty(), "{problems:?}");
    }
    (bench, timed)
}

impl BenchVm {
    /// One exit of vCPU `v`: a 4-byte `out` of `value` to `port`, through every hook.
    fn exit(&mut self, v: usize, port: u16, value: u32) {
        let data = value.to_le_bytes();
        let hooks = &mut self.hooks[v];
        hooks.before_run();
        let mut exit: Result<VcpuExit<'_>, kvm_ioctls::Error> = Ok(VcpuExit::IoOut(port, &data));
        std::hint::black_box(hooks.handle_exit(&mut exit));
        drop(exit);
        hooks.after_run(&self.vcpus[v]);
    }
}

fn spin_for(target: usize) -> u32 {
    SpinNotify {
        waiting_for: Some(target as u16),
        next_owner: false,
        spun_bucket: 10,
        lock_hash: 7,
    }
    .encode()
}

fn exits(c: &mut Criterion, kvm: &Kvm) {
    let mut g = c.benchmark_group("exit");
    for n in SIZES {
        let (mut vm, _) = make_vm(kvm, n, Shape::Full(KickPath::Userspace));
        let mut v = 0;
        g.bench_with_input(BenchmarkId::new("other", n), &n, |b, &n| {
            b.iter(|| {
                vm.exit(v, 0x3f8, u32::from(b'x'));
                v = (v + 1) % n;
            });
        });
        g.bench_with_input(BenchmarkId::new("spin", n), &n, |b, &n| {
            b.iter(|| {
                vm.exit(v, DEFAULT_PORT + SPIN_OFFSET, spin_for((v + 1) % n));
                v = (v + 1) % n;
            });
        });
        let telemetry = vm.pvspin.as_ref().expect("pvspin").telemetry();
        assert!(telemetry.problems.is_empty(), "{:?}", telemetry.problems);
    }
    g.finish();
}

fn kicks(c: &mut Criterion, kvm: &Kvm) {
    let mut g = c.benchmark_group("kick");
    for n in SIZES {
        let (mut vm, _) = make_vm(kvm, n, Shape::Full(KickPath::Userspace));
        let mut a = 0;
        g.bench_with_input(BenchmarkId::new("userspace", n), &n, |b, &n| {
            b.iter(|| {
                let target = (a + 1) % n;
                vm.exit(a, DEFAULT_PORT + KICK_OFFSET, target as u32);
                vm.exit(target, DEFAULT_PORT + WAIT_OFFSET, spin_for(a));
                a = target;
            });
        });
        let kicks = vm.pvspin.as_ref().expect("pvspin").telemetry();
        let stats = kicks.kick.expect("kick device").stats;
        assert!(stats.kicks > 0, "{stats:?}");
        drop(vm);

        let (mut vm, _) = make_vm(kvm, n, Shape::Kick(KickPath::SignalMsi));
        g.bench_with_input(BenchmarkId::new("signal-msi", n), &n, |b, &n| {
            b.iter(|| {
                let target = (a + 1) % n;
                vm.exit(a, DEFAULT_PORT + KICK_OFFSET, target as u32);
                a = target;
            });
        });
        let p = vm.pvspin.as_ref().expect("pvspin");
        assert!(p.check().is_empty(), "{:?}", p.check());
        drop(vm);

        let (vm, _) = make_vm(kvm, n, Shape::Kick(KickPath::InKernel));
        let p = vm.pvspin.as_ref().expect("pvspin");
        let wiring = p.kick_wiring().expect("in-kernel wiring");
        let fds: Vec<_> = wiring.ioevents().map(|e| e.eventfd).collect();
        g.bench_with_input(BenchmarkId::new("in-kernel", n), &n, |b, &n| {
            b.iter(|| {
                a = (a + 1) % n;
                fds[a].write(1).expect("eventfd write");
            });
        });
        drop(fds);
        drop(vm);
    }
    g.finish();
}

fn telemetry(c: &mut Criterion, kvm: &Kvm) {
    let mut g = c.benchmark_group("telemetry");
    for n in SIZES {
        let (mut vm, _) = make_vm(kvm, n, Shape::Full(KickPath::Userspace));
        for v in 0..n {
            vm.exit(v, 0x3f8, u32::from(b'x'));
        }
        let p = vm.pvspin.as_ref().expect("pvspin");
        g.bench_with_input(BenchmarkId::new("snapshot", n), &n, |b, _| {
            b.iter(|| std::hint::black_box(p.telemetry()));
        });
        g.bench_with_input(BenchmarkId::new("prometheus", n), &n, |b, _| {
            b.iter(|| std::hint::black_box(p.telemetry().render(TelemetryFormat::Prometheus)));
        });
        let text = p.telemetry().render(TelemetryFormat::Prometheus);
        println!(
            "telemetry/{n}: {} bytes of Prometheus text, {} lines",
            text.len(),
            text.lines().count()
        );
    }
    g.finish();
}

fn setup(c: &mut Criterion, kvm: &Kvm) {
    let mut g = c.benchmark_group("setup");
    g.sample_size(10);
    for n in SIZES {
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (vm, timed) = make_vm(kvm, n, Shape::Full(KickPath::InKernel));
                    total += timed;
                    drop(vm);
                }
                total
            });
        });
    }
    g.finish();
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Memory and file descriptors a VM of `n` vCPUs adds, per vCPU: bare, and with pvspin.
fn footprint(kvm: &Kvm) {
    println!("footprint: per vCPU, a VM of N vCPUs against none (bare: KVM's VM and vCPU fds and their kvm_run pages; pvspin: with the full configuration on the path)");
    for n in SIZES {
        let mut row = format!("footprint/{n}:");
        for (name, shape) in [
            ("bare", Shape::Bare),
            ("userspace", Shape::Full(KickPath::Userspace)),
            ("in-kernel", Shape::Full(KickPath::InKernel)),
        ] {
            let (rss0, fds0) = (rss_kib(), open_fds());
            let (mut vm, _) = make_vm(kvm, n, shape);
            // Touch what a running VMM touches: every vCPU's kvm_run page and its hooks.
            for vcpu in &mut vm.vcpus {
                std::hint::black_box(vcpu.get_kvm_run().exit_reason);
            }
            if let Some(p) = &vm.pvspin {
                std::hint::black_box(p.telemetry());
            }
            let (rss1, fds1) = (rss_kib(), open_fds());
            drop(vm);
            row += &format!(
                " {name} {:.1} KiB {:.2} fds;",
                rss1.saturating_sub(rss0) as f64 / n as f64,
                fds1.saturating_sub(fds0) as f64 / n as f64
            );
        }
        println!("{row}");
    }
}

fn main() {
    let kvm = kvm_required("cost_by_size");
    let args: Vec<String> = std::env::args().collect();
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-')).cloned();
    // A filter names a group (or a bench inside one, which criterion then picks).
    let wants = |group: &str| {
        filter
            .as_deref()
            .is_none_or(|f| f.split('/').next() == Some(group) || f == group)
    };
    with_watchdog("cost_by_size", Duration::from_secs(1500), || {
        let mut c = Criterion::default()
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(20)
            .configure_from_args();
        if wants("footprint") {
            footprint(&kvm);
        }
        if wants("exit") {
            exits(&mut c, &kvm);
        }
        if wants("kick") {
            kicks(&mut c, &kvm);
        }
        if wants("telemetry") {
            telemetry(&mut c, &kvm);
        }
        if wants("setup") {
            setup(&mut c, &kvm);
        }
        c.final_summary();
    });
}
