//! pvspin's KVM setup and telemetry.
//!
//! For stock guests (Linux with its own PV spinlocks) and pvspin-aware guests alike: a
//! placement-driven plan for the paravirtual CPUID leaf, exit disabling, halt polling and
//! quirks, validated before it is applied; the setup the kick paths need (in-kernel irqchip,
//! MP state of the APs, LAPIC refresh); and a reader for KVM's binary statistics
//! (`KVM_GET_STATS_FD`).
//!
//! **Implemented so far:** [`quirks`], the one quirk every pvspin VM needs off. The plan, the
//! kick setup and the statistics reader are not implemented yet.
#![deny(missing_docs)]

pub mod irqchip;
pub mod quirks;
