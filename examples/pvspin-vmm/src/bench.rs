//! `pvspin-vmm bench`: the overcommit experiment. Each variant (lock, PV mode, kick path) runs
//! at each overcommit level (hog count) several times, interleaved run by run so that noise
//! on a shared machine spreads evenly; the table gives mean (sd), median and the ratio to the
//! first variant (the BASE row of the original PV-spinlock tables).

use std::fmt;

use pvspin_vmm_proto::LockKind;

use crate::cli::VmArgs;
use crate::config::{GuestKind, PvMode, RunConfig};
use crate::vmm::{self, RunError};

/// One configuration to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// Guest lock.
    pub lock: LockKind,
    /// PV mode.
    pub pv: PvMode,
    /// Kick path (with PV on).
    pub kick_path: pvspin::KickPath,
    /// Directed-yield actuator (with `kick+yield`).
    pub actuator: &'static str,
    /// How waiters wait (`None`: the run's `--wait`).
    pub wait: Option<crate::config::WaitMode>,
    /// Budget unit (`None`: the run's `--budgets`).
    pub budgets: Option<crate::config::BudgetMode>,
    /// Run slots (`/slots`; `None`: the run's `--sched`).
    pub slots: Option<bool>,
    /// Kicks through the vhost-user backend of the bench's `--pv-backend` (`/vhost`); the
    /// other variants run pvspin in process, so both sit side by side in one table.
    pub vhost: bool,
    /// The guest (`@stock`, `@pvspin`; `None`: the run's `--guest`), so stock and
    /// pvspin-aware guests sit side by side in one table.
    pub guest: Option<GuestKind>,
}

impl Variant {
    /// `lock:pv[/option...][:path[:actuator]][@guest]`, e.g. `ticket:off`,
    /// `queued:kick:userspace`, `ticket:kick/spins` (ABI 0.2 spin budgets),
    /// `ticket:kick/doorbell` (WAIT in kernel mode), `ticket:kick/hlt`, `queued:kick@stock`
    /// (a stock Linux guest's pv qspinlock), `queued:kick:signal-msi@pvspin`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (variant, guest) = match text.rsplit_once('@') {
            Some((variant, "stock")) => (variant, Some(GuestKind::Stock)),
            Some((variant, "pvspin")) => (variant, Some(GuestKind::Pvspin)),
            Some((_, other)) => {
                return Err(format!("{text:?}: unknown guest {other:?} (stock, pvspin)"))
            }
            None => (text, None),
        };
        let mut parsed = Self::parse_variant(text, variant)?;
        parsed.guest = guest;
        Ok(parsed)
    }

    /// [`parse`](Self::parse) without the guest; `text` is the whole variant, for messages.
    fn parse_variant(text: &str, variant: &str) -> Result<Self, String> {
        let (text_base, options) = match variant.split_once('/') {
            Some((base, rest)) => {
                // Options sit on the pv part: split them off up to the next ':'.
                let (opts, tail) = rest.split_once(':').unwrap_or((rest, ""));
                let base = if tail.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}:{tail}")
                };
                (base, Some(opts.to_string()))
            }
            None => (variant.to_string(), None),
        };
        let (mut wait, mut budgets, mut slots, mut vhost) = (None, None, None, false);
        for opt in options.iter().flat_map(|o| o.split('/')) {
            match opt {
                "spins" => budgets = Some(crate::config::BudgetMode::Spins),
                "time" => budgets = Some(crate::config::BudgetMode::Time),
                "hlt" => wait = Some(crate::config::WaitMode::Hlt),
                "doorbell" => wait = Some(crate::config::WaitMode::Doorbell),
                "slots" => slots = Some(true),
                "vhost" => vhost = true,
                other => {
                    return Err(format!(
                    "{text:?}: unknown option {other:?} (spins, time, hlt, doorbell, slots, vhost)"
                ))
                }
            }
        }
        let mut parts = text_base.split(':');
        let lock = match parts.next() {
            Some("ticket") => LockKind::Ticket,
            Some("tas") => LockKind::Tas,
            Some("queued") => LockKind::Queued,
            Some("backoff") => LockKind::Backoff,
            other => {
                return Err(format!(
                    "{text:?}: unknown lock {other:?} (ticket, tas, queued, backoff)"
                ))
            }
        };
        let pv = match parts.next().unwrap_or("off") {
            "off" => PvMode::Off,
            "kick" => PvMode::Kick,
            "kick+yield" => PvMode::KickYield,
            other => {
                return Err(format!(
                    "{text:?}: unknown pv mode {other:?} (off, kick, kick+yield)"
                ))
            }
        };
        let kick_path = match parts.next().unwrap_or("in-kernel") {
            "in-kernel" => pvspin::KickPath::InKernel,
            "signal-msi" => pvspin::KickPath::SignalMsi,
            "userspace" => pvspin::KickPath::Userspace,
            other => {
                return Err(format!(
                    "{text:?}: unknown kick path {other:?} (in-kernel, signal-msi, userspace)"
                ))
            }
        };
        let actuator = match parts.next() {
            None => pvspin::DEFAULT_ACTUATOR,
            Some(_) if pv != PvMode::KickYield => {
                return Err(format!("{text:?}: an actuator needs kick+yield"))
            }
            Some("yield") => "yield",
            Some("nice") => "nice",
            Some("fifo") => "fifo",
            Some(other) => {
                return Err(format!(
                    "{text:?}: unknown actuator {other:?} (yield, nice, fifo)"
                ))
            }
        };
        if let Some(extra) = parts.next() {
            return Err(format!("{text:?}: unexpected {extra:?}"));
        }
        if pv == PvMode::Off && (wait.is_some() || budgets.is_some() || slots.is_some() || vhost) {
            return Err(format!(
                "{text:?}: wait, budget, slot and vhost options need a PV mode"
            ));
        }
        Ok(Self {
            lock,
            pv,
            kick_path,
            actuator,
            wait,
            budgets,
            slots,
            vhost,
            guest: None,
        })
    }

    fn options_suffix(&self) -> String {
        let mut s = String::new();
        match self.budgets {
            Some(crate::config::BudgetMode::Spins) => s.push_str("/spins"),
            Some(crate::config::BudgetMode::Time) => s.push_str("/time"),
            None => {}
        }
        match self.wait {
            Some(crate::config::WaitMode::Hlt) => s.push_str("/hlt"),
            Some(crate::config::WaitMode::Doorbell) => s.push_str("/doorbell"),
            Some(crate::config::WaitMode::Auto) | None => {}
        }
        if self.slots == Some(true) {
            s.push_str("/slots");
        }
        if self.vhost {
            s.push_str("/vhost");
        }
        s
    }

    /// The name `parse` accepts.
    pub fn name(&self) -> String {
        let guest = self
            .guest
            .map_or(String::new(), |g| format!("@{}", g.name()));
        format!("{}{guest}", self.name_without_guest())
    }

    fn name_without_guest(&self) -> String {
        let lock = vmm::lock_name(self.lock);
        match self.pv {
            PvMode::Off => format!("{lock}:off"),
            PvMode::Kick | PvMode::KickYield => {
                let path = match self.kick_path {
                    pvspin::KickPath::InKernel => "in-kernel",
                    pvspin::KickPath::SignalMsi => "signal-msi",
                    pvspin::KickPath::Userspace => "userspace",
                };
                let pv = if self.pv == PvMode::KickYield {
                    "kick+yield"
                } else {
                    "kick"
                };
                let pv = format!("{pv}{}", self.options_suffix());
                if self.pv == PvMode::KickYield && self.actuator != pvspin::DEFAULT_ACTUATOR {
                    format!("{lock}:{pv}:{path}:{}", self.actuator)
                } else {
                    format!("{lock}:{pv}:{path}")
                }
            }
        }
    }

    /// `base` with this variant's lock and PV settings and `hogs` hog threads.
    fn config(&self, base: &RunConfig, hogs: u32) -> RunConfig {
        RunConfig {
            lock: self.lock,
            pv: self.pv,
            kick_path: self.kick_path,
            actuator: self.actuator,
            wait: self.wait.unwrap_or(base.wait),
            budgets: self.budgets.unwrap_or(base.budgets),
            run_slots: match self.slots {
                Some(true) => Some(base.run_slots.unwrap_or(0)),
                _ => base.run_slots,
            },
            vhost_user: if self.vhost {
                base.vhost_user.clone()
            } else {
                None
            },
            guest: self.guest.unwrap_or(base.guest),
            hogs,
            ..base.clone()
        }
    }
}

/// What to compare.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// One case per hog count.
    pub hogs: Vec<u32>,
    /// Runs per case and variant.
    pub runs: u32,
    /// Variants; empty: the one the VM options describe.
    pub variants: Vec<Variant>,
    /// VMs per run, each its own process running the same case at once (1: in this process).
    pub vms: u32,
    /// In a child process of a multi-VM run: which case, and which VM of it.
    pub child: Option<(usize, u32)>,
}

/// One variant's results at one hog count.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Hog threads.
    pub hogs: u32,
    /// Which variant.
    pub variant: Variant,
    /// Guest seconds of each run; a run stopped by its bound (`--timeout-ms`) counts as the
    /// bound, and is counted in `timed_out` (its statistics are then lower bounds).
    pub seconds: Vec<f64>,
    /// Runs stopped by the bound.
    pub timed_out: u32,
    /// Multi-VM runs: per VM, its guest seconds in each run.
    pub per_vm_seconds: Vec<Vec<f64>>,
    /// Multi-VM runs: per VM, the host CPU seconds its process used in each run.
    pub per_vm_cpu: Vec<Vec<f64>>,
}

/// The median of `values` (0 for none).
fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

impl CaseResult {
    /// Mean of the runs.
    pub fn mean(&self) -> f64 {
        self.seconds.iter().sum::<f64>() / self.seconds.len().max(1) as f64
    }

    /// Sample standard deviation of the runs.
    pub fn sd(&self) -> f64 {
        if self.seconds.len() < 2 {
            return 0.0;
        }
        let mean = self.mean();
        let var = self.seconds.iter().map(|s| (s - mean).powi(2)).sum::<f64>()
            / (self.seconds.len() - 1) as f64;
        var.sqrt()
    }

    /// Median of the runs.
    pub fn median(&self) -> f64 {
        median_of(&self.seconds)
    }
}

/// The finished table.
#[derive(Clone, Debug)]
pub struct BenchTable {
    /// What ran.
    pub title: String,
    /// vCPUs per VM.
    pub vcpus: u32,
    /// VMs per run.
    pub vms: u32,
    /// Host CPUs.
    pub host_cpus: usize,
    /// Per hog count, per variant (the first variant is the baseline).
    pub cases: Vec<CaseResult>,
}

impl fmt::Display for BenchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.title)?;
        writeln!(
            f,
            "guest seconds, less is better; mean (sd), median, the median's change against the first variant, \
             and the median over the same variant's median at 0 hogs (T1x); '>' marks runs stopped by the bound"
        )?;
        let mut baseline = None;
        for case in &self.cases {
            if baseline.map(|(hogs, _)| hogs) != Some(case.hogs) {
                baseline = Some((case.hogs, case.median()));
            }
            let base = baseline.map_or(case.median(), |(_, median)| median);
            let load =
                f64::from(self.vcpus * self.vms.max(1) + case.hogs) / self.host_cpus.max(1) as f64;
            let change = if base > 0.0 {
                format!("{:+.1}%", (case.median() / base - 1.0) * 100.0)
            } else {
                "n/a".into()
            };
            let t1x = self
                .cases
                .iter()
                .find(|c| c.hogs == 0 && c.variant == case.variant)
                .map(CaseResult::median)
                .filter(|m| *m > 0.0)
                .map_or("n/a".into(), |m| format!("{:.2}", case.median() / m));
            let bound = if case.timed_out > 0 { ">" } else { "" };
            writeln!(
                f,
                "case {load:.0}x ({} hogs)  {:<34} {bound}{:>9.4} ({:.4})  median {bound}{:.4}  {change:>7}  T/T1x {t1x:>6}  runs: {}{}",
                case.hogs,
                case.variant.name(),
                case.mean(),
                case.sd(),
                case.median(),
                case.seconds
                    .iter()
                    .map(|s| format!("{s:.4}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                if case.timed_out > 0 {
                    format!(" ({} stopped by the bound)", case.timed_out)
                } else {
                    String::new()
                }
            )?;
            let total_cpu: f64 = case.per_vm_cpu.iter().map(|c| median_of(c)).sum();
            for (i, (secs, cpu)) in case.per_vm_seconds.iter().zip(&case.per_vm_cpu).enumerate() {
                let share = if total_cpu > 0.0 {
                    median_of(cpu) / total_cpu
                } else {
                    0.0
                };
                writeln!(
                    f,
                    "    VM {i}: guest seconds median {:.4}, host CPU seconds median {:.3} ({:.0}% of the VMs' CPU time)",
                    median_of(secs),
                    median_of(cpu),
                    share * 100.0
                )?;
            }
        }
        Ok(())
    }
}

/// In `--pv-backend vhost-user:PATH` of a multi-VM bench: the VM's index (each VM needs a socket
/// of its own).
pub const VM_PLACEHOLDER: &str = "{vm}";

/// One run of case `k` as `vms` VMs at once, each a child process of this one running the same
/// command line with `--child-case k --child-vm i`. The run's time is the slowest VM's.
fn run_vms(k: usize, case: &mut CaseResult, vms: u32, timeout_ms: u64) -> Result<(), RunError> {
    let exe = std::env::current_exe()
        .map_err(|e| RunError::Setup(format!("finding this executable: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for i in 0..vms {
        let child = std::process::Command::new(&exe)
            .args(&args)
            .args(["--child-case", &k.to_string(), "--child-vm", &i.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| RunError::Setup(format!("starting VM {i}: {e}")))?;
        children.push(child);
    }
    case.per_vm_seconds.resize(vms as usize, Vec::new());
    case.per_vm_cpu.resize(vms as usize, Vec::new());
    let mut slowest: f64 = 0.0;
    let mut stopped = false;
    for (i, mut child) in children.into_iter().enumerate() {
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        }
        let (status, cpu) = wait_with_rusage(child.id())?;
        let report = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        let seconds = match (status, report) {
            (0, Some(report)) => report["guest_seconds"].as_f64().unwrap_or(0.0),
            _ => {
                // A VM stopped by its bound (or failed): record the bound, as single-VM runs do.
                eprintln!(
                    "pvspin-vmm bench: {} VM {i} ended with status {status}",
                    case.variant.name()
                );
                stopped = true;
                timeout_ms as f64 / 1000.0
            }
        };
        crate::cli::print_stdout(&format!(
            "{{\"vm\":{i},\"guest_seconds\":{seconds},\"cpu_seconds\":{cpu}}}"
        ));
        case.per_vm_seconds[i].push(seconds);
        case.per_vm_cpu[i].push(cpu);
        slowest = slowest.max(seconds);
    }
    case.seconds.push(slowest);
    if stopped {
        case.timed_out += 1;
    }
    Ok(())
}

/// Waits for child `pid`; returns its exit status (or 128 + signal) and the CPU seconds it used.
fn wait_with_rusage(pid: u32) -> Result<(i32, f64), RunError> {
    let mut status = 0;
    // SAFETY: rusage is plain data, written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = libc::pid_t::try_from(pid).map_err(|_| RunError::Setup("bad pid".into()))?;
    // SAFETY: waits for our own child; both out-pointers are valid for the call.
    let ret = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if ret != pid {
        return Err(RunError::Setup(format!(
            "waiting for VM process {pid}: {}",
            std::io::Error::last_os_error()
        )));
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok((code, secs(usage.ru_utime) + secs(usage.ru_stime)))
}

/// Runs every case `runs` times, interleaved, printing each run's JSON line as it finishes.
pub fn run(vm: &VmArgs, options: &BenchOptions) -> Result<BenchTable, RunError> {
    let base = RunConfig {
        echo_console: false,
        ..vm.config(0)
    };
    let variants = if options.variants.is_empty() {
        vec![Variant {
            lock: base.lock,
            pv: base.pv,
            kick_path: base.kick_path,
            actuator: base.actuator,
            wait: None,
            budgets: None,
            slots: None,
            vhost: base.vhost_user.is_some(),
            guest: None,
        }]
    } else {
        options.variants.clone()
    };
    if let Some(variant) = variants
        .iter()
        .find(|v| v.vhost && base.vhost_user.is_none())
    {
        return Err(RunError::Refused(format!(
            "variant {} needs the backend's socket: --pv-backend vhost-user:PATH",
            variant.name()
        )));
    }
    let mut cases: Vec<CaseResult> = options
        .hogs
        .iter()
        .flat_map(|&hogs| {
            variants.iter().map(move |&variant| CaseResult {
                hogs,
                variant,
                seconds: Vec::new(),
                timed_out: 0,
                per_vm_seconds: Vec::new(),
                per_vm_cpu: Vec::new(),
            })
        })
        .collect();
    // Check every configuration before spending minutes on the first ones.
    for case in &cases {
        case.variant.config(&base, case.hogs).validate(u32::MAX)?;
    }
    // A vhost-user socket serves one VM at a time: VMs run side by side need one each.
    let vhost_variant = cases.iter().any(|c| c.variant.vhost);
    if let (true, true, Some(path)) = (options.vms > 1, vhost_variant, &base.vhost_user) {
        if !path.to_string_lossy().contains(VM_PLACEHOLDER) {
            return Err(RunError::Refused(format!(
                "--vms {} with vhost-user variants needs a socket per VM: put {VM_PLACEHOLDER} in the \
                 --pv-backend path (replaced by the VM's index), and serve each with pvspind",
                options.vms
            )));
        }
    }
    if let Some((k, vm_index)) = options.child {
        let case = cases
            .get(k)
            .ok_or(RunError::Refused(format!("no case {k}")))?;
        // The case's hogs belong to the first VM only.
        let hogs = if vm_index == 0 { case.hogs } else { 0 };
        let mut config = case.variant.config(&base, hogs);
        config.vhost_user = config.vhost_user.map(|path| {
            path.to_string_lossy()
                .replace(VM_PLACEHOLDER, &vm_index.to_string())
                .into()
        });
        let report = vmm::run(&config)?;
        crate::cli::print_stdout(&report.to_json());
        return Ok(BenchTable {
            title: String::new(),
            vcpus: vm.vcpus,
            vms: 1,
            host_cpus: 0,
            cases: Vec::new(),
        });
    }
    for _ in 0..options.runs {
        for (k, case) in cases.iter_mut().enumerate() {
            if options.vms > 1 {
                run_vms(k, case, options.vms, vm.timeout_ms)?;
                continue;
            }
            match vmm::run(&case.variant.config(&base, case.hogs)) {
                Ok(report) => {
                    crate::cli::print_stdout(&report.to_json());
                    case.seconds.push(report.guest_seconds);
                }
                // A collapse is a result, not an error: record the bound.
                Err(RunError::Timeout { limit_ms, .. }) => {
                    eprintln!(
                        "pvspin-vmm bench: {} with {} hogs stopped by its {limit_ms} ms bound",
                        case.variant.name(),
                        case.hogs
                    );
                    case.seconds.push(limit_ms as f64 / 1000.0);
                    case.timed_out += 1;
                }
                Err(err) => return Err(err),
            }
        }
    }
    Ok(BenchTable {
        title: format!(
            "{}lock workload on {} vCPUs ({} mode), {} acquisitions each, cs {} ncs {}, {} runs per case, interleaved",
            if options.vms > 1 {
                format!("{} VMs at once, separate processes, each: ", options.vms)
            } else {
                String::new()
            },
            vm.vcpus,
            if base.user_mode { "user" } else { "kernel" },
            vm.iterations,
            vm.cs_work,
            vm.ncs_work,
            options.runs
        ),
        vcpus: vm.vcpus,
        vms: options.vms.max(1),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cases,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(hogs: u32, variant: &str, seconds: &[f64]) -> CaseResult {
        CaseResult {
            hogs,
            variant: Variant::parse(variant).unwrap(),
            seconds: seconds.to_vec(),
            timed_out: 0,
            per_vm_seconds: Vec::new(),
            per_vm_cpu: Vec::new(),
        }
    }

    #[test]
    fn statistics() {
        let c = case(0, "ticket:off", &[1.0, 2.0, 3.0, 10.0]);
        assert!((c.mean() - 4.0).abs() < 1e-12);
        assert!((c.median() - 2.5).abs() < 1e-12);
        assert!((case(0, "tas", &[1.0, 2.0, 3.0]).sd() - 1.0).abs() < 1e-12);
        assert_eq!(case(0, "tas", &[5.0]).sd(), 0.0);
    }

    #[test]
    fn variants_round_trip_and_refuse_garbage() {
        for name in [
            "ticket:off",
            "queued:kick:userspace",
            "ticket:kick:signal-msi",
            "ticket:kick+yield:in-kernel",
            "queued:kick+yield:userspace",
            "backoff:off",
            "backoff:kick:in-kernel",
        ] {
            assert_eq!(Variant::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            Variant::parse("ticket:kick").unwrap().name(),
            "ticket:kick:in-kernel"
        );
        assert!(Variant::parse("mcs:off").is_err());
        assert!(Variant::parse("ticket:maybe").is_err());
        assert!(Variant::parse("ticket:kick:carrier-pigeon").is_err());
        assert!(Variant::parse("ticket:off:in-kernel:x").is_err());
    }

    #[test]
    fn variants_pick_the_guest_and_stock_rules_apply_per_variant() {
        for name in [
            "queued:kick:in-kernel@stock",
            "queued:kick:signal-msi@pvspin",
            "ticket:off@stock",
            "queued:kick/spins:in-kernel@stock",
        ] {
            assert_eq!(Variant::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            Variant::parse("queued:kick@stock").unwrap().name(),
            "queued:kick:in-kernel@stock"
        );
        assert!(Variant::parse("queued:kick@linux").is_err());
        assert!(Variant::parse("queued:kick:userspace@").is_err());
        let base = RunConfig::default();
        let stock = Variant::parse("queued:kick@stock").unwrap();
        let pvspin = Variant::parse("queued:kick@pvspin").unwrap();
        let default = Variant::parse("queued:kick").unwrap();
        assert_eq!(stock.config(&base, 0).guest, GuestKind::Stock);
        assert_eq!(pvspin.config(&base, 0).guest, GuestKind::Pvspin);
        let stock_base = RunConfig {
            guest: GuestKind::Stock,
            ..base.clone()
        };
        assert_eq!(default.config(&stock_base, 0).guest, GuestKind::Stock);
        // One table, both guests, each with its own spin threshold.
        assert_eq!(stock.config(&base, 2).guest_spin_threshold(), 1 << 15);
        assert_eq!(pvspin.config(&base, 2).guest_spin_threshold(), 128);
        assert_eq!(stock.config(&base, 2).validate(8), Ok(()));
        // A stock guest has no PV ticket lock and needs the in-kernel LAPIC.
        for refused in ["ticket:kick@stock", "queued:kick:userspace@stock"] {
            let variant = Variant::parse(refused).unwrap();
            assert!(variant.config(&base, 0).validate(8).is_err(), "{refused}");
        }
    }

    #[test]
    fn table_labels_overcommit_and_compares_with_the_first_variant() {
        let table = BenchTable {
            title: "t".into(),
            vcpus: 2,
            vms: 1,
            host_cpus: 2,
            cases: vec![
                case(0, "ticket:off", &[1.0]),
                case(0, "ticket:kick", &[0.5]),
                case(4, "ticket:off", &[3.0]),
                case(4, "ticket:kick", &[0.3]),
            ],
        };
        let text = table.to_string();
        assert!(text.contains("case 1x (0 hogs)"), "{text}");
        assert!(text.contains("case 3x (4 hogs)"), "{text}");
        assert!(text.contains("-50.0%"), "{text}");
        assert!(text.contains("-90.0%"), "{text}");
        // T/T1x: each variant against its own 0-hog median.
        assert!(text.contains("T/T1x   3.00"), "{text}");
        assert!(text.contains("T/T1x   0.60"), "{text}");
    }

    #[test]
    fn multi_vm_cases_count_every_vm_and_show_each_share() {
        let mut c = case(0, "ticket:kick", &[2.0]);
        c.per_vm_seconds = vec![vec![2.0], vec![1.5]];
        c.per_vm_cpu = vec![vec![3.0], vec![1.0]];
        let table = BenchTable {
            title: "t".into(),
            vcpus: 2,
            vms: 2,
            host_cpus: 2,
            cases: vec![c],
        };
        let text = table.to_string();
        assert!(text.contains("case 2x (0 hogs)"), "{text}");
        assert!(text.contains("VM 0: guest seconds median 2.0000"), "{text}");
        assert!(text.contains("(75% of the VMs' CPU time)"), "{text}");
        assert!(text.contains("(25% of the VMs' CPU time)"), "{text}");
    }
}
