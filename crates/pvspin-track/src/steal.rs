//! KVM's steal-time area (`struct kvm_steal_time`, 64 bytes in guest RAM), read by the VMM.
//!
//! When a guest enables `MSR_KVM_STEAL_TIME` (0x4b564d03), KVM itself writes byte 16
//! (`preempted`, bit 0 `KVM_VCPU_PREEMPTED`) when it deschedules the vCPU involuntarily at an
//! instruction boundary, and clears it before the next entry (the shared notes'
//! kvm-pv-reference.md, "`struct kvm_steal_time`" and "Preemption bookkeeping").
//! A userspace VMM can read that byte from guest memory from any thread: it is the only
//! host-preemption signal userspace gets without polling `/proc`.
//!
//! Everything here is guest-controlled and untrusted: the MSR value (address and reserved
//! bits) is validated against the guest memory size before any read, and a malformed area only
//! ever reads as "not preempted".
//!
//! The MSR is handled inside KVM, so the VMM learns its value either with `KVM_GET_MSRS` on the
//! vCPU's own thread (for example once after the guest's first few exits) or through pvspin's
//! own registration; this module only validates and parses.

use thiserror::Error;

/// Size of `struct kvm_steal_time`.
pub const STEAL_TIME_SIZE: usize = 64;
/// Offset of the `preempted` byte.
pub const PREEMPTED_OFFSET: usize = 16;
/// `KVM_VCPU_PREEMPTED`: bit 0 of the `preempted` byte.
pub const KVM_VCPU_PREEMPTED: u8 = 1;
/// `KVM_VCPU_FLUSH_TLB`: bit 1 of the `preempted` byte.
pub const KVM_VCPU_FLUSH_TLB: u8 = 2;
/// `KVM_MSR_ENABLED`: bit 0 of the MSR value.
pub const KVM_MSR_ENABLED: u64 = 1;
/// Bits 5:1 of the MSR are reserved (KVM rejects a write with any of them set).
pub const STEAL_TIME_RESERVED_MASK: u64 = 0x3e;

/// Why a steal-time registration is not used.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy, displaydoc::Display)]
pub enum StealTimeError {
    /// steal time is disabled (MSR bit 0 clear)
    Disabled,
    /// rule: steal-time MSR bits 5:1 are reserved, value {0:#x}
    ReservedBits(u64),
    /// rule: steal-time area at {gpa:#x} (+64) must lie inside guest memory of {mem_len:#x} bytes
    OutOfBounds {
        /// The area's guest-physical address.
        gpa: u64,
        /// The guest memory size.
        mem_len: u64,
    },
    /// rule: a steal-time area is exactly 64 bytes, got {0}
    WrongSize(usize),
}

/// Validates a `MSR_KVM_STEAL_TIME` value against a guest memory of `mem_len` bytes (one flat
/// region starting at GPA 0) and returns the area's GPA.
pub fn steal_time_gpa(msr: u64, mem_len: u64) -> Result<u64, StealTimeError> {
    if msr & KVM_MSR_ENABLED == 0 {
        return Err(StealTimeError::Disabled);
    }
    if msr & STEAL_TIME_RESERVED_MASK != 0 {
        return Err(StealTimeError::ReservedBits(msr));
    }
    let gpa = msr & !0x3f;
    match gpa.checked_add(STEAL_TIME_SIZE as u64) {
        Some(end) if end <= mem_len => Ok(gpa),
        _ => Err(StealTimeError::OutOfBounds { gpa, mem_len }),
    }
}

/// A parsed `struct kvm_steal_time` (the fields a VMM needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StealTime {
    /// Nanoseconds the vCPU was runnable but not running.
    pub steal: u64,
    /// Seqcount: odd while KVM updates `steal`.
    pub version: u32,
    /// The `preempted` byte.
    pub preempted: u8,
}

impl StealTime {
    /// Parses the 64 bytes of the area (little endian, x86).
    pub fn parse(bytes: &[u8]) -> Result<StealTime, StealTimeError> {
        let b: &[u8; STEAL_TIME_SIZE] = bytes
            .try_into()
            .map_err(|_| StealTimeError::WrongSize(bytes.len()))?;
        let mut steal = [0u8; 8];
        steal.copy_from_slice(&b[0..8]);
        let mut version = [0u8; 4];
        version.copy_from_slice(&b[8..12]);
        Ok(StealTime {
            steal: u64::from_le_bytes(steal),
            version: u32::from_le_bytes(version),
            preempted: b[PREEMPTED_OFFSET],
        })
    }

    /// Whether KVM marked the vCPU preempted.
    pub fn is_preempted(&self) -> bool {
        preempted_from_byte(self.preempted)
    }
}

/// Whether a `preempted` byte says "preempted" (bit 0). Bit 1 (TLB flush request) and the
/// other bits, which KVM never sets, are ignored.
#[inline]
pub fn preempted_from_byte(byte: u8) -> bool {
    byte & KVM_VCPU_PREEMPTED != 0
}

/// Reads bytes of guest memory; the VMM implements it over its memory (vm-memory or its own).
pub trait GuestBytes {
    /// The byte at `gpa`, or `None` when `gpa` is not guest memory.
    fn read_u8(&self, gpa: u64) -> Option<u8>;
}

/// A flat guest memory that starts at GPA 0 (tests, simple VMMs).
impl GuestBytes for [u8] {
    #[inline]
    fn read_u8(&self, gpa: u64) -> Option<u8> {
        usize::try_from(gpa).ok().and_then(|i| self.get(i).copied())
    }
}

/// Reads the `preempted` byte of the area at `gpa` (validated beforehand with
/// [`steal_time_gpa`]; a failed read is "not preempted").
#[inline]
pub fn read_preempted<M: GuestBytes + ?Sized>(mem: &M, gpa: u64) -> bool {
    gpa.checked_add(PREEMPTED_OFFSET as u64)
        .and_then(|a| mem.read_u8(a))
        .is_some_and(preempted_from_byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msr_validation_rules() {
        assert_eq!(
            steal_time_gpa(0x1000, 0x10000),
            Err(StealTimeError::Disabled)
        );
        assert_eq!(
            steal_time_gpa(0x1000 | 1 | 0x4, 0x10000),
            Err(StealTimeError::ReservedBits(0x1005))
        );
        assert_eq!(steal_time_gpa(0x1001, 0x10000), Ok(0x1000));
        // The last 64 bytes fit; one slot further does not.
        assert_eq!(steal_time_gpa(0xffc1, 0x10000), Ok(0xffc0));
        assert_eq!(
            steal_time_gpa(0x10001, 0x10000),
            Err(StealTimeError::OutOfBounds {
                gpa: 0x10000,
                mem_len: 0x10000
            })
        );
        // Address arithmetic must not wrap.
        assert!(matches!(
            steal_time_gpa(!0x3e, u64::MAX),
            Err(StealTimeError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn parse_fields_at_their_offsets() {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        b[8..12].copy_from_slice(&7u32.to_le_bytes());
        b[16] = 3;
        let st = StealTime::parse(&b).unwrap();
        assert_eq!(st.steal, 0x1122_3344_5566_7788);
        assert_eq!(st.version, 7);
        assert_eq!(st.preempted, 3);
        assert!(st.is_preempted());
        assert_eq!(
            StealTime::parse(&b[..63]),
            Err(StealTimeError::WrongSize(63))
        );
    }

    #[test]
    fn only_bit0_means_preempted() {
        assert!(!preempted_from_byte(0));
        assert!(preempted_from_byte(1));
        assert!(!preempted_from_byte(KVM_VCPU_FLUSH_TLB));
        assert!(!preempted_from_byte(0xfe));
    }

    #[test]
    fn read_preempted_from_memory_and_out_of_range() {
        let mut mem = vec![0u8; 256];
        mem[64 + 16] = 1;
        assert!(read_preempted(mem.as_slice(), 64));
        assert!(!read_preempted(mem.as_slice(), 0));
        assert!(!read_preempted(mem.as_slice(), 250));
        assert!(!read_preempted(mem.as_slice(), u64::MAX));
    }
}
