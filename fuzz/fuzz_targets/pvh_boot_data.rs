//! What the example guest reads from any PVH VMM at boot: the kernel command line
//! (`pvspin_test_vm_proto::cmdline`) and the firmware tables (`pvspin_test_vm_proto::firmware`: RSDP,
//! XSDT/RSDT, MADT, FADT, DSDT, MP table), from arbitrary bytes.
//!
//! Invariants: no panic (the guest's panic is a failed boot); a command line either parses
//! to boot parameters that satisfy the guest's rules or is refused with a name and a reason;
//! a CPU list has at most 255 distinct IDs, none of them the broadcast ID 0xff.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvspin_test_vm_proto::firmware::{self, PhysRead};
use pvspin_test_vm_proto::{cmdline, MAX_VCPUS};

/// Guest memory: the first MiB, zero but for the input, copied where the guest looks for
/// tables (the EBDA pointer at 0x40e, the last KiB of low memory, the BIOS area's start) and
/// where those tables would point (a pointer in the input lands in one of these windows).
struct Memory(Vec<u8>);

impl Memory {
    fn with(input: &[u8]) -> Self {
        let mut memory = vec![0u8; 1 << 20];
        for at in [0x400, 0x9_fc00, 0xe_0000, 0xf_0000] {
            let len = input.len().min(0x1_0000);
            memory[at..at + len].copy_from_slice(&input[..len]);
        }
        Self(memory)
    }
}

impl PhysRead for Memory {
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(addr).ok()?;
        self.0.get(start..start.checked_add(len)?)
    }
}

fuzz_target!(|data: &[u8]| {
    let (selector, rest) = data.split_first().unwrap_or((&0, &[]));
    if selector % 2 == 0 {
        if let Ok(text) = std::str::from_utf8(rest) {
            match cmdline::parse(text) {
                Ok(parsed) => {
                    let params = parsed.params;
                    assert!(parsed.vcpus.is_none_or(|n| (1..=MAX_VCPUS).contains(&n)));
                    assert!((1..=cmdline::MAX_SPIN_THRESHOLD).contains(&params.spin_threshold));
                    assert!(pvspin_test_vm_proto::Workload::from_u32(params.workload).is_some());
                    assert!(pvspin_test_vm_proto::LockKind::from_u32(params.lock).is_some());
                }
                Err(err) => assert!(!err.name.is_empty() && !err.reason.is_empty()),
            }
        }
    } else {
        let hint = rest.get(..4).map_or(0, |b| {
            u64::from(u32::from_le_bytes(b.try_into().unwrap_or([0; 4]))) & 0xf_ffff
        });
        let memory = Memory::with(rest);
        let found = firmware::read(&memory, hint);
        if let Some(cpus) = found.cpus {
            assert!(cpus.count <= MAX_VCPUS as usize);
            let ids = &cpus.apic_ids[..cpus.count];
            assert!(ids.iter().all(|id| *id != 0xff));
            for (i, id) in ids.iter().enumerate() {
                assert!(!ids[..i].contains(id));
            }
        }
    }
});
