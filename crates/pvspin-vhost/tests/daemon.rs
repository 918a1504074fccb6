//! Runs the real `pvspind` binary on temporary sockets and drives it with vhost's own
//! frontend over memfd-backed guest memory. Every wait is bounded.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use pvspin_abi::hint;
use pvspin_abi::virtio::{self, ControlRequest, OP_REGISTER_HINT_PAGE, STATUS_OK};
use pvspin_vhost::backend::DEVICE_FEATURES;
use pvspin_vhost::testing::{control_chain, DriverQueue};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM_SIZE: usize = 0x10_0000;
const REQ_AT: u64 = 0x8000;
const STATUS_AT: u64 = 0x9000;
const PAGE: u64 = 0x2_0000;
const WAIT: Duration = Duration::from_secs(10);

/// A private temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("pvspind-t-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The daemon process, killed on drop if still running.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn start(args: &[&str], wait_for: &[&Path]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_pvspind"))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning pvspind");
        let mut d = Self { child };
        let deadline = Instant::now() + WAIT;
        while !wait_for.iter().all(|p| p.exists()) {
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!("pvspind exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "pvspind did not create its sockets"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill only reads its arguments; the pid is our own child, not yet reaped.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0);
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "pvspind did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits up to `timeout` for `fd` to be readable.
fn readable(fd: RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    n > 0 && pfd.revents & libc::POLLIN != 0
}

struct Queue<'m> {
    ring: DriverQueue<'m, GuestMemoryMmap>,
    kick: EventFd,
    call: EventFd,
}

/// One VM: a vhost-user frontend connection over guest memory `'m` (from [`guest_memory`];
/// the drivers' queues borrow it).
struct Vm<'m> {
    frontend: Frontend,
    mem: &'m GuestMemoryMmap,
    queues: Vec<Option<Queue<'m>>>,
    max_vcpus: u32,
}

fn memfd() -> File {
    let name = c"pvspind-test";
    // SAFETY: a valid C string and flags; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: fd is a fresh descriptor owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(MEM_SIZE as u64).unwrap();
    file
}

/// Guest memory in a memfd, which the daemon maps.
fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        MEM_SIZE,
        Some(FileOffset::new(memfd(), 0)),
    )])
    .unwrap()
}

impl<'m> Vm<'m> {
    fn connect(socket: &Path, mem: &'m GuestMemoryMmap, max_vcpus: u32) -> Self {
        let nq = virtio::num_queues(max_vcpus);
        let mut frontend = Frontend::connect(socket, nq as u64).expect("connecting");
        frontend.set_owner().unwrap();
        let offered = frontend.get_features().unwrap();
        assert_eq!(offered, DEVICE_FEATURES);
        frontend.set_features(offered).unwrap();
        let pf = frontend.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
        frontend
            .set_protocol_features(
                pf & (VhostUserProtocolFeatures::CONFIG
                    | VhostUserProtocolFeatures::MQ
                    | VhostUserProtocolFeatures::REPLY_ACK),
            )
            .unwrap();
        assert_eq!(frontend.get_queue_num().unwrap(), nq as u64);
        let region = mem.iter().next().unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        frontend.set_mem_table(&[info]).unwrap();
        Self {
            frontend,
            mem,
            queues: (0..nq).map(|_| None).collect(),
            max_vcpus,
        }
    }

    /// The frontend's virtual address of guest address `gpa` (vhost-user rings use these).
    fn hva(&self, gpa: GuestAddress) -> u64 {
        let region = self.mem.iter().next().unwrap();
        region.as_ptr() as u64 + gpa.0 - region.start_addr().0
    }

    fn set_up(&mut self, q: usize, base: u64, size: u16) {
        let ring = DriverQueue::new(self.mem, GuestAddress(base), size);
        let mock = ring.mock();
        let f = &mut self.frontend;
        f.set_vring_num(q, size).unwrap();
        let config = VringConfigData {
            queue_max_size: size,
            queue_size: size,
            flags: 0,
            desc_table_addr: 0,
            used_ring_addr: 0,
            avail_ring_addr: 0,
            log_addr: None,
        };
        let config = VringConfigData {
            desc_table_addr: self.hva(mock.desc_table_addr()),
            used_ring_addr: self.hva(mock.used_addr()),
            avail_ring_addr: self.hva(mock.avail_addr()),
            ..config
        };
        let f = &mut self.frontend;
        f.set_vring_addr(q, &config).unwrap();
        f.set_vring_base(q, 0).unwrap();
        let call = EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC).unwrap();
        let kick = EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC).unwrap();
        f.set_vring_call(q, &call).unwrap();
        f.set_vring_kick(q, &kick).unwrap();
        f.set_vring_enable(q, true).unwrap();
        self.queues[q] = Some(Queue { ring, kick, call });
    }

    fn kick_queue(&self, vcpu: u32) -> usize {
        virtio::kick_queue(self.max_vcpus, vcpu).unwrap() as usize
    }

    fn queue(&self, q: usize) -> &Queue<'m> {
        self.queues[q].as_ref().expect("queue not set up")
    }

    /// Reads away any signal already pending on every call eventfd (enabling a queue may
    /// deliver one, as spurious wake-ups are allowed).
    fn drain_calls(&self) {
        std::thread::sleep(Duration::from_millis(100));
        for q in self.queues.iter().flatten() {
            let _ = q.call.read();
        }
    }

    fn notify(&self, q: usize) {
        self.queue(q).kick.write(1).unwrap();
    }

    fn called_within(&self, q: usize, timeout: Duration) -> bool {
        let call = &self.queue(q).call;
        readable(call.as_raw_fd(), timeout) && call.read().is_ok()
    }

    /// The whole configuration space, read through GET_CONFIG.
    fn config_space(&mut self) -> Vec<u8> {
        let size = virtio::config::SIZE;
        let (_, payload) = self
            .frontend
            .get_config(0, size as u32, VhostUserConfigFlags::empty(), &[0; 16])
            .unwrap();
        payload
    }

    /// Sends a control request and returns its status.
    fn control(&mut self, r: ControlRequest) -> u32 {
        self.mem
            .write_slice(&r.to_bytes(), GuestAddress(REQ_AT))
            .unwrap();
        self.mem
            .write_obj(0xffff_ffffu32, GuestAddress(STATUS_AT))
            .unwrap();
        let q = self.queue(0);
        let before = q.ring.used_idx().unwrap();
        q.ring.add_chain(&control_chain(REQ_AT, STATUS_AT)).unwrap();
        q.kick.write(1).unwrap();
        assert!(
            self.called_within(0, WAIT),
            "no answer on the control queue"
        );
        let q = self.queue(0);
        assert_eq!(q.ring.used_idx().unwrap(), before.wrapping_add(1));
        assert_eq!(q.ring.used_elem(before).unwrap().len(), 4);
        self.mem.read_obj(GuestAddress(STATUS_AT)).unwrap()
    }

    fn host<T: vm_memory::AtomicAccess>(&self, off: usize) -> T {
        self.mem
            .load(
                GuestAddress(PAGE + off as u64),
                std::sync::atomic::Ordering::Acquire,
            )
            .unwrap()
    }

    /// Sets up the control queue and the kick queues of vCPUs 0..n.
    fn standard(socket: &Path, mem: &'m GuestMemoryMmap, max_vcpus: u32, kick_vcpus: u32) -> Self {
        let mut vm = Self::connect(socket, mem, max_vcpus);
        vm.set_up(0, 0x1000, 8);
        for v in 0..kick_vcpus {
            let q = vm.kick_queue(v);
            vm.set_up(q, 0x4_0000 + u64::from(v) * 0x200, 1);
        }
        vm.drain_calls();
        vm
    }

    /// Kicks vCPU `vcpu` and checks that its queue, and no other, is called.
    fn kick_ok(&self, vcpu: u32) -> bool {
        let q = self.kick_queue(vcpu);
        self.notify(q);
        self.called_within(q, WAIT)
    }
}

fn control_query(path: &Path, what: &str) -> String {
    let mut s = UnixStream::connect(path).expect("control socket");
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(format!("{what}\n").as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&control_query(path, "json")).expect("control JSON")
}

/// The control request registering `vcpu`'s hint page at [`PAGE`], with guest TSC `khz`.
fn register_page(vcpu: u32, khz: u64) -> ControlRequest {
    ControlRequest {
        op: OP_REGISTER_HINT_PAGE,
        vcpu,
        gpa: PAGE,
        arg: khz,
    }
}

fn vm_entry<'a>(doc: &'a serde_json::Value, vm: &str) -> &'a serde_json::Value {
    doc["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["vm"] == vm)
        .unwrap_or_else(|| panic!("no VM {vm} in {doc}"))
}

/// Polls the control socket until `pred` holds (bounded).
fn until(path: &Path, what: &str, pred: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let doc = json(path);
        if pred(&doc) {
            return doc;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {doc}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The ABI's most vCPUs on one device: 256 queues (vhost-user's 8-bit vring index), every
/// kick queue served, including those past index 63 that vhost-user-backend's workers never
/// reached; no spin queues ([`virtio::spin_queues`]).
#[test]
fn a_device_of_255_vcpus_serves_all_256_queues() {
    let dir = TempDir::new();
    let sock = dir.path("a.sock");
    let _d = Daemon::start(
        &["--socket", sock.to_str().unwrap(), "--max-vcpus", "255"],
        &[&sock],
    );
    let mem = guest_memory();
    let mut vm = Vm::standard(&sock, &mem, 255, 255);
    assert_eq!(vm.queues.len(), virtio::MAX_QUEUES);
    for vcpu in [0, 62, 63, 127, 128, 200, 254] {
        assert!(vm.kick_ok(vcpu), "vCPU {vcpu}");
        for other in [vcpu.saturating_sub(1), (vcpu + 1).min(254)] {
            if other != vcpu {
                assert!(
                    !vm.called_within(vm.kick_queue(other), Duration::from_millis(20)),
                    "kicking {vcpu} woke {other}"
                );
            }
        }
    }
    assert_eq!(vm.control(register_page(254, 1_000_000)), STATUS_OK);
    assert_eq!(vm.host::<u32>(hint::HOST_SEQ), 1);
    let payload = vm.config_space();
    assert_eq!(payload, virtio::config::encode(255).to_vec());
    assert_eq!(
        u32::from_le_bytes(payload[12..16].try_into().unwrap()),
        0,
        "no spin queues at 255 vCPUs"
    );
}

#[test]
fn kicks_registration_config_and_telemetry() {
    let dir = TempDir::new();
    let (sock, control) = (dir.path("a.sock"), dir.path("control"));
    let _d = Daemon::start(
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "4",
        ],
        &[&sock, &control],
    );
    let mem = guest_memory();
    let mut vm = Vm::standard(&sock, &mem, 4, 3);

    // A kick on vCPU 1's queue signals vCPU 1's queue and not vCPU 2's.
    assert!(vm.kick_ok(1));
    assert!(!vm.called_within(vm.kick_queue(2), Duration::from_millis(200)));
    assert!(!vm.called_within(vm.kick_queue(0), Duration::from_millis(10)));

    // Hint page registration writes the host line.
    assert_eq!(vm.control(register_page(0, 1_000_000)), STATUS_OK);
    assert_eq!(vm.host::<u32>(hint::LAYOUT), hint::LAYOUT_VERSION);
    // The in-process host's defaults: a 100 us window (1 GHz guest TSC: cycles are ns).
    assert_eq!(vm.host::<u64>(hint::SPIN_WINDOW_TSC), 100 * 1000);
    assert_eq!(vm.host::<u64>(hint::WAIT_AFTER_TSC), 50 * 1000);
    assert_eq!(vm.host::<u32>(hint::TSC_KHZ), 1_000_000);
    assert_eq!(vm.host::<u32>(hint::HOST_SEQ), 1);
    // A bad vCPU gets its status.
    assert_eq!(
        vm.control(register_page(4, 1_000_000)),
        virtio::STATUS_BAD_VCPU
    );

    // The configuration space.
    let payload = vm.config_space();
    assert_eq!(payload, virtio::config::encode(4).to_vec());

    // Telemetry, JSON and Prometheus.
    let doc = json(&control);
    let a = vm_entry(&doc, "a.sock");
    assert!(a["kicks"][1].as_u64().unwrap() >= 1, "{doc}");
    assert_eq!(a["hint_page_registrations"], 1);
    assert_eq!(a["bad_inputs"]["control_vcpu"], 1);
    assert_eq!(a["peer_pid"], std::process::id(), "peer credentials: {doc}");
    assert_eq!(doc["host"]["connections_active"], 1);
    let prom = control_query(&control, "prometheus");
    assert!(prom.contains("# TYPE pvspin_kicks_total counter"), "{prom}");
    assert!(prom.contains("pvspin_kicks_total{vm=\"a.sock\",vcpu=\"1\",path=\"vhost_user\"}"));
    assert!(
        prom.contains("pvspin_rejected_guest_inputs_total{vm=\"a.sock\",kind=\"control_vcpu\"} 1")
    );
    assert!(prom.contains("pvspin_vhost_connections_active 1"));
    assert!(control_query(&control, "bogus").starts_with("error"));
}

#[test]
fn two_frontends_one_dies_the_other_lives_and_the_socket_takes_a_new_one() {
    let dir = TempDir::new();
    let (a, b, control) = (dir.path("a.sock"), dir.path("b.sock"), dir.path("ctl"));
    let _d = Daemon::start(
        &[
            "--socket",
            a.to_str().unwrap(),
            "--socket",
            b.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "2",
        ],
        &[&a, &b, &control],
    );
    let vm_a_mem = guest_memory();
    let mut vm_a = Vm::standard(&a, &vm_a_mem, 2, 2);
    let vm_b_mem = guest_memory();
    let vm_b = Vm::standard(&b, &vm_b_mem, 2, 2);
    assert!(vm_a.kick_ok(0));
    assert!(vm_b.kick_ok(1));
    assert_eq!(vm_a.control(register_page(1, 0)), STATUS_OK);

    // A goes away without a word (as a crashed VMM would).
    drop(vm_a);
    until(&control, "A's disconnect", |d| {
        d["host"]["disconnects"] == 1
    });
    assert!(vm_b.kick_ok(0), "B stopped working when A went away");

    // The socket takes a new frontend, with a fresh state.
    let vm_a2_mem = guest_memory();
    let vm_a2 = Vm::standard(&a, &vm_a2_mem, 2, 1);
    assert!(vm_a2.kick_ok(0));
    let doc = until(&control, "A2's connection", |d| {
        d["host"]["connections_total"] == 3
    });
    let a2 = vm_entry(&doc, "a.sock");
    assert_eq!(a2["hint_page_registrations"], 0, "{doc}");
    assert_eq!(doc["host"]["totals"]["hint_page_registrations"], 1);
    assert!(vm_b.kick_ok(1));
}

#[test]
fn sigterm_exits_zero_and_removes_the_sockets() {
    let dir = TempDir::new();
    let (sock, control) = (dir.path("a.sock"), dir.path("ctl"));
    // A stale socket (nobody listens) is replaced.
    drop(UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let mut d = Daemon::start(
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
        ],
        &[&control],
    );
    let mem = guest_memory();
    let vm = Vm::standard(&sock, &mem, 16, 1);
    assert!(vm.kick_ok(0));
    d.signal(libc::SIGTERM);
    let status = d.wait_exit();
    assert!(status.success(), "{status}");
    assert!(!sock.exists() && !control.exists());
}

#[test]
fn refuses_bad_options_and_foreign_files() {
    let dir = TempDir::new();
    let sock = dir.path("a.sock");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_pvspind"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&["--socket", sock.to_str().unwrap(), "--max-vcpus", "256"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MAX_VCPUS") && stderr.contains("xAPIC"),
        "{stderr}"
    );
    let out = run(&["--socket", sock.to_str().unwrap(), "--max-vcpus", "0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("at least 1"), "{stderr}");
    std::fs::write(&sock, b"not a socket").unwrap();
    let out = run(&["--socket", sock.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"));
    assert_eq!(std::fs::read(&sock).unwrap(), b"not a socket");
}

fn thread_nice(tid: u32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    pvspin_hints::proc::parse_stat_nice(&stat).unwrap()
}

fn tid_named(name: &str) -> Option<u32> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let e = e.ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim_end() == name).then(|| e.file_name().to_str()?.parse().ok())?
    })
}

fn has_cap_sys_nice() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    pvspin_hints::proc::parse_status_cap_eff(&status).unwrap() & (1 << 23) != 0
}

fn wait_for(what: &str, pred: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !pred() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The scheduler sampler on real threads: this process plays the VMM with two busy "vCPU"
/// threads pinned to one CPU, so at any time one of them is runnable but descheduled. The
/// daemon must flag it NOT_RUNNING in its page (and only a registered vCPU's page), and clear
/// every flag when the frontend goes away. Flags are opt-in (`--flag-not-running`).
#[test]
fn a_descheduled_vcpu_thread_is_flagged_not_running() {
    let dir = TempDir::new();
    let (sock, control) = (dir.path("a.sock"), dir.path("ctl"));
    let _d = Daemon::start(
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "2",
            "--flag-not-running",
            "--yield",
            "off",
            "--vcpu-thread-pattern",
            "pvns-vcpu{N}",
        ],
        &[&sock, &control],
    );
    // Two busy threads sharing the first CPU this process may use.
    let cpu = {
        let set = rustix::thread::sched_getaffinity(None).unwrap();
        (0..rustix::thread::CpuSet::MAX_CPU)
            .find(|&c| set.is_set(c))
            .unwrap()
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy: Vec<_> = (0..2)
        .map(|v| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("pvns-vcpu{v}"))
                .spawn(move || {
                    let mut set = rustix::thread::CpuSet::new();
                    set.set(cpu);
                    rustix::thread::sched_setaffinity(None, &set).unwrap();
                    let deadline = Instant::now() + WAIT * 3;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        std::hint::spin_loop();
                    }
                })
                .unwrap()
        })
        .collect();
    let mem = guest_memory();
    let mut vm = Vm::connect(&sock, &mem, 2);
    vm.set_up(0, 0x1000, 8);
    // Only vCPU 0 registers a page.
    assert_eq!(vm.control(register_page(0, 1_000_000)), STATUS_OK);
    // vCPU 0's thread is descheduled about half the time; the sampler must see it at least
    // once (bounded).
    wait_for("NOT_RUNNING on vCPU 0's page", || {
        vm.host::<u32>(hint::HOST_FLAGS) & hint::NOT_RUNNING != 0
    });
    let doc = until(&control, "a sample", |d| {
        vm_entry(d, "a.sock")["sched"]["thread_reads"].as_u64() > Some(10)
    });
    let a = vm_entry(&doc, "a.sock");
    assert!(a["not_running_set"][0].as_u64() >= Some(1), "{doc}");
    assert_eq!(a["not_running_set"][1], 0, "vCPU 1 has no page: {doc}");
    assert!(a["sched"]["read_ns"].as_u64() > Some(0), "{doc}");
    // The frontend goes: the daemon forgets the page and leaves no flag in it.
    drop(vm.frontend);
    until(&control, "the disconnect", |d| {
        d["host"]["connections_active"] == 0
    });
    let flags: u32 = vm
        .mem
        .load(
            GuestAddress(PAGE + hint::HOST_FLAGS as u64),
            std::sync::atomic::Ordering::Acquire,
        )
        .unwrap();
    assert_eq!(flags & hint::NOT_RUNNING, 0, "a flag outlived the frontend");
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
}

#[test]
fn spin_notification_deboosts_the_spinners_thread_then_restores_it() {
    let dir = TempDir::new();
    let (sock, control) = (dir.path("a.sock"), dir.path("ctl"));
    let _d = Daemon::start(
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "2",
            "--adjust-us",
            "300000",
            "--vcpu-thread-pattern",
            "pvt-vcpu{N}",
        ],
        &[&sock, &control],
    );
    // This process plays the VMM: its "vCPU 0" thread is the one the daemon may deboost.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let vcpu0 = std::thread::Builder::new()
        .name("pvt-vcpu0".into())
        .spawn(move || {
            ready_tx.send(()).unwrap();
            let _ = stop_rx.recv_timeout(WAIT * 3);
        })
        .unwrap();
    ready_rx.recv_timeout(WAIT).unwrap();
    let tid = tid_named("pvt-vcpu0").expect("the vCPU thread");
    let before = thread_nice(tid);

    let mem = guest_memory();
    let mut vm = Vm::connect(&sock, &mem, 2);
    vm.set_up(0, 0x1000, 8);
    let spin0 = virtio::spin_queue(2, 0).unwrap() as usize;
    vm.set_up(spin0, 0x4_0000, 1);
    vm.drain_calls();
    assert_eq!(vm.control(register_page(0, 1_000_000)), STATUS_OK);
    let waiting = pvspin_abi::doorbell::SpinNotify {
        waiting_for: Some(1),
        next_owner: false,
        spun_bucket: 4,
        lock_hash: 9,
    };
    vm.mem
        .store(
            waiting.encode(),
            GuestAddress(PAGE + hint::WAITING_FOR as u64),
            std::sync::atomic::Ordering::Release,
        )
        .unwrap();
    vm.mem
        .store(
            hint::SPIN_SPINNING,
            GuestAddress(PAGE + hint::SPIN_STATE as u64),
            std::sync::atomic::Ordering::Release,
        )
        .unwrap();
    vm.notify(spin0);

    if has_cap_sys_nice() || before >= 19 {
        wait_for("the deboost", || thread_nice(tid) == (before + 5).min(19));
        wait_for("the restore", || thread_nice(tid) == before);
        // At nice 19 already (a test run under `nice`) the deboost changes nothing, so the
        // nice value cannot show that the notification was handled: wait for its count.
        let doc = until(&control, "the notification's count", |d| {
            vm_entry(d, "a.sock")["spin_notifications"][0] == 1
        });
        let a = vm_entry(&doc, "a.sock");
        assert_eq!(a["restores"], a["deboosts"], "{doc}");
    } else {
        // Without the privilege to undo it, the daemon does not deboost at all.
        until(&control, "the refusal", |d| {
            vm_entry(d, "a.sock")["yield_skipped"]["no_privilege"] == 1
        });
        assert_eq!(thread_nice(tid), before);
    }
    assert!(
        !vm.called_within(spin0, Duration::from_millis(50)),
        "a spin queue was signalled"
    );
    stop_tx.send(()).unwrap();
    vcpu0.join().unwrap();
}

#[test]
fn reconnects_do_not_leak_descriptors() {
    let dir = TempDir::new();
    let (sock, control) = (dir.path("a.sock"), dir.path("ctl"));
    let d = Daemon::start(
        &[
            "--socket",
            sock.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "2",
        ],
        &[&sock, &control],
    );
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
            .unwrap()
            .count()
    };
    let cycle = |n: u64| {
        let mem = guest_memory();
        let vm = Vm::standard(&sock, &mem, 2, 2);
        assert!(vm.kick_ok(1));
        drop(vm);
        until(&control, "the disconnect", |doc| {
            doc["host"]["disconnects"] == n
        });
    };
    cycle(1);
    let after_one = fds();
    for n in 2..=6 {
        cycle(n);
    }
    // The control connection that saw the last disconnect may close a moment later.
    let deadline = Instant::now() + Duration::from_secs(2);
    while fds() > after_one {
        assert!(
            Instant::now() < deadline,
            "descriptors grew from {after_one} to {}",
            fds()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn garbage_on_one_socket_costs_only_that_connection() {
    let dir = TempDir::new();
    let (a, b, control) = (dir.path("a.sock"), dir.path("b.sock"), dir.path("ctl"));
    let _d = Daemon::start(
        &[
            "--socket",
            a.to_str().unwrap(),
            "--socket",
            b.to_str().unwrap(),
            "--control",
            control.to_str().unwrap(),
            "--max-vcpus",
            "2",
        ],
        &[&a, &b, &control],
    );
    let vm_b_mem = guest_memory();
    let vm_b = Vm::standard(&b, &vm_b_mem, 2, 1);
    // Not vhost-user at all: a header claiming a huge payload, then junk, then gone.
    let mut junk = UnixStream::connect(&a).unwrap();
    let mut bytes = vec![0xffu8; 12];
    bytes.extend_from_slice(&[0x5a; 256]);
    let _ = junk.write_all(&bytes);
    drop(junk);
    until(&control, "the junk connection to end", |d| {
        d["host"]["disconnects"] == 1
    });
    assert!(vm_b.kick_ok(0), "the other VM was disturbed");
    let vm_a_mem = guest_memory();
    let vm_a = Vm::standard(&a, &vm_a_mem, 2, 1);
    assert!(vm_a.kick_ok(0), "the socket did not recover");
}
