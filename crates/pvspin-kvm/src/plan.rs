//! The placement-driven paravirt plan for stock (Linux) guests.
//!
//! A Linux guest brings its own PV spinlocks; KVM implements the host side in the kernel. What the
//! VMM must get right is the configuration: the KVM CPUID leaf `0x40000001` (feature bits in EAX,
//! hints in EDX), `KVM_CAP_X86_DISABLE_EXITS`, the per-VM halt-poll limit (`KVM_CAP_HALT_POLL`),
//! `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` and the `FIX_HYPERCALL_INSN` quirk. This module computes
//! that configuration from the vCPU [`Placement`] and what the host supports ([`HostCaps`]),
//! validates it ([`PlanError`] names the rule that was broken), and applies it in the order KVM
//! requires ([`apply_vm`] before any vCPU exists, then [`apply_vcpu`] on each vCPU before its
//! first `KVM_RUN`).
//!
//! Planning ([`Plan::new`], [`edit_cpuid`]) is pure and has no KVM in it; only [`HostCaps::probe`],
//! [`apply_vm`] and [`apply_vcpu`] touch file descriptors.
//!
//! # Defaults per placement, and why
//!
//! The guest's decisions (Linux `arch/x86/kernel/kvm.c`; the whole table per kernel line is in
//! `docs/stock-guests.md` and encoded in [`crate::guest::guest_outcome`]): without `PV_UNHALT`
//! and without `KVM_HINTS_REALTIME` the guest keeps the unfair test-and-set `virt_spin_lock`;
//! with `PV_UNHALT` and without `REALTIME` (and more than one CPU) it uses PV qspinlock (wait =
//! HLT, kick = `KVM_HC_KICK_CPU`); with `REALTIME` it uses native qspinlock, **but** kernels
//! from 5.9 (the `nopvspin` series reordered `kvm_spinlock_init`) up to upstream 960550503965
//! (mainline 6.18; "Prefer native qspinlock for dedicated vCPUs irrespective of PV_UNHALT",
//! in the 5.10, 5.15, 6.1, 6.6, 6.12 and 6.17 stable lines from November/December 2025) check
//! `PV_UNHALT` first and keep test-and-set when it is absent, `REALTIME` or not
//! ([`GuestKernel::Legacy`]; [`GuestKernel::from_release`] tells a release's family).
//! `PV_TLB_FLUSH` and `PV_SCHED_YIELD` are used only with `STEAL_TIME` and without `REALTIME`
//! (and, from 5.17, with more than one CPU and without MWAIT in the guest's CPUID). `POLL_CONTROL` is used only by `cpuidle-haltpoll`, which loads only with
//! `REALTIME`. KVM strips `PV_UNHALT` when HLT exits are disabled, and a HLT that never exits
//! cannot be woken by a kick.
//!
//! | | dedicated (pinned 1:1) | shared | overcommitted |
//! |---|---|---|---|
//! | `KVM_HINTS_REALTIME` | **on**: vCPUs are never preempted for long, so native qspinlock is best | off | off |
//! | disabled exits | guest `Modern`: **HLT \| PAUSE**; `Unknown`/`Legacy`: **PAUSE** only, so that `PV_UNHALT` may be advertised | none | none |
//! | `PV_UNHALT` | on exactly when HLT exits stay enabled (guest `Unknown`/`Legacy`, or a host that cannot disable them, e.g. `mitigate_smt_rsb`): legacy guests need it next to `REALTIME` for native qspinlock | on | on |
//! | `STEAL_TIME` | on: steal accounting stays truthful (it reads ~0) | on | on |
//! | `PV_TLB_FLUSH`, `PV_SCHED_YIELD` | off: the guest ignores them under REALTIME | on | on |
//! | `PV_SEND_IPI` | on: one hypercall instead of one exit per destination | on | on |
//! | `POLL_CONTROL` | **on**: `cpuidle-haltpoll` loads under REALTIME and turns host polling off with it (without it the guest logs "host does not support poll control") | off: no guest uses it | off |
//! | halt-poll limit | KVM's default | KVM's default | **0**: polling burns a host CPU another runnable vCPU needs |
//! | `ENFORCE_PV_FEATURE_CPUID` | on | on | on |
//! | `FIX_HYPERCALL_INSN` quirk | disabled | disabled | disabled |
//!
//! `PV_UNHALT` also needs an in-kernel LAPIC (`KVM_CREATE_IRQCHIP` or a split irqchip): KVM
//! delivers `KVM_HC_KICK_CPU` as a REMRD interrupt to the target's in-kernel LAPIC, and without
//! one the kick reaches nobody while the guest's `kvm_wait` halts with interrupts off. QEMU
//! strips `PV_UNHALT` in that case too. [`PlanRequest::lapic_in_kernel`] says whether the VM has
//! one; when it is `None`, [`apply_vcpu`] asks each vCPU (`KVM_GET_LAPIC`).
//!
//! `ENFORCE_PV_FEATURE_CPUID` is on everywhere so that CPUID is the single truth: without it KVM
//! services `KICK_CPU`, `SCHED_YIELD` and `SEND_IPI` even when they were not advertised. The
//! `FIX_HYPERCALL_INSN` quirk is disabled everywhere so that a hypercall of the wrong vendor
//! raises #UD instead of being rewritten (on the emulating development hosts a rewritten
//! hypercall loops forever); a VMM that live-migrates guests between Intel and AMD hosts must
//! keep it (see [`crate::quirks`]).
//!
//! One vCPU: Linux turns PV spinlocks off when `num_possible_cpus() == 1`, and PV TLB flush,
//! sched-yield and send-IPI need more than one CPU. The defaults still advertise them: the guest
//! counts *possible* CPUs (hotpluggable ones included, which the VMM may add later), and an
//! unused bit costs nothing.
//!
//! Hosts whose KVM emulates every guest instruction (the development machines,
//! `docs/kvm-here.md`) never complete a hypercall: a stock Linux guest that was
//! offered `PV_UNHALT` would livelock on its first `KVM_HC_KICK_CPU` there. [`HostCaps`] cannot
//! see that without running a guest; a VMM for such hosts should request `pv_features`
//! without `PV_UNHALT`, `PV_SCHED_YIELD` and `PV_SEND_IPI` explicitly.
//!
//! A default the host does not support is dropped and recorded in [`Plan::dropped`]; an explicit
//! request ([`PlanRequest`] override) the host does not support is refused.
//!
//! # The CPUID edit ([`edit_cpuid`])
//!
//! The managed EAX bits are set as planned and EDX gets the hints; everything else the VMM put
//! in its CPUID stays. When the VMM's CPUID has no hypervisor leaves, the KVM signature and
//! feature leaves are added with the host's supported EAX (kvmclock, PV EOI, async PF, ...) for
//! the unmanaged bits, as `KVM_GET_SUPPORTED_CPUID` would have given them. The hypervisor bit
//! CPUID.1:ECX\[31\], without which Linux never looks for the KVM leaves (`kvm_cpuid_base`), is
//! required: a CPUID with it clear hides the hypervisor on purpose, and the plan is refused
//! unless [`PlanRequest::add_kvm_leaves`] is `Some(true)` (then the bit is set). With
//! `Some(false)` missing KVM leaves are refused rather than added.
//!
//! # Rules ([`PlanError`]), their sources, and what depends on a kernel version
//!
//! * `PV_UNHALT` together with HLT exits disabled is refused (KVM `api.rst`,
//!   `KVM_CAP_X86_DISABLE_EXITS`; host KVM
//!   strips the bit anyway, `cpuid.c`).
//! * `PV_UNHALT` without an in-kernel LAPIC is refused (QEMU `kvm_arch_get_supported_cpuid`;
//!   KVM `kvm_pv_kick_cpu_op` delivers to the in-kernel LAPIC only; Linux `kvm_wait` halts with
//!   interrupts off).
//! * `KVM_HINTS_REALTIME` without `PV_UNHALT` is refused unless the guest is declared
//!   [`GuestKernel::Modern`] (guest-version rule: Linux `kvm_spinlock_init` from 5.9 up to
//!   960550503965).
//! * `KVM_HINTS_REALTIME` without dedicated placement is refused (its meaning is "vCPUs are never
//!   preempted for an unlimited time", `Documentation/virt/kvm/x86/cpuid.rst`).
//! * Disabling HLT, PAUSE or CSTATE exits without dedicated placement is refused: a vCPU that
//!   does not exit on them keeps its host CPU while idle or spinning.
//! * `PV_TLB_FLUSH` or `PV_SCHED_YIELD` without `STEAL_TIME` is refused (the guest never uses
//!   them then: `pv_tlb_flush_supported`, `pv_sched_yield_supported`).
//! * A feature bit, exit flag, halt-poll setting, PV enforcement or quirk the host does not
//!   support is refused, the quirks the VMM says it disabled included.
//! * `dedicated` or `shared` placement with more vCPUs than host CPUs (when
//!   [`PlanRequest::host_cpus`] is given) is refused: that is overcommitted.
//! * Exit flags after vCPUs exist are refused (host-version rule: KVM refuses them once a vCPU
//!   exists since "KVM: x86: only allow exits disable before vCPUs created", 2023, Cc: stable;
//!   older hosts accepted them and applied them only to vCPUs created afterwards).
//! * A CPUID that hides the hypervisor (CPUID.1:ECX\[31\] clear), or lacks the KVM leaves with
//!   `add_kvm_leaves = Some(false)`, or has only foreign hypervisor leaves, is refused.
//! * The quirk mask pvspin writes includes [`PlanRequest::vmm_disabled_quirks`] (host-version
//!   rule: `KVM_CAP_DISABLE_QUIRKS2` replaced the mask before 9966b7822b3f, see
//!   [`crate::quirks`]).

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_enable_cap, CpuId, KVM_CAP_ENFORCE_PV_FEATURE_CPUID, KVM_CAP_HALT_POLL,
    KVM_CAP_X86_DISABLE_EXITS, KVM_MAX_CPUID_ENTRIES, KVM_X86_DISABLE_EXITS_CSTATE,
    KVM_X86_DISABLE_EXITS_HLT, KVM_X86_DISABLE_EXITS_MWAIT, KVM_X86_DISABLE_EXITS_PAUSE,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::Serialize;
use std::fmt;

pub use crate::guest::GuestKernel;
use crate::quirks;

/// `KVM_CPUID_SIGNATURE`: the first hypervisor leaf.
pub const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
/// `KVM_CPUID_FEATURES`: the KVM feature leaf (EAX features, EDX hints).
pub const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
/// EBX, ECX, EDX of the signature leaf: `"KVMKVMKVM\0\0\0"`.
pub const KVM_SIGNATURE: [u32; 3] = [0x4b4d_564b, 0x564b_4d56, 0x0000_004d];

/// Where the guest's vCPU threads run on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Each vCPU thread pinned to its own host CPU, nothing else runs there.
    Dedicated,
    /// vCPU threads float over host CPUs that other work shares; at most one vCPU per host CPU.
    Shared,
    /// More runnable vCPUs than host CPUs: vCPUs are preempted, lock holders included.
    Overcommitted,
}

impl Placement {
    /// All placements, for iteration in tests and CLIs.
    pub const ALL: [Placement; 3] = [
        Placement::Dedicated,
        Placement::Shared,
        Placement::Overcommitted,
    ];

    /// The lower-case name (`dedicated`, `shared`, `overcommitted`).
    pub fn name(self) -> &'static str {
        match self {
            Placement::Dedicated => "dedicated",
            Placement::Shared => "shared",
            Placement::Overcommitted => "overcommitted",
        }
    }
}

impl Placement {
    /// The placement implied by the counts: `dedicated` when the vCPU threads are pinned 1:1
    /// and fit, `shared` when they fit unpinned, `overcommitted` otherwise.
    pub fn infer(vcpus: u32, host_cpus: u32, pinned: bool) -> Placement {
        if vcpus > host_cpus {
            Placement::Overcommitted
        } else if pinned {
            Placement::Dedicated
        } else {
            Placement::Shared
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Placement {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| PlanError::UnknownPlacement(s.to_owned()))
    }
}

/// A set of `KVM_FEATURE_*` bits (EAX of CPUID `0x40000001`). The set operations
/// (`contains`, `union`, `difference`, `|`, ...) are bitflags'; bits outside the six named ones
/// are kept (`from_bits_retain`), since other bits of the leaf pass through untouched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct PvFeatures(pub u32);

bitflags::bitflags! {
    impl PvFeatures: u32 {
        /// `KVM_FEATURE_STEAL_TIME` (bit 5).
        const STEAL_TIME = 1 << 5;
        /// `KVM_FEATURE_PV_UNHALT` (bit 7): the guest enables PV spinlocks only with it.
        const PV_UNHALT = 1 << 7;
        /// `KVM_FEATURE_PV_TLB_FLUSH` (bit 9).
        const PV_TLB_FLUSH = 1 << 9;
        /// `KVM_FEATURE_PV_SEND_IPI` (bit 11).
        const PV_SEND_IPI = 1 << 11;
        /// `KVM_FEATURE_POLL_CONTROL` (bit 12).
        const POLL_CONTROL = 1 << 12;
        /// `KVM_FEATURE_PV_SCHED_YIELD` (bit 13).
        const PV_SCHED_YIELD = 1 << 13;
    }
}

impl PvFeatures {
    /// The six bits this plan manages; other bits of the leaf pass through untouched.
    pub const MANAGED: PvFeatures = PvFeatures::all();
    /// No bits.
    pub const NONE: PvFeatures = PvFeatures::empty();

    /// The names of the managed bits set, in bit order.
    pub fn names(self) -> Vec<&'static str> {
        self.iter_names().map(|(name, _)| name).collect()
    }
}

impl fmt::Display for PvFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = self.names();
        if names.is_empty() {
            write!(f, "none")
        } else {
            write!(f, "{}", names.join("|"))
        }
    }
}

/// A set of `KVM_X86_DISABLE_EXITS_*` flags (bitflags' set operations; unknown bits kept).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct ExitFlags(pub u32);

bitflags::bitflags! {
    impl ExitFlags: u32 {
        /// `KVM_X86_DISABLE_EXITS_MWAIT`.
        const MWAIT = KVM_X86_DISABLE_EXITS_MWAIT;
        /// `KVM_X86_DISABLE_EXITS_HLT`.
        const HLT = KVM_X86_DISABLE_EXITS_HLT;
        /// `KVM_X86_DISABLE_EXITS_PAUSE`.
        const PAUSE = KVM_X86_DISABLE_EXITS_PAUSE;
        /// `KVM_X86_DISABLE_EXITS_CSTATE`.
        const CSTATE = KVM_X86_DISABLE_EXITS_CSTATE;
    }
}

impl ExitFlags {
    /// No flags: every exit stays enabled.
    pub const NONE: ExitFlags = ExitFlags::empty();
}

impl fmt::Display for ExitFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.iter_names().map(|(name, _)| name).collect();
        let unknown = self.0 & !Self::all().0;
        if unknown != 0 {
            return write!(f, "{}{:#x}", names.join("|") + "|", unknown);
        }
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join("|"))
        }
    }
}

/// What the host KVM supports, as far as the plan is concerned. Built by hand in tests, probed
/// from a real VM with [`HostCaps::probe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HostCaps {
    /// EAX of CPUID `0x40000001` in `KVM_GET_SUPPORTED_CPUID` (0 if the leaf is absent).
    pub pv_features: PvFeatures,
    /// `KVM_CHECK_EXTENSION(KVM_CAP_X86_DISABLE_EXITS)`: the flags that can be disabled.
    pub disable_exits: ExitFlags,
    /// `KVM_CAP_HALT_POLL` is available (per-VM halt-poll limit).
    pub halt_poll: bool,
    /// `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` is available.
    pub enforce_pv_cpuid: bool,
    /// `KVM_CHECK_EXTENSION(KVM_CAP_DISABLE_QUIRKS2)`: the quirks that can be disabled.
    pub disableable_quirks: u64,
}

impl HostCaps {
    /// What the development machines report (the shared notes' kvm-on-these-machines.md,
    /// "Setup facts", "E6: PAUSE, disabling exits, PLE", "E7: binary stats"): EAX
    /// `0x01007efb`, exits `HLT|PAUSE|CSTATE`, halt poll, enforcement, quirks `0x5ff`.
    pub const DEVELOPMENT_HOST: HostCaps = HostCaps {
        pv_features: PvFeatures(0x0100_7efb),
        disable_exits: ExitFlags(0xe),
        halt_poll: true,
        enforce_pv_cpuid: true,
        disableable_quirks: 0x5ff,
    };

    /// Probes the host through `kvm` (supported CPUID) and `vm` (per-VM capabilities).
    pub fn probe(kvm: &Kvm, vm: &VmFd) -> Result<HostCaps, PlanError> {
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| PlanError::Kvm {
                op: "KVM_GET_SUPPORTED_CPUID",
                source,
            })?;
        let pv_features = find_kvm_leaf(cpuid.as_slice())
            .ok()
            .flatten()
            .map(|i| PvFeatures(cpuid.as_slice()[i].eax))
            .unwrap_or_default();
        let cap = |c: u32| vm.check_extension_raw(libc::c_ulong::from(c));
        Ok(HostCaps {
            pv_features,
            disable_exits: ExitFlags(u32::try_from(cap(KVM_CAP_X86_DISABLE_EXITS)).unwrap_or(0)),
            halt_poll: cap(KVM_CAP_HALT_POLL) > 0,
            enforce_pv_cpuid: cap(KVM_CAP_ENFORCE_PV_FEATURE_CPUID) > 0,
            disableable_quirks: quirks::disableable_quirks(vm),
        })
    }
}

/// The halt-poll setting of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HaltPoll {
    /// Leave KVM's module default (`halt_poll_ns`) in force; no ioctl.
    KvmDefault,
    /// Set the VM's maximum halt-poll time to this many ns (`KVM_CAP_HALT_POLL`; 0 = no polling).
    MaxNs(u32),
}

/// What the VMM asks for: a placement, and optional overrides of the placement's defaults.
/// `None` means "the placement default, minus what the host lacks"; `Some` is explicit and is
/// refused if the host lacks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRequest {
    /// Where the vCPUs run.
    pub placement: Placement,
    /// Number of vCPUs (at least 1).
    pub vcpus: u32,
    /// The managed PV feature bits to advertise (bits outside [`PvFeatures::MANAGED`] are refused).
    pub pv_features: Option<PvFeatures>,
    /// Advertise `KVM_HINTS_REALTIME`.
    pub realtime: Option<bool>,
    /// Exits to disable.
    pub disable_exits: Option<ExitFlags>,
    /// Halt-poll limit.
    pub halt_poll: Option<HaltPoll>,
    /// Enable `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` on every vCPU.
    pub enforce_pv_cpuid: Option<bool>,
    /// Disable the `FIX_HYPERCALL_INSN` quirk (`Some(false)` for guests that live-migrate
    /// between Intel and AMD hosts, see [`crate::quirks`]).
    pub disable_fix_hypercall_quirk: Option<bool>,
    /// Host CPUs available to this VM, if known: checks that the placement fits.
    pub host_cpus: Option<u32>,
    /// Which Linux guest kernels the plan must be right for (default [`GuestKernel::Unknown`]:
    /// all of them, at the cost of keeping HLT exits on dedicated vCPUs).
    pub guest_kernel: GuestKernel,
    /// Whether the VM has an in-kernel LAPIC (`KVM_CREATE_IRQCHIP` or a split irqchip) before
    /// the vCPU stage, which `PV_UNHALT` needs. `None`: [`apply_vcpu`] asks each vCPU.
    pub lapic_in_kernel: Option<bool>,
    /// Quirks the VMM disabled on this VM (`KVM_CAP_DISABLE_QUIRKS2`) before the VM stage:
    /// written again together with pvspin's, so that hosts that replace the mask keep them.
    pub vmm_disabled_quirks: u64,
    /// When the VMM's CPUID has no KVM leaves: `None` adds them unless the VMM hides the
    /// hypervisor (CPUID.1:ECX\[31\] clear, refused); `Some(true)` adds them and sets the
    /// hypervisor bit; `Some(false)` never adds them (refused).
    pub add_kvm_leaves: Option<bool>,
}

impl PlanRequest {
    /// A request with every setting at the placement's default, for any guest kernel.
    pub fn new(placement: Placement, vcpus: u32) -> PlanRequest {
        PlanRequest {
            placement,
            vcpus,
            pv_features: None,
            realtime: None,
            disable_exits: None,
            halt_poll: None,
            enforce_pv_cpuid: None,
            disable_fix_hypercall_quirk: None,
            host_cpus: None,
            guest_kernel: GuestKernel::Unknown,
            lapic_in_kernel: None,
            vmm_disabled_quirks: 0,
            add_kvm_leaves: None,
        }
    }
}

/// The defaults of one placement (before intersecting with the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacementDefaults {
    /// PV feature bits (for dedicated placement `PV_UNHALT` is added when HLT exits stay on).
    pub pv_features: PvFeatures,
    /// `KVM_HINTS_REALTIME`.
    pub realtime: bool,
    /// Exits to disable.
    pub disable_exits: ExitFlags,
    /// Halt-poll limit.
    pub halt_poll: HaltPoll,
    /// PV CPUID enforcement.
    pub enforce_pv_cpuid: bool,
    /// Disable `FIX_HYPERCALL_INSN`.
    pub disable_fix_hypercall_quirk: bool,
}

impl PlacementDefaults {
    /// The defaults for `placement` with any guest kernel (the table in the module docs).
    pub fn for_placement(placement: Placement) -> PlacementDefaults {
        Self::for_guest(placement, GuestKernel::Unknown)
    }

    /// The defaults for `placement` and guests of family `guest`.
    pub fn for_guest(placement: Placement, guest: GuestKernel) -> PlacementDefaults {
        let shared = PvFeatures::MANAGED.difference(PvFeatures::POLL_CONTROL);
        match placement {
            Placement::Dedicated => PlacementDefaults {
                pv_features: PvFeatures::STEAL_TIME
                    .union(PvFeatures::PV_SEND_IPI)
                    .union(PvFeatures::POLL_CONTROL),
                realtime: true,
                disable_exits: if guest.realtime_needs_pv_unhalt() {
                    ExitFlags::PAUSE
                } else {
                    ExitFlags(ExitFlags::HLT.0 | ExitFlags::PAUSE.0)
                },
                halt_poll: HaltPoll::KvmDefault,
                enforce_pv_cpuid: true,
                disable_fix_hypercall_quirk: true,
            },
            Placement::Shared => PlacementDefaults {
                pv_features: shared,
                realtime: false,
                disable_exits: ExitFlags::NONE,
                halt_poll: HaltPoll::KvmDefault,
                enforce_pv_cpuid: true,
                disable_fix_hypercall_quirk: true,
            },
            Placement::Overcommitted => PlacementDefaults {
                pv_features: shared,
                realtime: false,
                disable_exits: ExitFlags::NONE,
                halt_poll: HaltPoll::MaxNs(0),
                enforce_pv_cpuid: true,
                disable_fix_hypercall_quirk: true,
            },
        }
    }
}

/// A validated plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Where the vCPUs run.
    pub placement: Placement,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// The managed PV feature bits the guest will see (the others pass through).
    pub pv_features: PvFeatures,
    /// `KVM_HINTS_REALTIME` in EDX.
    pub realtime: bool,
    /// Exits to disable (empty: no ioctl).
    pub disable_exits: ExitFlags,
    /// Halt-poll limit.
    pub halt_poll: HaltPoll,
    /// Enable `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` on each vCPU.
    pub enforce_pv_cpuid: bool,
    /// Disable the `FIX_HYPERCALL_INSN` quirk.
    pub disable_fix_hypercall_quirk: bool,
    /// The guest kernels the plan is right for.
    pub guest_kernel: GuestKernel,
    /// Whether the VM has an in-kernel LAPIC (`None`: asked per vCPU at the vCPU stage).
    pub lapic_in_kernel: Option<bool>,
    /// `PV_UNHALT` (and the other features) were requested explicitly, not defaults.
    pub pv_features_explicit: bool,
    /// Quirks the VMM disabled before the VM stage (kept in the mask pvspin writes).
    pub vmm_disabled_quirks: u64,
    /// The host's supported KVM feature EAX: the unmanaged bits of KVM leaves pvspin adds.
    pub host_kvm_eax: u32,
    /// [`PlanRequest::add_kvm_leaves`].
    pub add_kvm_leaves: Option<bool>,
    /// Defaults dropped because the host (or the VM) lacks them, one line each.
    pub dropped: Vec<String>,
}

/// Errors of planning and of applying a plan; invalid configurations name the rule broken.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub enum PlanError {
    /// unknown placement {0:?} (expected dedicated, shared or overcommitted)
    UnknownPlacement(
        /// The placement as the user typed it: it matched no known name, so no type holds it.
        String,
    ),
    /// rule: a VM needs at least one vCPU
    NoVcpus,
    /// rule: {placement} placement needs at most one vCPU per host CPU ({vcpus} vCPUs, {host_cpus}
    /// host CPUs); use overcommitted
    PlacementDoesNotFit {
        /// The placement.
        placement: Placement,
        /// vCPUs.
        vcpus: u32,
        /// Host CPUs.
        host_cpus: u32,
    },
    /// rule: only the managed PV feature bits may be requested ({managed}); got {requested:#x}
    UnmanagedFeature {
        /// The bits requested.
        requested: u32,
        /// The managed set.
        managed: PvFeatures,
    },
    /// rule: PV_UNHALT must not be advertised with HLT exits disabled (a HLT that never exits
    /// cannot be woken by a kick; KVM api.rst 7.13)
    PvUnhaltWithHltExitsDisabled,
    /// rule: PV_UNHALT needs an in-kernel LAPIC (KVM_CREATE_IRQCHIP or a split irqchip): KVM
    /// delivers KVM_HC_KICK_CPU to the in-kernel LAPIC only, and the guest's kvm_wait halts with
    /// interrupts off, so a lost kick hangs it (QEMU strips PV_UNHALT without one too)
    PvUnhaltNeedsInKernelLapic,
    /// rule: KVM_HINTS_REALTIME without PV_UNHALT gives Linux guests from 5.9 (the
    /// kvm_spinlock_init reorder) up to commit 960550503965 (guest kernel {guest_kernel}) the
    /// unfair test-and-set lock: kvm_spinlock_init returns on the missing PV_UNHALT before it
    /// honours REALTIME; advertise PV_UNHALT (it needs HLT exits enabled and an in-kernel
    /// LAPIC{why}) or declare GuestKernel::Modern
    RealtimeWithoutPvUnhalt {
        /// The declared guest family.
        guest_kernel: GuestKernel,
        /// Why `PV_UNHALT` is missing, if known.
        why: PvUnhaltMissing,
    },
    /// rule: KVM_HINTS_REALTIME requires dedicated placement (it promises vCPUs are never preempted
    /// for long); placement is {placement}
    RealtimeRequiresDedicated {
        /// The placement.
        placement: Placement,
    },
    /// rule: disabling {flags} exits requires dedicated placement (the vCPU would keep its host CPU
    /// while idle or spinning); placement is {placement}
    ExitsRequireDedicated {
        /// The flags.
        flags: ExitFlags,
        /// The placement.
        placement: Placement,
    },
    /// rule: {feature} requires STEAL_TIME (the guest uses it only with steal time)
    NeedsStealTime {
        /// The feature that needs steal time.
        feature: PvFeatures,
    },
    /// rule: host does not support PV feature(s) {missing} (supported 0x40000001.eax =
    /// {supported:#x})
    FeatureUnsupported {
        /// The unsupported bits.
        missing: PvFeatures,
        /// The host's supported EAX.
        supported: u32,
    },
    /// rule: host cannot disable exits {requested} (KVM_CAP_X86_DISABLE_EXITS = {supported})
    ExitFlagsUnsupported {
        /// The requested flags.
        requested: ExitFlags,
        /// The host's mask.
        supported: ExitFlags,
    },
    /// rule: host does not support a per-VM halt-poll limit (no KVM_CAP_HALT_POLL)
    HaltPollUnsupported,
    /// rule: host does not support KVM_CAP_ENFORCE_PV_FEATURE_CPUID
    EnforceUnsupported,
    /// rule: host cannot disable quirk(s) {quirks:#x} (KVM_CAP_DISABLE_QUIRKS2 = {supported:#x})
    QuirkUnsupported {
        /// The quirks that cannot be disabled.
        quirks: u64,
        /// The host's mask.
        supported: u64,
    },
    /// rule: KVM_CAP_X86_DISABLE_EXITS must be enabled before any vCPU is created ({vcpus_created}
    /// exist)
    ExitsAfterVcpus {
        /// How many vCPUs the caller said exist (at least 1).
        vcpus_created: u32,
    },
    /// rule: KVM_CAP_X86_DISABLE_EXITS must be enabled before any vCPU is created (KVM refused it:
    /// the VM already has vCPUs)
    ExitsAfterUnknownVcpus,
    /// rule: the vCPU stage must run before the vCPU's first KVM_RUN (KVM_SET_CPUID2: {source})
    CpuidAfterRun {
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// rule: the CPUID has hypervisor leaves but no KVM signature at 0x40000000 + n*0x100; pvspin
    /// does not place KVM leaves next to a foreign hypervisor's
    NoKvmLeaf,
    /// rule: the CPUID has no KVM leaves and add_kvm_leaves is Some(false): a paravirt plan needs
    /// them
    KvmLeavesMissing,
    /// rule: the VMM's CPUID hides the hypervisor (CPUID.1:ECX bit 31 clear), so Linux never
    /// reads the KVM leaves (kvm_cpuid_base); pvspin does not undo that unless add_kvm_leaves is
    /// Some(true)
    HypervisorHidden,
    /// CPUID is full ({0} entries); cannot add the KVM leaves
    CpuidFull(usize),
    /// {op} failed: {source}
    Kvm {
        /// The operation.
        op: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// {0}
    ///
    /// Disabling the quirk failed.
    Quirk(#[from] quirks::QuirkError),
}

/// Why a plan with `KVM_HINTS_REALTIME` lacks `PV_UNHALT`
/// ([`PlanError::RealtimeWithoutPvUnhalt`]); its text ends that error's message, so it starts
/// with "; " (or is empty).
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum PvUnhaltMissing {
    /// HLT exits are disabled.
    #[displaydoc("; HLT exits are disabled")]
    HltExitsDisabled,
    /// The VM has no in-kernel LAPIC.
    #[displaydoc("; the VM has no in-kernel LAPIC")]
    NoInKernelLapic,
    /// The host does not offer `PV_UNHALT`.
    #[displaydoc("; the host does not offer PV_UNHALT")]
    HostLacksIt,
    /// The request left it out while nothing prevents it.
    #[displaydoc("")]
    NotRequested,
}

impl Plan {
    /// Computes and validates the plan for `req` on a host with `host`.
    pub fn new(req: &PlanRequest, host: &HostCaps) -> Result<Plan, PlanError> {
        if req.vcpus == 0 {
            return Err(PlanError::NoVcpus);
        }
        if let Some(host_cpus) = req.host_cpus {
            if req.placement != Placement::Overcommitted && req.vcpus > host_cpus {
                return Err(PlanError::PlacementDoesNotFit {
                    placement: req.placement,
                    vcpus: req.vcpus,
                    host_cpus,
                });
            }
        }
        let d = PlacementDefaults::for_guest(req.placement, req.guest_kernel);
        let mut dropped = Vec::new();

        // Exits first: PV_UNHALT's default depends on them.
        let disable_exits = match req.disable_exits {
            Some(flags) => {
                if flags.0 & !host.disable_exits.0 != 0 {
                    return Err(PlanError::ExitFlagsUnsupported {
                        requested: flags,
                        supported: host.disable_exits,
                    });
                }
                flags
            }
            None => {
                let kept = ExitFlags(d.disable_exits.0 & host.disable_exits.0);
                if kept != d.disable_exits {
                    dropped.push(format!(
                        "disable exits {}: host supports only {}",
                        ExitFlags(d.disable_exits.0 & !kept.0),
                        host.disable_exits
                    ));
                }
                kept
            }
        };
        if !disable_exits.is_empty() && req.placement != Placement::Dedicated {
            return Err(PlanError::ExitsRequireDedicated {
                flags: disable_exits,
                placement: req.placement,
            });
        }

        let hlt_off = disable_exits.contains(ExitFlags::HLT);
        let pv_features = match req.pv_features {
            Some(f) => {
                if !PvFeatures::MANAGED.contains(f) {
                    return Err(PlanError::UnmanagedFeature {
                        requested: f.0,
                        managed: PvFeatures::MANAGED,
                    });
                }
                let missing = f.difference(host.pv_features);
                if !missing.is_empty() {
                    return Err(PlanError::FeatureUnsupported {
                        missing,
                        supported: host.pv_features.0,
                    });
                }
                if f.contains(PvFeatures::PV_UNHALT) && req.lapic_in_kernel == Some(false) {
                    return Err(PlanError::PvUnhaltNeedsInKernelLapic);
                }
                f
            }
            None => {
                let mut f = d.pv_features;
                // Dedicated: PV_UNHALT exactly when HLT exits stay on.
                if req.placement == Placement::Dedicated && !hlt_off {
                    f = f.union(PvFeatures::PV_UNHALT);
                }
                if hlt_off && f.contains(PvFeatures::PV_UNHALT) {
                    f = f.difference(PvFeatures::PV_UNHALT);
                    dropped.push("PV_UNHALT: HLT exits are disabled".to_owned());
                }
                if req.lapic_in_kernel == Some(false) && f.contains(PvFeatures::PV_UNHALT) {
                    f = f.difference(PvFeatures::PV_UNHALT);
                    dropped.push("PV_UNHALT: the VM has no in-kernel LAPIC".to_owned());
                }
                let missing = f.difference(host.pv_features);
                if !missing.is_empty() {
                    dropped.push(format!("PV features {missing}: host does not support them"));
                }
                let mut f = f.intersection(host.pv_features);
                if !f.contains(PvFeatures::STEAL_TIME) {
                    let needs = PvFeatures::PV_TLB_FLUSH.union(PvFeatures::PV_SCHED_YIELD);
                    if f.intersects(needs) {
                        dropped.push(format!(
                            "PV features {}: STEAL_TIME is not available",
                            f.intersection(needs)
                        ));
                        f = f.difference(needs);
                    }
                }
                f
            }
        };
        if pv_features.contains(PvFeatures::PV_UNHALT) && hlt_off {
            return Err(PlanError::PvUnhaltWithHltExitsDisabled);
        }
        if !pv_features.contains(PvFeatures::STEAL_TIME) {
            for feature in [PvFeatures::PV_TLB_FLUSH, PvFeatures::PV_SCHED_YIELD] {
                if pv_features.contains(feature) {
                    return Err(PlanError::NeedsStealTime { feature });
                }
            }
        }

        let realtime = req.realtime.unwrap_or(d.realtime);
        if realtime && req.placement != Placement::Dedicated {
            return Err(PlanError::RealtimeRequiresDedicated {
                placement: req.placement,
            });
        }
        if realtime
            && !pv_features.contains(PvFeatures::PV_UNHALT)
            && req.guest_kernel.realtime_needs_pv_unhalt()
        {
            let why = if hlt_off {
                PvUnhaltMissing::HltExitsDisabled
            } else if req.lapic_in_kernel == Some(false) {
                PvUnhaltMissing::NoInKernelLapic
            } else if !host.pv_features.contains(PvFeatures::PV_UNHALT) {
                PvUnhaltMissing::HostLacksIt
            } else {
                PvUnhaltMissing::NotRequested
            };
            return Err(PlanError::RealtimeWithoutPvUnhalt {
                guest_kernel: req.guest_kernel,
                why,
            });
        }

        let halt_poll = match req.halt_poll {
            Some(HaltPoll::MaxNs(_)) if !host.halt_poll => {
                return Err(PlanError::HaltPollUnsupported)
            }
            Some(h) => h,
            None => match d.halt_poll {
                HaltPoll::MaxNs(ns) if !host.halt_poll => {
                    dropped.push(format!(
                        "halt-poll limit {ns} ns: host has no KVM_CAP_HALT_POLL"
                    ));
                    HaltPoll::KvmDefault
                }
                h => h,
            },
        };

        let enforce_pv_cpuid = match req.enforce_pv_cpuid {
            Some(true) if !host.enforce_pv_cpuid => return Err(PlanError::EnforceUnsupported),
            Some(e) => e,
            None => {
                if d.enforce_pv_cpuid && !host.enforce_pv_cpuid {
                    dropped.push("ENFORCE_PV_FEATURE_CPUID: host does not support it".to_owned());
                }
                d.enforce_pv_cpuid && host.enforce_pv_cpuid
            }
        };

        let unsupported_vmm = req.vmm_disabled_quirks & !host.disableable_quirks;
        if unsupported_vmm != 0 {
            return Err(PlanError::QuirkUnsupported {
                quirks: unsupported_vmm,
                supported: host.disableable_quirks,
            });
        }
        let quirk = quirks::FIX_HYPERCALL_INSN;
        let quirk_ok = host.disableable_quirks & quirk == quirk;
        let disable_fix_hypercall_quirk = match req.disable_fix_hypercall_quirk {
            Some(true) if !quirk_ok => {
                return Err(PlanError::QuirkUnsupported {
                    quirks: quirk,
                    supported: host.disableable_quirks,
                })
            }
            Some(q) => q,
            None => {
                if d.disable_fix_hypercall_quirk && !quirk_ok {
                    dropped.push(
                        "disable FIX_HYPERCALL_INSN quirk: host cannot disable it".to_owned(),
                    );
                }
                d.disable_fix_hypercall_quirk && quirk_ok
            }
        };

        Ok(Plan {
            placement: req.placement,
            vcpus: req.vcpus,
            pv_features,
            realtime,
            disable_exits,
            halt_poll,
            enforce_pv_cpuid,
            disable_fix_hypercall_quirk,
            guest_kernel: req.guest_kernel,
            lapic_in_kernel: req.lapic_in_kernel,
            pv_features_explicit: req.pv_features.is_some(),
            vmm_disabled_quirks: req.vmm_disabled_quirks,
            host_kvm_eax: host.pv_features.0,
            add_kvm_leaves: req.add_kvm_leaves,
            dropped,
        })
    }

    /// The plan for a VM whose in-kernel LAPIC is now known (`lapic_in_kernel`): without one,
    /// a default `PV_UNHALT` is dropped (recorded in [`Plan::dropped`]), an explicit one is
    /// refused, and so is `REALTIME` without `PV_UNHALT` for guests that may be legacy.
    pub fn for_lapic(&self, lapic_in_kernel: bool) -> Result<Plan, PlanError> {
        let mut plan = self.clone();
        plan.lapic_in_kernel = Some(lapic_in_kernel);
        if lapic_in_kernel || !plan.pv_features.contains(PvFeatures::PV_UNHALT) {
            return Ok(plan);
        }
        if plan.pv_features_explicit {
            return Err(PlanError::PvUnhaltNeedsInKernelLapic);
        }
        if plan.realtime && plan.guest_kernel.realtime_needs_pv_unhalt() {
            return Err(PlanError::RealtimeWithoutPvUnhalt {
                guest_kernel: plan.guest_kernel,
                why: PvUnhaltMissing::NoInKernelLapic,
            });
        }
        plan.pv_features = plan.pv_features.difference(PvFeatures::PV_UNHALT);
        plan.dropped
            .push("PV_UNHALT: the VM has no in-kernel LAPIC".to_owned());
        Ok(plan)
    }

    /// The quirk mask the VM stage writes with `KVM_CAP_DISABLE_QUIRKS2` (the VMM's quirks and
    /// pvspin's), or 0 when pvspin disables nothing (then it makes no call).
    pub fn quirks_to_write(&self) -> u64 {
        if self.disable_fix_hypercall_quirk {
            quirks::mask_to_write(self.vmm_disabled_quirks, quirks::FIX_HYPERCALL_INSN)
        } else {
            0
        }
    }

    /// EDX of CPUID `0x40000001` the guest sees (`KVM_HINTS_REALTIME` = bit 0).
    pub fn hints_edx(&self) -> u32 {
        u32::from(self.realtime)
    }

    /// EAX of CPUID `0x40000001` the guest sees, given the base value: the managed bits as
    /// planned, the others as in `base_eax`.
    pub fn features_eax(&self, base_eax: u32) -> u32 {
        (base_eax & !PvFeatures::MANAGED.0) | self.pv_features.0
    }

    /// The VM-stage check alone: refuses exit flags once vCPUs exist. [`apply_vm`] calls
    /// this; a VMM that tracks its vCPUs can call it earlier.
    pub fn check_vm_stage(&self, vcpus_created: u32) -> Result<(), PlanError> {
        if !self.disable_exits.is_empty() && vcpus_created > 0 {
            return Err(PlanError::ExitsAfterVcpus { vcpus_created });
        }
        Ok(())
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "placement: {} ({} vCPUs), guest kernel {}",
            self.placement, self.vcpus, self.guest_kernel
        )?;
        writeln!(
            f,
            "cpuid 0x40000001: managed eax bits {} ({:#x}), edx {:#x}{}",
            self.pv_features,
            self.pv_features.0,
            self.hints_edx(),
            if self.realtime { " (REALTIME)" } else { "" }
        )?;
        writeln!(f, "disable exits: {}", self.disable_exits)?;
        match self.halt_poll {
            HaltPoll::KvmDefault => writeln!(f, "halt poll: KVM default")?,
            HaltPoll::MaxNs(ns) => writeln!(f, "halt poll: max {ns} ns")?,
        }
        writeln!(f, "enforce PV feature CPUID: {}", self.enforce_pv_cpuid)?;
        write!(
            f,
            "FIX_HYPERCALL_INSN quirk disabled: {}",
            self.disable_fix_hypercall_quirk
        )?;
        if self.vmm_disabled_quirks != 0 {
            write!(f, " (with the VMM's {:#x})", self.vmm_disabled_quirks)?;
        }
        for d in &self.dropped {
            write!(f, "\ndropped default: {d}")?;
        }
        Ok(())
    }
}

/// Finds the KVM hypervisor base: the first `0x40000000 + n*0x100` whose leaf carries the KVM
/// signature. `Ok(None)`: no hypervisor leaves at all; `Err(NoKvmLeaf)`: only foreign ones.
fn find_kvm_base(entries: &[kvm_cpuid_entry2]) -> Result<Option<u32>, PlanError> {
    let mut any_hv = false;
    for n in 0..0x100u32 {
        let base = KVM_CPUID_SIGNATURE + n * 0x100;
        let Some(sig) = entries.iter().find(|e| e.function == base) else {
            continue;
        };
        any_hv = true;
        if [sig.ebx, sig.ecx, sig.edx] == KVM_SIGNATURE {
            return Ok(Some(base));
        }
    }
    if any_hv {
        Err(PlanError::NoKvmLeaf)
    } else {
        Ok(None)
    }
}

/// The index of the KVM feature leaf, if there is a KVM base and its feature leaf.
fn find_kvm_leaf(entries: &[kvm_cpuid_entry2]) -> Result<Option<usize>, PlanError> {
    Ok(find_kvm_base(entries)?.and_then(|b| entries.iter().position(|e| e.function == b + 1)))
}

/// CPUID.1:ECX\[31\], `X86_FEATURE_HYPERVISOR`.
pub const HYPERVISOR_BIT: u32 = 1 << 31;

/// What [`edit_cpuid`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CpuidEdit {
    /// The feature leaf's function number (`0x40000001` unless relocated).
    pub leaf: u32,
    /// EAX before.
    pub eax_before: u32,
    /// EAX after.
    pub eax: u32,
    /// EDX after.
    pub edx: u32,
    /// The KVM leaves (or the feature leaf alone) were missing and were added.
    pub added: bool,
    /// The hypervisor bit CPUID.1:ECX\[31\] was set by the edit (leaf 1 added if missing).
    pub hypervisor_bit_set: bool,
}

/// Edits `cpuid` per `plan` (pure): managed EAX bits of the KVM feature leaf as planned, other
/// EAX bits untouched, EDX = the plan's hints. Adds the signature and feature leaves at
/// `0x40000000` when the CPUID has no hypervisor leaves at all (unmanaged EAX bits from the
/// host's supported leaf), and the feature leaf when only the KVM signature is there; refuses
/// a CPUID whose hypervisor leaves are all foreign, one that hides the hypervisor
/// (CPUID.1:ECX\[31\] clear) unless `add_kvm_leaves` is `Some(true)`, and one without KVM
/// leaves when `add_kvm_leaves` is `Some(false)`.
pub fn edit_cpuid(plan: &Plan, cpuid: &mut CpuId) -> Result<CpuidEdit, PlanError> {
    let full = cpuid.as_slice().len();
    let force = plan.add_kvm_leaves == Some(true);
    let mut hypervisor_bit_set = false;
    match cpuid.as_slice().iter().position(|e| e.function == 1) {
        Some(i) => {
            let e = &mut cpuid.as_mut_slice()[i];
            if e.ecx & HYPERVISOR_BIT == 0 {
                if !force {
                    return Err(PlanError::HypervisorHidden);
                }
                e.ecx |= HYPERVISOR_BIT;
                hypervisor_bit_set = true;
            }
        }
        None => {
            // A hand-made CPUID without leaf 1: the guest would read zeros there.
            cpuid
                .push(kvm_cpuid_entry2 {
                    function: 1,
                    ecx: HYPERVISOR_BIT,
                    ..Default::default()
                })
                .map_err(|_| PlanError::CpuidFull(full))?;
            hypervisor_bit_set = true;
        }
    }
    let mut added = false;
    let base = match find_kvm_base(cpuid.as_slice())? {
        Some(base) => base,
        None => {
            if plan.add_kvm_leaves == Some(false) {
                return Err(PlanError::KvmLeavesMissing);
            }
            cpuid
                .push(kvm_cpuid_entry2 {
                    function: KVM_CPUID_SIGNATURE,
                    eax: KVM_CPUID_FEATURES,
                    ebx: KVM_SIGNATURE[0],
                    ecx: KVM_SIGNATURE[1],
                    edx: KVM_SIGNATURE[2],
                    ..Default::default()
                })
                .map_err(|_| PlanError::CpuidFull(full))?;
            added = true;
            KVM_CPUID_SIGNATURE
        }
    };
    let leaf = base + 1;
    if let Some(i) = cpuid.as_slice().iter().position(|e| e.function == leaf) {
        let e = &mut cpuid.as_mut_slice()[i];
        let eax_before = e.eax;
        e.eax = plan.features_eax(e.eax);
        e.edx = plan.hints_edx();
        return Ok(CpuidEdit {
            leaf,
            eax_before,
            eax: e.eax,
            edx: e.edx,
            added,
            hypervisor_bit_set,
        });
    }
    let entry = kvm_cpuid_entry2 {
        function: leaf,
        eax: plan.features_eax(plan.host_kvm_eax),
        edx: plan.hints_edx(),
        ..Default::default()
    };
    cpuid.push(entry).map_err(|_| PlanError::CpuidFull(full))?;
    Ok(CpuidEdit {
        leaf,
        eax_before: 0,
        eax: entry.eax,
        edx: entry.edx,
        added: true,
        hypervisor_bit_set,
    })
}

/// What [`apply_vm`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AppliedVm {
    /// `KVM_CAP_X86_DISABLE_EXITS` enabled with these flags (empty: not called).
    pub disable_exits: ExitFlags,
    /// `KVM_CAP_HALT_POLL` set to this many ns (`None`: not called, KVM default).
    pub halt_poll_ns: Option<u32>,
    /// `FIX_HYPERCALL_INSN` disabled.
    pub fix_hypercall_quirk_disabled: bool,
    /// The quirk mask written with `KVM_CAP_DISABLE_QUIRKS2` (0: no call). A VMM that disables
    /// quirks later must include it (hosts before 9966b7822b3f replace the mask).
    pub disabled_quirks: u64,
}

impl fmt::Display for AppliedVm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VM stage: FIX_HYPERCALL_INSN quirk ")?;
        f.write_str(if self.fix_hypercall_quirk_disabled {
            "disabled"
        } else {
            "left on"
        })?;
        if self.disabled_quirks != 0 {
            write!(f, " (quirk mask {:#x})", self.disabled_quirks)?;
        }
        write!(f, "; exits disabled: {}; halt poll: ", self.disable_exits)?;
        match self.halt_poll_ns {
            Some(ns) => write!(f, "max {ns} ns"),
            None => f.write_str("KVM default"),
        }
    }
}

impl fmt::Display for AppliedVcpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "vCPU stage: CPUID {:#x}.eax {:#x} -> {:#x} ({}), edx {:#x}{}{}; PV CPUID enforced: {}; in-kernel LAPIC: {}",
            self.cpuid.leaf,
            self.cpuid.eax_before,
            self.cpuid.eax,
            PvFeatures(self.cpuid.eax),
            self.cpuid.edx,
            if self.cpuid.added {
                " (leaf added)"
            } else {
                ""
            },
            if self.cpuid.hypervisor_bit_set {
                " (hypervisor bit set)"
            } else {
                ""
            },
            self.enforce_pv_cpuid,
            self.lapic_in_kernel
        )
    }
}

/// Whether `vm` has vCPUs already, asked of KVM without changing anything: enabling
/// `KVM_CAP_X86_DISABLE_EXITS` with no flags succeeds before the first `KVM_CREATE_VCPU` and is
/// refused (`EINVAL`) after it (KVM checks `kvm->created_vcpus`, since "KVM: x86: only allow
/// exits disable before vCPUs created", 2023). `None` where the host cannot tell (no
/// `KVM_CAP_X86_DISABLE_EXITS`, or another error). A host from before that change accepts the
/// call either way, so there this answers `Some(false)`: a check that can miss, never a false
/// alarm.
pub fn vcpus_exist(vm: &VmFd) -> Option<bool> {
    if vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_X86_DISABLE_EXITS)) <= 0 {
        return None;
    }
    let cap = kvm_enable_cap {
        cap: KVM_CAP_X86_DISABLE_EXITS,
        ..Default::default()
    };
    match vm.enable_cap(&cap) {
        Ok(()) => Some(false),
        Err(err) if err.errno() == libc::EINVAL => Some(true),
        Err(_) => None,
    }
}

/// What [`apply_vcpu`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AppliedVcpu {
    /// The CPUID edit that `KVM_SET_CPUID2` installed.
    pub cpuid: CpuidEdit,
    /// `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` enabled on this vCPU.
    pub enforce_pv_cpuid: bool,
    /// Whether the vCPU has an in-kernel LAPIC (as the plan said, or as `KVM_GET_LAPIC` found).
    pub lapic_in_kernel: bool,
}

/// The VM stage: call once, after `KVM_CREATE_VM` and **before the first `KVM_CREATE_VCPU`**
/// (`vcpus_created` must be 0 when the plan disables exits; KVM refuses the flags afterwards).
/// Order inside: quirks, disable exits, halt poll.
pub fn apply_vm(plan: &Plan, vm: &VmFd, vcpus_created: u32) -> Result<AppliedVm, PlanError> {
    plan.check_vm_stage(vcpus_created)?;
    let mut applied = AppliedVm {
        disable_exits: ExitFlags::NONE,
        halt_poll_ns: None,
        fix_hypercall_quirk_disabled: false,
        disabled_quirks: 0,
    };
    if plan.disable_fix_hypercall_quirk {
        applied.disabled_quirks =
            quirks::disable_quirks(vm, plan.vmm_disabled_quirks, quirks::FIX_HYPERCALL_INSN)?;
        applied.fix_hypercall_quirk_disabled = true;
    }
    if !plan.disable_exits.is_empty() {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_X86_DISABLE_EXITS,
            ..Default::default()
        };
        cap.args[0] = u64::from(plan.disable_exits.0);
        vm.enable_cap(&cap).map_err(|source| {
            // The flags were validated against the host's mask, so EINVAL here means vCPUs
            // exist already (KVM checks `kvm->created_vcpus`).
            if source.errno() == libc::EINVAL {
                match vcpus_created {
                    0 => PlanError::ExitsAfterUnknownVcpus,
                    vcpus_created => PlanError::ExitsAfterVcpus { vcpus_created },
                }
            } else {
                PlanError::Kvm {
                    op: "KVM_ENABLE_CAP(X86_DISABLE_EXITS)",
                    source,
                }
            }
        })?;
        applied.disable_exits = plan.disable_exits;
    }
    if let HaltPoll::MaxNs(ns) = plan.halt_poll {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_HALT_POLL,
            ..Default::default()
        };
        cap.args[0] = u64::from(ns);
        vm.enable_cap(&cap).map_err(|source| PlanError::Kvm {
            op: "KVM_ENABLE_CAP(HALT_POLL)",
            source,
        })?;
        applied.halt_poll_ns = Some(ns);
    }
    Ok(applied)
}

/// Whether `vcpu` has an in-kernel LAPIC: `KVM_GET_LAPIC` succeeds exactly then (KVM returns
/// EINVAL without one). One ioctl, at setup only.
pub fn vcpu_has_in_kernel_lapic(vcpu: &VcpuFd) -> bool {
    vcpu.get_lapic().is_ok()
}

/// The plan as it applies to `vcpu`: [`Plan::for_lapic`] with what `KVM_GET_LAPIC` says when
/// the plan does not know, the plan itself otherwise.
pub fn plan_for_vcpu(plan: &Plan, vcpu: &VcpuFd) -> Result<Plan, PlanError> {
    match plan.lapic_in_kernel {
        Some(_) => Ok(plan.clone()),
        None => plan.for_lapic(vcpu_has_in_kernel_lapic(vcpu)),
    }
}

/// The vCPU stage: call on each vCPU after [`apply_vm`] and **before the vCPU's first
/// `KVM_RUN`**. Resolves the plan for the vCPU's LAPIC ([`plan_for_vcpu`]), edits `cpuid` (the
/// VMM's CPUID for this vCPU, e.g. from `KVM_GET_SUPPORTED_CPUID` plus the VMM's own edits) per
/// the plan, installs it with `KVM_SET_CPUID2`, then enables `KVM_CAP_ENFORCE_PV_FEATURE_CPUID`.
pub fn apply_vcpu(plan: &Plan, vcpu: &VcpuFd, cpuid: &mut CpuId) -> Result<AppliedVcpu, PlanError> {
    let plan = plan_for_vcpu(plan, vcpu)?;
    let edit = edit_cpuid(&plan, cpuid)?;
    install_vcpu(&plan, vcpu, cpuid, edit)
}

/// `KVM_SET_CPUID2`, telling a CPUID refused because the vCPU has already run
/// ([`PlanError::CpuidAfterRun`]) from an invalid one.
pub fn set_cpuid(vcpu: &VcpuFd, cpuid: &CpuId) -> Result<(), PlanError> {
    vcpu.set_cpuid2(cpuid).map_err(|source| {
        // KVM refuses a changed CPUID once the vCPU has run (EINVAL on current kernels,
        // EBUSY on some). Tell that apart from an invalid CPUID by asking the vCPU's stats
        // whether it has ever exited (only on this error path).
        let ran = || {
            crate::stats::StatsFd::for_vcpu(vcpu)
                .and_then(|s| s.read())
                .ok()
                .and_then(|s| s.value("exits"))
                .is_some_and(|n| n > 0)
        };
        if source.errno() == libc::EBUSY || (source.errno() == libc::EINVAL && ran()) {
            PlanError::CpuidAfterRun { source }
        } else {
            PlanError::Kvm {
                op: "KVM_SET_CPUID2",
                source,
            }
        }
    })
}

/// The vCPU stage's last step for a VMM that sets the CPUID itself (after [`edit_cpuid`] and
/// its own `KVM_SET_CPUID2`): enables `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` when `plan` (resolved
/// by [`plan_for_vcpu`] or [`Plan::for_lapic`]) asks for it. Returns whether it did.
pub fn enforce_pv_cpuid(plan: &Plan, vcpu: &VcpuFd) -> Result<bool, PlanError> {
    if plan.enforce_pv_cpuid {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_ENFORCE_PV_FEATURE_CPUID,
            ..Default::default()
        };
        cap.args[0] = 1;
        vcpu.enable_cap(&cap).map_err(|source| PlanError::Kvm {
            op: "KVM_ENABLE_CAP(ENFORCE_PV_FEATURE_CPUID)",
            source,
        })?;
    }
    Ok(plan.enforce_pv_cpuid)
}

/// The second half of [`apply_vcpu`], for a VMM (or `pvspin`) that adds leaves of its own
/// between the edit and `KVM_SET_CPUID2`: installs `cpuid`, already edited by
/// [`edit_cpuid`] with `plan` as resolved by [`plan_for_vcpu`], and enables PV enforcement.
pub fn install_vcpu(
    plan: &Plan,
    vcpu: &VcpuFd,
    cpuid: &CpuId,
    edit: CpuidEdit,
) -> Result<AppliedVcpu, PlanError> {
    set_cpuid(vcpu, cpuid)?;
    enforce_pv_cpuid(plan, vcpu)?;
    Ok(AppliedVcpu {
        cpuid: edit,
        enforce_pv_cpuid: plan.enforce_pv_cpuid,
        lapic_in_kernel: plan.lapic_in_kernel.unwrap_or(false),
    })
}

/// Reads the KVM feature leaf (EAX, EDX) out of a CPUID, e.g. one read back with
/// `KVM_GET_CPUID2`. `None` if there is no KVM leaf.
pub fn kvm_leaf(cpuid: &CpuId) -> Option<(u32, u32)> {
    let i = find_kvm_leaf(cpuid.as_slice()).ok().flatten()?;
    let e = &cpuid.as_slice()[i];
    Some((e.eax, e.edx))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: HostCaps = HostCaps::DEVELOPMENT_HOST;

    fn plan(p: Placement) -> Plan {
        Plan::new(&PlanRequest::new(p, 4), &HOST).unwrap()
    }

    #[test]
    fn defaults_follow_the_placement_table() {
        // Any guest kernel: HLT exits stay on so that PV_UNHALT can sit next to REALTIME.
        let d = plan(Placement::Dedicated);
        assert!(d.realtime);
        assert_eq!(d.disable_exits, ExitFlags::PAUSE);
        assert!(d.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(d.pv_features.contains(PvFeatures::POLL_CONTROL));
        assert!(d.pv_features.contains(PvFeatures::STEAL_TIME));
        assert!(!d.pv_features.intersects(PvFeatures::PV_TLB_FLUSH));
        assert!(d.dropped.is_empty(), "{:?}", d.dropped);

        // Modern guests: HLT exits off too, no PV_UNHALT (and nothing recorded as dropped).
        let mut r = PlanRequest::new(Placement::Dedicated, 4);
        r.guest_kernel = GuestKernel::Modern;
        let m = Plan::new(&r, &HOST).unwrap();
        assert_eq!(
            m.disable_exits,
            ExitFlags(ExitFlags::HLT.0 | ExitFlags::PAUSE.0)
        );
        assert!(!m.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(m.pv_features.contains(PvFeatures::POLL_CONTROL));
        assert!(m.dropped.is_empty(), "{:?}", m.dropped);

        let s = plan(Placement::Shared);
        assert!(!s.realtime);
        assert!(s.disable_exits.is_empty());
        assert_eq!(
            s.pv_features,
            PvFeatures::MANAGED.difference(PvFeatures::POLL_CONTROL)
        );
        assert!(s.dropped.is_empty(), "{:?}", s.dropped);
        assert_eq!(s.halt_poll, HaltPoll::KvmDefault);

        let o = plan(Placement::Overcommitted);
        assert_eq!(o.halt_poll, HaltPoll::MaxNs(0));
        assert!(!o.pv_features.contains(PvFeatures::POLL_CONTROL));
        assert!(o.enforce_pv_cpuid && o.disable_fix_hypercall_quirk);
    }

    #[test]
    fn host_that_cannot_disable_hlt_exits_gets_pv_unhalt_on_dedicated() {
        // mitigate_smt_rsb: only PAUSE can be disabled; PV_UNHALT is valid again.
        let host = HostCaps {
            disable_exits: ExitFlags::PAUSE,
            ..HOST
        };
        let mut r = PlanRequest::new(Placement::Dedicated, 2);
        r.guest_kernel = GuestKernel::Modern;
        let p = Plan::new(&r, &host).unwrap();
        assert_eq!(p.disable_exits, ExitFlags::PAUSE);
        assert!(p.pv_features.contains(PvFeatures::PV_UNHALT));
        assert_eq!(p.dropped.len(), 1, "{:?}", p.dropped);
    }

    #[test]
    fn legacy_guests_need_pv_unhalt_next_to_realtime() {
        for guest in [GuestKernel::Unknown, GuestKernel::Legacy] {
            let mut r = PlanRequest::new(Placement::Dedicated, 2);
            r.guest_kernel = guest;
            r.disable_exits = Some(ExitFlags(ExitFlags::HLT.0 | ExitFlags::PAUSE.0));
            let e = Plan::new(&r, &HOST).unwrap_err();
            assert!(
                matches!(e, PlanError::RealtimeWithoutPvUnhalt { guest_kernel, .. } if guest_kernel == guest),
                "{e}"
            );
            let text = e.to_string();
            assert!(text.starts_with("rule: KVM_HINTS_REALTIME without PV_UNHALT"));
            assert!(text.contains("960550503965") && text.contains("HLT exits are disabled"));
            // Explicit features without PV_UNHALT: the same rule.
            let mut r = PlanRequest::new(Placement::Dedicated, 2);
            r.guest_kernel = guest;
            r.pv_features = Some(PvFeatures::STEAL_TIME);
            assert!(matches!(
                Plan::new(&r, &HOST).unwrap_err(),
                PlanError::RealtimeWithoutPvUnhalt { .. }
            ));
            // No in-kernel LAPIC: PV_UNHALT is impossible, so is REALTIME for these guests.
            let mut r = PlanRequest::new(Placement::Dedicated, 2);
            r.guest_kernel = guest;
            r.lapic_in_kernel = Some(false);
            let e = Plan::new(&r, &HOST).unwrap_err();
            assert!(e.to_string().contains("no in-kernel LAPIC"), "{e}");
            // Without REALTIME the rule does not apply.
            r.realtime = Some(false);
            let p = Plan::new(&r, &HOST).unwrap();
            assert!(!p.pv_features.contains(PvFeatures::PV_UNHALT));
        }
        let mut r = PlanRequest::new(Placement::Dedicated, 2);
        r.guest_kernel = GuestKernel::Modern;
        r.lapic_in_kernel = Some(false);
        assert!(Plan::new(&r, &HOST).is_ok());
        assert_eq!(
            "legacy".parse::<GuestKernel>().unwrap(),
            GuestKernel::Legacy
        );
    }

    #[test]
    fn pv_unhalt_needs_an_in_kernel_lapic() {
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.lapic_in_kernel = Some(false);
        let p = Plan::new(&r, &HOST).unwrap();
        assert!(!p.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(p.dropped.iter().any(|d| d.contains("in-kernel LAPIC")));
        r.pv_features = Some(PvFeatures::PV_UNHALT);
        let e = Plan::new(&r, &HOST).unwrap_err();
        assert!(matches!(e, PlanError::PvUnhaltNeedsInKernelLapic));
        assert!(e
            .to_string()
            .starts_with("rule: PV_UNHALT needs an in-kernel LAPIC"));

        // Decided at the vCPU stage when the request does not say.
        let shared = plan(Placement::Shared);
        assert_eq!(shared.lapic_in_kernel, None);
        assert_eq!(
            shared.for_lapic(true).unwrap().pv_features,
            shared.pv_features
        );
        let resolved = shared.for_lapic(false).unwrap();
        assert!(!resolved.pv_features.contains(PvFeatures::PV_UNHALT));
        assert_eq!(resolved.lapic_in_kernel, Some(false));
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.pv_features = Some(PvFeatures::PV_UNHALT);
        let explicit = Plan::new(&r, &HOST).unwrap();
        assert!(matches!(
            explicit.for_lapic(false).unwrap_err(),
            PlanError::PvUnhaltNeedsInKernelLapic
        ));
        assert!(matches!(
            plan(Placement::Dedicated).for_lapic(false).unwrap_err(),
            PlanError::RealtimeWithoutPvUnhalt { .. }
        ));
    }

    #[test]
    fn quirk_mask_keeps_the_vmm_quirks() {
        assert_eq!(plan(Placement::Shared).quirks_to_write(), 1 << 5);
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.vmm_disabled_quirks = 0x9;
        let p = Plan::new(&r, &HOST).unwrap();
        assert_eq!(p.quirks_to_write(), 0x29);
        assert!(p.to_string().contains("with the VMM's 0x9"), "{p}");
        r.disable_fix_hypercall_quirk = Some(false);
        assert_eq!(Plan::new(&r, &HOST).unwrap().quirks_to_write(), 0);
        // Bits the host cannot disable are refused, the VMM's included.
        r.vmm_disabled_quirks = 1 << 40;
        let e = Plan::new(&r, &HOST).unwrap_err();
        assert!(
            matches!(e, PlanError::QuirkUnsupported { quirks, .. } if quirks == 1 << 40),
            "{e}"
        );
    }

    #[test]
    fn host_without_steal_time_drops_it_and_its_dependants() {
        let host = HostCaps {
            pv_features: PvFeatures(0x0100_7efb).difference(PvFeatures::STEAL_TIME),
            ..HOST
        };
        let s = Plan::new(&PlanRequest::new(Placement::Shared, 2), &host).unwrap();
        assert!(s.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(!s.pv_features.contains(PvFeatures::STEAL_TIME));
        assert!(!s.pv_features.contains(PvFeatures::PV_TLB_FLUSH));
        assert!(!s.pv_features.contains(PvFeatures::PV_SCHED_YIELD));
        assert_eq!(s.dropped.len(), 2, "{:?}", s.dropped);
    }

    #[test]
    fn refusals_name_their_rule() {
        let mut r = PlanRequest::new(Placement::Dedicated, 2);
        r.disable_exits = Some(ExitFlags::HLT);
        r.pv_features = Some(PvFeatures::PV_UNHALT);
        let e = Plan::new(&r, &HOST).unwrap_err();
        assert!(matches!(e, PlanError::PvUnhaltWithHltExitsDisabled));
        assert!(e.to_string().starts_with("rule: PV_UNHALT"));

        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.realtime = Some(true);
        assert!(matches!(
            Plan::new(&r, &HOST).unwrap_err(),
            PlanError::RealtimeRequiresDedicated { .. }
        ));

        let mut r = PlanRequest::new(Placement::Overcommitted, 8);
        r.disable_exits = Some(ExitFlags::PAUSE);
        assert!(matches!(
            Plan::new(&r, &HOST).unwrap_err(),
            PlanError::ExitsRequireDedicated { .. }
        ));

        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.pv_features = Some(PvFeatures::STEAL_TIME);
        let no_steal = HostCaps {
            pv_features: PvFeatures(0x0100_7efb).difference(PvFeatures::STEAL_TIME),
            ..HOST
        };
        let e = Plan::new(&r, &no_steal).unwrap_err();
        assert!(
            matches!(e, PlanError::FeatureUnsupported { missing, .. } if missing == PvFeatures::STEAL_TIME)
        );

        let mut r = PlanRequest::new(Placement::Dedicated, 2);
        r.disable_exits = Some(ExitFlags::MWAIT);
        assert!(matches!(
            Plan::new(&r, &HOST).unwrap_err(),
            PlanError::ExitFlagsUnsupported { .. }
        ));

        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.pv_features = Some(PvFeatures::PV_SCHED_YIELD);
        let host = HostCaps {
            pv_features: PvFeatures(!0),
            ..HOST
        };
        assert!(matches!(
            Plan::new(&r, &host).unwrap_err(),
            PlanError::NeedsStealTime {
                feature: PvFeatures::PV_SCHED_YIELD
            }
        ));

        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.pv_features = Some(PvFeatures(1 << 3));
        assert!(matches!(
            Plan::new(&r, &HOST).unwrap_err(),
            PlanError::UnmanagedFeature { .. }
        ));

        let bare = HostCaps {
            halt_poll: false,
            enforce_pv_cpuid: false,
            disableable_quirks: 0,
            ..HOST
        };
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.halt_poll = Some(HaltPoll::MaxNs(1000));
        assert!(matches!(
            Plan::new(&r, &bare).unwrap_err(),
            PlanError::HaltPollUnsupported
        ));
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.enforce_pv_cpuid = Some(true);
        assert!(matches!(
            Plan::new(&r, &bare).unwrap_err(),
            PlanError::EnforceUnsupported
        ));
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.disable_fix_hypercall_quirk = Some(true);
        assert!(matches!(
            Plan::new(&r, &bare).unwrap_err(),
            PlanError::QuirkUnsupported { .. }
        ));
        // The same host with defaults: dropped, not refused.
        let p = Plan::new(&PlanRequest::new(Placement::Overcommitted, 2), &bare).unwrap();
        assert_eq!(p.halt_poll, HaltPoll::KvmDefault);
        assert!(!p.enforce_pv_cpuid && !p.disable_fix_hypercall_quirk);
        assert!(p.dropped.len() >= 3, "{:?}", p.dropped);

        assert!(matches!(
            Plan::new(&PlanRequest::new(Placement::Shared, 0), &HOST).unwrap_err(),
            PlanError::NoVcpus
        ));
        for p in [Placement::Dedicated, Placement::Shared] {
            let mut r = PlanRequest::new(p, 4);
            r.host_cpus = Some(2);
            assert!(matches!(
                Plan::new(&r, &HOST).unwrap_err(),
                PlanError::PlacementDoesNotFit {
                    vcpus: 4,
                    host_cpus: 2,
                    ..
                }
            ));
            r.host_cpus = Some(4);
            assert!(Plan::new(&r, &HOST).is_ok());
        }
        let mut r = PlanRequest::new(Placement::Overcommitted, 4);
        r.host_cpus = Some(2);
        assert!(Plan::new(&r, &HOST).is_ok());
        assert_eq!(Placement::infer(4, 2, true), Placement::Overcommitted);
        assert_eq!(Placement::infer(2, 2, true), Placement::Dedicated);
        assert_eq!(Placement::infer(2, 2, false), Placement::Shared);
        assert!(matches!(
            "pinned".parse::<Placement>().unwrap_err(),
            PlanError::UnknownPlacement(_)
        ));
    }

    #[test]
    fn exits_after_vcpus_refused_by_the_pure_check() {
        let d = plan(Placement::Dedicated);
        assert!(d.check_vm_stage(0).is_ok());
        assert!(matches!(
            d.check_vm_stage(1).unwrap_err(),
            PlanError::ExitsAfterVcpus { vcpus_created: 1 }
        ));
        // No exit flags: nothing to refuse.
        assert!(plan(Placement::Shared).check_vm_stage(3).is_ok());
    }

    #[test]
    fn dedicated_with_exits_off_may_take_pv_unhalt() {
        let mut r = PlanRequest::new(Placement::Dedicated, 2);
        r.disable_exits = Some(ExitFlags::PAUSE);
        r.pv_features = Some(PvFeatures::PV_UNHALT);
        let p = Plan::new(&r, &HOST).unwrap();
        assert!(p.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(p.realtime);
    }

    fn cpuid_with(entries: &[kvm_cpuid_entry2]) -> CpuId {
        CpuId::from_entries(entries).unwrap()
    }

    #[test]
    fn edit_keeps_unmanaged_bits_and_sets_hints() {
        let sig = kvm_cpuid_entry2 {
            function: KVM_CPUID_SIGNATURE,
            eax: KVM_CPUID_FEATURES,
            ebx: KVM_SIGNATURE[0],
            ecx: KVM_SIGNATURE[1],
            edx: KVM_SIGNATURE[2],
            ..Default::default()
        };
        let feat = kvm_cpuid_entry2 {
            function: KVM_CPUID_FEATURES,
            eax: 0x0100_7efb,
            edx: 0,
            ..Default::default()
        };
        let mut c = cpuid_with(&[sig, feat]);
        let d = plan(Placement::Dedicated);
        let e = edit_cpuid(&d, &mut c).unwrap();
        assert_eq!(e.eax_before, 0x0100_7efb);
        // Unmanaged bits (0,1,3,4,6,10,14,24) stay; of the managed ones only STEAL_TIME and
        // PV_SEND_IPI are planned for dedicated placement.
        assert_eq!(
            e.eax,
            (0x0100_7efb & !PvFeatures::MANAGED.0) | d.pv_features.0
        );
        assert_eq!(e.edx, 1);
        assert_eq!(kvm_leaf(&c), Some((e.eax, 1)));
        assert!(!e.added);
    }

    #[test]
    fn edit_adds_leaves_when_missing_and_refuses_foreign_hypervisor() {
        let basic = kvm_cpuid_entry2 {
            function: 0,
            eax: 0xd,
            ..Default::default()
        };
        let mut c = cpuid_with(&[basic]);
        let o = plan(Placement::Overcommitted);
        let e = edit_cpuid(&o, &mut c).unwrap();
        assert!(e.added && e.hypervisor_bit_set);
        // Leaf 1 (hypervisor bit only), the signature and the feature leaf.
        assert_eq!(c.as_slice().len(), 4);
        // The unmanaged bits come from the host's supported leaf (kvmclock, PV EOI, async PF).
        let eax = o.features_eax(HOST.pv_features.0);
        assert_eq!(eax & 0x0100_005b, 0x0100_005b);
        assert_eq!(kvm_leaf(&c), Some((eax, 0)));
        let leaf1 = c.as_slice().iter().find(|x| x.function == 1).unwrap();
        assert_eq!(leaf1.ecx, HYPERVISOR_BIT);

        let hyperv = kvm_cpuid_entry2 {
            function: KVM_CPUID_SIGNATURE,
            ebx: 0x7263_694d,
            ..Default::default()
        };
        let mut c = cpuid_with(&[hyperv]);
        assert!(matches!(
            edit_cpuid(&o, &mut c).unwrap_err(),
            PlanError::NoKvmLeaf
        ));

        // KVM behind Hyper-V at 0x40000100.
        let kvm_sig = kvm_cpuid_entry2 {
            function: KVM_CPUID_SIGNATURE + 0x100,
            ebx: KVM_SIGNATURE[0],
            ecx: KVM_SIGNATURE[1],
            edx: KVM_SIGNATURE[2],
            ..Default::default()
        };
        let kvm_feat = kvm_cpuid_entry2 {
            function: KVM_CPUID_FEATURES + 0x100,
            eax: 0x1,
            ..Default::default()
        };
        let mut c = cpuid_with(&[hyperv, kvm_sig, kvm_feat]);
        let e = edit_cpuid(&o, &mut c).unwrap();
        assert_eq!(e.leaf, 0x4000_0101);
        assert_eq!(e.eax, 1 | o.pv_features.0);
    }

    #[test]
    fn edit_keeps_a_hidden_hypervisor_hidden_unless_told() {
        let sig = kvm_cpuid_entry2 {
            function: KVM_CPUID_SIGNATURE,
            eax: KVM_CPUID_FEATURES,
            ebx: KVM_SIGNATURE[0],
            ecx: KVM_SIGNATURE[1],
            edx: KVM_SIGNATURE[2],
            ..Default::default()
        };
        let hidden = kvm_cpuid_entry2 {
            function: 1,
            ecx: 0x0120_2000,
            ..Default::default()
        };
        let s = plan(Placement::Shared);
        let mut c = cpuid_with(&[hidden, sig]);
        let e = edit_cpuid(&s, &mut c).unwrap_err();
        assert!(matches!(e, PlanError::HypervisorHidden));
        assert!(e.to_string().starts_with("rule:"));
        let mut r = PlanRequest::new(Placement::Shared, 2);
        r.add_kvm_leaves = Some(true);
        let forced = Plan::new(&r, &HOST).unwrap();
        let mut c = cpuid_with(&[hidden, sig]);
        let e = edit_cpuid(&forced, &mut c).unwrap();
        assert!(e.hypervisor_bit_set && e.added);
        let leaf1 = c.as_slice().iter().find(|x| x.function == 1).unwrap();
        assert_eq!(leaf1.ecx, 0x8120_2000);
        // Some(false): never add KVM leaves.
        r.add_kvm_leaves = Some(false);
        let never = Plan::new(&r, &HOST).unwrap();
        let visible = kvm_cpuid_entry2 {
            ecx: 0x8120_2000,
            ..hidden
        };
        let mut c = cpuid_with(&[visible]);
        assert!(matches!(
            edit_cpuid(&never, &mut c).unwrap_err(),
            PlanError::KvmLeavesMissing
        ));
        let mut c = cpuid_with(&[visible, sig]);
        let e = edit_cpuid(&never, &mut c).unwrap();
        assert!(e.added && !e.hypervisor_bit_set, "{e:?}");
    }

    #[test]
    fn display_mentions_every_setting() {
        let s = plan(Placement::Dedicated).to_string();
        for w in [
            "dedicated",
            "REALTIME",
            "disable exits: PAUSE",
            "guest kernel unknown",
            "halt poll",
            "enforce",
            "QUIRK",
        ] {
            assert!(
                s.to_lowercase().contains(&w.to_lowercase()),
                "{w} missing in {s}"
            );
        }
    }
}
