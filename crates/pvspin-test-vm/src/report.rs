//! What a run reports: one human line, one JSON line, and per-vCPU details.

use std::time::Duration;

use pvspin::{ExitKind, PvspinVcpuCounters};
use pvspin_test_vm_proto::{BootParams, Workload};
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::devices::IoBus;
use crate::memory::{self, VmMemory};
use crate::vcpu::{RegsSnapshot, VcpuRunState, VcpuShared};
use crate::vmm::{lock_name, workload_name};

/// One vCPU at the end of a run.
#[derive(Clone, Debug, Serialize)]
pub struct VcpuReport {
    /// Index.
    pub index: u32,
    /// State when the VM stopped.
    pub state: VcpuRunState,
    /// Exits handled by the VMM in userspace.
    pub userspace_exits: u64,
    /// `KVM_RUN` calls (pvspin's counters).
    pub runs: u64,
    /// Halt exits (pvspin's counters).
    pub hlt_exits: u64,
    /// Progress counter the guest bumps.
    pub heartbeat: u64,
    /// Lock acquisitions this vCPU made.
    pub acquisitions: u64,
    /// Registers, when the vCPU was stopped by a failure or the watchdog.
    pub regs: Option<RegsSnapshot>,
}

impl VcpuReport {
    pub(crate) fn collect(
        vcpu: &VcpuShared,
        memory: &VmMemory,
        counters: Option<&PvspinVcpuCounters>,
    ) -> Self {
        let slot = memory::read_slot(memory, vcpu.index).unwrap_or_default();
        let counters = counters.cloned().unwrap_or_default();
        Self {
            index: vcpu.index,
            state: vcpu.state(),
            userspace_exits: vcpu.exits.load(std::sync::atomic::Ordering::Relaxed),
            runs: counters.runs,
            hlt_exits: counters.exits.get(ExitKind::Hlt),
            heartbeat: slot.heartbeat,
            acquisitions: slot.acquisitions,
            regs: *vcpu
                .last_regs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        }
    }
}

impl std::fmt::Display for VcpuReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vCPU {}: {:?}, heartbeat {}, acquisitions {}, {} userspace exits",
            self.index, self.state, self.heartbeat, self.acquisitions, self.userspace_exits
        )?;
        if let Some(regs) = self.regs {
            write!(
                f,
                ", rip {:#x} rsp {:#x} cpl {}",
                regs.rip, regs.rsp, regs.cpl
            )?;
        }
        Ok(())
    }
}

/// The result of a successful run.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Workload name.
    pub workload: &'static str,
    /// Lock name.
    pub lock: &'static str,
    /// vCPUs.
    pub vcpus: u32,
    /// CPU hog threads.
    pub hogs: u32,
    /// Acquisitions per vCPU.
    pub iterations: u64,
    /// Work units inside the critical section.
    pub cs_work: u64,
    /// Work units outside.
    pub ncs_work: u64,
    /// The counter the guest found (lock workload).
    pub counter: u64,
    /// What it should be.
    pub expected: u64,
    /// Guest TSC cycles from the start barrier to the last finish.
    pub elapsed_tsc: u64,
    /// Guest TSC frequency.
    pub tsc_khz: u64,
    /// `elapsed_tsc` in seconds.
    pub guest_seconds: f64,
    /// Acquisitions per second, as the guest computed them.
    pub acquisitions_per_sec: u64,
    /// Host wall-clock time of the whole run (boot to exit).
    pub wall_seconds: f64,
    /// Guest accesses to ports no device decodes.
    pub unknown_port_accesses: u64,
    /// The guest's behaviour (`--guest`): `pvspin` (pvspin-aware) or `stock`.
    pub guest: &'static str,
    /// Whether the guest's locks were paravirtual, and how kicks travelled.
    pub pv: &'static str,
    /// PV locks (summed over vCPUs): waiters past the spin threshold.
    pub pv_slow_paths: u64,
    /// PV locks: halts.
    pub pv_halts: u64,
    /// PV locks: kicks the guest sent.
    pub pv_kicks: u64,
    /// PV locks: wake-ups that found the lock not yet theirs.
    pub pv_spurious_wakeups: u64,
    /// Waits begun early: the stock guest's pv qspinlock node waits that halted because the
    /// predecessor's node was not running (Linux's `pv_wait_early`); pvspin's locks' spin
    /// phases that ended before their time budget because the vCPU waited for did not run.
    pub pv_wait_early: u64,
    /// Stock guest's pv qspinlock: queue-head spins cut short because the predecessor's vCPU
    /// was preempted (its KVM steal-time `preempted` byte).
    pub pv_preempted: u64,
    /// pvspin guest: spin phases that kept spinning behind a just-kicked next owner because
    /// the host said the VM's vCPUs fit its CPUs (`VCPUS_FIT`, `--vm-cpus`); 0 when not said.
    pub pv_behind_waking: u64,
    /// pvspin guest: kicks sent a hand-over or two early, to halted waiters behind the new
    /// holder (`SpinConfig::prewake`), because the host said the VM's vCPUs fit its CPUs (`VCPUS_FIT`: run slots on
    /// the userspace and signal-msi paths, or `--vm-cpus`); also in `pv_kicks`.
    pub pv_prewakes: u64,
    /// Lock workload: the median TSC cycles of one `--ncs-work` section, over one section in
    /// 16 per vCPU, timed by the guest: how fast this run's work ran (the development hosts'
    /// speed switches 2x within seconds, `docs/benchmarks.md` §14.15). 0 for other workloads.
    pub ncs_median_tsc: u64,
    /// Lock workload: the mean TSC cycles of those sections that took less than 3 medians
    /// (the ones the host did not preempt), slow and fast stretches in proportion: the
    /// run's speed to divide its time by. 0 for other workloads.
    pub ncs_mean_tsc: u64,
    /// The sections timed for `ncs_median_tsc`.
    pub ncs_samples: u64,
    /// Stock guest: vCPUs whose KVM steal-time area KVM kept (version non-zero at the end),
    /// i.e. that registered it; `None` for a pvspin-aware guest.
    pub steal_time_registered: Option<u32>,
    /// Valid kicks that reached the host's kick device in userspace (pvspin's count): every
    /// kick on the signal-msi and userspace paths, only the fallbacks on the in-kernel path,
    /// whose kicks never exit. `None` without PV.
    pub host_kicks_in_userspace: Option<u64>,
    /// In-kernel path: KVM's `halt_wakeup` summed over the vCPUs (wake-ups from a halt by a
    /// kick or any other interrupt), standing in for the kicks the host cannot count there.
    /// `None` on the other paths and without KVM stats.
    pub kvm_halt_wakeups: Option<u64>,
    /// Kick-to-wake latency measured by the guest (ping-pong workload).
    pub kick_to_wake: Option<LatencySummary>,
    /// What directed yield did (`--pv kick+yield`).
    pub directed_yield: Option<YieldSummary>,
    /// What the run slots did (`--sched slots`).
    pub run_slots: Option<pvspin::telemetry::SlotTelemetry>,
    /// The vhost-user frontend's counters (`--pv-backend vhost-user:PATH`).
    pub vhost_user: Option<crate::vhost::FrontendSummary>,
    /// CPUID leaves vCPU 0 executed (`cpuid` workload): leaf and `[eax, ebx, ecx, edx]`.
    pub cpuid: Vec<(u32, [u32; 4])>,
    /// Per-vCPU details.
    pub per_vcpu: Vec<VcpuReport>,
    /// The paravirt plan pvspin applied (`--placement`), one line per stage.
    pub plan: Vec<String>,
    /// pvspin's counters merged with KVM's statistics (printed with `--stats`).
    #[serde(skip)]
    pub telemetry: Option<pvspin::VmTelemetry>,
    /// The guest's console output.
    #[serde(skip)]
    pub console: String,
}

impl RunReport {
    pub(crate) fn new(
        config: &RunConfig,
        params: &BootParams,
        tsc_khz: u64,
        wall: Duration,
        per_vcpu: Vec<VcpuReport>,
        console: String,
        bus: &IoBus,
    ) -> Self {
        let result = params.result;
        let guest_seconds = if tsc_khz == 0 {
            0.0
        } else {
            result.elapsed_tsc as f64 / (tsc_khz as f64 * 1000.0)
        };
        Self {
            workload: workload_name(config.workload),
            lock: lock_name(config.lock),
            vcpus: config.vcpus,
            hogs: config.hogs,
            iterations: config.iterations,
            cs_work: config.cs_work,
            ncs_work: config.ncs_work,
            counter: result.counter,
            expected: result.expected,
            elapsed_tsc: result.elapsed_tsc,
            tsc_khz,
            guest_seconds,
            acquisitions_per_sec: result.acquisitions_per_sec,
            wall_seconds: wall.as_secs_f64(),
            unknown_port_accesses: bus.unknown_port_accesses(),
            guest: config.guest.name(),
            pv: match (config.pv, config.kick_path) {
                (crate::config::PvMode::Off, _) => "off",
                (crate::config::PvMode::Kick, _) if config.vhost_user.is_some() => {
                    "kick/vhost-user"
                }
                (crate::config::PvMode::KickYield, _) if config.vhost_user.is_some() => {
                    "kick+yield/vhost-user"
                }
                (crate::config::PvMode::Kick, pvspin::KickPath::InKernel) => "kick/in-kernel",
                (crate::config::PvMode::Kick, pvspin::KickPath::SignalMsi) => "kick/signal-msi",
                (crate::config::PvMode::Kick, pvspin::KickPath::Userspace) => "kick/userspace",
                (crate::config::PvMode::KickYield, pvspin::KickPath::InKernel) => {
                    "kick+yield/in-kernel"
                }
                (crate::config::PvMode::KickYield, pvspin::KickPath::SignalMsi) => {
                    "kick+yield/signal-msi"
                }
                (crate::config::PvMode::KickYield, pvspin::KickPath::Userspace) => {
                    "kick+yield/userspace"
                }
            },
            pv_slow_paths: result.pv_slow_paths,
            pv_halts: result.pv_halts,
            pv_kicks: result.pv_kicks,
            pv_spurious_wakeups: result.pv_spurious_wakeups,
            pv_wait_early: result.pv_wait_early,
            pv_preempted: result.pv_preempted,
            pv_behind_waking: result.pv_behind_waking,
            pv_prewakes: result.pv_prewakes,
            ncs_median_tsc: result.ncs_median_tsc,
            ncs_mean_tsc: result.ncs_mean_tsc,
            ncs_samples: result.ncs_samples,
            steal_time_registered: None,
            host_kicks_in_userspace: None,
            kvm_halt_wakeups: None,
            kick_to_wake: None,
            directed_yield: None,
            run_slots: None,
            vhost_user: None,
            cpuid: params
                .cpuid_leaves
                .iter()
                .filter(|_| config.workload == Workload::Cpuid)
                .zip(result.cpuid.iter())
                .filter(|(leaf, _)| **leaf != 0)
                .map(|(leaf, regs)| (*leaf, *regs))
                .collect(),
            per_vcpu,
            plan: Vec::new(),
            telemetry: None,
            console,
        }
    }

    /// A report of a run of `config` that took `guest_seconds`, with nothing else in it (tests
    /// of what reads reports; feature `test-utils`).
    #[cfg(any(test, feature = "test-utils"))]
    pub fn made_up(config: &RunConfig, guest_seconds: f64) -> Self {
        let params = BootParams::default();
        let bus = IoBus::new(crate::devices::ConsoleSink::new(false));
        let tsc_khz = 1_000_000;
        let mut report = Self::new(
            config,
            &params,
            tsc_khz,
            Duration::from_secs_f64(guest_seconds),
            Vec::new(),
            String::new(),
            &bus,
        );
        report.guest_seconds = guest_seconds;
        report
    }

    /// Whether this run measured the ping-pong workload.
    pub fn is_pingpong_run(&self) -> bool {
        self.workload == workload_name(Workload::PingPong)
    }

    /// Whether this run measured the lock workload.
    pub fn is_lock_run(&self) -> bool {
        self.workload == workload_name(Workload::Lock)
    }

    /// One line for people.
    pub fn summary_line(&self) -> String {
        if self.is_pingpong_run() {
            let latency = self.kick_to_wake.as_ref().map_or_else(
                || "no kick-to-wake samples".to_string(),
                |l| {
                    format!(
                        "kick-to-wake min {:.1} us, p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, max {:.1} us ({} samples)",
                        l.min_us, l.p50_us, l.p90_us, l.p99_us, l.max_us, l.samples
                    )
                },
            );
            return format!(
                "pvspin-vmm: ping-pong (pv {}) on {} vCPUs: {} handoffs {} {}, {:.3} s guest time, {} waits, {} kicks; {} (wall {:.3} s)",
                self.pv,
                self.vcpus,
                self.counter,
                if self.counter == self.expected { "==" } else { "!=" },
                self.expected,
                self.guest_seconds,
                self.pv_halts,
                self.pv_kicks,
                latency,
                self.wall_seconds
            );
        }
        if !self.is_lock_run() {
            return format!(
                "pvspin-vmm: workload {} on {} vCPUs finished in {:.3} s",
                self.workload, self.vcpus, self.wall_seconds
            );
        }
        format!(
            "pvspin-vmm: lock {} (pv {}, {} guest) on {} vCPUs with {} hogs, {} x {} acquisitions (cs {}, ncs {}): counter {} {} {}, {:.3} s guest time, {} acquisitions/s, {} halts, {} kicks (wall {:.3} s)",
            self.lock,
            self.pv,
            self.guest,
            self.vcpus,
            self.hogs,
            self.vcpus,
            self.iterations,
            self.cs_work,
            self.ncs_work,
            self.counter,
            if self.counter == self.expected { "==" } else { "!=" },
            self.expected,
            self.guest_seconds,
            self.acquisitions_per_sec,
            self.pv_halts,
            self.pv_kicks,
            self.wall_seconds
        )
    }

    /// One JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"))
    }
}

/// Directed yield's decisions over a run.
#[derive(Clone, Debug, Serialize)]
pub struct YieldSummary {
    /// The actuator in use.
    pub actuator: String,
    /// Spin notifications handled.
    pub notifications: u64,
    /// Yields to the vCPU the guest named.
    pub yield_to_hint: u64,
    /// Yields to a vCPU the candidate scan found.
    pub yield_to_candidate: u64,
    /// Undirected yields.
    pub yield_self: u64,
    /// Target threads boosted.
    pub boosted: u64,
    /// Yields after which the spinner had been descheduled.
    pub descheduled: u64,
}

/// Percentiles of the guest's kick-to-wake samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub samples: usize,
    /// Smallest sample, in microseconds.
    pub min_us: f64,
    /// Median, in microseconds.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest sample.
    pub max_us: f64,
}

impl LatencySummary {
    /// Names of [`percentiles`](Self::percentiles), in order.
    pub const PERCENTILE_NAMES: [&'static str; 5] = ["min", "p50", "p90", "p99", "max"];

    /// min, p50, p90, p99 and max, in us.
    pub fn percentiles(&self) -> [f64; 5] {
        [
            self.min_us,
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.max_us,
        ]
    }

    /// Summarizes TSC-cycle samples; `None` without samples or a TSC frequency.
    pub fn from_cycles(mut cycles: Vec<u32>, tsc_khz: u64) -> Option<Self> {
        if cycles.is_empty() || tsc_khz == 0 {
            return None;
        }
        cycles.sort_unstable();
        let to_us = |c: u32| f64::from(c) * 1000.0 / tsc_khz as f64;
        let at = |q: f64| {
            let rank = ((cycles.len() as f64 * q).ceil() as usize).clamp(1, cycles.len());
            to_us(cycles[rank - 1])
        };
        Some(Self {
            samples: cycles.len(),
            min_us: to_us(cycles[0]),
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
            max_us: to_us(*cycles.last()?),
        })
    }

    /// Reads the samples the guest left in its memory. Untrusted: the address and count are
    /// bounds-checked against the protocol's maximum and guest memory.
    pub(crate) fn from_guest(memory: &VmMemory, params: &BootParams, tsc_khz: u64) -> Option<Self> {
        let result = params.result;
        let len = usize::try_from(result.samples_len).ok()?;
        if len == 0 || len > pvspin_test_vm_proto::MAX_SAMPLES {
            return None;
        }
        let mut bytes = vec![0u8; len * 4];
        vm_memory::Bytes::read_slice(
            memory,
            &mut bytes,
            vm_memory::GuestAddress(result.samples_addr),
        )
        .ok()?;
        let cycles = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Self::from_cycles(cycles, tsc_khz)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        // 1 kHz TSC: one cycle is 1000 us.
        let samples: Vec<u32> = (1..=100).collect();
        let summary = LatencySummary::from_cycles(samples, 1).unwrap();
        assert_eq!(summary.samples, 100);
        assert_eq!(summary.min_us, 1000.0);
        assert_eq!(summary.p50_us, 50_000.0);
        assert_eq!(summary.p90_us, 90_000.0);
        assert_eq!(summary.p99_us, 99_000.0);
        assert_eq!(summary.max_us, 100_000.0);
        assert!(LatencySummary::from_cycles(Vec::new(), 1).is_none());
        assert!(LatencySummary::from_cycles(vec![1], 0).is_none());
    }
}
