//! The guest-host contract of pvspin.
//!
//! Both sides depend on this crate: the host crates (`pvspin-kick`, `pvspin-pause`,
//! `pvspin-hints`) to decode what a guest writes, and `pvspin-guest` to produce it. It is
//! `no_std` and has no dependencies, so a guest kernel can vendor it. The prose version, for a
//! guest OS author who does not read Rust, is `docs/abi.md`.
//!
//! The contract has two parts:
//!
//! 1. **Discovery** ([`cpuid`]): a hypervisor CPUID leaf pair of pvspin's own, found by its
//!    signature `"pvspinpvspin"` when scanning the hypervisor range in 0x100 steps. It reports
//!    the ABI version, the doorbell port, the feature bits and the number of vCPUs.
//! 2. **The doorbell** ([`doorbell`]): a small port-I/O range. Offset 0 is the KICK register:
//!    a 32-bit `OUT` of a vCPU index wakes that vCPU from `pv_wait` (a halt), and a kick that
//!    arrives before the halt is remembered. The other offsets are reserved for later commands
//!    (spin notification with a holder hint, shared-page registration); their encodings are
//!    fixed here but hosts do not implement them yet and do not advertise them.
//!
//! **Implemented:** discovery and the KICK command. **Reserved, not implemented by any host
//! yet:** [`doorbell::SPIN_OFFSET`] and [`doorbell::SHARED_PAGE_OFFSET`] (their feature bits
//! [`cpuid::FEATURE_SPIN_NOTIFY`] and [`cpuid::FEATURE_SHARED_PAGE`] are never set today).
#![no_std]
#![deny(missing_docs)]

/// Version of the guest-host contract. A guest refuses a host whose major version differs.
pub const ABI_VERSION_MAJOR: u16 = 0;
/// Minor version: additions that old guests may ignore.
pub const ABI_VERSION_MINOR: u16 = 1;

/// The ABI version as one 32-bit word, as CPUID reports it: major in bits 31..16, minor in
/// bits 15..0.
pub const ABI_VERSION: u32 = ((ABI_VERSION_MAJOR as u32) << 16) | ABI_VERSION_MINOR as u32;

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
    /// is available. Always set by hosts of ABI 0.1.
    pub const FEATURE_KICK: u32 = 1 << 0;
    /// Feature bit: a valid kick is handled inside the host kernel (no exit to the VMM), so it
    /// costs the kicker about as much as a plain port write. Informational only: the encoding
    /// is the same either way.
    pub const FEATURE_KICK_IN_KERNEL: u32 = 1 << 1;
    /// Feature bit: the SPIN command at [`crate::doorbell::SPIN_OFFSET`] is available.
    /// **Reserved: no host implements it yet**, so hosts never set it.
    pub const FEATURE_SPIN_NOTIFY: u32 = 1 << 2;
    /// Feature bit: the SHARED_PAGE command at [`crate::doorbell::SHARED_PAGE_OFFSET`] is
    /// available. **Reserved: no host implements it yet**, so hosts never set it.
    pub const FEATURE_SHARED_PAGE: u32 = 1 << 3;
    /// All feature bits this ABI version defines. Guests ignore bits outside it.
    pub const FEATURES_DEFINED: u32 =
        FEATURE_KICK | FEATURE_KICK_IN_KERNEL | FEATURE_SPIN_NOTIFY | FEATURE_SHARED_PAGE;

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
        /// Number of vCPUs: valid kick targets are `0..nr_vcpus`.
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
    //! | 4 | SPIN (reserved) | [`SpinNotify`]: holder hint (bits 15..0), lock hash (bits 31..16) | [`crate::cpuid::FEATURE_SPIN_NOTIFY`] |
    //! | 8 | SHARED_PAGE (reserved) | guest page frame number of this vCPU's shared page, 0 = unregister | [`crate::cpuid::FEATURE_SHARED_PAGE`] |
    //! | 12 | reserved | - | - |
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
    /// SPIN (reserved): "I am spinning on a lock", with a holder hint. Exits to the VMM.
    pub const SPIN_OFFSET: u16 = 4;
    /// SHARED_PAGE (reserved): register the writing vCPU's shared page. Exits to the VMM.
    pub const SHARED_PAGE_OFFSET: u16 = 8;
    /// Reserved for a later command.
    pub const RESERVED_OFFSET: u16 = 12;

    /// The largest vCPU count the ABI can address in a SPIN holder hint (indexes
    /// `0..=0xFFFE`; `0xFFFF` means "holder unknown").
    pub const SPIN_HOLDER_UNKNOWN: u16 = 0xFFFF;

    /// The value of a SPIN command (reserved, not implemented by hosts yet).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct SpinNotify {
        /// The vCPU index the spinner believes holds the lock, or `None`.
        pub holder: Option<u16>,
        /// A 16-bit hash of the lock's guest address (guest-defined; the host only compares
        /// hashes for equality).
        pub lock_hash: u16,
    }

    impl SpinNotify {
        /// The 32-bit value to write.
        pub const fn encode(self) -> u32 {
            let holder = match self.holder {
                Some(h) => h,
                None => SPIN_HOLDER_UNKNOWN,
            };
            (holder as u32) | ((self.lock_hash as u32) << 16)
        }

        /// Decodes a written value. Every 32-bit value is a well-formed notification; the
        /// holder must still be range-checked against the number of vCPUs.
        pub const fn decode(value: u32) -> Self {
            let holder = (value & 0xffff) as u16;
            Self {
                holder: if holder == SPIN_HOLDER_UNKNOWN {
                    None
                } else {
                    Some(holder)
                },
                lock_hash: (value >> 16) as u16,
            }
        }
    }

    /// Size of the page a SHARED_PAGE command registers (reserved).
    pub const SHARED_PAGE_SIZE: u64 = 4096;

    /// Guest physical address of the page a SHARED_PAGE value names (page frame number times
    /// 4096; a 32-bit PFN covers 16 TiB of guest memory).
    pub const fn shared_page_gpa(pfn: u32) -> u64 {
        (pfn as u64) * SHARED_PAGE_SIZE
    }
}

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
        assert_eq!(regs.eax, 0x0000_0001);
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
        let offs = [
            KICK_OFFSET,
            SPIN_OFFSET,
            SHARED_PAGE_OFFSET,
            RESERVED_OFFSET,
        ];
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
            holder: Some(3),
            lock_hash: 0xbeef,
        };
        assert_eq!(n.encode(), 0xbeef_0003);
        assert_eq!(SpinNotify::decode(0xbeef_0003), n);
        let unknown = SpinNotify {
            holder: None,
            lock_hash: 1,
        };
        assert_eq!(unknown.encode(), 0x0001_ffff);
        assert_eq!(SpinNotify::decode(unknown.encode()), unknown);
        for v in [0u32, 1, 0xffff, 0x1_0000, u32::MAX, 0x1234_5678] {
            assert_eq!(SpinNotify::decode(v).encode(), v);
        }
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
        ];
        let mut acc = 0;
        for b in f {
            assert_eq!(b.count_ones(), 1);
            assert_eq!(acc & b, 0);
            acc |= b;
        }
        assert_eq!(acc, FEATURES_DEFINED);
    }
}
