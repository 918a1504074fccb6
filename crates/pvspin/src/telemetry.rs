//! KVM binary-stats fds kept per VM and vCPU, merged with pvspin's counters on demand.

use std::sync::{Arc, Mutex, PoisonError};

use kvm_ioctls::{VcpuFd, VmFd};
use pvspin_kvm::stats::{Snapshot, StatsFd};
use pvspin_kvm::telemetry::{VcpuCounterCell, VcpuTelemetry, VmTelemetry};

/// A vCPU's stats fd and its values when it was configured.
#[derive(Debug)]
struct VcpuStats {
    fd: StatsFd,
    baseline: Snapshot,
}

/// Stats fds; a host without `KVM_GET_STATS_FD` simply has none (telemetry then carries
/// pvspin's counters only).
#[derive(Debug)]
pub(crate) struct StatsFds {
    vm: Mutex<Option<StatsFd>>,
    vcpus: Vec<Mutex<Option<VcpuStats>>>,
}

impl StatsFds {
    pub(crate) fn new(vcpus: usize) -> Self {
        Self {
            vm: Mutex::new(None),
            vcpus: (0..vcpus).map(|_| Mutex::new(None)).collect(),
        }
    }

    pub(crate) fn open_vm(&self, vm: &VmFd) {
        match StatsFd::for_vm(vm) {
            Ok(fd) => *self.vm.lock().unwrap_or_else(PoisonError::into_inner) = Some(fd),
            Err(err) => log::info!("no KVM VM statistics: {err}"),
        }
    }

    pub(crate) fn open_vcpu(&self, index: usize, vcpu: &VcpuFd) {
        let Some(slot) = self.vcpus.get(index) else {
            return;
        };
        match StatsFd::for_vcpu(vcpu).and_then(|fd| Ok((fd.read()?, fd))) {
            Ok((baseline, fd)) => {
                *slot.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(VcpuStats { fd, baseline });
            }
            Err(err) => log::info!("no KVM statistics for vCPU {index}: {err}"),
        }
    }

    pub(crate) fn telemetry(&self, cells: &[Arc<VcpuCounterCell>]) -> VmTelemetry {
        let kvm_vm = self
            .vm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|fd| fd.read().ok());
        let vcpus = cells
            .iter()
            .zip(&self.vcpus)
            .enumerate()
            .map(|(index, (cell, stats))| {
                let kvm = stats
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_ref()
                    .and_then(|stats| stats.fd.read().ok()?.delta(&stats.baseline).ok());
                VcpuTelemetry {
                    vcpu: u32::try_from(index).unwrap_or(u32::MAX),
                    pvspin: cell.snapshot(),
                    kvm,
                }
            })
            .collect();
        VmTelemetry { kvm_vm, vcpus }
    }
}
