//! Guest memory: creation, the long-mode tables every vCPU starts with, the guest image and the
//! boot parameters.

use std::io::Cursor;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::loader::{elf::Elf, KernelLoader};
use pvspin_test_vm_proto::{
    stack_top, vcpu_slot_addr, BootParams, VcpuSlot, BOOT_PARAMS_ADDR, GDT_ADDR, IMAGE_BASE,
    IMAGE_MAX_BYTES, MAPPED_BYTES, PML4_ADDR,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory of the test VM.
pub type VmMemory = GuestMemoryMmap<()>;

/// Errors while preparing guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// mmap of guest memory failed.
    #[error("cannot allocate {bytes} bytes of guest memory: {source}")]
    Allocate {
        /// Size asked for.
        bytes: u64,
        /// The cause.
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    /// The memfd behind shared guest memory could not be made.
    #[error("cannot create {bytes} bytes of shareable guest memory (memfd): {source}")]
    Shared {
        /// Size asked for.
        bytes: u64,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A write into guest memory failed (an address outside it).
    #[error("writing the {what} at {addr:#x}: {source}")]
    Write {
        /// What was being written.
        what: &'static str,
        /// Where.
        addr: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The guest image could not be loaded.
    #[error("loading the guest image: {0}")]
    Load(#[source] linux_loader::loader::Error),
    /// The guest image lies outside its reserved window.
    #[error("the guest image spans {start:#x}..{end:#x}, outside its window {IMAGE_BASE:#x}..{:#x}", IMAGE_BASE + IMAGE_MAX_BYTES)]
    ImageOutOfWindow {
        /// Load address.
        start: u64,
        /// End address.
        end: u64,
    },
}

/// GDT entries: null, kernel code (64-bit), kernel data, user data, user code (64-bit).
const GDT: [u64; 5] = [
    0,
    0x00af_9b00_0000_ffff,
    0x00cf_9300_0000_ffff,
    0x00cf_f300_0000_ffff,
    0x00af_fb00_0000_ffff,
];
const KERNEL_CS: u16 = 0x08;
const KERNEL_DS: u16 = 0x10;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Allocates `bytes` of zeroed guest memory at GPA 0.
pub fn create(bytes: u64) -> Result<VmMemory, MemoryError> {
    let size = usize::try_from(bytes).unwrap_or(usize::MAX);
    VmMemory::from_ranges(&[(GuestAddress(0), size)])
        .map_err(|source| MemoryError::Allocate { bytes, source })
}

/// Allocates `bytes` of zeroed guest memory at GPA 0 backed by a memfd, so that a vhost-user
/// backend can map it (the descriptor travels in `VHOST_USER_SET_MEM_TABLE`).
pub fn create_shared(bytes: u64) -> Result<VmMemory, MemoryError> {
    let shared_error = |source: std::io::Error| MemoryError::Shared { bytes, source };
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new descriptor
    // or -1, checked below.
    let fd = unsafe { libc::memfd_create(c"pvspin-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(shared_error(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(bytes).map_err(shared_error)?;
    let size = usize::try_from(bytes).unwrap_or(usize::MAX);
    VmMemory::from_ranges_with_files(&[(
        GuestAddress(0),
        size,
        Some(vm_memory::FileOffset::new(file, 0)),
    )])
    .map_err(|source| MemoryError::Allocate { bytes, source })
}

fn write<T: vm_memory::ByteValued>(
    memory: &VmMemory,
    what: &'static str,
    addr: u64,
    value: T,
) -> Result<(), MemoryError> {
    memory
        .write_obj(value, GuestAddress(addr))
        .map_err(|source| MemoryError::Write { what, addr, source })
}

/// Writes the GDT and identity-maps [`MAPPED_BYTES`] with 2 MiB pages.
pub fn write_tables(memory: &VmMemory) -> Result<(), MemoryError> {
    for (i, entry) in GDT.iter().enumerate() {
        write(memory, "GDT", GDT_ADDR + 8 * i as u64, *entry)?;
    }
    let pdpt = PML4_ADDR + 0x1000;
    let directories = MAPPED_BYTES >> 30;
    // User-accessible too: the lock workload can run in user mode (no SMEP/SMAP is enabled,
    // so kernel mode is unaffected).
    const PRESENT_WRITABLE: u64 = 0x7;
    const HUGE: u64 = 0x80;
    write(memory, "PML4", PML4_ADDR, pdpt | PRESENT_WRITABLE)?;
    for gib in 0..directories {
        let directory = pdpt + 0x1000 * (gib + 1);
        write(memory, "PDPT", pdpt + 8 * gib, directory | PRESENT_WRITABLE)?;
        for page in 0..512u64 {
            let addr = (gib << 30) | (page << 21);
            write(
                memory,
                "page directory",
                directory + 8 * page,
                addr | PRESENT_WRITABLE | HUGE,
            )?;
        }
    }
    Ok(())
}

/// Loads the guest ELF image; returns its entry point.
pub fn load_image(memory: &VmMemory, image: &[u8]) -> Result<u64, MemoryError> {
    load(memory, image).map(|loaded| loaded.entry)
}

/// Where a loaded guest image is entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedImage {
    /// The ELF entry point (the direct boot's 64-bit entry).
    pub entry: u64,
    /// The PVH entry from the image's `XEN_ELFNOTE_PHYS32_ENTRY` note, when it has one.
    pub pvh_entry: Option<u64>,
}

/// Loads the guest ELF image (below 1 MiB nothing: linux-loader refuses segments there).
pub fn load(memory: &VmMemory, image: &[u8]) -> Result<LoadedImage, MemoryError> {
    let loaded = Elf::load(
        memory,
        None,
        &mut Cursor::new(image),
        Some(GuestAddress(1 << 20)),
    )
    .map_err(MemoryError::Load)?;
    let start = loaded.kernel_load.0;
    let end = loaded.kernel_end;
    if start < IMAGE_BASE || end > IMAGE_BASE + IMAGE_MAX_BYTES {
        return Err(MemoryError::ImageOutOfWindow { start, end });
    }
    let pvh_entry = match loaded.pvh_boot_cap {
        linux_loader::loader::elf::PvhBootCapability::PvhEntryPresent(addr) => Some(addr.0),
        _ => None,
    };
    Ok(LoadedImage {
        entry: start,
        pvh_entry,
    })
}

/// Writes the boot parameters and zeroes every vCPU's progress slot.
pub fn write_boot_params(
    memory: &VmMemory,
    params: &BootParams,
    vcpus: u32,
) -> Result<(), MemoryError> {
    write(memory, "boot parameters", BOOT_PARAMS_ADDR, Pod(*params))?;
    for index in 0..vcpus {
        let slot = VcpuSlot {
            index: u64::from(index),
            ..VcpuSlot::default()
        };
        write(memory, "vCPU slot", vcpu_slot_addr(index), Pod(slot))?;
    }
    Ok(())
}

/// Reads the boot parameters back (the guest writes its result into them).
pub fn read_boot_params(memory: &VmMemory) -> Option<BootParams> {
    memory
        .read_obj::<Pod<BootParams>>(GuestAddress(BOOT_PARAMS_ADDR))
        .ok()
        .map(|pod| pod.0)
}

/// Reads vCPU `index`'s progress slot.
pub fn read_slot(memory: &VmMemory, index: u32) -> Option<VcpuSlot> {
    memory
        .read_obj::<Pod<VcpuSlot>>(GuestAddress(vcpu_slot_addr(index)))
        .ok()
        .map(|pod| pod.0)
}

/// Wraps the protocol's plain-data structs so vm-memory can copy them.
#[derive(Clone, Copy, Debug, Default)]
#[repr(transparent)]
struct Pod<T>(T);

// SAFETY: BootParams and VcpuSlot are repr(C) structs of u32/u64 fields with no padding (the
// protocol crate checks their sizes at compile time), so every byte pattern is a valid value.
unsafe impl vm_memory::ByteValued for Pod<BootParams> {}
// SAFETY: as above.
unsafe impl vm_memory::ByteValued for Pod<VcpuSlot> {}

/// The special registers vCPU `index` starts with: 64-bit mode, CPL 0, paging on, and GS
/// based at its progress slot (the guest's per-CPU data: it reads its index there).
pub fn initial_sregs(mut sregs: kvm_sregs, index: u32) -> kvm_sregs {
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: KERNEL_CS,
        type_: 0xb,
        present: 1,
        dpl: 0,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: KERNEL_DS,
        type_: 0x3,
        db: 1,
        l: 0,
        ..code
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = kvm_segment {
        base: vcpu_slot_addr(index),
        ..data
    };
    sregs.ss = data;
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = u16::try_from(GDT.len() * 8 - 1).unwrap_or(u16::MAX);
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
    sregs
}

/// The general registers vCPU `index` starts with.
pub fn initial_regs(index: u32, entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: stack_top(index),
        rdi: u64::from(index),
        rsi: BOOT_PARAMS_ADDR,
        rflags: 0x2,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_identity_map_with_huge_pages() {
        let memory = create(16 << 20).unwrap();
        write_tables(&memory).unwrap();
        let pml4: u64 = memory.read_obj(GuestAddress(PML4_ADDR)).unwrap();
        assert_eq!(pml4, (PML4_ADDR + 0x1000) | 7);
        let pd = PML4_ADDR + 0x2000;
        let second: u64 = memory.read_obj(GuestAddress(pd + 8)).unwrap();
        assert_eq!(second, (2 << 20) | 0x87);
        let gdt_code: u64 = memory.read_obj(GuestAddress(GDT_ADDR + 8)).unwrap();
        assert_eq!(gdt_code, GDT[1]);
    }

    #[test]
    fn boot_params_round_trip() {
        let memory = create(16 << 20).unwrap();
        let params = BootParams {
            magic: 7,
            vcpus: 3,
            iterations: 9,
            ..Default::default()
        };
        write_boot_params(&memory, &params, 3).unwrap();
        assert_eq!(read_boot_params(&memory), Some(params));
        assert_eq!(read_slot(&memory, 2).map(|slot| slot.index), Some(2));
    }

    #[test]
    fn rejects_garbage_images() {
        let memory = create(16 << 20).unwrap();
        assert!(matches!(
            load_image(&memory, b"not an elf"),
            Err(MemoryError::Load(_))
        ));
    }

    #[test]
    fn the_guest_image_carries_a_pvh_entry_note_inside_its_window() {
        let memory = create(16 << 20).unwrap();
        let loaded = load(&memory, crate::vmm::GUEST_IMAGE).unwrap();
        let pvh = loaded
            .pvh_entry
            .expect("the guest ELF has no PVH entry note");
        assert!(
            (IMAGE_BASE..IMAGE_BASE + IMAGE_MAX_BYTES).contains(&pvh),
            "{pvh:#x}"
        );
        assert_ne!(pvh, loaded.entry);
        // The note itself, read from the ELF: owner "Xen", type 18, a 32-bit address.
        let image = crate::vmm::GUEST_IMAGE;
        let note = [4u32.to_le_bytes(), 4u32.to_le_bytes(), 18u32.to_le_bytes()].concat();
        let at = image
            .windows(note.len() + 4)
            .position(|w| w[..12] == note[..] && &w[12..] == b"Xen\0")
            .expect("no Xen note of type 18");
        let desc = u32::from_le_bytes(image[at + 16..at + 20].try_into().unwrap());
        assert_eq!(u64::from(desc), pvh);
    }

    #[test]
    fn initial_state_is_long_mode() {
        let sregs = initial_sregs(kvm_sregs::default(), 3);
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.gs.base, vcpu_slot_addr(3));
        assert_eq!(sregs.efer & EFER_LMA, EFER_LMA);
        let regs = initial_regs(1, 0x20_1000);
        assert_eq!(regs.rdi, 1);
        assert_eq!(regs.rsp, stack_top(1));
    }
}
