//! The embedding API's errors: [`ConfigError`] (the VMM's configuration broke a rule, named),
//! [`ParseActuatorError`] (an actuator name that is none) and [`Error`] (a setup call failed;
//! the cause keeps its type).

use crate::kick::{RouteFaults, MAX_GSI};
use crate::{cpuid, ActuatorKind, CplError, IrqchipError, PlanError, QuirkError, Verdict};

/// Invalid configuration given to the builder or the hooks.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ConfigError {
    /// the number of vCPUs must be set (PvSpinBuilder::vcpus)
    MissingVcpus,
    /// the number of vCPUs must be between 1 and {max}, got {got} (rule: pvspin_abi::MAX_VCPUS; a
    /// kick names the vCPU's 8-bit initial APIC ID and a REMRD MSI cannot address 0xFF, the xAPIC
    /// broadcast ID, alone; x2APIC IDs are not supported)
    VcpuCount {
        /// What was asked for.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// a VcpuInterrupter must be set (PvSpinBuilder::interrupter): pvspin must be able to get a
    /// vCPU out of KVM_RUN
    MissingInterrupter,
    /// vCPU index {index} is out of range: the VM was configured with {vcpus} vCPUs
    VcpuIndex {
        /// The index given.
        index: usize,
        /// The configured count.
        vcpus: usize,
    },
    /// vCPU {0} is already configured: configure_vcpu must be called once per vCPU
    VcpuConfiguredTwice(usize),
    /// rule: the paravirt plan's vCPU count must be the VM's: PlanRequest::vcpus is {plan},
    /// PvSpinBuilder::vcpus is {builder}
    PlanVcpus {
        /// `PlanRequest::vcpus`.
        plan: u32,
        /// `PvSpinBuilder::vcpus`.
        builder: usize,
    },
    /// rule: keep_hypercall_quirk(true) contradicts PlanRequest::disable_fix_hypercall_quirk =
    /// Some(true)
    QuirkConflict,
    /// directed yield: {0}
    DirectedYieldBoard(#[source] pvspin_track::BoardError),
    /// directed yield: {0}
    DirectedYieldPolicy(#[source] pvspin_yield::PolicyError),
    /// directed yield: {0}
    DirectedYieldWindows(#[source] pvspin_yield::WindowError),
    /// hint pages: {0}
    HintPages(#[source] pvspin_yield::BudgetError),
    /// run slots: {0}
    RunSlots(#[from] pvspin_slots::SlotError),
    /// run slots: {0}
    HaltWatcher(#[from] pvspin_slots::WatchError),
    /// rule: pvspin's CPUID base is 0x100-aligned, in 0x40000100..=0x4000ff00
    /// (PvSpinBuilder::cpuid_base), got {0:#x}
    CpuidBase(u32),
    /// rule: run slots on the in-kernel and signal-msi kick paths need KVM's per-vCPU binary
    /// statistic `blocking` (KVM_GET_STATS_FD): halts there never leave KVM_RUN
    RunSlotsNeedBlockingStat,
    /// rule: check_routes checks the kick routes of PvSpin::set_kick_gsis, which has not run
    RoutesBeforeGsis,
    /// rule: to edit CPUID without a vCPU, pvspin must know whether the VM has an in-kernel LAPIC:
    /// give a kick path or PlanRequest::lapic_in_kernel, or use edit_cpuid_for_vcpu
    LapicUnknown,
    /// rule: the in-kernel and signal-msi kick paths need an in-kernel LAPIC: create the irqchip
    /// (KVM_CREATE_IRQCHIP) before the vCPUs
    KickPathNeedsLapic,
    /// rule: the userspace kick path needs HLT exits, which an in-kernel LAPIC keeps inside KVM:
    /// with an irqchip use KickPath::SignalMsi or InKernel
    UserspaceKickWithLapic,
    /// rule: the in-kernel kick path needs its GSIs (PvSpin::set_kick_gsis) and their routes and
    /// eventfds applied before configure_vcpu
    KickGsisMissing,
    /// rule: only the in-kernel kick path has GSI routes and ioeventfds
    GsisWithoutInKernelPath,
    /// rule: kick GSIs: one GSI per vCPU: {vcpus} vCPUs, {gsis} GSIs
    KickGsiCount {
        /// The number of vCPUs.
        vcpus: usize,
        /// The number of GSIs given.
        gsis: usize,
    },
    /// rule: kick GSIs: GSI {0} given twice
    KickGsiTwice(u32),
    /// rule: kick GSIs: GSI {0} is not below KVM's {MAX_GSI:}
    KickGsiRange(u32),
    /// rule: kick GSIs: the kick GSIs are set once
    KickGsisSetTwice,
    /// rule: the doorbell's {count} ports from {port:#x} must fit below 0x10000
    DoorbellPort {
        /// The first port asked for.
        port: u16,
        /// The number of ports of the doorbell.
        count: u16,
    },
    /// rule: configure_vm runs after KVM_CREATE_VM and before the first KVM_CREATE_VCPU, and KVM
    /// says this VM has vCPUs already (it refuses VM-wide settings such as exit disabling once one
    /// exists, and an irqchip made afterwards misses them)
    VmAfterVcpus,
    /// rule: the in-kernel kick path needs the VMM's in-kernel irqchip (KVM_CREATE_IRQCHIP, or a
    /// split irqchip) before {call}: KVM refuses the kick irqfds without one (KVM_IRQFD: EINVAL)
    NoIrqchip {
        /// The call that found none.
        call: &'static str,
    },
    /// rule: the kick wiring is registered once: KVM says its irqfds or ioeventfds are registered
    /// already (by KickWiring::register or the VMM's own calls); a VMM that rebuilds its GSI table
    /// re-applies KickWiring::routes only
    WiringRegisteredTwice,
    /// rule: the GSI routing table the VMM applies keeps pvspin's kick routes
    /// (KickWiring::routes; KVM_SET_GSI_ROUTING replaces the whole table), or kicks to these
    /// vCPUs wake nobody: {faults}
    KickRoutes {
        /// What differs, per vCPU.
        faults: RouteFaults,
    },
    /// rule: pvspin's vCPU {index} is KVM vCPU id {index} (KVM_CREATE_VCPU({index})), but its LAPIC
    /// has APIC ID {apic_id}: KVM sets the APIC ID from the vCPU id, and the in-kernel and
    /// signal-msi kicks of vCPU i go to APIC ID i, so they would reach another vCPU or nobody
    ApicId {
        /// The vCPU's pvspin index.
        index: usize,
        /// Its APIC ID (its KVM vCPU id, unless the VMM changed it).
        apic_id: u32,
    },
    /// rule: vCPU {index}'s kick ioeventfd is registered before configure_vcpu as
    /// KickWiring::ioevents gives it (port {port:#x}, 4 bytes, datamatch {index}), and KVM has
    /// none: every kick to it would exit to userspace (a u64 datamatch registers an 8-byte
    /// ioeventfd that the guest's 4-byte OUT never matches; use KickWiring::register)
    KickIoeventfd {
        /// The vCPU.
        index: usize,
        /// The KICK port.
        port: u16,
    },
    /// rule: vCPU {index}'s kick irqfd (its eventfd at GSI {gsi}) is registered before
    /// configure_vcpu (KickWiring::irqfds or KickWiring::register), and KVM has none: its kicks
    /// would wake nobody
    KickIrqfd {
        /// The vCPU.
        index: usize,
        /// Its kick GSI.
        gsi: u32,
    },
    /// rule: set vCPU {index}'s CPUID from PvSpin::edit_cpuid with KVM_SET_CPUID2 before
    /// configure_vcpu: {what}
    Cpuid {
        /// The vCPU.
        index: usize,
        /// What is missing.
        what: CpuidFault,
    },
    /// directed yield actuator "{name}": {source}
    Actuator {
        /// The actuator built (`DirectedYieldOptions::actuator`, or the one a confinement
        /// step-down chose).
        name: ActuatorKind,
        /// Why it was refused.
        #[source]
        source: pvspin_hints::ActuatorError,
    },
    /// directed yield actuator "{name}": rule: a guest must not raise its VM's CPU share, and
    /// this boost would not be confined ({verdict}); run the VMM alone in its own cpu cgroup, or
    /// accept Confinement::Unconfined
    BoostNotConfined {
        /// The actuator asked for (`DirectedYieldOptions::actuator`).
        name: ActuatorKind,
        /// The confinement check's answer.
        verdict: Verdict,
    },
    /// directed yield actuator "{name}": rule: a guest must not raise its VM's CPU share, and
    /// this boost would not be confined (SCHED_FIFO preempts every fair-class task on its CPU,
    /// whatever the cgroup); run the VMM alone in its own cpu cgroup, or accept
    /// Confinement::Unconfined
    FifoNotConfined {
        /// The actuator asked for (`DirectedYieldOptions::actuator`).
        name: ActuatorKind,
    },
    /// rule: a VM gets at least one CPU (PvSpinBuilder::vm_cpus, PvSpin::set_vm_cpus), got 0
    NoVmCpus,
}

/// A directed-yield actuator name that is not one ([`ActuatorKind`]'s `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
pub enum ParseActuatorError {
    /// rule: the directed-yield actuator is one of yield, nice, fifo; got {0:?}
    UnknownName(
        /// The name as given: it matched no actuator, so no type holds it.
        String,
    ),
}

/// What is wrong with a vCPU's CPUID in KVM ([`ConfigError::Cpuid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
pub enum CpuidFault {
    /// pvspin's leaves are missing at {0:#x}
    LeavesMissing(u32),
    /// its initial APIC ID (CPUID 01H/0BH/1FH) is not its index
    ApicIdNotIndex,
    /// edit_cpuid was never called for it (the paravirt plan edits it)
    NeverEdited,
}

/// Errors from the setup hooks.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub enum Error {
    /// {0}
    ///
    /// The configuration is invalid.
    Config(#[from] ConfigError),
    /// configuring KVM quirks: {0}
    Quirk(#[from] QuirkError),
    /// paravirt plan: {0}
    Plan(#[from] PlanError),
    /// directed yield: {0}
    SyncRegs(#[from] CplError),
    /// KVM_SET_CPUID2 on vCPU {index}: {source}
    SetCpuid {
        /// The vCPU.
        index: usize,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM_GET_TSC_KHZ on vCPU {index}: {source}
    TscKhz {
        /// The vCPU.
        index: usize,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// configure_vm must be called before configure_vcpu
    VmNotConfigured,
    /// kick device: {0}
    Kick(#[from] pvspin_kick::KickError),
    /// kick device: duplicating the VM fd: {0}
    DupVmFd(#[source] std::io::Error),
    /// kick device: creating an eventfd: {0}
    KickEventFd(#[source] std::io::Error),
    /// kick device: building the GSI routing table: {0:?}
    RoutingTable(vmm_sys_util::fam::Error),
    /// kick device: KVM_SET_GSI_ROUTING: {0}
    SetGsiRouting(#[source] kvm_ioctls::Error),
    /// registering the kick wiring: {op}: {source}
    KickRegister {
        /// The ioctl.
        op: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// checking the kick wiring: {op}: {source}
    Probe {
        /// What was tried.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// KVM_GET_LAPIC on vCPU {index}: {source}
    GetLapic {
        /// The vCPU.
        index: usize,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// vCPU irqchip setup: {0}
    Irqchip(#[from] IrqchipError),
    /// CPUID: {0}
    Cpuid(#[from] cpuid::CpuidError),
    /// KVM_GET_CPUID2 on vCPU {index}: {source}
    GetCpuid {
        /// The vCPU.
        index: usize,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
}
