//! `pvspind`'s library: the pvspin virtio device ([`pvspin_abi::virtio`]) served over
//! vhost-user, for VMMs (QEMU, crosvm, Cloud Hypervisor...) that cannot link pvspin but can
//! attach a vhost-user device backend.
//!
//! - [`backend`]: the device for one frontend ([`backend::PvspinBackend`], a
//!   `vhost_user_backend::VhostUserBackend`): KICK queues answered on the same queue's call
//!   eventfd, SPIN queues read the notifier's hint page and hand the decision to the
//!   [`yield_policy`], the control queue registers hint pages and writes their host line.
//! - [`yield_policy`]: directed yield from outside the VMM (deboost the spinner, boost the
//!   waited-for vCPU only when the frontend is confined to its own cpu cgroup), restored at
//!   deadlines.
//! - [`telemetry`]: per-VM and host-wide counters as JSON and Prometheus text.
//! - [`cli`]: `pvspind`'s command line and process entry point.
//! - [`server`]: the daemon's sockets (one frontend at a time per socket, a fresh backend per
//!   connection), peer credentials, the telemetry control socket and shutdown.
//!
//! - [`sched`]: who runs, seen from outside the VMM: the vCPU threads sampled in `/proc`, so
//!   that the backend knows whether a spin notification's target was descheduled and, when
//!   asked ([`config::BackendConfig::flag_not_running`]), sets `NOT_RUNNING` in the hint pages
//!   of descheduled vCPUs.
//!
//! The backend adapts the hint pages' time budgets with pvspin's own code
//! (`pvspin_hints::PageBudgets`, which the in-process host runs too), from the guests' wait
//! reports (taken at kicks, spin notifications and samples) and from whether a spin
//! notification's target was descheduled.
//!
//! **Not implemented:** `VIRTIO_RING_F_EVENT_IDX` and indirect descriptors are not offered;
//! no live migration or device-state transfer; no run slots (an out-of-process backend cannot
//! gate the VMM's vCPU threads: `docs/vhost-user.md`, "What an out-of-process backend cannot
//! do"); `NOT_RUNNING` is a sample up to one period old, not exact; at most
//! [`config::TRANSPORT_MAX_VCPUS`] vCPUs per device (vhost-user-backend's workers reach queues
//! 0..=63 only; vhost-user itself allows 256 queues, 127 vCPUs); boosts need the daemon to be
//! allowed to lower nice values (`CAP_SYS_NICE` or `RLIMIT_NICE`); enabling a kick queue may
//! deliver one spurious wake-up to its vCPU (vhost-user-backend processes every queue once
//! when it is enabled; the ABI allows spurious wake-ups).
#![deny(missing_docs)]

pub mod backend;
pub mod cli;
pub mod config;
pub mod sched;
pub mod server;
pub mod telemetry;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod yield_policy;

pub use backend::PvspinBackend;
pub use config::{BackendConfig, BudgetsUs, YieldMode};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
