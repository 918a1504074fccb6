//! The KVM edge of the kick device: a [`RemrdSink`] for `kvm_ioctls::VmFd`, and the in-kernel
//! path's wiring for a [`KickDevice`]'s configuration.

use kvm_ioctls::VmFd;
use pvspin_abi::doorbell::KICK_OFFSET;
use pvspin_kvm::irqchip::{self, IrqchipError, KickRoutes, KickTarget, FIRST_FREE_GSI};

use crate::device::{KickDevice, KickPath, RemrdSink, SinkError};

impl RemrdSink for VmFd {
    fn signal_remrd(&self, apic_id: u32) -> Result<bool, SinkError> {
        irqchip::signal_remrd(self, apic_id).map_err(|e| SinkError {
            apic_id,
            reason: e.to_string(),
        })
    }
}

/// Errors from wiring a device into KVM.
#[derive(Debug, thiserror::Error)]
pub enum KvmSetupError {
    /// Rule: only an in-kernel device gets ioeventfd/irqfd wiring.
    #[error("setup_in_kernel needs a KickPath::InKernel device (this one uses {0:?})")]
    WrongPath(KickPath),
    /// KVM refused part of the setup.
    #[error(transparent)]
    Irqchip(#[from] IrqchipError),
}

/// Wires the in-kernel path for `device` on `vm`: one ioeventfd (KICK port, datamatch = vCPU
/// index) + irqfd + REMRD route (APIC ID = vCPU index) per vCPU, at GSIs from 24 on, keeping
/// KVM's default PIC/IOAPIC routes plus `extra_routes`. The irqchip must exist
/// ([`pvspin_kvm::irqchip::create_irqchip`]). Keep the returned [`KickRoutes`] alive as long
/// as the VM (dropping it closes the eventfds).
pub fn setup_in_kernel(
    vm: &VmFd,
    device: &KickDevice,
    extra_routes: &[kvm_bindings::kvm_irq_routing_entry],
) -> Result<KickRoutes, KvmSetupError> {
    if device.path() != KickPath::InKernel {
        return Err(KvmSetupError::WrongPath(device.path()));
    }
    let cfg = device.config();
    let targets: Vec<KickTarget> = (0..cfg.nr_vcpus)
        .map(|i| KickTarget {
            datamatch: i,
            apic_id: i,
        })
        .collect();
    Ok(KickRoutes::register(
        vm,
        cfg.port + KICK_OFFSET,
        &targets,
        FIRST_FREE_GSI,
        extra_routes,
    )?)
}
