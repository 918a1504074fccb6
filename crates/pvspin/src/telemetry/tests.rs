//! The telemetry types and both renderings, on hand-built snapshots.

use super::*;
use crate::{DirectedYieldStats, HintStats};
use kvm_bindings::{
    KVM_STATS_BASE_POW10, KVM_STATS_TYPE_CUMULATIVE, KVM_STATS_TYPE_INSTANT,
    KVM_STATS_TYPE_LOG_HIST, KVM_STATS_UNIT_BOOLEAN, KVM_STATS_UNIT_SECONDS,
};
use pvspin_kvm::stats::{parse, DESC_FIXED_SIZE};
use pvspin_prometheus::{escape_label, sanitize};
use std::collections::HashMap;

/// A KVM stats image (header, descriptors, data) for `parse`. Each stat: (name, flags,
/// exponent, values); offsets are assigned in order.
fn image(stats: &[(&str, u32, i16, &[u64])]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    const NAME_SIZE: u32 = 48;
    let mut h = Vec::new();
    for v in [0u32, NAME_SIZE, stats.len() as u32, 24, 24 + NAME_SIZE, 0] {
        h.extend_from_slice(&v.to_ne_bytes());
    }
    let mut d = Vec::new();
    let mut data = Vec::new();
    for (name, flags, exp, vals) in stats {
        d.extend_from_slice(&flags.to_ne_bytes());
        d.extend_from_slice(&exp.to_ne_bytes());
        d.extend_from_slice(&(vals.len() as u16).to_ne_bytes());
        d.extend_from_slice(&(data.len() as u32).to_ne_bytes());
        d.extend_from_slice(&0u32.to_ne_bytes());
        let mut n = name.as_bytes().to_vec();
        n.resize(NAME_SIZE as usize, 0);
        d.extend_from_slice(&n);
        for v in *vals {
            data.extend_from_slice(&v.to_ne_bytes());
        }
    }
    assert_eq!(
        d.len(),
        (DESC_FIXED_SIZE + NAME_SIZE as usize) * stats.len()
    );
    (h, d, data)
}

pub(crate) fn kvm_snapshot(exits: u64) -> Snapshot {
    let ns = KVM_STATS_UNIT_SECONDS | KVM_STATS_BASE_POW10;
    let (h, d, data) = image(&[
        ("exits", KVM_STATS_TYPE_CUMULATIVE, 0, &[exits]),
        ("halt_exits", KVM_STATS_TYPE_CUMULATIVE, 0, &[3]),
        ("halt_wakeup", KVM_STATS_TYPE_CUMULATIVE, 0, &[1930]),
        (
            "halt_wait_ns",
            KVM_STATS_TYPE_CUMULATIVE | ns,
            -9,
            &[2_000_000_000],
        ),
        (
            "blocking",
            KVM_STATS_TYPE_INSTANT | KVM_STATS_UNIT_BOOLEAN,
            0,
            &[1],
        ),
        (
            "halt_wait_hist",
            KVM_STATS_TYPE_LOG_HIST | ns,
            -9,
            &[1, 0, 2, 4],
        ),
    ]);
    parse(&h, &d, &data).unwrap()
}

fn counters(i: u32, path: KickPath) -> PvspinVcpuCounters {
    let mut p = PvspinVcpuCounters {
        runs: 10,
        exits: ExitCounts {
            io: 6,
            hlt: 4,
            ..ExitCounts::default()
        },
        run_ns: 1_500_000_000,
        kicks: Some(KickCounts {
            pvspin_delivered: 2,
            kvm_halt_wakeups: (path == KickPath::InKernel).then_some(1930),
        }),
        directed_yield: Some(VcpuYieldCounts {
            spin_notifications: 7 + u64::from(i),
            yields_attempted: 5,
            yields_successful: 2,
        }),
        ..PvspinVcpuCounters::default()
    };
    if path == KickPath::Userspace {
        let mut h = LatencyHistogram::new();
        for ns in [500, 1_500, 40_000, 3_000_000_000] {
            h.record(ns);
        }
        p.kick_to_wake_ns = Some(h);
    }
    p.rejected_guest_inputs
        .insert("doorbell target \"out of range\"\n".into(), 2);
    p
}

fn sample_vm(path: KickPath) -> VmTelemetry {
    let vcpus = (0..2u32)
        .map(|i| VcpuTelemetry {
            vcpu: i,
            pvspin: counters(i, path),
            budgets: Some(Budgets {
                wait_after_ns: 50_000,
                notify_after_ns: Some(20_000),
            }),
            kvm: Some(kvm_snapshot(100 + u64::from(i))),
        })
        .collect();
    VmTelemetry {
        kick: Some(KickDeviceTelemetry {
            path,
            stats: KickStats {
                accesses: 9,
                kicks: 4,
                forwarded: 3,
                rejected: [2, 0, 0, 0, 0],
                msi_delivered: 4,
                ..KickStats::default()
            },
        }),
        run_slots: None,
        directed_yield: Some(DirectedYieldStats {
            notifications: 15,
            yield_to_hint: 3,
            boosted: 3,
            trial: Some(pvspin_yield::TrialStats {
                epochs_on: 2,
                epochs_off: 1,
                boosting: true,
                mean_wait_ns: [Some(30_000), None],
            }),
            ..DirectedYieldStats::default()
        }),
        hints: Some(HintStats {
            registrations: 2,
            waits: 5,
            waits_kick_pending: (path == KickPath::Userspace).then_some(1),
            waits_timed_out: (path == KickPath::Userspace).then_some(0),
            ..HintStats::default()
        }),
        kvm_vm: Some(kvm_snapshot(1)),
        problems: Vec::new(),
        vcpus,
    }
}

#[test]
fn json_names_every_count_and_leaves_out_what_a_path_cannot_count() {
    let t = sample_vm(KickPath::InKernel);
    let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    let v0 = &v["vcpus"][0];
    assert_eq!(v0["vcpu"], 0);
    assert_eq!(v0["pvspin"]["runs"], 10);
    assert_eq!(v0["pvspin"]["exits"]["hlt"], 4);
    assert_eq!(v0["pvspin"]["kicks"]["pvspin_delivered"], 2);
    assert_eq!(v0["pvspin"]["kicks"]["kvm_halt_wakeups"], 1930);
    assert!(v0["pvspin"].get("kick_to_wake_ns").is_none());
    assert_eq!(v0["pvspin"]["directed_yield"]["spin_notifications"], 7);
    assert_eq!(v0["budgets"]["wait_after_ns"], 50_000);
    assert_eq!(v0["kvm"]["exits"]["value"], 100);
    assert_eq!(v["vcpus"][1]["kvm"]["exits"]["value"], 101);
    assert_eq!(v["kvm_vm"]["halt_wait_hist"]["buckets"][3], 4);
    // The device: path-specific counters only for its path.
    assert_eq!(v["kick"]["path"], "in_kernel");
    assert_eq!(v["kick"]["kicks_in_userspace"], 4);
    assert_eq!(v["kick"]["msi_delivered"], 4);
    assert_eq!(v["kick"]["rejected"]["no_such_vcpu"], 2);
    assert!(v["kick"].get("woke_parked").is_none());
    assert_eq!(
        v["directed_yield"]["trial"]["mean_wait_ns_boosts_off"],
        30_000
    );
    assert!(v["directed_yield"]["trial"]
        .get("mean_wait_ns_boosts_on")
        .is_none());
    assert_eq!(v["hints"]["waits"], 5);
    assert!(v["hints"].get("waits_timed_out").is_none());

    let t = sample_vm(KickPath::Userspace);
    let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    let v0 = &v["vcpus"][0];
    assert!(v0["pvspin"]["kicks"].get("kvm_halt_wakeups").is_none());
    assert_eq!(v0["pvspin"]["kick_to_wake_ns"]["count"], 4);
    assert_eq!(
        v0["pvspin"]["kick_to_wake_ns"]["counts"]
            .as_array()
            .unwrap()
            .len(),
        LATENCY_BOUNDS_NS.len() + 1
    );
    assert!(v["kick"].get("msi_delivered").is_none());
    assert_eq!(v["kick"]["woke_parked"], 0);
    assert_eq!(v["hints"]["waits_timed_out"], 0);
}

/// A strict reader of the text format: returns (family -> type, samples).
#[allow(clippy::type_complexity)]
fn parse_prometheus(
    text: &str,
) -> (
    HashMap<String, String>,
    Vec<(String, Vec<(String, String)>, f64)>,
) {
    let mut types = HashMap::new();
    let mut helps = HashMap::new();
    let mut samples = Vec::new();
    let mut current: Option<String> = None;
    let mut finished: Vec<String> = Vec::new();
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest.split_once(' ').unwrap();
            assert!(
                helps.insert(name.to_owned(), ()).is_none(),
                "HELP twice: {name}"
            );
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, typ) = rest.split_once(' ').unwrap();
            assert!(
                ["counter", "gauge", "histogram"].contains(&typ),
                "type {typ}"
            );
            assert!(helps.contains_key(name), "TYPE before HELP for {name}");
            assert!(types.insert(name.to_owned(), typ.to_owned()).is_none());
            if let Some(c) = current.replace(name.to_owned()) {
                finished.push(c);
            }
            continue;
        }
        assert!(!line.starts_with('#'), "stray comment {line}");
        // name{labels} value
        let name_end = line.find(['{', ' ']).unwrap();
        let name = &line[..name_end];
        assert!(name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'));
        assert!(!name.chars().next().unwrap().is_ascii_digit());
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(r) = rest.strip_prefix('{') {
            let mut r = r;
            loop {
                let eq = r.find('=').unwrap();
                let key = r[..eq].to_owned();
                r = &r[eq + 1..];
                assert!(r.starts_with('"'));
                let mut val = String::new();
                let mut chars = r[1..].char_indices();
                let end;
                loop {
                    let (i, c) = chars.next().expect("unterminated label");
                    match c {
                        '\\' => {
                            let (_, e) = chars.next().unwrap();
                            val.push(match e {
                                'n' => '\n',
                                '\\' => '\\',
                                '"' => '"',
                                other => panic!("bad escape \\{other}"),
                            });
                        }
                        '"' => {
                            end = i + 2;
                            break;
                        }
                        '\n' => panic!("raw newline"),
                        c => val.push(c),
                    }
                }
                labels.push((key, val));
                r = &r[end..];
                if let Some(x) = r.strip_prefix(',') {
                    r = x;
                } else {
                    r = r.strip_prefix('}').expect("labels end");
                    break;
                }
            }
            rest = r;
        }
        let value = rest.strip_prefix(' ').expect("space before value");
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().expect("numeric value"),
        };
        // The sample belongs to the current family.
        let fam = current.as_deref().expect("sample before TYPE");
        let typ = &types[fam];
        let ok = match typ.as_str() {
            "histogram" => [
                format!("{fam}_bucket"),
                format!("{fam}_sum"),
                format!("{fam}_count"),
            ]
            .contains(&name.to_owned()),
            _ => name == fam,
        };
        assert!(ok, "sample {name} outside its family {fam}");
        assert!(!finished.contains(&fam.to_owned()));
        samples.push((name.to_owned(), labels, v));
    }
    (types, samples)
}

type Samples = Vec<(String, Vec<(String, String)>, f64)>;

fn find(samples: &Samples, name: &str, want: &[(&str, &str)]) -> Vec<f64> {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|s| s.2)
        .collect()
}

#[test]
fn prometheus_follows_the_format_rules() {
    let text = sample_vm(KickPath::Userspace).to_prometheus();
    let (types, samples) = parse_prometheus(&text);
    for (fam, typ) in &types {
        if typ == "counter" {
            assert!(fam.ends_with("_total"), "counter {fam}");
        }
    }
    let find = |name: &str, want: &[(&str, &str)]| find(&samples, name, want);
    assert_eq!(
        find(
            "pvspin_kicks_total",
            &[("vcpu", "1"), ("path", "userspace"), ("source", "pvspin")]
        ),
        vec![2.0]
    );
    assert_eq!(
        find("pvspin_spin_notifications_total", &[("vcpu", "1")]),
        vec![8.0]
    );
    assert_eq!(
        find("pvspin_vcpu_exits_total", &[("vcpu", "0"), ("kind", "hlt")]),
        vec![4.0]
    );
    assert_eq!(
        find("pvspin_vcpu_run_seconds_total", &[("vcpu", "0")]),
        vec![1.5]
    );
    assert_eq!(
        find(
            "pvspin_rejected_guest_inputs_total",
            &[("reason", "doorbell target \"out of range\"\n")]
        ),
        vec![2.0, 2.0]
    );
    assert_eq!(
        find("pvspin_budget_wait_after_seconds", &[("vcpu", "0")]),
        vec![0.00005]
    );
    assert_eq!(
        find(
            "pvspin_kick_device_latch_total",
            &[("outcome", "woke_parked")]
        ),
        vec![0.0]
    );
    assert_eq!(
        find(
            "pvspin_directed_yield_decisions_total",
            &[("decision", "yield_to_hint")]
        ),
        vec![3.0]
    );
    assert_eq!(
        find(
            "pvspin_boost_trial_mean_wait_seconds",
            &[("boosting", "off")]
        ),
        vec![0.00003]
    );
    assert!(find(
        "pvspin_boost_trial_mean_wait_seconds",
        &[("boosting", "on")]
    )
    .is_empty());
    assert_eq!(find("pvspin_waits_timed_out_total", &[]), vec![0.0]);
    assert_eq!(find("kvm_vcpu_exits_total", &[("vcpu", "1")]), vec![101.0]);
    assert_eq!(find("kvm_vm_exits_total", &[]), vec![1.0]);
    assert_eq!(
        find("kvm_vcpu_halt_wait_seconds_total", &[("vcpu", "0")]),
        vec![2.0]
    );
    assert_eq!(find("kvm_vcpu_blocking", &[("vcpu", "0")]), vec![1.0]);
    assert_eq!(types["kvm_vcpu_blocking"], "gauge");

    // Histograms: buckets cumulative with increasing le, +Inf == _count.
    for fam in [
        "pvspin_kick_to_wake_latency_seconds",
        "kvm_vcpu_halt_wait_hist_seconds",
    ] {
        assert_eq!(types[fam], "histogram");
        for vcpu in ["0", "1"] {
            let buckets: Vec<_> = samples
                .iter()
                .filter(|(n, l, _)| {
                    *n == format!("{fam}_bucket") && l.iter().any(|(k, v)| k == "vcpu" && v == vcpu)
                })
                .map(|(_, l, v)| {
                    let le = &l.iter().find(|(k, _)| k == "le").unwrap().1;
                    let le: f64 = if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse().unwrap()
                    };
                    (le, *v)
                })
                .collect();
            assert!(buckets.len() > 2);
            for w in buckets.windows(2) {
                assert!(w[0].0 < w[1].0, "le not increasing in {fam}");
                assert!(w[0].1 <= w[1].1, "buckets not cumulative in {fam}");
            }
            let last = buckets.last().unwrap();
            assert!(last.0.is_infinite());
            let count = find(&format!("{fam}_count"), &[("vcpu", vcpu)]);
            assert_eq!(count, vec![last.1]);
        }
    }
    assert_eq!(
        find(
            "pvspin_kick_to_wake_latency_seconds_bucket",
            &[("vcpu", "0"), ("le", "0.000001")]
        ),
        vec![1.0]
    );
    let sum = find("pvspin_kick_to_wake_latency_seconds_sum", &[("vcpu", "0")]);
    assert!((sum[0] - 3.000042).abs() < 1e-9, "{sum:?}");
    // KVM log histogram: [0,1) -> le 0, [1,2) -> le 1e-9, [2,4) -> le 3e-9.
    assert_eq!(
        find(
            "kvm_vcpu_halt_wait_hist_seconds_bucket",
            &[("vcpu", "0"), ("le", "0.000000003")]
        ),
        vec![3.0]
    );
}

#[test]
fn prometheus_has_each_path_s_families_and_labels_the_in_kernel_stand_in() {
    let text = sample_vm(KickPath::InKernel).to_prometheus();
    let (types, samples) = parse_prometheus(&text);
    // In-kernel kicks: pvspin's count of the fallbacks, and KVM's halt_wakeup, labeled.
    assert_eq!(
        find(
            &samples,
            "pvspin_kicks_total",
            &[("vcpu", "0"), ("path", "in_kernel"), ("source", "pvspin")]
        ),
        vec![2.0]
    );
    assert_eq!(
        find(
            &samples,
            "pvspin_kick_wakeups_total",
            &[
                ("vcpu", "0"),
                ("path", "in_kernel"),
                ("source", "kvm_halt_wakeup")
            ]
        ),
        vec![1930.0]
    );
    for absent in [
        "pvspin_kick_to_wake_latency_seconds",
        "pvspin_kick_device_latch_total",
        "pvspin_kick_device_parks_total",
        "pvspin_waits_timed_out_total",
        "pvspin_waits_kick_pending_total",
    ] {
        assert!(
            !types.contains_key(absent),
            "{absent} on the in-kernel path"
        );
    }
    assert!(types.contains_key("pvspin_kick_device_in_kernel_missed_total"));
    assert!(types.contains_key("pvspin_kick_device_msis_total"));

    // Userspace: no stand-in, no MSI families.
    let (types, _) = parse_prometheus(&sample_vm(KickPath::Userspace).to_prometheus());
    for absent in [
        "pvspin_kick_wakeups_total",
        "pvspin_kick_device_msis_total",
        "pvspin_kick_device_in_kernel_missed_total",
    ] {
        assert!(
            !types.contains_key(absent),
            "{absent} on the userspace path"
        );
    }

    // Nothing configured: only the hooks' own counters.
    let mut t = sample_vm(KickPath::SignalMsi);
    t.kick = None;
    t.directed_yield = None;
    t.hints = None;
    for v in &mut t.vcpus {
        v.pvspin.kicks = None;
        v.pvspin.directed_yield = None;
        v.pvspin.rejected_guest_inputs.clear();
        v.budgets = None;
    }
    let (types, _) = parse_prometheus(&t.to_prometheus());
    let pvspin: Vec<_> = types.keys().filter(|f| f.starts_with("pvspin_")).collect();
    let mut pvspin: Vec<&str> = pvspin.iter().map(|s| s.as_str()).collect();
    pvspin.sort_unstable();
    assert_eq!(
        pvspin,
        [
            "pvspin_vcpu_configured",
            "pvspin_vcpu_exits_total",
            "pvspin_vcpu_run_seconds_total",
            "pvspin_vcpu_runs_before_all_configured_total",
            "pvspin_vcpu_runs_total"
        ]
    );
}

#[test]
fn empty_telemetry_renders_nothing_wrong() {
    let t = VmTelemetry::default();
    assert_eq!(t.to_prometheus(), "");
    let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    assert!(v["vcpus"].as_array().unwrap().is_empty());
    assert!(v.get("kick").is_none());
}

#[test]
fn formats_parse_and_files_are_written() {
    assert_eq!("json".parse(), Ok(TelemetryFormat::Json));
    assert_eq!("prometheus".parse(), Ok(TelemetryFormat::Prometheus));
    assert_eq!(
        "xml".parse::<TelemetryFormat>(),
        Err(TelemetryError::UnknownFormat("xml".into()))
    );
    let t = sample_vm(KickPath::SignalMsi);
    let path = std::env::temp_dir().join(format!("pvspin-telemetry-{}.prom", std::process::id()));
    t.write_to(&path, TelemetryFormat::Prometheus).unwrap();
    let back = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(back, t.to_prometheus());
}

#[test]
fn names_are_sanitized() {
    assert_eq!(sanitize("a-b.c"), "a_b_c");
    assert_eq!(sanitize(""), "_");
    assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

#[test]
fn adopter_problems_and_configuration_are_rendered() {
    let mut t = sample_vm(KickPath::SignalMsi);
    t.vcpus[0].pvspin.configured = true;
    t.vcpus[1].pvspin.runs_before_all_configured = 3;
    let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    assert!(v.get("problems").is_none(), "none found: left out");
    assert_eq!(v["vcpus"][0]["pvspin"]["configured"], true);
    assert_eq!(v["vcpus"][1]["pvspin"]["runs_before_all_configured"], 3);
    let kind = crate::ProblemKind::VcpusNotConfigured;
    t.problems.push(crate::Problem {
        kind,
        count: 1,
        vcpus: vec![1],
        signal: None,
        rule: kind.rule(),
    });
    let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    assert_eq!(v["problems"][0]["kind"], "vcpus_not_configured");
    assert_eq!(v["problems"][0]["vcpus"][0], 1);
    assert!(v["problems"][0]["rule"]
        .as_str()
        .unwrap()
        .starts_with("rule: "));
    let prom = t.to_prometheus();
    assert!(
        prom.contains("pvspin_adoption_problems_total{problem=\"vcpus_not_configured\"} 1\n"),
        "{prom}"
    );
    assert!(
        prom.contains("pvspin_vcpu_configured{vcpu=\"0\"} 1\n"),
        "{prom}"
    );
    assert!(
        prom.contains("pvspin_vcpu_configured{vcpu=\"1\"} 0\n"),
        "{prom}"
    );
    assert!(
        prom.contains("pvspin_vcpu_runs_before_all_configured_total{vcpu=\"1\"} 3\n"),
        "{prom}"
    );
}
