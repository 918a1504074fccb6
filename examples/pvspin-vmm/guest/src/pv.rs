//! The guest side of pvspin's ABI: discovery through CPUID, the kick doorbell, and the PV lock
//! domain all PV locks of this guest share.

use core::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};

use pvspin_abi::cpuid::{find_base, CpuidRegs, PvspinInfo, FEATURE_KICK, INFO_LEAF_OFFSET};
use pvspin_abi::doorbell::{lock_hash, spun_bucket, SpinNotify, KICK_OFFSET, SPIN_OFFSET};
use pvspin_guest::x86::{HaltPvOps, PvPlatform};
use pvspin_guest::{pv_static, PvDomain, SpinConfig, SpinWait};
use pvspin_vmm_proto::{MAX_PV_VCPUS, STACKS_ADDR, STACK_SIZE, VCPU_SLOT_INDEX_OFFSET};

use crate::arch::{cpuid, inl, outl, wrmsr};

/// The doorbell's first port, learned at boot (0: pvspin not found).
static DOORBELL: AtomicU16 = AtomicU16::new(0);

/// Set once the lock workload runs in user mode (`BootParams::user_mode`).
pub static USER_MODE: AtomicBool = AtomicBool::new(false);

/// Per vCPU: the spin window the host published, read at boot and after each notification;
/// `u32::MAX` (never notify) until [`enable_spin_notify`].
static WINDOWS: [AtomicU32; MAX_PV_VCPUS as usize] =
    [const { AtomicU32::new(u32::MAX) }; MAX_PV_VCPUS as usize];

/// Reads this vCPU's spin window from the SPIN register (one exit) and caches it.
fn refresh_window(cpu: u32) {
    let window = inl(DOORBELL.load(Ordering::Relaxed) + SPIN_OFFSET);
    if let Some(w) = WINDOWS.get(cpu as usize) {
        // All ones is what a host without SPIN answers: keep not notifying then.
        w.store(window.max(1), Ordering::Relaxed);
    }
}

/// Turns spin notifications on for `vcpu` (the host must advertise `SPIN_NOTIFY`), and
/// registers its KVM steal-time area when KVM offers steal time, so the host sees this vCPU
/// preempted.
pub fn enable_spin_notify(vcpu: u32) {
    refresh_window(vcpu);
    register_steal_time(vcpu);
}

/// KVM's CPUID signature leaf, feature leaf, steal-time feature bit and MSR.
const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
const KVM_FEATURE_STEAL_TIME: u32 = 1 << 5;
const MSR_KVM_STEAL_TIME: u32 = 0x4b56_4d03;

fn register_steal_time(vcpu: u32) {
    if vcpu >= MAX_PV_VCPUS {
        return;
    }
    let [max, ebx, ecx, edx] = cpuid(KVM_CPUID_SIGNATURE);
    let kvm = [ebx, ecx, edx] == [0x4b4d_564b, 0x564b_4d56, 0x0000_004d]; // "KVMKVMKVM\0\0\0"
    if !kvm || max < KVM_CPUID_FEATURES || cpuid(KVM_CPUID_FEATURES)[0] & KVM_FEATURE_STEAL_TIME == 0 {
        return;
    }
    // SAFETY: CPL 0, and KVM advertises the MSR; bit 0 enables the 64-byte-aligned area.
    unsafe { wrmsr(MSR_KVM_STEAL_TIME, pvspin_vmm_proto::steal_time_addr(vcpu) | 1) };
}

/// This guest's platform for the PV locks.
pub struct Platform;

impl PvPlatform for Platform {
    fn cpu_id(&self) -> u32 {
        if USER_MODE.load(Ordering::Relaxed) {
            // In user mode GS may have been nulled by the privilege change; every vCPU runs
            // on its own stack, which names it just as well.
            let rsp: u64;
            // SAFETY: reads the stack pointer.
            unsafe { core::arch::asm!("mov {0}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags)) };
            return (rsp.saturating_sub(STACKS_ADDR) / STACK_SIZE) as u32;
        }
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

    fn spin_window(&self) -> u32 {
        WINDOWS
            .get(self.cpu_id() as usize)
            .map_or(u32::MAX, |w| w.load(Ordering::Relaxed))
    }

    fn spin_notify(&self, wait: &SpinWait) {
        // The ABI: one 32-bit OUT of the notification to the SPIN offset, then (one more
        // exit) the window the host adapted.
        let value = SpinNotify {
            waiting_for: wait.waiting_for.and_then(|w| u16::try_from(w).ok()),
            next_owner: wait.next_owner,
            spun_bucket: spun_bucket(wait.spun),
            lock_hash: lock_hash(wait.lock as u64),
        }
        .encode();
        outl(DOORBELL.load(Ordering::Relaxed) + SPIN_OFFSET, value);
        refresh_window(self.cpu_id());
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
