//! The run-slot policy: at most S of a VM's vCPUs run guest code at once; the others wait on the VMM's
//! own futex-style waits instead of spinning in the host's run queue.
//!
//! The host scheduler time-slices a VM's vCPU threads among themselves when the VM has more
//! vCPUs than CPUs, and it cannot tell the lock holder from its spinners. Run slots make that
//! choice in the VMM, where the lock state is known: S slots (the CPUs the VM is entitled to:
//! [`entitled_cpus`](crate::quota::entitled_cpus)), handed out by this policy:
//!
//! 1. a vCPU just kicked or named as the one others wait for ([`RunSlots::prioritize`]) goes
//!    to the head of the queue;
//! 2. a vCPU whose quantum is over keeps its slot for at most one extension of
//!    `cs_extension` while its guest says it is inside a critical section
//!    ([`SlotSignals::in_critical_section`]: the hint page's `CS_DEPTH`);
//! 3. otherwise round robin with a quantum: a waiter whose turn is due asks the overdue holder
//!    to leave ([`SlotSignals::preempt`]: the VMM's interrupter forces it out of `KVM_RUN`),
//!    and the holder hands its slot over at its next exit ([`RunSlots::exited`]).
//!
//! A vCPU that blocks anyway (a halt or a WAIT parked in the VMM) gives its slot up
//! ([`RunSlots::leave`]). Slots pass directly from the leaving vCPU to the head of the queue,
//! so exactly one waiter wakes per hand-over.
//!
//! **The bound.** A waiter is overtaken by prioritized vCPUs at most `vcpus` times (then it
//! ages, and later priorities queue behind it), so it has at most `2 * vcpus - 1` vCPUs ahead
//! of it; each slot passes at least once per `quantum + cs_extension + preempt_latency`, where
//! `preempt_latency` is how long a forced exit takes (the interrupter's signal, a host
//! reschedule). So a vCPU waits at most
//! `ceil((2 * vcpus - 1) / slots) * (quantum + cs_extension + preempt_latency)`
//! ([`SlotConfig::wait_bound`]); the tests check it with a controlled clock.
//!
//! **Halts inside KVM** (in-kernel LAPIC: the in-kernel and signal-msi kick paths, stock
//! guests). A halt there never leaves `KVM_RUN` and a kick or interrupt wakes the vCPU there,
//! so the halt watcher ([`crate::watch`]) reports what KVM's `blocking` statistic shows
//! ([`RunSlots::halt_changed`]):
//!
//! * a holder that blocks in KVM while someone waits lends its slot to the head of the queue;
//! * a vCPU that KVM woke while its slot was lent runs at once, without asking: it is given a
//!   slot back at once (kicked vCPUs go first, so it never waits), and one holder too many then
//!   holds a slot: a holder halted in KVM lends its slot, or else the holder that has run
//!   longest (outside a critical section when one is) is asked to leave and does at its next
//!   exit. If a waiter has aged, the woken vCPU is asked to leave instead and queues first.
//!
//! So more vCPUs than slots run guest code only between a wake-up inside KVM and the exit of
//! the holder asked to leave: at most `halt_watch_interval` (the watcher has not polled yet)
//! plus `preempt_latency` (the forced exit) per woken vCPU, if the watcher and the forced exit
//! get a CPU in that time (on a host with spare CPU they do; `SlotStats::max_over_ns` reports
//! what happened, wake-ups that follow each other back to back included). Every other bound
//! above is unchanged: a woken vCPU overtakes waiters as a kicked one does.
//!
//! Without guest help there is no `CS_DEPTH`: the quantum alone keeps a holder running, and the
//! steal-time `preempted` byte ([`crate::steal`]) tells a stock guest's `vcpu_is_preempted`
//! which vCPUs wait for a slot.
//!
//! Pure policy over two small traits ([`SlotSignals`] for the guest's state and forced exits,
//! [`SlotClock`] for time); the waits are `Mutex` + `Condvar`, so a loom model checks the
//! hand-over (`RUSTFLAGS="--cfg loom" cargo test -p pvspin-slots --release --lib loom`).

use std::collections::VecDeque;
use std::time::Duration;

use crate::sync::{AtomicU64, Condvar, LockStats, Ordering, StatGuard, StatMutex};

/// Errors in the slot configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq, displaydoc::Display)]
pub enum SlotError {
    /// rule: run slots must be between 1 and the vCPU count ({vcpus}), got {slots}
    Slots {
        /// Slots asked for.
        slots: usize,
        /// vCPUs.
        vcpus: usize,
    },
    /// rule: the run-slot quantum must be between 100 us and 1 s, got {0:?}
    Quantum(Duration),
    /// rule: the halt-watch interval must be between 10 us and the quantum ({quantum:?}), got
    /// {interval:?}
    HaltWatchInterval {
        /// The interval.
        interval: Duration,
        /// The quantum.
        quantum: Duration,
    },
    /// rule: the critical-section extension ({extension:?}) must not exceed the quantum
    /// ({quantum:?})
    Extension {
        /// The extension.
        extension: Duration,
        /// The quantum.
        quantum: Duration,
    },
}

/// The halt watcher's default polling interval (see [`SlotConfig::halt_watch_interval`]).
pub const DEFAULT_HALT_WATCH_INTERVAL: Duration = Duration::from_micros(100);

/// How often a waiter behind the head of the queue re-checks without being woken: a safety
/// net only (a hand-over, a new head and the shutdown wake it), so that waiters do not take
/// the slots' mutex on timers in proportion to their number.
const BEHIND_HEAD_RECHECK: Duration = Duration::from_millis(100);

/// How run slots are handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotConfig {
    /// vCPUs that may run guest code at once.
    pub slots: usize,
    /// How long a vCPU keeps its slot while others wait.
    pub quantum: Duration,
    /// How much longer it keeps it, once per quantum, while inside a critical section.
    pub cs_extension: Duration,
    /// The forced-exit latency the wait bound assumes ([`SlotConfig::wait_bound`]), and how
    /// often a waiter repeats a preemption request that has not taken effect.
    pub preempt_latency: Duration,
    /// A prioritized (kicked or named) vCPU at the head of the queue does not wait for a
    /// quantum to end: it asks a holder that is outside any critical section and has run at
    /// least this long to leave now. Each waiter is overtaken a bounded number of times, so
    /// this does not change the wait bound.
    pub priority_preempt_after: Duration,
    /// How often the halt watcher ([`crate::watch`]) reads whether the watched vCPUs block
    /// inside KVM, while someone waits or a slot is lent: the most a halted holder keeps a slot
    /// a waiter could use, and the most a vCPU that KVM woke runs before it is counted.
    pub halt_watch_interval: Duration,
}

impl SlotConfig {
    /// `slots` slots with an 8 ms quantum, a 1 ms extension, a 1 ms preemption latency and
    /// priority preemption after 50 us. The quantum, measured side by side
    /// (`docs/benchmarks.md`, "Run slots, confinement and VMs side by side"): 2 ms cost
    /// 1.5-2x against 8 ms with 4 and 6 vCPUs at
    /// native speed and in emulated kernel mode (more forced exits, each a round trip through
    /// the VMM's signal), 20 ms gained nothing more and doubles the wait bound.
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            quantum: Duration::from_millis(8),
            cs_extension: Duration::from_millis(1),
            preempt_latency: Duration::from_millis(1),
            priority_preempt_after: Duration::from_micros(50),
            halt_watch_interval: DEFAULT_HALT_WATCH_INTERVAL,
        }
    }

    /// Checks the rules for `vcpus` vCPUs.
    pub fn validate(&self, vcpus: usize) -> Result<(), SlotError> {
        if self.slots == 0 || self.slots > vcpus {
            return Err(SlotError::Slots {
                slots: self.slots,
                vcpus,
            });
        }
        if self.quantum < Duration::from_micros(100) || self.quantum > Duration::from_secs(1) {
            return Err(SlotError::Quantum(self.quantum));
        }
        if self.halt_watch_interval < Duration::from_micros(10)
            || self.halt_watch_interval > self.quantum
        {
            return Err(SlotError::HaltWatchInterval {
                interval: self.halt_watch_interval,
                quantum: self.quantum,
            });
        }
        if self.cs_extension > self.quantum {
            return Err(SlotError::Extension {
                extension: self.cs_extension,
                quantum: self.quantum,
            });
        }
        Ok(())
    }

    /// The longest a vCPU waits for a slot with `vcpus` vCPUs (see the module docs).
    pub fn wait_bound(&self, vcpus: usize) -> Duration {
        let ahead = (2 * vcpus).saturating_sub(1) as u32;
        let rounds = ahead.div_ceil(self.slots.max(1) as u32);
        (self.quantum + self.cs_extension + self.preempt_latency) * rounds.max(1)
    }
}

/// What the policy asks about vCPUs, and how it forces one out of `KVM_RUN`.
pub trait SlotSignals: Send + Sync {
    /// Whether vCPU `v`'s guest says it is inside a critical section.
    fn in_critical_section(&self, v: usize) -> bool;
    /// Makes vCPU `v` leave `KVM_RUN` soon (it then calls [`RunSlots::exited`]). Called
    /// without the policy's lock held; must not block.
    fn preempt(&self, v: usize);
}

/// Monotonic time in nanoseconds.
pub trait SlotClock: Send + Sync {
    /// Now.
    fn now_ns(&self) -> u64;
}

/// The real clock.
#[derive(Debug)]
pub struct MonotonicSlotClock(std::time::Instant);

impl Default for MonotonicSlotClock {
    fn default() -> Self {
        Self(std::time::Instant::now())
    }
}

impl SlotClock for MonotonicSlotClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Told when a vCPU is granted a slot, for embedders that do not park vCPU threads on the
/// policy's condition variables (a simulator, an event loop): they learn here which waiter to
/// resume. Called with the policy's lock held: it must not call back into [`RunSlots`] and must
/// not block. The condition variables are notified as before, so a VMM needs none.
pub trait SlotWaker: Send + Sync {
    /// vCPU `v` now holds a slot (granted from the queue, by a hand-over, or taken back).
    fn granted(&self, v: usize);

    /// vCPU `v` is the queue's new head: it should ask again now (only the head waits on a
    /// timer, for the holders' quanta; the others wait to be granted or to become the head).
    fn new_head(&self, v: usize) {
        let _ = v;
    }
}

/// How [`RunSlots::enter`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnterOutcome {
    /// The vCPU holds a slot; `waited_ns` is how long it waited for it.
    Granted {
        /// Time spent waiting.
        waited_ns: u64,
    },
    /// The slots shut down: run without one (the VMM is stopping).
    Shutdown,
}

/// One step of [`RunSlots::enter`].
enum Step {
    Done(EnterOutcome),
    Preempt(usize),
    WaitNs(u64),
}

/// Counters, summed over the VM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStats {
    /// Slots granted (immediately or after a wait).
    pub grants: u64,
    /// Grants that had to wait.
    pub waits: u64,
    /// Grants to a vCPU that was prioritized (kicked or named) while it waited.
    pub prioritized_grants: u64,
    /// Preemption requests sent to overdue holders.
    pub preemptions: u64,
    /// Quantum extensions granted for critical sections.
    pub extensions: u64,
    /// Slots a kicker handed to the vCPU it kicked.
    pub hand_overs: u64,
    /// The longest wait seen, ns.
    pub max_wait_ns: u64,
    /// The most vCPUs that held slots at once: at most the slot count, but for vCPUs that KVM
    /// woke while their slot was lent ([`RunSlots::halt_changed`]), until a holder left.
    pub max_held: u64,
    /// Slots of vCPUs halted inside KVM lent to waiters ([`RunSlots::halt_changed`]).
    pub lends: u64,
    /// vCPUs that KVM woke while their slot was lent, given a slot back at once.
    pub reclaims: u64,
    /// The longest time more vCPUs held slots than there are slots, ns (the watcher's
    /// detection delay comes on top; the module docs state the bound).
    pub max_over_ns: u64,
}

#[derive(Debug)]
struct State {
    /// Per vCPU: when its current quantum began, if it holds a slot.
    granted_at: Vec<Option<u64>>,
    /// Per vCPU: its quantum was extended for a critical section.
    extended: Vec<bool>,
    /// Per vCPU: a preemption was requested at this time (0: none).
    preempt_sent: Vec<u64>,
    /// Per vCPU: prioritized while it waited (or before it asked).
    prioritized: Vec<bool>,
    /// Per vCPU: how often it was overtaken while waiting.
    overtaken: Vec<usize>,
    /// Per vCPU: when it joined the queue, while it is in it or granted from it.
    queued_since: Vec<Option<u64>>,
    /// Per vCPU: since when a slot is kept for it (a kicker handed its slot over before the
    /// kicked vCPU asked for one).
    reserved_for: Vec<Option<u64>>,
    /// Slots kept for kicked vCPUs: `held + reserved <= slots`.
    reserved: usize,
    held: usize,
    /// The vCPUs that hold a slot (those with `granted_at`), in no order: the decisions look
    /// at holders only, so their cost grows with the slots, not with the vCPUs.
    holders: Vec<usize>,
    queue: VecDeque<usize>,
    /// The head of the queue last woken to watch the holders' deadlines: only the head waits
    /// on a timer, the others sleep until granted, made head, or shut down.
    polling: Option<usize>,
    /// Per vCPU: halted inside KVM, as the halt watcher last saw it.
    halted: Vec<bool>,
    /// Per vCPU: halted inside KVM with its slot lent to another vCPU.
    lent: Vec<bool>,
    /// Since when more vCPUs hold slots than there are slots.
    over_since: Option<u64>,
    shutdown: bool,
}

impl State {
    fn queued(&self, v: usize) -> bool {
        self.queue.contains(&v)
    }

    /// Puts `v` in the queue: prioritized vCPUs go ahead of every waiter that has not aged.
    fn enqueue(&mut self, v: usize, limit: usize) {
        if self.queued(v) {
            return;
        }
        if self.prioritized[v] {
            let pos = self
                .queue
                .iter()
                .rposition(|&w| self.overtaken[w] >= limit || self.prioritized[w])
                .map_or(0, |p| p + 1);
            for &w in self.queue.iter().skip(pos) {
                self.overtaken[w] += 1;
            }
            self.queue.insert(pos, v);
        } else {
            self.queue.push_back(v);
        }
    }

    /// Whether a waiter has aged (been overtaken `limit` times): it must not be overtaken
    /// again.
    fn aged_waiter(&self, limit: usize) -> bool {
        self.queue.iter().any(|&w| self.overtaken[w] >= limit)
    }

    /// `v` holds no slot any more (its `granted_at` was just cleared).
    fn drop_holder(&mut self, v: usize) {
        if let Some(i) = self.holders.iter().position(|&h| h == v) {
            self.holders.swap_remove(i);
        }
    }

    /// Cancels the slot kept for `v`; returns whether there was one.
    fn cancel_reservation(&mut self, v: usize) -> bool {
        if self.reserved_for[v].take().is_some() {
            self.reserved -= 1;
            true
        } else {
            false
        }
    }

    /// The deadline of holder `h`'s quantum, with its extension if it was granted one.
    fn deadline(&self, h: usize, cfg: &SlotConfig) -> Option<u64> {
        let start = self.granted_at[h]?;
        let mut end = start.saturating_add(duration_ns(cfg.quantum));
        if self.extended[h] {
            end = end.saturating_add(duration_ns(cfg.cs_extension));
        }
        Some(end)
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The run slots of one VM. Every method is called from the vCPU's own thread except
/// [`prioritize`](Self::prioritize) and [`shutdown`](Self::shutdown), which any thread may
/// call.
pub struct RunSlots {
    cfg: SlotConfig,
    state: StatMutex<State>,
    wakeups: Vec<Condvar>,
    clock: Box<dyn SlotClock>,
    grants: AtomicU64,
    waits: AtomicU64,
    prioritized_grants: AtomicU64,
    preemptions: AtomicU64,
    extensions: AtomicU64,
    hand_overs: AtomicU64,
    max_wait_ns: AtomicU64,
    max_held: AtomicU64,
    lends: AtomicU64,
    reclaims: AtomicU64,
    max_over_ns: AtomicU64,
    /// Wakes the halt watcher when it has something to watch.
    watch: Condvar,
    /// Told of every grant, when set ([`RunSlots::with_waker`]).
    waker: Option<Box<dyn SlotWaker>>,
}

impl std::fmt::Debug for RunSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunSlots")
            .field("cfg", &self.cfg)
            .field("vcpus", &self.wakeups.len())
            .finish()
    }
}

impl RunSlots {
    /// Slots for `vcpus` vCPUs, on the real clock.
    pub fn new(vcpus: usize, cfg: SlotConfig) -> Result<Self, SlotError> {
        Self::with_clock(vcpus, cfg, Box::new(MonotonicSlotClock::default()))
    }

    /// Slots for `vcpus` vCPUs on `clock`.
    pub fn with_clock(
        vcpus: usize,
        cfg: SlotConfig,
        clock: Box<dyn SlotClock>,
    ) -> Result<Self, SlotError> {
        cfg.validate(vcpus)?;
        Ok(Self {
            cfg,
            state: StatMutex::new(State {
                granted_at: vec![None; vcpus],
                extended: vec![false; vcpus],
                preempt_sent: vec![0; vcpus],
                prioritized: vec![false; vcpus],
                overtaken: vec![0; vcpus],
                queued_since: vec![None; vcpus],
                reserved_for: vec![None; vcpus],
                reserved: 0,
                held: 0,
                holders: Vec::with_capacity(cfg.slots + 1),
                queue: VecDeque::with_capacity(vcpus),
                polling: None,
                halted: vec![false; vcpus],
                lent: vec![false; vcpus],
                over_since: None,
                shutdown: false,
            }),
            wakeups: (0..vcpus).map(|_| Condvar::new()).collect(),
            clock,
            grants: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            prioritized_grants: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            extensions: AtomicU64::new(0),
            hand_overs: AtomicU64::new(0),
            max_wait_ns: AtomicU64::new(0),
            max_held: AtomicU64::new(0),
            lends: AtomicU64::new(0),
            reclaims: AtomicU64::new(0),
            max_over_ns: AtomicU64::new(0),
            watch: Condvar::new(),
            waker: None,
        })
    }

    /// These slots, telling `waker` of every grant (see [`SlotWaker`]).
    pub fn with_waker(mut self, waker: Box<dyn SlotWaker>) -> Self {
        self.waker = Some(waker);
        self
    }

    /// The configuration.
    pub fn config(&self) -> SlotConfig {
        self.cfg
    }

    fn lock(&self) -> StatGuard<'_, State> {
        self.state.lock()
    }

    /// How the state mutex was used (counted with the `lock-stats` feature only; zero
    /// without it): what the benches' vCPU storm measures.
    pub fn lock_stats(&self) -> LockStats {
        self.state.stats()
    }

    /// Gives `v` a slot (the caller holds the lock and checked that one is free).
    fn grant(&self, st: &mut State, v: usize, now: u64) {
        if st.granted_at[v].replace(now).is_none() {
            st.holders.push(v);
        }
        st.extended[v] = false;
        st.preempt_sent[v] = 0;
        st.held += 1;
        if std::mem::take(&mut st.prioritized[v]) {
            self.prioritized_grants.fetch_add(1, Ordering::Relaxed);
        }
        st.overtaken[v] = 0;
        st.lent[v] = false;
        self.grants.fetch_add(1, Ordering::Relaxed);
        self.max_held.fetch_max(st.held as u64, Ordering::Relaxed);
        self.note_over(st, now);
        if let Some(waker) = &self.waker {
            waker.granted(v);
        }
    }

    /// Tracks how long more vCPUs hold slots than there are slots (only vCPUs that KVM woke
    /// while their slot was lent make that happen).
    fn note_over(&self, st: &mut State, now: u64) {
        let over = st.held + st.reserved > self.cfg.slots;
        match (over, st.over_since) {
            (true, None) => {
                st.over_since = Some(now);
                // A holder asked to leave may halt in KVM instead: the watcher must look.
                self.watch.notify_one();
            }
            (false, Some(since)) => {
                st.over_since = None;
                self.max_over_ns
                    .fetch_max(now.saturating_sub(since), Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// `v` gives its slot up; the head of the queue gets it and is woken.
    fn release(&self, st: &mut State, v: usize, now: u64) {
        if st.granted_at[v].take().is_none() {
            return;
        }
        st.drop_holder(v);
        st.held -= 1;
        st.preempt_sent[v] = 0;
        self.note_over(st, now);
        if st.held + st.reserved < self.cfg.slots {
            if let Some(w) = st.queue.pop_front() {
                self.grant(st, w, now);
                self.wakeups[w].notify_one();
            }
        }
        self.wake_new_head(st);
    }

    /// Only the queue's head waits on a timer (it asks overdue holders to leave); when the
    /// head changes, the new head is woken to take that over. The others sleep until granted
    /// (the hand-over wakes them), so waiters do not take the mutex on timers in proportion
    /// to their number.
    fn wake_new_head(&self, st: &mut State) {
        let head = st.queue.front().copied();
        if head != st.polling {
            st.polling = head;
            if let Some(h) = head {
                self.wakeups[h].notify_one();
                if let Some(waker) = &self.waker {
                    waker.new_head(h);
                }
            }
        }
    }

    /// vCPU `from` kicked `to` (the lock's next owner): `from` gives its slot to `to`, now if
    /// `to` waits for one, else kept for `to` for one preemption latency. Not when `to` holds
    /// a slot already or a waiter has aged (then `to` is only prioritized). Returns whether
    /// `from` gave its slot up (it waits in its next [`enter`](Self::enter)).
    pub fn hand_over(&self, from: usize, to: usize) -> bool {
        let now = self.clock.now_ns();
        let mut st = self.lock();
        let n = st.granted_at.len();
        if from >= n || to >= n || from == to || st.granted_at[to].is_some() {
            return false;
        }
        if st.granted_at[from].is_none() || st.aged_waiter(n) || st.reserved_for[to].is_some() {
            drop(st);
            self.prioritize(to);
            return false;
        }
        st.granted_at[from] = None;
        st.drop_holder(from);
        st.held -= 1;
        st.preempt_sent[from] = 0;
        self.hand_overs.fetch_add(1, Ordering::Relaxed);
        if st.lent[to] {
            // Halted inside KVM: the kick wakes it there, so it runs with the kicker's slot.
            self.grant(&mut st, to, now);
        } else if st.queued(to) {
            let ahead: Vec<usize> = st.queue.iter().copied().take_while(|&w| w != to).collect();
            for w in ahead {
                st.overtaken[w] += 1;
            }
            st.queue.retain(|&w| w != to);
            self.grant(&mut st, to, now);
            self.wakeups[to].notify_one();
        } else {
            st.reserved_for[to] = Some(now);
            st.reserved += 1;
        }
        self.wake_new_head(&mut st);
        true
    }

    /// Before `KVM_RUN`, on vCPU `v`'s thread: returns once `v` holds a slot (at once when it
    /// kept its slot or one is free), else waits, asking overdue holders to leave. Bounded by
    /// [`SlotConfig::wait_bound`] when preemptions take effect within `preempt_latency`.
    pub fn enter(&self, v: usize, signals: &dyn SlotSignals) -> EnterOutcome {
        let start = self.clock.now_ns();
        let mut st = self.lock();
        loop {
            match self.step(&mut st, v, start, signals) {
                Step::Done(outcome) => return outcome,
                Step::Preempt(h) => {
                    drop(st);
                    signals.preempt(h);
                    st = self.lock();
                }
                Step::WaitNs(ns) => st = self.wait(st, v, ns),
            }
        }
    }

    /// [`enter`](Self::enter) without blocking: `Some` when `v` holds a slot now (or the
    /// slots shut down), `None` when it is queued (asking an overdue holder to leave if one
    /// is due). `since_ns` is when `v` began to ask (the clock's time), for the wait it
    /// reports. For VMMs that poll, and for the policy's simulation tests.
    pub fn try_enter(
        &self,
        v: usize,
        since_ns: u64,
        signals: &dyn SlotSignals,
    ) -> Option<EnterOutcome> {
        self.poll_enter(v, since_ns, signals).ok()
    }

    /// [`try_enter`](Self::try_enter), saying when to ask again: `Err(ns)` when `v` is queued,
    /// where `ns` is how long [`enter`](Self::enter) would wait before its next look (a
    /// holder's quantum ends, or a preemption request is due again), unless a grant comes
    /// first. For event-driven embedders (a simulator) that cannot block.
    pub fn poll_enter(
        &self,
        v: usize,
        since_ns: u64,
        signals: &dyn SlotSignals,
    ) -> Result<EnterOutcome, u64> {
        let mut st = self.lock();
        loop {
            match self.step(&mut st, v, since_ns, signals) {
                Step::Done(outcome) => return Ok(outcome),
                Step::Preempt(h) => {
                    drop(st);
                    signals.preempt(h);
                    st = self.lock();
                }
                Step::WaitNs(ns) => return Err(ns),
            }
        }
    }

    /// The clock's time now (what [`try_enter`](Self::try_enter)'s `since_ns` is measured on).
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// One decision for `v`, which asks for a slot since `start`; wakes a new head of the
    /// queue.
    fn step(&self, st: &mut State, v: usize, start: u64, signals: &dyn SlotSignals) -> Step {
        let step = self.decide(st, v, start, signals);
        self.wake_new_head(st);
        step
    }

    fn decide(&self, st: &mut State, v: usize, start: u64, signals: &dyn SlotSignals) -> Step {
        let now = self.clock.now_ns();
        if v >= st.granted_at.len() {
            return Step::Done(EnterOutcome::Shutdown);
        }
        if st.granted_at[v].is_some() {
            let waited = now.saturating_sub(start);
            if st.queued_since[v].take().is_some() {
                self.waits.fetch_add(1, Ordering::Relaxed);
                self.max_wait_ns.fetch_max(waited, Ordering::Relaxed);
            }
            return Step::Done(EnterOutcome::Granted { waited_ns: waited });
        }
        if st.shutdown {
            st.queue.retain(|&w| w != v);
            st.queued_since[v] = None;
            st.cancel_reservation(v);
            return Step::Done(EnterOutcome::Shutdown);
        }
        st.halted[v] = false;
        if std::mem::take(&mut st.lent[v]) {
            // KVM woke it (a kick or an interrupt) and it left KVM_RUN before the watcher saw
            // it: it goes first, as a kicked vCPU.
            st.prioritized[v] = true;
        }
        if st.cancel_reservation(v) {
            // A kicker kept its slot for this vCPU.
            st.queue.retain(|&w| w != v);
            self.grant(st, v, now);
            return self.decide(st, v, start, signals);
        }
        // Slots kept for kicked vCPUs that did not come within a preemption latency go back.
        let latency = duration_ns(self.cfg.preempt_latency);
        if st.reserved > 0 {
            for w in 0..st.reserved_for.len() {
                if st.reserved_for[w].is_some_and(|t| now >= t.saturating_add(latency)) {
                    st.cancel_reservation(w);
                }
            }
        }
        if st.held + st.reserved < self.cfg.slots && st.queue.is_empty() {
            self.grant(st, v, now);
            return Step::Done(EnterOutcome::Granted { waited_ns: 0 });
        }
        if !st.queued(v) {
            let limit = st.granted_at.len();
            st.enqueue(v, limit);
            st.queued_since[v] = Some(start);
            self.watch.notify_one();
        }
        // A free slot with a queue: the head takes it (a wake-up can race a hand-over).
        if st.held + st.reserved < self.cfg.slots {
            if let Some(w) = st.queue.pop_front() {
                self.grant(st, w, now);
                if w != v {
                    self.wakeups[w].notify_one();
                }
                return self.decide(st, v, start, signals);
            }
        }
        if st.queue.front() != Some(&v) {
            // Behind the head: granted by a hand-over, or woken when it becomes the head.
            return Step::WaitNs(duration_ns(BEHIND_HEAD_RECHECK));
        }
        // A prioritized vCPU at the head: the holder that has run longest outside a critical
        // section leaves now, once it ran priority_preempt_after.
        if st.prioritized[v] {
            let min_run = duration_ns(self.cfg.priority_preempt_after);
            let candidate = st
                .holders
                .iter()
                .filter_map(|&h| st.granted_at[h].map(|g| (g, h)))
                .filter(|&(g, h)| {
                    st.preempt_sent[h] == 0
                        && now.saturating_sub(g) >= min_run
                        && !signals.in_critical_section(h)
                })
                .min();
            if let Some((_, h)) = candidate {
                st.preempt_sent[h] = now.max(1);
                self.preemptions.fetch_add(1, Ordering::Relaxed);
                return Step::Preempt(h);
            }
        }
        // The holder whose turn ended first: ask it to leave, again once per
        // preempt_latency while it has not.
        let mut wake_at = now.saturating_add(latency);
        let mut due = None;
        for &h in &st.holders {
            let Some(end) = st.deadline(h, &self.cfg) else {
                continue;
            };
            if end > now {
                wake_at = wake_at.min(end);
                continue;
            }
            let sent = st.preempt_sent[h];
            if sent == 0 || now >= sent.saturating_add(latency) {
                // The lowest-numbered one, whatever the holders' order.
                due = Some(due.map_or(h, |d: usize| d.min(h)));
            } else {
                wake_at = wake_at.min(sent.saturating_add(latency));
            }
        }
        if let Some(h) = due {
            st.preempt_sent[h] = now.max(1);
            self.preemptions.fetch_add(1, Ordering::Relaxed);
            return Step::Preempt(h);
        }
        Step::WaitNs(wake_at.saturating_sub(now))
    }

    /// Parks `v` until woken or `ns` passed (loom has no timeouts: the model checks the
    /// hand-over, which needs none).
    fn wait<'a>(&self, st: StatGuard<'a, State>, v: usize, ns: u64) -> StatGuard<'a, State> {
        st.wait(&self.wakeups[v], Duration::from_nanos(ns.max(1_000)))
    }

    /// After `KVM_RUN` returns, on vCPU `v`'s thread: when others wait and `v`'s quantum is
    /// over (or a preemption was asked), `v` gives its slot up, unless its guest is inside a
    /// critical section and this quantum was not extended yet. Returns whether `v` still
    /// holds a slot.
    pub fn exited(&self, v: usize, signals: &dyn SlotSignals) -> bool {
        let now = self.clock.now_ns();
        let mut st = self.lock();
        if let Some(h) = st.halted.get_mut(v) {
            // It left KVM_RUN: not halted there, whatever the watcher saw last.
            *h = false;
        }
        let Some(start) = st.granted_at.get(v).copied().flatten() else {
            return false;
        };
        if st.held + st.reserved > self.cfg.slots && st.preempt_sent[v] != 0 {
            // A vCPU that KVM woke took its lent slot back: this one was chosen to leave.
            self.release(&mut st, v, now);
            return false;
        }
        if st.queue.is_empty() {
            // Nobody waits: a fresh quantum, so a waiter that comes later finds it young.
            st.granted_at[v] = Some(now);
            st.extended[v] = false;
            st.preempt_sent[v] = 0;
            return true;
        }
        let over = now >= start.saturating_add(duration_ns(self.cfg.quantum));
        if !over && st.preempt_sent[v] == 0 {
            return true;
        }
        if !st.extended[v] && signals.in_critical_section(v) {
            let end = st.deadline(v, &self.cfg).unwrap_or(now);
            if now < end.saturating_add(duration_ns(self.cfg.cs_extension)) {
                st.extended[v] = true;
                st.preempt_sent[v] = 0;
                self.extensions.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        self.release(&mut st, v, now);
        false
    }

    /// vCPU `v` blocks anyway (a halt or a WAIT parked in the VMM): gives its slot up, or
    /// leaves the queue.
    pub fn leave(&self, v: usize) {
        let now = self.clock.now_ns();
        let mut st = self.lock();
        if v >= st.granted_at.len() {
            return;
        }
        st.queue.retain(|&w| w != v);
        st.queued_since[v] = None;
        st.lent[v] = false;
        st.halted[v] = false;
        if st.cancel_reservation(v) {
            // The kicked vCPU blocks again: its kept slot goes to the queue.
            if let Some(w) = st.queue.pop_front() {
                self.grant(&mut st, w, now);
                self.wakeups[w].notify_one();
            }
        }
        self.release(&mut st, v, now);
        self.wake_new_head(&mut st);
    }

    /// vCPU `v` was just kicked, or named as the vCPU others wait for: it goes ahead of
    /// waiters that have not aged, now if it waits, or when it next asks.
    pub fn prioritize(&self, v: usize) {
        let mut st = self.lock();
        if v >= st.granted_at.len() || st.granted_at[v].is_some() || st.prioritized[v] {
            return;
        }
        st.prioritized[v] = true;
        if st.queued(v) {
            st.queue.retain(|&w| w != v);
            let limit = st.granted_at.len();
            st.enqueue(v, limit);
            // Moved to the head, it takes over watching the holders' deadlines.
            self.wake_new_head(&mut st);
        }
    }

    /// The VM is stopping: every waiter returns [`EnterOutcome::Shutdown`] now and later.
    pub fn shutdown(&self) {
        let mut st = self.lock();
        st.shutdown = true;
        drop(st);
        for cv in &self.wakeups {
            cv.notify_all();
        }
        self.watch.notify_all();
    }

    /// The halt watcher saw vCPU `v` start (`halted`) or stop blocking inside KVM (a halt on
    /// the in-kernel LAPIC, which never leaves `KVM_RUN`).
    ///
    /// * A holder that halts lends its slot to the head of the queue when someone waits (or
    ///   when more vCPUs hold slots than there are).
    /// * A vCPU whose slot was lent and that KVM woke (kicked, or an interrupt arrived) already
    ///   runs guest code: it takes a slot back at once, so kicked vCPUs go first. If that makes
    ///   more holders than slots, a holder halted in KVM lends its slot, or else the holder that
    ///   has run longest (outside a critical section when one is) is asked to leave
    ///   ([`SlotSignals::preempt`]). When a waiter has aged, the woken vCPU is asked to leave
    ///   instead and queues ahead of the others, so the wait bound holds.
    pub fn halt_changed(&self, v: usize, halted: bool, signals: &dyn SlotSignals) {
        let now = self.clock.now_ns();
        let mut st = self.lock();
        if v >= st.granted_at.len() || st.shutdown {
            return;
        }
        st.halted[v] = halted;
        let over = |st: &State| st.held + st.reserved > self.cfg.slots;
        let victim = if halted {
            if st.granted_at[v].is_some() && (!st.queue.is_empty() || over(&st)) {
                self.release(&mut st, v, now);
                st.lent[v] = true;
                self.lends.fetch_add(1, Ordering::Relaxed);
            }
            None
        } else if std::mem::take(&mut st.lent[v]) {
            self.reclaims.fetch_add(1, Ordering::Relaxed);
            let n = st.granted_at.len();
            if st.aged_waiter(n) {
                st.prioritized[v] = true;
                Some(v)
            } else {
                for i in 0..st.queue.len() {
                    let w = st.queue[i];
                    st.overtaken[w] += 1;
                }
                st.prioritized[v] = true;
                self.grant(&mut st, v, now);
                if over(&st) {
                    self.make_room(&mut st, v, now, signals)
                } else {
                    None
                }
            }
        } else {
            None
        };
        if let Some(h) = victim {
            st.preempt_sent[h] = now.max(1);
            self.preemptions.fetch_add(1, Ordering::Relaxed);
            drop(st);
            signals.preempt(h);
        }
    }

    /// More holders than slots after `woken` took its slot back: a holder halted in KVM lends
    /// its slot now; else returns the holder to ask to leave.
    fn make_room(
        &self,
        st: &mut State,
        woken: usize,
        now: u64,
        signals: &dyn SlotSignals,
    ) -> Option<usize> {
        // The lowest-numbered halted holder, whatever the holders' order.
        if let Some(h) = st
            .holders
            .iter()
            .copied()
            .filter(|&h| h != woken && st.halted[h])
            .min()
        {
            self.release(st, h, now);
            st.lent[h] = true;
            self.lends.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let running = |st: &State| {
            st.holders
                .iter()
                .filter_map(|&h| st.granted_at[h].map(|g| (g, h)))
                .filter(|&(_, h)| h != woken && st.preempt_sent[h] == 0)
                .collect::<Vec<_>>()
        };
        let candidates = running(st);
        candidates
            .iter()
            .filter(|&&(_, h)| !signals.in_critical_section(h))
            .min()
            .or_else(|| candidates.iter().min())
            .map(|&(_, h)| h)
    }

    /// The vCPUs whose halts matter now, for the halt watcher: every holder and every vCPU
    /// with a lent slot while someone waits; only those with a lent slot otherwise. Empty:
    /// nothing to watch ([`wait_for_watch`](Self::wait_for_watch)).
    pub fn watch_set(&self, out: &mut Vec<usize>) {
        out.clear();
        let st = self.lock();
        let waiting = !st.queue.is_empty() || st.held + st.reserved > self.cfg.slots;
        out.extend(
            (0..st.granted_at.len())
                .filter(|&v| st.lent[v] || (waiting && st.granted_at[v].is_some())),
        );
    }

    /// For the halt watcher: blocks until someone waits for a slot, a slot is lent or more
    /// vCPUs hold slots than there are, or `timeout` passed; `false` once the slots shut down.
    #[cfg(not(loom))]
    pub fn wait_for_watch(&self, timeout: Duration) -> bool {
        let st = self.lock();
        let slots = self.cfg.slots;
        let idle = |st: &mut State| {
            !st.shutdown
                && st.queue.is_empty()
                && st.held + st.reserved <= slots
                && !st.lent.iter().any(|&l| l)
        };
        let st = st.wait_while(&self.watch, timeout, idle);
        !st.shutdown
    }

    /// The vCPU count.
    pub fn vcpus(&self) -> usize {
        self.wakeups.len()
    }

    /// Wakes the halt watcher (it stops when asked to).
    pub fn wake_watcher(&self) {
        let _st = self.lock();
        self.watch.notify_all();
    }

    /// Whether vCPU `v`'s slot is lent (it is halted inside KVM).
    pub fn lent(&self, v: usize) -> bool {
        self.lock().lent.get(v).copied().unwrap_or(false)
    }

    /// Whether `v` holds a slot now.
    pub fn holds(&self, v: usize) -> bool {
        self.lock().granted_at.get(v).is_some_and(Option::is_some)
    }

    /// The counters.
    pub fn stats(&self) -> SlotStats {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SlotStats {
            grants: ld(&self.grants),
            waits: ld(&self.waits),
            prioritized_grants: ld(&self.prioritized_grants),
            preemptions: ld(&self.preemptions),
            extensions: ld(&self.extensions),
            hand_overs: ld(&self.hand_overs),
            max_wait_ns: ld(&self.max_wait_ns),
            max_held: ld(&self.max_held),
            lends: ld(&self.lends),
            reclaims: ld(&self.reclaims),
            max_over_ns: ld(&self.max_over_ns),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64 as StdAtomicU64};
    use std::sync::{Arc, Mutex as StdMutex};

    #[derive(Debug, Default)]
    struct ManualClock(Arc<StdAtomicU64>);

    impl SlotClock for ManualClock {
        fn now_ns(&self) -> u64 {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// Records preemption requests; critical sections as set by the test.
    #[derive(Debug, Default)]
    struct Signals {
        preempted: StdMutex<Vec<usize>>,
        in_cs: StdMutex<Vec<bool>>,
    }

    impl SlotSignals for Signals {
        fn in_critical_section(&self, v: usize) -> bool {
            self.in_cs.lock().unwrap().get(v).copied().unwrap_or(false)
        }
        fn preempt(&self, v: usize) {
            self.preempted.lock().unwrap().push(v);
        }
    }

    #[derive(Debug, Default)]
    struct Granted(Arc<StdMutex<Vec<usize>>>);

    impl SlotWaker for Granted {
        fn granted(&self, v: usize) {
            self.0.lock().unwrap().push(v);
        }
    }

    /// `poll_enter` says how long to wait (the holder's quantum), and the waker names every
    /// grant, from the queue and directly.
    #[test]
    fn poll_enter_gives_the_wait_and_the_waker_names_each_grant() {
        let now = Arc::new(StdAtomicU64::new(1));
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let s = RunSlots::with_clock(2, test_config(1), Box::new(ManualClock(now.clone())))
            .unwrap()
            .with_waker(Box::new(Granted(seen.clone())));
        let sig = Signals::default();
        assert_eq!(
            s.poll_enter(0, 1, &sig),
            Ok(EnterOutcome::Granted { waited_ns: 0 })
        );
        now.store(500_001, std::sync::atomic::Ordering::SeqCst);
        // The 2 ms quantum of vCPU 0 ends 1.5 ms from now.
        assert_eq!(s.poll_enter(1, 500_001, &sig), Err(1_000_000));
        assert_eq!(*seen.lock().unwrap(), vec![0]);
        s.leave(0);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![0, 1],
            "the queued vCPU is named"
        );
        assert!(s.holds(1));
    }

    /// The configuration the tests' times are written for (not the defaults, which may move).
    fn test_config(slots: usize) -> SlotConfig {
        SlotConfig {
            slots,
            quantum: Duration::from_millis(2),
            cs_extension: Duration::from_micros(500),
            preempt_latency: Duration::from_millis(1),
            priority_preempt_after: Duration::from_micros(50),
            halt_watch_interval: Duration::from_micros(100),
        }
    }

    fn slots(n: usize, s: usize) -> (RunSlots, Arc<StdAtomicU64>) {
        let now = Arc::new(StdAtomicU64::new(1));
        let clock = ManualClock(now.clone());
        let cfg = test_config(s);
        (RunSlots::with_clock(n, cfg, Box::new(clock)).unwrap(), now)
    }

    const MS: u64 = 1_000_000;

    /// The holder list the decisions scan is exactly the vCPUs with a slot, and only the
    /// queue's head is the one woken to watch the deadlines (or nobody, with no queue).
    fn assert_holders_tracked(s: &RunSlots, seed: u64) {
        let st = s.lock();
        let mut listed = st.holders.clone();
        listed.sort_unstable();
        let granted: Vec<usize> = (0..st.granted_at.len())
            .filter(|&v| st.granted_at[v].is_some())
            .collect();
        assert_eq!(listed, granted, "seed {seed}");
        assert_eq!(st.holders.len(), st.held, "seed {seed}");
        assert_eq!(st.polling, st.queue.front().copied(), "seed {seed}: {st:?}");
    }

    #[test]
    fn configuration_rules_are_named() {
        assert_eq!(
            SlotConfig::new(0).validate(4),
            Err(SlotError::Slots { slots: 0, vcpus: 4 })
        );
        assert!(SlotConfig::new(5).validate(4).is_err());
        assert!(
            SlotConfig::new(2).validate(4).is_ok(),
            "the defaults are valid"
        );
        let short = SlotConfig {
            quantum: Duration::from_micros(10),
            ..SlotConfig::new(1)
        };
        assert!(short
            .validate(4)
            .unwrap_err()
            .to_string()
            .starts_with("rule:"));
        let long_ext = SlotConfig {
            cs_extension: Duration::from_millis(5),
            ..test_config(1)
        };
        assert!(matches!(
            long_ext.validate(4),
            Err(SlotError::Extension { .. })
        ));
        // 4 vCPUs, 1 slot: 7 ahead at most, 3.5 ms per turn.
        assert_eq!(
            test_config(1).wait_bound(4),
            Duration::from_micros(3500) * 7
        );
        assert_eq!(
            test_config(2).wait_bound(4),
            Duration::from_micros(3500) * 4
        );
        // The defaults: 10 ms per turn.
        assert_eq!(SlotConfig::new(2).wait_bound(4), Duration::from_millis(40));
    }

    #[test]
    fn free_slots_are_granted_and_held_across_exits_while_nobody_waits() {
        let (s, now) = slots(3, 2);
        let sig = Signals::default();
        assert_eq!(s.enter(0, &sig), EnterOutcome::Granted { waited_ns: 0 });
        assert_eq!(s.enter(1, &sig), EnterOutcome::Granted { waited_ns: 0 });
        now.fetch_add(10 * MS, std::sync::atomic::Ordering::SeqCst);
        assert!(s.exited(0, &sig), "nobody waits: keep the slot");
        assert_eq!(s.try_enter(2, s.now_ns(), &sig), None, "both slots held");
        assert_eq!(s.stats().max_held, 2);
    }

    #[test]
    fn an_overdue_holder_is_preempted_and_hands_its_slot_to_the_waiter() {
        let (s, now) = slots(2, 1);
        let sig = Signals::default();
        s.enter(0, &sig);
        let since = s.now_ns();
        assert_eq!(s.try_enter(1, since, &sig), None);
        assert!(
            sig.preempted.lock().unwrap().is_empty(),
            "vCPU 0's quantum is young"
        );
        // Before the quantum ends an exit keeps the slot even with a waiter.
        now.fetch_add(MS, std::sync::atomic::Ordering::SeqCst);
        assert!(s.exited(0, &sig));
        now.fetch_add(2 * MS, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(s.try_enter(1, since, &sig), None);
        assert_eq!(*sig.preempted.lock().unwrap(), vec![0]);
        assert!(!s.exited(0, &sig), "over its quantum: hands over");
        assert!(s.holds(1));
        assert_eq!(
            s.try_enter(1, since, &sig),
            Some(EnterOutcome::Granted { waited_ns: 3 * MS })
        );
        assert_eq!(s.stats().waits, 1);
        assert_eq!(s.stats().max_wait_ns, 3 * MS);
    }

    #[test]
    fn a_critical_section_extends_the_quantum_once() {
        let (s, now) = slots(2, 1);
        let sig = Signals::default();
        *sig.in_cs.lock().unwrap() = vec![true, false];
        s.enter(0, &sig);
        let since = s.now_ns();
        assert_eq!(s.try_enter(1, since, &sig), None);
        now.fetch_add(2 * MS + 1, std::sync::atomic::Ordering::SeqCst);
        assert!(s.exited(0, &sig), "inside a critical section: extended");
        assert_eq!(s.stats().extensions, 1);
        // Still inside at the extension's end: no second extension.
        now.fetch_add(MS, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(s.try_enter(1, since, &sig), None);
        assert!(!s.exited(0, &sig));
        assert!(s.holds(1));
    }

    #[test]
    fn a_kicked_vcpu_goes_first_but_cannot_starve_an_aged_waiter() {
        let n = 4;
        let (s, _now) = slots(n, 1);
        let sig = Signals::default();
        s.enter(0, &sig);
        let t = s.now_ns();
        assert_eq!(s.try_enter(1, t, &sig), None);
        // Kicked vCPUs keep arriving; each overtakes vCPU 1 until it has aged.
        let mut overtakes = 0;
        for k in 0..3 * n {
            let kicked = 2 + k % 2;
            s.prioritize(kicked);
            assert_eq!(s.try_enter(kicked, t, &sig), None);
            s.leave(s.holder_for_tests().unwrap());
            let holder = s.holder_for_tests().unwrap();
            if holder == 1 {
                assert!(overtakes >= 1, "a kicked vCPU goes first");
                assert!(overtakes <= n, "overtaken {overtakes} times");
                assert!(s.stats().prioritized_grants >= 1);
                return;
            }
            assert_eq!(holder, kicked);
            overtakes += 1;
        }
        panic!("vCPU 1 was overtaken {overtakes} times");
    }

    impl RunSlots {
        fn holder_for_tests(&self) -> Option<usize> {
            self.lock().granted_at.iter().position(Option::is_some)
        }
    }

    /// A tiny xorshift generator: seeded, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Sim {
        Running,
        Waiting(u64),
        Blocked,
    }

    /// Random schedules: vCPUs run, exit, block, get kicked, enter critical sections; the
    /// clock advances in steps below the preemption latency; a preempted vCPU exits at the
    /// next step. Every run checks: never more holders than slots, every wait within the
    /// bound, every grant of a prioritized vCPU counted.
    #[test]
    fn random_schedules_respect_the_slot_count_and_the_wait_bound() {
        for seed in 1..=200u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let n = 2 + rng.below(7) as usize;
            let s_count = 1 + rng.below(n as u64) as usize;
            let (s, now) = slots(n, s_count);
            let sig = Signals::default();
            *sig.in_cs.lock().unwrap() = vec![false; n];
            let bound = duration_ns(s.config().wait_bound(n));
            let mut state = vec![Sim::Blocked; n];
            for _ in 0..3000 {
                now.fetch_add(
                    10_000 + rng.below(490_000),
                    std::sync::atomic::Ordering::SeqCst,
                );
                let t = s.now_ns();
                let preempted: Vec<usize> = std::mem::take(&mut *sig.preempted.lock().unwrap());
                for (v, sim) in state.iter_mut().enumerate() {
                    sig.in_cs.lock().unwrap()[v] = rng.below(4) == 0;
                    match *sim {
                        Sim::Running if rng.below(6) == 0 => {
                            let to = rng.below(n as u64) as usize;
                            if s.hand_over(v, to) {
                                *sim = Sim::Waiting(t);
                            }
                        }
                        Sim::Running => {
                            if preempted.contains(&v) || rng.below(3) == 0 {
                                if !s.exited(v, &sig) {
                                    *sim = Sim::Waiting(t);
                                } else if rng.below(8) == 0 {
                                    s.leave(v);
                                    *sim = Sim::Blocked;
                                }
                            }
                        }
                        Sim::Blocked => {
                            if rng.below(4) == 0 {
                                if rng.below(2) == 0 {
                                    s.prioritize(v);
                                }
                                *sim = Sim::Waiting(t);
                            }
                        }
                        Sim::Waiting(since) => {
                            if let Some(EnterOutcome::Granted { waited_ns }) =
                                s.try_enter(v, since, &sig)
                            {
                                assert!(
                                    waited_ns <= bound,
                                    "seed {seed}: vCPU {v} waited {waited_ns} ns > {bound}"
                                );
                                *sim = Sim::Running;
                            } else {
                                assert!(t - since <= bound, "seed {seed}: vCPU {v} still waits");
                            }
                        }
                    }
                }
                let holders = (0..n).filter(|&v| s.holds(v)).count();
                assert_holders_tracked(&s, seed);
                let kept = s.lock().reserved;
                assert!(
                    holders + kept <= s_count,
                    "seed {seed}: {holders} + {kept} kept > {s_count}"
                );
                assert!(
                    holders <= s_count,
                    "seed {seed}: {holders} holders > {s_count}"
                );
                for (v, sim) in state.iter().enumerate() {
                    // A waiter may hold a slot handed over before it looked again.
                    match sim {
                        Sim::Running => assert!(s.holds(v), "seed {seed} vCPU {v}"),
                        Sim::Blocked => assert!(!s.holds(v), "seed {seed} vCPU {v}"),
                        Sim::Waiting(_) => {}
                    }
                }
            }
            assert!(s.stats().max_held as usize <= s_count);
        }
    }

    /// vCPUs of a guest that halts inside KVM (in-kernel LAPIC): what the simulation knows of
    /// each, as the VMM's thread and KVM would.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum KvmSim {
        /// In `KVM_RUN`, running guest code.
        Running,
        /// In `KVM_RUN`, blocked in KVM's halt.
        Halted,
        /// Parked in `enter`, asking since then.
        Waiting(u64),
    }

    /// Random schedules of a stock guest: vCPUs halt inside KVM and are woken there (kicks,
    /// interrupts) without asking; the halt watcher reports what it sees each step (sometimes
    /// late: it misses a step at random); forced exits take effect at the next step. Checks:
    /// every wait within the bound; more holders than slots only for the step a woken vCPU's
    /// victim needs to leave; a woken vCPU never waits for a slot (kicked vCPUs go first) unless a
    /// waiter has aged; nothing is lent while nobody waits.
    #[test]
    // The loops index `state` and the policy's per-vCPU vectors by the same vCPU number.
    #[allow(clippy::needless_range_loop)]
    fn random_schedules_with_halts_inside_kvm_lend_and_reclaim_within_bounds() {
        for seed in 1..=200u64 {
            let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
            let n = 2 + rng.below(7) as usize;
            let s_count = 1 + rng.below(n as u64 - 1) as usize;
            let (s, now) = slots(n, s_count);
            let sig = Signals::default();
            *sig.in_cs.lock().unwrap() = vec![false; n];
            let bound = duration_ns(s.config().wait_bound(n));
            let mut state: Vec<KvmSim> = (0..n).map(|_| KvmSim::Waiting(1)).collect();
            let (mut over_steps, mut over_run, mut last_reclaims) = (0, 0, 0);
            // before_run's first try, at once after the exit.
            let ask = |s: &RunSlots, v: usize, t: u64, sig: &Signals| match s.try_enter(v, t, sig) {
                Some(_) => KvmSim::Running,
                None => KvmSim::Waiting(t),
            };
            for step in 0..3000 {
                now.fetch_add(
                    10_000 + rng.below(490_000),
                    std::sync::atomic::Ordering::SeqCst,
                );
                let t = s.now_ns();
                let preempted: Vec<usize> = std::mem::take(&mut *sig.preempted.lock().unwrap());
                for v in 0..n {
                    match state[v] {
                        KvmSim::Running | KvmSim::Halted if preempted.contains(&v) => {
                            // The forced exit: after_run, then before_run's enter.
                            if !s.exited(v, &sig) {
                                state[v] = ask(&s, v, t, &sig);
                            }
                        }
                        KvmSim::Running => {
                            if rng.below(4) == 0 {
                                state[v] = KvmSim::Halted;
                            } else if rng.below(5) == 0 && !s.exited(v, &sig) {
                                state[v] = ask(&s, v, t, &sig);
                            }
                        }
                        KvmSim::Halted => {
                            if rng.below(5) == 0 {
                                // KVM woke it: it runs at once, seen or not.
                                state[v] = KvmSim::Running;
                            }
                        }
                        KvmSim::Waiting(since) => match s.try_enter(v, since, &sig) {
                            Some(_) if preempted.contains(&v) => {
                                // The signal came between runs: the next KVM_RUN returns at
                                // once (immediate_exit), so it exits at the next step.
                                sig.preempted.lock().unwrap().push(v);
                                state[v] = KvmSim::Running;
                            }
                            Some(EnterOutcome::Granted { waited_ns }) => {
                                assert!(waited_ns <= bound, "seed {seed}: vCPU {v} waited");
                                state[v] = KvmSim::Running;
                            }
                            _ => assert!(t - since <= bound, "seed {seed}: vCPU {v} waits"),
                        },
                    }
                }
                // The watcher, which sometimes misses a step.
                if rng.below(4) != 0 {
                    let mut set = Vec::new();
                    s.watch_set(&mut set);
                    for v in set {
                        s.halt_changed(v, state[v] == KvmSim::Halted, &sig);
                    }
                }
                let holders = (0..n).filter(|&v| s.holds(v)).count();
                assert_holders_tracked(&s, seed);
                let kept = s.lock().reserved;
                // Each vCPU that KVM woke with its slot lent makes one holder too many, until
                // the holder it asked to leave exits; wakes that keep coming chain such runs.
                let reclaims = s.stats().reclaims;
                let woke_now = reclaims != last_reclaims;
                last_reclaims = reclaims;
                if holders + kept <= s_count {
                    over_run = 0;
                } else {
                    over_steps += 1;
                    over_run = if woke_now { 1 } else { over_run + 1 };
                    assert!(
                        over_run <= 2,
                        "seed {seed} step {step}: over for {over_run} steps: {state:?} {:?} {:?}",
                        s.lock(),
                        sig.preempted.lock().unwrap()
                    );
                    let st = s.lock();
                    assert!(
                        !sig.preempted.lock().unwrap().is_empty()
                            || st.preempt_sent.iter().any(|&p| p != 0),
                        "seed {seed} step {step}: over the slots and nobody asked to leave: \
                         {state:?} {st:?}"
                    );
                }
                let st = s.lock();
                for v in 0..n {
                    if st.lent[v] {
                        assert!(
                            matches!(state[v], KvmSim::Halted | KvmSim::Running),
                            "seed {seed} step {step}: vCPU {v} lent but not in KVM_RUN: {:?}",
                            state[v]
                        );
                    }
                    if state[v] == KvmSim::Running && !st.lent[v] && st.granted_at[v].is_none() {
                        // Running without a slot: only a woken vCPU asked to leave.
                        assert!(st.prioritized[v], "seed {seed}: vCPU {v} runs unseen");
                    }
                }
            }
            assert!(over_steps < 3000, "seed {seed}: always over");
        }
    }

    /// Real threads: a vCPU parked in `enter` is woken by the hand-over a kick causes, and
    /// shutdown releases every waiter.
    #[test]
    fn parked_threads_are_woken_by_hand_over_and_by_shutdown() {
        let s = Arc::new(RunSlots::new(3, SlotConfig::new(1)).unwrap());
        #[derive(Debug)]
        struct NoPreempt;
        impl SlotSignals for NoPreempt {
            fn in_critical_section(&self, _: usize) -> bool {
                true
            }
            fn preempt(&self, _: usize) {}
        }
        s.enter(0, &NoPreempt);
        let got = Arc::new(AtomicBool::new(false));
        let (s1, g1) = (s.clone(), got.clone());
        let t1 = std::thread::spawn(move || {
            let out = s1.enter(1, &NoPreempt);
            g1.store(true, std::sync::atomic::Ordering::SeqCst);
            out
        });
        while !s.lock().queue.contains(&1) {
            std::thread::yield_now();
        }
        assert!(!got.load(std::sync::atomic::Ordering::SeqCst));
        s.prioritize(1); // kicked
        s.leave(0); // the holder halts
        assert!(matches!(t1.join().unwrap(), EnterOutcome::Granted { .. }));
        let s2 = s.clone();
        let t2 = std::thread::spawn(move || s2.enter(2, &NoPreempt));
        while !s.lock().queue.contains(&2) {
            std::thread::yield_now();
        }
        s.shutdown();
        assert_eq!(t2.join().unwrap(), EnterOutcome::Shutdown);
        assert_eq!(s.enter(0, &NoPreempt), EnterOutcome::Shutdown);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    #[derive(Debug)]
    struct NoSignals;
    impl SlotSignals for NoSignals {
        fn in_critical_section(&self, _: usize) -> bool {
            false
        }
        fn preempt(&self, _: usize) {}
    }

    #[derive(Debug)]
    struct Zero;
    impl SlotClock for Zero {
        fn now_ns(&self) -> u64 {
            0
        }
    }

    /// One slot, two vCPUs: the holder leaves while the other enters; the other always gets
    /// the slot (no lost wake-up) and never both hold it.
    #[test]
    fn loom_hand_over_loses_no_wake_up() {
        loom::model(|| {
            let s = Arc::new(RunSlots::with_clock(2, SlotConfig::new(1), Box::new(Zero)).unwrap());
            assert!(matches!(
                s.enter(0, &NoSignals),
                EnterOutcome::Granted { .. }
            ));
            let s1 = s.clone();
            let t = loom::thread::spawn(move || {
                let out = s1.enter(1, &NoSignals);
                assert!(!s1.holds(0));
                out
            });
            s.leave(0);
            assert!(matches!(t.join().unwrap(), EnterOutcome::Granted { .. }));
            assert!(s.holds(1));
        });
    }

    /// The halt watcher lends a halted holder's slot while the other vCPU enters, then KVM
    /// wakes the holder: the waiter is woken exactly once with the slot, the woken vCPU takes a
    /// slot back, and the borrower is the one that leaves at its next exit.
    #[test]
    fn loom_lend_and_reclaim_race_an_enter() {
        loom::model(|| {
            let s = Arc::new(RunSlots::with_clock(2, SlotConfig::new(1), Box::new(Zero)).unwrap());
            s.enter(0, &NoSignals);
            let s1 = s.clone();
            let t = loom::thread::spawn(move || s1.enter(1, &NoSignals));
            // The watcher: vCPU 0 blocks in KVM; its slot is lent once vCPU 1 waits.
            while !s.lent(0) {
                s.halt_changed(0, true, &NoSignals);
                loom::thread::yield_now();
            }
            s.halt_changed(0, false, &NoSignals);
            assert!(matches!(t.join().unwrap(), EnterOutcome::Granted { .. }));
            assert!(
                s.holds(0) && s.holds(1),
                "one over until the borrower exits"
            );
            assert!(!s.exited(1, &NoSignals), "the borrower leaves");
            assert!(s.holds(0) && !s.holds(1));
        });
    }

    /// Three vCPUs, one slot: two wait (one of them behind the head, which sleeps without a
    /// timer) while the holder leaves and a kick moves the last one to the front; each takes
    /// the slot and leaves in turn. Every hand-over reaches its waiter: nobody sleeps forever,
    /// and never two hold the slot.
    #[test]
    fn loom_waiters_behind_the_head_are_handed_the_slot() {
        loom::model(|| {
            let s = Arc::new(RunSlots::with_clock(3, SlotConfig::new(1), Box::new(Zero)).unwrap());
            s.enter(0, &NoSignals);
            let spawn = |v: usize| {
                let s = s.clone();
                loom::thread::spawn(move || {
                    let out = s.enter(v, &NoSignals);
                    assert!(matches!(out, EnterOutcome::Granted { .. }));
                    assert!(!s.holds(3 - v) && !s.holds(0), "one slot, one holder");
                    s.leave(v);
                })
            };
            let (t1, t2) = (spawn(1), spawn(2));
            s.prioritize(2);
            s.leave(0);
            t1.join().unwrap();
            t2.join().unwrap();
            assert!(!s.holds(1) && !s.holds(2));
        });
    }

    /// A prioritization racing the hand-over and a shutdown racing a waiter: the waiter
    /// returns either way.
    #[test]
    fn loom_shutdown_releases_a_waiter() {
        loom::model(|| {
            let s = Arc::new(RunSlots::with_clock(2, SlotConfig::new(1), Box::new(Zero)).unwrap());
            s.enter(0, &NoSignals);
            let s1 = s.clone();
            let t = loom::thread::spawn(move || s1.enter(1, &NoSignals));
            s.prioritize(1);
            s.shutdown();
            let _ = t.join().unwrap();
        });
    }
}
