//! The guest-host contract of pvspin.
//!
//! Both sides depend on this crate: the host crates (`pvspin-kick`, `pvspin-yield`,
//! `pvspin-hints`, `pvspin-vhost`) to decode what a guest writes, and `pvspin-guest` to produce
//! it. It is `no_std` and has no dependencies, so a guest kernel can vendor it. The prose
//! version, for a guest OS author who does not read Rust, is `docs/abi.md`.
//!
//! | module | what |
//! |---|---|
//! | [`cpuid`] | discovery: a hypervisor CPUID leaf pair of pvspin's own, found by its signature `"pvspinpvspin"` when scanning the hypervisor range in 0x100 steps; it reports the ABI version, the doorbell port, the feature bits and the number of vCPUs |
//! | [`doorbell`] | a small port-I/O range: KICK (offset 0: a 32-bit `OUT` of a vCPU index wakes it from `pv_wait`, and a kick before the halt is remembered), SPIN (4: `OUT` a spin notification, [`doorbell::SpinNotify`]; `IN` the caller's spin window), SHARED_PAGE (8: register the vCPU's hint page), WAIT (12: `pv_wait` without `HLT`) |
//! | [`hint`] | the per-vCPU hint page: spin and wait budgets in TSC cycles published by the host, what the guest holds and waits for, so a notification costs one exit and a budget read none |
//! | [`virtio`] | the same device as a virtio device (experimental), for VMMs that attach a vhost-user backend (`pvspind`) |
//!
//! Versions: discovery and KICK since 0.1; SPIN and the window read since 0.2 (when
//! [`cpuid::FEATURE_SPIN_NOTIFY`] is set); WAIT ([`doorbell::WAIT_OFFSET`]) and the hint page
//! ([`doorbell::SHARED_PAGE_OFFSET`]) since 0.3, each behind its feature bit; the hint page's
//! [`hint::VCPUS_FIT`] flag since 0.4. This crate's
//! version is [`ABI_VERSION`]; [`version_compatible`] says whether a guest may use a host's.
#![no_std]
#![deny(missing_docs)]

/// Version of the guest-host contract. A guest refuses a host whose major version differs.
pub const ABI_VERSION_MAJOR: u16 = 0;
/// Minor version: additions that old guests may ignore.
pub const ABI_VERSION_MINOR: u16 = 4;

/// The ABI version as one 32-bit word, as CPUID reports it: major in bits 31..16, minor in
/// bits 15..0.
pub const ABI_VERSION: u32 = ((ABI_VERSION_MAJOR as u32) << 16) | ABI_VERSION_MINOR as u32;

/// The most vCPUs a VM using this ABI may have: vCPU indices are `0..=254`.
///
/// A vCPU's index is its initial APIC ID (CPUID.01H:EBX bits 31..24, 8 bits), the kick
/// names that index, and a host delivers the kick as KVM does `KVM_HC_KICK_CPU`: an MSI in
/// REMRD delivery mode whose address carries an 8-bit xAPIC physical destination. Destination
/// 0xFF is the xAPIC broadcast ID, so index 255 cannot be kicked alone (its kick would wake
/// every vCPU); 255 vCPUs is the limit, the same as xAPIC's.
///
/// **Past 255 vCPUs: not supported.** It would need the index to be the x2APIC ID
/// (CPUID.0BH/1FH:EDX, 32 bits) instead of the initial APIC ID, guests in x2APIC mode, and
/// hosts sending 32-bit destinations (in KVM: `KVM_CAP_X2APIC_API` with
/// `KVM_X2APIC_API_USE_32BIT_IDS`, destination bits 31..8 in the MSI's `address_hi`); the
/// virtio form would also need a queue layout for more than 255 vCPUs
/// ([`virtio::MAX_VCPUS`]). Hosts refuse more than [`MAX_VCPUS`] vCPUs.
pub const MAX_VCPUS: u32 = 255;

/// Splits a 32-bit version word into `(major, minor)`.
pub const fn split_version(word: u32) -> (u16, u16) {
    ((word >> 16) as u16, (word & 0xffff) as u16)
}

/// Whether a guest built against this crate may use a host reporting `host_version`: the major
/// versions must be equal. The host's minor version may be older or newer; features are
/// negotiated by feature bits, not by minor version.
pub const fn version_compatible(host_version: u32) -> bool {
    split_version(host_version).0 == ABI_VERSION_MAJOR
}

pub mod cpuid {
    //! CPUID discovery.
    //!
    //! Hypervisor CPUID leaves live in `0x4000_0000..=0x4000_FFFF`. Guests (Linux's
    //! `cpuid_base_hypervisor`, for one) find a hypervisor interface by scanning the bases
    //! `0x4000_0000, 0x4000_0100, ..., 0x4000_FF00` for a 12-byte signature in EBX, ECX, EDX of
    //! the base leaf. KVM's own leaves stay at `0x4000_0000` (a stock Linux guest must keep
    //! finding them there), and `0x4000_0100` is where VMMs relocate KVM's leaves when they
    //! present Hyper-V at `0x4000_0000`. pvspin therefore defaults to the next free base,
    //! [`DEFAULT_BASE`] = `0x4000_0200`; a VMM may move it to any other 0x100-aligned base in
    //! the range, so **guests must scan for the signature and never hard-code the base**.
    //!
    //! | leaf | EAX | EBX | ECX | EDX |
    //! |---|---|---|---|---|
    //! | base + 0 | highest pvspin leaf (base + 1) | `"pvsp"` | `"inpv"` | `"spin"` |
    //! | base + 1 | ABI version (major << 16 \| minor) | doorbell port (bits 15..0), port count (bits 31..16) | feature bits | number of vCPUs |

    /// Default base leaf of pvspin's CPUID interface.
    pub const DEFAULT_BASE: u32 = 0x4000_0200;
    /// First base a guest scans.
    pub const SCAN_FIRST: u32 = 0x4000_0000;
    /// Last base a guest scans.
    pub const SCAN_LAST: u32 = 0x4000_FF00;
    /// Step between scanned bases.
    pub const SCAN_STEP: u32 = 0x100;

    /// The signature, as the 12 bytes EBX, ECX, EDX hold in that order (little-endian each).
    pub const SIGNATURE: [u8; 12] = *b"pvspinpvspin";
    /// EBX of the base leaf: `"pvsp"`.
    pub const SIGNATURE_EBX: u32 = u32::from_le_bytes([b'p', b'v', b's', b'p']);
    /// ECX of the base leaf: `"inpv"`.
    pub const SIGNATURE_ECX: u32 = u32::from_le_bytes([b'i', b'n', b'p', b'v']);
    /// EDX of the base leaf: `"spin"`.
    pub const SIGNATURE_EDX: u32 = u32::from_le_bytes([b's', b'p', b'i', b'n']);

    /// Offset of the information leaf from the base.
    pub const INFO_LEAF_OFFSET: u32 = 1;
    /// Number of leaves pvspin defines (base and info).
    pub const NR_LEAVES: u32 = 2;

    /// Feature bit (ECX of the info leaf): the KICK command at [`crate::doorbell::KICK_OFFSET`]
    /// is available. Always set by hosts of ABI 0.x.
    pub const FEATURE_KICK: u32 = 1 << 0;
    /// Feature bit: a valid kick is handled inside the host kernel (no exit to the VMM), so it
    /// costs the kicker about as much as a plain port write. Informational only: the encoding
    /// is the same either way.
    pub const FEATURE_KICK_IN_KERNEL: u32 = 1 << 1;
    /// Feature bit: the SPIN command at [`crate::doorbell::SPIN_OFFSET`] (notification `OUT`,
    /// window `IN`) is available. Defined in 0.1, implemented since 0.2; set only by hosts
    /// that act on notifications.
    pub const FEATURE_SPIN_NOTIFY: u32 = 1 << 2;
    /// Feature bit: the SHARED_PAGE command at [`crate::doorbell::SHARED_PAGE_OFFSET`] works
    /// and the registered page follows [`crate::hint`] (since 0.3; reserved before).
    pub const FEATURE_SHARED_PAGE: u32 = 1 << 3;
    /// Feature bit: the WAIT command at [`crate::doorbell::WAIT_OFFSET`] works: `pv_wait`
    /// without `HLT`, usable from guest user mode (since 0.3).
    pub const FEATURE_WAIT: u32 = 1 << 4;
    /// All feature bits this ABI version defines. Guests ignore bits outside it.
    pub const FEATURES_DEFINED: u32 = FEATURE_KICK
        | FEATURE_KICK_IN_KERNEL
        | FEATURE_SPIN_NOTIFY
        | FEATURE_SHARED_PAGE
        | FEATURE_WAIT;

    /// One CPUID result, in register order. `repr(C)` so it can be filled from inline asm or
    /// compared with a `kvm_cpuid_entry2`'s eax..edx.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct CpuidRegs {
        /// EAX.
        pub eax: u32,
        /// EBX.
        pub ebx: u32,
        /// ECX.
        pub ecx: u32,
        /// EDX.
        pub edx: u32,
    }

    /// What the info leaf reports.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct PvspinInfo {
        /// ABI version word ([`crate::ABI_VERSION`] on a host built from this crate).
        pub version: u32,
        /// First port of the doorbell range.
        pub doorbell_port: u16,
        /// Number of ports in the doorbell range ([`crate::doorbell::PORT_COUNT`]).
        pub doorbell_ports: u16,
        /// Feature bits (`FEATURE_*`).
        pub features: u32,
        /// Number of vCPUs: valid kick targets are `0..nr_vcpus`; at most
        /// [`crate::MAX_VCPUS`].
        pub nr_vcpus: u32,
    }

    impl PvspinInfo {
        /// The base leaf's registers for a host using `base`.
        pub const fn base_leaf(base: u32) -> CpuidRegs {
            CpuidRegs {
                eax: base + INFO_LEAF_OFFSET,
                ebx: SIGNATURE_EBX,
                ecx: SIGNATURE_ECX,
                edx: SIGNATURE_EDX,
            }
        }

        /// The info leaf's registers.
        pub const fn info_leaf(&self) -> CpuidRegs {
            CpuidRegs {
                eax: self.version,
                ebx: (self.doorbell_port as u32) | ((self.doorbell_ports as u32) << 16),
                ecx: self.features,
                edx: self.nr_vcpus,
            }
        }

        /// Decodes the info leaf.
        pub const fn from_info_leaf(regs: CpuidRegs) -> Self {
            Self {
                version: regs.eax,
                doorbell_port: (regs.ebx & 0xffff) as u16,
                doorbell_ports: (regs.ebx >> 16) as u16,
                features: regs.ecx,
                nr_vcpus: regs.edx,
            }
        }
    }

    /// Whether a base leaf carries pvspin's signature and says the info leaf exists.
    pub const fn is_pvspin_base(base: u32, regs: CpuidRegs) -> bool {
        regs.ebx == SIGNATURE_EBX
            && regs.ecx == SIGNATURE_ECX
            && regs.edx == SIGNATURE_EDX
            && regs.eax >= base + INFO_LEAF_OFFSET
    }

    /// Scans the hypervisor range with `cpuid(leaf)` and returns the base where pvspin's
    /// signature is, if any. A guest passes its CPUID instruction; tests pass a table.
    pub fn find_base(mut cpuid: impl FnMut(u32) -> CpuidRegs) -> Option<u32> {
        let mut base = SCAN_FIRST;
        loop {
            if is_pvspin_base(base, cpuid(base)) {
                return Some(base);
            }
            if base == SCAN_LAST {
                return None;
            }
            base += SCAN_STEP;
        }
    }
}

pub mod doorbell {
    //! The doorbell: a range of [`PORT_COUNT`] I/O ports starting at the port CPUID reports.
    //!
    //! Every command is one 32-bit `OUT` (`out %eax, %dx`) to `port + offset`. Any other access
    //! width, any read, and any write to an offset not listed here is ignored by the host (and
    //! counted). Commands whose feature bit is clear are ignored too.
    //!
    //! | offset | command | value written (32 bits) | feature |
    //! |---|---|---|---|
    //! | 0 | KICK | target vCPU index | [`crate::cpuid::FEATURE_KICK`] |
    //! | 4 | SPIN | `OUT`: [`SpinNotify`] (waited-for vCPU, next-owner flag, spun bucket, lock hash); `IN`: the caller's spin window | [`crate::cpuid::FEATURE_SPIN_NOTIFY`] |
    //! | 8 | SHARED_PAGE | guest page frame number of this vCPU's hint page ([`crate::hint`]), 0 = unregister | [`crate::cpuid::FEATURE_SHARED_PAGE`] |
    //! | 12 | WAIT | [`SpinNotify`] of the wait (the vCPU waited for, may be unknown) | [`crate::cpuid::FEATURE_WAIT`] |
    //!
    //! **Kick semantics** (as KVM's `KVM_HC_KICK_CPU`): if the target is halted in `pv_wait` it
    //! resumes after its `HLT`; if it is not halted, the kick is remembered and the target's
    //! next `HLT` returns at once (one remembered kick, not a counter). A kick may also end a
    //! halt for no reason the guest can see (a spurious wake-up), so `pv_wait` callers must
    //! re-check their condition, exactly as with KVM. The target index is the vCPU's index,
    //! which in a pvspin VMM equals its initial APIC ID (CPUID.01H:EBX bits 31..24). A kick naming
    //! an index `>= nr_vcpus` wakes nobody.

    /// Default first port of the doorbell range (the VMM may choose another; guests read it
    /// from CPUID). Chosen clear of the PC legacy ports, PCI configuration (0xCF8..0xCFF) and
    /// QEMU's fw_cfg (0x510..0x51B).
    pub const DEFAULT_PORT: u16 = 0x0A40;
    /// Number of ports in the doorbell range.
    pub const PORT_COUNT: u16 = 16;
    /// Width of every doorbell command, in bytes.
    pub const COMMAND_WIDTH: usize = 4;

    /// KICK: wake the vCPU whose index is the value written.
    pub const KICK_OFFSET: u16 = 0;
    /// SPIN: a 32-bit `OUT` is a spin notification ([`SpinNotify`]); a 32-bit `IN` returns the
    /// calling vCPU's current spin window (spins before notifying, at least
    /// [`SPIN_WINDOW_MIN`]). Both exit to the VMM (each costs an exit): a guest re-reads the
    /// window only after it notified, since that is when the host changes it.
    pub const SPIN_OFFSET: u16 = 4;
    /// SHARED_PAGE: register the writing vCPU's hint page ([`crate::hint`]). Exits to the VMM.
    pub const SHARED_PAGE_OFFSET: u16 = 8;
    /// WAIT: `pv_wait` without `HLT`. The writing vCPU stops until it is kicked, with `HLT`'s
    /// latch semantics (a kick that landed since its last wait makes it return at once;
    /// spurious returns are allowed; the host bounds the wait). The value is a [`SpinNotify`]
    /// describing what it waits for, which the host may act on (directed yield) exactly as
    /// for a SPIN notification, in the same exit. Usable at any privilege level the guest lets
    /// reach the port.
    pub const WAIT_OFFSET: u16 = 12;

    /// Bits 12..0 of a SPIN value: the vCPU the spinner waits for.
    pub const SPIN_WAITING_FOR_MASK: u32 = 0x1FFF;
    /// The "waiting for" field's value meaning "unknown". Valid indexes are `0..=0x1FFE`, so the
    /// field addresses more vCPUs than any host supports (KVM: 4096).
    pub const SPIN_WAITING_FOR_UNKNOWN: u16 = 0x1FFF;
    /// Bit 13 of a SPIN value: the named vCPU is the *next owner* of a fair lock (released to
    /// it, not taken yet) rather than the holder. Informational: the host treats both alike.
    pub const SPIN_NEXT_OWNER: u32 = 1 << 13;
    /// Bits 18..14 of a SPIN value: how long the spinner spun, as a log2 bucket
    /// ([`spun_bucket`]).
    pub const SPIN_SPUN_SHIFT: u32 = 14;
    /// Width of the spun bucket field.
    pub const SPIN_SPUN_MASK: u32 = 0x1F;
    /// Bits 31..19 of a SPIN value: a 13-bit hash of the lock ([`lock_hash`]).
    pub const SPIN_LOCK_SHIFT: u32 = 19;
    /// Width of the lock hash field.
    pub const SPIN_LOCK_MASK: u32 = 0x1FFF;

    /// The log2 bucket of a spin count: 0 for 0, `b` for `2^(b-1) <= spun < 2^b` (b = 1..=30),
    /// 31 for `spun >= 2^30`.
    pub const fn spun_bucket(spun: u32) -> u8 {
        let b = 32 - spun.leading_zeros();
        if b > 31 {
            31
        } else {
            b as u8
        }
    }

    /// The smallest spin count in bucket `b` (0 for bucket 0; `b` above 31 reads as 31).
    pub const fn spun_bucket_floor(b: u8) -> u32 {
        let b = if b > 31 { 31 } else { b };
        if b == 0 {
            0
        } else {
            1 << (b - 1)
        }
    }

    /// A 13-bit hash of a lock's guest address (or any guest lock id), for
    /// [`SpinNotify::lock_hash`]. Guests may use another hash: the host only compares them.
    pub const fn lock_hash(id: u64) -> u16 {
        let x = (id >> 3) ^ (id >> 16) ^ (id >> 29) ^ (id >> 42);
        (x & SPIN_LOCK_MASK as u64) as u16
    }

    /// The value of a SPIN command: "I spun past my window on a lock; I wait for vCPU X".
    ///
    /// | bits | field |
    /// |---|---|
    /// | 12..0 | `waiting_for`: the vCPU the spinner waits for, `0x1FFF` = unknown |
    /// | 13 | `next_owner`: that vCPU is the next owner of a fair lock, not its holder |
    /// | 18..14 | `spun`: log2 bucket of the spins since the last notification ([`spun_bucket`]) |
    /// | 31..19 | `lock_hash`: 13-bit hash of the lock ([`lock_hash`]) |
    ///
    /// Every 32-bit value decodes; the host must still range-check `waiting_for`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct SpinNotify {
        /// The vCPU index the spinner waits for (the holder, or the next owner), or `None`.
        pub waiting_for: Option<u16>,
        /// `waiting_for` names the next owner of a fair lock rather than its holder.
        pub next_owner: bool,
        /// Log2 bucket of the spin count ([`spun_bucket`]), 0..=31.
        pub spun_bucket: u8,
        /// 13-bit hash of the lock (guest-defined; the host only compares hashes).
        pub lock_hash: u16,
    }

    impl SpinNotify {
        /// The 32-bit value to write. Fields wider than their bits are truncated; a
        /// `waiting_for` of `0x1FFF` or more reads as unknown.
        pub const fn encode(self) -> u32 {
            let w = match self.waiting_for {
                Some(h) if (h as u32) < SPIN_WAITING_FOR_UNKNOWN as u32 => h as u32,
                _ => SPIN_WAITING_FOR_UNKNOWN as u32,
            };
            let mut v = w;
            if self.next_owner {
                v |= SPIN_NEXT_OWNER;
            }
            v |= ((self.spun_bucket as u32) & SPIN_SPUN_MASK) << SPIN_SPUN_SHIFT;
            v |= ((self.lock_hash as u32) & SPIN_LOCK_MASK) << SPIN_LOCK_SHIFT;
            v
        }

        /// Decodes a written value. Every 32-bit value is a well-formed notification; the
        /// `waiting_for` index must still be range-checked against the number of vCPUs.
        pub const fn decode(value: u32) -> Self {
            let w = (value & SPIN_WAITING_FOR_MASK) as u16;
            Self {
                waiting_for: if w == SPIN_WAITING_FOR_UNKNOWN {
                    None
                } else {
                    Some(w)
                },
                next_owner: value & SPIN_NEXT_OWNER != 0,
                spun_bucket: ((value >> SPIN_SPUN_SHIFT) & SPIN_SPUN_MASK) as u8,
                lock_hash: ((value >> SPIN_LOCK_SHIFT) & SPIN_LOCK_MASK) as u16,
            }
        }
    }

    /// The smallest spin window a host publishes (a window is never 0).
    pub const SPIN_WINDOW_MIN: u32 = 1;

    /// Size of the page a SHARED_PAGE command registers.
    pub const SHARED_PAGE_SIZE: u64 = 4096;

    /// Guest physical address of the page a SHARED_PAGE value names (page frame number times
    /// 4096; a 32-bit PFN covers 16 TiB of guest memory).
    pub const fn shared_page_gpa(pfn: u32) -> u64 {
        (pfn as u64) * SHARED_PAGE_SIZE
    }
}

pub mod hint {
    //! The hint page (ABI 0.3, [`crate::cpuid::FEATURE_SHARED_PAGE`]): one 4 KiB page of
    //! guest memory per vCPU, registered once with the SHARED_PAGE command
    //! ([`crate::doorbell::SHARED_PAGE_OFFSET`], value = GPA / 4096, written by the vCPU the page
    //! belongs to). Host and guest then talk through it without exits.
    //!
    //! The first cache line (bytes 0..64) is written by the host only, the second (64..128) by
    //! the guest only (except that the host takes [`LAST_WAIT_TSC`] by exchanging it for 0); the rest is reserved (the host never reads or writes it). Every field is
    //! little-endian, naturally aligned, and accessed with single loads and stores of its
    //! width (atomics), so no value is ever torn.
    //!
    //! | offset | size | writer | field |
    //! |---|---|---|---|
    //! | 0 | 4 | host | [`LAYOUT`]: [`LAYOUT_VERSION`], stored at registration (a guest may poll it to see the registration took) |
    //! | 4 | 4 | host | [`HOST_FLAGS`]: bit 0 [`NOT_RUNNING`]: the host does not run this vCPU now (it waits in WAIT or in a userspace halt, or the VMM parked it); bit 1 [`VCPUS_FIT`] (0.4): the VM's vCPUs fit the CPUs the host gives it |
    //! | 8 | 8 | host | [`SPIN_WINDOW_TSC`]: TSC cycles a waiter spins before a SPIN notification; `u64::MAX`: do not notify |
    //! | 16 | 8 | host | [`WAIT_AFTER_TSC`]: TSC cycles a waiter spins before it waits (`HLT` or WAIT) |
    //! | 24 | 4 | host | [`HOST_SEQ`]: incremented after every host update of the fields above |
    //! | 28 | 4 | host | [`TSC_KHZ`]: the guest TSC frequency the host converts with (0: unknown) |
    //! | 32 | 8 | host | [`WAIT_AFTER_MIN_TSC`]: floor of the wait budget |
    //! | 40 | 8 | host | [`WAIT_AFTER_MAX_TSC`]: ceiling of the wait budget, also the wait length that decides ([`adapt_wait_after`]) |
    //! | 64 | 4 | guest | [`CS_DEPTH`]: spinlocks this vCPU holds now |
    //! | 68 | 4 | guest | [`SPIN_STATE`]: [`SPIN_IDLE`], [`SPIN_SPINNING`] or [`SPIN_WAITING`] |
    //! | 72 | 4 | guest | [`WAITING_FOR`]: the current wait as a [`crate::doorbell::SpinNotify`] value |
    //! | 80 | 8 | guest | [`SPIN_SINCE_TSC`]: guest TSC when the current spin began |
    //! | 88 | 8 | guest | [`LAST_WAIT_TSC`]: how long this vCPU's last wait lasted (WAIT or `HLT` in `pv_wait`), in TSC cycles; the host reads it at this vCPU's exits to adapt [`WAIT_AFTER_TSC`] (a wait that never exits, an in-kernel `HLT`, is otherwise invisible to it) |
    //!
    //! **Ordering.** The host stores the budgets, then increments `HOST_SEQ` with release
    //! semantics; budgets are advice, so a guest may read them with relaxed loads at any time
    //! (a mix of old and new values is harmless). `NOT_RUNNING` is set before the host stops
    //! running the vCPU and cleared before it runs it again; a guest that reads it set for
    //! another vCPU may stop spinning on a lock that vCPU holds or is about to get (its own
    //! `vcpu_is_preempted`). Guest fields are hints the host reads without trusting them:
    //! every value is bounds-checked, and no value can wake another vCPU or raise this vCPU's
    //! share.
    //!
    //! **Budgets** are in guest TSC cycles, so the guest compares them with `RDTSC` deltas
    //! without knowing the frequency. The host adapts them per vCPU from how waits and
    //! notifications turned out (a wait that a kick ended soon after it began means spinning a
    //! little longer would have avoided the exit; a long wait means waiting earlier saves CPU),
    //! so on an idle host waiters rarely leave their spin and under overcommit they wait early.
    //! The host sees the guest's wait reports only at the vCPU's exits; a guest whose waits
    //! never exit (`HLT` with an in-kernel irqchip) may apply the same rule itself
    //! ([`adapt_wait_after`] with the published floor and ceiling) between host updates, and
    //! takes the host's value whenever `HOST_SEQ` changes.

    /// Value of [`LAYOUT`] for the layout of this module.
    pub const LAYOUT_VERSION: u32 = 1;

    /// u32, host: layout version.
    pub const LAYOUT: usize = 0;
    /// u32, host: flags ([`NOT_RUNNING`], [`VCPUS_FIT`]).
    pub const HOST_FLAGS: usize = 4;
    /// u64, host: TSC cycles of spinning before a SPIN notification (`u64::MAX`: never).
    pub const SPIN_WINDOW_TSC: usize = 8;
    /// u64, host: TSC cycles of spinning before waiting.
    pub const WAIT_AFTER_TSC: usize = 16;
    /// u32, host: update counter.
    pub const HOST_SEQ: usize = 24;
    /// u32, host: TSC frequency in kHz the host converts with (0: unknown).
    pub const TSC_KHZ: usize = 28;
    /// u64, host: floor of the wait budget, TSC cycles.
    pub const WAIT_AFTER_MIN_TSC: usize = 32;
    /// u64, host: ceiling of the wait budget, TSC cycles.
    pub const WAIT_AFTER_MAX_TSC: usize = 40;
    /// u32, guest: spinlocks held.
    pub const CS_DEPTH: usize = 64;
    /// u32, guest: spin state.
    pub const SPIN_STATE: usize = 68;
    /// u32, guest: the current wait as a `SpinNotify` value.
    pub const WAITING_FOR: usize = 72;
    /// u64, guest: TSC when the current spin began.
    pub const SPIN_SINCE_TSC: usize = 80;
    /// u64, guest: TSC cycles the last wait lasted; 0: none since the host took it. The one
    /// guest field the host also writes: it takes the value with an atomic exchange for 0,
    /// so each wait is counted once.
    pub const LAST_WAIT_TSC: usize = 88;

    /// First byte of the guest-written line.
    pub const GUEST_LINE: usize = 64;
    /// End of the defined fields; bytes from here to the page end are reserved.
    pub const DEFINED_END: usize = 128;

    /// [`HOST_FLAGS`] bit: the host does not run this vCPU now.
    pub const NOT_RUNNING: u32 = 1 << 0;
    /// [`HOST_FLAGS`] bit (0.4): the VM runs no more vCPUs at once than the CPUs the host
    /// gives it (its affinity and CPU quota): all its vCPUs, or, where the host gates them with
    /// run slots and hands a kicker's slot to the vCPU it kicks, its slots; so a vCPU that an
    /// unlocker kicked awake gets a CPU without queueing behind this VM's other vCPUs. A waiter whose next owner was just kicked
    /// may then keep spinning its budget instead of waiting early: the owner is about to run,
    /// and waiting would make the next hand-over a wake-up too (a wake-up convoy). Without the
    /// flag (more vCPUs than CPUs, or a host that does not say) the spinners would take the CPU
    /// the kicked owner needs, so waiting early is right. The same in every page of a VM; a
    /// hint, changed by the host at any time.
    pub const VCPUS_FIT: u32 = 1 << 1;

    /// [`SPIN_STATE`]: not spinning on a lock.
    pub const SPIN_IDLE: u32 = 0;
    /// [`SPIN_STATE`]: spinning on a lock.
    pub const SPIN_SPINNING: u32 = 1;
    /// [`SPIN_STATE`]: waiting (halted or in WAIT) for a lock.
    pub const SPIN_WAITING: u32 = 2;

    /// The wait-budget rule both sides apply (KVM's halt-polling rule): after a wait of
    /// `waited` (TSC cycles), a budget `current` doubles if the ceiling `max` would have covered
    /// the wait (the kick came soon: spinning is cheaper than the exit and the wake-up) and
    /// halves otherwise (the waited-for vCPU was not running: waiting earlier saves CPU), then
    /// is clamped to `min..=max`.
    pub const fn adapt_wait_after(current: u64, waited: u64, min: u64, max: u64) -> u64 {
        let next = if waited <= max {
            current.saturating_mul(2)
        } else {
            current / 2
        };
        if next < min {
            min
        } else if next > max {
            max
        } else {
            next
        }
    }

    /// Whether a SHARED_PAGE value names a usable page: any non-zero PFN; the host still
    /// checks that the page is guest RAM.
    pub const fn is_registration(pfn: u32) -> bool {
        pfn != 0
    }
}

pub mod virtio {
    //! pvspin as a virtio device (**experimental**): the same kicks, spin notifications and hint
    //! pages as the doorbell, for VMMs that do not link pvspin but can attach a vhost-user
    //! device backend (`pvspind`). The prose version, with the transport and the host side, is
    //! `docs/vhost-user.md`.
    //!
    //! **Device ID** [`DEVICE_ID`] = 63 is **not allocated by OASIS**: it is the highest ID a
    //! virtio-pci function can carry (PCI device ID 0x1040 + 63 = 0x107F) and is above every ID
    //! allocated in virtio 1.3. It is an agreement between a pvspin-aware guest and the VMM
    //! that presents the device, and may change before 1.0.
    //!
    //! **Feature bits** (device-specific bits 0..23): [`F_SPIN_NOTIFY`], [`F_HINT_PAGES`]. The
    //! device also offers `VIRTIO_F_VERSION_1` (bit 32), which the driver must accept.
    //!
    //! **Queues**, for a device whose configuration says `max_vcpus` = M:
    //!
    //! | queue | role | descriptors |
    //! |---|---|---|
    //! | 0 ([`CONTROL_QUEUE`]) | control requests ([`ControlRequest`]), answered in a device-writable `u32` status | yes |
    //! | 1 + i ([`kick_queue`]) | KICK vCPU i: notifying this queue is the kick | never read |
    //! | 1 + M + i ([`spin_queue`]), i < S | SPIN from vCPU i: the notification; what it waits for is in its hint page (`WAITING_FOR`), which must also say it spins or waits (`SPIN_STATE`): other notifications are ignored | never read |
    //!
    //! S = [`spin_queues`]`(M)` = min(M, 255 - M): every vCPU has a spin queue up to M = 127,
    //! and the layout never needs more than [`MAX_QUEUES`] = 256 queues, which every transport
    //! can name (vhost-user names a queue in 8 bits). Above 127 vCPUs the vCPUs S..M have no
    //! spin queue (at M = 255, none has): they report a spin with the control request
    //! [`OP_SPIN_NOTIFY`] instead, on the one control queue they share (a driver that finds
    //! it busy skips the report: spin notifications are hints). Kicks, hint pages and budgets
    //! serve all M.
    //!
    //! A kick queue carries no descriptors: the queue notification itself (on virtio-mmio a
    //! 32-bit write of the queue index to `QueueNotify`, on virtio-pci a write to the queue's
    //! notify address) is the command, and the device answers by signalling the **same queue's
    //! used-buffer notification** (its interrupt), which the VMM delivers to vCPU i as a
    //! wake-up with `KVM_HC_KICK_CPU` semantics (in KVM: an MSI in REMRD delivery mode to
    //! APIC ID i, which sets `pv_unhalted`, so it ends a `cli; hlt` and is remembered when
    //! vCPU i is not halted). A driver sets these queues up (any size, 1 is enough) and never
    //! posts buffers on them. Queues of vCPUs the driver does not set up do not exist: a kick
    //! to one wakes nobody.
    //!
    //! **Configuration space** (read-only, little-endian): [`config`].
    //!
    //! **Restarts.** Hint-page registrations live in the device's backend. When the transport's
    //! configuration generation changes (virtio-mmio `ConfigGeneration`, virtio-pci
    //! `config_generation`), the device may have lost them: the driver registers its pages again.
    //!
    //! **Waiting** needs nothing from the device: `pv_wait` is `HLT` (kernel mode), as in
    //! the doorbell's `pv_wait` (`docs/abi.md`, "`pv_wait(ptr, val)`"). The device has no WAIT
    //! command.

    /// The virtio device ID (experimental, see the module docs).
    pub const DEVICE_ID: u32 = 63;

    /// Feature bit number: spin queues exist and the device acts on their notifications
    /// (reads the notifying vCPU's hint page, may yield to the vCPU it waits for).
    pub const F_SPIN_NOTIFY: u32 = 0;
    /// Feature bit number: the control queue's [`OP_REGISTER_HINT_PAGE`] works and the device
    /// publishes spin and wait budgets in registered pages ([`crate::hint`] layout).
    pub const F_HINT_PAGES: u32 = 1;
    /// `VIRTIO_F_VERSION_1`'s bit number (virtio 1.x): required.
    pub const F_VERSION_1: u32 = 32;
    /// Every device-specific feature bit this version defines, as a mask.
    pub const FEATURES_DEFINED: u64 = (1 << F_SPIN_NOTIFY) | (1 << F_HINT_PAGES);

    /// The most vCPUs a device may serve: the ABI's [`crate::MAX_VCPUS`] (kicks are REMRD
    /// MSIs to 8-bit xAPIC IDs, 0xFF being broadcast). The queue layout keeps every device
    /// within [`MAX_QUEUES`] queues, so that vhost-user, which names a vring in 8 bits
    /// (`SET_VRING_KICK`/`CALL`), can carry a device of 255 vCPUs.
    pub const MAX_VCPUS: u32 = crate::MAX_VCPUS;

    /// Index of the control queue.
    pub const CONTROL_QUEUE: u16 = 0;

    /// Index of the queue whose notification kicks vCPU `vcpu` (`None` outside `max_vcpus`).
    pub const fn kick_queue(max_vcpus: u32, vcpu: u32) -> Option<u16> {
        if vcpu < max_vcpus && max_vcpus <= MAX_VCPUS {
            Some(1 + vcpu as u16)
        } else {
            None
        }
    }

    /// The most queues a device has: a device serving [`MAX_VCPUS`] vCPUs has the control
    /// queue and one kick queue per vCPU, no spin queue ([`spin_queues`]).
    pub const MAX_QUEUES: usize = 256;

    /// How many vCPUs have a spin queue, for a device serving `max_vcpus` vCPUs: vCPUs
    /// `0..spin_queues(max_vcpus)`. All of them up to 127 vCPUs, then fewer, so that the
    /// device never has more than [`MAX_QUEUES`] queues (0 outside the ABI's limit).
    pub const fn spin_queues(max_vcpus: u32) -> u32 {
        if max_vcpus > MAX_VCPUS {
            0
        } else if max_vcpus <= MAX_VCPUS - max_vcpus {
            max_vcpus
        } else {
            MAX_VCPUS - max_vcpus
        }
    }

    /// Index of vCPU `vcpu`'s spin-notification queue (`None` outside `max_vcpus`, and for
    /// the vCPUs that have none: see [`spin_queues`]).
    pub const fn spin_queue(max_vcpus: u32, vcpu: u32) -> Option<u16> {
        if vcpu < spin_queues(max_vcpus) {
            Some(1 + max_vcpus as u16 + vcpu as u16)
        } else {
            None
        }
    }

    /// Number of queues of a device serving `max_vcpus` vCPUs (at most [`MAX_QUEUES`]).
    pub const fn num_queues(max_vcpus: u32) -> usize {
        1 + max_vcpus as usize + spin_queues(max_vcpus) as usize
    }

    /// What a queue index means, for a device serving `max_vcpus` vCPUs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum QueueRole {
        /// The control queue.
        Control,
        /// Kicks vCPU `.0`.
        Kick(u32),
        /// Spin notifications from vCPU `.0`.
        Spin(u32),
    }

    /// Decodes a queue index (`None`: no such queue).
    pub const fn queue_role(max_vcpus: u32, queue: usize) -> Option<QueueRole> {
        let m = max_vcpus as usize;
        if max_vcpus > MAX_VCPUS {
            None
        } else if queue == 0 {
            Some(QueueRole::Control)
        } else if queue <= m {
            Some(QueueRole::Kick((queue - 1) as u32))
        } else if queue <= m + spin_queues(max_vcpus) as usize {
            Some(QueueRole::Spin((queue - 1 - m) as u32))
        } else {
            None
        }
    }

    pub mod config {
        //! The device configuration space: [`SIZE`] bytes, read-only for the driver,
        //! little-endian.
        //!
        //! | offset | size | field |
        //! |---|---|---|
        //! | 0 | 4 | [`MAX_VCPUS`]: M, the vCPUs the device has queues for (the driver uses vCPUs `0..min(M, its own)`) |
        //! | 4 | 4 | [`ABI_VERSION`]: pvspin's ABI version word ([`crate::ABI_VERSION`]) |
        //! | 8 | 4 | [`SPIN_QUEUE_BASE`]: index of vCPU 0's spin queue (1 + M) |
        //! | 12 | 4 | [`SPIN_QUEUES`]: S, how many vCPUs (`0..S`) have a spin queue ([`super::spin_queues`]) |

        /// u32: the vCPUs the device has queues for.
        pub const MAX_VCPUS: usize = 0;
        /// u32: the ABI version word.
        pub const ABI_VERSION: usize = 4;
        /// u32: index of vCPU 0's spin queue.
        pub const SPIN_QUEUE_BASE: usize = 8;
        /// u32: how many vCPUs have a spin queue.
        pub const SPIN_QUEUES: usize = 12;
        /// Size of the configuration space in bytes.
        pub const SIZE: usize = 16;

        /// The configuration space of a device serving `max_vcpus` vCPUs.
        pub const fn encode(max_vcpus: u32) -> [u8; SIZE] {
            let mut out = [0u8; SIZE];
            let m = max_vcpus.to_le_bytes();
            let v = crate::ABI_VERSION.to_le_bytes();
            let s = (1 + max_vcpus).to_le_bytes();
            let n = super::spin_queues(max_vcpus).to_le_bytes();
            let mut i = 0;
            while i < 4 {
                out[MAX_VCPUS + i] = m[i];
                out[ABI_VERSION + i] = v[i];
                out[SPIN_QUEUE_BASE + i] = s[i];
                out[SPIN_QUEUES + i] = n[i];
                i += 1;
            }
            out
        }
    }

    /// One control request: the first descriptor of a chain, device-readable, exactly
    /// [`ControlRequest::SIZE`] bytes, little-endian. The chain's last descriptor is
    /// device-writable and at least 4 bytes: the device writes a `u32` status there
    /// ([`STATUS_OK`] ...) and returns the chain with used length 4.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct ControlRequest {
        /// [`OP_REGISTER_HINT_PAGE`] or [`OP_SPIN_NOTIFY`].
        pub op: u32,
        /// The vCPU the request is about.
        pub vcpu: u32,
        /// A guest physical address (for [`OP_REGISTER_HINT_PAGE`]: the 4 KiB-aligned hint
        /// page, 0 to unregister).
        pub gpa: u64,
        /// An argument (for [`OP_REGISTER_HINT_PAGE`]: the guest TSC frequency in kHz the
        /// device converts its time budgets with; 0 if unknown, then the device publishes no
        /// time budgets: spin window `u64::MAX`).
        pub arg: u64,
    }

    impl ControlRequest {
        /// Size in bytes.
        pub const SIZE: usize = 24;

        /// Decodes a request from its little-endian bytes (`None` unless exactly
        /// [`Self::SIZE`] bytes).
        pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
            if bytes.len() != Self::SIZE {
                return None;
            }
            let u32_at =
                |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
            let u64_at = |o: usize| (u32_at(o) as u64) | ((u32_at(o + 4) as u64) << 32);
            Some(Self {
                op: u32_at(0),
                vcpu: u32_at(4),
                gpa: u64_at(8),
                arg: u64_at(16),
            })
        }

        /// The little-endian bytes of the request.
        pub fn to_bytes(&self) -> [u8; Self::SIZE] {
            let mut out = [0u8; Self::SIZE];
            out[0..4].copy_from_slice(&self.op.to_le_bytes());
            out[4..8].copy_from_slice(&self.vcpu.to_le_bytes());
            out[8..16].copy_from_slice(&self.gpa.to_le_bytes());
            out[16..24].copy_from_slice(&self.arg.to_le_bytes());
            out
        }
    }

    /// Control op: register (`gpa` != 0) or unregister (`gpa` == 0) vCPU `vcpu`'s hint page.
    /// Needs [`F_HINT_PAGES`]. The page must lie in guest RAM the device can map.
    pub const OP_REGISTER_HINT_PAGE: u32 = 1;

    /// Control op: vCPU `vcpu` spins (or waits); the device acts as on a notification of its
    /// spin queue: it reads what `vcpu`'s hint page says it waits for (the page must say it
    /// spins or waits, else the report is ignored and counted). For the vCPUs that have no spin
    /// queue ([`spin_queues`]); any vCPU may use it. `gpa` and `arg` must be 0. Needs
    /// [`F_SPIN_NOTIFY`] and [`F_HINT_PAGES`] ([`STATUS_UNSUPPORTED`] otherwise); a device
    /// older than this op answers [`STATUS_BAD_REQUEST`], and a driver then stops sending it.
    pub const OP_SPIN_NOTIFY: u32 = 2;

    /// Status: done.
    pub const STATUS_OK: u32 = 0;
    /// Status: malformed chain, unknown op, or an op's argument out of its range.
    pub const STATUS_BAD_REQUEST: u32 = 1;
    /// Status: `vcpu` is not below `max_vcpus`.
    pub const STATUS_BAD_VCPU: u32 = 2;
    /// Status: the address is not aligned or not in guest RAM the device maps.
    pub const STATUS_BAD_ADDRESS: u32 = 3;
    /// Status: the op needs a feature the driver did not accept.
    pub const STATUS_UNSUPPORTED: u32 = 4;
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    use super::cpuid::*;
    use super::doorbell::*;
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    // Layout of the repr(C) types, checked at compile time and again in a test.
    const _: () = assert!(size_of::<CpuidRegs>() == 16);
    const _: () = assert!(align_of::<CpuidRegs>() == 4);

    #[test]
    fn cpuid_regs_layout() {
        assert_eq!(size_of::<CpuidRegs>(), 16);
        assert_eq!(offset_of!(CpuidRegs, eax), 0);
        assert_eq!(offset_of!(CpuidRegs, ebx), 4);
        assert_eq!(offset_of!(CpuidRegs, ecx), 8);
        assert_eq!(offset_of!(CpuidRegs, edx), 12);
    }

    #[test]
    fn signature_registers_spell_the_signature() {
        let mut bytes = [0u8; 12];
        bytes[0..4].copy_from_slice(&SIGNATURE_EBX.to_le_bytes());
        bytes[4..8].copy_from_slice(&SIGNATURE_ECX.to_le_bytes());
        bytes[8..12].copy_from_slice(&SIGNATURE_EDX.to_le_bytes());
        assert_eq!(&bytes, &SIGNATURE);
        // The values docs/abi.md gives to guest authors.
        assert_eq!(SIGNATURE_EBX, 0x7073_7670);
        assert_eq!(SIGNATURE_ECX, 0x7670_6e69);
        assert_eq!(SIGNATURE_EDX, 0x6e69_7073);
    }

    #[test]
    fn default_base_is_outside_kvm_and_relocated_kvm_windows() {
        assert_eq!(DEFAULT_BASE % SCAN_STEP, 0);
        assert!((SCAN_FIRST..=SCAN_LAST).contains(&DEFAULT_BASE));
        assert_ne!(DEFAULT_BASE, 0x4000_0000);
        assert_ne!(DEFAULT_BASE, 0x4000_0100);
    }

    #[test]
    fn info_leaf_round_trips() {
        let info = PvspinInfo {
            version: ABI_VERSION,
            doorbell_port: DEFAULT_PORT,
            doorbell_ports: PORT_COUNT,
            features: FEATURE_KICK | FEATURE_KICK_IN_KERNEL,
            nr_vcpus: 8,
        };
        let regs = info.info_leaf();
        assert_eq!(regs.ebx, 0x0010_0A40);
        assert_eq!(regs.eax, 0x0000_0004);
        assert_eq!(PvspinInfo::from_info_leaf(regs), info);
    }

    #[test]
    fn find_base_scans_in_steps_and_ignores_kvm() {
        let table = |leaf: u32| match leaf {
            0x4000_0000 => CpuidRegs {
                eax: 0x4000_0001,
                ebx: 0x4b4d_564b,
                ecx: 0x564b_4d56,
                edx: 0x4d,
            },
            0x4000_0700 => PvspinInfo::base_leaf(0x4000_0700),
            _ => CpuidRegs::default(),
        };
        assert_eq!(find_base(table), Some(0x4000_0700));
        assert_eq!(find_base(|_| CpuidRegs::default()), None);
        // A signature whose max-leaf says the info leaf is absent does not count.
        let short = |leaf: u32| {
            let mut r = PvspinInfo::base_leaf(leaf);
            r.eax = leaf;
            r
        };
        assert_eq!(find_base(short), None);
        // The last base is scanned too.
        let last = |leaf: u32| {
            if leaf == SCAN_LAST {
                PvspinInfo::base_leaf(leaf)
            } else {
                CpuidRegs::default()
            }
        };
        assert_eq!(find_base(last), Some(SCAN_LAST));
    }

    #[test]
    fn version_word() {
        assert_eq!(
            split_version(ABI_VERSION),
            (ABI_VERSION_MAJOR, ABI_VERSION_MINOR)
        );
        assert!(version_compatible(ABI_VERSION));
        assert!(version_compatible(ABI_VERSION + 7));
        assert!(!version_compatible(ABI_VERSION + (1 << 16)));
    }

    #[test]
    fn doorbell_offsets_are_distinct_aligned_and_inside_the_range() {
        let offs = [KICK_OFFSET, SPIN_OFFSET, SHARED_PAGE_OFFSET, WAIT_OFFSET];
        for (i, a) in offs.iter().enumerate() {
            assert_eq!(usize::from(*a) % COMMAND_WIDTH, 0);
            assert!(usize::from(*a) + COMMAND_WIDTH <= usize::from(PORT_COUNT));
            for b in &offs[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // The range stays clear of PCI config space and fw_cfg.
        let range = DEFAULT_PORT..DEFAULT_PORT + PORT_COUNT;
        for p in [0xcf8u16, 0xcfc, 0x510, 0x511, 0x514] {
            assert!(!range.contains(&p));
        }
    }

    #[test]
    fn spin_notify_encoding() {
        let n = SpinNotify {
            waiting_for: Some(3),
            next_owner: false,
            spun_bucket: 5,
            lock_hash: 0x1abc,
        };
        // 0x1abc << 19 | 5 << 14 | 3
        assert_eq!(n.encode(), 0xd5e0_0000 | 0x0001_4003);
        assert_eq!(SpinNotify::decode(n.encode()), n);
        let unknown = SpinNotify {
            waiting_for: None,
            next_owner: true,
            spun_bucket: 0,
            lock_hash: 1,
        };
        assert_eq!(unknown.encode(), 0x0008_3fff);
        assert_eq!(SpinNotify::decode(unknown.encode()), unknown);
        // Every value round-trips: no bit is lost or invented.
        for v in [
            0u32,
            1,
            0x1fff,
            0x2000,
            0x7_c000,
            0x8_0000,
            u32::MAX,
            0x1234_5678,
        ] {
            assert_eq!(SpinNotify::decode(v).encode(), v);
        }
        // An index that does not fit is sent as unknown, never as another vCPU.
        let wide = SpinNotify {
            waiting_for: Some(0x2001),
            ..unknown
        };
        assert_eq!(SpinNotify::decode(wide.encode()).waiting_for, None);
        // Over-wide hash and bucket are truncated to their fields.
        let over = SpinNotify {
            waiting_for: Some(0),
            next_owner: false,
            spun_bucket: 0xff,
            lock_hash: 0xffff,
        };
        let d = SpinNotify::decode(over.encode());
        assert_eq!(
            (d.waiting_for, d.spun_bucket, d.lock_hash),
            (Some(0), 31, 0x1fff)
        );
    }

    #[test]
    fn spin_fields_are_disjoint_and_cover_32_bits() {
        let fields = [
            SPIN_WAITING_FOR_MASK,
            SPIN_NEXT_OWNER,
            SPIN_SPUN_MASK << SPIN_SPUN_SHIFT,
            SPIN_LOCK_MASK << SPIN_LOCK_SHIFT,
        ];
        let mut acc = 0u32;
        for f in fields {
            assert_eq!(acc & f, 0);
            acc |= f;
        }
        assert_eq!(acc, u32::MAX);
        assert_eq!(u32::from(SPIN_WAITING_FOR_UNKNOWN), SPIN_WAITING_FOR_MASK);
    }

    #[test]
    fn spun_buckets_are_log2() {
        assert_eq!(spun_bucket(0), 0);
        assert_eq!(spun_bucket(1), 1);
        assert_eq!(spun_bucket(2), 2);
        assert_eq!(spun_bucket(3), 2);
        assert_eq!(spun_bucket(16), 5);
        assert_eq!(spun_bucket(31), 5);
        assert_eq!(spun_bucket(1 << 29), 30);
        assert_eq!(spun_bucket(1 << 30), 31);
        assert_eq!(spun_bucket(u32::MAX), 31);
        for b in 1..=31u8 {
            assert_eq!(spun_bucket(spun_bucket_floor(b)), b);
            if b < 31 {
                assert_eq!(spun_bucket((spun_bucket_floor(b) << 1) - 1), b);
            }
        }
        assert_eq!(spun_bucket_floor(0), 0);
        assert_eq!(spun_bucket_floor(200), 1 << 30);
    }

    #[test]
    fn lock_hash_fits_and_spreads_neighbouring_locks() {
        let a = lock_hash(0x20_1000);
        let b = lock_hash(0x20_1008);
        assert!(u32::from(a) <= SPIN_LOCK_MASK && u32::from(b) <= SPIN_LOCK_MASK);
        assert_ne!(a, b);
        assert_eq!(lock_hash(u64::MAX) as u32 & !SPIN_LOCK_MASK, 0);
    }

    #[test]
    fn hint_page_fields_are_aligned_disjoint_and_split_by_writer() {
        use crate::hint::*;
        let fields = [
            (LAYOUT, 4, true),
            (HOST_FLAGS, 4, true),
            (SPIN_WINDOW_TSC, 8, true),
            (WAIT_AFTER_TSC, 8, true),
            (HOST_SEQ, 4, true),
            (TSC_KHZ, 4, true),
            (WAIT_AFTER_MIN_TSC, 8, true),
            (WAIT_AFTER_MAX_TSC, 8, true),
            (CS_DEPTH, 4, false),
            (SPIN_STATE, 4, false),
            (WAITING_FOR, 4, false),
            (SPIN_SINCE_TSC, 8, false),
            (LAST_WAIT_TSC, 8, false),
        ];
        let mut used = [false; DEFINED_END];
        for (offset, size, host) in fields {
            assert_eq!(offset % size, 0, "field at {offset} is not aligned");
            assert!(offset + size <= DEFINED_END);
            assert_eq!(
                offset < GUEST_LINE,
                host,
                "field at {offset} is in the wrong line"
            );
            for b in &mut used[offset..offset + size] {
                assert!(!*b, "fields overlap at {offset}");
                *b = true;
            }
        }
        assert!(DEFINED_END as u64 <= SHARED_PAGE_SIZE);
        assert!(!is_registration(0) && is_registration(1));
        assert_eq!(adapt_wait_after(100, 50, 10, 1000), 200);
        assert_eq!(adapt_wait_after(800, 1000, 10, 1000), 1000);
        assert_eq!(adapt_wait_after(100, 5000, 10, 1000), 50);
        assert_eq!(adapt_wait_after(15, 5000, 10, 1000), 10);
    }

    #[test]
    fn shared_page_gpa_is_pfn_times_page() {
        assert_eq!(shared_page_gpa(0), 0);
        assert_eq!(shared_page_gpa(0x80), 0x8_0000);
        assert_eq!(shared_page_gpa(u32::MAX), 0xfff_ffff_f000);
    }

    #[test]
    fn defined_features_are_disjoint_bits() {
        let f = [
            FEATURE_KICK,
            FEATURE_KICK_IN_KERNEL,
            FEATURE_SPIN_NOTIFY,
            FEATURE_SHARED_PAGE,
            FEATURE_WAIT,
        ];
        let mut acc = 0;
        for b in f {
            assert_eq!(b.count_ones(), 1);
            assert_eq!(acc & b, 0);
            acc |= b;
        }
        assert_eq!(acc, FEATURES_DEFINED);
    }

    #[test]
    fn virtio_queue_layout_round_trips() {
        use crate::virtio::*;
        for m in 1..=MAX_VCPUS {
            let spinners = spin_queues(m);
            assert_eq!(spinners, if m <= 127 { m } else { 255 - m });
            assert!(num_queues(m) <= MAX_QUEUES, "{m} vCPUs");
            assert_eq!(queue_role(m, 0), Some(QueueRole::Control));
            // Every queue index below num_queues has exactly one role, and each vCPU's
            // queues decode back to it.
            for i in 0..m {
                let k = kick_queue(m, i).unwrap();
                assert_eq!(queue_role(m, k as usize), Some(QueueRole::Kick(i)));
                match spin_queue(m, i) {
                    Some(s) => {
                        assert!(i < spinners);
                        assert_eq!(queue_role(m, s as usize), Some(QueueRole::Spin(i)));
                        assert!((s as usize) < num_queues(m));
                    }
                    None => assert!(i >= spinners, "{m} vCPUs, vCPU {i}"),
                }
            }
            assert_eq!(kick_queue(m, m), None);
            assert_eq!(spin_queue(m, m), None);
            assert_eq!(queue_role(m, num_queues(m)), None);
            let c = config::encode(m);
            assert_eq!(u32::from_le_bytes(c[0..4].try_into().unwrap()), m);
            assert_eq!(u32::from_le_bytes(c[8..12].try_into().unwrap()), 1 + m);
            assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), spinners);
        }
        assert_eq!(num_queues(127), 255);
        assert_eq!(num_queues(128), 256);
        assert_eq!(num_queues(MAX_VCPUS), MAX_QUEUES);
        assert_eq!(spin_queue(MAX_VCPUS, 0), None);
        assert_eq!(kick_queue(MAX_VCPUS + 1, 0), None);
        assert_eq!(queue_role(MAX_VCPUS + 1, 0), None);
        let r = ControlRequest {
            op: OP_REGISTER_HINT_PAGE,
            vcpu: 3,
            gpa: 0x1234_5000,
            arg: 2_000_000,
        };
        assert_eq!(ControlRequest::from_bytes(&r.to_bytes()), Some(r));
        assert_eq!(ControlRequest::from_bytes(&[0; 23]), None);
        assert_eq!(FEATURES_DEFINED.count_ones(), 2);
    }
}
