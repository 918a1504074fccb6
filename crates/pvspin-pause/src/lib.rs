//! The pvspin pause-exit handler.
//!
//! Takes a spin notification from a guest vCPU, decides whom to yield to (the guest's holder
//! hint first, KVM's `kvm_vcpu_on_spin` candidate rules otherwise), adapts each vCPU's spin
//! window like KVM's PLE window, and hands the decision to an actuator. The decision is pure
//! code over a small trait, so it is unit-tested and fuzzed without KVM.
//!
//! **Not implemented yet.**
#![deny(missing_docs)]
