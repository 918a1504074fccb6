//! A minimal virtio-mmio (version 2) driver for the pvspin virtio device (`pvspin_abi::virtio`),
//! the guest side of the out-of-process backend `pvspind`.
//!
//! vCPU 0 brings the device up (features, the control queue, one tiny queue per kick and spin
//! doorbell) and registers every vCPU's hint page through the control queue; the other vCPUs
//! wait for it. After that a kick is one 32-bit MMIO write of the target's kick-queue index
//! to `QueueNotify`, which the VMM turns into an ioeventfd, so it reaches the backend without
//! a VMM exit; the backend answers on the same queue's interrupt, which the VMM routes to the
//! target as a REMRD MSI (`pv_unhalted`).

use core::sync::atomic::{fence, AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};

use pvspin_abi::virtio::{
    config, kick_queue, spin_queue, ControlRequest, CONTROL_QUEUE, DEVICE_ID, F_HINT_PAGES,
    F_SPIN_NOTIFY, F_VERSION_1, OP_REGISTER_HINT_PAGE, OP_SPIN_NOTIFY, STATUS_OK,
};
use pvspin_test_vm_proto::MAX_PV_VCPUS;

// virtio-mmio register offsets (virtio 1.x, "MMIO Device Register Layout").
const MAGIC: usize = 0x000;
const VERSION: usize = 0x004;
const DEVICE: usize = 0x008;
const DEVICE_FEATURES: usize = 0x010;
const DEVICE_FEATURES_SEL: usize = 0x014;
const DRIVER_FEATURES: usize = 0x020;
const DRIVER_FEATURES_SEL: usize = 0x024;
const QUEUE_SEL: usize = 0x030;
const QUEUE_NUM_MAX: usize = 0x034;
const QUEUE_NUM: usize = 0x038;
const QUEUE_READY: usize = 0x044;
/// `QueueNotify`: the doorbell every kick writes.
pub const QUEUE_NOTIFY: usize = 0x050;
const STATUS: usize = 0x070;
const CONFIG_GENERATION: usize = 0x0fc;
const QUEUE_DESC_LOW: usize = 0x080;
const QUEUE_DRIVER_LOW: usize = 0x090;
const QUEUE_DEVICE_LOW: usize = 0x0a0;
const CONFIG: usize = 0x100;

const MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

/// Queue size of the control queue (one request in flight: two descriptors).
const CONTROL_SIZE: usize = 2;

/// A split-ring descriptor.
#[repr(C, align(16))]
struct Desc {
    addr: AtomicU64,
    len: AtomicU32,
    flags: AtomicU16,
    next: AtomicU16,
}

/// A split ring's driver area for `N` entries.
#[repr(C, align(4))]
struct Avail<const N: usize> {
    flags: AtomicU16,
    idx: AtomicU16,
    ring: [AtomicU16; N],
    used_event: AtomicU16,
}

/// A split ring's device area for `N` entries.
#[repr(C, align(4))]
struct Used<const N: usize> {
    flags: AtomicU16,
    idx: AtomicU16,
    ring: [[AtomicU32; 2]; N],
    avail_event: AtomicU16,
}

/// One split ring of `N` entries, laid out as virtio's alignment rules ask.
#[repr(C, align(64))]
struct Ring<const N: usize> {
    desc: [Desc; N],
    avail: Avail<N>,
    used: Used<N>,
}

impl<const N: usize> Ring<N> {
    const fn new() -> Self {
        Self {
            desc: [const {
                Desc {
                    addr: AtomicU64::new(0),
                    len: AtomicU32::new(0),
                    flags: AtomicU16::new(0),
                    next: AtomicU16::new(0),
                }
            }; N],
            avail: Avail {
                flags: AtomicU16::new(0),
                idx: AtomicU16::new(0),
                ring: [const { AtomicU16::new(0) }; N],
                used_event: AtomicU16::new(0),
            },
            used: Used {
                flags: AtomicU16::new(0),
                idx: AtomicU16::new(0),
                ring: [const { [AtomicU32::new(0), AtomicU32::new(0)] }; N],
                avail_event: AtomicU16::new(0),
            },
        }
    }
}

static CONTROL_RING: Ring<CONTROL_SIZE> = Ring::new();
/// The kick and spin queues carry no buffers; virtio still wants a ring for each.
static DOORBELL_RINGS: [Ring<1>; 2 * MAX_PV_VCPUS as usize] =
    [const { Ring::new() }; 2 * MAX_PV_VCPUS as usize];

/// The control request and its status (identity-mapped: the address is the GPA).
#[repr(C, align(64))]
struct ControlBuffers {
    request: [AtomicU64; 3],
    status: AtomicU32,
}
static CONTROL_BUFFERS: ControlBuffers = ControlBuffers {
    request: [const { AtomicU64::new(0) }; 3],
    status: AtomicU32::new(u32::MAX),
};

/// Set up by vCPU 0: 0 while it works, 1 up, 2 failed.
static STATE: AtomicU32 = AtomicU32::new(0);
const STATE_UP: u32 = 1;
const STATE_FAILED: u32 = 2;

/// What the device offered and the driver took.
#[derive(Clone, Copy, Debug)]
pub struct Device {
    /// Address of `QueueNotify`.
    pub notify: u64,
    /// The device's `max_vcpus`.
    pub max_vcpus: u32,
    /// Spin notifications were negotiated.
    pub spin_notify: bool,
    /// Hint pages were negotiated.
    pub hint_pages: bool,
}

static NOTIFY: AtomicU64 = AtomicU64::new(0);
static MAX_VCPUS: AtomicU32 = AtomicU32::new(0);
static FEATURES: AtomicU32 = AtomicU32::new(0);
/// The device's register window.
static BASE: AtomicU64 = AtomicU64::new(0);
/// `ConfigGeneration` when the hint pages were last registered.
static GENERATION: AtomicU32 = AtomicU32::new(0);
/// What registrations need again after a backend restart.
static VCPUS: AtomicU32 = AtomicU32::new(0);
static TSC_KHZ: AtomicU64 = AtomicU64::new(0);
/// Held by the vCPU using the control queue (one request in flight at a time).
static CONTROL_BUSY: AtomicBool = AtomicBool::new(false);
/// The device takes spin reports on the control queue (`OP_SPIN_NOTIFY`, for vCPUs without a
/// spin queue): set at bring-up when spin notifications and hint pages were negotiated,
/// cleared when the device refuses one (a device older than the op).
static SPIN_REPORTS: AtomicBool = AtomicBool::new(false);
/// A spin report holds the control queue until answered: `REPORT_PENDING` | the used index
/// that answers it; 0 when none is in flight.
static REPORT_IN_FLIGHT: AtomicU32 = AtomicU32::new(0);
const REPORT_PENDING: u32 = 1 << 16;

fn read(base: u64, offset: usize) -> u32 {
    // SAFETY: `base` is the device's MMIO window (identity-mapped, uncached by the VMM's
    // emulation); a 32-bit volatile load of a register has no other effect on this guest.
    unsafe { ((base + offset as u64) as *const u32).read_volatile() }
}

fn write(base: u64, offset: usize, value: u32) {
    // SAFETY: as for `read`: a 32-bit volatile store to a register of the MMIO window.
    unsafe { ((base + offset as u64) as *mut u32).write_volatile(value) }
}

/// Notifies queue `queue`: one 32-bit MMIO write (an ioeventfd in the VMM).
pub fn notify(notify_addr: u64, queue: u16) {
    // SAFETY: `notify_addr` is `QueueNotify` of the device `bring_up` found.
    unsafe { (notify_addr as *mut u32).write_volatile(u32::from(queue)) }
}

/// vCPU 0: brings the device at `base` up for `vcpus` vCPUs and registers their hint pages
/// (`hint_page(i)` = GPA of vCPU i's page) with the guest TSC frequency `tsc_khz`. Other
/// vCPUs: waits until vCPU 0 is done. `None` when the device is absent or unusable.
pub fn setup(
    vcpu: u32,
    base: u64,
    vcpus: u32,
    tsc_khz: u64,
    hint_page: impl Fn(u32) -> u64,
) -> Option<Device> {
    if vcpu == 0 {
        VCPUS.store(vcpus, Ordering::Relaxed);
        TSC_KHZ.store(tsc_khz, Ordering::Relaxed);
        BASE.store(base, Ordering::Relaxed);
        GENERATION.store(read(base, CONFIG_GENERATION), Ordering::Relaxed);
        let ok = bring_up(base, vcpus) && register_pages(vcpus, tsc_khz, &hint_page);
        STATE.store(if ok { STATE_UP } else { STATE_FAILED }, Ordering::Release);
        if ok {
            // The others halt until now (below): one kick each, after the state they read.
            let (notify_addr, max_vcpus) = (
                NOTIFY.load(Ordering::Relaxed),
                MAX_VCPUS.load(Ordering::Relaxed),
            );
            for other in 1..vcpus {
                if let Some(queue) = kick_queue(max_vcpus, other) {
                    notify(notify_addr, queue);
                }
            }
        }
    }
    loop {
        match STATE.load(Ordering::Acquire) {
            STATE_UP => break,
            STATE_FAILED => return None,
            // Halted, not spinning: with hundreds of vCPUs, spinning waiters (kernel mode, which
            // some hosts emulate) would leave vCPU 0 a sliver of the host while it sets up up to
            // 256 queues and registers every page. A failed bring-up ends the run with vCPU
            // 0's status, so nobody waits for a kick that never comes.
            _ => crate::arch::halt_until_kicked(),
        }
    }
    let features = FEATURES.load(Ordering::Relaxed);
    Some(Device {
        notify: NOTIFY.load(Ordering::Relaxed),
        max_vcpus: MAX_VCPUS.load(Ordering::Relaxed),
        spin_notify: features & (1 << F_SPIN_NOTIFY) != 0,
        hint_pages: features & (1 << F_HINT_PAGES) != 0,
    })
}

fn bring_up(base: u64, vcpus: u32) -> bool {
    if read(base, MAGIC) != MAGIC_VALUE || read(base, VERSION) != 2 {
        return false;
    }
    if read(base, DEVICE) != DEVICE_ID {
        return false;
    }
    write(base, STATUS, 0);
    write(base, STATUS, STATUS_ACKNOWLEDGE);
    write(base, STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    write(base, DEVICE_FEATURES_SEL, 0);
    let low = read(base, DEVICE_FEATURES);
    write(base, DEVICE_FEATURES_SEL, 1);
    let high = read(base, DEVICE_FEATURES);
    let version_1 = 1 << (F_VERSION_1 - 32);
    if high & version_1 == 0 {
        return false;
    }
    let wanted = low & ((1 << F_SPIN_NOTIFY) | (1 << F_HINT_PAGES));
    write(base, DRIVER_FEATURES_SEL, 0);
    write(base, DRIVER_FEATURES, wanted);
    write(base, DRIVER_FEATURES_SEL, 1);
    write(base, DRIVER_FEATURES, version_1);
    let features_ok = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
    write(base, STATUS, features_ok);
    if read(base, STATUS) & STATUS_FEATURES_OK == 0 {
        return false;
    }
    let max_vcpus = read(base, CONFIG + config::MAX_VCPUS);
    if vcpus > max_vcpus || vcpus > MAX_PV_VCPUS {
        return false;
    }
    if !setup_queue(base, CONTROL_QUEUE, &CONTROL_RING) {
        return false;
    }
    for i in 0..vcpus {
        let (Some(kick), Some(ring)) = (kick_queue(max_vcpus, i), DOORBELL_RINGS.get(i as usize))
        else {
            return false;
        };
        if !setup_queue(base, kick, ring) {
            return false;
        }
        // Above 127 vCPUs only vCPUs 0..spin_queues(M) have a spin queue (the layout fits
        // vhost-user's 256 queues): the others send no spin notifications.
        if let (true, Some(spin)) = (wanted & (1 << F_SPIN_NOTIFY) != 0, spin_queue(max_vcpus, i)) {
            let Some(ring) = DOORBELL_RINGS.get((MAX_PV_VCPUS + i) as usize) else {
                return false;
            };
            if !setup_queue(base, spin, ring) {
                return false;
            }
        }
    }
    write(base, STATUS, features_ok | STATUS_DRIVER_OK);
    // A device that failed to start (its backend refused) says so with DEVICE_NEEDS_RESET.
    if read(base, STATUS) & 0x40 != 0 {
        return false;
    }
    NOTIFY.store(base + QUEUE_NOTIFY as u64, Ordering::Relaxed);
    MAX_VCPUS.store(max_vcpus, Ordering::Relaxed);
    FEATURES.store(wanted, Ordering::Relaxed);
    let both = (1 << F_SPIN_NOTIFY) | (1 << F_HINT_PAGES);
    SPIN_REPORTS.store(wanted & both == both, Ordering::Relaxed);
    true
}

fn setup_queue<const N: usize>(base: u64, queue: u16, ring: &'static Ring<N>) -> bool {
    write(base, QUEUE_SEL, u32::from(queue));
    if (read(base, QUEUE_NUM_MAX) as usize) < N || read(base, QUEUE_READY) != 0 {
        return false;
    }
    write(base, QUEUE_NUM, N as u32);
    let addresses = [
        (QUEUE_DESC_LOW, ring.desc.as_ptr() as u64),
        (QUEUE_DRIVER_LOW, &ring.avail as *const Avail<N> as u64),
        (QUEUE_DEVICE_LOW, &ring.used as *const Used<N> as u64),
    ];
    for (register, addr) in addresses {
        write(base, register, addr as u32);
        write(base, register + 4, (addr >> 32) as u32);
    }
    write(base, QUEUE_READY, 1);
    true
}

/// Sends one control request and waits (bounded) for its status.
fn control(request: ControlRequest) -> Option<u32> {
    let used_before = post(request);
    // The backend answers from another host thread; the bound keeps a dead backend from
    // hanging the boot (on emulating hosts this loop runs ~2 us per round: seconds in all).
    for _ in 0..2_000_000u32 {
        if CONTROL_RING.used.idx.load(Ordering::Acquire) != used_before {
            fence(Ordering::SeqCst);
            return Some(CONTROL_BUFFERS.status.load(Ordering::Acquire));
        }
        core::hint::spin_loop();
    }
    None
}

/// Posts one control request and notifies the queue; returns the used index before it.
fn post(request: ControlRequest) -> u16 {
    let bytes = request.to_bytes();
    for (i, word) in CONTROL_BUFFERS.request.iter().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        word.store(u64::from_le_bytes(w), Ordering::Relaxed);
    }
    CONTROL_BUFFERS.status.store(u32::MAX, Ordering::Relaxed);
    let [request_desc, status_desc] = &CONTROL_RING.desc;
    request_desc
        .addr
        .store(CONTROL_BUFFERS.request.as_ptr() as u64, Ordering::Relaxed);
    request_desc
        .len
        .store(ControlRequest::SIZE as u32, Ordering::Relaxed);
    request_desc.flags.store(DESC_F_NEXT, Ordering::Relaxed);
    request_desc.next.store(1, Ordering::Relaxed);
    status_desc
        .addr
        .store(&CONTROL_BUFFERS.status as *const AtomicU32 as u64, Ordering::Relaxed);
    status_desc.len.store(4, Ordering::Relaxed);
    status_desc.flags.store(DESC_F_WRITE, Ordering::Relaxed);
    let avail = &CONTROL_RING.avail;
    let idx = avail.idx.load(Ordering::Relaxed);
    avail.ring[usize::from(idx) % CONTROL_SIZE].store(0, Ordering::Relaxed);
    let used_before = CONTROL_RING.used.idx.load(Ordering::Acquire);
    // The device must see the descriptors and the ring entry before the new index.
    fence(Ordering::SeqCst);
    avail.idx.store(idx.wrapping_add(1), Ordering::Release);
    fence(Ordering::SeqCst);
    notify(NOTIFY.load(Ordering::Relaxed), CONTROL_QUEUE);
    used_before
}

/// Takes the control queue: free, or held only by a spin report the device has answered
/// (whose status this checks). A report is not awaited by its sender, so it keeps the queue
/// until the next user finds it answered.
fn take_control() -> bool {
    if !CONTROL_BUSY.swap(true, Ordering::Acquire) {
        return true;
    }
    let pending = REPORT_IN_FLIGHT.load(Ordering::Acquire);
    if pending == 0 || CONTROL_RING.used.idx.load(Ordering::Acquire) != pending as u16 {
        return false;
    }
    if REPORT_IN_FLIGHT
        .compare_exchange(pending, 0, Ordering::AcqRel, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    fence(Ordering::SeqCst);
    if CONTROL_BUFFERS.status.load(Ordering::Acquire) != STATUS_OK {
        // A device older than the op: no more reports.
        SPIN_REPORTS.store(false, Ordering::Relaxed);
    }
    true
}

/// Reports that `vcpu` (one without a spin queue) spins: one `OP_SPIN_NOTIFY` on the control
/// queue. Not awaited (a round trip through the backend's thread, with hundreds of vCPUs on
/// a few CPUs, would hold up a waiter that may be the lock's next owner), and skipped while
/// the queue is in use or the previous report unanswered: reports are hints. Stopped for good
/// when the device refuses the op.
pub fn report_spin(vcpu: u32) {
    if !SPIN_REPORTS.load(Ordering::Relaxed) || !take_control() {
        return;
    }
    let used_before = post(ControlRequest {
        op: OP_SPIN_NOTIFY,
        vcpu,
        gpa: 0,
        arg: 0,
    });
    // The queue stays taken until a later user finds this answered (`take_control`).
    REPORT_IN_FLIGHT.store(
        REPORT_PENDING | u32::from(used_before.wrapping_add(1)),
        Ordering::Release,
    );
}

fn register_pages(vcpus: u32, tsc_khz: u64, hint_page: &impl Fn(u32) -> u64) -> bool {
    if FEATURES.load(Ordering::Relaxed) & (1 << F_HINT_PAGES) == 0 {
        return true;
    }
    if !take_control() {
        return false;
    }
    let ok = (0..vcpus).all(|vcpu| {
        control(ControlRequest {
            op: OP_REGISTER_HINT_PAGE,
            vcpu,
            gpa: hint_page(vcpu),
            arg: tsc_khz,
        }) == Some(STATUS_OK)
    });
    CONTROL_BUSY.store(false, Ordering::Release);
    ok
}

/// Registers every hint page again if the device's `ConfigGeneration` changed since they were
/// registered (the VMM changes it when a new backend took over, which knows none of them).
/// One MMIO read (an exit to the VMM); callers use it now and then, on a slow path. Another
/// vCPU already registering makes this a no-op.
pub fn reregister_if_needed(hint_page: impl Fn(u32) -> u64) {
    let base = BASE.load(Ordering::Relaxed);
    if base == 0 {
        return;
    }
    let generation = read(base, CONFIG_GENERATION);
    if generation == GENERATION.load(Ordering::Relaxed) {
        return;
    }
    let vcpus = VCPUS.load(Ordering::Relaxed);
    if register_pages(vcpus, TSC_KHZ.load(Ordering::Relaxed), &hint_page) {
        GENERATION.store(generation, Ordering::Relaxed);
    }
}
