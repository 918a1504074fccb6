//! What the kernel says about threads and their cpu cgroup: the one place pvspin parses
//! `/proc` and the cgroup filesystem.
//!
//! | file | parser | used by |
//! |---|---|---|
//! | `/proc/<pid>/task/<tid>/schedstat` | [`parse_schedstat`] | pvspind's vCPU sampler |
//! | `/proc/<pid>/task/<tid>/stat` | [`parse_stat_state`], [`parse_stat_nice`] | the sampler, pvspind's nice changes |
//! | `/proc/<pid>/task/<tid>/status` | [`parse_status_switches`], [`parse_status_cap_eff`] | the sampler, pvspind's permission check |
//! | `/proc/<pid>/cgroup` | [`parse_cpu_cgroup`], then [`cpu_cgroup_dir`] | [`confine`](crate::confine), the run slots' entitlement |
//! | `cpu.max` (v2), `cpu.cfs_quota_us` and `cpu.cfs_period_us` (v1) | [`parse_cpu_max`], [`parse_cfs_quota`], [`read_cpu_quota`] | the run slots' entitlement |
//!
//! The parsers take the file's text and return its value or a [`ParseError`] that names the
//! file and the field; malformed text never panics. The thread files are read by their
//! callers, which know how often they read and what a failure means (a thread that exited);
//! [`own_cpu_cgroup_dir`] and [`read_cpu_quota`] read their small files themselves.
//!
//! **Hand-written, not the `procfs` crate**, because pvspind's sampler reads `schedstat` of
//! every vCPU thread every millisecond (and `stat` or `status` when it moved): it keeps the
//! files open and re-reads them with `pread` into a stack buffer, while `procfs` opens the
//! file anew and allocates for each read. Measured on one thread's files (CPU time per read,
//! median of 9 rounds of 20,000, interleaved; `docs/benchmarks.md`, "Reading /proc: the
//! procfs crate or pread"): `schedstat` 0.63 us here against 4.8 us with `procfs` 0.17,
//! `stat` 2.8 against 8.1 us, `status` 7.6 against 24 us. The parsers are a few lines each,
//! over fields documented in proc(5) and the kernel's cgroup documentation.

use std::fmt;
use std::num::ParseIntError;
use std::path::{Path, PathBuf};

/// The file a text came from, for errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum ProcFile {
    /// a thread's schedstat
    Schedstat,
    /// a thread's stat
    Stat,
    /// a thread's status
    Status,
    /// a process's cgroup list
    Cgroup,
    /// cpu.max
    CpuMax,
    /// cpu.cfs_quota_us
    CfsQuota,
    /// cpu.cfs_period_us
    CfsPeriod,
}

/// The field of a file that was missing or malformed, for errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum Field {
    /// the run time
    RunTime,
    /// the run-queue wait
    WaitTime,
    /// the switch-in count
    SwitchesIn,
    /// the end of the thread's name (`)`)
    NameEnd,
    /// the state
    State,
    /// the nice value
    Nice,
    /// voluntary_ctxt_switches
    VoluntarySwitches,
    /// nonvoluntary_ctxt_switches
    InvoluntarySwitches,
    /// CapEff
    CapEff,
    /// a cpu controller entry
    CpuController,
    /// the quota
    Quota,
    /// the period
    Period,
}

/// Why a file's text does not hold what it should.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
pub enum ParseError {
    /// {file} has no {field}
    Missing {
        /// The file.
        file: ProcFile,
        /// What it lacks.
        field: Field,
    },
    /// {field} of {file} is not a number: {source}
    Number {
        /// The file.
        file: ProcFile,
        /// The field.
        field: Field,
        /// What parsing it said.
        #[source]
        source: ParseIntError,
    },
    /// {field} of {file} is out of range: {value}
    OutOfRange {
        /// The file.
        file: ProcFile,
        /// The field.
        field: Field,
        /// The value read.
        value: i64,
    },
}

/// Parses `text` as a number, or says which field of which file it is not.
fn number<T: std::str::FromStr<Err = ParseIntError>>(
    text: Option<&str>,
    file: ProcFile,
    field: Field,
) -> Result<T, ParseError> {
    text.ok_or(ParseError::Missing { file, field })?
        .trim()
        .parse()
        .map_err(|source| ParseError::Number {
            file,
            field,
            source,
        })
}

/// One read of a thread's `schedstat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStat {
    /// Time on a CPU, ns (advances at ticks and switches).
    pub run_ns: u64,
    /// Time runnable on a run queue, ns (charged at switch-in).
    pub wait_ns: u64,
    /// Times switched in.
    pub switches_in: u64,
}

/// Parses `schedstat`: three decimal numbers.
pub fn parse_schedstat(text: &str) -> Result<SchedStat, ParseError> {
    let file = ProcFile::Schedstat;
    let mut fields = text.split_ascii_whitespace();
    Ok(SchedStat {
        run_ns: number(fields.next(), file, Field::RunTime)?,
        wait_ns: number(fields.next(), file, Field::WaitTime)?,
        switches_in: number(fields.next(), file, Field::SwitchesIn)?,
    })
}

/// A thread's state as procfs shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// `R`: on a CPU or runnable.
    Runnable,
    /// Sleeping, stopped, in disk wait, idle: not runnable.
    Blocked,
    /// Exiting or dead (`Z`, `X`).
    Gone,
}

impl TaskState {
    /// The state letter's meaning.
    pub fn from_letter(letter: u8) -> Self {
        match letter {
            b'R' => TaskState::Runnable,
            b'Z' | b'X' | b'x' => TaskState::Gone,
            _ => TaskState::Blocked,
        }
    }
}

/// The fields of a `stat` line from the state (field 3) on. The name (field 2) may hold
/// spaces and parentheses: the fields resume after its last `)`.
fn stat_fields_from_state(text: &str) -> Result<std::str::SplitAsciiWhitespace<'_>, ParseError> {
    let name_end = text.rfind(')').ok_or(ParseError::Missing {
        file: ProcFile::Stat,
        field: Field::NameEnd,
    })?;
    Ok(text[name_end + 1..].split_ascii_whitespace())
}

/// The state (field 3) of a `stat` line.
pub fn parse_stat_state(text: &str) -> Result<TaskState, ParseError> {
    let state = stat_fields_from_state(text)?
        .next()
        .and_then(|field| field.bytes().next())
        .ok_or(ParseError::Missing {
            file: ProcFile::Stat,
            field: Field::State,
        })?;
    Ok(TaskState::from_letter(state))
}

/// The nice value (field 19) of a `stat` line.
pub fn parse_stat_nice(text: &str) -> Result<i32, ParseError> {
    number(
        stat_fields_from_state(text)?.nth(16),
        ProcFile::Stat,
        Field::Nice,
    )
}

/// The value of `key:` in a `status` text.
fn status_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
}

/// The state and the switch-outs (`voluntary_ctxt_switches + nonvoluntary_ctxt_switches`) of
/// a `status` text.
pub fn parse_status_switches(text: &str) -> Result<(TaskState, u64), ParseError> {
    let file = ProcFile::Status;
    let state = status_value(text, "State")
        .and_then(|value| value.trim_start().bytes().next())
        .ok_or(ParseError::Missing {
            file,
            field: Field::State,
        })?;
    let voluntary: u64 = number(
        status_value(text, "voluntary_ctxt_switches"),
        file,
        Field::VoluntarySwitches,
    )?;
    let involuntary: u64 = number(
        status_value(text, "nonvoluntary_ctxt_switches"),
        file,
        Field::InvoluntarySwitches,
    )?;
    Ok((
        TaskState::from_letter(state),
        voluntary.wrapping_add(involuntary),
    ))
}

/// The effective capability set (`CapEff`, hexadecimal) of a `status` text.
pub fn parse_status_cap_eff(text: &str) -> Result<u64, ParseError> {
    let (file, field) = (ProcFile::Status, Field::CapEff);
    let hex = status_value(text, "CapEff").ok_or(ParseError::Missing { file, field })?;
    u64::from_str_radix(hex.trim(), 16).map_err(|source| ParseError::Number {
        file,
        field,
        source,
    })
}

/// Which cgroup hierarchy a cgroup belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// A v1 hierarchy with its own controllers (`cpu` among them).
    V1,
    /// The v2 unified hierarchy.
    V2,
}

impl CgroupVersion {
    /// The cpu weight file, which a cgroup has when the cpu controller is enabled for it:
    /// `cpu.shares` (v1) or `cpu.weight` (v2).
    pub fn weight_file(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "cpu.shares",
            CgroupVersion::V2 => "cpu.weight",
        }
    }
}

/// A process's cpu-controller cgroup, as `/proc/<pid>/cgroup` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuCgroup {
    /// The path below the hierarchy's mount (`/` for its root).
    pub path: String,
    /// The hierarchy.
    pub version: CgroupVersion,
}

/// The cpu cgroup in the text of a `/proc/<pid>/cgroup`: the v1 hierarchy that has `cpu`
/// among its controllers, else the v2 (`0::`) entry.
pub fn parse_cpu_cgroup(text: &str) -> Result<CpuCgroup, ParseError> {
    let mut v2 = None;
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "cpu") {
            return Ok(CpuCgroup {
                path: path.to_string(),
                version: CgroupVersion::V1,
            });
        }
    }
    v2.map(|path| CpuCgroup {
        path: path.to_string(),
        version: CgroupVersion::V2,
    })
    .ok_or(ParseError::Missing {
        file: ProcFile::Cgroup,
        field: Field::CpuController,
    })
}

/// Where the cgroup filesystem is mounted on a normal host.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The directory of `cgroup` under the cgroup filesystem at `root` (normally
/// [`CGROUP_ROOT`]): v1 cpu hierarchies are mounted at `cpu` or `cpu,cpuacct`; `None` when
/// none is.
pub fn cpu_cgroup_dir(root: &Path, cgroup: &CpuCgroup) -> Option<PathBuf> {
    let rel = cgroup.path.trim_start_matches('/');
    match cgroup.version {
        CgroupVersion::V2 => Some(root.join(rel)),
        CgroupVersion::V1 => ["cpu", "cpu,cpuacct", "cpuacct,cpu"]
            .iter()
            .map(|mount| root.join(mount))
            .find(|mount| mount.is_dir())
            .map(|mount| mount.join(rel)),
    }
}

/// This process's cpu cgroup directory on this machine, and its hierarchy; `None` when
/// `/proc/self/cgroup` names none or its hierarchy is not mounted.
pub fn own_cpu_cgroup_dir() -> Option<(PathBuf, CgroupVersion)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let cgroup = parse_cpu_cgroup(&text).ok()?;
    Some((
        cpu_cgroup_dir(Path::new(CGROUP_ROOT), &cgroup)?,
        cgroup.version,
    ))
}

/// A cpu cgroup's CFS bandwidth limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuQuota {
    /// No limit (`max`, or a v1 quota of -1).
    Unlimited,
    /// At most `quota_us` of CPU time every `period_us` (both at least 1).
    Limited {
        /// CPU time per period, microseconds.
        quota_us: u64,
        /// The period, microseconds.
        period_us: u64,
    },
}

impl CpuQuota {
    /// The CPUs the limit allows, rounded up; `None` when unlimited.
    pub fn cpus(self) -> Option<usize> {
        match self {
            CpuQuota::Unlimited => None,
            CpuQuota::Limited {
                quota_us,
                period_us,
            } => usize::try_from(quota_us.div_ceil(period_us)).ok(),
        }
    }
}

impl fmt::Display for CpuQuota {
    /// As `cpu.max` writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuQuota::Unlimited => f.write_str("max"),
            CpuQuota::Limited {
                quota_us,
                period_us,
            } => write!(f, "{quota_us} {period_us}"),
        }
    }
}

/// A positive period, or which file's period is out of range.
fn period(period_us: u64, file: ProcFile) -> Result<u64, ParseError> {
    if period_us == 0 {
        return Err(ParseError::OutOfRange {
            file,
            field: Field::Period,
            value: 0,
        });
    }
    Ok(period_us)
}

/// Parses a v2 `cpu.max`: `"<quota> <period>"` or `"max <period>"` (the period defaults to
/// 100 ms when absent).
pub fn parse_cpu_max(text: &str) -> Result<CpuQuota, ParseError> {
    let file = ProcFile::CpuMax;
    let mut fields = text.split_ascii_whitespace();
    let quota = fields.next().ok_or(ParseError::Missing {
        file,
        field: Field::Quota,
    })?;
    let period_us = match fields.next() {
        Some(text) => period(number(Some(text), file, Field::Period)?, file)?,
        None => 100_000,
    };
    if quota == "max" {
        return Ok(CpuQuota::Unlimited);
    }
    let quota_us: u64 = number(Some(quota), file, Field::Quota)?;
    if quota_us == 0 {
        return Err(ParseError::OutOfRange {
            file,
            field: Field::Quota,
            value: 0,
        });
    }
    Ok(CpuQuota::Limited {
        quota_us,
        period_us,
    })
}

/// Parses v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` (a quota of -1: unlimited).
pub fn parse_cfs_quota(quota: &str, period_text: &str) -> Result<CpuQuota, ParseError> {
    let quota_us: i64 = number(Some(quota), ProcFile::CfsQuota, Field::Quota)?;
    let period_us = period(
        number(Some(period_text), ProcFile::CfsPeriod, Field::Period)?,
        ProcFile::CfsPeriod,
    )?;
    match u64::try_from(quota_us) {
        _ if quota_us == -1 => Ok(CpuQuota::Unlimited),
        Ok(quota_us) if quota_us > 0 => Ok(CpuQuota::Limited {
            quota_us,
            period_us,
        }),
        _ => Err(ParseError::OutOfRange {
            file: ProcFile::CfsQuota,
            field: Field::Quota,
            value: quota_us,
        }),
    }
}

/// Why [`read_cpu_quota`] found no quota.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum QuotaError {
    /// reading {file}: {source}
    Read {
        /// The control file.
        file: PathBuf,
        /// The filesystem's answer.
        #[source]
        source: std::io::Error,
    },
    /// {0}
    Parse(#[from] ParseError),
}

/// Reads the CFS bandwidth limit of the cpu cgroup in directory `dir` of a `version`
/// hierarchy.
pub fn read_cpu_quota(dir: &Path, version: CgroupVersion) -> Result<CpuQuota, QuotaError> {
    let read = |name: &str| {
        let file = dir.join(name);
        std::fs::read_to_string(&file).map_err(|source| QuotaError::Read { file, source })
    };
    Ok(match version {
        CgroupVersion::V1 => {
            parse_cfs_quota(&read("cpu.cfs_quota_us")?, &read("cpu.cfs_period_us")?)?
        }
        CgroupVersion::V2 => parse_cpu_max(&read("cpu.max")?)?,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A temporary directory removed on drop (no dependency for one test helper).
    pub(crate) mod tempdir {
        pub struct Dir(std::path::PathBuf);

        impl Dir {
            pub fn new() -> Self {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p =
                    std::env::temp_dir().join(format!("pvspin-hints-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&p).unwrap();
                Self(p)
            }

            pub fn path(&self) -> &std::path::Path {
                &self.0
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn schedstat_is_three_numbers() {
        assert_eq!(
            parse_schedstat("123 45 6\n"),
            Ok(SchedStat {
                run_ns: 123,
                wait_ns: 45,
                switches_in: 6
            })
        );
        assert_eq!(
            parse_schedstat("1 2"),
            Err(ParseError::Missing {
                file: ProcFile::Schedstat,
                field: Field::SwitchesIn
            })
        );
        assert!(matches!(
            parse_schedstat("1 x 3"),
            Err(ParseError::Number {
                field: Field::WaitTime,
                ..
            })
        ));
        assert!(parse_schedstat("-1 2 3").is_err());
        assert!(parse_schedstat("99999999999999999999999 2 3").is_err());
        assert!(parse_schedstat("").is_err());
    }

    #[test]
    fn stat_fields_resume_after_the_name() {
        let stat = "42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 -3 1 0 0";
        assert_eq!(parse_stat_state(stat), Ok(TaskState::Blocked));
        assert_eq!(parse_stat_nice(stat), Ok(-3));
        assert_eq!(
            parse_stat_state("42 (vcpu 1) (x)) S 1 2 3"),
            Ok(TaskState::Blocked)
        );
        assert_eq!(parse_stat_state("42 (a) R 1"), Ok(TaskState::Runnable));
        assert_eq!(parse_stat_state("42 (a) Z 1"), Ok(TaskState::Gone));
        assert_eq!(TaskState::from_letter(b'X'), TaskState::Gone);
        assert_eq!(TaskState::from_letter(b'D'), TaskState::Blocked);
        assert_eq!(TaskState::from_letter(b'I'), TaskState::Blocked);
        assert_eq!(
            parse_stat_state("no paren"),
            Err(ParseError::Missing {
                file: ProcFile::Stat,
                field: Field::NameEnd
            })
        );
        assert!(parse_stat_state("42 (a)").is_err());
        assert!(parse_stat_state("42 (a)   \n").is_err());
        assert!(parse_stat_nice("42 (a) R 1 2").is_err(), "too few fields");
        assert!(parse_stat_nice("42 (a) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 x").is_err());
        // A `)` as the last byte, multi-byte names: no slicing panic.
        assert!(parse_stat_state("42 (\u{e9}\u{e9})").is_err());
        assert_eq!(parse_stat_state("42 (\u{e9}) R"), Ok(TaskState::Runnable));
    }

    #[test]
    fn status_gives_state_switches_and_capabilities() {
        let status = "Name:\tvcpu0\nState:\tR (running)\nCapEff:\t0000000000800000\n\
                      voluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(parse_status_switches(status), Ok((TaskState::Runnable, 10)));
        assert_eq!(parse_status_cap_eff(status), Ok(1 << 23));
        assert_eq!(
            parse_status_switches("State:\tZ (zombie)\n"),
            Err(ParseError::Missing {
                file: ProcFile::Status,
                field: Field::VoluntarySwitches
            })
        );
        assert!(parse_status_switches("State:\n").is_err());
        assert!(parse_status_switches(
            "State:\tS\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\tlots\n"
        )
        .is_err());
        assert!(parse_status_cap_eff("CapEff:\tzz\n").is_err());
        assert!(parse_status_cap_eff("CapPrm:\t1\n").is_err());
        // A key that only starts like another is not it.
        assert!(parse_status_cap_eff("CapEffective:\t1\n").is_err());
    }

    #[test]
    fn the_cpu_cgroup_is_the_v1_cpu_hierarchy_else_v2() {
        let v1 = "9:name=systemd:/\n4:memory:/x\n2:cpuacct:/\n1:cpu:/vms/vm1\n0::/\n";
        assert_eq!(
            parse_cpu_cgroup(v1),
            Ok(CpuCgroup {
                path: "/vms/vm1".into(),
                version: CgroupVersion::V1
            })
        );
        assert_eq!(
            parse_cpu_cgroup("0::/vms/vm1\n").map(|c| c.version),
            Ok(CgroupVersion::V2)
        );
        assert_eq!(
            parse_cpu_cgroup("3:cpu,cpuacct:/a\n").map(|c| c.path),
            Ok("/a".into())
        );
        // A path may hold ':'.
        assert_eq!(
            parse_cpu_cgroup("0::/a:b\n").map(|c| c.path),
            Ok("/a:b".into())
        );
        for text in ["4:memory:/x\n", "garbage", "", "::"] {
            assert_eq!(
                parse_cpu_cgroup(text).map(|c| c.path).ok(),
                (text == "::").then(String::new),
                "{text:?}"
            );
        }
    }

    #[test]
    fn cgroup_dirs_follow_the_hierarchy() {
        let root = Path::new("/nonexistent-root");
        let v2 = CpuCgroup {
            path: "/vms/vm1".into(),
            version: CgroupVersion::V2,
        };
        assert_eq!(cpu_cgroup_dir(root, &v2), Some(root.join("vms/vm1")));
        let v1 = CpuCgroup {
            version: CgroupVersion::V1,
            ..v2
        };
        assert_eq!(cpu_cgroup_dir(root, &v1), None, "no v1 cpu mount");
    }

    #[test]
    fn quotas_parse_and_round_up() {
        assert_eq!(parse_cpu_max("max 100000\n"), Ok(CpuQuota::Unlimited));
        assert_eq!(parse_cpu_max("max"), Ok(CpuQuota::Unlimited));
        assert_eq!(
            parse_cpu_max("150000 100000\n").map(CpuQuota::cpus),
            Ok(Some(2))
        );
        assert_eq!(
            parse_cpu_max("100000 100000").map(CpuQuota::cpus),
            Ok(Some(1))
        );
        assert_eq!(parse_cpu_max("50000").map(CpuQuota::cpus), Ok(Some(1)));
        assert!(parse_cpu_max("garbage").is_err());
        assert!(parse_cpu_max("").is_err());
        assert!(parse_cpu_max("100000 0").is_err());
        assert!(parse_cpu_max("0 100000").is_err());
        assert!(parse_cpu_max("100000 x").is_err());
        assert_eq!(parse_cfs_quota("-1\n", "100000\n"), Ok(CpuQuota::Unlimited));
        assert_eq!(
            parse_cfs_quota("250000", "100000").map(CpuQuota::cpus),
            Ok(Some(3))
        );
        assert!(parse_cfs_quota("0", "100000").is_err());
        assert!(parse_cfs_quota("-5", "100000").is_err());
        assert!(parse_cfs_quota("100000", "0").is_err());
        assert!(parse_cfs_quota("x", "100000").is_err());
        assert!(parse_cfs_quota("100000", "").is_err());
        let limited = CpuQuota::Limited {
            quota_us: 150_000,
            period_us: 100_000,
        };
        assert_eq!(parse_cpu_max(&limited.to_string()), Ok(limited));
        assert_eq!(CpuQuota::Unlimited.to_string(), "max");
    }

    #[test]
    fn quotas_are_read_from_either_hierarchy() {
        let dir = tempdir::Dir::new();
        assert!(matches!(
            read_cpu_quota(dir.path(), CgroupVersion::V2),
            Err(QuotaError::Read { .. })
        ));
        std::fs::write(dir.path().join("cpu.max"), "250000 100000\n").unwrap();
        assert_eq!(
            read_cpu_quota(dir.path(), CgroupVersion::V2)
                .unwrap()
                .cpus(),
            Some(3)
        );
        std::fs::write(dir.path().join("cpu.cfs_quota_us"), "-1\n").unwrap();
        std::fs::write(dir.path().join("cpu.cfs_period_us"), "100000\n").unwrap();
        assert_eq!(
            read_cpu_quota(dir.path(), CgroupVersion::V1).unwrap(),
            CpuQuota::Unlimited
        );
        std::fs::write(dir.path().join("cpu.cfs_quota_us"), "oops\n").unwrap();
        assert!(matches!(
            read_cpu_quota(dir.path(), CgroupVersion::V1),
            Err(QuotaError::Parse(_))
        ));
    }

    /// Every parser on every prefix and byte flip of real files: an answer or an error,
    /// never a panic.
    #[test]
    fn malformed_text_never_panics() {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let samples = [
            "123 45 6\n".to_string(),
            stat,
            status,
            "1:cpu:/a\n0::/b\n".into(),
            "150000 100000\n".into(),
        ];
        for sample in &samples {
            let mut variants: Vec<String> = (0..sample.len())
                .filter(|&end| sample.is_char_boundary(end))
                .map(|end| sample[..end].to_string())
                .collect();
            for (i, _) in sample.char_indices().step_by(7) {
                for replacement in [")", "(", ":", "\n", "-", "\u{e9}", " "] {
                    let mut flipped = sample.clone();
                    let len = flipped[i..].chars().next().map_or(0, char::len_utf8);
                    flipped.replace_range(i..i + len, replacement);
                    variants.push(flipped);
                }
            }
            for text in &variants {
                let _ = parse_schedstat(text);
                let _ = parse_stat_state(text);
                let _ = parse_stat_nice(text);
                let _ = parse_status_switches(text);
                let _ = parse_status_cap_eff(text);
                let _ = parse_cpu_cgroup(text);
                let _ = parse_cpu_max(text);
                let _ = parse_cfs_quota(text, text);
            }
        }
    }

    /// This machine's own files parse.
    #[test]
    fn this_threads_files_parse() {
        let read = |name: &str| std::fs::read_to_string(format!("/proc/thread-self/{name}"));
        assert!(parse_schedstat(&read("schedstat").unwrap()).is_ok());
        assert_eq!(
            parse_stat_state(&read("stat").unwrap()),
            Ok(TaskState::Runnable),
            "a thread reading its own stat is running"
        );
        let nice = rustix::process::getpriority_process(None).unwrap();
        assert_eq!(parse_stat_nice(&read("stat").unwrap()), Ok(nice));
        let status = read("status").unwrap();
        assert_eq!(
            parse_status_switches(&status).map(|(state, _)| state),
            Ok(TaskState::Runnable)
        );
        assert!(parse_status_cap_eff(&status).is_ok());
    }
}
