//! Fuzzes the pure `KVM_GET_STATS_FD` parser (`pvspin_kvm::stats::parse`) and everything that
//! consumes its output: lookups, deltas, histogram bounds, and pvspin's telemetry renderings
//! (`pvspin::VmTelemetry`: JSON and Prometheus).
//!
//! Input: two bytes choosing where the descriptor block ends, then the 24 header bytes, the
//! descriptor block and the data block.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvspin::{PvspinVcpuCounters, VcpuTelemetry, VmTelemetry};
use pvspin_kvm::stats::{parse, HEADER_SIZE};

fuzz_target!(|input: &[u8]| {
    if input.len() < 2 {
        return;
    }
    let split = usize::from(u16::from_le_bytes([input[0], input[1]]));
    let rest = &input[2..];
    let (header, rest) = rest.split_at(rest.len().min(HEADER_SIZE));
    let (descs, data) = rest.split_at(split.min(rest.len()));
    let Ok(snap) = parse(header, descs, data) else {
        return;
    };
    for st in snap.iter() {
        assert_eq!(
            snap.get(&st.desc.name).map(|s| s.values.len()),
            Some(st.values.len())
        );
        assert_eq!(st.values.len(), usize::from(st.desc.size));
        let bounds = st.desc.bucket_upper_bounds();
        assert!(bounds.is_empty() || bounds.len() == st.values.len());
        let _ = st.desc.scale();
    }
    // A snapshot minus itself is all zeros for monotonic stats.
    let d = snap.delta(&snap).expect("self delta");
    for st in d.iter() {
        if st.desc.kind.is_monotonic() {
            assert!(st.values.iter().all(|&v| v == 0));
        }
    }
    let t = VmTelemetry {
        kvm_vm: Some(snap.clone()),
        vcpus: vec![VcpuTelemetry {
            vcpu: 0,
            pvspin: PvspinVcpuCounters::default(),
            budgets: None,
            kvm: Some(snap),
        }],
        ..VmTelemetry::default()
    };
    let _ = t.to_json();
    let _ = t.to_prometheus();
});
