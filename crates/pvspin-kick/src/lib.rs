//! The pvspin kick device: the doorbell a guest rings to wake a halted vCPU.
//!
//! KVM's own `KVM_HC_KICK_CPU` hypercall never reaches a userspace VMM, so pvspin's kick is a
//! port-I/O doorbell (the layout is in `pvspin-abi` and `docs/abi.md`): a 32-bit `OUT` of the
//! target vCPU index to the KICK port. This crate decodes doorbell accesses with every guest
//! value bounds-checked, counts and rate-limits what it ignores, and wakes the target through
//! one of three paths ([`KickPath`]): **in-kernel** (an ioeventfd per target wired to an irqfd
//! routed to a REMRD MSI: KVM latches `pv_unhalted` as for `KVM_HC_KICK_CPU`, no userspace exit;
//! the wiring is the VMM's, built by `pvspin`), **signal-msi** (the doorbell exits and the
//! device sends the same MSI through a [`RemrdSink`]), and **userspace** (no in-kernel irqchip:
//! `KVM_EXIT_HLT` parks the vCPU thread on its [`WakeLatch`], which remembers an early kick).
//! It knows nothing of KVM: its edges are [`RemrdSink`] and plain calls from the VMM's exit
//! handling.
//!
//! | module | what |
//! |---|---|
//! | [`decode`](mod@decode) | a doorbell access to a [`Command`], or a [`Reject`] ([`decode()`]) |
//! | [`device`] | [`KickDevice`]: the three paths, commands forwarded to the VMM, [`KickStats`] |
//! | [`latch`] | [`WakeLatch`]: the userspace path's per-vCPU latch (one remembered kick) |
//! | [`ratelimit`] | one log line per reject reason per interval |
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
//! SPIN notifications, spin-window reads, SHARED_PAGE (hint page) registrations and WAIT
//! commands are decoded, bounds-checked and, when [`KickConfig::extra_commands`] enables them,
//! forwarded to the VMM ([`Handled::Forward`]); the embedding API `pvspin` acts on them
//! (directed yield and the adaptive window, hint pages, waits without `HLT`). vCPU index and
//! APIC ID are assumed equal (an ABI rule), so a device serves at most 255 vCPUs on every path
//! ([`MAX_VCPUS`]: the MSI paths address xAPIC IDs, 0xFF is broadcast). The wake paths, their checks and costs are in `docs/kick.md`; the
//! loom model of the latch runs with
//! `RUSTFLAGS="--cfg loom" cargo test -p pvspin-kick --release --lib loom`.
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
