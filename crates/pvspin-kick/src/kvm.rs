//! The KVM edge of the kick device: a [`RemrdSink`] for `kvm_ioctls::VmFd`, and the in-kernel
//! path's wiring for a [`KickDevice`]'s configuration.

use kvm_bindings::kvm_cpuid_entry2;
use kvm_ioctls::VmFd;
use pvspin_abi::cpuid::{PvspinInfo, SCAN_FIRST, SCAN_LAST, SCAN_STEP};
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
    /// Rule: the pvspin CPUID base is a 0x100-aligned hypervisor base other than KVM's
    /// 0x40000000.
    #[error(
        "pvspin CPUID base {0:#x} is invalid (the rule: 0x100-aligned, 0x40000100..=0x4000ff00)"
    )]
    BadCpuidBase(u32),
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

/// The ABI's rule that a vCPU's kick index is its initial APIC ID, applied to that vCPU's
/// CPUID table: CPUID.01H:EBX[31:24] (the xAPIC ID, when `index` fits in 8 bits) and EDX of
/// every subleaf of the x2APIC topology leaves 0BH and 1FH are set to `index`. KVM's
/// supported CPUID carries the host CPU's values there, so without this every vCPU reads the
/// same ID. Pure: edits only those fields of the entries present. Returns how many entries
/// it changed.
pub fn set_initial_apic_id(entries: &mut [kvm_cpuid_entry2], index: u32) -> usize {
    let mut changed = 0;
    for e in entries.iter_mut() {
        let before = (e.ebx, e.edx);
        match e.function {
            1 => {
                if let Ok(id) = u8::try_from(index) {
                    e.ebx = (e.ebx & 0x00ff_ffff) | (u32::from(id) << 24);
                }
            }
            0xb | 0x1f => e.edx = index,
            _ => {}
        }
        if (e.ebx, e.edx) != before {
            changed += 1;
        }
    }
    changed
}

/// The two CPUID entries (base leaf and info leaf) that advertise `device` at `base`
/// (normally [`pvspin_abi::cpuid::DEFAULT_BASE`]). Add them to every vCPU's `KVM_SET_CPUID2`
/// table, next to (not instead of) KVM's leaves at 0x40000000.
pub fn cpuid_entries(
    device: &KickDevice,
    base: u32,
) -> Result<[kvm_cpuid_entry2; 2], KvmSetupError> {
    if base % SCAN_STEP != 0 || base <= SCAN_FIRST || base > SCAN_LAST {
        return Err(KvmSetupError::BadCpuidBase(base));
    }
    let entry = |function: u32, r: pvspin_abi::cpuid::CpuidRegs| kvm_cpuid_entry2 {
        function,
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
        ..Default::default()
    };
    let info = device.cpuid_info();
    Ok([
        entry(base, PvspinInfo::base_leaf(base)),
        entry(base + 1, info.info_leaf()),
    ])
}

#[cfg(test)]
mod tests {

    #[test]
    fn initial_apic_id_is_the_vcpu_index() {
        let entry = |function: u32, index: u32| kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0x0a00_0800,
            edx: 7,
            ..Default::default()
        };
        let mut table = [
            entry(0, 0),
            entry(1, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0x1f, 0),
        ];
        assert_eq!(super::set_initial_apic_id(&mut table, 3), 4);
        assert_eq!(table[1].ebx, 0x0300_0800, "only bits 31..24 change");
        assert!(table[2..].iter().all(|e| e.edx == 3));
        assert_eq!(
            (table[0].ebx, table[0].edx),
            (0x0a00_0800, 7),
            "other leaves untouched"
        );
        // An index beyond 8 bits keeps leaf 1 (the x2APIC leaves carry it).
        assert_eq!(super::set_initial_apic_id(&mut table, 300), 3);
        assert_eq!(table[1].ebx >> 24, 3);
        assert_eq!(table[4].edx, 300);
    }

    use super::*;
    use crate::KickConfig;
    use pvspin_abi::cpuid::{find_base, CpuidRegs, DEFAULT_BASE, FEATURE_KICK};

    #[test]
    fn cpuid_entries_are_found_by_a_guest_scan() {
        let d = KickDevice::userspace(KickConfig {
            nr_vcpus: 3,
            ..KickConfig::default()
        })
        .unwrap();
        let e = cpuid_entries(&d, DEFAULT_BASE).unwrap();
        let lookup = |leaf: u32| {
            e.iter()
                .find(|x| x.function == leaf)
                .map(|x| CpuidRegs {
                    eax: x.eax,
                    ebx: x.ebx,
                    ecx: x.ecx,
                    edx: x.edx,
                })
                .unwrap_or_default()
        };
        assert_eq!(find_base(lookup), Some(DEFAULT_BASE));
        let info = PvspinInfo::from_info_leaf(lookup(DEFAULT_BASE + 1));
        assert_eq!(info, d.cpuid_info());
        assert_eq!(info.features, FEATURE_KICK);
        assert_eq!(info.nr_vcpus, 3);
    }

    #[test]
    fn cpuid_base_rules() {
        let d = KickDevice::userspace(KickConfig::default()).unwrap();
        for bad in [0x4000_0000, 0x4000_0201, 0x3fff_ff00, 0x4001_0000] {
            assert!(matches!(
                cpuid_entries(&d, bad),
                Err(KvmSetupError::BadCpuidBase(_))
            ));
        }
        assert!(cpuid_entries(&d, 0x4000_0100).is_ok());
        assert!(cpuid_entries(&d, 0x4000_ff00).is_ok());
    }
}
