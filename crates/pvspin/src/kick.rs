//! The kick device inside the embedding API: which wake path, what the VM needs for it
//! (asked of the VMM, which owns its irqchip, routing table and ioeventfds), and what the hooks
//! do with doorbell and halt exits.

use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_ioeventfd, kvm_ioeventfd_flag_nr_datamatch, kvm_ioeventfd_flag_nr_deassign,
    kvm_ioeventfd_flag_nr_pio, kvm_irq_routing_entry, kvm_irqfd, kvm_msi, CpuId, KVMIO,
    KVM_IRQFD_FLAG_DEASSIGN, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::{IoEventAddress, VmFd};
use pvspin_abi::doorbell::KICK_OFFSET;
use pvspin_kick::{KickConfig, KickDevice, KickPath, RemrdSink, SinkError};
use pvspin_kvm::irqchip;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

use crate::{ConfigError, Error};

ioctl_iow_nr!(KVM_SIGNAL_MSI, KVMIO, 0xa5, kvm_msi);
ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);

/// The default bound on one userspace-path park ([`KickOptions::park_bound`]).
pub const DEFAULT_PARK_BOUND: Duration = Duration::from_millis(20);

/// KVM's limit on GSI routes (`KVM_MAX_IRQ_ROUTES`): kick GSIs must be below it.
pub const MAX_GSI: u32 = 4096;

/// Sends the kick's REMRD MSIs (`KVM_SIGNAL_MSI`) through its own duplicate of the VM's fd,
/// so that pvspin needs no `Arc<VmFd>` from the VMM. The ioctl is issued directly because
/// kvm-ioctls' `VmFd::signal_msi` needs a `VmFd`, which cannot be built from a duplicate.
#[derive(Debug)]
pub struct VmMsiSink {
    vm: OwnedFd,
}

impl VmMsiSink {
    /// Duplicates `vm`'s descriptor.
    pub fn new(vm: &VmFd) -> Result<Self, Error> {
        // kvm-ioctls' VmFd has no AsFd, so borrow its raw descriptor.
        // SAFETY: `vm` owns the descriptor and outlives this borrow.
        let borrowed = unsafe { BorrowedFd::borrow_raw(vm.as_raw_fd()) };
        let vm = borrowed.try_clone_to_owned().map_err(Error::DupVmFd)?;
        Ok(Self { vm })
    }
}

impl VmMsiSink {
    /// `KVM_IRQFD` of `eventfd` at `gsi` and, when KVM took it, its removal at once: whether
    /// KVM would take that irqfd now. `Err(EINVAL)`: the VM has no in-kernel irqchip;
    /// `Err(EBUSY)`: `eventfd` is an irqfd already.
    fn irqfd_probe(&self, eventfd: RawFd, gsi: u32) -> std::io::Result<()> {
        let mut irqfd = kvm_irqfd {
            fd: u32::try_from(eventfd).unwrap_or(u32::MAX),
            gsi,
            ..Default::default()
        };
        // SAFETY: KVM_IRQFD reads one kvm_irqfd, which lives across the call; the fd is a VM
        // fd (a dup of the VMM's).
        if unsafe { ioctl_with_ref(&self.vm, KVM_IRQFD(), &irqfd) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        irqfd.flags = KVM_IRQFD_FLAG_DEASSIGN;
        // SAFETY: as above; removes the irqfd just added.
        if unsafe { ioctl_with_ref(&self.vm, KVM_IRQFD(), &irqfd) } < 0 {
            log::warn!(
                "pvspin: removing a probe irqfd at GSI {gsi}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// `KVM_IOEVENTFD` of a probe eventfd on port `port`, 4 bytes, datamatch `datamatch`, and
    /// its removal: `Ok(true)` when KVM refused it with `EEXIST` (that ioeventfd, or one that
    /// catches the same writes, is registered), `Ok(false)` when it took it (none was).
    fn ioeventfd_registered(&self, port: u16, datamatch: u32) -> std::io::Result<bool> {
        let probe = EventFd::new(EFD_NONBLOCK)?;
        let mut io = kvm_ioeventfd {
            datamatch: u64::from(datamatch),
            addr: u64::from(port),
            len: 4,
            fd: probe.as_raw_fd(),
            flags: (1 << kvm_ioeventfd_flag_nr_datamatch) | (1 << kvm_ioeventfd_flag_nr_pio),
            ..Default::default()
        };
        // SAFETY: KVM_IOEVENTFD reads one kvm_ioeventfd, which lives across the call; the fd
        // is a VM fd (a dup of the VMM's).
        if unsafe { ioctl_with_ref(&self.vm, KVM_IOEVENTFD(), &io) } < 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EEXIST) => Ok(true),
                _ => Err(err),
            };
        }
        io.flags |= 1 << kvm_ioeventfd_flag_nr_deassign;
        // SAFETY: as above; removes the probe just added.
        if unsafe { ioctl_with_ref(&self.vm, KVM_IOEVENTFD(), &io) } < 0 {
            log::warn!(
                "pvspin: removing a probe ioeventfd at port {port:#x}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(false)
    }
}

impl RemrdSink for VmMsiSink {
    fn signal_remrd(&self, apic_id: u32) -> Result<bool, SinkError> {
        let msi = irqchip::remrd_msi(apic_id).map_err(|err| SinkError {
            apic_id,
            source: Box::new(err),
        })?;
        // SAFETY: KVM_SIGNAL_MSI reads one kvm_msi, which lives across the call; the fd is a
        // VM fd (a dup of the VMM's).
        let ret = unsafe { ioctl_with_ref(&self.vm, KVM_SIGNAL_MSI(), &msi) };
        if ret < 0 {
            return Err(SinkError {
                apic_id,
                source: Box::new(std::io::Error::last_os_error()),
            });
        }
        Ok(ret > 0)
    }
}

/// How the embedding VMM configures the kick device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KickOptions {
    /// The wake path. `InKernel` and `SignalMsi` need an in-kernel LAPIC, which the VMM
    /// creates (`KVM_CREATE_IRQCHIP`) before its vCPUs; `Userspace` needs `HLT` exits, so a
    /// VM without one.
    pub path: KickPath,
    /// Userspace path: spin this long on the latch before sleeping on a halt.
    pub park_spin: Duration,
    /// Userspace path: the longest one halt parks the vCPU's thread inside
    /// [`crate::VcpuHooks::handle_exit`] before the vCPU resumes (a spurious wake-up, which
    /// `HLT` and `pv_wait` allow). `None`: until a kick, [`crate::PvSpin::interrupt`] or
    /// shutdown. A WAIT's bound is [`crate::WaitOptions::timeout`].
    pub park_bound: Option<Duration>,
}

impl KickOptions {
    /// `path` with no spinning before a park and the default park bound.
    pub const fn new(path: KickPath) -> Self {
        Self {
            path,
            park_spin: Duration::ZERO,
            park_bound: Some(DEFAULT_PARK_BOUND),
        }
    }

    /// Whether the path needs an in-kernel LAPIC.
    pub fn needs_lapic(&self) -> bool {
        self.path != KickPath::Userspace
    }
}

/// What the VMM registers for the in-kernel kick path ([`crate::PvSpin::kick_wiring`]): per
/// vCPU, one eventfd that is both an ioeventfd on the KICK port (4-byte datamatch = the vCPU's
/// index) and an irqfd on a GSI the VMM chose, whose route is a REMRD MSI to the vCPU's APIC
/// ID. A valid kick then never leaves the kernel. The eventfds are pvspin's and live as long
/// as the [`crate::PvSpin`].
#[derive(Clone, Copy, Debug)]
pub struct KickWiring<'a> {
    port: u16,
    gsis: &'a [u32],
    eventfds: &'a [EventFd],
}

/// How a routing table differs from the kick wiring at one vCPU's GSI
/// ([`KickWiring::verify`], [`ConfigError::KickRoutes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteFault {
    /// No entry at the GSI: a kick to the vCPU wakes nobody.
    Missing {
        /// The vCPU.
        vcpu: u32,
        /// Its kick GSI.
        gsi: u32,
    },
    /// The entries at the GSI are not the kick's REMRD MSI to the vCPU's APIC ID.
    Changed {
        /// The vCPU.
        vcpu: u32,
        /// Its kick GSI.
        gsi: u32,
    },
    /// The kick's route is there, with other entries at the same GSI: every kick also fires
    /// them, and they fire the kick.
    Shared {
        /// The vCPU.
        vcpu: u32,
        /// Its kick GSI.
        gsi: u32,
    },
}

impl RouteFault {
    /// The vCPU whose route it is.
    pub fn vcpu(self) -> u32 {
        match self {
            RouteFault::Missing { vcpu, .. }
            | RouteFault::Changed { vcpu, .. }
            | RouteFault::Shared { vcpu, .. } => vcpu,
        }
    }
}

impl std::fmt::Display for RouteFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteFault::Missing { vcpu, gsi } => write!(f, "vCPU {vcpu}: GSI {gsi} missing"),
            RouteFault::Changed { vcpu, gsi } => {
                write!(f, "vCPU {vcpu}: GSI {gsi} routed elsewhere")
            }
            RouteFault::Shared { vcpu, gsi } => {
                write!(f, "vCPU {vcpu}: GSI {gsi} shared with other routes")
            }
        }
    }
}

/// The kick routes a routing table lacks or changes, per vCPU ([`ConfigError::KickRoutes`]);
/// displayed comma-separated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteFaults(pub Vec<RouteFault>);

impl std::ops::Deref for RouteFaults {
    type Target = [RouteFault];
    fn deref(&self) -> &[RouteFault] {
        &self.0
    }
}

impl<const N: usize> PartialEq<[RouteFault; N]> for RouteFaults {
    fn eq(&self, other: &[RouteFault; N]) -> bool {
        self.0 == other
    }
}

impl fmt::Display for RouteFaults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, fault) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{fault}")?;
        }
        Ok(())
    }
}

/// Whether two MSI routing entries route the same way.
fn same_msi_route(a: &kvm_irq_routing_entry, b: &kvm_irq_routing_entry) -> bool {
    if a.type_ != KVM_IRQ_ROUTING_MSI || b.type_ != KVM_IRQ_ROUTING_MSI || a.flags != b.flags {
        return false;
    }
    // SAFETY: `a` is an MSI entry (checked above), so `msi` is the union member KVM reads.
    let x = unsafe { a.u.msi };
    // SAFETY: likewise for `b`.
    let y = unsafe { b.u.msi };
    (x.address_lo, x.address_hi, x.data) == (y.address_lo, y.address_hi, y.data)
}

/// One ioeventfd registration of [`KickWiring::ioevents`].
#[derive(Debug)]
pub struct KickIoEvent<'a> {
    /// The eventfd.
    pub eventfd: &'a EventFd,
    /// The KICK port.
    pub address: IoEventAddress,
    /// The 4-byte value that selects this eventfd (the target vCPU's index).
    pub datamatch: u32,
}

impl<'a> KickWiring<'a> {
    /// The routes to merge into the VMM's GSI routing table (one REMRD MSI per vCPU at its
    /// GSI). Pure: call again whenever the VMM rebuilds its table, and keep these in it.
    pub fn routes(&self) -> Result<Vec<kvm_irq_routing_entry>, Error> {
        (0u32..)
            .zip(self.gsis)
            .map(|(apic_id, &gsi)| irqchip::remrd_route(gsi, apic_id).map_err(Error::Irqchip))
            .collect()
    }

    /// The GSI of each vCPU, in index order.
    pub fn gsis(&self) -> &'a [u32] {
        self.gsis
    }

    /// Checks that `table`, the GSI routing table the VMM applied last (`KVM_SET_GSI_ROUTING`
    /// replaces the whole table), routes every kick GSI to its REMRD MSI and nothing else.
    /// Refused naming the vCPUs whose kicks would be lost ([`ConfigError::KickRoutes`]). KVM
    /// cannot be asked for its table, so the VMM passes what it applied: call this after every
    /// `KVM_SET_GSI_ROUTING` ([`crate::PvSpin::check_routes`] also counts a failure in
    /// [`crate::PvSpin::check`]). Pure.
    pub fn verify(&self, table: &[kvm_irq_routing_entry]) -> Result<(), ConfigError> {
        let mut faults = Vec::new();
        for (vcpu, &gsi) in (0u32..).zip(self.gsis) {
            let Ok(want) = irqchip::remrd_route(gsi, vcpu) else {
                continue;
            };
            let at: Vec<_> = table.iter().filter(|e| e.gsi == gsi).collect();
            let fault = match (at.len(), at.iter().any(|e| same_msi_route(e, &want))) {
                (0, _) => Some(RouteFault::Missing { vcpu, gsi }),
                (_, false) => Some(RouteFault::Changed { vcpu, gsi }),
                (1, true) => None,
                (_, true) => Some(RouteFault::Shared { vcpu, gsi }),
            };
            faults.extend(fault);
        }
        if faults.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::KickRoutes {
                faults: RouteFaults(faults),
            })
        }
    }

    /// The ioeventfds to register (`VmFd::register_ioevent`), one per vCPU.
    pub fn ioevents(&self) -> impl Iterator<Item = KickIoEvent<'a>> + 'a {
        let address = u64::from(self.port + KICK_OFFSET);
        (0u32..)
            .zip(self.eventfds)
            .map(move |(datamatch, eventfd)| KickIoEvent {
                eventfd,
                address: IoEventAddress::Pio(address),
                datamatch,
            })
    }

    /// The irqfds to register (`VmFd::register_irqfd`): each eventfd with its GSI.
    pub fn irqfds(&self) -> impl Iterator<Item = (&'a EventFd, u32)> + 'a {
        self.eventfds.iter().zip(self.gsis.iter().copied())
    }

    /// Registers every irqfd and ioeventfd with `vm` (the routes are the VMM's to install);
    /// undoes what it registered on error. Once: a second registration is refused naming the
    /// rule ([`ConfigError::WiringRegisteredTwice`], KVM's `EBUSY`), as is a VM without an
    /// in-kernel irqchip ([`ConfigError::NoIrqchip`], KVM's `EINVAL`).
    pub fn register(&self, vm: &VmFd) -> Result<(), Error> {
        let kvm = |op: &'static str| move |source| Error::KickRegister { op, source };
        for (i, (event, (eventfd, gsi))) in self.ioevents().zip(self.irqfds()).enumerate() {
            let result = vm
                .register_irqfd(eventfd, gsi)
                .map_err(|source| match source.errno() {
                    libc::EBUSY => ConfigError::WiringRegisteredTwice.into(),
                    libc::EINVAL => ConfigError::NoIrqchip {
                        call: "KickWiring::register",
                    }
                    .into(),
                    _ => kvm("KVM_IRQFD")(source),
                });
            let result = result.and_then(|()| {
                vm.register_ioevent(event.eventfd, &event.address, event.datamatch)
                    .map_err(|e| {
                        let _ = vm.unregister_irqfd(eventfd, gsi);
                        if e.errno() == libc::EEXIST {
                            ConfigError::WiringRegisteredTwice.into()
                        } else {
                            kvm("KVM_IOEVENTFD")(e)
                        }
                    })
            });
            if let Err(err) = result {
                self.unregister_first(vm, i);
                return Err(err);
            }
        }
        Ok(())
    }

    /// Removes every registration [`register`](Self::register) made.
    pub fn unregister(&self, vm: &VmFd) {
        self.unregister_first(vm, self.eventfds.len());
    }

    fn unregister_first(&self, vm: &VmFd, n: usize) {
        for (event, (eventfd, gsi)) in self.ioevents().zip(self.irqfds()).take(n) {
            if let Err(e) = vm.unregister_ioevent(event.eventfd, &event.address, event.datamatch) {
                log::warn!(
                    "pvspin: unregistering the kick ioeventfd {}: {e}",
                    event.datamatch
                );
            }
            if let Err(e) = vm.unregister_irqfd(eventfd, gsi) {
                log::warn!("pvspin: unregistering the kick irqfd at GSI {gsi}: {e}");
            }
        }
    }
}

/// The kick device of one VM.
#[derive(Debug)]
pub(crate) struct KickState {
    pub(crate) device: Arc<KickDevice>,
    pub(crate) options: KickOptions,
    /// In-kernel path: one eventfd per vCPU, made with the device.
    eventfds: Vec<EventFd>,
    /// In-kernel path: the GSIs the VMM chose, once.
    gsis: OnceLock<Vec<u32>>,
    /// In-kernel path: the VM, for the setup checks (a dup of the VMM's fd).
    vm: Option<Arc<VmMsiSink>>,
    /// Per target: when it was last kicked (ns since `epoch`), for kick-to-wake latency on the
    /// userspace path, where pvspin sees both ends.
    kicked_at: Vec<AtomicU64>,
    epoch: Instant,
}

impl KickState {
    /// VM stage: the device and, in-kernel, its eventfds. Nothing is done to the VM: the
    /// irqchip, the routes and the registrations are the VMM's.
    pub(crate) fn configure_vm(
        options: KickOptions,
        cfg: KickConfig,
        vm: &VmFd,
    ) -> Result<Self, Error> {
        let vcpus = cfg.nr_vcpus as usize;
        let mut eventfds = Vec::new();
        let mut probe_vm = None;
        let device = match options.path {
            KickPath::Userspace => KickDevice::userspace(cfg)?,
            KickPath::SignalMsi => KickDevice::signal_msi(cfg, Arc::new(VmMsiSink::new(vm)?))?,
            KickPath::InKernel => {
                for _ in 0..vcpus {
                    eventfds.push(EventFd::new(EFD_NONBLOCK).map_err(Error::KickEventFd)?);
                }
                // The fallback delivers a valid kick whose ioeventfd did not catch it.
                let vm = Arc::new(VmMsiSink::new(vm)?);
                probe_vm = Some(vm.clone());
                let sink: Arc<dyn RemrdSink> = vm;
                KickDevice::in_kernel(cfg, Some(sink))?
            }
        };
        let mut me = Self::new(device, options, eventfds);
        me.vm = probe_vm;
        Ok(me)
    }

    fn new(device: KickDevice, options: KickOptions, eventfds: Vec<EventFd>) -> Self {
        let vcpus = device.config().nr_vcpus as usize;
        Self {
            device: Arc::new(device),
            options,
            eventfds,
            gsis: OnceLock::new(),
            vm: None,
            kicked_at: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
        }
    }

    /// Records the VMM's GSIs for the in-kernel path (once) and returns the wiring.
    pub(crate) fn set_gsis(&self, gsis: &[u32]) -> Result<KickWiring<'_>, Error> {
        if self.options.path != KickPath::InKernel {
            return Err(ConfigError::GsisWithoutInKernelPath.into());
        }
        if gsis.len() != self.eventfds.len() {
            return Err(ConfigError::KickGsiCount {
                vcpus: self.eventfds.len(),
                gsis: gsis.len(),
            }
            .into());
        }
        let mut sorted = gsis.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::KickGsiTwice(w[0]).into());
        }
        if let Some(&gsi) = sorted.last().filter(|&&g| g >= MAX_GSI) {
            return Err(ConfigError::KickGsiRange(gsi).into());
        }
        if let (Some(vm), Some(&gsi)) = (&self.vm, gsis.first()) {
            // KVM refuses the kick irqfds without an in-kernel irqchip, with a bare EINVAL:
            // ask now, with a probe irqfd, and name the rule instead.
            let probe = EventFd::new(EFD_NONBLOCK).map_err(|source| Error::Probe {
                op: "creating an eventfd",
                source,
            })?;
            match vm.irqfd_probe(probe.as_raw_fd(), gsi) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                    return Err(ConfigError::NoIrqchip {
                        call: "PvSpin::set_kick_gsis",
                    }
                    .into())
                }
                Err(source) => {
                    return Err(Error::Probe {
                        op: "KVM_IRQFD (probe)",
                        source,
                    })
                }
            }
        }
        self.gsis
            .set(gsis.to_vec())
            .map_err(|_| ConfigError::KickGsisSetTwice)?;
        Ok(self.wiring().expect("just set"))
    }

    /// In-kernel path, at `configure_vcpu`: vCPU `index`'s irqfd and ioeventfd are registered
    /// as [`KickWiring`] gives them. Asked of KVM with probes that are removed at once: an
    /// irqfd of the vCPU's own eventfd is refused with `EBUSY` when registered, and a 4-byte
    /// ioeventfd with its datamatch with `EEXIST` (an 8-byte one from a `u64` datamatch does
    /// not collide, and is what the guest's 4-byte `OUT` never matches).
    pub(crate) fn check_registered(&self, index: usize) -> Result<(), Error> {
        let (Some(vm), Some(wiring)) = (&self.vm, self.wiring()) else {
            return Ok(());
        };
        let (Some(eventfd), Some(&gsi)) = (self.eventfds.get(index), wiring.gsis.get(index)) else {
            return Ok(());
        };
        match vm.irqfd_probe(eventfd.as_raw_fd(), gsi) {
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) => {}
            Ok(()) => return Err(ConfigError::KickIrqfd { index, gsi }.into()),
            Err(source) => {
                return Err(Error::Probe {
                    op: "KVM_IRQFD (probe)",
                    source,
                })
            }
        }
        let port = wiring.port + KICK_OFFSET;
        let datamatch = u32::try_from(index).unwrap_or(u32::MAX);
        match vm.ioeventfd_registered(port, datamatch) {
            Ok(true) => Ok(()),
            Ok(false) => Err(ConfigError::KickIoeventfd { index, port }.into()),
            Err(source) => Err(Error::Probe {
                op: "KVM_IOEVENTFD (probe)",
                source,
            }),
        }
    }

    pub(crate) fn wiring(&self) -> Option<KickWiring<'_>> {
        self.gsis.get().map(|gsis| KickWiring {
            port: self.device.config().port,
            gsis,
            eventfds: &self.eventfds,
        })
    }

    /// A userspace-path device with no VM, for the hooks' unit tests.
    #[cfg(test)]
    pub(crate) fn userspace_for_tests(vcpus: usize, extra_commands: u32) -> Self {
        let cfg = KickConfig {
            nr_vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
            extra_commands,
            ..KickConfig::default()
        };
        Self::new(
            KickDevice::userspace(cfg).expect("valid test config"),
            KickOptions::new(KickPath::Userspace),
            Vec::new(),
        )
    }

    /// The CPUID edits of vCPU `index`: its initial APIC ID is its index (the ABI's kick-index
    /// rule) and pvspin's leaves at `base` advertise the device.
    pub(crate) fn add_cpuid(
        &self,
        cpuid: &mut CpuId,
        index: usize,
        base: u32,
    ) -> Result<(), Error> {
        crate::cpuid::set_initial_apic_id(
            cpuid.as_mut_slice(),
            u32::try_from(index).unwrap_or(u32::MAX),
        );
        crate::cpuid::add_pvspin_entries(cpuid, self.device.cpuid_info(), base)?;
        Ok(())
    }

    pub(crate) fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    pub(crate) fn note_kick(&self, target: u32) {
        if let Some(slot) = self.kicked_at.get(target as usize) {
            slot.store(self.now_ns().max(1), Ordering::Relaxed);
        }
    }

    /// Nanoseconds since vCPU `index` was last kicked; clears the stamp.
    pub(crate) fn take_kick_age(&self, index: usize) -> Option<u64> {
        let stamp = self.kicked_at.get(index)?.swap(0, Ordering::Relaxed);
        (stamp != 0).then(|| self.now_ns().saturating_sub(stamp))
    }
}
