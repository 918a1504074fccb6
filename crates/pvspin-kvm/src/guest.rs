//! What a stock Linux guest does with the KVM CPUID it is given: the guest-kernel table of
//! `docs/stock-guests.md`, as a pure function ([`guest_outcome`]) tested row by row.
//!
//! Everything here was read from `arch/x86/kernel/kvm.c` (`kvm_spinlock_init`,
//! `kvm_smp_prepare_cpus`, `pv_tlb_flush_supported`, `pv_ipi_supported`,
//! `pv_sched_yield_supported`, `arch_haltpoll_enable`) and `drivers/cpuidle/cpuidle-haltpoll.c`
//! (`haltpoll_want`) of the kernel lines listed in [`KernelLine`]; `docs/stock-guests.md` says
//! which line was read from which tree and what is inferred rather than read.
//!
//! The one difference that matters for the plan ([`GuestKernel`]): from 2019 (the `REALTIME`
//! check moved into `kvm_spinlock_init`, behind the `PV_UNHALT` check, somewhere between v4.19
//! and v5.4-rc; the exact commit is not pinned here) until upstream commit 960550503965
//! ("x86/kvm: Prefer native qspinlock for dedicated vCPUs irrespective of PV_UNHALT", 2025;
//! queued for the 5.4 to 6.17 stable trees in November 2025), `kvm_spinlock_init` returns early
//! when `KVM_FEATURE_PV_UNHALT` is absent, *before* it looks at `KVM_HINTS_REALTIME`, so
//! `virt_spin_lock_key` stays on and the guest uses the unfair test-and-set lock even on
//! dedicated vCPUs. 4.19 turned the key off for `REALTIME` in `kvm_smp_prepare_cpus` regardless
//! of `PV_UNHALT`, and kernels with 960550503965 check `REALTIME` first.

use serde::Serialize;
use std::fmt;

use crate::plan::PvFeatures;

/// Which Linux guest kernels a plan must be right for, by how they treat `KVM_HINTS_REALTIME`
/// without `KVM_FEATURE_PV_UNHALT`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestKernel {
    /// Any Linux kernel: the plan must be right for all of them (the default).
    #[default]
    Unknown,
    /// Honours `REALTIME` only together with `PV_UNHALT`: Linux from the 2019 rework (between
    /// v4.19 and v5.4) up to (not including) 960550503965, i.e. the 5.10, 5.15, 6.1, 6.6 and
    /// 6.12 base releases and every stable release of them without the November 2025 backport.
    Legacy,
    /// Honours `REALTIME` irrespective of `PV_UNHALT`: kernels with 960550503965 (mainline
    /// since the 6.18 merge window, and stable releases with the backport), and 4.19
    /// (`kvm_smp_prepare_cpus` turns the test-and-set lock off for `REALTIME`).
    Modern,
}

impl GuestKernel {
    /// All values, for CLIs and tests.
    pub const ALL: [GuestKernel; 3] = [
        GuestKernel::Unknown,
        GuestKernel::Legacy,
        GuestKernel::Modern,
    ];

    /// The lower-case name (`unknown`, `legacy`, `modern`).
    pub fn name(self) -> &'static str {
        match self {
            GuestKernel::Unknown => "unknown",
            GuestKernel::Legacy => "legacy",
            GuestKernel::Modern => "modern",
        }
    }

    /// Whether a kernel of this family may need `PV_UNHALT` next to `REALTIME` to get native
    /// qspinlock (true for `Unknown` and `Legacy`).
    pub fn realtime_needs_pv_unhalt(self) -> bool {
        self != GuestKernel::Modern
    }
}

impl fmt::Display for GuestKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for GuestKernel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GuestKernel::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| {
                format!("unknown guest kernel {s:?} (expected unknown, legacy or modern)")
            })
    }
}

/// The Linux lines of the guest-kernel table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum KernelLine {
    /// 4.19 (LTS).
    V4_19,
    /// 5.10 (LTS).
    V5_10,
    /// 5.15 (LTS).
    V5_15,
    /// 6.1 (LTS).
    V6_1,
    /// 6.6 (LTS).
    V6_6,
    /// 6.12 (LTS).
    V6_12,
    /// Current mainline (with 960550503965).
    Current,
}

impl KernelLine {
    /// Every line, oldest first.
    pub const ALL: [KernelLine; 7] = [
        KernelLine::V4_19,
        KernelLine::V5_10,
        KernelLine::V5_15,
        KernelLine::V6_1,
        KernelLine::V6_6,
        KernelLine::V6_12,
        KernelLine::Current,
    ];

    /// The version as written in the docs.
    pub fn name(self) -> &'static str {
        match self {
            KernelLine::V4_19 => "4.19",
            KernelLine::V5_10 => "5.10",
            KernelLine::V5_15 => "5.15",
            KernelLine::V6_1 => "6.1",
            KernelLine::V6_6 => "6.6",
            KernelLine::V6_12 => "6.12",
            KernelLine::Current => "current",
        }
    }
}

/// One guest kernel: a line, and whether it carries 960550503965 (always true for
/// [`KernelLine::Current`]; for the stable lines it depends on the point release; ignored for
/// 4.19, which behaves like a kernel with it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct LinuxGuest {
    /// The line.
    pub line: KernelLine,
    /// The stable backport of 960550503965 is in.
    pub realtime_fix: bool,
}

impl LinuxGuest {
    /// The base release of `line` (no stable backports; `Current` has the fix).
    pub fn base(line: KernelLine) -> LinuxGuest {
        LinuxGuest {
            line,
            realtime_fix: line == KernelLine::Current,
        }
    }

    /// The [`GuestKernel`] family this kernel belongs to.
    pub fn family(self) -> GuestKernel {
        if self.line == KernelLine::V4_19 || self.line == KernelLine::Current || self.realtime_fix {
            GuestKernel::Modern
        } else {
            GuestKernel::Legacy
        }
    }
}

/// What the guest sees: the KVM feature leaf and the facts the guest combines it with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GuestCpuid {
    /// EAX of the KVM feature leaf.
    pub pv_features: PvFeatures,
    /// `KVM_HINTS_REALTIME` (EDX bit 0).
    pub realtime: bool,
    /// The guest's `num_possible_cpus()`.
    pub possible_cpus: u32,
    /// `X86_FEATURE_MWAIT` is set in the guest's CPUID leaf 1.
    pub mwait: bool,
}

/// Which spinlock implementation the guest ends up with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestLockChoice {
    /// Plain native qspinlock (`virt_spin_lock_key` off, no PV ops).
    NativeQspinlock,
    /// PV qspinlock: wait = HLT, kick = `KVM_HC_KICK_CPU`.
    PvQspinlock,
    /// `virt_spin_lock()`: the unfair test-and-set lock (`virt_spin_lock_key` left on).
    TestAndSet,
}

/// What the guest does with `cpuidle-haltpoll` and `KVM_FEATURE_POLL_CONTROL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Haltpoll {
    /// The kernel has no `cpuidle-haltpoll` driver (before 5.4).
    NotInKernel,
    /// The driver does not load (no `REALTIME`, and no `force` module parameter).
    NotLoaded,
    /// The driver loads and turns host halt polling off through `MSR_KVM_POLL_CONTROL`.
    LoadedPollControl,
    /// The driver loads, finds no `POLL_CONTROL` and logs "host does not support poll control"
    /// and "host upgrade recommended"; host halt polling stays on under guest polling.
    LoadedNoPollControl,
}

/// Everything the guest-kernel table records for one kernel and one CPUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GuestOutcome {
    /// The spinlock.
    pub lock: GuestLockChoice,
    /// PV TLB flush (`kvm_flush_tlb_multi`/`_others`) installed.
    pub pv_tlb_flush: bool,
    /// PV sched yield (`kvm_smp_send_call_func_ipi`) installed.
    pub pv_sched_yield: bool,
    /// PV send-IPI (`kvm_setup_pv_ipi`) installed.
    pub pv_send_ipi: bool,
    /// `cpuidle-haltpoll`.
    pub haltpoll: Haltpoll,
}

/// What a Linux guest of kernel `kernel` does with `cpuid` (the guest-kernel table). Assumes a
/// 64-bit SMP guest with `CONFIG_PARAVIRT_SPINLOCKS` and `CONFIG_HALTPOLL_CPUIDLE`, no
/// `nopvspin`/`nopv` boot parameters and no `cpuidle_haltpoll.force`.
pub fn guest_outcome(kernel: LinuxGuest, cpuid: &GuestCpuid) -> GuestOutcome {
    let has = |f: PvFeatures| cpuid.pv_features.contains(f);
    let rt = cpuid.realtime;
    let single = cpuid.possible_cpus <= 1;
    let lock = match kernel.family() {
        // 4.19: kvm_spinlock_init returns early without PV_UNHALT, with REALTIME and with one
        // CPU, never touching the key; kvm_smp_prepare_cpus turns the key off for REALTIME.
        _ if kernel.line == KernelLine::V4_19 => {
            if rt {
                GuestLockChoice::NativeQspinlock
            } else if !has(PvFeatures::PV_UNHALT) || single {
                GuestLockChoice::TestAndSet
            } else {
                GuestLockChoice::PvQspinlock
            }
        }
        // 2019 rework until 960550503965: PV_UNHALT first (return, key on), then REALTIME and one CPU
        // (goto out: key off).
        GuestKernel::Legacy | GuestKernel::Unknown => {
            if !has(PvFeatures::PV_UNHALT) {
                GuestLockChoice::TestAndSet
            } else if rt || single {
                GuestLockChoice::NativeQspinlock
            } else {
                GuestLockChoice::PvQspinlock
            }
        }
        // With 960550503965: REALTIME and one CPU first, then PV_UNHALT.
        GuestKernel::Modern => {
            if rt || single {
                GuestLockChoice::NativeQspinlock
            } else if !has(PvFeatures::PV_UNHALT) {
                GuestLockChoice::TestAndSet
            } else {
                GuestLockChoice::PvQspinlock
            }
        }
    };
    let line = kernel.line;
    // The one-CPU checks arrived between 5.10.13 and 5.15.85, the MWAIT check (Feb 2022
    // patch "Don't use PV TLB/yield when mwait is advertised") between 5.15.85 and 6.1.
    let cpus_checked = !matches!(line, KernelLine::V4_19 | KernelLine::V5_10);
    let mwait_checked = cpus_checked && line != KernelLine::V5_15;
    let multi_ok = !cpus_checked || !single;
    let mwait_ok = !mwait_checked || !cpuid.mwait;
    let steal = has(PvFeatures::STEAL_TIME);
    let pv_tlb_flush = has(PvFeatures::PV_TLB_FLUSH) && !rt && steal && multi_ok && mwait_ok;
    let pv_sched_yield = line != KernelLine::V4_19
        && has(PvFeatures::PV_SCHED_YIELD)
        && !rt
        && steal
        && multi_ok
        && mwait_ok;
    let pv_send_ipi = has(PvFeatures::PV_SEND_IPI) && multi_ok;
    let haltpoll = if line == KernelLine::V4_19 {
        Haltpoll::NotInKernel
    } else if !rt {
        Haltpoll::NotLoaded
    } else if has(PvFeatures::POLL_CONTROL) {
        Haltpoll::LoadedPollControl
    } else {
        Haltpoll::LoadedNoPollControl
    };
    GuestOutcome {
        lock,
        pv_tlb_flush,
        pv_sched_yield,
        pv_send_ipi,
        haltpoll,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use KernelLine::*;

    const KVM_ALL: PvFeatures = PvFeatures(0x0100_7efb);

    fn view(features: PvFeatures, realtime: bool) -> GuestCpuid {
        GuestCpuid {
            pv_features: features,
            realtime,
            possible_cpus: 4,
            mwait: false,
        }
    }

    /// The plan's CPUID per placement, as `docs/stock-guests.md` lists them: dedicated with HLT
    /// exits disabled (GuestKernel::Modern), dedicated with HLT exits kept (Unknown, Legacy),
    /// shared/overcommitted.
    fn dedicated_hlt_off() -> GuestCpuid {
        view(
            PvFeatures::STEAL_TIME
                .union(PvFeatures::PV_SEND_IPI)
                .union(PvFeatures::POLL_CONTROL),
            true,
        )
    }
    fn dedicated_hlt_on() -> GuestCpuid {
        view(
            dedicated_hlt_off().pv_features.union(PvFeatures::PV_UNHALT),
            true,
        )
    }
    fn shared() -> GuestCpuid {
        view(KVM_ALL.difference(PvFeatures::POLL_CONTROL), false)
    }

    fn row(
        line: KernelLine,
        cpuid: GuestCpuid,
        lock: GuestLockChoice,
        tlb: bool,
        yield_: bool,
        ipi: bool,
        haltpoll: Haltpoll,
    ) {
        let got = guest_outcome(LinuxGuest::base(line), &cpuid);
        let want = GuestOutcome {
            lock,
            pv_tlb_flush: tlb,
            pv_sched_yield: yield_,
            pv_send_ipi: ipi,
            haltpoll,
        };
        assert_eq!(got, want, "{} with {cpuid:?}", line.name());
    }

    use GuestLockChoice::{NativeQspinlock as Native, PvQspinlock as Pv, TestAndSet as Tas};
    use Haltpoll::*;

    #[test]
    fn table_dedicated_hlt_exits_disabled() {
        // No PV_UNHALT: only kernels that honour REALTIME first get native qspinlock.
        row(
            V4_19,
            dedicated_hlt_off(),
            Native,
            false,
            false,
            true,
            NotInKernel,
        );
        for line in [V5_10, V5_15, V6_1, V6_6, V6_12] {
            row(
                line,
                dedicated_hlt_off(),
                Tas,
                false,
                false,
                true,
                LoadedPollControl,
            );
        }
        row(
            Current,
            dedicated_hlt_off(),
            Native,
            false,
            false,
            true,
            LoadedPollControl,
        );
    }

    #[test]
    fn table_dedicated_hlt_exits_kept() {
        // PV_UNHALT next to REALTIME: native qspinlock on every line.
        row(
            V4_19,
            dedicated_hlt_on(),
            Native,
            false,
            false,
            true,
            NotInKernel,
        );
        for line in [V5_10, V5_15, V6_1, V6_6, V6_12, Current] {
            row(
                line,
                dedicated_hlt_on(),
                Native,
                false,
                false,
                true,
                LoadedPollControl,
            );
        }
    }

    #[test]
    fn table_shared_and_overcommitted() {
        row(V4_19, shared(), Pv, true, false, true, NotInKernel);
        for line in [V5_10, V5_15, V6_1, V6_6, V6_12, Current] {
            row(line, shared(), Pv, true, true, true, NotLoaded);
        }
    }

    #[test]
    fn table_old_plan_dedicated_without_poll_control() {
        // The plan before issue 12: no POLL_CONTROL on dedicated vCPUs.
        let old = view(PvFeatures::STEAL_TIME.union(PvFeatures::PV_SEND_IPI), true);
        for line in [V5_10, V5_15, V6_1, V6_6, V6_12, Current] {
            assert_eq!(
                guest_outcome(LinuxGuest::base(line), &old).haltpoll,
                LoadedNoPollControl
            );
        }
    }

    #[test]
    fn stable_backport_and_single_cpu_and_mwait() {
        let fixed = LinuxGuest {
            line: V6_6,
            realtime_fix: true,
        };
        assert_eq!(fixed.family(), GuestKernel::Modern);
        assert_eq!(LinuxGuest::base(V6_6).family(), GuestKernel::Legacy);
        assert_eq!(guest_outcome(fixed, &dedicated_hlt_off()).lock, Native);
        // One possible CPU: 5.10.13 still installs PV IPIs and TLB flush, 5.15 does not.
        let one = GuestCpuid {
            possible_cpus: 1,
            ..shared()
        };
        let o = guest_outcome(LinuxGuest::base(V5_10), &one);
        assert!(o.pv_send_ipi && o.pv_tlb_flush);
        assert_eq!(o.lock, Native);
        let o = guest_outcome(LinuxGuest::base(V5_15), &one);
        assert!(!o.pv_send_ipi && !o.pv_tlb_flush && !o.pv_sched_yield);
        // One CPU without PV_UNHALT: legacy keeps test-and-set, the fix gives native.
        let one_no_unhalt = GuestCpuid {
            pv_features: one.pv_features.difference(PvFeatures::PV_UNHALT),
            ..one
        };
        assert_eq!(
            guest_outcome(LinuxGuest::base(V6_1), &one_no_unhalt).lock,
            Tas
        );
        assert_eq!(
            guest_outcome(LinuxGuest::base(Current), &one_no_unhalt).lock,
            Native
        );
        // MWAIT in the guest's CPUID: 6.1 and later skip PV TLB flush and sched yield.
        let mwait = GuestCpuid {
            mwait: true,
            ..shared()
        };
        let o = guest_outcome(LinuxGuest::base(V5_15), &mwait);
        assert!(o.pv_tlb_flush && o.pv_sched_yield);
        let o = guest_outcome(LinuxGuest::base(V6_1), &mwait);
        assert!(!o.pv_tlb_flush && !o.pv_sched_yield && o.pv_send_ipi);
    }

    #[test]
    fn names_round_trip() {
        for g in GuestKernel::ALL {
            assert_eq!(g.name().parse::<GuestKernel>().unwrap(), g);
        }
        assert!("ancient".parse::<GuestKernel>().is_err());
        assert_eq!(KernelLine::ALL.len(), 7);
    }
}
