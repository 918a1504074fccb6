//! The x86-64 guest half of pv_wait: halt with interrupts masked unless the condition changed.
//!
//! The guest's [`PvOps`] is [`HaltPvOps`] around a [`PvPlatform`] the embedding guest writes:
//! `cpu_id` (its vCPU index) and `kick` (a doorbell write naming the target vCPU, encoded as
//! `pvspin-abi` says). Not run in this crate's tests (HLT faults outside ring 0); it runs in
//! the guest program of `crates/pvspin-test-vm`.

use crate::pv::{PvOps, SpinBudget, SpinWait};
use crate::sync::{AtomicU8, Ordering};

/// What the embedding guest provides: its vCPU index and the kick doorbell.
pub trait PvPlatform: Sync {
    /// This vCPU's index, `0..N` of the [`PvDomain`](crate::PvDomain).
    fn cpu_id(&self) -> u32;

    /// Rings the kick doorbell for vCPU `cpu` (a single port or MMIO write; the host latches
    /// the kick if `cpu` is not halted yet). Must not wait for the target.
    fn kick(&self, cpu: u32);

    /// Spins before notifying the host ([`PvOps::spin_window`]); the default, `u32::MAX`,
    /// never notifies. Over pvspin's ABI: the window read from the SPIN register (an `IN`,
    /// one exit), cached, and re-read only after a notification.
    fn spin_window(&self) -> u32 {
        u32::MAX
    }

    /// Tells the host this vCPU spun past its window ([`PvOps::spin_notify`]). Over pvspin's
    /// ABI: one `OUT` of `pvspin_abi::doorbell::SpinNotify` to the SPIN register, when the
    /// host sets `SPIN_NOTIFY`. The default does nothing.
    fn spin_notify(&self, _wait: &SpinWait) {}

    /// `pv_wait` without `HLT` (pvspin's WAIT command, ABI 0.3): if this platform waits through
    /// the doorbell (always in user mode, where `HLT` faults; by choice in kernel mode), check
    /// `*ptr == val` and, if so, write WAIT with `why`, then return `true`; return `false` to
    /// have [`HaltPvOps`] halt instead. The default never uses the doorbell.
    fn doorbell_wait(&self, _ptr: &AtomicU8, _val: u8, _why: &SpinWait) -> bool {
        false
    }

    /// Whether [`doorbell_wait`](Self::doorbell_wait) is used (then it carries the spin
    /// notification, [`PvOps::wait_notifies`]).
    fn waits_through_doorbell(&self) -> bool {
        false
    }

    /// The clock of [`PvOps::now`] (`RDTSC` for budgets in TSC cycles). Default: none.
    fn now(&self) -> u64 {
        0
    }

    /// [`PvOps::spin_budget`] (from pvspin's hint page). Default: unlimited.
    fn spin_budget(&self) -> SpinBudget {
        SpinBudget::UNLIMITED
    }

    /// [`PvOps::is_not_running`] (from pvspin's hint pages). Default: never known.
    fn is_not_running(&self, _cpu: u32) -> bool {
        false
    }

    /// [`PvOps::vcpus_fit`] (pvspin's hint page `VCPUS_FIT`). Default: not known.
    fn vcpus_fit(&self) -> bool {
        false
    }

    /// [`PvOps::vcpu_is_preempted`] (a stock guest: the `preempted` byte of `cpu`'s KVM
    /// steal-time area). Default: never preempted.
    fn vcpu_is_preempted(&self, _cpu: u32) -> bool {
        false
    }

    /// Called right before this vCPU waits (halt or WAIT): e.g. publish "waiting" in its hint
    /// page. Default: nothing.
    fn before_wait(&self) {}

    /// Called right after a wait that lasted `ticks` of [`now`](Self::now): e.g. report it to
    /// the host through the hint page. Default: nothing.
    fn after_wait(&self, _ticks: u64) {}
}

/// `cli`; if `*ptr == val` then halt; restore the interrupt flag.
///
/// With interrupts enabled on entry it halts with `sti; hlt` (the STI shadow keeps an
/// interrupt from landing between them), so interrupts still wake it; with interrupts
/// disabled on entry it halts with IF=0, so only a kick (KVM's `pv_unhalted`, or the VMM's
/// latch), an NMI or an SMI ends the halt. Either way the check and the halt run with
/// interrupts masked, and a kick that arrives after the check is latched by the host, so no
/// wakeup is lost.
///
/// # Safety
///
/// Must run at CPL 0 in a guest whose host latches kicks (pvspin's kick device, or KVM's
/// `KVM_HC_KICK_CPU` / REMRD path).
pub unsafe fn halt_if_eq(ptr: &AtomicU8, val: u8) {
    let flags: u64;
    // SAFETY: reads RFLAGS through the stack; no memory the compiler knows of is touched.
    unsafe { core::arch::asm!("pushfq", "pop {}", out(reg) flags, options(preserves_flags)) };
    let interrupts_were_on = flags & (1 << 9) != 0;
    // SAFETY: the caller runs at CPL 0; CLI only masks interrupts. Not `nomem`, so the load
    // below is not moved above it.
    unsafe { core::arch::asm!("cli", options(nostack)) };
    if ptr.load(Ordering::SeqCst) == val {
        if interrupts_were_on {
            // SAFETY: CPL 0; `sti; hlt` re-enables interrupts and halts in one shadow.
            unsafe { core::arch::asm!("sti", "hlt", options(nostack)) };
        } else {
            // SAFETY: CPL 0; halts until a kick, NMI or SMI.
            unsafe { core::arch::asm!("hlt", options(nostack)) };
        }
    } else if interrupts_were_on {
        // SAFETY: CPL 0; restores the interrupt flag the caller had.
        unsafe { core::arch::asm!("sti", options(nostack)) };
    }
}

/// The guest's [`PvOps`]: [`halt_if_eq`] for `wait`, the platform for `cpu_id` and `kick`.
#[derive(Debug)]
pub struct HaltPvOps<P> {
    platform: P,
}

impl<P> HaltPvOps<P> {
    /// Wraps the guest's platform.
    ///
    /// # Safety
    ///
    /// Every `wait` through it that the platform does not take through the doorbell
    /// ([`PvPlatform::doorbell_wait`] returning `false`) runs [`halt_if_eq`]: such code must
    /// run at CPL 0 in a guest whose host latches kicks.
    pub const unsafe fn new(platform: P) -> Self {
        Self { platform }
    }

    /// The platform.
    pub fn platform(&self) -> &P {
        &self.platform
    }
}

impl<P: PvPlatform> HaltPvOps<P> {
    fn wait_with(&self, ptr: &AtomicU8, val: u8, why: Option<&SpinWait>) {
        let start = self.platform.now();
        self.platform.before_wait();
        let unknown = SpinWait {
            lock: 0,
            waiting_for: None,
            next_owner: false,
            ahead: None,
            waking: false,
            spun: 0,
        };
        if !self
            .platform
            .doorbell_wait(ptr, val, why.unwrap_or(&unknown))
        {
            // SAFETY: `HaltPvOps::new`'s contract: CPL 0 whenever the platform does not wait
            // through the doorbell, and kicks latched by the host.
            unsafe { halt_if_eq(ptr, val) };
        }
        self.platform
            .after_wait(self.platform.now().wrapping_sub(start));
    }
}

impl<P: PvPlatform> PvOps for HaltPvOps<P> {
    fn wait(&self, ptr: &AtomicU8, val: u8) {
        self.wait_with(ptr, val, None);
    }

    fn wait_for(&self, ptr: &AtomicU8, val: u8, why: &SpinWait) {
        self.wait_with(ptr, val, Some(why));
    }

    fn wait_notifies(&self) -> bool {
        self.platform.waits_through_doorbell()
    }

    fn now(&self) -> u64 {
        self.platform.now()
    }

    fn spin_budget(&self) -> SpinBudget {
        self.platform.spin_budget()
    }

    fn is_not_running(&self, cpu: u32) -> bool {
        self.platform.is_not_running(cpu)
    }

    fn vcpus_fit(&self) -> bool {
        self.platform.vcpus_fit()
    }

    fn vcpu_is_preempted(&self, cpu: u32) -> bool {
        self.platform.vcpu_is_preempted(cpu)
    }

    fn kick(&self, cpu: u32) {
        self.platform.kick(cpu);
    }

    fn cpu_id(&self) -> u32 {
        self.platform.cpu_id()
    }

    fn spin_window(&self) -> u32 {
        self.platform.spin_window()
    }

    fn spin_notify(&self, wait: &SpinWait) {
        self.platform.spin_notify(wait);
    }
}
