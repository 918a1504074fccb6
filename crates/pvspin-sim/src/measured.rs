//! The measured runs the simulator is validated against (`validation/measured.csv`,
//! `pvspin-sim validate`): one row per measured median, and the simulation that reproduces it.
//!
//! Columns: `hogs,vcpus,iterations,variant,median_s,slowest_s[,cpu_limit,cs_work,ncs_work,
//! source,bound_s,guest_prewake,halts,guest_features,work_unit_ps]`. `guest_prewake` says which pvspin guest
//! was measured: empty for the guest before `VCPUS_FIT` (it waits at once behind a waking next
//! owner and never pre-wakes: every row before source D), a depth (`2`) for the guest that is
//! told `VCPUS_FIT` and pre-wakes that many waiters. `halts` is the measured median of the VM's
//! halts, when the runs counted them. `guest_features` names the guest changes of 2026-12-02
//! the measured guest had, `+`-separated: `names-holder` (the MCS waiter names the holder,
//! [`SimConfig::queued_names_holder`]) and `hybrid-trylock` (the stock guest's
//! [`SimConfig::stock_hybrid_trylock`]); empty for the guest before both. `work_unit_ps` is the
//! row's own work unit, calibrated on reference runs interleaved with the row's runs (the host's
//! speed drifts up to 2x between hours, so one unit for a whole table measured over many
//! minutes puts that drift into every cell's ratio); empty: the cost model's.

use thiserror::Error;

use crate::config::{ConfigError, SimConfig, Variant};
use crate::cost::CostModel;

/// A row the validation cannot read; each names the rule.
#[derive(Debug, Error, PartialEq)]
pub enum MeasuredError {
    /// Rule: a row has at least the six leading columns.
    #[error(
        "rule: a row is hogs,vcpus,iterations,variant,median_s,slowest_s[,...], got {0} columns"
    )]
    Columns(
        /// The columns found.
        usize,
    ),
    /// Rule: numeric columns are numbers.
    #[error("rule: column {column} must be a number, got {value:?}")]
    Number {
        /// The column's name.
        column: &'static str,
        /// What it holds.
        value: String,
    },
    /// Rule: `guest_features` is `+`-separated `names-holder` and `hybrid-trylock`.
    #[error("rule: guest_features is names-holder and/or hybrid-trylock joined by +, got {0:?}")]
    GuestFeature(
        /// What the column holds.
        String,
    ),
    /// Rule: a row's own work unit is a whole number of ps above 0.
    #[error("rule: work_unit_ps is a whole number of ps above 0, got 0")]
    WorkUnit,
    /// Rule: the variant is one the simulator knows.
    #[error(transparent)]
    Variant(#[from] ConfigError),
}

/// One measured median.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredRow {
    /// CPU hogs beside the VM.
    pub hogs: usize,
    /// The VM's vCPUs.
    pub vcpus: usize,
    /// Acquisitions per vCPU.
    pub iterations: u64,
    /// What ran.
    pub variant: Variant,
    /// Median guest seconds.
    pub median_s: f64,
    /// Slowest guest seconds.
    pub slowest_s: f64,
    /// The VM's CPU limit, CPUs.
    pub cpu_limit: Option<f64>,
    /// Work units inside a critical section (default 15000).
    pub cs_work: Option<u64>,
    /// Work units between critical sections (default 15000).
    pub ncs_work: Option<u64>,
    /// The table it comes from (`A`, `B`, ...).
    pub source: String,
    /// The bench's bound, s: a median at it is a lower bound only.
    pub bound_s: Option<f64>,
    /// The measured guest's pre-wake depth; `None`: the guest before `VCPUS_FIT`.
    pub guest_prewake: Option<u8>,
    /// The measured median of the VM's halts.
    pub halts: Option<u64>,
    /// The measured MCS waiter named the holder in its WAIT ([`SimConfig::queued_names_holder`]).
    pub names_holder: bool,
    /// The measured stock guest used Linux's hybrid trylock
    /// ([`SimConfig::stock_hybrid_trylock`]).
    pub hybrid_trylock: bool,
    /// The row's own work unit in ps ([`crate::cost::CostModel::work_unit_ps`]), calibrated
    /// in the same stretch as its runs; `None`: the cost model's.
    pub work_unit_ps: Option<u64>,
}

impl MeasuredRow {
    /// Reads one line of the CSV; `Ok(None)` for blank lines, comments and the header.
    pub fn parse(line: &str) -> Result<Option<Self>, MeasuredError> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("hogs") {
            return Ok(None);
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() < 6 {
            return Err(MeasuredError::Columns(f.len()));
        }
        const NAMES: [&str; 15] = [
            "hogs",
            "vcpus",
            "iterations",
            "variant",
            "median_s",
            "slowest_s",
            "cpu_limit",
            "cs_work",
            "ncs_work",
            "source",
            "bound_s",
            "guest_prewake",
            "halts",
            "guest_features",
            "work_unit_ps",
        ];
        // An empty or missing optional column is absent; anything else must parse.
        fn opt<T: std::str::FromStr>(
            f: &[&str],
            i: usize,
            names: &[&'static str],
        ) -> Result<Option<T>, MeasuredError> {
            match f.get(i).copied().filter(|s| !s.is_empty()) {
                None => Ok(None),
                Some(s) => s.parse().map(Some).map_err(|_| MeasuredError::Number {
                    column: names.get(i).copied().unwrap_or("extra"),
                    value: s.to_string(),
                }),
            }
        }
        let req = |i: usize| -> Result<f64, MeasuredError> {
            opt::<f64>(&f, i, &NAMES)?.ok_or(MeasuredError::Number {
                column: NAMES[i],
                value: String::new(),
            })
        };
        let int = |i: usize| -> Result<u64, MeasuredError> {
            opt::<u64>(&f, i, &NAMES)?.ok_or(MeasuredError::Number {
                column: NAMES[i],
                value: String::new(),
            })
        };
        let (mut names_holder, mut hybrid_trylock) = (false, false);
        for feature in f.get(13).copied().unwrap_or("").split('+') {
            match feature.trim() {
                "" => {}
                "names-holder" => names_holder = true,
                "hybrid-trylock" => hybrid_trylock = true,
                _ => return Err(MeasuredError::GuestFeature(f[13].to_string())),
            }
        }
        Ok(Some(Self {
            hogs: int(0)? as usize,
            vcpus: int(1)? as usize,
            iterations: int(2)?,
            variant: f[3].parse()?,
            median_s: req(4)?,
            slowest_s: req(5)?,
            cpu_limit: opt(&f, 6, &NAMES)?,
            cs_work: opt(&f, 7, &NAMES)?,
            ncs_work: opt(&f, 8, &NAMES)?,
            source: f.get(9).copied().unwrap_or("").to_string(),
            bound_s: opt::<f64>(&f, 10, &NAMES)?.filter(|&b| b > 0.0),
            guest_prewake: opt(&f, 11, &NAMES)?,
            halts: opt(&f, 12, &NAMES)?,
            names_holder,
            hybrid_trylock,
            work_unit_ps: match opt::<u64>(&f, 14, &NAMES)? {
                Some(0) => return Err(MeasuredError::WorkUnit),
                w => w,
            },
        }))
    }

    /// The host's costs for this row: `host`'s, with the row's own work unit if it has one.
    pub fn cost(&self, host: &CostModel) -> CostModel {
        let mut cost = host.clone();
        if let Some(w) = self.work_unit_ps {
            cost.work_unit_ps = w;
        }
        cost
    }

    /// Whether the measured median sits at the bench's bound (then only a lower bound).
    pub fn at_bound(&self) -> bool {
        self.bound_s.is_some_and(|b| self.median_s >= b)
    }

    /// The simulation of this row with `seed`. It simulates the guest that was measured
    /// ([`Self::guest_prewake`]) unless `today` asks for today's guest with pre-wake depth
    /// `prewake` (the `--current-guest` columns).
    pub fn config(&self, seed: u64, today: Option<u8>) -> SimConfig {
        let mut cfg = SimConfig::new(self.variant, self.vcpus, self.iterations);
        cfg.hogs = self.hogs;
        cfg.seed = seed;
        // The measured guest's MCS waiter and stock trylock, or today's.
        cfg.queued_names_holder = today.is_some() || self.names_holder;
        cfg.stock_hybrid_trylock = today.is_some() || self.hybrid_trylock;
        match today.or(self.guest_prewake) {
            Some(depth) => {
                cfg.early_wait_behind_waking = false;
                cfg.prewake = depth;
            }
            // The guest before `VCPUS_FIT`: never told, so it never pre-wakes either.
            None => cfg.early_wait_behind_waking = true,
        }
        cfg.cpu_limit = self.cpu_limit;
        if let Some(c) = self.cs_work {
            cfg.cs_work = c;
        }
        if let Some(c) = self.ncs_work {
            cfg.ncs_work = c;
        }
        cfg.bound_ns = self.bound_s.map_or(60_000_000_000, |b| (b * 1e9) as u64);
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_before_source_d_simulate_the_guest_before_vcpus_fit() {
        let r =
            MeasuredRow::parse("0,8,10000,queued:kick/slots:userspace,0.560,0.621,,15000,15000,A")
                .unwrap()
                .unwrap();
        assert_eq!(
            (r.guest_prewake, r.halts, r.source.as_str()),
            (None, None, "A")
        );
        let c = r.config(1, None);
        assert!(c.early_wait_behind_waking);
        assert_eq!(c.prewake_depth(), 0, "the measured guest never pre-wakes");
        // Asked for today's guest, it pre-wakes where told `VCPUS_FIT`.
        let today = r.config(1, Some(2));
        assert!(!today.early_wait_behind_waking);
        assert_eq!(today.prewake_depth(), 2);
        assert_eq!(r.config(1, Some(0)).prewake_depth(), 0);
    }

    #[test]
    fn a_row_measured_with_the_prewake_simulates_it() {
        let r = MeasuredRow::parse(
            "0,64,1250,ticket:kick/slots:userspace,0.430,0.499,,15000,15000,D,,2,1085",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (r.guest_prewake, r.halts, r.bound_s),
            (Some(2), Some(1085), None)
        );
        let c = r.config(3, None);
        assert!(!c.early_wait_behind_waking);
        assert_eq!((c.prewake_depth(), c.seed, c.vcpus), (2, 3, 64));
        assert_eq!(c.iterations, Some(1250));
        // The row's guest, not the command line's, unless today's guest is asked for.
        assert_eq!(r.config(1, Some(1)).prewake_depth(), 1);
    }

    #[test]
    fn a_row_of_todays_guest_simulates_its_features() {
        let r = MeasuredRow::parse(
            "0,8,10000,queued:kick:in-kernel@stock,0.9,1.0,,15000,15000,E,,2,,names-holder+hybrid-trylock",
        )
        .unwrap()
        .unwrap();
        assert!(r.names_holder && r.hybrid_trylock);
        let c = r.config(1, None);
        assert!(c.queued_names_holder && c.stock_hybrid_trylock);
        let old =
            MeasuredRow::parse("0,8,10000,queued:kick:in-kernel@stock,0.9,1.0,,15000,15000,A")
                .unwrap()
                .unwrap();
        let c = old.config(1, None);
        assert!(!c.queued_names_holder && !c.stock_hybrid_trylock);
        assert!(matches!(
            MeasuredRow::parse("0,8,10000,ticket:kick,0.9,1.0,,15000,15000,E,,2,,hybrid"),
            Err(MeasuredError::GuestFeature(_))
        ));
    }

    /// A shipped table's rows (each line must parse).
    fn table(text: &str) -> Vec<MeasuredRow> {
        text.lines()
            .filter_map(|l| MeasuredRow::parse(l).unwrap())
            .collect()
    }

    /// A shipped cost file, applied over the defaults.
    fn costs(text: &str) -> crate::CostModel {
        let mut cost = crate::CostModel::default();
        cost.apply(text).unwrap();
        cost
    }

    #[test]
    fn the_intel_table_reads_and_its_costs_apply() {
        let rows = table(include_str!("../validation/measured-intel.csv"));
        assert_eq!(rows.len(), 196);
        assert!(rows.iter().all(|r| r.names_holder && r.hybrid_trylock));
        // Source E used the cost file's one work unit; every row of F to J has its own.
        for (source, own_unit, count) in [
            ("E", false, 42),
            ("F", true, 42),
            ("G", true, 42),
            ("H", true, 14),
            ("I", true, 42),
            ("J", true, 14),
        ] {
            let of: Vec<_> = rows.iter().filter(|r| r.source == source).collect();
            assert_eq!(of.len(), count, "{source}");
            assert!(of.iter().all(|r| r.work_unit_ps.is_some() == own_unit));
        }
        let cost = costs(include_str!("../validation/intel-kvm-pvm.costs"));
        assert_ne!(cost.work_unit_ps, crate::CostModel::default().work_unit_ps);
    }

    #[test]
    fn the_amd_hz250_table_reads_and_its_costs_apply() {
        let rows = table(include_str!("../validation/measured-amd-hz250.csv"));
        assert_eq!(rows.len(), 56);
        assert!(rows.iter().all(|r| r.source == "K"
            && r.names_holder
            && r.hybrid_trylock
            && r.guest_prewake == Some(2)
            && r.halts.is_some()
            && r.work_unit_ps.is_some()));
        let cost = costs(include_str!("../validation/amd-hz250-kvm-pvm.costs"));
        assert_eq!(cost.tick_ns, 4_000_000);
        // Both HZ=250 hosts carry the two fitted scheduler knobs.
        for file in [
            include_str!("../validation/amd-hz250-kvm-pvm.costs"),
            include_str!("../validation/intel-kvm-pvm.costs"),
        ] {
            let cost = costs(file);
            assert_eq!(cost.kick_to_wake_jitter_pct, 25);
            assert_eq!(cost.migration_cost_ns, 2_000_000);
        }
    }

    /// Source K's stock guest at 8 vCPUs, 5 seeds, with the AMD HZ=250 host's costs (and
    /// `edit`): the median and the slowest guest seconds.
    fn stock_8_vcpus_on_the_amd_hz250_host(edit: impl Fn(&mut crate::CostModel)) -> (f64, f64) {
        let row = MeasuredRow::parse(
            "0,8,10000,queued:kick:in-kernel@stock,0.935,0.997,,15000,15000,K,60,2,279,names-holder+hybrid-trylock,375",
        )
        .unwrap()
        .unwrap();
        let host = costs(include_str!("../validation/amd-hz250-kvm-pvm.costs"));
        let mut times: Vec<f64> = (1..=5)
            .map(|seed| {
                let mut cfg = row.config(seed, None);
                cfg.cost = row.cost(&host);
                edit(&mut cfg.cost);
                let r = crate::Sim::new(cfg).unwrap().run();
                assert!(r.finished);
                r.guest_seconds()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        (times[2], times[4])
    }

    /// The host's idle CPUs beside waiting vCPU threads (`migration_cost_ns`) made some seeds
    /// collapse while every kick woke its vCPU after exactly the p50: the vCPUs fell into a
    /// cycle repeated every balance. The host's wake-ups vary; with the spread the tail is
    /// the host's (its slowest of 5: 1.07x its median).
    #[test]
    fn with_the_wake_ups_spread_idle_cpus_cause_no_lock_step_collapse() {
        let (median, slowest) = stock_8_vcpus_on_the_amd_hz250_host(|_| {});
        assert!(slowest < 1.5 * median, "{median} {slowest}");
        let (_, exact_slowest) =
            stock_8_vcpus_on_the_amd_hz250_host(|c| c.kick_to_wake_jitter_pct = 0);
        assert!(exact_slowest > 2.0 * median, "{median} {exact_slowest}");
    }

    #[test]
    fn a_row_with_its_own_work_unit_simulates_with_it() {
        let host = crate::CostModel::default();
        let r = MeasuredRow::parse(
            "0,8,10000,ticket:kick,0.9,1.0,,15000,15000,F,60,2,,names-holder+hybrid-trylock,455",
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.work_unit_ps, Some(455));
        let cost = r.cost(&host);
        assert_eq!(cost.work_unit_ps, 455);
        assert_eq!(
            cost.tick_ns, host.tick_ns,
            "only the work unit is the row's"
        );
        // Without the column (or empty), the host's.
        let plain = MeasuredRow::parse("0,8,10000,ticket:kick,0.9,1.0,,15000,15000,E,60,2,,,")
            .unwrap()
            .unwrap();
        assert_eq!(plain.cost(&host), host);
        assert_eq!(
            MeasuredRow::parse("0,8,10000,ticket:kick,0.9,1.0,,15000,15000,F,60,2,,,0"),
            Err(MeasuredError::WorkUnit)
        );
        assert!(matches!(
            MeasuredRow::parse("0,8,10000,ticket:kick,0.9,1.0,,15000,15000,F,60,2,,,fast"),
            Err(MeasuredError::Number {
                column: "work_unit_ps",
                ..
            })
        ));
    }

    #[test]
    fn the_old_columns_read_as_before() {
        let r = MeasuredRow::parse("2,2,300000,backoff:off,7.0476,29.7169,,5000,5000,B,60")
            .unwrap()
            .unwrap();
        assert_eq!(r.bound_s, Some(60.0));
        assert!(!r.at_bound());
        let c = r.config(1, None);
        assert_eq!(
            (c.cs_work, c.ncs_work, c.hogs, c.bound_ns),
            (5000, 5000, 2, 60_000_000_000)
        );
        let r = MeasuredRow::parse("0,4,25000,ticket:off,20.0,20.0,,5000,5000,C,20")
            .unwrap()
            .unwrap();
        assert!(r.at_bound());
        let r = MeasuredRow::parse("0,4,20000,ticket:kick:in-kernel,4.614,5.555,1,15000,15000,A")
            .unwrap()
            .unwrap();
        assert_eq!(r.config(1, None).cpu_limit, Some(1.0));
        assert_eq!(r.config(1, None).bound_ns, 60_000_000_000);
    }

    #[test]
    fn comments_and_bad_rows() {
        assert_eq!(MeasuredRow::parse("# Source D").unwrap(), None);
        assert_eq!(MeasuredRow::parse("hogs,vcpus").unwrap(), None);
        assert_eq!(MeasuredRow::parse("  ").unwrap(), None);
        assert_eq!(
            MeasuredRow::parse("0,4,1,ticket:off"),
            Err(MeasuredError::Columns(4))
        );
        assert_eq!(
            MeasuredRow::parse("0,4,1,ticket:off,0.1,0.2,,,,D,,two"),
            Err(MeasuredError::Number {
                column: "guest_prewake",
                value: "two".into()
            })
        );
        assert!(matches!(
            MeasuredRow::parse("0,4,1,nope,0.1,0.2"),
            Err(MeasuredError::Variant(_))
        ));
    }

    #[test]
    fn the_shipped_table_reads_and_marks_its_guests() {
        let rows = table(include_str!("../validation/measured.csv"));
        assert_eq!(rows.len(), 107);
        for r in &rows {
            // Only source D ran the pre-wake guest, and only it counted halts.
            let d = r.source == "D";
            assert_eq!(r.guest_prewake, d.then_some(2), "{r:?}");
            assert_eq!(r.halts.is_some(), d, "{r:?}");
        }
        assert_eq!(rows.iter().filter(|r| r.source == "D").count(), 14);
    }
}
