//! [`PvSpin`]: pvspin for one VM, from `configure_vm` to `shutdown`.

use std::sync::{Arc, OnceLock};

use kvm_bindings::CpuId;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pvspin_kvm::quirks;

use crate::telemetry::collect::StatsFds;
use crate::telemetry::{Shape, VcpuCounterCell};
use crate::{
    check, cpuid, directed, hints, kick, slots, telemetry, AppliedVcpu, AppliedVm, ConfigError,
    CpuidFault, DoorbellPio, Error, KickDeviceTelemetry, KickOptions, KickPath, KickWiring, Plan,
    PlanRequest, Problem, PvSpinBuilder, QuirkError, SignalCollision, VcpuHooks, VcpuInterrupter,
    VcpuTelemetry, Verdict, VmTelemetry, WaitOptions,
};

/// What [`PvSpin::configure_vm`] did.
#[derive(Clone, Debug)]
pub struct VmSetup {
    /// Whether KVM's FIX_HYPERCALL_INSN quirk is now off (by pvspin, or by the VMM as it said
    /// with [`PvSpinBuilder::vmm_disabled_quirks`]).
    pub hypercall_quirk_disabled: bool,
    /// The quirk mask pvspin wrote with `KVM_CAP_DISABLE_QUIRKS2` (the VMM's quirks and
    /// pvspin's; 0: no call). A VMM that disables quirks later must include it: hosts before
    /// 9966b7822b3f replace the mask, which would turn FIX_HYPERCALL_INSN back on.
    pub disabled_quirks: u64,
    /// The paravirt plan and what applying its VM stage did, when one was requested.
    pub plan: Option<(Plan, AppliedVm)>,
}

/// pvspin for one VM: the composed parts and the hooks' shared state.
#[derive(Debug)]
pub struct PvSpin {
    /// Run slots, when enabled.
    pub(crate) run_slots: Option<Arc<slots::SlotState>>,
    pub(crate) doorbell_port: u16,
    pub(crate) cpuid_base: u32,
    /// Whether the VM has an in-kernel LAPIC, when the configuration says (kick path, plan).
    pub(crate) lapic_in_kernel: Option<bool>,
    /// Which vCPUs went through `configure_vcpu`, and the mistakes found at run time.
    pub(crate) adoption: Arc<check::Adoption>,
    /// Per vCPU, the plan's CPUID edit `edit_cpuid` made last (for `AppliedVcpu`).
    pub(crate) edits: Vec<std::sync::Mutex<Option<pvspin_kvm::plan::CpuidEdit>>>,
    pub(crate) interrupter: Arc<dyn VcpuInterrupter>,
    pub(crate) keep_hypercall_quirk: bool,
    pub(crate) vmm_disabled_quirks: u64,
    pub(crate) paravirt: Option<PlanRequest>,
    pub(crate) kick_options: Option<KickOptions>,
    /// Directed yield and spin windows, when enabled.
    pub(crate) directed_yield: Option<Arc<directed::YieldState>>,
    /// Hint pages and budgets, when enabled.
    pub(crate) hints: Option<Arc<hints::HintState>>,
    /// WAIT, when enabled.
    pub(crate) wait: Option<WaitOptions>,
    /// The kick device, made by `configure_vm`.
    pub(crate) kick: OnceLock<Arc<kick::KickState>>,
    /// Set by `configure_vm`: `Some(plan)` with a paravirt request, `None` without.
    pub(crate) plan: OnceLock<Option<Plan>>,
    pub(crate) stats: StatsFds,
    /// Per vCPU, pvspin's counters.
    pub(crate) cells: Arc<[Arc<VcpuCounterCell>]>,
}

impl PvSpin {
    /// Starts building.
    pub fn builder() -> PvSpinBuilder {
        PvSpinBuilder::default()
    }

    /// Number of vCPUs.
    pub fn vcpus(&self) -> usize {
        self.cells.len()
    }

    /// VM-stage setup: call after creating the VM, before creating any vCPU. Applies the
    /// paravirt plan's VM stage (or, without one, turns the FIX_HYPERCALL_INSN quirk off) and
    /// makes the kick device. It does not create an irqchip, touch the GSI routing or register
    /// eventfds: those are the VMM's ([`kick_wiring`](Self::kick_wiring); `simple::setup_vm`
    /// does all of it for a VMM that has none of its own). Refused, naming the rule
    /// ([`ConfigError::VmAfterVcpus`]), when KVM says the VM has vCPUs already
    /// (`pvspin_kvm::plan::vcpus_exist`).
    pub fn configure_vm(&self, kvm: &Kvm, vm: &VmFd) -> Result<VmSetup, Error> {
        if pvspin_kvm::plan::vcpus_exist(vm) == Some(true) {
            return Err(ConfigError::VmAfterVcpus.into());
        }
        self.stats.open_vm(vm);
        let setup = match &self.paravirt {
            Some(request) => {
                let host = pvspin_kvm::plan::HostCaps::probe(kvm, vm)?;
                let plan = Plan::new(request, &host)?;
                let applied = pvspin_kvm::plan::apply_vm(&plan, vm, 0)?;
                VmSetup {
                    hypercall_quirk_disabled: plan.disable_fix_hypercall_quirk
                        || plan.vmm_disabled_quirks & quirks::FIX_HYPERCALL_INSN != 0,
                    disabled_quirks: applied.disabled_quirks,
                    plan: Some((plan, applied)),
                }
            }
            None => {
                let supported = quirks::disableable_quirks(vm);
                let unsupported = self.vmm_disabled_quirks & !supported;
                if unsupported != 0 {
                    return Err(QuirkError::Unsupported {
                        quirk: unsupported,
                        supported,
                    }
                    .into());
                }
                // The default: off where the host can turn it off, left on (not refused)
                // where it cannot, like the plan's dropped defaults.
                let disable =
                    !self.keep_hypercall_quirk && supported & quirks::FIX_HYPERCALL_INSN != 0;
                let disabled_quirks = if disable {
                    quirks::disable_quirks(
                        vm,
                        self.vmm_disabled_quirks,
                        quirks::FIX_HYPERCALL_INSN,
                    )?
                } else {
                    0
                };
                VmSetup {
                    hypercall_quirk_disabled: disable
                        || self.vmm_disabled_quirks & quirks::FIX_HYPERCALL_INSN != 0,
                    disabled_quirks,
                    plan: None,
                }
            }
        };
        if self.directed_yield.is_some() {
            pvspin_track::cpl::check_sync_sregs(kvm)?;
        }
        if let Some(options) = self.kick_options {
            let mut extra = 0;
            if self.directed_yield.is_some() {
                extra |= pvspin_abi::cpuid::FEATURE_SPIN_NOTIFY;
            }
            if self.hints.is_some() {
                extra |= pvspin_abi::cpuid::FEATURE_SHARED_PAGE;
            }
            if self.wait.is_some() {
                extra |= pvspin_abi::cpuid::FEATURE_WAIT;
            }
            let cfg = pvspin_kick::KickConfig {
                port: self.doorbell_port,
                nr_vcpus: u32::try_from(self.vcpus()).unwrap_or(u32::MAX),
                extra_commands: extra,
                spin: options.park_spin,
                park_timeout: options.park_bound,
                ..pvspin_kick::KickConfig::default()
            };
            let state = Arc::new(kick::KickState::configure_vm(options, cfg, vm)?);
            if let Some(slots) = &self.run_slots {
                slots.set_kick(state.clone());
            }
            let _ = self.kick.set(state);
        }
        let _ = self
            .plan
            .set(setup.plan.as_ref().map(|(plan, _)| plan.clone()));
        Ok(setup)
    }

    /// In-kernel kick path: records the GSIs the VMM allocated for the kicks (one per vCPU, in
    /// index order, distinct, below [`MAX_GSI`](crate::MAX_GSI); once) and returns what to apply: the routes
    /// to merge into the VMM's GSI routing table and the ioeventfds and irqfds to register.
    /// Call after [`configure_vm`](Self::configure_vm) and before
    /// [`configure_vcpu`](Self::configure_vcpu), after the VMM made its in-kernel irqchip
    /// (refused naming the rule without one: [`ConfigError::NoIrqchip`]). Refused, naming the
    /// rule, on the other paths.
    pub fn set_kick_gsis(&self, gsis: &[u32]) -> Result<KickWiring<'_>, Error> {
        let kick = self.kick.get().ok_or(Error::VmNotConfigured)?;
        kick.set_gsis(gsis)
    }

    /// The in-kernel kick wiring, once [`set_kick_gsis`](Self::set_kick_gsis) ran: a VMM that
    /// rebuilds its GSI routing table takes [`KickWiring::routes`] from here again.
    pub fn kick_wiring(&self) -> Option<KickWiring<'_>> {
        self.kick.get().and_then(|kick| kick.wiring())
    }

    /// In-kernel kick path: checks `table`, the GSI routing table the VMM just applied
    /// (`KVM_SET_GSI_ROUTING` replaces the whole table, and KVM cannot be asked for it), for
    /// pvspin's kick routes ([`KickWiring::verify`]). Call it after every
    /// `KVM_SET_GSI_ROUTING` the VMM makes: at setup and whenever it rebuilds the table
    /// (device hotplug, MSI-X updates). Missing or changed routes (kicks that would wake
    /// nobody, a hang) are refused naming the vCPUs ([`ConfigError::KickRoutes`]), counted
    /// and logged once, and [`check`](Self::check) lists them. `Ok` on the other kick paths
    /// (they have no routes); refused before [`set_kick_gsis`](Self::set_kick_gsis).
    pub fn check_routes(&self, table: &[kvm_bindings::kvm_irq_routing_entry]) -> Result<(), Error> {
        let kick = self.kick.get().ok_or(Error::VmNotConfigured)?;
        if kick.options.path != KickPath::InKernel {
            return Ok(());
        }
        let wiring = kick.wiring().ok_or(ConfigError::RoutesBeforeGsis)?;
        wiring.verify(table).map_err(|err| {
            if let ConfigError::KickRoutes { faults } = &err {
                let mut vcpus: Vec<u32> = faults.iter().map(|f| f.vcpu()).collect();
                vcpus.dedup();
                self.adoption.route_check_failed(vcpus);
            }
            err.into()
        })
    }

    /// The adopter mistakes pvspin found so far that could only show at run time (or through
    /// [`check_routes`](Self::check_routes)), each with the rule it breaks: runs before every
    /// vCPU was configured and the vCPUs never configured, kicks to unconfigured vCPUs,
    /// doorbell accesses on threads without hooks, kicks that missed their ioeventfd or
    /// reached no vCPU, failed kick MSIs, dropped kick routes, and an interrupt signal shared
    /// with another handler. Empty when none. Each is also counted in
    /// [`telemetry`](Self::telemetry) and logged once when first seen. Any thread, any time
    /// (a VMM prints it at exit); off the hot path.
    pub fn check(&self) -> Vec<Problem> {
        let kick = self.kick.get().map(|k| k.device.stats());
        let signal = self
            .interrupter
            .signal_collision()
            .map(SignalCollision::signal);
        self.adoption.problems(kick.as_ref(), signal)
    }

    /// The doorbell's first port and its number of ports.
    pub fn doorbell_ports(&self) -> (u16, u16) {
        (self.doorbell_port, pvspin_abi::doorbell::PORT_COUNT)
    }

    /// The doorbell as a port-I/O bus device (after [`configure_vm`](Self::configure_vm), with
    /// a kick path), for a VMM that dispatches port I/O through a bus.
    pub fn doorbell_pio(&self) -> Option<DoorbellPio> {
        self.kick.get().map(|_| {
            let (base, len) = self.doorbell_ports();
            DoorbellPio::new(base, len, self.adoption.clone())
        })
    }

    /// Where pvspin's CPUID leaves are.
    pub fn cpuid_base(&self) -> u32 {
        self.cpuid_base
    }

    /// Edits vCPU `index`'s CPUID (pure: no KVM call): the paravirt plan's edits (KVM's
    /// feature leaf, added KVM leaves), the kick-index rule (initial APIC ID = `index` in
    /// leaves 01H, 0BH and 1FH) and pvspin's leaves. The VMM sets the result with
    /// `KVM_SET_CPUID2` before [`configure_vcpu`](Self::configure_vcpu). Needs to know whether
    /// the VM has an in-kernel LAPIC: the kick path says, or `PlanRequest::lapic_in_kernel`;
    /// without either, use [`edit_cpuid_for_vcpu`](Self::edit_cpuid_for_vcpu).
    pub fn edit_cpuid(&self, index: usize, cpuid: &mut CpuId) -> Result<(), Error> {
        self.edit_cpuid_with(index, cpuid, self.lapic_in_kernel)
    }

    /// [`edit_cpuid`](Self::edit_cpuid) asking `vcpu` whether it has an in-kernel LAPIC
    /// (`KVM_GET_LAPIC`) when the configuration does not say.
    pub fn edit_cpuid_for_vcpu(
        &self,
        index: usize,
        vcpu: &VcpuFd,
        cpuid: &mut CpuId,
    ) -> Result<(), Error> {
        let lapic = self
            .lapic_in_kernel
            .or_else(|| Some(pvspin_kvm::plan::vcpu_has_in_kernel_lapic(vcpu)));
        self.edit_cpuid_with(index, cpuid, lapic)
    }

    fn edit_cpuid_with(
        &self,
        index: usize,
        cpuid: &mut CpuId,
        lapic_in_kernel: Option<bool>,
    ) -> Result<(), Error> {
        let edit_slot = self.edits.get(index).ok_or(ConfigError::VcpuIndex {
            index,
            vcpus: self.vcpus(),
        })?;
        let plan = self.plan.get().ok_or(Error::VmNotConfigured)?;
        // The plan edits the VMM's CPUID first: pvspin's own leaf must not be mistaken for a
        // foreign hypervisor's when the VMM's CPUID has no KVM leaves yet.
        if let Some(plan) = plan {
            let plan = match (plan.lapic_in_kernel, lapic_in_kernel) {
                (Some(_), _) => plan.clone(),
                (None, Some(lapic)) => plan.for_lapic(lapic)?,
                (None, None) => return Err(ConfigError::LapicUnknown.into()),
            };
            let edit = pvspin_kvm::plan::edit_cpuid(&plan, cpuid)?;
            *edit_slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(edit);
        }
        let apic_id = u32::try_from(index).unwrap_or(u32::MAX);
        cpuid::set_initial_apic_id(cpuid.as_mut_slice(), apic_id);
        if let Some(kick) = self.kick.get() {
            kick.add_cpuid(cpuid, index, self.cpuid_base)?;
        }
        Ok(())
    }

    /// The VM is stopping: releases every vCPU thread parked in pvspin (userspace kick path)
    /// for good. Call before interrupting the vCPU threads to join them.
    /// Also ends every priority boost directed yield applied.
    pub fn shutdown(&self) {
        if let Some(slots) = &self.run_slots {
            slots.slots.shutdown();
            slots.stop_watcher();
        }
        if let Some(kick) = self.kick.get() {
            kick.device.shutdown();
        }
        if let Some(dy) = &self.directed_yield {
            dy.actuator.restore_all();
        }
    }

    /// Whether directed yield's boosts stay inside the VM's CPU share (and why not), if
    /// directed yield is enabled.
    pub fn boost_confinement(&self) -> Option<&Verdict> {
        self.directed_yield.as_ref().map(|dy| &dy.confinement)
    }

    /// The actuator directed yield uses (`"yield"`, `"nice"`, `"fifo"`; with `fallback`, the
    /// one that was permitted), if directed yield is enabled.
    pub fn actuator_name(&self) -> Option<&'static str> {
        self.directed_yield.as_ref().map(|dy| dy.actuator.name())
    }

    /// The CPUs this VM gets changed (a new quota or affinity): tells the guest again whether
    /// the vCPUs it runs at once (all, or its run slots) fit them (see
    /// [`PvSpinBuilder::vm_cpus`]). Any time, any thread; a no-op without hint pages.
    pub fn set_vm_cpus(&self, cpus: usize) -> Result<(), ConfigError> {
        if cpus == 0 {
            return Err(ConfigError::NoVmCpus);
        }
        if let Some(hints) = &self.hints {
            let fit = crate::builder::vcpus_fit(
                self.vcpus(),
                Some(cpus),
                self.run_slots.as_ref().map(|s| s.slots.config().slots),
                self.kick_options.map(|k| k.path),
            );
            hints.pages.set_vcpus_fit(fit == Some(true));
        }
        Ok(())
    }

    /// Where vCPU `index`'s steal-time area is (`None`: it has none), for directed yield with
    /// [`PvSpinBuilder::steal_time_memory`]. Any time, any thread; a no-op without directed
    /// yield or for an index out of range.
    pub fn set_steal_time_gpa(&self, index: usize, gpa: Option<u64>) {
        if let Some(dy) = &self.directed_yield {
            dy.board.set_steal_time_gpa(index, gpa);
        }
        if let Some(slots) = &self.run_slots {
            slots.set_steal_time_gpa(index, gpa);
        }
    }

    /// vCPU-stage setup: call once per vCPU after creating it and setting its CPUID (from
    /// [`edit_cpuid`](Self::edit_cpuid)), before its first `KVM_RUN`. Checks the rules that
    /// tie the vCPU to the configuration (its CPUID carries pvspin's leaves and its index as
    /// initial APIC ID; an in-kernel LAPIC exactly when the kick path needs one; the in-kernel
    /// path's GSIs set), enables the plan's PV-CPUID enforcement, reads the TSC frequency for
    /// hint pages and, with directed yield, asks KVM to copy the special registers into
    /// `kvm_run` at every exit (`KVM_SYNC_X86_SREGS`: the CPL without an ioctl). The last vCPU
    /// configured rewrites its own LAPIC unchanged, which makes KVM rebuild its APIC-ID map
    /// (stale until then: kicks to later vCPUs would reach nobody). Changes no MP state.
    /// The returned hooks belong to that vCPU's thread.
    pub fn configure_vcpu(
        &self,
        index: usize,
        vcpu: &mut VcpuFd,
    ) -> Result<(VcpuHooks, Option<AppliedVcpu>), Error> {
        if index >= self.vcpus() {
            return Err(ConfigError::VcpuIndex {
                index,
                vcpus: self.vcpus(),
            }
            .into());
        }
        let plan = self.plan.get().ok_or(Error::VmNotConfigured)?;
        if self.adoption.is_configured(index) {
            return Err(ConfigError::VcpuConfiguredTwice(index).into());
        }
        let lapic = pvspin_kvm::plan::vcpu_has_in_kernel_lapic(vcpu);
        if let Some(kick) = self.kick.get() {
            match (kick.options.needs_lapic(), lapic) {
                (true, false) => return Err(ConfigError::KickPathNeedsLapic.into()),
                (false, true) => return Err(ConfigError::UserspaceKickWithLapic.into()),
                _ => {}
            }
            if kick.options.path == KickPath::InKernel && kick.wiring().is_none() {
                return Err(ConfigError::KickGsisMissing.into());
            }
            if lapic {
                check_apic_id(index, vcpu)?;
            }
            if kick.options.path == KickPath::InKernel {
                kick.check_registered(index)?;
            }
            self.check_cpuid(index, vcpu, kick)?;
        }
        let applied = match plan {
            Some(plan) => {
                let plan = pvspin_kvm::plan::plan_for_vcpu(plan, vcpu)?;
                let enforce = pvspin_kvm::plan::enforce_pv_cpuid(&plan, vcpu)?;
                let edit = self.edits[index]
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
                    .ok_or(ConfigError::Cpuid {
                        index,
                        what: CpuidFault::NeverEdited,
                    })?;
                Some(AppliedVcpu {
                    cpuid: edit,
                    enforce_pv_cpuid: enforce,
                    lapic_in_kernel: lapic,
                })
            }
            None => None,
        };
        self.stats.open_vcpu(index, vcpu);
        if let Some(slots) = &self.run_slots {
            slots.open_vcpu(index, vcpu)?;
        }
        if let Some(hints) = &self.hints {
            // Budgets are published in guest TSC cycles; without the frequency they read 0
            // (spin not at all), so a host that cannot tell it is refused here.
            let khz = vcpu
                .get_tsc_khz()
                .map_err(|source| Error::TscKhz { index, source })?;
            hints.set_tsc_khz(khz);
        }
        if self.directed_yield.is_some() {
            pvspin_track::enable_sync_sregs(vcpu);
        }
        let last = self
            .adoption
            .mark_configured(index)
            .ok_or(ConfigError::VcpuConfiguredTwice(index))?;
        if last && lapic {
            pvspin_kvm::irqchip::refresh_lapic(vcpu)?;
        }
        let hooks = VcpuHooks::new(
            index,
            self.cells.clone(),
            self.kick.get().cloned(),
            self.directed_yield.clone(),
        )
        .with_hints(self.hints.clone(), self.wait)
        .with_slots(self.run_slots.clone())
        .with_adoption(self.adoption.clone());
        Ok((hooks, applied))
    }

    /// The CPUID KVM holds for vCPU `index` must be [`edit_cpuid`](Self::edit_cpuid)'s.
    fn check_cpuid(
        &self,
        index: usize,
        vcpu: &VcpuFd,
        kick: &kick::KickState,
    ) -> Result<(), Error> {
        let set = vcpu
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| Error::GetCpuid { index, source })?;
        let apic_id = u32::try_from(index).unwrap_or(u32::MAX);
        let what = if cpuid::find_pvspin_info(set.as_slice(), self.cpuid_base)
            != Some(kick.device.cpuid_info())
        {
            CpuidFault::LeavesMissing(self.cpuid_base)
        } else if !cpuid::follows_apic_id_rule(set.as_slice(), apic_id) {
            CpuidFault::ApicIdNotIndex
        } else {
            return Ok(());
        };
        Err(ConfigError::Cpuid { index, what }.into())
    }

    /// Everything pvspin and KVM count, in one snapshot ([`telemetry`]): per vCPU, pvspin's
    /// counters (runs, exits, time in `KVM_RUN`, kicks, rejected guest inputs, notifications,
    /// yields, kick-to-wake latency), its spin budgets and KVM's stats (the change since
    /// `configure_vcpu`); per VM, the kick device's, directed yield's and hint pages' counters
    /// and KVM's VM stats. What the configuration or its kick path cannot count is absent;
    /// in-kernel kicks, which never exit, are stood in for by KVM's `halt_wakeup`, labeled as
    /// such ([`KickCounts`](crate::KickCounts)). Readable at any time, from any thread; each read is atomic,
    /// the whole is not one consistent cut. Reads the KVM stats fds (one `pread` each).
    pub fn telemetry(&self) -> VmTelemetry {
        let kick_path = self.kick.get().map(|kick| kick.device.path());
        let shape = Shape {
            kick_path,
            directed_yield: self.directed_yield.is_some(),
        };
        let vcpus = self
            .cells
            .iter()
            .enumerate()
            .map(|(index, cell)| {
                let kvm = self.stats.vcpu(index);
                let halt_wakeups = kvm.as_ref().and_then(|s| s.value("halt_wakeup"));
                let mut pvspin = cell.snapshot(shape, halt_wakeups);
                pvspin.configured = self.adoption.is_configured(index);
                pvspin.runs_before_all_configured = self.adoption.early_runs(index);
                VcpuTelemetry {
                    vcpu: u32::try_from(index).unwrap_or(u32::MAX),
                    pvspin,
                    budgets: self.hints.as_ref().map(|h| h.budgets(index)),
                    kvm,
                }
            })
            .collect();
        VmTelemetry {
            kick: self.kick.get().map(|kick| KickDeviceTelemetry {
                path: kick.device.path(),
                stats: kick.device.stats(),
            }),
            directed_yield: self.directed_yield.as_ref().map(|dy| dy.stats()),
            run_slots: self.run_slots.as_ref().map(|s| {
                telemetry::SlotTelemetry::new(
                    s.slots.config().slots,
                    s.stats(),
                    s.steal_time_marks(),
                    s.watch_stats(),
                )
            }),
            hints: self
                .hints
                .as_ref()
                .map(|h| h.stats(kick_path == Some(KickPath::Userspace))),
            kvm_vm: self.stats.vm(),
            problems: self.check(),
            vcpus,
        }
    }

    /// Forces vCPU `index` out of `KVM_RUN` through the VMM's [`VcpuInterrupter`].
    pub fn interrupt(&self, index: usize) {
        if index < self.vcpus() {
            if let Some(kick) = self.kick.get() {
                kick.device
                    .interrupt(u32::try_from(index).unwrap_or(u32::MAX));
            }
            self.interrupter.interrupt(index);
        }
    }
}

/// The MSI kick paths address vCPU `index` at APIC ID `index`; KVM gives a vCPU the APIC ID
/// of its vCPU id (`KVM_CREATE_VCPU`). Reads it back (`KVM_GET_LAPIC`, APIC ID register at
/// 0x20: bits 31..24 in xAPIC format, which KVM reports unless the VMM enabled the 32-bit
/// x2APIC format and put the LAPIC in x2APIC mode; then the whole register).
fn check_apic_id(index: usize, vcpu: &VcpuFd) -> Result<(), Error> {
    const APIC_ID: usize = 0x20;
    let lapic = vcpu
        .get_lapic()
        .map_err(|source| Error::GetLapic { index, source })?;
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[APIC_ID + i] as u8);
    let reg = u32::from_le_bytes(bytes);
    let want = u32::try_from(index).unwrap_or(u32::MAX);
    if reg >> 24 == want || reg == want {
        return Ok(());
    }
    // xAPIC format keeps bits 23..0 clear.
    let apic_id = if reg & 0x00ff_ffff == 0 {
        reg >> 24
    } else {
        reg
    };
    Err(ConfigError::ApicId { index, apic_id }.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Confinement, DirectedYieldOptions, DirectedYieldStats, Placement, WindowConfig, MAX_VCPUS,
    };

    #[derive(Debug, Default)]
    struct CountingInterrupter(std::sync::atomic::AtomicUsize);

    impl VcpuInterrupter for CountingInterrupter {
        fn interrupt(&self, _index: usize) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn builder_refuses_invalid_configuration_naming_the_rule() {
        let interrupter = Arc::new(CountingInterrupter::default());
        assert!(matches!(
            PvSpin::builder().build().unwrap_err(),
            ConfigError::MissingVcpus
        ));
        assert!(matches!(
            PvSpin::builder()
                .vcpus(0)
                .interrupter(interrupter.clone())
                .build()
                .unwrap_err(),
            ConfigError::VcpuCount {
                got: 0,
                max: MAX_VCPUS
            }
        ));
        // The ABI's limit, on every kick path, named with its rule.
        assert_eq!(MAX_VCPUS, 255);
        for kick in [None, Some(KickPath::Userspace), Some(KickPath::InKernel)] {
            let builder = PvSpin::builder()
                .vcpus(MAX_VCPUS + 1)
                .interrupter(interrupter.clone());
            let text = match kick {
                Some(path) => builder.kick(KickOptions::new(path)).build(),
                None => builder.build(),
            }
            .unwrap_err()
            .to_string();
            assert!(text.contains("between 1 and 255"), "{text}");
            assert!(text.contains("pvspin_abi::MAX_VCPUS"), "{text}");
        }
        assert!(matches!(
            PvSpin::builder().vcpus(2).build().unwrap_err(),
            ConfigError::MissingInterrupter
        ));
        let err = PvSpin::builder()
            .vcpus(2)
            .interrupter(interrupter.clone())
            .paravirt(PlanRequest::new(Placement::Shared, 4))
            .build()
            .unwrap_err();
        assert!(matches!(
            err,
            ConfigError::PlanVcpus {
                plan: 4,
                builder: 2
            }
        ));
        assert!(err.to_string().starts_with("rule:"), "{err}");
        let mut request = PlanRequest::new(Placement::Shared, 2);
        request.disable_fix_hypercall_quirk = Some(true);
        assert!(matches!(
            PvSpin::builder()
                .vcpus(2)
                .interrupter(interrupter.clone())
                .keep_hypercall_quirk(true)
                .paravirt(request)
                .build()
                .unwrap_err(),
            ConfigError::QuirkConflict
        ));
        assert_eq!(
            PvSpin::builder()
                .vcpus(2)
                .interrupter(interrupter)
                .build()
                .unwrap()
                .vcpus(),
            2
        );
    }

    #[test]
    fn directed_yield_needs_a_known_actuator() {
        // Without a kick path it does not compile (`builder.rs`'s compile_fail example).
        let interrupter = Arc::new(CountingInterrupter::default());
        let kick = KickOptions::new(KickPath::Userspace);
        let base = || PvSpin::builder().vcpus(2).interrupter(interrupter.clone());
        // An unknown name is refused where it is parsed, naming the accepted ones.
        let err = "teleport".parse::<crate::ActuatorKind>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"rule: the directed-yield actuator is one of yield, nice, fifo; got "teleport""#
        );
        let err = base()
            .kick(kick)
            .directed_yield(DirectedYieldOptions {
                windows: WindowConfig {
                    base: 0,
                    ..WindowConfig::default()
                },
                ..DirectedYieldOptions::default()
            })
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("rule: spin window base"), "{err}");
        let ok = base()
            .kick(kick)
            .directed_yield(DirectedYieldOptions::default())
            .build()
            .unwrap();
        // The default boosts with nice, stepping down to a plain yield without the privilege.
        assert!(
            matches!(ok.actuator_name(), Some("nice" | "yield")),
            "{:?}",
            ok.actuator_name()
        );
        // Nothing happened yet; the default policy boosts running hints, so the boost trial
        // is on, starting with boosts.
        let stats = ok.telemetry().directed_yield.unwrap();
        assert_eq!(
            DirectedYieldStats {
                trial: None,
                ..stats
            },
            DirectedYieldStats::default()
        );
        let trial = stats.trial.expect("boost trial with boost_running_hint");
        assert!(trial.boosting && trial.epochs_on == 0 && trial.epochs_off == 0);
        ok.shutdown();
    }

    #[test]
    fn vcpus_fit_follows_the_vm_cpus_and_the_run_slots() {
        let interrupter = Arc::new(CountingInterrupter::default());
        let map = Arc::new(pvspin_hints::BufferPageMap::new(4));
        let base = |vcpus: usize| {
            PvSpin::builder()
                .vcpus(vcpus)
                .interrupter(interrupter.clone())
                .kick(KickOptions::new(KickPath::Userspace))
                .hint_pages(crate::HintOptions {
                    memory: map.clone(),
                    budgets: pvspin_yield::BudgetConfig::default(),
                })
        };
        let fit = |pvspin: &PvSpin| pvspin.hints.as_ref().unwrap().pages.vcpus_fit();
        // Not told: says nothing (waiters wait early behind a kicked owner).
        assert!(!fit(&base(2).build().unwrap()));
        assert!(fit(&base(2).vm_cpus(2).build().unwrap()));
        let crowded = base(4).vm_cpus(2).build().unwrap();
        assert!(!fit(&crowded));
        // A new quota says it again.
        crowded.set_vm_cpus(4).unwrap();
        assert!(fit(&crowded));
        assert!(matches!(
            crowded.set_vm_cpus(0).unwrap_err(),
            ConfigError::NoVmCpus
        ));
        // With run slots the slots' holders are what runs at once: 2 slots fit 2 or more CPUs,
        // however many vCPUs wait for them.
        let slotted = base(4).vm_cpus(8).run_slots(crate::SlotConfig::new(2));
        let slotted = slotted.build().unwrap();
        assert!(fit(&slotted));
        slotted.set_vm_cpus(1).unwrap();
        assert!(!fit(&slotted), "2 slots on 1 CPU");
        slotted.set_vm_cpus(2).unwrap();
        assert!(fit(&slotted));
        slotted.shutdown();
        let over = base(4).vm_cpus(1).run_slots(crate::SlotConfig::new(2));
        assert!(!fit(&over.build().unwrap()), "more slots than CPUs");
        let many = base(4)
            .run_slots(crate::SlotConfig::new(2))
            .build()
            .unwrap();
        assert!(fit(&many), "by default the slots fit themselves");
        many.shutdown();
        let all_slots = base(2)
            .run_slots(crate::SlotConfig::new(2))
            .build()
            .unwrap();
        assert!(fit(&all_slots));
        all_slots.shutdown();
        let err = base(2).vm_cpus(0).build().unwrap_err();
        assert!(err.to_string().contains("at least one CPU"), "{err}");
    }

    #[test]
    fn run_slots_raise_the_wait_budgets_floor() {
        let interrupter = Arc::new(CountingInterrupter::default());
        let map = Arc::new(pvspin_hints::BufferPageMap::new(4));
        let base = |budgets: pvspin_yield::BudgetConfig| {
            PvSpin::builder()
                .vcpus(4)
                .interrupter(interrupter.clone())
                .kick(KickOptions::new(KickPath::Userspace))
                .hint_pages(crate::HintOptions {
                    memory: map.clone(),
                    budgets,
                })
        };
        let config = |pvspin: &PvSpin| pvspin.hints.as_ref().unwrap().budgets.budgets().config();
        let defaults = pvspin_yield::BudgetConfig::default();
        let plain = base(defaults).build().unwrap();
        assert_eq!(config(&plain), defaults, "without slots: as configured");
        let slotted = base(defaults)
            .run_slots(crate::SlotConfig::new(2))
            .build()
            .unwrap();
        assert_eq!(config(&slotted), defaults.for_run_slots());
        assert_eq!(config(&slotted).wait_after_min_ns, 100_000);
        assert_eq!(
            slotted.hints.as_ref().unwrap().budgets(3).wait_after_ns,
            100_000
        );
        slotted.shutdown();
        // Not where every vCPU holds a slot (nobody waits for one).
        let all_slots = base(defaults)
            .vcpus(2)
            .run_slots(crate::SlotConfig::new(2))
            .build()
            .unwrap();
        assert_eq!(config(&all_slots), defaults, "2 vCPUs on 2 slots");
        all_slots.shutdown();
        // Not where a kicked vCPU wakes inside KVM (signal-msi, in-kernel).
        for path in [KickPath::SignalMsi, KickPath::InKernel] {
            let other = PvSpin::builder()
                .vcpus(4)
                .interrupter(interrupter.clone())
                .kick(KickOptions::new(path))
                .hint_pages(crate::HintOptions {
                    memory: map.clone(),
                    budgets: defaults,
                })
                .run_slots(crate::SlotConfig::new(2))
                .build()
                .unwrap();
            assert_eq!(config(&other), defaults, "{path:?}");
            other.shutdown();
        }
        // A ceiling below the floor caps it.
        let low = pvspin_yield::BudgetConfig {
            wait_after_max_ns: 50_000,
            wait_after_ns: 50_000,
            ..defaults
        };
        let capped = base(low)
            .run_slots(crate::SlotConfig::new(2))
            .build()
            .unwrap();
        assert_eq!(config(&capped).wait_after_min_ns, 50_000);
        capped.shutdown();
    }

    #[test]
    fn boosts_that_would_raise_the_vms_share_are_refused_or_stepped_down() {
        let interrupter = Arc::new(CountingInterrupter::default());
        let base = || {
            PvSpin::builder()
                .vcpus(2)
                .interrupter(interrupter.clone())
                .kick(KickOptions::new(KickPath::Userspace))
        };
        // FIFO is never confined by a cgroup.
        let fifo = |fallback| DirectedYieldOptions {
            actuator: crate::ActuatorKind::Fifo,
            fallback,
            ..DirectedYieldOptions::default()
        };
        let err = base().directed_yield(fifo(false)).build().unwrap_err();
        assert!(
            err.to_string()
                .contains("must not raise its VM's CPU share"),
            "{err}"
        );
        let stepped = base().directed_yield(fifo(true)).build().unwrap();
        assert_ne!(stepped.actuator_name(), Some("fifo"));
        // Nice is used exactly when the verdict allows it (or the privilege is missing).
        let nice = base()
            .directed_yield(DirectedYieldOptions::default())
            .build()
            .unwrap();
        let verdict = nice.boost_confinement().unwrap().clone();
        if !verdict.allows_nice() {
            assert_eq!(nice.actuator_name(), Some("yield"), "{verdict:?}");
        }
        let unconfined = base()
            .directed_yield(DirectedYieldOptions {
                confinement: Confinement::Unconfined,
                ..DirectedYieldOptions::default()
            })
            .build()
            .unwrap();
        assert_eq!(unconfined.boost_confinement(), Some(&Verdict::Unconfined));
    }

    #[test]
    fn interrupt_forwards_valid_indexes_only() {
        let interrupter = Arc::new(CountingInterrupter::default());
        let pvspin = PvSpin::builder()
            .vcpus(2)
            .interrupter(interrupter.clone())
            .build()
            .unwrap();
        pvspin.interrupt(1);
        pvspin.interrupt(2);
        assert_eq!(interrupter.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        let t = pvspin.telemetry();
        assert_eq!(t.vcpus.len(), 2);
        // Nothing configured and no VM yet: the hooks' counters only, nothing else pretends.
        assert!(t.kick.is_none() && t.directed_yield.is_none() && t.hints.is_none());
        assert!(t.kvm_vm.is_none());
        for v in &t.vcpus {
            assert!(v.kvm.is_none() && v.budgets.is_none());
            assert!(v.pvspin.kicks.is_none() && v.pvspin.directed_yield.is_none());
        }
    }
}
