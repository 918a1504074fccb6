//! Seccomp filters for every thread of a run: the test VM's own needs per thread, merged with
//! the runtime baseline and pvspin's rules for what pvspin does on that thread
//! (`pvspin::seccomp`).
//!
//! | thread | started by | filter installed | pvspin's rules |
//! |---|---|---|---|
//! | `vcpuN` | the VMM thread | first thing on the thread, before its first `KVM_RUN` | [`ThreadKind::Vcpu`] |
//! | `hogN` | the VMM thread | first thing on the thread | none |
//! | `pvspin-boost-wd`, `pvspin-slot-watch` | pvspin, in `build` | first thing on the thread (`PvSpinBuilder::helper_thread_filter`) | [`ThreadKind::BoostWatchdog`], [`ThreadKind::SlotWatcher`] |
//! | `vmm` (the run's own thread) | [`crate::vmm::run`] | after setup, once every vCPU and hog thread runs | [`ThreadKind::Control`] |
//! | the binary's main thread (`run` only) | | once the `vmm` thread has started | none |
//!
//! The lists were taken from `strace -f` of every workload, kick path and PV mode with the
//! filters in `--seccomp log` mode: for each thread, the syscalls after its `seccomp(2)` call.
//! What the threads did before (setup, thread start) needs no rule.
//!
//! One call no list allows is answered instead of killing: glibc's allocator opens
//! `/proc/sys/vm/overcommit_memory` once per process, on whichever thread first shrinks a
//! thread arena's heap (see [`refuse_overcommit_probe`]); every thread's program refuses that
//! open with `EACCES`, and glibc carries on without it.

use std::collections::BTreeMap;
use std::sync::Arc;

use pvspin::seccomp::{self, RuleMap, SeccompError, ThreadKind};
use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompRule,
};

use crate::config::SeccompMode;

/// The test VM's own KVM requests after setup, as kvm-ioctls defines them.
mod nr {
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr};

    ioctl_io_nr!(KVM_RUN, kvm_bindings::KVMIO, 0x80);
    ioctl_ior_nr!(
        KVM_GET_REGS,
        kvm_bindings::KVMIO,
        0x81,
        kvm_bindings::kvm_regs
    );
    ioctl_ior_nr!(
        KVM_GET_SREGS,
        kvm_bindings::KVMIO,
        0x83,
        kvm_bindings::kvm_sregs
    );
}
use nr::{KVM_GET_REGS, KVM_GET_SREGS, KVM_RUN};

/// The threads of a run, by what they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmmThread {
    /// A vCPU thread: `KVM_RUN`, pvspin's hooks, the test VM's devices.
    Vcpu,
    /// A busy host thread (`--hogs`).
    Hog,
    /// pvspin's boost watchdog.
    BoostWatchdog,
    /// The run's own thread after setup: the event loop, stopping and joining the vCPUs,
    /// pvspin's telemetry and shutdown, the report.
    Vmm,
    /// The binary's main thread while `run` runs the VM and after: waits for the VMM thread,
    /// prints the report, writes `--stats-file`.
    Main,
}

impl VmmThread {
    /// Every thread kind.
    pub const ALL: [VmmThread; 5] = [
        VmmThread::Vcpu,
        VmmThread::Hog,
        VmmThread::BoostWatchdog,
        VmmThread::Vmm,
        VmmThread::Main,
    ];
}

/// A condition on one 32-bit argument.
fn arg_eq(arg: u8, value: u64) -> SeccompRule {
    // Fixed tables: argument indexes are below 6 and every rule has one condition.
    SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        value,
    )
    .expect("argument index below 6")])
    .expect("one condition")
}

fn allow(nrs: &[i64]) -> RuleMap {
    nrs.iter().map(|&nr| (nr, Vec::new())).collect()
}

/// What a vhost-user frontend adds (`--pv-backend vhost-user:PATH`): vCPU threads send the
/// device state to the backend when the driver starts or resets the device (requests with
/// descriptors, `sendmsg`/`recvmsg`); the VMM thread relays kicks while the backend is gone
/// (eventfd reads and writes it already has) and reconnects (a Unix socket, `connect`, then the
/// same requests).
fn vhost_user_rules(thread: VmmThread) -> RuleMap {
    match thread {
        VmmThread::Vcpu => allow(&[libc::SYS_sendmsg, libc::SYS_recvmsg]),
        VmmThread::Vmm => {
            let mut map = allow(&[
                libc::SYS_connect,
                libc::SYS_sendmsg,
                libc::SYS_recvmsg,
                libc::SYS_timerfd_settime,
            ]);
            map.insert(libc::SYS_socket, vec![arg_eq(0, libc::AF_UNIX as u64)]);
            map
        }
        VmmThread::Hog | VmmThread::BoostWatchdog | VmmThread::Main => RuleMap::new(),
    }
}

/// The test VM's own syscalls on `thread` (without the baseline and pvspin's); `vhost_user`:
/// the run has a vhost-user backend.
pub fn own_rules(thread: VmmThread, vhost_user: bool) -> RuleMap {
    let mut map = own_rules_in_process(thread);
    if vhost_user {
        seccomp::merge(&mut map, vhost_user_rules(thread));
    }
    map
}

fn own_rules_in_process(thread: VmmThread) -> RuleMap {
    match thread {
        VmmThread::Vcpu => {
            let mut map = allow(&[
                // The end-of-run eventfd, the console echo to stdout, log records.
                libc::SYS_write,
                // Parking a finished vCPU (Condvar), shared state.
                libc::SYS_futex,
            ]);
            // KVM_RUN; the registers of a failed or stopped vCPU for its report.
            map.insert(
                libc::SYS_ioctl,
                [KVM_RUN(), KVM_GET_REGS(), KVM_GET_SREGS()]
                    .into_iter()
                    .map(|nr| arg_eq(1, nr))
                    .collect(),
            );
            map
        }
        VmmThread::Hog | VmmThread::BoostWatchdog => RuleMap::new(),
        VmmThread::Vmm => {
            let mut map = allow(&[
                // The event loop: the end-of-run eventfd, the watchdog timer, stdin.
                libc::SYS_epoll_wait,
                libc::SYS_epoll_ctl,
                libc::SYS_read,
                libc::SYS_write,
                // Kicking vCPU threads out of KVM_RUN (pthread_kill).
                libc::SYS_getpid,
                libc::SYS_futex,
                // Dropping the VM, its vCPUs, memory and event loop.
                libc::SYS_close,
                libc::SYS_munmap,
            ]);
            map.insert(
                libc::SYS_tgkill,
                vec![arg_eq(
                    2,
                    u64::from(pvspin::interrupt::default_signal() as u32),
                )],
            );
            map
        }
        VmmThread::Main => {
            let mut map = allow(&[libc::SYS_write, libc::SYS_close, libc::SYS_futex]);
            // `--stats-file`: created write-only, never read.
            let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC;
            map.insert(libc::SYS_openat, vec![arg_eq(2, u64::from(flags as u32))]);
            map
        }
    }
}

/// Everything `thread` may call: the baseline, the test VM's own needs and pvspin's.
pub fn thread_rules(thread: VmmThread, vhost_user: bool) -> Result<RuleMap, SeccompError> {
    let mut map = seccomp::baseline_rules()?;
    seccomp::merge(&mut map, own_rules(thread, vhost_user));
    match thread {
        VmmThread::Vcpu => seccomp::merge_into(&mut map, ThreadKind::Vcpu)?,
        VmmThread::BoostWatchdog => {
            // One filter for pvspin's helper threads: the boost watchdog and the slot watcher.
            seccomp::merge_into(&mut map, ThreadKind::BoostWatchdog)?;
            seccomp::merge_into(&mut map, ThreadKind::SlotWatcher)?;
        }
        VmmThread::Vmm => seccomp::merge_into(&mut map, ThreadKind::Control)?,
        VmmThread::Hog | VmmThread::Main => {}
    }
    Ok(map)
}

/// `AUDIT_ARCH_X86_64` (`EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`), what the kernel
/// puts in `seccomp_data.arch` for an x86-64 syscall (the test VM is x86-64 only).
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// Offsets in `struct seccomp_data`: `nr`, `arch`, and the low halves of `args[0]` and
/// `args[2]` (little-endian).
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARG0_LOW: u32 = 16;
const DATA_ARG2_LOW: u32 = 16 + 2 * 8;
/// The flags glibc's `check_may_shrink_heap` opens `/proc/sys/vm/overcommit_memory` with.
const PROBE_FLAGS: u32 = (libc::O_RDONLY | libc::O_CLOEXEC) as u32;

/// Puts in front of `program` a test that answers `openat(AT_FDCWD, _, O_RDONLY | O_CLOEXEC)`
/// with `EACCES`, whatever `program` would do with it; every other syscall goes to `program`
/// unchanged.
///
/// Why: glibc's `free` shrinks a thread arena's heap (`heap_trim`, `shrink_heap`) once a free
/// leaves a consolidated chunk of at least 64 KiB and the heap's top above `M_TRIM_THRESHOLD`;
/// the first time any thread of the process does, `check_may_shrink_heap` opens
/// `/proc/sys/vm/overcommit_memory` (`O_RDONLY | O_CLOEXEC`) to learn whether strict overcommit
/// accounting is on. That happens long after setup, on whichever thread frees: with
/// `--workload hello` it is the VMM thread dropping the vCPUs' state at the end of a run of
/// about 180 vCPUs or more (fewer vCPUs never free that much in one arena), or the main thread
/// freeing the report; no allow-list could name the thread in advance. Allowing the open would
/// let every thread open any file for reading (a filter cannot see the path). Refused, the open
/// costs glibc nothing it needs: with no descriptor it caches "not strict" and releases the
/// memory with `madvise(MADV_DONTNEED)` instead of remapping it, which under
/// `vm.overcommit_memory=2` only keeps that range counted against the commit limit.
///
/// Nothing else the test VM or pvspin does opens with exactly these flags after setup (the
/// main thread's `--stats-file` is created write-only).
pub fn refuse_overcommit_probe(program: BpfProgram) -> BpfProgram {
    let ld = |offset: u32| sock_filter {
        code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
        jt: 0,
        jf: 0,
        k: offset,
    };
    // On a mismatch, jump to the first instruction of `program` (index 9).
    let jeq_or_skip = |value: u32, at: u8| sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt: 0,
        jf: 9 - at - 1,
        k: value,
    };
    let mut out = vec![
        ld(DATA_ARCH),
        jeq_or_skip(AUDIT_ARCH_X86_64, 1),
        ld(DATA_NR),
        jeq_or_skip(libc::SYS_openat as u32, 3),
        ld(DATA_ARG0_LOW),
        jeq_or_skip(libc::AT_FDCWD as u32, 5),
        ld(DATA_ARG2_LOW),
        jeq_or_skip(PROBE_FLAGS, 7),
        sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EACCES as u32,
        },
    ];
    out.extend(program);
    out
}

/// The compiled filters of one run.
#[derive(Clone, Debug)]
pub struct Filters {
    programs: BTreeMap<u8, Arc<BpfProgram>>,
}

fn key(thread: VmmThread) -> u8 {
    thread as u8
}

impl Filters {
    /// Compiles every thread's filter for `mode`; `None` when `mode` is `Off`. `vhost_user`:
    /// the run has a vhost-user backend.
    pub fn new(mode: SeccompMode, vhost_user: bool) -> Result<Option<Filters>, SeccompError> {
        let mismatch = match mode {
            SeccompMode::Enforce => SeccompAction::KillProcess,
            SeccompMode::Log => SeccompAction::Log,
            SeccompMode::Off => return Ok(None),
        };
        let programs = VmmThread::ALL
            .into_iter()
            .map(|thread| {
                let program =
                    seccomp::compile(thread_rules(thread, vhost_user)?, mismatch.clone())?;
                Ok((key(thread), Arc::new(refuse_overcommit_probe(program))))
            })
            .collect::<Result<_, SeccompError>>()?;
        Ok(Some(Filters { programs }))
    }

    /// The filter of `thread`.
    pub fn program(&self, thread: VmmThread) -> Arc<BpfProgram> {
        self.programs[&key(thread)].clone()
    }

    /// Installs the filter of `thread` on the calling thread.
    pub fn apply(&self, thread: VmmThread) -> Result<(), InstallError> {
        install(&self.programs[&key(thread)], thread)
    }
}

/// A thread's seccomp filter that could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("installing the {thread:?} seccomp filter: {source}")]
pub struct InstallError {
    /// Whose filter it is.
    pub thread: VmmThread,
    /// What seccompiler (the kernel) answered.
    #[source]
    pub source: seccompiler::Error,
}

/// Installs `program`, the filter of `thread`, on the calling thread.
pub fn install(program: &BpfProgram, thread: VmmThread) -> Result<(), InstallError> {
    seccompiler::apply_filter(program).map_err(|source| InstallError { thread, source })
}

/// Test aid (`--seccomp-violation`): a syscall no thread's filter allows. Under `enforce`
/// the process dies of `SIGSYS` here; under `log` or `off` it goes on.
pub fn violate() {
    eprintln!("pvspin-vmm: seccomp test aid: calling socket(2), which no filter allows");
    // SAFETY: socket takes no pointers; a descriptor it returns is closed at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned to us and nothing else uses it.
        unsafe { libc::close(fd) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_filter_compiles_in_every_mode() {
        for mode in [SeccompMode::Enforce, SeccompMode::Log] {
            let filters = Filters::new(mode, false).unwrap().unwrap();
            for thread in VmmThread::ALL {
                assert!(!filters.program(thread).is_empty());
            }
        }
        assert!(Filters::new(SeccompMode::Off, false).unwrap().is_none());
        assert!(Filters::new(SeccompMode::Enforce, true).unwrap().is_some());
    }

    #[test]
    fn the_overcommit_probe_is_refused_and_nothing_else_changes() {
        let allow_all = vec![sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        }];
        let program = refuse_overcommit_probe(allow_all);
        // Filters are per thread: only this one is confined.
        let results = std::thread::spawn(move || {
            seccompiler::apply_filter(&program).expect("installing the filter");
            let open = |path: &std::ffi::CStr, dir: i32, flags: i32| {
                // SAFETY: a valid NUL-terminated path; the descriptor is closed below.
                let fd = unsafe { libc::openat(dir, path.as_ptr(), flags) };
                if fd < 0 {
                    return std::io::Error::last_os_error().raw_os_error().unwrap_or(-1);
                }
                // SAFETY: our own new descriptor.
                unsafe { libc::close(fd) };
                0
            };
            let probe = c"/proc/sys/vm/overcommit_memory";
            let flags = libc::O_RDONLY | libc::O_CLOEXEC;
            [
                open(probe, libc::AT_FDCWD, flags),
                // Whatever the path: a filter cannot see it.
                open(c"/dev/null", libc::AT_FDCWD, flags),
                // Other flags or a directory descriptor go to the thread's own filter (here:
                // allow everything).
                open(probe, libc::AT_FDCWD, libc::O_RDONLY),
                open(
                    c"/dev/null",
                    libc::AT_FDCWD,
                    libc::O_WRONLY | libc::O_CLOEXEC,
                ),
                open(c"/proc/sys/vm/overcommit_memory", -1, flags),
            ]
        })
        .join()
        .expect("the confined thread");
        // The last: an absolute path ignores the (invalid) directory descriptor.
        assert_eq!(results, [libc::EACCES, libc::EACCES, 0, 0, 0]);
    }

    #[test]
    fn every_thread_filter_starts_with_the_overcommit_refusal() {
        let prefix = refuse_overcommit_probe(Vec::new());
        for mode in [SeccompMode::Enforce, SeccompMode::Log] {
            let filters = Filters::new(mode, true).unwrap().unwrap();
            for thread in VmmThread::ALL {
                assert_eq!(filters.program(thread)[..prefix.len()], prefix[..]);
            }
        }
    }

    #[test]
    fn vcpu_ioctls_are_the_examples_and_pvspins() {
        let map = thread_rules(VmmThread::Vcpu, false).unwrap();
        // The test VM's own vCPU ioctls and pvspin's (KVM_SET_MP_STATE, KVM_SIGNAL_MSI,
        // KVM_GET_MSRS; KVM_RUN is both's).
        assert_eq!(map[&libc::SYS_ioctl].len(), 6);
        assert_eq!(KVM_RUN(), 0xae80);
        // The VMM's unconditional write stays unconditional after the baseline's stderr rule.
        assert!(map[&libc::SYS_write].is_empty());
        for thread in VmmThread::ALL {
            let map = thread_rules(thread, false).unwrap();
            assert!(!map.contains_key(&libc::SYS_socket), "{thread:?}");
            assert!(!map.contains_key(&libc::SYS_execve), "{thread:?}");
        }
    }

    #[test]
    fn only_a_vhost_user_run_may_reconnect_and_only_over_unix_sockets() {
        for thread in VmmThread::ALL {
            let map = thread_rules(thread, true).unwrap();
            assert!(!map.contains_key(&libc::SYS_execve), "{thread:?}");
            match thread {
                VmmThread::Vmm => assert_eq!(map[&libc::SYS_socket].len(), 1),
                _ => assert!(!map.contains_key(&libc::SYS_socket), "{thread:?}"),
            }
        }
        assert!(!thread_rules(VmmThread::Vcpu, false)
            .unwrap()
            .contains_key(&libc::SYS_sendmsg));
        assert!(thread_rules(VmmThread::Vcpu, true)
            .unwrap()
            .contains_key(&libc::SYS_sendmsg));
    }
}
