//! `pvspin-vmm bench`: the overcommit experiment, several runs per case, mean and standard
//! deviation, in the shape of the original PV-spinlock tables.

use std::fmt;

use crate::cli::VmArgs;
use crate::vmm::{self, RunError};

/// What to compare.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// One case per hog count.
    pub hogs: Vec<u32>,
    /// Runs per case.
    pub runs: u32,
}

/// One case's results.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Hog threads.
    pub hogs: u32,
    /// Guest seconds of each run.
    pub seconds: Vec<f64>,
}

impl CaseResult {
    /// Mean of the runs.
    pub fn mean(&self) -> f64 {
        self.seconds.iter().sum::<f64>() / self.seconds.len().max(1) as f64
    }

    /// Sample standard deviation of the runs.
    pub fn sd(&self) -> f64 {
        if self.seconds.len() < 2 {
            return 0.0;
        }
        let mean = self.mean();
        let var = self.seconds.iter().map(|s| (s - mean).powi(2)).sum::<f64>()
            / (self.seconds.len() - 1) as f64;
        var.sqrt()
    }
}

/// The finished table.
#[derive(Clone, Debug)]
pub struct BenchTable {
    /// What ran.
    pub title: String,
    /// vCPUs per VM.
    pub vcpus: u32,
    /// Host CPUs.
    pub host_cpus: usize,
    /// Per case.
    pub cases: Vec<CaseResult>,
}

impl fmt::Display for BenchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.title)?;
        writeln!(f, "guest seconds, less is better; mean (sd)")?;
        for case in &self.cases {
            let load = f64::from(self.vcpus + case.hogs) / self.host_cpus.max(1) as f64;
            writeln!(
                f,
                "case {load:.0}x ({} hogs):\t{:.4} ({:.4})\truns: {}",
                case.hogs,
                case.mean(),
                case.sd(),
                case.seconds
                    .iter()
                    .map(|s| format!("{s:.4}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )?;
        }
        Ok(())
    }
}

/// Runs every case `runs` times, interleaved, printing each run's JSON line as it finishes.
pub fn run(vm: &VmArgs, options: &BenchOptions) -> Result<BenchTable, RunError> {
    let mut cases: Vec<CaseResult> = options
        .hogs
        .iter()
        .map(|&hogs| CaseResult {
            hogs,
            seconds: Vec::new(),
        })
        .collect();
    let mut quiet = vm.clone();
    quiet.quiet = true;
    for _ in 0..options.runs {
        for case in &mut cases {
            let report = vmm::run(&quiet.config(case.hogs))?;
            crate::cli::print_stdout(&report.to_json());
            case.seconds.push(report.guest_seconds);
        }
    }
    let config = vm.config(0);
    Ok(BenchTable {
        title: format!(
            "lock {} on {} vCPUs, {} acquisitions each, cs {} ncs {}",
            vmm::lock_name(config.lock),
            vm.vcpus,
            vm.iterations,
            vm.cs_work,
            vm.ncs_work
        ),
        vcpus: vm.vcpus,
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cases,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics() {
        let case = CaseResult {
            hogs: 0,
            seconds: vec![1.0, 2.0, 3.0],
        };
        assert!((case.mean() - 2.0).abs() < 1e-12);
        assert!((case.sd() - 1.0).abs() < 1e-12);
        let single = CaseResult {
            hogs: 0,
            seconds: vec![5.0],
        };
        assert_eq!(single.sd(), 0.0);
    }

    #[test]
    fn table_labels_overcommit() {
        let table = BenchTable {
            title: "t".into(),
            vcpus: 2,
            host_cpus: 2,
            cases: vec![
                CaseResult {
                    hogs: 0,
                    seconds: vec![1.0],
                },
                CaseResult {
                    hogs: 4,
                    seconds: vec![3.0],
                },
            ],
        };
        let text = table.to_string();
        assert!(text.contains("case 1x (0 hogs)"), "{text}");
        assert!(text.contains("case 3x (4 hogs)"), "{text}");
    }
}
