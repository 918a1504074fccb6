//! The guest side of pvspin's ABI: discovery through CPUID, the kick doorbell, and the PV lock
//! domain all PV locks of this guest share.

use core::sync::atomic::{AtomicU16, Ordering};

use pvspin_abi::cpuid::{find_base, CpuidRegs, PvspinInfo, FEATURE_KICK, INFO_LEAF_OFFSET};
use pvspin_abi::doorbell::KICK_OFFSET;
use pvspin_guest::x86::{HaltPvOps, PvPlatform};
use pvspin_guest::{pv_static, PvDomain, SpinConfig};
use pvspin_vmm_proto::{MAX_PV_VCPUS, VCPU_SLOT_INDEX_OFFSET};

use crate::arch::{cpuid, outl};

/// The doorbell's first port, learned at boot (0: pvspin not found).
static DOORBELL: AtomicU16 = AtomicU16::new(0);

/// This guest's platform for the PV locks.
pub struct Platform;

impl PvPlatform for Platform {
    fn cpu_id(&self) -> u32 {
        let index: u32;
        // SAFETY: the VMM points each vCPU's GS base at its own progress slot, whose `index`
        // field holds the vCPU's index; a 4-byte load from there has no other effect.
        unsafe {
            core::arch::asm!(
                "mov {index:e}, dword ptr gs:[{offset}]",
                index = out(reg) index,
                offset = const VCPU_SLOT_INDEX_OFFSET,
                options(nostack, preserves_flags, readonly),
            );
        }
        index
    }

    fn kick(&self, cpu: u32) {
        // The ABI: one 32-bit OUT of the target's index to the doorbell's KICK offset.
        outl(DOORBELL.load(Ordering::Relaxed) + KICK_OFFSET, cpu);
    }
}

/// The PV lock domain: per-vCPU wait slots, MCS nodes and counters for up to
/// [`MAX_PV_VCPUS`] vCPUs.
// SAFETY: the guest runs at CPL 0 and the host's kick device latches kicks (pvspin ABI §3.1).
pub static PV: PvDomain<HaltPvOps<Platform>, { MAX_PV_VCPUS as usize }> =
    PvDomain::new(unsafe { HaltPvOps::new(Platform) }, SpinConfig::EMULATED);
pv_static!(pub GuestPv: HaltPvOps<Platform> = PV);

/// Why PV locks cannot be used.
pub enum PvUnavailable {
    /// No pvspin signature in the hypervisor CPUID range.
    NotFound,
    /// pvspin found, but an incompatible ABI or no KICK feature.
    Unusable,
}

/// Finds pvspin through CPUID (pvspin ABI §2) and remembers the doorbell.
pub fn discover() -> Result<PvspinInfo, PvUnavailable> {
    let read = |leaf: u32| {
        let [eax, ebx, ecx, edx] = cpuid(leaf);
        CpuidRegs { eax, ebx, ecx, edx }
    };
    let base = find_base(read).ok_or(PvUnavailable::NotFound)?;
    let info = PvspinInfo::from_info_leaf(read(base + INFO_LEAF_OFFSET));
    if !pvspin_abi::version_compatible(info.version) || info.features & FEATURE_KICK == 0 {
        return Err(PvUnavailable::Unusable);
    }
    DOORBELL.store(info.doorbell_port, Ordering::Relaxed);
    Ok(info)
}

/// Applies the VMM's spin policy to the domain.
pub fn configure(spin_threshold: u32, halt: bool) -> bool {
    PV.configure(SpinConfig {
        spin_threshold,
        halt,
    })
    .is_ok()
}
