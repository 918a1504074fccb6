//! The Prometheus rendering of [`VmTelemetry`] (text exposition format 0.0.4); the families
//! are listed in the [module docs](super).

use pvspin_kick::KickPath;
use pvspin_kvm::stats::{Snapshot, StatBase, StatKind, StatUnit};
use pvspin_prometheus::{escape_help, fmt_f64, sanitize, Families};

use super::{ExitKind, VcpuTelemetry, VmTelemetry};

/// One vCPU's label.
fn vcpu_label(v: &VcpuTelemetry) -> (&'static str, String) {
    ("vcpu", v.vcpu.to_string())
}

fn seconds(ns: u64) -> String {
    fmt_f64(ns as f64 / 1e9)
}

pub(super) fn render(t: &VmTelemetry) -> String {
    let mut out = Families::default();
    for v in &t.vcpus {
        vcpu_samples(&mut out, v, t.kick_path());
    }
    vm_samples(&mut out, t);
    if let Some(s) = &t.kvm_vm {
        kvm_samples(&mut out, "kvm_vm_", s, &[]);
    }
    for v in &t.vcpus {
        if let Some(s) = &v.kvm {
            kvm_samples(&mut out, "kvm_vcpu_", s, &[vcpu_label(v)]);
        }
    }
    out.render()
}

fn vcpu_samples(out: &mut Families, v: &VcpuTelemetry, path: Option<KickPath>) {
    let vl = [vcpu_label(v)];
    let p = &v.pvspin;
    out.counter(
        "pvspin_vcpu_runs_total",
        "Returns from KVM_RUN seen by pvspin's hooks.",
        &vl,
        p.runs,
    );
    for kind in ExitKind::ALL {
        out.counter(
            "pvspin_vcpu_exits_total",
            "Returns from KVM_RUN seen by pvspin's hooks, per kind.",
            &[vcpu_label(v), ("kind", kind.name().to_owned())],
            p.exits.get(kind),
        );
    }
    out.sample(
        "pvspin_vcpu_configured",
        "gauge",
        "Whether the vCPU went through PvSpin::configure_vcpu (1) or not (0).",
        "",
        &vl,
        if p.configured { "1" } else { "0" },
    );
    out.counter(
        "pvspin_vcpu_runs_before_all_configured_total",
        "Runs of the vCPU's hooks made before every vCPU was configured (a forgotten \
         configure_vcpu keeps it growing).",
        &vl,
        p.runs_before_all_configured,
    );
    out.sample(
        "pvspin_vcpu_run_seconds_total",
        "counter",
        "Time inside KVM_RUN (guest time plus exits and halts handled in KVM).",
        "",
        &vl,
        seconds(p.run_ns),
    );
    if let (Some(kicks), Some(path)) = (&p.kicks, path) {
        out.counter(
            "pvspin_kicks_total",
            "Kicks to the vCPU that pvspin delivered itself: every valid kick on the signal_msi \
             and userspace paths; on the in_kernel path, whose kicks never exit, only those that \
             reached userspace (see pvspin_kick_wakeups_total).",
            &[
                vcpu_label(v),
                ("path", path.name().to_owned()),
                ("source", "pvspin".to_owned()),
            ],
            kicks.pvspin_delivered,
        );
        if let Some(wakeups) = kicks.kvm_halt_wakeups {
            out.counter(
                "pvspin_kick_wakeups_total",
                "In-kernel path: KVM's halt_wakeup for the vCPU, its wake-ups from a halt by a \
                 kick or any other interrupt (stands in for the kicks pvspin cannot count).",
                &[
                    vcpu_label(v),
                    ("path", path.name().to_owned()),
                    ("source", "kvm_halt_wakeup".to_owned()),
                ],
                wakeups,
            );
        }
    }
    for (reason, n) in &p.rejected_guest_inputs {
        out.counter(
            "pvspin_rejected_guest_inputs_total",
            "Guest inputs from the vCPU that pvspin ignored, per reason.",
            &[vcpu_label(v), ("reason", reason.clone())],
            *n,
        );
    }
    if let Some(dy) = &p.directed_yield {
        for (name, help, value) in [
            (
                "pvspin_spin_notifications_total",
                "Spin notifications the vCPU sent.",
                dy.spin_notifications,
            ),
            (
                "pvspin_yields_attempted_total",
                "Directed yields attempted for the vCPU.",
                dy.yields_attempted,
            ),
            (
                "pvspin_yields_successful_total",
                "Directed yields that handed the CPU over.",
                dy.yields_successful,
            ),
        ] {
            out.counter(name, help, &vl, value);
        }
    }
    if let Some(h) = &p.kick_to_wake_ns {
        let fam = "pvspin_kick_to_wake_latency_seconds";
        let help = "Kick-to-wake latency of the kicked vCPU (userspace path).";
        let mut cum = 0u64;
        for (bound, c) in h.buckets() {
            cum = cum.saturating_add(c);
            let le = bound.map_or_else(|| "+Inf".to_owned(), seconds);
            out.sample(
                fam,
                "histogram",
                help,
                "_bucket",
                &[vcpu_label(v), ("le", le)],
                cum.to_string(),
            );
        }
        out.sample(fam, "histogram", help, "_sum", &vl, seconds(h.sum_ns()));
        out.sample(fam, "histogram", help, "_count", &vl, h.count().to_string());
    }
    if let Some(b) = &v.budgets {
        out.sample(
            "pvspin_budget_wait_after_seconds",
            "gauge",
            "The vCPU's spin budget before waiting (hint page).",
            "",
            &vl,
            seconds(b.wait_after_ns),
        );
        if let Some(ns) = b.notify_after_ns {
            out.sample(
                "pvspin_budget_notify_after_seconds",
                "gauge",
                "The vCPU's spin budget before notifying (hint page).",
                "",
                &vl,
                seconds(ns),
            );
        }
    }
}

fn vm_samples(out: &mut Families, t: &VmTelemetry) {
    for p in &t.problems {
        out.counter(
            "pvspin_adoption_problems_total",
            "Adopter mistakes pvspin found (PvSpin::check), per kind: events counted, or \
             vCPUs for vcpus_not_configured.",
            &[("problem", p.kind.name().to_owned())],
            p.count,
        );
    }
    if let Some(k) = &t.kick {
        let path = ("path", k.path.name().to_owned());
        let s = &k.stats;
        for (name, help, value) in [
            (
                "pvspin_kick_device_accesses_total",
                "Doorbell accesses that reached userspace.",
                s.accesses,
            ),
            (
                "pvspin_kick_device_kicks_in_userspace_total",
                "Valid kicks that reached userspace (the in_kernel path: only those its \
                 ioeventfds did not catch).",
                s.kicks,
            ),
            (
                "pvspin_kick_device_forwarded_total",
                "Doorbell commands forwarded to pvspin's hooks (SPIN, SHARED_PAGE, WAIT, \
                 window reads).",
                s.forwarded,
            ),
        ] {
            out.counter(name, help, std::slice::from_ref(&path), value);
        }
        for reason in pvspin_kick::Reject::ALL {
            out.counter(
                "pvspin_kick_device_rejected_total",
                "Doorbell accesses ignored, per reason.",
                &[path.clone(), ("reason", reason.name().to_owned())],
                s.rejected(reason),
            );
        }
        match k.path {
            KickPath::SignalMsi | KickPath::InKernel => {
                for (outcome, value) in [
                    ("delivered", s.msi_delivered),
                    ("not_delivered", s.msi_not_delivered),
                    ("failed", s.msi_failed),
                ] {
                    out.counter(
                        "pvspin_kick_device_msis_total",
                        "KVM_SIGNAL_MSI calls for kicks, per outcome (in_kernel: the fallback).",
                        &[path.clone(), ("outcome", outcome.to_owned())],
                        value,
                    );
                }
            }
            KickPath::Userspace => {
                for (outcome, value) in [
                    ("woke_parked", s.woke_parked),
                    ("latched", s.latched),
                    ("coalesced", s.coalesced),
                ] {
                    out.counter(
                        "pvspin_kick_device_latch_total",
                        "Userspace path: kicks per latch outcome.",
                        &[("outcome", outcome.to_owned())],
                        value,
                    );
                }
                for (kind, value) in [("hlt", s.hlt_parks), ("wait", s.wait_parks)] {
                    out.counter(
                        "pvspin_kick_device_parks_total",
                        "Userspace path: parks of a vCPU thread on its latch, per cause.",
                        &[("kind", kind.to_owned())],
                        value,
                    );
                }
            }
        }
        if k.path == KickPath::InKernel {
            out.counter(
                "pvspin_kick_device_in_kernel_missed_total",
                "In-kernel path: valid kicks that reached userspace because their ioeventfd \
                 missed them (not registered, or a u64 datamatch); delivered by the fallback \
                 MSI, an exit each.",
                &[],
                s.in_kernel_missed,
            );
        }
    }
    if let Some(r) = &t.run_slots {
        out.sample(
            "pvspin_run_slots",
            "gauge",
            "vCPUs that may run guest code at once.",
            "",
            &[],
            r.slots.to_string(),
        );
        for (what, help, value) in [
            ("grants", "Run slots granted.", r.grants),
            ("waits", "Run-slot grants that had to wait.", r.waits),
            (
                "prioritized_grants",
                "Run slots granted to a kicked or named vCPU that waited.",
                r.prioritized_grants,
            ),
            (
                "hand_overs",
                "Run slots a kicker handed to the vCPU it kicked.",
                r.hand_overs,
            ),
            (
                "preemptions",
                "Forced exits asked of run-slot holders.",
                r.preemptions,
            ),
            (
                "extensions",
                "Run-slot quanta extended for a critical section.",
                r.extensions,
            ),
            (
                "steal_time_marks",
                "Waits for a run slot shown to the guest through its steal-time preempted byte.",
                r.steal_time_marks,
            ),
            (
                "lends",
                "Run slots of vCPUs halted inside KVM lent to waiters.",
                r.lends,
            ),
            (
                "reclaims",
                "vCPUs that KVM woke while their run slot was lent, given one back.",
                r.reclaims,
            ),
            (
                "watch_polls",
                "Polls of the run-slot halt watcher.",
                r.watch_polls,
            ),
            (
                "watch_reads",
                "Reads of KVM's blocking statistic by the halt watcher.",
                r.watch_reads,
            ),
            (
                "watch_read_errors",
                "Reads of KVM's blocking statistic that failed.",
                r.watch_read_errors,
            ),
        ] {
            out.counter(&format!("pvspin_run_slot_{what}_total"), help, &[], value);
        }
        out.sample(
            "pvspin_run_slot_max_wait_seconds",
            "gauge",
            "The longest wait for a run slot.",
            "",
            &[],
            format!("{}", r.max_wait_ns as f64 / 1e9),
        );
        out.sample(
            "pvspin_run_slot_max_over_seconds",
            "gauge",
            "The longest run with more run-slot holders than slots.",
            "",
            &[],
            format!("{}", r.max_over_ns as f64 / 1e9),
        );
        out.sample(
            "pvspin_run_slot_max_held",
            "gauge",
            "The most vCPUs that held run slots at once.",
            "",
            &[],
            r.max_held.to_string(),
        );
    }
    if let Some(d) = &t.directed_yield {
        out.counter(
            "pvspin_directed_yield_notifications_total",
            "Spin notifications directed yield handled.",
            &[],
            d.notifications,
        );
        for (decision, value) in [
            ("yield_to_hint", d.yield_to_hint),
            ("yield_to_candidate", d.yield_to_candidate),
            ("yield_self", d.yield_self),
            ("nothing", d.nothing),
        ] {
            out.counter(
                "pvspin_directed_yield_decisions_total",
                "Directed-yield decisions, per decision.",
                &[("decision", decision.to_owned())],
                value,
            );
        }
        for (name, help, value) in [
            (
                "pvspin_directed_yield_boosted_total",
                "Actuations that boosted the target's thread.",
                d.boosted,
            ),
            (
                "pvspin_directed_yield_descheduled_total",
                "Actuations after which the spinner's thread had been descheduled.",
                d.descheduled,
            ),
            (
                "pvspin_directed_yield_hint_not_ready_total",
                "Hints naming a vCPU that was not ready.",
                d.hint_not_ready,
            ),
            (
                "pvspin_directed_yield_hint_self_total",
                "Hints naming the spinner itself.",
                d.hint_self,
            ),
            (
                "pvspin_directed_yield_window_reads_total",
                "Spin-window reads answered.",
                d.window_reads,
            ),
            (
                "pvspin_directed_yield_trial_skipped_total",
                "Boosts of a running target left out by the boost trial.",
                d.trial_skipped,
            ),
        ] {
            out.counter(name, help, &[], value);
        }
        if let Some(trial) = &d.trial {
            for (boosting, value) in [("on", trial.epochs_on), ("off", trial.epochs_off)] {
                out.counter(
                    "pvspin_boost_trial_epochs_total",
                    "Boost-trial epochs, with boosts of running targets on and off.",
                    &[("boosting", boosting.to_owned())],
                    value,
                );
            }
            out.sample(
                "pvspin_boost_trial_boosting",
                "gauge",
                "Whether the boost trial boosts running targets now (1) or not (0).",
                "",
                &[],
                if trial.boosting { "1" } else { "0" },
            );
            for (boosting, mean) in [
                ("off", trial.mean_wait_ns[0]),
                ("on", trial.mean_wait_ns[1]),
            ] {
                if let Some(ns) = mean {
                    out.sample(
                        "pvspin_boost_trial_mean_wait_seconds",
                        "gauge",
                        "The boost trial's mean wait (moving average), with boosts off and on.",
                        "",
                        &[("boosting", boosting.to_owned())],
                        seconds(ns),
                    );
                }
            }
        }
    }
    if let Some(h) = &t.hints {
        for (name, help, value) in [
            (
                "pvspin_hint_page_registrations_total",
                "Hint-page registrations accepted (unregistrations included).",
                Some(h.registrations),
            ),
            (
                "pvspin_hint_page_bad_registrations_total",
                "Hint-page registrations refused (not guest RAM).",
                Some(h.bad_registrations),
            ),
            (
                "pvspin_hint_wait_reports_total",
                "Wait reports taken from hint pages.",
                Some(h.wait_reports),
            ),
            (
                "pvspin_waits_total",
                "WAIT commands handled.",
                Some(h.waits),
            ),
            (
                "pvspin_waits_kick_pending_total",
                "Userspace path: WAITs that ended at once on a pending kick.",
                h.waits_kick_pending,
            ),
            (
                "pvspin_waits_timed_out_total",
                "Userspace path: WAITs that ended by their timeout.",
                h.waits_timed_out,
            ),
        ] {
            if let Some(value) = value {
                out.counter(name, help, &[], value);
            }
        }
    }
}

fn kvm_samples(out: &mut Families, prefix: &str, snap: &Snapshot, labels: &[(&str, String)]) {
    for st in snap.iter() {
        let d = st.desc;
        let mut base = format!("{prefix}{}", sanitize(&d.name));
        // Divide by 10^-e rather than multiply by 10^e: 3 / 1e9 prints as 0.000000003.
        let scale = |v: f64| match d.base {
            StatBase::Pow10 if d.exponent < 0 => v / 10f64.powi(-i32::from(d.exponent)),
            _ => v * d.scale(),
        };
        let scaled = match d.unit {
            StatUnit::Seconds => {
                if let Some(b) = base.strip_suffix("_ns") {
                    base = b.to_owned();
                }
                base.push_str("_seconds");
                true
            }
            StatUnit::Bytes => {
                if !base.ends_with("_bytes") {
                    base.push_str("_bytes");
                }
                true
            }
            _ => false,
        };
        let val = |v: u64| {
            if scaled {
                fmt_f64(scale(v as f64))
            } else {
                v.to_string()
            }
        };
        let help = format!(
            "KVM stat {} ({:?}, unit {:?}).",
            escape_help(&d.name),
            d.kind,
            d.unit
        );
        match d.kind {
            StatKind::Cumulative => {
                let fam = format!("{base}_total");
                let v = st.values.first().copied().unwrap_or(0);
                out.sample(&fam, "counter", &help, "", labels, val(v));
            }
            StatKind::LinearHist | StatKind::LogHist => {
                let mut cum = 0u64;
                for (bound, c) in d.bucket_upper_bounds().into_iter().zip(st.values) {
                    cum = cum.saturating_add(*c);
                    // Integer values: [a, b) is <= b - 1.
                    let le = bound.map_or_else(
                        || "+Inf".to_owned(),
                        |b| {
                            let raw = b.saturating_sub(1) as f64;
                            fmt_f64(if scaled { scale(raw) } else { raw })
                        },
                    );
                    let mut l = labels.to_vec();
                    l.push(("le", le));
                    out.sample(&base, "histogram", &help, "_bucket", &l, cum.to_string());
                }
                out.sample(&base, "histogram", &help, "_count", labels, cum.to_string());
            }
            StatKind::Instant | StatKind::Peak | StatKind::Unknown(_) => {
                let v = st.values.first().copied().unwrap_or(0);
                out.sample(&base, "gauge", &help, "", labels, val(v));
            }
        }
    }
}
