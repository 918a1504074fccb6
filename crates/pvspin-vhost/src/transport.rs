//! The vhost-user transport for one frontend: the protocol's requests, answered on the
//! socket's thread by a [`Connection`] (the `vhost` crate's backend request handler over
//! pvspind's own handler), and one queue worker thread that waits on every queue's kick
//! eventfd in one epoll set and hands each notification to the device
//! ([`PvspinBackend::handle_notification`]).
//!
//! Why pvspind has a transport of its own: vhost-user-backend's daemon gives each worker
//! thread a 64-bit mask of absolute queue indices, so no queue past 63 reaches a worker (31
//! vCPUs in this device's layout). vhost-user names a queue in 8 bits; this transport serves
//! all 256 ([`virtio::MAX_QUEUES`]), a device of [`virtio::MAX_VCPUS`] vCPUs.
//!
//! What it implements of vhost-user: ownership, virtio and protocol features (`CONFIG`, `MQ`,
//! `REPLY_ACK`), the memory table, split virtqueues (size, addresses, base, kick, call, err,
//! enable, stop), the configuration space (read-only: writes are ignored) and device reset.
//! Everything else (memory slots, inflight descriptors, shared objects, device state,
//! dirty-page logging, postcopy, GPU sockets, rings without a kick eventfd) is refused with
//! an error, which ends the connection.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use pvspin_abi::virtio;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    BackendReqHandler, Error as VhostUserError, GpuBackend, Result as VhostUserResult,
    VhostUserBackendReqHandlerMut, VhostUserVirtioFeatures,
};
use vhost::VhostUserMemoryRegionBase;
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryAtomic, GuestMemoryMmap, GuestRegionMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::{BackendMemory, PvspinBackend, Vring, MAX_QUEUE_SIZE};

/// The queue worker's epoll token for its exit event (queue tokens are queue indices).
const EXIT_TOKEN: u64 = u64::MAX;
/// Events the queue worker takes from one `epoll_wait`.
const WORKER_EVENTS: usize = 64;

/// Errors of setting up one frontend's transport.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum TransportError {
    /// creating virtqueue {0}: {1}
    Vring(usize, virtio_queue::Error),
    /// creating the queue worker's epoll set or exit event: {0}
    Epoll(#[source] io::Error),
    /// starting the queue worker thread: {0}
    Thread(#[source] io::Error),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a queue's kick eventfd held when the worker looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    /// At least one notification, now consumed.
    Notified,
    /// Nothing (the eventfd was replaced or the queue stopped since the epoll event).
    Nothing,
    /// The descriptor is at end of file or in error: it would wake the worker forever.
    Broken,
}

/// One queue's kick eventfd and whether it is in the worker's epoll set.
#[derive(Debug, Default)]
struct KickSlot {
    file: Option<File>,
    armed: bool,
}

/// Every queue's kick eventfd, the epoll set the queue worker waits in, and its exit event.
/// The request handler changes the set; the worker only reads.
#[derive(Debug)]
struct Kicks {
    epoll: Epoll,
    /// Written once to stop the worker, never read: every later wait returns at once.
    exit: EventFd,
    queues: Mutex<Vec<KickSlot>>,
}

impl Kicks {
    fn new(queues: usize) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        let exit = EventFd::new(EFD_NONBLOCK)?;
        epoll.ctl(
            ControlOperation::Add,
            exit.as_raw_fd(),
            EpollEvent::new(EventSet::IN, EXIT_TOKEN),
        )?;
        Ok(Self {
            epoll,
            exit,
            queues: Mutex::new((0..queues).map(|_| KickSlot::default()).collect()),
        })
    }

    fn disarm(&self, slot: &mut KickSlot) {
        if let (true, Some(file)) = (slot.armed, &slot.file) {
            // A descriptor that is no longer in the set is no loss.
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                file.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        slot.armed = false;
    }

    /// Replaces `queue`'s kick eventfd; the old one leaves the epoll set first.
    fn set_file(&self, queue: usize, file: Option<File>) {
        let mut queues = lock(&self.queues);
        if let Some(slot) = queues.get_mut(queue) {
            self.disarm(slot);
            slot.file = file;
        }
    }

    /// Puts `queue`'s kick eventfd in the worker's epoll set (`on`) or takes it out. A
    /// notification that arrived while it was out is still pending in the eventfd, and wakes
    /// the worker once it is in: none is lost.
    fn arm(&self, queue: usize, on: bool) -> io::Result<()> {
        let mut queues = lock(&self.queues);
        let Some(slot) = queues.get_mut(queue) else {
            return Ok(());
        };
        if !on {
            self.disarm(slot);
            return Ok(());
        }
        match (&slot.file, slot.armed) {
            (Some(file), false) => {
                self.epoll.ctl(
                    ControlOperation::Add,
                    file.as_raw_fd(),
                    EpollEvent::new(EventSet::IN, queue as u64),
                )?;
                slot.armed = true;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Takes `queue`'s pending notifications. Never blocks: the worker is the eventfd's only
    /// reader here and reads only what `poll` says is there (the frontend's eventfd may be
    /// blocking, and may have been replaced since the epoll event).
    fn consume(&self, queue: usize) -> Pending {
        let queues = lock(&self.queues);
        let Some(KickSlot {
            file: Some(file),
            armed: true,
        }) = queues.get(queue)
        else {
            return Pending::Nothing;
        };
        let mut pfd = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the length of the call; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
        if ready != 1 {
            return Pending::Nothing;
        }
        if pfd.revents & libc::POLLIN == 0 {
            // Hung up or in error without data: level-triggered, it would wake us forever.
            return Pending::Broken;
        }
        let mut count = [0u8; 8];
        match (&*file).read(&mut count) {
            Ok(0) => Pending::Broken,
            Ok(_) => Pending::Notified,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Pending::Nothing,
            Err(_) => Pending::Broken,
        }
    }
}

/// The queue worker: waits for kick eventfds and the exit event, never spins.
fn run_worker(kicks: &Kicks, vrings: &[Vring], backend: &PvspinBackend) {
    let vm = backend.telemetry().vm().to_owned();
    let mut events = vec![EpollEvent::default(); WORKER_EVENTS];
    loop {
        let n = match kicks.epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::error!("{vm}: queue worker: waiting for notifications: {e}; stopping");
                return;
            }
        };
        for event in &events[..n] {
            let token = event.data();
            if token == EXIT_TOKEN {
                return;
            }
            let queue = token as usize;
            match kicks.consume(queue) {
                Pending::Notified => {
                    if let Err(e) = backend.handle_notification(queue, vrings) {
                        log::debug!("{vm}: queue {queue}: {e}");
                    }
                }
                Pending::Nothing => {}
                Pending::Broken => {
                    log::warn!(
                        "{vm}: queue {queue}'s kick descriptor is closed or in error; \
                         it is not watched any more"
                    );
                    let _ = kicks.arm(queue, false);
                }
            }
        }
    }
}

/// A range of the frontend's address space and the guest addresses it maps (vring addresses
/// arrive as frontend virtual addresses).
#[derive(Clone, Copy, Debug)]
struct Mapping {
    frontend_addr: u64,
    size: u64,
    guest_addr: u64,
}

/// pvspind's answers to one frontend's vhost-user requests.
struct FrontendHandler {
    backend: PvspinBackend,
    vrings: Arc<[Vring]>,
    kicks: Arc<Kicks>,
    memory: BackendMemory,
    mappings: Vec<Mapping>,
    owned: bool,
    acked_features: u64,
    acked_protocol_features: u64,
}

fn refused(what: &'static str) -> VhostUserError {
    VhostUserError::InvalidOperation(what)
}

impl FrontendHandler {
    fn vring(&self, index: u32) -> VhostUserResult<&Vring> {
        self.vrings
            .get(index as usize)
            .ok_or(VhostUserError::InvalidParam)
    }

    /// A queue takes notifications while it is started (has its kick eventfd, not stopped)
    /// and enabled.
    fn rearm(&self, index: usize) -> VhostUserResult<()> {
        let Some(vring) = self.vrings.get(index) else {
            return Err(VhostUserError::InvalidParam);
        };
        let on = {
            let state = vring.get_ref();
            state.get_queue().ready() && state.is_enabled()
        };
        self.kicks
            .arm(index, on)
            .map_err(VhostUserError::ReqHandlerError)
    }

    fn frontend_to_guest(&self, addr: u64) -> VhostUserResult<u64> {
        self.mappings
            .iter()
            .find(|m| addr >= m.frontend_addr && addr - m.frontend_addr < m.size)
            .map(|m| addr - m.frontend_addr + m.guest_addr)
            .ok_or(VhostUserError::InvalidParam)
    }

    /// Stops every queue and forgets the negotiated features (device reset, owner reset).
    fn reset(&mut self) {
        for (index, vring) in self.vrings.iter().enumerate() {
            self.kicks.set_file(index, None);
            vring.set_call(None);
            vring.set_err(None);
            vring.set_enabled(false);
            vring.get_mut().get_queue_mut().reset();
        }
        self.acked_features = 0;
        self.backend.reset_device();
    }
}

impl VhostUserBackendReqHandlerMut for FrontendHandler {
    fn set_owner(&mut self) -> VhostUserResult<()> {
        if self.owned {
            return Err(refused("the device already has an owner"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostUserResult<()> {
        self.owned = false;
        self.acked_protocol_features = 0;
        self.reset();
        Ok(())
    }

    fn reset_device(&mut self) -> VhostUserResult<()> {
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> VhostUserResult<u64> {
        Ok(self.backend.features())
    }

    fn set_features(&mut self, features: u64) -> VhostUserResult<()> {
        if features & !self.backend.features() != 0 {
            return Err(VhostUserError::InvalidParam);
        }
        self.acked_features = features;
        // Without VHOST_USER_F_PROTOCOL_FEATURES every ring is enabled at once (there is no
        // SET_VRING_ENABLE to wait for).
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            for index in 0..self.vrings.len() {
                self.vrings[index].set_enabled(true);
                self.rearm(index)?;
            }
        }
        self.backend.set_acked_features(features);
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> VhostUserResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy_listening.is_some() {
            return Err(refused("postcopy is not supported"));
        }
        let mut mapped = Vec::with_capacity(regions.len());
        let mut mappings = Vec::with_capacity(regions.len());
        for (region, file) in regions.iter().zip(files) {
            let guest = GuestRegionMmap::new(
                region.mmap_region(file)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or(VhostUserError::InvalidParam)?;
            mapped.push(guest);
            mappings.push(Mapping {
                frontend_addr: region.user_addr,
                size: region.memory_size,
                guest_addr: region.guest_phys_addr,
            });
        }
        let memory = GuestMemoryMmap::from_regions(mapped)
            .map_err(|e| VhostUserError::ReqHandlerError(io::Error::other(e)))?;
        // Every vring reads through the same atomic handle: they see the new map at once.
        self.memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(memory);
        self.backend.set_memory(self.memory.clone());
        self.mappings = mappings;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostUserResult<()> {
        if num == 0 || num as usize > MAX_QUEUE_SIZE {
            return Err(VhostUserError::InvalidParam);
        }
        self.vring(index)?.set_queue_size(num as u16);
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhostUserResult<()> {
        let desc = self.frontend_to_guest(descriptor)?;
        let avail = self.frontend_to_guest(available)?;
        let used = self.frontend_to_guest(used)?;
        let vring = self.vring(index)?;
        vring
            .set_queue_info(desc, avail, used)
            .map_err(|_| VhostUserError::InvalidParam)?;
        // A restarted driver's used index is whatever its ring says, not 0.
        let used_idx = vring
            .queue_used_idx()
            .map_err(|_| VhostUserError::InvalidParam)?;
        vring.set_queue_next_used(used_idx);
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostUserResult<()> {
        self.vring(index)?.set_queue_next_avail(base as u16);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostUserResult<VhostUserVringState> {
        // Stops the ring: no notification is taken from here on.
        let vring = self.vring(index)?;
        vring.set_queue_ready(false);
        let next_avail = vring.queue_next_avail();
        vring.set_call(None);
        self.kicks.set_file(index as usize, None);
        Ok(VhostUserVringState::new(index, u32::from(next_avail)))
    }

    fn set_vring_kick(&mut self, index: u8, file: Option<File>) -> VhostUserResult<()> {
        let vring = self.vring(u32::from(index))?;
        let Some(file) = file else {
            return Err(refused(
                "rings without a kick eventfd (polling) are not supported",
            ));
        };
        // The kick starts the ring.
        self.kicks.set_file(usize::from(index), Some(file));
        vring.set_queue_ready(true);
        self.rearm(usize::from(index))
    }

    fn set_vring_call(&mut self, index: u8, file: Option<File>) -> VhostUserResult<()> {
        self.vring(u32::from(index))?.set_call(file);
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, file: Option<File>) -> VhostUserResult<()> {
        self.vring(u32::from(index))?.set_err(file);
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostUserResult<VhostUserProtocolFeatures> {
        Ok(self.backend.protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VhostUserResult<()> {
        self.acked_protocol_features = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostUserResult<u64> {
        Ok(self.vrings.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostUserResult<()> {
        if self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            return Err(refused(
                "SET_VRING_ENABLE needs VHOST_USER_F_PROTOCOL_FEATURES",
            ));
        }
        self.vring(index)?.set_enabled(enable);
        self.rearm(index as usize)
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhostUserResult<Vec<u8>> {
        Ok(self.backend.config_read(offset, size))
    }

    fn set_config(
        &mut self,
        _offset: u32,
        _buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhostUserResult<()> {
        // The configuration space is read-only; virtio ignores writes to it.
        Ok(())
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VhostUserResult<()> {
        Err(refused("GPU sockets are not supported"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostUserResult<File> {
        Err(refused("shared objects are not supported"))
    }

    fn get_inflight_fd(
        &mut self,
        _inflight: &VhostUserInflight,
    ) -> VhostUserResult<(VhostUserInflight, File)> {
        Err(refused("inflight descriptors are not supported"))
    }

    fn set_inflight_fd(
        &mut self,
        _inflight: &VhostUserInflight,
        _file: File,
    ) -> VhostUserResult<()> {
        Err(refused("inflight descriptors are not supported"))
    }

    fn get_max_mem_slots(&mut self) -> VhostUserResult<u64> {
        Err(refused("memory slots are not supported"))
    }

    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VhostUserResult<Option<VhostUserMemoryRegionBase>> {
        Err(refused("memory slots are not supported"))
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> VhostUserResult<()> {
        Err(refused("memory slots are not supported"))
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostUserResult<Option<File>> {
        Err(refused("device state transfer is not supported"))
    }

    fn check_device_state(&mut self) -> VhostUserResult<()> {
        Err(refused("device state transfer is not supported"))
    }

    fn get_shmem_config(&mut self) -> VhostUserResult<VhostUserShMemConfig> {
        Err(refused("shared memory regions are not supported"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VhostUserResult<()> {
        Err(refused("dirty-page logging is not supported"))
    }
}

/// One frontend's transport: the request handler over its socket and the queue worker.
/// Dropping it stops and joins the worker.
pub struct Connection {
    handler: BackendReqHandler<Mutex<FrontendHandler>>,
    kicks: Arc<Kicks>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("kicks", &self.kicks)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Sets up `backend`'s queues for the frontend on `stream` and starts the queue worker
    /// thread (named `worker_name`). Nothing is read from the socket until [`Self::serve`].
    pub fn new(
        backend: PvspinBackend,
        stream: UnixStream,
        worker_name: String,
    ) -> Result<Self, TransportError> {
        let queues = backend.num_queues();
        let memory: BackendMemory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let vrings: Arc<[Vring]> = (0..queues)
            .map(|q| {
                Vring::new(memory.clone(), MAX_QUEUE_SIZE as u16)
                    .map_err(|e| TransportError::Vring(q, e))
            })
            .collect::<Result<_, _>>()?;
        let kicks = Arc::new(Kicks::new(queues).map_err(TransportError::Epoll)?);
        let worker = {
            let (kicks, vrings, backend) = (kicks.clone(), vrings.clone(), backend.clone());
            std::thread::Builder::new()
                .name(worker_name)
                .spawn(move || run_worker(&kicks, &vrings, &backend))
                .map_err(TransportError::Thread)?
        };
        let handler = FrontendHandler {
            backend,
            vrings,
            kicks: kicks.clone(),
            memory,
            mappings: Vec::new(),
            owned: false,
            acked_features: 0,
            acked_protocol_features: 0,
        };
        Ok(Self {
            handler: BackendReqHandler::from_stream(stream, Arc::new(Mutex::new(handler))),
            kicks,
            worker: Some(worker),
        })
    }

    /// Answers the frontend's requests until it disconnects (`Disconnected`, also after the
    /// socket is shut down from another thread) or breaks the protocol: returns why it ended.
    pub fn serve(&mut self) -> VhostUserError {
        loop {
            if let Err(e) = self.handler.handle_request() {
                return e;
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Err(e) = self.kicks.exit.write(1) {
            log::error!("stopping a queue worker: {e}");
            return;
        }
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

// A device of the ABI's most vCPUs fits vhost-user's 8-bit queue index.
const _: () = assert!(virtio::num_queues(virtio::MAX_VCPUS) <= 256);

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::{FromRawFd, IntoRawFd};

    use super::*;

    fn eventfd_file() -> (EventFd, File) {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        // SAFETY: the clone's descriptor is fresh and owned by the File from here on.
        let file = unsafe { File::from_raw_fd(fd.try_clone().unwrap().into_raw_fd()) };
        (fd, file)
    }

    #[test]
    fn kicks_are_consumed_once_and_only_while_armed() {
        let kicks = Kicks::new(256).unwrap();
        let (fd, file) = eventfd_file();
        kicks.set_file(255, Some(file));
        fd.write(1).unwrap();
        // Not armed: the notification waits in the eventfd.
        assert_eq!(kicks.consume(255), Pending::Nothing);
        kicks.arm(255, true).unwrap();
        let mut events = [EpollEvent::default(); 4];
        assert_eq!(kicks.epoll.wait(1000, &mut events).unwrap(), 1);
        assert_eq!(events[0].data(), 255);
        assert_eq!(kicks.consume(255), Pending::Notified);
        assert_eq!(kicks.consume(255), Pending::Nothing);
        assert_eq!(kicks.epoll.wait(0, &mut events).unwrap(), 0);
        // Replacing the eventfd takes the old one out of the set.
        let (fd2, file2) = eventfd_file();
        kicks.set_file(255, Some(file2));
        fd.write(1).unwrap();
        fd2.write(1).unwrap();
        assert_eq!(kicks.epoll.wait(0, &mut events).unwrap(), 0);
        assert_eq!(kicks.consume(255), Pending::Nothing);
        // Queues outside the device are ignored.
        kicks.set_file(256, None);
        kicks.arm(256, true).unwrap();
        assert_eq!(kicks.consume(256), Pending::Nothing);
    }

    #[test]
    fn a_hung_up_kick_descriptor_is_reported_not_spun_on() {
        let kicks = Kicks::new(2).unwrap();
        let (reader, writer) = UnixStream::pair().unwrap();
        // SAFETY: the descriptor is the stream's own, moved into the File.
        let file = unsafe { File::from_raw_fd(reader.into_raw_fd()) };
        kicks.set_file(1, Some(file));
        kicks.arm(1, true).unwrap();
        (&writer).write_all(&[1; 8]).unwrap();
        assert_eq!(kicks.consume(1), Pending::Notified);
        drop(writer);
        assert_eq!(kicks.consume(1), Pending::Broken);
    }

    #[test]
    fn the_worker_exits_on_its_exit_event() {
        let kicks = Kicks::new(1).unwrap();
        kicks.exit.write(1).unwrap();
        let mut events = [EpollEvent::default(); 2];
        assert_eq!(kicks.epoll.wait(0, &mut events).unwrap(), 1);
        assert_eq!(events[0].data(), EXIT_TOKEN);
        // Never read: it still says exit.
        assert_eq!(kicks.epoll.wait(0, &mut events).unwrap(), 1);
    }
}
