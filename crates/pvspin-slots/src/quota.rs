//! The VM's CPU entitlement: how many CPUs its process may use (affinity and cpu cgroup
//! quota), the default slot count. The cgroup files are read and parsed by
//! [`pvspin_hints::proc`].

/// The CPUs this process may use: the fewer of its affinity mask's CPUs and its cpu
/// cgroup's quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, rounded up),
/// at least 1: the default slot count.
#[cfg(not(loom))]
pub fn entitled_cpus() -> usize {
    use pvspin_hints::proc;

    let affinity = affinity_cpus().unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let quota = proc::own_cpu_cgroup_dir()
        .and_then(|(dir, version)| proc::read_cpu_quota(&dir, version).ok())
        .and_then(proc::CpuQuota::cpus);
    quota.map_or(affinity, |q| q.min(affinity)).max(1)
}

#[cfg(not(loom))]
fn affinity_cpus() -> Option<usize> {
    rustix::thread::sched_getaffinity(None)
        .ok()
        .map(|set| set.count() as usize)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn at_least_one_cpu_and_no_more_than_the_affinity_mask() {
        let entitled = entitled_cpus();
        assert!(entitled >= 1);
        assert!(entitled <= affinity_cpus().unwrap_or(usize::MAX));
    }
}
