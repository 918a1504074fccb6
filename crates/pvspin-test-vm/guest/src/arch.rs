//! The few x86 instructions the guest needs, each in its own inline-asm wrapper.

use core::arch::asm;

/// Writes one byte to an I/O port.
pub fn outb(port: u16, value: u8) {
    // SAFETY: port I/O has no memory effects in this guest; the VMM decides what it means.
    unsafe { asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags)) };
}

/// Writes four bytes to an I/O port.
pub fn outl(port: u16, value: u32) {
    // SAFETY: as for `outb`.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack, preserves_flags)) };
}

/// Reads four bytes from an I/O port.
pub fn inl(port: u16) -> u32 {
    let value: u32;
    // SAFETY: as for `outb`: port I/O has no memory effects in this guest.
    unsafe { asm!("in eax, dx", in("dx") port, out("eax") value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes a model-specific register.
///
/// # Safety
///
/// CPL 0; `msr` must exist (an unknown MSR raises #GP, which this guest cannot handle).
pub unsafe fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("wrmsr", in("ecx") msr, in("eax") value as u32, in("edx") (value >> 32) as u32, options(nostack, preserves_flags))
    };
}

/// Reads the time-stamp counter.
pub fn rdtsc() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: rdtsc only reads the TSC into edx:eax.
    unsafe { asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags)) };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// The current privilege level (CS.RPL).
pub fn cpl() -> u16 {
    let cs: u16;
    // SAFETY: reads the CS selector into a register.
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) };
    cs & 3
}

/// Stops this vCPU for good: the vCPU has nothing more to do. In kernel mode `cli; hlt`; in
/// user mode, where `hlt` is privileged, a write to the park port asks the VMM to park it.
pub fn halt_forever() -> ! {
    loop {
        if cpl() == 0 {
            // SAFETY: CPL 0: cli; hlt stops this vCPU until the VMM resumes it.
            unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
        } else {
            outb(pvspin_test_vm_proto::PARK_PORT, 0);
            core::hint::spin_loop();
        }
    }
}

/// Halts this vCPU once with interrupts off (CPL 0 only): returns when a kick (a REMRD MSI,
/// which KVM remembers when it arrives before the halt) or any other wake-up ends it.
pub fn halt_until_kicked() {
    // SAFETY: CPL 0 (the caller's contract): cli; hlt stops this vCPU until KVM wakes it, and
    // touches no memory.
    unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
}

/// Drops to user mode (CPL 3, IOPL 3, interrupts still off) on the same stack, and returns
/// there. The GDT's user code and data selectors are 0x23 and 0x1b; the page tables map
/// everything user-accessible. There is no TSS or IDT: any exception in user mode is a triple
/// fault.
pub fn enter_user_mode() {
    // SAFETY: builds an iretq frame to the label right after it, with the current stack
    // pointer and flags (plus IOPL 3): execution continues in place, only the privilege
    // changes. The selectors name user descriptors in the VMM's GDT.
    unsafe {
        asm!(
            "mov {tmp}, rsp",
            "push 0x1b",
            "push {tmp}",
            "pushfq",
            "or qword ptr [rsp], 0x3000",
            "push 0x23",
            "lea {tmp}, [rip + 2f]",
            "push {tmp}",
            "iretq",
            "2:",
            tmp = out(reg) _,
        );
    }
}

/// Executes `ud2`: an invalid-opcode fault. With no IDT this is a triple fault.
pub fn invalid_opcode() -> ! {
    // SAFETY: deliberately faults; nothing after it runs.
    unsafe { asm!("ud2", options(noreturn, nomem, nostack)) }
}

/// Executes `vmcall` (a KVM hypercall with an unknown number). With the FIX_HYPERCALL_INSN
/// quirk off this raises #UD on hosts of the other vendor or on emulating hosts, instead of
/// looping inside KVM.
pub fn hypercall() {
    // SAFETY: vmcall clobbers rax with the return value; the number 0x7fff is unknown to KVM.
    unsafe { asm!("vmcall", inout("rax") 0x7fffu64 => _, options(nostack)) };
}

/// Executes CPUID for `leaf` (subleaf 0); returns `[eax, ebx, ecx, edx]`.
pub fn cpuid(leaf: u32) -> [u32; 4] {
    let (eax, ebx, ecx, edx): (u32, u32, u32, u32);
    // SAFETY: cpuid only writes the four registers; rbx is reserved by LLVM, so it is saved
    // and restored around the instruction by hand.
    unsafe {
        asm!(
            "mov {saved:r}, rbx",
            "cpuid",
            "xchg {saved:r}, rbx",
            saved = out(reg) ebx,
            inout("eax") leaf => eax,
            inout("ecx") 0u32 => ecx,
            out("edx") edx,
            options(nomem, nostack, preserves_flags),
        );
    }
    [eax, ebx, ecx, edx]
}


/// Writes two bytes to an I/O port.
pub fn outw(port: u16, value: u16) {
    // SAFETY: as for `outb`.
    unsafe { asm!("out dx, ax", in("dx") port, in("ax") value, options(nomem, nostack, preserves_flags)) };
}

/// Reads a 32-bit device register (memory-mapped I/O).
///
/// # Safety
///
/// `addr` must be mapped (the PVH page tables identity-map 4 GiB) and reading it must have no
/// effect the caller did not intend.
pub unsafe fn mmio_read32(addr: u64) -> u32 {
    // SAFETY: the caller's contract; a volatile load is one 32-bit access.
    unsafe { (addr as *const u32).read_volatile() }
}

/// Writes a 32-bit device register (memory-mapped I/O).
///
/// # Safety
///
/// As for [`mmio_read32`], for a write.
pub unsafe fn mmio_write32(addr: u64, value: u32) {
    // SAFETY: the caller's contract; a volatile store is one 32-bit access.
    unsafe { (addr as *mut u32).write_volatile(value) };
}
