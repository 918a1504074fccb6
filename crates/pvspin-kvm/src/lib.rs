//! pvspin's KVM setup, and a reader for KVM's binary statistics.
//!
//! For stock guests (Linux with its own PV spinlocks) and pvspin-aware guests alike: a
//! placement-driven plan for the paravirtual CPUID leaf, exit disabling, halt polling and
//! quirks, validated before it is applied ([`plan`]); and a reader for KVM's binary statistics
//! (`KVM_GET_STATS_FD`, [`stats`]). pvspin's own counters, and the telemetry snapshot that
//! merges them with KVM's stats (JSON, Prometheus), are the `pvspin` crate's
//! (`pvspin::PvSpin::telemetry`, `pvspin::telemetry`).
//!
//! **Implemented:** [`quirks`], [`plan`], [`guest`] (what stock Linux guests do with the plan's
//! CPUID, per kernel line: `docs/stock-guests.md`), [`stats`], and [`irqchip`]: the setup the
//! in-kernel and signal-msi kick paths need (in-kernel irqchip, MP state of the APs, LAPIC
//! refresh, ioeventfd + irqfd routes to REMRD MSIs).
//!
//! # The order KVM requires
//!
//! ```no_run
//! use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
//! use pvspin_kvm::plan::{apply_vcpu, apply_vm, HostCaps, Placement, Plan, PlanRequest};
//! use pvspin_kvm::stats::StatsFd;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let kvm = kvm_ioctls::Kvm::new()?;
//! let vm = kvm.create_vm()?;
//! // 1. Plan: pure, refuses invalid combinations with the rule's name.
//! let mut req = PlanRequest::new(Placement::Overcommitted, 2);
//! req.host_cpus = Some(2);
//! let plan = Plan::new(&req, &HostCaps::probe(&kvm, &vm)?)?;
//! println!("{plan}");
//! // 2. VM stage: after KVM_CREATE_VM, before the first KVM_CREATE_VCPU.
//! println!("{}", apply_vm(&plan, &vm, 0)?);
//! // 3. vCPU stage: on each vCPU, before its first KVM_RUN.
//! let vcpu = vm.create_vcpu(0)?;
//! let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
//! println!("{}", apply_vcpu(&plan, &vcpu, &mut cpuid)?);
//! // 4. KVM's statistics: stats fds opened once, read before and after the run.
//! let stats = StatsFd::for_vcpu(&vcpu)?;
//! let before = stats.read()?;
//! // ... run the guest ...
//! let delta = stats.read()?.delta(&before)?;
//! println!(
//!     "halt exits +{:?}, halt wake-ups +{:?}",
//!     delta.value("halt_exits"),
//!     delta.value("halt_wakeup")
//! );
//! println!("{}", serde_json::to_string(&StatsFd::for_vm(&vm)?.read()?)?);
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod guest;
pub mod irqchip;
pub mod plan;
pub mod quirks;
pub mod stats;

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
