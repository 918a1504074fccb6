//! `--pv-backend vhost-user:PATH`: the pvspin virtio device (`pvspin_abi::virtio`) presented to
//! the guest over a minimal virtio-mmio (version 2) transport, with its queues served out of
//! process by a vhost-user backend (`pvspind`) through the vhost crate's frontend.
//!
//! What the VMM does here is what any vhost-user frontend does, plus the one choice pvspin
//! needs: **each kick queue's call eventfd is an irqfd on a GSI routed to a REMRD MSI at the
//! kicked vCPU's APIC ID**, so the backend's answer sets KVM's `pv_unhalted` (a kick that
//! ends a `cli; hlt`, remembered when it comes early) without a VMM exit. Every queue's
//! `QueueNotify` write is an ioeventfd (data-matched on the queue index), so a kick reaches
//! the backend without a VMM exit either.
//!
//! **Backend loss.** When the backend's socket hangs up, the VMM's event loop relays kicks
//! itself (kick eventfd -> call eventfd) and wakes every vCPU once (a kick the backend had
//! read but not answered is not lost: the guest re-checks after any wake), and tries to
//! reconnect every [`RECONNECT_EVERY`]. After a reconnection it replays the device state
//! (features, memory table, every ready queue), notifies each queue once (a request the lost
//! backend took but did not answer is answered by the new one) and stops relaying. A new
//! backend has no hint-page registrations: the budgets already published stay in guest
//! memory, and the VMM changes the device's `ConfigGeneration`, which tells the guest to
//! register again (until it does, the backend ignores its spin notifications).

use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use kvm_bindings::KvmIrqRouting;
use kvm_ioctls::{IoEventAddress, VmFd};
use pvspin_abi::virtio::{self, QueueRole};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::memory::VmMemory;
use crate::virtio_mmio::{MmioEffect, MmioRegisters, QUEUE_NOTIFY, STATUS_DRIVER_OK};

/// How often the VMM tries to reconnect to a lost backend.
pub const RECONNECT_EVERY: Duration = Duration::from_millis(100);
/// The largest queue the device offers (`QueueNumMax`).
const QUEUE_NUM_MAX: u16 = 256;
/// The most queues a vhost-user device can have: `SET_VRING_KICK`, `SET_VRING_CALL` and
/// `SET_VRING_ERR` carry the vring index in bits 0..7 of their payload (bit 8 says "no
/// descriptor"), so a queue index past 255 cannot be given its eventfds. The device's layout
/// fits that at every size up to the ABI's 255 vCPUs (`virtio::spin_queues`).
const VHOST_USER_MAX_QUEUES: usize = 256;
const _: () = assert!(virtio::num_queues(virtio::MAX_VCPUS) <= VHOST_USER_MAX_QUEUES);

const VIRTIO_F_VERSION_1: u64 = 1 << virtio::F_VERSION_1;

/// Why the device could not be set up or started.
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    /// Connecting to the backend's socket failed.
    #[error("connecting to the vhost-user backend at {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A vhost-user request failed.
    #[error("vhost-user {what}: {source}")]
    Request {
        /// The request.
        what: &'static str,
        /// The cause.
        #[source]
        source: vhost::Error,
    },
    /// The backend does not offer what the device needs.
    #[error("the vhost-user backend cannot serve the pvspin device: {0}")]
    Backend(String),
    /// A KVM registration failed.
    #[error("{what}: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory is not shareable (the backend maps it from a file descriptor).
    #[error("guest memory cannot be shared with the backend: {0}")]
    Memory(String),
}

fn request(what: &'static str) -> impl FnOnce(vhost::Error) -> VhostError {
    move |source| VhostError::Request { what, source }
}

/// Counters of the frontend, for the run report.
#[derive(Debug, Default)]
pub struct FrontendStats {
    /// Successful connections to a backend (the first one included).
    pub connects: AtomicU64,
    /// Times the backend's socket hung up.
    pub backend_losses: AtomicU64,
    /// Kicks the VMM relayed itself while no backend was connected.
    pub relayed_kicks: AtomicU64,
    /// Notifications the VMM sent a new backend, one per queue it serves, so that it looks at
    /// requests posted before it came.
    pub replayed_notifications: AtomicU64,
    /// Device starts (`DRIVER_OK`) that failed.
    pub start_failures: AtomicU64,
    /// Guest accesses to the window that no register takes (wrong width, unknown offset).
    pub bad_accesses: AtomicU64,
}

/// What the report shows of the frontend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FrontendSummary {
    /// See [`FrontendStats::connects`].
    pub connects: u64,
    /// See [`FrontendStats::backend_losses`].
    pub backend_losses: u64,
    /// See [`FrontendStats::relayed_kicks`].
    pub relayed_kicks: u64,
    /// See [`FrontendStats::replayed_notifications`].
    pub replayed_notifications: u64,
    /// See [`FrontendStats::start_failures`].
    pub start_failures: u64,
    /// See [`FrontendStats::bad_accesses`].
    pub bad_accesses: u64,
}

/// A connected backend.
struct Link {
    frontend: Frontend,
    virtio_features: u64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("virtio_features", &self.virtio_features)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Connects once (no retries: the caller decides when to try again) and negotiates the
    /// protocol; returns the link and the device's configuration space.
    fn open(path: &Path) -> Result<(Self, [u8; virtio::config::SIZE]), VhostError> {
        let stream = UnixStream::connect(path).map_err(|source| VhostError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let mut frontend = Frontend::from_stream(stream, VHOST_USER_MAX_QUEUES as u64);
        frontend.set_owner().map_err(request("SET_OWNER"))?;
        let features = frontend.get_features().map_err(request("GET_FEATURES"))?;
        let protocol_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if features & protocol_bit == 0 || features & VIRTIO_F_VERSION_1 == 0 {
            return Err(VhostError::Backend(format!(
                "features {features:#x} lack VHOST_USER_F_PROTOCOL_FEATURES or VIRTIO_F_VERSION_1"
            )));
        }
        let offered = frontend
            .get_protocol_features()
            .map_err(request("GET_PROTOCOL_FEATURES"))?;
        let needed = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ;
        if !offered.contains(needed) {
            return Err(VhostError::Backend(format!(
                "protocol features {offered:?} lack CONFIG or MQ"
            )));
        }
        frontend
            .set_protocol_features(needed)
            .map_err(request("SET_PROTOCOL_FEATURES"))?;
        let (_, bytes) = frontend
            .get_config(
                0,
                virtio::config::SIZE as u32,
                VhostUserConfigFlags::WRITABLE,
                &[0; virtio::config::SIZE],
            )
            .map_err(request("GET_CONFIG"))?;
        let config: [u8; virtio::config::SIZE] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| VhostError::Backend("config space of the wrong size".into()))?;
        Ok((
            Self {
                frontend,
                virtio_features: features & !protocol_bit,
            },
            config,
        ))
    }
}

/// The device's state: the transport registers, the queues' eventfds and the backend link.
#[derive(Debug)]
struct State {
    link: Option<Link>,
    regs: MmioRegisters,
    /// Per queue index: the kick and call eventfds, when the VM uses the queue.
    fds: Vec<Option<(EventFd, EventFd)>>,
}

/// The pvspin virtio device of one VM, with its vhost-user link.
pub struct VhostPvspin {
    path: PathBuf,
    base: u64,
    vcpus: u32,
    max_vcpus: u32,
    memory: VmMemory,
    regions: Vec<VhostUserMemoryRegionInfo>,
    /// Kick queues wired inside KVM (`connect`'s `direct_kicks`).
    direct_kicks: bool,
    state: Mutex<State>,
    stats: FrontendStats,
}

impl std::fmt::Debug for VhostPvspin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostPvspin")
            .field("path", &self.path)
            .field("base", &self.base)
            .field("vcpus", &self.vcpus)
            .field("max_vcpus", &self.max_vcpus)
            .finish_non_exhaustive()
    }
}

impl VhostPvspin {
    /// Connects to the backend at `path`, checks it can serve `vcpus` vCPUs, and wires the
    /// VM: an ioeventfd per queue on `QueueNotify` at `base + 0x50`, and for each kick queue
    /// an irqfd on a GSI routed to a REMRD MSI at that vCPU (the routing table is the
    /// default irqchip routes plus these: call after creating the in-kernel irqchip and
    /// before any other routes are set). With `direct_kicks` a kick queue's ioeventfd is its
    /// irqfd's eventfd, so kicks stay in KVM and the backend is not given the kick queues.
    pub fn connect(
        path: &Path,
        base: u64,
        vcpus: u32,
        memory: VmMemory,
        vm: &VmFd,
        direct_kicks: bool,
    ) -> Result<Arc<Self>, VhostError> {
        let (link, config) = Link::open(path)?;
        let max_vcpus = u32::from_le_bytes(
            config[virtio::config::MAX_VCPUS..virtio::config::MAX_VCPUS + 4]
                .try_into()
                .unwrap_or([0; 4]),
        );
        if max_vcpus > virtio::MAX_VCPUS || vcpus > max_vcpus {
            return Err(VhostError::Backend(format!(
                "it serves {max_vcpus} vCPUs, the VM has {vcpus}"
            )));
        }
        if virtio::num_queues(max_vcpus) > VHOST_USER_MAX_QUEUES {
            return Err(VhostError::Backend(format!(
                "its device has {} queues for {max_vcpus} vCPUs, and vhost-user names a vring in 8 bits (at most {VHOST_USER_MAX_QUEUES} queues)",
                virtio::num_queues(max_vcpus)
            )));
        }
        let regions = memory
            .iter()
            .map(|region| {
                VhostUserMemoryRegionInfo::from_guest_region(region)
                    .map_err(|err| VhostError::Memory(err.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut fds: Vec<Option<(EventFd, EventFd)>> =
            (0..virtio::num_queues(max_vcpus)).map(|_| None).collect();
        let mut routes = pvspin_kvm::irqchip::default_irqchip_routes();
        let notify = IoEventAddress::Mmio(base + QUEUE_NOTIFY);
        for (index, queue_fds) in fds.iter_mut().enumerate() {
            let used = match virtio::queue_role(max_vcpus, index) {
                Some(QueueRole::Control) => true,
                Some(QueueRole::Kick(v) | QueueRole::Spin(v)) => v < vcpus,
                None => false,
            };
            if !used {
                continue;
            }
            let eventfd = || {
                EventFd::new(libc::EFD_NONBLOCK)
                    .map_err(|source| VhostError::Backend(format!("eventfd: {source}")))
            };
            let call = eventfd()?;
            let kick_queue = matches!(
                virtio::queue_role(max_vcpus, index),
                Some(QueueRole::Kick(_))
            );
            // Direct kicks: the guest's notification signals the target's irqfd itself.
            let kick = if direct_kicks && kick_queue {
                call.try_clone()
                    .map_err(|source| VhostError::Backend(format!("eventfd: {source}")))?
            } else {
                eventfd()?
            };
            vm.register_ioevent(&kick, &notify, index as u32)
                .map_err(|source| VhostError::Kvm {
                    what: "KVM_IOEVENTFD on QueueNotify",
                    source,
                })?;
            if let Some(QueueRole::Kick(v)) = virtio::queue_role(max_vcpus, index) {
                // The kick queues' irqfds take the GSIs after the IOAPIC's pins.
                let gsi = pvspin_kvm::irqchip::FIRST_FREE_GSI + v;
                routes.push(
                    pvspin_kvm::irqchip::remrd_route(gsi, v)
                        .map_err(|err| VhostError::Backend(err.to_string()))?,
                );
                vm.register_irqfd(&call, gsi)
                    .map_err(|source| VhostError::Kvm {
                        what: "KVM_IRQFD for a kick queue",
                        source,
                    })?;
            }
            *queue_fds = Some((kick, call));
        }
        let table = KvmIrqRouting::from_entries(&routes)
            .map_err(|err| VhostError::Backend(format!("routing table: {err:?}")))?;
        vm.set_gsi_routing(&table)
            .map_err(|source| VhostError::Kvm {
                what: "KVM_SET_GSI_ROUTING",
                source,
            })?;
        let device = Arc::new(Self {
            path: path.to_path_buf(),
            base,
            vcpus,
            max_vcpus,
            memory,
            regions,
            direct_kicks,
            state: Mutex::new(State {
                regs: MmioRegisters::new(
                    virtio::DEVICE_ID,
                    link.virtio_features,
                    config.to_vec(),
                    QUEUE_NUM_MAX,
                    fds.iter().map(Option::is_some).collect(),
                ),
                link: Some(link),
                fds,
            }),
            stats: FrontendStats::default(),
        });
        device.stats.connects.fetch_add(1, Ordering::Relaxed);
        Ok(device)
    }

    /// The guest physical window of the registers.
    pub fn window(&self) -> std::ops::Range<u64> {
        self.base..self.base + pvspin_test_vm_proto::VIRTIO_MMIO_SIZE
    }

    /// The frontend's counters.
    pub fn summary(&self) -> FrontendSummary {
        let s = &self.stats;
        FrontendSummary {
            connects: s.connects.load(Ordering::Relaxed),
            backend_losses: s.backend_losses.load(Ordering::Relaxed),
            relayed_kicks: s.relayed_kicks.load(Ordering::Relaxed),
            replayed_notifications: s.replayed_notifications.load(Ordering::Relaxed),
            start_failures: s.start_failures.load(Ordering::Relaxed),
            bad_accesses: s.bad_accesses.load(Ordering::Relaxed),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bad_access(&self, what: &str, offset: u64) {
        if self.stats.bad_accesses.fetch_add(1, Ordering::Relaxed) == 0 {
            log::warn!("pvspin virtio device: ignoring a {what} at offset {offset:#x} (further ones counted, not logged)");
        }
    }

    /// A guest read of `data.len()` bytes at `addr` (inside [`Self::window`]).
    pub fn read(&self, addr: u64, data: &mut [u8]) {
        let offset = addr - self.base;
        if let Err(why) = self.state().regs.read(offset, data) {
            self.bad_access(why, offset);
        }
    }

    /// A guest write of `data` at `addr` (inside [`Self::window`]).
    pub fn write(&self, addr: u64, data: &[u8]) {
        let offset = addr - self.base;
        let mut state = self.state();
        match state.regs.write(offset, data) {
            MmioEffect::None => {}
            MmioEffect::Bad(why) => self.bad_access(why, offset),
            MmioEffect::Start => {
                if let Err(err) = self.start(&mut state) {
                    log::error!(
                        "pvspin virtio device: starting the backend's queues failed: {err}"
                    );
                    self.stats.start_failures.fetch_add(1, Ordering::Relaxed);
                    state.regs.start_failed();
                }
            }
            MmioEffect::Reset => {
                // The backend stops its rings; the driver starts over (the registers are
                // reset already, so every queue the VM has is disabled).
                let State { link, fds, .. } = &mut *state;
                if let Some(link) = link.as_mut() {
                    for index in fds
                        .iter()
                        .enumerate()
                        .filter_map(|(i, f)| f.as_ref().map(|_| i))
                    {
                        let _ = link.frontend.set_vring_enable(index, false);
                    }
                }
            }
        }
    }

    fn hva(&self, gpa: u64) -> Result<u64, VhostError> {
        self.memory
            .get_host_address(GuestAddress(gpa))
            .map(|ptr| ptr as u64)
            .map_err(|err| VhostError::Backend(format!("ring address {gpa:#x}: {err}")))
    }

    /// Gives the backend the device state: features, memory, every ready queue.
    fn start(&self, state: &mut State) -> Result<(), VhostError> {
        let State { link, regs, fds } = state;
        let link = link
            .as_mut()
            .ok_or_else(|| VhostError::Backend("no backend connected".into()))?;
        let features = regs.driver_features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let frontend = &mut link.frontend;
        frontend
            .set_features(features)
            .map_err(request("SET_FEATURES"))?;
        frontend
            .set_mem_table(&self.regions)
            .map_err(request("SET_MEM_TABLE"))?;
        for (index, queue) in regs.ready_queues() {
            let Some((kick, call)) = fds.get(index).and_then(Option::as_ref) else {
                continue;
            };
            if !self.served_by_backend(index) {
                continue;
            }
            let ring = VringConfigData {
                queue_max_size: QUEUE_NUM_MAX,
                queue_size: queue.num,
                flags: 0,
                desc_table_addr: self.hva(queue.desc)?,
                used_ring_addr: self.hva(queue.device)?,
                avail_ring_addr: self.hva(queue.driver)?,
                log_addr: None,
            };
            // A reconnected backend continues where the device is: the used index in guest
            // memory (offset 2 of the used ring) is where it left off.
            let used_idx: u16 =
                vm_memory::Bytes::read_obj(&self.memory, GuestAddress(queue.device + 2))
                    .unwrap_or(0);
            frontend
                .set_vring_num(index, queue.num)
                .map_err(request("SET_VRING_NUM"))?;
            frontend
                .set_vring_addr(index, &ring)
                .map_err(request("SET_VRING_ADDR"))?;
            frontend
                .set_vring_base(index, used_idx)
                .map_err(request("SET_VRING_BASE"))?;
            frontend
                .set_vring_call(index, call)
                .map_err(request("SET_VRING_CALL"))?;
            frontend
                .set_vring_kick(index, kick)
                .map_err(request("SET_VRING_KICK"))?;
            frontend
                .set_vring_enable(index, true)
                .map_err(request("SET_VRING_ENABLE"))?;
        }
        Ok(())
    }

    /// Whether the backend is given queue `index`: all but the kick queues with direct kicks,
    /// which KVM delivers (their kick eventfd is the kicked vCPU's irqfd).
    fn served_by_backend(&self, index: usize) -> bool {
        let kick_queue = matches!(
            virtio::queue_role(self.max_vcpus, index),
            Some(QueueRole::Kick(_))
        );
        !(self.direct_kicks && kick_queue)
    }

    /// Notifies every queue the backend serves once (a spurious notification, which virtio
    /// allows): a request the lost backend had taken, its notification read, but not answered
    /// is still in the ring past the used index the new backend starts from, and with no
    /// notification left it would wait there for the guest's next one. The guest's control
    /// queue has no next one: a request in flight holds it.
    fn notify_all(&self, state: &State) {
        for (index, _) in state.regs.ready_queues() {
            if !self.served_by_backend(index) {
                continue;
            }
            let Some((kick, _)) = state.fds.get(index).and_then(Option::as_ref) else {
                continue;
            };
            if kick.write(1).is_ok() {
                self.stats
                    .replayed_notifications
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Wakes every vCPU once through its kick queue's irqfd (a spurious wake-up, which the
    /// ABI allows): covers a kick a lost backend had taken but not answered.
    fn wake_all(&self, state: &State) {
        for (index, queue_fds) in state.fds.iter().enumerate() {
            if let (Some(QueueRole::Kick(_)), Some((_, call))) = (
                virtio::queue_role(self.max_vcpus, index),
                queue_fds.as_ref(),
            ) {
                let _ = call.write(1);
            }
        }
    }

    /// The kick queues' indices and eventfds (for the relay; none with direct kicks, which
    /// KVM delivers with or without a backend).
    fn kick_queue_fds(&self, state: &State) -> Vec<(u32, i32)> {
        if self.direct_kicks {
            return Vec::new();
        }
        let max_vcpus = self.max_vcpus;
        state
            .fds
            .iter()
            .enumerate()
            .filter_map(
                |(index, queue_fds)| match virtio::queue_role(max_vcpus, index) {
                    Some(QueueRole::Kick(_)) => queue_fds
                        .as_ref()
                        .map(|(kick, _)| (index as u32, kick.as_raw_fd())),
                    _ => None,
                },
            )
            .collect()
    }

    /// The backend's socket descriptor, while connected.
    fn socket_fd(&self) -> Option<i32> {
        self.state()
            .link
            .as_ref()
            .map(|link| link.frontend.as_raw_fd())
    }

    /// Drops the link (the backend's socket hung up) and wakes every vCPU once.
    fn lose_backend(&self) {
        let mut state = self.state();
        if state.link.take().is_some() {
            self.stats.backend_losses.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "pvspin virtio device: the backend at {} went away; the VMM relays kicks until it is back",
                self.path.display()
            );
        }
        self.wake_all(&state);
    }

    /// One reconnection attempt; on success the device state is replayed if the driver had
    /// started the device.
    fn try_reconnect(&self) -> bool {
        let (link, config) = match Link::open(&self.path) {
            Ok(opened) => opened,
            Err(err) => {
                log::debug!("reconnecting: {err}");
                return false;
            }
        };
        let mut state = self.state();
        if config.as_slice() != state.regs.config()
            || link.virtio_features != state.regs.device_features()
        {
            log::warn!(
                "pvspin virtio device: the new backend's configuration differs; not using it"
            );
            return false;
        }
        state.link = Some(link);
        if state.regs.status() & STATUS_DRIVER_OK != 0 {
            if let Err(err) = self.start(&mut state) {
                log::warn!("pvspin virtio device: replaying the device state failed: {err}");
                state.link = None;
                return false;
            }
        }
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        // The new backend has none of the driver's hint-page registrations: a new
        // ConfigGeneration tells the driver to register again.
        state.regs.bump_config_generation();
        self.notify_all(&state);
        self.wake_all(&state);
        log::info!(
            "pvspin virtio device: reconnected to {}",
            self.path.display()
        );
        true
    }

    /// Relays one kick while no backend is connected.
    fn relay(&self, queue: u32) {
        let state = self.state();
        if let Some((kick, call)) = state.fds.get(queue as usize).and_then(Option::as_ref) {
            if kick.read().is_ok() {
                let _ = call.write(1);
                self.stats.relayed_kicks.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// vCPUs the device serves.
    pub fn vcpus(&self) -> u32 {
        self.vcpus
    }
}

/// Event-loop data of the backend socket and the reconnect timer (queue indices are below).
const SOCKET_DATA: u32 = u32::MAX;
const TIMER_DATA: u32 = u32::MAX - 1;

/// The VMM event loop's part: watches the backend's socket, relays kicks while it is gone,
/// and reconnects.
#[derive(Debug)]
pub struct BackendWatch {
    device: Arc<VhostPvspin>,
    timer: TimerFd,
    watched_socket: Option<i32>,
}

impl BackendWatch {
    /// A watch over `device`'s link.
    pub fn new(device: Arc<VhostPvspin>) -> std::io::Result<Self> {
        Ok(Self {
            device,
            timer: TimerFd::new()?,
            watched_socket: None,
        })
    }

    fn watch_socket(&mut self, ops: &mut EventOps) {
        if let Some(fd) = self.device.socket_fd() {
            // Only hang-ups: replies to the vCPU threads' requests make it readable too.
            let events = Events::with_data_raw(fd, SOCKET_DATA, EventSet::READ_HANG_UP);
            match ops.add(events) {
                Ok(()) => self.watched_socket = Some(fd),
                Err(err) => log::error!("cannot watch the vhost-user socket: {err:?}"),
            }
        }
    }

    fn relay_fds(&self) -> Vec<(u32, i32)> {
        let state = self.device.state();
        self.device.kick_queue_fds(&state)
    }
}

impl MutEventSubscriber for BackendWatch {
    fn init(&mut self, ops: &mut EventOps) {
        self.watch_socket(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            SOCKET_DATA => {
                if let Some(fd) = self.watched_socket.take() {
                    let _ = ops.remove(Events::with_data_raw(
                        fd,
                        SOCKET_DATA,
                        EventSet::READ_HANG_UP,
                    ));
                }
                for (queue, fd) in self.relay_fds() {
                    if let Err(err) = ops.add(Events::with_data_raw(fd, queue, EventSet::IN)) {
                        log::error!("cannot relay kicks of queue {queue}: {err:?}");
                    }
                }
                self.device.lose_backend();
                if let Err(err) = self.timer.reset(RECONNECT_EVERY, Some(RECONNECT_EVERY)) {
                    log::error!("cannot arm the reconnect timer: {err}");
                }
                if let Err(err) = ops.add(Events::with_data(&self.timer, TIMER_DATA, EventSet::IN))
                {
                    log::error!("cannot watch the reconnect timer: {err:?}");
                }
            }
            TIMER_DATA => {
                let _ = self.timer.wait();
                if self.device.try_reconnect() {
                    for (queue, fd) in self.relay_fds() {
                        let _ = ops.remove(Events::with_data_raw(fd, queue, EventSet::IN));
                    }
                    let _ = ops.remove(Events::with_data(&self.timer, TIMER_DATA, EventSet::IN));
                    self.watch_socket(ops);
                }
            }
            queue => self.device.relay(queue),
        }
    }
}
