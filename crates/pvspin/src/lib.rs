//! pvspin's embedding API: paravirtual spinlocks and lock-holder-aware vCPU scheduling for a
//! KVM-based VMM built on rust-vmm crates. The VMM keeps its threads, memory, device model and
//! VM-wide KVM state; pvspin asks for what it needs and plugs in through a few hooks:
//!
//! 1. [`PvSpin::builder`]: the number of vCPUs, a [`VcpuInterrupter`] (how to get a vCPU thread
//!    out of `KVM_RUN`; [`SignalInterrupter`] is a ready one) and the features wanted.
//! 2. After `KVM_CREATE_VM`, before the first vCPU: [`PvSpin::configure_vm`]. The VMM creates
//!    its irqchip as always and, for the in-kernel kick path, gives GSIs
//!    ([`PvSpin::set_kick_gsis`]), merges [`KickWiring::routes`] into its routing table, checks
//!    each table it applies ([`PvSpin::check_routes`]) and registers the eventfds
//!    ([`KickWiring::register`] or its own calls).
//! 3. For each vCPU: [`PvSpin::edit_cpuid`] (pure) on the VMM's CPUID, its `KVM_SET_CPUID2`,
//!    then [`PvSpin::configure_vcpu`], which checks the rules and returns the vCPU's
//!    [`VcpuHooks`]. pvspin changes no MP state: APs start as the VMM starts them.
//! 4. In each vCPU's loop: [`VcpuHooks::before_run`], `KVM_RUN`, [`VcpuHooks::handle_exit`]
//!    (or [`PvSpin::doorbell_pio`] on the VMM's port-I/O bus), [`VcpuHooks::after_run`].
//! 5. When the VM stops: [`PvSpin::shutdown`], before interrupting the vCPU threads. Any time:
//!    [`PvSpin::telemetry`], and [`PvSpin::check`]: the adopter mistakes that show only at run
//!    time ([`Problem`], each counted, logged once and named by its rule; `docs/embedding.md`,
//!    "Adopter's mistakes").
//!
//! | module | what |
//! |---|---|
//! | crate root | [`VcpuInterrupter`], [`MAX_VCPUS`], and the re-exports below |
//! | `builder` | [`PvSpinBuilder`], typed by its kick path ([`NoKick`], [`WithKick`]), and its options ([`KickOptions`], [`DirectedYieldOptions`] with its [`ActuatorKind`], [`HintOptions`], [`WaitOptions`], [`SlotConfig`], [`PlanRequest`]) |
//! | `vm` | [`PvSpin`] (one VM: `configure_vm`, `edit_cpuid`, `configure_vcpu`, `telemetry`, `check`, `shutdown`), [`VmSetup`] |
//! | `hooks` | [`VcpuHooks`], [`ExitOutcome`] |
//! | `kick` | [`KickWiring`] and the kick routes |
//! | `error` | [`ConfigError`] (a broken rule, named), [`ParseActuatorError`], [`Error`] (a failed setup call, its cause typed) |
//! | [`cpuid`] | pure CPUID edits: pvspin's leaves and the kick-index rule |
//! | [`interrupt`] | [`SignalInterrupter`]: a signal that makes a vCPU thread leave `KVM_RUN` |
//! | [`seccomp`] | pvspin's system calls per thread kind, as `seccompiler` rules to merge into the VMM's filters ([`PvSpinBuilder::helper_thread_filter`] confines pvspin's own threads) |
//! | `embed` | for a VMM that keeps pvspin behind its own abstractions (Cloud Hypervisor): [`PvspinOptions`] (the operator's choices as a `key=value` option or a config-file field, and the builder they make), [`VcpuHooks::after_kvm_run`], [`VmTelemetry::counter_groups`] |
//! | [`simple`] | the VMM's part of steps 2 and 3, for a VMM without irqchip, routes or CPUID of its own |
//! | [`telemetry`] | one snapshot of pvspin's and KVM's counters per VM, as JSON or Prometheus text |
//!
//! The README has the hooks in a vCPU loop as a compiling example. In the repository,
//! `docs/embedding.md` adopts pvspin call by call (seccomp included), and
//! `docs/architecture.md` says what each builder option makes the hooks do (the kick doorbell,
//! directed yield, hint pages, WAIT, run slots, KVM's paravirt plan) and what is not
//! implemented yet.
#![deny(missing_docs)]

mod builder;
mod check;
pub mod cpuid;
mod directed;
mod embed;
mod error;
mod hints;
mod hooks;
pub mod interrupt;
mod kick;
mod pio;
pub mod seccomp;
pub mod simple;
mod slots;
pub mod telemetry;
mod vm;

pub use builder::{KickChoice, NoKick, PvSpinBuilder, WithKick};
pub use check::{Problem, ProblemKind};
pub use directed::{ActuatorKind, DirectedYieldOptions, DirectedYieldStats, StealTimeMemory};
pub use embed::{kick_path_option, OptionsError, PvspinOptions};
pub use error::{ConfigError, CpuidFault, Error, ParseActuatorError};
pub use hints::{HintOptions, HintStats, WaitOptions};
pub use interrupt::{SignalCollision, SignalInterrupter, VcpuThread};
pub use kick::{
    KickIoEvent, KickOptions, KickWiring, RouteFault, RouteFaults, VmMsiSink, DEFAULT_PARK_BOUND,
    MAX_GSI,
};
pub use pio::DoorbellPio;
pub use pvspin_hints::confine;
pub use pvspin_hints::proc;
#[cfg(feature = "test-utils")]
pub use pvspin_hints::BufferPageMap;
pub use pvspin_hints::GuestPageMap;
pub use pvspin_hints::DEFAULT_ACTUATOR;
pub use pvspin_hints::{Confinement, Verdict};
pub use pvspin_kick::{KickPath, KickStats, Reject};
pub use pvspin_slots::{entitled_cpus, SlotConfig, SlotStats};
pub use pvspin_yield::BudgetConfig;
pub use pvspin_yield::{PolicyConfig, WindowConfig};
pub use vm::{PvSpin, VmSetup};

use std::fmt::Debug;

pub use hooks::{ExitOutcome, VcpuHooks};
pub use pvspin_kvm::irqchip::IrqchipError;
pub use pvspin_kvm::plan::{
    AppliedVcpu, AppliedVm, CpuidEdit, ExitFlags, GuestKernel, HaltPoll, Placement, Plan,
    PlanError, PlanRequest, PvFeatures,
};
pub use pvspin_kvm::quirks::QuirkError;
pub use pvspin_kvm::stats::{Descriptor, Snapshot, Stat, StatKind, StatUnit};
pub use pvspin_track::CplError;
pub use pvspin_yield::TrialStats;

pub use crate::telemetry::{
    Budgets, ExitCounts, ExitKind, KickCounts, KickDeviceTelemetry, LatencyHistogram,
    PvspinVcpuCounters, TelemetryError, TelemetryFormat, VcpuTelemetry, VcpuYieldCounts,
    VmTelemetry,
};

/// The most vCPUs pvspin manages in one VM: the ABI's [`pvspin_abi::MAX_VCPUS`] (255). A
/// kick names the vCPU's initial APIC ID (8 bits) and is delivered as a REMRD MSI to that
/// xAPIC ID, where 0xFF is broadcast; x2APIC IDs (more vCPUs) are not supported.
pub const MAX_VCPUS: usize = pvspin_abi::MAX_VCPUS as usize;
// The MSI kick paths reach every vCPU pvspin accepts.
const _: () = assert!(MAX_VCPUS <= pvspin_kvm::irqchip::MAX_MSI_APIC_ID as usize + 1);

/// What pvspin needs from the VMM: a way to force a vCPU thread out of `KVM_RUN`.
///
/// The usual implementation sets `immediate_exit` in the vCPU's `kvm_run` and signals its
/// thread (Firecracker and Cloud Hypervisor do the same). It must be cheap, must not block, and
/// may be called from any thread, including other vCPU threads.
pub trait VcpuInterrupter: Send + Sync + Debug {
    /// Makes vCPU `index` return from `KVM_RUN` soon; a no-op for an index that does not exist.
    fn interrupt(&self, index: usize);

    /// Whether the signal this interrupter sends is shared with another handler in the
    /// process ([`SignalInterrupter::collision`]); [`PvSpin::check`] lists it. `None` (the
    /// default) for interrupters without a signal of their own; a VMM that wraps a
    /// [`SignalInterrupter`] forwards it.
    fn signal_collision(&self) -> Option<SignalCollision> {
        None
    }
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
