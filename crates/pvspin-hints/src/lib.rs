//! pvspin vCPU scheduler hints.
//!
//! Reads the per-vCPU hint pages the guest shares (holding a lock, spinning on one, in a
//! critical section), keeps the per-vCPU board, and acts on it: a host-thread actuator
//! (bounded priority boosts that are always restored, affinity) and a run-slot scheduler for
//! VMMs that gate their vCPU threads.
//!
//! **Not implemented yet.**
#![deny(missing_docs)]
