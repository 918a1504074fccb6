//! Fuzzes the `/proc` and cgroup parsers (`pvspin_hints::proc`): any text gives a value or a
//! `ParseError`, never a panic, and what parses keeps its meaning when written back.
//!
//! Input: text, handed to every parser (as UTF-8, lossily); the quota parsers get it split
//! at its first newline as quota and period.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvspin_hints::proc::{
    parse_cfs_quota, parse_cpu_cgroup, parse_cpu_max, parse_schedstat, parse_stat_nice,
    parse_stat_state, parse_status_cap_eff, parse_status_switches, CpuQuota,
};

fuzz_target!(|input: &[u8]| {
    let text = String::from_utf8_lossy(input);
    if let Ok(stat) = parse_schedstat(&text) {
        let again = format!("{} {} {}\n", stat.run_ns, stat.wait_ns, stat.switches_in);
        assert_eq!(parse_schedstat(&again), Ok(stat));
    }
    let _ = parse_stat_state(&text);
    if parse_stat_nice(&text).is_ok() {
        assert!(
            parse_stat_state(&text).is_ok(),
            "a nice value without a state"
        );
    }
    let _ = parse_status_switches(&text);
    let _ = parse_status_cap_eff(&text);
    if let Ok(cgroup) = parse_cpu_cgroup(&text) {
        assert!(text.contains(cgroup.path.as_str()));
    }
    let quota = parse_cpu_max(&text);
    if let Ok(quota) = quota {
        assert_eq!(parse_cpu_max(&quota.to_string()), Ok(quota));
        if let CpuQuota::Limited { period_us, .. } = quota {
            assert!(period_us > 0 && quota.cpus().is_some_and(|cpus| cpus >= 1));
        }
    }
    let (quota, period) = text.split_once('\n').unwrap_or((&text, ""));
    if let Ok(CpuQuota::Limited {
        quota_us,
        period_us,
    }) = parse_cfs_quota(quota, period)
    {
        assert!(quota_us > 0 && period_us > 0);
    }
});
