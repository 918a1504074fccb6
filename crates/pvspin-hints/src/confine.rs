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
        reason: String,
    },
}

/// The reason for `NotConfined`; a short description otherwise.
impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Confined { cgroup } => write!(f, "confined to {}", cgroup.display()),
            Verdict::Unconfined => f.write_str("unconfined boosts accepted"),
            Verdict::NotConfined { reason } => f.write_str(reason),
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
    let not = |reason: String| Verdict::NotConfined { reason };
    if *confinement == Confinement::Unconfined {
        return Verdict::Unconfined;
    }
    let Ok(cgroup) = proc::parse_cpu_cgroup(proc_cgroup) else {
        return not("the process is in no cpu cgroup".into());
    };
    let path = cgroup.path.as_str();
    if path == "/" {
        return not("the process is in the root cpu cgroup, shared with every other task".into());
    }
    if let Confinement::Cgroup(asked) = confinement {
        if Path::new(&path) != asked.as_path() {
            return not(format!(
                "the process is in cpu cgroup {path}, not in {}",
                asked.display()
            ));
        }
    }
    let Some(dir) = proc::cpu_cgroup_dir(root, &cgroup) else {
        return not("no cgroup v1 cpu hierarchy is mounted".into());
    };
    let weight = match cgroup.version {
        CgroupVersion::V1 => "cpu.shares",
        CgroupVersion::V2 => "cpu.weight",
    };
    if !dir.join(weight).exists() {
        return not(format!(
            "{} has no {weight}: the cpu controller is not enabled for it",
            dir.display()
        ));
    }
    match std::fs::read_to_string(dir.join("cgroup.procs")) {
        Ok(procs) => {
            let others: Vec<&str> = procs
                .split_whitespace()
                .filter(|p| p.parse() != Ok(pid))
                .collect();
            if !others.is_empty() {
                return not(format!(
                    "cpu cgroup {path} also holds processes {others:?}: boosts would take CPU from them"
                ));
            }
        }
        Err(err) => return not(format!("reading {}/cgroup.procs: {err}", dir.display())),
    }
    // Processes of a child cgroup compete with this one's threads too (in its cpu group when
    // the child has no cpu controller, by weight against them in v1): boosting the VMM's
    // threads would take CPU from them.
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            if let Some(child) = entries.flatten().find(|e| e.path().is_dir()) {
                return not(format!(
                    "cpu cgroup {path} has a child cgroup ({}): boosts would take CPU from its processes",
                    child.file_name().to_string_lossy()
                ));
            }
        }
        Err(err) => return not(format!("listing {}: {err}", dir.display())),
    }
    Verdict::Confined { cgroup: dir }
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
            reason: format!("reading /proc/self/cgroup: {err}"),
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
            let file = if v1 { "cpu.shares" } else { "cpu.weight" };
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
            assert!(matches!(&v, Verdict::NotConfined { reason } if reason.contains("child")));
        }
        let root = tree(false, "42\n", true);
        let v = check_at(&Confinement::Auto, "0::/\n", 42, root.path());
        assert!(matches!(&v, Verdict::NotConfined { reason } if reason.contains("root")));
        assert!(!v.allows_fifo());
        assert!(check_at(&Confinement::Unconfined, "", 42, root.path()).allows_fifo());
    }
}
