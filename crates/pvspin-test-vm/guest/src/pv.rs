//! The guest side of pvspin's ABI: discovery through CPUID, the kick doorbell, and the PV lock
//! domain all PV locks of this guest share.

use core::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};

use pvspin_abi::cpuid::{
    find_base, CpuidRegs, PvspinInfo, FEATURE_KICK, FEATURE_SHARED_PAGE, FEATURE_WAIT,
    INFO_LEAF_OFFSET,
};
use pvspin_abi::doorbell::{
    lock_hash, spun_bucket, SpinNotify, KICK_OFFSET, SHARED_PAGE_OFFSET, SPIN_OFFSET, WAIT_OFFSET,
};
use pvspin_abi::hint;
use pvspin_abi::virtio::{kick_queue, spin_queue};
use pvspin_guest::x86::{HaltPvOps, PvPlatform};
use pvspin_guest::{pv_static, AtomicU8, PvDomain, SpinBudget, SpinConfig, SpinWait};
use pvspin_test_vm_proto::{MAX_PV_VCPUS, STACKS_ADDR, STACK_SIZE, VCPU_SLOT_INDEX_OFFSET};

use crate::arch::{cpuid, inl, outl, rdtsc, wrmsr};

/// The doorbell's first port, learned at boot (0: pvspin not found).
static DOORBELL: AtomicU16 = AtomicU16::new(0);

/// With the pvspin virtio device: its `QueueNotify` address (0: the doorbell is in use).
static VIRTIO_NOTIFY: AtomicU64 = AtomicU64::new(0);
/// With the pvspin virtio device: its `max_vcpus` (the queue layout's M).
static VIRTIO_MAX_VCPUS: AtomicU32 = AtomicU32::new(0);
/// With the pvspin virtio device: spin notifications were negotiated.
static VIRTIO_SPIN: AtomicBool = AtomicBool::new(false);
/// The port a doorbell-style wait writes: the doorbell's WAIT, or the test VM's halt
/// port with the virtio device (which has no WAIT command).
static WAIT_PORT: AtomicU16 = AtomicU16::new(0);

/// Set once the lock workload runs in user mode (`BootParams::user_mode`).
pub static USER_MODE: AtomicBool = AtomicBool::new(false);

/// Waiters use the doorbell's WAIT command instead of `hlt` (always in user mode).
static WAIT_DOORBELL: AtomicBool = AtomicBool::new(false);

/// The wait carries the spin notification in its own exit (the doorbell's WAIT; not the
/// test VM's halt port, which tells the virtio device nothing), so no separate SPIN.
static WAIT_NOTIFIES: AtomicBool = AtomicBool::new(false);

/// The time budgets of the hint pages are in use (else ABI 0.2 spin counts).
static TIME_BUDGETS: AtomicBool = AtomicBool::new(false);

/// A stock guest (`PV_FLAG_STOCK_GUEST`): its WAIT carries no notification.
static STOCK: AtomicBool = AtomicBool::new(false);

/// A WAIT value that says nothing: waiting for no known vCPU, no lock, no spins.
const NO_NOTIFICATION: u32 = SpinNotify {
    waiting_for: None,
    next_owner: false,
    spun_bucket: 0,
    lock_hash: 0,
}
.encode();

/// This guest registered its KVM steal-time areas (every vCPU does at setup when KVM offers
/// steal time), so their `preempted` bytes mean something.
static STEAL_TIME: AtomicBool = AtomicBool::new(false);

/// One vCPU's hint page (pvspin ABI 0.3): host line, guest line, reserved rest.
#[repr(C, align(4096))]
pub struct HintPage([AtomicU64; 512]);

/// The hint pages of every vCPU this guest has PV state for (identity-mapped, so a page's
/// address is its GPA).
static HINT_PAGES: [HintPage; MAX_PV_VCPUS as usize] =
    [const { HintPage([const { AtomicU64::new(0) }; 512]) }; MAX_PV_VCPUS as usize];

/// Per vCPU: the wait budget this vCPU adapts itself between host updates (the ABI's rule),
/// and the host sequence number it was last taken at.
static LOCAL_WAIT_AFTER: [AtomicU64; MAX_PV_VCPUS as usize] =
    [const { AtomicU64::new(0) }; MAX_PV_VCPUS as usize];
static LOCAL_SEQ: [AtomicU32; MAX_PV_VCPUS as usize] =
    [const { AtomicU32::new(u32::MAX) }; MAX_PV_VCPUS as usize];

impl HintPage {
    fn u64_at(&self, offset: usize) -> Option<&AtomicU64> {
        self.0.get(offset / 8)
    }

    fn u32_at(&self, offset: usize) -> Option<&AtomicU32> {
        let word = self.u64_at(offset & !7)?;
        // SAFETY: an AtomicU64 is 8 bytes, 8-aligned; its two halves are 4-aligned u32s
        // (little-endian: the field at offset % 8 == 4 is the upper half). Every access to
        // them is atomic, like the host's.
        Some(unsafe { &*(word.as_ptr().cast::<AtomicU32>().add((offset % 8) / 4)) })
    }

    fn load64(&self, offset: usize) -> u64 {
        self.u64_at(offset).map_or(0, |a| a.load(Ordering::Relaxed))
    }

    fn load32(&self, offset: usize) -> u32 {
        self.u32_at(offset).map_or(0, |a| a.load(Ordering::Relaxed))
    }

    fn store32(&self, offset: usize, value: u32) {
        if let Some(a) = self.u32_at(offset) {
            a.store(value, Ordering::Relaxed);
        }
    }
}

/// This vCPU's hint page, when pages are in use.
fn page(cpu: u32) -> Option<&'static HintPage> {
    if !TIME_BUDGETS.load(Ordering::Relaxed) {
        return None;
    }
    HINT_PAGES.get(cpu as usize)
}

/// Registers `vcpu`'s hint page (SHARED_PAGE, one exit) and waits until the host wrote its
/// layout version, so budgets are there before the first lock.
fn register_hint_page(vcpu: u32) -> bool {
    let Some(page) = HINT_PAGES.get(vcpu as usize) else {
        return false;
    };
    let pfn = hint_page_gpa(vcpu) / pvspin_abi::doorbell::SHARED_PAGE_SIZE;
    outl(
        DOORBELL.load(Ordering::Relaxed) + SHARED_PAGE_OFFSET,
        u32::try_from(pfn).unwrap_or(0),
    );
    // The OUT exited and the host handled it before this vCPU resumed.
    page.load32(hint::LAYOUT) == hint::LAYOUT_VERSION
}

/// Per vCPU: the spin window the host published, read at boot and after each notification;
/// `u32::MAX` (never notify) until [`enable_spin_notify`].
static WINDOWS: [AtomicU32; MAX_PV_VCPUS as usize] =
    [const { AtomicU32::new(u32::MAX) }; MAX_PV_VCPUS as usize];

/// Reads this vCPU's spin window from the SPIN register (one exit) and caches it.
fn refresh_window(cpu: u32) {
    let window = inl(DOORBELL.load(Ordering::Relaxed) + SPIN_OFFSET);
    if let Some(w) = WINDOWS.get(cpu as usize) {
        // All ones is what a host without SPIN answers: keep not notifying then.
        w.store(window.max(1), Ordering::Relaxed);
    }
}

/// Turns spin notifications on for `vcpu` (the host must advertise `SPIN_NOTIFY`), and
/// registers its KVM steal-time area when KVM offers steal time, so the host sees this vCPU
/// preempted.
pub fn enable_spin_notify(vcpu: u32) {
    if !TIME_BUDGETS.load(Ordering::Relaxed) {
        refresh_window(vcpu);
    }
    register_steal_time(vcpu);
}

/// KVM's CPUID signature leaf, feature leaf, steal-time feature bit and MSR.
const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
const KVM_FEATURE_STEAL_TIME: u32 = 1 << 5;
const MSR_KVM_STEAL_TIME: u32 = 0x4b56_4d03;

/// Registers `vcpu`'s KVM steal-time area when KVM offers steal time (at CPL 0); returns
/// whether it did.
pub fn register_steal_time(vcpu: u32) -> bool {
    if vcpu >= MAX_PV_VCPUS {
        return false;
    }
    let [max, ebx, ecx, edx] = cpuid(KVM_CPUID_SIGNATURE);
    let kvm = [ebx, ecx, edx] == [0x4b4d_564b, 0x564b_4d56, 0x0000_004d]; // "KVMKVMKVM\0\0\0"
    if !kvm || max < KVM_CPUID_FEATURES || cpuid(KVM_CPUID_FEATURES)[0] & KVM_FEATURE_STEAL_TIME == 0 {
        return false;
    }
    // SAFETY: CPL 0, and KVM advertises the MSR; bit 0 enables the 64-byte-aligned area.
    unsafe { wrmsr(MSR_KVM_STEAL_TIME, pvspin_test_vm_proto::steal_time_addr(vcpu) | 1) };
    STEAL_TIME.store(true, Ordering::Relaxed);
    true
}

/// Offset of `preempted` in `struct kvm_steal_time`, and its `KVM_VCPU_PREEMPTED` bit.
const STEAL_TIME_PREEMPTED: u64 = 16;
const KVM_VCPU_PREEMPTED: u8 = 1;

/// Linux's `kvm_vcpu_is_preempted(cpu)`: bit 0 of the `preempted` byte of `cpu`'s steal-time
/// area, which KVM sets when it deschedules the runnable vCPU and clears when it runs it again.
fn steal_time_preempted(cpu: u32) -> bool {
    if cpu >= MAX_PV_VCPUS || !STEAL_TIME.load(Ordering::Relaxed) {
        return false;
    }
    let addr = pvspin_test_vm_proto::steal_time_addr(cpu) + STEAL_TIME_PREEMPTED;
    // SAFETY: the steal-time areas are guest RAM, identity-mapped and user-accessible, and KVM
    // writes the byte while this vCPU reads it: an atomic byte load, like Linux's READ_ONCE.
    let byte = unsafe { AtomicU8::from_ptr(addr as *mut u8) };
    byte.load(Ordering::Relaxed) & KVM_VCPU_PREEMPTED != 0
}

/// This guest's platform for the PV locks.
pub struct Platform;

impl PvPlatform for Platform {
    fn cpu_id(&self) -> u32 {
        if USER_MODE.load(Ordering::Relaxed) {
            // In user mode GS may have been nulled by the privilege change; every vCPU runs
            // on its own stack, which names it just as well.
            let rsp: u64;
            // SAFETY: reads the stack pointer.
            unsafe { core::arch::asm!("mov {0}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags)) };
            return (rsp.saturating_sub(STACKS_ADDR) / STACK_SIZE) as u32;
        }
        let index: u32;
        // SAFETY: the VMM points each vCPU's GS base at its own progress slot, whose `index`
        // field holds the vCPU's index; a 4-byte load from there has no other effect.
        unsafe {
            core::arch::asm!(
                "mov {index:e}, dword ptr gs:[{offset}]",
                index = out(reg) index,
                offset = const VCPU_SLOT_INDEX_OFFSET,
                options(nostack, preserves_flags, readonly),
            );
        }
        index
    }

    fn kick(&self, cpu: u32) {
        let notify = VIRTIO_NOTIFY.load(Ordering::Relaxed);
        if notify != 0 {
            // The virtio ABI: notifying vCPU `cpu`'s kick queue is the kick.
            if let Some(queue) = kick_queue(VIRTIO_MAX_VCPUS.load(Ordering::Relaxed), cpu) {
                crate::virtio::notify(notify, queue);
            }
            return;
        }
        // The ABI: one 32-bit OUT of the target's index to the doorbell's KICK offset.
        outl(DOORBELL.load(Ordering::Relaxed) + KICK_OFFSET, cpu);
    }

    fn spin_window(&self) -> u32 {
        if TIME_BUDGETS.load(Ordering::Relaxed) {
            return u32::MAX;
        }
        WINDOWS
            .get(self.cpu_id() as usize)
            .map_or(u32::MAX, |w| w.load(Ordering::Relaxed))
    }

    fn now(&self) -> u64 {
        if TIME_BUDGETS.load(Ordering::Relaxed) {
            rdtsc()
        } else {
            0
        }
    }

    fn spin_budget(&self) -> SpinBudget {
        let cpu = self.cpu_id();
        let Some(page) = page(cpu) else {
            return SpinBudget::UNLIMITED;
        };
        let i = cpu as usize;
        let (Some(local), Some(seq)) = (LOCAL_WAIT_AFTER.get(i), LOCAL_SEQ.get(i)) else {
            return SpinBudget::UNLIMITED;
        };
        // The host's value wins whenever it published a new one.
        // Plain loads on the hot path; a store only when the host published anew (an atomic
        // swap here was a locked write per slow path, on a line the vCPUs share).
        let host_seq = page.load32(hint::HOST_SEQ);
        if seq.load(Ordering::Relaxed) != host_seq {
            seq.store(host_seq, Ordering::Relaxed);
            local.store(page.load64(hint::WAIT_AFTER_TSC), Ordering::Relaxed);
        }
        // A waiter that waits with WAIT notifies in that same exit: no separate SPIN.
        let notify_after = if WAIT_NOTIFIES.load(Ordering::Relaxed) {
            u64::MAX
        } else {
            page.load64(hint::SPIN_WINDOW_TSC)
        };
        SpinBudget {
            notify_after,
            wait_after: local.load(Ordering::Relaxed),
        }
    }

    fn vcpu_is_preempted(&self, cpu: u32) -> bool {
        steal_time_preempted(cpu)
    }

    fn vcpus_fit(&self) -> bool {
        page(self.cpu_id()).is_some_and(|p| p.load32(hint::HOST_FLAGS) & hint::VCPUS_FIT != 0)
    }

    fn is_not_running(&self, cpu: u32) -> bool {
        page(cpu).is_some_and(|p| {
            p.load32(hint::HOST_FLAGS) & hint::NOT_RUNNING != 0
                || p.load32(hint::SPIN_STATE) == hint::SPIN_WAITING
        })
    }

    fn before_wait(&self) {
        if let Some(p) = page(self.cpu_id()) {
            p.store32(hint::SPIN_STATE, hint::SPIN_WAITING);
        }
    }

    fn after_wait(&self, ticks: u64) {
        let cpu = self.cpu_id();
        let Some(p) = page(cpu) else {
            return;
        };
        p.store32(hint::SPIN_STATE, hint::SPIN_IDLE);
        if VIRTIO_NOTIFY.load(Ordering::Relaxed) != 0 {
            // Waits too: a guest without spin notifications (kick only), or one whose
            // notification window grew (the backend adapts it), notifies rarely or never.
            registration_check(cpu);
        }
        if let Some(a) = p.u64_at(hint::LAST_WAIT_TSC) {
            a.store(ticks.max(1), Ordering::Relaxed);
        }
        // Adapt locally too: in-kernel halts never exit, so the host may not see this report
        // for a long time.
        if let Some(local) = LOCAL_WAIT_AFTER.get(cpu as usize) {
            let next = hint::adapt_wait_after(
                local.load(Ordering::Relaxed),
                ticks,
                p.load64(hint::WAIT_AFTER_MIN_TSC),
                p.load64(hint::WAIT_AFTER_MAX_TSC),
            );
            local.store(next, Ordering::Relaxed);
        }
    }

    fn waits_through_doorbell(&self) -> bool {
        WAIT_DOORBELL.load(Ordering::Relaxed)
    }

    fn doorbell_wait(&self, ptr: &AtomicU8, val: u8, why: &SpinWait) -> bool {
        if !WAIT_DOORBELL.load(Ordering::Relaxed) {
            return false;
        }
        // The check and the WAIT need no interrupt masking: a kick after the check is
        // remembered by the host (HLT's latch), and a spurious return is allowed.
        if ptr.load(Ordering::SeqCst) == val {
            // A stock guest's WAIT is only its halt: "waiting for nobody", no notification.
            let value = if STOCK.load(Ordering::Relaxed) {
                NO_NOTIFICATION
            } else {
                encode(why)
            };
            outl(WAIT_PORT.load(Ordering::Relaxed), value);
        }
        true
    }

    fn spin_notify(&self, wait: &SpinWait) {
        let notify = VIRTIO_NOTIFY.load(Ordering::Relaxed);
        if notify != 0 {
            // The virtio ABI: what this vCPU waits for goes in its hint page, then one
            // notification of its spin queue.
            let cpu = self.cpu_id();
            let max = VIRTIO_MAX_VCPUS.load(Ordering::Relaxed);
            if let (true, Some(page)) = (VIRTIO_SPIN.load(Ordering::Relaxed), page(cpu)) {
                registration_check(cpu);
                page.store32(hint::WAITING_FOR, encode(wait));
                page.store32(hint::SPIN_STATE, hint::SPIN_SPINNING);
                match spin_queue(max, cpu) {
                    Some(queue) => crate::virtio::notify(notify, queue),
                    // Above 127 vCPUs, vCPUs without a spin queue report on the control queue.
                    None => crate::virtio::report_spin(cpu),
                }
            }
            return;
        }
        // The ABI: one 32-bit OUT of the notification to the SPIN offset; with time budgets
        // the host updated the hint page before this vCPU resumed, otherwise (0.2) one more
        // exit reads the window it adapted.
        outl(DOORBELL.load(Ordering::Relaxed) + SPIN_OFFSET, encode(wait));
        if !TIME_BUDGETS.load(Ordering::Relaxed) {
            refresh_window(self.cpu_id());
        }
    }
}

/// Marks `vcpu`'s hint page inside (`true`) or outside a critical section (`CS_DEPTH`), for
/// the host's run slots: one relaxed store on the page's guest line.
pub fn critical_section(vcpu: u32, inside: bool) {
    if let Some(p) = page(vcpu) {
        p.store32(hint::CS_DEPTH, u32::from(inside));
    }
}

/// The hostile workload's round: vCPU `vcpu` claims on its hint page to be inside a critical
/// section and waiting for `target` with a huge wait behind it, then sends a SPIN
/// notification naming `target` (which is running, not holding anything).
pub fn abuse(vcpu: u32, target: u32, round: u64) {
    let notify = SpinNotify {
        waiting_for: u16::try_from(target).ok(),
        next_owner: true,
        spun_bucket: u8::MAX,
        lock_hash: round as u16,
    };
    let virtio = VIRTIO_NOTIFY.load(Ordering::Relaxed);
    if let Some(p) = HINT_PAGES.get(vcpu as usize) {
        p.store32(hint::CS_DEPTH, 1);
        p.store32(hint::SPIN_STATE, hint::SPIN_SPINNING);
        // The virtio device reads the notification from the page; the doorbell host gets it
        // in the OUT below.
        p.store32(
            hint::WAITING_FOR,
            if virtio != 0 { notify.encode() } else { target },
        );
        if let Some(a) = p.u64_at(hint::LAST_WAIT_TSC) {
            a.store(u64::MAX - round, Ordering::Relaxed);
        }
    }
    if virtio != 0 {
        // Through the virtio device: its spin queue, and a kick of `target` on top (a guest
        // that notifies in a loop, for the daemon's pacing).
        let max = VIRTIO_MAX_VCPUS.load(Ordering::Relaxed);
        if let Some(queue) = spin_queue(max, vcpu) {
            crate::virtio::notify(virtio, queue);
        }
        if let Some(queue) = kick_queue(max, target) {
            crate::virtio::notify(virtio, queue);
        }
        return;
    }
    outl(DOORBELL.load(Ordering::Relaxed) + SPIN_OFFSET, notify.encode());
}

/// A wait as the ABI's `SpinNotify` value.
fn encode(wait: &SpinWait) -> u32 {
    SpinNotify {
        waiting_for: wait.waiting_for.and_then(|w| u16::try_from(w).ok()),
        next_owner: wait.next_owner,
        spun_bucket: spun_bucket(wait.spun),
        lock_hash: lock_hash(wait.lock as u64),
    }
    .encode()
}

/// The PV lock domain: per-vCPU wait slots, MCS nodes and counters for up to
/// [`MAX_PV_VCPUS`] vCPUs.
// SAFETY: every wait that is not a doorbell WAIT runs at CPL 0 (`setup` turns WAIT on for
// user mode), and the host's kick device latches kicks (`docs/abi.md`, "KICK: `pv_kick(cpu)`").
pub static PV: PvDomain<HaltPvOps<Platform>, { MAX_PV_VCPUS as usize }> =
    PvDomain::new(unsafe { HaltPvOps::new(Platform) }, SpinConfig::EMULATED);
pv_static!(pub GuestPv: HaltPvOps<Platform> = PV);

/// Why PV locks cannot be used.
pub enum PvUnavailable {
    /// No pvspin signature in the hypervisor CPUID range.
    NotFound,
    /// pvspin found, but an incompatible ABI or no KICK feature.
    Unusable,
}

/// Finds pvspin through CPUID (`docs/abi.md`, "Discovery (CPUID)") and remembers the doorbell.
pub fn discover() -> Result<PvspinInfo, PvUnavailable> {
    let read = |leaf: u32| {
        let [eax, ebx, ecx, edx] = cpuid(leaf);
        CpuidRegs { eax, ebx, ecx, edx }
    };
    let base = find_base(read).ok_or(PvUnavailable::NotFound)?;
    let info = PvspinInfo::from_info_leaf(read(base + INFO_LEAF_OFFSET));
    if !pvspin_abi::version_compatible(info.version) || info.features & FEATURE_KICK == 0 {
        return Err(PvUnavailable::Unusable);
    }
    DOORBELL.store(info.doorbell_port, Ordering::Relaxed);
    WAIT_PORT.store(info.doorbell_port + WAIT_OFFSET, Ordering::Relaxed);
    Ok(info)
}

/// GPA of vCPU `i`'s hint page (identity-mapped), 0 for none.
fn hint_page_gpa(i: u32) -> u64 {
    HINT_PAGES
        .get(i as usize)
        .map_or(0, |p| p as *const HintPage as u64)
}

/// Spin notifications and waits per vCPU through the virtio device, and how often one of them
/// checks whether the hint pages must be registered again.
static SLOW_PATH_EVENTS: [AtomicU32; MAX_PV_VCPUS as usize] =
    [const { AtomicU32::new(0) }; MAX_PV_VCPUS as usize];
const REGISTRATION_CHECK_EVERY: u32 = 64;

/// One slow-path event (a spin notification or a wait) of `cpu` through the virtio device: now
/// and then (an MMIO read exits) it checks whether a restarted backend has forgotten the hint
/// pages, which the device's ConfigGeneration says.
fn registration_check(cpu: u32) {
    // Only this vCPU writes its count: no locked add.
    if let Some(count) = SLOW_PATH_EVENTS.get(cpu as usize) {
        let n = count.load(Ordering::Relaxed);
        count.store(n.wrapping_add(1), Ordering::Relaxed);
        if n % REGISTRATION_CHECK_EVERY == 0 {
            crate::virtio::reregister_if_needed(hint_page_gpa);
        }
    }
}

/// Turns PV kicks on through the pvspin virtio device at `base` (vCPU 0 brings it up and
/// registers every vCPU's hint page; the others wait for it). Waiters halt with `hlt` in
/// kernel mode and with the test VM's halt port in user mode or when `wait_port` asks.
/// `spin_notify`: the run wants spin notifications (the device must offer them).
pub fn enable_virtio(
    vcpu: u32,
    base: u64,
    vcpus: u32,
    tsc_khz: u64,
    wait_port: bool,
    spin_notify: bool,
) -> bool {
    let Some(device) = crate::virtio::setup(vcpu, base, vcpus, tsc_khz, hint_page_gpa) else {
        return false;
    };
    if spin_notify && !(device.spin_notify && device.hint_pages) {
        return false;
    }
    VIRTIO_MAX_VCPUS.store(device.max_vcpus, Ordering::Relaxed);
    VIRTIO_SPIN.store(spin_notify, Ordering::Relaxed);
    VIRTIO_NOTIFY.store(device.notify, Ordering::Relaxed);
    if wait_port {
        WAIT_PORT.store(pvspin_test_vm_proto::HALT_PORT, Ordering::Relaxed);
        WAIT_DOORBELL.store(true, Ordering::Relaxed);
    }
    // Time budgets come with registered pages (the device wrote their host line).
    let registered = HINT_PAGES
        .get(vcpu as usize)
        .is_some_and(|p| p.load32(hint::LAYOUT) == hint::LAYOUT_VERSION);
    if device.hint_pages && registered {
        TIME_BUDGETS.store(true, Ordering::Relaxed);
    }
    true
}

/// Turns on the ABI 0.3 parts for `vcpu`: its hint page and time budgets (unless
/// `spin_budgets`), and WAIT instead of `hlt` (`wait_doorbell`). Fails when the host lacks
/// a feature asked for.
pub fn enable_v03(vcpu: u32, info: &PvspinInfo, spin_budgets: bool, wait_doorbell: bool) -> bool {
    if wait_doorbell {
        if info.features & FEATURE_WAIT == 0 {
            return false;
        }
        WAIT_DOORBELL.store(true, Ordering::Relaxed);
        WAIT_NOTIFIES.store(true, Ordering::Relaxed);
    }
    if !spin_budgets {
        if info.features & FEATURE_SHARED_PAGE == 0 || !register_hint_page(vcpu) {
            return false;
        }
        TIME_BUDGETS.store(true, Ordering::Relaxed);
    }
    true
}

/// Turns on what a stock guest uses of pvspin (`PV_FLAG_STOCK_GUEST`): the doorbell's KICK,
/// and in user mode (`wait_doorbell`) its WAIT as the stand-in for the kernel's `hlt`. No hint
/// page, no spin notifications. Fails when the host lacks WAIT and it is needed.
pub fn enable_stock(info: &PvspinInfo, wait_doorbell: bool) -> bool {
    if wait_doorbell {
        if info.features & FEATURE_WAIT == 0 {
            return false;
        }
        WAIT_DOORBELL.store(true, Ordering::Relaxed);
    }
    STOCK.store(true, Ordering::Relaxed);
    true
}

/// Applies the VMM's spin policy to the domain. With time budgets the iteration limit is
/// only a cap (the hint page's budgets decide).
pub fn configure(spin_threshold: u32, halt: bool) -> bool {
    let spin_threshold = if TIME_BUDGETS.load(Ordering::Relaxed) {
        SpinConfig::MAX_SPIN_THRESHOLD
    } else {
        spin_threshold
    };
    PV.configure(SpinConfig {
        spin_threshold,
        halt,
        prewake: SpinConfig::DEFAULT_PREWAKE,
    })
    .is_ok()
}
