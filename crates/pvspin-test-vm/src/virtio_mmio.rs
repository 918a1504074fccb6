//! The registers of a virtio-mmio (version 2) transport, as pure state: what a guest reads and
//! writes, with no backend and no KVM behind it. [`crate::vhost`] puts the pvspin virtio device
//! behind it; the fuzz target `virtio_mmio` drives it with arbitrary accesses.
//!
//! Every access is the guest's and untrusted: a wrong width, an unknown offset, a queue the
//! device does not have or a feature it does not offer is refused ([`MmioEffect::Bad`]) and
//! changes nothing.

/// Offset of `QueueNotify` (notifications normally reach the backend through ioeventfds).
pub const QUEUE_NOTIFY: u64 = 0x050;
/// Offset of the device configuration space.
pub const CONFIG: u64 = 0x100;
/// `MagicValue`: "virt".
pub const MAGIC: u32 = 0x7472_6976;
/// `VendorID` the test VM reports ("PVSP").
pub const VENDOR_ID: u32 = 0x5053_5650;

/// Status bit: the driver accepted the features.
pub const STATUS_FEATURES_OK: u32 = 8;
/// Status bit: the driver is ready.
pub const STATUS_DRIVER_OK: u32 = 4;
/// Status bit: the device failed and needs a reset.
pub const STATUS_NEEDS_RESET: u32 = 0x40;

/// One queue as the driver configured it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueRegs {
    /// `QueueNum`.
    pub num: u16,
    /// `QueueReady`.
    pub ready: bool,
    /// `QueueDesc`: GPA of the descriptor table.
    pub desc: u64,
    /// `QueueDriver`: GPA of the available ring.
    pub driver: u64,
    /// `QueueDevice`: GPA of the used ring.
    pub device: u64,
}

/// What a write asks of the device behind the registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmioEffect {
    /// Nothing beyond the registers.
    None,
    /// The driver set `DRIVER_OK`: start the device ([`MmioRegisters::start_failed`] if it
    /// cannot).
    Start,
    /// The driver wrote status 0: stop the device; the registers are reset already.
    Reset,
    /// A write no register takes (ignored); the reason, for the VMM's count and log.
    Bad(&'static str),
}

/// The transport's registers.
#[derive(Clone, Debug)]
pub struct MmioRegisters {
    device_id: u32,
    device_features: u64,
    config: Vec<u8>,
    queue_num_max: u16,
    /// Per queue index: whether the device has it (the VM uses it).
    present: Vec<bool>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    queues: Vec<QueueRegs>,
    config_generation: u32,
}

impl MmioRegisters {
    /// Registers of device `device_id` offering `device_features`, with configuration space
    /// `config`, queues of at most `queue_num_max` entries, and the queues `present` marks.
    pub fn new(
        device_id: u32,
        device_features: u64,
        config: Vec<u8>,
        queue_num_max: u16,
        present: Vec<bool>,
    ) -> Self {
        let queues = vec![QueueRegs::default(); present.len()];
        Self {
            device_id,
            device_features,
            config,
            queue_num_max,
            present,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            queues,
            config_generation: 0,
        }
    }

    /// Changes `ConfigGeneration`: the device's state behind the configuration changed (the
    /// pvspin device: a new backend, which has none of the driver's hint-page registrations).
    pub fn bump_config_generation(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
    }

    /// The device status.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The features the device offers.
    pub fn device_features(&self) -> u64 {
        self.device_features
    }

    /// The features the driver accepted (meaningful once `FEATURES_OK` is set).
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// The configuration space.
    pub fn config(&self) -> &[u8] {
        &self.config
    }

    /// Queue `index` as configured, if the device has it.
    pub fn queue(&self, index: usize) -> Option<&QueueRegs> {
        self.queues.get(index).filter(|_| self.present[index])
    }

    /// The queues the device has that the driver made ready, with their index.
    pub fn ready_queues(&self) -> impl Iterator<Item = (usize, &QueueRegs)> {
        self.queues
            .iter()
            .enumerate()
            .filter(|(i, q)| self.present[*i] && q.ready)
    }

    /// The device could not start: it tells the driver with `DEVICE_NEEDS_RESET`.
    pub fn start_failed(&mut self) {
        self.status |= STATUS_NEEDS_RESET;
    }

    /// A read of `data.len()` bytes at `offset`; `Err` (data all zeros) when no register takes
    /// it.
    pub fn read(&self, offset: u64, data: &mut [u8]) -> Result<(), &'static str> {
        data.fill(0);
        if offset >= CONFIG {
            let start = usize::try_from(offset - CONFIG).unwrap_or(usize::MAX);
            let bytes = start
                .checked_add(data.len())
                .and_then(|end| self.config.get(start..end))
                .ok_or("read outside the configuration space")?;
            data.copy_from_slice(bytes);
            return Ok(());
        }
        if data.len() != 4 {
            return Err("register read of the wrong width");
        }
        let queue = self.queue(self.queue_sel as usize);
        let value: u32 = match offset {
            0x000 => MAGIC,
            0x004 => 2,
            0x008 => self.device_id,
            0x00c => VENDOR_ID,
            0x010 => match self.device_features_sel {
                0 => self.device_features as u32,
                1 => (self.device_features >> 32) as u32,
                _ => 0,
            },
            0x034 => queue.map_or(0, |_| u32::from(self.queue_num_max)),
            0x044 => queue.map_or(0, |q| u32::from(q.ready)),
            0x060 => 0,
            0x0fc => self.config_generation,
            0x070 => self.status,
            _ => return Err("read of an unknown register"),
        };
        data.copy_from_slice(&value.to_le_bytes());
        Ok(())
    }

    /// A write of `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> MmioEffect {
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return MmioEffect::Bad("write of the wrong width");
        };
        let value = u32::from_le_bytes(bytes);
        let set_low = |field: &mut u64| *field = (*field & !0xffff_ffff) | u64::from(value);
        let set_high = |field: &mut u64| *field = (*field & 0xffff_ffff) | (u64::from(value) << 32);
        // Feature and queue setup is for a driver that has not started the device yet.
        let started = self.status & STATUS_DRIVER_OK != 0;
        match offset {
            0x014 => self.device_features_sel = value,
            0x020 if self.status & STATUS_FEATURES_OK != 0 => {
                return MmioEffect::Bad("feature write after FEATURES_OK")
            }
            0x020 => match self.driver_features_sel {
                0 => set_low(&mut self.driver_features),
                1 => set_high(&mut self.driver_features),
                _ => return MmioEffect::Bad("feature write to a selector past 1"),
            },
            0x024 => self.driver_features_sel = value,
            0x030 => self.queue_sel = value,
            0x038 | 0x044 | 0x080 | 0x084 | 0x090 | 0x094 | 0x0a0 | 0x0a4 => {
                let sel = self.queue_sel as usize;
                if started {
                    return MmioEffect::Bad("queue register write after DRIVER_OK");
                }
                if !self.present.get(sel).copied().unwrap_or(false) {
                    return MmioEffect::Bad("queue register write for a queue that does not exist");
                }
                let queue = &mut self.queues[sel];
                match offset {
                    0x038 => {
                        let num = u16::try_from(value).unwrap_or(0);
                        if num == 0 || num > self.queue_num_max || !num.is_power_of_two() {
                            return MmioEffect::Bad(
                                "queue size not a power of two up to the maximum",
                            );
                        }
                        queue.num = num;
                    }
                    0x044 => queue.ready = value == 1 && queue.num != 0,
                    0x080 => set_low(&mut queue.desc),
                    0x084 => set_high(&mut queue.desc),
                    0x090 => set_low(&mut queue.driver),
                    0x094 => set_high(&mut queue.driver),
                    0x0a0 => set_low(&mut queue.device),
                    _ => set_high(&mut queue.device),
                }
            }
            // Notifications reach the backend through ioeventfds; one that arrives here names
            // a queue the VM does not use.
            QUEUE_NOTIFY => return MmioEffect::Bad("notification of a queue that does not exist"),
            0x064 => {}
            0x070 => return self.write_status(value),
            _ => return MmioEffect::Bad("write of an unknown register"),
        }
        MmioEffect::None
    }

    fn write_status(&mut self, value: u32) -> MmioEffect {
        if value == 0 {
            let was_started = self.status & STATUS_DRIVER_OK != 0;
            let generation = self.config_generation;
            *self = Self::new(
                self.device_id,
                self.device_features,
                std::mem::take(&mut self.config),
                self.queue_num_max,
                std::mem::take(&mut self.present),
            );
            self.config_generation = generation;
            return if was_started {
                MmioEffect::Reset
            } else {
                MmioEffect::None
            };
        }
        // The driver may only add bits (virtio 1.x, "Device Status Field"); clearing one needs
        // a reset.
        if (value | STATUS_NEEDS_RESET) & self.status != self.status {
            return MmioEffect::Bad("status write clearing bits without a reset");
        }
        let mut value = value & !STATUS_NEEDS_RESET | (self.status & STATUS_NEEDS_RESET);
        let version_1 = 1u64 << pvspin_abi::virtio::F_VERSION_1;
        if value & STATUS_FEATURES_OK != 0 && self.status & STATUS_FEATURES_OK == 0 {
            let acceptable = self.driver_features & !self.device_features == 0
                && self.driver_features & version_1 != 0;
            if !acceptable {
                value &= !STATUS_FEATURES_OK;
            }
        }
        let start = value & STATUS_DRIVER_OK != 0
            && self.status & STATUS_DRIVER_OK == 0
            && value & STATUS_FEATURES_OK != 0;
        if value & STATUS_DRIVER_OK != 0 && value & STATUS_FEATURES_OK == 0 {
            return MmioEffect::Bad("DRIVER_OK without FEATURES_OK");
        }
        self.status = value;
        if start {
            MmioEffect::Start
        } else {
            MmioEffect::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VERSION_1: u64 = 1 << 32;

    fn regs() -> MmioRegisters {
        MmioRegisters::new(
            63,
            VERSION_1 | 0b11,
            vec![1, 2, 3, 4],
            8,
            vec![true, true, false],
        )
    }

    fn read32(r: &MmioRegisters, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        r.read(offset, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    fn w(r: &mut MmioRegisters, offset: u64, value: u32) -> MmioEffect {
        r.write(offset, &value.to_le_bytes())
    }

    #[test]
    fn a_driver_brings_the_device_up() {
        let mut r = regs();
        assert_eq!(read32(&r, 0), MAGIC);
        assert_eq!(read32(&r, 8), 63);
        w(&mut r, 0x014, 1);
        assert_eq!(read32(&r, 0x010), 1);
        assert_eq!(w(&mut r, 0x070, 3), MmioEffect::None);
        w(&mut r, 0x024, 0);
        w(&mut r, 0x020, 0b01);
        w(&mut r, 0x024, 1);
        w(&mut r, 0x020, 1);
        assert_eq!(w(&mut r, 0x070, 3 | STATUS_FEATURES_OK), MmioEffect::None);
        assert_ne!(r.status() & STATUS_FEATURES_OK, 0);
        w(&mut r, 0x030, 1);
        assert_eq!(read32(&r, 0x034), 8);
        assert_eq!(w(&mut r, 0x038, 4), MmioEffect::None);
        w(&mut r, 0x080, 0x1000);
        w(&mut r, 0x084, 0x1);
        w(&mut r, 0x044, 1);
        assert_eq!(r.ready_queues().count(), 1);
        assert_eq!(r.queue(1).unwrap().desc, 0x1_0000_1000);
        let on = 3 | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
        assert_eq!(w(&mut r, 0x070, on), MmioEffect::Start);
        r.start_failed();
        assert_ne!(read32(&r, 0x070) & STATUS_NEEDS_RESET, 0);
        r.bump_config_generation();
        assert_eq!(w(&mut r, 0x070, 0), MmioEffect::Reset);
        assert_eq!(r.ready_queues().count(), 0);
        assert_eq!(read32(&r, 0x070), 0);
        assert_eq!(read32(&r, 0x0fc), 1, "a reset keeps the generation");
    }

    #[test]
    fn bad_accesses_change_nothing() {
        let mut r = regs();
        // Queue 2 does not exist; wrong widths; unknown offsets; bad sizes.
        w(&mut r, 0x030, 2);
        assert_eq!(read32(&r, 0x034), 0);
        assert!(matches!(w(&mut r, 0x038, 4), MmioEffect::Bad(_)));
        w(&mut r, 0x030, 1);
        assert!(matches!(w(&mut r, 0x038, 3), MmioEffect::Bad(_)));
        assert!(matches!(w(&mut r, 0x038, 16), MmioEffect::Bad(_)));
        assert!(matches!(r.write(0x070, &[1]), MmioEffect::Bad(_)));
        assert!(matches!(w(&mut r, 0x0f0, 1), MmioEffect::Bad(_)));
        assert!(matches!(w(&mut r, QUEUE_NOTIFY, 1), MmioEffect::Bad(_)));
        let mut two = [0u8; 2];
        assert!(r.read(0x070, &mut two).is_err());
        assert!(r.read(CONFIG + 3, &mut [0u8; 4]).is_err());
        assert!(r.read(u64::MAX, &mut [0u8; 4]).is_err());
        // Features the device does not offer, or no VERSION_1: FEATURES_OK does not stick.
        w(&mut r, 0x024, 0);
        w(&mut r, 0x020, 0b100);
        w(&mut r, 0x070, STATUS_FEATURES_OK);
        assert_eq!(r.status() & STATUS_FEATURES_OK, 0);
        // DRIVER_OK without FEATURES_OK starts nothing.
        assert!(matches!(
            w(&mut r, 0x070, STATUS_DRIVER_OK),
            MmioEffect::Bad(_)
        ));
        assert_eq!(r.ready_queues().count(), 0);
    }
}
