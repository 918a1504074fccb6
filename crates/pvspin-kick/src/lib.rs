//! The pvspin kick device: the doorbell a guest rings to wake a halted vCPU.
//!
//! KVM's own `KVM_HC_KICK_CPU` hypercall never reaches a userspace VMM, so pvspin's kick is a
//! port-I/O doorbell (the layout is in `pvspin-abi`). This crate decodes doorbell writes, with
//! every guest value bounds-checked, and wakes the target through one of three paths: in-kernel
//! (ioeventfd + irqfd to a REMRD MSI), signal-msi (`KVM_SIGNAL_MSI` after a userspace exit) or
//! userspace (a per-vCPU latch parked on by `KVM_EXIT_HLT`).
//!
//! **Not implemented yet.**
#![deny(missing_docs)]
