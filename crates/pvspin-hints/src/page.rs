//! The guest's hint pages (ABI 0.3, `pvspin_abi::hint`): one page of guest memory per vCPU,
//! read and written by the host without exits.
//!
//! The VMM gives pvspin a [`GuestPageMap`] (how a guest page frame becomes host memory);
//! when a vCPU registers its page with the SHARED_PAGE command, [`HintPages::register`] maps
//! it once and keeps the host pointer. Every access afterwards is one atomic load or store of
//! the field's width: the guest writes its line concurrently, so nothing is ever read twice
//! and trusted, and nothing the host reads from the guest line changes host memory safety.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use pvspin_abi::doorbell::SHARED_PAGE_SIZE;
use pvspin_abi::hint;

/// How the host reaches a guest page.
///
/// # Safety
///
/// A pointer [`GuestPageMap::host_page`] returns must point at `SHARED_PAGE_SIZE` bytes of
/// guest RAM mapped into this process, 8-byte aligned, valid for reads and writes for as long
/// as the map object lives (pvspin keeps an `Arc` of it next to every pointer it keeps).
pub unsafe trait GuestPageMap: Send + Sync + fmt::Debug {
    /// The host address of the page at guest physical address `gpa` (page-aligned), or `None`
    /// when it is not guest RAM mapped contiguously in this process.
    fn host_page(&self, gpa: u64) -> Option<NonNull<u8>>;

    /// The byte at `gpa`, read atomically (the guest may write it meanwhile), or `None` when its
    /// page is not guest RAM mapped here. pvspin reads KVM's steal-time `preempted` bytes this
    /// way, so one map serves every guest-memory access pvspin makes.
    fn read_u8(&self, gpa: u64) -> Option<u8> {
        let page = self.host_page(gpa - gpa % SHARED_PAGE_SIZE)?;
        // `gpa % SHARED_PAGE_SIZE` is below the page size, a usize.
        let offset = (gpa % SHARED_PAGE_SIZE) as usize;
        // SAFETY: `host_page`'s contract: the page is SHARED_PAGE_SIZE bytes of mapped guest
        // RAM, and `offset` lies inside it.
        let ptr = unsafe { page.as_ptr().add(offset) };
        // SAFETY: `ptr` is a byte of that page, live while `self` is; pvspin accesses guest
        // RAM only atomically.
        let byte = unsafe { AtomicU8::from_ptr(ptr) };
        Some(byte.load(Ordering::Relaxed))
    }
}

/// What the guest last wrote in its line of a hint page (untrusted hints).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestHints {
    /// Spinlocks the vCPU says it holds.
    pub cs_depth: u32,
    /// Its spin state (`pvspin_abi::hint::SPIN_*`; other values are passed on as written).
    pub spin_state: u32,
    /// Its current wait, as a `SpinNotify` value.
    pub waiting_for: u32,
    /// TSC when its spin began.
    pub spin_since_tsc: u64,
}

/// One registered hint page. Copyable handle; valid while its [`HintPages`] lives.
#[derive(Clone, Copy, Debug)]
pub struct HintPage {
    base: NonNull<u8>,
}

// SAFETY: the page is shared guest memory accessed only through atomics; the pointer itself
// is plain data.
unsafe impl Send for HintPage {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for HintPage {}

impl HintPage {
    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % 4 == 0 && offset + 4 <= hint::DEFINED_END);
        // SAFETY: `offset` is a field inside the page (the ABI's layout, checked in its tests),
        // so the pointer stays inside the page `base` points at.
        let field = unsafe { self.base.as_ptr().add(offset) };
        // SAFETY: the page is live and 8-byte aligned (GuestPageMap's contract) and `offset`
        // is 4-aligned, so `field` is a valid, aligned u32 accessed only atomically.
        unsafe { AtomicU32::from_ptr(field.cast()) }
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= hint::DEFINED_END);
        // SAFETY: as in `u32_at`: the field is inside the page.
        let field = unsafe { self.base.as_ptr().add(offset) };
        // SAFETY: as in `u32_at`, for an 8-aligned field.
        unsafe { AtomicU64::from_ptr(field.cast()) }
    }

    /// Publishes the budgets (TSC cycles) and the TSC frequency, then bumps the sequence.
    pub fn publish_budgets(&self, spin_window_tsc: u64, wait_after_tsc: u64, tsc_khz: u32) {
        self.u64_at(hint::SPIN_WINDOW_TSC)
            .store(spin_window_tsc, Ordering::Relaxed);
        self.u64_at(hint::WAIT_AFTER_TSC)
            .store(wait_after_tsc, Ordering::Relaxed);
        self.u32_at(hint::TSC_KHZ).store(tsc_khz, Ordering::Relaxed);
        self.u32_at(hint::HOST_SEQ).fetch_add(1, Ordering::Release);
    }

    /// Publishes the wait budget's floor and ceiling (TSC cycles), for guests that adapt
    /// between host updates.
    pub fn publish_wait_bounds(&self, min_tsc: u64, max_tsc: u64) {
        self.u64_at(hint::WAIT_AFTER_MIN_TSC)
            .store(min_tsc, Ordering::Relaxed);
        self.u64_at(hint::WAIT_AFTER_MAX_TSC)
            .store(max_tsc, Ordering::Relaxed);
    }

    /// Sets or clears `NOT_RUNNING` (SeqCst: ordered against the guest's lock-word accesses
    /// and the host's own park).
    pub fn set_not_running(&self, not_running: bool) {
        let flags = self.u32_at(hint::HOST_FLAGS);
        if not_running {
            flags.fetch_or(hint::NOT_RUNNING, Ordering::SeqCst);
        } else {
            flags.fetch_and(!hint::NOT_RUNNING, Ordering::SeqCst);
        }
    }

    /// Sets or clears `VCPUS_FIT` (the VM's vCPUs fit its CPUs; a hint the guest reads
    /// relaxed).
    pub fn set_vcpus_fit(&self, fit: bool) {
        let flags = self.u32_at(hint::HOST_FLAGS);
        if fit {
            flags.fetch_or(hint::VCPUS_FIT, Ordering::Relaxed);
        } else {
            flags.fetch_and(!hint::VCPUS_FIT, Ordering::Relaxed);
        }
    }

    /// Whether `VCPUS_FIT` is set.
    pub fn vcpus_fit(&self) -> bool {
        self.u32_at(hint::HOST_FLAGS).load(Ordering::Relaxed) & hint::VCPUS_FIT != 0
    }

    /// Whether `NOT_RUNNING` is set.
    pub fn not_running(&self) -> bool {
        self.u32_at(hint::HOST_FLAGS).load(Ordering::SeqCst) & hint::NOT_RUNNING != 0
    }

    /// The budgets as published: (spin window, wait after), TSC cycles.
    pub fn budgets(&self) -> (u64, u64) {
        (
            self.u64_at(hint::SPIN_WINDOW_TSC).load(Ordering::Relaxed),
            self.u64_at(hint::WAIT_AFTER_TSC).load(Ordering::Relaxed),
        )
    }

    /// Takes the guest's report of its last wait (TSC cycles), leaving 0; `None` if there was
    /// none since the last take.
    pub fn take_last_wait(&self) -> Option<u64> {
        let cycles = self.u64_at(hint::LAST_WAIT_TSC).swap(0, Ordering::Relaxed);
        (cycles != 0).then_some(cycles)
    }

    /// The guest's line, each field read once.
    pub fn guest_hints(&self) -> GuestHints {
        GuestHints {
            cs_depth: self.u32_at(hint::CS_DEPTH).load(Ordering::Relaxed),
            spin_state: self.u32_at(hint::SPIN_STATE).load(Ordering::Relaxed),
            waiting_for: self.u32_at(hint::WAITING_FOR).load(Ordering::Relaxed),
            spin_since_tsc: self.u64_at(hint::SPIN_SINCE_TSC).load(Ordering::Relaxed),
        }
    }
}

/// Why a registration was refused (guest input: counted and ignored by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
pub enum RegisterError {
    /// hint page at GPA {0:#x} is not guest RAM
    NotRam(u64),
    /// no vCPU {0}
    NoSuchVcpu(usize),
    /// hint page at GPA {0:#x} maps to a misaligned host address
    Misaligned(u64),
}

/// The hint pages of one VM: at most one per vCPU, registered by the guest.
pub struct HintPages {
    map: Arc<dyn GuestPageMap>,
    pages: Box<[AtomicPtr<u8>]>,
    /// `VCPUS_FIT` for every page, at registration and on change.
    vcpus_fit: AtomicBool,
}

impl fmt::Debug for HintPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let registered = self
            .pages
            .iter()
            .filter(|p| !p.load(Ordering::Relaxed).is_null())
            .count();
        f.debug_struct("HintPages")
            .field("vcpus", &self.pages.len())
            .field("registered", &registered)
            .field("vcpus_fit", &self.vcpus_fit())
            .finish()
    }
}

impl HintPages {
    /// No pages registered yet, for `n` vCPUs; `VCPUS_FIT` clear (see
    /// [`set_vcpus_fit`](Self::set_vcpus_fit)).
    pub fn new(map: Arc<dyn GuestPageMap>, n: usize) -> Self {
        Self {
            map,
            pages: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            vcpus_fit: AtomicBool::new(false),
        }
    }

    /// Whether the VM's vCPUs fit the CPUs the host gives it (`VCPUS_FIT`): stored in every
    /// page registered now and later. Clear by default: a host that does not know says nothing.
    pub fn set_vcpus_fit(&self, fit: bool) {
        self.vcpus_fit.store(fit, Ordering::Relaxed);
        for v in 0..self.pages.len() {
            if let Some(page) = self.get(v) {
                page.set_vcpus_fit(fit);
            }
        }
    }

    /// What [`set_vcpus_fit`](Self::set_vcpus_fit) last stored.
    pub fn vcpus_fit(&self) -> bool {
        self.vcpus_fit.load(Ordering::Relaxed)
    }

    /// vCPU `v` registers the page at frame `pfn` (0 unregisters). On success the host has
    /// stored the layout version; the caller publishes budgets next.
    pub fn register(&self, v: usize, pfn: u32) -> Result<Option<HintPage>, RegisterError> {
        let gpa = if hint::is_registration(pfn) {
            pvspin_abi::doorbell::shared_page_gpa(pfn)
        } else {
            0
        };
        self.register_gpa(v, gpa)
    }

    /// [`register`](Self::register) by guest physical address (the virtio device's control
    /// request names the page by address, which may lie above 16 TiB); 0 unregisters.
    pub fn register_gpa(&self, v: usize, gpa: u64) -> Result<Option<HintPage>, RegisterError> {
        let slot = self.pages.get(v).ok_or(RegisterError::NoSuchVcpu(v))?;
        if gpa == 0 {
            slot.store(std::ptr::null_mut(), Ordering::Release);
            return Ok(None);
        }
        let base = self.map.host_page(gpa).ok_or(RegisterError::NotRam(gpa))?;
        if base.as_ptr().align_offset(8) != 0 {
            return Err(RegisterError::Misaligned(gpa));
        }
        let page = HintPage { base };
        // The guest owns the page: host flags start from what the host says now.
        page.u32_at(hint::HOST_FLAGS).store(
            if self.vcpus_fit() { hint::VCPUS_FIT } else { 0 },
            Ordering::Relaxed,
        );
        page.u32_at(hint::LAYOUT)
            .store(hint::LAYOUT_VERSION, Ordering::Release);
        slot.store(base.as_ptr(), Ordering::Release);
        // A `set_vcpus_fit` that ran meanwhile did not see this page yet.
        page.set_vcpus_fit(self.vcpus_fit());
        Ok(Some(page))
    }

    /// vCPU `v`'s page, if registered.
    pub fn get(&self, v: usize) -> Option<HintPage> {
        let p = self.pages.get(v)?.load(Ordering::Acquire);
        NonNull::new(p).map(|base| HintPage { base })
    }

    /// Number of vCPUs.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether there are no vCPUs.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

// SAFETY: a page inside one region of mmap-backed guest memory is contiguous host memory that
// stays mapped while any clone of the region lives, and the map holds its regions; regions
// start page-aligned (mmap), so a page-aligned GPA maps to a page-aligned host address.
unsafe impl<B: vm_memory::bitmap::Bitmap + Send + Sync + fmt::Debug> GuestPageMap
    for vm_memory::GuestMemoryMmap<B>
{
    fn host_page(&self, gpa: u64) -> Option<NonNull<u8>> {
        use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
        if gpa % SHARED_PAGE_SIZE != 0 {
            return None;
        }
        let (region, offset) = self.to_region_addr(GuestAddress(gpa))?;
        if offset.0.checked_add(SHARED_PAGE_SIZE)? > region.len() {
            return None;
        }
        NonNull::new(region.get_host_address(offset).ok()?)
    }
}

/// A [`GuestPageMap`] over one host buffer standing in for guest RAM at GPA 0 (tests, fuzzing,
/// simulators; feature `test-utils`).
#[cfg(any(test, feature = "test-utils"))]
#[derive(Debug)]
pub struct BufferPageMap {
    buf: Box<[AtomicU64]>,
}

#[cfg(any(test, feature = "test-utils"))]
impl BufferPageMap {
    /// The 8-byte word at `gpa` (rounded down to 8), as the guest would access it.
    ///
    /// # Panics
    ///
    /// If `gpa` is outside the buffer.
    pub fn word(&self, gpa: usize) -> &AtomicU64 {
        &self.buf[gpa / 8]
    }

    /// `pages` pages of zeroed memory.
    pub fn new(pages: usize) -> Self {
        let words = pages * (SHARED_PAGE_SIZE as usize / 8);
        Self {
            buf: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

// SAFETY: pages are inside `buf` (checked below), which is 8-byte aligned, lives as long as the
// map and is only accessed through atomics.
#[cfg(any(test, feature = "test-utils"))]
unsafe impl GuestPageMap for BufferPageMap {
    fn host_page(&self, gpa: u64) -> Option<NonNull<u8>> {
        let page = SHARED_PAGE_SIZE as usize;
        let start = usize::try_from(gpa).ok()?;
        if start % page != 0 || start.checked_add(page)? > self.buf.len() * 8 {
            return None;
        }
        NonNull::new(self.buf.get(start / 8)?.as_ptr().cast())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvspin_abi::hint::*;

    fn read_u64(map: &BufferPageMap, gpa: usize, offset: usize) -> u64 {
        map.buf[(gpa + offset) / 8].load(Ordering::Relaxed)
    }

    #[test]
    fn registration_maps_ram_only_and_writes_the_layout() {
        let map = Arc::new(BufferPageMap::new(4));
        let pages = HintPages::new(map.clone(), 2);
        assert_eq!(
            pages.register(0, 4).unwrap_err(),
            RegisterError::NotRam(0x4000)
        );
        assert_eq!(
            pages.register(2, 1).unwrap_err(),
            RegisterError::NoSuchVcpu(2)
        );
        assert!(pages.get(0).is_none());
        let page = pages.register(0, 3).unwrap().unwrap();
        assert_eq!(read_u64(&map, 0x3000, LAYOUT) as u32, LAYOUT_VERSION);
        page.publish_budgets(1_000, 2_000, 2_600_000);
        assert_eq!(read_u64(&map, 0x3000, SPIN_WINDOW_TSC), 1_000);
        assert_eq!(read_u64(&map, 0x3000, WAIT_AFTER_TSC), 2_000);
        assert_eq!(pages.get(0).unwrap().budgets(), (1_000, 2_000));
        page.set_not_running(true);
        assert!(pages.get(0).unwrap().not_running());
        page.set_not_running(false);
        assert!(!page.not_running());
        assert!(pages.register(0, 0).unwrap().is_none());
        assert!(pages.get(0).is_none(), "0 unregisters");
    }

    #[test]
    fn vcpus_fit_reaches_pages_registered_before_and_after() {
        let map = Arc::new(BufferPageMap::new(3));
        let pages = HintPages::new(map.clone(), 2);
        // HOST_FLAGS is the upper half of the word at offset 0 (little-endian).
        let flags = |gpa: usize| (read_u64(&map, gpa, LAYOUT) >> 32) as u32;
        // Whatever the guest left in the host line is overwritten at registration.
        map.word(0x1000 + HOST_FLAGS)
            .store(u64::MAX, Ordering::Relaxed);
        let first = pages.register(0, 1).unwrap().unwrap();
        assert_eq!(flags(0x1000), 0, "clear until the host says");
        pages.set_vcpus_fit(true);
        assert!(first.vcpus_fit());
        pages.register(1, 2).unwrap().unwrap();
        assert_eq!(flags(0x2000), VCPUS_FIT);
        first.set_not_running(true);
        pages.set_vcpus_fit(false);
        assert_eq!(flags(0x1000), NOT_RUNNING, "NOT_RUNNING is kept");
        assert_eq!(flags(0x2000), 0);
    }

    #[test]
    fn guest_line_is_read_and_last_wait_taken_once() {
        let map = Arc::new(BufferPageMap::new(2));
        let pages = HintPages::new(map.clone(), 1);
        let page = pages.register(0, 1).unwrap().unwrap();
        let word = |offset: usize| &map.buf[(0x1000 + offset) / 8];
        word(CS_DEPTH).store(
            u64::from(3u32) | (u64::from(SPIN_SPINNING) << 32),
            Ordering::Relaxed,
        );
        word(WAITING_FOR).store(0x1234, Ordering::Relaxed);
        word(SPIN_SINCE_TSC).store(99, Ordering::Relaxed);
        word(LAST_WAIT_TSC).store(5_000, Ordering::Relaxed);
        assert_eq!(
            page.guest_hints(),
            GuestHints {
                cs_depth: 3,
                spin_state: SPIN_SPINNING,
                waiting_for: 0x1234,
                spin_since_tsc: 99
            }
        );
        assert_eq!(page.take_last_wait(), Some(5_000));
        assert_eq!(page.take_last_wait(), None);
    }

    #[test]
    fn bytes_read_through_the_page_map() {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
        let mem: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x2000)]).unwrap();
        mem.write_obj(0xa5u8, GuestAddress(0x1ff3)).unwrap();
        assert_eq!(GuestPageMap::read_u8(&mem, 0x1ff3), Some(0xa5));
        assert_eq!(GuestPageMap::read_u8(&mem, 0x1ff4), Some(0));
        assert_eq!(GuestPageMap::read_u8(&mem, 0x2000), None);
        assert_eq!(GuestPageMap::read_u8(&mem, u64::MAX), None);
    }

    #[test]
    fn vm_memory_pages_must_lie_inside_one_region() {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
        let mem: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x4000),
            (GuestAddress(0x10000), 0x2000),
        ])
        .unwrap();
        assert!(mem.host_page(0x3000).is_some());
        assert!(mem.host_page(0x11000).is_some());
        assert!(mem.host_page(0x4000).is_none(), "a hole");
        assert!(mem.host_page(0x12000).is_none(), "past the end");
        assert!(mem.host_page(0x1008).is_none(), "not page-aligned");
        let pages = HintPages::new(Arc::new(mem.clone()), 1);
        pages
            .register(0, 0x11)
            .unwrap()
            .unwrap()
            .publish_budgets(7, 8, 9);
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(0x11000 + SPIN_WINDOW_TSC as u64))
                .unwrap(),
            7
        );
    }
}
