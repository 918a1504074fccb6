//! `--vm-cgroup`: the VMM process in a cpu cgroup of its own, so that directed yield's nice
//! boosts stay inside the VM's CPU share (`pvspin_hints::confine`). The VMM's job, not
//! pvspin's: pvspin only checks.

use std::io;
use std::path::PathBuf;

/// Why the VM's cgroup could not be made or limited.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The process is in no cpu cgroup to make a child of.
    #[error("the process is in no mounted cpu cgroup hierarchy")]
    NoCpuCgroup,
    /// The cgroup directory could not be made.
    #[error("creating {}: {source}", .dir.display())]
    Create {
        /// The directory.
        dir: PathBuf,
        /// The filesystem's answer.
        #[source]
        source: io::Error,
    },
    /// The process could not be moved into the cgroup.
    #[error("moving the process into {}: {source}", .dir.display())]
    Enter {
        /// The cgroup's directory.
        dir: PathBuf,
        /// The filesystem's answer.
        #[source]
        source: io::Error,
    },
    /// `--cpu-limit` outside the range the test VM accepts (exit code 2).
    #[error("rule: --cpu-limit must be within 0.01..=4096 CPUs, got {0}")]
    CpuLimit(f64),
    /// A cgroup control file could not be written.
    #[error("writing {value:?} to {}: {source}", .file.display())]
    Write {
        /// What was written.
        value: String,
        /// The control file.
        file: PathBuf,
        /// The filesystem's answer.
        #[source]
        source: io::Error,
    },
}

/// The process's own cpu cgroup, left and removed on drop.
#[derive(Debug)]
pub struct VmCgroup {
    dir: PathBuf,
    parent: PathBuf,
}

impl VmCgroup {
    /// Creates `pvspin-vm-<pid>` under this process's cpu cgroup (v1 `cpu` hierarchy, or v2
    /// with the cpu controller) and moves the whole process into it. Needs write access to
    /// the cgroup filesystem.
    pub fn enter() -> Result<Self, CgroupError> {
        let (parent, version) =
            pvspin::proc::own_cpu_cgroup_dir().ok_or(CgroupError::NoCpuCgroup)?;
        if version == pvspin::proc::CgroupVersion::V2 {
            // v2: the parent must hand the cpu controller to its children.
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+cpu");
        }
        let dir = parent.join(format!("pvspin-vm-{}", std::process::id()));
        if let Err(source) = std::fs::create_dir_all(&dir) {
            return Err(CgroupError::Create { dir, source });
        }
        let me = Self { dir, parent };
        std::fs::write(me.dir.join("cgroup.procs"), std::process::id().to_string()).map_err(
            |source| CgroupError::Enter {
                dir: me.dir.clone(),
                source,
            },
        )?;
        Ok(me)
    }

    /// Limits the cgroup to `cpus` CPUs of CPU time (CFS bandwidth: v1 `cpu.cfs_quota_us`
    /// over a 100 ms period, v2 `cpu.max`), as a container or a microVM under a CPU limit
    /// runs. `entitled_cpus()` (the default slot count) reads it back, rounded up.
    pub fn limit(&self, cpus: f64) -> Result<(), CgroupError> {
        if !(0.01..=4096.0).contains(&cpus) {
            return Err(CgroupError::CpuLimit(cpus));
        }
        let period_us: u64 = 100_000;
        let quota_us = (cpus * period_us as f64).round() as u64;
        let write = |file: &str, value: String| {
            let file = self.dir.join(file);
            std::fs::write(&file, &value).map_err(|source| CgroupError::Write {
                value,
                file,
                source,
            })
        };
        if self.dir.join("cpu.max").exists() {
            let quota = pvspin::proc::CpuQuota::Limited {
                quota_us,
                period_us,
            };
            write("cpu.max", quota.to_string())
        } else {
            write("cpu.cfs_period_us", period_us.to_string())?;
            write("cpu.cfs_quota_us", quota_us.to_string())
        }
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for VmCgroup {
    fn drop(&mut self) {
        let pid = std::process::id().to_string();
        if let Err(e) = std::fs::write(self.parent.join("cgroup.procs"), &pid) {
            log::warn!("leaving {}: {e}", self.dir.display());
        } else if let Err(e) = std::fs::remove_dir(&self.dir) {
            log::warn!("removing {}: {e}", self.dir.display());
        }
    }
}
