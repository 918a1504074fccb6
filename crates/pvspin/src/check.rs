//! Adopter mistakes that can only show at run time (or through a check the VMM calls):
//! counted, logged once each, listed by [`crate::PvSpin::check`] and carried in
//! [`crate::PvSpin::telemetry`] ([`crate::VmTelemetry::problems`]).
//!
//! Mistakes pvspin can see at setup are refused there instead, each with an error naming its
//! rule (`docs/embedding.md`, "Adopter's mistakes", has the whole table).
//!
//! Cost: nothing here is on the per-run hot path once every vCPU is configured. Until then
//! [`crate::VcpuHooks::before_run`] reads one flag per run (a local `bool` afterwards); a kick
//! that reaches userspace reads one relaxed flag before all vCPUs are configured and nothing
//! after; everything else is counted on paths that are already failures (an unattributed
//! doorbell access, a kick that missed its ioeventfd or reached nobody).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use pvspin_kick::{Delivery, KickPath, KickStats};
use serde::Serialize;

/// A kind of adopter mistake pvspin found while the VM ran ([`Problem`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    /// A routing table given to [`crate::PvSpin::check_routes`] lacked or changed pvspin's kick
    /// routes (in-kernel path: kicks wake nobody, the guest hangs).
    KickRoutesMissing,
    /// vCPUs ran while these never went through [`crate::PvSpin::configure_vcpu`].
    VcpusNotConfigured,
    /// Runs (`before_run`) made before every vCPU was configured.
    RunsBeforeAllConfigured,
    /// Kicks naming a vCPU that was not configured.
    KicksToUnconfiguredVcpu,
    /// Doorbell accesses on a thread without vCPU hooks ([`crate::DoorbellPio`]), ignored.
    DoorbellWithoutHooks,
    /// In-kernel path: valid kicks their ioeventfd did not catch (they exited to userspace).
    KicksMissedIoeventfd,
    /// MSI paths: kick MSIs KVM delivered to no vCPU.
    KicksReachedNobody,
    /// MSI paths: `KVM_SIGNAL_MSI` failed for a kick.
    KickMsiFailed,
    /// The interrupter's signal is (or was) handled by someone else too.
    InterruptSignalShared,
}

impl ProblemKind {
    /// Every kind, in the order [`crate::PvSpin::check`] lists them.
    pub const ALL: [ProblemKind; 9] = [
        ProblemKind::KickRoutesMissing,
        ProblemKind::VcpusNotConfigured,
        ProblemKind::RunsBeforeAllConfigured,
        ProblemKind::KicksToUnconfiguredVcpu,
        ProblemKind::DoorbellWithoutHooks,
        ProblemKind::KicksMissedIoeventfd,
        ProblemKind::KicksReachedNobody,
        ProblemKind::KickMsiFailed,
        ProblemKind::InterruptSignalShared,
    ];

    /// A short stable name (telemetry label `problem`).
    pub const fn name(self) -> &'static str {
        match self {
            ProblemKind::KickRoutesMissing => "kick_routes_missing",
            ProblemKind::VcpusNotConfigured => "vcpus_not_configured",
            ProblemKind::RunsBeforeAllConfigured => "runs_before_all_configured",
            ProblemKind::KicksToUnconfiguredVcpu => "kicks_to_unconfigured_vcpu",
            ProblemKind::DoorbellWithoutHooks => "doorbell_without_hooks",
            ProblemKind::KicksMissedIoeventfd => "kicks_missed_ioeventfd",
            ProblemKind::KicksReachedNobody => "kicks_reached_nobody",
            ProblemKind::KickMsiFailed => "kick_msi_failed",
            ProblemKind::InterruptSignalShared => "interrupt_signal_shared",
        }
    }

    /// The rule the VMM broke, and what breaking it does.
    pub const fn rule(self) -> &'static str {
        match self {
            ProblemKind::KickRoutesMissing => {
                "rule: every GSI routing table the VMM applies keeps pvspin's kick routes \
                 (KickWiring::routes; KVM_SET_GSI_ROUTING replaces the whole table): without \
                 them an in-kernel kick wakes nobody and the guest hangs. Call \
                 PvSpin::check_routes with each table the VMM applies"
            }
            ProblemKind::VcpusNotConfigured => {
                "rule: every vCPU goes through PvSpin::configure_vcpu before any vCPU runs: an \
                 unconfigured vCPU's exits never reach pvspin (userspace path: its halts are \
                 not parked and kicks to it only latch, so it runs far slower), and on the \
                 in-kernel and signal-msi paths KVM's APIC-ID map is never rebuilt, so kicks \
                 to some vCPUs reach nobody and the guest hangs"
            }
            ProblemKind::RunsBeforeAllConfigured => {
                "rule: configure every vCPU (PvSpin::configure_vcpu) before the first KVM_RUN \
                 of any: until the last one is configured, KVM's APIC-ID map may miss vCPUs \
                 (kicks to them reach nobody) and an unconfigured vCPU's exits never reach \
                 pvspin"
            }
            ProblemKind::KicksToUnconfiguredVcpu => {
                "rule: a vCPU the guest kicks has gone through PvSpin::configure_vcpu: a kick to \
                 one that has not is latched for a thread that never parks on it (userspace \
                 path) or sent to a LAPIC KVM may not find yet (signal-msi path)"
            }
            ProblemKind::DoorbellWithoutHooks => {
                "rule: the VMM's port-I/O bus dispatches pvspin's doorbell (PvSpin::doorbell_pio) \
                 on the vCPU's own thread, between VcpuHooks::before_run and after_run: an \
                 access from another thread is ignored, so its kicks wake nobody (signal-msi and \
                 userspace paths hang), its WAITs do not wait and its reads return all ones"
            }
            ProblemKind::KicksMissedIoeventfd => {
                "rule: the in-kernel path's kick ioeventfds stay registered as \
                 KickWiring::ioevents gives them (4-byte datamatch = the target's index; a u64 \
                 datamatch makes an 8-byte ioeventfd that never matches): a kick that misses \
                 exits to userspace and pvspin delivers it by KVM_SIGNAL_MSI, an exit per kick"
            }
            ProblemKind::KicksReachedNobody => {
                "rule: vCPU i is KVM vCPU id i (KVM_CREATE_VCPU sets its APIC ID, which the \
                 kick's MSI addresses) and every vCPU is configured before the first KVM_RUN \
                 (the last configure_vcpu rebuilds KVM's APIC-ID map): a kick MSI that reaches \
                 nobody leaves its target halted"
            }
            ProblemKind::KickMsiFailed => {
                "rule: the vCPU threads may call KVM_SIGNAL_MSI (their seccomp filter includes \
                 pvspin::seccomp::rules(ThreadKind::Vcpu)): a kick whose MSI failed leaves its \
                 target halted; the log has KVM's error"
            }
            ProblemKind::InterruptSignalShared => {
                "rule: SignalInterrupter's signal is pvspin's alone (SignalInterrupter::with_signal \
                 picks another): a process has one handler per signal, the last one installed \
                 wins, and Firecracker, Cloud Hypervisor and crosvm kick their vCPUs with \
                 SIGRTMIN; with the other handler, an interrupt that arrives outside KVM_RUN is \
                 lost"
            }
        }
    }
}

/// One adopter mistake pvspin found so far ([`crate::PvSpin::check`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// What.
    pub kind: ProblemKind,
    /// How often it happened (events: runs, kicks, accesses, failed route checks; for
    /// [`ProblemKind::VcpusNotConfigured`] the number of such vCPUs).
    pub count: u64,
    /// The vCPUs it concerns, where pvspin knows them (in index order).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vcpus: Vec<u32>,
    /// The signal, for [`ProblemKind::InterruptSignalShared`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The rule broken ([`ProblemKind::rule`]).
    pub rule: &'static str,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (x{}", self.kind.name(), self.count)?;
        if !self.vcpus.is_empty() {
            write!(f, ", vCPUs {:?}", self.vcpus)?;
        }
        if let Some(signal) = self.signal {
            write!(f, ", signal {signal}")?;
        }
        write!(f, "): {}", self.rule)
    }
}

/// What pvspin knows about how it was adopted, shared by the [`crate::PvSpin`], every vCPU's
/// hooks and the bus device.
#[derive(Debug)]
pub(crate) struct Adoption {
    /// Per vCPU: `configure_vcpu` succeeded.
    configured: Box<[AtomicBool]>,
    configured_count: AtomicUsize,
    /// Every vCPU is configured.
    all_configured: AtomicBool,
    kicks_to_unconfigured: AtomicU64,
    unattributed_doorbell: AtomicU64,
    route_checks_failed: AtomicU64,
    /// The vCPUs whose routes the last failing route check missed.
    route_faults: Mutex<Vec<u32>>,
    /// Per vCPU: a kick to it missed its ioeventfd (in-kernel path).
    missed_ioeventfd: Box<[AtomicBool]>,
    /// Per vCPU: a kick MSI to it reached nobody.
    reached_nobody: Box<[AtomicBool]>,
    /// Per vCPU: runs made before every vCPU was configured.
    early_runs: Box<[AtomicU64]>,
    /// Per kind: logged already.
    logged: [AtomicBool; ProblemKind::ALL.len()],
}

impl Default for Adoption {
    /// No vCPUs, nothing missing.
    fn default() -> Self {
        Self::complete(0)
    }
}

fn flags(n: usize) -> Box<[AtomicBool]> {
    (0..n).map(|_| AtomicBool::new(false)).collect()
}

fn set_indexes(flags: &[AtomicBool]) -> Vec<u32> {
    (0u32..)
        .zip(flags)
        .filter(|(_, f)| f.load(Ordering::Relaxed))
        .map(|(i, _)| i)
        .collect()
}

impl Adoption {
    /// Nothing configured yet.
    pub(crate) fn new(vcpus: usize) -> Self {
        Self {
            configured: flags(vcpus),
            configured_count: AtomicUsize::new(0),
            all_configured: AtomicBool::new(false),
            kicks_to_unconfigured: AtomicU64::new(0),
            unattributed_doorbell: AtomicU64::new(0),
            route_checks_failed: AtomicU64::new(0),
            route_faults: Mutex::new(Vec::new()),
            missed_ioeventfd: flags(vcpus),
            reached_nobody: flags(vcpus),
            early_runs: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            logged: std::array::from_fn(|_| AtomicBool::new(false)),
        }
    }

    /// Every vCPU configured (hooks made without a `PvSpin`, in unit tests).
    pub(crate) fn complete(vcpus: usize) -> Self {
        let me = Self::new(vcpus);
        for i in 0..vcpus {
            me.mark_configured(i);
        }
        me.all_configured.store(true, Ordering::Release);
        me
    }

    /// Marks vCPU `index` configured (once: `false` if it already was); returns whether it
    /// was the last.
    pub(crate) fn mark_configured(&self, index: usize) -> Option<bool> {
        let flag = self.configured.get(index)?;
        if flag.swap(true, Ordering::AcqRel) {
            return None;
        }
        let done = self.configured_count.fetch_add(1, Ordering::AcqRel) + 1;
        let last = done == self.configured.len();
        if last {
            self.all_configured.store(true, Ordering::Release);
        }
        Some(last)
    }

    pub(crate) fn is_configured(&self, index: usize) -> bool {
        self.configured
            .get(index)
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    pub(crate) fn all_configured(&self) -> bool {
        self.all_configured.load(Ordering::Acquire)
    }

    fn unconfigured(&self) -> Vec<u32> {
        (0u32..)
            .zip(self.configured.iter())
            .filter(|(_, f)| !f.load(Ordering::Acquire))
            .map(|(i, _)| i)
            .collect()
    }

    /// Logs `kind` the first time it is seen, with `what` happened.
    fn log_once(&self, kind: ProblemKind, what: fmt::Arguments<'_>) {
        let logged = &self.logged[ProblemKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or_default()];
        if !logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "pvspin: {what}; {}. Counted in PvSpin::telemetry(), listed by \
                 PvSpin::check() as {} (logged once)",
                kind.rule(),
                kind.name()
            );
        }
    }

    /// vCPU `index` is about to run while some vCPU is not configured.
    pub(crate) fn run_before_all_configured(&self, index: usize) {
        if let Some(c) = self.early_runs.get(index) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.log_once(
            ProblemKind::RunsBeforeAllConfigured,
            format_args!(
                "vCPU {index} runs while vCPUs {:?} have not gone through \
                 PvSpin::configure_vcpu",
                self.unconfigured()
            ),
        );
    }

    /// The hooks saw a kick of `target` on `path` and what its delivery did.
    pub(crate) fn on_kick(&self, path: KickPath, target: u32, delivery: Delivery) {
        let index = target as usize;
        if !self.all_configured.load(Ordering::Relaxed) && !self.is_configured(index) {
            self.kicks_to_unconfigured.fetch_add(1, Ordering::Relaxed);
            self.log_once(
                ProblemKind::KicksToUnconfiguredVcpu,
                format_args!("the guest kicked vCPU {target}, which is not configured"),
            );
        }
        if path == KickPath::InKernel {
            // A valid kick reaches userspace on the in-kernel path only when its ioeventfd
            // missed it (the device logs the cause, rate-limited).
            if let Some(f) = self.missed_ioeventfd.get(index) {
                f.store(true, Ordering::Relaxed);
            }
        }
        if delivery == Delivery::MsiNotDelivered {
            if let Some(f) = self.reached_nobody.get(index) {
                f.store(true, Ordering::Relaxed);
            }
        }
    }

    /// A doorbell access on a thread without vCPU hooks.
    pub(crate) fn unattributed_doorbell(&self) {
        self.unattributed_doorbell.fetch_add(1, Ordering::Relaxed);
        self.log_once(
            ProblemKind::DoorbellWithoutHooks,
            format_args!("a doorbell access on a thread without vCPU hooks was ignored"),
        );
    }

    pub(crate) fn unattributed_doorbell_count(&self) -> u64 {
        self.unattributed_doorbell.load(Ordering::Relaxed)
    }

    /// A route check found the routes of `vcpus` missing or changed.
    pub(crate) fn route_check_failed(&self, vcpus: Vec<u32>) {
        self.route_checks_failed.fetch_add(1, Ordering::Relaxed);
        self.log_once(
            ProblemKind::KickRoutesMissing,
            format_args!("the VMM's GSI routing table lacks the kick routes of vCPUs {vcpus:?}"),
        );
        *self
            .route_faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = vcpus;
    }

    /// vCPU `index`'s runs made before every vCPU was configured.
    pub(crate) fn early_runs(&self, index: usize) -> u64 {
        self.early_runs
            .get(index)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The problems found so far: what this records, the kick device's failure counters
    /// (`kick`) and the interrupter's signal (`signal_shared`).
    pub(crate) fn problems(
        &self,
        kick: Option<&KickStats>,
        signal_shared: Option<i32>,
    ) -> Vec<Problem> {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = Vec::new();
        let mut add = |kind: ProblemKind, count: u64, vcpus: Vec<u32>| {
            if count > 0 {
                out.push(Problem {
                    kind,
                    count,
                    vcpus,
                    signal: None,
                    rule: kind.rule(),
                });
            }
        };
        add(
            ProblemKind::KickRoutesMissing,
            ld(&self.route_checks_failed),
            self.route_faults
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        );
        let early = self.early_runs.iter().map(ld).sum::<u64>();
        if early > 0 && !self.all_configured() {
            let missing = self.unconfigured();
            add(
                ProblemKind::VcpusNotConfigured,
                missing.len() as u64,
                missing,
            );
        }
        let ran_early = (0u32..)
            .zip(self.early_runs.iter())
            .filter(|(_, c)| ld(c) > 0)
            .map(|(i, _)| i)
            .collect();
        add(ProblemKind::RunsBeforeAllConfigured, early, ran_early);
        add(
            ProblemKind::KicksToUnconfiguredVcpu,
            ld(&self.kicks_to_unconfigured),
            Vec::new(),
        );
        add(
            ProblemKind::DoorbellWithoutHooks,
            ld(&self.unattributed_doorbell),
            Vec::new(),
        );
        if let Some(k) = kick {
            add(
                ProblemKind::KicksMissedIoeventfd,
                k.in_kernel_missed,
                set_indexes(&self.missed_ioeventfd),
            );
            add(
                ProblemKind::KicksReachedNobody,
                k.msi_not_delivered,
                set_indexes(&self.reached_nobody),
            );
            add(ProblemKind::KickMsiFailed, k.msi_failed, Vec::new());
        }
        if let Some(signal) = signal_shared {
            let kind = ProblemKind::InterruptSignalShared;
            out.push(Problem {
                kind,
                count: 1,
                vcpus: Vec::new(),
                signal: Some(signal),
                rule: kind.rule(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_listed_with_their_rule_only_when_seen() {
        let a = Adoption::new(3);
        assert!(a.problems(None, None).is_empty());
        assert_eq!(a.mark_configured(0), Some(false));
        assert_eq!(a.mark_configured(0), None, "once");
        a.run_before_all_configured(0);
        a.run_before_all_configured(0);
        a.on_kick(KickPath::Userspace, 2, Delivery::MsiDelivered);
        a.on_kick(KickPath::Userspace, 0, Delivery::MsiDelivered);
        a.unattributed_doorbell();
        let p = a.problems(None, None);
        let kinds: Vec<_> = p.iter().map(|p| p.kind).collect();
        assert_eq!(
            kinds,
            [
                ProblemKind::VcpusNotConfigured,
                ProblemKind::RunsBeforeAllConfigured,
                ProblemKind::KicksToUnconfiguredVcpu,
                ProblemKind::DoorbellWithoutHooks
            ]
        );
        assert_eq!((p[0].count, p[0].vcpus.clone()), (2, vec![1, 2]));
        assert_eq!((p[1].count, p[1].vcpus.clone()), (2, vec![0]));
        assert_eq!(p[2].count, 1);
        assert!(p.iter().all(|p| p.rule.starts_with("rule: ")));
        assert!(p[0]
            .to_string()
            .starts_with("vcpus_not_configured (x2, vCPUs [1, 2]): rule:"));
        // Once all are configured the missing vCPUs are gone; what happened stays counted.
        assert_eq!(a.mark_configured(1), Some(false));
        assert_eq!(a.mark_configured(2), Some(true));
        let kinds: Vec<_> = a.problems(None, None).iter().map(|p| p.kind).collect();
        assert!(!kinds.contains(&ProblemKind::VcpusNotConfigured));
        assert!(kinds.contains(&ProblemKind::RunsBeforeAllConfigured));
        // The device's failure counters, with the targets the hooks saw.
        a.on_kick(KickPath::InKernel, 1, Delivery::MsiNotDelivered);
        let stats = KickStats {
            in_kernel_missed: 1,
            msi_not_delivered: 1,
            ..KickStats::default()
        };
        let p = a.problems(Some(&stats), Some(40));
        let missed = p
            .iter()
            .find(|p| p.kind == ProblemKind::KicksMissedIoeventfd)
            .unwrap();
        assert_eq!(missed.vcpus, [1]);
        let nobody = p
            .iter()
            .find(|p| p.kind == ProblemKind::KicksReachedNobody)
            .unwrap();
        assert_eq!(nobody.vcpus, [1]);
        assert!(p
            .iter()
            .any(|p| p.kind == ProblemKind::InterruptSignalShared && p.signal == Some(40)));
        // Names are distinct.
        let mut names: Vec<_> = ProblemKind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ProblemKind::ALL.len());
    }
}
