//! The guest's current privilege level (CPL) at an exit, from `kvm_run`'s sync registers.
//!
//! KVM's VMX backend reports CPL as the DPL of SS (`vmx_get_cpl`); in real mode (CR0.PE clear)
//! the CPL is 0. [`cpl_from_sregs`] applies the same rule to a `kvm_sregs`, however it was
//! obtained. The cheap way to obtain one is `KVM_CAP_SYNC_REGS`: with `KVM_SYNC_X86_SREGS` set
//! in `kvm_run.kvm_valid_regs`, KVM copies the special registers into `kvm_run.s.regs.sregs` at
//! every return from `KVM_RUN`, inside the same syscall. A `KVM_GET_SREGS` ioctl per exit costs
//! one extra syscall, about 5 us on the development machines (the shared notes'
//! kvm-on-these-machines.md, "E4: exit costs").
//! The copy inside KVM is not free either (it is `__get_sregs` on every exit), but it needs
//! no extra kernel entry. Measured on the development machines
//! (`cargo test -p pvspin-integration-tests --test track_cpl -- --ignored --nocapture`,
//! loaded machine, medians): reading the CPL from the sync registers 0.02 us, a
//! `KVM_GET_SREGS` 2.6 us; whole exits (30-40 us each under the emulator and the load) are too
//! noisy to show the in-kernel copy.
//!
//! Not observable from userspace: the CPL at the moment the host *preempted* a vCPU inside
//! `KVM_RUN` (KVM reads it at `vcpu_put`). The board records the CPL at the last exit, which
//! is exact when the vCPU is descheduled by the VMM itself (it is outside `KVM_RUN` then) and
//! when it was forced out by a kick (`immediate_exit` or a signal), and a stale proxy
//! otherwise: the guest may change mode between exits without exiting.

use kvm_bindings::{kvm_sregs, KVM_SYNC_X86_SREGS};
use kvm_ioctls::{Cap, Kvm, SyncReg, VcpuFd};
use thiserror::Error;

/// CR0.PE: protected mode enable.
const CR0_PE: u64 = 1;

/// Errors of the sync-register edge.
#[derive(Debug, Error, PartialEq, Eq, displaydoc::Display)]
pub enum CplError {
    /// rule: KVM_CAP_SYNC_REGS with KVM_SYNC_X86_SREGS is required (host reports {0:#x})
    SyncRegsUnsupported(u64),
}

/// The CPL (0 to 3) of a vCPU whose special registers are `sregs`.
///
/// Real mode (CR0.PE clear) is CPL 0; otherwise the DPL of SS, as KVM's VMX backend computes
/// it. Virtual-8086 mode (CPL 3) cannot be told apart here, because RFLAGS.VM is not in
/// `kvm_sregs`: such a vCPU reads as the DPL of its SS, which is 3 in every sane vm86 setup.
pub fn cpl_from_sregs(sregs: &kvm_sregs) -> u8 {
    if sregs.cr0 & CR0_PE == 0 {
        0
    } else {
        sregs.ss.dpl & 3
    }
}

/// Checks that the host can fill `kvm_run.s.regs.sregs` on every exit.
pub fn check_sync_sregs(kvm: &Kvm) -> Result<(), CplError> {
    // The capability's value is the set of supported KVM_SYNC_X86_* bits.
    let mask = u64::try_from(kvm.check_extension_int(Cap::SyncRegs)).unwrap_or(0);
    if mask & u64::from(KVM_SYNC_X86_SREGS) == 0 {
        return Err(CplError::SyncRegsUnsupported(mask));
    }
    Ok(())
}

/// Asks KVM to copy the special registers into `kvm_run` at every exit of `vcpu`.
///
/// Call once from the vCPU's thread before its first `KVM_RUN` (the bit stays set in
/// `kvm_run.kvm_valid_regs`). Nothing is written back to the guest: the dirty mask is left
/// alone.
pub fn enable_sync_sregs(vcpu: &mut VcpuFd) {
    vcpu.set_sync_valid_reg(SyncReg::SystemRegister);
}

/// The CPL at the last exit of `vcpu`, from `kvm_run.s.regs.sregs` (no ioctl).
///
/// Only meaningful after [`enable_sync_sregs`] and at least one return from `KVM_RUN`; call it
/// from the vCPU's own thread between `KVM_RUN`s.
pub fn cpl_from_sync_regs(vcpu: &VcpuFd) -> u8 {
    let regs = vcpu.sync_regs();
    cpl_from_sregs(&regs.sregs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sregs(cr0: u64, ss_dpl: u8, cs_dpl: u8) -> kvm_sregs {
        let mut s = kvm_sregs {
            cr0,
            ..Default::default()
        };
        s.ss.dpl = ss_dpl;
        s.cs.dpl = cs_dpl;
        s
    }

    #[test]
    fn real_mode_is_cpl0_whatever_the_dpl_fields_say() {
        assert_eq!(cpl_from_sregs(&sregs(0, 3, 3)), 0);
    }

    #[test]
    fn protected_mode_takes_ss_dpl() {
        assert_eq!(cpl_from_sregs(&sregs(CR0_PE | 0x8000_0000, 0, 0)), 0);
        assert_eq!(cpl_from_sregs(&sregs(CR0_PE, 3, 3)), 3);
        // SS.DPL wins over CS.DPL (conforming code segments), as in vmx_get_cpl.
        assert_eq!(cpl_from_sregs(&sregs(CR0_PE, 3, 0)), 3);
    }

    #[test]
    fn garbage_dpl_is_masked_to_two_bits() {
        assert_eq!(cpl_from_sregs(&sregs(CR0_PE, 0xff, 0)), 3);
    }
}
