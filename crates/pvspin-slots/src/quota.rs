//! The VM's CPU entitlement: how many CPUs its process may use (affinity and cpu cgroup
//! quota), the default slot count.

/// The CPUs this process may use: the fewer of its affinity mask's CPUs and its cpu
/// cgroup's quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, rounded up),
/// at least 1: the default slot count.
#[cfg(not(loom))]
pub fn entitled_cpus() -> usize {
    let affinity = affinity_cpus().unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let quota = pvspin_hints::confine::own_cpu_cgroup_dir()
        .and_then(|(dir, v1)| cgroup_quota_cpus(&dir, v1));
    quota.map_or(affinity, |q| q.min(affinity)).max(1)
}

#[cfg(not(loom))]
fn affinity_cpus() -> Option<usize> {
    rustix::thread::sched_getaffinity(None)
        .ok()
        .map(|set| set.count() as usize)
}

/// CPUs allowed by a v2 `cpu.max` text (`"max 100000"`: unlimited), rounded up.
pub fn parse_cpu_max(text: &str) -> Option<usize> {
    let mut it = text.split_whitespace();
    let quota = it.next()?;
    let period: u64 = it.next().map_or(Some(100_000), |p| p.parse().ok())?;
    if quota == "max" || period == 0 {
        return None;
    }
    let quota: u64 = quota.parse().ok()?;
    usize::try_from(quota.div_ceil(period)).ok()
}

/// CPUs allowed by v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` texts (quota -1:
/// unlimited), rounded up.
pub fn parse_cfs_quota(quota: &str, period: &str) -> Option<usize> {
    let quota: i64 = quota.trim().parse().ok()?;
    let period: u64 = period.trim().parse().ok()?;
    if quota <= 0 || period == 0 {
        return None;
    }
    usize::try_from((quota as u64).div_ceil(period)).ok()
}

/// The quota of the cpu cgroup in directory `dir`, if limited.
#[cfg(not(loom))]
fn cgroup_quota_cpus(dir: &std::path::Path, v1: bool) -> Option<usize> {
    let read = |file: &str| std::fs::read_to_string(dir.join(file)).ok();
    if v1 {
        parse_cfs_quota(&read("cpu.cfs_quota_us")?, &read("cpu.cfs_period_us")?)
    } else {
        parse_cpu_max(&read("cpu.max")?)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn quotas_parse() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000\n"), Some(2));
        assert_eq!(parse_cpu_max("100000 100000"), Some(1));
        assert_eq!(parse_cpu_max("garbage"), None);
        assert_eq!(parse_cfs_quota("-1\n", "100000\n"), None);
        assert_eq!(parse_cfs_quota("250000", "100000"), Some(3));
        assert!(entitled_cpus() >= 1);
    }
}
