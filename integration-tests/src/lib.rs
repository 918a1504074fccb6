//! Shared fixtures for pvspin's real-KVM tests (the tests themselves are in `tests/`).
#![deny(missing_docs)]

/// Opens `/dev/kvm`, or prints a SKIPPED line naming the test and returns `None` when it cannot
/// be opened (a CI machine without KVM must still pass).
pub fn kvm_or_skip(test: &str) -> Option<kvm_ioctls::Kvm> {
    match kvm_ioctls::Kvm::new() {
        Ok(kvm) => Some(kvm),
        Err(err) => {
            eprintln!("SKIPPED {test}: /dev/kvm cannot be opened ({err})");
            None
        }
    }
}
