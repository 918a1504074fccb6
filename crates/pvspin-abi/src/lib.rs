//! The guest-host contract of pvspin.
//!
//! Both sides depend on this crate: the host crates (`pvspin-kick`, `pvspin-pause`,
//! `pvspin-hints`) to decode what a guest writes, and `pvspin-guest` to produce it. It is
//! `no_std` and has no dependencies, so a guest kernel can vendor it.
//!
//! What it will hold: the CPUID discovery leaf, the doorbell's location and command encoding
//! (kick, spin notification, shared-page registration), the per-vCPU shared page layout and the
//! ABI version. **Not implemented yet:** only the version number exists; the contract itself
//! comes with the kick device (see `docs/abi.md` once it exists).
#![no_std]
#![deny(missing_docs)]

/// Version of the guest-host contract. A guest refuses a host whose major version differs.
pub const ABI_VERSION_MAJOR: u16 = 0;
/// Minor version: additions that old guests may ignore.
pub const ABI_VERSION_MINOR: u16 = 1;
