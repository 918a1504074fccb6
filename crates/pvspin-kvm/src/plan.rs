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
//! The guest's decisions (Linux `arch/x86/kernel/kvm.c`, see `kvm-pv-reference.md` §2.1):
//! without `PV_UNHALT` the guest keeps the unfair test-and-set `virt_spin_lock`; with
//! `KVM_HINTS_REALTIME` (or one vCPU) it uses plain native qspinlock; otherwise PV qspinlock
//! (wait = HLT, kick = `KVM_HC_KICK_CPU`). `PV_TLB_FLUSH` and `PV_SCHED_YIELD` are used only
//! with `STEAL_TIME`, without `REALTIME` and with more than one CPU. KVM strips `PV_UNHALT` when
//! HLT exits are disabled, and a HLT that never exits cannot be woken by a kick.
//!
//! | | dedicated (pinned 1:1) | shared | overcommitted |
//! |---|---|---|---|
//! | `KVM_HINTS_REALTIME` | **on**: vCPUs are never preempted for long, so native qspinlock is best | off | off |
//! | disabled exits | **HLT \| PAUSE**: an idle or spinning vCPU keeps its own host CPU, no exit cost | none | none |
//! | `PV_UNHALT` | off: it conflicts with HLT exits disabled, and the guest ignores it under REALTIME | on | on |
//! | `STEAL_TIME` | on: steal accounting stays truthful (it reads ~0) | on | on |
//! | `PV_TLB_FLUSH`, `PV_SCHED_YIELD` | off: the guest ignores them under REALTIME | on | on |
//! | `PV_SEND_IPI` | on: one hypercall instead of one exit per destination | on | on |
//! | `POLL_CONTROL` | off: with HLT exits disabled there is no host halt polling to control | on | on |
//! | halt-poll limit | KVM's default (irrelevant: HLT does not exit) | KVM's default | **0**: polling burns a host CPU another runnable vCPU needs |
//! | `ENFORCE_PV_FEATURE_CPUID` | on | on | on |
//! | `FIX_HYPERCALL_INSN` quirk | disabled | disabled | disabled |
//!
//! `ENFORCE_PV_FEATURE_CPUID` is on everywhere so that CPUID is the single truth: without it KVM
//! services `KICK_CPU`, `SCHED_YIELD` and `SEND_IPI` even when they were not advertised. The
//! `FIX_HYPERCALL_INSN` quirk is disabled everywhere so that a hypercall of the wrong vendor
//! raises #UD instead of being rewritten (on the emulating development hosts a rewritten
//! hypercall loops forever).
//!
//! One vCPU: Linux turns PV spinlocks off when `num_possible_cpus() == 1`, and PV TLB flush,
//! sched-yield and send-IPI need more than one CPU. The defaults still advertise them: the guest
//! counts *possible* CPUs (hotpluggable ones included, which the VMM may add later), and an
//! unused bit costs nothing.
//!
//! Hosts whose KVM emulates every guest instruction (the development machines,
//! `kvm-on-these-machines.md` §0) never complete a hypercall: a stock Linux guest that was
//! offered `PV_UNHALT` would livelock on its first `KVM_HC_KICK_CPU` there. [`HostCaps`] cannot
//! see that without running a guest; a VMM for such hosts should request `pv_features`
//! without `PV_UNHALT`, `PV_SCHED_YIELD` and `PV_SEND_IPI` explicitly.
//!
//! A default the host does not support is dropped and recorded in [`Plan::dropped`]; an explicit
//! request ([`PlanRequest`] override) the host does not support is refused.
//!
//! # Rules ([`PlanError`])
//!
//! * `PV_UNHALT` together with HLT exits disabled is refused (KVM `api.rst` §7.13).
//! * `KVM_HINTS_REALTIME` without dedicated placement is refused (its meaning is "vCPUs are never
//!   preempted for an unlimited time").
//! * Disabling HLT, PAUSE or CSTATE exits without dedicated placement is refused: a vCPU that
//!   does not exit on them keeps its host CPU while idle or spinning.
//! * `PV_TLB_FLUSH` or `PV_SCHED_YIELD` without `STEAL_TIME` is refused (the guest never uses
//!   them then).
//! * A feature bit, exit flag, halt-poll setting, PV enforcement or quirk the host does not
//!   support is refused.
//! * `dedicated` or `shared` placement with more vCPUs than host CPUs (when
//!   [`PlanRequest::host_cpus`] is given) is refused: that is overcommitted.
//! * Exit flags after vCPUs exist are refused (KVM accepts them only before the first
//!   `KVM_CREATE_VCPU`).

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_enable_cap, CpuId, KVM_CAP_ENFORCE_PV_FEATURE_CPUID, KVM_CAP_HALT_POLL,
    KVM_CAP_X86_DISABLE_EXITS, KVM_MAX_CPUID_ENTRIES, KVM_X86_DISABLE_EXITS_CSTATE,
    KVM_X86_DISABLE_EXITS_HLT, KVM_X86_DISABLE_EXITS_MWAIT, KVM_X86_DISABLE_EXITS_PAUSE,
    KVM_X86_QUIRK_FIX_HYPERCALL_INSN,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::Serialize;
use std::fmt;

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

/// A set of `KVM_FEATURE_*` bits (EAX of CPUID `0x40000001`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct PvFeatures(pub u32);

impl PvFeatures {
    /// `KVM_FEATURE_STEAL_TIME` (bit 5).
    pub const STEAL_TIME: PvFeatures = PvFeatures(1 << 5);
    /// `KVM_FEATURE_PV_UNHALT` (bit 7): the guest enables PV spinlocks only with it.
    pub const PV_UNHALT: PvFeatures = PvFeatures(1 << 7);
    /// `KVM_FEATURE_PV_TLB_FLUSH` (bit 9).
    pub const PV_TLB_FLUSH: PvFeatures = PvFeatures(1 << 9);
    /// `KVM_FEATURE_PV_SEND_IPI` (bit 11).
    pub const PV_SEND_IPI: PvFeatures = PvFeatures(1 << 11);
    /// `KVM_FEATURE_POLL_CONTROL` (bit 12).
    pub const POLL_CONTROL: PvFeatures = PvFeatures(1 << 12);
    /// `KVM_FEATURE_PV_SCHED_YIELD` (bit 13).
    pub const PV_SCHED_YIELD: PvFeatures = PvFeatures(1 << 13);
    /// The six bits this plan manages; other bits of the leaf pass through untouched.
    pub const MANAGED: PvFeatures = PvFeatures(
        Self::STEAL_TIME.0
            | Self::PV_UNHALT.0
            | Self::PV_TLB_FLUSH.0
            | Self::PV_SEND_IPI.0
            | Self::POLL_CONTROL.0
            | Self::PV_SCHED_YIELD.0,
    );
    /// No bits.
    pub const NONE: PvFeatures = PvFeatures(0);

    const NAMES: [(PvFeatures, &'static str); 6] = [
        (Self::STEAL_TIME, "STEAL_TIME"),
        (Self::PV_UNHALT, "PV_UNHALT"),
        (Self::PV_TLB_FLUSH, "PV_TLB_FLUSH"),
        (Self::PV_SEND_IPI, "PV_SEND_IPI"),
        (Self::POLL_CONTROL, "POLL_CONTROL"),
        (Self::PV_SCHED_YIELD, "PV_SCHED_YIELD"),
    ];

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: PvFeatures) -> bool {
        self.0 & other.0 == other.0
    }
    /// Whether any bit of `other` is set in `self`.
    pub fn intersects(self, other: PvFeatures) -> bool {
        self.0 & other.0 != 0
    }
    /// `self | other`.
    pub fn union(self, other: PvFeatures) -> PvFeatures {
        PvFeatures(self.0 | other.0)
    }
    /// `self & other`.
    pub fn intersection(self, other: PvFeatures) -> PvFeatures {
        PvFeatures(self.0 & other.0)
    }
    /// `self & !other`.
    pub fn difference(self, other: PvFeatures) -> PvFeatures {
        PvFeatures(self.0 & !other.0)
    }
    /// Whether no bit is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The names of the managed bits set, in bit order.
    pub fn names(self) -> Vec<&'static str> {
        let mut v: Vec<(u32, &'static str)> = Self::NAMES
            .iter()
            .filter(|(f, _)| self.contains(*f))
            .map(|(f, n)| (f.0, *n))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, n)| n).collect()
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

/// A set of `KVM_X86_DISABLE_EXITS_*` flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct ExitFlags(pub u32);

impl ExitFlags {
    /// `KVM_X86_DISABLE_EXITS_MWAIT`.
    pub const MWAIT: ExitFlags = ExitFlags(KVM_X86_DISABLE_EXITS_MWAIT);
    /// `KVM_X86_DISABLE_EXITS_HLT`.
    pub const HLT: ExitFlags = ExitFlags(KVM_X86_DISABLE_EXITS_HLT);
    /// `KVM_X86_DISABLE_EXITS_PAUSE`.
    pub const PAUSE: ExitFlags = ExitFlags(KVM_X86_DISABLE_EXITS_PAUSE);
    /// `KVM_X86_DISABLE_EXITS_CSTATE`.
    pub const CSTATE: ExitFlags = ExitFlags(KVM_X86_DISABLE_EXITS_CSTATE);
    /// No flags: every exit stays enabled.
    pub const NONE: ExitFlags = ExitFlags(0);

    /// Whether every flag of `other` is set in `self`.
    pub fn contains(self, other: ExitFlags) -> bool {
        self.0 & other.0 == other.0
    }
    /// Whether no flag is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for ExitFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (flag, name) in [
            (Self::MWAIT, "MWAIT"),
            (Self::HLT, "HLT"),
            (Self::PAUSE, "PAUSE"),
            (Self::CSTATE, "CSTATE"),
        ] {
            if self.contains(flag) {
                names.push(name);
            }
        }
        let unknown = self.0 & !0xf;
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
    /// What the development machines report (`kvm-on-these-machines.md` §1, §7, §9): EAX
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
    /// Disable the `FIX_HYPERCALL_INSN` quirk.
    pub disable_fix_hypercall_quirk: Option<bool>,
    /// Host CPUs available to this VM, if known: checks that the placement fits.
    pub host_cpus: Option<u32>,
}

impl PlanRequest {
    /// A request with every setting at the placement's default.
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
        }
    }
}

/// The defaults of one placement (before intersecting with the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacementDefaults {
    /// PV feature bits.
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
    /// The defaults for `placement` (the table in the module docs).
    pub fn for_placement(placement: Placement) -> PlacementDefaults {
        let all = PvFeatures::MANAGED;
        match placement {
            Placement::Dedicated => PlacementDefaults {
                pv_features: PvFeatures::STEAL_TIME.union(PvFeatures::PV_SEND_IPI),
                realtime: true,
                disable_exits: ExitFlags(ExitFlags::HLT.0 | ExitFlags::PAUSE.0),
                halt_poll: HaltPoll::KvmDefault,
                enforce_pv_cpuid: true,
                disable_fix_hypercall_quirk: true,
            },
            Placement::Shared => PlacementDefaults {
                pv_features: all,
                realtime: false,
                disable_exits: ExitFlags::NONE,
                halt_poll: HaltPoll::KvmDefault,
                enforce_pv_cpuid: true,
                disable_fix_hypercall_quirk: true,
            },
            Placement::Overcommitted => PlacementDefaults {
                pv_features: all,
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
    /// Defaults dropped because the host lacks them, one line each.
    pub dropped: Vec<String>,
}

/// Errors of planning and of applying a plan; invalid configurations name the rule broken.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Not one of `dedicated`, `shared`, `overcommitted`.
    #[error("unknown placement {0:?} (expected dedicated, shared or overcommitted)")]
    UnknownPlacement(String),
    /// `vcpus == 0`.
    #[error("rule: a VM needs at least one vCPU")]
    NoVcpus,
    /// The placement does not fit the vCPU and host CPU counts.
    #[error("rule: {placement} placement needs at most one vCPU per host CPU ({vcpus} vCPUs, {host_cpus} host CPUs); use overcommitted")]
    PlacementDoesNotFit {
        /// The placement.
        placement: Placement,
        /// vCPUs.
        vcpus: u32,
        /// Host CPUs.
        host_cpus: u32,
    },
    /// A feature bit outside the managed set was requested.
    #[error(
        "rule: only the managed PV feature bits may be requested ({managed}); got {requested:#x}"
    )]
    UnmanagedFeature {
        /// The bits requested.
        requested: u32,
        /// The managed set.
        managed: PvFeatures,
    },
    /// `PV_UNHALT` with HLT exits disabled.
    #[error("rule: PV_UNHALT must not be advertised with HLT exits disabled (a HLT that never exits cannot be woken by a kick)")]
    PvUnhaltWithHltExitsDisabled,
    /// `REALTIME` without dedicated placement.
    #[error("rule: KVM_HINTS_REALTIME requires dedicated placement (it promises vCPUs are never preempted for long); placement is {placement}")]
    RealtimeRequiresDedicated {
        /// The placement.
        placement: Placement,
    },
    /// Exits disabled without dedicated placement.
    #[error("rule: disabling {flags} exits requires dedicated placement (the vCPU would keep its host CPU while idle or spinning); placement is {placement}")]
    ExitsRequireDedicated {
        /// The flags.
        flags: ExitFlags,
        /// The placement.
        placement: Placement,
    },
    /// `PV_TLB_FLUSH`/`PV_SCHED_YIELD` without `STEAL_TIME`.
    #[error("rule: {feature} requires STEAL_TIME (the guest uses it only with steal time)")]
    NeedsStealTime {
        /// The feature that needs steal time.
        feature: &'static str,
    },
    /// A feature bit the host does not support.
    #[error("rule: host does not support PV feature(s) {missing} (supported 0x40000001.eax = {supported:#x})")]
    FeatureUnsupported {
        /// The unsupported bits.
        missing: PvFeatures,
        /// The host's supported EAX.
        supported: u32,
    },
    /// Exit flags the host does not support.
    #[error(
        "rule: host cannot disable exits {requested} (KVM_CAP_X86_DISABLE_EXITS = {supported})"
    )]
    ExitFlagsUnsupported {
        /// The requested flags.
        requested: ExitFlags,
        /// The host's mask.
        supported: ExitFlags,
    },
    /// `KVM_CAP_HALT_POLL` is missing.
    #[error("rule: host does not support a per-VM halt-poll limit (no KVM_CAP_HALT_POLL)")]
    HaltPollUnsupported,
    /// `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` is missing.
    #[error("rule: host does not support KVM_CAP_ENFORCE_PV_FEATURE_CPUID")]
    EnforceUnsupported,
    /// The quirk cannot be disabled.
    #[error("rule: host cannot disable quirk FIX_HYPERCALL_INSN (KVM_CAP_DISABLE_QUIRKS2 = {supported:#x})")]
    QuirkUnsupported {
        /// The host's mask.
        supported: u64,
    },
    /// Exit flags after vCPUs exist.
    #[error("rule: KVM_CAP_X86_DISABLE_EXITS must be enabled before any vCPU is created ({vcpus_created} exist)")]
    ExitsAfterVcpus {
        /// How many vCPUs the caller said exist (0 if KVM refused without the caller saying).
        vcpus_created: u32,
    },
    /// `KVM_SET_CPUID2` was refused and the vCPU has already run (its `exits` stat is not 0):
    /// KVM accepts only an identical CPUID after the first `KVM_RUN`.
    #[error(
        "rule: the vCPU stage must run before the vCPU's first KVM_RUN (KVM_SET_CPUID2: {source})"
    )]
    CpuidAfterRun {
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Another hypervisor owns leaf `0x40000000` and no KVM signature was found.
    #[error("CPUID has hypervisor leaves but no KVM signature at 0x40000000 + n*0x100; cannot place the KVM leaf")]
    NoKvmLeaf,
    /// Too many CPUID entries to add the KVM leaves.
    #[error("CPUID is full ({0} entries); cannot add the KVM leaves")]
    CpuidFull(usize),
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Kvm {
        /// The operation.
        op: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Disabling the quirk failed.
    #[error(transparent)]
    Quirk(#[from] quirks::QuirkError),
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
        let d = PlacementDefaults::for_placement(req.placement);
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
                f
            }
            None => {
                let mut f = d.pv_features;
                if disable_exits.contains(ExitFlags::HLT) && f.contains(PvFeatures::PV_UNHALT) {
                    f = f.difference(PvFeatures::PV_UNHALT);
                    dropped.push("PV_UNHALT: HLT exits are disabled".to_owned());
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
        if pv_features.contains(PvFeatures::PV_UNHALT) && disable_exits.contains(ExitFlags::HLT) {
            return Err(PlanError::PvUnhaltWithHltExitsDisabled);
        }
        if !pv_features.contains(PvFeatures::STEAL_TIME) {
            for (f, name) in [
                (PvFeatures::PV_TLB_FLUSH, "PV_TLB_FLUSH"),
                (PvFeatures::PV_SCHED_YIELD, "PV_SCHED_YIELD"),
            ] {
                if pv_features.contains(f) {
                    return Err(PlanError::NeedsStealTime { feature: name });
                }
            }
        }

        let realtime = req.realtime.unwrap_or(d.realtime);
        if realtime && req.placement != Placement::Dedicated {
            return Err(PlanError::RealtimeRequiresDedicated {
                placement: req.placement,
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

        let quirk = u64::from(KVM_X86_QUIRK_FIX_HYPERCALL_INSN);
        let quirk_ok = host.disableable_quirks & quirk == quirk;
        let disable_fix_hypercall_quirk = match req.disable_fix_hypercall_quirk {
            Some(true) if !quirk_ok => {
                return Err(PlanError::QuirkUnsupported {
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
            dropped,
        })
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
        writeln!(f, "placement: {} ({} vCPUs)", self.placement, self.vcpus)?;
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
}

/// Edits the KVM feature leaf in `cpuid` per `plan` (pure): managed EAX bits as planned, other
/// EAX bits untouched, EDX = the plan's hints. Adds the signature and feature leaves at
/// `0x40000000` when the CPUID has no hypervisor leaves at all, and the feature leaf when only
/// the KVM signature is there. Refuses a CPUID whose hypervisor leaves are all foreign.
pub fn edit_cpuid(plan: &Plan, cpuid: &mut CpuId) -> Result<CpuidEdit, PlanError> {
    let full = cpuid.as_slice().len();
    let base = match find_kvm_base(cpuid.as_slice())? {
        Some(base) => base,
        None => {
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
            added: false,
        });
    }
    let entry = kvm_cpuid_entry2 {
        function: leaf,
        eax: plan.features_eax(0),
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
}

impl fmt::Display for AppliedVm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VM stage: FIX_HYPERCALL_INSN quirk ")?;
        f.write_str(if self.fix_hypercall_quirk_disabled {
            "disabled"
        } else {
            "left on"
        })?;
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
            "vCPU stage: CPUID {:#x}.eax {:#x} -> {:#x} ({}), edx {:#x}{}; PV CPUID enforced: {}",
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
            self.enforce_pv_cpuid
        )
    }
}

/// What [`apply_vcpu`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AppliedVcpu {
    /// The CPUID edit that `KVM_SET_CPUID2` installed.
    pub cpuid: CpuidEdit,
    /// `KVM_CAP_ENFORCE_PV_FEATURE_CPUID` enabled on this vCPU.
    pub enforce_pv_cpuid: bool,
}

/// The VM stage: call once, after `KVM_CREATE_VM` and **before the first `KVM_CREATE_VCPU`**
/// (`vcpus_created` must be 0 when the plan disables exits; KVM refuses the flags afterwards).
/// Order inside: quirk, disable exits, halt poll.
pub fn apply_vm(plan: &Plan, vm: &VmFd, vcpus_created: u32) -> Result<AppliedVm, PlanError> {
    plan.check_vm_stage(vcpus_created)?;
    let mut applied = AppliedVm {
        disable_exits: ExitFlags::NONE,
        halt_poll_ns: None,
        fix_hypercall_quirk_disabled: false,
    };
    if plan.disable_fix_hypercall_quirk {
        quirks::disable_fix_hypercall_insn(vm)?;
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
                PlanError::ExitsAfterVcpus { vcpus_created }
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

/// The vCPU stage: call on each vCPU after [`apply_vm`] and **before the vCPU's first
/// `KVM_RUN`**. Edits `cpuid` (the VMM's CPUID for this vCPU, e.g. from
/// `KVM_GET_SUPPORTED_CPUID` plus the VMM's own edits) per the plan, installs it with
/// `KVM_SET_CPUID2`, then enables `KVM_CAP_ENFORCE_PV_FEATURE_CPUID`.
pub fn apply_vcpu(plan: &Plan, vcpu: &VcpuFd, cpuid: &mut CpuId) -> Result<AppliedVcpu, PlanError> {
    let edit = edit_cpuid(plan, cpuid)?;
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
    })?;
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
    Ok(AppliedVcpu {
        cpuid: edit,
        enforce_pv_cpuid: plan.enforce_pv_cpuid,
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
        let d = plan(Placement::Dedicated);
        assert!(d.realtime);
        assert_eq!(
            d.disable_exits,
            ExitFlags(ExitFlags::HLT.0 | ExitFlags::PAUSE.0)
        );
        assert!(!d.pv_features.contains(PvFeatures::PV_UNHALT));
        assert!(d.pv_features.contains(PvFeatures::STEAL_TIME));
        assert!(d.dropped.is_empty(), "{:?}", d.dropped);

        let s = plan(Placement::Shared);
        assert!(!s.realtime);
        assert!(s.disable_exits.is_empty());
        assert_eq!(s.pv_features, PvFeatures::MANAGED);
        assert!(s.dropped.is_empty(), "{:?}", s.dropped);
        assert_eq!(s.halt_poll, HaltPoll::KvmDefault);

        let o = plan(Placement::Overcommitted);
        assert_eq!(o.halt_poll, HaltPoll::MaxNs(0));
        assert!(o.enforce_pv_cpuid && o.disable_fix_hypercall_quirk);
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
                feature: "PV_SCHED_YIELD"
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
        assert!(e.added);
        assert_eq!(c.as_slice().len(), 3);
        assert_eq!(kvm_leaf(&c), Some((o.pv_features.0, 0)));

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
    fn display_mentions_every_setting() {
        let s = plan(Placement::Dedicated).to_string();
        for w in [
            "dedicated",
            "REALTIME",
            "HLT|PAUSE",
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
