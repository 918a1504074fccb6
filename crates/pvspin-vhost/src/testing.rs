//! Test support: a driver's side of split virtqueues, and fake thread and scheduler sources.
//! Used by the unit tests, the integration tests (which drive the daemon with vhost's own
//! frontend) and the fuzz target; it is not needed to run the daemon.
//!
//! The rings are virtio-queue's own driver mock ([`MockSplitQueue`]): it lays a queue out in
//! guest memory and writes its descriptors and available-ring entries. [`DriverQueue`] adds
//! the two things the mock does not do: it makes chains available for as long as a test
//! runs (the mock's `add_desc_chains` and `add_chain` index the available ring without
//! wrapping, and fail or write past the ring after a queue's worth of chains), and it
//! publishes and reads the ring indices with release/acquire atomics, because in the
//! daemon's integration test the device is another process.

use std::sync::atomic::Ordering;

use virtio_queue::desc::split::{Descriptor, VirtqUsedElem};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::{MockError, MockSplitQueue};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// `VRING_DESC_F_NEXT` (virtio-bindings is not a dependency for two spec constants).
pub const DESC_F_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE`.
pub const DESC_F_WRITE: u16 = 2;

/// The well-formed control chain: a device-readable request at `request` and a 4-byte
/// device-writable status at `status`.
pub fn control_chain(request: u64, status: u64) -> [Descriptor; 2] {
    [
        Descriptor::new(
            request,
            pvspin_abi::virtio::ControlRequest::SIZE as u32,
            0,
            0,
        ),
        Descriptor::new(status, 4, DESC_F_WRITE, 0),
    ]
}

/// A split virtqueue of `size` descriptors as a driver sees it, in memory `M`.
pub struct DriverQueue<'m, M: GuestMemory> {
    mock: MockSplitQueue<'m, M>,
    mem: &'m M,
    size: u16,
}

// The mock is not `Debug`: show where the queue lies.
impl<M: GuestMemory> std::fmt::Debug for DriverQueue<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverQueue")
            .field("size", &self.size)
            .field("desc_table", &self.mock.desc_table_addr())
            .field("avail", &self.mock.avail_addr())
            .field("used", &self.mock.used_addr())
            .finish()
    }
}

impl<'m, M: GuestMemory> DriverQueue<'m, M> {
    /// A queue of `size` descriptors at `base` (16-byte aligned), laid out by the mock, which
    /// zeroes both rings' headers.
    pub fn new(mem: &'m M, base: GuestAddress, size: u16) -> Self {
        Self {
            mock: MockSplitQueue::create(mem, base, size),
            mem,
            size,
        }
    }

    /// The mock: ring addresses, the descriptor table and the used ring.
    pub fn mock(&self) -> &MockSplitQueue<'m, M> {
        &self.mock
    }

    /// Writes `descs` as one chain from descriptor 0 (`NEXT` and `next` set by position, the
    /// other flags kept) and makes it available; returns its head.
    pub fn add_chain(&self, descs: &[Descriptor]) -> Result<u16, MockError> {
        for (i, d) in descs.iter().enumerate() {
            let index = u16::try_from(i).map_err(|_| MockError::InvalidIndex)?;
            let (flags, next) = if i + 1 < descs.len() {
                (d.flags() | DESC_F_NEXT, index + 1)
            } else {
                (d.flags() & !DESC_F_NEXT, 0)
            };
            let d = Descriptor::new(d.addr().raw_value(), d.len(), flags, next);
            self.mock
                .desc_table()
                .store(index, RawDescriptor::from(d))?;
        }
        self.publish(0)?;
        Ok(0)
    }

    /// Writes raw descriptor `index % size` (any flags and `next`, for malformed chains).
    pub fn write_desc(&self, index: u16, desc: Descriptor) -> Result<(), MockError> {
        self.mock
            .desc_table()
            .store(index % self.size, RawDescriptor::from(desc))
    }

    /// Puts `head` in the available ring, wrapping, and bumps its index.
    pub fn publish(&self, head: u16) -> Result<(), MockError> {
        let avail = u16::from_le(self.mock.avail().idx().load());
        self.mock
            .avail()
            .ring()
            .ref_at(usize::from(avail % self.size))?
            .store(head.to_le());
        self.mem
            .store(
                avail.wrapping_add(1).to_le(),
                self.mock.avail_addr().unchecked_add(2),
                Ordering::Release,
            )
            .map_err(MockError::GuestMem)
    }

    /// The used ring's index.
    pub fn used_idx(&self) -> Result<u16, MockError> {
        self.mem
            .load(self.mock.used_addr().unchecked_add(2), Ordering::Acquire)
            .map(u16::from_le)
            .map_err(MockError::GuestMem)
    }

    /// Used-ring element `i`, wrapping.
    pub fn used_elem(&self, i: u16) -> Result<VirtqUsedElem, MockError> {
        Ok(self
            .mock
            .used()
            .ring()
            .ref_at(usize::from(i % self.size))?
            .load())
    }
}

/// A fake process for the yield policy: vCPU `i` is thread `FakeThreads::TID_BASE + i`, every
/// thread starts at nice 0. The nice values are shared, so a test keeps a handle after giving
/// the fake to a backend.
#[derive(Clone, Debug)]
pub struct FakeThreads {
    pid: u32,
    confined: bool,
    nice: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u32, i32>>>,
}

impl FakeThreads {
    /// Thread id of vCPU 0.
    pub const TID_BASE: u32 = 1000;

    /// Process `pid` with `vcpus` vCPU threads; boosts allowed when `confined`.
    pub fn new(pid: u32, vcpus: u32, confined: bool) -> Self {
        let nice = (0..vcpus).map(|v| (Self::TID_BASE + v, 0)).collect();
        Self {
            pid,
            confined,
            nice: std::sync::Arc::new(std::sync::Mutex::new(nice)),
        }
    }

    /// The nice values now, by thread id.
    pub fn nice_values(&self) -> std::collections::BTreeMap<u32, i32> {
        self.nice
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl crate::yield_policy::ThreadActions for FakeThreads {
    fn vcpu_threads(&mut self, pid: u32) -> std::io::Result<std::collections::BTreeMap<u32, u32>> {
        if pid != self.pid {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        Ok(self
            .nice_values()
            .keys()
            .map(|t| (t - Self::TID_BASE, *t))
            .collect())
    }

    fn is_vcpu_thread(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        pid == self.pid
            && self.nice_values().contains_key(&tid)
            && Some(tid) == Self::TID_BASE.checked_add(vcpu)
    }

    fn nice(&mut self, _pid: u32, tid: u32) -> std::io::Result<i32> {
        self.nice_values()
            .get(&tid)
            .copied()
            .ok_or(std::io::ErrorKind::NotFound.into())
    }

    fn set_nice(&mut self, tid: u32, nice: i32) -> std::io::Result<()> {
        let mut map = self
            .nice
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(
            map.contains_key(&tid),
            "changed thread {tid}, which is not the VM's"
        );
        assert!((-20..=19).contains(&nice), "nice {nice} out of range");
        map.insert(tid, nice);
        Ok(())
    }

    fn may_lower_to(&mut self, _nice: i32) -> bool {
        true
    }

    fn confinement(&mut self, _pid: u32) -> pvspin_hints::confine::Verdict {
        if self.confined {
            pvspin_hints::confine::Verdict::Confined {
                cgroup: "/sys/fs/cgroup/fake".into(),
            }
        } else {
            pvspin_hints::confine::Verdict::NotConfined {
                reason: pvspin_hints::confine::NotConfinedReason::SharedCgroup {
                    path: "/fake".into(),
                    others: vec!["1".into()],
                },
            }
        }
    }
}

/// A fake `/proc` for the scheduler sampler: vCPU `i` is thread `FakeSched::TID_BASE + i`
/// of process `pid`; each thread's state and counts are set by the test. Clones share the
/// threads, so a test keeps a handle after giving the fake to a backend.
#[derive(Clone, Debug)]
pub struct FakeSched {
    pid: u32,
    threads: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u32, FakeTask>>>,
}

/// One fake thread: state, `schedstat` and switch-outs.
#[derive(Clone, Copy, Debug)]
struct FakeTask {
    state: crate::sched::TaskState,
    stat: crate::sched::SchedStat,
    switches_out: u64,
}

impl FakeSched {
    /// Thread id of vCPU 0.
    pub const TID_BASE: u32 = 2000;

    /// Process `pid` with `vcpus` vCPU threads, all blocked and never run.
    pub fn new(pid: u32, vcpus: u32) -> Self {
        let threads = (0..vcpus)
            .map(|v| {
                (
                    Self::TID_BASE + v,
                    FakeTask {
                        state: crate::sched::TaskState::Blocked,
                        stat: crate::sched::SchedStat::default(),
                        switches_out: 0,
                    },
                )
            })
            .collect();
        Self {
            pid,
            threads: std::sync::Arc::new(std::sync::Mutex::new(threads)),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut std::collections::BTreeMap<u32, FakeTask>) -> R) -> R {
        f(&mut self
            .threads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Sets thread `tid`'s state and switch counts.
    pub fn set(&self, tid: u32, state: crate::sched::TaskState, switches_in: u64, out: u64) {
        self.with(|t| {
            if let Some(task) = t.get_mut(&tid) {
                task.state = state;
                task.stat.switches_in = switches_in;
                task.switches_out = out;
            }
        });
    }

    /// Adds `ns` to thread `tid`'s run time (a tick or a switch-out).
    pub fn add_run(&self, tid: u32, ns: u64) {
        self.with(|t| {
            if let Some(task) = t.get_mut(&tid) {
                task.stat.run_ns += ns;
            }
        });
    }

    /// Thread `tid` exits.
    pub fn remove(&self, tid: u32) {
        self.with(|t| t.remove(&tid));
    }

    /// vCPU `v` is on a CPU (switched in once more than out, its run time moved).
    pub fn running(&self, v: u32) {
        self.step(v, crate::sched::TaskState::Runnable, 1);
    }

    /// vCPU `v` is runnable but descheduled.
    pub fn preempted(&self, v: u32) {
        self.step(v, crate::sched::TaskState::Runnable, 0);
    }

    /// vCPU `v` is blocked (halted).
    pub fn blocked(&self, v: u32) {
        self.step(v, crate::sched::TaskState::Blocked, 0);
    }

    fn step(&self, v: u32, state: crate::sched::TaskState, on_cpu: u64) {
        let tid = Self::TID_BASE + v;
        self.with(|t| {
            if let Some(task) = t.get_mut(&tid) {
                task.state = state;
                task.stat.run_ns += 1000;
                task.stat.switches_in += 1;
                task.switches_out = task.stat.switches_in - on_cpu;
            }
        });
    }

    fn task(&self, tid: u32) -> std::io::Result<FakeTask> {
        self.with(|t| t.get(&tid).copied())
            .ok_or_else(|| std::io::ErrorKind::NotFound.into())
    }
}

impl crate::sched::SchedSource for FakeSched {
    fn vcpu_threads(&mut self, pid: u32) -> std::io::Result<std::collections::BTreeMap<u32, u32>> {
        if pid != self.pid {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        Ok(self.with(|t| t.keys().map(|tid| (tid - Self::TID_BASE, *tid)).collect()))
    }

    fn watch(&mut self, pid: u32, tid: u32, vcpu: u32) -> bool {
        pid == self.pid && Some(tid) == Self::TID_BASE.checked_add(vcpu) && self.task(tid).is_ok()
    }

    fn schedstat(&mut self, tid: u32) -> std::io::Result<crate::sched::SchedStat> {
        Ok(self.task(tid)?.stat)
    }

    fn state(&mut self, tid: u32) -> std::io::Result<crate::sched::TaskState> {
        Ok(self.task(tid)?.state)
    }

    fn switches(&mut self, tid: u32) -> std::io::Result<(crate::sched::TaskState, u64)> {
        let t = self.task(tid)?;
        Ok((t.state, t.switches_out))
    }

    fn forget(&mut self, _tid: u32) {}
}
