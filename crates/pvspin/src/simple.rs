//! A convenience layer for a VMM with no irqchip, GSI routing or CPUID handling of its own
//! (the example VMM): it does the VMM's part of the setup with the same public calls any
//! VMM makes ([`PvSpin::configure_vm`], [`PvSpin::set_kick_gsis`], [`PvSpin::edit_cpuid`],
//! [`PvSpin::configure_vcpu`]). A VMM that owns that state skips this module.

use kvm_bindings::{CpuId, KvmIrqRouting};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pvspin_kick::KickPath;
use pvspin_kvm::irqchip::{self, FIRST_FREE_GSI};

use crate::{AppliedVcpu, Error, PvSpin, VcpuHooks, VmSetup};

/// Everything a VM needs before its vCPUs: [`PvSpin::configure_vm`]; for the in-kernel and
/// signal-msi kick paths the in-kernel irqchip; for the in-kernel path the kick GSIs (from 24,
/// after the IOAPIC pins), a routing table of KVM's default irqchip routes plus the kick
/// routes and the kick eventfds registered. Call after creating the VM, before any vCPU.
pub fn setup_vm(pvspin: &PvSpin, kvm: &Kvm, vm: &VmFd) -> Result<VmSetup, Error> {
    let setup = pvspin.configure_vm(kvm, vm)?;
    let Some(options) = pvspin.kick_options else {
        return Ok(setup);
    };
    if options.needs_lapic() {
        irqchip::create_irqchip(vm)?;
    }
    if options.path == KickPath::InKernel {
        let first = FIRST_FREE_GSI;
        let gsis: Vec<u32> = (first..).take(pvspin.vcpus()).collect();
        let wiring = pvspin.set_kick_gsis(&gsis)?;
        let mut routes = irqchip::default_irqchip_routes();
        routes.extend(wiring.routes()?);
        let table = KvmIrqRouting::from_entries(&routes).map_err(Error::RoutingTable)?;
        vm.set_gsi_routing(&table).map_err(Error::SetGsiRouting)?;
        // What any VMM does after each KVM_SET_GSI_ROUTING.
        pvspin.check_routes(&routes)?;
        wiring.register(vm)?;
    }
    Ok(setup)
}

/// One vCPU's setup: [`PvSpin::edit_cpuid_for_vcpu`] on `cpuid` (the CPUID the VMM wants the
/// vCPU to have, e.g. `KVM_GET_SUPPORTED_CPUID`), `KVM_SET_CPUID2`, then
/// [`PvSpin::configure_vcpu`].
pub fn configure_vcpu(
    pvspin: &PvSpin,
    index: usize,
    vcpu: &mut VcpuFd,
    cpuid: &mut CpuId,
) -> Result<(VcpuHooks, Option<AppliedVcpu>), Error> {
    pvspin.edit_cpuid_for_vcpu(index, vcpu, cpuid)?;
    pvspin_kvm::plan::set_cpuid(vcpu, cpuid).map_err(|err| match err {
        pvspin_kvm::plan::PlanError::Kvm { source, .. } => Error::SetCpuid { index, source },
        after_run => Error::Plan(after_run),
    })?;
    pvspin.configure_vcpu(index, vcpu)
}

/// For guests that start every vCPU at once (no INIT/SIPI), with an in-kernel LAPIC: makes
/// the APplication processors (index > 0) runnable; KVM starts them waiting for a SIPI. A VMM
/// whose guest boots its APs itself does not call this. `vcpus` in index order.
pub fn start_aps<'a>(vcpus: impl IntoIterator<Item = &'a VcpuFd>) -> Result<(), Error> {
    for vcpu in vcpus.into_iter().skip(1) {
        if pvspin_kvm::plan::vcpu_has_in_kernel_lapic(vcpu) {
            irqchip::set_runnable(vcpu)?;
        }
    }
    Ok(())
}
