//! `--boot pvh`: the test VM boots its guest image the way any PVH VMM does (Cloud
//! Hypervisor's `--kernel`, QEMU's `-kernel`, Firecracker): the PVH start info with a memory
//! map, the kernel command line the guest reads its parameters from, ACPI tables (RSDP, XSDT,
//! FADT with the sleep control port, a DSDT with `\_S5_`, and an MADT listing the vCPUs), the
//! boot vCPU at the ELF's PVH entry in 32-bit protected mode, and the APs left waiting for the
//! guest's INIT-SIPI-SIPI (KVM's in-kernel LAPIC starts them).

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use pvspin_test_vm_proto::pvh::{
    ACPI_ADDR, CMDLINE_ADDR, LOW_RAM_END, MEMMAP_ADDR, MEMMAP_RAM, MEMMAP_RESERVED, POWER_OFF_PORT,
    START_INFO_ADDR, START_INFO_MAGIC,
};
use vm_memory::{Bytes, GuestAddress};

use crate::config::{BudgetMode, GuestKind, PvMode, RunConfig, WaitMode};
use crate::memory::VmMemory;
use crate::vmm::{lock_name, workload_name};

/// Errors while writing the PVH boot data.
#[derive(Debug, thiserror::Error)]
pub enum PvhError {
    /// The command line does not fit where the guest reads it.
    #[error("the guest command line is {len} bytes, more than the {max} the guest reads")]
    CmdlineTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A write into guest memory failed.
    #[error("writing the PVH {what}: {source}")]
    Write {
        /// What.
        what: &'static str,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// linux-loader refused the start info or memory map.
    #[error("writing the PVH start info: {0}")]
    StartInfo(linux_loader::configurator::Error),
}

/// The kernel command line that describes `config` to the guest, with the names of `run`'s
/// options (`pvspin_test_vm_proto::cmdline`); `tsc_khz` when known (0: the guest asks CPUID).
pub fn guest_cmdline(config: &RunConfig, tsc_khz: u64) -> String {
    let mut words = vec![
        format!("vcpus={}", config.vcpus),
        format!("workload={}", workload_name(config.workload)),
        format!("lock={}", lock_name(config.lock)),
        format!(
            "pv={}",
            match config.pv {
                PvMode::Off => "off",
                PvMode::Kick => "kick",
                PvMode::KickYield => "kick+yield",
            }
        ),
        format!("guest={}", config.guest.name()),
        format!(
            "cs-mode={}",
            if config.user_mode { "user" } else { "kernel" }
        ),
    ];
    if config.guest == GuestKind::Pvspin {
        words.push(format!(
            "wait={}",
            match config.wait {
                WaitMode::Auto => "auto",
                WaitMode::Hlt => "hlt",
                WaitMode::Doorbell => "doorbell",
            }
        ));
        words.push(format!(
            "budgets={}",
            match config.budgets {
                BudgetMode::Time => "time",
                BudgetMode::Spins => "spins",
            }
        ));
    }
    if config.run_slots.is_some() {
        words.push("sched=slots".into());
    }
    words.push(format!("spin-threshold={}", config.guest_spin_threshold()));
    words.push(format!("iterations={}", config.iterations));
    words.push(format!("cs-work={}", config.cs_work));
    words.push(format!("ncs-work={}", config.ncs_work));
    let leaves: Vec<String> = config
        .cpuid_leaves
        .iter()
        .filter(|leaf| **leaf != 0)
        .map(|leaf| format!("{leaf:#x}"))
        .collect();
    if !leaves.is_empty() {
        words.push(format!("cpuid-leaves={}", leaves.join(",")));
    }
    if config.pv.kicks() {
        words.push(format!(
            "kick-path={}",
            match config.kick_path {
                pvspin::KickPath::InKernel => "in-kernel",
                pvspin::KickPath::SignalMsi => "signal-msi",
                pvspin::KickPath::Userspace => "userspace",
            }
        ));
    }
    if tsc_khz != 0 {
        words.push(format!("tsc-khz={tsc_khz}"));
    }
    words.join(" ")
}

fn write_bytes(
    memory: &VmMemory,
    what: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), PvhError> {
    memory
        .write_slice(bytes, GuestAddress(addr))
        .map_err(|source| PvhError::Write { what, source })
}

/// Writes the start info, memory map, command line and ACPI tables for `vcpus` vCPUs in
/// `mem_bytes` of guest memory.
pub fn write_boot_data(
    memory: &VmMemory,
    mem_bytes: u64,
    cmdline: &str,
    vcpus: u32,
) -> Result<(), PvhError> {
    let max = pvspin_test_vm_proto::cmdline::MAX_CMDLINE_BYTES - 1;
    if cmdline.len() > max {
        return Err(PvhError::CmdlineTooLong {
            len: cmdline.len(),
            max,
        });
    }
    let mut text = cmdline.as_bytes().to_vec();
    text.push(0);
    write_bytes(memory, "command line", CMDLINE_ADDR, &text)?;
    for (offset, table) in acpi_tables(vcpus) {
        write_bytes(memory, "ACPI tables", ACPI_ADDR + offset, &table)?;
    }
    let memmap = [
        (0, LOW_RAM_END, MEMMAP_RAM),
        (ACPI_ADDR, (1 << 20) - ACPI_ADDR, MEMMAP_RESERVED),
        (1 << 20, mem_bytes - (1 << 20), MEMMAP_RAM),
    ]
    .map(|(addr, size, type_)| hvm_memmap_table_entry {
        addr,
        size,
        type_,
        reserved: 0,
    });
    let start_info = hvm_start_info {
        magic: START_INFO_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        rsdp_paddr: ACPI_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(START_INFO_ADDR));
    params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
    PvhBootConfigurator::write_bootparams(&params, memory).map_err(PvhError::StartInfo)
}

/// Offsets (from [`ACPI_ADDR`]) of the tables.
const RSDP_OFFSET: u64 = 0;
const XSDT_OFFSET: u64 = 0x40;
const FADT_OFFSET: u64 = 0x100;
const DSDT_OFFSET: u64 = 0x280;
const MADT_OFFSET: u64 = 0x300;

/// A system description table: the 36-byte header, `body`, and the checksum.
fn sdt(signature: &[u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(36 + body.len()).unwrap_or(u32::MAX);
    let mut table = Vec::with_capacity(36 + body.len());
    table.extend_from_slice(signature);
    table.extend_from_slice(&len.to_le_bytes());
    table.push(revision);
    table.push(0); // checksum, below
    table.extend_from_slice(b"PVSPIN");
    table.extend_from_slice(b"PVSPINVM");
    table.extend_from_slice(&1u32.to_le_bytes()); // OEM revision
    table.extend_from_slice(b"PVSP");
    table.extend_from_slice(&1u32.to_le_bytes()); // creator revision
    table.extend_from_slice(body);
    set_checksum(&mut table, 9, None);
    table
}

/// Sets byte `at` so the first `len` bytes (all of them: `None`) sum to 0.
fn set_checksum(bytes: &mut [u8], at: usize, len: Option<usize>) {
    bytes[at] = 0;
    let end = len.unwrap_or(bytes.len());
    let sum = bytes[..end].iter().fold(0u8, |sum, b| sum.wrapping_add(*b));
    bytes[at] = 0u8.wrapping_sub(sum);
}

/// The ACPI tables for `vcpus` vCPUs (APIC IDs 0..vcpus, KVM's vCPU ids), as (offset, bytes).
pub fn acpi_tables(vcpus: u32) -> Vec<(u64, Vec<u8>)> {
    let mut rsdp = Vec::with_capacity(36);
    rsdp.extend_from_slice(b"RSD PTR ");
    rsdp.push(0); // checksum of the first 20 bytes
    rsdp.extend_from_slice(b"PVSPIN");
    rsdp.push(2); // revision: XSDT
    rsdp.extend_from_slice(&0u32.to_le_bytes()); // no RSDT
    rsdp.extend_from_slice(&36u32.to_le_bytes());
    rsdp.extend_from_slice(&(ACPI_ADDR + XSDT_OFFSET).to_le_bytes());
    rsdp.extend_from_slice(&[0; 4]); // extended checksum, reserved
    set_checksum(&mut rsdp, 8, Some(20));
    set_checksum(&mut rsdp, 32, None);

    let xsdt_body: Vec<u8> = [FADT_OFFSET, MADT_OFFSET]
        .iter()
        .flat_map(|offset| (ACPI_ADDR + offset).to_le_bytes())
        .collect();

    // FADT revision 6 (276 bytes): hardware-reduced ACPI, the sleep control register at the
    // power-off port, the DSDT.
    let mut fadt = vec![0u8; 276 - 36];
    let dsdt = ACPI_ADDR + DSDT_OFFSET;
    let put = |fadt: &mut Vec<u8>, offset: usize, bytes: &[u8]| {
        fadt[offset - 36..offset - 36 + bytes.len()].copy_from_slice(bytes);
    };
    put(&mut fadt, 40, &(dsdt as u32).to_le_bytes());
    put(&mut fadt, 112, &(1u32 << 20).to_le_bytes()); // HW_REDUCED_ACPI
    put(&mut fadt, 131, &[3]); // minor version
    put(&mut fadt, 140, &dsdt.to_le_bytes()); // X_DSDT
                                              // SLEEP_CONTROL_REG: system I/O, 8 bits, byte access, the power-off port.
    put(&mut fadt, 244, &[1, 8, 0, 1]);
    put(&mut fadt, 248, &u64::from(POWER_OFF_PORT).to_le_bytes());
    put(&mut fadt, 268, b"PVSPINVM");

    // DSDT: Name (_S5_, Package () { 5 }): SLP_TYP 5 for S5.
    let dsdt_body = [0x08, b'_', b'S', b'5', b'_', 0x12, 0x04, 0x01, 0x0a, 0x05];

    // MADT: the LAPIC address, PCAT_COMPAT, one enabled processor local APIC per vCPU.
    let mut madt = Vec::new();
    madt.extend_from_slice(&0xfee0_0000u32.to_le_bytes());
    madt.extend_from_slice(&1u32.to_le_bytes());
    for index in 0..vcpus {
        let id = u8::try_from(index).unwrap_or(u8::MAX);
        madt.extend_from_slice(&[0, 8, id, id]);
        madt.extend_from_slice(&1u32.to_le_bytes());
    }

    vec![
        (RSDP_OFFSET, rsdp),
        (XSDT_OFFSET, sdt(b"XSDT", 1, &xsdt_body)),
        (FADT_OFFSET, sdt(b"FACP", 6, &fadt)),
        (DSDT_OFFSET, sdt(b"DSDT", 2, &dsdt_body)),
        (MADT_OFFSET, sdt(b"APIC", 4, &madt)),
    ]
}

/// The boot vCPU's special registers at the PVH entry: 32-bit protected mode, flat segments,
/// paging off.
pub fn entry_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3,
        ..code
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.cr0 = 1; // PE
    sregs.cr4 = 0;
    sregs.efer = 0;
    sregs
}

/// The boot vCPU's general registers at the PVH entry: `rbx` = the start info.
pub fn entry_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rbx: START_INFO_ADDR,
        rflags: 0x2,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvspin_test_vm_proto::cmdline;

    #[test]
    fn the_guest_reads_back_every_configuration_pvspin_vmm_writes() {
        let base = RunConfig::default();
        let configs = [
            base.clone(),
            RunConfig {
                vcpus: 4,
                lock: pvspin_test_vm_proto::LockKind::Queued,
                pv: PvMode::KickYield,
                user_mode: true,
                wait: WaitMode::Doorbell,
                budgets: BudgetMode::Spins,
                run_slots: Some(2),
                spin_threshold: 99,
                iterations: 7,
                cs_work: 3,
                ncs_work: 5,
                kick_path: pvspin::KickPath::SignalMsi,
                cpuid_leaves: [1, 0x4000_0200, 0, 0],
                ..base.clone()
            },
            RunConfig {
                guest: GuestKind::Stock,
                lock: pvspin_test_vm_proto::LockKind::Queued,
                pv: PvMode::Kick,
                ..base.clone()
            },
            RunConfig {
                workload: pvspin_test_vm_proto::Workload::PingPong,
                pv: PvMode::Kick,
                wait: WaitMode::Hlt,
                ..base
            },
        ];
        for config in configs {
            assert_eq!(config.validate(255), Ok(()), "{config:?}");
            let line = guest_cmdline(&config, 2_600_000);
            let parsed = cmdline::parse(&line).unwrap_or_else(|e| panic!("{line}: {e:?}"));
            assert_eq!(
                parsed.params,
                crate::vmm::boot_params(&config, 2_600_000),
                "{line}"
            );
            assert_eq!(parsed.vcpus, Some(config.vcpus));
        }
    }

    fn checksum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |sum, b| sum.wrapping_add(*b))
    }

    #[test]
    fn acpi_tables_have_valid_checksums_and_list_every_vcpu() {
        let tables = acpi_tables(5);
        let (_, rsdp) = &tables[0];
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(checksum(&rsdp[..20]), 0);
        assert_eq!(checksum(rsdp), 0);
        for (_, table) in &tables[1..] {
            assert_eq!(
                u32::from_le_bytes(table[4..8].try_into().unwrap()) as usize,
                table.len()
            );
            assert_eq!(checksum(table), 0, "{:?}", &table[..4]);
        }
        let (_, madt) = tables.iter().find(|(_, t)| &t[..4] == b"APIC").unwrap();
        let ids: Vec<u8> = madt[44..].chunks(8).map(|entry| entry[3]).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4]);
        // The tables do not overlap.
        let mut spans: Vec<(u64, u64)> = tables
            .iter()
            .map(|(offset, t)| (*offset, offset + t.len() as u64))
            .collect();
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
        let largest = acpi_tables(255);
        let end = largest
            .iter()
            .map(|(o, t)| o + t.len() as u64)
            .max()
            .unwrap();
        assert!(ACPI_ADDR + end <= 1 << 20);
    }

    /// The first MiB of guest memory, as the guest's firmware reader sees it.
    struct Phys(Vec<u8>);

    impl Phys {
        fn of(memory: &VmMemory) -> Self {
            let mut low = vec![0; 1 << 20];
            memory.read_slice(&mut low, GuestAddress(0)).unwrap();
            Self(low)
        }
    }

    impl pvspin_test_vm_proto::firmware::PhysRead for Phys {
        fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
            self.0.get(addr as usize..(addr as usize).checked_add(len)?)
        }
    }

    #[test]
    fn the_guests_firmware_reader_finds_the_vcpus_and_the_power_off_port() {
        let memory = crate::memory::create(16 << 20).unwrap();
        write_boot_data(&memory, 16 << 20, "", 7).unwrap();
        // Through the start info's RSDP, and by the guest's scan of the BIOS area.
        for hint in [ACPI_ADDR, 0] {
            let firmware = pvspin_test_vm_proto::firmware::read(&Phys::of(&memory), hint);
            assert!(firmware.power_off.hardware_reduced);
            assert_eq!(firmware.power_off.dsdt, ACPI_ADDR + DSDT_OFFSET);
            let cpus = firmware.cpus.expect("the MADT's CPUs");
            assert_eq!(&cpus.apic_ids[..cpus.count], &[0, 1, 2, 3, 4, 5, 6]);
            assert_eq!(firmware.power_off.sleep_control_port, POWER_OFF_PORT);
            let memory = Phys::of(&memory);
            assert_eq!(
                pvspin_test_vm_proto::firmware::s5_sleep_type(&memory, &firmware.power_off),
                5
            );
        }
    }

    #[test]
    fn boot_data_lands_where_the_start_info_says() {
        let memory = crate::memory::create(16 << 20).unwrap();
        write_boot_data(&memory, 16 << 20, "vcpus=2", 2).unwrap();
        let info: hvm_start_info = memory.read_obj(GuestAddress(START_INFO_ADDR)).unwrap();
        assert_eq!(info.magic, START_INFO_MAGIC);
        assert_eq!(
            (info.cmdline_paddr, info.rsdp_paddr),
            (CMDLINE_ADDR, ACPI_ADDR)
        );
        let mut text = [0u8; 8];
        memory
            .read_slice(&mut text, GuestAddress(CMDLINE_ADDR))
            .unwrap();
        assert_eq!(&text, b"vcpus=2\0");
        let too_long = "x".repeat(5000);
        assert!(matches!(
            write_boot_data(&memory, 16 << 20, &too_long, 2),
            Err(PvhError::CmdlineTooLong { .. })
        ));
    }
}
