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
//! The checks read `/proc/self/cgroup` and the cgroup filesystem; the parsing is pure and
//! unit-tested, the reading takes a root directory so tests use a fake tree.

use std::path::{Path, PathBuf};

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

/// The cpu-controller cgroup of a process, from the text of its `/proc/<pid>/cgroup`: the
/// v1 hierarchy that has `cpu` among its controllers, else the v2 (`0::`) entry. Returns
/// the path and whether it is a v1 hierarchy.
pub fn cpu_cgroup(proc_cgroup: &str) -> Option<(String, bool)> {
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "cpu") {
            return Some((path.to_string(), true));
        }
    }
    v2.map(|p| (p, false))
}

/// The directory of cpu cgroup `path` (as [`cpu_cgroup`] gives it) under the cgroup
/// filesystem at `root` (normally `/sys/fs/cgroup`): v1 hierarchies are mounted at `cpu` or
/// `cpu,cpuacct`; `None` when no v1 cpu hierarchy is mounted.
pub fn cpu_cgroup_dir(root: &Path, path: &str, v1: bool) -> Option<PathBuf> {
    let rel = path.trim_start_matches('/');
    if !v1 {
        return Some(root.join(rel));
    }
    ["cpu", "cpu,cpuacct", "cpuacct,cpu"]
        .iter()
        .map(|m| root.join(m))
        .find(|m| m.is_dir())
        .map(|m| m.join(rel))
}

/// Checks `confinement` for process `pid`, whose `/proc/<pid>/cgroup` reads `proc_cgroup`,
/// against the cgroup filesystem at `root`.
pub fn check_at(confinement: &Confinement, proc_cgroup: &str, pid: u32, root: &Path) -> Verdict {
    let not = |reason: String| Verdict::NotConfined { reason };
    if *confinement == Confinement::Unconfined {
        return Verdict::Unconfined;
    }
    let Some((path, v1)) = cpu_cgroup(proc_cgroup) else {
        return not("the process is in no cpu cgroup".into());
    };
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
    let Some(dir) = cpu_cgroup_dir(root, &path, v1) else {
        return not("no cgroup v1 cpu hierarchy is mounted".into());
    };
    let weight = if v1 { "cpu.shares" } else { "cpu.weight" };
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

/// This process's cpu cgroup directory on this machine, and whether it is a v1 hierarchy.
pub fn own_cpu_cgroup_dir() -> Option<(PathBuf, bool)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let (path, v1) = cpu_cgroup(&text)?;
    Some((cpu_cgroup_dir(Path::new("/sys/fs/cgroup"), &path, v1)?, v1))
}

/// [`check_at`] for this process on this machine.
pub fn check(confinement: &Confinement) -> Verdict {
    match std::fs::read_to_string("/proc/self/cgroup") {
        Ok(text) => check_at(
            confinement,
            &text,
            std::process::id(),
            Path::new("/sys/fs/cgroup"),
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

    const V1: &str = "9:name=systemd:/\n4:memory:/x\n2:cpuacct:/\n1:cpu:/vms/vm1\n0::/\n";
    const V2: &str = "0::/vms/vm1\n";

    #[test]
    fn finds_the_cpu_hierarchy() {
        assert_eq!(cpu_cgroup(V1), Some(("/vms/vm1".into(), true)));
        assert_eq!(cpu_cgroup(V2), Some(("/vms/vm1".into(), false)));
        assert_eq!(cpu_cgroup("3:cpu,cpuacct:/a\n"), Some(("/a".into(), true)));
        assert_eq!(cpu_cgroup("4:memory:/x\n"), None);
        assert_eq!(cpu_cgroup("garbage"), None);
    }

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

    /// A temporary directory removed on drop (no dependency for one test helper).
    mod tempdir {
        pub struct Dir(std::path::PathBuf);

        impl Dir {
            pub fn new() -> Self {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p =
                    std::env::temp_dir().join(format!("pvspin-confine-{}-{n}", std::process::id()));
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
}
