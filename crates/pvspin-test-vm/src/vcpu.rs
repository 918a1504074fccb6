//! vCPU threads: the run loop, how other threads interrupt it, and what it reports.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use kvm_bindings::KVM_EXIT_INTERNAL_ERROR;
use kvm_ioctls::{VcpuExit, VcpuFd};
use pvspin::{ExitOutcome, VcpuHooks, VcpuInterrupter};

use crate::devices::{IoBus, PioAction};

/// Why a vCPU thread stopped or what it saw last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VcpuRunState {
    /// Not started yet.
    Created,
    /// In or around `KVM_RUN`.
    Running,
    /// Halted (`KVM_EXIT_HLT`), parked until the run ends.
    Halted,
    /// The thread left its loop.
    Exited,
}

/// What the VMM knows about one vCPU, shared between its thread and the rest of the VMM.
#[derive(Debug)]
pub struct VcpuShared {
    /// The vCPU's index.
    pub index: u32,
    state: Mutex<VcpuRunState>,
    parked: Condvar,
    unpark: AtomicBool,
    /// Exits handled in userspace.
    pub exits: AtomicU64,
    /// Gets the vCPU's thread out of `KVM_RUN` (a signal handled on that thread).
    signal: Arc<pvspin::SignalInterrupter>,
    /// Registers captured when the thread stopped on a failure or a stop request.
    pub last_regs: Mutex<Option<RegsSnapshot>>,
}

/// Where a vCPU was when it stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RegsSnapshot {
    /// Instruction pointer.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Current privilege level (CS.DPL).
    pub cpl: u8,
}

impl VcpuShared {
    /// State for vCPU `index`, interrupted through `signal`.
    pub fn new(index: u32, signal: Arc<pvspin::SignalInterrupter>) -> Self {
        Self {
            index,
            state: Mutex::new(VcpuRunState::Created),
            parked: Condvar::new(),
            unpark: AtomicBool::new(false),
            exits: AtomicU64::new(0),
            signal,
            last_regs: Mutex::new(None),
        }
    }

    /// The vCPU's state now.
    pub fn state(&self) -> VcpuRunState {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_state(&self, state: VcpuRunState) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = state;
    }

    /// Forces the vCPU out of `KVM_RUN` (or out of its halt) soon.
    pub fn kick(&self) {
        self.signal.interrupt(self.index as usize);
        let _state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.unpark.store(true, Ordering::Release);
        self.parked.notify_all();
    }

    /// Parks the calling vCPU thread until kicked. Bounded: wakes at least every `poll` to let
    /// the caller re-check why it is parked.
    fn park(&self, poll: Duration) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = VcpuRunState::Halted;
        while !self.unpark.swap(false, Ordering::AcqRel) {
            let (guard, timeout) = self
                .parked
                .wait_timeout(state, poll)
                .unwrap_or_else(PoisonError::into_inner);
            state = guard;
            if timeout.timed_out() {
                break;
            }
        }
        *state = VcpuRunState::Running;
    }
}

/// The VMM's [`VcpuInterrupter`] for pvspin: pvspin's signal interrupter, plus the wake-up of
/// the VMM's own park.
#[derive(Debug)]
pub struct VcpuKicker {
    vcpus: Vec<Arc<VcpuShared>>,
}

impl VcpuKicker {
    /// Interrupts the given vCPUs by index.
    pub fn new(vcpus: Vec<Arc<VcpuShared>>) -> Self {
        Self { vcpus }
    }
}

impl VcpuInterrupter for VcpuKicker {
    fn interrupt(&self, index: usize) {
        if let Some(vcpu) = self.vcpus.get(index) {
            vcpu.kick();
        }
    }

    // Forwarded, so that `PvSpin::check` sees a handler that took pvspin's signal.
    fn signal_collision(&self) -> Option<pvspin::SignalCollision> {
        self.vcpus.first().and_then(|v| v.signal.collision())
    }
}

/// How a vCPU thread ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VcpuEnd {
    /// The guest wrote this status to the exit port.
    GuestExit(u32),
    /// Asked to stop by the VMM.
    Stopped,
    /// The guest or KVM failed.
    Fault(String),
}

/// What a vCPU thread needs to run.
#[derive(Debug)]
pub struct VcpuRunner {
    /// The vCPU.
    pub vcpu: VcpuFd,
    /// pvspin's hooks for it.
    pub hooks: VcpuHooks,
    /// Shared state.
    pub shared: Arc<VcpuShared>,
    /// Devices.
    pub bus: Arc<IoBus>,
    /// Set when the whole VM is stopping.
    pub stopping: Arc<AtomicBool>,
}

enum Step {
    Continue,
    Halt,
    /// Enter KVM's halt state (the guest's user-mode `hlt` through the halt port).
    KvmHalt,
    End(VcpuEnd),
    /// `KVM_EXIT_INTERNAL_ERROR`: described once the exit no longer borrows the vCPU.
    InternalError,
}

impl VcpuRunner {
    /// Runs the vCPU until the guest ends the run, it fails, or the VM stops. Calls `on_end`
    /// with the reason before returning the vCPU (which must outlive every kick).
    pub fn run(mut self, on_end: impl FnOnce(u32, &VcpuEnd)) -> VcpuFd {
        let index = self.shared.index;
        let thread = match self.shared.signal.attach(index as usize) {
            Ok(thread) => thread,
            Err(err) => {
                let end = VcpuEnd::Fault(format!("attaching the vCPU thread: {err}"));
                on_end(index, &end);
                self.shared.set_state(VcpuRunState::Exited);
                return self.vcpu;
            }
        };
        self.shared.set_state(VcpuRunState::Running);
        let end = loop {
            if self.stopping.load(Ordering::Acquire) {
                break VcpuEnd::Stopped;
            }
            match self.step(&thread) {
                Step::Continue => {}
                Step::Halt => {
                    // Without an in-kernel irqchip, nothing wakes a halted vCPU but the VMM;
                    // the test VM's guests halt only when done, so park until the run ends,
                    // without its run slot (others would wait for its quantum to end).
                    self.hooks.before_vmm_park();
                    self.shared.park(Duration::from_millis(100));
                }
                Step::KvmHalt => self.kvm_halt(),
                Step::End(end) => break end,
                Step::InternalError => break VcpuEnd::Fault("KVM internal error".into()),
            }
        };
        if !matches!(end, VcpuEnd::GuestExit(_)) {
            self.capture_regs();
        }
        drop(thread);
        on_end(index, &end);
        self.shared.set_state(VcpuRunState::Exited);
        self.vcpu
    }

    fn step(&mut self, thread: &pvspin::VcpuThread) -> Step {
        self.hooks.before_run();
        let mut exit = thread.run(&mut self.vcpu);
        let outcome = self.hooks.handle_exit(&mut exit);
        let step = match (outcome, exit) {
            (ExitOutcome::Handled, _) => Step::Continue,
            (ExitOutcome::NotHandled, Ok(exit)) => handle_exit(&self.shared, &self.bus, exit),
            (ExitOutcome::NotHandled, Err(err)) if err.errno() == libc::EINTR => Step::Continue,
            (ExitOutcome::NotHandled, Err(err)) if err.errno() == libc::EAGAIN => Step::Continue,
            (ExitOutcome::NotHandled, Err(err)) => {
                Step::End(VcpuEnd::Fault(format!("KVM_RUN failed: {err}")))
            }
        };
        self.hooks.after_run(&self.vcpu);
        match step {
            Step::InternalError => Step::End(VcpuEnd::Fault(self.describe_internal_error())),
            step => step,
        }
    }
}

/// The VMM's own handling of an exit pvspin did not take.
fn handle_exit(shared: &VcpuShared, bus: &IoBus, exit: VcpuExit<'_>) -> Step {
    shared.exits.fetch_add(1, Ordering::Relaxed);
    match exit {
            VcpuExit::IoOut(port, data) => match bus.write(port, data) {
                PioAction::Continue => Step::Continue,
                PioAction::Exit(status) => Step::End(VcpuEnd::GuestExit(status)),
                PioAction::Park => Step::Halt,
                PioAction::KvmHalt => Step::KvmHalt,
            },
            VcpuExit::IoIn(port, data) => {
                bus.read(port, data);
                Step::Continue
            }
            VcpuExit::Hlt => Step::Halt,
            VcpuExit::Shutdown => Step::End(VcpuEnd::Fault(
                "shutdown (triple fault: the guest took an exception it could not handle)".into(),
            )),
            VcpuExit::InternalError => Step::InternalError,
            VcpuExit::FailEntry(reason, cpu) => Step::End(VcpuEnd::Fault(format!(
                "KVM could not enter the guest (hardware entry failure reason {reason:#x} on host CPU {cpu})"
            ))),
            VcpuExit::MmioRead(addr, data) => {
                if bus.mmio_read(addr, data) {
                    Step::Continue
                } else {
                    unbacked(addr)
                }
            }
            VcpuExit::MmioWrite(addr, data) => {
                if bus.mmio_write(addr, data) {
                    Step::Continue
                } else {
                    unbacked(addr)
                }
            }
            other => Step::End(VcpuEnd::Fault(format!("unexpected exit {other:?}"))),
        }
}

fn unbacked(addr: u64) -> Step {
    Step::End(VcpuEnd::Fault(format!(
        "access to unbacked guest physical address {addr:#x}"
    )))
}

impl VcpuRunner {
    /// Puts the vCPU in KVM's halt state: the next KVM_RUN blocks inside KVM until an
    /// interrupt or a kick (`pv_unhalted`, also latched before the halt) wakes it. Without an
    /// in-kernel LAPIC there is no such state: the thread parks as for `hlt`.
    fn kvm_halt(&mut self) {
        let halted = kvm_bindings::kvm_mp_state {
            mp_state: kvm_bindings::KVM_MP_STATE_HALTED,
        };
        if self.vcpu.set_mp_state(halted).is_err() {
            self.hooks.before_vmm_park();
            self.shared.park(Duration::from_millis(100));
        }
    }

    fn describe_internal_error(&mut self) -> String {
        let run = self.vcpu.get_kvm_run();
        if run.exit_reason != KVM_EXIT_INTERNAL_ERROR {
            return "internal error".into();
        }
        // SAFETY: exit_reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the union member
        // KVM filled in.
        let internal = unsafe { run.__bindgen_anon_1.internal };
        let suberror = internal.suberror;
        let what = match suberror {
            1 => "instruction emulation failed (on emulating hosts: an instruction the emulator does not support, such as SSE)",
            2 => "simultaneous exceptions",
            3 => "unexpected event delivery",
            _ => "unknown suberror",
        };
        format!("KVM internal error, suberror {suberror}: {what}")
    }

    fn capture_regs(&self) {
        let regs = self.vcpu.get_regs();
        let sregs = self.vcpu.get_sregs();
        if let (Ok(regs), Ok(sregs)) = (regs, sregs) {
            *self
                .shared
                .last_regs
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(RegsSnapshot {
                rip: regs.rip,
                rsp: regs.rsp,
                cpl: sregs.cs.dpl,
            });
        }
    }
}
