//! Whether a priority boost stays inside the VM's own CPU share.
//!
//! A nice boost only reorders threads that compete with each other. Inside a cgroup with the
//! cpu controller, the group competes with its siblings by its weight (`cpu.weight` on v2,
//! `cpu.shares` on v1) whatever its threads' nice values, so when the VMM's process is alone
//! in its own cpu cgroup, boosting one vCPU thread takes CPU only from the VM's other threads:
//! nothing a guest writes can raise the VM's share. Without such a cgroup a boosted thread
//! competes with every other task of its scheduling group (with autogroup, its session's;
//! without, the whole machine's), so a guest naming a running vCPU again and again would
//! raise its VM's share: boosts are then off unless the VMM says it accepts that
//! ([`Confinement::Unconfined`]). `SCHED_FIFO` preempts every fair-class task on its CPU
//! whatever the cgroup, so it is never confined.
//!
//! The checks read `/proc/self/cgroup` and the cgroup filesystem; the parsing is
//! [`proc`]'s, the reading takes a root directory so tests use a fake tree.

use std::path::{Path, PathBuf};

use crate::proc::{self, CgroupVersion};

/// What the VMM says about its CPU confinement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Confinement {
    /// Find out: boosts are confined when this process is alone in its own cpu cgroup.
    #[default]
    Auto,
    /// The VM's cpu cgroup (a path under the cgroup mount, e.g. `/vms/vm1`); checked like
    /// `Auto`, but this one must be the process's.
    Cgroup(PathBuf),
    /// The VMM accepts boosts that can raise the VM's share over co-tenants (a host that runs
    /// one VM, or trusts its guests).
    Unconfined,
}

/// The answer: may boosts be used, and why (for the log and reports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Boosts stay inside this cpu cgroup, which holds only this process.
    Confined {
        /// The cgroup's directory.
        cgroup: PathBuf,
    },
    /// The VMM accepted unconfined boosts.
    Unconfined,
    /// Boosts would not be confined: they are off.
    NotConfined {
        /// Why.
        reason: NotConfinedReason,
    },
}

/// Why boosts would not stay inside the VM's CPU share. The messages are the `#[error]`
/// texts (they format paths, which `displaydoc` cannot).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotConfinedReason {
    /// `/proc/<pid>/cgroup` names no cpu cgroup.
    #[error("the process is in no cpu cgroup ({0})")]
    NoCpuCgroup(#[source] proc::ParseError),
    /// The process is in the root cpu cgroup.
    #[error("the process is in the root cpu cgroup, shared with every other task")]
    RootCgroup,
    /// The process is not in the cgroup the VMM named ([`Confinement::Cgroup`]).
    #[error("the process is in cpu cgroup {path}, not in {}", .asked.display())]
    NotTheNamedCgroup {
        /// The process's cpu cgroup.
        path: String,
        /// The one the VMM named.
        asked: PathBuf,
    },
    /// The process's cgroup is in a v1 hierarchy, and no v1 cpu hierarchy is mounted.
    #[error("no cgroup v1 cpu hierarchy is mounted")]
    NoV1CpuMount,
    /// The cgroup has no cpu controller.
    #[error(
        "{} has no {}: the cpu controller is not enabled for it",
        .dir.display(),
        .version.weight_file()
    )]
    NoCpuController {
        /// The cgroup's directory.
        dir: PathBuf,
        /// Its hierarchy, which says the weight file it lacks.
        version: CgroupVersion,
    },
    /// Other processes share the cgroup.
    #[error("cpu cgroup {path} also holds processes {others:?}: boosts would take CPU from them")]
    SharedCgroup {
        /// The process's cpu cgroup.
        path: String,
        /// The other entries of its `cgroup.procs`.
        others: Vec<String>,
    },
    /// The cgroup has a child cgroup, whose processes compete with the VMM's threads.
    #[error(
        "cpu cgroup {path} has a child cgroup ({child}): boosts would take CPU from its processes"
    )]
    ChildCgroup {
        /// The process's cpu cgroup.
        path: String,
        /// The first child's name.
        child: String,
    },
    /// A file or directory of the check could not be read.
    #[error("{} {}: {cause}", .action, .path.display())]
    Unreadable {
        /// What was done: `reading` or `listing`.
        action: ReadAction,
        /// The file or directory.
        path: PathBuf,
        /// The filesystem's answer.
        cause: IoCause,
    },
}

/// What [`NotConfinedReason::Unreadable`] was doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, displaydoc::Display)]
pub enum ReadAction {
    /// reading
    Reading,
    /// listing
    Listing,
}

/// An I/O error kept comparable and cloneable, for a [`Verdict`]: its OS error number, else
/// its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoCause {
    /// The error's kind.
    pub kind: std::io::ErrorKind,
    /// The OS error number, when the OS gave one.
    pub os_error: Option<i32>,
}

impl From<&std::io::Error> for IoCause {
    fn from(err: &std::io::Error) -> Self {
        Self {
            kind: err.kind(),
            os_error: err.raw_os_error(),
        }
    }
}

/// As the `io::Error` it came from showed it (for OS errors) or its kind.
impl std::fmt::Display for IoCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.os_error {
            Some(code) => std::io::Error::from_raw_os_error(code).fmt(f),
            None => self.kind.fmt(f),
        }
    }
}

/// The reason for `NotConfined`; a short description otherwise.
impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Confined { cgroup } => write!(f, "confined to {}", cgroup.display()),
            Verdict::Unconfined => f.write_str("unconfined boosts accepted"),
            Verdict::NotConfined { reason } => reason.fmt(f),
        }
    }
}

impl Verdict {
    /// Whether nice boosts may be used.
    pub fn allows_nice(&self) -> bool {
        !matches!(self, Verdict::NotConfined { .. })
    }

    /// Whether `SCHED_FIFO` boosts may be used (only when unconfined boosts are accepted).
    pub fn allows_fifo(&self) -> bool {
        matches!(self, Verdict::Unconfined)
    }
}

/// Checks `confinement` for process `pid`, whose `/proc/<pid>/cgroup` reads `proc_cgroup`,
/// against the cgroup filesystem at `root`.
pub fn check_at(confinement: &Confinement, proc_cgroup: &str, pid: u32, root: &Path) -> Verdict {
    if *confinement == Confinement::Unconfined {
        return Verdict::Unconfined;
    }
    match confined_cgroup_dir(confinement, proc_cgroup, pid, root) {
        Ok(cgroup) => Verdict::Confined { cgroup },
        Err(reason) => Verdict::NotConfined { reason },
    }
}

/// The directory of `pid`'s cpu cgroup if boosts stay inside it, else why not.
fn confined_cgroup_dir(
    confinement: &Confinement,
    proc_cgroup: &str,
    pid: u32,
    root: &Path,
) -> Result<PathBuf, NotConfinedReason> {
    let cgroup = proc::parse_cpu_cgroup(proc_cgroup).map_err(NotConfinedReason::NoCpuCgroup)?;
    let path = cgroup.path.as_str();
    if path == "/" {
        return Err(NotConfinedReason::RootCgroup);
    }
    if let Confinement::Cgroup(asked) = confinement {
        if Path::new(&path) != asked.as_path() {
            return Err(NotConfinedReason::NotTheNamedCgroup {
                path: path.to_string(),
                asked: asked.clone(),
            });
        }
    }
    let dir = proc::cpu_cgroup_dir(root, &cgroup).ok_or(NotConfinedReason::NoV1CpuMount)?;
    if !dir.join(cgroup.version.weight_file()).exists() {
        return Err(NotConfinedReason::NoCpuController {
            dir,
            version: cgroup.version,
        });
    }
    let unreadable = |action, path: PathBuf| {
        move |err: std::io::Error| NotConfinedReason::Unreadable {
            action,
            path,
            cause: IoCause::from(&err),
        }
    };
    let procs_file = dir.join("cgroup.procs");
    let procs = std::fs::read_to_string(&procs_file)
        .map_err(unreadable(ReadAction::Reading, procs_file))?;
    let others: Vec<String> = procs
        .split_whitespace()
        .filter(|p| p.parse() != Ok(pid))
        .map(str::to_string)
        .collect();
    if !others.is_empty() {
        return Err(NotConfinedReason::SharedCgroup {
            path: path.to_string(),
            others,
        });
    }
    // Processes of a child cgroup compete with this one's threads too (in its cpu group when
    // the child has no cpu controller, by weight against them in v1): boosting the VMM's
    // threads would take CPU from them.
    let entries = std::fs::read_dir(&dir).map_err(unreadable(ReadAction::Listing, dir.clone()))?;
    if let Some(child) = entries.flatten().find(|e| e.path().is_dir()) {
        return Err(NotConfinedReason::ChildCgroup {
            path: path.to_string(),
            child: child.file_name().to_string_lossy().into_owned(),
        });
    }
    Ok(dir)
}

/// [`check_at`] for this process on this machine.
pub fn check(confinement: &Confinement) -> Verdict {
    match std::fs::read_to_string("/proc/self/cgroup") {
        Ok(text) => check_at(
            confinement,
            &text,
            std::process::id(),
            Path::new(proc::CGROUP_ROOT),
        ),
        Err(err) if *confinement != Confinement::Unconfined => Verdict::NotConfined {
            reason: NotConfinedReason::Unreadable {
                action: ReadAction::Reading,
                path: "/proc/self/cgroup".into(),
                cause: IoCause::from(&err),
            },
        },
        Err(_) => Verdict::Unconfined,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::proc::tests::tempdir;

    const V1: &str = "9:name=systemd:/\n4:memory:/x\n2:cpuacct:/\n1:cpu:/vms/vm1\n0::/\n";
    const V2: &str = "0::/vms/vm1\n";

    fn tree(v1: bool, procs: &str, weight: bool) -> tempdir::Dir {
        let root = tempdir::Dir::new();
        let dir = if v1 {
            root.path().join("cpu/vms/vm1")
        } else {
            root.path().join("vms/vm1")
        };
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), procs).unwrap();
        if weight {
            let version = if v1 {
                CgroupVersion::V1
            } else {
                CgroupVersion::V2
            };
            let file = version.weight_file();
            std::fs::write(dir.join(file), "100\n").unwrap();
        }
        root
    }

    #[test]
    fn confined_only_alone_in_an_own_cpu_cgroup() {
        for (v1, text) in [(true, V1), (false, V2)] {
            let alone = tree(v1, "42\n", true);
            assert!(matches!(
                check_at(&Confinement::Auto, text, 42, alone.path()),
                Verdict::Confined { .. }
            ));
            let asked = Confinement::Cgroup("/vms/vm1".into());
            assert!(check_at(&asked, text, 42, alone.path()).allows_nice());
            let elsewhere = Confinement::Cgroup("/vms/vm2".into());
            assert!(!check_at(&elsewhere, text, 42, alone.path()).allows_nice());
            let shared = tree(v1, "42\n43\n", true);
            let v = check_at(&Confinement::Auto, text, 42, shared.path());
            assert!(!v.allows_nice(), "{v:?}");
            let no_controller = tree(v1, "42\n", false);
            assert!(!check_at(&Confinement::Auto, text, 42, no_controller.path()).allows_nice());
            // A child cgroup's processes would compete with the boosted threads.
            let with_child = tree(v1, "42\n", true);
            let sub = if v1 {
                "cpu/vms/vm1/child"
            } else {
                "vms/vm1/child"
            };
            std::fs::create_dir_all(with_child.path().join(sub)).unwrap();
            let v = check_at(&Confinement::Auto, text, 42, with_child.path());
            assert!(matches!(
                &v,
                Verdict::NotConfined {
                    reason: NotConfinedReason::ChildCgroup { .. }
                }
            ));
            assert!(v.to_string().contains("has a child cgroup (child)"), "{v}");
        }
        let root = tree(false, "42\n", true);
        let v = check_at(&Confinement::Auto, "0::/\n", 42, root.path());
        assert_eq!(
            v,
            Verdict::NotConfined {
                reason: NotConfinedReason::RootCgroup
            }
        );
        assert!(!v.allows_fifo());
        assert!(check_at(&Confinement::Unconfined, "", 42, root.path()).allows_fifo());
    }

    /// The reasons keep their types, and their messages are the ones the checks always gave.
    #[test]
    fn reasons_are_typed_and_say_why() {
        let not = |v: Verdict| match v {
            Verdict::NotConfined { reason } => reason,
            other => panic!("confined: {other:?}"),
        };
        let shared = tree(false, "42\n43\n", true);
        assert_eq!(
            not(check_at(&Confinement::Auto, V2, 42, shared.path())).to_string(),
            "cpu cgroup /vms/vm1 also holds processes [\"43\"]: boosts would take CPU from them"
        );
        let alone = tree(false, "42\n", true);
        let elsewhere = Confinement::Cgroup("/vms/vm2".into());
        assert_eq!(
            not(check_at(&elsewhere, V2, 42, alone.path())).to_string(),
            "the process is in cpu cgroup /vms/vm1, not in /vms/vm2"
        );
        let reason = not(check_at(
            &Confinement::Auto,
            "4:memory:/x\n",
            42,
            alone.path(),
        ));
        assert!(
            matches!(reason, NotConfinedReason::NoCpuCgroup(_)),
            "{reason}"
        );
        let no_controller = tree(false, "42\n", false);
        let reason = not(check_at(&Confinement::Auto, V2, 42, no_controller.path()));
        assert_eq!(
            reason,
            NotConfinedReason::NoCpuController {
                dir: no_controller.path().join("vms/vm1"),
                version: CgroupVersion::V2
            }
        );
        assert!(reason
            .to_string()
            .ends_with("vms/vm1 has no cpu.weight: the cpu controller is not enabled for it"));
        std::fs::remove_file(alone.path().join("vms/vm1/cgroup.procs")).unwrap();
        let reason = not(check_at(&Confinement::Auto, V2, 42, alone.path()));
        assert!(
            matches!(
                &reason,
                NotConfinedReason::Unreadable {
                    action: ReadAction::Reading,
                    cause: IoCause {
                        kind: std::io::ErrorKind::NotFound,
                        ..
                    },
                    ..
                }
            ),
            "{reason:?}"
        );
        assert!(
            reason
                .to_string()
                .ends_with("vms/vm1/cgroup.procs: No such file or directory (os error 2)"),
            "{reason}"
        );
    }
}
