//! Counters per VM (one frontend connection) and for the whole daemon, rendered as one JSON
//! or Prometheus document. Metric names follow the library's telemetry (`pvspin_` prefix,
//! `vcpu="N"` labels) with a `vm` label naming the socket that serves the VM.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use pvspin_hints::PageBudgets;
use pvspin_kick::ratelimit::{Clock, MonotonicClock, RateLimiter};
use pvspin_prometheus::Families;
use serde::Serialize;

use crate::sched::Reads;

/// A kind of bad guest (or frontend) input, counted and logged at a bounded rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BadInput {
    /// A control chain of the wrong shape (descriptor kinds, sizes or count).
    ControlChain,
    /// A control request with an unknown op.
    ControlOp,
    /// A control request naming a vCPU at or above `max_vcpus`.
    ControlVcpu,
    /// A hint page address that is unaligned or not in the frontend's memory.
    ControlAddress,
    /// A control op whose feature the driver did not accept.
    ControlUnsupported,
    /// A spin notification naming a vCPU at or above `max_vcpus`, or the spinner itself.
    SpinTarget,
    /// A registered hint page that can no longer be read (the memory table changed).
    HintRead,
    /// A configuration-space read outside the space.
    ConfigRead,
    /// A ring the backend could not read or update (bad addresses, a broken chain).
    Ring,
}

impl BadInput {
    /// Every kind, in rendering order.
    pub const ALL: [BadInput; 9] = [
        BadInput::ControlChain,
        BadInput::ControlOp,
        BadInput::ControlVcpu,
        BadInput::ControlAddress,
        BadInput::ControlUnsupported,
        BadInput::SpinTarget,
        BadInput::HintRead,
        BadInput::ConfigRead,
        BadInput::Ring,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            BadInput::ControlChain => "control_chain",
            BadInput::ControlOp => "control_op",
            BadInput::ControlVcpu => "control_vcpu",
            BadInput::ControlAddress => "control_address",
            BadInput::ControlUnsupported => "control_unsupported",
            BadInput::SpinTarget => "spin_target",
            BadInput::HintRead => "hint_read",
            BadInput::ConfigRead => "config_read",
            BadInput::Ring => "ring",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

/// Why a spin notification changed no thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YieldSkip {
    /// The frontend's pid is unknown (no peer credentials).
    NoPeer,
    /// No thread of the frontend matches the vCPU's name patterns.
    NoThread,
    /// Reading or changing the thread's priority failed.
    ActionFailed,
    /// The spinner is already deboosted (the deadline is extended instead).
    AlreadyAdjusted,
    /// The change could not be undone (or made): lowering the nice value needs
    /// `CAP_SYS_NICE` or `RLIMIT_NICE`.
    NoPrivilege,
}

impl YieldSkip {
    const ALL: [YieldSkip; 5] = [
        YieldSkip::NoPeer,
        YieldSkip::NoThread,
        YieldSkip::ActionFailed,
        YieldSkip::AlreadyAdjusted,
        YieldSkip::NoPrivilege,
    ];

    fn name(self) -> &'static str {
        match self {
            YieldSkip::NoPeer => "no_peer",
            YieldSkip::NoThread => "no_thread",
            YieldSkip::ActionFailed => "action_failed",
            YieldSkip::AlreadyAdjusted => "already_adjusted",
            YieldSkip::NoPrivilege => "no_privilege",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

fn add(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// How often each kind of bad input may be logged.
const BAD_INPUT_LOG_INTERVAL_NS: u64 = 1_000_000_000;

/// The log limiter of a VM's bad inputs: one key per [`BadInput`] kind, at most one line per
/// kind per second (pvspin-kick's limiter, which the in-process doorbell uses too).
fn bad_input_limiter<C: Clock>(clock: C) -> RateLimiter<C> {
    RateLimiter::new(clock, BadInput::ALL.len(), BAD_INPUT_LOG_INTERVAL_NS)
}

/// The counters of one VM, i.e. of one frontend connection. Shared by the backend (which
/// counts) and the daemon (which renders).
#[derive(Debug)]
pub struct DaemonVmTelemetry {
    vm: String,
    socket: String,
    peer_pid: Mutex<Option<u32>>,
    connected_unix_s: u64,
    kicks: Vec<AtomicU64>,
    spin_notifications: Vec<AtomicU64>,
    kicks_unset_queue: AtomicU64,
    spins_without_page: AtomicU64,
    spins_not_spinning: AtomicU64,
    paced: AtomicU64,
    events_unknown_queue: AtomicU64,
    deboosts: AtomicU64,
    boosts: AtomicU64,
    restores: AtomicU64,
    boost_refused_unconfined: AtomicU64,
    yield_skipped: [AtomicU64; YieldSkip::ALL.len()],
    registrations: AtomicU64,
    unregistrations: AtomicU64,
    control_requests: AtomicU64,
    bad_inputs: [AtomicU64; BadInput::ALL.len()],
    rate_limit: RateLimiter<MonotonicClock>,
    wait_reports: AtomicU64,
    useful_notifications: AtomicU64,
    not_running_set: Vec<AtomicU64>,
    sched_passes: AtomicU64,
    sched_thread_reads: AtomicU64,
    sched_read_ns: AtomicU64,
    sched_file_reads: [AtomicU64; 3],
    budgets: OnceLock<Arc<PageBudgets>>,
}

impl DaemonVmTelemetry {
    /// Fresh counters for a VM served on `socket`, labelled `vm` (the socket's file name).
    pub fn new(vm: &str, socket: &str, max_vcpus: u32) -> Self {
        let zeros = |n: u32| (0..n).map(|_| AtomicU64::new(0)).collect();
        Self {
            vm: vm.to_owned(),
            socket: socket.to_owned(),
            peer_pid: Mutex::new(None),
            connected_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            kicks: zeros(max_vcpus),
            spin_notifications: zeros(max_vcpus),
            kicks_unset_queue: AtomicU64::new(0),
            spins_without_page: AtomicU64::new(0),
            spins_not_spinning: AtomicU64::new(0),
            paced: AtomicU64::new(0),
            events_unknown_queue: AtomicU64::new(0),
            deboosts: AtomicU64::new(0),
            boosts: AtomicU64::new(0),
            restores: AtomicU64::new(0),
            boost_refused_unconfined: AtomicU64::new(0),
            yield_skipped: Default::default(),
            registrations: AtomicU64::new(0),
            unregistrations: AtomicU64::new(0),
            control_requests: AtomicU64::new(0),
            bad_inputs: Default::default(),
            rate_limit: bad_input_limiter(MonotonicClock::new()),
            wait_reports: AtomicU64::new(0),
            useful_notifications: AtomicU64::new(0),
            not_running_set: zeros(max_vcpus),
            sched_passes: AtomicU64::new(0),
            sched_thread_reads: AtomicU64::new(0),
            sched_read_ns: AtomicU64::new(0),
            sched_file_reads: Default::default(),
            budgets: OnceLock::new(),
        }
    }

    /// The budgets the VM's backend adapts (rendered per vCPU; set once).
    pub fn set_budgets(&self, budgets: Arc<PageBudgets>) {
        let _ = self.budgets.set(budgets);
    }

    /// Counts a wait report taken into a budget.
    pub fn wait_report(&self) {
        add(&self.wait_reports);
    }

    /// Counts a spin notification whose waited-for vCPU was descheduled.
    pub fn useful_notification(&self) {
        add(&self.useful_notifications);
    }

    /// Counts `NOT_RUNNING` set in `vcpu`'s page.
    pub fn not_running_set(&self, vcpu: u32) {
        if let Some(c) = self.not_running_set.get(vcpu as usize) {
            add(c);
        }
    }

    /// Counts a scheduler sampler pass: `threads` vCPU threads read with `reads`, in `ns`.
    pub fn sched_pass(&self, threads: u32, reads: Reads, ns: u64) {
        add(&self.sched_passes);
        self.sched_thread_reads
            .fetch_add(u64::from(threads), Ordering::Relaxed);
        self.sched_read_ns.fetch_add(ns, Ordering::Relaxed);
        for (c, n) in self
            .sched_file_reads
            .iter()
            .zip([reads.schedstat, reads.stat, reads.status])
        {
            c.fetch_add(u64::from(n), Ordering::Relaxed);
        }
    }

    /// The `vm` label.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// Records the frontend's pid (from its peer credentials).
    pub fn set_peer_pid(&self, pid: Option<u32>) {
        *self.peer_pid.lock().unwrap_or_else(PoisonError::into_inner) = pid;
    }

    /// Counts a kick of `vcpu` that was delivered.
    pub fn kick(&self, vcpu: u32) {
        if let Some(c) = self.kicks.get(vcpu as usize) {
            add(c);
        }
    }

    /// Counts a kick on a queue the frontend did not set up (nothing was signalled).
    pub fn kick_unset_queue(&self) {
        add(&self.kicks_unset_queue);
    }

    /// Counts a spin notification from `vcpu`.
    pub fn spin_notification(&self, vcpu: u32) {
        if let Some(c) = self.spin_notifications.get(vcpu as usize) {
            add(c);
        }
    }

    /// Counts a spin notification from a vCPU without a registered hint page.
    pub fn spin_without_page(&self) {
        add(&self.spins_without_page);
    }

    /// Counts a pause of the VM's worker thread: it reached its event rate.
    pub fn paced(&self) {
        add(&self.paced);
    }

    /// Counts a spin-queue event whose vCPU's hint page does not say it spins or waits (a
    /// stray notify).
    pub fn spin_not_spinning(&self) {
        add(&self.spins_not_spinning);
    }

    /// Counts an event on a queue index the device does not have.
    pub fn event_unknown_queue(&self) {
        add(&self.events_unknown_queue);
    }

    /// Counts a deboost.
    pub fn deboost(&self) {
        add(&self.deboosts);
    }

    /// Counts a boost.
    pub fn boost(&self) {
        add(&self.boosts);
    }

    /// Counts a priority restored after a deboost or boost.
    pub fn restore(&self) {
        add(&self.restores);
    }

    /// Counts a boost refused because the frontend is not confined.
    pub fn boost_refused_unconfined(&self) {
        add(&self.boost_refused_unconfined);
    }

    /// Counts a notification that changed no thread, and why.
    pub fn yield_skipped(&self, why: YieldSkip) {
        add(&self.yield_skipped[why.index()]);
    }

    /// Counts a control request (valid or not).
    pub fn control_request(&self) {
        add(&self.control_requests);
    }

    /// Counts a hint-page registration (`registered`) or unregistration.
    pub fn registration(&self, registered: bool) {
        add(if registered {
            &self.registrations
        } else {
            &self.unregistrations
        });
    }

    /// Counts a bad input of `kind` and logs it at most once per kind per second.
    pub fn bad_input(&self, kind: BadInput, detail: std::fmt::Arguments<'_>) {
        add(&self.bad_inputs[kind.index()]);
        match self.rate_limit.check(kind.index()) {
            Some(0) => log::warn!("{}: bad guest input ({}): {detail}", self.vm, kind.name()),
            Some(suppressed) => log::warn!(
                "{}: bad guest input ({}): {detail} ({suppressed} more since the last line)",
                self.vm,
                kind.name()
            ),
            None => {}
        }
    }

    /// The count of bad inputs of `kind`.
    pub fn bad_inputs(&self, kind: BadInput) -> u64 {
        get(&self.bad_inputs[kind.index()])
    }

    /// A consistent-enough copy of the counters (each read once, relaxed).
    pub fn snapshot(&self) -> VmSnapshot {
        let per_vcpu = |v: &[AtomicU64]| v.iter().map(get).collect::<Vec<_>>();
        VmSnapshot {
            vm: self.vm.clone(),
            socket: self.socket.clone(),
            peer_pid: *self.peer_pid.lock().unwrap_or_else(PoisonError::into_inner),
            connected_since_unix_s: self.connected_unix_s,
            kicks: per_vcpu(&self.kicks),
            spin_notifications: per_vcpu(&self.spin_notifications),
            kicks_unset_queue: get(&self.kicks_unset_queue),
            spins_without_page: get(&self.spins_without_page),
            spins_not_spinning: get(&self.spins_not_spinning),
            paced: get(&self.paced),
            events_unknown_queue: get(&self.events_unknown_queue),
            deboosts: get(&self.deboosts),
            boosts: get(&self.boosts),
            restores: get(&self.restores),
            boost_refused_unconfined: get(&self.boost_refused_unconfined),
            yield_skipped: YieldSkip::ALL
                .iter()
                .map(|k| (k.name().to_owned(), get(&self.yield_skipped[k.index()])))
                .collect(),
            hint_page_registrations: get(&self.registrations),
            hint_page_unregistrations: get(&self.unregistrations),
            control_requests: get(&self.control_requests),
            bad_inputs: BadInput::ALL
                .iter()
                .map(|k| (k.name().to_owned(), get(&self.bad_inputs[k.index()])))
                .collect(),
            wait_reports: get(&self.wait_reports),
            useful_spin_notifications: get(&self.useful_notifications),
            not_running_set: per_vcpu(&self.not_running_set),
            wait_after_ns: self
                .budgets
                .get()
                .map(|b| {
                    (0..self.kicks.len())
                        .map(|v| b.budgets().wait_after_ns(v))
                        .collect()
                })
                .unwrap_or_default(),
            spin_window_ns: self.budgets.get().filter(|b| b.notify()).map(|b| {
                (0..self.kicks.len())
                    .map(|v| b.budgets().notify_after_ns(v))
                    .collect()
            }),
            sched: SchedSnapshot {
                passes: get(&self.sched_passes),
                thread_reads: get(&self.sched_thread_reads),
                read_ns: get(&self.sched_read_ns),
                schedstat_reads: get(&self.sched_file_reads[0]),
                stat_reads: get(&self.sched_file_reads[1]),
                status_reads: get(&self.sched_file_reads[2]),
            },
        }
    }
}

/// A copy of one VM's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VmSnapshot {
    /// The `vm` label: the serving socket's file name.
    pub vm: String,
    /// The serving socket's path.
    pub socket: String,
    /// The frontend's pid, when its peer credentials were available.
    pub peer_pid: Option<u32>,
    /// When the frontend connected, seconds since the Unix epoch.
    pub connected_since_unix_s: u64,
    /// Kicks delivered, per vCPU.
    pub kicks: Vec<u64>,
    /// Spin notifications acted on (page registered), per notifying vCPU.
    pub spin_notifications: Vec<u64>,
    /// Kicks on queues the frontend did not set up.
    pub kicks_unset_queue: u64,
    /// Spin notifications from vCPUs without a registered hint page.
    pub spins_without_page: u64,
    /// Spin-queue events whose vCPU's page did not say it spins or waits.
    pub spins_not_spinning: u64,
    /// Times the VM's worker thread slept because the VM reached its event rate.
    pub paced: u64,
    /// Events on queue indices the device does not have.
    pub events_unknown_queue: u64,
    /// Spinner threads deboosted.
    pub deboosts: u64,
    /// Waited-for threads boosted.
    pub boosts: u64,
    /// Priorities restored.
    pub restores: u64,
    /// Boosts refused because the frontend is not alone in its own cpu cgroup.
    pub boost_refused_unconfined: u64,
    /// Notifications that changed no thread, by reason.
    pub yield_skipped: BTreeMap<String, u64>,
    /// Hint pages registered.
    pub hint_page_registrations: u64,
    /// Hint pages unregistered.
    pub hint_page_unregistrations: u64,
    /// Control requests seen.
    pub control_requests: u64,
    /// Bad inputs, by kind.
    pub bad_inputs: BTreeMap<String, u64>,
    /// Wait reports taken from hint pages into the budgets.
    pub wait_reports: u64,
    /// Spin notifications whose waited-for vCPU was descheduled at the last sample (the
    /// notification window resets on those, and doubles on the others).
    pub useful_spin_notifications: u64,
    /// Times `NOT_RUNNING` was set in the vCPU's page, per vCPU.
    pub not_running_set: Vec<u64>,
    /// Spin-before-waiting budget now, per vCPU, ns.
    pub wait_after_ns: Vec<u64>,
    /// Spin-before-notifying budget now, per vCPU, ns (absent with `--yield off`: guests are
    /// told never to notify).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spin_window_ns: Option<Vec<u64>>,
    /// The scheduler sampler's work.
    pub sched: SchedSnapshot,
}

/// What the scheduler sampler read, and what it cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SchedSnapshot {
    /// Sampler passes.
    pub passes: u64,
    /// vCPU threads read (one per registered vCPU per pass).
    pub thread_reads: u64,
    /// CPU time the sampler thread spent reading them, ns (divided by `thread_reads`: the
    /// cost per vCPU per read).
    pub read_ns: u64,
    /// `schedstat` files read.
    pub schedstat_reads: u64,
    /// `stat` files read.
    pub stat_reads: u64,
    /// `status` files read.
    pub status_reads: u64,
}

impl VmSnapshot {
    fn add_into(&self, t: &mut Totals) {
        t.kicks += self.kicks.iter().sum::<u64>();
        t.spin_notifications += self.spin_notifications.iter().sum::<u64>();
        t.deboosts += self.deboosts;
        t.boosts += self.boosts;
        t.boost_refused_unconfined += self.boost_refused_unconfined;
        t.hint_page_registrations += self.hint_page_registrations;
        t.bad_inputs += self.bad_inputs.values().sum::<u64>();
        t.unset_queue_events +=
            self.kicks_unset_queue + self.spins_without_page + self.spins_not_spinning;
        t.paced += self.paced;
        t.wait_reports += self.wait_reports;
        t.not_running_set += self.not_running_set.iter().sum::<u64>();
        t.sched_thread_reads += self.sched.thread_reads;
        t.sched_read_ns += self.sched.read_ns;
    }
}

/// Host-wide sums over every VM served since the daemon started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Kicks delivered.
    pub kicks: u64,
    /// Spin notifications acted on.
    pub spin_notifications: u64,
    /// Deboosts.
    pub deboosts: u64,
    /// Boosts.
    pub boosts: u64,
    /// Boosts refused, unconfined.
    pub boost_refused_unconfined: u64,
    /// Hint pages registered.
    pub hint_page_registrations: u64,
    /// Bad inputs of every kind.
    pub bad_inputs: u64,
    /// Kicks and spin notifications on queues or vCPUs not set up.
    pub unset_queue_events: u64,
    /// Times a VM's worker thread slept at its event rate.
    pub paced: u64,
    /// Wait reports taken into budgets.
    pub wait_reports: u64,
    /// Times `NOT_RUNNING` was set.
    pub not_running_set: u64,
    /// vCPU threads the scheduler sampler read.
    pub sched_thread_reads: u64,
    /// CPU time those reads took, ns.
    pub sched_read_ns: u64,
}

/// The daemon's telemetry: connection counts, the VMs connected now, and totals.
#[derive(Debug, Default)]
pub struct HostTelemetry {
    connections_total: AtomicU64,
    disconnects: AtomicU64,
    /// Socket path → the VM it serves now (`None` while it waits for a frontend).
    sockets: Mutex<BTreeMap<String, Option<Arc<DaemonVmTelemetry>>>>,
    retired: Mutex<Totals>,
}

impl HostTelemetry {
    /// Lists a socket that serves no VM yet.
    pub fn add_socket(&self, socket: &str) {
        self.lock_sockets().insert(socket.to_owned(), None);
    }

    fn lock_sockets(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<String, Option<Arc<DaemonVmTelemetry>>>> {
        self.sockets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A frontend connected on `socket`; its VM counts into `vm`.
    pub fn connected(&self, socket: &str, vm: Arc<DaemonVmTelemetry>) {
        add(&self.connections_total);
        self.lock_sockets().insert(socket.to_owned(), Some(vm));
    }

    /// The frontend on `socket` went away: its counters move into the totals.
    pub fn disconnected(&self, socket: &str) {
        add(&self.disconnects);
        let gone = self.lock_sockets().get_mut(socket).and_then(Option::take);
        if let Some(vm) = gone {
            let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
            vm.snapshot().add_into(&mut retired);
        }
    }

    /// The whole document's data.
    pub fn snapshot(&self) -> DaemonSnapshot {
        let (sockets, vms): (Vec<String>, Vec<VmSnapshot>) = {
            let s = self.lock_sockets();
            (
                s.keys().cloned().collect(),
                s.values().flatten().map(|vm| vm.snapshot()).collect(),
            )
        };
        let mut totals = *self.retired.lock().unwrap_or_else(PoisonError::into_inner);
        for vm in &vms {
            vm.add_into(&mut totals);
        }
        DaemonSnapshot {
            host: HostSnapshot {
                sockets,
                connections_active: vms.len() as u64,
                connections_total: get(&self.connections_total),
                disconnects: get(&self.disconnects),
                totals,
            },
            vms,
        }
    }

    /// The JSON document.
    pub fn render_json(&self) -> String {
        serde_json::to_string_pretty(&self.snapshot()).unwrap_or_else(|_| "{}".to_owned())
    }

    /// The Prometheus text document (exposition format 0.0.4).
    pub fn render_prometheus(&self) -> String {
        render_prometheus(&self.snapshot())
    }
}

/// Host-wide part of the document.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostSnapshot {
    /// The sockets the daemon serves.
    pub sockets: Vec<String>,
    /// Frontends connected now.
    pub connections_active: u64,
    /// Frontends accepted since the daemon started.
    pub connections_total: u64,
    /// Frontends that went away (cleanly or not).
    pub disconnects: u64,
    /// Sums over every VM served since the daemon started.
    pub totals: Totals,
}

/// The telemetry document: host-wide counters and every connected VM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DaemonSnapshot {
    /// Host-wide counters.
    pub host: HostSnapshot,
    /// One entry per connected frontend.
    pub vms: Vec<VmSnapshot>,
}

/// Nanoseconds as a Prometheus seconds value.
fn ns_as_seconds(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

/// Renders a snapshot as Prometheus text.
pub fn render_prometheus(d: &DaemonSnapshot) -> String {
    let mut f = Families::default();
    let h = &d.host;
    f.gauge(
        "pvspin_vhost_connections_active",
        "Frontends connected to pvspind now.",
        &[],
        h.connections_active,
    );
    f.counter(
        "pvspin_vhost_connections_total",
        "Frontends pvspind accepted since it started.",
        &[],
        h.connections_total,
    );
    f.counter(
        "pvspin_vhost_disconnects_total",
        "Frontends that went away, cleanly or not.",
        &[],
        h.disconnects,
    );
    let t = &h.totals;
    for (what, value) in [
        ("kicks", t.kicks),
        ("spin_notifications", t.spin_notifications),
        ("deboosts", t.deboosts),
        ("boosts", t.boosts),
        ("boost_refused_unconfined", t.boost_refused_unconfined),
        ("hint_page_registrations", t.hint_page_registrations),
        ("rejected_guest_inputs", t.bad_inputs),
        ("unset_queue_events", t.unset_queue_events),
        ("paced", t.paced),
        ("wait_reports", t.wait_reports),
        ("not_running_set", t.not_running_set),
        ("sched_thread_reads", t.sched_thread_reads),
    ] {
        f.counter(
            &format!("pvspin_vhost_host_{what}_total"),
            "Sum over every VM pvspind served since it started.",
            &[],
            value,
        );
    }
    for vm in &d.vms {
        let l = || ("vm", vm.vm.clone());
        f.gauge(
            "pvspin_vhost_connected_since_seconds",
            "When the VM's frontend connected (Unix time); pid is the frontend's, empty when unknown.",
            &[
                l(),
                ("pid", vm.peer_pid.map(|p| p.to_string()).unwrap_or_default()),
            ],
            vm.connected_since_unix_s,
        );
        for (i, k) in vm.kicks.iter().enumerate() {
            f.counter(
                "pvspin_kicks_total",
                "Kicks delivered by pvspind: KICK-queue notifications answered on the same queue's call eventfd.",
                &[l(), ("vcpu", i.to_string()), ("path", "vhost_user".to_owned())],
                *k,
            );
        }
        for (i, n) in vm.spin_notifications.iter().enumerate() {
            f.counter(
                "pvspin_spin_notifications_total",
                "Spin notifications from the vCPU (SPIN-queue notifications with a registered hint page).",
                &[l(), ("vcpu", i.to_string())],
                *n,
            );
        }
        f.counter(
            "pvspin_vhost_unset_queue_events_total",
            "Notifications pvspind ignored: kicks on queues not set up, spins without a hint page, unknown queues.",
            &[l(), ("kind", "kick".to_owned())],
            vm.kicks_unset_queue,
        );
        f.counter(
            "pvspin_vhost_unset_queue_events_total",
            "",
            &[l(), ("kind", "spin_without_page".to_owned())],
            vm.spins_without_page,
        );
        f.counter(
            "pvspin_vhost_unset_queue_events_total",
            "",
            &[l(), ("kind", "spin_not_spinning".to_owned())],
            vm.spins_not_spinning,
        );
        f.counter(
            "pvspin_vhost_paced_total",
            "Times the VM's worker thread slept because the VM reached --max-events-per-sec.",
            &[l()],
            vm.paced,
        );
        f.counter(
            "pvspin_vhost_unset_queue_events_total",
            "",
            &[l(), ("kind", "unknown_queue".to_owned())],
            vm.events_unknown_queue,
        );
        for (action, value) in [
            ("deboost", vm.deboosts),
            ("boost", vm.boosts),
            ("restore", vm.restores),
        ] {
            f.counter(
                "pvspin_vhost_yield_actions_total",
                "Thread priority changes pvspind made for directed yield, and restores.",
                &[l(), ("action", action.to_owned())],
                value,
            );
        }
        f.counter(
            "pvspin_vhost_boost_refused_total",
            "Boosts refused because the frontend is not alone in its own cpu cgroup.",
            &[l(), ("reason", "unconfined".to_owned())],
            vm.boost_refused_unconfined,
        );
        for (reason, value) in &vm.yield_skipped {
            f.counter(
                "pvspin_vhost_yield_skipped_total",
                "Spin notifications that changed no thread, by reason.",
                &[l(), ("reason", reason.clone())],
                *value,
            );
        }
        for (op, value) in [
            ("register", vm.hint_page_registrations),
            ("unregister", vm.hint_page_unregistrations),
        ] {
            f.counter(
                "pvspin_vhost_hint_pages_total",
                "Hint-page control requests that succeeded.",
                &[l(), ("op", op.to_owned())],
                value,
            );
        }
        f.counter(
            "pvspin_vhost_control_requests_total",
            "Control-queue requests seen, valid or not.",
            &[l()],
            vm.control_requests,
        );
        for (kind, value) in &vm.bad_inputs {
            f.counter(
                "pvspin_rejected_guest_inputs_total",
                "Guest inputs pvspind rejected, by kind.",
                &[l(), ("kind", kind.clone())],
                *value,
            );
        }
        f.counter(
            "pvspin_hint_wait_reports_total",
            "Wait reports taken from hint pages into the budgets.",
            &[l()],
            vm.wait_reports,
        );
        f.counter(
            "pvspin_vhost_useful_spin_notifications_total",
            "Spin notifications whose waited-for vCPU was descheduled at the last sample.",
            &[l()],
            vm.useful_spin_notifications,
        );
        for (i, ns) in vm.wait_after_ns.iter().enumerate() {
            f.gauge(
                "pvspin_budget_wait_after_seconds",
                "The vCPU's spin budget before waiting (hint page).",
                &[l(), ("vcpu", i.to_string())],
                ns_as_seconds(*ns),
            );
        }
        for (i, ns) in vm.spin_window_ns.iter().flatten().enumerate() {
            f.gauge(
                "pvspin_budget_notify_after_seconds",
                "The vCPU's spin budget before notifying (hint page).",
                &[l(), ("vcpu", i.to_string())],
                ns_as_seconds(*ns),
            );
        }
        for (i, n) in vm.not_running_set.iter().enumerate() {
            f.counter(
                "pvspin_vhost_not_running_set_total",
                "Times pvspind set NOT_RUNNING in the vCPU's hint page (its thread was runnable but descheduled).",
                &[l(), ("vcpu", i.to_string())],
                *n,
            );
        }
        f.counter(
            "pvspin_vhost_sched_passes_total",
            "Scheduler sampler passes over the VM's vCPU threads.",
            &[l()],
            vm.sched.passes,
        );
        f.counter(
            "pvspin_vhost_sched_thread_reads_total",
            "vCPU threads the scheduler sampler read.",
            &[l()],
            vm.sched.thread_reads,
        );
        f.sample(
            "pvspin_vhost_sched_read_seconds_total",
            "counter",
            "CPU time the scheduler sampler spent reading /proc for the VM's vCPU threads.",
            "",
            &[l()],
            ns_as_seconds(vm.sched.read_ns),
        );
        for (file, n) in [
            ("schedstat", vm.sched.schedstat_reads),
            ("stat", vm.sched.stat_reads),
            ("status", vm.sched.status_reads),
        ] {
            f.counter(
                "pvspin_vhost_sched_file_reads_total",
                "/proc files the scheduler sampler read, by file.",
                &[l(), ("file", file.to_owned())],
                n,
            );
        }
    }
    f.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_carry_vm_and_host_counts() {
        let host = HostTelemetry::default();
        host.add_socket("/run/a.sock");
        host.add_socket("/run/b.sock");
        let vm = Arc::new(DaemonVmTelemetry::new("a.sock", "/run/a.sock", 2));
        host.connected("/run/a.sock", vm.clone());
        vm.kick(1);
        vm.kick(1);
        vm.kick(7); // outside: not counted per vCPU
        vm.bad_input(BadInput::ControlVcpu, format_args!("vcpu 9"));
        let json: serde_json::Value = serde_json::from_str(&host.render_json()).unwrap();
        assert_eq!(json["host"]["connections_active"], 1);
        assert_eq!(json["vms"][0]["kicks"][1], 2);
        assert_eq!(json["vms"][0]["bad_inputs"]["control_vcpu"], 1);
        let prom = host.render_prometheus();
        assert!(
            prom.contains("pvspin_kicks_total{vm=\"a.sock\",vcpu=\"1\",path=\"vhost_user\"} 2"),
            "{prom}"
        );
        assert!(prom.contains("# TYPE pvspin_vhost_connections_active gauge"));
        host.disconnected("/run/a.sock");
        let d = host.snapshot();
        assert_eq!(d.host.connections_active, 0);
        assert_eq!(d.host.disconnects, 1);
        assert_eq!(d.host.totals.kicks, 2);
        assert_eq!(d.host.totals.bad_inputs, 1);
    }

    #[test]
    fn logging_is_rate_limited_per_kind() {
        let clock = std::sync::Arc::new(pvspin_kick::ratelimit::ManualClock::new(0));
        let r = bad_input_limiter(clock.clone());
        let key = |k: BadInput| k.index();
        assert_eq!(r.check(key(BadInput::Ring)), Some(0));
        assert_eq!(r.check(key(BadInput::Ring)), None);
        assert_eq!(r.check(key(BadInput::HintRead)), Some(0));
        clock.advance(BAD_INPUT_LOG_INTERVAL_NS);
        assert_eq!(r.check(key(BadInput::Ring)), Some(1));
        // Every kind has its own key.
        for (i, kind) in BadInput::ALL.iter().enumerate() {
            assert_eq!(key(*kind), i);
        }
    }
}
