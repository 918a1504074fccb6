//! pvspin's per-vCPU tracking of what the scheduling policy needs to know.
//!
//! Per vCPU: the guest CPL at the last exit (from `kvm_run` sync registers, no extra ioctl),
//! whether the host preempted it (KVM's steal-time `preempted` byte in guest memory), and
//! whether it was preempted in guest kernel mode, cached at the moment of preemption as KVM
//! does. Readable lock-free from any vCPU thread.
//!
//! **Not implemented yet.**
#![deny(missing_docs)]
