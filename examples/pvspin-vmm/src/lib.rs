//! `pvspin-vmm`: an example VMM that runs pvspin guest workloads on /dev/kvm.
//!
//! It is what a rust-vmm VMM adopting pvspin looks like: guest memory with vm-memory, one
//! thread per vCPU with kvm-ioctls, a 16550 console from vm-superio, an event-manager loop for
//! the VMM's own events (end of run, the watchdog timer), and pvspin used only through its
//! embedding API (`pvspin::PvSpin`). It also reproduces the lock-holder-preemption
//! experiment: busy host threads (`--hogs`) compete with the vCPUs for host CPUs.
#![deny(missing_docs)]

pub mod bench;
pub mod cgroup;
pub mod cli;
pub mod config;
pub mod devices;
pub mod memory;
pub mod plot;
pub mod pvh;
pub mod report;
pub mod saved;
pub mod seccomp;
pub mod suite;
pub mod vcpu;
pub mod vhost;
pub mod virtio_mmio;
pub mod vmm;

pub use config::{PvMode, RunConfig, RunConfigError};
pub use report::RunReport;
pub use vmm::{run, RunError};
