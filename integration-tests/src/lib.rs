//! Shared fixtures for pvspin's real-KVM tests (the tests themselves are in `tests/`).
#![deny(missing_docs)]

/// The environment variable naming the directory where gated tests record whether they ran
/// (`.ci/run` sets it, then `.ci/test-tally` prints and checks the tally).
pub const TALLY_DIR_ENV: &str = "PVSPIN_TEST_TALLY_DIR";

/// The gate of the real-KVM tests in the tally.
pub const KVM_GATE: &str = "kvm";

/// Records in the tally that `test`, gated on `gate` (what it needs: `kvm`, a capability, a
/// tool), ran (`skipped: None`) or was skipped for `reason`. A no-op unless
/// [`TALLY_DIR_ENV`] is set. Format (also written by `pvspin-hints`'s capability-gated
/// tests, read by `.ci/test-tally`): one file per gate and test, `<gate>--<test>`, holding
/// `ran` or `skipped<TAB><reason>`. Panics if the tally cannot be written: a run whose tally
/// is incomplete must not look complete.
pub fn record(gate: &str, test: &str, skipped: Option<&str>) {
    let Some(dir) = std::env::var_os(TALLY_DIR_ENV) else {
        return;
    };
    let name: String = format!("{gate}--{test}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let line = match skipped {
        None => "ran\n".to_owned(),
        Some(reason) => format!("skipped\t{}\n", reason.replace('\n', " ")),
    };
    let path = std::path::Path::new(&dir).join(name);
    if let Err(err) = std::fs::write(&path, line) {
        panic!("{test}: writing the test tally {}: {err}", path.display());
    }
}

/// Opens `/dev/kvm` for a real-KVM test. A test cannot pass by skipping: when `/dev/kvm`
/// cannot be opened the test fails, unless `PVSPIN_SKIP_KVM_TESTS=1` says this machine has no
/// KVM on purpose; then it prints a `SKIPPED` line naming the test and returns `None`. Either
/// way the outcome goes to the tally ([`record`]), where `.ci/run` counts it and fails when a
/// test skipped on a machine whose `/dev/kvm` is usable.
pub fn kvm_or_skip(test: &str) -> Option<kvm_ioctls::Kvm> {
    match kvm_ioctls::Kvm::new() {
        Ok(kvm) => {
            record(KVM_GATE, test, None);
            Some(kvm)
        }
        Err(err) if std::env::var("PVSPIN_SKIP_KVM_TESTS").as_deref() == Ok("1") => {
            let reason = format!("/dev/kvm cannot be opened ({err})");
            eprintln!("SKIPPED {test}: {reason}");
            record(KVM_GATE, test, Some(&reason));
            None
        }
        Err(err) => panic!(
            "{test} needs /dev/kvm, which cannot be opened ({err}); set PVSPIN_SKIP_KVM_TESTS=1 \
             to skip real-KVM tests on a machine without KVM"
        ),
    }
}

/// Opens `/dev/kvm`, or fails the test naming it: for tests that must not pass by skipping.
/// Records in the tally that the test ran.
pub fn kvm_required(test: &str) -> kvm_ioctls::Kvm {
    match kvm_ioctls::Kvm::new() {
        Ok(kvm) => {
            record(KVM_GATE, test, None);
            kvm
        }
        Err(err) => panic!("{test} needs /dev/kvm, which cannot be opened ({err})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_has_one_file_per_gate_and_test() {
        let dir = std::env::temp_dir().join(format!("pvspin-tally-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // The variable is process-wide: this crate's only unit test sets it.
        std::env::set_var(TALLY_DIR_ENV, &dir);
        record("kvm", "a_test", None);
        record("cap_sys_nice", "b/test", Some("no CAP_SYS_NICE\nhere"));
        std::env::remove_var(TALLY_DIR_ENV);
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        assert_eq!(read("kvm--a_test"), "ran\n");
        assert_eq!(
            read("cap_sys_nice--b_test"),
            "skipped\tno CAP_SYS_NICE here\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A VM with guest memory at GPA 0, for tests that write guest code by hand. Guest memory is
/// vm-memory's mmap, registered as slot 0; it outlives the VM (fields drop in order).
#[derive(Debug)]
pub struct TestVm {
    /// The VM.
    pub vm: kvm_ioctls::VmFd,
    /// Its memory.
    pub memory: vm_memory::GuestMemoryMmap<()>,
}

impl TestVm {
    /// Creates a VM with `size` bytes of zeroed memory at GPA 0. Panics on failure: a fixture.
    pub fn new(kvm: &kvm_ioctls::Kvm, size: usize) -> TestVm {
        let vm = kvm.create_vm().expect("KVM_CREATE_VM");
        let memory =
            vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(vm_memory::GuestAddress(0), size)])
                .expect("guest memory");
        let host =
            vm_memory::GuestMemoryBackend::get_host_address(&memory, vm_memory::GuestAddress(0))
                .expect("host address of guest memory");
        let region = kvm_bindings::kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: size as u64,
            userspace_addr: host as u64,
            flags: 0,
        };
        // SAFETY: the region is `memory`'s mapping of `size` bytes, which the returned struct
        // keeps alive after the VM (field order drops `vm` first).
        unsafe { vm.set_user_memory_region(region) }.expect("KVM_SET_USER_MEMORY_REGION");
        TestVm { vm, memory }
    }

    /// Writes `bytes` at `gpa`. Panics outside guest memory.
    pub fn write(&self, gpa: u64, bytes: &[u8]) {
        vm_memory::Bytes::write_slice(&self.memory, bytes, vm_memory::GuestAddress(gpa))
            .expect("write into guest memory");
    }
}

/// The child side of a test that runs the example VMM as a child process of its own test
/// binary: when the environment variable `env` is set (the VMM's arguments, separated by
/// `\x1f`), runs the example VMM's process entry point with them and exits with its code;
/// otherwise returns at once (the parent's run of the same test).
pub fn run_vmm_child_if_asked(env: &str) {
    let Ok(args) = std::env::var(env) else {
        return;
    };
    let args = std::iter::once("pvspin-vmm".to_string())
        .chain(args.split('\x1f').map(str::to_string))
        .collect::<Vec<_>>();
    let code = pvspin_vmm::cli::main_process(args);
    #[allow(clippy::exit)] // the child's result is its exit code
    std::process::exit(code);
}

/// Runs `f`, aborting the whole test process if it has not returned within `limit`: a
/// real-guest test must never wait on a guest without a bound.
pub fn with_watchdog<T>(
    test: &'static str,
    limit: std::time::Duration,
    f: impl FnOnce() -> T,
) -> T {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if flag.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("{test}: watchdog fired after {limit:?}; aborting");
        std::process::abort();
    });
    let out = f();
    done.store(true, Ordering::Release);
    out
}

/// Waits for `child`, killing it (and panicking, naming `what`) once it has run past `limit`:
/// a test that runs the VMM as a child process never waits on it without a bound. Returns its
/// exit status, stdout and stderr.
pub fn finish_child(
    mut child: std::process::Child,
    what: &str,
    limit: std::time::Duration,
) -> (std::process::ExitStatus, String, String) {
    let start = std::time::Instant::now();
    while child.try_wait().expect("waiting for the child").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}, killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let output = child.wait_with_output().expect("the child's output");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
