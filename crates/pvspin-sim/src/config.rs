//! What to simulate: the host, the VMs, their workload and pvspin's variant, and the rules an
//! invalid configuration breaks.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use crate::cost::CostModel;

/// Invalid configuration; each names the rule.
#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    /// Rule: a variant is `LOCK:PV[/slots][:PATH][@GUEST]`.
    #[error("rule: a variant is LOCK:PV[/slots][:PATH][@GUEST] (e.g. queued:kick/slots:in-kernel@stock), got {0:?}")]
    Variant(
        /// The variant as the user typed it.
        String,
    ),
    /// Rule: slots, paths and guests other than pvspin need `--pv kick` or `kick+yield`.
    #[error("rule: {0} needs pv kick or kick+yield")]
    NeedsPv(&'static str),
    /// Rule: the stock guest runs the queued lock with `kick`, on in-kernel or signal-msi.
    #[error("rule: the stock guest runs queued:kick on the in-kernel or signal-msi path, got {0}")]
    Stock(
        /// The variant as the user typed it.
        String,
    ),
    /// Rule: the TAS lock has no PV version.
    #[error("rule: the tas lock has no PV version (tas:off only)")]
    TasPv,
    /// Rule: at least one host CPU, VM and vCPU.
    #[error("rule: at least one host CPU, one VM and one vCPU per VM")]
    Empty,
    /// Rule: at most 4096 host CPUs and 4096 vCPUs per VM (the board's limit is 65535).
    #[error("rule: at most 4096 host CPUs and 4096 vCPUs per VM")]
    TooBig,
    /// Rule: a run ends by iterations or by a duration, and has one of them.
    #[error("rule: give iterations per vCPU or a duration, and not zero")]
    NoEnd,
    /// Rule: a CPU limit is more than 0 and at most the host's CPUs.
    #[error("rule: a VM's CPU limit must be in (0, host CPUs], got {0}")]
    CpuLimit(f64),
    /// Rule: the pre-wake is at most the guest's `SpinConfig::MAX_PREWAKE` waiters deep.
    #[error("rule: prewake ({0}) must be at most pvspin-guest's SpinConfig::MAX_PREWAKE ({max})", max = pvspin_guest::SpinConfig::MAX_PREWAKE)]
    PrewakeTooDeep(
        /// The depth asked for.
        u8,
    ),
    /// Rule: run slots are at most the vCPUs per VM.
    #[error("rule: run slots ({slots}) must be at most the vCPUs per VM ({vcpus})")]
    Slots {
        /// Slots asked for.
        slots: usize,
        /// vCPUs per VM.
        vcpus: usize,
    },
}

/// The guest's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LockKind {
    /// Fair FIFO ticket lock (`PvTicketLock` with PV).
    Ticket,
    /// Unfair test-and-test-and-set lock.
    Tas,
    /// MCS queued lock (`PvQueuedLock` with PV; Linux's pv qspinlock for the stock guest).
    Queued,
    /// Ticket lock whose waiters back off in proportion to their place in the queue, with an
    /// auto-tuned unit (`BackoffTicketLock`; `PvBackoffTicketLock` with PV).
    Backoff,
}

/// Paravirtual mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PvMode {
    /// Plain spinning.
    Off,
    /// Waiters wait past their budget, the unlocker kicks.
    Kick,
    /// As `Kick`, and the host boosts the vCPU a WAIT names (directed yield).
    KickYield,
}

/// How a kick reaches a halted vCPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KickPath {
    /// ioeventfd + irqfd: no exit for the kicker, the waiter halts inside KVM.
    InKernel,
    /// The kicker exits, the VMM sends the MSI; the waiter halts inside KVM.
    SignalMsi,
    /// No in-kernel LAPIC: the kicker exits, the waiter's thread parks in the VMM.
    Userspace,
}

impl KickPath {
    /// Index into per-path cost tables.
    pub fn index(self) -> usize {
        match self {
            KickPath::InKernel => 0,
            KickPath::SignalMsi => 1,
            KickPath::Userspace => 2,
        }
    }

    /// Whether the waiter halts inside KVM (the halt watcher sees it).
    pub fn halts_in_kvm(self) -> bool {
        self != KickPath::Userspace
    }
}

/// What the guest is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guest {
    /// pvspin-aware: time budgets, hint pages, notifications naming the waited-for vCPU.
    Pvspin,
    /// A stock Linux guest: pv qspinlock, fixed spin threshold, `pv_wait_early` on the
    /// steal-time `preempted` byte, the hybrid unfair trylock ([`SimConfig::stock_hybrid_trylock`]).
    Stock,
}

/// One variant, as `pvspin-vmm bench --variants` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// The lock.
    pub lock: LockKind,
    /// PV mode.
    pub pv: PvMode,
    /// Run slots on.
    pub slots: bool,
    /// Kick path.
    pub path: KickPath,
    /// Guest kind.
    pub guest: Guest,
}

impl FromStr for Variant {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let bad = || ConfigError::Variant(s.to_string());
        let (body, guest) = match s.split_once('@') {
            Some((b, "pvspin")) => (b, Guest::Pvspin),
            Some((b, "stock")) => (b, Guest::Stock),
            Some(_) => return Err(bad()),
            None => (s, Guest::Pvspin),
        };
        let mut parts = body.split(':');
        let lock = match parts.next() {
            Some("ticket") => LockKind::Ticket,
            Some("tas") => LockKind::Tas,
            Some("queued") => LockKind::Queued,
            Some("backoff") => LockKind::Backoff,
            _ => return Err(bad()),
        };
        let pv_part = parts.next().unwrap_or("off");
        let (pv_name, slots) = match pv_part.split_once('/') {
            Some((p, "slots")) => (p, true),
            Some(_) => return Err(bad()),
            None => (pv_part, false),
        };
        let pv = match pv_name {
            "off" => PvMode::Off,
            "kick" => PvMode::Kick,
            "kick+yield" => PvMode::KickYield,
            _ => return Err(bad()),
        };
        let path = match parts.next() {
            None | Some("in-kernel") => KickPath::InKernel,
            Some("signal-msi") => KickPath::SignalMsi,
            Some("userspace") => KickPath::Userspace,
            Some(_) => return Err(bad()),
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        let v = Variant {
            lock,
            pv,
            slots,
            path,
            guest,
        };
        v.validate()?;
        Ok(v)
    }
}

impl Variant {
    /// Checks the rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.pv == PvMode::Off {
            if self.slots {
                return Err(ConfigError::NeedsPv("run slots"));
            }
            if self.guest == Guest::Stock {
                return Err(ConfigError::NeedsPv("the stock guest"));
            }
        }
        if self.lock == LockKind::Tas && self.pv != PvMode::Off {
            return Err(ConfigError::TasPv);
        }
        if self.guest == Guest::Stock
            && (self.lock != LockKind::Queued
                || self.pv != PvMode::Kick
                || self.path == KickPath::Userspace)
        {
            return Err(ConfigError::Stock(self.to_string()));
        }
        Ok(())
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lock = match self.lock {
            LockKind::Ticket => "ticket",
            LockKind::Tas => "tas",
            LockKind::Queued => "queued",
            LockKind::Backoff => "backoff",
        };
        let pv = match self.pv {
            PvMode::Off => "off",
            PvMode::Kick => "kick",
            PvMode::KickYield => "kick+yield",
        };
        write!(f, "{lock}:{pv}")?;
        if self.slots {
            write!(f, "/slots")?;
        }
        if self.pv != PvMode::Off {
            let path = match self.path {
                KickPath::InKernel => "in-kernel",
                KickPath::SignalMsi => "signal-msi",
                KickPath::Userspace => "userspace",
            };
            write!(f, ":{path}")?;
        }
        if self.guest == Guest::Stock {
            write!(f, "@stock")?;
        }
        Ok(())
    }
}

/// One simulation.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Host CPUs.
    pub host_cpus: usize,
    /// VMs, each with `vcpus` vCPUs and its own lock.
    pub vms: usize,
    /// vCPUs per VM.
    pub vcpus: usize,
    /// Always-runnable host threads beside the VMs.
    pub hogs: usize,
    /// The variant every VM runs.
    pub variant: Variant,
    /// Work units inside a critical section.
    pub cs_work: u64,
    /// Work units between critical sections.
    pub ncs_work: u64,
    /// Acquisitions per vCPU, when the run ends by iterations.
    pub iterations: Option<u64>,
    /// Simulated nanoseconds, when the run ends by time.
    pub duration_ns: Option<u64>,
    /// Stop here even if unfinished (the bench's `--timeout-ms`).
    pub bound_ns: u64,
    /// Each VM's CPU limit in CPUs (its own cgroup with `cpu.max` quota/period).
    pub cpu_limit: Option<f64>,
    /// The quota period (cgroup v2 default 100 ms).
    pub quota_period_ns: u64,
    /// Run slots per VM; 0: the CPUs the VM is entitled to (host CPUs, or its CPU limit).
    pub slots: usize,
    /// The seed.
    pub seed: u64,
    /// The pvspin guest before ABI 0.4's `VCPUS_FIT` (or a host that never sets it): it also
    /// waits at once behind a next owner that was handed the lock and is still waking, even
    /// when the VM's vCPUs fit its CPUs. The validation's measurements ran that guest. Such a
    /// guest is never told `VCPUS_FIT`, so it never pre-wakes either ([`Self::prewake`]).
    pub early_wait_behind_waking: bool,
    /// The pvspin guest's pre-wake depth (`pvspin_guest::SpinConfig::prewake`; default the
    /// guest's `DEFAULT_PREWAKE`, at most its `MAX_PREWAKE`, 0 turns it off): while the host
    /// says the VM's vCPUs fit its CPUs ([`Self::vcpus_fit`]), the unlocker of the PV ticket,
    /// backoff and MCS locks also kicks the halted waiters of up to this many places behind the
    /// new holder, so that they spin by the time the lock reaches them. Never the stock guest.
    pub prewake: u8,
    /// Today's pvspin MCS lock (pvspin-guest after d22c42c): a waiter deeper than the holder's
    /// successor names the holder to the host (what run slots prioritize and directed yield
    /// boosts), not its predecessor. Off: the guest every measured row of the validation ran.
    pub queued_names_holder: bool,
    /// Today's stock guest (pvspin-guest's `StockQueuedLock` after 2026-12-02, as current
    /// Linux's `pv_hybrid_queued_unfair_trylock`): an arrival that finds the lock held keeps
    /// trying to steal it while others are queued and no queue head spins with pending set,
    /// and queues only once the queue is empty or pending is set. Off: one steal attempt, then
    /// queue (the guest every measured stock row of the validation ran).
    pub stock_hybrid_trylock: bool,
    /// The run slots' quantum, overriding `SlotConfig::new`'s (the VMM's `--slot-quantum-us`).
    pub slot_quantum_ns: Option<u64>,
    /// How often the slots' halt watcher polls while it has vCPUs to watch, overriding
    /// `SlotConfig::new`'s (the VMM's `--halt-watch-us`).
    pub halt_watch_ns: Option<u64>,
    /// Costs.
    pub cost: CostModel,
}

impl SimConfig {
    /// A configuration with the validation's defaults: 2 host CPUs, one VM of `vcpus` vCPUs,
    /// cs/ncs 15000, `iterations` acquisitions per vCPU.
    pub fn new(variant: Variant, vcpus: usize, iterations: u64) -> Self {
        Self {
            host_cpus: 2,
            vms: 1,
            vcpus,
            hogs: 0,
            variant,
            cs_work: 15_000,
            ncs_work: 15_000,
            iterations: Some(iterations),
            duration_ns: None,
            bound_ns: 60_000_000_000,
            cpu_limit: None,
            quota_period_ns: 100_000_000,
            slots: 0,
            seed: 1,
            early_wait_behind_waking: false,
            prewake: pvspin_guest::SpinConfig::DEFAULT_PREWAKE,
            queued_names_holder: true,
            stock_hybrid_trylock: true,
            slot_quantum_ns: None,
            halt_watch_ns: None,
            cost: CostModel::default(),
        }
    }

    /// Checks the rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.variant.validate()?;
        if self.host_cpus == 0 || self.vms == 0 || self.vcpus == 0 {
            return Err(ConfigError::Empty);
        }
        if self.host_cpus > 4096 || self.vcpus > 4096 {
            return Err(ConfigError::TooBig);
        }
        match (self.iterations, self.duration_ns) {
            (Some(0), _) | (_, Some(0)) | (None, None) | (Some(_), Some(_)) => {
                return Err(ConfigError::NoEnd)
            }
            _ => {}
        }
        if let Some(l) = self.cpu_limit {
            if !(l > 0.0 && l <= self.host_cpus as f64) {
                return Err(ConfigError::CpuLimit(l));
            }
        }
        if self.prewake > pvspin_guest::SpinConfig::MAX_PREWAKE {
            return Err(ConfigError::PrewakeTooDeep(self.prewake));
        }
        if self.slots > self.vcpus {
            return Err(ConfigError::Slots {
                slots: self.slots,
                vcpus: self.vcpus,
            });
        }
        Ok(())
    }

    /// The slots each VM gets: as asked, else its entitlement (`pvspin_slots::entitled_cpus`'
    /// rule: the quota rounded up, else the CPUs it may use), at most its vCPUs.
    pub fn slot_count(&self) -> usize {
        if self.slots > 0 {
            return self.slots;
        }
        let entitled = match self.cpu_limit {
            Some(l) => l.ceil() as usize,
            None => self.host_cpus,
        };
        entitled.clamp(1, self.vcpus)
    }

    /// What the host says in `VCPUS_FIT`, as pvspin's rule with pvspin-vmm's default CPUs: what
    /// the VM runs at once is no more than its entitlement (the quota rounded up, else the
    /// host's CPUs). That is its vCPUs, or with run slots on a path whose kick hands the
    /// kicker's slot over (userspace, signal-msi) its slots; on the in-kernel path all vCPUs,
    /// capped by the slots.
    pub fn vcpus_fit(&self) -> bool {
        let entitled = match self.cpu_limit {
            Some(l) => l.ceil() as usize,
            None => self.host_cpus,
        };
        if !self.variant.slots {
            return self.vcpus <= entitled;
        }
        if self.variant.path == KickPath::InKernel {
            self.vcpus <= entitled.min(self.slot_count())
        } else {
            self.slot_count().min(self.vcpus) <= entitled
        }
    }

    /// How many waiters behind the new holder an unlocker pre-wakes: [`Self::prewake`] for the
    /// pvspin guest's PV ticket, backoff and MCS locks when it is told `VCPUS_FIT` (the host
    /// says so, [`Self::vcpus_fit`], and the guest is not one that is never told,
    /// [`Self::early_wait_behind_waking`]); else 0 (the stock guest, TAS, no PV).
    pub fn prewake_depth(&self) -> usize {
        let v = self.variant;
        let lock = matches!(
            v.lock,
            LockKind::Ticket | LockKind::Backoff | LockKind::Queued
        );
        let told_fit = self.vcpus_fit() && !self.early_wait_behind_waking;
        if lock && v.pv != PvMode::Off && v.guest == Guest::Pvspin && told_fit {
            usize::from(self.prewake)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_and_print_back() {
        for s in [
            "ticket:off",
            "tas:off",
            "ticket:kick:in-kernel",
            "queued:kick+yield:in-kernel",
            "queued:kick:in-kernel@stock",
            "queued:kick/slots:signal-msi@stock",
            "queued:kick/slots:userspace",
            "ticket:kick/slots:in-kernel",
            "backoff:off",
            "backoff:kick:in-kernel",
        ] {
            let v: Variant = s.parse().unwrap();
            assert_eq!(v.to_string(), s);
        }
        let v: Variant = "ticket:kick".parse().unwrap();
        assert_eq!(v.path, KickPath::InKernel);
        assert_eq!(
            "tas:kick".parse::<Variant>(),
            Err(ConfigError::TasPv),
            "named rule"
        );
        assert!(matches!(
            "ticket:off/slots".parse::<Variant>(),
            Err(ConfigError::NeedsPv(_))
        ));
        assert!(matches!(
            "ticket:kick@stock".parse::<Variant>(),
            Err(ConfigError::Stock(_))
        ));
        assert!(matches!(
            "spin:off".parse::<Variant>(),
            Err(ConfigError::Variant(_))
        ));
    }

    #[test]
    fn configuration_rules_are_named() {
        let v: Variant = "ticket:kick".parse().unwrap();
        let mut c = SimConfig::new(v, 4, 10);
        assert_eq!(c.validate(), Ok(()));
        c.duration_ns = Some(1);
        assert_eq!(c.validate(), Err(ConfigError::NoEnd));
        c.duration_ns = None;
        c.cpu_limit = Some(3.0);
        assert_eq!(c.validate(), Err(ConfigError::CpuLimit(3.0)));
        c.cpu_limit = Some(1.0);
        assert_eq!(c.slot_count(), 1);
        c.slots = 5;
        assert!(matches!(c.validate(), Err(ConfigError::Slots { .. })));
        c.slots = 0;
        c.cpu_limit = None;
        assert_eq!(c.slot_count(), 2);
        c.prewake = pvspin_guest::SpinConfig::MAX_PREWAKE + 1;
        assert_eq!(c.validate(), Err(ConfigError::PrewakeTooDeep(5)));
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("MAX_PREWAKE (4)"));
        c.prewake = pvspin_guest::SpinConfig::MAX_PREWAKE;
        assert_eq!(c.validate(), Ok(()));
    }

    /// The pre-wake as the guest gates it: the pvspin guest's PV ticket, backoff and MCS
    /// locks, told `VCPUS_FIT`, at the guest's default depth; never the stock guest, TAS,
    /// plain spinning, a guest never told, or a VM whose vCPUs do not fit.
    #[test]
    fn the_prewake_depth_follows_the_guests_rule() {
        let depth = |s: &str, vcpus: usize| {
            let mut c = SimConfig::new(s.parse().unwrap(), vcpus, 1);
            let on = c.prewake_depth();
            c.early_wait_behind_waking = true;
            (on, c.prewake_depth())
        };
        let d = usize::from(pvspin_guest::SpinConfig::DEFAULT_PREWAKE);
        assert_eq!(d, 2);
        assert_eq!(
            SimConfig::new("ticket:kick".parse().unwrap(), 2, 1).prewake,
            2
        );
        for fit in [
            "ticket:kick/slots:userspace",
            "backoff:kick/slots:signal-msi",
            "queued:kick+yield/slots:userspace",
        ] {
            assert_eq!(depth(fit, 16), (d, 0), "{fit}");
        }
        assert_eq!(depth("ticket:kick", 2), (d, 0), "2 vCPUs on 2 CPUs fit");
        for never in [
            "ticket:kick",
            "ticket:kick/slots:in-kernel",
            "queued:kick/slots:signal-msi@stock",
            "ticket:off",
        ] {
            assert_eq!(depth(never, 16), (0, 0), "{never}");
        }
        assert_eq!(depth("tas:off", 2), (0, 0));
        let mut c = SimConfig::new("queued:kick/slots:userspace".parse().unwrap(), 8, 1);
        c.prewake = 0;
        assert_eq!(c.prewake_depth(), 0);
    }
}
