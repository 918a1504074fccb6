//! The per-vCPU hooks a VMM's vCPU loop calls around `KVM_RUN`.

use std::sync::Arc;
use std::time::Instant;

use kvm_ioctls::VcpuExit;

use crate::counters::{ExitKind, SharedCounters};

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
    run_started: Option<Instant>,
    last_exit: Option<ExitKind>,
}

impl VcpuHooks {
    pub(crate) fn new(index: usize, counters: Arc<SharedCounters>) -> Self {
        Self {
            index,
            counters,
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

    /// Offer `KVM_RUN`'s result to pvspin; call before the VMM handles it.
    pub fn handle_exit(&mut self, exit: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> ExitOutcome {
        let kind = classify(exit);
        let ns = self.run_started.take().map_or(0, |start| {
            u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
        });
        self.counters.record_run(kind, ns);
        self.last_exit = Some(kind);
        // No pvspin device is attached yet, so every exit is the VMM's.
        ExitOutcome::NotHandled
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
        let mut hooks = VcpuHooks::new(3, counters.clone());
        let mut data = [0u8; 4];
        let exits: Vec<Result<VcpuExit<'_>, kvm_ioctls::Error>> = vec![
            Ok(VcpuExit::IoOut(0x3f8, b"a")),
            Ok(VcpuExit::Hlt),
            Ok(VcpuExit::MmioWrite(0xd000_0000, &[1, 2])),
            Ok(VcpuExit::Shutdown),
            Ok(VcpuExit::IrqWindowOpen),
            Err(kvm_ioctls::Error::new(libc::EINTR)),
            Err(kvm_ioctls::Error::new(libc::EFAULT)),
        ];
        for exit in &exits {
            hooks.before_run();
            assert_eq!(hooks.handle_exit(exit), ExitOutcome::NotHandled);
            hooks.after_run();
        }
        hooks.before_run();
        let read = Ok(VcpuExit::IoIn(0x3fd, &mut data));
        hooks.handle_exit(&read);
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
