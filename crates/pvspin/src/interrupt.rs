//! A ready [`VcpuInterrupter`]: a signal to the vCPU's own thread,
//! whose handler sets `immediate_exit` in that thread's `kvm_run`.
//!
//! The shape Firecracker uses: the kicking thread never touches another thread's `kvm_run`.
//! It sends a real-time signal with `pthread_kill`; the handler runs on the vCPU's thread and
//! writes `immediate_exit` through a thread-local pointer, which is set only while
//! [`VcpuThread::run`] borrows the `VcpuFd` (so it can never outlive the mapping). A signal
//! that arrives outside `KVM_RUN` is remembered in a thread-local flag, and the next
//! [`VcpuThread::run`] returns at once (`KVM_EXIT_INTR`, i.e. `Err(EINTR)`).
//!
//! Guarantee: after [`SignalInterrupter::interrupt`]`(i)` returns, the next return of vCPU
//! `i`'s [`VcpuThread::run`] happens without waiting for a guest exit (it may be the run in
//! progress, interrupted, or the next one, which returns at once).
//!
//! **The signal.** A process has one handler per signal, and the last one installed wins. The
//! default is [`default_signal`] (`SIGRTMIN + 2`), not `SIGRTMIN`: Firecracker
//! (`src/vmm/src/vstate/vcpu.rs`, `sigrtmin() + VCPU_RTSIG_OFFSET` with offset 0), Cloud
//! Hypervisor (`vmm/src/cpu.rs`, `SIGRTMIN()`) and crosvm (`src/crosvm/sys/linux/vcpu.rs`,
//! `SIGRTMIN() + 0`) all kick their own vCPU threads with `SIGRTMIN`. A VMM that uses another
//! signal for something else picks one with [`SignalInterrupter::with_signal`]. When the
//! signal already had a handler, or another handler replaces pvspin's later, pvspin logs a
//! warning and [`SignalInterrupter::collision`] says so (and `PvSpin::check` lists it): with
//! the other handler, an interrupt that arrives outside `KVM_RUN` is lost.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMAX, SIGRTMIN};

use crate::VcpuInterrupter;

/// The signal [`SignalInterrupter::new`] uses: `SIGRTMIN + 2`, which none of Firecracker,
/// Cloud Hypervisor and crosvm uses (they kick their vCPUs with `SIGRTMIN`).
pub fn default_signal() -> i32 {
    SIGRTMIN() + 2
}

/// The interrupt signal had, or got, another handler ([`SignalInterrupter::collision`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalCollision {
    /// The signal had another handler when the interrupter installed its own over it (the
    /// other user's interrupts now run pvspin's handler instead).
    HadHandler {
        /// The signal.
        signal: i32,
    },
    /// Another handler replaced the interrupter's after it was installed (pvspin's interrupts
    /// now run that handler, which does not set `immediate_exit`).
    Replaced {
        /// The signal.
        signal: i32,
    },
}

impl SignalCollision {
    /// The signal.
    pub fn signal(self) -> i32 {
        match self {
            SignalCollision::HadHandler { signal } | SignalCollision::Replaced { signal } => signal,
        }
    }
}

/// The handler installed for `signal` now (`SIG_DFL`, `SIG_IGN` or a function), if the
/// process can tell.
fn current_handler(signal: i32) -> Option<libc::sighandler_t> {
    // SAFETY: an all-zero sigaction is a valid value to be overwritten.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a null new action only queries; `old` is a valid, writable sigaction.
    let ret = unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) };
    (ret == 0).then_some(old.sa_sigaction)
}

fn is_foreign(handler: libc::sighandler_t) -> bool {
    handler != libc::SIG_DFL
        && handler != libc::SIG_IGN
        && handler != on_interrupt_signal as *const () as libc::sighandler_t
}

/// Errors from the signal interrupter.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum InterruptError {
    /// rule: the interrupt signal must be a real-time signal (SIGRTMIN..=SIGRTMAX), got {0}
    NotRealtime(i32),
    /// installing the interrupt signal's handler: {0}
    Handler(#[source] vmm_sys_util::errno::Error),
    /// vCPU index {index} is out of range: the interrupter has {vcpus} vCPUs
    VcpuIndex {
        /// The index.
        index: usize,
        /// The count.
        vcpus: usize,
    },
    /// rule: vCPU {0} already has a thread attached (one VcpuThread per vCPU at a time)
    Attached(usize),
}

thread_local! {
    /// This thread's `kvm_run.immediate_exit`, while `VcpuThread::run` borrows its `VcpuFd`.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
    /// An interrupt arrived since the last return from `KVM_RUN`.
    static PENDING: Cell<bool> = const { Cell::new(false) };
}

extern "C" fn on_interrupt_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only thread-local cells with const initialisers and no destructors: async-signal-safe.
    PENDING.with(|p| p.set(true));
    let ptr = IMMEDIATE_EXIT.with(Cell::get);
    if !ptr.is_null() {
        // SAFETY: the pointer is this thread's kvm_run.immediate_exit, set by `run` while it
        // holds `&mut VcpuFd` (the mapping is alive) and cleared before `run` returns; the
        // handler interrupts that same thread, so nothing else writes it concurrently.
        unsafe { AtomicU8::from_ptr(ptr) }.store(1, Ordering::Relaxed);
    }
}

/// Interrupts vCPU threads with a real-time signal (default [`default_signal`],
/// `SIGRTMIN + 2`; see the [module docs](self) for why not `SIGRTMIN`).
#[derive(Debug)]
pub struct SignalInterrupter {
    signal: i32,
    threads: Box<[Mutex<Option<libc::pthread_t>>]>,
    /// The signal had a handler of someone else's when this was made.
    had_handler: bool,
    /// A replacement of the handler was logged.
    replaced_logged: std::sync::atomic::AtomicBool,
}

impl SignalInterrupter {
    /// An interrupter for `vcpus` vCPUs using [`default_signal`] (`SIGRTMIN + 2`).
    pub fn new(vcpus: usize) -> Result<Arc<Self>, InterruptError> {
        Self::with_signal(vcpus, default_signal())
    }

    /// An interrupter using `signal`, a real-time signal nothing else in the process handles;
    /// installs its handler for the whole process (the handler only touches the interrupted
    /// thread's own state, so installing it twice is harmless). A handler of someone else's
    /// already on `signal` is replaced with a warning, and [`collision`](Self::collision)
    /// reports it.
    pub fn with_signal(vcpus: usize, signal: i32) -> Result<Arc<Self>, InterruptError> {
        if !(SIGRTMIN()..=SIGRTMAX()).contains(&signal) {
            return Err(InterruptError::NotRealtime(signal));
        }
        let had_handler = current_handler(signal).is_some_and(is_foreign);
        if had_handler {
            log::warn!(
                "pvspin: the interrupt signal {signal} already has a handler, which                  SignalInterrupter replaces for the whole process; the rule: the signal is                  pvspin's alone (Firecracker, Cloud Hypervisor and crosvm kick their vCPUs with                  SIGRTMIN = {}): pick another with SignalInterrupter::with_signal",
                SIGRTMIN()
            );
        }
        register_signal_handler(signal, on_interrupt_signal).map_err(InterruptError::Handler)?;
        Ok(Arc::new(Self {
            signal,
            threads: (0..vcpus).map(|_| Mutex::new(None)).collect(),
            had_handler,
            replaced_logged: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The signal.
    pub fn signal(&self) -> i32 {
        self.signal
    }

    /// Whether the signal is shared with another handler: it had one when this interrupter
    /// was made, or another handler replaced this one since (asked of the process now: one
    /// `rt_sigaction` query with a null new action, which `pvspin::seccomp` allows the
    /// `Control` thread; logged once). `PvSpin::check` and `PvSpin::telemetry` ask it.
    pub fn collision(&self) -> Option<SignalCollision> {
        let signal = self.signal;
        if current_handler(signal).is_some_and(is_foreign) {
            if !self
                .replaced_logged
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                log::warn!(
                    "pvspin: another handler replaced SignalInterrupter's on signal {signal};                      the rule: the signal is pvspin's alone (pick another with                      SignalInterrupter::with_signal): pvspin's interrupts that arrive outside                      KVM_RUN are now lost"
                );
            }
            return Some(SignalCollision::Replaced { signal });
        }
        self.had_handler
            .then_some(SignalCollision::HadHandler { signal })
    }

    /// Attaches the calling thread as vCPU `index`'s: interrupts for `index` signal it until
    /// the returned [`VcpuThread`] is dropped. Call on the vCPU's thread, which then runs the
    /// vCPU with [`VcpuThread::run`].
    pub fn attach(self: &Arc<Self>, index: usize) -> Result<VcpuThread, InterruptError> {
        let slot = self.threads.get(index).ok_or(InterruptError::VcpuIndex {
            index,
            vcpus: self.threads.len(),
        })?;
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Err(InterruptError::Attached(index));
        }
        // SAFETY: pthread_self has no preconditions.
        *slot = Some(unsafe { libc::pthread_self() });
        PENDING.with(|p| p.set(false));
        Ok(VcpuThread {
            owner: self.clone(),
            index,
            _same_thread: PhantomData,
        })
    }
}

impl VcpuInterrupter for SignalInterrupter {
    fn interrupt(&self, index: usize) {
        let Some(slot) = self.threads.get(index) else {
            return;
        };
        // Held across pthread_kill: `VcpuThread::drop` clears the slot under the same lock,
        // so the thread cannot have exited when it is signalled.
        let slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(thread) = *slot {
            // SAFETY: `thread` is a live thread of this process (see above); the handler is
            // installed, so the signal cannot kill the process.
            let ret = unsafe { libc::pthread_kill(thread, self.signal) };
            if ret != 0 {
                log::debug!("interrupting vCPU {index}: pthread_kill returned {ret}");
            }
        }
    }

    fn signal_collision(&self) -> Option<SignalCollision> {
        self.collision()
    }
}

/// A vCPU thread attached to a [`SignalInterrupter`]; stays on that thread.
#[derive(Debug)]
pub struct VcpuThread {
    owner: Arc<SignalInterrupter>,
    index: usize,
    /// `!Send`: the registration names this thread.
    _same_thread: PhantomData<*const ()>,
}

impl VcpuThread {
    /// The vCPU index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// `KVM_RUN` on `vcpu`, returning at once (`Err` with `EINTR`) when an interrupt arrived
    /// since the previous return, and early when one arrives during the run.
    pub fn run<'a>(&self, vcpu: &'a mut VcpuFd) -> Result<VcpuExit<'a>, kvm_ioctls::Error> {
        let run = vcpu.get_kvm_run();
        // Clears what an interrupt during the previous run left, before the handler can see
        // the pointer (a signal in between is caught by PENDING below).
        run.immediate_exit = 0;
        let ptr: *mut u8 = &mut run.immediate_exit;
        IMMEDIATE_EXIT.with(|p| p.set(ptr));
        if PENDING.with(Cell::get) {
            // SAFETY: `ptr` points into `vcpu`'s kvm_run, borrowed mutably for this call.
            unsafe { AtomicU8::from_ptr(ptr) }.store(1, Ordering::Relaxed);
        }
        let result = vcpu.run();
        // Whatever arrived until here is answered by this return.
        IMMEDIATE_EXIT.with(|p| p.set(std::ptr::null_mut()));
        PENDING.with(|p| p.set(false));
        result
    }
}

impl Drop for VcpuThread {
    fn drop(&mut self) {
        if let Some(slot) = self.owner.threads.get(self.index) {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        IMMEDIATE_EXIT.with(|p| p.set(std::ptr::null_mut()));
    }
}
