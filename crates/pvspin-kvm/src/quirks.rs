//! KVM quirks that pvspin turns off.
//!
//! With `KVM_X86_QUIRK_FIX_HYPERCALL_INSN` on, KVM rewrites a guest's VMMCALL/VMCALL into the
//! host vendor's instruction and re-executes it. On emulating hosts the rewritten instruction
//! never completes, so a stray hypercall burns a host CPU forever. With the quirk off, a
//! hypercall instruction of the wrong vendor raises #UD in the guest instead, which fails fast.

use kvm_bindings::{kvm_enable_cap, KVM_CAP_DISABLE_QUIRKS2, KVM_X86_QUIRK_FIX_HYPERCALL_INSN};
use kvm_ioctls::VmFd;

/// Errors from changing KVM quirks.
#[derive(Debug, thiserror::Error)]
pub enum QuirkError {
    /// The host cannot disable the quirk (no `KVM_CAP_DISABLE_QUIRKS2`, or not this quirk).
    #[error(
        "host KVM cannot disable quirk {quirk:#x} (KVM_CAP_DISABLE_QUIRKS2 reports {supported:#x})"
    )]
    Unsupported {
        /// The quirk bit asked for.
        quirk: u64,
        /// The quirk mask the host reports as disableable.
        supported: u64,
    },
    /// `KVM_ENABLE_CAP(KVM_CAP_DISABLE_QUIRKS2)` failed.
    #[error("KVM_ENABLE_CAP(DISABLE_QUIRKS2, {quirk:#x}) failed: {source}")]
    Enable {
        /// The quirk bit asked for.
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

/// Disables `KVM_X86_QUIRK_FIX_HYPERCALL_INSN` on `vm`, so a stray hypercall faults (#UD)
/// instead of livelocking. Must be called before the vCPUs run.
pub fn disable_fix_hypercall_insn(vm: &VmFd) -> Result<(), QuirkError> {
    disable_quirk(vm, u64::from(KVM_X86_QUIRK_FIX_HYPERCALL_INSN))
}

fn disable_quirk(vm: &VmFd, quirk: u64) -> Result<(), QuirkError> {
    let supported = disableable_quirks(vm);
    if supported & quirk != quirk {
        return Err(QuirkError::Unsupported { quirk, supported });
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_DISABLE_QUIRKS2,
        ..Default::default()
    };
    cap.args[0] = quirk;
    vm.enable_cap(&cap)
        .map_err(|source| QuirkError::Enable { quirk, source })
}
