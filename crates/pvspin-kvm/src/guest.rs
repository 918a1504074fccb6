//! What a stock Linux guest does with the KVM CPUID it is given: the guest-kernel table of
//! `docs/stock-guests.md`, as a pure function ([`guest_outcome`]) tested row by row.
//!
//! Everything here was read from `arch/x86/kernel/kvm.c` (`kvm_spinlock_init`,
//! `kvm_smp_prepare_cpus`, `pv_tlb_flush_supported`, `pv_ipi_supported`,
//! `pv_sched_yield_supported`, `arch_haltpoll_enable`) and `drivers/cpuidle/cpuidle-haltpoll.c`
//! (`haltpoll_want`) of the kernel lines listed in [`KernelLine`]; `docs/stock-guests.md` says
//! which line was read from which tree and what is inferred rather than read.
//!
//! The one difference that matters for the plan ([`GuestKernel`]): what `REALTIME` without
//! `KVM_FEATURE_PV_UNHALT` gives. Three orders of the checks, read from the trees named in
//! `docs/stock-guests.md`:
//!
//! * **4.19 order**, upstream 4.19 through 5.8 (read: 4.19.0, 5.2, 5.4.214, 5.7.14, 5.8.1):
//!   `kvm_smp_prepare_cpus` turns `virt_spin_lock_key` off for `REALTIME` on its own, so the
//!   guest gets native qspinlock with or without `PV_UNHALT`.
//! * **legacy order**, from 5.9 (read: 5.9.1, 5.10.13, 5.15.85): the series that added
//!   `nopvspin` (commit 05eee619ed61, posted in October 2019) reverted 34226b6b7098 and moved
//!   the `REALTIME` check into `kvm_spinlock_init`, behind the `PV_UNHALT` check; it reached
//!   mainline in the 5.9 merge window (August 2020), not in 2019. `kvm_spinlock_init` returns
//!   early when `PV_UNHALT` is absent, *before* it looks at `REALTIME`, so the key stays on and
//!   the guest uses the unfair test-and-set lock even on dedicated vCPUs.
//! * **with 960550503965** ("x86/kvm: Prefer native qspinlock for dedicated vCPUs irrespective
//!   of PV_UNHALT"): `REALTIME` is checked first again. Mainline from 6.18 (the "x86/kvm: Guest
//!   side changes for 6.18" pull); stable from 6.12.58 and 6.17.8 (13 November 2025), 6.6.117
//!   (24 November 2025), 5.10.247, 5.15.197 and 6.1.159 (7 December 2025), per the release
//!   announcements' shortlogs.
//!
//! [`GuestKernel::from_release`] maps a release string onto these.

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
    /// Honours `REALTIME` only together with `PV_UNHALT` (the legacy order of
    /// `kvm_spinlock_init`): upstream 5.9 up to (not including) 960550503965, i.e. every 5.9 to
    /// 6.17 release except the stable releases with its backport (5.10.247, 5.15.197, 6.1.159,
    /// 6.6.117, 6.12.58, 6.17.8 and later in those lines).
    Legacy,
    /// Honours `REALTIME` irrespective of `PV_UNHALT`: kernels with 960550503965 (mainline from
    /// 6.18, and the stable releases with the backport), and upstream 4.19 to 5.8 (the 4.19
    /// order: `kvm_smp_prepare_cpus` turns the test-and-set lock off for `REALTIME`).
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

    /// The family of a Linux release, as `uname -r` or a kernel.org tag writes it:
    /// `MAJOR.MINOR[.PATCH]`, an optional leading `v`, and an optional suffix that starts with
    /// `-` or `+` (`-rc1`, `-amd64`, `-200.fc41.x86_64`, `-arch1-1`).
    ///
    /// | release | family | why |
    /// |---|---|---|
    /// | before 4.19 | `Unknown` | no vanilla tree older than 4.19 was read; RHEL 8's 4.18 kernels carry the legacy order (read from a RHEL 8 tree) |
    /// | 4.19 to 5.8 | `Modern` | the 4.19 order (read: 4.19.0, 5.2, 5.4.214, 5.7.14, 5.8.1) |
    /// | 4.19 to 5.8 with a suffix other than `-rcN` | `Unknown` | a distribution kernel may carry the 5.9 reorder (RHEL 8 does), and then it is legacy |
    /// | 5.9 to 6.17 | `Legacy` | the legacy order (read: 5.9.1, 5.10.13, 5.15.85) |
    /// | 5.10.247+, 5.15.197+, 6.1.159+, 6.6.117+, 6.12.58+, 6.17.8+ | `Modern` | the stable backport of 960550503965, from its first release in each line (release announcements) |
    /// | 6.18 and later, `-rc`s included | `Modern` | 960550503965 came in the 6.18 merge window |
    ///
    /// Stable lines other than those six never got the backport (they were closed before
    /// November 2025) and stay `Legacy`. A `-rcN` suffix is a release candidate of the release it
    /// names: `6.6.117-rc1` has the stable queue that became 6.6.117, `6.18-rc1` the merge
    /// window. A distribution names its kernel after its base release, not its backports:
    /// Debian's `6.1.0-18-amd64` or Ubuntu's `6.8.0-45-generic` read as 6.1.0 and 6.8.0, hence
    /// `Legacy` even when the distribution took the backport itself (the safe answer: the plan
    /// for `Legacy` is right for every kernel). Malformed input is an error naming the rule.
    pub fn from_release(release: &str) -> Result<GuestKernel, ReleaseError> {
        Ok(parse_release(release)?.family())
    }
}

/// Why [`GuestKernel::from_release`] refused a release string. Each message starts with `rule:`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
pub enum ReleaseError {
    /// rule: a kernel release is MAJOR.MINOR[.PATCH] with an optional suffix (e.g. 6.6.117,
    /// 6.18-rc1, 6.1.0-18-amd64); got an empty string
    Empty,
    /// rule: a kernel release starts with MAJOR.MINOR, two decimal numbers (e.g. 6.6.117);
    /// {release:?} does not
    NoMajorMinor {
        /// The release as given.
        release: String,
    },
    /// rule: each number of a kernel release fits in 32 bits; {release:?} has {number:?}
    NumberTooLarge {
        /// The release as given.
        release: String,
        /// The number that does not fit.
        number: String,
    },
    /// rule: what follows MAJOR.MINOR[.PATCH] in a kernel release starts with '-' or '+' (e.g.
    /// -rc1, -amd64, +); {release:?} has {suffix:?}
    BadSuffix {
        /// The release as given.
        release: String,
        /// What follows the numbers.
        suffix: String,
    },
}

/// The first stable release of each line that carries the backport of 960550503965, from the
/// release announcements' shortlogs: 6.12.58 and 6.17.8 (13 November 2025), 6.6.117
/// (24 November 2025), 5.10.247, 5.15.197 and 6.1.159 (7 December 2025). The releases before
/// them (6.12.57, 6.17.7, 6.6.116 of 2 November, 5.10.246 of 29 October) predate the patch's
/// entry into the stable queues (8 November 2025). 5.4 was queued too, but 5.4 has the 4.19
/// order anyway.
const REALTIME_FIX_BACKPORTS: [(u32, u32, u32); 6] = [
    (5, 10, 247),
    (5, 15, 197),
    (6, 1, 159),
    (6, 6, 117),
    (6, 12, 58),
    (6, 17, 8),
];

/// A Linux release reduced to what [`GuestKernel::from_release`] needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Release {
    major: u32,
    minor: u32,
    patch: u32,
    /// A suffix other than `-rcN` (a distribution's or builder's local version).
    local: bool,
}

impl Release {
    fn family(self) -> GuestKernel {
        let line = (self.major, self.minor);
        if line < (4, 19) {
            return GuestKernel::Unknown;
        }
        if line <= (5, 8) {
            return if self.local {
                GuestKernel::Unknown
            } else {
                GuestKernel::Modern
            };
        }
        if line >= (6, 18) {
            return GuestKernel::Modern;
        }
        let fixed = REALTIME_FIX_BACKPORTS
            .iter()
            .any(|&(major, minor, first)| line == (major, minor) && self.patch >= first);
        if fixed {
            GuestKernel::Modern
        } else {
            GuestKernel::Legacy
        }
    }
}

/// The leading decimal number of `s` and the rest (`None` when `s` does not start with a digit).
fn leading_number<'a>(s: &'a str, release: &str) -> Result<Option<(u32, &'a str)>, ReleaseError> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 {
        return Ok(None);
    }
    let (digits, rest) = s.split_at(end);
    let n = digits.parse().map_err(|_| ReleaseError::NumberTooLarge {
        release: release.to_string(),
        number: digits.to_string(),
    })?;
    Ok(Some((n, rest)))
}

fn parse_release(release: &str) -> Result<Release, ReleaseError> {
    let s = release.strip_prefix('v').unwrap_or(release);
    if s.is_empty() {
        return Err(ReleaseError::Empty);
    }
    let no_major_minor = || ReleaseError::NoMajorMinor {
        release: release.to_string(),
    };
    let (major, rest) = leading_number(s, release)?.ok_or_else(no_major_minor)?;
    let rest = rest.strip_prefix('.').ok_or_else(no_major_minor)?;
    let (minor, mut rest) = leading_number(rest, release)?.ok_or_else(no_major_minor)?;
    let mut patch = 0;
    if let Some(after_dot) = rest.strip_prefix('.') {
        if let Some((p, after)) = leading_number(after_dot, release)? {
            patch = p;
            rest = after;
        }
    }
    let local = match rest.chars().next() {
        None => false,
        Some('-' | '+') => {
            let rc_tail = rest
                .strip_prefix("-rc")
                .and_then(|t| leading_number(t, release).transpose());
            match rc_tail {
                Some(Ok((_, tail))) => !tail.is_empty(),
                Some(Err(e)) => return Err(e),
                None => true,
            }
        }
        Some(_) => {
            return Err(ReleaseError::BadSuffix {
                release: release.to_string(),
                suffix: rest.to_string(),
            })
        }
    };
    Ok(Release {
        major,
        minor,
        patch,
        local,
    })
}

impl fmt::Display for GuestKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// unknown guest kernel {0:?} (expected unknown, legacy or modern)
///
/// A name [`GuestKernel`]'s `FromStr` does not know; it holds the name given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub struct UnknownGuestKernel(pub String);

impl std::str::FromStr for GuestKernel {
    type Err = UnknownGuestKernel;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GuestKernel::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| UnknownGuestKernel(s.to_owned()))
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

/// One guest kernel: a line, whether it carries 960550503965 (always true for
/// [`KernelLine::Current`]; for the stable lines it depends on the point release; ignored for
/// 4.19, which behaves like a kernel with it), and whether it has the one-CPU check of the PV
/// TLB flush, sched yield and send-IPI setup (also a point-release matter for 5.15).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct LinuxGuest {
    /// The line.
    pub line: KernelLine,
    /// The stable backport of 960550503965 is in.
    pub realtime_fix: bool,
    /// `num_possible_cpus() != 1` in `pv_tlb_flush_supported`, `pv_ipi_supported` and
    /// `pv_sched_yield_supported` ("x86/kvm: Don't use pv tlb/ipi/sched_yield if on 1 vCPU"):
    /// mainline from 5.17, stable from 5.15.29 and 5.16.15 (release announcements of
    /// 16 March 2022); not in 5.10.106, released the same day (later 5.10 releases not checked).
    pub one_cpu_check: bool,
}

impl LinuxGuest {
    /// The base release of `line` (no stable backports; `Current` has the fix). Of the base
    /// releases, 6.1 and later have the one-CPU check, 4.19, 5.10 and 5.15.0 do not.
    pub fn base(line: KernelLine) -> LinuxGuest {
        LinuxGuest {
            line,
            realtime_fix: line == KernelLine::Current,
            one_cpu_check: !matches!(
                line,
                KernelLine::V4_19 | KernelLine::V5_10 | KernelLine::V5_15
            ),
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
        // Legacy order (5.9 until 960550503965): PV_UNHALT first (return, key on), then
        // REALTIME and one CPU (goto out: key off).
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
    // The MWAIT check ("x86/kvm: Don't use PV TLB/yield when mwait is advertised") came in
    // 5.17-rc7; 5.15.85 does not have it. The one-CPU check is per point release.
    let mwait_checked = !matches!(
        line,
        KernelLine::V4_19 | KernelLine::V5_10 | KernelLine::V5_15
    );
    let multi_ok = !kernel.one_cpu_check || !single;
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
            realtime_fix: true,
            ..LinuxGuest::base(V6_6)
        };
        assert_eq!(fixed.family(), GuestKernel::Modern);
        assert_eq!(LinuxGuest::base(V6_6).family(), GuestKernel::Legacy);
        assert_eq!(guest_outcome(fixed, &dedicated_hlt_off()).lock, Native);
        // One possible CPU: 5.10.13 and 5.15.0 still install PV IPIs and TLB flush, 5.15.29
        // and 6.1 do not.
        let one = GuestCpuid {
            possible_cpus: 1,
            ..shared()
        };
        for line in [V5_10, V5_15] {
            let o = guest_outcome(LinuxGuest::base(line), &one);
            assert!(
                o.pv_send_ipi && o.pv_tlb_flush && o.pv_sched_yield,
                "{line:?}"
            );
            assert_eq!(o.lock, Native);
        }
        let v5_15_29 = LinuxGuest {
            one_cpu_check: true,
            ..LinuxGuest::base(V5_15)
        };
        for kernel in [v5_15_29, LinuxGuest::base(V6_1)] {
            let o = guest_outcome(kernel, &one);
            assert!(!o.pv_send_ipi && !o.pv_tlb_flush && !o.pv_sched_yield);
        }
        // With four CPUs the check changes nothing.
        assert_eq!(
            guest_outcome(v5_15_29, &shared()),
            guest_outcome(LinuxGuest::base(V5_15), &shared())
        );
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
        // MWAIT in the guest's CPUID: 5.17 and later (so 6.1 on) skip PV TLB flush and sched
        // yield; 5.15 (5.15.85 read) does not check.
        let mwait = GuestCpuid {
            mwait: true,
            ..shared()
        };
        let o = guest_outcome(LinuxGuest::base(V5_15), &mwait);
        assert!(o.pv_tlb_flush && o.pv_sched_yield);
        let o = guest_outcome(LinuxGuest::base(V6_1), &mwait);
        assert!(!o.pv_tlb_flush && !o.pv_sched_yield && o.pv_send_ipi);
    }

    fn family(release: &str) -> GuestKernel {
        GuestKernel::from_release(release).unwrap_or_else(|e| panic!("{release}: {e}"))
    }

    use GuestKernel::{Legacy, Modern, Unknown};

    #[test]
    fn release_4_19_order_boundaries() {
        // Below 4.19: not vouched for (RHEL 8's 4.18 has the legacy order).
        for r in [
            "4.18",
            "4.18.20",
            "4.14.336",
            "3.10.0",
            "4.18.0-553.el8_10.x86_64",
        ] {
            assert_eq!(family(r), Unknown, "{r}");
        }
        // 4.19 to 5.8: the 4.19 order.
        for r in [
            "4.19", "4.19.0", "4.19.1", "4.19.325", "5.4.214", "5.8", "5.8.18",
        ] {
            assert_eq!(family(r), Modern, "{r}");
        }
        // ... unless a distribution suffix says the kernel may carry backports.
        for r in ["4.19.0-27-amd64", "5.4.0-150-generic", "5.8.18+"] {
            assert_eq!(family(r), Unknown, "{r}");
        }
        // Release candidates are no distribution kernels.
        assert_eq!(family("4.19-rc1"), Modern);
        assert_eq!(family("5.8.1-rc1"), Modern);
        // 5.9: the legacy order, from the merge window on.
        for r in ["5.9-rc1", "5.9", "5.9.0", "5.9.1", "5.9.16"] {
            assert_eq!(family(r), Legacy, "{r}");
        }
    }

    #[test]
    fn release_stable_backport_boundaries() {
        for (line, first) in [
            ("5.10", 247),
            ("5.15", 197),
            ("6.1", 159),
            ("6.6", 117),
            ("6.12", 58),
            ("6.17", 8),
        ] {
            assert_eq!(family(line), Legacy, "{line}");
            assert_eq!(family(&format!("{line}.0")), Legacy, "{line}.0");
            assert_eq!(family(&format!("{line}.{}", first - 1)), Legacy, "{line}");
            assert_eq!(family(&format!("{line}.{first}")), Modern, "{line}");
            assert_eq!(family(&format!("{line}.{}", first + 1)), Modern, "{line}");
            assert_eq!(family(&format!("{line}.{first}-rc1")), Modern, "{line}");
            assert_eq!(family(&format!("{line}.{first}-amd64")), Modern, "{line}");
        }
        // Lines that were closed before the backport.
        for r in [
            "5.11.22", "5.14.21", "5.16.20", "5.19.17", "6.2.16", "6.5.13", "6.8.12",
        ] {
            assert_eq!(family(r), Legacy, "{r}");
        }
        for r in [
            "6.9.12", "6.11.11", "6.13.12", "6.14.11", "6.15.11", "6.16.12",
        ] {
            assert_eq!(family(r), Legacy, "{r}");
        }
        // Distribution kernels named after their base release read as that release.
        assert_eq!(family("6.1.0-18-amd64"), Legacy);
        assert_eq!(family("6.8.0-45-generic"), Legacy);
        assert_eq!(family("6.17.8-arch1-1"), Modern);
        assert_eq!(family("6.12.58-200.fc41.x86_64"), Modern);
        assert_eq!(family("v6.6.117"), Modern);
    }

    #[test]
    fn release_mainline_6_18_boundary() {
        assert_eq!(family("6.17"), Legacy);
        assert_eq!(family("6.17.7"), Legacy);
        for r in [
            "6.18-rc1", "6.18", "6.18.0", "6.18.1", "6.19", "7.0", "7.2-rc3",
        ] {
            assert_eq!(family(r), Modern, "{r}");
        }
    }

    #[test]
    fn release_bad_inputs_name_the_rule() {
        use ReleaseError::*;
        assert_eq!(GuestKernel::from_release(""), Err(Empty));
        assert_eq!(GuestKernel::from_release("v"), Err(Empty));
        for r in ["6", "6-rc1", "six.one", "6.", ".6.1", "6.x", " 6.1", "-6.1"] {
            assert_eq!(
                GuestKernel::from_release(r),
                Err(NoMajorMinor {
                    release: r.to_string()
                }),
                "{r}"
            );
        }
        for (r, suffix) in [
            ("6.1.", "."),
            ("6.1.x", ".x"),
            ("6.1_foo", "_foo"),
            ("6.1.0.1", ".1"),
            ("6.1 ", " "),
            ("6.6.117amd64", "amd64"),
        ] {
            assert_eq!(
                GuestKernel::from_release(r),
                Err(BadSuffix {
                    release: r.to_string(),
                    suffix: suffix.to_string()
                }),
                "{r}"
            );
        }
        for (r, number) in [
            ("99999999999.1", "99999999999"),
            ("6.99999999999", "99999999999"),
            ("6.1.99999999999", "99999999999"),
            ("6.18-rc99999999999", "99999999999"),
        ] {
            assert_eq!(
                GuestKernel::from_release(r),
                Err(NumberTooLarge {
                    release: r.to_string(),
                    number: number.to_string()
                }),
                "{r}"
            );
        }
        for r in ["", "6", "6.1_foo", "6.99999999999"] {
            let e = GuestKernel::from_release(r).unwrap_err();
            assert!(e.to_string().starts_with("rule: "), "{e}");
        }
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
