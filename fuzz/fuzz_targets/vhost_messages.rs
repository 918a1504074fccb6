//! Fuzzes pvspind's handling of frontend messages over a real socket: one in-process daemon
//! (`pvspin_vhost::server::Server`, what `pvspind` runs), and per input one connection that
//! first checks the daemon still answers (a valid `GET_FEATURES` must return the device's
//! features), then sends vhost-user messages built from the input (any request code, flags,
//! declared size and payload; no descriptors, so the requests that need them fail) and reads
//! whatever comes back until the daemon closes the connection. Invariants: nothing panics (a
//! panic on any daemon thread aborts the process), and junk on one connection never stops the
//! daemon from serving the next.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use pvspin_vhost::backend::DEVICE_FEATURES;
use pvspin_vhost::config::{BackendConfig, WorkerPriority};
use pvspin_vhost::server::{Server, ServerConfig};

/// vhost-user: `VHOST_USER_GET_FEATURES`, header flags version 1.
const GET_FEATURES: u32 = 1;
const VERSION_1: u32 = 0x1;
const REPLY: u32 = 0x4;

fn server() -> &'static (Server, PathBuf) {
    static SERVER: OnceLock<(Server, PathBuf)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pvspin-fuzz-vhost-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("vm.sock");
        let config = ServerConfig {
            sockets: vec![path.clone()],
            control: None,
            backend: BackendConfig {
                max_vcpus: 4,
                // No real-time worker threads in a fuzzing process.
                worker_priority: WorkerPriority::Inherit,
                ..BackendConfig::default()
            },
        };
        let server = Server::start(&config).expect("starting the in-process daemon");
        (server, path)
    })
}

fn socket() -> &'static PathBuf {
    &server().1
}

/// Frontends the daemon has finished with (their threads stopped and joined).
fn disconnects() -> u64 {
    server().0.telemetry().snapshot().host.disconnects
}

fn header(request: u32, flags: u32, size: u32) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[0..4].copy_from_slice(&request.to_le_bytes());
    h[4..8].copy_from_slice(&flags.to_le_bytes());
    h[8..12].copy_from_slice(&size.to_le_bytes());
    h
}

/// Connects (the daemon accepts the next frontend once the previous one is torn down).
fn connect() -> UnixStream {
    for _ in 0..500 {
        if let Ok(stream) = UnixStream::connect(socket()) {
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .expect("read timeout");
            return stream;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("the daemon stopped accepting connections");
}

fuzz_target!(|data: &[u8]| {
    let done_before = disconnects();
    let mut stream = connect();
    // The daemon must still serve: GET_FEATURES answers the device's features.
    stream
        .write_all(&header(GET_FEATURES, VERSION_1, 0))
        .expect("writing GET_FEATURES");
    let mut reply = [0u8; 20];
    stream
        .read_exact(&mut reply)
        .expect("the daemon did not answer GET_FEATURES");
    let flags = u32::from_le_bytes(reply[4..8].try_into().unwrap());
    let features = u64::from_le_bytes(reply[12..20].try_into().unwrap());
    assert_ne!(
        flags & REPLY,
        0,
        "GET_FEATURES answer without the reply flag"
    );
    assert_eq!(
        features & DEVICE_FEATURES,
        DEVICE_FEATURES,
        "GET_FEATURES answered {features:#x}"
    );

    // The input: messages of [request, flags, size (declared), payload length, payload...].
    let mut rest = data;
    let mut out = Vec::new();
    while rest.len() >= 4 {
        let request = u32::from(rest[0] % 48);
        let flags = u32::from(rest[1]);
        // The declared size may lie; the payload is what the input has, up to 255 bytes.
        let declared = u32::from(rest[2]);
        let len = usize::from(rest[3]).min(rest.len() - 4);
        out.extend_from_slice(&header(request, flags, declared));
        out.extend_from_slice(&rest[4..4 + len]);
        rest = &rest[4 + len..];
    }
    // The daemon may close the connection part-way (a bad message ends it): writes may fail.
    let _ = stream.write_all(&out);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Drain replies until the daemon closes the connection (bounded by the read timeout).
    let mut sink = Vec::new();
    let _ = stream.read_to_end(&mut sink);
    drop(stream);
    // Wait (bounded) until the daemon has torn the connection down, so the next input starts
    // on a fresh backend and nothing of this one is still being freed.
    for _ in 0..2_500 {
        if disconnects() > done_before {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("the daemon did not finish with a closed connection within 5 s");
});
