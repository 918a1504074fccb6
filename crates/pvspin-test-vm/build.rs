//! Builds the guest program (`guest/`) as a freestanding x86-64 ELF and tells the crate where
//! it is (`PVSPIN_GUEST_ELF`).
//!
//! The guest is its own cargo workspace, built by a nested cargo with its own target directory
//! (so it never waits on this build's lock), for the host target, with:
//! - no SSE: KVM's instruction emulator rejects most SSE, and hosts without hardware
//!   virtualization emulate every guest instruction;
//! - a static, non-PIE link at the image base the VMM loads it at, without C start files.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const IMAGE_BASE: &str = "0x200000";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let guest_dir = manifest_dir.join("guest");
    let crates_dir = manifest_dir.join("..");
    for path in [
        guest_dir.join("Cargo.toml"),
        guest_dir.join("Cargo.lock"),
        guest_dir.join("src"),
        manifest_dir.join("proto/src"),
        crates_dir.join("pvspin-guest/src"),
        crates_dir.join("pvspin-abi/src"),
    ] {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    let target = "x86_64-unknown-linux-gnu";
    let rustflags = [
        "-Ctarget-feature=-sse,-sse2,-sse3,-ssse3,-sse4.1,-sse4.2,-avx,-avx2".to_string(),
        "-Crelocation-model=static".to_string(),
        "-Clink-arg=-nostartfiles".to_string(),
        "-Clink-arg=-nostdlib".to_string(),
        "-Clink-arg=-static".to_string(),
        format!("-Clink-arg=-Wl,--image-base={IMAGE_BASE}"),
        "-Clink-arg=-Wl,--build-id=none".to_string(),
        // The ABI warning for disabling SSE on this target is expected: the guest uses no
        // floats, so no value is ever passed in an SSE register.
        "-Awarnings".to_string(),
    ]
    .join("\x1f");
    let target_dir = out_dir.join("guest-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(&guest_dir)
        .args(["build", "--release", "--offline", "--target", target])
        .arg("--manifest-path")
        .arg(guest_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags);
    // Settings meant for the outer build must not leak into the guest's.
    for var in [
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PROFILE_RELEASE_LTO",
        "CARGO_LLVM_COV",
        "LLVM_PROFILE_FILE",
    ] {
        command.env_remove(var);
    }
    let status = command
        .status()
        .unwrap_or_else(|err| panic!("cannot run cargo to build the guest program: {err}"));
    assert!(
        status.success(),
        "building the guest program in {} failed ({status})",
        guest_dir.display()
    );
    let elf = target_dir.join(target).join("release/pvspin-test-guest");
    assert!(elf.exists(), "guest build produced no {}", elf.display());
    println!("cargo:rustc-env=PVSPIN_GUEST_ELF={}", elf.display());
}
