//! The pure doorbell decoder: one guest port write in, one command or one reject reason out.

use pvspin_abi::doorbell::{
    SpinNotify, COMMAND_WIDTH, KICK_OFFSET, SHARED_PAGE_OFFSET, SPIN_OFFSET, WAIT_OFFSET,
};

/// A well-formed doorbell command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// KICK: wake vCPU `target` (already checked to be `< nr_vcpus`).
    Kick {
        /// The vCPU index to wake.
        target: u32,
    },
    /// SPIN: the writer spins on a lock; the vCPU it waits for, if named, is already checked
    /// to be `< nr_vcpus`.
    Spin(SpinNotify),
    /// A 32-bit read of the SPIN register: the VMM answers with the reading vCPU's spin window
    /// (the device pre-fills all ones in case it does not).
    ReadSpinWindow,
    /// SHARED_PAGE: register (or, with 0, unregister) the writing vCPU's hint page at this
    /// guest page frame number.
    SharedPage {
        /// Guest page frame number; 0 unregisters.
        pfn: u32,
    },
    /// WAIT: the writer waits for a kick (`pv_wait` without `HLT`); the notification says
    /// what for, its waited-for vCPU already checked to be `< nr_vcpus`.
    Wait(SpinNotify),
}

/// Why a doorbell access was ignored. Each reason has its own counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reject {
    /// A KICK target or a SPIN waited-for vCPU names a vCPU that does not exist.
    NoSuchVcpu,
    /// The access was not a 4-byte write.
    WrongWidth,
    /// The write went to an offset that holds no command (reserved, or not 4-aligned).
    UnusedOffset,
    /// The guest read from the doorbell (it is write-only).
    Read,
    /// A command whose feature bit the host does not advertise.
    NotEnabled,
}

impl Reject {
    /// Number of reasons.
    pub const COUNT: usize = 5;
    /// Every reason, in counter order.
    pub const ALL: [Reject; Reject::COUNT] = [
        Reject::NoSuchVcpu,
        Reject::WrongWidth,
        Reject::UnusedOffset,
        Reject::Read,
        Reject::NotEnabled,
    ];

    /// The counter index of this reason.
    pub const fn index(self) -> usize {
        match self {
            Reject::NoSuchVcpu => 0,
            Reject::WrongWidth => 1,
            Reject::UnusedOffset => 2,
            Reject::Read => 3,
            Reject::NotEnabled => 4,
        }
    }

    /// A short stable name, for logs and stats.
    pub const fn name(self) -> &'static str {
        match self {
            Reject::NoSuchVcpu => "no_such_vcpu",
            Reject::WrongWidth => "wrong_width",
            Reject::UnusedOffset => "unused_offset",
            Reject::Read => "read",
            Reject::NotEnabled => "not_enabled",
        }
    }
}

/// Decodes a guest write of `data` at `offset` from the doorbell's first port.
///
/// Pure and total: every input gives a command or a reason, nothing panics. `nr_vcpus` bounds
/// the KICK target and the SPIN holder hint. Feature gating is the device's job, not this
/// function's.
pub fn decode(offset: u16, data: &[u8], nr_vcpus: u32) -> Result<Command, Reject> {
    if ![KICK_OFFSET, SPIN_OFFSET, SHARED_PAGE_OFFSET, WAIT_OFFSET].contains(&offset) {
        return Err(Reject::UnusedOffset);
    }
    let bytes: [u8; COMMAND_WIDTH] = data.try_into().map_err(|_| Reject::WrongWidth)?;
    let value = u32::from_le_bytes(bytes);
    match offset {
        KICK_OFFSET => {
            if value < nr_vcpus {
                Ok(Command::Kick { target: value })
            } else {
                Err(Reject::NoSuchVcpu)
            }
        }
        SPIN_OFFSET | WAIT_OFFSET => {
            let n = SpinNotify::decode(value);
            match n.waiting_for {
                Some(w) if u32::from(w) >= nr_vcpus => Err(Reject::NoSuchVcpu),
                _ if offset == WAIT_OFFSET => Ok(Command::Wait(n)),
                _ => Ok(Command::Spin(n)),
            }
        }
        _ => Ok(Command::SharedPage { pfn: value }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvspin_abi::doorbell::PORT_COUNT;

    #[test]
    fn kick_decodes_only_valid_targets() {
        assert_eq!(
            decode(0, &3u32.to_le_bytes(), 4),
            Ok(Command::Kick { target: 3 })
        );
        assert_eq!(
            decode(0, &0u32.to_le_bytes(), 1),
            Ok(Command::Kick { target: 0 })
        );
        assert_eq!(decode(0, &4u32.to_le_bytes(), 4), Err(Reject::NoSuchVcpu));
        assert_eq!(
            decode(0, &u32::MAX.to_le_bytes(), 4),
            Err(Reject::NoSuchVcpu)
        );
        assert_eq!(decode(0, &0u32.to_le_bytes(), 0), Err(Reject::NoSuchVcpu));
    }

    #[test]
    fn widths_other_than_four_are_rejected() {
        for len in [0usize, 1, 2, 3, 5, 8] {
            let data = vec![0u8; len];
            assert_eq!(decode(0, &data, 4), Err(Reject::WrongWidth), "len {len}");
            assert_eq!(decode(4, &data, 4), Err(Reject::WrongWidth), "len {len}");
            assert_eq!(decode(8, &data, 4), Err(Reject::WrongWidth), "len {len}");
        }
    }

    #[test]
    fn unused_offsets_are_rejected_whatever_the_width() {
        for off in 0..PORT_COUNT + 4 {
            if [KICK_OFFSET, SPIN_OFFSET, SHARED_PAGE_OFFSET, WAIT_OFFSET].contains(&off) {
                continue;
            }
            assert_eq!(decode(off, &[0; 4], 4), Err(Reject::UnusedOffset));
            assert_eq!(decode(off, &[0; 1], 4), Err(Reject::UnusedOffset));
        }
        assert_eq!(decode(u16::MAX, &[0; 4], 4), Err(Reject::UnusedOffset));
    }

    #[test]
    fn spin_checks_the_waited_for_vcpu() {
        let ok = SpinNotify {
            waiting_for: Some(2),
            next_owner: true,
            spun_bucket: 4,
            lock_hash: 9,
        };
        assert_eq!(
            decode(SPIN_OFFSET, &ok.encode().to_le_bytes(), 3),
            Ok(Command::Spin(ok))
        );
        assert_eq!(
            decode(SPIN_OFFSET, &ok.encode().to_le_bytes(), 2),
            Err(Reject::NoSuchVcpu)
        );
        let unknown = SpinNotify {
            waiting_for: None,
            next_owner: false,
            spun_bucket: 31,
            lock_hash: 9,
        };
        assert_eq!(
            decode(SPIN_OFFSET, &unknown.encode().to_le_bytes(), 1),
            Ok(Command::Spin(unknown))
        );
    }

    #[test]
    fn wait_checks_the_waited_for_vcpu_and_width() {
        let n = SpinNotify {
            waiting_for: Some(1),
            next_owner: false,
            spun_bucket: 3,
            lock_hash: 0x55,
        };
        let bytes = n.encode().to_le_bytes();
        assert_eq!(decode(WAIT_OFFSET, &bytes, 2), Ok(Command::Wait(n)));
        assert_eq!(decode(WAIT_OFFSET, &bytes, 1), Err(Reject::NoSuchVcpu));
        assert_eq!(decode(WAIT_OFFSET, &bytes[..2], 2), Err(Reject::WrongWidth));
        // "Unknown" is a valid wait: the host waits without a hint.
        let unknown = SpinNotify {
            waiting_for: None,
            ..n
        };
        assert_eq!(
            decode(WAIT_OFFSET, &unknown.encode().to_le_bytes(), 1),
            Ok(Command::Wait(unknown))
        );
    }

    #[test]
    fn shared_page_passes_the_pfn() {
        assert_eq!(
            decode(SHARED_PAGE_OFFSET, &0x1234u32.to_le_bytes(), 1),
            Ok(Command::SharedPage { pfn: 0x1234 })
        );
    }

    #[test]
    fn reject_indexes_match_all() {
        for (i, r) in Reject::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert!(!r.name().is_empty());
        }
    }
}
