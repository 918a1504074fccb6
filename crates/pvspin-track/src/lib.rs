//! pvspin's per-vCPU tracking of what the scheduling policy needs to know.
//!
//! * [`cpl`]: the guest CPL at the last exit, from `kvm_run`'s sync registers
//!   (`KVM_CAP_SYNC_REGS`, no extra ioctl per exit).
//! * [`steal`]: KVM's steal-time area in guest memory, whose `preempted` byte says the host
//!   descheduled the vCPU; validated (the guest chose its address) and parsed.
//! * [`board`]: [`VcpuBoard`], one packed atomic word per vCPU (state, last CPL, preempted,
//!   preempted-in-kernel cached when preemption is recorded, pending kick, spinning,
//!   eligibility) plus thread ids; written by each vCPU's thread, read lock-free by the others.
//!
//! What the embedding VMM calls, per vCPU thread: [`cpl::enable_sync_sregs`] and
//! [`VcpuBoard::set_tid`] once; [`VcpuBoard::on_enter_run`] before each `KVM_RUN`;
//! [`VcpuBoard::on_exit`] with [`cpl::cpl_from_sync_regs`] after each; [`VcpuBoard::on_halt`]
//! / [`VcpuBoard::on_wake`] around a userspace halt; [`VcpuBoard::kick`] from the kicker;
//! [`VcpuBoard::park`] / [`VcpuBoard::unpark`] from a VMM scheduler; and
//! [`VcpuBoard::set_steal_time_gpa`] once the guest's steal-time MSR is known.
//!
//! Not implemented: detecting a vCPU thread that is runnable but off-CPU from `/proc` (see
//! [`board`]), and learning the steal-time MSR value (the VMM reads it with `KVM_GET_MSRS`).
#![deny(missing_docs)]

pub mod board;
pub mod cpl;
pub mod steal;

pub use board::{BoardError, VcpuBoard, VcpuSnapshot, VcpuState};
pub use cpl::{cpl_from_sregs, cpl_from_sync_regs, enable_sync_sregs, CplError};
pub use steal::{GuestBytes, StealTime, StealTimeError};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
