//! What a VMM that keeps pvspin behind its own abstractions needs from it, written once here
//! instead of in each such VMM (Cloud Hypervisor is the first, `integrations/cloud-hypervisor`;
//! crosvm would need the same):
//!
//! * [`PvspinOptions`]: the operator's choices as one `key=value,...` option
//!   (`path=in-kernel,yield=on,slots=2`), the form Cloud Hypervisor's and crosvm's command
//!   lines use, and as a field of a serde config file; [`PvspinOptions::builder`] turns them
//!   into the [`PvSpinBuilder`] every such VMM would write by hand.
//! * [`VcpuHooks::after_kvm_run`]: the exit handling for a vCPU loop that never sees
//!   `kvm_ioctls::VcpuExit` (its hypervisor crate returns its own exit type).
//! * [`VmTelemetry::counter_groups`]: the telemetry as flat named counters, for a VMM's own
//!   counters API (Cloud Hypervisor's `vm.counters`, `ch-remote counters`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use kvm_bindings::KVM_EXIT_INTR;
use kvm_ioctls::VcpuFd;
use pvspin_kick::KickPath;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::telemetry::{ExitKind, VmTelemetry};
use crate::{
    entitled_cpus, BudgetConfig, DirectedYieldOptions, ExitOutcome, GuestPageMap, HintOptions,
    KickOptions, PvSpin, PvSpinBuilder, SlotConfig, VcpuHooks, VcpuInterrupter, WaitOptions,
    WithKick,
};

/// The operator's pvspin choices for one VM, as a VMM's option or config file carries them.
///
/// As an option ([`FromStr`]):
/// `path=in-kernel|signal-msi|userspace,yield=on|off,slots=N,cpus=C`
/// ([`PvspinOptions::SYNTAX`]), every key optional (the default is the in-kernel path, no
/// directed yield, no run slots, the VM's CPUs not said). In a config file (serde):
/// `{"path": "in-kernel", "directed_yield": true, "slots": 2, "cpus": 2}`, with the same
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PvspinOptions {
    /// How a kick wakes a halted vCPU (`path=`).
    #[serde(with = "path_name", default = "in_kernel")]
    pub path: KickPath,
    /// Spin notifications and directed yield (`yield=on`).
    #[serde(default)]
    pub directed_yield: bool,
    /// Run slots: at most this many vCPUs in guest code at once (`slots=N`); 0 stands for
    /// [`entitled_cpus`], the CPUs the process may use.
    #[serde(default)]
    pub slots: Option<usize>,
    /// The CPUs the VM gets (`cpus=C`, [`PvSpinBuilder::vm_cpus`]): guests whose vCPUs (or
    /// run slots, where kicks hand slots over) fit them are told so (`VCPUS_FIT`) and stop the
    /// wake-up convoy at 2x/3x host overcommit. Not said by default (run slots, when on,
    /// count).
    #[serde(default)]
    pub cpus: Option<usize>,
}

fn in_kernel() -> KickPath {
    KickPath::InKernel
}

impl Default for PvspinOptions {
    fn default() -> Self {
        PvspinOptions {
            path: KickPath::InKernel,
            directed_yield: false,
            slots: None,
            cpus: None,
        }
    }
}

/// A `key=value,...` pvspin option that breaks a rule, named.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// A key the option does not have.
    #[error("unknown key {0:?}: the keys are path, yield, slots and cpus")]
    UnknownKey(String),
    /// A key given twice.
    #[error("{0} given twice")]
    Repeated(String),
    /// A value the key does not take.
    #[error("{key}={value}: {key} is {expected}")]
    Value {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What the key takes.
        expected: &'static str,
    },
}

/// The option name of a kick path (`in-kernel`, `signal-msi`, `userspace`), as
/// [`PvspinOptions`] parses and prints it.
pub fn kick_path_option(path: KickPath) -> &'static str {
    match path {
        KickPath::InKernel => "in-kernel",
        KickPath::SignalMsi => "signal-msi",
        KickPath::Userspace => "userspace",
    }
}

fn parse_path(value: &str) -> Result<KickPath, OptionsError> {
    (KickPath::ALL.into_iter())
        .find(|&path| kick_path_option(path) == value)
        .ok_or_else(|| OptionsError::Value {
            key: "path",
            value: value.into(),
            expected: "in-kernel, signal-msi or userspace",
        })
}

impl PvspinOptions {
    /// The option's syntax, for a VMM's help text.
    pub const SYNTAX: &'static str = "path=in-kernel|signal-msi|userspace,yield=on|off,\
        slots=<vCPUs in guest code at once, 0: the CPUs this process may use>,\
        cpus=<the CPUs the VM gets, at least 1>";

    /// A builder for a VM of `vcpus` vCPUs with these choices: the kick path, hint pages over
    /// `memory` (the VM's guest memory) and WAIT (what pvspin's guests use with a kick path),
    /// directed yield with its default options if asked, and run slots if asked. The VMM adds
    /// its own settings (a helper-thread filter, say) and calls `build`.
    pub fn builder(
        &self,
        vcpus: usize,
        interrupter: Arc<dyn VcpuInterrupter>,
        memory: Arc<dyn GuestPageMap>,
    ) -> PvSpinBuilder<WithKick> {
        let budgets = BudgetConfig::default();
        let mut builder = PvSpin::builder()
            .vcpus(vcpus)
            .interrupter(interrupter)
            .kick(KickOptions::new(self.path))
            .hint_pages(HintOptions { memory, budgets })
            .pv_wait(WaitOptions::default());
        if self.directed_yield {
            builder = builder.directed_yield(DirectedYieldOptions::default());
        }
        if let Some(cpus) = self.cpus {
            builder = builder.vm_cpus(cpus);
        }
        match self.slots {
            Some(0) => builder.run_slots(SlotConfig::new(entitled_cpus())),
            Some(slots) => builder.run_slots(SlotConfig::new(slots)),
            None => builder,
        }
    }
}

impl FromStr for PvspinOptions {
    type Err = OptionsError;

    fn from_str(option: &str) -> Result<Self, OptionsError> {
        let mut options = PvspinOptions::default();
        let mut seen: Vec<&str> = Vec::new();
        for pair in option.split(',').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&key) {
                return Err(OptionsError::Repeated(key.into()));
            }
            seen.push(key);
            match key {
                "path" => options.path = parse_path(value)?,
                "yield" => {
                    options.directed_yield = match value {
                        "on" | "true" => true,
                        "off" | "false" => false,
                        _ => return Err(value_error("yield", value, "on or off")),
                    }
                }
                "slots" => {
                    let slots = value.parse().map_err(|_| {
                        value_error("slots", value, "a count of vCPUs (0: the process's CPUs)")
                    })?;
                    options.slots = Some(slots);
                }
                "cpus" => {
                    let cpus =
                        value.parse().ok().filter(|&c| c > 0).ok_or_else(|| {
                            value_error("cpus", value, "a count of CPUs, at least 1")
                        })?;
                    options.cpus = Some(cpus);
                }
                _ => return Err(OptionsError::UnknownKey(key.into())),
            }
        }
        Ok(options)
    }
}

fn value_error(key: &'static str, value: &str, expected: &'static str) -> OptionsError {
    OptionsError::Value {
        key,
        value: value.into(),
        expected,
    }
}

impl fmt::Display for PvspinOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on_off = if self.directed_yield { "on" } else { "off" };
        write!(f, "path={},yield={on_off}", kick_path_option(self.path))?;
        if let Some(slots) = self.slots {
            write!(f, ",slots={slots}")?;
        }
        match self.cpus {
            Some(cpus) => write!(f, ",cpus={cpus}"),
            None => Ok(()),
        }
    }
}

/// `path` in a config file: the option name.
mod path_name {
    use super::*;

    pub(super) fn serialize<S: Serializer>(path: &KickPath, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(kick_path_option(*path))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<KickPath, D::Error> {
        let name = String::deserialize(d)?;
        parse_path(&name).map_err(serde::de::Error::custom)
    }
}

impl VcpuHooks {
    /// After a `KVM_RUN` for a VMM whose vCPU loop sees its own exit type, not
    /// `kvm_ioctls::VcpuExit` (Cloud Hypervisor's `hypervisor::VmExit`): the exit's kind is
    /// read from `vcpu`'s `kvm_run.exit_reason` ([`ExitKind::from_exit_reason`]; a run that
    /// failed with anything but `EINTR` is a [`ExitKind::Failure`]), then
    /// [`handle_exit_kind`](Self::handle_exit_kind) and [`after_run`](Self::after_run).
    /// `run_failed`: the run returned an error. The doorbell is the VMM's bus device
    /// ([`PvSpin::doorbell_pio`]). `Handled`: pvspin consumed the exit; the VMM re-enters
    /// `KVM_RUN`.
    pub fn after_kvm_run(&mut self, vcpu: &mut VcpuFd, run_failed: bool) -> ExitOutcome {
        let reason = vcpu.get_kvm_run().exit_reason;
        let kind = match run_failed && reason != KVM_EXIT_INTR {
            true => ExitKind::Failure,
            false => ExitKind::from_exit_reason(reason),
        };
        let outcome = self.handle_exit_kind(kind);
        self.after_run(vcpu);
        outcome
    }
}

impl VmTelemetry {
    /// The counters as named groups of named counts, for a VMM's own counters API: `pvspin`
    /// (the kick device's counters, the hint-page and WAIT counters, the run slots', and
    /// `problems`, how many adopter mistakes [`PvSpin::check`] found) and `pvspin-vcpuN` per
    /// vCPU (`runs`, its exits by kind as `exits_KIND`, `run_ns`, its kicks, its directed
    /// yields, `configured`). Counters a configuration lacks are left out.
    pub fn counter_groups(&self) -> Vec<(String, Vec<(&'static str, u64)>)> {
        let mut vm = self.kick.map(|kick| kick.counters()).unwrap_or_default();
        if let Some(h) = &self.hints {
            vm.extend([
                ("hint_registrations", h.registrations),
                ("hint_bad_registrations", h.bad_registrations),
                ("hint_wait_reports", h.wait_reports),
                ("waits", h.waits),
            ]);
        }
        if let Some(s) = &self.run_slots {
            vm.extend([
                ("slots", s.slots as u64),
                ("slot_grants", s.grants),
                ("slot_waits", s.waits),
                ("slot_hand_overs", s.hand_overs),
                ("slot_preemptions", s.preemptions),
            ]);
        }
        vm.push(("problems", self.problems.len() as u64));
        let mut groups = vec![("pvspin".to_owned(), vm)];
        for vcpu in &self.vcpus {
            let p = &vcpu.pvspin;
            let mut counters = vec![("runs", p.runs), ("run_ns", p.run_ns)];
            counters.extend(ExitKind::ALL.map(|kind| (exit_counter(kind), p.exits.get(kind))));
            if let Some(kicks) = p.kicks {
                counters.push(("kicks_pvspin_delivered", kicks.pvspin_delivered));
                if let Some(wakeups) = kicks.kvm_halt_wakeups {
                    counters.push(("kvm_halt_wakeups", wakeups));
                }
            }
            if let Some(dy) = p.directed_yield {
                counters.extend([
                    ("spin_notifications", dy.spin_notifications),
                    ("yields_attempted", dy.yields_attempted),
                    ("yields_successful", dy.yields_successful),
                ]);
            }
            counters.push(("configured", u64::from(p.configured)));
            groups.push((format!("pvspin-vcpu{}", vcpu.vcpu), counters));
        }
        groups
    }
}

fn exit_counter(kind: ExitKind) -> &'static str {
    match kind {
        ExitKind::Io => "exits_io",
        ExitKind::Mmio => "exits_mmio",
        ExitKind::Hlt => "exits_hlt",
        ExitKind::Interrupted => "exits_interrupted",
        ExitKind::Failure => "exits_failure",
        ExitKind::Other => "exits_other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{PvspinVcpuCounters, VcpuTelemetry};
    use crate::KickCounts;

    #[test]
    fn options_parse_every_key_and_default_the_rest() {
        let options: PvspinOptions = "path=signal-msi,yield=on,slots=2,cpus=3".parse().unwrap();
        let expected = PvspinOptions {
            path: KickPath::SignalMsi,
            directed_yield: true,
            slots: Some(2),
            cpus: Some(3),
        };
        assert_eq!(options, expected);
        assert_eq!(
            options.to_string(),
            "path=signal-msi,yield=on,slots=2,cpus=3"
        );
        assert_eq!("".parse(), Ok(PvspinOptions::default()));
        assert_eq!(
            "yield=off".parse::<PvspinOptions>().unwrap().path,
            KickPath::InKernel
        );
        for path in KickPath::ALL {
            let option = format!("path={}", kick_path_option(path));
            assert_eq!(option.parse::<PvspinOptions>().unwrap().path, path);
        }
    }

    #[test]
    fn options_refuse_what_breaks_a_rule() {
        let err = |option: &str| option.parse::<PvspinOptions>().unwrap_err();
        assert!(matches!(
            err("path=hlt"),
            OptionsError::Value { key: "path", .. }
        ));
        assert!(matches!(
            err("yield=maybe"),
            OptionsError::Value { key: "yield", .. }
        ));
        assert!(matches!(
            err("slots=two"),
            OptionsError::Value { key: "slots", .. }
        ));
        assert!(matches!(
            err("slots=-1"),
            OptionsError::Value { key: "slots", .. }
        ));
        for bad in ["cpus=0", "cpus=x", "cpus="] {
            assert!(
                matches!(err(bad), OptionsError::Value { key: "cpus", .. }),
                "{bad}"
            );
        }
        assert_eq!(err("bogus=1"), OptionsError::UnknownKey("bogus".into()));
        assert_eq!(
            err("slots=1,slots=2"),
            OptionsError::Repeated("slots".into())
        );
        assert!(err("path=hlt")
            .to_string()
            .contains("in-kernel, signal-msi or userspace"));
    }

    #[test]
    fn cpus_tell_the_guest_whether_its_vcpus_fit() {
        #[derive(Debug)]
        struct NoInterrupt;
        impl VcpuInterrupter for NoInterrupt {
            fn interrupt(&self, _index: usize) {}
        }
        let fit = |option: &str, vcpus: usize| {
            let options: PvspinOptions = option.parse().unwrap();
            let memory = Arc::new(pvspin_hints::BufferPageMap::new(1));
            let pvspin = options
                .builder(vcpus, Arc::new(NoInterrupt), memory)
                .build()
                .unwrap();
            let fit = pvspin.hints.as_ref().unwrap().pages.vcpus_fit();
            pvspin.shutdown();
            fit
        };
        assert!(!fit("path=userspace", 2), "not said");
        assert!(fit("path=userspace,cpus=2", 2));
        assert!(!fit("path=userspace,cpus=2", 4));
        assert!(
            fit("path=userspace,cpus=8,slots=2", 4),
            "2 slots fit 8 CPUs"
        );
        assert!(
            !fit("path=userspace,cpus=1,slots=2", 4),
            "2 slots do not fit 1 CPU"
        );
    }

    #[test]
    fn options_round_trip_through_a_config_file() {
        let options = PvspinOptions {
            path: KickPath::Userspace,
            directed_yield: true,
            slots: Some(0),
            cpus: None,
        };
        let json = serde_json::to_string(&options).unwrap();
        assert_eq!(
            json,
            r#"{"path":"userspace","directed_yield":true,"slots":0,"cpus":null}"#
        );
        assert_eq!(
            serde_json::from_str::<PvspinOptions>(&json).unwrap(),
            options
        );
        let defaults: PvspinOptions = serde_json::from_str("{}").unwrap();
        assert_eq!(defaults, PvspinOptions::default());
        assert!(serde_json::from_str::<PvspinOptions>(r#"{"path":"hlt"}"#).is_err());
    }

    #[test]
    fn counter_groups_name_every_vcpu_and_count_problems() {
        let vcpu = |index: u32, runs: u64| VcpuTelemetry {
            vcpu: index,
            pvspin: PvspinVcpuCounters {
                runs,
                kicks: Some(KickCounts {
                    pvspin_delivered: 3,
                    kvm_halt_wakeups: None,
                }),
                configured: true,
                ..Default::default()
            },
            budgets: None,
            kvm: None,
        };
        let telemetry = VmTelemetry {
            vcpus: vec![vcpu(0, 5), vcpu(1, 7)],
            ..Default::default()
        };
        let groups = telemetry.counter_groups();
        let names: Vec<&str> = groups.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["pvspin", "pvspin-vcpu0", "pvspin-vcpu1"]);
        assert_eq!(groups[0].1, [("problems", 0)]);
        let get = |group: usize, name: &str| {
            let counters = &groups[group].1;
            counters.iter().find(|(n, _)| *n == name).map(|&(_, v)| v)
        };
        assert_eq!(get(2, "runs"), Some(7));
        assert_eq!(get(1, "kicks_pvspin_delivered"), Some(3));
        assert_eq!(get(1, "exits_hlt"), Some(0));
        assert_eq!(get(1, "configured"), Some(1));
        assert_eq!(get(1, "kvm_halt_wakeups"), None);
        assert_eq!(get(1, "spin_notifications"), None);
    }
}
