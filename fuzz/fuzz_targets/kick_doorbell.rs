//! Fuzzes the kick doorbell: arbitrary sequences of port accesses (any port near the doorbell,
//! any width, any value: KICK, SPIN, SHARED_PAGE, WAIT) and latch operations (halts and WAIT
//! parks) against a userspace-path `KickDevice`, checked against an independent model. Invariants: only valid targets are latched, nothing else is
//! ever woken, every access is counted exactly once, and nothing blocks (the target only parks
//! when the model says a kick is pending or an interrupt was posted, so every park returns at
//! once).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvspin_abi::cpuid::{FEATURE_SHARED_PAGE, FEATURE_SPIN_NOTIFY, FEATURE_WAIT};
use pvspin_abi::doorbell::{PORT_COUNT, SPIN_OFFSET, SPIN_WAITING_FOR_UNKNOWN};
use pvspin_kick::ratelimit::ManualClock;
use pvspin_kick::{
    Command, Delivery, Handled, KickConfig, KickDevice, KickResult, ParkOutcome, PioOutcome, Reject,
};

const BASE: u16 = 0x0a40;

/// The model's verdict on a write, derived from the ABI text, not from the decoder.
fn expected_write(
    offset: u16,
    width: usize,
    value: u32,
    nr: u32,
    extra: u32,
) -> Result<Option<u32>, Reject> {
    if !matches!(offset, 0 | 4 | 8 | 12) {
        return Err(Reject::UnusedOffset);
    }
    if width != 4 {
        return Err(Reject::WrongWidth);
    }
    match offset {
        0 if value < nr => Ok(Some(value)),
        0 => Err(Reject::NoSuchVcpu),
        4 | 12 => {
            // Bits 12..0: the vCPU waited for (SPIN since 0.2, WAIT since 0.3).
            let waiting_for = value & 0x1fff;
            let feature = if offset == 4 {
                FEATURE_SPIN_NOTIFY
            } else {
                FEATURE_WAIT
            };
            // A command that is off is "not enabled" whatever it names (ABI: commands whose
            // feature bit is clear are ignored).
            if extra & feature == 0 {
                Err(Reject::NotEnabled)
            } else if waiting_for != u32::from(SPIN_WAITING_FOR_UNKNOWN) && waiting_for >= nr {
                Err(Reject::NoSuchVcpu)
            } else {
                Ok(None)
            }
        }
        _ if extra & FEATURE_SHARED_PAGE == 0 => Err(Reject::NotEnabled),
        _ => Ok(None),
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    // Every vCPU count the device accepts (1..=MAX_VCPUS); one above is refused by rule.
    let nr = 1 + u32::from(u16::from_le_bytes([data[0], data[1]])) % (pvspin_kick::MAX_VCPUS + 1);
    if nr > pvspin_kick::MAX_VCPUS {
        let refused = KickDevice::userspace_with_clock(
            KickConfig {
                port: BASE,
                nr_vcpus: nr,
                ..KickConfig::default()
            },
            Box::new(ManualClock::new(0)),
        );
        assert!(refused.is_err(), "more than MAX_VCPUS vCPUs accepted");
        return;
    }
    let extra = u32::from(data[2]) & (FEATURE_SPIN_NOTIFY | FEATURE_SHARED_PAGE | FEATURE_WAIT);
    let dev = KickDevice::userspace_with_clock(
        KickConfig {
            port: BASE,
            nr_vcpus: nr,
            extra_commands: extra,
            ..KickConfig::default()
        },
        Box::new(ManualClock::new(0)),
    )
    .expect("valid config");
    let n = usize::try_from(nr).unwrap();
    let mut pending = vec![false; n];
    let mut accesses = 0u64;
    let mut rejected = [0u64; Reject::COUNT];
    let mut kicks = 0u64;
    let mut forwarded = 0u64;

    for op in data[3..].chunks_exact(7) {
        // A port from 8 below to 8 above the doorbell range.
        let port = BASE
            .wrapping_sub(8)
            .wrapping_add(u16::from(op[1]) % (PORT_COUNT + 16));
        let width = usize::from(op[2] % 9);
        let value = u32::from_le_bytes([op[3], op[4], op[5], op[6]]);
        let bytes = [op[3], op[4], op[5], op[6], 0, 0, 0, 0, 0];
        let vcpu = u32::from(op[1]) % (nr + 2);
        let in_range = port.wrapping_sub(BASE) < PORT_COUNT && port >= BASE;
        match op[0] % 5 {
            0 => {
                let got = dev.handle_pio_write(port, &bytes[..width]);
                if !in_range {
                    assert_eq!(got, PioOutcome::NotMine);
                    continue;
                }
                accesses += 1;
                match expected_write(port - BASE, width, value, nr, extra) {
                    Ok(Some(t)) => {
                        kicks += 1;
                        let slot = &mut pending[usize::try_from(t).unwrap()];
                        let want = if *slot {
                            KickResult::AlreadyPending
                        } else {
                            KickResult::Latched
                        };
                        *slot = true;
                        assert_eq!(
                            got,
                            PioOutcome::Handled(Handled::Kicked {
                                target: t,
                                delivery: Delivery::Latch(want)
                            })
                        );
                    }
                    Ok(None) => {
                        forwarded += 1;
                        let is_wait = port - BASE == 12;
                        assert!(
                            matches!(
                                got,
                                PioOutcome::Handled(Handled::Forward(Command::Wait(n)))
                                    if is_wait && n.encode() == value
                            ) || (!is_wait
                                && matches!(got, PioOutcome::Handled(Handled::Forward(_)))),
                            "{got:?}"
                        );
                    }
                    Err(r) => {
                        rejected[r.index()] += 1;
                        assert_eq!(got, PioOutcome::Handled(Handled::Rejected(r)));
                    }
                }
            }
            1 => {
                let mut buf = [0u8; 8];
                let got = dev.handle_pio_read(port, &mut buf[..width.min(8)]);
                if in_range {
                    accesses += 1;
                    if port - BASE == SPIN_OFFSET && width == 4 && extra & FEATURE_SPIN_NOTIFY != 0
                    {
                        forwarded += 1;
                        assert_eq!(
                            got,
                            PioOutcome::Handled(Handled::Forward(Command::ReadSpinWindow))
                        );
                    } else {
                        rejected[Reject::Read.index()] += 1;
                        assert_eq!(got, PioOutcome::Handled(Handled::Rejected(Reject::Read)));
                    }
                    assert!(buf[..width.min(8)].iter().all(|b| *b == 0xff));
                } else {
                    assert_eq!(got, PioOutcome::NotMine);
                }
            }
            2 => match dev.try_take_kick(vcpu) {
                Ok(had) => {
                    let i = usize::try_from(vcpu).unwrap();
                    assert_eq!(had, pending[i]);
                    pending[i] = false;
                }
                Err(_) => assert!(vcpu >= nr),
            },
            3 => {
                // Park only when it cannot block.
                if vcpu < nr {
                    let i = usize::try_from(vcpu).unwrap();
                    if !pending[i] {
                        dev.interrupt(vcpu);
                    }
                    // A halt and a WAIT park on the same latch (the WAIT bounded).
                    let got = if op[2] % 2 == 0 {
                        dev.handle_hlt(vcpu).unwrap()
                    } else {
                        dev.handle_wait(vcpu, Some(std::time::Duration::from_secs(5)))
                            .unwrap()
                    };
                    if pending[i] {
                        assert_eq!(got, ParkOutcome::KickedBeforePark);
                        pending[i] = false;
                    } else {
                        assert_eq!(got, ParkOutcome::Interrupted);
                    }
                } else {
                    assert!(dev.handle_hlt(vcpu).is_err());
                    assert!(dev.handle_wait(vcpu, None).is_err());
                }
            }
            _ => {
                // The model and the device agree on every latch.
                for (i, p) in pending.iter().enumerate() {
                    assert_eq!(dev.kick_pending(u32::try_from(i).unwrap()).unwrap(), *p);
                }
            }
        }
    }
    let s = dev.stats();
    assert_eq!(s.accesses, accesses);
    assert_eq!(s.kicks, kicks);
    assert_eq!(s.forwarded, forwarded);
    assert_eq!(s.rejected, rejected);
    assert_eq!(s.kicks + s.forwarded + s.rejected_total(), s.accesses);
    assert_eq!(s.latched + s.coalesced + s.woke_parked, s.kicks);
    assert_eq!(s.woke_parked, 0);
});
