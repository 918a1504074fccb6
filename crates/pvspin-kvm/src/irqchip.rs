//! The KVM setup the in-kernel and signal-msi kick paths need.
//!
//! - [`create_irqchip`]: the in-kernel PIC, IOAPIC and LAPICs (`KVM_CREATE_IRQCHIP`), before
//!   the vCPUs are created. `HLT` then blocks inside KVM instead of exiting.
//! - [`set_runnable`]: with an in-kernel LAPIC, vCPUs other than 0 start in wait-for-SIPI
//!   (`KVM_MP_STATE_UNINITIALIZED`) and never run. A VMM whose guest starts all vCPUs at once
//!   (no INIT/SIPI) makes them `KVM_MP_STATE_RUNNABLE`.
//! - [`refresh_lapic`]: right after vCPU creation KVM's APIC-ID map is stale and an MSI to
//!   APIC ID 1 reaches nobody. `KVM_GET_LAPIC` + `KVM_SET_LAPIC` (unchanged) on every vCPU,
//!   after all of them exist, rebuilds it.
//! - [`KickRoutes`]: for each kick target, an eventfd that is both an ioeventfd on the
//!   doorbell port (4-byte datamatch = target index) and an irqfd on a GSI routed to a REMRD
//!   MSI at the target's APIC ID. A valid kick then never leaves the kernel.
//! - [`remrd_msi`]/[`signal_remrd`]: the MSI the signal-msi path sends with `KVM_SIGNAL_MSI`.
//!
//! REMRD (delivery mode 3, "remote read", MSI data `0x300`) is what KVM's own
//! `KVM_HC_KICK_CPU` does internally: it sets the target's `pv_unhalted`, which wakes a
//! `cli; hlt` and, if the target is not halted yet, makes its next `HLT` fall through.

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_mp_state, kvm_msi, KvmIrqRouting, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
    KVM_MP_STATE_RUNNABLE,
};
use kvm_ioctls::{IoEventAddress, VcpuFd, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// MSI address of the local APICs (physical destination mode, destination in bits 19..12).
pub const MSI_ADDRESS_BASE: u32 = 0xfee0_0000;
/// MSI data for delivery mode REMRD (0b011 in bits 10..8), KVM's `pv_unhalted` wake.
pub const MSI_DATA_REMRD: u32 = 0x300;
/// Highest APIC ID an MSI can address alone in xAPIC physical mode: destination 0xFF is the
/// broadcast ID (KVM delivers it to every vCPU), so a REMRD kick to it would wake them all.
pub const MAX_MSI_APIC_ID: u32 = 0xfe;
/// The first GSI after the 24 IOAPIC pins, where [`KickRoutes`] starts by default.
pub const FIRST_FREE_GSI: u32 = 24;
/// Number of IOAPIC pins KVM's default routing covers.
pub const IOAPIC_PINS: u32 = 24;

/// Errors from the irqchip and kick-route setup.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum IrqchipError {
    /// APIC ID {0} cannot be addressed alone by an xAPIC MSI (the rule: at most 254; 0xFF is the
    /// broadcast ID)
    ApicIdTooLarge(u32),
    /// kick GSI base {0} overlaps the IOAPIC pins (the rule: gsi_base >= 24)
    GsiOverlap(u32),
    /// {op} failed: {source}
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// What KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// creating an eventfd failed: {0}
    EventFd(#[source] std::io::Error),
    /// building the GSI routing table failed: {0:?}
    Routing(vmm_sys_util::fam::Error),
    /// KVM_CREATE_IRQCHIP refused with EINVAL: the rule is that the in-kernel irqchip is created
    /// before the first KVM_CREATE_VCPU (pvspin::simple::setup_vm creates it, so it runs before the
    /// vCPUs too)
    AfterVcpus,
    /// KVM_CREATE_IRQCHIP refused with EEXIST: the VM already has an irqchip; a VMM that makes its
    /// own calls PvSpin::configure_vm and wires the kicks itself instead of
    /// pvspin::simple::setup_vm, which creates one
    Exists,
}

fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> IrqchipError {
    move |source| IrqchipError::Kvm { op, source }
}

/// `KVM_CREATE_IRQCHIP`. Call once, after creating the VM and before creating vCPUs.
pub fn create_irqchip(vm: &VmFd) -> Result<(), IrqchipError> {
    vm.create_irq_chip().map_err(|source| match source.errno() {
        libc::EINVAL => IrqchipError::AfterVcpus,
        libc::EEXIST => IrqchipError::Exists,
        _ => IrqchipError::Kvm {
            op: "KVM_CREATE_IRQCHIP",
            source,
        },
    })
}

/// `KVM_SET_MP_STATE(RUNNABLE)`: lets an AP run without INIT/SIPI. Call after creating it.
pub fn set_runnable(vcpu: &VcpuFd) -> Result<(), IrqchipError> {
    vcpu.set_mp_state(kvm_mp_state {
        mp_state: KVM_MP_STATE_RUNNABLE,
    })
    .map_err(kvm("KVM_SET_MP_STATE"))
}

/// `KVM_GET_LAPIC` + `KVM_SET_LAPIC` with unchanged contents, which makes KVM rebuild its
/// APIC-ID map. Call on every vCPU after all vCPUs exist (and after their CPUID is set).
pub fn refresh_lapic(vcpu: &VcpuFd) -> Result<(), IrqchipError> {
    let lapic = vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    vcpu.set_lapic(&lapic).map_err(kvm("KVM_SET_LAPIC"))
}

/// The setup every vCPU needs once all vCPUs exist: `KVM_SET_MP_STATE(RUNNABLE)` on the APs
/// (index > 0) when `aps_runnable` (guests that start all vCPUs at once, without INIT/SIPI),
/// then [`refresh_lapic`] on every vCPU. `vcpus` in index order.
pub fn finish_vcpus<'a>(
    vcpus: impl IntoIterator<Item = &'a VcpuFd>,
    aps_runnable: bool,
) -> Result<(), IrqchipError> {
    for (i, v) in vcpus.into_iter().enumerate() {
        if aps_runnable && i > 0 {
            set_runnable(v)?;
        }
        refresh_lapic(v)?;
    }
    Ok(())
}

/// The MSI address for physical destination `apic_id`.
pub fn msi_address(apic_id: u32) -> Result<u32, IrqchipError> {
    if apic_id > MAX_MSI_APIC_ID {
        return Err(IrqchipError::ApicIdTooLarge(apic_id));
    }
    Ok(MSI_ADDRESS_BASE | (apic_id << 12))
}

/// The REMRD MSI for `apic_id`.
pub fn remrd_msi(apic_id: u32) -> Result<kvm_msi, IrqchipError> {
    Ok(kvm_msi {
        address_lo: msi_address(apic_id)?,
        address_hi: 0,
        data: MSI_DATA_REMRD,
        ..Default::default()
    })
}

/// `KVM_SIGNAL_MSI` of a REMRD MSI to `apic_id`. `Ok(true)` if KVM delivered it to a vCPU,
/// `Ok(false)` if to nobody.
pub fn signal_remrd(vm: &VmFd, apic_id: u32) -> Result<bool, IrqchipError> {
    let n = vm
        .signal_msi(remrd_msi(apic_id)?)
        .map_err(kvm("KVM_SIGNAL_MSI"))?;
    Ok(n > 0)
}

/// A routing entry sending GSI `gsi` to a REMRD MSI at `apic_id`.
pub fn remrd_route(gsi: u32, apic_id: u32) -> Result<kvm_irq_routing_entry, IrqchipError> {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    e.u.msi.address_lo = msi_address(apic_id)?;
    e.u.msi.address_hi = 0;
    e.u.msi.data = MSI_DATA_REMRD;
    Ok(e)
}

fn irqchip_route(gsi: u32, irqchip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    e.u.irqchip.irqchip = irqchip;
    e.u.irqchip.pin = pin;
    e
}

/// The routing KVM installs by default with `KVM_CREATE_IRQCHIP`: GSIs 0..16 to the PIC and
/// the IOAPIC, GSIs 16..24 to the IOAPIC. `KVM_SET_GSI_ROUTING` replaces the whole table, so
/// [`KickRoutes`] includes these to keep legacy interrupts working.
pub fn default_irqchip_routes() -> Vec<kvm_irq_routing_entry> {
    let mut v = Vec::with_capacity(40);
    for gsi in 0..IOAPIC_PINS {
        if gsi < 16 {
            let chip = if gsi < 8 {
                KVM_IRQCHIP_PIC_MASTER
            } else {
                KVM_IRQCHIP_PIC_SLAVE
            };
            v.push(irqchip_route(gsi, chip, gsi % 8));
        }
        v.push(irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi));
    }
    v
}

/// One kick target of the in-kernel path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KickTarget {
    /// The 32-bit value the guest writes to kick it (its vCPU index).
    pub datamatch: u32,
    /// Its APIC ID.
    pub apic_id: u32,
}

/// The in-kernel kick wiring: one eventfd per target, registered as a 4-byte datamatch
/// ioeventfd on the kick port and as an irqfd on a GSI routed to a REMRD MSI.
#[derive(Debug)]
pub struct KickRoutes {
    port: u16,
    gsi_base: u32,
    targets: Vec<KickTarget>,
    evts: Vec<EventFd>,
    routes: Vec<kvm_irq_routing_entry>,
}

impl KickRoutes {
    /// Wires the kicks: sets the GSI routing to [`default_irqchip_routes`] + `extra_routes`
    /// (the VMM's own, e.g. device MSIs) + one REMRD route per target at GSIs
    /// `gsi_base..gsi_base + targets.len()`, then registers each target's irqfd and ioeventfd
    /// (`port`, 4 bytes, datamatch). Needs the in-kernel irqchip. May be called before or
    /// after the vCPUs exist; the MSIs only reach their targets after [`refresh_lapic`].
    /// Partial registrations are undone on error.
    pub fn register(
        vm: &VmFd,
        port: u16,
        targets: &[KickTarget],
        gsi_base: u32,
        extra_routes: &[kvm_irq_routing_entry],
    ) -> Result<Self, IrqchipError> {
        if gsi_base < IOAPIC_PINS {
            return Err(IrqchipError::GsiOverlap(gsi_base));
        }
        let mut routes = default_irqchip_routes();
        routes.extend_from_slice(extra_routes);
        for (i, t) in (0u32..).zip(targets) {
            routes.push(remrd_route(gsi_base + i, t.apic_id)?);
        }
        let table = KvmIrqRouting::from_entries(&routes).map_err(IrqchipError::Routing)?;
        vm.set_gsi_routing(&table)
            .map_err(kvm("KVM_SET_GSI_ROUTING"))?;
        let mut me = Self {
            port,
            gsi_base,
            targets: Vec::with_capacity(targets.len()),
            evts: Vec::with_capacity(targets.len()),
            routes,
        };
        for (i, t) in (0u32..).zip(targets) {
            if let Err(e) = me.add(vm, gsi_base + i, *t) {
                me.unregister(vm);
                return Err(e);
            }
        }
        Ok(me)
    }

    fn add(&mut self, vm: &VmFd, gsi: u32, t: KickTarget) -> Result<(), IrqchipError> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(IrqchipError::EventFd)?;
        vm.register_irqfd(&evt, gsi).map_err(kvm("KVM_IRQFD"))?;
        if let Err(e) = vm.register_ioevent(
            &evt,
            &IoEventAddress::Pio(u64::from(self.port)),
            t.datamatch,
        ) {
            let _ = vm.unregister_irqfd(&evt, gsi);
            return Err(kvm("KVM_IOEVENTFD")(e));
        }
        self.targets.push(t);
        self.evts.push(evt);
        Ok(())
    }

    /// Removes every ioeventfd and irqfd this registered (the routing table is left as is).
    pub fn unregister(&mut self, vm: &VmFd) {
        for (i, (t, evt)) in (0u32..).zip(self.targets.iter().zip(&self.evts)) {
            let addr = IoEventAddress::Pio(u64::from(self.port));
            if let Err(e) = vm.unregister_ioevent(evt, &addr, t.datamatch) {
                log::warn!("pvspin: unregistering the kick ioeventfd of {t:?} failed: {e}");
            }
            if let Err(e) = vm.unregister_irqfd(evt, self.gsi_base + i) {
                log::warn!("pvspin: unregistering the kick irqfd of {t:?} failed: {e}");
            }
        }
        self.targets.clear();
        self.evts.clear();
    }

    /// The full routing table that was installed. A VMM that changes the routing later must
    /// keep these entries.
    pub fn routes(&self) -> &[kvm_irq_routing_entry] {
        &self.routes
    }

    /// The targets wired, in GSI order.
    pub fn targets(&self) -> &[KickTarget] {
        &self.targets
    }

    /// GSI of the `i`th target.
    pub fn gsi(&self, i: usize) -> Option<u32> {
        (i < self.targets.len()).then(|| self.gsi_base + u32::try_from(i).unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msi_encoding() {
        assert_eq!(msi_address(0).unwrap(), 0xfee0_0000);
        assert_eq!(msi_address(1).unwrap(), 0xfee0_1000);
        assert_eq!(msi_address(254).unwrap(), 0xfeef_e000);
        // 0xFF is the xAPIC broadcast destination: a kick to it would wake every vCPU.
        assert!(matches!(
            msi_address(255),
            Err(IrqchipError::ApicIdTooLarge(255))
        ));
        assert!(matches!(
            msi_address(256),
            Err(IrqchipError::ApicIdTooLarge(256))
        ));
        let m = remrd_msi(3).unwrap();
        assert_eq!(
            (m.address_lo, m.address_hi, m.data),
            (0xfee0_3000, 0, 0x300)
        );
        let r = remrd_route(30, 2).unwrap();
        assert_eq!(r.gsi, 30);
        assert_eq!(r.type_, KVM_IRQ_ROUTING_MSI);
        // SAFETY: the entry was built as an MSI entry, so `msi` is the active union member.
        let msi = unsafe { r.u.msi };
        assert_eq!((msi.address_lo, msi.data), (0xfee0_2000, 0x300));
    }

    #[test]
    fn default_routes_match_kvm() {
        let r = default_irqchip_routes();
        assert_eq!(r.len(), 16 * 2 + 8);
        let pic = r
            .iter()
            .filter(|e| e.type_ == KVM_IRQ_ROUTING_IRQCHIP)
            .filter(|e| {
                // SAFETY: every entry here is an irqchip entry.
                let c = unsafe { e.u.irqchip };
                c.irqchip != KVM_IRQCHIP_IOAPIC
            })
            .count();
        assert_eq!(pic, 16);
        let e = r.iter().find(|e| e.gsi == 9).unwrap();
        // SAFETY: irqchip entry.
        let c = unsafe { e.u.irqchip };
        assert_eq!((c.irqchip, c.pin), (KVM_IRQCHIP_PIC_SLAVE, 1));
        assert!(r.iter().all(|e| e.gsi < IOAPIC_PINS));
    }
}
