//! Fuzzes pvspind's device backend in-process (no socket): arbitrary acked features and
//! vCPU count, configuration reads, guest memory contents (hint pages, control requests,
//! raw descriptors and ring indices), notifications on arbitrary queue indices, and
//! scheduler samples of fake vCPU threads in any state. Invariants: nothing panics; a call
//! eventfd is signalled only on a queue that was notified, at most once per notification;
//! only the fake VM's threads are reniced, within the nice range; the budgets the backend
//! adapts from guest reports stay within their bounds; after a sample exactly the registered
//! pages of vCPUs descheduled for a whole sample period say NOT_RUNNING; after a reset every thread is back at its
//! original nice value and no page says NOT_RUNNING.
#![no_main]

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use pvspin_abi::hint;
use pvspin_abi::virtio::{self, ControlRequest, QueueRole};
use pvspin_vhost::backend::{BackendMemory, PvspinBackend, Vring, MAX_QUEUE_SIZE};
use pvspin_vhost::config::{BackendConfig, WorkerPriority, YieldMode};
use pvspin_vhost::sched::RunState;
use pvspin_vhost::telemetry::DaemonVmTelemetry;
use pvspin_vhost::testing::{control_chain, DriverQueue, FakeSched, FakeThreads};
use vhost_user_backend::VringT;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM_SIZE: u64 = 0x4_0000;
const CONTROL_RING: u64 = 0x1000;
const REQ_AT: u64 = 0x8000;
const STATUS_AT: u64 = 0x9000;

fuzz_target!(|data: &[u8]| {
    if data.len() < 12 {
        return;
    }
    let max_vcpus = 1 + u32::from(data[0] % 4);
    let acked = u64::from_le_bytes(data[1..9].try_into().unwrap());
    let setup_mask = u16::from_le_bytes([data[9], data[10]]);
    let mode = match data[11] % 3 {
        0 => YieldMode::Off,
        1 => YieldMode::Deboost,
        _ => YieldMode::Confined,
    };
    let config = BackendConfig {
        max_vcpus,
        yield_mode: mode,
        // Pacing sleeps (it has its own unit test); a fuzz run must not.
        max_events_per_sec: u32::MAX,
        // handle_notification would make the fuzzing thread SCHED_FIFO.
        worker_priority: WorkerPriority::Inherit,
        // Samples with and without NOT_RUNNING flags (opt-in in the daemon).
        flag_not_running: data[11] & 0x40 != 0,
        ..BackendConfig::default()
    };
    let threads = FakeThreads::new(42, max_vcpus, data[11] & 0x80 != 0);
    let tel = Arc::new(DaemonVmTelemetry::new("fuzz", "/fuzz", max_vcpus));
    let sched = FakeSched::new(42, max_vcpus);
    let backend = PvspinBackend::with_actions(
        config,
        tel,
        Box::new(threads.clone()),
        Box::new(sched.clone()),
    )
    .expect("valid configuration");
    backend.set_peer_pid(Some(42));
    let mem: BackendMemory = GuestMemoryAtomic::new(
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
    );
    backend.set_memory(mem.clone());
    // The driver's queues borrow the guest memory: a handle on the same mappings.
    let guest: GuestMemoryMmap = (*mem.memory()).clone();
    backend.set_acked_features(acked);

    let nq = backend.num_queues();
    let vrings: Vec<Vring> = (0..nq)
        .map(|_| Vring::new(mem.clone(), MAX_QUEUE_SIZE as u16).unwrap())
        .collect();
    let mut calls: Vec<Option<EventFd>> = (0..nq).map(|_| None).collect();
    let mut control_ring = None;
    for q in 0..nq {
        if setup_mask & (1 << (q % 16)) == 0 {
            continue;
        }
        let size: u16 = if q == 0 { 8 } else { 1 };
        let base = if q == 0 {
            CONTROL_RING
        } else {
            0x2_0000 + q as u64 * 0x2000
        };
        let ring = DriverQueue::new(&guest, GuestAddress(base), size);
        let v = &vrings[q];
        v.set_queue_size(size);
        let mock = ring.mock();
        v.set_queue_info(
            mock.desc_table_addr().0,
            mock.avail_addr().0,
            mock.used_addr().0,
        )
        .unwrap();
        v.set_queue_ready(true);
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        // SAFETY: the clone's descriptor is fresh and owned by the File from here on.
        let file = unsafe { File::from_raw_fd(call.try_clone().unwrap().into_raw_fd()) };
        v.set_call(Some(file));
        calls[q] = Some(call);
        if q == 0 {
            control_ring = Some(ring);
        }
    }

    let mut notified = vec![0u64; nq];
    let mut signalled = vec![0u64; nq];
    for op in data[12..].chunks_exact(12) {
        let a = u16::from_le_bytes([op[2], op[3]]);
        let word = u64::from_le_bytes(op[4..12].try_into().unwrap());
        match op[0] % 7 {
            // A notification on any queue index, including ones the device does not have.
            0 => {
                let q = usize::from(op[1]) % (nq + 3);
                if q < nq {
                    notified[q] += 1;
                }
                let _ = backend.handle_notification(q, &vrings);
            }
            // A configuration read.
            1 => {
                let got = backend.config_read(u32::from(a) % 32, (word % 32) as u32);
                assert!(got.len() <= virtio::config::SIZE);
            }
            // A guest write of 8 bytes anywhere (hint pages, rings, requests).
            2 => {
                let gpa = u64::from(a) * 8 % MEM_SIZE;
                let _ = mem.memory().write_obj(word, GuestAddress(gpa));
            }
            // A raw descriptor in the control queue, then a head made available.
            3 => {
                if let Some(ring) = control_ring.as_ref() {
                    let addr = (word & 0xffff_ffff) % (MEM_SIZE + 0x1000);
                    let len = (word >> 32) as u32 % 64;
                    let flags = u16::from(op[1]) & 0x7;
                    let desc = Descriptor::new(addr, len, flags, u16::from(op[1] >> 4));
                    let _ = ring.write_desc(a % 8, desc);
                    let _ = ring.publish(a % 9);
                }
            }
            // A control request in the request buffer (an op of 1 most of the time).
            4 => {
                let r = ControlRequest {
                    op: if op[1] < 200 {
                        virtio::OP_REGISTER_HINT_PAGE
                    } else {
                        u32::from(op[1])
                    },
                    vcpu: u32::from(op[1] % 6),
                    gpa: (word % (MEM_SIZE + 0x2000)) & !(u64::from(op[1] & 1) * 0xfff),
                    arg: word >> 40,
                };
                let m = mem.memory();
                let _ = m.write_slice(&r.to_bytes(), GuestAddress(REQ_AT));
                // Usually also post it as a well-formed chain, so registrations happen.
                if let (Some(ring), true) = (control_ring.as_ref(), op[1] & 0x40 == 0) {
                    let _ = ring.add_chain(&control_chain(REQ_AT, STATUS_AT));
                }
            }
            // Device reset.
            5 => backend.reset_device(),
            // The vCPU threads move (each vCPU: running, descheduled, blocked, unchanged), then
            // a scheduler sample.
            6 if op[1] & 1 == 0 => {
                for v in 0..max_vcpus {
                    match (word >> (2 * v)) & 3 {
                        0 => sched.running(v),
                        1 => sched.preempted(v),
                        2 => sched.blocked(v),
                        _ => {}
                    }
                }
                backend.sample_once(std::time::Instant::now());
                let b = backend.budgets().config();
                for v in 0..max_vcpus {
                    let wait = backend.budgets().budgets().wait_after_ns(v as usize);
                    assert!((b.wait_after_min_ns..=b.wait_after_max_ns).contains(&wait));
                    let Some(gpa) = backend.hint_page(v) else {
                        continue;
                    };
                    let flags: u32 = mem
                        .memory()
                        .load(
                            GuestAddress(gpa + hint::HOST_FLAGS as u64),
                            std::sync::atomic::Ordering::Acquire,
                        )
                        .unwrap();
                    let descheduled = backend.descheduled(v);
                    assert!(!descheduled || backend.run_state(v) == RunState::Preempted);
                    // Two vCPUs may share a page (the guest's choice): then the flag is
                    // either's.
                    let shared =
                        (0..max_vcpus).any(|w| w != v && backend.hint_page(w) == Some(gpa));
                    if !shared {
                        assert_eq!(flags & hint::NOT_RUNNING != 0, descheduled, "vCPU {v}");
                    }
                }
            }
            // Time passes: restore what is due.
            _ => {
                let _ = backend.expire_adjustments(std::time::Instant::now());
            }
        }
        for q in 0..nq {
            if let Some(call) = &calls[q] {
                if let Ok(n) = call.read() {
                    signalled[q] += n;
                }
            }
            assert!(
                signalled[q] <= notified[q],
                "queue {q} signalled {} times for {} notifications",
                signalled[q],
                notified[q]
            );
            if matches!(virtio::queue_role(max_vcpus, q), Some(QueueRole::Spin(_))) {
                assert_eq!(signalled[q], 0, "a spin queue was signalled");
            }
        }
    }
    let pages: Vec<u64> = (0..max_vcpus)
        .filter_map(|v| backend.hint_page(v))
        .collect();
    backend.reset_device();
    assert!(
        threads.nice_values().values().all(|n| *n == 0),
        "priorities not restored: {:?}",
        threads.nice_values()
    );
    for gpa in pages {
        let flags: u32 = mem
            .memory()
            .load(
                GuestAddress(gpa + hint::HOST_FLAGS as u64),
                std::sync::atomic::Ordering::Acquire,
            )
            .unwrap();
        assert_eq!(flags & hint::NOT_RUNNING, 0, "a flag outlived the reset");
    }
});
