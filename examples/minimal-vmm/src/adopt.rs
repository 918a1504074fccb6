//! Everything minimal-vmm does with pvspin. A unit test keeps this file at 55 lines of code
//! or fewer (not counting comments, blank lines, `use` lines and lines that only close
//! brackets), and the rest of the VMM names no pvspin item.

use std::sync::Arc;

use kvm_bindings::{kvm_irq_routing_entry, CpuId};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
pub use pvspin::interrupt::InterruptError;
pub use pvspin::{KickPath, PvSpin, SignalInterrupter, VcpuHooks, VcpuThread};
use pvspin_test_vm::memory::VmMemory;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// pvspin for `n` vCPUs on `path`: kicks, WAIT and hint pages; interrupts by signal.
pub fn build(n: usize, path: KickPath, mem: &VmMemory) -> Res<(PvSpin, Arc<SignalInterrupter>)> {
    let signal = SignalInterrupter::new(n)?;
    let hints = pvspin::HintOptions {
        memory: Arc::new(mem.clone()),
        budgets: pvspin::BudgetConfig::default(),
    };
    let builder = PvSpin::builder().vcpus(n).interrupter(signal.clone());
    let builder = builder
        .kick(pvspin::KickOptions::new(path))
        .hint_pages(hints);
    Ok((
        builder.pv_wait(pvspin::WaitOptions::default()).build()?,
        signal,
    ))
}

/// VM stage (before vCPUs): quirks and the kick device.
pub fn configure_vm(pvspin: &PvSpin, kvm: &Kvm, vm: &VmFd) -> Res<()> {
    pvspin.configure_vm(kvm, vm)?;
    Ok(())
}

/// In-kernel path only: kick GSIs from the VMM's allocator, their eventfds registered;
/// returns the routes for the VMM's table.
pub fn kick_routes(
    pvspin: &PvSpin,
    vm: &VmFd,
    gsi: impl FnMut() -> u32,
) -> Res<Vec<kvm_irq_routing_entry>> {
    let gsis: Vec<u32> = std::iter::repeat_with(gsi).take(pvspin.vcpus()).collect();
    let wiring = pvspin.set_kick_gsis(&gsis)?;
    wiring.register(vm)?;
    Ok(wiring.routes()?)
}

/// After every `KVM_SET_GSI_ROUTING` of the VMM: its table still has pvspin's kick routes.
pub fn check_routes(pvspin: &PvSpin, table: &[kvm_irq_routing_entry]) -> Res<()> {
    Ok(pvspin.check_routes(table)?)
}

/// vCPU stage: pvspin's CPUID edit on the VMM's `cpuid`, which the VMM then sets.
pub fn edit_cpuid(pvspin: &PvSpin, index: usize, cpuid: &mut CpuId) -> Res<()> {
    Ok(pvspin.edit_cpuid(index, cpuid)?)
}

/// vCPU stage, after `KVM_SET_CPUID2`: the vCPU's hooks.
pub fn configure_vcpu(pvspin: &PvSpin, index: usize, vcpu: &mut VcpuFd) -> Res<VcpuHooks> {
    Ok(pvspin.configure_vcpu(index, vcpu)?.0)
}

/// Attaches the calling thread as vCPU `index`'s for interrupts.
pub fn attach(signal: &Arc<SignalInterrupter>, index: usize) -> Result<VcpuThread, InterruptError> {
    signal.attach(index)
}

/// One `KVM_RUN` with the hooks around it; `vmm` handles the exits pvspin did not take.
pub fn run_once<R>(
    hooks: &mut VcpuHooks,
    thread: &VcpuThread,
    vcpu: &mut VcpuFd,
    vmm: impl FnOnce(&mut Result<VcpuExit<'_>, kvm_ioctls::Error>) -> R,
) -> Option<R> {
    hooks.before_run();
    let mut exit = thread.run(vcpu);
    let handled = hooks.handle_exit(&mut exit) == pvspin::ExitOutcome::Handled;
    let step = (!handled).then(|| vmm(&mut exit));
    drop(exit);
    hooks.after_run(vcpu);
    step
}

/// The VM is stopping: parked vCPUs released, every vCPU out of `KVM_RUN`; what pvspin found
/// wrong with this adoption goes to stderr.
pub fn stop(pvspin: &PvSpin) {
    pvspin.shutdown();
    (0..pvspin.vcpus()).for_each(|i| pvspin.interrupt(i));
    for problem in pvspin.check() {
        eprintln!("minimal-vmm: pvspin: {problem}");
    }
}
