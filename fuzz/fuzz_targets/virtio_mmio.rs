//! Fuzzes the example VMM's virtio-mmio transport registers (`pvspin_test_vm::virtio_mmio`), the
//! MMIO exit handler of the pvspin virtio device: arbitrary reads and writes of any width at
//! any offset. Invariants: nothing panics; a read that no register takes returns zeros; the
//! device starts (`MmioEffect::Start`) only once per `DRIVER_OK`, only after the driver
//! accepted a subset of the offered features including VERSION_1, and only queues the device
//! has can be ready.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvspin_test_vm::virtio_mmio::{MmioEffect, MmioRegisters, STATUS_DRIVER_OK, STATUS_FEATURES_OK};

const VERSION_1: u64 = 1 << 32;
const OFFERED: u64 = VERSION_1 | 0b11;

fuzz_target!(|data: &[u8]| {
    let present = vec![true, true, false, true];
    let mut regs = MmioRegisters::new(63, OFFERED, vec![7; 16], 8, present.clone());
    let mut started = false;
    // Each access: [kind, offset (2 bytes, scaled to the window), width, value (4 bytes)].
    for chunk in data.chunks_exact(8) {
        let offset = u64::from(u16::from_le_bytes([chunk[1], chunk[2]])) % 0x140;
        let width = usize::from(chunk[3] % 9);
        let value = [chunk[4], chunk[5], chunk[6], chunk[7]];
        if chunk[0] & 1 == 0 {
            let mut out = vec![0xAAu8; width];
            if regs.read(offset, &mut out).is_err() {
                assert!(out.iter().all(|&b| b == 0), "a refused read leaked data");
            }
        } else {
            let mut bytes = value.to_vec();
            bytes.resize(width, 0);
            match regs.write(offset, &bytes) {
                MmioEffect::Start => {
                    assert!(!started, "started twice without a reset");
                    started = true;
                    let accepted = regs.driver_features();
                    assert_eq!(accepted & !OFFERED, 0, "started with features not offered");
                    assert_ne!(accepted & VERSION_1, 0, "started without VERSION_1");
                    assert_ne!(regs.status() & STATUS_FEATURES_OK, 0);
                    assert_ne!(regs.status() & STATUS_DRIVER_OK, 0);
                }
                MmioEffect::Reset => {
                    assert!(started, "a reset of a device that never started");
                    started = false;
                    assert_eq!(regs.status(), 0);
                }
                MmioEffect::None | MmioEffect::Bad(_) => {}
            }
        }
        for (index, queue) in regs.ready_queues() {
            assert!(
                present[index],
                "queue {index} the device does not have is ready"
            );
            assert!(queue.num.is_power_of_two() && queue.num <= 8);
        }
    }
});
