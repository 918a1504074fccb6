//! PVH boot: what the guest reads from any VMM that boots x86 ELF kernels through PVH, and
//! where `pvspin-vmm --boot pvh` puts it.
//!
//! The guest ELF carries a `XEN_ELFNOTE_PHYS32_ENTRY` note. The VMM starts the boot vCPU
//! there in 32-bit protected mode with paging off and `ebx` = the physical address of
//! [`StartInfo`]; the other vCPUs wait for INIT-SIPI-SIPI. The guest then:
//!
//! 1. builds its own long-mode state from its image (page tables identity-mapping 4 GiB, GDT,
//!    IDT, one TSS per vCPU);
//! 2. reads its parameters from the command line ([`crate::cmdline`]), the CPU list from the
//!    ACPI MADT (RSDP from [`StartInfo::rsdp_paddr`], or a scan of the BIOS area) or the MP
//!    table, and how to power off from the FADT;
//! 3. checks that the memory it uses at fixed addresses (the boot parameters, progress slots
//!    and steal-time areas at 0x8000..0xf000, the AP trampoline at [`TRAMPOLINE_ADDR`], the
//!    stacks from [`crate::STACKS_ADDR`]) is RAM in the VMM's memory map;
//! 4. starts the APs with INIT-SIPI-SIPI through its LAPIC (real-mode trampoline below 1 MiB)
//!    and runs the workload as under the direct boot;
//! 5. prints `pvspin-vmm`'s JSON result line on the 16550 at 0x3f8, writes its status to
//!    [`crate::EXIT_PORT`] (`pvspin-vmm`'s status register, other VMMs ignore it) and powers
//!    off through ACPI, with the i8042 reset as the fallback.

/// `hvm_start_info.magic`.
pub const START_INFO_MAGIC: u32 = 0x336e_c578;

/// The PVH start info (`struct hvm_start_info`, version 1), as the VMM writes it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StartInfo {
    /// [`START_INFO_MAGIC`].
    pub magic: u32,
    /// 0 or 1 (1 adds the memory map).
    pub version: u32,
    /// `SIF_*` flags.
    pub flags: u32,
    /// Number of modules.
    pub nr_modules: u32,
    /// GPA of the module list.
    pub modlist_paddr: u64,
    /// GPA of the NUL-terminated command line (0: none).
    pub cmdline_paddr: u64,
    /// GPA of the ACPI RSDP (0: the guest scans for it).
    pub rsdp_paddr: u64,
    /// Version 1: GPA of the memory map ([`MemmapEntry`] each).
    pub memmap_paddr: u64,
    /// Version 1: its number of entries.
    pub memmap_entries: u32,
    /// Reserved.
    pub reserved: u32,
}

/// One entry of the PVH memory map (`struct hvm_memmap_table_entry`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemmapEntry {
    /// First GPA.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// [`MEMMAP_RAM`], [`MEMMAP_RESERVED`], ...
    pub kind: u32,
    /// Reserved.
    pub reserved: u32,
}

/// [`MemmapEntry::kind`]: usable RAM.
pub const MEMMAP_RAM: u32 = 1;
/// [`MemmapEntry::kind`]: reserved.
pub const MEMMAP_RESERVED: u32 = 2;

/// GPA of the page the boot vCPU copies the APs' real-mode trampoline to (SIPI vector 1).
pub const TRAMPOLINE_ADDR: u64 = 0x1000;
/// The SIPI vector that starts an AP at [`TRAMPOLINE_ADDR`].
pub const TRAMPOLINE_VECTOR: u8 = (TRAMPOLINE_ADDR >> 12) as u8;

/// `pvspin-vmm --boot pvh`: GPA of the start info (as Cloud Hypervisor and Firecracker).
pub const START_INFO_ADDR: u64 = 0x6000;
/// `pvspin-vmm --boot pvh`: GPA of the memory map.
pub const MEMMAP_ADDR: u64 = 0x7000;
/// `pvspin-vmm --boot pvh`: GPA of the command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// `pvspin-vmm --boot pvh`: GPA of the ACPI tables (RSDP first, in the BIOS area the guest
/// would scan), reserved in the memory map up to 1 MiB.
pub const ACPI_ADDR: u64 = 0xe_0000;
/// Where the low RAM of `pvspin-vmm --boot pvh`'s memory map ends (the EBDA's usual start).
pub const LOW_RAM_END: u64 = 0x9_fc00;

/// The ACPI sleep control port of Cloud Hypervisor and `pvspin-vmm --boot pvh` (the FADT's
/// `SLEEP_CONTROL_REG`): the guest powers off with [`POWER_OFF_VALUE`] there when the FADT
/// names no other register.
pub const POWER_OFF_PORT: u16 = 0x600;
/// S5 (`SLP_TYP` 5 in bits 2..4) with `SLP_EN` (bit 5): power off.
pub const POWER_OFF_VALUE: u8 = (5 << 2) | (1 << 5);
/// The i8042 command port: writing [`I8042_RESET`] resets the machine (the fallback).
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// The i8042 "pulse reset line" command.
pub const I8042_RESET: u8 = 0xfe;

/// The prefix of every line the guest prints under PVH boot, and of its JSON result line
/// (`pvspin-guest: result {...}`), so a harness can find it in a VMM's console.
pub const RESULT_PREFIX: &str = "pvspin-guest: result ";

const _: () = {
    assert!(core::mem::size_of::<StartInfo>() == 56);
    assert!(core::mem::size_of::<MemmapEntry>() == 24);
    assert!(TRAMPOLINE_ADDR + 0x1000 <= crate::GDT_ADDR + 0x5000);
    assert!(START_INFO_ADDR + 0x1000 <= crate::BOOT_PARAMS_ADDR);
    assert!(MEMMAP_ADDR + 0x1000 <= crate::BOOT_PARAMS_ADDR);
    assert!(CMDLINE_ADDR >= crate::steal_time_addr(crate::MAX_VCPUS));
    assert!(CMDLINE_ADDR + crate::cmdline::MAX_CMDLINE_BYTES as u64 <= LOW_RAM_END);
    assert!(LOW_RAM_END <= ACPI_ADDR);
};
