//! PVH boot (`pvspin_test_vm_proto::pvh`): the ELF note, the 32-bit entry, long mode from the
//! guest's own tables, the CPU list, the APs' INIT-SIPI-SIPI, exceptions, and power-off.
//!
//! Kernel-mode guest code is emulated on hosts without hardware virtualization, so the boot
//! path does little: the page tables and GDT are built by the assembler, not at run time.

use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

use pvspin_test_vm_proto::cmdline::{self, MAX_CMDLINE_BYTES};
use pvspin_test_vm_proto::firmware::{self, PhysRead, PowerOff};
use pvspin_test_vm_proto::pvh::{
    MemmapEntry, StartInfo, I8042_COMMAND_PORT, I8042_RESET, MEMMAP_RAM, POWER_OFF_PORT,
    POWER_OFF_VALUE, START_INFO_MAGIC, TRAMPOLINE_ADDR, TRAMPOLINE_VECTOR,
};
use pvspin_test_vm_proto::{
    status, steal_time_addr, vcpu_slot_addr, BootParams, VcpuSlot, BOOT_PARAMS_ADDR, MAX_VCPUS,
    STACKS_ADDR, STACK_SIZE,
};

use crate::arch::{cpuid, halt_forever, mmio_read32, mmio_write32, outb, outl, outw, wrmsr};
use crate::console::Line;

/// Set once the boot vCPU entered through PVH: the run ends with a power-off.
pub static PVH_BOOT: AtomicBool = AtomicBool::new(false);

/// The GDT: null, kernel code (64-bit, 0x08), kernel data (0x10), user data (0x1b), user code
/// (64-bit, 0x23) as under the direct boot, 32-bit kernel code (0x28) for the entry and the
/// AP trampoline, then one 16-byte TSS descriptor per vCPU from [`TSS_SELECTOR_BASE`].
#[repr(C, align(16))]
struct Gdt([u64; 6 + 2 * MAX_VCPUS as usize]);

const TSS_SELECTOR_BASE: u16 = 0x30;

static mut GDT: Gdt = Gdt({
    let mut gdt = [0u64; 6 + 2 * MAX_VCPUS as usize];
    gdt[1] = 0x00af_9b00_0000_ffff;
    gdt[2] = 0x00cf_9300_0000_ffff;
    gdt[3] = 0x00cf_f300_0000_ffff;
    gdt[4] = 0x00af_fb00_0000_ffff;
    gdt[5] = 0x00cf_9b00_0000_ffff;
    gdt
});
const GDT_LIMIT: usize = core::mem::size_of::<Gdt>() - 1;

/// A 64-bit TSS: `rsp0` (the stack an exception from user mode runs on) and the I/O bitmap
/// offset. Every vCPU's TSS points at one shared bitmap that allows every port: user mode
/// runs the workloads' port I/O (the doorbell, the console). IOPL 3 would allow it too on
/// hardware, but emulators check the bitmap (KVM's does, here).
#[repr(C, packed)]
struct Tss {
    reserved0: u32,
    rsp: [u64; 3],
    reserved1: u64,
    ist: [u64; 7],
    reserved2: u64,
    reserved3: u16,
    iopb_offset: u16,
}

const TSS_BYTES: u16 = core::mem::size_of::<Tss>() as u16;

/// Every vCPU's TSS, then the I/O bitmap they share (all ports allowed) and its terminating
/// all-ones byte. Each TSS's bitmap offset is the distance to the shared bitmap (at most
/// 64 KiB, which the layout keeps).
#[repr(C, packed)]
struct TssBlock {
    tss: [Tss; MAX_VCPUS as usize],
    io_bitmap: [u8; IO_BITMAP_BYTES],
    terminator: u8,
}

const IO_BITMAP_BYTES: usize = 65536 / 8;
const IO_BITMAP_OFFSET: usize = core::mem::offset_of!(TssBlock, io_bitmap);
const _: () = assert!(IO_BITMAP_OFFSET + IO_BITMAP_BYTES < 0x1_0000);

static mut TSS: TssBlock = TssBlock {
    tss: [const {
        Tss {
            reserved0: 0,
            rsp: [0; 3],
            reserved1: 0,
            ist: [0; 7],
            reserved2: 0,
            reserved3: 0,
            iopb_offset: 0,
        }
    }; MAX_VCPUS as usize],
    io_bitmap: [0; IO_BITMAP_BYTES],
    terminator: 0xff,
};

/// Per-vCPU stacks for exceptions taken in user mode.
#[repr(C, align(16))]
struct ExceptionStack([u8; 2048]);
static mut EXCEPTION_STACKS: [ExceptionStack; MAX_VCPUS as usize] =
    [const { ExceptionStack([0; 2048]) }; MAX_VCPUS as usize];

/// The IDT: the 32 exception vectors, each an interrupt gate to its stub.
#[repr(C, align(16))]
struct Idt([u64; 64]);
static mut IDT: Idt = Idt([0; 64]);

/// The boot vCPU's stack until it knows its index.
#[repr(C, align(16))]
struct BootStack([u8; 16384]);
static mut BOOT_STACK: BootStack = BootStack([0; 16384]);

/// Per APIC ID: vCPU index + 1 (0: not a vCPU of this run), written by the boot vCPU before
/// it sends the SIPIs, read by each AP to find its stack.
static APIC_INDEX: [AtomicU8; 256] = [const { AtomicU8::new(0) }; 256];
/// APs that reached long mode and set themselves up.
static ONLINE: AtomicU32 = AtomicU32::new(0);

/// How to power off, read from the FADT at boot (the DSDT only when powering off).
static POWER_SLEEP_CONTROL: AtomicU32 = AtomicU32::new(0);
static POWER_PM1A: AtomicU32 = AtomicU32::new(0);
static POWER_PM1B: AtomicU32 = AtomicU32::new(0);
static POWER_HARDWARE_REDUCED: AtomicBool = AtomicBool::new(false);
static POWER_DSDT: AtomicU64 = AtomicU64::new(0);

const LAPIC_BASE: u64 = 0xfee0_0000;
const LAPIC_ID: u64 = LAPIC_BASE + 0x20;
const LAPIC_ICR_LOW: u64 = LAPIC_BASE + 0x300;
const LAPIC_ICR_HIGH: u64 = LAPIC_BASE + 0x310;
const ICR_INIT: u32 = 0x0000_4500;
const ICR_STARTUP: u32 = 0x0000_4600;
const ICR_PENDING: u32 = 1 << 12;
const MSR_GS_BASE: u32 = 0xc000_0101;

global_asm!(
    // The PVH entry note: owner "Xen", type XEN_ELFNOTE_PHYS32_ENTRY, the 32-bit entry.
    ".pushsection .note.pvh, \"a\", @note",
    ".balign 4",
    ".long 4",
    ".long 4",
    ".long 18",
    ".asciz \"Xen\"",
    ".balign 4",
    ".long pvh_start32",
    ".popsection",
    // The identity map of the first 4 GiB, 2 MiB pages, user-accessible (the workloads can
    // run in user mode; no SMEP/SMAP), the last GiB uncached (the LAPIC and other MMIO).
    ".pushsection .data.pvh_tables, \"aw\"",
    ".balign 4096",
    "pvh_pml4:",
    ".quad pvh_pdpt + 7",
    ".fill 511, 8, 0",
    "pvh_pdpt:",
    ".quad pvh_pd + 0x0007",
    ".quad pvh_pd + 0x1007",
    ".quad pvh_pd + 0x2007",
    ".quad pvh_pd + 0x3007",
    ".fill 508, 8, 0",
    "pvh_pd:",
    ".set pvh_page, 0",
    ".rept 1536",
    ".quad pvh_page + 0x87",
    ".set pvh_page, pvh_page + 0x200000",
    ".endr",
    ".rept 512",
    ".quad pvh_page + 0x9f",
    ".set pvh_page, pvh_page + 0x200000",
    ".endr",
    ".balign 16",
    "pvh_gdt_ptr:",
    ".word {gdt_limit}",
    ".quad {gdt}",
    ".balign 16",
    "pvh_idt_ptr:",
    ".word 64 * 8 - 1",
    ".quad {idt}",
    ".popsection",
    ".pushsection .text.pvh, \"ax\"",
    // The boot vCPU: 32-bit protected mode, paging off, ebx = start info, no stack.
    ".code32",
    ".globl pvh_start32",
    "pvh_start32:",
    "cli",
    "cld",
    "mov esi, ebx",
    "rdtsc", // when the boot started, for the boot line
    "mov [{entry_tsc}], eax",
    "mov [{entry_tsc} + 4], edx",
    "lgdt [pvh_gdt_ptr]",
    "xor edi, edi",
    "jmp 2f",
    // An AP, from the trampoline: our GDT, CS = 0x28.
    "pvh_ap_start32:",
    "mov edi, 1",
    "2:",
    "mov eax, 0x10",
    "mov ds, ax",
    "mov es, ax",
    "mov ss, ax",
    "mov fs, ax",
    "mov gs, ax",
    "mov eax, offset pvh_pml4",
    "mov cr3, eax",
    "mov eax, cr4",
    "or eax, 0x20", // PAE
    "mov cr4, eax",
    "mov ecx, 0xc0000080", // EFER
    "rdmsr",
    "or eax, 0x100", // LME
    "wrmsr",
    "mov eax, cr0",
    "or eax, 0x80000023", // PG | NE | MP | PE
    "mov cr0, eax",
    ".byte 0xea", // ljmp 0x08:3f
    ".long 3f",
    ".word 0x08",
    ".code64",
    "3:",
    "test edi, edi",
    "jnz 4f",
    "lea rsp, [rip + {boot_stack} + {boot_stack_size}]",
    "mov edi, esi",
    "call {bsp_main}",
    "ud2",
    // An AP: its index from its LAPIC ID, then its own stack.
    "4:",
    "mov edx, {lapic_id}",
    "mov eax, [rdx]",
    "shr eax, 24",
    "lea rdx, [rip + {apic_index}]",
    "movzx edi, byte ptr [rdx + rax]",
    "test edi, edi",
    "jz 5f",
    "mov eax, edi",
    "dec edi",
    "imul rax, rax, {stack_size}",
    "add rax, {stacks}",
    "mov rsp, rax",
    "call {ap_main}",
    "5:",
    "cli",
    "hlt",
    "jmp 5b",
    // The APs' real-mode trampoline, copied below 1 MiB: CS = SIPI vector << 8, IP = 0.
    ".code16",
    ".globl pvh_trampoline_start",
    "pvh_trampoline_start:",
    ".byte 0xeb, 6", // jmp over the GDT pointer, which is at offset 2
    ".word {gdt_limit}",
    ".long {gdt}",
    "cli",
    "cld",
    "mov ax, cs",
    "mov ds, ax",
    ".byte 0x66", // 32-bit operand: the whole base
    "lgdt [2]",
    "mov eax, cr0",
    "or eax, 1",
    "mov cr0, eax",
    ".byte 0x66, 0xea", // ljmpl 0x28:pvh_ap_start32
    ".long pvh_ap_start32",
    ".word 0x28",
    ".globl pvh_trampoline_end",
    "pvh_trampoline_end:",
    ".code64",
    // Exceptions: push the vector, then one handler reports and powers off.
    ".irp vector, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    "pvh_exception_\\vector:",
    "push \\vector",
    "jmp pvh_exception_common",
    ".endr",
    "pvh_exception_common:",
    "mov rdi, rsp",
    "and rsp, -16",
    "call {exception}",
    "ud2",
    ".popsection",
    ".pushsection .rodata.pvh_exception_stubs, \"a\"",
    ".balign 8",
    ".globl pvh_exception_stubs",
    "pvh_exception_stubs:",
    ".irp vector, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    ".quad pvh_exception_\\vector",
    ".endr",
    ".popsection",
    gdt = sym GDT,
    gdt_limit = const GDT_LIMIT,
    idt = sym IDT,
    boot_stack = sym BOOT_STACK,
    boot_stack_size = const core::mem::size_of::<BootStack>(),
    bsp_main = sym bsp_main,
    ap_main = sym ap_main,
    apic_index = sym APIC_INDEX,
    lapic_id = const LAPIC_ID,
    stack_size = const STACK_SIZE,
    stacks = const STACKS_ADDR,
    exception = sym exception,
    entry_tsc = sym ENTRY_TSC,
);

/// The TSC at the PVH entry (written by the 32-bit entry code, before anything else).
static ENTRY_TSC: AtomicU64 = AtomicU64::new(0);

extern "C" {
    static pvh_trampoline_start: u8;
    static pvh_trampoline_end: u8;
    static pvh_exception_stubs: [u64; 32];
}

/// Ends a boot that cannot go on: says why on the console, then the failure power-off.
fn boot_failed(what: &str, detail: &str) -> ! {
    Line::new()
        .text("pvspin-guest: boot failed: ")
        .text(what)
        .text(detail)
        .print();
    exit(status::BOOT_FAILED)
}

/// Ends the run under PVH boot: the status on the console and in `pvspin-vmm`'s status
/// register, then power-off.
pub fn exit(code: u32) -> ! {
    Line::new()
        .text("pvspin-guest: status ")
        .num(u64::from(code))
        .text(" (")
        .text(status::meaning(code))
        .text("), powering off")
        .print_bounded();
    outl(pvspin_test_vm_proto::EXIT_PORT, code);
    power_off()
}

/// ACPI power-off (the FADT's sleep control register or PM1 control blocks, else Cloud
/// Hypervisor's port 0x600), then the i8042 reset when the VMM is still running us.
pub fn power_off() -> ! {
    let power = PowerOff {
        sleep_control_port: POWER_SLEEP_CONTROL.load(Ordering::Relaxed) as u16,
        pm1a_control_port: POWER_PM1A.load(Ordering::Relaxed) as u16,
        pm1b_control_port: POWER_PM1B.load(Ordering::Relaxed) as u16,
        hardware_reduced: POWER_HARDWARE_REDUCED.load(Ordering::Relaxed),
        dsdt: POWER_DSDT.load(Ordering::Relaxed),
    };
    if power.sleep_control_port != 0 {
        let sleep_type = firmware::s5_sleep_type(&IdentityMapped, &power);
        outb(power.sleep_control_port, ((sleep_type & 7) << 2) | (1 << 5));
    } else if power.pm1a_control_port != 0 {
        let sleep_type = firmware::s5_sleep_type(&IdentityMapped, &power);
        let value = (u16::from(sleep_type & 7) << 10) | (1 << 13);
        outw(power.pm1a_control_port, value);
        if power.pm1b_control_port != 0 {
            outw(power.pm1b_control_port, value);
        }
    } else {
        outb(POWER_OFF_PORT, POWER_OFF_VALUE);
    }
    outb(I8042_COMMAND_PORT, I8042_RESET);
    halt_forever()
}

fn remember_power_off(power: &PowerOff) {
    POWER_SLEEP_CONTROL.store(u32::from(power.sleep_control_port), Ordering::Relaxed);
    POWER_PM1A.store(u32::from(power.pm1a_control_port), Ordering::Relaxed);
    POWER_PM1B.store(u32::from(power.pm1b_control_port), Ordering::Relaxed);
    POWER_HARDWARE_REDUCED.store(power.hardware_reduced, Ordering::Relaxed);
    POWER_DSDT.store(power.dsdt, Ordering::Relaxed);
}

/// Guest-physical memory as the guest sees it: the first 4 GiB identity-mapped.
struct IdentityMapped;

impl PhysRead for IdentityMapped {
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        if addr.checked_add(len as u64)? > 1 << 32 {
            return None;
        }
        // SAFETY: below 4 GiB (checked), which the PVH page tables identity-map (user pages
        // too: the power-off may read the DSDT in user mode); the VMM's tables are memory it
        // gave the guest, which the guest never writes.
        Some(unsafe { core::slice::from_raw_parts(addr as *const u8, len) })
    }
}

/// Reads a `T` of guest-physical memory below 4 GiB.
fn read_phys<T: Copy>(addr: u64) -> T {
    // SAFETY: the PVH page tables identity-map the first 4 GiB; callers pass addresses the VMM
    // gave (start info, memory map) and check they are below 4 GiB; any bytes are a valid
    // value of the plain-data types read here.
    unsafe { (addr as *const T).read_unaligned() }
}

/// The command line at `addr` (up to its NUL or [`MAX_CMDLINE_BYTES`]).
fn cmdline_text(addr: u64) -> Result<&'static str, &'static str> {
    if addr == 0 {
        return Ok("");
    }
    if addr + MAX_CMDLINE_BYTES as u64 > 1 << 32 {
        return Err("the command line lies above 4 GiB");
    }
    // SAFETY: identity-mapped memory below 4 GiB that nothing writes while the guest runs
    // (the VMM's command line; the guest never writes there).
    let bytes = unsafe { core::slice::from_raw_parts(addr as *const u8, MAX_CMDLINE_BYTES) };
    let len = bytes
        .iter()
        .position(|b| *b == 0)
        .ok_or("the command line has no NUL within 4096 bytes")?;
    core::str::from_utf8(bytes.get(..len).unwrap_or(&[]))
        .map_err(|_| "the command line is not UTF-8")
}

/// Whether `[start, end)` lies in one RAM entry of the memory map (true without a map).
fn is_ram(info: &StartInfo, start: u64, end: u64) -> bool {
    if info.version < 1 || info.memmap_entries == 0 || info.memmap_paddr == 0 {
        return true;
    }
    (0..u64::from(info.memmap_entries.min(128))).any(|i| {
        let entry: MemmapEntry =
            read_phys(info.memmap_paddr + i * core::mem::size_of::<MemmapEntry>() as u64);
        entry.kind == MEMMAP_RAM
            && entry.addr <= start
            && end <= entry.addr.saturating_add(entry.size)
    })
}

/// The guest TSC's rate: the command line's, else the hypervisor's timing leaf
/// (0x40000010), else CPUID 0x15; 0 when unknown.
fn tsc_khz(from_cmdline: u64) -> u64 {
    if from_cmdline != 0 {
        return from_cmdline;
    }
    let [max, ..] = cpuid(0x4000_0000);
    if (0x4000_0010..0x4001_0000).contains(&max) {
        let [khz, ..] = cpuid(0x4000_0010);
        if khz != 0 {
            return u64::from(khz);
        }
    }
    let [max_basic, ..] = cpuid(0);
    if max_basic >= 0x15 {
        let [denominator, numerator, crystal_hz, _] = cpuid(0x15);
        if denominator != 0 && numerator != 0 && crystal_hz != 0 {
            return u64::from(crystal_hz) * u64::from(numerator) / u64::from(denominator) / 1000;
        }
    }
    0
}

fn lapic_id() -> u8 {
    // SAFETY: the LAPIC's ID register, identity-mapped (uncached); reading it has no effect.
    (unsafe { mmio_read32(LAPIC_ID) } >> 24) as u8
}

/// Sends one IPI (`icr_low`) to `apic_id` and waits (bounded) until the LAPIC took it.
fn send_ipi(apic_id: u8, icr_low: u32) {
    // SAFETY: the LAPIC's ICR, identity-mapped (uncached): the high half names the target,
    // the write of the low half sends.
    unsafe {
        mmio_write32(LAPIC_ICR_HIGH, u32::from(apic_id) << 24);
        mmio_write32(LAPIC_ICR_LOW, icr_low);
    }
    for _ in 0..1000 {
        // SAFETY: as above; reading the ICR has no effect.
        if unsafe { mmio_read32(LAPIC_ICR_LOW) } & ICR_PENDING == 0 {
            break;
        }
        core::hint::spin_loop();
    }
}

/// Sets vCPU `index` up on the vCPU running this: its GS base (its progress slot, as under the
/// direct boot), its TSS and the IDT.
fn cpu_init(index: u32) {
    if index >= MAX_VCPUS {
        return;
    }
    let i = index as usize;
    // SAFETY: each vCPU writes only its own TSS and its own GDT descriptor, before loading
    // them; the exception stack is its own too. GS base: CPL 0, the MSR exists in long mode.
    unsafe {
        let stack = core::ptr::addr_of_mut!(EXCEPTION_STACKS[i]);
        let top = stack as u64 + core::mem::size_of::<ExceptionStack>() as u64;
        let tss = core::ptr::addr_of_mut!(TSS.tss[i]);
        core::ptr::addr_of_mut!((*tss).rsp).write_unaligned([top, 0, 0]);
        // The distance from this TSS to the shared bitmap; the limit takes in the bitmap and
        // its terminating byte.
        let iopb_offset = IO_BITMAP_OFFSET - i * usize::from(TSS_BYTES);
        core::ptr::addr_of_mut!((*tss).iopb_offset).write_unaligned(iopb_offset as u16);
        let base = tss as u64;
        let limit = (iopb_offset + IO_BITMAP_BYTES) as u64;
        let low = (limit & 0xffff)
            | ((base & 0xff_ffff) << 16)
            | (0x89 << 40)
            | (((limit >> 16) & 0xf) << 48)
            | (((base >> 24) & 0xff) << 56);
        let slot = 6 + 2 * i;
        let gdt = core::ptr::addr_of_mut!(GDT.0);
        (*gdt)[slot] = low;
        (*gdt)[slot + 1] = base >> 32;
        let selector = TSS_SELECTOR_BASE + 16 * index as u16;
        asm!("ltr {0:x}", in(reg) selector, options(nostack, preserves_flags));
        asm!(
            "lidt [rip + pvh_idt_ptr]",
            options(nostack, preserves_flags)
        );
        wrmsr(MSR_GS_BASE, vcpu_slot_addr(index));
    }
}

/// Fills the IDT: interrupt gates (kernel code, DPL 0) to the exception stubs.
fn build_idt() {
    // SAFETY: only the boot vCPU writes the IDT, before any vCPU loads it; the stub table is
    // the assembler's list of 32 addresses.
    unsafe {
        let stubs = core::ptr::addr_of!(pvh_exception_stubs).read();
        let idt = core::ptr::addr_of_mut!(IDT.0);
        for (vector, stub) in stubs.iter().enumerate() {
            (*idt)[2 * vector] =
                (stub & 0xffff) | (0x08 << 16) | (0x8e << 40) | (((stub >> 16) & 0xffff) << 48);
            (*idt)[2 * vector + 1] = stub >> 32;
        }
    }
}

/// Vectors whose exceptions push an error code.
const fn has_error_code(vector: u64) -> bool {
    matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30)
}

/// Every exception: report it (vector, vCPU, RIP, CPL) and end the run with a failure.
extern "C" fn exception(frame: *const u64) -> ! {
    // SAFETY: the stub pushed the vector on the exception frame the CPU built, which it
    // passed: vector, [error code], RIP, CS, RFLAGS, RSP, SS.
    let (vector, rip, cs) = unsafe {
        let vector = frame.read();
        let rip_at = if has_error_code(vector) { 2 } else { 1 };
        (
            vector,
            frame.add(rip_at).read(),
            frame.add(rip_at + 1).read(),
        )
    };
    // SAFETY: the GS base is this vCPU's progress slot once it was set up; before that it is
    // 0 and the index reads as the boot vCPU's (0 or whatever is at address 24).
    let index: u32;
    unsafe {
        asm!(
            "mov {0:e}, dword ptr gs:[{offset}]",
            out(reg) index,
            offset = const pvspin_test_vm_proto::VCPU_SLOT_INDEX_OFFSET,
            options(nostack, preserves_flags, readonly),
        );
    }
    Line::new()
        .text("pvspin-guest: exception ")
        .num(vector)
        .text(" on vCPU ")
        .num(u64::from(index))
        .text(" at rip ")
        .hex(rip)
        .text(", cpl ")
        .num(cs & 3)
        .print_bounded();
    exit(status::EXCEPTION)
}

/// The boot vCPU, in long mode on its boot stack: reads what the VMM gave, starts the APs,
/// and runs the workload on its own stack.
extern "C" fn bsp_main(start_info: u32) -> ! {
    PVH_BOOT.store(true, Ordering::Relaxed);
    build_idt();
    // SAFETY: loads the IDT just built, so a fault during boot is reported.
    unsafe {
        asm!(
            "lidt [rip + pvh_idt_ptr]",
            options(nostack, preserves_flags)
        )
    };
    let info: StartInfo = read_phys(u64::from(start_info));
    if info.magic != START_INFO_MAGIC {
        boot_failed("the PVH start info's magic is wrong", "");
    }
    let text = cmdline_text(info.cmdline_paddr).unwrap_or_else(|why| boot_failed(why, ""));
    let parsed = match cmdline::parse(text) {
        Ok(parsed) => parsed,
        Err(err) => {
            // The command line only now: every console byte is an exit, and the result line
            // names every parameter of a run that went well.
            crate::console::Stream::new()
                .text("pvspin-guest: command line: ")
                .text(text)
                .text("\n");
            let mut out = crate::console::Stream::new();
            out.text("pvspin-guest: command line refused: ")
                .text(err.name)
                .text(": ")
                .text(err.reason);
            let word = err.word_in(text);
            if !word.is_empty() {
                out.text(" (in \"").text(word).text("\")");
            }
            out.text("\n");
            drop(out);
            exit(status::BAD_PARAMS)
        }
    };
    let firmware = firmware::read(&IdentityMapped, info.rsdp_paddr);
    remember_power_off(&firmware.power_off);
    let Some(cpus) = firmware.cpus else {
        boot_failed("the VMM lists no CPUs (no ACPI MADT, no MP table)", "");
    };
    let vcpus = parsed.vcpus.unwrap_or(cpus.count as u32);
    if vcpus as usize > cpus.count {
        boot_failed(
            "vcpus= asks for more CPUs than the VMM lists in its ",
            cpus.source,
        );
    }
    let bsp_apic = lapic_id();
    let bsp_index = match cpus.index_of(bsp_apic) {
        Some(index) if index < vcpus as usize => index as u32,
        _ => boot_failed(
            "the boot CPU is not among the first vcpus= CPUs of the ",
            cpus.source,
        ),
    };
    let fixed = [
        (TRAMPOLINE_ADDR, TRAMPOLINE_ADDR + 0x1000),
        (BOOT_PARAMS_ADDR, steal_time_addr(vcpus)),
        (STACKS_ADDR, STACKS_ADDR + u64::from(vcpus) * STACK_SIZE),
    ];
    if let Some((start, _)) = fixed
        .iter()
        .find(|(start, end)| !is_ram(&info, *start, *end))
    {
        Line::new()
            .text("pvspin-guest: memory the guest uses at ")
            .hex(*start)
            .text(" is not RAM in the VMM's memory map")
            .print();
        exit(status::BOOT_FAILED);
    }
    let params = BootParams {
        vcpus,
        tsc_khz: tsc_khz(parsed.params.tsc_khz),
        ..parsed.params
    };
    KICK_PATH_NAME.store(
        parsed
            .kick_path
            .and_then(|p| cmdline::KICK_PATHS.iter().position(|k| *k == p))
            .map_or(0, |i| i as u8 + 1),
        Ordering::Relaxed,
    );
    // SAFETY: checked RAM above (or the VMM gave no map), and nothing else uses it: the boot
    // parameters, progress slots and steal-time areas, written before any AP starts.
    unsafe {
        (BOOT_PARAMS_ADDR as *mut BootParams).write_volatile(params);
        for index in 0..vcpus {
            (vcpu_slot_addr(index) as *mut VcpuSlot).write_volatile(VcpuSlot {
                index: u64::from(index),
                ..VcpuSlot::default()
            });
        }
        core::ptr::write_bytes(
            steal_time_addr(0) as *mut u8,
            0,
            (steal_time_addr(vcpus) - steal_time_addr(0)) as usize,
        );
    }
    for (index, apic) in cpus.apic_ids.iter().take(vcpus as usize).enumerate() {
        if let Some(slot) = APIC_INDEX.get(usize::from(*apic)) {
            slot.store(index as u8 + 1, Ordering::Relaxed);
        }
    }
    cpu_init(bsp_index);
    if vcpus > 1 {
        // SAFETY: the trampoline page is RAM nothing else uses (checked above); the
        // trampoline is position-independent code between the two assembler labels.
        unsafe {
            let start = core::ptr::addr_of!(pvh_trampoline_start);
            let len = core::ptr::addr_of!(pvh_trampoline_end) as usize - start as usize;
            core::ptr::copy_nonoverlapping(start, TRAMPOLINE_ADDR as *mut u8, len);
        }
        core::sync::atomic::fence(Ordering::SeqCst);
        for apic in cpus.apic_ids.iter().take(vcpus as usize) {
            if *apic != bsp_apic {
                send_ipi(*apic, ICR_INIT);
                send_ipi(*apic, ICR_STARTUP | u32::from(TRAMPOLINE_VECTOR));
                send_ipi(*apic, ICR_STARTUP | u32::from(TRAMPOLINE_VECTOR));
            }
        }
        // Bounded: an AP that never comes is a boot failure, not a hang.
        let deadline = if params.tsc_khz != 0 {
            params.tsc_khz * 1000 * 10
        } else {
            u64::MAX
        };
        let started = crate::arch::rdtsc();
        let mut spins = 0u64;
        while ONLINE.load(Ordering::Acquire) + 1 < vcpus {
            spins += 1;
            let waited = crate::arch::rdtsc().wrapping_sub(started);
            if waited > deadline || (deadline == u64::MAX && spins > 100_000_000) {
                Line::new()
                    .text("pvspin-guest: boot failed: only ")
                    .num(u64::from(ONLINE.load(Ordering::Acquire)) + 1)
                    .text(" of ")
                    .num(u64::from(vcpus))
                    .text(" vCPUs came up after INIT-SIPI-SIPI")
                    .print();
                exit(status::BOOT_FAILED);
            }
            core::hint::spin_loop();
        }
    }
    // From the PVH entry to here: the emulated boot path (tables, command line, APs).
    let boot_cycles = crate::arch::rdtsc().wrapping_sub(ENTRY_TSC.load(Ordering::Relaxed));
    let line = Line::new()
        .text("pvspin-guest: ")
        .num(u64::from(vcpus))
        .text(" vCPUs up (CPU list: ")
        .text(cpus.source)
        .text("), boot took ");
    match boot_cycles
        .checked_mul(1000)
        .zip(Some(params.tsc_khz).filter(|k| *k != 0))
    {
        Some((scaled, khz)) => line.num(scaled / khz).text(" us"),
        None => line.num(boot_cycles).text(" TSC cycles"),
    }
    .print();
    let top = STACKS_ADDR + (u64::from(bsp_index) + 1) * STACK_SIZE;
    // SAFETY: switches to this vCPU's own stack (RAM, checked above) for good: the call never
    // returns, and nothing on the boot stack is used again.
    unsafe {
        asm!(
            "mov rsp, {top}",
            "call {run}",
            "ud2",
            top = in(reg) top,
            run = sym run_vcpu,
            in("edi") bsp_index,
            options(noreturn),
        )
    }
}

/// An AP in long mode on its own stack, `index` from its LAPIC ID.
extern "C" fn ap_main(index: u32) -> ! {
    cpu_init(index);
    ONLINE.fetch_add(1, Ordering::Release);
    run_vcpu(index)
}

extern "C" fn run_vcpu(index: u32) -> ! {
    crate::run(index, BOOT_PARAMS_ADDR as *mut BootParams)
}

/// `kick-path=` from the command line (index + 1 in [`cmdline::KICK_PATHS`], 0: none), for the
/// result line.
static KICK_PATH_NAME: AtomicU8 = AtomicU8::new(0);

/// `kick-path=` from the command line.
pub fn kick_path() -> Option<&'static str> {
    let i = KICK_PATH_NAME.load(Ordering::Relaxed);
    cmdline::KICK_PATHS
        .get(usize::from(i).checked_sub(1)?)
        .copied()
}
