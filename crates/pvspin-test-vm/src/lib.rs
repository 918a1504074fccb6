//! `pvspin-test-vm`: the test VM that pvspin's example VMMs, integration tests and fuzz
//! targets run. A small rust-vmm VMM (vm-memory, kvm-ioctls, vm-superio, event-manager,
//! linux-loader, vhost) that boots its own bare-metal guest program, runs one lock or
//! ping-pong workload on it with pvspin adopted through its embedding API, and reports.
//!
//! | module | what |
//! |---|---|
//! | [`config`] | [`RunConfig`] (one run: workload, vCPUs, pvspin's options) and its validation ([`RunConfigError`]) |
//! | [`vmm`] | [`run`] a VM to its end ([`RunError`]), [`GUEST_IMAGE`], the guest's boot parameters |
//! | [`vcpu`] | the vCPU threads: run loop, interruption, register snapshots |
//! | [`memory`] | guest memory, long-mode tables, loading the guest image |
//! | [`pvh`] | the PVH boot protocol: start info, ACPI tables, the kernel command line |
//! | [`devices`] | the port-I/O bus: 16550 UART, exit port, power-off and reset |
//! | [`virtio_mmio`] | the registers of a virtio-mmio transport, as pure state |
//! | [`vhost`] | the pvspin virtio device served by a vhost-user backend (`pvspind`) |
//! | [`seccomp`] | a seccomp filter per VMM thread, merged with pvspin's rules |
//! | [`cgroup`] | the VMM process in a cpu cgroup of its own |
//! | [`report`] | [`RunReport`]: one human line, one JSON line, per-vCPU details |
//! | [`proto`] | the boot and result protocol shared with the guest program (`pvspin-test-vm-proto`) |
//!
//! The guest program (`guest/`, bare-metal x86-64) is built by this crate's build script and
//! embedded as [`GUEST_IMAGE`].
//!
//! ```no_run
//! use pvspin_test_vm::proto::{LockKind, Workload};
//! use pvspin_test_vm::{run, PvMode, RunConfig};
//!
//! let config = RunConfig {
//!     workload: Workload::Lock,
//!     lock: LockKind::Ticket,
//!     vcpus: 2,
//!     iterations: 100,
//!     pv: PvMode::Kick,
//!     ..RunConfig::default()
//! };
//! let report = run(&config).expect("the run");
//! assert_eq!(report.counter, report.expected);
//! println!("{}", report.summary_line());
//! ```
#![deny(missing_docs)]

pub mod cgroup;
pub mod config;
pub mod devices;
pub mod memory;
pub mod pvh;
pub mod report;
pub mod seccomp;
pub mod vcpu;
pub mod vhost;
pub mod virtio_mmio;
pub mod vmm;

pub use pvspin_test_vm_proto as proto;

pub use config::{PvMode, RunConfig, RunConfigError};
pub use report::RunReport;
pub use vmm::{run, RunError, GUEST_IMAGE};
