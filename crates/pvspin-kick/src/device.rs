//! The kick device: decoder, counters, rate-limited logging and the chosen wake path.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pvspin_abi::cpuid::{
    PvspinInfo, FEATURE_KICK, FEATURE_KICK_IN_KERNEL, FEATURE_SHARED_PAGE, FEATURE_SPIN_NOTIFY,
    FEATURE_WAIT,
};
use pvspin_abi::doorbell::{COMMAND_WIDTH, DEFAULT_PORT, PORT_COUNT, SPIN_OFFSET};

use crate::decode::{decode, Command, Reject};
use crate::latch::{KickResult, ParkOutcome, ParkPolicy, WakeLatch};
use crate::ratelimit::{Clock, MonotonicClock, RateLimiter};

/// Which mechanism wakes a kicked vCPU. The embedding VMM chooses one per VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KickPath {
    /// In-kernel irqchip; each valid kick is an ioeventfd (datamatch = target) wired to an
    /// irqfd routed to a REMRD MSI at the target's APIC ID. KVM sets `pv_unhalted` exactly as
    /// for `KVM_HC_KICK_CPU`; a valid kick never exits to userspace. Only bad writes reach
    /// [`KickDevice::handle_pio_write`].
    InKernel,
    /// In-kernel irqchip; every doorbell write exits to the VMM, which calls
    /// `KVM_SIGNAL_MSI` with a REMRD MSI through a [`RemrdSink`].
    SignalMsi,
    /// No in-kernel irqchip; `KVM_EXIT_HLT` parks the vCPU thread on its [`WakeLatch`]
    /// ([`KickDevice::handle_hlt`]) and a kick sets the latch.
    Userspace,
}

impl KickPath {
    /// Every path.
    pub const ALL: [KickPath; 3] = [KickPath::InKernel, KickPath::SignalMsi, KickPath::Userspace];

    /// A short stable name, for logs and telemetry labels (`in_kernel`, `signal_msi`,
    /// `userspace`).
    pub const fn name(self) -> &'static str {
        match self {
            KickPath::InKernel => "in_kernel",
            KickPath::SignalMsi => "signal_msi",
            KickPath::Userspace => "userspace",
        }
    }
}

/// Something that can send a REMRD ("remote read", KVM's `pv_unhalted` wake) MSI to an APIC
/// ID. `pvspin::VmMsiSink` implements it over a VM fd; tests use fakes.
pub trait RemrdSink: Send + Sync {
    /// Sends the MSI. `Ok(true)`: delivered to a vCPU; `Ok(false)`: KVM delivered it to nobody
    /// (e.g. a stale APIC-ID map in KVM).
    fn signal_remrd(&self, apic_id: u32) -> Result<bool, SinkError>;
}

/// sending a REMRD MSI to APIC ID {apic_id} failed: {source}
///
/// A failed [`RemrdSink::signal_remrd`].
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub struct SinkError {
    /// The APIC ID the MSI was for.
    pub apic_id: u32,
    /// What went wrong: KVM's error, or the MSI the APIC ID cannot be addressed by.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Errors of the kick device's configuration and calls.
#[derive(Debug, thiserror::Error, PartialEq, Eq, displaydoc::Display)]
pub enum KickError {
    /// invalid kick configuration: nr_vcpus must be at least 1 (got 0)
    NoVcpus,
    /// invalid kick configuration: doorbell ports {port:#x}..+{count} run past port 0xffff
    PortRange {
        /// The first port asked for.
        port: u16,
        /// The range length.
        count: u16,
    },
    /// invalid kick configuration: extra_commands {0:#x} has bits other than FEATURE_SPIN_NOTIFY |
    /// FEATURE_SHARED_PAGE | FEATURE_WAIT
    UnknownCommands(u32),
    /// invalid kick configuration: nr_vcpus must be at most 255 (got {0}):
    /// pvspin_abi::MAX_VCPUS, a kick index is the vCPU's 8-bit initial APIC ID and a REMRD MSI
    /// cannot address 0xFF (the xAPIC broadcast ID) alone; x2APIC IDs are not supported
    TooManyVcpus(u32),
    /// vCPU {vcpu} does not exist (the device has {nr_vcpus})
    NoSuchVcpu {
        /// The index given.
        vcpu: u32,
        /// The number of vCPUs.
        nr_vcpus: u32,
    },
    /// handle_hlt is only for the userspace kick path (this device uses {0:?})
    NotUserspacePath(KickPath),
}

/// The commands a VMM may enable on top of KICK ([`KickConfig::extra_commands`]).
pub const EXTRA_COMMANDS: u32 = FEATURE_SPIN_NOTIFY | FEATURE_SHARED_PAGE | FEATURE_WAIT;

/// The most vCPUs a device accepts: the ABI's [`pvspin_abi::MAX_VCPUS`] (255), on every path.
pub const MAX_VCPUS: u32 = pvspin_abi::MAX_VCPUS;
// `KickError::TooManyVcpus`'s message names the limit.
const _: () = assert!(MAX_VCPUS == 255);

/// Configuration of a [`KickDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KickConfig {
    /// First doorbell port.
    pub port: u16,
    /// Number of vCPUs; valid kick targets are `0..nr_vcpus`, and vCPU `i` has APIC ID `i`.
    pub nr_vcpus: u32,
    /// Reserved commands to accept and forward to the VMM (`FEATURE_SPIN_NOTIFY`,
    /// `FEATURE_SHARED_PAGE`, `FEATURE_WAIT`: [`EXTRA_COMMANDS`]); 0 (the default) rejects them
    /// as [`Reject::NotEnabled`]. Only set these when something handles the forwarded commands.
    pub extra_commands: u32,
    /// Userspace path: how long to spin before sleeping on an `HLT` exit.
    pub spin: Duration,
    /// Userspace path: longest sleep per `HLT` exit (`None`: until kicked, interrupted or shut
    /// down). A timeout resumes the guest, which `pv_wait` treats as a spurious wake-up.
    pub park_timeout: Option<Duration>,
    /// At most one log line per reject reason per this interval.
    pub log_interval: Duration,
}

impl Default for KickConfig {
    fn default() -> Self {
        Self {
            port: DEFAULT_PORT,
            nr_vcpus: 1,
            extra_commands: 0,
            spin: Duration::ZERO,
            park_timeout: None,
            log_interval: Duration::from_secs(10),
        }
    }
}

/// What [`KickDevice::handle_pio_write`] did with an access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PioOutcome {
    /// Not a doorbell port: the VMM handles the access itself.
    NotMine,
    /// A doorbell access, fully handled (the VMM resumes the vCPU).
    Handled(Handled),
}

/// The detail of a handled doorbell access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    /// A kick of `target`, delivered as `delivery` says.
    Kicked {
        /// The vCPU kicked.
        target: u32,
        /// What the wake path did.
        delivery: Delivery,
    },
    /// A reserved command that the configuration enables, for the VMM to act on (the writing
    /// vCPU is the one whose exit this was).
    Forward(Command),
    /// Ignored and counted.
    Rejected(Reject),
}

/// What the wake path did with a valid kick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Userspace path: the latch's answer.
    Latch(KickResult),
    /// Signal-msi path (or the in-kernel fallback): KVM delivered the MSI to a vCPU.
    MsiDelivered,
    /// KVM delivered the MSI to nobody (stale APIC map, or the target is gone).
    MsiNotDelivered,
    /// `KVM_SIGNAL_MSI` failed.
    MsiFailed,
    /// In-kernel path without a fallback sink: a valid kick reached userspace, which means
    /// its ioeventfd is missing. Counted, not delivered.
    InKernelMissed,
}

/// Counter snapshot. Every doorbell access is counted exactly once in
/// `kicks + forwarded + rejected.sum()`, which equals `accesses`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KickStats {
    /// Doorbell accesses seen (writes and reads).
    pub accesses: u64,
    /// Valid kicks seen (on the in-kernel path, only those that reached userspace).
    pub kicks: u64,
    /// Reserved commands forwarded to the VMM.
    pub forwarded: u64,
    /// Ignored accesses, per [`Reject`] (index with [`Reject::index`]).
    pub rejected: [u64; Reject::COUNT],
    /// Userspace path: kicks that woke a parked thread.
    pub woke_parked: u64,
    /// Userspace path: kicks remembered for the next park.
    pub latched: u64,
    /// Userspace path: kicks that coalesced with a pending one.
    pub coalesced: u64,
    /// MSIs KVM delivered.
    pub msi_delivered: u64,
    /// MSIs KVM delivered to nobody.
    pub msi_not_delivered: u64,
    /// `KVM_SIGNAL_MSI` failures.
    pub msi_failed: u64,
    /// In-kernel path: valid kicks that reached userspace, i.e. that their ioeventfd did not
    /// catch (not registered, or registered with another length than the guest's 4-byte
    /// `OUT`, such as a `u64` datamatch). With a fallback sink (pvspin always gives one) each is
    /// still delivered, by `KVM_SIGNAL_MSI` (counted under `msi_*` too), at the cost of an exit;
    /// without one it is dropped ([`Delivery::InKernelMissed`]). Logged, rate-limited, with
    /// the likely cause.
    pub in_kernel_missed: u64,
    /// Userspace path: `HLT` exits handled.
    pub hlt_parks: u64,
    /// Userspace path: WAIT commands that parked (or tried to park) on the latch.
    pub wait_parks: u64,
}

impl KickStats {
    /// Ignored accesses for one reason.
    pub fn rejected(&self, reason: Reject) -> u64 {
        self.rejected[reason.index()]
    }

    /// All ignored accesses.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().sum()
    }
}

#[derive(Debug, Default)]
struct Counters {
    accesses: AtomicU64,
    kicks: AtomicU64,
    forwarded: AtomicU64,
    rejected: [AtomicU64; Reject::COUNT],
    woke_parked: AtomicU64,
    latched: AtomicU64,
    coalesced: AtomicU64,
    msi_delivered: AtomicU64,
    msi_not_delivered: AtomicU64,
    msi_failed: AtomicU64,
    in_kernel_missed: AtomicU64,
    hlt_parks: AtomicU64,
    wait_parks: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Log keys beyond the reject reasons.
const LOG_MSI_FAILED: usize = Reject::COUNT;
const LOG_MSI_NOT_DELIVERED: usize = Reject::COUNT + 1;
const LOG_IN_KERNEL_MISSED: usize = Reject::COUNT + 2;
const LOG_KEYS: usize = Reject::COUNT + 3;

/// The likely cause of a valid kick that reached userspace on the in-kernel path.
macro_rules! in_kernel_missed_cause {
    ($then:literal) => {
        concat!(
            "a valid kick reached userspace on the in-kernel path: its ioeventfd is not \
             registered, or was registered with another length than the guest's 4-byte OUT (a \
             u64 datamatch makes an 8-byte ioeventfd that never matches); register the kick \
             ioeventfds with their u32 datamatch (pvspin: KickWiring::ioevents or \
             KickWiring::register). ",
            $then
        )
    };
}
const IN_KERNEL_MISSED_CAUSE_DELIVERED: &str =
    in_kernel_missed_cause!("Delivered by KVM_SIGNAL_MSI instead, at the cost of an exit");
const IN_KERNEL_MISSED_CAUSE_DROPPED: &str = in_kernel_missed_cause!("Dropped");

enum Waker {
    InKernel(Option<Arc<dyn RemrdSink>>),
    SignalMsi(Arc<dyn RemrdSink>),
    Userspace(Box<[WakeLatch]>),
}

/// The kick doorbell device of one VM. Shared by all vCPU threads (`&self` methods, `Sync`).
pub struct KickDevice {
    cfg: KickConfig,
    waker: Waker,
    counters: Counters,
    limiter: RateLimiter<Box<dyn Clock>>,
}

impl fmt::Debug for KickDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KickDevice")
            .field("cfg", &self.cfg)
            .field("path", &self.path())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Clock for Box<dyn Clock> {
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
}

impl KickDevice {
    fn validate(cfg: &KickConfig) -> Result<(), KickError> {
        if cfg.nr_vcpus == 0 {
            return Err(KickError::NoVcpus);
        }
        if cfg.nr_vcpus > MAX_VCPUS {
            return Err(KickError::TooManyVcpus(cfg.nr_vcpus));
        }
        if u32::from(cfg.port) + u32::from(PORT_COUNT) > 0x1_0000 {
            return Err(KickError::PortRange {
                port: cfg.port,
                count: PORT_COUNT,
            });
        }
        if cfg.extra_commands & !EXTRA_COMMANDS != 0 {
            return Err(KickError::UnknownCommands(cfg.extra_commands));
        }
        Ok(())
    }

    fn build(cfg: KickConfig, waker: Waker, clock: Box<dyn Clock>) -> Result<Self, KickError> {
        Self::validate(&cfg)?;
        let interval = u64::try_from(cfg.log_interval.as_nanos()).unwrap_or(u64::MAX);
        Ok(Self {
            cfg,
            waker,
            counters: Counters::default(),
            limiter: RateLimiter::new(clock, LOG_KEYS, interval),
        })
    }

    /// A device on the userspace path (no in-kernel irqchip).
    pub fn userspace(cfg: KickConfig) -> Result<Self, KickError> {
        Self::userspace_with_clock(cfg, Box::new(MonotonicClock::new()))
    }

    /// As [`KickDevice::userspace`], with the log limiter's clock injected (tests, fuzzing).
    pub fn userspace_with_clock(cfg: KickConfig, clock: Box<dyn Clock>) -> Result<Self, KickError> {
        Self::validate(&cfg)?;
        let latches = (0..cfg.nr_vcpus).map(|_| WakeLatch::new()).collect();
        Self::build(cfg, Waker::Userspace(latches), clock)
    }

    /// A device on the signal-msi path.
    pub fn signal_msi(cfg: KickConfig, sink: Arc<dyn RemrdSink>) -> Result<Self, KickError> {
        Self::build(cfg, Waker::SignalMsi(sink), Box::new(MonotonicClock::new()))
    }

    /// A device on the in-kernel path. The ioeventfd/irqfd wiring is done separately
    /// (`pvspin::PvSpin::kick_wiring`). `fallback`, if given, delivers a valid kick that
    /// reaches userspace anyway (its ioeventfd is missing); without it such a kick is counted
    /// as [`Delivery::InKernelMissed`] and logged.
    pub fn in_kernel(
        cfg: KickConfig,
        fallback: Option<Arc<dyn RemrdSink>>,
    ) -> Result<Self, KickError> {
        Self::build(
            cfg,
            Waker::InKernel(fallback),
            Box::new(MonotonicClock::new()),
        )
    }

    /// The wake path.
    pub fn path(&self) -> KickPath {
        match self.waker {
            Waker::InKernel(_) => KickPath::InKernel,
            Waker::SignalMsi(_) => KickPath::SignalMsi,
            Waker::Userspace(_) => KickPath::Userspace,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KickConfig {
        &self.cfg
    }

    /// The doorbell's ports.
    pub fn ports(&self) -> Range<u16> {
        // validate() guarantees no overflow past 0xffff + 1; saturate to stay total anyway.
        self.cfg.port..self.cfg.port.saturating_add(PORT_COUNT)
    }

    /// Feature bits to advertise in the CPUID info leaf.
    pub fn features(&self) -> u32 {
        let mut f = FEATURE_KICK | self.cfg.extra_commands;
        if self.path() == KickPath::InKernel {
            f |= FEATURE_KICK_IN_KERNEL;
        }
        f
    }

    /// What the CPUID info leaf must report for this device.
    pub fn cpuid_info(&self) -> PvspinInfo {
        PvspinInfo {
            version: pvspin_abi::ABI_VERSION,
            doorbell_port: self.cfg.port,
            doorbell_ports: PORT_COUNT,
            features: self.features(),
            nr_vcpus: self.cfg.nr_vcpus,
        }
    }

    fn offset(&self, port: u16) -> Option<u16> {
        port.checked_sub(self.cfg.port).filter(|o| *o < PORT_COUNT)
    }

    fn reject(&self, reason: Reject, port: u16, data: &[u8]) -> PioOutcome {
        bump(&self.counters.rejected[reason.index()]);
        if let Some(suppressed) = self.limiter.check(reason.index()) {
            log::warn!(
                "pvspin kick doorbell: ignored guest access ({}) at port {port:#x}, {} bytes \
                 {:02x?}; {suppressed} more of this kind since the last report",
                reason.name(),
                data.len(),
                &data[..data.len().min(8)],
            );
        }
        PioOutcome::Handled(Handled::Rejected(reason))
    }

    fn log_host(&self, key: usize, what: &str, target: u32) {
        if let Some(suppressed) = self.limiter.check(key) {
            log::warn!(
                "pvspin kick: {what} (target vCPU {target}); {suppressed} more since the last report"
            );
        }
    }

    /// Handles a guest `OUT` (`KVM_EXIT_IO` out, or `VcpuExit::IoOut(port, data)`). Returns
    /// [`PioOutcome::NotMine`] for ports outside the doorbell. Never panics, never blocks,
    /// never wakes a vCPU other than a valid target.
    pub fn handle_pio_write(&self, port: u16, data: &[u8]) -> PioOutcome {
        let Some(offset) = self.offset(port) else {
            return PioOutcome::NotMine;
        };
        bump(&self.counters.accesses);
        let cmd = match decode(offset, data, self.cfg.nr_vcpus) {
            Ok(c) => c,
            // A command that is off is "not enabled" whatever vCPU it names.
            Err(Reject::NoSuchVcpu) if !self.command_enabled(offset) => {
                return self.reject(Reject::NotEnabled, port, data)
            }
            Err(reason) => return self.reject(reason, port, data),
        };
        match cmd {
            Command::Kick { target } => {
                bump(&self.counters.kicks);
                let delivery = self.wake(target);
                PioOutcome::Handled(Handled::Kicked { target, delivery })
            }
            Command::Spin(_) if self.cfg.extra_commands & FEATURE_SPIN_NOTIFY == 0 => {
                self.reject(Reject::NotEnabled, port, data)
            }
            Command::SharedPage { .. } if self.cfg.extra_commands & FEATURE_SHARED_PAGE == 0 => {
                self.reject(Reject::NotEnabled, port, data)
            }
            Command::Wait(_) if self.cfg.extra_commands & FEATURE_WAIT == 0 => {
                self.reject(Reject::NotEnabled, port, data)
            }
            other => {
                bump(&self.counters.forwarded);
                PioOutcome::Handled(Handled::Forward(other))
            }
        }
    }

    /// Whether the command at doorbell `offset` is enabled (KICK always is).
    fn command_enabled(&self, offset: u16) -> bool {
        let feature = match offset {
            SPIN_OFFSET => FEATURE_SPIN_NOTIFY,
            pvspin_abi::doorbell::SHARED_PAGE_OFFSET => FEATURE_SHARED_PAGE,
            pvspin_abi::doorbell::WAIT_OFFSET => FEATURE_WAIT,
            _ => return true,
        };
        self.cfg.extra_commands & feature != 0
    }

    /// Handles a guest `IN` from the doorbell. The guest reads all ones unless the VMM fills
    /// in an answer: a 4-byte read of the SPIN register with SPIN enabled is forwarded as
    /// [`Command::ReadSpinWindow`] (the VMM writes the reading vCPU's window into `data`);
    /// every other read is counted as [`Reject::Read`].
    pub fn handle_pio_read(&self, port: u16, data: &mut [u8]) -> PioOutcome {
        let Some(offset) = self.offset(port) else {
            return PioOutcome::NotMine;
        };
        bump(&self.counters.accesses);
        data.fill(0xff);
        if offset == SPIN_OFFSET
            && data.len() == COMMAND_WIDTH
            && self.cfg.extra_commands & FEATURE_SPIN_NOTIFY != 0
        {
            bump(&self.counters.forwarded);
            return PioOutcome::Handled(Handled::Forward(Command::ReadSpinWindow));
        }
        self.reject(Reject::Read, port, &[])
    }

    fn send_msi(&self, sink: &dyn RemrdSink, target: u32) -> Delivery {
        // vCPU index == APIC ID (ABI rule); validate() bounds it to 0..=254.
        match sink.signal_remrd(target) {
            Ok(true) => {
                bump(&self.counters.msi_delivered);
                Delivery::MsiDelivered
            }
            Ok(false) => {
                bump(&self.counters.msi_not_delivered);
                self.log_host(
                    LOG_MSI_NOT_DELIVERED,
                    "KVM delivered the kick's REMRD MSI to no vCPU: no LAPIC has that APIC ID in \
                     KVM's APIC-ID map. The rules: vCPU i is KVM vCPU id i (KVM_CREATE_VCPU sets \
                     the APIC ID from it), and every vCPU is configured before the first KVM_RUN \
                     (the last configure_vcpu rebuilds the map); else the guest changed its APIC \
                     ID or disabled its LAPIC. The target stays halted",
                    target,
                );
                Delivery::MsiNotDelivered
            }
            Err(e) => {
                bump(&self.counters.msi_failed);
                self.log_host(LOG_MSI_FAILED, &e.to_string(), target);
                Delivery::MsiFailed
            }
        }
    }

    fn wake(&self, target: u32) -> Delivery {
        match &self.waker {
            Waker::Userspace(latches) => {
                let Some(latch) = usize::try_from(target).ok().and_then(|i| latches.get(i)) else {
                    // Unreachable: decode() bounds target by nr_vcpus == latches.len().
                    return Delivery::InKernelMissed;
                };
                let r = latch.kick();
                bump(match r {
                    KickResult::WokeParked => &self.counters.woke_parked,
                    KickResult::Latched => &self.counters.latched,
                    KickResult::AlreadyPending => &self.counters.coalesced,
                });
                Delivery::Latch(r)
            }
            Waker::SignalMsi(sink) => self.send_msi(sink.as_ref(), target),
            Waker::InKernel(Some(sink)) => {
                bump(&self.counters.in_kernel_missed);
                self.log_host(
                    LOG_IN_KERNEL_MISSED,
                    IN_KERNEL_MISSED_CAUSE_DELIVERED,
                    target,
                );
                self.send_msi(sink.as_ref(), target)
            }
            Waker::InKernel(None) => {
                bump(&self.counters.in_kernel_missed);
                self.log_host(LOG_IN_KERNEL_MISSED, IN_KERNEL_MISSED_CAUSE_DROPPED, target);
                Delivery::InKernelMissed
            }
        }
    }

    fn latch_of(&self, vcpu: u32) -> Result<&WakeLatch, KickError> {
        let Waker::Userspace(latches) = &self.waker else {
            return Err(KickError::NotUserspacePath(self.path()));
        };
        usize::try_from(vcpu)
            .ok()
            .and_then(|i| latches.get(i))
            .ok_or(KickError::NoSuchVcpu {
                vcpu,
                nr_vcpus: self.cfg.nr_vcpus,
            })
    }

    /// Userspace path: handles `KVM_EXIT_HLT` of `vcpu` by parking its thread per the
    /// configured spin and timeout, then returns why it woke. The VMM re-enters `KVM_RUN`
    /// unless the outcome is [`ParkOutcome::Shutdown`] (or [`ParkOutcome::Interrupted`] when it
    /// asked for the thread back).
    pub fn handle_hlt(&self, vcpu: u32) -> Result<ParkOutcome, KickError> {
        let latch = self.latch_of(vcpu)?;
        bump(&self.counters.hlt_parks);
        Ok(latch.park(&ParkPolicy {
            spin: self.cfg.spin,
            timeout: self.cfg.park_timeout,
        }))
    }

    /// Userspace path: a WAIT command of `vcpu` (forwarded as [`Command::Wait`]): parks its
    /// thread exactly as [`KickDevice::handle_hlt`] does (the same latch, so a kick that
    /// landed first is remembered), for at most `timeout` when given, or the configured
    /// park timeout otherwise.
    pub fn handle_wait(
        &self,
        vcpu: u32,
        timeout: Option<Duration>,
    ) -> Result<ParkOutcome, KickError> {
        let latch = self.latch_of(vcpu)?;
        bump(&self.counters.wait_parks);
        Ok(latch.park(&ParkPolicy {
            spin: self.cfg.spin,
            timeout: timeout.or(self.cfg.park_timeout),
        }))
    }

    /// Userspace path: consumes a pending kick of `vcpu` without blocking.
    pub fn try_take_kick(&self, vcpu: u32) -> Result<bool, KickError> {
        Ok(self.latch_of(vcpu)?.try_take())
    }

    /// Userspace path: whether `vcpu` has a kick pending.
    pub fn kick_pending(&self, vcpu: u32) -> Result<bool, KickError> {
        Ok(self.latch_of(vcpu)?.is_pending())
    }

    /// Userspace path: the latch of `vcpu` (for VMMs that park themselves).
    pub fn latch(&self, vcpu: u32) -> Result<&WakeLatch, KickError> {
        self.latch_of(vcpu)
    }

    /// Userspace path: releases `vcpu`'s thread from [`KickDevice::handle_hlt`] without a kick
    /// (e.g. to pause it). A no-op on the other paths (there the VMM uses a signal and
    /// `immediate_exit`).
    pub fn interrupt(&self, vcpu: u32) {
        if let Ok(l) = self.latch_of(vcpu) {
            l.interrupt();
        }
    }

    /// Userspace path: releases every parked vCPU thread, now and in future, so the VMM can
    /// stop. A no-op on the other paths.
    pub fn shutdown(&self) {
        if let Waker::Userspace(latches) = &self.waker {
            for l in latches.iter() {
                l.shutdown();
            }
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> KickStats {
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut rejected = [0; Reject::COUNT];
        for (r, a) in rejected.iter_mut().zip(c.rejected.iter()) {
            *r = ld(a);
        }
        KickStats {
            accesses: ld(&c.accesses),
            kicks: ld(&c.kicks),
            forwarded: ld(&c.forwarded),
            rejected,
            woke_parked: ld(&c.woke_parked),
            latched: ld(&c.latched),
            coalesced: ld(&c.coalesced),
            msi_delivered: ld(&c.msi_delivered),
            msi_not_delivered: ld(&c.msi_not_delivered),
            msi_failed: ld(&c.msi_failed),
            in_kernel_missed: ld(&c.in_kernel_missed),
            hlt_parks: ld(&c.hlt_parks),
            wait_parks: ld(&c.wait_parks),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ratelimit::ManualClock;
    use pvspin_abi::doorbell::{KICK_OFFSET, SHARED_PAGE_OFFSET};
    use std::sync::Mutex;
    use std::thread;
    use std::time::Instant;

    const P: u16 = DEFAULT_PORT;

    fn cfg(n: u32) -> KickConfig {
        KickConfig {
            nr_vcpus: n,
            ..KickConfig::default()
        }
    }

    fn le(v: u32) -> [u8; 4] {
        v.to_le_bytes()
    }

    #[derive(Default)]
    struct FakeSink {
        sent: Mutex<Vec<u32>>,
        answer: Option<bool>,
    }

    impl RemrdSink for FakeSink {
        fn signal_remrd(&self, apic_id: u32) -> Result<bool, SinkError> {
            self.sent.lock().unwrap().push(apic_id);
            self.answer.ok_or(SinkError {
                apic_id,
                source: "fake failure".into(),
            })
        }
    }

    #[test]
    fn config_rules() {
        assert_eq!(
            KickDevice::userspace(cfg(0)).unwrap_err(),
            KickError::NoVcpus
        );
        let c = KickConfig {
            port: 0xfff8,
            ..cfg(1)
        };
        assert!(matches!(
            KickDevice::userspace(c).unwrap_err(),
            KickError::PortRange { .. }
        ));
        let c = KickConfig {
            port: 0xfff0,
            ..cfg(1)
        };
        assert_eq!(KickDevice::userspace(c).unwrap().ports(), 0xfff0..0xffff);
        let c = KickConfig {
            extra_commands: FEATURE_KICK_IN_KERNEL,
            ..cfg(1)
        };
        assert_eq!(
            KickDevice::userspace(c).unwrap_err(),
            KickError::UnknownCommands(FEATURE_KICK_IN_KERNEL)
        );
        assert_eq!(MAX_VCPUS, 255);
        assert!(KickDevice::in_kernel(cfg(MAX_VCPUS), None).is_ok());
        assert!(KickDevice::userspace(cfg(MAX_VCPUS)).is_ok());
        for err in [
            KickDevice::in_kernel(cfg(MAX_VCPUS + 1), None).unwrap_err(),
            KickDevice::userspace(cfg(MAX_VCPUS + 1)).unwrap_err(),
        ] {
            assert_eq!(err, KickError::TooManyVcpus(MAX_VCPUS + 1));
            assert!(err.to_string().contains("broadcast"), "{err}");
        }
        // Errors name the rule.
        assert!(KickError::NoVcpus.to_string().contains("at least 1"));
    }

    #[test]
    fn cpuid_info_reflects_path_and_commands() {
        let d = KickDevice::in_kernel(cfg(4), None).unwrap();
        let i = d.cpuid_info();
        assert_eq!(i.features, FEATURE_KICK | FEATURE_KICK_IN_KERNEL);
        assert_eq!(i.nr_vcpus, 4);
        assert_eq!(i.doorbell_port, DEFAULT_PORT);
        assert_eq!(i.doorbell_ports, PORT_COUNT);
        let d = KickDevice::userspace(KickConfig {
            extra_commands: FEATURE_SPIN_NOTIFY,
            ..cfg(2)
        })
        .unwrap();
        assert_eq!(d.features(), FEATURE_KICK | FEATURE_SPIN_NOTIFY);
    }

    #[test]
    fn ports_outside_the_doorbell_are_not_mine_and_not_counted() {
        let d = KickDevice::userspace(cfg(2)).unwrap();
        assert_eq!(d.handle_pio_write(P - 1, &le(0)), PioOutcome::NotMine);
        assert_eq!(
            d.handle_pio_write(P + PORT_COUNT, &le(0)),
            PioOutcome::NotMine
        );
        assert_eq!(d.handle_pio_read(0x3f8, &mut [0]), PioOutcome::NotMine);
        assert_eq!(d.stats(), KickStats::default());
    }

    #[test]
    fn userspace_kick_latches_only_the_target() {
        let d = KickDevice::userspace(cfg(3)).unwrap();
        assert_eq!(
            d.handle_pio_write(P + KICK_OFFSET, &le(1)),
            PioOutcome::Handled(Handled::Kicked {
                target: 1,
                delivery: Delivery::Latch(KickResult::Latched)
            })
        );
        assert!(!d.kick_pending(0).unwrap());
        assert!(d.kick_pending(1).unwrap());
        assert!(!d.kick_pending(2).unwrap());
        assert_eq!(
            d.handle_pio_write(P, &le(1)),
            PioOutcome::Handled(Handled::Kicked {
                target: 1,
                delivery: Delivery::Latch(KickResult::AlreadyPending)
            })
        );
        assert_eq!(d.handle_hlt(1).unwrap(), ParkOutcome::KickedBeforePark);
        assert!(!d.try_take_kick(1).unwrap());
        let s = d.stats();
        assert_eq!((s.kicks, s.latched, s.coalesced, s.hlt_parks), (2, 1, 1, 1));
    }

    #[test]
    fn bad_input_is_ignored_counted_and_wakes_nobody() {
        let d = KickDevice::userspace(cfg(2)).unwrap();
        let r = |x| PioOutcome::Handled(Handled::Rejected(x));
        assert_eq!(d.handle_pio_write(P, &le(2)), r(Reject::NoSuchVcpu));
        assert_eq!(d.handle_pio_write(P, &le(u32::MAX)), r(Reject::NoSuchVcpu));
        assert_eq!(d.handle_pio_write(P, &[1]), r(Reject::WrongWidth));
        assert_eq!(d.handle_pio_write(P, &[1, 0]), r(Reject::WrongWidth));
        assert_eq!(d.handle_pio_write(P + 1, &le(1)), r(Reject::UnusedOffset));
        assert_eq!(d.handle_pio_write(P + 13, &le(1)), r(Reject::UnusedOffset));
        assert_eq!(d.handle_pio_write(P + 12, &le(1)), r(Reject::NotEnabled));
        // Off is "not enabled" even when the named vCPU does not exist either.
        assert_eq!(
            d.handle_pio_write(P + 12, &le(0x1ffe)),
            r(Reject::NotEnabled)
        );
        assert_eq!(
            d.handle_pio_write(P + SPIN_OFFSET, &le(0xffff)),
            r(Reject::NotEnabled)
        );
        // A SPIN naming a vCPU that does not exist, with notifications off: "not enabled",
        // not "no such vCPU" (the adoption issue's report).
        assert_eq!(
            d.handle_pio_write(P + SPIN_OFFSET, &le(0x1ffe)),
            r(Reject::NotEnabled)
        );
        assert_eq!(
            d.handle_pio_write(P + SHARED_PAGE_OFFSET, &le(7)),
            r(Reject::NotEnabled)
        );
        let mut buf = [0u8; 4];
        assert_eq!(d.handle_pio_read(P, &mut buf), r(Reject::Read));
        assert_eq!(buf, [0xff; 4]);
        for v in 0..2 {
            assert!(!d.kick_pending(v).unwrap());
        }
        let s = d.stats();
        assert_eq!(s.rejected(Reject::NoSuchVcpu), 2);
        assert_eq!(s.rejected(Reject::WrongWidth), 2);
        assert_eq!(s.rejected(Reject::UnusedOffset), 2);
        assert_eq!(s.rejected(Reject::NotEnabled), 5);
        assert_eq!(s.rejected(Reject::Read), 1);
        assert_eq!(s.accesses, 12);
        assert_eq!(s.kicks + s.forwarded + s.rejected_total(), s.accesses);
    }

    #[test]
    fn enabled_reserved_commands_are_forwarded() {
        let d = KickDevice::userspace(KickConfig {
            extra_commands: FEATURE_SPIN_NOTIFY | FEATURE_SHARED_PAGE,
            ..cfg(2)
        })
        .unwrap();
        assert!(matches!(
            d.handle_pio_write(P + SPIN_OFFSET, &le(0x0042_0001)),
            PioOutcome::Handled(Handled::Forward(Command::Spin(_)))
        ));
        assert_eq!(
            d.handle_pio_write(P + SPIN_OFFSET, &le(0x0042_0002)), // waits for vCPU 2 of 2
            PioOutcome::Handled(Handled::Rejected(Reject::NoSuchVcpu))
        );
        assert_eq!(
            d.handle_pio_write(P + SHARED_PAGE_OFFSET, &le(9)),
            PioOutcome::Handled(Handled::Forward(Command::SharedPage { pfn: 9 }))
        );
        let mut buf = [0u8; 4];
        assert_eq!(
            d.handle_pio_read(P + SPIN_OFFSET, &mut buf),
            PioOutcome::Handled(Handled::Forward(Command::ReadSpinWindow))
        );
        assert_eq!(buf, [0xff; 4], "pre-filled for a VMM that does not answer");
        let mut short = [0u8; 2];
        assert_eq!(
            d.handle_pio_read(P + SPIN_OFFSET, &mut short),
            PioOutcome::Handled(Handled::Rejected(Reject::Read))
        );
        assert_eq!(
            d.handle_pio_read(P + KICK_OFFSET, &mut buf),
            PioOutcome::Handled(Handled::Rejected(Reject::Read))
        );
        let s = d.stats();
        assert_eq!(s.forwarded, 3);
        assert_eq!(s.kicks + s.forwarded + s.rejected_total(), s.accesses);
    }

    #[test]
    fn spin_window_read_is_rejected_when_spin_is_not_enabled() {
        let d = KickDevice::userspace(cfg(2)).unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(
            d.handle_pio_read(P + SPIN_OFFSET, &mut buf),
            PioOutcome::Handled(Handled::Rejected(Reject::Read))
        );
        assert_eq!(buf, [0xff; 4]);
    }

    #[test]
    fn signal_msi_sends_remrd_to_the_target_apic_id_only() {
        let sink = Arc::new(FakeSink {
            answer: Some(true),
            ..FakeSink::default()
        });
        let d = KickDevice::signal_msi(cfg(4), sink.clone()).unwrap();
        assert_eq!(
            d.handle_pio_write(P, &le(3)),
            PioOutcome::Handled(Handled::Kicked {
                target: 3,
                delivery: Delivery::MsiDelivered
            })
        );
        d.handle_pio_write(P, &le(4));
        d.handle_pio_write(P, &[3]);
        assert_eq!(*sink.sent.lock().unwrap(), vec![3]);
        assert_eq!(d.stats().msi_delivered, 1);
        assert_eq!(
            d.handle_hlt(0).unwrap_err(),
            KickError::NotUserspacePath(KickPath::SignalMsi)
        );

        let failing = Arc::new(FakeSink::default());
        let d = KickDevice::signal_msi(cfg(4), failing).unwrap();
        assert!(matches!(
            d.handle_pio_write(P, &le(0)),
            PioOutcome::Handled(Handled::Kicked {
                delivery: Delivery::MsiFailed,
                ..
            })
        ));
        let nobody = Arc::new(FakeSink {
            answer: Some(false),
            ..FakeSink::default()
        });
        let d = KickDevice::signal_msi(cfg(4), nobody).unwrap();
        d.handle_pio_write(P, &le(0));
        assert_eq!(d.stats().msi_not_delivered, 1);
    }

    #[test]
    fn in_kernel_counts_kicks_that_reach_userspace() {
        let d = KickDevice::in_kernel(cfg(2), None).unwrap();
        assert!(matches!(
            d.handle_pio_write(P, &le(1)),
            PioOutcome::Handled(Handled::Kicked {
                delivery: Delivery::InKernelMissed,
                ..
            })
        ));
        assert_eq!(d.stats().in_kernel_missed, 1);
        let sink = Arc::new(FakeSink {
            answer: Some(true),
            ..FakeSink::default()
        });
        let d = KickDevice::in_kernel(cfg(2), Some(sink.clone())).unwrap();
        d.handle_pio_write(P, &le(1));
        assert_eq!(*sink.sent.lock().unwrap(), vec![1]);
        // In-kernel and signal-msi devices ignore shutdown/interrupt (nothing parks).
        d.shutdown();
        d.interrupt(0);
    }

    #[test]
    fn rejects_are_logged_once_per_interval() {
        let clock = Arc::new(ManualClock::new(0));
        let d = KickDevice::userspace_with_clock(
            KickConfig {
                log_interval: Duration::from_secs(1),
                ..cfg(1)
            },
            Box::new(clock.clone()),
        )
        .unwrap();
        // The limiter decides; check it through the device's own limiter state.
        d.handle_pio_write(P, &le(5));
        assert_eq!(d.limiter.check(Reject::NoSuchVcpu.index()), None);
        clock.advance(1_000_000_000);
        assert_eq!(d.limiter.check(Reject::NoSuchVcpu.index()), Some(1));
    }

    #[test]
    fn handle_hlt_parks_until_kicked_and_shutdown_releases() {
        let d = Arc::new(
            KickDevice::userspace(KickConfig {
                park_timeout: Some(Duration::from_secs(10)),
                ..cfg(2)
            })
            .unwrap(),
        );
        assert!(matches!(
            d.handle_hlt(2).unwrap_err(),
            KickError::NoSuchVcpu { vcpu: 2, .. }
        ));
        let t = {
            let d = d.clone();
            thread::spawn(move || d.handle_hlt(1).unwrap())
        };
        let start = Instant::now();
        while !d.latch(1).unwrap().is_parked() && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(1));
        }
        // A kick of vCPU 0 must not release vCPU 1.
        d.handle_pio_write(P, &le(0));
        thread::sleep(Duration::from_millis(20));
        assert!(d.latch(1).unwrap().is_parked());
        d.handle_pio_write(P, &le(1));
        assert_eq!(t.join().unwrap(), ParkOutcome::Kicked);
        assert_eq!(d.stats().woke_parked, 1);

        let t = {
            let d = d.clone();
            thread::spawn(move || d.handle_hlt(1).unwrap())
        };
        d.shutdown();
        assert_eq!(t.join().unwrap(), ParkOutcome::Shutdown);
    }

    #[test]
    fn wait_is_gated_forwarded_and_parks_on_the_hlt_latch() {
        use pvspin_abi::doorbell::{SpinNotify, WAIT_OFFSET};
        let wait = SpinNotify {
            waiting_for: Some(0),
            next_owner: false,
            spun_bucket: 2,
            lock_hash: 7,
        }
        .encode();
        // Off by default: rejected as not enabled, nothing parks.
        let off = KickDevice::userspace(cfg(2)).unwrap();
        assert_eq!(
            off.handle_pio_write(P + WAIT_OFFSET, &le(wait)),
            PioOutcome::Handled(Handled::Rejected(Reject::NotEnabled))
        );
        let d = Arc::new(
            KickDevice::userspace(KickConfig {
                extra_commands: FEATURE_WAIT,
                ..cfg(2)
            })
            .unwrap(),
        );
        assert_ne!(d.features() & FEATURE_WAIT, 0);
        assert_eq!(
            d.handle_pio_write(P + WAIT_OFFSET, &le(wait)),
            PioOutcome::Handled(Handled::Forward(Command::Wait(SpinNotify::decode(wait))))
        );
        // A kick that lands before the wait is remembered: the wait returns at once.
        d.handle_pio_write(P, &le(1));
        assert_eq!(
            d.handle_wait(1, Some(Duration::from_secs(10))).unwrap(),
            ParkOutcome::KickedBeforePark
        );
        // Bounded: without a kick the wait ends by its timeout.
        let start = Instant::now();
        assert_eq!(
            d.handle_wait(1, Some(Duration::from_millis(20))).unwrap(),
            ParkOutcome::TimedOut
        );
        assert!(start.elapsed() >= Duration::from_millis(20));
        // Interruptible by the VMM.
        let t = {
            let d = d.clone();
            thread::spawn(move || d.handle_wait(0, Some(Duration::from_secs(10))).unwrap())
        };
        while !d.latch(0).unwrap().is_parked() && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(1));
        }
        d.interrupt(0);
        assert_eq!(t.join().unwrap(), ParkOutcome::Interrupted);
        assert_eq!(d.stats().wait_parks, 3);
        assert!(d.handle_wait(2, None).is_err());
    }
}
