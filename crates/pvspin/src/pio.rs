//! The doorbell as a port-I/O bus device, for VMMs whose exit loop dispatches port I/O
//! through a bus (vm-device's `Bus`, Cloud Hypervisor's `VmOps::pio_read`/`pio_write`, crosvm's
//! `Bus`) instead of offering each exit to [`crate::VcpuHooks::handle_exit`].
//!
//! Bus devices are told an offset and data, not which vCPU made the access. The doorbell
//! needs the caller (a SPIN or WAIT is the caller's), so [`DoorbellPio`] finds it through a
//! thread-local set by [`crate::VcpuHooks::before_run`]: the bus dispatch must run on the
//! vCPU's thread, between `before_run` and `after_run`, as every VMM's does.

use std::sync::Arc;

use crate::check::Adoption;
use crate::hooks::VcpuDoorbell;
use crate::ExitOutcome;

/// pvspin's doorbell on the VMM's port-I/O bus: register it at
/// [`base`](Self::base)..+[`len`](Self::len) and forward accesses with the offset from the base.
#[derive(Clone, Debug)]
pub struct DoorbellPio {
    base: u16,
    len: u16,
    adoption: Arc<Adoption>,
}

impl DoorbellPio {
    pub(crate) fn new(base: u16, len: u16, adoption: Arc<Adoption>) -> Self {
        Self {
            base,
            len,
            adoption,
        }
    }

    /// The first port.
    pub fn base(&self) -> u16 {
        self.base
    }

    /// The number of ports.
    pub fn len(&self) -> u16 {
        self.len
    }

    /// Always false: the doorbell has ports (clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Accesses made on a thread whose vCPU hooks never ran `before_run` (ignored; counted
    /// for the whole VM, whichever `DoorbellPio` saw them, and listed by
    /// [`crate::PvSpin::check`] as [`crate::ProblemKind::DoorbellWithoutHooks`]).
    pub fn unattributed(&self) -> u64 {
        self.adoption.unattributed_doorbell_count()
    }

    fn port(&self, offset: u64) -> Option<u16> {
        let offset = u16::try_from(offset).ok().filter(|&o| o < self.len)?;
        Some(self.base + offset)
    }

    fn unattributed_access(&self) {
        // Counted and logged once, with the rule.
        self.adoption.unattributed_doorbell();
    }

    /// A guest write of `data` at `offset` from [`base`](Self::base). Returns whether the
    /// doorbell took it (false: the offset is not the doorbell's).
    pub fn write(&self, offset: u64, data: &[u8]) -> bool {
        let Some(port) = self.port(offset) else {
            return false;
        };
        VcpuDoorbell::with_current(|doorbell| match doorbell {
            Some(d) => d.pio_write(port, data) == ExitOutcome::Handled,
            None => {
                self.unattributed_access();
                true
            }
        })
    }

    /// A guest read into `data` at `offset` from [`base`](Self::base). Returns whether the
    /// doorbell answered it (false: the offset is not the doorbell's). Unattributed reads
    /// read all ones, like an absent device.
    pub fn read(&self, offset: u64, data: &mut [u8]) -> bool {
        let Some(port) = self.port(offset) else {
            return false;
        };
        VcpuDoorbell::with_current(|doorbell| match doorbell {
            Some(d) => d.pio_read(port, data) == ExitOutcome::Handled,
            None => {
                self.unattributed_access();
                data.fill(0xff);
                true
            }
        })
    }
}
