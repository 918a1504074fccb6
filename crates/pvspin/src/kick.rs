//! The kick device inside the embedding API: which wake path, its KVM setup, and what the
//! hooks do with doorbell and halt exits.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_msi, CpuId, KVMIO};
use kvm_ioctls::VmFd;
use pvspin_kick::{KickConfig, KickDevice, KickPath, RemrdSink, SinkError};
use pvspin_kvm::irqchip::{self, KickRoutes};
use pvspin_kvm::telemetry::KickPath as TelemetryPath;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

use crate::Error;

ioctl_iow_nr!(KVM_SIGNAL_MSI, KVMIO, 0xa5, kvm_msi);

/// Sends REMRD MSIs through a duplicate of the VM's fd, so pvspin needs no `Arc<VmFd>` from
/// the VMM.
#[derive(Debug)]
struct VmMsiSink {
    vm: OwnedFd,
}

impl VmMsiSink {
    fn new(vm: &VmFd) -> Result<Self, Error> {
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
    /// The wake path.
    pub path: KickPath,
    /// Userspace path: spin this long on the latch before sleeping on a halt.
    pub park_spin: Duration,
}

/// The kick device of one VM and its KVM wiring.
#[derive(Debug)]
pub(crate) struct KickState {
    pub(crate) device: Arc<KickDevice>,
    /// ioeventfd/irqfd routes of the in-kernel path; dropped with the VM.
    _routes: Mutex<Option<KickRoutes>>,
    /// Per target: when it was last kicked (ns since `epoch`), for kick-to-wake latency on the
    /// userspace path, where pvspin sees both ends.
    kicked_at: Vec<AtomicU64>,
    epoch: Instant,
    /// `PvSpin::vcpus_created` ran (the MSI paths need it before any vCPU runs).
    pub(crate) vcpus_created: std::sync::atomic::AtomicBool,
}

impl KickState {
    /// VM stage: the irqchip (MSI paths), the device and, in-kernel, the ioeventfd/irqfd
    /// routes. Must run before any vCPU is created.
    pub(crate) fn configure_vm(
        options: KickOptions,
        extra_commands: u32,
        vcpus: usize,
        vm: &VmFd,
    ) -> Result<Self, Error> {
        let cfg = KickConfig {
            nr_vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
            extra_commands,
            spin: options.park_spin,
            ..KickConfig::default()
        };
        let kick_err = |err: &dyn std::fmt::Display| Error::Kick(err.to_string());
        let mut routes = None;
        let device = match options.path {
            KickPath::Userspace => KickDevice::userspace(cfg).map_err(|e| kick_err(&e))?,
            KickPath::SignalMsi | KickPath::InKernel => {
                irqchip::create_irqchip(vm).map_err(|e| kick_err(&e))?;
                let sink: Arc<dyn RemrdSink> = Arc::new(VmMsiSink::new(vm)?);
                if options.path == KickPath::SignalMsi {
                    KickDevice::signal_msi(cfg, sink).map_err(|e| kick_err(&e))?
                } else {
                    // The fallback delivers a valid kick whose ioeventfd did not catch it.
                    let device =
                        KickDevice::in_kernel(cfg, Some(sink)).map_err(|e| kick_err(&e))?;
                    routes = Some(
                        pvspin_kick::kvm::setup_in_kernel(vm, &device, &[])
                            .map_err(|e| kick_err(&e))?,
                    );
                    device
                }
            }
        };
        Ok(Self {
            device: Arc::new(device),
            _routes: Mutex::new(routes),
            kicked_at: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            vcpus_created: std::sync::atomic::AtomicBool::new(false),
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
        Self {
            device: Arc::new(KickDevice::userspace(cfg).expect("valid test config")),
            _routes: Mutex::new(None),
            kicked_at: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            vcpus_created: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// vCPU stage: advertise the device in the vCPU's CPUID, and make its initial APIC ID
    /// its index (the ABI's kick index rule).
    pub(crate) fn add_cpuid(&self, cpuid: &mut CpuId, index: usize) -> Result<(), Error> {
        pvspin_kick::kvm::set_initial_apic_id(
            cpuid.as_mut_slice(),
            u32::try_from(index).unwrap_or(u32::MAX),
        );
        let entries =
            pvspin_kick::kvm::cpuid_entries(&self.device, pvspin_abi::cpuid::DEFAULT_BASE)
                .map_err(|e| Error::Kick(e.to_string()))?;
        for entry in entries {
            // Replace a stale copy rather than adding a duplicate leaf.
            if let Some(existing) = cpuid
                .as_mut_slice()
                .iter_mut()
                .find(|e| e.function == entry.function && e.index == entry.index)
            {
                *existing = entry;
            } else {
                cpuid
                    .push(entry)
                    .map_err(|e| Error::Kick(format!("CPUID table full: {e:?}")))?;
            }
        }
        Ok(())
    }

    /// Telemetry's name of this device's path.
    pub(crate) fn telemetry_path(&self) -> TelemetryPath {
        match self.device.path() {
            KickPath::InKernel => TelemetryPath::InKernel,
            KickPath::SignalMsi => TelemetryPath::SignalMsi,
            KickPath::Userspace => TelemetryPath::Userspace,
        }
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
