//! Grids of simulations, written as CSV.

use std::fmt::Write as _;

use crate::config::{SimConfig, Variant};
use crate::engine::{Sim, SimError};

/// One point of a sweep.
#[derive(Clone, Debug)]
pub struct Point {
    /// Host CPUs.
    pub host_cpus: usize,
    /// VMs.
    pub vms: usize,
    /// vCPUs per VM.
    pub vcpus: usize,
    /// The variant.
    pub variant: Variant,
    /// Each VM limited to its share of the host (`host_cpus / vms` CPUs, cgroup quota), so
    /// run slots size themselves to it.
    pub fair_share: bool,
}

/// The CSV header [`row`] writes under.
pub const HEADER: &str = "host_cpus,vms,vcpus_per_vm,total_vcpus,overcommit,vm_cpu_limit,variant,sim_ms,acquisitions,ns_per_acquisition,acq_per_vcpu_s,halts,kicks,prewakes,boosts,slot_preemptions,slot_lends,events,wall_ms";

/// Simulates `p` for `duration_ns` with `base`'s workload and seed; returns its CSV row.
pub fn row(base: &SimConfig, p: &Point, duration_ns: u64) -> Result<String, SimError> {
    let mut cfg = base.clone();
    cfg.host_cpus = p.host_cpus;
    cfg.vms = p.vms;
    cfg.vcpus = p.vcpus;
    cfg.variant = p.variant;
    cfg.iterations = None;
    cfg.duration_ns = Some(duration_ns);
    cfg.cpu_limit = p
        .fair_share
        .then(|| p.host_cpus as f64 / p.vms as f64)
        .filter(|&l| l < p.host_cpus as f64);
    let start = std::time::Instant::now();
    let r = Sim::new(cfg)?.run();
    let wall = start.elapsed().as_secs_f64() * 1e3;
    let acq = r.acquisitions();
    let total = p.vms * p.vcpus;
    let per_acq = if acq == 0 {
        f64::INFINITY
    } else {
        // Per VM: its time over its acquisitions, averaged.
        duration_ns as f64 * p.vms as f64 / acq as f64
    };
    let sum = |f: fn(&crate::engine::VmReport) -> u64| r.vms.iter().map(f).sum::<u64>();
    let slot = |f: fn(&pvspin_slots::SlotStats) -> u64| {
        r.vms
            .iter()
            .filter_map(|v| v.slots.as_ref().map(f))
            .sum::<u64>()
    };
    let mut s = String::new();
    let _ = write!(
        s,
        "{},{},{},{},{:.2},{},{},{:.1},{},{:.0},{:.0},{},{},{},{},{},{},{},{:.0}",
        p.host_cpus,
        p.vms,
        p.vcpus,
        total,
        total as f64 / p.host_cpus as f64,
        cfg_limit(p),
        p.variant,
        duration_ns as f64 / 1e6,
        acq,
        per_acq,
        acq as f64 / total as f64 / (duration_ns as f64 / 1e9),
        sum(|v| v.halts),
        sum(|v| v.kicks),
        sum(|v| v.prewakes),
        sum(|v| v.boosts),
        slot(|s| s.preemptions),
        slot(|s| s.lends),
        r.events,
        wall
    );
    Ok(s)
}

fn cfg_limit(p: &Point) -> String {
    if p.fair_share && p.vms > 1 {
        format!("{}", p.host_cpus as f64 / p.vms as f64)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_has_every_column_and_the_fair_share_limit() {
        let v: Variant = "ticket:kick/slots".parse().unwrap();
        let base = SimConfig::new(v, 1, 1);
        let p = Point {
            host_cpus: 8,
            vms: 2,
            vcpus: 8,
            variant: v,
            fair_share: true,
        };
        let row = row(&base, &p, 20_000_000).unwrap();
        let cols: Vec<&str> = row.split(',').collect();
        assert_eq!(cols.len(), HEADER.split(',').count(), "{row}");
        assert_eq!(
            &cols[..7],
            &[
                "8",
                "2",
                "8",
                "16",
                "2.00",
                "4",
                "ticket:kick/slots:in-kernel"
            ]
        );
        assert!(cols[8].parse::<u64>().unwrap() > 0, "acquisitions: {row}");
        let p = Point {
            fair_share: false,
            ..p
        };
        let row = super::row(&base, &p, 20_000_000).unwrap();
        assert_eq!(
            row.split(',').nth(5),
            Some(""),
            "no limit without a fair share"
        );
    }
}
