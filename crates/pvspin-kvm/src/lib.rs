//! pvspin's KVM setup, and a reader for KVM's binary statistics.
//!
//! For stock guests (Linux with its own PV spinlocks) and pvspin-aware guests alike:
//!
//! | module | what |
//! |---|---|
//! | [`plan`] | a placement-driven plan for the paravirtual CPUID leaf, exit disabling, halt polling and quirks, validated before it is applied ([`plan::Plan::new`]), then applied in the order KVM requires ([`plan::apply_vm`], [`plan::apply_vcpu`]) |
//! | [`guest`] | what stock Linux guests do with the plan's CPUID, per kernel line ([`guest::GuestKernel`], [`guest::GuestKernel::from_release`]; `docs/stock-guests.md`) |
//! | [`quirks`] | KVM's quirks pvspin turns off (`FIX_HYPERCALL_INSN`), keeping the VMM's own |
//! | [`irqchip`] | what the in-kernel and signal-msi kick paths need: in-kernel irqchip, MP state of the APs, LAPIC refresh, ioeventfd + irqfd routes to REMRD MSIs |
//! | [`stats`] | KVM's binary statistics (`KVM_GET_STATS_FD`): snapshots, deltas, JSON, and one statistic read cheaply ([`stats::StatsFd::value_reader`]) |
//!
//! The README has the plan (pure) and the order KVM requires as compiling examples. pvspin's
//! own counters, and the telemetry snapshot that merges them with KVM's statistics (JSON,
//! Prometheus), are the `pvspin` crate's (`pvspin::PvSpin::telemetry`, `pvspin::telemetry`).
#![deny(missing_docs)]

pub mod guest;
pub mod irqchip;
pub mod plan;
pub mod quirks;
pub mod stats;

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
