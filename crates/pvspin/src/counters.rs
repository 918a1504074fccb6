//! Per-vCPU counters the hooks keep, written by the vCPU's own thread, read from any thread.

use std::sync::atomic::{AtomicU64, Ordering};

/// Kinds of `KVM_RUN` outcomes pvspin counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExitKind {
    /// Port I/O (`KVM_EXIT_IO`).
    Io,
    /// MMIO (`KVM_EXIT_MMIO`).
    Mmio,
    /// `KVM_EXIT_HLT` (only without an in-kernel irqchip).
    Hlt,
    /// `KVM_RUN` returned `EINTR` (a signal or `immediate_exit`).
    Interrupted,
    /// `KVM_EXIT_SHUTDOWN`, `KVM_EXIT_FAIL_ENTRY`, `KVM_EXIT_INTERNAL_ERROR` or another error.
    Failure,
    /// Anything else.
    Other,
}

impl ExitKind {
    /// Every kind, in [`VcpuCounters::exits`] order.
    pub const ALL: [ExitKind; 6] = [
        ExitKind::Io,
        ExitKind::Mmio,
        ExitKind::Hlt,
        ExitKind::Interrupted,
        ExitKind::Failure,
        ExitKind::Other,
    ];

    /// A short name, for reports.
    pub fn name(self) -> &'static str {
        match self {
            ExitKind::Io => "io",
            ExitKind::Mmio => "mmio",
            ExitKind::Hlt => "hlt",
            ExitKind::Interrupted => "interrupted",
            ExitKind::Failure => "failure",
            ExitKind::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A snapshot of one vCPU's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VcpuCounters {
    /// `KVM_RUN` calls.
    pub runs: u64,
    /// Exits by kind, indexed like [`ExitKind::ALL`].
    pub exits: [u64; 6],
    /// Nanoseconds spent inside `KVM_RUN` (guest time plus in-kernel exits and halts).
    pub run_ns: u64,
}

impl VcpuCounters {
    /// Exits of one kind.
    pub fn exits_of(&self, kind: ExitKind) -> u64 {
        self.exits[kind.index()]
    }
}

#[derive(Debug, Default)]
pub(crate) struct SharedCounters {
    runs: AtomicU64,
    exits: [AtomicU64; 6],
    run_ns: AtomicU64,
}

impl SharedCounters {
    // Only the vCPU's own thread writes, so Relaxed increments are enough: readers want a
    // recent value, not a consistent cut across counters.
    pub(crate) fn record_run(&self, kind: ExitKind, ns: u64) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        self.exits[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.run_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> VcpuCounters {
        VcpuCounters {
            runs: self.runs.load(Ordering::Relaxed),
            exits: std::array::from_fn(|i| self.exits[i].load(Ordering::Relaxed)),
            run_ns: self.run_ns.load(Ordering::Relaxed),
        }
    }
}
