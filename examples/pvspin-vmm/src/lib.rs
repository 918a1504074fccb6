//! `pvspin-vmm`: an example VMM that runs pvspin guest workloads on /dev/kvm.
//!
//! The VM itself is `pvspin_test_vm`'s (a rust-vmm VMM adopting pvspin through its embedding
//! API, with its own guest program); this crate is the command line over it and the
//! benchmark harness that reproduces the lock-holder-preemption experiments: busy host
//! threads (`--hogs`) compete with the vCPUs for host CPUs.
//!
//! | module | what |
//! |---|---|
//! | [`cli`] | the command line (`run`, `bench`, `report`, `guest-cmdline`) and the process entry point |
//! | [`bench`](mod@bench) | variants compared side by side, interleaved runs, the table |
//! | [`suite`] | one command per table of `docs/benchmarks.md` |
//! | [`saved`] | runs saved as JSON lines and read back (`report`) |
//! | [`plot`] | SVG plots of the tables |
#![deny(missing_docs)]

pub mod bench;
pub mod cli;
pub mod plot;
pub mod saved;
pub mod suite;
