//! A minimal VMM that adopts pvspin the way a VMM with its own VM-wide state does.
//!
//! It owns its in-kernel irqchip, its GSI allocator and routing table (with a route of its own
//! besides pvspin's), every vCPU's CPUID (its own edit, then pvspin's) and its AP start-up
//! (it makes the APs runnable itself: the example guest has no INIT/SIPI code). pvspin only
//! asks and checks. Every use of pvspin is in `adopt.rs`, which a unit test keeps at 55 lines
//! of code or fewer. Guest memory, the guest image and its boot protocol, and the UART/exit-port
//! bus come from the test VM's library (`pvspin_test_vm`), which is not pvspin.
#![deny(missing_docs)]

mod adopt;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use adopt::KickPath;
use kvm_bindings::{
    kvm_irq_routing_entry, kvm_mp_state, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_MAX_CPUID_ENTRIES,
    KVM_MP_STATE_RUNNABLE,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use pvspin_test_vm::config::RunConfig;
use pvspin_test_vm::devices::{ConsoleSink, IoBus, PioAction};
use pvspin_test_vm::memory;
use pvspin_test_vm_proto::Workload;
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

/// vCPUs per run.
pub const VCPUS: u32 = 2;
/// The longest one run may take before it is stopped and reported as failed.
pub const RUN_LIMIT: Duration = Duration::from_secs(60);
/// The MSI vector of the VMM's own device route (a doorbell of its own; nothing fires it here).
const OWN_DEVICE_VECTOR: u32 = 0x40;

/// The runs `minimal-vmm` makes with no arguments: lock and ping-pong, in kernel mode (`HLT`)
/// and in user mode (pvspin's WAIT), on every kick path.
pub fn default_runs() -> Vec<(KickPath, Workload, bool)> {
    let mut runs = Vec::new();
    for path in [KickPath::InKernel, KickPath::SignalMsi, KickPath::Userspace] {
        runs.push((path, Workload::Lock, false));
        runs.push((path, Workload::PingPong, false));
        runs.push((path, Workload::Lock, true));
        runs.push((path, Workload::PingPong, true));
    }
    runs
}

/// A run's name for reports.
pub fn run_name(path: KickPath, workload: Workload, user_mode: bool) -> String {
    let mode = if user_mode { "user" } else { "kernel" };
    format!(
        "{path:?} {} ({mode} mode)",
        pvspin_test_vm::vmm::workload_name(workload)
    )
}

fn err(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> MinimalVmmError {
    move |source| MinimalVmmError::Kvm { op, source }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum MinimalVmmError {
    /// A KVM call of the VMM's failed.
    #[error("{op}: {source}")]
    Kvm {
        /// The call.
        op: &'static str,
        /// KVM's answer.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be made or written.
    #[error("{0}")]
    Memory(#[from] memory::MemoryError),
    /// Guest memory has no host mapping at GPA 0.
    #[error("{0}")]
    HostAddress(#[from] vm_memory::GuestMemoryError),
    /// A step of the pvspin adoption (`adopt.rs`) failed.
    #[error("{0}")]
    Adopt(Box<dyn std::error::Error>),
    /// The VMM's device eventfd could not be made.
    #[error("eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    /// The GSI routing table could not be built.
    #[error("{0:?}")]
    RoutingTable(vmm_sys_util::fam::Error),
    /// A vCPU failed.
    #[error("{0}")]
    Vcpu(#[from] VcpuError),
    /// No vCPU ended the run in time.
    #[error("no vCPU ended the run within {0:?}")]
    Timeout(Duration),
    /// The guest ended with a failure status.
    #[error("guest exit status {status}: {console}")]
    GuestStatus {
        /// The status.
        status: u32,
        /// What the guest wrote to its console.
        console: String,
    },
}

/// Why a vCPU thread ended the run with an error.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// The vCPU's thread could not be attached to pvspin's interrupter.
    #[error("{0}")]
    Attach(#[from] adopt::InterruptError),
    /// The guest wrote the halt port, which needs a virtio device this VMM lacks.
    #[error("vCPU {0}: wrote the halt port, but this VMM has no virtio pvspin device")]
    HaltPort(usize),
    /// An exit this VMM does not handle.
    #[error("vCPU {index}: unexpected exit {exit}")]
    UnexpectedExit {
        /// The vCPU.
        index: usize,
        /// The exit, as `VcpuExit`'s `Debug` prints it (it borrows the vCPU's run area).
        exit: String,
    },
    /// `KVM_RUN` failed.
    #[error("vCPU {index}: KVM_RUN: {source}")]
    Run {
        /// The vCPU.
        index: usize,
        /// KVM's answer.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The vCPU was stopped before the guest ended the run.
    #[error("vCPU {0} stopped")]
    Stopped(usize),
}

/// The VMM's GSI allocator: GSIs after the 24 IOAPIC pins, handed out in order.
#[derive(Debug)]
struct GsiAllocator(u32);

impl GsiAllocator {
    fn allocate(&mut self) -> u32 {
        self.0 += 1;
        self.0 - 1
    }
}

/// The VMM's routing table: KVM's defaults for the PIC and IOAPIC pins, plus its own device.
fn own_routes(device_gsi: u32) -> Vec<kvm_irq_routing_entry> {
    let pin = |gsi: u32, chip: u32, pin: u32| {
        let mut e = kvm_irq_routing_entry {
            gsi,
            type_: KVM_IRQ_ROUTING_IRQCHIP,
            ..Default::default()
        };
        e.u.irqchip.irqchip = chip;
        e.u.irqchip.pin = pin;
        e
    };
    let mut routes: Vec<_> = (0..24).map(|g| pin(g, KVM_IRQCHIP_IOAPIC, g)).collect();
    routes.extend((0..8).map(|g| pin(g, KVM_IRQCHIP_PIC_MASTER, g)));
    routes.extend((8..16).map(|g| pin(g, KVM_IRQCHIP_PIC_SLAVE, g - 8)));
    let mut device = kvm_irq_routing_entry {
        gsi: device_gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    device.u.msi.address_lo = 0xfee0_0000;
    device.u.msi.data = OWN_DEVICE_VECTOR;
    routes.push(device);
    routes
}

/// Runs one workload on `path` to its end; returns the guest's summary line.
pub fn run(path: KickPath, workload: Workload, user_mode: bool) -> Result<String, MinimalVmmError> {
    let config = RunConfig {
        vcpus: VCPUS,
        workload,
        // Kernel-mode guest code is emulated instruction by instruction on hosts without
        // hardware virtualization; user mode runs natively.
        iterations: match (workload, user_mode) {
            (Workload::Lock, false) => 500,
            (Workload::Lock, true) => 200_000,
            (_, false) => 100,
            (_, true) => 5_000,
        },
        pv: pvspin_test_vm::PvMode::Kick,
        kick_path: path,
        user_mode,
        ..RunConfig::default()
    };
    let n = VCPUS as usize;
    let kvm = Kvm::new().map_err(err("opening /dev/kvm"))?;
    let vm = kvm.create_vm().map_err(err("KVM_CREATE_VM"))?;
    let mem = memory::create(config.mem_bytes())?;
    memory::write_tables(&mem)?;
    let entry = memory::load_image(&mem, pvspin_test_vm::vmm::GUEST_IMAGE)?;
    let host = mem.get_host_address(GuestAddress(0))?;
    let region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: config.mem_bytes(),
        userspace_addr: host as u64,
        flags: 0,
    };
    // SAFETY: `mem` maps `mem_bytes` bytes and outlives the VM (dropped after `vm` below).
    unsafe { vm.set_user_memory_region(region) }.map_err(err("KVM_SET_USER_MEMORY_REGION"))?;

    let (pvspin, signal) = adopt::build(n, path, &mem).map_err(MinimalVmmError::Adopt)?;
    adopt::configure_vm(&pvspin, &kvm, &vm).map_err(MinimalVmmError::Adopt)?;

    // The VMM's own VM-wide state: irqchip (the userspace kick path wants HLT exits, so none
    // there), its GSIs and routes, its device's irqfd.
    let irqchip = path != KickPath::Userspace;
    let mut gsis = GsiAllocator(24);
    let device_gsi = gsis.allocate();
    let device_event = vmm_eventfd()?;
    let mut routes = own_routes(device_gsi);
    if irqchip {
        vm.create_irq_chip().map_err(err("KVM_CREATE_IRQCHIP"))?;
    }
    if path == KickPath::InKernel {
        let kick = adopt::kick_routes(&pvspin, &vm, || gsis.allocate());
        routes.extend(kick.map_err(MinimalVmmError::Adopt)?);
    }
    if irqchip {
        let table = KvmIrqRouting::from_entries(&routes).map_err(MinimalVmmError::RoutingTable)?;
        vm.set_gsi_routing(&table)
            .map_err(err("KVM_SET_GSI_ROUTING"))?;
        adopt::check_routes(&pvspin, &routes).map_err(MinimalVmmError::Adopt)?;
        vm.register_irqfd(&device_event, device_gsi)
            .map_err(err("KVM_IRQFD"))?;
    }

    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(err("CPUID"))?;
    let mut vcpus = Vec::new();
    for i in 0..VCPUS {
        let mut vcpu = vm
            .create_vcpu(u64::from(i))
            .map_err(err("KVM_CREATE_VCPU"))?;
        let mut cpuid = supported.clone();
        own_cpuid_edit(&mut cpuid);
        adopt::edit_cpuid(&pvspin, i as usize, &mut cpuid).map_err(MinimalVmmError::Adopt)?;
        vcpu.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
        let hooks = adopt::configure_vcpu(&pvspin, i as usize, &mut vcpu)
            .map_err(MinimalVmmError::Adopt)?;
        let sregs = vcpu.get_sregs().map_err(err("KVM_GET_SREGS"))?;
        vcpu.set_sregs(&memory::initial_sregs(sregs, i))
            .map_err(err("KVM_SET_SREGS"))?;
        vcpu.set_regs(&memory::initial_regs(i, entry))
            .map_err(err("KVM_SET_REGS"))?;
        if irqchip && i > 0 {
            // The VMM's AP start-up: this guest has no INIT/SIPI code.
            let runnable = kvm_mp_state {
                mp_state: KVM_MP_STATE_RUNNABLE,
            };
            vcpu.set_mp_state(runnable)
                .map_err(err("KVM_SET_MP_STATE"))?;
        }
        vcpus.push((vcpu, hooks));
    }
    let tsc_khz = vcpus[0].0.get_tsc_khz().map_or(0, u64::from);
    let params = pvspin_test_vm::vmm::boot_params(&config, tsc_khz);
    memory::write_boot_params(&mem, &params, VCPUS)?;

    let console = ConsoleSink::new(false);
    let bus = Arc::new(IoBus::new(console.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = mpsc::channel::<Result<u32, VcpuError>>();
    let mut threads = Vec::new();
    for (i, (vcpu, hooks)) in vcpus.into_iter().enumerate() {
        let (bus, stop, done, signal) =
            (bus.clone(), stop.clone(), done_tx.clone(), signal.clone());
        threads.push(std::thread::spawn(move || {
            let result = vcpu_loop(i, vcpu, hooks, &signal, &bus, &stop);
            let _ = done.send(result);
        }));
    }
    let deadline = Instant::now() + RUN_LIMIT;
    let outcome = match done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(result) => result.map_err(MinimalVmmError::Vcpu),
        Err(_) => Err(MinimalVmmError::Timeout(RUN_LIMIT)),
    };
    stop.store(true, Ordering::Release);
    adopt::stop(&pvspin);
    for t in threads {
        let _ = t.join();
    }
    drop(vm);
    let status = outcome?;
    let text = console.captured();
    let summary = text
        .lines()
        .find(|l| l.starts_with("guest:"))
        .unwrap_or("")
        .to_string();
    if status == pvspin_test_vm_proto::status::OK {
        Ok(summary)
    } else {
        Err(MinimalVmmError::GuestStatus {
            status,
            console: text,
        })
    }
}

/// The VMM's own CPUID policy: here, hide the PMU (leaf 0AH), as many VMMs do.
fn own_cpuid_edit(cpuid: &mut kvm_bindings::CpuId) {
    for e in cpuid.as_mut_slice() {
        if e.function == 0xa {
            (e.eax, e.ebx, e.ecx, e.edx) = (0, 0, 0, 0);
        }
    }
}

fn vmm_eventfd() -> Result<EventFd, MinimalVmmError> {
    EventFd::new(libc::EFD_NONBLOCK).map_err(MinimalVmmError::EventFd)
}

/// One vCPU thread: pvspin's hooks around `KVM_RUN`, the VMM's bus for the rest.
fn vcpu_loop(
    index: usize,
    mut vcpu: VcpuFd,
    mut hooks: adopt::VcpuHooks,
    signal: &Arc<adopt::SignalInterrupter>,
    bus: &IoBus,
    stop: &AtomicBool,
) -> Result<u32, VcpuError> {
    let thread = adopt::attach(signal, index)?;
    let mut parked = false;
    while !stop.load(Ordering::Acquire) {
        if parked {
            // The guest's work on this vCPU is done (user mode cannot HLT): wait for the end.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let step = adopt::run_once(&mut hooks, &thread, &mut vcpu, |exit| match exit {
            Ok(VcpuExit::IoOut(port, data)) => match bus.write(*port, data) {
                PioAction::Exit(status) => Some(Ok(status)),
                PioAction::Park => {
                    parked = true;
                    None
                }
                PioAction::Continue => None,
                // The halt port stands in for `hlt` with the virtio device, which this VMM
                // does not present.
                PioAction::KvmHalt => Some(Err(VcpuError::HaltPort(index))),
            },
            Ok(VcpuExit::IoIn(port, data)) => {
                bus.read(*port, data);
                None
            }
            // Halted for good without an irqchip (this guest halts only when done).
            Ok(VcpuExit::Hlt) => {
                parked = true;
                None
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Ok(other) => Some(Err(VcpuError::UnexpectedExit {
                index,
                exit: format!("{other:?}"),
            })),
            Err(source) => Some(Err(VcpuError::Run {
                index,
                source: *source,
            })),
        })
        .flatten();
        if let Some(result) = step {
            return result;
        }
    }
    Err(VcpuError::Stopped(index))
}

#[cfg(test)]
mod tests {
    /// The adoption stays small: `adopt.rs` has at most 55 lines of code (47 before the
    /// adopter checks: `check_routes` after each routing table and `check` at the end), and
    /// nothing else in this VMM names pvspin.
    #[test]
    fn adopting_pvspin_takes_at_most_55_lines() {
        let closing = |l: &str| l.chars().all(|c| ")]};,?.".contains(c));
        let code = include_str!("adopt.rs")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//") && !closing(l))
            .filter(|l| !l.starts_with("use ") && !l.starts_with("pub use "))
            .count();
        assert!(code <= 55, "adopt.rs has {code} lines of code");
        let lib = include_str!("lib.rs");
        let lib = &lib[..lib.find("#[cfg(test)]").unwrap_or(lib.len())];
        let named = ["pvspin::", "pvspin.", "use pvspin;"];
        for (n, line) in lib.lines().enumerate() {
            let line = line.trim();
            if line.starts_with("//") {
                continue;
            }
            for word in named {
                assert!(
                    !line.contains(word),
                    "lib.rs:{}: names pvspin: {line}",
                    n + 1
                );
            }
        }
    }
}
