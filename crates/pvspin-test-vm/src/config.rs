//! The run configuration and its validation.

use pvspin_test_vm_proto::{
    min_memory_bytes, LockKind, Workload, CPUID_QUERIES, MAPPED_BYTES, MAX_VCPUS,
};

// The guest protocol's vCPU limit is the ABI's.
const _: () = assert!(MAX_VCPUS == pvspin_abi::MAX_VCPUS);

/// Everything one run needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunConfig {
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest workload.
    pub workload: Workload,
    /// Lock used by the lock workload.
    pub lock: LockKind,
    /// Lock acquisitions per vCPU.
    pub iterations: u64,
    /// Work units inside each critical section.
    pub cs_work: u64,
    /// Work units between critical sections.
    pub ncs_work: u64,
    /// Busy host threads competing with the vCPUs for host CPUs.
    pub hogs: u32,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// A running vCPU that shows no progress for this long fails the run.
    pub watchdog_ms: u64,
    /// The whole run fails after this long.
    pub timeout_ms: u64,
    /// Copy the guest's serial output to stdout.
    pub echo_console: bool,
    /// CPUID leaves the `cpuid` workload executes and reports (0 = unused).
    pub cpuid_leaves: [u32; CPUID_QUERIES],
    /// Where the vCPUs run, for KVM's paravirt plan (`None`: no plan, CPUID passed through).
    pub placement: Option<pvspin::Placement>,
    /// Which Linux guest kernels the paravirt plan must be right for (with `placement`).
    pub guest_kernel: pvspin::GuestKernel,
    /// Paravirtual locks in the guest.
    pub pv: PvMode,
    /// How kicks wake halted vCPUs (with `pv: Kick`).
    pub kick_path: pvspin::KickPath,
    /// Which guest behaviour the guest program runs: pvspin-aware, or a stock Linux guest's.
    pub guest: GuestKind,
    /// A pvspin-aware guest's PV locks: spins before a waiter halts (with spin budgets; with
    /// time budgets only a cap).
    pub spin_threshold: u32,
    /// A stock guest's PV lock: spins before a waiter halts, and before the queue head marks
    /// the lock slow and halts (Linux's `SPIN_THRESHOLD`, [`STOCK_SPIN_THRESHOLD`], unless
    /// `--spin-threshold` says otherwise).
    pub stock_spin_threshold: u32,
    /// With `pv: KickYield`: the directed-yield actuator.
    pub actuator: pvspin::ActuatorKind,
    /// KVM's per-VM halt-polling limit in ns (`None`: the host's default).
    pub halt_poll_ns: Option<u32>,
    /// Userspace kick path: spin this long on the latch before sleeping.
    pub park_spin_us: u64,
    /// Lock and ping-pong workloads: run them in guest user mode.
    pub user_mode: bool,
    /// How PV waiters wait.
    pub wait: WaitMode,
    /// Spin budgets in time (ABI 0.3 hint pages) or in spins (0.2).
    pub budgets: BudgetMode,
    /// Start value of the wait budget in us (`None`: pvspin's default).
    pub wait_after_us: Option<u64>,
    /// Ceiling of the wait budget in us (`None`: pvspin's default).
    pub wait_after_max_us: Option<u64>,
    /// Floor of the wait budget in us (`None`: pvspin's default).
    pub wait_after_min_us: Option<u64>,
    /// Floor of the wait budget under run slots in us (`None`: pvspin's default; 0: the plain
    /// floor).
    pub slot_wait_after_min_us: Option<u64>,
    /// Directed yield: longest boost in us (`None`: pvspin's default).
    pub boost_deadline_us: Option<u64>,
    /// Directed yield: whether boosts must stay inside the VM's CPU share.
    pub confinement: pvspin::Confinement,
    /// Run slots (`--sched slots`): how many (`Some(0)`: the CPUs the process is entitled to,
    /// at most the vCPU count); `None`: the host scheduler alone decides.
    pub run_slots: Option<u32>,
    /// Run slots: the quantum in us (`None`: pvspin's default).
    pub slot_quantum_us: Option<u64>,
    /// Run slots on the in-kernel and signal-msi paths: the halt watcher's interval in us
    /// (`None`: pvspin's default).
    pub halt_watch_us: Option<u64>,
    /// The CPUs pvspin tells the guest the VM gets (`PvSpinBuilder::vm_cpus`); `None`: what the
    /// process may use (`pvspin::entitled_cpus`).
    pub vm_cpus: Option<usize>,
    /// PV kicks through the pvspin virtio device served by the vhost-user backend at this
    /// socket (`--pv-backend vhost-user:PATH`), instead of pvspin in this process.
    pub vhost_user: Option<std::path::PathBuf>,
    /// With `vhost_user`: kicks stay in KVM (`--vhost-direct-kicks`). Each kick queue's
    /// notification is an ioeventfd on the very eventfd that is the target vCPU's irqfd, as
    /// pvspin's in-kernel path wires its doorbell, so no backend thread runs per kick; the
    /// backend serves everything else (hint pages, budgets, spin notifications) and never sees
    /// a kick.
    pub vhost_direct_kicks: bool,
    /// Seccomp filters on the run's threads (`crate::seccomp`). The command line's default is
    /// `Enforce`; this struct's is `Off`, so that a library caller opts in.
    pub seccomp: SeccompMode,
    /// Test aid: vCPU 0's thread makes a syscall no filter allows (`socket`) right after its
    /// filter is installed, to show that the filter stops it.
    pub seccomp_violation: bool,
    /// How the guest image boots.
    pub boot: BootMode,
    /// Test aid for `--boot pvh`: this kernel command line instead of the one the options
    /// describe (to show what the guest refuses).
    pub pvh_cmdline: Option<String>,
}

/// How the guest image boots (`--boot`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BootMode {
    /// The test VM's own protocol: every vCPU starts in 64-bit mode at the ELF entry with
    /// the boot parameters the VMM wrote (`pvspin_test_vm_proto`).
    #[default]
    Direct,
    /// PVH, as any PVH VMM boots the image: start info, command line, ACPI MADT/FADT, the
    /// boot vCPU at the PVH entry, APs started by the guest with INIT-SIPI-SIPI, power-off
    /// through the ACPI sleep control port (`crate::pvh`).
    Pvh,
}

impl BootMode {
    /// The name `--boot` takes.
    pub fn name(self) -> &'static str {
        match self {
            BootMode::Direct => "direct",
            BootMode::Pvh => "pvh",
        }
    }
}

/// Which guest the guest program behaves as (`--guest`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GuestKind {
    /// A pvspin-aware guest: pvspin's PV locks, hint pages, budgets, spin notifications.
    #[default]
    Pvspin,
    /// A stock Linux guest on KVM: Linux's pv qspinlock (`--lock queued`), halts in KVM
    /// (`hlt`; in user mode the doorbell's WAIT without a notification, the stand-in for the
    /// kernel's `hlt`), kicks with the doorbell's KICK (the stand-in for `KVM_HC_KICK_CPU`,
    /// on the in-kernel or signal-msi path), registers steal time and reads the `preempted`
    /// bytes; nothing else of pvspin's ABI.
    Stock,
}

impl GuestKind {
    /// The name `--guest` takes.
    pub fn name(self) -> &'static str {
        match self {
            GuestKind::Pvspin => "pvspin",
            GuestKind::Stock => "stock",
        }
    }
}

/// Linux's `SPIN_THRESHOLD` (`1 << 15` spins of `cpu_relax`): a stock guest's default.
pub const STOCK_SPIN_THRESHOLD: u32 = 1 << 15;

/// What the run's seccomp filters do with a syscall they do not allow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeccompMode {
    /// Kill the process (`SIGSYS`).
    Enforce,
    /// Allow it and log it (the kernel's audit log).
    Log,
    /// No filters.
    #[default]
    Off,
}

/// How the guest's PV waiters wait.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WaitMode {
    /// `hlt` in kernel mode, the doorbell's WAIT in user mode.
    #[default]
    Auto,
    /// `hlt` (kernel mode only).
    Hlt,
    /// The doorbell's WAIT command (ABI 0.3), in either mode.
    Doorbell,
}

/// The unit of the guest's spin budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BudgetMode {
    /// Time (TSC cycles) from the hint page, adapted by host and guest (ABI 0.3).
    #[default]
    Time,
    /// Spin counts: `--spin-threshold` and the SPIN register's window (ABI 0.2).
    Spins,
}

/// Whether the guest's locks are paravirtual.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PvMode {
    /// Plain spinning locks.
    Off,
    /// Waiters halt past the spin threshold; the unlocker kicks the next one through pvspin's
    /// doorbell.
    Kick,
    /// As `Kick`, and waiters past the host's spin window send spin notifications; the host
    /// yields (directed yield to the vCPU they wait for when it can tell it is preempted).
    KickYield,
}

impl PvMode {
    /// Whether the guest's locks halt and are kicked through pvspin's doorbell.
    pub fn kicks(self) -> bool {
        matches!(self, PvMode::Kick | PvMode::KickYield)
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            vcpus: 2,
            workload: Workload::Lock,
            lock: LockKind::Ticket,
            iterations: 2000,
            cs_work: 40,
            ncs_work: 40,
            hogs: 0,
            mem_mib: 16,
            watchdog_ms: 10_000,
            timeout_ms: 300_000,
            echo_console: true,
            cpuid_leaves: [0x4000_0000, 0x4000_0001, 0, 0],
            placement: None,
            guest_kernel: pvspin::GuestKernel::Unknown,
            pv: PvMode::Off,
            kick_path: pvspin::KickPath::InKernel,
            guest: GuestKind::Pvspin,
            spin_threshold: 128,
            stock_spin_threshold: STOCK_SPIN_THRESHOLD,
            actuator: pvspin::ActuatorKind::default(),
            halt_poll_ns: None,
            park_spin_us: 0,
            user_mode: false,
            wait: WaitMode::Auto,
            budgets: BudgetMode::Time,
            wait_after_us: None,
            wait_after_max_us: None,
            wait_after_min_us: None,
            slot_wait_after_min_us: None,
            boost_deadline_us: None,
            confinement: pvspin::Confinement::Auto,
            run_slots: None,
            slot_quantum_us: None,
            halt_watch_us: None,
            vm_cpus: None,
            vhost_user: None,
            vhost_direct_kicks: false,
            seccomp: SeccompMode::Off,
            seccomp_violation: false,
            boot: BootMode::Direct,
            pvh_cmdline: None,
        }
    }
}

/// Why a configuration is refused. Each message names the rule.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RunConfigError {
    /// Zero vCPUs.
    #[error("--vcpus must be at least 1")]
    NoVcpus,
    /// More vCPUs than KVM or the guest protocol allows.
    #[error("--vcpus {got} is more than allowed: KVM allows {kvm_max} vCPUs per VM here and the guest protocol {proto_max} (pvspin_abi::MAX_VCPUS: a vCPU's index is its 8-bit xAPIC ID, 0xFF is broadcast; x2APIC IDs are not supported)")]
    TooManyVcpus {
        /// What was asked for.
        got: u32,
        /// `KVM_CAP_MAX_VCPUS`.
        kvm_max: u32,
        /// [`MAX_VCPUS`].
        proto_max: u32,
    },
    /// Not enough memory for the image and the vCPU stacks.
    #[error("--mem-mib {got} is too little: {vcpus} vCPUs need at least {need_mib} MiB (image, tables and one stack per vCPU)")]
    TooLittleMemory {
        /// What was asked for.
        got: u64,
        /// vCPUs configured.
        vcpus: u32,
        /// The minimum.
        need_mib: u64,
    },
    /// More memory than the guest's page tables map.
    #[error("--mem-mib {got} is more than the guest maps: at most {max_mib} MiB")]
    TooMuchMemory {
        /// What was asked for.
        got: u64,
        /// The maximum.
        max_mib: u64,
    },
    /// A lock workload with nothing to do.
    #[error("--iterations must be at least 1 for the lock workload")]
    NoIterations,
    /// A zero watchdog or timeout would fail every run.
    #[error("--watchdog-ms and --timeout-ms must be at least 1")]
    ZeroBound,
    /// The TAS lock has no PV variant.
    #[error(
        "--pv kick needs --lock ticket, queued or backoff (the tas lock has no paravirtual variant)"
    )]
    NoPvVariant,
    /// A spin threshold of 0 or beyond the PV locks' maximum.
    #[error("--spin-threshold must be between 1 and {max}, got {got}")]
    SpinThreshold {
        /// What was asked for.
        got: u32,
        /// The maximum.
        max: u32,
    },
    /// Ping-pong measures kicks, so it needs PV and a partner.
    #[error("--workload pingpong needs --pv kick and at least 2 vCPUs")]
    PingPongNeedsPv,
    /// Run slots gate the vCPU threads through pvspin's hooks, which a kick path brings.
    #[error("--sched slots needs --pv kick or kick+yield")]
    SlotsNeedKicks,
    /// The vhost-user backend serves the virtio device's kicks, time budgets only.
    #[error("--pv-backend vhost-user needs --pv kick or kick+yield, --kick-path in-kernel (the kick queues are irqfds on the in-kernel irqchip), --budgets time and no --sched slots")]
    VhostUserNeeds,
    /// Direct kicks wire the vhost-user device's kick queues.
    #[error("--vhost-direct-kicks needs --pv-backend vhost-user")]
    DirectKicksNeedVhostUser,
    /// Options of pvspin in this process, which a vhost-user run does not use.
    #[error("--pv-backend vhost-user: {0} acts on pvspin in this process, which a vhost-user run does not use (pvspind has its own options: --yield, --adjust-us, --max-events-per-sec)")]
    InProcessOnly(&'static str),
    /// The hostile workload acts through spin notifications.
    #[error("--workload abuse needs --pv kick+yield and at least 2 vCPUs")]
    AbuseNeedsNotifications,
    /// User mode cannot halt.
    #[error("--cs-mode user needs --workload lock, pingpong, burn or abuse, and not --wait hlt (hlt is privileged: user-mode waiters wait with the doorbell's WAIT)")]
    UserModeCannotHalt,
    /// Budget overrides that contradict each other.
    #[error(
        "the wait budget needs 0 < --wait-after-min-us ({min}) <= --wait-after-us ({start}) <= --wait-after-max-us ({max}), in us with pvspin's defaults 2, 50 and 1000"
    )]
    WaitBudget {
        /// Floor.
        min: u64,
        /// Start.
        start: u64,
        /// Ceiling.
        max: u64,
    },
    /// A stock guest halts in KVM, so its kicks need the in-kernel LAPIC.
    #[error("--guest stock needs --kick-path in-kernel or signal-msi: a stock guest halts inside KVM (hlt, or in user mode WAIT as its stand-in), which needs the in-kernel LAPIC, and kicks as KVM_HC_KICK_CPU does (a REMRD MSI)")]
    StockGuestNeedsInKernelLapic,
    /// Linux has a PV version of the queued spinlock only.
    #[error("--guest stock with --pv kick needs --lock queued (Linux's pv qspinlock; Linux has no PV ticket or backoff lock); with --pv off any lock runs plain")]
    StockGuestNoPvLock,
    /// An option only a pvspin-aware guest has a use for.
    #[error("--guest stock: {0} needs a pvspin-aware guest (a stock guest uses only the doorbell's KICK, WAIT as its user-mode halt, and KVM steal time)")]
    StockGuestCannot(&'static str),
    /// PVH boot starts the APs through KVM's in-kernel LAPIC.
    #[error("--boot pvh needs an in-kernel LAPIC (the guest starts its APs with INIT-SIPI-SIPI, which KVM's LAPIC delivers): not --kick-path userspace, which runs without one")]
    PvhNeedsInKernelLapic,
    /// PVH boot tells the guest its parameters on the command line, which has no virtio-mmio
    /// device address.
    #[error("--boot pvh does not take --pv-backend vhost-user (the guest's command line has no virtio-mmio device; use --boot direct)")]
    PvhNoVhostUser,
    /// Too many hogs.
    #[error("--hogs {got} is more than {max}")]
    TooManyHogs {
        /// What was asked for.
        got: u32,
        /// The maximum.
        max: u32,
    },
}

/// The largest spin threshold the guest's PV locks accept.
pub const MAX_SPIN_THRESHOLD: u32 = 1 << 24;

/// The most CPU-hog threads a run may start.
pub const MAX_HOGS: u32 = 256;

impl RunConfig {
    /// Checks the configuration against its rules and against KVM's vCPU limit.
    pub fn validate(&self, kvm_max_vcpus: u32) -> Result<(), RunConfigError> {
        if self.vcpus == 0 {
            return Err(RunConfigError::NoVcpus);
        }
        if self.vcpus > kvm_max_vcpus || self.vcpus > MAX_VCPUS {
            return Err(RunConfigError::TooManyVcpus {
                got: self.vcpus,
                kvm_max: kvm_max_vcpus,
                proto_max: MAX_VCPUS,
            });
        }
        let need = min_memory_bytes(self.vcpus);
        let need_mib = need.div_ceil(1 << 20);
        if self.mem_mib < need_mib {
            return Err(RunConfigError::TooLittleMemory {
                got: self.mem_mib,
                vcpus: self.vcpus,
                need_mib,
            });
        }
        if self.mem_mib > MAPPED_BYTES >> 20 {
            return Err(RunConfigError::TooMuchMemory {
                got: self.mem_mib,
                max_mib: MAPPED_BYTES >> 20,
            });
        }
        if self.workload == Workload::Lock && self.iterations == 0 {
            return Err(RunConfigError::NoIterations);
        }
        if self.watchdog_ms == 0 || self.timeout_ms == 0 {
            return Err(RunConfigError::ZeroBound);
        }
        if self.pv.kicks() && self.lock == LockKind::Tas {
            return Err(RunConfigError::NoPvVariant);
        }
        for threshold in [self.spin_threshold, self.stock_spin_threshold] {
            if threshold == 0 || threshold > MAX_SPIN_THRESHOLD {
                return Err(RunConfigError::SpinThreshold {
                    got: threshold,
                    max: MAX_SPIN_THRESHOLD,
                });
            }
        }
        if self.guest == GuestKind::Stock {
            self.validate_stock()?;
        }
        if self.workload == Workload::PingPong
            && (self.pv != PvMode::Kick || self.vcpus < 2 || self.iterations == 0)
        {
            return Err(RunConfigError::PingPongNeedsPv);
        }
        if self.vhost_direct_kicks && self.vhost_user.is_none() {
            return Err(RunConfigError::DirectKicksNeedVhostUser);
        }
        if self.vhost_user.is_some()
            && (!self.pv.kicks()
                || self.run_slots.is_some()
                || self.budgets == BudgetMode::Spins
                || self.kick_path != pvspin::KickPath::InKernel)
        {
            return Err(RunConfigError::VhostUserNeeds);
        }
        if self.vhost_user.is_some() {
            let in_process_only = [
                (
                    self.actuator != pvspin::ActuatorKind::default(),
                    "--actuator",
                ),
                (
                    self.confinement != pvspin::Confinement::Auto,
                    "--boosts unconfined",
                ),
                (self.boost_deadline_us.is_some(), "--boost-deadline-us"),
                (self.park_spin_us != 0, "--park-spin-us"),
            ];
            if let Some((_, option)) = in_process_only.iter().find(|(set, _)| *set) {
                return Err(RunConfigError::InProcessOnly(option));
            }
        }
        if self.run_slots.is_some() && self.pv == PvMode::Off {
            return Err(RunConfigError::SlotsNeedKicks);
        }
        if self.workload == Workload::Abuse && (self.pv != PvMode::KickYield || self.vcpus < 2) {
            return Err(RunConfigError::AbuseNeedsNotifications);
        }
        if self.user_mode
            && (!matches!(
                self.workload,
                Workload::Lock | Workload::PingPong | Workload::Burn | Workload::Abuse
            ) || self.wait == WaitMode::Hlt)
        {
            return Err(RunConfigError::UserModeCannotHalt);
        }
        let budget = self.budget_config();
        if budget.validate().is_err() {
            return Err(RunConfigError::WaitBudget {
                min: budget.wait_after_min_ns / 1000,
                start: budget.wait_after_ns / 1000,
                max: budget.wait_after_max_ns / 1000,
            });
        }
        if self.boot == BootMode::Pvh {
            if self.pv.kicks() && self.kick_path == pvspin::KickPath::Userspace {
                return Err(RunConfigError::PvhNeedsInKernelLapic);
            }
            if self.vhost_user.is_some() {
                return Err(RunConfigError::PvhNoVhostUser);
            }
        }
        if self.hogs > MAX_HOGS {
            return Err(RunConfigError::TooManyHogs {
                got: self.hogs,
                max: MAX_HOGS,
            });
        }
        Ok(())
    }

    /// The stock guest's rules (`--guest stock`).
    fn validate_stock(&self) -> Result<(), RunConfigError> {
        let pvspin_only = [
            (
                self.pv == PvMode::KickYield,
                "--pv kick+yield (spin notifications; a stock guest sends none, use --pv kick)",
            ),
            (
                self.wait == WaitMode::Doorbell,
                "--wait doorbell (a stock kernel halts with hlt)",
            ),
            (
                self.vhost_user.is_some(),
                "--pv-backend vhost-user (pvspin's virtio device)",
            ),
            (self.workload == Workload::PingPong, "--workload pingpong"),
            (self.workload == Workload::Abuse, "--workload abuse"),
        ];
        if let Some((_, option)) = pvspin_only.iter().find(|(set, _)| *set) {
            return Err(RunConfigError::StockGuestCannot(option));
        }
        if self.pv.kicks() {
            if self.kick_path == pvspin::KickPath::Userspace {
                return Err(RunConfigError::StockGuestNeedsInKernelLapic);
            }
            if self.lock != LockKind::Queued {
                return Err(RunConfigError::StockGuestNoPvLock);
            }
        }
        Ok(())
    }

    /// The spin threshold the run's guest uses.
    pub fn guest_spin_threshold(&self) -> u32 {
        match self.guest {
            GuestKind::Pvspin => self.spin_threshold,
            GuestKind::Stock => self.stock_spin_threshold,
        }
    }

    /// Guest memory in bytes.
    pub fn mem_bytes(&self) -> u64 {
        self.mem_mib << 20
    }

    /// pvspin's budget configuration with this run's overrides.
    pub fn budget_config(&self) -> pvspin::BudgetConfig {
        let mut b = pvspin::BudgetConfig::default();
        if let Some(us) = self.wait_after_max_us {
            b.wait_after_max_ns = us.saturating_mul(1000);
        }
        if let Some(us) = self.wait_after_us {
            b.wait_after_ns = us.saturating_mul(1000);
        }
        if let Some(us) = self.wait_after_min_us {
            b.wait_after_min_ns = us.saturating_mul(1000);
        }
        if let Some(us) = self.slot_wait_after_min_us {
            b.run_slots_wait_after_min_ns = us.saturating_mul(1000);
        }
        b
    }

    /// The guest's [`pvspin_test_vm_proto::BootParams::pv_flags`].
    pub fn pv_flags(&self) -> u32 {
        if self.guest == GuestKind::Stock {
            // Nothing of pvspin's options: no budgets, no CS_DEPTH, its own way to wait.
            return pvspin_test_vm_proto::PV_FLAG_STOCK_GUEST;
        }
        let mut flags = 0;
        match self.wait {
            WaitMode::Auto => {}
            WaitMode::Hlt => flags |= pvspin_test_vm_proto::PV_FLAG_WAIT_HLT,
            WaitMode::Doorbell => flags |= pvspin_test_vm_proto::PV_FLAG_WAIT_DOORBELL,
        }
        if self.budgets == BudgetMode::Spins {
            flags |= pvspin_test_vm_proto::PV_FLAG_SPIN_BUDGETS;
        }
        if self.run_slots.is_some() {
            flags |= pvspin_test_vm_proto::PV_FLAG_CS_DEPTH;
        }
        flags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(RunConfig::default().validate(1024), Ok(()));
    }

    #[test]
    fn backoff_lock_runs_with_and_without_pv() {
        for pv in [PvMode::Off, PvMode::Kick, PvMode::KickYield] {
            let backoff = RunConfig {
                lock: LockKind::Backoff,
                pv,
                ..RunConfig::default()
            };
            assert_eq!(backoff.validate(1024), Ok(()), "{pv:?}");
        }
    }

    #[test]
    fn refuses_each_rule() {
        let base = RunConfig::default();
        let check = |config: RunConfig| config.validate(8).unwrap_err();
        assert_eq!(
            check(RunConfig {
                wait_after_min_us: Some(100),
                ..base.clone()
            }),
            RunConfigError::WaitBudget {
                min: 100,
                start: 50,
                max: 1000
            }
        );
        // A ceiling below the run slots' floor is not an error: the floor is capped.
        RunConfig {
            wait_after_us: Some(10),
            wait_after_max_us: Some(10),
            ..base.clone()
        }
        .validate(8)
        .unwrap();
        assert_eq!(
            check(RunConfig {
                vcpus: 0,
                ..base.clone()
            }),
            RunConfigError::NoVcpus
        );
        assert!(matches!(
            check(RunConfig {
                vcpus: 9,
                ..base.clone()
            }),
            RunConfigError::TooManyVcpus {
                got: 9,
                kvm_max: 8,
                ..
            }
        ));
        assert!(matches!(
            check(RunConfig {
                mem_mib: 1,
                ..base.clone()
            }),
            RunConfigError::TooLittleMemory { got: 1, .. }
        ));
        assert!(matches!(
            check(RunConfig {
                mem_mib: 4096,
                ..base.clone()
            }),
            RunConfigError::TooMuchMemory { got: 4096, .. }
        ));
        assert_eq!(
            check(RunConfig {
                iterations: 0,
                ..base.clone()
            }),
            RunConfigError::NoIterations
        );
        assert_eq!(
            check(RunConfig {
                watchdog_ms: 0,
                ..base.clone()
            }),
            RunConfigError::ZeroBound
        );
        assert!(matches!(
            check(RunConfig {
                hogs: 1000,
                ..base.clone()
            }),
            RunConfigError::TooManyHogs { .. }
        ));
        assert_eq!(
            check(RunConfig {
                pv: PvMode::Kick,
                lock: LockKind::Tas,
                ..base.clone()
            }),
            RunConfigError::NoPvVariant
        );
        // The guest's PV lock domain has state for every vCPU the protocol allows.
        for lock in [LockKind::Queued, LockKind::Ticket] {
            assert_eq!(
                RunConfig {
                    pv: PvMode::Kick,
                    lock,
                    vcpus: MAX_VCPUS,
                    ..base.clone()
                }
                .validate(1024),
                Ok(())
            );
        }
        assert!(matches!(
            check(RunConfig {
                spin_threshold: 0,
                ..base.clone()
            }),
            RunConfigError::SpinThreshold { got: 0, .. }
        ));
        // The protocol's limit applies even when KVM allows more.
        assert!(RunConfig {
            vcpus: 256,
            mem_mib: 64,
            ..base
        }
        .validate(1024)
        .is_err());
    }

    #[test]
    fn vhost_user_runs_refuse_what_they_cannot_use() {
        let vhost = RunConfig {
            pv: PvMode::KickYield,
            vhost_user: Some("/run/pvspind.sock".into()),
            ..RunConfig::default()
        };
        assert_eq!(vhost.validate(8), Ok(()));
        let check = |config: RunConfig| config.validate(8).unwrap_err();
        for refused in [
            RunConfig {
                pv: PvMode::Off,
                ..vhost.clone()
            },
            RunConfig {
                kick_path: pvspin::KickPath::Userspace,
                ..vhost.clone()
            },
            RunConfig {
                budgets: BudgetMode::Spins,
                ..vhost.clone()
            },
            RunConfig {
                run_slots: Some(0),
                kick_path: pvspin::KickPath::Userspace,
                ..vhost.clone()
            },
        ] {
            assert_eq!(check(refused), RunConfigError::VhostUserNeeds);
        }
        let direct = RunConfig {
            vhost_direct_kicks: true,
            ..vhost.clone()
        };
        assert_eq!(direct.validate(8), Ok(()));
        assert_eq!(
            check(RunConfig {
                vhost_user: None,
                ..direct
            }),
            RunConfigError::DirectKicksNeedVhostUser
        );
        let fifo = RunConfig {
            actuator: pvspin::ActuatorKind::Fifo,
            ..vhost.clone()
        };
        assert_eq!(check(fifo), RunConfigError::InProcessOnly("--actuator"));
        let spin = RunConfig {
            park_spin_us: 50,
            ..vhost
        };
        assert!(check(spin).to_string().contains("--park-spin-us"));
    }

    #[test]
    fn stock_guest_runs_the_pv_qspinlock_on_the_msi_paths_and_any_lock_plain() {
        let stock = RunConfig {
            guest: GuestKind::Stock,
            lock: LockKind::Queued,
            pv: PvMode::Kick,
            ..RunConfig::default()
        };
        for kick_path in [pvspin::KickPath::InKernel, pvspin::KickPath::SignalMsi] {
            for user_mode in [false, true] {
                let config = RunConfig {
                    kick_path,
                    user_mode,
                    ..stock.clone()
                };
                assert_eq!(config.validate(8), Ok(()), "{kick_path:?} user {user_mode}");
            }
        }
        for lock in [
            LockKind::Ticket,
            LockKind::Tas,
            LockKind::Backoff,
            LockKind::Queued,
        ] {
            let plain = RunConfig {
                lock,
                pv: PvMode::Off,
                ..stock.clone()
            };
            assert_eq!(plain.validate(8), Ok(()), "{lock:?}");
        }
        // Linux's default threshold, and only the stock guest's flag.
        assert_eq!(stock.guest_spin_threshold(), STOCK_SPIN_THRESHOLD);
        assert_eq!(stock.pv_flags(), pvspin_test_vm_proto::PV_FLAG_STOCK_GUEST);
        let slots = RunConfig {
            run_slots: Some(0),
            budgets: BudgetMode::Spins,
            ..stock.clone()
        };
        assert_eq!(slots.pv_flags(), pvspin_test_vm_proto::PV_FLAG_STOCK_GUEST);
        assert_eq!(RunConfig::default().guest_spin_threshold(), 128);
    }

    #[test]
    fn stock_guest_refusals_are_named() {
        let stock = RunConfig {
            guest: GuestKind::Stock,
            lock: LockKind::Queued,
            pv: PvMode::Kick,
            ..RunConfig::default()
        };
        let check = |config: RunConfig| config.validate(8).unwrap_err();
        assert_eq!(
            check(RunConfig {
                kick_path: pvspin::KickPath::Userspace,
                ..stock.clone()
            }),
            RunConfigError::StockGuestNeedsInKernelLapic
        );
        for lock in [LockKind::Ticket, LockKind::Backoff] {
            assert_eq!(
                check(RunConfig {
                    lock,
                    ..stock.clone()
                }),
                RunConfigError::StockGuestNoPvLock,
                "{lock:?}"
            );
        }
        // The tas lock has no PV variant in either guest.
        assert_eq!(
            check(RunConfig {
                lock: LockKind::Tas,
                ..stock.clone()
            }),
            RunConfigError::NoPvVariant
        );
        let yield_ = check(RunConfig {
            pv: PvMode::KickYield,
            ..stock.clone()
        });
        assert!(
            matches!(yield_, RunConfigError::StockGuestCannot(o) if o.starts_with("--pv kick+yield")),
            "{yield_}"
        );
        let doorbell = check(RunConfig {
            wait: WaitMode::Doorbell,
            ..stock.clone()
        });
        assert!(
            doorbell.to_string().contains("--wait doorbell"),
            "{doorbell}"
        );
        let vhost = check(RunConfig {
            vhost_user: Some("/run/pvspind.sock".into()),
            ..stock.clone()
        });
        assert!(
            matches!(vhost, RunConfigError::StockGuestCannot(_)),
            "{vhost}"
        );
        let pingpong = check(RunConfig {
            workload: Workload::PingPong,
            ..stock.clone()
        });
        assert_eq!(
            pingpong,
            RunConfigError::StockGuestCannot("--workload pingpong")
        );
        assert!(matches!(
            check(RunConfig {
                stock_spin_threshold: 0,
                ..stock.clone()
            }),
            RunConfigError::SpinThreshold { got: 0, .. }
        ));
        // The same options are fine for a pvspin-aware guest.
        for config in [
            RunConfig {
                kick_path: pvspin::KickPath::Userspace,
                ..stock.clone()
            },
            RunConfig {
                lock: LockKind::Ticket,
                ..stock.clone()
            },
            RunConfig {
                pv: PvMode::KickYield,
                ..stock.clone()
            },
        ] {
            let pvspin = RunConfig {
                guest: GuestKind::Pvspin,
                ..config
            };
            assert_eq!(pvspin.validate(8), Ok(()), "{pvspin:?}");
        }
    }

    #[test]
    fn pvh_boot_refuses_what_it_cannot_start() {
        let pvh = RunConfig {
            boot: BootMode::Pvh,
            pv: PvMode::Kick,
            ..RunConfig::default()
        };
        assert_eq!(pvh.validate(8), Ok(()));
        assert_eq!(
            RunConfig {
                kick_path: pvspin::KickPath::Userspace,
                ..pvh.clone()
            }
            .validate(8),
            Err(RunConfigError::PvhNeedsInKernelLapic)
        );
        assert_eq!(
            RunConfig {
                vhost_user: Some("/run/pvspind.sock".into()),
                ..pvh.clone()
            }
            .validate(8),
            Err(RunConfigError::PvhNoVhostUser)
        );
        // Without PV the kick path is not used.
        assert_eq!(
            RunConfig {
                pv: PvMode::Off,
                kick_path: pvspin::KickPath::Userspace,
                ..pvh
            }
            .validate(8),
            Ok(())
        );
    }

    #[test]
    fn memory_minimum_grows_with_vcpus() {
        let config = RunConfig {
            vcpus: 255,
            mem_mib: 4,
            ..RunConfig::default()
        };
        let err = config.validate(1024).unwrap_err();
        assert!(err.to_string().contains("255 vCPUs need at least"), "{err}");
    }
}
