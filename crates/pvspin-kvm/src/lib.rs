//! pvspin's KVM setup and telemetry.
//!
//! For stock guests (Linux with its own PV spinlocks) and pvspin-aware guests alike: a
//! placement-driven plan for the paravirtual CPUID leaf, exit disabling, halt polling and
//! quirks, validated before it is applied ([`plan`]); a reader for KVM's binary statistics
//! (`KVM_GET_STATS_FD`, [`stats`]); and the telemetry snapshot that merges pvspin's own
//! counters with KVM's, rendered as JSON or Prometheus text ([`telemetry`]).
//!
//! **Implemented:** [`quirks`], [`plan`], [`stats`], [`telemetry`]. **Not implemented here
//! yet:** the kick setup (in-kernel irqchip, MP state of the APs, LAPIC refresh).
#![deny(missing_docs)]

pub mod plan;
pub mod quirks;
pub mod stats;
pub mod telemetry;
