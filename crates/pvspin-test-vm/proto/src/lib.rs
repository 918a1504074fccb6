//! The protocol between the test VM (`pvspin-test-vm`) and its guest program.
//!
//! This is the test harness's own protocol, not part of pvspin's guest ABI (that is
//! `pvspin-abi`): where the VMM puts the boot parameters, where each vCPU starts, how the guest
//! reports progress and results, and how it ends the run.
//!
//! Guest physical memory (identity-mapped in the guest, 2 MiB pages):
//!
//! | GPA | what |
//! |---|---|
//! | [`GDT_ADDR`] | GDT |
//! | [`PML4_ADDR`] .. | page tables (PML4, PDPT, one PD per GiB mapped) |
//! | [`BOOT_PARAMS_ADDR`] | [`BootParams`] |
//! | [`VCPU_SLOTS_ADDR`] | one [`VcpuSlot`] per vCPU (32 bytes each) |
//! | [`STEAL_TIME_ADDR`] | KVM steal-time areas, 64 bytes per vCPU |
//! | [`IMAGE_BASE`] | the guest ELF image |
//! | [`STACKS_ADDR`] | one [`STACK_SIZE`] stack per vCPU |
//!
//! Every vCPU enters the ELF entry point in 64-bit mode at CPL 0 with `rdi` = its index and
//! `rsi` = [`BOOT_PARAMS_ADDR`].
#![no_std]
#![deny(missing_docs)]

use core::mem::size_of;

pub mod cmdline;
pub mod firmware;
pub mod pvh;
pub mod timing;

/// GPA of the GDT.
pub const GDT_ADDR: u64 = 0x1000;
/// GPA of the PML4; the PDPT and the page directories follow it page by page.
pub const PML4_ADDR: u64 = 0x2000;
/// How much guest memory the page tables identity-map (one page directory).
pub const MAPPED_BYTES: u64 = 1 << 30;
/// GPA of [`BootParams`].
pub const BOOT_PARAMS_ADDR: u64 = 0x8000;
/// GPA of the first KVM steal-time area: 64 bytes per vCPU, for every vCPU up to
/// [`MAX_VCPUS`] (16 KiB less 64 bytes, after the vCPU slots). A guest with
/// [`PV_KICK_YIELD`] registers its area with `MSR_KVM_STEAL_TIME` when KVM offers steal time,
/// and the VMM tells pvspin where it is, so directed yield sees host preemption; a stock guest
/// ([`PV_FLAG_STOCK_GUEST`]) registers it too, and reads other vCPUs' `preempted` bytes.
pub const STEAL_TIME_ADDR: u64 = 0xb000;

/// GPA of vCPU `index`'s steal-time area (64-byte aligned).
pub const fn steal_time_addr(index: u32) -> u64 {
    STEAL_TIME_ADDR + index as u64 * 64
}
/// GPA of the first [`VcpuSlot`].
pub const VCPU_SLOTS_ADDR: u64 = BOOT_PARAMS_ADDR + 0x1000;
/// Where the guest ELF is linked.
pub const IMAGE_BASE: u64 = 0x20_0000;
/// The most the guest image may span.
pub const IMAGE_MAX_BYTES: u64 = 0x20_0000;
/// GPA of vCPU 0's stack (bottom); vCPU `i`'s is `STACKS_ADDR + i * STACK_SIZE`.
pub const STACKS_ADDR: u64 = IMAGE_BASE + IMAGE_MAX_BYTES;
/// Stack bytes per vCPU.
pub const STACK_SIZE: u64 = 0x4000;
/// The most vCPUs the protocol has slots for: pvspin's ABI limit (`pvspin_abi::MAX_VCPUS`;
/// a vCPU's index is its 8-bit xAPIC ID, and 0xFF is the broadcast ID).
pub const MAX_VCPUS: u32 = 255;

/// I/O port of the 16550 UART (COM1).
pub const SERIAL_PORT: u16 = 0x3f8;
/// I/O port the guest writes a 32-bit status to when the run is over.
pub const EXIT_PORT: u16 = 0x501;
/// I/O port a vCPU writes (any value) when it has nothing more to do but cannot `hlt`
/// (in user mode): the VMM parks it until the run ends.
pub const PARK_PORT: u16 = 0x502;
/// I/O port a vCPU in guest user mode writes (32 bits, any value) to halt as `hlt` would in
/// kernel mode: the VMM puts the vCPU in KVM's halt state, which a kick (a REMRD MSI) ends,
/// also when it arrived first. Used with the virtio pvspin device, which has no WAIT command:
/// it stands in for the guest kernel's halt that a real guest's user code would reach through
/// a system call.
pub const HALT_PORT: u16 = 0x503;

/// GPA of the virtio-mmio window of the pvspin virtio device, when the VMM presents one
/// ([`BootParams::virtio_mmio_base`]): the last 2 MiB page of the identity map, above any
/// guest RAM the test VM gives a guest.
pub const VIRTIO_MMIO_ADDR: u64 = MAPPED_BYTES - 0x20_0000;
/// Size of the virtio-mmio window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;

/// Guest memory needed for `vcpus` vCPUs: everything up to the end of the last stack.
pub const fn min_memory_bytes(vcpus: u32) -> u64 {
    STACKS_ADDR + vcpus as u64 * STACK_SIZE
}

/// [`BootParams::magic`].
pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"pvspinbt");
/// [`BootParams::version`].
pub const BOOT_VERSION: u32 = 3;

/// What the guest runs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Every vCPU prints a greeting; the last one ends the run.
    Hello = 1,
    /// The lock-contention workload (see [`BootParams`]).
    Lock = 2,
    /// vCPU 0 spins forever without progress: for watchdog tests.
    Spin = 3,
    /// The last vCPU executes `ud2` with no IDT: a triple fault.
    Fault = 4,
    /// The last vCPU executes `vmcall`: with the FIX_HYPERCALL_INSN quirk off this faults
    /// instead of looping inside KVM.
    Hypercall = 5,
    /// vCPU 0 executes CPUID for [`BootParams::cpuid_leaves`] and reports what it saw.
    Cpuid = 6,
    /// The vCPUs pass a token around a ring `iterations` times in all: each handoff is one
    /// pv_kick and one pv_wait (halt). Before each kick the holder works `cs_work` units plus
    /// a random `0..=ncs_work`, and before each wait a random `0..=ncs_work`, so kicks land
    /// both on halted vCPUs and on vCPUs about to halt. Measures kick-to-wake latency with the
    /// guest TSC. Needs PV on.
    PingPong = 7,
    /// Every vCPU computes `iterations` x (`cs_work` + `ncs_work`) units without a single exit:
    /// a guest that only uses its CPU (the co-tenant baseline of the confinement benchmark).
    Burn = 8,
    /// A hostile guest: every vCPU, `iterations` times, computes `cs_work` units; vCPU 0 does
    /// nothing else (it never exits), and every other vCPU then scribbles on its hint page
    /// (critical section, waiting for vCPU 0, huge wait reports) and sends a SPIN
    /// notification naming vCPU 0, which is running and holds nothing; through the virtio
    /// device it also kicks vCPU 0 each round. Needs PV kick+yield.
    Abuse = 9,
}

impl Workload {
    /// Decodes a workload number.
    pub const fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            1 => Self::Hello,
            2 => Self::Lock,
            3 => Self::Spin,
            4 => Self::Fault,
            5 => Self::Hypercall,
            6 => Self::Cpuid,
            7 => Self::PingPong,
            8 => Self::Burn,
            9 => Self::Abuse,
            _ => return None,
        })
    }
}

/// Which lock the lock workload takes.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockKind {
    /// `pvspin_guest::TicketLock`.
    Ticket = 1,
    /// `pvspin_guest::TasLock`.
    Tas = 2,
    /// `pvspin_guest::PvQueuedLock` (an MCS lock; with PV off its waiters never halt).
    Queued = 3,
    /// A ticket lock with proportional backoff: `pvspin_guest::BackoffTicketLock` with PV off,
    /// `pvspin_guest::PvBackoffTicketLock` with PV on.
    Backoff = 4,
}

impl LockKind {
    /// Decodes a lock number.
    pub const fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            1 => Self::Ticket,
            2 => Self::Tas,
            3 => Self::Queued,
            4 => Self::Backoff,
            _ => return None,
        })
    }
}

/// Exit statuses the guest writes to [`EXIT_PORT`].
pub mod status {
    /// The workload finished and checked its result.
    pub const OK: u32 = 0;
    /// The lock workload's counter was wrong: mutual exclusion failed.
    pub const COUNTER_MISMATCH: u32 = 1;
    /// The boot parameters were invalid.
    pub const BAD_PARAMS: u32 = 2;
    /// The guest panicked.
    pub const PANIC: u32 = 3;
    /// PV locks were asked for, but the host advertises no usable pvspin kick device.
    pub const NO_PVSPIN: u32 = 4;
    /// PVH boot: the guest took a CPU exception (its IDT reported it on the console).
    pub const EXCEPTION: u32 = 5;
    /// PVH boot: the guest could not boot (bad command line, no CPU list, too few CPUs,
    /// memory it needs not RAM, an AP that did not start); the console says which.
    pub const BOOT_FAILED: u32 = 6;
    /// `pvspin-vmm --boot pvh`: the guest powered off (or reset) without writing a status to
    /// the status register first.
    pub const NOT_REPORTED: u32 = u32::MAX;

    /// What a status means, for people.
    pub const fn meaning(status: u32) -> &'static str {
        match status {
            OK => "success",
            COUNTER_MISMATCH => "the shared counter is wrong: mutual exclusion failed",
            BAD_PARAMS => "the guest refused its boot parameters",
            PANIC => "the guest panicked",
            NO_PVSPIN => "PV locks asked for, but no usable pvspin device",
            EXCEPTION => "the guest took a CPU exception",
            BOOT_FAILED => "the guest could not boot (see its console)",
            NOT_REPORTED => "the guest powered off without reporting a status",
            _ => "unknown status",
        }
    }
}

/// [`BootParams::pv`]: plain spinning locks.
pub const PV_OFF: u32 = 0;
/// [`BootParams::pv`]: PV locks that halt past the spin threshold and are kicked at unlock.
pub const PV_KICK: u32 = 1;
/// [`BootParams::pv`]: as [`PV_KICK`], and waiters that spin past the host's spin window send
/// a spin notification (pvspin ABI SPIN command) naming the vCPU they wait for, so the host
/// can yield to it.
pub const PV_KICK_YIELD: u32 = 2;

/// [`BootParams::pv_flags`]: waiters wait with the doorbell's WAIT command, in kernel mode too
/// (user mode always does: `hlt` is privileged there).
pub const PV_FLAG_WAIT_DOORBELL: u32 = 1 << 0;
/// [`BootParams::pv_flags`]: waiters halt with `hlt` (kernel mode only).
pub const PV_FLAG_WAIT_HLT: u32 = 1 << 1;
/// [`BootParams::pv_flags`]: ABI 0.2 budgets: spin counts (`spin_threshold`, the SPIN
/// register's window) instead of the hint page's time budgets.
pub const PV_FLAG_SPIN_BUDGETS: u32 = 1 << 2;
/// [`BootParams::pv_flags`]: lock holders mark their critical sections in their hint page
/// (`CS_DEPTH`), for the host's run slots.
pub const PV_FLAG_CS_DEPTH: u32 = 1 << 3;
/// [`BootParams::pv_flags`]: the guest behaves as a stock Linux guest on KVM (`--guest
/// stock`): its PV lock is Linux's pv qspinlock (`pvspin_guest::StockQueuedLock`), it waits
/// halted in KVM (`hlt`; in user mode the doorbell's WAIT without a notification, which the
/// host turns into KVM's halt), kicks with the doorbell's KICK (the stand-in for
/// `KVM_HC_KICK_CPU`), registers its KVM steal-time area and reads its `preempted` bytes, and
/// uses nothing else of pvspin's ABI: no hint pages, spin notifications, spin windows or
/// budgets, no `CS_DEPTH`.
pub const PV_FLAG_STOCK_GUEST: u32 = 1 << 4;

/// The most vCPUs the guest's PV lock domain has per-vCPU state for (hint pages, MCS nodes,
/// spin windows, virtio rings): every vCPU the protocol has a slot for.
pub const MAX_PV_VCPUS: u32 = MAX_VCPUS;

/// Parameters the VMM writes before the vCPUs start; the guest only reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BootParams {
    /// [`BOOT_MAGIC`].
    pub magic: u64,
    /// [`BOOT_VERSION`].
    pub version: u32,
    /// A [`Workload`] number.
    pub workload: u32,
    /// A [`LockKind`] number.
    pub lock: u32,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Lock acquisitions per vCPU.
    pub iterations: u64,
    /// Work units inside the critical section.
    pub cs_work: u64,
    /// Work units between critical sections.
    pub ncs_work: u64,
    /// Guest TSC frequency in kHz, for rates.
    pub tsc_khz: u64,
    /// CPUID leaves the [`Workload::Cpuid`] workload executes (0 = unused).
    pub cpuid_leaves: [u32; CPUID_QUERIES],
    /// [`PV_OFF`], [`PV_KICK`] or [`PV_KICK_YIELD`].
    pub pv: u32,
    /// PV locks: spins before a waiter halts.
    pub spin_threshold: u32,
    /// Lock workload: 1 runs the lock loop, and everything after it, in guest user mode
    /// (CPL 3, IOPL 3 so port I/O still works); 0 in kernel mode.
    pub user_mode: u32,
    /// PV options ([`PV_FLAG_WAIT_DOORBELL`], [`PV_FLAG_WAIT_HLT`], [`PV_FLAG_SPIN_BUDGETS`],
    /// [`PV_FLAG_CS_DEPTH`], [`PV_FLAG_STOCK_GUEST`]).
    pub pv_flags: u32,
    /// GPA of the pvspin virtio device's virtio-mmio registers (0: none). When set, PV locks
    /// kick through that device (pvspin's virtio ABI, served out of process by `pvspind`)
    /// instead of the CPUID-discovered doorbell.
    pub virtio_mmio_base: u64,
    /// Results written by the guest.
    pub result: RunResult,
}

/// What the guest reports at the end of the run (in [`BootParams::result`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunResult {
    /// The shared counter at the end.
    pub counter: u64,
    /// What it should be: vCPUs × iterations.
    pub expected: u64,
    /// TSC cycles from the start barrier to the last vCPU's finish.
    pub elapsed_tsc: u64,
    /// Lock acquisitions per second of guest TSC time.
    pub acquisitions_per_sec: u64,
    /// `[eax, ebx, ecx, edx]` of each of [`BootParams::cpuid_leaves`], as vCPU 0 saw them.
    pub cpuid: [[u32; 4]; CPUID_QUERIES],
    /// PV locks, summed over vCPUs: waiters that went past the spin threshold.
    pub pv_slow_paths: u64,
    /// PV locks: halts.
    pub pv_halts: u64,
    /// PV locks: kicks sent.
    pub pv_kicks: u64,
    /// PV locks: wake-ups that found the lock not yet theirs.
    pub pv_spurious_wakeups: u64,
    /// GPA of the guest's kick-to-wake samples (`u32` TSC cycles each; ping-pong workload).
    pub samples_addr: u64,
    /// Number of samples there.
    pub samples_len: u64,
    /// Waits begun early: the stock guest's PV lock node waits that halted because the
    /// predecessor's node was not running (Linux's `pv_wait_early`); pvspin's locks' spin
    /// phases that ended before their time budget because the vCPU waited for did not run.
    pub pv_wait_early: u64,
    /// Stock guest's PV lock: queue-head spins cut short because the predecessor's vCPU was
    /// preempted (its KVM steal-time `preempted` byte).
    pub pv_preempted: u64,
    /// pvspin locks: spin phases that kept spinning behind a just-kicked next owner because
    /// the host said the VM's vCPUs fit its CPUs (`VCPUS_FIT`).
    pub pv_behind_waking: u64,
    /// pvspin locks: kicks an unlocker sent early, to halted waiters behind the new holder,
    /// because the host said the VM's vCPUs fit its CPUs (`VCPUS_FIT`); also in `pv_kicks`.
    pub pv_prewakes: u64,
    /// Lock workload: the median TSC cycles of one `ncs_work` section, over the sections the
    /// vCPUs timed (one in [`NCS_SAMPLE_EVERY`] each; [`timing`]): how fast this run's work
    /// ran, for comparing runs on a host whose speed drifts. 0 for other workloads.
    pub ncs_median_tsc: u64,
    /// Lock workload: the mean TSC cycles of the timed sections that took less than
    /// [`NCS_MEAN_CAP`] times the median (those the host did not preempt), with the run's slow
    /// and fast stretches in proportion: the run's time is made of these. 0 for other
    /// workloads.
    pub ncs_mean_tsc: u64,
    /// The sections timed for [`RunResult::ncs_median_tsc`].
    pub ncs_samples: u64,
}

/// [`RunResult::ncs_mean_tsc`] leaves out the sections that took this many medians or more.
pub const NCS_MEAN_CAP: u64 = 3;

/// The lock workload times one non-critical section in this many per vCPU
/// ([`RunResult::ncs_median_tsc`]).
pub const NCS_SAMPLE_EVERY: u64 = 16;

/// The most kick-to-wake samples the ping-pong workload keeps.
pub const MAX_SAMPLES: usize = 16384;

/// How many CPUID leaves the [`Workload::Cpuid`] workload can report.
pub const CPUID_QUERIES: usize = 4;

/// Per-vCPU progress, written by the guest and read by the VMM's watchdog.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VcpuSlot {
    /// Bumped by the guest whenever it makes progress.
    pub heartbeat: u64,
    /// Lock acquisitions done so far.
    pub acquisitions: u64,
    /// TSC when this vCPU finished its share (0 while running).
    pub finish_tsc: u64,
    /// The vCPU's index, written by the VMM; the guest reads it through GS (its per-CPU base).
    pub index: u64,
}

/// Byte offset of [`VcpuSlot::index`], for `mov gs:[offset]`.
pub const VCPU_SLOT_INDEX_OFFSET: usize = core::mem::offset_of!(VcpuSlot, index);

/// GPA of vCPU `index`'s slot.
pub const fn vcpu_slot_addr(index: u32) -> u64 {
    VCPU_SLOTS_ADDR + index as u64 * size_of::<VcpuSlot>() as u64
}

/// GPA of vCPU `index`'s initial stack pointer (16-byte aligned, minus the return-address slot
/// a `call` would have pushed, so the entry function sees the ABI's alignment).
pub const fn stack_top(index: u32) -> u64 {
    STACKS_ADDR + (index as u64 + 1) * STACK_SIZE - 8
}

// The layout regions must not overlap; checked at compile time.
const _: () = {
    assert!(PML4_ADDR + 3 * 0x1000 <= BOOT_PARAMS_ADDR);
    assert!(size_of::<BootParams>() as u64 <= VCPU_SLOTS_ADDR - BOOT_PARAMS_ADDR);
    assert!(vcpu_slot_addr(MAX_VCPUS) <= STEAL_TIME_ADDR);
    assert!(STEAL_TIME_ADDR % 64 == 0);
    assert!(steal_time_addr(MAX_PV_VCPUS) <= IMAGE_BASE);
    assert!(size_of::<VcpuSlot>() == 32);
    assert!(size_of::<BootParams>() == 96 + size_of::<RunResult>());
    assert!(VIRTIO_MMIO_ADDR + VIRTIO_MMIO_SIZE <= MAPPED_BYTES);
    assert!(size_of::<RunResult>() == 136 + 16 * CPUID_QUERIES);
    assert!(min_memory_bytes(MAX_VCPUS) <= MAPPED_BYTES);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip() {
        for w in [
            Workload::Hello,
            Workload::Lock,
            Workload::Spin,
            Workload::Fault,
            Workload::Hypercall,
            Workload::Cpuid,
            Workload::PingPong,
            Workload::Burn,
            Workload::Abuse,
        ] {
            assert_eq!(Workload::from_u32(w as u32), Some(w));
        }
        assert_eq!(Workload::from_u32(0), None);
        assert_eq!(LockKind::from_u32(2), Some(LockKind::Tas));
        assert_eq!(LockKind::from_u32(9), None);
    }

    #[test]
    fn every_vcpu_has_a_steal_time_area_of_its_own_within_one_page() {
        for i in 0..MAX_PV_VCPUS {
            let area = steal_time_addr(i);
            assert!(area >= vcpu_slot_addr(MAX_VCPUS) && area + 64 <= IMAGE_BASE);
            assert_eq!(area / 4096, (area + 63) / 4096);
        }
        assert_eq!(MAX_PV_VCPUS, 255);
    }

    #[test]
    fn stacks_are_abi_aligned_at_entry() {
        for i in 0..4 {
            assert_eq!((stack_top(i) + 8) % 16, 0);
        }
    }
}
