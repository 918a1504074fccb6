//! Pure CPUID edits for pvspin's guests: the kick-index rule and pvspin's own leaves.
//!
//! Nothing here touches KVM; the VMM keeps its CPUID and sets it with `KVM_SET_CPUID2`
//! (`PvSpin::edit_cpuid` combines these with the paravirt plan's edits).

use kvm_bindings::{kvm_cpuid_entry2, CpuId};
use pvspin_abi::cpuid::{CpuidRegs, PvspinInfo, SCAN_FIRST, SCAN_LAST, SCAN_STEP};

/// Errors from the CPUID edits.
#[derive(Debug, thiserror::Error, PartialEq, Eq, displaydoc::Display)]
pub enum CpuidError {
    /// pvspin CPUID base {0:#x} is invalid (the rule: 0x100-aligned, 0x40000100..=0x4000ff00)
    BadBase(u32),
    /// the CPUID table is full ({0} entries): no room for pvspin's leaves
    Full(usize),
}

/// Checks the rule for a pvspin CPUID base.
pub fn check_base(base: u32) -> Result<(), CpuidError> {
    if base % SCAN_STEP != 0 || base <= SCAN_FIRST || base > SCAN_LAST {
        return Err(CpuidError::BadBase(base));
    }
    Ok(())
}

/// The ABI's rule that a vCPU's kick index is its initial APIC ID, applied to that vCPU's
/// CPUID table: CPUID.01H:EBX bits 31..24 (the xAPIC ID, when `index` fits in 8 bits) and EDX of
/// every subleaf of the x2APIC topology leaves 0BH and 1FH are set to `index`. KVM's
/// supported CPUID carries the host CPU's values there, so without this every vCPU reads the
/// same ID. Edits only those fields of the entries present; returns how many entries changed.
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

/// Whether `entries` follow the kick-index rule for vCPU `index` (leaf 1 where it can carry
/// the ID, and every 0BH/1FH subleaf present).
pub fn follows_apic_id_rule(entries: &[kvm_cpuid_entry2], index: u32) -> bool {
    entries.iter().all(|e| match e.function {
        1 => u8::try_from(index).map_or(true, |id| e.ebx >> 24 == u32::from(id)),
        0xb | 0x1f => e.edx == index,
        _ => true,
    })
}

/// The two entries (base leaf and info leaf) that advertise `info` at `base`, next to (not
/// instead of) KVM's leaves at 0x40000000.
pub fn pvspin_entries(info: PvspinInfo, base: u32) -> Result<[kvm_cpuid_entry2; 2], CpuidError> {
    check_base(base)?;
    let entry = |function: u32, r: CpuidRegs| kvm_cpuid_entry2 {
        function,
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
        ..Default::default()
    };
    Ok([
        entry(base, PvspinInfo::base_leaf(base)),
        entry(base + 1, info.info_leaf()),
    ])
}

/// Puts pvspin's leaves into `cpuid`, replacing stale copies rather than adding duplicates.
pub fn add_pvspin_entries(
    cpuid: &mut CpuId,
    info: PvspinInfo,
    base: u32,
) -> Result<(), CpuidError> {
    for entry in pvspin_entries(info, base)? {
        if let Some(existing) = cpuid
            .as_mut_slice()
            .iter_mut()
            .find(|e| e.function == entry.function && e.index == entry.index)
        {
            *existing = entry;
        } else {
            let len = cpuid.as_slice().len();
            cpuid.push(entry).map_err(|_| CpuidError::Full(len))?;
        }
    }
    Ok(())
}

/// The pvspin info a CPUID table advertises at `base`, if its base leaf is there.
pub fn find_pvspin_info(entries: &[kvm_cpuid_entry2], base: u32) -> Option<PvspinInfo> {
    let regs = |leaf: u32| {
        entries
            .iter()
            .find(|e| e.function == leaf)
            .map(|e| CpuidRegs {
                eax: e.eax,
                ebx: e.ebx,
                ecx: e.ecx,
                edx: e.edx,
            })
    };
    (regs(base)? == PvspinInfo::base_leaf(base))
        .then(|| regs(base + 1).map(PvspinInfo::from_info_leaf))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvspin_abi::cpuid::{find_base, DEFAULT_BASE, FEATURE_KICK};

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
        assert!(!follows_apic_id_rule(&table, 3));
        assert_eq!(set_initial_apic_id(&mut table, 3), 4);
        assert!(follows_apic_id_rule(&table, 3));
        assert_eq!(table[1].ebx, 0x0300_0800, "only bits 31..24 change");
        assert!(table[2..].iter().all(|e| e.edx == 3));
        assert_eq!(
            (table[0].ebx, table[0].edx),
            (0x0a00_0800, 7),
            "other leaves untouched"
        );
        // An index beyond 8 bits keeps leaf 1 (the x2APIC leaves carry it).
        assert_eq!(set_initial_apic_id(&mut table, 300), 3);
        assert_eq!(table[1].ebx >> 24, 3);
        assert_eq!(table[4].edx, 300);
        assert!(follows_apic_id_rule(&table, 300));
    }

    #[test]
    fn pvspin_entries_are_found_by_a_guest_scan_and_replace_stale_copies() {
        let info = PvspinInfo {
            version: pvspin_abi::ABI_VERSION,
            doorbell_port: pvspin_abi::doorbell::DEFAULT_PORT,
            doorbell_ports: pvspin_abi::doorbell::PORT_COUNT,
            features: FEATURE_KICK,
            nr_vcpus: 3,
        };
        let e = pvspin_entries(info, DEFAULT_BASE).unwrap();
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
        assert_eq!(find_pvspin_info(&e, DEFAULT_BASE), Some(info));
        let mut cpuid = CpuId::new(0).unwrap();
        add_pvspin_entries(&mut cpuid, info, DEFAULT_BASE).unwrap();
        let newer = PvspinInfo {
            nr_vcpus: 4,
            ..info
        };
        add_pvspin_entries(&mut cpuid, newer, DEFAULT_BASE).unwrap();
        assert_eq!(cpuid.as_slice().len(), 2);
        assert_eq!(
            find_pvspin_info(cpuid.as_slice(), DEFAULT_BASE),
            Some(newer)
        );
        assert_eq!(
            find_pvspin_info(cpuid.as_slice(), DEFAULT_BASE + 0x100),
            None
        );
    }

    #[test]
    fn cpuid_base_rules() {
        for bad in [0x4000_0000, 0x4000_0201, 0x3fff_ff00, 0x4001_0000] {
            assert_eq!(check_base(bad), Err(CpuidError::BadBase(bad)));
        }
        assert!(check_base(0x4000_0100).is_ok());
        assert!(check_base(0x4000_ff00).is_ok());
    }
}
