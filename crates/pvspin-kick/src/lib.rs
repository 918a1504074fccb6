//! The pvspin kick device: the doorbell a guest rings to wake a halted vCPU.
//!
//! KVM's own `KVM_HC_KICK_CPU` hypercall never reaches a userspace VMM, so pvspin's kick is a
//! port-I/O doorbell (the layout is in `pvspin-abi` and `docs/abi.md`): a 32-bit `OUT` of the
//! target vCPU index to the KICK port. This crate decodes doorbell writes, with every guest
//! value bounds-checked ([`decode()`], [`Reject`]), counts and rate-limits what it ignores, and
//! wakes the target through one of three paths ([`KickPath`]):
//!
//! - **in-kernel**: the KICK port is an ioeventfd per target (datamatch = target) wired to an
//!   irqfd routed to a REMRD MSI at the target's APIC ID; KVM latches `pv_unhalted` exactly as
//!   for `KVM_HC_KICK_CPU`, and no userspace exit happens (the wiring is the VMM's, built by
//!   the `pvspin` crate: `PvSpin::kick_wiring`);
//! - **signal-msi**: the doorbell exits to userspace and the device sends the same REMRD MSI
//!   through a [`RemrdSink`] (`pvspin::VmMsiSink` over a VM fd);
//! - **userspace**: no in-kernel irqchip; `KVM_EXIT_HLT` parks the vCPU thread on its
//!   [`WakeLatch`], and a kick sets the latch (a kick before the halt is remembered).
//!
//! This crate knows nothing of KVM: it depends on `pvspin-abi` only; its edges are the
//! [`RemrdSink`] trait (send an MSI) and plain calls from the VMM's exit handling. The KVM
//! setup around it (irqchip, GSI routes, ioeventfds, CPUID) is the `pvspin` crate's
//! (`docs/embedding.md`).
//!
//! # What the VMM calls, and when
//!
//! | stage | in-kernel | signal-msi | userspace |
//! |---|---|---|---|
//! | VM created | [`KickDevice::in_kernel`]; the VMM's irqchip and kick routes | [`KickDevice::signal_msi`] with a [`RemrdSink`] | [`KickDevice::userspace`] |
//! | each vCPU created | CPUID: the leaves of [`KickDevice::cpuid_info`] | same | CPUID only |
//! | `KVM_EXIT_IO` out | [`KickDevice::handle_pio_write`] (only bad writes arrive) | same (every kick arrives) | same |
//! | `KVM_EXIT_IO` in | [`KickDevice::handle_pio_read`] | same | same |
//! | `KVM_EXIT_HLT` | (never exits) | (never exits) | [`KickDevice::handle_hlt`] |
//! | stop | signal + `immediate_exit` | same | [`KickDevice::shutdown`], then as the others |
//!
//! Loom model of the latch: `RUSTFLAGS="--cfg loom" cargo test -p pvspin-kick --release --lib
//! loom`.
//!
//! SPIN notifications and spin-window reads are decoded, bounds-checked and, when the
//! configuration enables `FEATURE_SPIN_NOTIFY`, forwarded to the VMM ([`Handled::Forward`]);
//! the embedding API (`pvspin`) acts on them (directed yield, adaptive window).
//! **Not implemented yet:** the reserved SHARED_PAGE command is decoded and forwarded when
//! enabled, but nothing acts on it. vCPU index and APIC ID are assumed equal (an ABI rule), and the MSI paths address
//! at most 256 vCPUs (xAPIC physical destination).
#![deny(missing_docs)]

mod sync;

#[cfg(not(loom))]
pub mod decode;
#[cfg(not(loom))]
pub mod device;
pub mod latch;
#[cfg(not(loom))]
pub mod ratelimit;

#[cfg(not(loom))]
pub use decode::{decode, Command, Reject};
#[cfg(not(loom))]
pub use device::{
    Delivery, Handled, KickConfig, KickDevice, KickError, KickPath, KickStats, PioOutcome,
    RemrdSink, SinkError, MAX_VCPUS,
};
#[cfg(not(loom))]
pub use latch::ParkPolicy;
pub use latch::{KickResult, ParkOutcome, WakeLatch};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
