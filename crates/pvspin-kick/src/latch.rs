//! The per-vCPU wake latch of the userspace kick path.
//!
//! Without an in-kernel irqchip a guest `HLT` exits to the VMM (`KVM_EXIT_HLT`), and the vCPU
//! thread must wait there until the vCPU is kicked. [`WakeLatch`] gives that wait KVM's
//! `pv_unhalted` semantics:
//!
//! - a kick that arrives while the thread is parked wakes it ([`ParkOutcome::Kicked`]);
//! - a kick that arrives before the park (even before the guest's `HLT` exit) is remembered,
//!   and the next park returns at once ([`ParkOutcome::KickedBeforePark`]);
//! - kicks do not accumulate: one remembered kick, consumed by one park;
//! - [`WakeLatch::interrupt`] (the VMM wants the thread back, e.g. to pause) and
//!   [`WakeLatch::shutdown`] (the VMM stops; every later park returns at once) release a
//!   parked thread without a kick.
//!
//! The state is a mutex-protected record with a condition variable; a kick takes the mutex,
//! so "check, then sleep" in [`WakeLatch::park`] cannot miss it. An atomic mirror of the
//! pending flag lets the optional bounded spin before parking poll without the mutex. The
//! protocol is model-checked with loom (`RUSTFLAGS="--cfg loom" cargo test -p pvspin-kick
//! --release --lib loom`).

use crate::sync::{AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
#[cfg(not(loom))]
use std::time::{Duration, Instant};

/// What a [`WakeLatch::kick`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KickResult {
    /// The target was parked and has been woken.
    WokeParked,
    /// The target was not parked; the kick is remembered for its next park.
    Latched,
    /// A kick was already pending; the two coalesce into one.
    AlreadyPending,
}

/// Why [`WakeLatch::park`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParkOutcome {
    /// A kick was pending on entry or arrived during the bounded spin; the thread never slept.
    KickedBeforePark,
    /// A kick woke the sleeping thread.
    Kicked,
    /// The timeout passed without a kick. Resuming the guest is still correct: `pv_wait`
    /// tolerates spurious wake-ups.
    TimedOut,
    /// [`WakeLatch::interrupt`] released the thread; no kick was consumed.
    Interrupted,
    /// [`WakeLatch::shutdown`] was called; the VMM is stopping.
    Shutdown,
}

impl ParkOutcome {
    /// Whether a kick was consumed.
    pub fn kicked(self) -> bool {
        matches!(self, ParkOutcome::KickedBeforePark | ParkOutcome::Kicked)
    }
}

/// How long to spin and sleep in [`WakeLatch::park`].
#[cfg(not(loom))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkPolicy {
    /// Bounded spin on the pending flag before sleeping (zero: sleep at once). Trades host CPU
    /// for wake-up latency, like KVM's halt polling.
    pub spin: Duration,
    /// Longest sleep; `None` sleeps until a kick, an interrupt or shutdown.
    pub timeout: Option<Duration>,
}

#[derive(Debug, Default)]
struct State {
    pending: bool,
    parked: bool,
    interrupt: bool,
    shutdown: bool,
}

/// One vCPU's wake latch. See the module docs.
#[derive(Debug, Default)]
pub struct WakeLatch {
    state: Mutex<State>,
    cv: Condvar,
    /// Mirror of `state.pending`, only for the lock-free spin; the mutex-protected flag is the
    /// truth.
    pending_hint: AtomicBool,
}

impl WakeLatch {
    /// A latch with no kick pending.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while holding it; the state is
        // four booleans and always consistent, so carry on rather than propagate the panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kicks: wakes the parked thread, or remembers the kick for its next park.
    pub fn kick(&self) -> KickResult {
        let mut s = self.lock();
        let result = if s.pending {
            KickResult::AlreadyPending
        } else if s.parked {
            KickResult::WokeParked
        } else {
            KickResult::Latched
        };
        s.pending = true;
        self.pending_hint.store(true, Ordering::Release);
        drop(s);
        if result == KickResult::WokeParked {
            self.cv.notify_all();
        }
        result
    }

    /// Consumes a pending kick without blocking; `true` if there was one.
    pub fn try_take(&self) -> bool {
        let mut s = self.lock();
        Self::take(&mut s, &self.pending_hint)
    }

    /// Whether a kick is pending (not consumed).
    pub fn is_pending(&self) -> bool {
        self.lock().pending
    }

    /// Whether a thread is parked right now.
    pub fn is_parked(&self) -> bool {
        self.lock().parked
    }

    /// Releases the parked thread (or the next park) without a kick.
    pub fn interrupt(&self) {
        let mut s = self.lock();
        s.interrupt = true;
        drop(s);
        self.cv.notify_all();
    }

    /// Releases the parked thread, and makes every later park return
    /// [`ParkOutcome::Shutdown`] at once.
    pub fn shutdown(&self) {
        let mut s = self.lock();
        s.shutdown = true;
        drop(s);
        self.cv.notify_all();
    }

    fn take(s: &mut State, hint: &AtomicBool) -> bool {
        let had = s.pending;
        s.pending = false;
        hint.store(false, Ordering::Relaxed);
        had
    }

    /// Outcome for a thread that holds the lock and is about to sleep or has just woken, or
    /// `None` to keep sleeping.
    fn ready(s: &mut State, hint: &AtomicBool, slept: bool) -> Option<ParkOutcome> {
        if s.shutdown {
            return Some(ParkOutcome::Shutdown);
        }
        if Self::take(s, hint) {
            return Some(if slept {
                ParkOutcome::Kicked
            } else {
                ParkOutcome::KickedBeforePark
            });
        }
        if s.interrupt {
            s.interrupt = false;
            return Some(ParkOutcome::Interrupted);
        }
        None
    }

    /// Parks until a kick, an interrupt, shutdown or the policy's timeout; consumes the kick.
    /// Never spins longer than `policy.spin`.
    #[cfg(not(loom))]
    pub fn park(&self, policy: &ParkPolicy) -> ParkOutcome {
        if !policy.spin.is_zero() {
            let start = Instant::now();
            while start.elapsed() < policy.spin {
                if self.pending_hint.load(Ordering::Acquire) {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let deadline = policy.timeout.and_then(|t| Instant::now().checked_add(t));
        let mut s = self.lock();
        if let Some(o) = Self::ready(&mut s, &self.pending_hint, false) {
            return o;
        }
        s.parked = true;
        let outcome = loop {
            s = match deadline {
                None => self.cv.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break ParkOutcome::TimedOut;
                    }
                    self.cv
                        .wait_timeout(s, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            if let Some(o) = Self::ready(&mut s, &self.pending_hint, true) {
                break o;
            }
        };
        s.parked = false;
        outcome
    }

    /// Parks until a kick, an interrupt or shutdown (the loom build has no timeouts).
    #[cfg(loom)]
    pub fn park(&self) -> ParkOutcome {
        let mut s = self.lock();
        if let Some(o) = Self::ready(&mut s, &self.pending_hint, false) {
            return o;
        }
        s.parked = true;
        let outcome = loop {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            if let Some(o) = Self::ready(&mut s, &self.pending_hint, true) {
                break o;
            }
        };
        s.parked = false;
        outcome
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    const FOREVER: ParkPolicy = ParkPolicy {
        spin: Duration::ZERO,
        timeout: None,
    };
    const BOUNDED: ParkPolicy = ParkPolicy {
        spin: Duration::ZERO,
        timeout: Some(Duration::from_secs(10)),
    };

    #[test]
    fn kick_before_park_is_remembered_once() {
        let l = WakeLatch::new();
        assert_eq!(l.kick(), KickResult::Latched);
        assert_eq!(l.kick(), KickResult::AlreadyPending);
        assert!(l.is_pending());
        assert_eq!(l.park(&BOUNDED), ParkOutcome::KickedBeforePark);
        assert!(!l.is_pending());
        // Coalesced: the second park has nothing to consume.
        let short = ParkPolicy {
            spin: Duration::ZERO,
            timeout: Some(Duration::from_millis(20)),
        };
        assert_eq!(l.park(&short), ParkOutcome::TimedOut);
    }

    #[test]
    fn kick_during_park_wakes() {
        let l = Arc::new(WakeLatch::new());
        let p = {
            let l = l.clone();
            thread::spawn(move || l.park(&BOUNDED))
        };
        // Wait (bounded) until the thread sleeps, so this really is a kick during the park.
        let start = Instant::now();
        while !l.is_parked() && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(1));
        }
        assert!(l.is_parked());
        assert_eq!(l.kick(), KickResult::WokeParked);
        assert_eq!(p.join().unwrap(), ParkOutcome::Kicked);
        assert!(!l.is_pending());
    }

    #[test]
    fn spin_sees_a_kick_without_sleeping() {
        let l = Arc::new(WakeLatch::new());
        let k = {
            let l = l.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(5));
                l.kick()
            })
        };
        let policy = ParkPolicy {
            spin: Duration::from_secs(5),
            timeout: Some(Duration::from_secs(10)),
        };
        let start = Instant::now();
        let o = l.park(&policy);
        assert!(o.kicked(), "{o:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
        k.join().unwrap();
    }

    #[test]
    fn spin_is_bounded() {
        let l = WakeLatch::new();
        let policy = ParkPolicy {
            spin: Duration::from_millis(10),
            timeout: Some(Duration::from_millis(10)),
        };
        let start = Instant::now();
        assert_eq!(l.park(&policy), ParkOutcome::TimedOut);
        assert!(start.elapsed() >= Duration::from_millis(10));
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn interrupt_and_shutdown_release_without_a_kick() {
        let l = Arc::new(WakeLatch::new());
        l.interrupt();
        assert_eq!(l.park(&BOUNDED), ParkOutcome::Interrupted);
        let p = {
            let l = l.clone();
            thread::spawn(move || (l.park(&FOREVER), l.park(&FOREVER)))
        };
        let start = Instant::now();
        while !l.is_parked() && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(1));
        }
        l.shutdown();
        assert_eq!(
            p.join().unwrap(),
            (ParkOutcome::Shutdown, ParkOutcome::Shutdown)
        );
        assert!(!l.is_pending());
    }

    #[test]
    fn many_rounds_lose_no_kick() {
        // Ping-pong: each round the kicker kicks once and waits for the parker to consume it.
        // A lost wake-up shows up as a park that times out.
        let l = Arc::new(WakeLatch::new());
        let ack = Arc::new(WakeLatch::new());
        let rounds = 2000;
        let parker = {
            let (l, ack) = (l.clone(), ack.clone());
            thread::spawn(move || {
                let mut timeouts = 0;
                for _ in 0..rounds {
                    if !l.park(&BOUNDED).kicked() {
                        timeouts += 1;
                    }
                    ack.kick();
                }
                timeouts
            })
        };
        for _ in 0..rounds {
            l.kick();
            assert!(ack.park(&BOUNDED).kicked());
        }
        assert_eq!(parker.join().unwrap(), 0);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Model checks of the latch protocol. Run with
    //! `RUSTFLAGS="--cfg loom" cargo test -p pvspin-kick --release --lib loom`.
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// A kick racing with a park: whichever runs first, the park returns having consumed the
    /// kick (a lost wake-up would leave the parker asleep forever, which loom reports as a
    /// deadlock), and nothing stays pending.
    #[test]
    fn loom_kick_races_park() {
        loom::model(|| {
            let l = Arc::new(WakeLatch::new());
            let k = {
                let l = l.clone();
                thread::spawn(move || l.kick())
            };
            let o = l.park();
            let r = k.join().unwrap();
            assert!(o.kicked(), "{o:?}");
            assert_ne!(r, KickResult::AlreadyPending);
            // The kicker's view and the parker's agree on the order.
            match o {
                ParkOutcome::KickedBeforePark => assert_eq!(r, KickResult::Latched),
                ParkOutcome::Kicked => assert_eq!(r, KickResult::WokeParked),
                _ => unreachable!(),
            }
            assert!(!l.is_pending());
        });
    }

    /// Kicks go only to their target: with two latches, a parker on latch 0 is woken by the
    /// kick to 0, and the kick to 1 stays pending on latch 1 only.
    #[test]
    fn loom_no_misdelivery() {
        loom::model(|| {
            let a = Arc::new(WakeLatch::new());
            let b = Arc::new(WakeLatch::new());
            let k = {
                let (a, b) = (a.clone(), b.clone());
                thread::spawn(move || {
                    b.kick();
                    a.kick();
                })
            };
            assert!(a.park().kicked());
            k.join().unwrap();
            assert!(!a.is_pending());
            assert!(b.is_pending());
            assert!(b.try_take());
            assert!(!b.try_take());
        });
    }

    /// Two concurrent kicks and two parks in sequence: the first park consumes a kick; the
    /// second park must be released by the second kick unless both coalesced before the first
    /// park, in which case exactly one was `AlreadyPending`.
    #[test]
    fn loom_two_kicks_coalesce_or_wake_twice() {
        loom::model(|| {
            let l = Arc::new(WakeLatch::new());
            let k1 = {
                let l = l.clone();
                thread::spawn(move || l.kick())
            };
            let k2 = {
                let l = l.clone();
                thread::spawn(move || l.kick())
            };
            assert!(l.park().kicked());
            let r1 = k1.join().unwrap();
            let r2 = k2.join().unwrap();
            let coalesced = [r1, r2]
                .iter()
                .filter(|r| **r == KickResult::AlreadyPending)
                .count();
            if coalesced == 0 {
                // Both kicks were distinct wake-ups: one was consumed, one is pending.
                assert!(l.try_take());
            } else {
                assert_eq!(coalesced, 1);
                assert!(!l.is_pending());
            }
        });
    }

    /// Shutdown releases a parker that no kick will ever wake.
    #[test]
    fn loom_shutdown_releases_parker() {
        loom::model(|| {
            let l = Arc::new(WakeLatch::new());
            let s = {
                let l = l.clone();
                thread::spawn(move || l.shutdown())
            };
            assert_eq!(l.park(), ParkOutcome::Shutdown);
            s.join().unwrap();
            assert_eq!(l.park(), ParkOutcome::Shutdown);
        });
    }

    /// An interrupt racing with a kick: the park returns (never a lost wake-up), and the kick is
    /// either consumed or still pending, never dropped.
    #[test]
    fn loom_interrupt_never_drops_a_kick() {
        loom::model(|| {
            let l = Arc::new(WakeLatch::new());
            let k = {
                let l = l.clone();
                thread::spawn(move || {
                    l.kick();
                })
            };
            let i = {
                let l = l.clone();
                thread::spawn(move || l.interrupt())
            };
            let o = l.park();
            k.join().unwrap();
            i.join().unwrap();
            match o {
                ParkOutcome::Interrupted => assert!(l.try_take()),
                ParkOutcome::Kicked | ParkOutcome::KickedBeforePark => assert!(!l.is_pending()),
                other => panic!("unexpected {other:?}"),
            }
        });
    }

    /// The WAIT command's path (ABI 0.3): the waiter checks its condition, then parks on the
    /// same latch as a halt; it re-checks and parks again after every return that did not
    /// find the condition true (a timeout of the bounded park, which is the same event as the
    /// VMM's interrupt from the waiter's side, or a kick meant for an earlier wait). The
    /// kicker makes the condition true, then kicks. Whatever the interleaving, including the
    /// interrupt landing before, during or after the park, the waiter ends with the condition
    /// true: no lost wake-up (loom reports a waiter asleep forever as a deadlock).
    #[test]
    fn loom_wait_loop_with_timeout_or_interrupt_never_loses_the_kick() {
        use loom::sync::atomic::AtomicBool;
        loom::model(|| {
            let l = Arc::new(WakeLatch::new());
            let cond = Arc::new(AtomicBool::new(false));
            let k = {
                let (l, cond) = (l.clone(), cond.clone());
                thread::spawn(move || {
                    cond.store(true, Ordering::SeqCst);
                    l.kick();
                })
            };
            let i = {
                let l = l.clone();
                thread::spawn(move || l.interrupt())
            };
            let mut parks = 0;
            while !cond.load(Ordering::SeqCst) {
                let o = l.park();
                assert_ne!(o, ParkOutcome::Shutdown);
                parks += 1;
                assert!(parks <= 2, "more parks than kicks and interrupts");
            }
            k.join().unwrap();
            i.join().unwrap();
        });
    }
}
