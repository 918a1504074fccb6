//! Test support: building split virtqueues in guest memory, as a driver would. Used by the
//! unit tests, the integration tests (which drive the daemon with vhost's own frontend) and
//! the fuzz target; it is not needed to run the daemon.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

/// `VRING_DESC_F_NEXT`.
pub const DESC_F_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE`.
pub const DESC_F_WRITE: u16 = 2;

/// Errors of ring building.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum RingError {
    /// guest memory: {0}
    Memory(#[from] vm_memory::GuestMemoryError),
    /// the queue has {0} descriptors
    Full(u16),
}

/// A split virtqueue laid out at fixed guest addresses, with the driver's view of it.
#[derive(Clone, Copy, Debug)]
pub struct SplitRing {
    /// Queue size (a power of two).
    pub size: u16,
    /// Descriptor table address (16-byte aligned).
    pub desc_table: GuestAddress,
    /// Available ring address.
    pub avail: GuestAddress,
    /// Used ring address (4-byte aligned).
    pub used: GuestAddress,
    next_desc: u16,
    avail_idx: u16,
}

/// One descriptor: address, length, device-writable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Buffer address.
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

impl Desc {
    /// The well-formed control chain: a device-readable request at `request` and a 4-byte
    /// device-writable status at `status`.
    pub fn control_chain(request: u64, status: u64) -> [Desc; 2] {
        [
            Desc {
                addr: request,
                len: pvspin_abi::virtio::ControlRequest::SIZE as u32,
                write: false,
            },
            Desc {
                addr: status,
                len: 4,
                write: true,
            },
        ]
    }
}

impl SplitRing {
    /// Bytes a ring of `size` takes from its base: table, avail ring, used ring (page aligned).
    pub fn footprint(size: u16) -> u64 {
        let n = u64::from(size);
        let used = (16 * n + 6 + 2 * n + 4095) & !4095;
        used + 6 + 8 * n
    }

    /// A ring of `size` descriptors at `base` (4 KiB aligned), zeroing its memory.
    pub fn new<M: GuestMemoryBackend>(
        mem: &M,
        base: GuestAddress,
        size: u16,
    ) -> Result<Self, RingError> {
        let n = u64::from(size);
        let used_off = (16 * n + 6 + 2 * n + 4095) & !4095;
        let ring = Self {
            size,
            desc_table: base,
            avail: GuestAddress(base.0 + 16 * n),
            used: GuestAddress(base.0 + used_off),
            next_desc: 0,
            avail_idx: 0,
        };
        mem.write_slice(&vec![0u8; Self::footprint(size) as usize], base)?;
        Ok(ring)
    }

    /// Writes a chain of `descs` and makes it available; returns its head index.
    pub fn add_chain<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        descs: &[Desc],
    ) -> Result<u16, RingError> {
        if descs.is_empty() || usize::from(self.size) < descs.len() {
            return Err(RingError::Full(self.size));
        }
        let head = self.next_desc % self.size;
        for (i, d) in descs.iter().enumerate() {
            let index = (head + i as u16) % self.size;
            let mut flags = if d.write { DESC_F_WRITE } else { 0 };
            let next = (index + 1) % self.size;
            if i + 1 < descs.len() {
                flags |= DESC_F_NEXT;
            }
            self.write_desc(mem, index, d.addr, d.len, flags, next)?;
        }
        self.next_desc = self.next_desc.wrapping_add(descs.len() as u16);
        self.publish(mem, head)?;
        Ok(head)
    }

    /// Writes raw descriptor `index` (any flags and `next`, for malformed chains).
    pub fn write_desc<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        index: u16,
        addr: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) -> Result<(), RingError> {
        let at = GuestAddress(self.desc_table.0 + 16 * u64::from(index % self.size));
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, at)?;
        Ok(())
    }

    /// Puts `head` in the available ring and bumps its index.
    pub fn publish<M: GuestMemoryBackend>(&mut self, mem: &M, head: u16) -> Result<(), RingError> {
        let slot = u64::from(self.avail_idx % self.size);
        mem.write_obj(head.to_le(), GuestAddress(self.avail.0 + 4 + 2 * slot))?;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.store(
            self.avail_idx.to_le(),
            GuestAddress(self.avail.0 + 2),
            std::sync::atomic::Ordering::Release,
        )?;
        Ok(())
    }

    /// The used ring's index.
    pub fn used_idx<M: GuestMemoryBackend>(&self, mem: &M) -> Result<u16, RingError> {
        let v: u16 = mem.load(
            GuestAddress(self.used.0 + 2),
            std::sync::atomic::Ordering::Acquire,
        )?;
        Ok(u16::from_le(v))
    }

    /// Used-ring element `i`: (descriptor head, length).
    pub fn used_elem<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        i: u16,
    ) -> Result<(u32, u32), RingError> {
        let at = GuestAddress(self.used.0 + 4 + 8 * u64::from(i % self.size));
        let id: u32 = mem.read_obj(at)?;
        let len: u32 = mem.read_obj(GuestAddress(at.0 + 4))?;
        Ok((u32::from_le(id), u32::from_le(len)))
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
