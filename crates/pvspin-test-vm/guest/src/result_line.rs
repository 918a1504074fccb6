//! Under PVH boot the guest prints the run's result itself: `pvspin-vmm run`'s JSON record
//! (`RunReport`), the same keys in the same order, after `pvspin-guest: result `. What only
//! the host knows (wall time, exits, pvspin's and KVM's counters, kick-to-wake percentiles,
//! which the host computes from the samples in guest memory) is `null`, and `hogs` is 0.

use core::sync::atomic::Ordering;

use pvspin_test_vm_proto::cmdline::{LOCKS, WORKLOADS};
use pvspin_test_vm_proto::pvh::RESULT_PREFIX;
use pvspin_test_vm_proto::{
    steal_time_addr, vcpu_slot_addr, BootParams, VcpuSlot, Workload, PV_FLAG_STOCK_GUEST, PV_KICK,
    PV_KICK_YIELD,
};

use crate::console::Stream;

fn name<T: Copy + PartialEq>(table: &[(&'static str, T)], value: Option<T>) -> &'static str {
    table
        .iter()
        .find(|(_, v)| Some(*v) == value)
        .map_or("unknown", |(n, _)| n)
}

/// Prints the JSON result line for the finished run `params` describes.
pub fn print(params: &BootParams) {
    let result = &params.result;
    let stock = params.pv_flags & PV_FLAG_STOCK_GUEST != 0;
    let mut out = Stream::new();
    out.text(RESULT_PREFIX);
    out.text("{\"workload\":\"")
        .text(name(&WORKLOADS, Workload::from_u32(params.workload)))
        .text("\",\"lock\":\"")
        .text(name(
            &LOCKS,
            pvspin_test_vm_proto::LockKind::from_u32(params.lock),
        ))
        .text("\",\"vcpus\":")
        .num(u64::from(params.vcpus))
        .text(",\"hogs\":0,\"iterations\":")
        .num(params.iterations)
        .text(",\"cs_work\":")
        .num(params.cs_work)
        .text(",\"ncs_work\":")
        .num(params.ncs_work)
        .text(",\"counter\":")
        .num(result.counter)
        .text(",\"expected\":")
        .num(result.expected)
        .text(",\"elapsed_tsc\":")
        .num(result.elapsed_tsc)
        .text(",\"tsc_khz\":")
        .num(params.tsc_khz)
        .text(",\"guest_seconds\":")
        .ratio(result.elapsed_tsc, params.tsc_khz.saturating_mul(1000))
        .text(",\"acquisitions_per_sec\":")
        .num(result.acquisitions_per_sec)
        .text(",\"wall_seconds\":null,\"unknown_port_accesses\":null,\"guest\":\"")
        .text(if stock { "stock" } else { "pvspin" })
        .text("\",\"pv\":\"");
    match params.pv {
        PV_KICK => {
            out.text("kick");
        }
        PV_KICK_YIELD => {
            out.text("kick+yield");
        }
        _ => {
            out.text("off");
        }
    }
    if let (PV_KICK | PV_KICK_YIELD, Some(path)) = (params.pv, crate::pvh::kick_path()) {
        out.text("/").text(path);
    }
    out.text("\",\"pv_slow_paths\":")
        .num(result.pv_slow_paths)
        .text(",\"pv_halts\":")
        .num(result.pv_halts)
        .text(",\"pv_kicks\":")
        .num(result.pv_kicks)
        .text(",\"pv_spurious_wakeups\":")
        .num(result.pv_spurious_wakeups)
        .text(",\"pv_wait_early\":")
        .num(result.pv_wait_early)
        .text(",\"pv_preempted\":")
        .num(result.pv_preempted)
        .text(",\"pv_behind_waking\":")
        .num(result.pv_behind_waking)
        .text(",\"pv_prewakes\":")
        .num(result.pv_prewakes)
        .text(",\"ncs_median_tsc\":")
        .num(result.ncs_median_tsc)
        .text(",\"ncs_mean_tsc\":")
        .num(result.ncs_mean_tsc)
        .text(",\"ncs_samples\":")
        .num(result.ncs_samples)
        .text(",\"steal_time_registered\":");
    if stock {
        // KVM bumps an area's version at each update: non-zero means it was registered.
        let registered = (0..params.vcpus)
            .filter(|&i| {
                // SAFETY: the steal-time areas are RAM the guest owns, identity-mapped; KVM
                // writes the version, an aligned u32 read here once.
                let version = unsafe { ((steal_time_addr(i) + 8) as *const u32).read_volatile() };
                version != 0
            })
            .count();
        out.num(registered as u64);
    } else {
        out.text("null");
    }
    out.text(
        ",\"host_kicks_in_userspace\":null,\"kvm_halt_wakeups\":null,\"kick_to_wake\":null,\
         \"directed_yield\":null,\"run_slots\":null,\"vhost_user\":null,\"cpuid\":[",
    );
    let mut first = true;
    if params.workload == Workload::Cpuid as u32 {
        for (leaf, regs) in params.cpuid_leaves.iter().zip(result.cpuid.iter()) {
            if *leaf == 0 {
                continue;
            }
            if !first {
                out.text(",");
            }
            first = false;
            out.text("[").num(u64::from(*leaf)).text(",[");
            for (i, reg) in regs.iter().enumerate() {
                if i > 0 {
                    out.text(",");
                }
                out.num(u64::from(*reg));
            }
            out.text("]]");
        }
    }
    out.text("],\"per_vcpu\":[");
    for index in 0..params.vcpus {
        // SAFETY: vCPU `index`'s progress slot, RAM the guest owns; every vCPU has finished.
        let slot = unsafe { (vcpu_slot_addr(index) as *const VcpuSlot).read_volatile() };
        if index > 0 {
            out.text(",");
        }
        out.text("{\"index\":")
            .num(u64::from(index))
            .text(",\"state\":null,\"userspace_exits\":null,\"runs\":null,\"hlt_exits\":null,\"heartbeat\":")
            .num(slot.heartbeat)
            .text(",\"acquisitions\":")
            .num(slot.acquisitions)
            .text(",\"regs\":null}");
    }
    out.text("],\"plan\":[]}\n");
    // The finished-vCPU count is the only ordering this needs: every vCPU finished first.
    core::sync::atomic::fence(Ordering::SeqCst);
}
