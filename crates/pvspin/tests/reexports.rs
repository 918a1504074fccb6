//! Every type a VMM must name to use pvspin (configure it, read its telemetry, match its
//! errors) is reachable through `pvspin::` alone: this test has no other pvspin crate.

use std::collections::BTreeMap;

/// Names each type in a signature; compiling is the test.
#[allow(clippy::too_many_arguments, clippy::type_complexity, dead_code)]
fn names(
    _telemetry: (
        pvspin::VmTelemetry,
        pvspin::VcpuTelemetry,
        pvspin::PvspinVcpuCounters,
        pvspin::KickCounts,
        pvspin::KickDeviceTelemetry,
        pvspin::ExitCounts,
        pvspin::ExitKind,
        pvspin::VcpuYieldCounts,
        pvspin::Budgets,
        pvspin::LatencyHistogram,
        pvspin::TelemetryFormat,
        pvspin::TelemetryError,
    ),
    _kvm_stats: (
        pvspin::Snapshot,
        pvspin::Stat<'_>,
        pvspin::StatKind,
        pvspin::StatUnit,
        pvspin::Descriptor,
    ),
    _parts: (
        pvspin::KickStats,
        pvspin::KickPath,
        pvspin::Reject,
        pvspin::DirectedYieldStats,
        pvspin::TrialStats,
        pvspin::HintStats,
    ),
    _errors: (
        pvspin::Error,
        pvspin::ConfigError,
        pvspin::PlanError,
        pvspin::QuirkError,
        pvspin::CplError,
        pvspin::IrqchipError,
        pvspin::cpuid::CpuidError,
    ),
    _plan: (
        pvspin::PlanRequest,
        pvspin::Placement,
        pvspin::GuestKernel,
        pvspin::PvFeatures,
        pvspin::ExitFlags,
        pvspin::HaltPoll,
        pvspin::Plan,
        pvspin::CpuidEdit,
        pvspin::AppliedVm,
        pvspin::AppliedVcpu,
        pvspin::VmSetup,
    ),
    _options: (
        pvspin::KickOptions,
        pvspin::DirectedYieldOptions,
        pvspin::HintOptions,
        pvspin::WaitOptions,
        pvspin::BudgetConfig,
        pvspin::PolicyConfig,
        pvspin::WindowConfig,
        pvspin::ExitOutcome,
    ),
) {
}

#[test]
fn telemetry_types_are_usable_through_pvspin_only() {
    let format: pvspin::TelemetryFormat = "prometheus".parse().unwrap();
    assert_eq!(format, pvspin::TelemetryFormat::Prometheus);
    let kicks = pvspin::KickCounts {
        pvspin_delivered: 1,
        kvm_halt_wakeups: Some(2),
    };
    let counters = pvspin::PvspinVcpuCounters {
        kicks: Some(kicks),
        rejected_guest_inputs: BTreeMap::from([(pvspin::Reject::NotEnabled.name().into(), 1)]),
        ..pvspin::PvspinVcpuCounters::default()
    };
    let t = pvspin::VmTelemetry {
        kick: Some(pvspin::KickDeviceTelemetry {
            path: pvspin::KickPath::InKernel,
            stats: pvspin::KickStats::default(),
        }),
        vcpus: vec![pvspin::VcpuTelemetry {
            vcpu: 0,
            pvspin: counters,
            budgets: None,
            kvm: None::<pvspin::Snapshot>,
        }],
        ..pvspin::VmTelemetry::default()
    };
    assert_eq!(t.kick_path(), Some(pvspin::KickPath::InKernel));
    let text = t.render(format);
    assert!(
        text.contains(
            "pvspin_kick_wakeups_total{vcpu=\"0\",path=\"in_kernel\",source=\"kvm_halt_wakeup\"} 2\n"
        ),
        "{text}"
    );
    assert!(text.contains("reason=\"not_enabled\"} 1\n"), "{text}");
    assert_eq!(pvspin::ExitKind::ALL.len(), 6);
}
