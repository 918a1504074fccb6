//! A deterministic discrete-event simulator of pvspin on hosts we do not have.
//!
//! It models host CPUs under a CFS-like fair scheduler (weights, slices, wake-up preemption,
//! CPU hogs, cgroup quota throttling), VMs whose vCPU threads run a guest lock workload
//! (ticket, TAS, backoff, MCS queued, Linux's pv qspinlock as a stock guest runs it; critical
//! and non-critical sections; PV wait and kick), and the VMM's pvspin hooks ([`engine`]).
//! pvspin's own policies decide, unchanged: `pvspin_slots::RunSlots`,
//! `pvspin_hints::PageBudgets`, `pvspin_yield::DirectedYield` over a `pvspin_track::VcpuBoard`,
//! `pvspin_yield::BoostTrial`.
//! Every cost comes from one documented struct ([`CostModel`]) with the source of each number.
//!
//! ```
//! use pvspin_sim::{Sim, SimConfig, Variant};
//!
//! let variant: Variant = "ticket:kick:in-kernel".parse()?;
//! let mut cfg = SimConfig::new(variant, 2, 1000); // 2 vCPUs on 2 CPUs, 1000 acquisitions each
//! cfg.hogs = 2;                                     // 2x overcommit
//! let report = Sim::new(cfg)?.run();
//! assert!(report.finished);
//! assert_eq!(report.acquisitions(), 2000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The same configuration and seed give the same report. How well it matches real runs, and
//! the tables at scale: `docs/simulator.md`. The binary: `pvspin-sim run | sweep | validate`.
#![deny(missing_docs)]

pub mod config;
pub mod cost;
pub mod engine;
pub mod measured;
pub mod rng;
pub(crate) mod sched;
pub mod sweep;

pub use config::{ConfigError, Guest, KickPath, LockKind, PvMode, SimConfig, Variant};
pub use cost::{CostModel, Span};
pub use engine::{Report, Sim, SimError, VmReport};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
