//! KVM quirks that pvspin turns off, and how it keeps the VMM's own.
//!
//! With `KVM_X86_QUIRK_FIX_HYPERCALL_INSN` on, KVM rewrites a guest's VMMCALL/VMCALL into the
//! host vendor's instruction and re-executes it. On emulating hosts the rewritten instruction
//! never completes, so a stray hypercall burns a host CPU forever. With the quirk off, a
//! hypercall instruction of the wrong vendor raises #UD in the guest instead, which fails fast.
//! The price: a Linux guest patches its hypercall instruction once, at boot, for the vendor it
//! booted on; after a live migration between an Intel and an AMD host its hypercalls are of the
//! wrong vendor and fault. A VMM that migrates across vendors must keep the quirk
//! (`PlanRequest::disable_fix_hypercall_quirk = Some(false)`, or `keep_hypercall_quirk(true)`
//! in the `pvspin` builder).
//!
//! # The mask is per VM, and old hosts replace it
//!
//! `KVM_ENABLE_CAP(KVM_CAP_DISABLE_QUIRKS2, mask)` (KVM v5.19 and later) on hosts before
//! upstream 9966b7822b3f (2025) does `kvm->arch.disabled_quirks = mask`: each call *replaces*
//! the set of disabled quirks, so a call that names only FIX_HYPERCALL_INSN re-enables every
//! quirk the VMM disabled before, and a later VMM call that does not name FIX_HYPERCALL_INSN
//! re-enables it. Later hosts add to the set (`|=`). KVM offers no way to read the set back.
//! pvspin therefore writes the VMM's already-disabled quirks together with its own
//! ([`mask_to_write`]); the VMM tells pvspin what it disabled (`vmm_disabled_quirks`) and, if it
//! disables quirks after pvspin, includes the mask pvspin reports (`VmSetup::disabled_quirks`).
//! Both orders are then right on both kinds of host.

use kvm_bindings::{kvm_enable_cap, KVM_CAP_DISABLE_QUIRKS2, KVM_X86_QUIRK_FIX_HYPERCALL_INSN};
use kvm_ioctls::VmFd;

/// `KVM_X86_QUIRK_FIX_HYPERCALL_INSN` as a mask.
pub const FIX_HYPERCALL_INSN: u64 = KVM_X86_QUIRK_FIX_HYPERCALL_INSN as u64;

/// Errors from changing KVM quirks.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum QuirkError {
    /// rule: host KVM cannot disable quirk(s) {quirk:#x} (KVM_CAP_DISABLE_QUIRKS2 reports
    /// {supported:#x})
    Unsupported {
        /// The quirk bits asked for.
        quirk: u64,
        /// The quirk mask the host reports as disableable.
        supported: u64,
    },
    /// KVM_ENABLE_CAP(DISABLE_QUIRKS2, {quirk:#x}) failed: {source}
    Enable {
        /// The quirk mask written.
        quirk: u64,
        /// The error KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// The quirks this host lets userspace disable (`KVM_CHECK_EXTENSION(KVM_CAP_DISABLE_QUIRKS2)`).
pub fn disableable_quirks(vm: &VmFd) -> u64 {
    let mask = vm.check_extension_raw(u64::from(KVM_CAP_DISABLE_QUIRKS2));
    u64::try_from(mask).unwrap_or(0)
}

/// The mask to write so that, on hosts that replace the disabled set as on hosts that add to
/// it, the VMM's already-disabled quirks stay disabled next to pvspin's (pure).
pub fn mask_to_write(vmm_disabled: u64, ours: u64) -> u64 {
    vmm_disabled | ours
}

/// Disables `KVM_X86_QUIRK_FIX_HYPERCALL_INSN` on `vm`, so a stray hypercall faults (#UD)
/// instead of livelocking. Must be called before the vCPUs run. Same as
/// `disable_quirks(vm, 0, FIX_HYPERCALL_INSN)`: use [`disable_quirks`] when the VMM disabled
/// other quirks already.
pub fn disable_fix_hypercall_insn(vm: &VmFd) -> Result<u64, QuirkError> {
    disable_quirks(vm, 0, FIX_HYPERCALL_INSN)
}

/// Disables `ours` on `vm` without re-enabling `vmm_disabled` on hosts that replace the mask:
/// writes [`mask_to_write`]`(vmm_disabled, ours)` in one `KVM_ENABLE_CAP` and returns it (the
/// set now disabled, which a VMM must include in any later `KVM_CAP_DISABLE_QUIRKS2` call).
/// Refuses bits the host cannot disable, the VMM's included.
pub fn disable_quirks(vm: &VmFd, vmm_disabled: u64, ours: u64) -> Result<u64, QuirkError> {
    let supported = disableable_quirks(vm);
    let mask = mask_to_write(vmm_disabled, ours);
    if supported & mask != mask {
        return Err(QuirkError::Unsupported {
            quirk: mask & !supported,
            supported,
        });
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_DISABLE_QUIRKS2,
        ..Default::default()
    };
    cap.args[0] = mask;
    vm.enable_cap(&cap).map_err(|source| QuirkError::Enable {
        quirk: mask,
        source,
    })?;
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_keeps_the_vmm_quirks() {
        assert_eq!(FIX_HYPERCALL_INSN, 1 << 5);
        assert_eq!(mask_to_write(0, FIX_HYPERCALL_INSN), 0x20);
        // LINT0_REENABLED | OUT_7E_INC_RIP disabled by the VMM before pvspin.
        assert_eq!(mask_to_write(0x9, FIX_HYPERCALL_INSN), 0x29);
        assert_eq!(mask_to_write(0x29, FIX_HYPERCALL_INSN), 0x29);
        assert_eq!(mask_to_write(0x9, 0), 0x9);
    }
}
