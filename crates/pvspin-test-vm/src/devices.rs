//! The test VM's port-I/O devices: a 16550 UART (vm-superio) and the exit port; with
//! `--boot pvh` the exit port only records the status, and the ACPI sleep control port
//! (power-off) or the i8042 reset ends the run.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pvspin_test_vm_proto::pvh::{I8042_COMMAND_PORT, I8042_RESET, POWER_OFF_PORT, POWER_OFF_VALUE};
use pvspin_test_vm_proto::{EXIT_PORT, SERIAL_PORT};
use vm_superio::{Serial, Trigger};

/// The UART's interrupt line. The test VM has no interrupt controller for it (the guest polls),
/// so raising it does nothing.
#[derive(Debug)]
pub struct NoInterrupt;

impl Trigger for NoInterrupt {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        Ok(())
    }
}

/// How much console output a run keeps for its report and tests.
const CAPTURE_LIMIT: usize = 64 << 10;

/// Where the guest's serial output goes: kept (bounded) and optionally echoed to stdout.
#[derive(Clone, Debug, Default)]
pub struct ConsoleSink {
    captured: Arc<Mutex<Vec<u8>>>,
    echo: bool,
}

impl ConsoleSink {
    /// A sink that echoes to stdout when `echo` is set.
    pub fn new(echo: bool) -> Self {
        Self {
            captured: Arc::default(),
            echo,
        }
    }

    /// What the guest printed (the first 64 KiB).
    pub fn captured(&self) -> String {
        let bytes = self.captured.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        {
            let mut captured = self.captured.lock().unwrap_or_else(PoisonError::into_inner);
            let room = CAPTURE_LIMIT.saturating_sub(captured.len());
            captured.extend_from_slice(&buf[..buf.len().min(room)]);
        }
        if self.echo {
            io::stdout().write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.echo {
            io::stdout().flush()?;
        }
        Ok(())
    }
}

/// What a port write meant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PioAction {
    /// Nothing more to do.
    Continue,
    /// The guest ended the run with this status.
    Exit(u32),
    /// The vCPU has nothing more to do (and cannot `hlt`, in user mode): park it.
    Park,
    /// Halt in KVM as `hlt` would (the vCPU wrote [`pvspin_test_vm_proto::HALT_PORT`]).
    KvmHalt,
}

/// The port-I/O bus: the UART, the exit port, and counters for everything else.
#[derive(Debug)]
pub struct IoBus {
    serial: Mutex<Serial<NoInterrupt, vm_superio::serial::NoEvents, ConsoleSink>>,
    unknown_port_accesses: AtomicU64,
    bad_exit_writes: AtomicU64,
    virtio: Option<Arc<crate::vhost::VhostPvspin>>,
    /// `--boot pvh`: the exit port records, power-off ends.
    pvh: AtomicBool,
    /// `--boot pvh`: the last status the guest wrote to the exit port (`u64::MAX`: none).
    reported_status: AtomicU64,
}

const SERIAL_PORTS: std::ops::Range<u16> = SERIAL_PORT..SERIAL_PORT + 8;

impl IoBus {
    /// A bus whose UART writes to `console`.
    pub fn new(console: ConsoleSink) -> Self {
        Self {
            serial: Mutex::new(Serial::new(NoInterrupt, console)),
            unknown_port_accesses: AtomicU64::new(0),
            bad_exit_writes: AtomicU64::new(0),
            virtio: None,
            pvh: AtomicBool::new(false),
            reported_status: AtomicU64::new(u64::MAX),
        }
    }

    /// The bus of a `--boot pvh` run: the exit port records the guest's status, the ACPI
    /// sleep control port ([`POWER_OFF_PORT`]) and the i8042 reset end the run with it.
    pub fn with_pvh(self, pvh: bool) -> Self {
        self.pvh.store(pvh, Ordering::Relaxed);
        self
    }

    fn power_off_status(&self) -> u32 {
        u32::try_from(self.reported_status.load(Ordering::Relaxed))
            .unwrap_or(pvspin_test_vm_proto::status::NOT_REPORTED)
    }

    /// The bus with the pvspin virtio device's MMIO window on it.
    pub fn with_virtio(mut self, device: Option<Arc<crate::vhost::VhostPvspin>>) -> Self {
        self.virtio = device;
        self
    }

    /// An MMIO read; `false` when no device decodes `addr`.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        match &self.virtio {
            Some(device) if device.window().contains(&addr) => {
                device.read(addr, data);
                true
            }
            _ => false,
        }
    }

    /// An MMIO write; `false` when no device decodes `addr`.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        match &self.virtio {
            Some(device) if device.window().contains(&addr) => {
                device.write(addr, data);
                true
            }
            _ => false,
        }
    }

    /// Handles a guest `out`.
    pub fn write(&self, port: u16, data: &[u8]) -> PioAction {
        if SERIAL_PORTS.contains(&port) {
            let offset = (port - SERIAL_PORT) as u8;
            let mut serial = self.serial.lock().unwrap_or_else(PoisonError::into_inner);
            for &byte in data {
                if let Err(err) = serial.write(offset, byte) {
                    log::warn!("serial write failed: {err:?}");
                }
            }
            return PioAction::Continue;
        }
        if port == pvspin_test_vm_proto::PARK_PORT {
            return PioAction::Park;
        }
        if port == pvspin_test_vm_proto::HALT_PORT {
            return PioAction::KvmHalt;
        }
        let pvh = self.pvh.load(Ordering::Relaxed);
        if pvh && port == POWER_OFF_PORT {
            // SLP_TYP in bits 2..4, SLP_EN in bit 5: S5 with SLP_EN is power-off.
            if data
                .first()
                .is_some_and(|value| value & 0x3c == POWER_OFF_VALUE & 0x3c)
            {
                return PioAction::Exit(self.power_off_status());
            }
            self.count_unknown(port, "sleep-state write (not S5)");
            return PioAction::Continue;
        }
        if pvh && port == I8042_COMMAND_PORT && data == [I8042_RESET] {
            log::info!("the guest reset the machine (i8042): the run ends");
            return PioAction::Exit(self.power_off_status());
        }
        if port == EXIT_PORT {
            return match <[u8; 4]>::try_from(data) {
                Ok(bytes) if pvh => {
                    let status = u32::from_le_bytes(bytes);
                    self.reported_status
                        .store(u64::from(status), Ordering::Relaxed);
                    PioAction::Continue
                }
                Ok(bytes) => PioAction::Exit(u32::from_le_bytes(bytes)),
                Err(_) => {
                    // Only 32-bit writes end the run; anything else is a guest bug.
                    if self.bad_exit_writes.fetch_add(1, Ordering::Relaxed) == 0 {
                        log::warn!(
                            "ignoring a {}-byte write to the exit port (expected 4)",
                            data.len()
                        );
                    }
                    PioAction::Continue
                }
            };
        }
        self.count_unknown(port, "write");
        PioAction::Continue
    }

    /// Handles a guest `in`.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        if SERIAL_PORTS.contains(&port) {
            let offset = (port - SERIAL_PORT) as u8;
            let mut serial = self.serial.lock().unwrap_or_else(PoisonError::into_inner);
            for byte in data.iter_mut() {
                *byte = serial.read(offset);
            }
            return;
        }
        self.count_unknown(port, "read");
        data.fill(0xff); // what an ISA bus returns for a port nobody decodes
    }

    fn count_unknown(&self, port: u16, what: &str) {
        // Log the first one only: a guest looping on a bad port must not flood the log.
        if self.unknown_port_accesses.fetch_add(1, Ordering::Relaxed) == 0 {
            log::warn!("guest {what} to unhandled port {port:#x} ignored (further ones counted, not logged)");
        }
    }

    /// Queues console input for the guest to read from the UART; returns how many bytes fit
    /// (the UART's FIFO is bounded; the rest is dropped, as on a real line without flow
    /// control).
    pub fn enqueue_input(&self, input: &[u8]) -> usize {
        let mut serial = self.serial.lock().unwrap_or_else(PoisonError::into_inner);
        serial.enqueue_raw_bytes(input).unwrap_or(0)
    }

    /// Accesses to ports no device decodes.
    pub fn unknown_port_accesses(&self) -> u64 {
        self.unknown_port_accesses.load(Ordering::Relaxed)
    }

    /// Writes to the exit port of the wrong width.
    pub fn bad_exit_writes(&self) -> u64 {
        self.bad_exit_writes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_output_is_captured() {
        let console = ConsoleSink::new(false);
        let bus = IoBus::new(console.clone());
        for byte in b"hi\n" {
            assert_eq!(bus.write(SERIAL_PORT, &[*byte]), PioAction::Continue);
        }
        assert_eq!(console.captured(), "hi\n");
        // The line status register says the transmitter is empty.
        let mut lsr = [0u8];
        bus.read(SERIAL_PORT + 5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);
    }

    #[test]
    fn exit_port_needs_four_bytes() {
        let bus = IoBus::new(ConsoleSink::new(false));
        assert_eq!(
            bus.write(EXIT_PORT, &7u32.to_le_bytes()),
            PioAction::Exit(7)
        );
        assert_eq!(bus.write(EXIT_PORT, &[1]), PioAction::Continue);
        assert_eq!(bus.write(EXIT_PORT, &[1, 2]), PioAction::Continue);
        assert_eq!(bus.bad_exit_writes(), 2);
    }

    #[test]
    fn pvh_runs_end_at_power_off_with_the_status_reported_before() {
        let bus = IoBus::new(ConsoleSink::new(false)).with_pvh(true);
        assert_eq!(bus.write(POWER_OFF_PORT, &[0x14]), PioAction::Continue);
        assert_eq!(
            bus.write(POWER_OFF_PORT, &[POWER_OFF_VALUE]),
            PioAction::Exit(pvspin_test_vm_proto::status::NOT_REPORTED)
        );
        assert_eq!(
            bus.write(EXIT_PORT, &3u32.to_le_bytes()),
            PioAction::Continue
        );
        assert_eq!(
            bus.write(POWER_OFF_PORT, &[POWER_OFF_VALUE]),
            PioAction::Exit(3)
        );
        assert_eq!(
            bus.write(I8042_COMMAND_PORT, &[I8042_RESET]),
            PioAction::Exit(3)
        );
        // Under the direct boot those ports are nobody's, and the exit port ends the run.
        let direct = IoBus::new(ConsoleSink::new(false));
        assert_eq!(
            direct.write(POWER_OFF_PORT, &[POWER_OFF_VALUE]),
            PioAction::Continue
        );
        assert_eq!(
            direct.write(EXIT_PORT, &0u32.to_le_bytes()),
            PioAction::Exit(0)
        );
    }

    #[test]
    fn unknown_ports_are_counted_and_read_as_ones() {
        let bus = IoBus::new(ConsoleSink::new(false));
        bus.write(0x80, &[1]);
        let mut data = [0u8; 2];
        bus.read(0x70, &mut data);
        assert_eq!(data, [0xff, 0xff]);
        assert_eq!(bus.unknown_port_accesses(), 2);
    }

    #[test]
    fn console_input_reaches_the_receive_register() {
        let bus = IoBus::new(ConsoleSink::new(false));
        assert_eq!(bus.enqueue_input(b"k"), 1);
        let mut lsr = [0u8];
        bus.read(SERIAL_PORT + 5, &mut lsr);
        assert_ne!(lsr[0] & 0x01, 0, "data ready");
        let mut rbr = [0u8];
        bus.read(SERIAL_PORT, &mut rbr);
        assert_eq!(rbr, *b"k");
    }

    #[test]
    fn capture_is_bounded() {
        let mut console = ConsoleSink::new(false);
        let chunk = vec![b'x'; 4096];
        for _ in 0..20 {
            console.write_all(&chunk).unwrap();
        }
        assert_eq!(console.captured().len(), CAPTURE_LIMIT);
    }
}
