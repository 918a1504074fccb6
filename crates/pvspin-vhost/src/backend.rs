//! The vhost-user backend of the pvspin virtio device: kicks, spin notifications, the
//! control queue and the configuration space, for one frontend.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pvspin_abi::doorbell::{SpinNotify, SHARED_PAGE_SIZE};
use pvspin_abi::hint;
use pvspin_abi::virtio::{self, ControlRequest, QueueRole};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserVirtioFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::BackendConfig;
use crate::telemetry::{BadInput, VmTelemetry};
use crate::yield_policy::{ProcThreads, ThreadActions, YieldPolicy};

/// The guest memory type the backend works on.
pub type GuestMemory = GuestMemoryAtomic<GuestMemoryMmap<()>>;
/// The vring type the backend works on.
pub type Vring = VringRwLock<GuestMemory>;

/// Largest queue the backend accepts (control queue; kick and spin queues need 1).
pub const MAX_QUEUE_SIZE: usize = 256;
/// Most descriptors of one control chain the backend walks (a valid one has 2).
const MAX_CHAIN_DESCRIPTORS: usize = 4;

/// The virtio feature bits the device offers.
pub const DEVICE_FEATURES: u64 = (1 << virtio::F_VERSION_1)
    | (1 << virtio::F_SPIN_NOTIFY)
    | (1 << virtio::F_HINT_PAGES)
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// Errors of the backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The configuration is refused.
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
}

/// The thread actions a backend uses (boxed so tests and the fuzz target can fake them).
pub type BoxedActions = Box<dyn ThreadActions>;

#[derive(Debug)]
struct DeviceState {
    acked_features: u64,
    memory: Option<GuestMemory>,
    /// Registered hint pages, per vCPU.
    hint_pages: Vec<Option<u64>>,
}

struct Inner {
    config: BackendConfig,
    telemetry: Arc<VmTelemetry>,
    state: Mutex<DeviceState>,
    yields: Mutex<YieldPolicy<BoxedActions>>,
    /// Wakes the restore timer when a new deadline exists or the backend stops.
    timer: Condvar,
    stopping: AtomicBool,
    /// The read ends of the worker threads' exit events. vhost-user-backend hands them to
    /// its epoll as raw descriptors and never closes them; the server closes them once the
    /// workers are gone ([`PvspinBackend::close_exit_events`]).
    exit_consumers: Mutex<Vec<RawFd>>,
    /// Events handled in the current pacing window.
    pacing: Mutex<Pacing>,
}

/// The pacing window: events handled since `start`.
#[derive(Debug)]
struct Pacing {
    start: Instant,
    events: u32,
}

/// Length of a pacing window.
const PACING_WINDOW: Duration = Duration::from_millis(1);

/// The pvspin device backend for one frontend. Cheap to clone (shared state): the
/// vhost-user-backend daemon clones it into its worker threads.
#[derive(Clone)]
pub struct PvspinBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PvspinBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PvspinBackend")
            .field("vm", &self.inner.telemetry.vm())
            .field("max_vcpus", &self.inner.config.max_vcpus)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the control queue did in one pass (for tests and the fuzz target).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlPass {
    /// Chains returned to the driver.
    pub chains: usize,
    /// Whether the queue's call eventfd was signalled.
    pub signalled: bool,
}

impl PvspinBackend {
    /// A backend acting on the real threads of the frontend (procfs, setpriority).
    pub fn new(config: BackendConfig, telemetry: Arc<VmTelemetry>) -> Result<Self, BackendError> {
        let actions = Box::new(ProcThreads::new(config.thread_patterns.clone()));
        Self::with_actions(config, telemetry, actions)
    }

    /// A backend acting through `actions`.
    pub fn with_actions(
        config: BackendConfig,
        telemetry: Arc<VmTelemetry>,
        actions: BoxedActions,
    ) -> Result<Self, BackendError> {
        config.validate()?;
        let policy = YieldPolicy::new(
            config.yield_mode,
            config.nice_step,
            config.adjust_for,
            actions,
        );
        Ok(Self {
            inner: Arc::new(Inner {
                state: Mutex::new(DeviceState {
                    acked_features: 0,
                    memory: None,
                    hint_pages: vec![None; config.max_vcpus as usize],
                }),
                config,
                telemetry,
                yields: Mutex::new(policy),
                timer: Condvar::new(),
                stopping: AtomicBool::new(false),
                exit_consumers: Mutex::new(Vec::new()),
                pacing: Mutex::new(Pacing {
                    start: Instant::now(),
                    events: 0,
                }),
            }),
        })
    }

    /// The VM's counters.
    pub fn telemetry(&self) -> &Arc<VmTelemetry> {
        &self.inner.telemetry
    }

    /// The configuration.
    pub fn config(&self) -> &BackendConfig {
        &self.inner.config
    }

    /// Sets the frontend's pid (from its peer credentials; `None` when unknown).
    pub fn set_peer_pid(&self, pid: Option<u32>) {
        self.inner.telemetry.set_peer_pid(pid);
        lock(&self.inner.yields).set_peer(pid);
    }

    /// The hint page registered for `vcpu`, if any.
    pub fn hint_page(&self, vcpu: u32) -> Option<u64> {
        lock(&self.inner.state)
            .hint_pages
            .get(vcpu as usize)
            .copied()
            .flatten()
    }

    /// How many thread priorities the backend has changed now.
    pub fn adjusted_threads(&self) -> usize {
        lock(&self.inner.yields).adjusted()
    }

    /// Forgets hint pages and acked features and restores every changed priority (device
    /// reset, frontend gone).
    pub fn forget(&self) {
        {
            let mut s = lock(&self.inner.state);
            s.acked_features = 0;
            s.hint_pages.iter_mut().for_each(|p| *p = None);
        }
        lock(&self.inner.yields).restore_all(&self.inner.telemetry);
    }

    /// Restores every priority change whose deadline passed; returns how long until the next
    /// one (for the restore timer).
    pub fn expire_adjustments(&self, now: Instant) -> Option<Duration> {
        let mut y = lock(&self.inner.yields);
        y.expire(now, &self.inner.telemetry);
        y.next_deadline().map(|d| d.saturating_duration_since(now))
    }

    /// Runs the restore timer until [`Self::stop`]: sleeps until the next deadline (never
    /// spins), restores what is due. Run it on a thread of its own.
    pub fn run_restore_timer(&self) {
        let mut y = lock(&self.inner.yields);
        while !self.inner.stopping.load(Ordering::Acquire) {
            let now = Instant::now();
            y.expire(now, &self.inner.telemetry);
            let wait = y
                .next_deadline()
                .map(|d| {
                    d.saturating_duration_since(now)
                        .max(Duration::from_micros(100))
                })
                .unwrap_or(Duration::from_secs(1));
            y = self
                .inner
                .timer
                .wait_timeout(y, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        y.restore_all(&self.inner.telemetry);
    }

    /// Stops the restore timer (it restores everything on its way out) and forgets the
    /// device state.
    pub fn stop(&self) {
        self.inner.stopping.store(true, Ordering::Release);
        // `forget` takes the lock the timer waits under, so the timer is either waiting (and
        // woken next) or sees `stopping` before it waits: no lost wake-up.
        self.forget();
        self.inner.timer.notify_all();
    }

    /// Closes the exit-event descriptors vhost-user-backend leaves open. Call it only after
    /// the worker threads exited and the daemon was dropped: until then its epoll uses them.
    pub fn close_exit_events(&self) {
        for fd in lock(&self.inner.exit_consumers).drain(..) {
            // SAFETY: `fd` came from an EventConsumer that vhost-user-backend turned into a
            // raw descriptor and registered in an epoll that no longer exists (the caller's
            // contract); nothing else owns or closes it.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }

    fn acked(&self, bit: u32) -> bool {
        lock(&self.inner.state).acked_features & (1 << bit) != 0
    }

    /// The configuration space bytes `offset..offset + size` (empty when outside).
    pub fn config_read(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = virtio::config::encode(self.inner.config.max_vcpus);
        let start = offset as usize;
        match start.checked_add(size as usize) {
            Some(end) if end <= space.len() => space[start..end].to_vec(),
            _ => {
                self.inner.telemetry.bad_input(
                    BadInput::ConfigRead,
                    format_args!("config read of {size} bytes at {offset}"),
                );
                Vec::new()
            }
        }
    }

    /// Counts one handled event at `now`; past the VM's rate
    /// ([`BackendConfig::max_events_per_sec`]) returns how long its worker thread should
    /// sleep: to the end of the current window.
    pub fn pace(&self, now: Instant) -> Option<Duration> {
        let per_window = (self.inner.config.max_events_per_sec / 1000).max(1);
        let mut pacing = lock(&self.inner.pacing);
        let elapsed = now.saturating_duration_since(pacing.start);
        if elapsed >= PACING_WINDOW {
            pacing.start = now;
            pacing.events = 0;
        }
        pacing.events += 1;
        if pacing.events < per_window {
            return None;
        }
        self.inner.telemetry.paced();
        Some(PACING_WINDOW.saturating_sub(now.saturating_duration_since(pacing.start)))
    }

    /// Handles a notification on queue `queue`. Returns whether a call eventfd was
    /// signalled. Never fails on guest input: bad input is counted.
    pub fn handle_queue_event(&self, queue: usize, vrings: &[Vring]) -> io::Result<bool> {
        let tel = &self.inner.telemetry;
        let (Some(role), Some(vring)) = (
            virtio::queue_role(self.inner.config.max_vcpus, queue),
            vrings.get(queue),
        ) else {
            tel.event_unknown_queue();
            return Ok(false);
        };
        match role {
            QueueRole::Kick(vcpu) => Ok(self.kick(vcpu, vring)),
            QueueRole::Spin(vcpu) => {
                self.spin(vcpu);
                Ok(false)
            }
            QueueRole::Control => Ok(self.process_control(vring).signalled),
        }
    }

    fn kick(&self, vcpu: u32, vring: &Vring) -> bool {
        let tel = &self.inner.telemetry;
        let set_up = {
            let v = vring.get_ref();
            v.get_queue().ready() && v.get_call().is_some()
        };
        if !set_up {
            tel.kick_unset_queue();
            return false;
        }
        // No EVENT_IDX is offered, so there is no suppression to honour: the call is the kick.
        match vring.signal_used_queue() {
            Ok(()) => {
                tel.kick(vcpu);
                true
            }
            Err(err) => {
                log::debug!("{}: signalling kick queue of vCPU {vcpu}: {err}", tel.vm());
                tel.kick_unset_queue();
                false
            }
        }
    }

    fn spin(&self, vcpu: u32) {
        let tel = &self.inner.telemetry;
        let (page, memory) = {
            let s = lock(&self.inner.state);
            (
                s.hint_pages.get(vcpu as usize).copied().flatten(),
                s.memory.clone(),
            )
        };
        let (Some(gpa), Some(memory)) = (page, memory) else {
            tel.spin_without_page();
            return;
        };
        // One load of a guest-line field; a page the memory no longer covers is bad input.
        let field = |offset: usize| -> Option<u32> {
            match memory
                .memory()
                .load(GuestAddress(gpa + offset as u64), Ordering::Acquire)
            {
                Ok(v) => Some(v),
                Err(err) => {
                    tel.bad_input(
                        BadInput::HintRead,
                        format_args!("vCPU {vcpu} page {gpa:#x}: {err}"),
                    );
                    None
                }
            }
        };
        // The ABI: a notifying vCPU has said in its page that it spins (or waits). An event
        // without that is vhost-user-backend's one pass over each queue it enables, or a
        // stray notify: acting on it would deboost a vCPU that waits for nothing.
        let Some(state) = field(hint::SPIN_STATE) else {
            return;
        };
        if state != hint::SPIN_SPINNING && state != hint::SPIN_WAITING {
            tel.spin_not_spinning();
            return;
        }
        let Some(value) = field(hint::WAITING_FOR) else {
            return;
        };
        tel.spin_notification(vcpu);
        let target = match SpinNotify::decode(value).waiting_for {
            Some(h) if u32::from(h) < self.inner.config.max_vcpus && u32::from(h) != vcpu => {
                Some(u32::from(h))
            }
            Some(h) => {
                tel.bad_input(
                    BadInput::SpinTarget,
                    format_args!("vCPU {vcpu} waits for vCPU {h}"),
                );
                None
            }
            None => None,
        };
        let mut y = lock(&self.inner.yields);
        y.on_spin(vcpu, target, Instant::now(), tel);
        drop(y);
        self.inner.timer.notify_all();
    }

    /// Processes the control queue: at most one queue's worth of chains per call.
    pub fn process_control(&self, vring: &Vring) -> ControlPass {
        let tel = &self.inner.telemetry;
        let Some(memory) = lock(&self.inner.state).memory.clone() else {
            tel.bad_input(
                BadInput::Ring,
                format_args!("control queue event before SET_MEM_TABLE"),
            );
            return ControlPass::default();
        };
        let mem = memory.memory();
        let mut pass = ControlPass::default();
        {
            let mut v = vring.get_mut();
            let queue = v.get_queue_mut();
            if !queue.ready() {
                tel.bad_input(BadInput::Ring, format_args!("control queue not ready"));
                return pass;
            }
            let cap = usize::from(queue.size()).max(1);
            while pass.chains < cap {
                let Some(chain) = queue.pop_descriptor_chain(&*mem) else {
                    break;
                };
                let head = chain.head_index();
                let descriptors: Vec<_> = chain.take(MAX_CHAIN_DESCRIPTORS + 1).collect();
                let used_len = self.control_chain(&descriptors, &mem);
                if let Err(err) = queue.add_used(&*mem, head, used_len) {
                    tel.bad_input(BadInput::Ring, format_args!("control add_used: {err}"));
                    break;
                }
                pass.chains += 1;
            }
        }
        if pass.chains > 0 {
            pass.signalled = vring.signal_used_queue().is_ok();
        }
        pass
    }

    /// Handles one control chain; returns the used length (4 when a status was written).
    fn control_chain(
        &self,
        descriptors: &[virtio_queue::desc::split::Descriptor],
        mem: &GuestMemoryMmap<()>,
    ) -> u32 {
        let tel = &self.inner.telemetry;
        tel.control_request();
        let status_at = descriptors
            .last()
            .filter(|d| d.is_write_only() && d.len() >= 4)
            .map(|d| d.addr());
        let request = match descriptors {
            [req, status]
                if !req.is_write_only()
                    && req.len() as usize == ControlRequest::SIZE
                    && status.is_write_only()
                    && status.len() >= 4 =>
            {
                let mut bytes = [0u8; ControlRequest::SIZE];
                mem.read_slice(&mut bytes, req.addr())
                    .ok()
                    .and_then(|()| ControlRequest::from_bytes(&bytes))
            }
            _ => None,
        };
        let status = match request {
            Some(r) => self.control_request(&r, mem),
            None => {
                tel.bad_input(
                    BadInput::ControlChain,
                    format_args!("control chain of {} descriptors", descriptors.len()),
                );
                virtio::STATUS_BAD_REQUEST
            }
        };
        let Some(at) = status_at else { return 0 };
        match mem.write_obj(status.to_le(), at) {
            Ok(()) => 4,
            Err(err) => {
                tel.bad_input(
                    BadInput::Ring,
                    format_args!("writing control status: {err}"),
                );
                0
            }
        }
    }

    /// Executes one well-formed control request; returns its status.
    fn control_request(&self, r: &ControlRequest, mem: &GuestMemoryMmap<()>) -> u32 {
        let tel = &self.inner.telemetry;
        if r.op != virtio::OP_REGISTER_HINT_PAGE {
            tel.bad_input(BadInput::ControlOp, format_args!("op {}", r.op));
            return virtio::STATUS_BAD_REQUEST;
        }
        if !self.acked(virtio::F_HINT_PAGES) {
            tel.bad_input(
                BadInput::ControlUnsupported,
                format_args!("F_HINT_PAGES not acked"),
            );
            return virtio::STATUS_UNSUPPORTED;
        }
        if r.vcpu >= self.inner.config.max_vcpus {
            tel.bad_input(BadInput::ControlVcpu, format_args!("vCPU {}", r.vcpu));
            return virtio::STATUS_BAD_VCPU;
        }
        if r.gpa == 0 {
            self.set_page(r.vcpu, None);
            tel.registration(false);
            return virtio::STATUS_OK;
        }
        if r.gpa % SHARED_PAGE_SIZE != 0
            || !mem.check_range(GuestAddress(r.gpa), SHARED_PAGE_SIZE as usize)
        {
            tel.bad_input(BadInput::ControlAddress, format_args!("page {:#x}", r.gpa));
            return virtio::STATUS_BAD_ADDRESS;
        }
        if let Err(err) = self.write_host_line(r.gpa, r.arg, mem) {
            tel.bad_input(
                BadInput::ControlAddress,
                format_args!("page {:#x}: {err}", r.gpa),
            );
            return virtio::STATUS_BAD_ADDRESS;
        }
        self.set_page(r.vcpu, Some(r.gpa));
        tel.registration(true);
        virtio::STATUS_OK
    }

    fn set_page(&self, vcpu: u32, gpa: Option<u64>) {
        if let Some(slot) = lock(&self.inner.state).hint_pages.get_mut(vcpu as usize) {
            *slot = gpa;
        }
    }

    /// Writes the host line of the page at `gpa` (budgets for a `tsc_khz` guest clock), then
    /// publishes it by incrementing HOST_SEQ with release ordering.
    fn write_host_line(
        &self,
        gpa: u64,
        tsc_khz: u64,
        mem: &GuestMemoryMmap<()>,
    ) -> Result<(), vm_memory::GuestMemoryError> {
        // A frequency that does not fit the field is no frequency a guest has: treat as unknown.
        let khz = u32::try_from(tsc_khz).unwrap_or(0);
        let b = self.inner.config.budgets.to_tsc(u64::from(khz));
        let at = |off: usize| GuestAddress(gpa + off as u64);
        let relaxed = Ordering::Relaxed;
        mem.store(hint::LAYOUT_VERSION, at(hint::LAYOUT), relaxed)?;
        mem.store(0u32, at(hint::HOST_FLAGS), relaxed)?;
        mem.store(b.spin_window, at(hint::SPIN_WINDOW_TSC), relaxed)?;
        mem.store(b.wait_after, at(hint::WAIT_AFTER_TSC), relaxed)?;
        mem.store(khz, at(hint::TSC_KHZ), relaxed)?;
        mem.store(b.wait_after_min, at(hint::WAIT_AFTER_MIN_TSC), relaxed)?;
        mem.store(b.wait_after_max, at(hint::WAIT_AFTER_MAX_TSC), relaxed)?;
        // The host is HOST_SEQ's only writer, so load + store is an increment.
        let seq: u32 = mem.load(at(hint::HOST_SEQ), relaxed)?;
        mem.store(seq.wrapping_add(1), at(hint::HOST_SEQ), Ordering::Release)
    }

    /// Replaces the guest memory (SET_MEM_TABLE). Hint pages stay registered by address and
    /// are read through the new memory.
    pub fn set_memory(&self, memory: GuestMemory) {
        lock(&self.inner.state).memory = Some(memory);
    }

    /// Records the features the driver acked.
    pub fn set_acked_features(&self, features: u64) {
        lock(&self.inner.state).acked_features = features;
    }
}

impl VhostUserBackend for PvspinBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.inner.config.num_queues()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        DEVICE_FEATURES
    }

    fn acked_features(&self, features: u64) {
        self.set_acked_features(features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn reset_device(&self) {
        self.forget();
    }

    fn set_event_idx(&self, _enabled: bool) {
        // EVENT_IDX is not offered.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.config_read(offset, size)
    }

    fn update_memory(&self, mem: GuestMemory) -> io::Result<()> {
        self.set_memory(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // One worker thread for every queue (the default mask covers only 32).
        let n = self.num_queues().min(64) as u32;
        vec![u64::MAX >> (64 - n)]
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) =
            new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()?;
        lock(&self.inner.exit_consumers).push(consumer.as_raw_fd());
        Some((consumer, notifier))
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        let result = self
            .handle_queue_event(usize::from(device_event), vrings)
            .map(|_| ());
        if let Some(pause) = self.pace(Instant::now()) {
            // Sleeps, never spins: this VM's notifications wait in their eventfds.
            std::thread::sleep(pause);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::{FromRawFd, IntoRawFd};

    use pvspin_abi::virtio::{
        ControlRequest, OP_REGISTER_HINT_PAGE, STATUS_BAD_ADDRESS, STATUS_BAD_REQUEST,
        STATUS_BAD_VCPU, STATUS_OK, STATUS_UNSUPPORTED,
    };
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::config::YieldMode;
    use crate::testing::{Desc, SplitRing};
    use crate::yield_policy::tests::FakeThreads;

    const MEM_SIZE: u64 = 0x10_0000;
    const REQ_AT: u64 = 0x8000;
    const STATUS_AT: u64 = 0x9000;
    const PAGE: u64 = 0x2_0000;
    const ALL_FEATURES: u64 = DEVICE_FEATURES;

    struct Rig {
        backend: PvspinBackend,
        mem: GuestMemory,
        vrings: Vec<Vring>,
        calls: Vec<Option<EventFd>>,
    }

    impl Rig {
        fn new(mode: YieldMode, confined: bool, acked: u64) -> Self {
            let config = BackendConfig {
                max_vcpus: 4,
                yield_mode: mode,
                ..BackendConfig::default()
            };
            let tel = Arc::new(VmTelemetry::new("t", "/t", 4));
            let backend = PvspinBackend::with_actions(
                config,
                tel,
                Box::new(FakeThreads::new(7, 4, confined)),
            )
            .unwrap();
            backend.set_peer_pid(Some(7));
            let mem = GuestMemoryAtomic::new(
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
            );
            backend.set_memory(mem.clone());
            backend.set_acked_features(acked);
            let n = backend.num_queues();
            let vrings = (0..n)
                .map(|_| Vring::new(mem.clone(), MAX_QUEUE_SIZE as u16).unwrap())
                .collect();
            Self {
                backend,
                mem,
                vrings,
                calls: (0..n).map(|_| None).collect(),
            }
        }

        fn set_up(&mut self, q: usize, base: u64, size: u16) -> SplitRing {
            let ring = SplitRing::new(&*self.mem.memory(), GuestAddress(base), size).unwrap();
            let v = &self.vrings[q];
            v.set_queue_size(size);
            v.set_queue_info(ring.desc_table.0, ring.avail.0, ring.used.0)
                .unwrap();
            v.set_queue_ready(true);
            let call = EventFd::new(EFD_NONBLOCK).unwrap();
            // SAFETY: the clone's descriptor is fresh and owned by the File from here on.
            let file = unsafe { File::from_raw_fd(call.try_clone().unwrap().into_raw_fd()) };
            v.set_call(Some(file));
            self.calls[q] = Some(call);
            ring
        }

        fn signalled(&self, q: usize) -> bool {
            self.calls[q].as_ref().is_some_and(|c| c.read().is_ok())
        }

        /// Posts `descs`, runs the control queue, returns (status word, used len).
        fn post(&mut self, ring: &mut SplitRing, descs: &[Desc]) -> (u32, u32) {
            let m = self.mem.memory();
            m.write_obj(0xdead_beefu32, GuestAddress(STATUS_AT))
                .unwrap();
            let before = ring.used_idx(&*m).unwrap();
            ring.add_chain(&*m, descs).unwrap();
            let pass = self.backend.process_control(&self.vrings[0]);
            assert_eq!(pass.chains, 1);
            assert!(pass.signalled && self.signalled(0));
            assert_eq!(ring.used_idx(&*m).unwrap(), before.wrapping_add(1));
            let (_, len) = ring.used_elem(&*m, before).unwrap();
            (m.read_obj(GuestAddress(STATUS_AT)).unwrap(), len)
        }

        fn request(&mut self, ring: &mut SplitRing, r: ControlRequest) -> u32 {
            self.mem
                .memory()
                .write_slice(&r.to_bytes(), GuestAddress(REQ_AT))
                .unwrap();
            let (status, len) = self.post(ring, &good_chain());
            assert_eq!(len, 4);
            status
        }

        fn host<T: vm_memory::AtomicAccess>(&self, off: usize) -> T {
            self.mem
                .memory()
                .load(GuestAddress(PAGE + off as u64), Ordering::Acquire)
                .unwrap()
        }
    }

    fn good_chain() -> [Desc; 2] {
        Desc::control_chain(REQ_AT, STATUS_AT)
    }

    fn register(vcpu: u32, gpa: u64, khz: u64) -> ControlRequest {
        ControlRequest {
            op: OP_REGISTER_HINT_PAGE,
            vcpu,
            gpa,
            arg: khz,
        }
    }

    #[test]
    fn registration_writes_the_host_line() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mut ring = rig.set_up(0, 0x1000, 8);
        assert_eq!(
            rig.request(&mut ring, register(2, PAGE, 2_000_000)),
            STATUS_OK
        );
        assert_eq!(rig.backend.hint_page(2), Some(PAGE));
        assert_eq!(rig.host::<u32>(hint::LAYOUT), hint::LAYOUT_VERSION);
        assert_eq!(rig.host::<u64>(hint::SPIN_WINDOW_TSC), 40_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_TSC), 100_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_MIN_TSC), 10_000);
        assert_eq!(rig.host::<u64>(hint::WAIT_AFTER_MAX_TSC), 2_000_000);
        assert_eq!(rig.host::<u32>(hint::TSC_KHZ), 2_000_000);
        assert_eq!(rig.host::<u32>(hint::HOST_SEQ), 1);
        // Unknown frequency: no time budgets, and the sequence moves on.
        assert_eq!(rig.request(&mut ring, register(2, PAGE, 0)), STATUS_OK);
        assert_eq!(rig.host::<u64>(hint::SPIN_WINDOW_TSC), u64::MAX);
        assert_eq!(rig.host::<u32>(hint::HOST_SEQ), 2);
        // gpa 0 unregisters.
        assert_eq!(rig.request(&mut ring, register(2, 0, 0)), STATUS_OK);
        assert_eq!(rig.backend.hint_page(2), None);
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(
            (s.hint_page_registrations, s.hint_page_unregistrations),
            (2, 1)
        );
    }

    #[test]
    fn bad_requests_get_their_status() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mut ring = rig.set_up(0, 0x1000, 8);
        let cases = [
            (register(4, PAGE, 1), STATUS_BAD_VCPU),
            (register(u32::MAX, PAGE, 1), STATUS_BAD_VCPU),
            (register(0, PAGE + 8, 1), STATUS_BAD_ADDRESS),
            (register(0, MEM_SIZE, 1), STATUS_BAD_ADDRESS),
            (register(0, !0xfff, 1), STATUS_BAD_ADDRESS),
            (
                ControlRequest {
                    op: 9,
                    ..register(0, PAGE, 1)
                },
                STATUS_BAD_REQUEST,
            ),
        ];
        for (req, want) in cases {
            assert_eq!(rig.request(&mut ring, req), want, "{req:?}");
        }
        // The last page of memory is fine.
        assert_eq!(
            rig.request(&mut ring, register(0, MEM_SIZE - 4096, 1)),
            STATUS_OK
        );
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.bad_inputs["control_vcpu"], 2);
        assert_eq!(s.bad_inputs["control_address"], 3);
        assert_eq!(s.bad_inputs["control_op"], 1);

        let mut no_pages = Rig::new(YieldMode::Deboost, false, 1 << virtio::F_VERSION_1);
        let mut ring = no_pages.set_up(0, 0x1000, 8);
        assert_eq!(
            no_pages.request(&mut ring, register(0, PAGE, 1)),
            STATUS_UNSUPPORTED
        );
        assert_eq!(no_pages.backend.hint_page(0), None);
    }

    #[test]
    fn malformed_chains_are_rejected() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let mut ring = rig.set_up(0, 0x1000, 8);
        rig.mem
            .memory()
            .write_slice(&register(0, PAGE, 1).to_bytes(), GuestAddress(REQ_AT))
            .unwrap();
        let [req, status] = good_chain();
        let short = Desc { len: 23, ..req };
        let long = Desc { len: 25, ..req };
        let writable_req = Desc { write: true, ..req };
        let tiny_status = Desc { len: 3, ..status };
        let readable_status = Desc {
            write: false,
            ..status
        };
        // A status can be written: BAD_REQUEST, used length 4.
        for chain in [
            vec![short, status],
            vec![long, status],
            vec![writable_req, status],
            vec![req, req, status],
            vec![status],
        ] {
            assert_eq!(
                rig.post(&mut ring, &chain),
                (STATUS_BAD_REQUEST, 4),
                "{chain:?}"
            );
        }
        // No status can be written: the chain comes back with used length 0, memory untouched.
        for chain in [
            vec![req, tiny_status],
            vec![req, readable_status],
            vec![req],
        ] {
            assert_eq!(rig.post(&mut ring, &chain), (0xdead_beef, 0), "{chain:?}");
        }
        // A request buffer outside memory is a bad chain too.
        let outside = Desc {
            addr: MEM_SIZE + 0x1000,
            ..req
        };
        assert_eq!(
            rig.post(&mut ring, &[outside, status]),
            (STATUS_BAD_REQUEST, 4)
        );
        assert_eq!(rig.backend.hint_page(0), None);
        assert_eq!(
            rig.backend.telemetry().bad_inputs(BadInput::ControlChain),
            9
        );
    }

    #[test]
    fn control_work_per_event_is_bounded() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let ring = rig.set_up(0, 0x1000, 4);
        // The driver claims 1000 chains are available: one pass takes at most a queue's worth.
        let m = rig.mem.memory();
        m.store(1000u16, GuestAddress(ring.avail.0 + 2), Ordering::Release)
            .unwrap();
        for i in 0..4u16 {
            ring.write_desc(&*m, i, STATUS_AT, 4, crate::testing::DESC_F_WRITE, 0)
                .unwrap();
        }
        drop(m);
        let pass = rig.backend.process_control(&rig.vrings[0]);
        assert!(pass.chains <= 4, "{pass:?}");
    }

    #[test]
    fn kicks_signal_their_own_queue_only() {
        let mut rig = Rig::new(YieldMode::Deboost, false, ALL_FEATURES);
        let k1 = virtio::kick_queue(4, 1).unwrap() as usize;
        let k2 = virtio::kick_queue(4, 2).unwrap() as usize;
        rig.set_up(k1, 0x4000, 1);
        rig.set_up(k2, 0x6000, 1);
        assert!(rig.backend.handle_queue_event(k1, &rig.vrings).unwrap());
        assert!(rig.signalled(k1));
        assert!(!rig.signalled(k2));
        // vCPU 3's kick queue is not set up: counted, nothing signalled.
        let k3 = virtio::kick_queue(4, 3).unwrap() as usize;
        assert!(!rig.backend.handle_queue_event(k3, &rig.vrings).unwrap());
        // No such queue.
        assert!(!rig.backend.handle_queue_event(999, &rig.vrings).unwrap());
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.kicks, vec![0, 1, 0, 0]);
        assert_eq!((s.kicks_unset_queue, s.events_unknown_queue), (1, 1));
    }

    fn spin_rig(mode: YieldMode, confined: bool, waiting_for: Option<u16>) -> Rig {
        let mut rig = Rig::new(mode, confined, ALL_FEATURES);
        let mut ring = rig.set_up(0, 0x1000, 8);
        assert_eq!(
            rig.request(&mut ring, register(0, PAGE, 1_000_000)),
            STATUS_OK
        );
        let n = SpinNotify {
            waiting_for,
            next_owner: false,
            spun_bucket: 3,
            lock_hash: 5,
        };
        rig.mem
            .memory()
            .store(
                n.encode(),
                GuestAddress(PAGE + hint::WAITING_FOR as u64),
                Ordering::Release,
            )
            .unwrap();
        let s0 = virtio::spin_queue(4, 0).unwrap() as usize;
        // Not yet marked spinning in the page: ignored (what the enable-time pass looks like).
        assert!(!rig.backend.handle_queue_event(s0, &rig.vrings).unwrap());
        let s = rig.backend.telemetry().snapshot();
        assert_eq!((s.spins_not_spinning, s.deboosts), (1, 0));
        rig.mem
            .memory()
            .store(
                hint::SPIN_SPINNING,
                GuestAddress(PAGE + hint::SPIN_STATE as u64),
                Ordering::Release,
            )
            .unwrap();
        assert!(!rig.backend.handle_queue_event(s0, &rig.vrings).unwrap());
        rig
    }

    #[test]
    fn spin_notifications_reach_the_yield_policy() {
        let rig = spin_rig(YieldMode::Confined, true, Some(2));
        let s = rig.backend.telemetry().snapshot();
        assert_eq!(s.spin_notifications, vec![1, 0, 0, 0]);
        assert_eq!((s.deboosts, s.boosts), (1, 1));
        assert_eq!(rig.backend.adjusted_threads(), 2);
        // Reset forgets the pages and restores the threads.
        rig.backend.forget();
        assert_eq!(rig.backend.hint_page(0), None);
        assert_eq!(rig.backend.adjusted_threads(), 0);
        assert_eq!(rig.backend.telemetry().snapshot().restores, 2);

        let refused = spin_rig(YieldMode::Confined, false, Some(2));
        let s = refused.backend.telemetry().snapshot();
        assert_eq!(
            (s.deboosts, s.boosts, s.boost_refused_unconfined),
            (1, 0, 1)
        );

        let out_of_range = spin_rig(YieldMode::Confined, true, Some(9));
        let s = out_of_range.backend.telemetry().snapshot();
        assert_eq!((s.deboosts, s.boosts), (1, 0));
        assert_eq!(s.bad_inputs["spin_target"], 1);

        // vCPU 1 has no page: counted and ignored.
        let s1 = virtio::spin_queue(4, 1).unwrap() as usize;
        out_of_range
            .backend
            .handle_queue_event(s1, &out_of_range.vrings)
            .unwrap();
        assert_eq!(
            out_of_range
                .backend
                .telemetry()
                .snapshot()
                .spins_without_page,
            1
        );
    }

    #[test]
    fn a_vm_past_its_event_rate_is_paused_to_the_end_of_the_window() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        // Past the window the backend started with: the first call opens a new one.
        let t0 = Instant::now() + Duration::from_millis(5);
        // Default rate: 20 events per 1 ms window; the 20th pauses.
        for _ in 0..19 {
            assert_eq!(rig.backend.pace(t0), None);
        }
        let pause = rig.backend.pace(t0 + Duration::from_micros(300)).unwrap();
        assert_eq!(pause, Duration::from_micros(700));
        assert_eq!(rig.backend.telemetry().snapshot().paced, 1);
        // A new window starts afresh.
        assert_eq!(rig.backend.pace(t0 + Duration::from_millis(2)), None);
        let refused = BackendConfig {
            max_events_per_sec: 999,
            ..BackendConfig::default()
        };
        assert!(refused.validate().is_err());
    }

    #[test]
    fn config_reads_are_bounds_checked() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        let full = rig.backend.get_config(0, virtio::config::SIZE as u32);
        assert_eq!(full, virtio::config::encode(4).to_vec());
        assert_eq!(rig.backend.get_config(8, 4), 5u32.to_le_bytes().to_vec());
        for (off, size) in [(0, 17), (16, 1), (15, 2), (u32::MAX, 4), (4, u32::MAX)] {
            assert!(rig.backend.get_config(off, size).is_empty(), "{off} {size}");
        }
        assert_eq!(rig.backend.get_config(16, 0), Vec::<u8>::new());
        assert_eq!(rig.backend.telemetry().bad_inputs(BadInput::ConfigRead), 5);
    }

    #[test]
    fn offers_the_device_features_and_queue_masks() {
        let rig = Rig::new(YieldMode::Off, false, 0);
        let f = rig.backend.features();
        assert_ne!(f & (1 << virtio::F_VERSION_1), 0);
        assert_ne!(f & (1 << virtio::F_SPIN_NOTIFY), 0);
        assert_ne!(f & (1 << virtio::F_HINT_PAGES), 0);
        assert_eq!(rig.backend.num_queues(), 9);
        assert_eq!(rig.backend.queues_per_thread(), vec![0x1ff]);
        assert!(rig
            .backend
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    }
}
