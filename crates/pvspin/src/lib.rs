//! pvspin's embedding API: paravirtual spinlocks and lock-holder-aware vCPU scheduling for a
//! KVM-based VMM built on rust-vmm crates.
//!
//! The VMM keeps its threads, memory and device model; pvspin plugs in through a few hooks:
//!
//! 1. Build a [`PvSpin`] with [`PvSpin::builder`], giving the number of vCPUs and a
//!    [`VcpuInterrupter`] (how to get a vCPU thread out of `KVM_RUN`).
//! 2. After creating the VM and before creating vCPUs: [`PvSpin::configure_vm`].
//! 3. For each vCPU, after creating it: [`PvSpin::configure_vcpu`], which returns the
//!    [`VcpuHooks`] that vCPU's thread owns.
//! 4. In the vCPU loop: [`VcpuHooks::before_run`], `KVM_RUN`, then offer the exit to
//!    [`VcpuHooks::handle_exit`] (pvspin says whether it handled it), then
//!    [`VcpuHooks::after_run`].
//!
//! ```no_run
//! use std::sync::Arc;
//! # use kvm_ioctls::{Kvm, VcpuExit};
//! # #[derive(Debug)] struct MyInterrupter;
//! # impl pvspin::VcpuInterrupter for MyInterrupter { fn interrupt(&self, _: usize) {} }
//! let pvspin = pvspin::PvSpin::builder()
//!     .vcpus(2)
//!     .interrupter(Arc::new(MyInterrupter))
//!     .build()?;
//! let kvm = Kvm::new()?;
//! let vm = kvm.create_vm()?;
//! pvspin.configure_vm(&vm)?;
//! let mut vcpu = vm.create_vcpu(0)?;
//! let mut hooks = pvspin.configure_vcpu(0, &vcpu)?;
//! loop {
//!     hooks.before_run();
//!     let exit = vcpu.run();
//!     let outcome = hooks.handle_exit(&exit);
//!     if outcome == pvspin::ExitOutcome::NotHandled {
//!         match exit {
//!             Ok(VcpuExit::Hlt) => break,
//!             _ => { /* the VMM's own devices */ }
//!         }
//!     }
//!     hooks.after_run();
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **What pvspin does through these hooks today:** VM setup turns KVM's FIX_HYPERCALL_INSN
//! quirk off (a stray hypercall faults instead of livelocking a host CPU), and the hooks keep
//! per-vCPU counters of runs, exits by kind and time spent in `KVM_RUN` ([`VcpuCounters`]).
//! **Not implemented yet** (each comes with its crate): the kick doorbell and its wake paths
//! (`pvspin-kick`), spin notifications and directed yield (`pvspin-pause`, `pvspin-track`),
//! scheduler hints (`pvspin-hints`) and the placement-driven paravirt plan (`pvspin-kvm`).
#![deny(missing_docs)]

mod counters;
mod hooks;

use std::fmt::Debug;
use std::sync::Arc;

pub use counters::{ExitKind, VcpuCounters};
pub use hooks::{ExitOutcome, VcpuHooks};
use kvm_ioctls::{VcpuFd, VmFd};
use pvspin_kvm::quirks::{self, QuirkError};

use crate::counters::SharedCounters;

/// The most vCPUs pvspin manages in one VM (KVM's own `KVM_MAX_VCPUS` on x86 is 1024 or 4096).
pub const MAX_VCPUS: usize = 4096;

/// What pvspin needs from the VMM: a way to force a vCPU thread out of `KVM_RUN`.
///
/// The usual implementation sets `immediate_exit` in the vCPU's `kvm_run` and signals its
/// thread (Firecracker and Cloud Hypervisor do the same). It must be cheap, must not block, and
/// may be called from any thread, including other vCPU threads.
pub trait VcpuInterrupter: Send + Sync + Debug {
    /// Makes vCPU `index` return from `KVM_RUN` soon; a no-op for an index that does not exist.
    fn interrupt(&self, index: usize);
}

/// Invalid configuration given to the builder or the hooks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// `vcpus` was never set.
    #[error("the number of vCPUs must be set (PvSpinBuilder::vcpus)")]
    MissingVcpus,
    /// `vcpus` out of range.
    #[error("the number of vCPUs must be between 1 and {max}, got {got}")]
    VcpuCount {
        /// What was asked for.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// No interrupter was given.
    #[error("a VcpuInterrupter must be set (PvSpinBuilder::interrupter): pvspin must be able to get a vCPU out of KVM_RUN")]
    MissingInterrupter,
    /// A vCPU index at or beyond the configured count.
    #[error("vCPU index {index} is out of range: the VM was configured with {vcpus} vCPUs")]
    VcpuIndex {
        /// The index given.
        index: usize,
        /// The configured count.
        vcpus: usize,
    },
    /// `configure_vcpu` called twice for one index.
    #[error("vCPU {0} is already configured: configure_vcpu must be called once per vCPU")]
    VcpuConfiguredTwice(usize),
}

/// Errors from the setup hooks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A KVM quirk could not be changed.
    #[error("configuring KVM quirks: {0}")]
    Quirk(#[from] QuirkError),
}

/// Builds a [`PvSpin`].
#[derive(Debug, Default)]
pub struct PvSpinBuilder {
    vcpus: Option<usize>,
    interrupter: Option<Arc<dyn VcpuInterrupter>>,
    keep_hypercall_quirk: bool,
}

impl PvSpinBuilder {
    /// Number of vCPUs in the VM (required).
    pub fn vcpus(mut self, vcpus: usize) -> Self {
        self.vcpus = Some(vcpus);
        self
    }

    /// How pvspin interrupts a vCPU thread (required).
    pub fn interrupter(mut self, interrupter: Arc<dyn VcpuInterrupter>) -> Self {
        self.interrupter = Some(interrupter);
        self
    }

    /// Leaves KVM's FIX_HYPERCALL_INSN quirk on (it is turned off by default, so that a stray
    /// hypercall raises #UD instead of looping in KVM on hosts that emulate guest code).
    pub fn keep_hypercall_quirk(mut self, keep: bool) -> Self {
        self.keep_hypercall_quirk = keep;
        self
    }

    /// Validates the configuration.
    pub fn build(self) -> Result<PvSpin, ConfigError> {
        let vcpus = self.vcpus.ok_or(ConfigError::MissingVcpus)?;
        if vcpus == 0 || vcpus > MAX_VCPUS {
            return Err(ConfigError::VcpuCount {
                got: vcpus,
                max: MAX_VCPUS,
            });
        }
        let interrupter = self.interrupter.ok_or(ConfigError::MissingInterrupter)?;
        Ok(PvSpin {
            interrupter,
            keep_hypercall_quirk: self.keep_hypercall_quirk,
            counters: (0..vcpus).map(|_| Arc::default()).collect(),
            configured: (0..vcpus)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        })
    }
}

/// What [`PvSpin::configure_vm`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmSetup {
    /// Whether KVM's FIX_HYPERCALL_INSN quirk is now off.
    pub hypercall_quirk_disabled: bool,
}

/// pvspin for one VM: the composed parts and the hooks' shared state.
#[derive(Debug)]
pub struct PvSpin {
    interrupter: Arc<dyn VcpuInterrupter>,
    keep_hypercall_quirk: bool,
    counters: Vec<Arc<SharedCounters>>,
    configured: Vec<std::sync::atomic::AtomicBool>,
}

impl PvSpin {
    /// Starts building.
    pub fn builder() -> PvSpinBuilder {
        PvSpinBuilder::default()
    }

    /// Number of vCPUs.
    pub fn vcpus(&self) -> usize {
        self.counters.len()
    }

    /// VM-stage setup: call after creating the VM, before creating any vCPU.
    pub fn configure_vm(&self, vm: &VmFd) -> Result<VmSetup, Error> {
        let hypercall_quirk_disabled = if self.keep_hypercall_quirk {
            false
        } else {
            quirks::disable_fix_hypercall_insn(vm)?;
            true
        };
        Ok(VmSetup {
            hypercall_quirk_disabled,
        })
    }

    /// vCPU-stage setup: call once per vCPU after creating it. The returned hooks belong to
    /// that vCPU's thread.
    pub fn configure_vcpu(&self, index: usize, _vcpu: &VcpuFd) -> Result<VcpuHooks, Error> {
        let configured = self.configured.get(index).ok_or(ConfigError::VcpuIndex {
            index,
            vcpus: self.vcpus(),
        })?;
        if configured.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(ConfigError::VcpuConfiguredTwice(index).into());
        }
        Ok(VcpuHooks::new(index, self.counters[index].clone()))
    }

    /// Forces vCPU `index` out of `KVM_RUN` through the VMM's [`VcpuInterrupter`].
    pub fn interrupt(&self, index: usize) {
        if index < self.vcpus() {
            self.interrupter.interrupt(index);
        }
    }

    /// A snapshot of vCPU `index`'s counters, readable from any thread.
    pub fn vcpu_counters(&self, index: usize) -> Option<VcpuCounters> {
        self.counters.get(index).map(|counters| counters.snapshot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct CountingInterrupter(std::sync::atomic::AtomicUsize);

    impl VcpuInterrupter for CountingInterrupter {
        fn interrupt(&self, _index: usize) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn builder_refuses_invalid_configuration_naming_the_rule() {
        let interrupter = Arc::new(CountingInterrupter::default());
        assert_eq!(
            PvSpin::builder().build().unwrap_err(),
            ConfigError::MissingVcpus
        );
        assert_eq!(
            PvSpin::builder()
                .vcpus(0)
                .interrupter(interrupter.clone())
                .build()
                .unwrap_err(),
            ConfigError::VcpuCount {
                got: 0,
                max: MAX_VCPUS
            }
        );
        assert!(PvSpin::builder()
            .vcpus(MAX_VCPUS + 1)
            .interrupter(interrupter.clone())
            .build()
            .unwrap_err()
            .to_string()
            .contains("between 1 and 4096"));
        assert_eq!(
            PvSpin::builder().vcpus(2).build().unwrap_err(),
            ConfigError::MissingInterrupter
        );
        assert_eq!(
            PvSpin::builder()
                .vcpus(2)
                .interrupter(interrupter)
                .build()
                .unwrap()
                .vcpus(),
            2
        );
    }

    #[test]
    fn interrupt_forwards_valid_indexes_only() {
        let interrupter = Arc::new(CountingInterrupter::default());
        let pvspin = PvSpin::builder()
            .vcpus(2)
            .interrupter(interrupter.clone())
            .build()
            .unwrap();
        pvspin.interrupt(1);
        pvspin.interrupt(2);
        assert_eq!(interrupter.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(pvspin.vcpu_counters(1).is_some());
        assert!(pvspin.vcpu_counters(2).is_none());
    }
}
