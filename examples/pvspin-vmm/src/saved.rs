//! Saved runs: `bench --json-out PATH` writes them, `pvspin-vmm report` reads them back.
//!
//! The file is JSON lines. A bench starts with its header, `{"record":"bench",...}` (the title,
//! vCPUs, VMs, host CPUs, hog counts, variants, the command line), followed by one
//! `{"record":"run",...}` line per run in the order the runs finished: variant, hogs, case,
//! case index, run index, the guest seconds the table counts (the bound for a run stopped by
//! it), the command line, and the run's full report (`report`, the JSON line `pvspin-vmm run`
//! prints; per VM in `vms` for multi-VM runs). Several benches may follow each other in one
//! file (`cat a.jsonl b.jsonl`).

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::bench::{BenchError, BenchOptions, BenchTable, CaseResult, Variant};
use pvspin_test_vm::report::LatencySummary;

/// The version of the format, in every header.
pub const FORMAT: u32 = 1;

/// One line of a saved file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    /// A bench starts.
    Bench(BenchHeader),
    /// One run finished.
    Run(RunRecord),
}

/// What a bench ran: enough to print its table again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// The table's title.
    pub title: String,
    /// The guest workload.
    pub workload: String,
    /// vCPUs per VM.
    pub vcpus: u32,
    /// VMs per run.
    pub vms: u32,
    /// Host CPUs the bench saw.
    pub host_cpus: usize,
    /// Acquisitions per vCPU (`pingpong`: handoffs).
    pub iterations: u64,
    /// Hog counts, one case each, in the table's order.
    pub hogs: Vec<u32>,
    /// Variants, in the table's order (the first is the baseline).
    pub variants: Vec<String>,
    /// Runs per case.
    pub runs: u32,
    /// The command line.
    pub command: Vec<String>,
}

impl BenchHeader {
    /// The header of `table` (still without runs), run with `options`.
    pub fn new(table: &BenchTable, options: &BenchOptions) -> Self {
        let mut hogs = Vec::new();
        let mut variants = Vec::new();
        for case in &table.cases {
            if !hogs.contains(&case.hogs) {
                hogs.push(case.hogs);
            }
            let name = case.variant.name();
            if !variants.contains(&name) {
                variants.push(name);
            }
        }
        Self {
            format: FORMAT,
            title: table.title.clone(),
            workload: table.workload.clone(),
            vcpus: table.vcpus,
            vms: table.vms,
            host_cpus: table.host_cpus,
            iterations: table.iterations,
            hogs,
            variants,
            runs: options.runs,
            command: options.command.clone(),
        }
    }
}

/// One run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// The variant's name (`--variants` syntax).
    pub variant: String,
    /// Hog threads.
    pub hogs: u32,
    /// The case's name in the table, e.g. `2x (2 hogs)`.
    pub case: String,
    /// The case's row in the table (hog counts times variants, in order).
    pub case_index: usize,
    /// Which run of the case, from 0.
    pub run: u32,
    /// Guest seconds the table counts: the run's, the slowest VM's, or the bound.
    pub guest_seconds: f64,
    /// Stopped by its bound (`--timeout-ms`): `guest_seconds` is the bound.
    pub timed_out: bool,
    /// Multi-VM runs: each VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vms: Vec<VmRecord>,
    /// The command line.
    pub command: Vec<String>,
    /// The run's report (single-VM runs that finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
    /// The share of the host's CPU time the hypervisor below took during the run (steal in
    /// `/proc/stat`); absent where it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_steal: Option<f64>,
    /// Not counted: the host's steal passed `--max-host-steal`, and the run was tried again
    /// (the next record of the same case and run is its replacement).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub discarded_for_steal: bool,
    /// Counted although the host's steal passed `--max-host-steal`: its retries were spent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub over_steal_bound: bool,
}

/// One VM of a multi-VM run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmRecord {
    /// Which VM.
    pub vm: u32,
    /// Its process's exit status.
    pub status: i32,
    /// Its guest seconds (the bound when it did not finish).
    pub guest_seconds: f64,
    /// Host CPU seconds its process used.
    pub cpu_seconds: f64,
    /// Its report, when it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
}

/// `--json-out`: records written and flushed one by one, so a bench stopped half-way leaves
/// the runs it finished.
#[derive(Debug)]
pub struct JsonLines {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
}

impl JsonLines {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> Result<Self, BenchError> {
        let file = std::fs::File::create(path).map_err(|source| BenchError::JsonOut {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            out: std::io::BufWriter::new(file),
        })
    }

    /// Appends one line.
    pub fn write(&mut self, record: &Record) -> Result<(), BenchError> {
        let result = serde_json::to_writer(&mut self.out, record)
            .map_err(std::io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"))
            .and_then(|()| self.out.flush());
        result.map_err(|source| BenchError::JsonOut {
            path: self.path.clone(),
            source,
        })
    }
}

/// Why saved runs could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("reading {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a record.
    #[error("{}:{line}: not a record of `bench --json-out`: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// Why.
        source: serde_json::Error,
    },
    /// A line does not fit the bench it is in.
    #[error("{}:{line}: {message}", path.display())]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The file holds no runs.
    #[error("{}: no runs", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// Why `pvspin-vmm report` failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be read.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// `--ab` files hold different numbers of benches.
    #[error("--ab: {} holds {a} benches and {} holds {b}; they are paired one by one", a_path.display(), b_path.display())]
    AbShape {
        /// A's file.
        a_path: PathBuf,
        /// Benches in it.
        a: usize,
        /// B's file.
        b_path: PathBuf,
        /// Benches in it.
        b: usize,
    },
    /// `--plot` failed.
    #[error("--plot: {0}")]
    Plot(#[from] crate::plot::PlotError),
    /// stdout could not be written.
    #[error("writing the report: {0}")]
    Write(#[from] std::io::Error),
}

/// `pvspin-vmm report`: the tables of the benches saved in `files`, or with `ab` (two files)
/// A and B side by side; written to `out`, and drawn to `plot`.
pub fn report(
    files: &[PathBuf],
    ab: Option<&[PathBuf]>,
    plot: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), ReportError> {
    if let Some([a_path, b_path]) = ab {
        let (a, b) = (load(a_path)?, load(b_path)?);
        if a.len() != b.len() {
            return Err(ReportError::AbShape {
                a_path: a_path.clone(),
                a: a.len(),
                b_path: b_path.clone(),
                b: b.len(),
            });
        }
        for (a, b) in a.iter().zip(&b) {
            let table = AbTable {
                a_name: &a_path.to_string_lossy(),
                a,
                b_name: &b_path.to_string_lossy(),
                b,
            };
            writeln!(out, "{table}")?;
        }
        if let Some(plot) = plot {
            let pairs: Vec<(&BenchTable, &BenchTable)> = a.iter().zip(&b).collect();
            crate::plot::write(plot, &crate::plot::render_ab_svg(&pairs)?)?;
        }
        return Ok(());
    }
    // Each bench with the name its plot gives it: the file's name among several.
    let mut benches: Vec<(Option<String>, BenchTable)> = Vec::new();
    for path in files {
        let name = path.file_name().map_or_else(
            || path.to_string_lossy().into_owned(),
            |n| n.to_string_lossy().into_owned(),
        );
        for table in load(path)? {
            writeln!(out, "{table}")?;
            benches.push(((files.len() > 1).then(|| name.clone()), table));
        }
    }
    if let Some(plot) = plot {
        let labelled: Vec<crate::plot::Labelled<'_>> = benches
            .iter()
            .map(|(label, table)| crate::plot::Labelled {
                label: label.as_deref(),
                table,
            })
            .collect();
        crate::plot::write(plot, &crate::plot::render_svg(&labelled)?)?;
    }
    Ok(())
}

/// Reads the benches saved in `path`, each as the table `bench` printed.
pub fn load(path: &Path) -> Result<Vec<BenchTable>, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(&text, path)
}

/// [`load`] of `text`, read from `path` (for messages).
pub fn parse(text: &str, path: &Path) -> Result<Vec<BenchTable>, LoadError> {
    let mut tables: Vec<BenchTable> = Vec::new();
    let mismatch = |line: usize, message: String| LoadError::Mismatch {
        path: path.to_owned(),
        line,
        message,
    };
    for (index, text) in text.lines().enumerate() {
        let line = index + 1;
        if text.trim().is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(text).map_err(|source| LoadError::Json {
            path: path.to_owned(),
            line,
            source,
        })?;
        match record {
            Record::Bench(header) => {
                if header.format > FORMAT {
                    return Err(mismatch(
                        line,
                        format!(
                            "format {} is newer than this pvspin-vmm's {FORMAT}",
                            header.format
                        ),
                    ));
                }
                let mut cases = Vec::new();
                for &hogs in &header.hogs {
                    for name in &header.variants {
                        let variant =
                            Variant::parse(name).map_err(|err| mismatch(line, err.to_string()))?;
                        cases.push(CaseResult::new(hogs, variant));
                    }
                }
                tables.push(BenchTable {
                    title: header.title,
                    workload: header.workload,
                    vcpus: header.vcpus,
                    vms: header.vms,
                    host_cpus: header.host_cpus,
                    iterations: header.iterations,
                    cases,
                });
            }
            Record::Run(run) => {
                let table = tables
                    .last_mut()
                    .ok_or_else(|| mismatch(line, "a run before its bench's header".to_string()))?;
                let fits = |c: &CaseResult| c.hogs == run.hogs && c.variant.name() == run.variant;
                let k = match table.cases.get(run.case_index) {
                    Some(case) if fits(case) => run.case_index,
                    _ => table.cases.iter().position(fits).ok_or_else(|| {
                        mismatch(
                            line,
                            format!(
                                "{} with {} hogs is not a case of its bench",
                                run.variant, run.hogs
                            ),
                        )
                    })?,
                };
                add_run(&mut table.cases[k], &run);
            }
        }
    }
    for table in &mut tables {
        table.cases.retain(|c| !c.seconds.is_empty());
    }
    tables.retain(|t| !t.cases.is_empty());
    if tables.is_empty() {
        return Err(LoadError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(tables)
}

/// Counts `run` in `case`, as the bench did when it ran.
fn add_run(case: &mut CaseResult, run: &RunRecord) {
    if run.discarded_for_steal {
        case.rerun_for_steal += 1;
        return;
    }
    if run.over_steal_bound {
        case.kept_over_steal += 1;
    }
    case.seconds.push(run.guest_seconds);
    case.host_steal.push(run.host_steal);
    let field = |name: &str| {
        run.report
            .as_ref()
            .and_then(|r| r.get(name))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    case.section_ns.push(if run.timed_out {
        None
    } else {
        crate::bench::section_ns(field("ncs_mean_tsc"), field("tsc_khz"))
    });
    if run.timed_out {
        case.timed_out += 1;
    }
    if !run.vms.is_empty() {
        case.per_vm_seconds.resize(run.vms.len(), Vec::new());
        case.per_vm_cpu.resize(run.vms.len(), Vec::new());
        for (i, vm) in run.vms.iter().enumerate() {
            case.per_vm_seconds[i].push(vm.guest_seconds);
            case.per_vm_cpu[i].push(vm.cpu_seconds);
        }
    }
    if let Some(latency) = run
        .report
        .as_ref()
        .and_then(|r| r.get("kick_to_wake"))
        .and_then(|l| LatencySummary::deserialize(l).ok())
    {
        case.kick_to_wake.push(latency);
    }
}

/// Two saved benches side by side (`report --ab A B`): per row, each side's median and
/// slowest run, and B's median over A's.
#[derive(Clone, Copy, Debug)]
pub struct AbTable<'a> {
    /// Where A came from.
    pub a_name: &'a str,
    /// A.
    pub a: &'a BenchTable,
    /// Where B came from.
    pub b_name: &'a str,
    /// B.
    pub b: &'a BenchTable,
}

impl AbTable<'_> {
    /// What A and B ran differently beside their variants, e.g. `vcpus 2 / 4`.
    pub fn differences(&self) -> Vec<String> {
        let (a, b) = (self.a, self.b);
        let mut out = Vec::new();
        if a.workload != b.workload {
            out.push(format!("workload {} / {}", a.workload, b.workload));
        }
        for (name, x, y) in [
            ("vcpus", u64::from(a.vcpus), u64::from(b.vcpus)),
            ("vms", u64::from(a.vms), u64::from(b.vms)),
            ("iterations", a.iterations, b.iterations),
            ("host cpus", a.host_cpus as u64, b.host_cpus as u64),
        ] {
            if x != y {
                out.push(format!("{name} {x} / {y}"));
            }
        }
        out
    }
}

impl fmt::Display for AbTable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "A: {}: {}", self.a_name, self.a.title)?;
        writeln!(f, "B: {}: {}", self.b_name, self.b.title)?;
        let differences = self.differences();
        if !differences.is_empty() {
            writeln!(
                f,
                "note: A and B differ beside their variants (A / B): {}",
                differences.join(", ")
            )?;
        }
        writeln!(
            f,
            "guest seconds, less is better; each side's median and slowest run, and B's median over A's \
             (B/A, below 1: B is faster); '>' marks runs stopped by the bound"
        )?;
        let side = |case: Option<&CaseResult>| match case {
            Some(c) => {
                let bound = if c.timed_out > 0 { ">" } else { "" };
                format!(
                    "median {bound}{:>8.4} slowest {bound}{:>8.4}",
                    c.median(),
                    c.slowest()
                )
            }
            None => format!("{:<32}", "(not run)"),
        };
        let mut rows: Vec<(&CaseResult, Option<&CaseResult>, Option<&CaseResult>)> = self
            .a
            .cases
            .iter()
            .map(|case| (case, Some(case), same_case(self.b, case)))
            .collect();
        rows.extend(
            self.b
                .cases
                .iter()
                .filter(|case| same_case(self.a, case).is_none())
                .map(|case| (case, None, Some(case))),
        );
        for (row, a, b) in rows {
            let ratio = match (a, b) {
                (Some(a), Some(b)) if a.median() > 0.0 => {
                    let r = b.median() / a.median();
                    format!("B/A {r:.3} ({:+.1}%)", (r - 1.0) * 100.0)
                }
                _ => "B/A n/a".to_string(),
            };
            writeln!(
                f,
                "case {:<12} {:<34} A {}  B {}  {ratio}",
                self.a.case_label(row.hogs),
                row.variant.name(),
                side(a),
                side(b),
            )?;
        }
        Ok(())
    }
}

/// The case of `table` with `case`'s hogs and variant.
fn same_case<'t>(table: &'t BenchTable, case: &CaseResult) -> Option<&'t CaseResult> {
    table
        .cases
        .iter()
        .find(|c| c.hogs == case.hogs && c.variant.name() == case.variant.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_line(variant: &str, hogs: u32, k: usize, run: u32, seconds: f64) -> String {
        serde_json::to_string(&Record::Run(RunRecord {
            variant: variant.into(),
            hogs,
            case: String::new(),
            case_index: k,
            run,
            guest_seconds: seconds,
            timed_out: false,
            vms: Vec::new(),
            command: vec!["pvspin-vmm".into(), "bench".into()],
            report: Some(serde_json::json!({
                "guest_seconds": seconds,
                "kick_to_wake": {"samples": 10, "min_us": 1.0, "p50_us": 2.0, "p90_us": 3.0, "p99_us": 4.0, "max_us": 5.0}
            })),
            host_steal: Some(0.05),
            discarded_for_steal: false,
            over_steal_bound: false,
        }))
        .unwrap()
    }

    fn header(vcpus: u32) -> String {
        serde_json::to_string(&Record::Bench(BenchHeader {
            format: FORMAT,
            title: format!("t{vcpus}"),
            workload: "lock".into(),
            vcpus,
            vms: 1,
            host_cpus: 2,
            iterations: 100,
            hogs: vec![0, 2],
            variants: vec!["ticket:off".into(), "ticket:kick:in-kernel".into()],
            runs: 2,
            command: Vec::new(),
        }))
        .unwrap()
    }

    #[test]
    fn saved_lines_come_back_as_the_table() {
        let text = [
            header(2),
            run_line("ticket:off", 0, 0, 0, 1.0),
            run_line("ticket:kick:in-kernel", 0, 1, 0, 0.5),
            run_line("ticket:off", 2, 2, 0, 3.0),
            run_line("ticket:kick:in-kernel", 2, 3, 0, 0.25),
            run_line("ticket:off", 0, 0, 1, 1.5),
            String::new(),
            header(4),
            run_line("ticket:off", 0, 0, 0, 2.0),
        ]
        .join("\n");
        let tables = parse(&text, Path::new("x.jsonl")).unwrap();
        assert_eq!(tables.len(), 2);
        let t = &tables[0];
        assert_eq!((t.title.as_str(), t.vcpus, t.cases.len()), ("t2", 2, 4));
        assert_eq!(t.cases[0].seconds, [1.0, 1.5]);
        assert_eq!(t.cases[3].seconds, [0.25]);
        assert_eq!(t.cases[3].kick_to_wake.len(), 1);
        let shown = t.to_string();
        assert!(shown.contains("slowest 1.5000"), "{shown}");
        // Cases without runs (the second bench stopped early) are left out.
        assert_eq!(tables[1].cases.len(), 1);
    }

    #[test]
    fn garbage_is_refused_with_file_and_line() {
        let err = parse("{\"no\":1}\n", Path::new("x.jsonl")).unwrap_err();
        assert!(err.to_string().starts_with("x.jsonl:1: "), "{err}");
        let err = parse(&run_line("ticket:off", 0, 0, 0, 1.0), Path::new("y")).unwrap_err();
        assert!(
            err.to_string().contains("before its bench's header"),
            "{err}"
        );
        let text = format!("{}\n{}", header(2), run_line("tas:off", 0, 0, 0, 1.0));
        let err = parse(&text, Path::new("z")).unwrap_err();
        assert!(err.to_string().contains("not a case"), "{err}");
        assert!(matches!(
            parse(&header(2), Path::new("e")),
            Err(LoadError::Empty { .. })
        ));
    }

    #[test]
    fn ab_rows_give_b_over_a() {
        let a = parse(
            &[header(2), run_line("ticket:off", 0, 0, 0, 2.0)].join("\n"),
            Path::new("a"),
        )
        .unwrap();
        let b = parse(
            &[
                header(4),
                run_line("ticket:off", 0, 0, 0, 1.0),
                run_line("ticket:kick:in-kernel", 0, 1, 0, 1.0),
            ]
            .join("\n"),
            Path::new("b"),
        )
        .unwrap();
        let text = AbTable {
            a_name: "a",
            a: &a[0],
            b_name: "b",
            b: &b[0],
        }
        .to_string();
        assert!(text.contains("B/A 0.500 (-50.0%)"), "{text}");
        assert!(text.contains("vcpus 2 / 4"), "{text}");
        assert!(text.contains("(not run)"), "{text}");
    }
}
