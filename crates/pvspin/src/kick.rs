//! The kick device inside the embedding API: which wake path, what the VM needs for it
//! (asked of the VMM, which owns its irqchip, routing table and ioeventfds), and what the hooks
//! do with doorbell and halt exits.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_irq_routing_entry, kvm_msi, CpuId, KVMIO};
use kvm_ioctls::{IoEventAddress, VmFd};
use pvspin_abi::doorbell::KICK_OFFSET;
use pvspin_kick::{KickConfig, KickDevice, KickPath, RemrdSink, SinkError};
use pvspin_kvm::irqchip;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

use crate::{ConfigError, Error};

ioctl_iow_nr!(KVM_SIGNAL_MSI, KVMIO, 0xa5, kvm_msi);

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
        // SAFETY: dup of a descriptor we borrow; the result is checked before use.
        let fd = unsafe { libc::dup(vm.as_raw_fd()) };
        if fd < 0 {
            return Err(Error::Kick(format!(
                "duplicating the VM fd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let vm = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { vm })
    }
}

impl RemrdSink for VmMsiSink {
    fn signal_remrd(&self, apic_id: u32) -> Result<bool, SinkError> {
        let msi = irqchip::remrd_msi(apic_id).map_err(|err| SinkError {
            apic_id,
            reason: err.to_string(),
        })?;
        // SAFETY: KVM_SIGNAL_MSI reads one kvm_msi, which lives across the call; the fd is a
        // VM fd (a dup of the VMM's).
        let ret = unsafe { ioctl_with_ref(&self.vm, KVM_SIGNAL_MSI(), &msi) };
        if ret < 0 {
            return Err(SinkError {
                apic_id,
                reason: std::io::Error::last_os_error().to_string(),
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
            .map(|(apic_id, &gsi)| {
                irqchip::remrd_route(gsi, apic_id).map_err(|e| Error::Kick(e.to_string()))
            })
            .collect()
    }

    /// The GSI of each vCPU, in index order.
    pub fn gsis(&self) -> &'a [u32] {
        self.gsis
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
    /// undoes what it registered on error.
    pub fn register(&self, vm: &VmFd) -> Result<(), Error> {
        let kvm = |op: &'static str| move |e: kvm_ioctls::Error| Error::Kick(format!("{op}: {e}"));
        for (i, (event, (eventfd, gsi))) in self.ioevents().zip(self.irqfds()).enumerate() {
            let result = vm.register_irqfd(eventfd, gsi).map_err(kvm("KVM_IRQFD"));
            let result = result.and_then(|()| {
                vm.register_ioevent(event.eventfd, &event.address, event.datamatch)
                    .map_err(|e| {
                        let _ = vm.unregister_irqfd(eventfd, gsi);
                        kvm("KVM_IOEVENTFD")(e)
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
    /// Per target: when it was last kicked (ns since `epoch`), for kick-to-wake latency on the
    /// userspace path, where pvspin sees both ends.
    kicked_at: Vec<AtomicU64>,
    epoch: Instant,
    /// Every vCPU is configured (the last `configure_vcpu` rebuilt KVM's APIC-ID map).
    pub(crate) all_configured: std::sync::atomic::AtomicBool,
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
        let kick_err = |err: &dyn std::fmt::Display| Error::Kick(err.to_string());
        let mut eventfds = Vec::new();
        let device = match options.path {
            KickPath::Userspace => KickDevice::userspace(cfg).map_err(|e| kick_err(&e))?,
            KickPath::SignalMsi => KickDevice::signal_msi(cfg, Arc::new(VmMsiSink::new(vm)?))
                .map_err(|e| kick_err(&e))?,
            KickPath::InKernel => {
                for _ in 0..vcpus {
                    eventfds.push(
                        EventFd::new(EFD_NONBLOCK)
                            .map_err(|e| Error::Kick(format!("creating an eventfd: {e}")))?,
                    );
                }
                // The fallback delivers a valid kick whose ioeventfd did not catch it.
                let sink: Arc<dyn RemrdSink> = Arc::new(VmMsiSink::new(vm)?);
                KickDevice::in_kernel(cfg, Some(sink)).map_err(|e| kick_err(&e))?
            }
        };
        Ok(Self::new(device, options, eventfds))
    }

    fn new(device: KickDevice, options: KickOptions, eventfds: Vec<EventFd>) -> Self {
        let vcpus = device.config().nr_vcpus as usize;
        Self {
            device: Arc::new(device),
            options,
            eventfds,
            gsis: OnceLock::new(),
            kicked_at: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            all_configured: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Records the VMM's GSIs for the in-kernel path (once) and returns the wiring.
    pub(crate) fn set_gsis(&self, gsis: &[u32]) -> Result<KickWiring<'_>, Error> {
        if self.options.path != KickPath::InKernel {
            return Err(ConfigError::Rule(
                "only the in-kernel kick path has GSI routes and ioeventfds",
            )
            .into());
        }
        if gsis.len() != self.eventfds.len() {
            return Err(ConfigError::KickGsis(format!(
                "one GSI per vCPU: {} vCPUs, {} GSIs",
                self.eventfds.len(),
                gsis.len()
            ))
            .into());
        }
        let mut sorted = gsis.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::KickGsis(format!("GSI {} given twice", w[0])).into());
        }
        if let Some(&gsi) = sorted.last().filter(|&&g| g >= MAX_GSI) {
            return Err(
                ConfigError::KickGsis(format!("GSI {gsi} is not below KVM's {MAX_GSI}")).into(),
            );
        }
        self.gsis
            .set(gsis.to_vec())
            .map_err(|_| ConfigError::KickGsis("the kick GSIs are set once".into()))?;
        Ok(self.wiring().expect("just set"))
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
