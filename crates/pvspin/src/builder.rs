//! [`PvSpinBuilder`]: what the VMM asks of pvspin, checked once in
//! [`build`](PvSpinBuilder::build).
//!
//! The options that ride the kick doorbell (directed yield, hint pages, WAIT, run slots) exist
//! only on the builder that [`kick`](PvSpinBuilder::kick) returns, so a configuration that
//! needs a kick path and has none does not compile:
//!
//! ```compile_fail
//! // Run slots without a kick path: `PvSpinBuilder<NoKick>` has no `run_slots`.
//! let _ = pvspin::PvSpin::builder().run_slots(pvspin::SlotConfig::new(2));
//! ```
//!
//! ```
//! # use pvspin::{KickOptions, KickPath, PvSpin, SlotConfig, WaitOptions};
//! let _builder = PvSpin::builder()
//!     .vcpus(4)
//!     .kick(KickOptions::new(KickPath::InKernel))
//!     .pv_wait(WaitOptions::default())
//!     .run_slots(SlotConfig::new(2));
//! ```

use std::sync::{Arc, OnceLock};

use pvspin_kick::KickPath;

use crate::telemetry::collect::StatsFds;
use crate::telemetry::VcpuCounterCell;
use crate::{
    check, cpuid, directed, hints, seccomp, slots, ConfigError, DirectedYieldOptions, HintOptions,
    KickOptions, PlanRequest, PvSpin, SlotConfig, StealTimeMemory, VcpuInterrupter, WaitOptions,
    MAX_VCPUS,
};

/// The builder's kick path: none yet ([`NoKick`]) or chosen ([`WithKick`]).
pub trait KickChoice: sealed::Sealed + std::fmt::Debug {
    /// The chosen options, if any.
    fn options(&self) -> Option<KickOptions>;
}

/// No kick path: pvspin's paravirt plan, telemetry and checks only.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoKick;

/// A kick path, with the options that ride its doorbell available.
#[derive(Clone, Copy, Debug)]
pub struct WithKick(KickOptions);

impl KickChoice for NoKick {
    fn options(&self) -> Option<KickOptions> {
        None
    }
}

impl KickChoice for WithKick {
    fn options(&self) -> Option<KickOptions> {
        Some(self.0)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::NoKick {}
    impl Sealed for super::WithKick {}
}

/// Builds a [`PvSpin`]. `K` says whether a kick path was chosen ([`PvSpinBuilder::kick`]).
#[derive(Debug, Default)]
pub struct PvSpinBuilder<K: KickChoice = NoKick> {
    kick: K,
    vcpus: Option<usize>,
    interrupter: Option<Arc<dyn VcpuInterrupter>>,
    keep_hypercall_quirk: bool,
    vmm_disabled_quirks: u64,
    paravirt: Option<PlanRequest>,
    directed_yield: Option<DirectedYieldOptions>,
    steal_time: Option<StealTimeMemory>,
    hints: Option<HintOptions>,
    wait: Option<WaitOptions>,
    doorbell_port: Option<u16>,
    cpuid_base: Option<u32>,
    run_slots: Option<SlotConfig>,
    vm_cpus: Option<usize>,
    helper_thread_filter: Option<Arc<seccompiler::BpfProgram>>,
}

impl<K: KickChoice> PvSpinBuilder<K> {
    /// Number of vCPUs in the VM (required).
    pub fn vcpus(mut self, vcpus: usize) -> Self {
        self.vcpus = Some(vcpus);
        self
    }

    /// How pvspin interrupts a vCPU thread (required).
    pub fn interrupter(mut self, interrupter: Arc<dyn VcpuInterrupter>) -> Self {
        self.interrupter = Some(interrupter);
        self
    }

    /// Leaves KVM's FIX_HYPERCALL_INSN quirk on (it is turned off by default, so that a stray
    /// hypercall raises #UD instead of looping in KVM on hosts that emulate guest code). Keep it
    /// for guests that live-migrate between Intel and AMD hosts: their hypercall instruction
    /// was patched for the vendor they booted on. With [`paravirt`](Self::paravirt) it sets
    /// `PlanRequest::disable_fix_hypercall_quirk` to `Some(false)` (refused if that is
    /// `Some(true)`).
    pub fn keep_hypercall_quirk(mut self, keep: bool) -> Self {
        self.keep_hypercall_quirk = keep;
        self
    }

    /// The KVM quirks the VMM disabled on the VM (`KVM_CAP_DISABLE_QUIRKS2`) before
    /// [`PvSpin::configure_vm`]. Hosts before upstream 9966b7822b3f (2025) *replace* the
    /// disabled set on every such call, so pvspin writes these together with its own; a VMM
    /// that disables quirks after `configure_vm` must include [`VmSetup::disabled_quirks`](crate::VmSetup::disabled_quirks).
    pub fn vmm_disabled_quirks(mut self, mask: u64) -> Self {
        self.vmm_disabled_quirks = mask;
        self
    }

    /// Configures KVM's own paravirt machinery (for stock guests' PV spinlocks) from the VM's
    /// placement: the CPUID 0x40000001 features and hints, exit disabling, halt polling,
    /// enforcement of the PV CPUID, quirks. Validated in [`PvSpin::configure_vm`], which
    /// refuses an invalid combination naming the rule. Without it, pvspin only turns the
    /// FIX_HYPERCALL_INSN quirk off and passes the VMM's CPUID through.
    pub fn paravirt(mut self, request: PlanRequest) -> Self {
        self.paravirt = Some(request);
        self
    }

    /// The doorbell's first port (default `pvspin_abi::doorbell::DEFAULT_PORT`, 0xa40; the
    /// doorbell takes `pvspin_abi::doorbell::PORT_COUNT` ports). The guest finds it in
    /// pvspin's CPUID leaf.
    pub fn doorbell_port(mut self, port: u16) -> Self {
        self.doorbell_port = Some(port);
        self
    }

    /// Where pvspin's CPUID leaves go (default `pvspin_abi::cpuid::DEFAULT_BASE`,
    /// 0x40000200): a 0x100-aligned hypervisor base above KVM's 0x40000000 (and above
    /// 0x40000100, where VMMs that present Hyper-V move KVM's leaves), where guests scan.
    pub fn cpuid_base(mut self, base: u32) -> Self {
        self.cpuid_base = Some(base);
        self
    }

    /// Installs `filter` (seccomp, with `seccompiler::apply_filter`) as the first thing on
    /// every helper thread pvspin starts that outlives [`build`](Self::build): the boost
    /// watchdog `pvspin-boost-wd` of the `nice` and `fifo` directed-yield actuators and the
    /// run slots' halt watcher `pvspin-slot-watch` (in-kernel and signal-msi paths). The filter
    /// must allow [`seccomp::baseline_rules`],
    /// [`seccomp::rules`]`(`[`seccomp::ThreadKind::BoostWatchdog`]`)` and
    /// [`seccomp::rules`]`(`[`seccomp::ThreadKind::SlotWatcher`]`)` for the threads it
    /// starts, merged with whatever the VMM's logger needs. If it cannot be installed the
    /// thread stops before doing anything else and `build` fails with
    /// [`ConfigError::Actuator`] or [`ConfigError::HaltWatcher`] (no step-down). The short-lived probe thread (`pvspin-probe`) runs and ends inside
    /// `build`, so it is covered by whatever the thread calling `build` runs under.
    pub fn helper_thread_filter(mut self, filter: Arc<seccompiler::BpfProgram>) -> Self {
        self.helper_thread_filter = Some(filter);
        self
    }

    /// Validates the configuration.
    pub fn build(self) -> Result<PvSpin, ConfigError> {
        let vcpus = self.vcpus.ok_or(ConfigError::MissingVcpus)?;
        if vcpus == 0 || vcpus > MAX_VCPUS {
            return Err(ConfigError::VcpuCount {
                got: vcpus,
                max: MAX_VCPUS,
            });
        }
        let interrupter = self.interrupter.ok_or(ConfigError::MissingInterrupter)?;
        let doorbell_port = self
            .doorbell_port
            .unwrap_or(pvspin_abi::doorbell::DEFAULT_PORT);
        let count = pvspin_abi::doorbell::PORT_COUNT;
        if u32::from(doorbell_port) + u32::from(count) > 0x1_0000 {
            return Err(ConfigError::DoorbellPort {
                port: doorbell_port,
                count,
            });
        }
        let cpuid_base = self.cpuid_base.unwrap_or(pvspin_abi::cpuid::DEFAULT_BASE);
        if cpuid::check_base(cpuid_base).is_err() {
            return Err(ConfigError::CpuidBase(cpuid_base));
        }
        let kick_options = self.kick.options();
        let mut paravirt = self.paravirt;
        if let Some(request) = &mut paravirt {
            if usize::try_from(request.vcpus).ok() != Some(vcpus) {
                return Err(ConfigError::PlanVcpus {
                    plan: request.vcpus,
                    builder: vcpus,
                });
            }
            if self.keep_hypercall_quirk {
                if request.disable_fix_hypercall_quirk == Some(true) {
                    return Err(ConfigError::QuirkConflict);
                }
                request.disable_fix_hypercall_quirk = Some(false);
            }
            request.vmm_disabled_quirks |= self.vmm_disabled_quirks;
            if request.lapic_in_kernel.is_none() {
                // The kick paths decide the irqchip; without the kick the VMM does, and the
                // vCPU stage asks each vCPU.
                request.lapic_in_kernel = kick_options.map(|k| k.path != KickPath::Userspace);
            }
        }
        let directed_yield = match &self.directed_yield {
            Some(options) => {
                let start = self.helper_thread_filter.clone().map(seccomp::start_hook);
                let mut state = directed::YieldState::new(options, vcpus, start.as_ref())?;
                // One memory: without memory of its own, directed yield reads steal time
                // through the hint pages' map.
                state.mem = self
                    .steal_time
                    .clone()
                    .or_else(|| self.hints.as_ref().map(|h| h.memory.clone()))
                    .map(directed::PageBytes);
                Some(Arc::new(state))
            }
            None => None,
        };
        let hints = match &self.hints {
            Some(options) => {
                // The higher floor where slots gate vCPUs (more vCPUs than slots), a kick hands
                // the kicker's slot over and a waiter's halt leaves KVM (the userspace path):
                // on signal-msi it made 64 vCPUs 11x slower (docs/benchmarks.md §14.11).
                let gated = self.run_slots.is_some_and(|s| s.slots < vcpus)
                    && kick_options.is_some_and(|k| k.path == KickPath::Userspace);
                let state = hints::HintState::new(options, vcpus, directed_yield.is_some(), gated)?;
                if self.vm_cpus == Some(0) {
                    return Err(ConfigError::NoVmCpus);
                }
                let fit = vcpus_fit(
                    vcpus,
                    self.vm_cpus,
                    self.run_slots.as_ref().map(|s| s.slots),
                    kick_options.map(|k| k.path),
                );
                if let Some(fit) = fit {
                    state.pages.set_vcpus_fit(fit);
                }
                Some(Arc::new(state))
            }
            None => None,
        };
        let run_slots = match (self.run_slots, kick_options) {
            // Only a builder with a kick path (`PvSpinBuilder<WithKick>`) sets `run_slots`.
            (None, _) | (Some(_), None) => None,
            (Some(cfg), Some(kick)) => {
                cfg.validate(vcpus)?;
                if let Some(warning) = slots_path_warning(kick.path, cfg.slots, vcpus) {
                    log::warn!("pvspin: {warning}");
                }
                Some(Arc::new(slots::SlotState::new(
                    vcpus,
                    cfg,
                    hints.clone(),
                    self.hints.as_ref().map(|h| h.memory.clone()),
                    interrupter.clone(),
                    kick.path != KickPath::Userspace,
                    self.helper_thread_filter.clone().map(seccomp::start_hook),
                )?))
            }
        };
        let lapic_in_kernel = match (kick_options, &paravirt) {
            (Some(kick), _) => Some(kick.needs_lapic()),
            (None, Some(request)) => request.lapic_in_kernel,
            (None, None) => None,
        };
        Ok(PvSpin {
            run_slots,
            doorbell_port,
            cpuid_base,
            lapic_in_kernel,
            adoption: Arc::new(check::Adoption::new(vcpus)),
            edits: (0..vcpus).map(|_| std::sync::Mutex::new(None)).collect(),
            hints,
            wait: self.wait,
            directed_yield,
            interrupter,
            keep_hypercall_quirk: self.keep_hypercall_quirk,
            vmm_disabled_quirks: self.vmm_disabled_quirks,
            paravirt,
            kick_options,
            kick: OnceLock::new(),
            plan: OnceLock::new(),
            stats: StatsFds::new(vcpus),
            cells: (0..vcpus)
                .map(|_| Arc::new(VcpuCounterCell::new()))
                .collect(),
        })
    }
}

impl PvSpinBuilder<NoKick> {
    /// Gives the guest pvspin's kick doorbell (pv_kick for PV spinlocks; see `docs/abi.md`),
    /// woken through `options.path`. The in-kernel and signal-msi paths need the VMM's
    /// in-kernel irqchip (created before the vCPUs); the in-kernel path also needs
    /// [`PvSpin::set_kick_gsis`] and the wiring it returns applied. The options that ride the
    /// doorbell (directed yield, hint pages, WAIT, run slots) are set on the builder this
    /// returns, so a configuration that needs a kick path and lacks one does not compile.
    pub fn kick(self, options: KickOptions) -> PvSpinBuilder<WithKick> {
        PvSpinBuilder {
            kick: WithKick(options),
            vcpus: self.vcpus,
            interrupter: self.interrupter,
            keep_hypercall_quirk: self.keep_hypercall_quirk,
            vmm_disabled_quirks: self.vmm_disabled_quirks,
            paravirt: self.paravirt,
            directed_yield: None,
            steal_time: None,
            hints: None,
            wait: None,
            doorbell_port: self.doorbell_port,
            cpuid_base: self.cpuid_base,
            run_slots: None,
            vm_cpus: None,
            helper_thread_filter: self.helper_thread_filter,
        }
    }
}

impl PvSpinBuilder<WithKick> {
    /// Acts on the guest's spin notifications (the SPIN doorbell command, `docs/abi.md`):
    /// directed yield to the vCPU the guest waits for, KVM's candidate rules otherwise
    /// (kernel-mode filter from the CPL at each exit), and an adaptive per-vCPU spin window the
    /// guest reads. Needs [`kick`](Self::kick); the host then advertises `SPIN_NOTIFY`. The
    /// actuator is built here: a `fifo` (or `nice`) actuator the process may not apply is
    /// refused with [`ConfigError::Actuator`] unless `options.fallback` is set.
    pub fn directed_yield(mut self, options: DirectedYieldOptions) -> Self {
        self.directed_yield = Some(options);
        self
    }

    /// Lets directed yield see vCPUs the host preempted inside `KVM_RUN`: `memory` is the
    /// VMM's guest memory (the [`GuestPageMap`](crate::GuestPageMap) hint pages take; a
    /// `vm_memory::GuestMemoryMmap` is one), and [`PvSpin::set_steal_time_gpa`] says where each
    /// vCPU's KVM steal-time area is (the guest registers it with `MSR_KVM_STEAL_TIME`; KVM sets
    /// its `preempted` byte when it deschedules a runnable vCPU). Candidates' bytes are read as
    /// a decision examines them. Needed only without [`hint_pages`](Self::hint_pages), whose
    /// memory serves here too; without either, a vCPU inside `KVM_RUN` always reads as
    /// running.
    pub fn steal_time_memory(mut self, memory: StealTimeMemory) -> Self {
        self.steal_time = Some(memory);
        self
    }

    /// Lets each vCPU register a hint page (ABI 0.3 SHARED_PAGE, `docs/abi.md`, "SHARED_PAGE:
    /// the hint page"): pvspin
    /// publishes the vCPU's spin and wait budgets there in TSC cycles, adapts them from the
    /// guest's wait reports (`options.budgets`), and reads the guest's spin state, all without
    /// exits. `options.memory` maps guest pages (a `vm_memory::GuestMemoryMmap` does). Needs
    /// [`kick`](Self::kick); the host then advertises `SHARED_PAGE`.
    pub fn hint_pages(mut self, options: HintOptions) -> Self {
        self.hints = Some(options);
        self
    }

    /// Gives the guest the WAIT command (ABI 0.3): `pv_wait` without `HLT`, for guest code
    /// that cannot halt (user mode) or prefers one exit that also carries its spin
    /// notification. A kick that lands first is remembered (HLT's latch); the in-kernel path
    /// wakes a waiting vCPU without an exit of the kicker. Needs [`kick`](Self::kick); the host
    /// then advertises `WAIT`.
    pub fn pv_wait(mut self, options: WaitOptions) -> Self {
        self.wait = Some(options);
        self
    }

    /// Run slots (the scheduling issue's lock-aware scheduling inside the VM's share): at
    /// most `config.slots` vCPUs run guest code at once (`entitled_cpus()` is what the
    /// process may use: its affinity and cpu-cgroup quota); the others wait in
    /// [`VcpuHooks::before_run`](crate::VcpuHooks::before_run) on pvspin's own waits, their hint pages saying
    /// `NOT_RUNNING`. A kicked vCPU, or one a waiter names, goes first; a vCPU inside a
    /// critical section (its hint page's `CS_DEPTH`) keeps its slot once past its quantum;
    /// otherwise round robin, an overdue vCPU forced out through the [`VcpuInterrupter`].
    /// Needs a kick path. On the in-kernel and signal-msi paths halts stay inside KVM: `build`
    /// starts a halt watcher thread (`pvspin-slot-watch`, under [`helper_thread_filter`](Self::helper_thread_filter)) that
    /// polls KVM's `blocking` statistic of the holders every
    /// `config.halt_watch_interval` while someone waits, and `configure_vcpu` refuses a host
    /// without that statistic. See `pvspin_slots::policy` for the bound on a vCPU's wait and
    /// on how long more vCPUs than slots run.
    /// With hint pages (pvspin's access to guest memory), a vCPU that waits
    /// for a slot is also shown preempted in its KVM steal-time area, if its guest registered
    /// one (learned from `MSR_KVM_STEAL_TIME`, or given with
    /// [`PvSpin::set_steal_time_gpa`]): KVM sets that byte itself only when it deschedules a
    /// runnable vCPU, and clears it (`record_steal_time`, keeping a PV TLB flush the guest
    /// requested meanwhile) when the vCPU next enters the guest.
    pub fn run_slots(mut self, config: SlotConfig) -> Self {
        self.run_slots = Some(config);
        self
    }

    /// The CPUs this VM gets: its entitlement, the fewer of its affinity's CPUs and its CPU
    /// quota ([`entitled_cpus`](crate::entitled_cpus) reads both for this process; call it
    /// before the thread is confined by seccomp). With hint pages, pvspin tells the guest
    /// whether the vCPUs it runs at once fit them (`VCPUS_FIT`, ABI 0.4): all its vCPUs, or
    /// with run slots on the userspace and signal-msi paths its slots (the slots run at most
    /// that many, and a kicked vCPU gets the kicker's).
    /// A waiter whose lock's next owner was just kicked then keeps spinning instead of waiting
    /// early, which stops wake-up convoys at 2x/3x host overcommit and under run slots.
    /// Default: the run slots' count when run slots are on (so they fit); otherwise pvspin
    /// says nothing, and waiters wait early behind a kicked owner (right when the VM has more
    /// vCPUs than CPUs). [`PvSpin::set_vm_cpus`] changes it later (a new quota).
    pub fn vm_cpus(mut self, cpus: usize) -> Self {
        self.vm_cpus = Some(cpus);
        self
    }
}

/// Why run slots on this kick path will cost the VM, where they will (`build` logs it once):
/// on the in-kernel path a kick wakes its vCPU inside KVM, beyond the slots, so with more
/// vCPUs than slots pvspin-aware guests are not told `VCPUS_FIT` and halt at almost every hand-over.
pub(crate) fn slots_path_warning(path: KickPath, slots: usize, vcpus: usize) -> Option<String> {
    (path == KickPath::InKernel && slots < vcpus).then(|| {
        format!(
            "run slots on the in-kernel kick path, {vcpus} vCPUs on {slots} slots: a kick wakes \
             its vCPU inside KVM beyond the slots, so pvspin-aware guests halt at almost every \
             lock hand-over (4-64 vCPUs on 2 slots ran 1.7-3.5x slower than on the signal-msi \
             path, which hands the kicker's slot to the kicked vCPU; a stock guest 0.96-1.13x); \
             prefer signal-msi with run slots (docs/embedding.md, section 6)"
        )
    })
}

/// What pvspin says in `VCPUS_FIT` (`None`: nothing): whether what the VM runs at once fits the
/// CPUs it gets (`vm_cpus`; by default, with run slots, the slots' count). That is all its
/// vCPUs, except with run slots on a kick path that hands the kicker's slot to the kicked
/// vCPU (userspace, signal-msi): there the slots' holders are what runs, and a kicked next
/// owner gets a slot. On the in-kernel path KVM runs a kicked vCPU beyond the slots, so it
/// may queue behind the holders for a CPU, and all vCPUs count.
pub(crate) fn vcpus_fit(
    vcpus: usize,
    vm_cpus: Option<usize>,
    slots: Option<usize>,
    path: Option<KickPath>,
) -> Option<bool> {
    let kick_hands_over = matches!(path, Some(KickPath::Userspace | KickPath::SignalMsi));
    match (vm_cpus, slots) {
        (cpus, Some(slots)) if kick_hands_over => Some(vcpus.min(slots) <= cpus.unwrap_or(slots)),
        (cpus, Some(slots)) => Some(vcpus <= cpus.map_or(slots, |c| c.min(slots))),
        (Some(cpus), None) => Some(vcpus <= cpus),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_kernel_slots_with_more_vcpus_than_slots_are_warned_about() {
        let warning = slots_path_warning(KickPath::InKernel, 2, 4).expect("warned");
        assert!(warning.contains("4 vCPUs on 2 slots"), "{warning}");
        assert!(warning.contains("prefer signal-msi"), "{warning}");
        assert_eq!(
            slots_path_warning(KickPath::InKernel, 2, 2),
            None,
            "every vCPU holds one"
        );
        for path in [KickPath::SignalMsi, KickPath::Userspace] {
            assert_eq!(
                slots_path_warning(path, 2, 64),
                None,
                "{path:?} hands slots over"
            );
        }
    }

    #[test]
    fn vcpus_fit_counts_what_runs_at_once() {
        let (user, msi, kernel) = (
            Some(KickPath::Userspace),
            Some(KickPath::SignalMsi),
            Some(KickPath::InKernel),
        );
        // Without slots: all vCPUs, and nothing said without the CPUs.
        assert_eq!(vcpus_fit(2, None, None, user), None);
        assert_eq!(vcpus_fit(2, Some(2), None, user), Some(true));
        assert_eq!(vcpus_fit(4, Some(2), None, user), Some(false));
        // Slots on a path whose kick hands a slot over: the slots count.
        for path in [user, msi] {
            assert_eq!(vcpus_fit(6, None, Some(2), path), Some(true));
            assert_eq!(vcpus_fit(6, Some(2), Some(2), path), Some(true));
            assert_eq!(vcpus_fit(6, Some(1), Some(2), path), Some(false));
            // More slots than vCPUs: the vCPUs are what runs.
            assert_eq!(vcpus_fit(2, Some(2), Some(4), path), Some(true));
            assert_eq!(vcpus_fit(3, Some(2), Some(4), path), Some(false));
        }
        // In kernel, a kicked vCPU runs beyond the slots: all vCPUs count, capped by the slots.
        assert_eq!(vcpus_fit(6, None, Some(2), kernel), Some(false));
        assert_eq!(vcpus_fit(2, None, Some(2), kernel), Some(true));
        assert_eq!(vcpus_fit(2, Some(8), Some(1), kernel), Some(false));
    }
}
