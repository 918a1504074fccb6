//! `pvspind`'s library: the pvspin virtio device ([`pvspin_abi::virtio`]) served over
//! vhost-user, for VMMs (QEMU, crosvm, Cloud Hypervisor...) that cannot link pvspin but can
//! attach a vhost-user device backend.
//!
//! - [`backend`]: the device for one frontend ([`backend::PvspinBackend`]): KICK queues
//!   answered on the same queue's call eventfd, SPIN queues read the notifier's hint page and
//!   hand the decision to the [`yield_policy`], the control queue registers hint pages and
//!   writes their host line.
//! - [`transport`]: vhost-user for one frontend (the `vhost` crate's request handler over
//!   pvspind's own, and one queue worker thread over every queue's kick eventfd): 256
//!   queues, 255 vCPUs.
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
//! [`config::TRANSPORT_MAX_VCPUS`] (255) vCPUs per device, and above 127 only the first
//! `255 - M` have spin queues (`pvspin_abi::virtio::spin_queues`: the layout fits
//! vhost-user's 256 queues); boosts need the daemon to be allowed to lower nice values
//! (`CAP_SYS_NICE` or `RLIMIT_NICE`).
#![deny(missing_docs)]

pub mod backend;
pub mod cli;
pub mod config;
pub mod sched;
pub mod server;
pub mod telemetry;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod transport;
pub mod yield_policy;

pub use backend::PvspinBackend;
pub use config::{BackendConfig, BudgetsUs, YieldMode};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
