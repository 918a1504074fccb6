//! The per-vCPU hooks a VMM's vCPU loop calls around `KVM_RUN`.

use std::sync::Arc;
use std::time::Instant;

use kvm_ioctls::VcpuExit;
use pvspin_kick::{Handled, KickPath, PioOutcome};
use pvspin_kvm::telemetry::VcpuCounterCell;

use crate::counters::{ExitKind, SharedCounters};
use crate::kick::KickState;

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
    counters: Arc<SharedCounters>,
    /// Every vCPU's telemetry cell: a kick is counted on its target.
    cells: Arc<[Arc<VcpuCounterCell>]>,
    kick: Option<Arc<KickState>>,
    run_started: Option<Instant>,
    last_exit: Option<ExitKind>,
}

impl VcpuHooks {
    pub(crate) fn new(
        index: usize,
        counters: Arc<SharedCounters>,
        cells: Arc<[Arc<VcpuCounterCell>]>,
        kick: Option<Arc<KickState>>,
    ) -> Self {
        Self {
            index,
            counters,
            cells,
            kick,
            run_started: None,
            last_exit: None,
        }
    }

    /// The vCPU's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Call right before `KVM_RUN`.
    pub fn before_run(&mut self) {
        self.run_started = Some(Instant::now());
    }

    /// Offer `KVM_RUN`'s result to pvspin; call before the VMM handles it. On the userspace
    /// kick path a halt parks the calling thread here until a kick, an interrupt or shutdown.
    pub fn handle_exit(
        &mut self,
        exit: &mut Result<VcpuExit<'_>, kvm_ioctls::Error>,
    ) -> ExitOutcome {
        let kind = classify(exit);
        let ns = self.run_started.take().map_or(0, |start| {
            u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
        });
        self.counters.record_run(kind, ns);
        self.last_exit = Some(kind);
        let Some(kick) = &self.kick else {
            return ExitOutcome::NotHandled;
        };
        let outcome = match exit {
            Ok(VcpuExit::IoOut(port, data)) => kick.device.handle_pio_write(*port, data),
            Ok(VcpuExit::IoIn(port, data)) => kick.device.handle_pio_read(*port, data),
            Ok(VcpuExit::Hlt) if kick.device.path() == KickPath::Userspace => {
                self.park(kick);
                return ExitOutcome::Handled;
            }
            _ => return ExitOutcome::NotHandled,
        };
        match outcome {
            PioOutcome::NotMine => ExitOutcome::NotHandled,
            PioOutcome::Handled(Handled::Kicked { target, .. }) => {
                kick.note_kick(target);
                if let Some(cell) = self.cells.get(target as usize) {
                    cell.record_kick(kick.telemetry_path());
                }
                ExitOutcome::Handled
            }
            PioOutcome::Handled(Handled::Rejected(reason)) => {
                if let Some(cell) = self.cells.get(self.index) {
                    cell.reject(reason.name());
                }
                ExitOutcome::Handled
            }
            // Reserved commands are not enabled, so nothing is forwarded yet.
            PioOutcome::Handled(Handled::Forward(_)) => ExitOutcome::Handled,
        }
    }

    fn park(&self, kick: &KickState) {
        let index = u32::try_from(self.index).unwrap_or(u32::MAX);
        match kick.device.handle_hlt(index) {
            Ok(outcome) if outcome.kicked() => {
                if let (Some(age), Some(cell)) =
                    (kick.take_kick_age(self.index), self.cells.get(self.index))
                {
                    cell.record_kick_to_wake_ns(age);
                }
            }
            Ok(_) => {}
            Err(err) => log::error!("vCPU {index}: parking on a halt: {err}"),
        }
    }

    /// Call after the VMM has dealt with the exit, before the next `before_run`.
    pub fn after_run(&mut self) {
        self.last_exit = None;
    }

    /// The kind of the exit being handled, between `handle_exit` and `after_run`.
    pub fn last_exit(&self) -> Option<ExitKind> {
        self.last_exit
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

    #[test]
    fn classifies_and_counts_hand_built_exits() {
        let counters = Arc::new(SharedCounters::default());
        let cells: Arc<[Arc<VcpuCounterCell>]> = Arc::new([]);
        let mut hooks = VcpuHooks::new(3, counters.clone(), cells, None);
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
            hooks.after_run();
        }
        hooks.before_run();
        let mut read = Ok(VcpuExit::IoIn(0x3fd, &mut data));
        hooks.handle_exit(&mut read);
        assert_eq!(hooks.last_exit(), Some(ExitKind::Io));
        let snapshot = counters.snapshot();
        assert_eq!(snapshot.runs, 8);
        assert_eq!(snapshot.exits_of(ExitKind::Io), 2);
        assert_eq!(snapshot.exits_of(ExitKind::Hlt), 1);
        assert_eq!(snapshot.exits_of(ExitKind::Mmio), 1);
        assert_eq!(snapshot.exits_of(ExitKind::Failure), 2);
        assert_eq!(snapshot.exits_of(ExitKind::Interrupted), 1);
        assert_eq!(snapshot.exits_of(ExitKind::Other), 1);
        assert_eq!(hooks.index(), 3);
    }
}
