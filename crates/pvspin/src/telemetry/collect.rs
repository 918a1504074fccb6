//! KVM binary-stats fds kept per VM and vCPU, read when a telemetry snapshot is taken.

use std::sync::{Mutex, PoisonError};

use kvm_ioctls::{VcpuFd, VmFd};
use pvspin_kvm::stats::{Snapshot, StatsFd};

/// A vCPU's stats fd and its values when it was configured.
#[derive(Debug)]
struct VcpuStats {
    fd: StatsFd,
    baseline: Snapshot,
}

/// Stats fds; a host without `KVM_GET_STATS_FD` simply has none (telemetry then carries
/// pvspin's counters only, and no KVM stand-ins).
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

    /// KVM's VM-wide stats now, if there is a stats fd and it reads.
    pub(crate) fn vm(&self) -> Option<Snapshot> {
        self.vm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|fd| fd.read().ok())
    }

    /// vCPU `index`'s KVM stats as the change since `configure_vcpu`, if it has a stats fd.
    pub(crate) fn vcpu(&self, index: usize) -> Option<Snapshot> {
        self.vcpus
            .get(index)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|stats| stats.fd.read().ok()?.delta(&stats.baseline).ok())
    }
}
