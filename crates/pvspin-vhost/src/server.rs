//! The daemon's sockets: each vhost-user socket serves one frontend at a time on a thread of
//! its own, with a fresh [`PvspinBackend`] and [`Connection`] per frontend; a control socket
//! answers telemetry requests; [`Server::shutdown`] stops everything and restores every
//! changed priority.
//!
//! A socket's thread answers its frontend's requests itself until the frontend goes (or
//! shutdown hangs up its socket). Between connections it sleeps in a vmm-sys-util `Epoll`
//! over its listener and the server's exit `EventFd`, so shutdown wakes it at once and an
//! idle daemon makes no wake-ups.

use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use vhost::vhost_user::Error as VhostUserError;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::PvspinBackend;
use crate::config::{BackendConfig, DaemonConfigError};
use crate::telemetry::{DaemonVmTelemetry, HostTelemetry};
use crate::transport::{Connection, TransportError};

/// Longest a control-socket client may take to send its request or read the answer.
const CONTROL_IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Errors of starting the server.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[ignore_extra_doc_attributes]
pub enum ServerError {
    /// {0}
    ///
    /// The backend configuration is refused.
    Config(#[from] DaemonConfigError),
    /// no --socket given
    NoSockets,
    /// {0} exists and is not a socket: refusing to replace it
    NotASocket(PathBuf),
    /// {0} is a live socket (another daemon serves it)
    InUse(PathBuf),
    /// binding {path}: {source}
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// starting a thread: {0}
    Thread(io::Error),
    /// creating the shutdown event or a socket's epoll set: {0}
    Wait(io::Error),
}

/// Why one frontend connection could not be served (logged; the socket thread goes on).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
enum ConnectionError {
    /// {0}
    Backend(#[from] crate::backend::BackendError),
    /// {0}
    Transport(#[from] TransportError),
    /// accepting a frontend: {0}
    Accept(#[source] io::Error),
}

/// What the daemon serves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// vhost-user sockets, one frontend each at a time.
    pub sockets: Vec<PathBuf>,
    /// The telemetry control socket.
    pub control: Option<PathBuf>,
    /// The backend every connection gets.
    pub backend: BackendConfig,
}

/// Removes a stale socket at `path` (nothing listens on it); refuses other files and live
/// sockets.
pub fn prepare_socket_path(path: &Path) -> Result<(), ServerError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ServerError::NotASocket(path.to_owned()));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(ServerError::InUse(path.to_owned()));
    }
    std::fs::remove_file(path).map_err(|source| ServerError::Bind {
        path: path.to_owned(),
        source,
    })
}

fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    prepare_socket_path(path)?;
    UnixListener::bind(path).map_err(|source| ServerError::Bind {
        path: path.to_owned(),
        source,
    })
}

/// What woke a socket thread waiting between connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// A client is waiting to be accepted.
    Client,
    /// The server is shutting down.
    Exit,
}

const LISTENER_TOKEN: u64 = 0;
const EXIT_TOKEN: u64 = 1;

/// An epoll set over one listener and the server's exit event. The exit event is written
/// once and never read, so it wakes every socket thread, now and at each later wait.
struct ListenWait {
    epoll: Epoll,
}

impl ListenWait {
    fn new(listener: &UnixListener, exit: &EventFd) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        for (fd, token) in [
            (listener.as_raw_fd(), LISTENER_TOKEN),
            (exit.as_raw_fd(), EXIT_TOKEN),
        ] {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        Ok(Self { epoll })
    }

    /// Sleeps until a client arrives or the server stops (shutdown wins when both).
    fn wait(&self) -> io::Result<Wake> {
        let mut events = [EpollEvent::default(); 2];
        loop {
            match self.epoll.wait(-1, &mut events) {
                Ok(n) => {
                    let ready = &events[..n];
                    if ready.iter().any(|e| e.data() == EXIT_TOKEN) {
                        return Ok(Wake::Exit);
                    }
                    if !ready.is_empty() {
                        return Ok(Wake::Client);
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
    }
}

/// The pid of a connected socket's peer, from its credentials (`SO_PEERCRED`).
fn peer_pid(fd: BorrowedFd<'_>) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len point to a ucred and its size, as SO_PEERCRED expects.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid as u32)
}

/// One socket's shared state.
struct Slot {
    path: PathBuf,
    /// The connected frontend's socket (a clone), for shutdown to hang up.
    active: Mutex<Option<UnixStream>>,
}

/// The running daemon.
pub struct Server {
    stop: Arc<AtomicBool>,
    /// Written once by [`Server::shutdown`] to wake the threads waiting for clients.
    exit: EventFd,
    host: Arc<HostTelemetry>,
    slots: Vec<Arc<Slot>>,
    control: Option<PathBuf>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field(
                "sockets",
                &self.slots.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("control", &self.control)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds every socket (refusing on the first error, before serving anything) and starts
    /// a thread per socket and one for the control socket.
    pub fn start(config: &ServerConfig) -> Result<Self, ServerError> {
        config.backend.validate()?;
        if config.sockets.is_empty() {
            return Err(ServerError::NoSockets);
        }
        let mut listeners = Vec::new();
        for path in &config.sockets {
            listeners.push((path.clone(), bind(path)?));
        }
        let control = match &config.control {
            Some(path) => Some((path.clone(), bind(path)?)),
            None => None,
        };
        let exit = EventFd::new(EFD_NONBLOCK).map_err(ServerError::Wait)?;
        let mut waits = Vec::new();
        for (_, listener) in listeners.iter().chain(control.iter()) {
            waits.push(ListenWait::new(listener, &exit).map_err(ServerError::Wait)?);
        }
        let mut waits = waits.into_iter();
        let mut server = Self {
            stop: Arc::new(AtomicBool::new(false)),
            exit,
            host: Arc::new(HostTelemetry::default()),
            slots: Vec::new(),
            control: config.control.clone(),
            threads: Vec::new(),
        };
        for (path, listener) in listeners {
            server.host.add_socket(&path.to_string_lossy());
            let slot = Arc::new(Slot {
                path,
                active: Mutex::new(None),
            });
            server.slots.push(slot.clone());
            let (stop, host, backend) = (
                server.stop.clone(),
                server.host.clone(),
                config.backend.clone(),
            );
            let name = format!("pvspind-{}", socket_label(&slot.path));
            let wait = waits.next().expect("one wait set per listener");
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || serve_socket(&slot, &listener, &wait, &backend, &host, &stop))
                .map_err(ServerError::Thread)?;
            server.threads.push(t);
        }
        if let Some((_, listener)) = control {
            let (stop, host) = (server.stop.clone(), server.host.clone());
            let wait = waits.next().expect("one wait set per listener");
            let t = std::thread::Builder::new()
                .name("pvspind-control".into())
                .spawn(move || serve_control(&listener, &wait, &host, &stop))
                .map_err(ServerError::Thread)?;
            server.threads.push(t);
        }
        Ok(server)
    }

    /// The daemon's telemetry.
    pub fn telemetry(&self) -> &Arc<HostTelemetry> {
        &self.host
    }

    /// Stops serving: disconnects every frontend (their backends restore priorities), joins
    /// the threads and removes the socket files.
    pub fn shutdown(self) {
        self.stop.store(true, Ordering::Release);
        if let Err(err) = self.exit.write(1) {
            log::error!("waking the socket threads: {err}");
        }
        for slot in &self.slots {
            if let Some(stream) = slot
                .active
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                hang_up(stream);
            }
        }
        for t in self.threads {
            let _ = t.join();
        }
        for slot in &self.slots {
            let _ = std::fs::remove_file(&slot.path);
        }
        if let Some(c) = &self.control {
            let _ = std::fs::remove_file(c);
        }
    }
}

/// The `vm` label of a socket: its file name.
pub fn socket_label(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_string_lossy().into_owned())
}

fn serve_socket(
    slot: &Slot,
    listener: &UnixListener,
    wait: &ListenWait,
    config: &BackendConfig,
    host: &HostTelemetry,
    stop: &AtomicBool,
) {
    let label = socket_label(&slot.path);
    let path_text = slot.path.to_string_lossy().into_owned();
    log::info!("{label}: serving on {}", slot.path.display());
    while !stop.load(Ordering::Acquire) {
        match wait.wait() {
            Ok(Wake::Client) => {}
            Ok(Wake::Exit) => break,
            Err(err) => {
                log::error!("{label}: waiting for a frontend: {err}; not serving any more");
                break;
            }
        }
        if let Err(err) = serve_connection(slot, listener, config, host, stop, &label, &path_text) {
            log::warn!("{label}: {err}");
            // A failing accept must not turn into a busy loop.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    log::info!("{label}: stopped");
}

/// Ends a frontend's connection from another thread: its request loop reads end of file.
fn hang_up(stream: &UnixStream) {
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

fn serve_connection(
    slot: &Slot,
    listener: &UnixListener,
    config: &BackendConfig,
    host: &HostTelemetry,
    stop: &AtomicBool,
    label: &str,
    path_text: &str,
) -> Result<(), ConnectionError> {
    let (stream, _) = listener.accept().map_err(ConnectionError::Accept)?;
    let pid = peer_pid(stream.as_fd());
    match pid {
        Some(pid) => log::info!("{label}: frontend pid {pid} connected"),
        None => {
            log::warn!(
                "{label}: frontend connected; its pid is unknown, no thread will be changed"
            );
        }
    }
    let hangup = stream.try_clone().map_err(ConnectionError::Accept)?;
    let vm = Arc::new(DaemonVmTelemetry::new(label, path_text, config.max_vcpus));
    let backend = PvspinBackend::new(config.clone(), vm.clone())?;
    backend.set_peer_pid(pid);
    let mut connection = Connection::new(backend.clone(), stream, format!("{label}-queues"))?;
    host.connected(path_text, vm);
    let timer_backend = backend.clone();
    let timer = std::thread::Builder::new()
        .name(format!("{label}-restore"))
        .spawn(move || timer_backend.run_restore_timer())
        .ok();
    let sampler_backend = backend.clone();
    let sampler = std::thread::Builder::new()
        .name(format!("{label}-sched"))
        .spawn(move || sampler_backend.run_sched_sampler())
        .ok();
    {
        let mut active = slot.active.lock().unwrap_or_else(PoisonError::into_inner);
        if stop.load(Ordering::Acquire) {
            hang_up(&hangup);
        }
        *active = Some(hangup);
    }
    let end = connection.serve();
    *slot.active.lock().unwrap_or_else(PoisonError::into_inner) = None;
    // Stops and joins the queue worker before the backend forgets its state.
    drop(connection);
    backend.stop();
    for t in [timer, sampler].into_iter().flatten() {
        let _ = t.join();
    }
    host.disconnected(path_text);
    match end {
        VhostUserError::Disconnected => log::info!("{label}: frontend disconnected"),
        e => log::info!("{label}: frontend gone: {e}"),
    }
    Ok(())
}

fn serve_control(
    listener: &UnixListener,
    wait: &ListenWait,
    host: &HostTelemetry,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Acquire) {
        match wait.wait() {
            Ok(Wake::Client) => {}
            Ok(Wake::Exit) => break,
            Err(err) => {
                log::error!("control socket: waiting for a client: {err}; not serving any more");
                break;
            }
        }
        let Ok((stream, _)) = listener.accept() else {
            // Readable but not acceptable (out of descriptors): do not spin on it.
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        if let Err(err) = answer_control(&stream, host) {
            log::debug!("control client: {err}");
        }
    }
}

fn answer_control(stream: &UnixStream, host: &HostTelemetry) -> io::Result<()> {
    stream.set_read_timeout(Some(CONTROL_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(CONTROL_IO_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(io::Read::take(stream, 64)).read_line(&mut line)?;
    let doc = match line.trim() {
        "json" => host.render_json(),
        "prometheus" => host.render_prometheus(),
        other => format!("error: unknown request {other:?}; send \"json\" or \"prometheus\"\n"),
    };
    let mut out = stream;
    out.write_all(doc.as_bytes())?;
    stream.shutdown(std::net::Shutdown::Both)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("pvspind-{}-{name}.sock", std::process::id()))
    }

    #[test]
    fn listen_wait_wakes_for_a_client_and_for_exit() {
        let path = socket_path("listen-wait");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let exit = EventFd::new(EFD_NONBLOCK).unwrap();
        let wait = ListenWait::new(&listener, &exit).unwrap();
        let _client = UnixStream::connect(&path).unwrap();
        assert_eq!(wait.wait().unwrap(), Wake::Client);
        // Exit wins over a pending client, and stays signalled for every later wait.
        exit.write(1).unwrap();
        assert_eq!(wait.wait().unwrap(), Wake::Exit);
        assert_eq!(wait.wait().unwrap(), Wake::Exit);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn shutdown_ends_idle_socket_threads_and_removes_the_sockets() {
        let path = socket_path("shutdown");
        let control = socket_path("shutdown-control");
        let server = Server::start(&ServerConfig {
            sockets: vec![path.clone()],
            control: Some(control.clone()),
            backend: BackendConfig::default(),
        })
        .unwrap();
        assert!(path.exists() && control.exists());
        // Joins both threads, which sleep in their epoll sets with no timeout: only the exit
        // event can end them.
        server.shutdown();
        assert!(!path.exists() && !control.exists());
    }
}
