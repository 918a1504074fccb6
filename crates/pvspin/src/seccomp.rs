//! The system calls pvspin makes, per kind of thread, as `seccompiler` rules a VMM merges into
//! its own seccomp filters.
//!
//! A VMM that confines its threads with seccomp (Firecracker and Cloud Hypervisor do, with
//! `seccompiler`) has to allow what pvspin's code does on them. [`rules`] lists exactly that,
//! per [`ThreadKind`], in `seccompiler`'s rule-map type; [`merge_into`] adds it to the VMM's own
//! map for that thread, and [`compile`] turns a map into a BPF program for the host. Rules
//! restrict arguments where pvspin's use allows it: `ioctl` to the KVM request numbers pvspin
//! issues on that thread, `getrusage` to `RUSAGE_THREAD`, `getpriority`/`setpriority` to
//! `PRIO_PROCESS`.
//!
//! **What the lists cover.** [`rules`] lists pvspin's own calls only, from the moment the
//! thread's filter is installed until the thread ends. What every Rust thread of a glibc
//! program needs to run at all (the allocator, `std`'s locks, signal return, thread exit) is
//! [`baseline_rules`], kept separate: a VMM with filters already allows it (or its own
//! variant), and one without can merge it. Neither list covers:
//! * **setup**: [`PvSpinBuilder::build`](crate::PvSpinBuilder::build),
//!   [`PvSpin::configure_vm`](crate::PvSpin::configure_vm),
//!   [`PvSpin::configure_vcpu`](crate::PvSpin::configure_vcpu) and the wiring calls open
//!   descriptors, register eventfds, check CPUID and probe the scheduler; like a VMM's own setup they run
//!   before its threads are confined. `build` also starts and joins the `pvspin-probe` thread
//!   (with a `nice` or `fifo` actuator: it tries a boost on a throwaway thread); that thread
//!   lives only inside `build`, so it needs no rules of its own, but a VMM that calls `build`
//!   on an already confined thread confines it with that thread's filter (seccomp filters are
//!   inherited by new threads), which must then allow setup too.
//! * **the VMM's own code**: `KVM_RUN` and the VMM's exit handling on vCPU threads, its
//!   [`VcpuInterrupter`](crate::VcpuInterrupter) (a signal, typically `tgkill`), and its
//!   logger: pvspin logs through the `log` crate, so whatever the VMM's logger does (writing
//!   to stderr, say) is the VMM's to allow on every thread pvspin runs on.
//!
//! **Merging.** `seccompiler` allows a syscall unconditionally when its rule vector is empty,
//! and when any of its rules matches otherwise. [`merge`] keeps that meaning: an unconditional
//! entry on either side stays unconditional, two conditional ones are joined (without
//! duplicates), so the merged map allows exactly the union of what both allow.
//!
//! **Helper threads.** pvspin starts one long-lived thread: the boost watchdog of the `nice`
//! and `fifo` directed-yield actuators ([`ThreadKind::BoostWatchdog`]), inside `build`. Give
//! its filter to [`PvSpinBuilder::helper_thread_filter`](crate::PvSpinBuilder::helper_thread_filter):
//! pvspin installs it as the first thing on that thread.
//!
//! ```no_run
//! use pvspin::seccomp::{self, RuleMap, ThreadKind};
//! use seccompiler::{SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
//!
//! // The VMM's own needs on a vCPU thread (here only KVM_RUN, _IO(KVMIO, 0x80))...
//! let kvm_run = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, 0xae80)?;
//! let mut vcpu = RuleMap::from([(libc::SYS_ioctl, vec![SeccompRule::new(vec![kvm_run])?])]);
//! // ...plus the runtime baseline and pvspin's hooks.
//! seccomp::merge(&mut vcpu, seccomp::baseline_rules()?);
//! seccomp::merge_into(&mut vcpu, ThreadKind::Vcpu)?;
//! let program = seccomp::compile(vcpu, SeccompAction::KillProcess)?;
//! // On the vCPU thread, before its first KVM_RUN:
//! seccompiler::apply_filter(&program)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};
/// `seccompiler`'s rule map: syscall number to rules (an empty vector allows the syscall
/// whatever its arguments).
pub type RuleMap = BTreeMap<i64, Vec<SeccompRule>>;

/// The KVM requests pvspin issues after setup, defined as kvm-ioctls defines them
/// (`src/kvm_ioctls.rs` there; its numbers are not public).
mod nr {
    use vmm_sys_util::ioctl_iow_nr;

    // `_IOW(KVMIO, 0x99, struct kvm_mp_state)`: a WAIT halts the vCPU (MSI kick paths).
    ioctl_iow_nr!(
        KVM_SET_MP_STATE,
        kvm_bindings::KVMIO,
        0x99,
        kvm_bindings::kvm_mp_state
    );
    // `_IOW(KVMIO, 0xa5, struct kvm_msi)`: a kick's REMRD MSI (signal-msi path, in-kernel
    // fallback); the same definition `crate::kick` sends with.
    pub(super) use crate::kick::KVM_SIGNAL_MSI;
    // `_IO(KVMIO, 0x80)`: `VcpuThread::run` (the ready interrupter) runs the vCPU.
    vmm_sys_util::ioctl_io_nr!(KVM_RUN, kvm_bindings::KVMIO, 0x80);
    // `_IOWR(KVMIO, 0x88, struct kvm_msrs)`: run slots read MSR_KVM_STEAL_TIME once.
    vmm_sys_util::ioctl_iowr_nr!(
        KVM_GET_MSRS,
        kvm_bindings::KVMIO,
        0x88,
        kvm_bindings::kvm_msrs
    );
}
use nr::{KVM_GET_MSRS, KVM_RUN, KVM_SET_MP_STATE, KVM_SIGNAL_MSI};

/// The KVM requests of pvspin's setup (`configure_vm`, `set_kick_gsis`,
/// `KickWiring::register`, `configure_vcpu`), for [`setup_rules`].
mod setup_nr {
    use kvm_bindings::KVMIO;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
    ioctl_iowr_nr!(
        KVM_GET_SUPPORTED_CPUID,
        KVMIO,
        0x05,
        kvm_bindings::kvm_cpuid2
    );
    ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_bindings::kvm_irqfd);
    ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_bindings::kvm_ioeventfd);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_bindings::kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_bindings::kvm_lapic_state);
    ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_bindings::kvm_cpuid2);
    ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_bindings::kvm_enable_cap);
    ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
    ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);
}

/// Errors building or compiling rules.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SeccompError {
    /// seccomp rule for {syscall}: {source}
    Rule {
        /// The syscall's name.
        syscall: &'static str,
        /// What `seccompiler` said.
        #[source]
        source: BackendError,
    },
    /// seccomp: host architecture {arch}: {source}
    Arch {
        /// `std::env::consts::ARCH`.
        arch: &'static str,
        /// What `seccompiler` said.
        #[source]
        source: BackendError,
    },
    /// compiling the seccomp filter: {0}
    Compile(#[source] BackendError),
}

/// A kind of thread pvspin's code runs on after setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ThreadKind {
    /// A vCPU thread running [`VcpuHooks`](crate::VcpuHooks) (`before_run`, `handle_exit`,
    /// `after_run`): `KVM_SET_MP_STATE` on its own vCPU (a WAIT on the in-kernel and
    /// signal-msi paths is KVM's halt) and `KVM_SIGNAL_MSI` on pvspin's duplicate of the VM
    /// fd (a kick on the signal-msi path, and a kick that missed its ioeventfd on the
    /// in-kernel path); the userspace path's park of the thread on its wake latch and the
    /// wake-up of a parked one (`futex`); directed yield: `gettid` once, `sched_yield`,
    /// `getrusage(RUSAGE_THREAD)` (did the yield deschedule the thread), and the bounded boosts
    /// of *other* vCPU threads and their restore (`getpriority`/`setpriority` with
    /// `PRIO_PROCESS`, `sched_getscheduler`/`sched_getparam`/`sched_setscheduler`); clock
    /// reads (`clock_gettime`, normally answered by the vDSO without a syscall). With the
    /// ready interrupter, `KVM_RUN` itself ([`VcpuThread::run`](crate::VcpuThread::run)) and
    /// the return from its signal handler (`rt_sigreturn`, in the baseline); `tgkill` and
    /// `getpid` when a vCPU thread interrupts another (`PvSpin::interrupt` from a vCPU
    /// thread, run slots); with run slots, `KVM_GET_MSRS` (`MSR_KVM_STEAL_TIME`, once per
    /// vCPU).
    Vcpu,
    /// The boost watchdog `pvspin-boost-wd` (`pvspin_hints::boost`) that the `nice` and
    /// `fifo` actuators start in `build`: sleeps on a condition variable with a timeout
    /// (`futex`, `clock_gettime`), restores boosts whose deadline passed (`setpriority`,
    /// `sched_setscheduler`), and with `fifo` raises itself to `SCHED_FIFO` once (`gettid`,
    /// `sched_setscheduler`).
    BoostWatchdog,
    /// The run slots' halt watcher `pvspin-slot-watch` (`pvspin_slots::watch`) that `build`
    /// starts for run slots on the in-kernel and signal-msi kick paths: reads KVM's `blocking`
    /// statistic of the watched vCPUs (`pread64`), sleeps between polls (`clock_nanosleep`,
    /// `nanosleep`) and on a condition variable (`futex`), and forces a vCPU out of `KVM_RUN`
    /// through the interrupter ([`SignalInterrupter`](crate::SignalInterrupter): `tgkill`,
    /// `getpid`).
    SlotWatcher,
    /// A VMM thread that calls [`PvSpin`](crate::PvSpin)'s run-time methods after setup
    /// (`telemetry`, `shutdown`, `interrupt`, the statistics getters) and drops it at the end:
    /// reads KVM's statistics fds (`pread64`), releases parked vCPU threads and joins the
    /// watchdog (`futex`), ends every boost at shutdown (`setpriority`, `sched_setscheduler`),
    /// closes pvspin's descriptors (`close`); [`SignalInterrupter`](crate::SignalInterrupter)
    /// signals vCPU threads (`tgkill`, `getpid`); `check` and `telemetry` ask whether the
    /// interrupt signal's handler is still the interrupter's (`rt_sigaction` with a null new
    /// action: a query).
    Control,
}

impl ThreadKind {
    /// Every kind.
    pub const ALL: [ThreadKind; 4] = [
        ThreadKind::Vcpu,
        ThreadKind::BoostWatchdog,
        ThreadKind::SlotWatcher,
        ThreadKind::Control,
    ];

    /// A short name (`vcpu`, `boost-watchdog`, `slot-watcher`, `control`).
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::BoostWatchdog => "boost-watchdog",
            ThreadKind::SlotWatcher => "slot-watcher",
            ThreadKind::Control => "control",
        }
    }
}

impl std::fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One allowed syscall: by number, with a name for errors and a condition on one argument.
struct Need {
    nr: i64,
    name: &'static str,
    /// `None`: any arguments; `Some((arg, values))`: argument `arg` (32 bits) is one of
    /// `values`.
    arg: Option<(u8, Vec<u64>)>,
}

fn any(nr: i64, name: &'static str) -> Need {
    Need {
        nr,
        name,
        arg: None,
    }
}

fn arg_in(nr: i64, name: &'static str, arg: u8, values: Vec<u64>) -> Need {
    Need {
        nr,
        name,
        arg: Some((arg, values)),
    }
}

fn unsigned(v: libc::c_int) -> u64 {
    // Compared as 32-bit words: the bit pattern is what the kernel sees.
    u64::from(v as u32)
}

fn needs(kind: ThreadKind) -> Vec<Need> {
    let prio_process = unsigned(libc::PRIO_PROCESS as libc::c_int);
    let sched = || {
        [
            any(libc::SYS_sched_getscheduler, "sched_getscheduler"),
            any(libc::SYS_sched_getparam, "sched_getparam"),
            any(libc::SYS_sched_setscheduler, "sched_setscheduler"),
        ]
    };
    match kind {
        ThreadKind::Vcpu => {
            let mut v = vec![
                arg_in(
                    libc::SYS_ioctl,
                    "ioctl",
                    1,
                    vec![
                        KVM_SET_MP_STATE(),
                        KVM_SIGNAL_MSI(),
                        KVM_RUN(),
                        KVM_GET_MSRS(),
                    ],
                ),
                any(libc::SYS_futex, "futex"),
                any(libc::SYS_tgkill, "tgkill"),
                any(libc::SYS_getpid, "getpid"),
                any(libc::SYS_sched_yield, "sched_yield"),
                arg_in(
                    libc::SYS_getrusage,
                    "getrusage",
                    0,
                    vec![unsigned(libc::RUSAGE_THREAD)],
                ),
                any(libc::SYS_gettid, "gettid"),
                arg_in(libc::SYS_getpriority, "getpriority", 0, vec![prio_process]),
                arg_in(libc::SYS_setpriority, "setpriority", 0, vec![prio_process]),
                any(libc::SYS_clock_gettime, "clock_gettime"),
            ];
            v.extend(sched());
            v
        }
        ThreadKind::BoostWatchdog => vec![
            any(libc::SYS_futex, "futex"),
            any(libc::SYS_clock_gettime, "clock_gettime"),
            any(libc::SYS_gettid, "gettid"),
            arg_in(libc::SYS_setpriority, "setpriority", 0, vec![prio_process]),
            any(libc::SYS_sched_setscheduler, "sched_setscheduler"),
        ],
        ThreadKind::SlotWatcher => vec![
            any(libc::SYS_pread64, "pread64"),
            any(libc::SYS_futex, "futex"),
            any(libc::SYS_clock_nanosleep, "clock_nanosleep"),
            any(libc::SYS_nanosleep, "nanosleep"),
            any(libc::SYS_tgkill, "tgkill"),
            any(libc::SYS_getpid, "getpid"),
            any(libc::SYS_clock_gettime, "clock_gettime"),
        ],
        ThreadKind::Control => vec![
            // `PvSpin::check` asks whether the interrupt signal's handler is still
            // SignalInterrupter's: a query, with a null new action.
            arg_in(libc::SYS_rt_sigaction, "rt_sigaction", 1, vec![0]),
            any(libc::SYS_pread64, "pread64"),
            any(libc::SYS_futex, "futex"),
            any(libc::SYS_close, "close"),
            any(libc::SYS_tgkill, "tgkill"),
            any(libc::SYS_getpid, "getpid"),
            arg_in(libc::SYS_setpriority, "setpriority", 0, vec![prio_process]),
            any(libc::SYS_sched_setscheduler, "sched_setscheduler"),
            any(libc::SYS_clock_gettime, "clock_gettime"),
        ],
    }
}

/// What any thread of a Rust program on glibc needs between the moment its filter is
/// installed and its end, before doing anything of its own: the allocator (`brk`, `mmap`,
/// `mprotect`, `munmap`, `mremap`, `madvise`), `std`'s locks, once-cells and joins (`futex`),
/// returning from a signal handler (`rt_sigreturn`), thread exit (`rt_sigprocmask`,
/// `sigaltstack` and `munmap` of `std`'s alternate signal stack, `madvise` of the freed stack,
/// `exit`), process exit (`exit_group`), clock reads the vDSO cannot answer
/// (`clock_gettime`), writes to stderr only (`write` to fd 2: panic messages, and log
/// records of a logger that writes there), and `fcntl(fd, F_GETFD)`, with which `std` built
/// with debug assertions checks that a descriptor it closes is open. A panic or `abort` may need more (a backtrace reads
/// the binary); such a thread is then stopped by the filter's mismatch action instead.
///
/// A VMM with its own filters usually allows all of this already, often more loosely; one
/// without merges it ([`merge`]). Not part of [`rules`].
///
/// Not in it either: glibc's allocator opens `/proc/sys/vm/overcommit_memory`
/// (`O_RDONLY | O_CLOEXEC`) once per process, the first time a `free` shrinks a thread arena's
/// heap, on whichever thread that is and whenever it happens (a large teardown, say). A filter
/// cannot restrict the path, so rather than allowing the open a VMM can refuse it with an
/// errno (glibc then releases the memory with `madvise` and goes on), as the example VMM does
/// in front of every thread's program (`pvspin-vmm`'s `seccomp::refuse_overcommit_probe`).
pub fn baseline_rules() -> Result<RuleMap, SeccompError> {
    build(&[
        any(libc::SYS_brk, "brk"),
        any(libc::SYS_mmap, "mmap"),
        any(libc::SYS_mprotect, "mprotect"),
        any(libc::SYS_munmap, "munmap"),
        any(libc::SYS_mremap, "mremap"),
        any(libc::SYS_madvise, "madvise"),
        any(libc::SYS_futex, "futex"),
        any(libc::SYS_rt_sigreturn, "rt_sigreturn"),
        any(libc::SYS_rt_sigprocmask, "rt_sigprocmask"),
        any(libc::SYS_sigaltstack, "sigaltstack"),
        any(libc::SYS_exit, "exit"),
        any(libc::SYS_exit_group, "exit_group"),
        any(libc::SYS_clock_gettime, "clock_gettime"),
        arg_in(
            libc::SYS_write,
            "write",
            0,
            vec![unsigned(libc::STDERR_FILENO)],
        ),
        arg_in(libc::SYS_fcntl, "fcntl", 1, vec![unsigned(libc::F_GETFD)]),
    ])
}

/// The syscalls pvspin's own code makes on a thread of `kind` after setup, as `seccompiler`
/// rules (see the module docs for what is and is not included). A superset over every
/// configuration: e.g. the `KVM_SIGNAL_MSI` rule is there even when the VM uses the
/// userspace kick path.
pub fn rules(kind: ThreadKind) -> Result<RuleMap, SeccompError> {
    build(&needs(kind))
}

/// The syscalls pvspin's setup makes (`PvSpinBuilder::build`, `SignalInterrupter::new`,
/// `configure_vm`, `set_kick_gsis`, `KickWiring::register`, `edit_cpuid`, `configure_vcpu`),
/// for a VMM whose thread is confined before it sets a VM up: Cloud Hypervisor's `vmm` thread
/// creates every VM under its filter. A superset over every configuration: the KVM requests
/// (`KVM_CHECK_EXTENSION`, `KVM_ENABLE_CAP`, `KVM_GET_SUPPORTED_CPUID`; `KVM_IRQFD` and
/// `KVM_IOEVENTFD`, also as probes; `KVM_GET_LAPIC`/`KVM_SET_LAPIC`, `KVM_GET_CPUID2`,
/// `KVM_GET_TSC_KHZ`, `KVM_GET_STATS_FD` and `pread64` of the stats header), the kick
/// eventfds and the VM fd's duplicate (`eventfd2`, `dup`, `fcntl`, `close`), the helper
/// threads and the actuator's probe thread (`clone3`, `clone`, `set_robust_list`, `rseq`,
/// `gettid`, `getpriority`/`setpriority`, `sched_getscheduler`/`sched_getparam`/
/// `sched_setscheduler`), the interrupt signal's handler (`rt_sigaction`), and the reads of
/// `/proc` and the cgroup tree that directed yield's confinement check and run slots'
/// entitlement make (`openat`, `read`, `newfstatat`, `statx`, `statfs`, `getdents64`,
/// `readlink`, `lseek`, `sched_getaffinity`). Not in [`ThreadKind::ALL`]'s rules: a VMM
/// that sets pvspin up before confining the thread needs none of it.
pub fn setup_rules() -> Result<RuleMap, SeccompError> {
    use setup_nr::*;
    let prio_process = unsigned(libc::PRIO_PROCESS as libc::c_int);
    let kvm = vec![
        KVM_CHECK_EXTENSION(),
        KVM_GET_SUPPORTED_CPUID(),
        KVM_IRQFD(),
        KVM_IOEVENTFD(),
        KVM_GET_LAPIC(),
        KVM_SET_LAPIC(),
        KVM_GET_CPUID2(),
        KVM_ENABLE_CAP(),
        KVM_GET_TSC_KHZ(),
        KVM_GET_STATS_FD(),
    ];
    build(&[
        arg_in(libc::SYS_ioctl, "ioctl", 1, kvm),
        any(libc::SYS_pread64, "pread64"),
        any(libc::SYS_eventfd2, "eventfd2"),
        any(libc::SYS_dup, "dup"),
        any(libc::SYS_fcntl, "fcntl"),
        any(libc::SYS_close, "close"),
        any(libc::SYS_clone3, "clone3"),
        any(libc::SYS_clone, "clone"),
        any(libc::SYS_set_robust_list, "set_robust_list"),
        any(libc::SYS_rseq, "rseq"),
        any(libc::SYS_gettid, "gettid"),
        arg_in(libc::SYS_getpriority, "getpriority", 0, vec![prio_process]),
        arg_in(libc::SYS_setpriority, "setpriority", 0, vec![prio_process]),
        any(libc::SYS_sched_getscheduler, "sched_getscheduler"),
        any(libc::SYS_sched_getparam, "sched_getparam"),
        any(libc::SYS_sched_setscheduler, "sched_setscheduler"),
        any(libc::SYS_sched_getaffinity, "sched_getaffinity"),
        any(libc::SYS_rt_sigaction, "rt_sigaction"),
        any(libc::SYS_openat, "openat"),
        any(libc::SYS_read, "read"),
        any(libc::SYS_newfstatat, "newfstatat"),
        any(libc::SYS_statx, "statx"),
        any(libc::SYS_statfs, "statfs"),
        any(libc::SYS_getdents64, "getdents64"),
        any(libc::SYS_readlink, "readlink"),
        any(libc::SYS_lseek, "lseek"),
    ])
}

/// Merges pvspin's rules for `kind` into `map`, the VMM's rules for that thread ([`merge`]).
pub fn merge_into(map: &mut RuleMap, kind: ThreadKind) -> Result<(), SeccompError> {
    merge(map, rules(kind)?);
    Ok(())
}

/// What pvspin's helper threads (`pvspin-boost-wd`, `pvspin-slot-watch`) need once
/// [`PvSpinBuilder::helper_thread_filter`](crate::PvSpinBuilder::helper_thread_filter)
/// confines them: [`baseline_rules`] with the rules of [`ThreadKind::BoostWatchdog`] and
/// [`ThreadKind::SlotWatcher`], to [`compile`] with the VMM's mismatch action. A VMM whose
/// logger does more than write to stderr merges that in too.
pub fn helper_thread_rules() -> Result<RuleMap, SeccompError> {
    let mut map = baseline_rules()?;
    merge_into(&mut map, ThreadKind::BoostWatchdog)?;
    merge_into(&mut map, ThreadKind::SlotWatcher)?;
    Ok(map)
}

/// For a VMM that sets pvspin up on a thread it confined before (Cloud Hypervisor's `vmm`
/// thread creates every VM under its filter): [`setup_rules`] with the rules of every
/// [`ThreadKind`], since each thread that thread starts inherits its filter (filters stack)
/// and so must be allowed there too. To [`merge`] into that thread's rules.
pub fn confined_setup_rules() -> Result<RuleMap, SeccompError> {
    let mut map = setup_rules()?;
    for kind in ThreadKind::ALL {
        merge_into(&mut map, kind)?;
    }
    Ok(map)
}

/// Merges `from` into `into` so that the result allows exactly what either allows: an empty
/// (unconditional) rule vector on either side stays unconditional, conditional rules are
/// joined without duplicates.
pub fn merge(into: &mut RuleMap, from: RuleMap) {
    for (nr, rules) in from {
        match into.entry(nr) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(rules);
            }
            std::collections::btree_map::Entry::Occupied(mut slot) => {
                let existing = slot.get_mut();
                if existing.is_empty() {
                    // Already unconditional: conditions would only narrow it.
                } else if rules.is_empty() {
                    existing.clear();
                } else {
                    for rule in rules {
                        if !existing.contains(&rule) {
                            existing.push(rule);
                        }
                    }
                }
            }
        }
    }
}

/// Compiles `rules` into a BPF program for the host architecture: matching syscalls are
/// allowed, every other one gets `mismatch` (e.g. `KillProcess`, `Log`, `Errno(EPERM)`).
pub fn compile(rules: RuleMap, mismatch: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let arch = std::env::consts::ARCH;
    let target =
        TargetArch::try_from(arch).map_err(|source| SeccompError::Arch { arch, source })?;
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, target)
        .map_err(SeccompError::Compile)?;
    BpfProgram::try_from(filter).map_err(SeccompError::Compile)
}

fn build(needs: &[Need]) -> Result<RuleMap, SeccompError> {
    let mut map = RuleMap::new();
    for need in needs {
        let rules = match &need.arg {
            None => Vec::new(),
            Some((arg, values)) => values
                .iter()
                .map(|&value| {
                    SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
                        .and_then(|cond| SeccompRule::new(vec![cond]))
                        .map_err(|source| SeccompError::Rule {
                            syscall: need.name,
                            source,
                        })
                })
                .collect::<Result<_, _>>()?,
        };
        merge(&mut map, BTreeMap::from([(need.nr, rules)]));
    }
    Ok(map)
}

/// The start hook that installs `filter` on a helper thread (see
/// [`PvSpinBuilder::helper_thread_filter`](crate::PvSpinBuilder::helper_thread_filter)).
pub(crate) fn start_hook(filter: Arc<BpfProgram>) -> pvspin_hints::ThreadStartHook {
    Arc::new(move |name: &str| {
        seccompiler::apply_filter(&filter).map_err(|err| {
            std::io::Error::other(format!("installing the seccomp filter on {name}: {err}"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(arg: u8, value: u64) -> SeccompRule {
        SeccompRule::new(vec![SeccompCondition::new(
            arg,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            value,
        )
        .unwrap()])
        .unwrap()
    }

    #[test]
    fn setup_rules_name_the_uapi_requests_and_compile() {
        use setup_nr::*;
        let expected: [(u64, u64); 10] = [
            (KVM_CHECK_EXTENSION(), 0xae03),
            (KVM_GET_SUPPORTED_CPUID(), 0xc008_ae05),
            (KVM_IRQFD(), 0x4020_ae76),
            (KVM_IOEVENTFD(), 0x4040_ae79),
            (KVM_GET_LAPIC(), 0x8400_ae8e),
            (KVM_SET_LAPIC(), 0x4400_ae8f),
            (KVM_GET_CPUID2(), 0xc008_ae91),
            (KVM_ENABLE_CAP(), 0x4068_aea3),
            (KVM_GET_TSC_KHZ(), 0xaea3),
            (KVM_GET_STATS_FD(), 0xaece),
        ];
        for (got, want) in expected {
            assert_eq!(got, want, "{got:#x}");
        }
        let map = setup_rules().unwrap();
        assert!(map.contains_key(&libc::SYS_ioctl) && map.contains_key(&libc::SYS_pread64));
        assert!(!map.contains_key(&libc::SYS_execve) && !map.contains_key(&libc::SYS_socket));
        let mut with_baseline = baseline_rules().unwrap();
        merge(&mut with_baseline, map);
        compile(with_baseline, SeccompAction::KillProcess).unwrap();
    }

    #[test]
    fn kvm_request_numbers_are_the_uapi_ones() {
        // _IOW(KVMIO, 0x99, struct kvm_mp_state) and _IOW(KVMIO, 0xa5, struct kvm_msi).
        assert_eq!(KVM_SET_MP_STATE(), 0x4004_ae99);
        assert_eq!(KVM_SIGNAL_MSI(), 0x4020_aea5);
    }

    #[test]
    fn every_kind_and_the_baseline_compile_for_the_host() {
        for kind in ThreadKind::ALL {
            let mut map = baseline_rules().unwrap();
            merge_into(&mut map, kind).unwrap();
            for action in [
                SeccompAction::KillProcess,
                SeccompAction::Log,
                SeccompAction::Errno(libc::EPERM as u32),
            ] {
                let program = compile(map.clone(), action).unwrap();
                assert!(!program.is_empty(), "{kind}");
            }
            assert!(!rules(kind).unwrap().is_empty(), "{kind}");
        }
        assert!(matches!(
            compile(baseline_rules().unwrap(), SeccompAction::Allow),
            Err(SeccompError::Compile(BackendError::IdenticalActions))
        ));
    }

    #[test]
    fn ioctl_is_restricted_to_pvspins_requests_on_vcpu_threads() {
        let vcpu = rules(ThreadKind::Vcpu).unwrap();
        let ioctl = &vcpu[&libc::SYS_ioctl];
        assert_eq!(
            *ioctl,
            [
                cond(1, KVM_SET_MP_STATE()),
                cond(1, KVM_SIGNAL_MSI()),
                cond(1, KVM_RUN()),
                cond(1, KVM_GET_MSRS())
            ]
        );
        assert_eq!(
            vcpu[&libc::SYS_getrusage],
            [cond(0, libc::RUSAGE_THREAD as u64)]
        );
        for kind in [ThreadKind::BoostWatchdog, ThreadKind::Control] {
            assert!(
                !rules(kind).unwrap().contains_key(&libc::SYS_ioctl),
                "{kind}"
            );
        }
        // Boosts act on other vCPU threads: both scheduling calls are there.
        assert!(vcpu.contains_key(&libc::SYS_setpriority));
        assert!(vcpu.contains_key(&libc::SYS_sched_setscheduler));
        // Nothing that opens files or sockets.
        for kind in ThreadKind::ALL {
            let map = rules(kind).unwrap();
            for nr in [libc::SYS_openat, libc::SYS_socket, libc::SYS_execve] {
                assert!(!map.contains_key(&nr), "{kind} allows {nr}");
            }
        }
    }

    #[test]
    fn merging_keeps_unconditional_entries_unconditional() {
        let a = cond(1, 7);
        let b = cond(1, 8);
        // Conditional into unconditional: stays unconditional.
        let mut map = RuleMap::from([(libc::SYS_ioctl, vec![])]);
        merge(
            &mut map,
            RuleMap::from([(libc::SYS_ioctl, vec![a.clone()])]),
        );
        assert!(map[&libc::SYS_ioctl].is_empty());
        // Unconditional into conditional: becomes unconditional.
        let mut map = RuleMap::from([(libc::SYS_ioctl, vec![a.clone()])]);
        merge(&mut map, RuleMap::from([(libc::SYS_ioctl, vec![])]));
        assert!(map[&libc::SYS_ioctl].is_empty());
        // Conditional into conditional: the union, once each.
        let mut map = RuleMap::from([(libc::SYS_ioctl, vec![a.clone()])]);
        merge(
            &mut map,
            RuleMap::from([(libc::SYS_ioctl, vec![b.clone(), a.clone()])]),
        );
        assert_eq!(map[&libc::SYS_ioctl], [a.clone(), b]);
        // New syscalls are added as they are; others are left alone.
        let mut map = RuleMap::from([(libc::SYS_read, vec![])]);
        merge(
            &mut map,
            RuleMap::from([(libc::SYS_ioctl, vec![a.clone()])]),
        );
        assert_eq!(map.len(), 2);
        assert!(map[&libc::SYS_read].is_empty());
        assert_eq!(map[&libc::SYS_ioctl], [a]);
    }

    #[test]
    fn merge_into_a_vmm_map_keeps_its_own_rules() {
        // A VMM that allows KVM_RUN by number and write unconditionally.
        let kvm_run = cond(1, 0xae80);
        let mut map = RuleMap::from([
            (libc::SYS_ioctl, vec![kvm_run.clone()]),
            (libc::SYS_write, vec![]),
        ]);
        merge(&mut map, baseline_rules().unwrap());
        merge_into(&mut map, ThreadKind::Vcpu).unwrap();
        let ioctl = &map[&libc::SYS_ioctl];
        // The VMM's KVM_RUN, and pvspin's other three (its own KVM_RUN merged into the VMM's).
        assert_eq!(ioctl.len(), 4);
        assert_eq!(ioctl[0], kvm_run);
        // The baseline's write to stderr does not narrow the VMM's unconditional write.
        assert!(map[&libc::SYS_write].is_empty());
        // Merging twice changes nothing.
        let again = map.clone();
        merge_into(&mut map, ThreadKind::Vcpu).unwrap();
        assert_eq!(map, again);
    }

    #[test]
    fn kinds_have_names() {
        let names: Vec<String> = ThreadKind::ALL.iter().map(|k| k.to_string()).collect();
        assert_eq!(names, ["vcpu", "boost-watchdog", "slot-watcher", "control"]);
    }

    /// Every rule of every part is in the union, allowed at least as widely: a syscall a
    /// part allows without condition stays unconditional, a conditional one keeps its rules.
    fn assert_contains(union: &RuleMap, part: &RuleMap) {
        for (nr, rules) in part {
            let got = union
                .get(nr)
                .unwrap_or_else(|| panic!("syscall {nr} missing"));
            if rules.is_empty() {
                assert!(got.is_empty(), "syscall {nr} narrowed");
            } else if !got.is_empty() {
                assert!(rules.iter().all(|rule| got.contains(rule)), "syscall {nr}");
            }
        }
    }

    #[test]
    fn helper_thread_rules_are_the_baseline_and_both_helper_kinds() {
        let map = helper_thread_rules().unwrap();
        assert_contains(&map, &baseline_rules().unwrap());
        assert_contains(&map, &rules(ThreadKind::BoostWatchdog).unwrap());
        assert_contains(&map, &rules(ThreadKind::SlotWatcher).unwrap());
        assert!(
            !map.contains_key(&libc::SYS_eventfd2),
            "setup is not a helper's"
        );
        compile(map, SeccompAction::KillProcess).unwrap();
    }

    #[test]
    fn confined_setup_rules_are_setup_and_every_kind() {
        let map = confined_setup_rules().unwrap();
        assert_contains(&map, &setup_rules().unwrap());
        for kind in ThreadKind::ALL {
            assert_contains(&map, &rules(kind).unwrap());
        }
        compile(map, SeccompAction::KillProcess).unwrap();
    }
}
