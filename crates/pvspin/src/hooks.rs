//! The per-vCPU hooks a VMM's vCPU loop calls around `KVM_RUN`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvm_ioctls::{VcpuExit, VcpuFd};
use pvspin_abi::doorbell::SpinNotify;
use pvspin_kick::{Command, Handled, KickDevice, KickError, KickPath, ParkOutcome, PioOutcome};

use crate::check::Adoption;
use crate::directed::YieldState;
use crate::hints::{HintState, WaitOptions};
use crate::kick::KickState;
use crate::slots::SlotState;
use crate::telemetry::{ExitKind, VcpuCounterCell};

/// Whether pvspin consumed an exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitOutcome {
    /// pvspin handled it; the VMM re-enters `KVM_RUN`.
    Handled,
    /// Not pvspin's: the VMM handles it as it would without pvspin.
    NotHandled,
}

/// The hooks of one vCPU, owned by that vCPU's thread.
#[derive(Debug)]
pub struct VcpuHooks {
    index: usize,
    /// Every vCPU's telemetry cell: this vCPU's runs and exits are counted on its own, a
    /// kick on its target.
    cells: Arc<[Arc<VcpuCounterCell>]>,
    kick: Option<Arc<KickState>>,
    /// Directed yield, when enabled (it needs `kick`).
    dy: Option<Arc<YieldState>>,
    /// Whether this thread's id is on the board.
    tid_recorded: bool,
    /// The doorbell handling this vCPU shares with the port-I/O bus device
    /// ([`crate::DoorbellPio`]), which finds it through a thread-local.
    doorbell: Arc<VcpuDoorbell>,
    /// Hint pages and budgets, when enabled.
    hints: Option<Arc<HintState>>,
    /// WAIT, when enabled.
    wait: Option<WaitOptions>,
    /// Which vCPUs are configured, and the mistakes found at run time.
    adoption: Arc<Adoption>,
    /// Every vCPU was configured when a `before_run` last looked (then it stops looking).
    setup_complete: bool,
    /// Run slots, when enabled.
    slots: Option<Arc<SlotState>>,
    /// The next `KVM_RUN` only enters KVM's halt (a WAIT on the in-kernel or signal-msi path):
    /// it needs no run slot, as a `hlt` that never left KVM would not.
    halt_entry: bool,
    /// The VMM parked this vCPU's thread in a wait of its own ([`VcpuHooks::before_vmm_park`]):
    /// the board and the hint page show it as not running until the next `before_run`.
    vmm_parked: bool,
    run_started: Option<Instant>,
    last_exit: Option<ExitKind>,
}

impl VcpuHooks {
    pub(crate) fn new(
        index: usize,
        cells: Arc<[Arc<VcpuCounterCell>]>,
        kick: Option<Arc<KickState>>,
        dy: Option<Arc<YieldState>>,
    ) -> Self {
        let cells_len = cells.len();
        let mut hooks = Self {
            index,
            cells,
            kick,
            dy,
            tid_recorded: false,
            doorbell: Arc::new(VcpuDoorbell::default()),
            hints: None,
            wait: None,
            adoption: Arc::new(Adoption::complete(cells_len)),
            setup_complete: false,
            slots: None,
            halt_entry: false,
            vmm_parked: false,
            run_started: None,
            last_exit: None,
        };
        hooks.doorbell = hooks.make_doorbell();
        hooks
    }

    /// The doorbell shared with the bus device: the parts of these hooks it acts on.
    fn make_doorbell(&self) -> Arc<VcpuDoorbell> {
        Arc::new(VcpuDoorbell {
            index: self.index,
            cells: self.cells.clone(),
            kick: self.kick.clone(),
            dy: self.dy.clone(),
            hints: self.hints.clone(),
            slots: self.slots.clone(),
            adoption: self.adoption.clone(),
            pending_spin: AtomicU64::new(0),
            pending_wait: AtomicU64::new(0),
        })
    }

    pub(crate) fn with_hints(
        mut self,
        hints: Option<Arc<HintState>>,
        wait: Option<WaitOptions>,
    ) -> Self {
        self.hints = hints;
        self.wait = wait;
        self.doorbell = self.make_doorbell();
        self
    }

    pub(crate) fn with_slots(mut self, slots: Option<Arc<SlotState>>) -> Self {
        self.slots = slots;
        self.doorbell = self.make_doorbell();
        self
    }

    pub(crate) fn with_adoption(mut self, adoption: Arc<Adoption>) -> Self {
        self.adoption = adoption;
        self.doorbell = self.make_doorbell();
        self
    }

    /// The vCPU's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Call right before `KVM_RUN`, on the vCPU's thread.
    pub fn before_run(&mut self) {
        // Until every vCPU is configured each run is counted (and the first logged): a vCPU
        // whose configure_vcpu was forgotten keeps this count growing. Afterwards, a local
        // flag: nothing on the hot path.
        if !self.setup_complete {
            if self.adoption.all_configured() {
                self.setup_complete = true;
            } else {
                self.adoption.run_before_all_configured(self.index);
            }
        }
        if self.kick.is_some() {
            CURRENT.with(|current| {
                let mut current = current.borrow_mut();
                if !current
                    .as_ref()
                    .is_some_and(|d| Arc::ptr_eq(d, &self.doorbell))
                {
                    *current = Some(self.doorbell.clone());
                }
            });
        }
        if std::mem::take(&mut self.vmm_parked) {
            self.show_running();
        }
        if let Some(slots) = &self.slots {
            if !std::mem::take(&mut self.halt_entry) {
                // Blocks (bounded) until this vCPU may run guest code.
                slots.enter(self.index);
            }
        }
        if let Some(dy) = &self.dy {
            if !self.tid_recorded {
                dy.board
                    .set_tid(self.index, pvspin_hints::sched::current_tid());
                self.tid_recorded = true;
            }
            dy.board.on_enter_run(self.index);
        }
        self.run_started = Some(Instant::now());
    }

    /// Offer `KVM_RUN`'s result to pvspin; call before the VMM handles it. On the userspace
    /// kick path a halt parks the calling thread here until a kick, an interrupt or shutdown.
    pub fn handle_exit(
        &mut self,
        exit: &mut Result<VcpuExit<'_>, kvm_ioctls::Error>,
    ) -> ExitOutcome {
        let kind = classify(exit);
        match exit {
            Ok(VcpuExit::IoOut(port, data)) if self.kick.is_some() => {
                self.record_exit(kind);
                self.doorbell.pio_write(*port, data)
            }
            Ok(VcpuExit::IoIn(port, data)) if self.kick.is_some() => {
                self.record_exit(kind);
                self.doorbell.pio_read(*port, data)
            }
            _ => self.handle_exit_kind(kind),
        }
    }

    /// [`handle_exit`](Self::handle_exit) for a VMM whose vCPU loop sees its own exit type, not
    /// `kvm_ioctls::VcpuExit` (Cloud Hypervisor's `hypervisor::cpu::VmExit`): `kind` is what
    /// `KVM_RUN` returned ([`ExitKind::from_exit_reason`] of `kvm_run.exit_reason`). Such a
    /// VMM dispatches port I/O on a bus, so the doorbell is its bus device
    /// ([`crate::PvSpin::doorbell_pio`]); everything else `handle_exit` does happens here: the
    /// run and its exit are counted, the guest's wait report is read, and on the userspace kick
    /// path a halt parks the thread (then `Handled`).
    pub fn handle_exit_kind(&mut self, kind: ExitKind) -> ExitOutcome {
        self.record_exit(kind);
        match &self.kick {
            Some(kick) if kind == ExitKind::Hlt && kick.device.path() == KickPath::Userspace => {
                let index = u32::try_from(self.index).unwrap_or(u32::MAX);
                self.park(kick, "parking on a halt", |dev| dev.handle_hlt(index));
                ExitOutcome::Handled
            }
            _ => ExitOutcome::NotHandled,
        }
    }

    /// Counts the run that just ended and reads the guest's wait report.
    fn record_exit(&mut self, kind: ExitKind) {
        let ns = self.run_started.take().map_or(0, |start| {
            u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
        });
        if let Some(cell) = self.cells.get(self.index) {
            cell.record_run(kind, ns);
        }
        self.last_exit = Some(kind);
        if let Some(hints) = &self.hints {
            if let (Some(ns), Some(dy)) = (hints.on_exit(self.index), &self.dy) {
                dy.on_wait_report(ns);
            }
        }
    }

    /// Userspace path: parks this thread on the vCPU's latch with `park` (a halt or a WAIT),
    /// the board and the hint page saying meanwhile that the vCPU does not run; records the
    /// kick-to-wake time of a kicked wake-up. `None` when the device refused (logged).
    fn park(
        &self,
        kick: &KickState,
        what: &str,
        park: impl FnOnce(&KickDevice) -> Result<ParkOutcome, KickError>,
    ) -> Option<ParkOutcome> {
        let page = self.hints.as_ref().and_then(|h| h.pages.get(self.index));
        if let Some(page) = page {
            page.set_not_running(true);
        }
        if let Some(slots) = &self.slots {
            slots.slots.leave(self.index);
        }
        if let Some(dy) = &self.dy {
            dy.board.on_halt(self.index);
        }
        let outcome = park(&kick.device);
        if let Some(dy) = &self.dy {
            dy.board.on_wake(self.index);
            dy.actuator.on_target_exit(self.index);
        }
        if let Some(page) = page {
            page.set_not_running(false);
        }
        match outcome {
            Ok(outcome) => {
                if outcome.kicked() {
                    if let (Some(age), Some(cell)) =
                        (kick.take_kick_age(self.index), self.cells.get(self.index))
                    {
                        cell.record_kick_to_wake_ns(age);
                    }
                }
                Some(outcome)
            }
            Err(err) => {
                log::error!("vCPU {}: {what}: {err}", self.index);
                None
            }
        }
    }

    /// Call after [`after_run`](Self::after_run) when the VMM parks this vCPU's thread in a
    /// wait of its own rather than running it again (a halt or an idle vCPU it handles
    /// itself, outside pvspin's hooks): the vCPU gives its run slot up, so the other vCPUs run
    /// meanwhile instead of waiting for its quantum to end, and directed yield and the hint
    /// page see it as not running. The next [`before_run`](Self::before_run) asks for a slot
    /// again. Nothing to do without run slots, directed yield or hint pages.
    pub fn before_vmm_park(&mut self) {
        if self.vmm_parked {
            return;
        }
        if let Some(page) = self.hints.as_ref().and_then(|h| h.pages.get(self.index)) {
            page.set_not_running(true);
        }
        if let Some(slots) = &self.slots {
            slots.slots.leave(self.index);
        }
        if let Some(dy) = &self.dy {
            dy.board.on_halt(self.index);
        }
        self.vmm_parked = true;
    }

    /// The VMM's park ended: the vCPU runs again (see [`before_vmm_park`](Self::before_vmm_park)).
    fn show_running(&self) {
        if let Some(dy) = &self.dy {
            dy.board.on_wake(self.index);
            dy.actuator.on_target_exit(self.index);
        }
        if let Some(page) = self.hints.as_ref().and_then(|h| h.pages.get(self.index)) {
            page.set_not_running(false);
        }
    }

    /// Acts on a notification of this vCPU: a SPIN, or the one a WAIT carries (`parking`:
    /// the thread parks next, so it is not yielded).
    fn notify(&self, n: SpinNotify, parking: bool) {
        if let (Some(slots), Some(target)) = (&self.slots, n.waiting_for) {
            slots.slots.prioritize(usize::from(target));
        }
        let Some(dy) = &self.dy else {
            return;
        };
        let cell = self.cells.get(self.index);
        if let Some(cell) = cell {
            cell.record_spin_notification();
        }
        let handled = if parking {
            dy.on_wait_notification(self.index, n)
        } else {
            dy.on_notification(self.index, n)
        };
        if let (Some(cell), Some(successful)) = (cell, handled.yielded) {
            cell.record_yield(successful);
        }
        if let Some(hints) = &self.hints {
            hints.on_notification(self.index, handled.useful);
        }
    }

    /// Call after the VMM has dealt with the exit, before the next `before_run`, with the
    /// vCPU (not borrowed by the exit any more). With directed yield, reads the CPL of this
    /// exit from `kvm_run`'s sync registers (no ioctl), records it on the board and handles
    /// a spin notification that came with the exit (which may yield this thread).
    pub fn after_run(&mut self, vcpu: &VcpuFd) {
        let cpl = self
            .dy
            .as_ref()
            .map(|_| pvspin_track::cpl_from_sync_regs(vcpu));
        self.after_run_inner(cpl, Some(vcpu));
    }

    /// [`after_run`](Self::after_run) for a VMM that reads the CPL itself (or for tests):
    /// `cpl` is the guest's privilege level at this exit, `None` when unknown. Without the
    /// vCPU, a WAIT on the in-kernel and signal-msi paths cannot halt it and returns at once
    /// (a spurious wake-up, which the guest tolerates).
    pub fn after_run_with_cpl(&mut self, cpl: Option<u8>) {
        self.after_run_inner(cpl, None);
    }

    fn after_run_inner(&mut self, cpl: Option<u8>, vcpu: Option<&VcpuFd>) {
        // A WAIT that becomes KVM's halt (MSI paths) goes back into KVM to block there, as a
        // `hlt` would without leaving it: the slots neither count this exit nor gate that
        // entry; the halt watcher sees the halt.
        let halts_in_kvm = vcpu.is_some()
            && self.doorbell.pending_wait.load(Ordering::Relaxed) != 0
            && self
                .kick
                .as_ref()
                .is_some_and(|k| k.device.path() != KickPath::Userspace);
        if let (Some(slots), false) = (&self.slots, halts_in_kvm) {
            if !slots.exited(self.index) {
                // It will wait for a slot: learn where to show that to a stock guest.
                if let Some(vcpu) = vcpu {
                    slots.learn_steal_time(self.index, vcpu);
                }
            }
        }
        self.after_run_spin(cpl);
        if let Some(n) = take_pending(&self.doorbell.pending_wait) {
            self.wait(n, vcpu);
        }
        self.halt_entry = halts_in_kvm && self.slots.is_some();
    }

    /// Carries out a WAIT: acts on its notification (directed yield) like a SPIN, then waits:
    /// on the userspace path parks this thread on the vCPU's latch (bounded), on the MSI
    /// paths sets the vCPU halted so that the next `KVM_RUN` blocks in KVM until a kick.
    fn wait(&mut self, n: SpinNotify, vcpu: Option<&VcpuFd>) {
        let Some(kick) = self.kick.clone() else {
            return;
        };
        self.notify(n, true);
        match kick.device.path() {
            KickPath::Userspace => {
                let timeout = self.wait.map(|w| w.timeout);
                let index = u32::try_from(self.index).unwrap_or(u32::MAX);
                let outcome = self.park(&kick, "WAIT", |dev| dev.handle_wait(index, timeout));
                if let (Some(outcome), Some(hints)) = (outcome, &self.hints) {
                    hints.note_wait(
                        outcome == ParkOutcome::KickedBeforePark,
                        outcome == ParkOutcome::TimedOut,
                    );
                }
            }
            KickPath::InKernel | KickPath::SignalMsi => {
                if let Some(hints) = &self.hints {
                    hints.note_wait(false, false);
                }
                let Some(vcpu) = vcpu else {
                    return;
                };
                // KVM's own halt: blocks in the next KVM_RUN until the kick's REMRD MSI
                // (pv_unhalted, which also remembers a kick that landed first), an interrupt
                // the guest accepts, or a signal.
                let halted = kvm_bindings::kvm_mp_state {
                    mp_state: kvm_bindings::KVM_MP_STATE_HALTED,
                };
                if let Err(err) = vcpu.set_mp_state(halted) {
                    log::error!("vCPU {}: WAIT: KVM_SET_MP_STATE: {err}", self.index);
                }
            }
        }
    }

    fn after_run_spin(&mut self, cpl: Option<u8>) {
        self.last_exit = None;
        let Some(dy) = &self.dy else {
            return;
        };
        dy.board.on_exit(self.index, cpl);
        dy.actuator.on_target_exit(self.index);
        if let Some(n) = take_pending(&self.doorbell.pending_spin) {
            self.notify(n, false);
        }
    }

    /// The kind of the exit being handled, between `handle_exit` and `after_run`.
    pub fn last_exit(&self) -> Option<ExitKind> {
        self.last_exit
    }
}

impl Drop for VcpuHooks {
    fn drop(&mut self) {
        // Forget this vCPU on this thread (`try_with`: the thread may be exiting).
        let _ = CURRENT.try_with(|current| {
            if let Ok(mut current) = current.try_borrow_mut() {
                if current
                    .as_ref()
                    .is_some_and(|d| Arc::ptr_eq(d, &self.doorbell))
                {
                    *current = None;
                }
            }
        });
    }
}

thread_local! {
    /// The doorbell of the vCPU whose hooks last ran `before_run` on this thread.
    static CURRENT: std::cell::RefCell<Option<Arc<VcpuDoorbell>>> =
        const { std::cell::RefCell::new(None) };
}

/// A pending notification: 0 when none, else `1 << 32 | value`.
fn take_pending(slot: &AtomicU64) -> Option<SpinNotify> {
    let v = slot.swap(0, Ordering::Relaxed);
    (v != 0).then(|| SpinNotify::decode(v as u32))
}

fn set_pending(slot: &AtomicU64, n: SpinNotify) {
    slot.store(1 << 32 | u64::from(n.encode()), Ordering::Relaxed);
}

/// One vCPU's doorbell accesses: what both [`VcpuHooks::handle_exit`] and the bus device
/// ([`crate::DoorbellPio`]) do with a port-I/O exit. Only the vCPU's own thread uses it.
#[derive(Debug, Default)]
pub(crate) struct VcpuDoorbell {
    index: usize,
    cells: Arc<[Arc<VcpuCounterCell>]>,
    kick: Option<Arc<KickState>>,
    dy: Option<Arc<YieldState>>,
    hints: Option<Arc<HintState>>,
    slots: Option<Arc<SlotState>>,
    /// Which vCPUs are configured (a kick to another is counted).
    adoption: Arc<Adoption>,
    /// A SPIN that arrived with this exit, handled in `after_run` once the CPL is known.
    pending_spin: AtomicU64,
    /// A WAIT that arrived with this exit, carried out in `after_run`.
    pending_wait: AtomicU64,
}

impl VcpuDoorbell {
    /// Runs `f` with the doorbell of the vCPU whose hooks run on this thread.
    pub(crate) fn with_current<R>(f: impl FnOnce(Option<&VcpuDoorbell>) -> R) -> R {
        CURRENT.with(|current| f(current.borrow().as_deref()))
    }

    pub(crate) fn pio_write(&self, port: u16, data: &[u8]) -> ExitOutcome {
        let Some(kick) = &self.kick else {
            return ExitOutcome::NotHandled;
        };
        let outcome = kick.device.handle_pio_write(port, data);
        self.after_pio(kick, outcome)
    }

    pub(crate) fn pio_read(&self, port: u16, data: &mut [u8]) -> ExitOutcome {
        let Some(kick) = &self.kick else {
            return ExitOutcome::NotHandled;
        };
        let outcome = kick.device.handle_pio_read(port, data);
        if outcome == PioOutcome::Handled(Handled::Forward(Command::ReadSpinWindow)) {
            if let Some(dy) = &self.dy {
                let window = dy.read_window(self.index).to_le_bytes();
                // The device forwards only 4-byte reads.
                if data.len() == window.len() {
                    data.copy_from_slice(&window);
                }
            }
        }
        self.after_pio(kick, outcome)
    }

    fn after_pio(&self, kick: &KickState, outcome: PioOutcome) -> ExitOutcome {
        match outcome {
            PioOutcome::NotMine => ExitOutcome::NotHandled,
            PioOutcome::Handled(Handled::Kicked { target, delivery }) => {
                self.adoption.on_kick(kick.device.path(), target, delivery);
                kick.note_kick(target);
                if let Some(slots) = &self.slots {
                    // Lock hand-over is slot hand-over: the kicked vCPU is the next owner.
                    slots.slots.hand_over(self.index, target as usize);
                }
                if let Some(dy) = &self.dy {
                    dy.board.kick(target as usize);
                }
                if let Some(cell) = self.cells.get(target as usize) {
                    cell.record_kick();
                }
                ExitOutcome::Handled
            }
            PioOutcome::Handled(Handled::Rejected(reason)) => {
                if let Some(cell) = self.cells.get(self.index) {
                    cell.reject(reason.name());
                }
                ExitOutcome::Handled
            }
            PioOutcome::Handled(Handled::Forward(Command::Spin(n))) => {
                // Decided in `after_run`, once the CPL of this exit is known.
                if self.dy.is_some() {
                    set_pending(&self.pending_spin, n);
                }
                ExitOutcome::Handled
            }
            PioOutcome::Handled(Handled::Forward(Command::SharedPage { pfn })) => {
                if let Some(hints) = &self.hints {
                    if let Err(err) = hints.register(self.index, pfn) {
                        if let Some(cell) = self.cells.get(self.index) {
                            cell.reject("bad_hint_page");
                        }
                        log::debug!("vCPU {}: SHARED_PAGE ignored: {err}", self.index);
                    }
                }
                ExitOutcome::Handled
            }
            PioOutcome::Handled(Handled::Forward(Command::Wait(n))) => {
                // Carried out in `after_run`, once the VMM is done with this exit.
                set_pending(&self.pending_wait, n);
                ExitOutcome::Handled
            }
            // Window reads were answered in `pio_read`.
            PioOutcome::Handled(Handled::Forward(_)) => ExitOutcome::Handled,
        }
    }
}

/// Sorts a `KVM_RUN` result into the kinds pvspin counts.
pub(crate) fn classify(exit: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> ExitKind {
    match exit {
        Ok(VcpuExit::IoIn(..) | VcpuExit::IoOut(..)) => ExitKind::Io,
        Ok(VcpuExit::MmioRead(..) | VcpuExit::MmioWrite(..)) => ExitKind::Mmio,
        Ok(VcpuExit::Hlt) => ExitKind::Hlt,
        Ok(VcpuExit::Shutdown | VcpuExit::FailEntry(..) | VcpuExit::InternalError) => {
            ExitKind::Failure
        }
        Ok(_) => ExitKind::Other,
        Err(err) if err.errno() == libc::EINTR => ExitKind::Interrupted,
        Err(_) => ExitKind::Failure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Shape;

    #[test]
    fn classifies_and_counts_hand_built_exits() {
        let cells: Arc<[Arc<VcpuCounterCell>]> =
            (0..4).map(|_| Arc::new(VcpuCounterCell::new())).collect();
        let mut hooks = VcpuHooks::new(3, cells.clone(), None, None);
        let mut data = [0u8; 4];
        let mut exits: Vec<Result<VcpuExit<'_>, kvm_ioctls::Error>> = vec![
            Ok(VcpuExit::IoOut(0x3f8, b"a")),
            Ok(VcpuExit::Hlt),
            Ok(VcpuExit::MmioWrite(0xd000_0000, &[1, 2])),
            Ok(VcpuExit::Shutdown),
            Ok(VcpuExit::IrqWindowOpen),
            Err(kvm_ioctls::Error::new(libc::EINTR)),
            Err(kvm_ioctls::Error::new(libc::EFAULT)),
        ];
        for exit in &mut exits {
            hooks.before_run();
            assert_eq!(hooks.handle_exit(exit), ExitOutcome::NotHandled);
            hooks.after_run_with_cpl(None);
        }
        hooks.before_run();
        let mut read = Ok(VcpuExit::IoIn(0x3fd, &mut data));
        hooks.handle_exit(&mut read);
        assert_eq!(hooks.last_exit(), Some(ExitKind::Io));
        let snapshot = cells[3].snapshot(Shape::default(), None);
        assert_eq!(snapshot.runs, 8);
        let exits = snapshot.exits;
        assert_eq!(exits.get(ExitKind::Io), 2);
        assert_eq!(exits.get(ExitKind::Hlt), 1);
        assert_eq!(exits.get(ExitKind::Mmio), 1);
        assert_eq!(exits.get(ExitKind::Failure), 2);
        assert_eq!(exits.get(ExitKind::Interrupted), 1);
        assert_eq!(exits.get(ExitKind::Other), 1);
        assert_eq!(exits.total(), 8);
        assert_eq!(cells[0].snapshot(Shape::default(), None).runs, 0);
        assert_eq!(hooks.index(), 3);
    }

    #[test]
    fn neutral_entry_counts_exit_reasons_like_handle_exit() {
        let cells: Arc<[Arc<VcpuCounterCell>]> =
            (0..2).map(|_| Arc::new(VcpuCounterCell::new())).collect();
        let mut hooks = VcpuHooks::new(1, cells.clone(), None, None);
        let reasons = [
            kvm_bindings::KVM_EXIT_IO,
            kvm_bindings::KVM_EXIT_MMIO,
            kvm_bindings::KVM_EXIT_HLT,
            kvm_bindings::KVM_EXIT_INTR,
            kvm_bindings::KVM_EXIT_SHUTDOWN,
            kvm_bindings::KVM_EXIT_IRQ_WINDOW_OPEN,
        ];
        for reason in reasons {
            hooks.before_run();
            let kind = ExitKind::from_exit_reason(reason);
            assert_eq!(hooks.handle_exit_kind(kind), ExitOutcome::NotHandled);
            assert_eq!(hooks.last_exit(), Some(kind));
            hooks.after_run_with_cpl(None);
        }
        let exits = cells[1].snapshot(Shape::default(), None).exits;
        for kind in ExitKind::ALL {
            assert_eq!(exits.get(kind), 1, "{kind:?}");
        }
        assert_eq!(cells[0].snapshot(Shape::default(), None).runs, 0);
    }
}

#[cfg(test)]
mod directed_tests {
    use super::*;
    use crate::directed::DirectedYieldOptions;
    use crate::telemetry::Shape;
    use pvspin_abi::cpuid::FEATURE_SPIN_NOTIFY;
    use pvspin_abi::doorbell::{DEFAULT_PORT, SPIN_OFFSET};
    use pvspin_hints::{Actuator, YieldReport};
    use std::sync::Mutex;

    /// Records what it was asked to do; reports "descheduled" as told.
    #[derive(Debug, Default)]
    struct RecorderInner {
        calls: Mutex<Vec<String>>,
        deschedule: bool,
    }

    #[derive(Debug, Default, Clone)]
    struct Recorder(Arc<RecorderInner>);

    impl std::ops::Deref for Recorder {
        type Target = RecorderInner;
        fn deref(&self) -> &RecorderInner {
            &self.0
        }
    }

    impl Actuator for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn yield_to(&self, target: usize, tid: i32) -> YieldReport {
            self.calls
                .lock()
                .unwrap()
                .push(format!("yield_to {target} tid {tid}"));
            YieldReport {
                boosted: true,
                descheduled: self.deschedule,
            }
        }
        fn yield_self(&self) -> YieldReport {
            self.calls.lock().unwrap().push("yield_self".into());
            YieldReport {
                boosted: false,
                descheduled: self.deschedule,
            }
        }
        fn on_target_exit(&self, v: usize) {
            self.calls.lock().unwrap().push(format!("exit {v}"));
        }
        fn restore_all(&self) {
            self.calls.lock().unwrap().push("restore_all".into());
        }
    }

    struct Vm {
        hooks: Vec<VcpuHooks>,
        cells: Arc<[Arc<VcpuCounterCell>]>,
        dy: Arc<YieldState>,
        rec: Recorder,
    }

    const SHAPE: Shape = Shape {
        kick_path: Some(KickPath::Userspace),
        directed_yield: true,
    };

    fn yields(cell: &VcpuCounterCell) -> crate::telemetry::VcpuYieldCounts {
        cell.snapshot(SHAPE, None)
            .directed_yield
            .expect("directed yield is on")
    }

    fn vm(n: usize, deschedule: bool) -> Vm {
        vm_with(n, deschedule, &DirectedYieldOptions::default())
    }

    fn vm_with(n: usize, deschedule: bool, options: &DirectedYieldOptions) -> Vm {
        let rec = Recorder(Arc::new(RecorderInner {
            deschedule,
            ..RecorderInner::default()
        }));
        let dy = Arc::new(YieldState::with_actuator(options, n, Box::new(rec.clone())).unwrap());
        let kick = Arc::new(KickState::userspace_for_tests(n, FEATURE_SPIN_NOTIFY));
        let cells: Arc<[Arc<VcpuCounterCell>]> =
            (0..n).map(|_| Arc::new(VcpuCounterCell::new())).collect();
        let hooks = (0..n)
            .map(|i| VcpuHooks::new(i, cells.clone(), Some(kick.clone()), Some(dy.clone())))
            .collect();
        Vm {
            hooks,
            cells,
            dy,
            rec,
        }
    }

    const SPIN_PORT: u16 = DEFAULT_PORT + SPIN_OFFSET;

    /// One exit of `v`: a SPIN write of `value`, at CPL `cpl`.
    fn spin(vm: &mut Vm, v: usize, value: u32, cpl: u8) -> ExitOutcome {
        let h = &mut vm.hooks[v];
        h.before_run();
        let bytes = value.to_le_bytes();
        let mut exit = Ok(VcpuExit::IoOut(SPIN_PORT, &bytes));
        let out = h.handle_exit(&mut exit);
        h.after_run_with_cpl(Some(cpl));
        out
    }

    fn read_window(vm: &mut Vm, v: usize) -> u32 {
        let h = &mut vm.hooks[v];
        h.before_run();
        let mut data = [0u8; 4];
        let mut exit = Ok(VcpuExit::IoIn(SPIN_PORT, &mut data));
        assert_eq!(h.handle_exit(&mut exit), ExitOutcome::Handled);
        drop(exit);
        h.after_run_with_cpl(Some(0));
        u32::from_le_bytes(data)
    }

    fn notify(waiting_for: Option<u16>) -> u32 {
        SpinNotify {
            waiting_for,
            next_owner: false,
            spun_bucket: 5,
            lock_hash: 0x123,
        }
        .encode()
    }

    #[test]
    fn hint_naming_a_preempted_vcpu_yields_to_it() {
        let mut vm = vm(3, false);
        // vCPU 1 exits in kernel mode and its VMM scheduler parks it: preempted in kernel.
        vm.hooks[1].before_run();
        assert_eq!(vm.dy.board.tid(1), pvspin_hints::sched::current_tid());
        vm.dy.board.set_tid(1, 4242);
        vm.hooks[1].after_run_with_cpl(Some(0));
        vm.dy.board.park(1);
        vm.rec.calls.lock().unwrap().clear();
        assert_eq!(spin(&mut vm, 0, notify(Some(1)), 0), ExitOutcome::Handled);
        let calls = vm.rec.calls.lock().unwrap().clone();
        assert_eq!(calls, ["exit 0", "yield_to 1 tid 4242"]);
        let s = yields(&vm.cells[0]);
        assert_eq!(
            (
                s.spin_notifications,
                s.yields_attempted,
                s.yields_successful
            ),
            (1, 1, 1)
        );
        let st = vm.dy.stats();
        assert_eq!((st.notifications, st.yield_to_hint, st.boosted), (1, 1, 1));
    }

    #[test]
    fn running_holder_is_boosted_by_default() {
        let mut vm = vm(2, false);
        vm.hooks[1].before_run();
        vm.dy.board.set_tid(1, 77);
        spin(&mut vm, 0, notify(Some(1)), 0);
        assert!(vm
            .rec
            .calls
            .lock()
            .unwrap()
            .contains(&"yield_to 1 tid 77".to_string()));
        assert_eq!(vm.dy.stats().yield_to_hint, 1);
    }

    #[test]
    fn with_kvm_rules_a_running_holder_falls_back_to_the_scan_and_yields_self() {
        let options = DirectedYieldOptions {
            policy: pvspin_yield::PolicyConfig::default(),
            ..DirectedYieldOptions::default()
        };
        let mut vm = vm_with(2, false, &options);
        // vCPU 1 is in the guest: running, not ready.
        vm.hooks[1].before_run();
        assert_eq!(spin(&mut vm, 0, notify(Some(1)), 0), ExitOutcome::Handled);
        assert!(vm
            .rec
            .calls
            .lock()
            .unwrap()
            .contains(&"yield_self".to_string()));
        let st = vm.dy.stats();
        assert_eq!(
            (st.yield_self, st.hint_not_ready, st.yield_to_hint),
            (1, 1, 0)
        );
        // Not descheduled: counted as attempted, not successful.
        let s = yields(&vm.cells[0]);
        assert_eq!((s.yields_attempted, s.yields_successful), (1, 0));
    }

    #[test]
    fn steal_time_shows_preemption_inside_kvm_run_and_in_which_mode() {
        // KVM's rules (no trust in running hints): only steal time can make a vCPU ready.
        let options = DirectedYieldOptions {
            policy: pvspin_yield::PolicyConfig::default(),
            ..DirectedYieldOptions::default()
        };
        let mut vm = vm_with(3, false, &options);
        // Guest memory whose bytes the test flips while vCPUs "run".
        let mem = Arc::new(pvspin_hints::BufferPageMap::new(1));
        // A state with the memory (the builder installs it for a real VM).
        let dy = Arc::new({
            let mut state =
                YieldState::with_actuator(&options, 3, Box::new(vm.rec.clone())).unwrap();
            state.mem = Some(crate::directed::PageBytes(mem.clone()));
            for (v, gpa) in [(1usize, 64u64), (2, 128)] {
                state.board.set_steal_time_gpa(v, Some(gpa));
            }
            state
        });
        for h in &mut vm.hooks {
            h.dy = Some(dy.clone());
        }
        vm.dy = dy;
        // vCPU 1 last exited in user mode, vCPU 2 in kernel mode; both are back in the guest.
        for (v, cpl) in [(1, 3), (2, 0)] {
            vm.hooks[v].before_run();
            vm.hooks[v].after_run_with_cpl(Some(cpl));
            vm.hooks[v].before_run();
        }
        // Not preempted: the hint names a running vCPU, the scan finds nobody.
        spin(&mut vm, 0, notify(Some(1)), 0);
        assert_eq!(vm.dy.stats().yield_self, 1);
        // KVM marks both preempted: the hint is used.
        // The `preempted` byte (offset 16) of each area; the word's low byte, little-endian.
        mem.word(64 + 16)
            .store(1, std::sync::atomic::Ordering::Relaxed);
        mem.word(128 + 16)
            .store(1, std::sync::atomic::Ordering::Relaxed);
        spin(&mut vm, 0, notify(Some(1)), 0);
        assert_eq!(vm.dy.stats().yield_to_hint, 1);
        // No hint, spinner in kernel mode: the filter skips vCPU 1 (preempted in user mode).
        spin(&mut vm, 0, notify(None), 0);
        let calls = vm.rec.calls.lock().unwrap().clone();
        assert_eq!(
            calls.iter().rfind(|c| c.starts_with("yield_to")).unwrap(),
            &format!("yield_to 2 tid {}", pvspin_hints::sched::current_tid())
        );
        assert_eq!(vm.dy.stats().yield_to_candidate, 1);
    }

    #[test]
    fn kernel_mode_filter_skips_a_vcpu_preempted_in_user_mode() {
        let mut vm = vm(3, false);
        // vCPU 1 preempted at CPL 3, vCPU 2 preempted at CPL 0; the spinner (kernel mode)
        // names nobody, so the scan decides.
        for (v, cpl) in [(1, 3), (2, 0)] {
            vm.hooks[v].before_run();
            vm.hooks[v].after_run_with_cpl(Some(cpl));
            vm.dy.board.park(v);
        }
        spin(&mut vm, 0, notify(None), 0);
        assert!(vm
            .rec
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("yield_to 2")));
        assert_eq!(vm.dy.stats().yield_to_candidate, 1);
        // A spinner in user mode does not filter: the round robin moves on to vCPU 1.
        spin(&mut vm, 0, notify(None), 3);
        assert!(vm
            .rec
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("yield_to 1")));
    }

    #[test]
    fn window_grows_per_notification_and_resets_when_descheduled() {
        let mut vm = vm(2, false);
        assert_eq!(read_window(&mut vm, 0), 16);
        spin(&mut vm, 0, notify(None), 0);
        assert_eq!(read_window(&mut vm, 0), 32);
        spin(&mut vm, 0, notify(None), 0);
        assert_eq!(read_window(&mut vm, 0), 64);
        assert_eq!(read_window(&mut vm, 1), 16, "windows are per vCPU");
        let mut vm = vm_descheduling();
        spin(&mut vm, 0, notify(None), 0);
        assert_eq!(
            read_window(&mut vm, 0),
            16,
            "grown, then reset by the deschedule"
        );
        assert_eq!(vm.dy.stats().window_reads, 1);
    }

    fn vm_descheduling() -> Vm {
        vm(2, true)
    }

    #[test]
    fn bad_spin_writes_are_counted_and_ignored() {
        let mut vm = vm(2, false);
        // Names vCPU 7 of 2: rejected by the device, no decision, no yield.
        assert_eq!(spin(&mut vm, 0, notify(Some(7)), 0), ExitOutcome::Handled);
        // Wrong width.
        let h = &mut vm.hooks[0];
        h.before_run();
        let mut exit = Ok(VcpuExit::IoOut(SPIN_PORT, &[1, 2]));
        assert_eq!(h.handle_exit(&mut exit), ExitOutcome::Handled);
        h.after_run_with_cpl(Some(0));
        // Names itself: reaches the policy, which counts and ignores the hint.
        spin(&mut vm, 0, notify(Some(0)), 0);
        let s = vm.cells[0].snapshot(SHAPE, None);
        assert_eq!(s.rejected_guest_inputs.get("no_such_vcpu"), Some(&1));
        assert_eq!(s.rejected_guest_inputs.get("wrong_width"), Some(&1));
        assert_eq!(s.directed_yield.unwrap().spin_notifications, 1);
        let st = vm.dy.stats();
        assert_eq!((st.notifications, st.hint_self), (1, 1));
        assert!(!vm
            .rec
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("yield_to")));
    }

    #[test]
    fn kicks_and_userspace_halts_reach_the_board() {
        let mut vm = vm(2, false);
        vm.hooks[1].before_run();
        vm.hooks[1].after_run_with_cpl(Some(0));
        vm.dy.board.park(1);
        let h = &mut vm.hooks[0];
        h.before_run();
        let bytes = 1u32.to_le_bytes();
        let mut exit = Ok(VcpuExit::IoOut(DEFAULT_PORT, &bytes));
        assert_eq!(h.handle_exit(&mut exit), ExitOutcome::Handled);
        h.after_run_with_cpl(Some(0));
        assert!(vm.dy.board.snapshot(1).unwrap().has_pending_kick());
        // vCPU 1's halt consumes the latched kick without blocking, and it is awake again.
        let h = &mut vm.hooks[1];
        h.before_run();
        let mut exit = Ok(VcpuExit::Hlt);
        assert_eq!(h.handle_exit(&mut exit), ExitOutcome::Handled);
        let snap = vm.dy.board.snapshot(1).unwrap();
        assert!(!snap.is_halted() && !snap.has_pending_kick());
    }
}

#[cfg(test)]
mod hint_tests {
    use super::*;
    use crate::hints::{HintOptions, HintState};
    use crate::telemetry::Shape;
    use pvspin_abi::cpuid::{FEATURE_SHARED_PAGE, FEATURE_WAIT};
    use pvspin_abi::doorbell::{DEFAULT_PORT, SHARED_PAGE_OFFSET, WAIT_OFFSET};
    use pvspin_abi::hint;
    use pvspin_hints::BufferPageMap;
    use std::time::Duration;

    struct Vm {
        hooks: Vec<VcpuHooks>,
        hints: Arc<HintState>,
        cells: Arc<[Arc<VcpuCounterCell>]>,
        map: Arc<BufferPageMap>,
    }

    fn vm() -> Vm {
        let map = Arc::new(BufferPageMap::new(8));
        let options = HintOptions {
            memory: map.clone(),
            budgets: pvspin_yield::BudgetConfig::default(),
        };
        let hints = Arc::new(HintState::new(&options, 2, false, false).unwrap());
        hints.set_tsc_khz(1_000_000); // 1 GHz: cycles == ns
        let kick = Arc::new(KickState::userspace_for_tests(
            2,
            FEATURE_SHARED_PAGE | FEATURE_WAIT,
        ));
        let cells: Arc<[Arc<VcpuCounterCell>]> =
            (0..2).map(|_| Arc::new(VcpuCounterCell::new())).collect();
        let wait = crate::WaitOptions {
            timeout: Duration::from_millis(20),
        };
        let hooks = (0..2)
            .map(|i| {
                VcpuHooks::new(i, cells.clone(), Some(kick.clone()), None)
                    .with_hints(Some(hints.clone()), Some(wait))
            })
            .collect();
        Vm {
            hooks,
            hints,
            cells,
            map,
        }
    }

    fn out(vm: &mut Vm, v: usize, offset: u16, value: u32) {
        let h = &mut vm.hooks[v];
        h.before_run();
        let bytes = value.to_le_bytes();
        let mut exit = Ok(VcpuExit::IoOut(DEFAULT_PORT + offset, &bytes));
        assert_eq!(h.handle_exit(&mut exit), ExitOutcome::Handled);
        drop(exit);
        h.after_run_with_cpl(Some(3));
    }

    #[test]
    fn page_registration_budgets_and_wait_reports() {
        let mut vm = vm();
        out(&mut vm, 0, SHARED_PAGE_OFFSET, 2);
        let page = vm.hints.pages.get(0).expect("registered");
        assert_eq!(
            page.budgets(),
            (u64::MAX, 50_000),
            "no notifications: window never"
        );
        // The guest reports a 10 us wait: short, so the budget doubles at its next exit.
        let map = vm.map.clone();
        let word = map.word(0x2000 + hint::LAST_WAIT_TSC);
        word.store(10_000, std::sync::atomic::Ordering::Relaxed);
        out(&mut vm, 0, 0, 1); // any exit: a kick of vCPU 1
        assert_eq!(page.budgets().1, 100_000);
        assert_eq!(
            word.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "taken once"
        );
        // A frame that is not guest RAM: counted and ignored.
        out(&mut vm, 1, SHARED_PAGE_OFFSET, 4096);
        assert!(vm.hints.pages.get(1).is_none());
        let s = vm.hints.stats(true);
        assert_eq!(
            (s.registrations, s.bad_registrations, s.wait_reports),
            (1, 1, 1)
        );
        assert_eq!(
            vm.cells[1]
                .snapshot(Shape::default(), None)
                .rejected_guest_inputs
                .get("bad_hint_page"),
            Some(&1)
        );
    }

    #[test]
    fn wait_consumes_a_pending_kick_or_ends_by_its_bound() {
        let mut vm = vm();
        out(&mut vm, 1, SHARED_PAGE_OFFSET, 3);
        // vCPU 0 kicks vCPU 1 first: vCPU 1's WAIT returns at once.
        out(&mut vm, 0, 0, 1);
        let start = std::time::Instant::now();
        out(&mut vm, 1, WAIT_OFFSET, 0x1fff);
        assert!(start.elapsed() < Duration::from_millis(20));
        // No kick now: the bounded park ends by its 20 ms timeout.
        out(&mut vm, 1, WAIT_OFFSET, 0x1fff);
        assert!(start.elapsed() >= Duration::from_millis(20));
        let s = vm.hints.stats(true);
        assert_eq!(
            (s.waits, s.waits_kick_pending, s.waits_timed_out),
            (2, Some(1), Some(1))
        );
        assert_eq!(
            (
                vm.hints.stats(false).waits_kick_pending,
                vm.hints.stats(false).waits_timed_out
            ),
            (None, None),
            "only the userspace path sees how a WAIT ends"
        );
        assert!(
            !vm.hints.pages.get(1).unwrap().not_running(),
            "cleared on wake"
        );
    }
}

#[cfg(test)]
mod pio_tests {
    use super::*;
    use crate::DoorbellPio;
    use pvspin_abi::doorbell::{DEFAULT_PORT, KICK_OFFSET, PORT_COUNT};

    /// The bus device does what `handle_exit` does, for the vCPU whose hooks run on the
    /// calling thread; accesses on other threads are counted and ignored.
    #[test]
    fn doorbell_pio_acts_for_the_vcpu_of_the_calling_thread() {
        let kick = Arc::new(KickState::userspace_for_tests(2, 0));
        let cells: Arc<[Arc<VcpuCounterCell>]> =
            (0..2).map(|_| Arc::new(VcpuCounterCell::new())).collect();
        let mut hooks = VcpuHooks::new(0, cells.clone(), Some(kick.clone()), None);
        let pio = DoorbellPio::new(
            DEFAULT_PORT,
            PORT_COUNT,
            Arc::new(crate::check::Adoption::complete(2)),
        );
        let kick_offset = u64::from(KICK_OFFSET);
        // Before any `before_run` on this thread, nobody is attributed.
        assert!(pio.write(kick_offset, &1u32.to_le_bytes()));
        assert_eq!(pio.unattributed(), 1);
        hooks.before_run();
        assert!(pio.write(kick_offset, &1u32.to_le_bytes()));
        assert!(kick.device.kick_pending(1).unwrap(), "vCPU 1 was kicked");
        // A kick of a vCPU that does not exist is a counted reject of the caller.
        assert!(pio.write(kick_offset, &7u32.to_le_bytes()));
        assert_eq!(
            cells[0]
                .snapshot(crate::telemetry::Shape::default(), None)
                .rejected_guest_inputs
                .values()
                .sum::<u64>(),
            1
        );
        // Offsets beyond the doorbell are not its.
        assert!(!pio.write(u64::from(PORT_COUNT), &1u32.to_le_bytes()));
        // Another thread has no hooks: ignored, counted.
        let other = pio.clone();
        std::thread::spawn(move || {
            let mut data = [0u8; 4];
            assert!(other.read(kick_offset, &mut data));
            assert_eq!(data, [0xff; 4]);
        })
        .join()
        .unwrap();
        assert_eq!(pio.unattributed(), 2);
        // Dropping the hooks forgets them on this thread.
        drop(hooks);
        assert!(pio.write(kick_offset, &1u32.to_le_bytes()));
        assert_eq!(pio.unattributed(), 3);
    }
}
