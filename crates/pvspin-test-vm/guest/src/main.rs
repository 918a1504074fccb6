//! The guest program of the test VM (`pvspin-test-vm`): bare-metal x86-64, one image for every
//! workload, entered by every vCPU at `_start` in 64-bit mode (see `pvspin_test_vm_proto`).
//!
//! The lock workload is the lock-holder-preemption experiment: every vCPU takes one shared
//! lock `iterations` times, does `cs_work` units of work inside and `ncs_work` outside, and
//! increments a plain (non-atomic) counter inside. The last vCPU to finish checks the counter
//! and reports the elapsed guest TSC time.
#![no_std]
#![no_main]

mod arch;
mod console;
mod ncs_timing;
mod pingpong;
mod pv;
mod pvh;
mod result_line;
mod rt;
mod virtio;

use core::hint::black_box;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pvspin_guest::{
    BackoffTicketLock, RawSpinLock, SpinMutex, StaticPvBackoffTicketLock, StaticPvQueuedLock,
    StaticPvTicketLock, StaticStockQueuedLock, TasLock, TicketLock,
};
use pvspin_test_vm_proto::{
    status, vcpu_slot_addr, BootParams, LockKind, RunResult, VcpuSlot, Workload, BOOT_MAGIC,
    BOOT_VERSION, CPUID_QUERIES, EXIT_PORT, MAX_PV_VCPUS, PV_FLAG_CS_DEPTH, PV_FLAG_SPIN_BUDGETS,
    PV_FLAG_STOCK_GUEST, PV_FLAG_WAIT_DOORBELL, PV_KICK, PV_KICK_YIELD, PV_OFF,
};

use arch::{halt_forever, outl, rdtsc};
use console::Line;

/// vCPUs at the start barrier.
static ARRIVED: AtomicU32 = AtomicU32::new(0);
/// vCPUs that finished their share.
static FINISHED: AtomicU32 = AtomicU32::new(0);
/// TSC when the barrier opened.
static START_TSC: AtomicU64 = AtomicU64::new(0);

/// Gives each lock workload's counter (its lock and the value it guards) a cache line of its
/// own, as a lock embedded in a kernel structure usually has: placed by the linker, a 12-byte
/// PV lock and its value straddled two lines, so every hand-over moved both and the PV locks
/// looked slower than they are (issue 19, part 4), and counters of different lock kinds shared
/// a line.
#[repr(align(64))]
struct LineAligned<T>(T);

static TICKET_COUNTER: LineAligned<SpinMutex<TicketLock, u64>> = LineAligned(SpinMutex::new(0));
static TAS_COUNTER: LineAligned<SpinMutex<TasLock, u64>> = LineAligned(SpinMutex::new(0));
static PV_TICKET_COUNTER: LineAligned<SpinMutex<StaticPvTicketLock<pv::GuestPv>, u64>> =
    LineAligned(SpinMutex::new(0));
static PV_QUEUED_COUNTER: LineAligned<SpinMutex<StaticPvQueuedLock<pv::GuestPv>, u64>> =
    LineAligned(SpinMutex::new(0));
/// A stock guest's queued lock: Linux's pv qspinlock (a plain qspinlock with PV off).
static STOCK_QUEUED_COUNTER: LineAligned<SpinMutex<StaticStockQueuedLock<pv::GuestPv>, u64>> =
    LineAligned(SpinMutex::new(0));
static BACKOFF_COUNTER: LineAligned<SpinMutex<BackoffTicketLock, u64>> =
    LineAligned(SpinMutex::new(0));
/// Rounds done by every vCPU (burn and abuse workloads).
static ROUNDS: AtomicU64 = AtomicU64::new(0);
static PV_BACKOFF_COUNTER: LineAligned<SpinMutex<StaticPvBackoffTicketLock<pv::GuestPv>, u64>> =
    LineAligned(SpinMutex::new(0));

/// Entry point of every vCPU under the direct boot: `rdi` = vCPU index, `rsi` = boot
/// parameters. (PVH boot enters at `pvh_start32`, see `pvh`, and ends up in [`run`] too.)
#[no_mangle]
pub extern "C" fn _start(vcpu: u64, params: *mut BootParams) -> ! {
    run(vcpu as u32, params)
}

/// Ends the run with `code`: the exit port under the direct boot, a power-off under PVH.
pub fn exit(code: u32) -> ! {
    if pvh::PVH_BOOT.load(Ordering::Relaxed) {
        pvh::exit(code)
    }
    outl(EXIT_PORT, code);
    halt_forever()
}

/// vCPU `vcpu` runs the workload the boot parameters at `params` describe.
pub(crate) fn run(vcpu: u32, params: *mut BootParams) -> ! {
    // SAFETY: the VMM (direct boot) or the boot vCPU (PVH) put the boot parameters at this
    // address before starting any other vCPU, and nothing writes them while the guest runs
    // except `report` below (the last vCPU only).
    let boot = unsafe { params.read_volatile() };
    if boot.magic != BOOT_MAGIC || boot.version != BOOT_VERSION || vcpu >= boot.vcpus {
        exit(status::BAD_PARAMS);
    }
    match Workload::from_u32(boot.workload) {
        Some(Workload::Hello) => {
            Line::new()
                .text("hello from vCPU ")
                .num(u64::from(vcpu))
                .text(" of ")
                .num(u64::from(boot.vcpus))
                .print();
            heartbeat(vcpu);
            finish(vcpu, &boot, params, None)
        }
        Some(Workload::Lock) => {
            let lock = LockKind::from_u32(boot.lock);
            let uses_pv_domain =
                matches!(boot.pv, PV_KICK | PV_KICK_YIELD) || lock == Some(LockKind::Queued);
            prepare(vcpu, &boot, uses_pv_domain);
            let stock = boot.pv_flags & PV_FLAG_STOCK_GUEST != 0;
            match (lock, boot.pv) {
                // A stock guest: Linux has a PV version of the queued lock only, and no
                // directed yield to notify.
                (Some(LockKind::Queued), PV_OFF | PV_KICK) if stock => {
                    lock_workload(vcpu, &boot, params, &STOCK_QUEUED_COUNTER.0)
                }
                (_, PV_KICK | PV_KICK_YIELD) if stock => exit(status::BAD_PARAMS),
                (Some(LockKind::Ticket), PV_OFF) => {
                    lock_workload(vcpu, &boot, params, &TICKET_COUNTER.0)
                }
                (Some(LockKind::Tas), PV_OFF) => lock_workload(vcpu, &boot, params, &TAS_COUNTER.0),
                (Some(LockKind::Ticket), PV_KICK | PV_KICK_YIELD) => {
                    lock_workload(vcpu, &boot, params, &PV_TICKET_COUNTER.0)
                }
                (Some(LockKind::Backoff), PV_OFF) => {
                    lock_workload(vcpu, &boot, params, &BACKOFF_COUNTER.0)
                }
                (Some(LockKind::Backoff), PV_KICK | PV_KICK_YIELD) => {
                    lock_workload(vcpu, &boot, params, &PV_BACKOFF_COUNTER.0)
                }
                // With PV off the queued lock's waiters never halt: a plain MCS lock.
                (Some(LockKind::Queued), PV_OFF | PV_KICK | PV_KICK_YIELD) => {
                    lock_workload(vcpu, &boot, params, &PV_QUEUED_COUNTER.0)
                }
                _ => exit(status::BAD_PARAMS),
            }
        }
        Some(Workload::Spin) => {
            if vcpu == 0 {
                // Spins without ever reporting progress: the watchdog must catch this.
                loop {
                    core::hint::spin_loop();
                }
            }
            finish(vcpu, &boot, params, None)
        }
        Some(Workload::Fault) => {
            if vcpu == boot.vcpus - 1 {
                arch::invalid_opcode();
            }
            halt_forever()
        }
        Some(Workload::Cpuid) => {
            if vcpu == 0 {
                report_cpuid(&boot, params);
            }
            heartbeat(vcpu);
            finish(vcpu, &boot, params, None)
        }
        Some(Workload::PingPong) => {
            if boot.pv != PV_KICK {
                exit(status::BAD_PARAMS);
            }
            prepare(vcpu, &boot, true);
            start_barrier(vcpu, &boot);
            pingpong::run(vcpu, &boot, || heartbeat(vcpu));
            finish(
                vcpu,
                &boot,
                params,
                Some((&pingpong::handoffs, boot.iterations)),
            )
        }
        Some(Workload::Burn) | Some(Workload::Abuse) => {
            let abuse = boot.workload == Workload::Abuse as u32;
            prepare(vcpu, &boot, abuse);
            start_barrier(vcpu, &boot);
            for round in 0..boot.iterations {
                work(boot.cs_work);
                // vCPU 0 computes without exiting; the others keep naming it.
                if abuse && vcpu != 0 {
                    pv::abuse(vcpu, 0, round);
                }
                work(boot.ncs_work);
                ROUNDS.fetch_add(1, Ordering::Relaxed);
                heartbeat(vcpu);
            }
            let expected = u64::from(boot.vcpus) * boot.iterations;
            let total = || ROUNDS.load(Ordering::Relaxed);
            finish(vcpu, &boot, params, Some((&total, expected)))
        }
        Some(Workload::Hypercall) => {
            if vcpu == boot.vcpus - 1 {
                arch::hypercall();
                Line::new().text("hypercall returned").print();
            }
            halt_forever()
        }
        None => exit(status::BAD_PARAMS),
    }
}

/// Sets PV up when `pv` (or ends the run with the status saying why it cannot), then enters
/// user mode when the run asks for it.
fn prepare(vcpu: u32, boot: &BootParams, pv: bool) {
    if pv {
        if let Err(code) = setup_pv(vcpu, boot) {
            exit(code);
        }
    }
    // A stock kernel registers its steal-time area whenever KVM offers steal time (here, at
    // CPL 0, before any user mode): its PV lock reads other vCPUs' `preempted` bytes.
    if boot.pv_flags & PV_FLAG_STOCK_GUEST != 0 {
        pv::register_steal_time(vcpu);
    }
    if boot.user_mode != 0 {
        pv::USER_MODE.store(true, Ordering::Relaxed);
        arch::enter_user_mode();
    }
}

/// Executes the CPUID leaves the VMM asked for, prints and records what they returned.
fn report_cpuid(boot: &BootParams, params: *mut BootParams) {
    let mut seen = [[0u32; 4]; CPUID_QUERIES];
    for (leaf, out) in boot.cpuid_leaves.iter().zip(seen.iter_mut()) {
        if *leaf == 0 {
            continue;
        }
        *out = arch::cpuid(*leaf);
        let line = Line::new().text("guest: cpuid ").num(u64::from(*leaf));
        out.iter()
            .fold(line, |line, reg| line.text(" ").num(u64::from(*reg)))
            .print();
    }
    // SAFETY: only vCPU 0 writes this field, before it finishes; the VMM reads it after the
    // run ended.
    unsafe { core::ptr::addr_of_mut!((*params).result.cpuid).write_volatile(seen) };
}

/// Finds pvspin (with PV on) and applies the spin policy to the PV lock domain.
fn setup_pv(vcpu: u32, boot: &BootParams) -> Result<(), u32> {
    let pv_on = matches!(boot.pv, PV_KICK | PV_KICK_YIELD);
    // `hlt` is privileged: in user mode waiters wait with the doorbell's WAIT command.
    let wait_doorbell = boot.user_mode != 0 || boot.pv_flags & PV_FLAG_WAIT_DOORBELL != 0;
    let spin_budgets = boot.pv_flags & PV_FLAG_SPIN_BUDGETS != 0;
    let halt = pv_on;
    if pv_on && boot.pv_flags & PV_FLAG_STOCK_GUEST != 0 {
        // A stock guest: the doorbell's KICK (and WAIT in user mode, its `hlt`), nothing else.
        match pv::discover() {
            Ok(info) if info.nr_vcpus >= boot.vcpus && boot.virtio_mmio_base == 0 => {
                if boot.pv != PV_KICK || !pv::enable_stock(&info, boot.user_mode != 0) {
                    return Err(status::NO_PVSPIN);
                }
            }
            _ => return Err(status::NO_PVSPIN),
        }
    } else if pv_on && boot.virtio_mmio_base != 0 {
        // The out-of-process backend's device: time budgets only, no WAIT command (user
        // mode halts through the test VM's halt port).
        if spin_budgets
            || !pv::enable_virtio(
                vcpu,
                boot.virtio_mmio_base,
                boot.vcpus,
                boot.tsc_khz,
                wait_doorbell,
                boot.pv == PV_KICK_YIELD,
            )
        {
            return Err(status::NO_PVSPIN);
        }
    } else if pv_on {
        match pv::discover() {
            Ok(info) if info.nr_vcpus >= boot.vcpus => {
                if !pv::enable_v03(vcpu, &info, spin_budgets, wait_doorbell) {
                    return Err(status::NO_PVSPIN);
                }
                if boot.pv == PV_KICK_YIELD {
                    if info.features & pvspin_abi::cpuid::FEATURE_SPIN_NOTIFY == 0 {
                        return Err(status::NO_PVSPIN);
                    }
                    pv::enable_spin_notify(vcpu);
                }
            }
            _ => return Err(status::NO_PVSPIN),
        }
    }
    // The PV locks learn "which vCPU am I" through GS; it must agree with the boot index,
    // and with PV on, so must the initial APIC ID (the ABI's kick index rule), which the host
    // sets in each vCPU's CPUID.
    if pvspin_guest::x86::PvPlatform::cpu_id(&pv::Platform) != vcpu {
        return Err(status::BAD_PARAMS);
    }
    if pv_on && arch::cpuid(1)[1] >> 24 != vcpu {
        return Err(status::BAD_PARAMS);
    }
    if vcpu >= MAX_PV_VCPUS || !pv::configure(boot.spin_threshold, halt) {
        return Err(status::BAD_PARAMS);
    }
    Ok(())
}

/// This vCPU's progress slot, shared with the VMM's watchdog.
fn slot(vcpu: u32) -> &'static VcpuSlot {
    // SAFETY: the VMM reserves one slot per vCPU at this address (identity-mapped), and only
    // this vCPU writes its slot, through the atomics below.
    unsafe { &*(vcpu_slot_addr(vcpu) as *const VcpuSlot) }
}

fn slot_field(field: &u64) -> &AtomicU64 {
    // SAFETY: AtomicU64 has the layout of u64, and slot fields are 8-byte aligned.
    unsafe { AtomicU64::from_ptr(field as *const u64 as *mut u64) }
}

fn heartbeat(vcpu: u32) {
    slot_field(&slot(vcpu).heartbeat).fetch_add(1, Ordering::Relaxed);
}

/// Burns `units` units of work that the compiler cannot remove.
fn work(units: u64) {
    for unit in 0..units {
        black_box(unit);
    }
}

fn lock_workload<L: RawSpinLock + Sync>(
    vcpu: u32,
    boot: &BootParams,
    params: *mut BootParams,
    counter: &SpinMutex<L, u64>,
) -> ! {
    start_barrier(vcpu, boot);
    let acquisitions = slot_field(&slot(vcpu).acquisitions);
    let mark_cs = boot.pv_flags & PV_FLAG_CS_DEPTH != 0;
    for round in 0..boot.iterations {
        {
            let mut value = counter.lock();
            if mark_cs {
                pv::critical_section(vcpu, true);
            }
            // A plain read-modify-write with work in between: without mutual exclusion,
            // updates are lost and the final check fails.
            let seen = black_box(*value);
            work(boot.cs_work);
            *value = seen + 1;
            if mark_cs {
                pv::critical_section(vcpu, false);
            }
        }
        acquisitions.fetch_add(1, Ordering::Relaxed);
        heartbeat(vcpu);
        if round % ncs_timing::NCS_SAMPLE_EVERY == 0 {
            let start = rdtsc();
            work(boot.ncs_work);
            ncs_timing::record(rdtsc().wrapping_sub(start));
        } else {
            work(boot.ncs_work);
        }
    }
    let expected = u64::from(boot.vcpus) * boot.iterations;
    // Read by the last vCPU to finish, after every other one has: a value read now could
    // miss the increments of vCPUs still in their loops.
    let total = || *counter.lock();
    finish(vcpu, boot, params, Some((&total, expected)))
}

/// Starts every vCPU together (so all contend from the first acquisition) and stamps the
/// start time.
///
/// A waiting vCPU beats its heartbeat whenever another one arrives: the start is progressing,
/// and the VMM's watchdog must not stop it while hundreds of vCPUs on a few host CPUs finish
/// their emulated set-up. A vCPU that never arrives still stops the run: nobody beats once
/// arrivals stop.
fn start_barrier(vcpu: u32, boot: &BootParams) {
    let mut arrived = ARRIVED.fetch_add(1, Ordering::AcqRel) + 1;
    if arrived == boot.vcpus {
        START_TSC.store(rdtsc(), Ordering::Release);
    }
    while arrived != boot.vcpus {
        core::hint::spin_loop();
        let now = ARRIVED.load(Ordering::Acquire);
        if now != arrived {
            arrived = now;
            heartbeat(vcpu);
        }
    }
}

/// Records this vCPU's finish; the last vCPU reports and ends the run. Others halt.
/// `check`: how to read the counter the workload ended with (called by the last vCPU only,
/// once all others finished) and what it must be.
fn finish(
    vcpu: u32,
    boot: &BootParams,
    params: *mut BootParams,
    check: Option<(&dyn Fn() -> u64, u64)>,
) -> ! {
    let now = rdtsc();
    slot_field(&slot(vcpu).finish_tsc).store(now, Ordering::Relaxed);
    if FINISHED.fetch_add(1, Ordering::AcqRel) + 1 != boot.vcpus {
        halt_forever();
    }
    let mut code = status::OK;
    if let Some((read_counter, expected)) = check {
        let counter = read_counter();
        let elapsed = now.saturating_sub(START_TSC.load(Ordering::Acquire)).max(1);
        // acquisitions / (elapsed / (tsc_khz * 1000)), in integers: no floats in the guest.
        let mut pv_stats = pv::PV.total_stats();
        let (mut samples_addr, mut samples_len) = (0, 0);
        if boot.workload == Workload::PingPong as u32 {
            (pv_stats.halts, pv_stats.kicks) = pingpong::totals();
            samples_addr = pingpong::SAMPLES.as_ptr() as u64;
            samples_len = pingpong::SAMPLE_COUNT
                .load(Ordering::Relaxed)
                .min(pingpong::SAMPLES.len()) as u64;
        }
        let (ncs_median_tsc, ncs_mean_tsc, ncs_samples) = ncs_timing::summary();
        let rate = (u128::from(expected) * u128::from(boot.tsc_khz) * 1000 / u128::from(elapsed))
            .min(u128::from(u64::MAX)) as u64;
        let result = RunResult {
            counter,
            expected,
            elapsed_tsc: elapsed,
            acquisitions_per_sec: rate,
            cpuid: boot.result.cpuid,
            pv_slow_paths: pv_stats.slowpath,
            pv_halts: pv_stats.halts,
            pv_kicks: pv_stats.kicks,
            pv_spurious_wakeups: pv_stats.spurious,
            samples_addr,
            samples_len,
            pv_wait_early: pv_stats.wait_early,
            pv_preempted: pv_stats.preempted,
            pv_behind_waking: pv_stats.behind_waking,
            pv_prewakes: pv_stats.prewakes,
            ncs_median_tsc,
            ncs_mean_tsc,
            ncs_samples,
        };
        // SAFETY: only the last vCPU writes the result, after every other vCPU finished.
        unsafe { core::ptr::addr_of_mut!((*params).result).write_volatile(result) };
        Line::new()
            .text("guest: counter ")
            .num(counter)
            .text(if counter == expected { " == " } else { " != " })
            .num(expected)
            .text(", elapsed ")
            .num(elapsed)
            .text(" TSC cycles, ")
            .num(rate)
            .text(" acquisitions/s")
            .print();
        if counter != expected {
            code = status::COUNTER_MISMATCH;
        }
    }
    if pvh::PVH_BOOT.load(Ordering::Relaxed) {
        // SAFETY: as at the start of `run`; every other vCPU has finished, and this one wrote
        // the result above.
        let done = unsafe { params.read_volatile() };
        result_line::print(&done);
    }
    exit(code)
}
