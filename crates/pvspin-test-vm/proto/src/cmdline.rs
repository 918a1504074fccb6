//! The guest's kernel command line under PVH boot: its workload parameters, with the names of
//! `pvspin-vmm run`'s options (`vcpus=4 workload=lock lock=queued pv=kick cs-mode=user ...`).
//!
//! Parsed by the guest (no_std, no `core::fmt`: errors are static strings the guest prints
//! as they are) and written by `pvspin-vmm` for its own PVH boot, so both sides share one
//! list of names. Words are separated by spaces; each is `name=value`. Words with a `.` in
//! their name (`virtio_mmio.device=...`, which some VMMs append for a Linux kernel) are
//! ignored, and so are the Linux parameters of [`VMM_LINUX_PARAMS`] (Firecracker appends
//! `pci=off` to every command line); any other unknown name, or a bad value, is refused.

use crate::{
    BootParams, LockKind, Workload, BOOT_MAGIC, BOOT_VERSION, CPUID_QUERIES, MAX_VCPUS,
    PV_FLAG_CS_DEPTH, PV_FLAG_SPIN_BUDGETS, PV_FLAG_STOCK_GUEST, PV_FLAG_WAIT_DOORBELL,
    PV_FLAG_WAIT_HLT, PV_KICK, PV_KICK_YIELD, PV_OFF,
};

/// The spin threshold of a pvspin-aware guest unless `spin-threshold=` says otherwise.
pub const DEFAULT_SPIN_THRESHOLD: u32 = 128;
/// A stock guest's: Linux's `SPIN_THRESHOLD`.
pub const STOCK_SPIN_THRESHOLD: u32 = 1 << 15;
/// The largest `spin-threshold=` the guest's PV locks accept.
pub const MAX_SPIN_THRESHOLD: u32 = 1 << 24;
/// The longest command line the guest reads.
pub const MAX_CMDLINE_BYTES: usize = 4096;

/// Every name the command line knows, in the order `pvspin-vmm` writes them.
pub const NAMES: [&str; 15] = [
    "vcpus",
    "workload",
    "lock",
    "pv",
    "guest",
    "cs-mode",
    "wait",
    "budgets",
    "sched",
    "spin-threshold",
    "iterations",
    "cs-work",
    "ncs-work",
    "cpuid-leaves",
    "kick-path",
];

/// Names of the other words the guest takes: `tsc-khz` (the guest TSC's rate, when the VMM
/// knows it better than CPUID says).
pub const EXTRA_NAMES: [&str; 1] = ["tsc-khz"];

/// Why a command line is refused: the word (or rule) and what is wrong, both static text,
/// and where the word is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CmdlineError {
    /// The offending word's name, or `"rule"` for a combination of values.
    pub name: &'static str,
    /// What is wrong.
    pub reason: &'static str,
    /// The offending word's byte range in the command line (empty for a rule).
    pub word: core::ops::Range<usize>,
}

impl CmdlineError {
    const fn new(name: &'static str, reason: &'static str) -> Self {
        Self {
            name,
            reason,
            word: 0..0,
        }
    }

    /// The offending word, cut from the command line that was parsed.
    pub fn word_in<'a>(&self, text: &'a str) -> &'a str {
        text.get(self.word.clone()).unwrap_or("")
    }
}

/// A parsed command line: the boot parameters it describes, and what the guest reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestCmdline {
    /// The boot parameters (`tsc_khz` from `tsc-khz=`, else 0: the guest asks CPUID).
    pub params: BootParams,
    /// `vcpus=` when given (else the guest runs on every CPU the VMM lists).
    pub vcpus: Option<u32>,
    /// `kick-path=`: how the VMM wakes halted vCPUs, for the result line only.
    pub kick_path: Option<&'static str>,
}

fn pick<T: Copy>(
    name: &'static str,
    value: &str,
    table: &[(&'static str, T)],
) -> Result<T, CmdlineError> {
    table
        .iter()
        .find(|(text, _)| *text == value)
        .map(|(_, v)| *v)
        .ok_or(CmdlineError::new(name, "unknown value"))
}

fn number(name: &'static str, value: &str) -> Result<u64, CmdlineError> {
    let (digits, radix) = match value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
    {
        Some(hex) => (hex, 16),
        None => (value, 10),
    };
    u64::from_str_radix(digits, radix)
        .map_err(|_| CmdlineError::new(name, "not a number (decimal or 0x-hex)"))
}

fn number_u32(name: &'static str, value: &str) -> Result<u32, CmdlineError> {
    u32::try_from(number(name, value)?)
        .map_err(|_| CmdlineError::new(name, "does not fit in 32 bits"))
}

/// The workload names, as `--workload` spells them.
pub const WORKLOADS: [(&str, Workload); 9] = [
    ("lock", Workload::Lock),
    ("hello", Workload::Hello),
    ("spin", Workload::Spin),
    ("fault", Workload::Fault),
    ("hypercall", Workload::Hypercall),
    ("cpuid", Workload::Cpuid),
    ("pingpong", Workload::PingPong),
    ("burn", Workload::Burn),
    ("abuse", Workload::Abuse),
];

/// The lock names, as `--lock` spells them.
pub const LOCKS: [(&str, LockKind); 4] = [
    ("ticket", LockKind::Ticket),
    ("tas", LockKind::Tas),
    ("queued", LockKind::Queued),
    ("backoff", LockKind::Backoff),
];

/// The `--kick-path` names.
pub const KICK_PATHS: [&str; 3] = ["in-kernel", "signal-msi", "userspace"];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    Auto,
    Hlt,
    Doorbell,
}

/// Linux kernel parameters that VMMs add to a guest's command line on their own (Firecracker:
/// `pci=off`, and `reboot=k panic=1` in its default line; others: `console=`, `earlyprintk=`,
/// `acpi=`): ignored, so the same image boots under each of them. The guest's own names never
/// collide with them.
pub const VMM_LINUX_PARAMS: &[&str] = &["pci", "reboot", "panic", "console", "earlyprintk", "acpi"];

/// Parses `text` (the whole command line).
pub fn parse(text: &str) -> Result<GuestCmdline, CmdlineError> {
    let mut workload = Workload::Lock;
    let mut lock = None;
    let mut pv = PV_OFF;
    let mut stock = false;
    let mut user_mode = false;
    let mut wait = Wait::Auto;
    let mut spin_budgets = false;
    let mut slots = false;
    let mut spin_threshold = None;
    let mut iterations = 2000;
    let mut cs_work = 40;
    let mut ncs_work = 40;
    let mut cpuid_leaves = [0x4000_0000, 0x4000_0001, 0, 0];
    let mut kick_path = None;
    let mut vcpus = None;
    let mut tsc_khz = 0;
    let mut seen = [false; NAMES.len() + EXTRA_NAMES.len()];
    for word in text.split([' ', '\t', '\n', '\0']) {
        if word.is_empty() {
            continue;
        }
        let offset = word.as_ptr() as usize - text.as_ptr() as usize;
        let located = |mut err: CmdlineError| {
            err.word = offset..offset + word.len();
            err
        };
        let Some((name, value)) = word.split_once('=') else {
            return Err(located(CmdlineError::new(
                "word",
                "every word must be name=value",
            )));
        };
        if name.contains('.') || VMM_LINUX_PARAMS.contains(&name) {
            continue;
        }
        let Some(position) = NAMES
            .iter()
            .chain(EXTRA_NAMES.iter())
            .position(|known| *known == name)
        else {
            return Err(located(CmdlineError::new(
                "word",
                "unknown name (see docs/guest-programs.md for the names)",
            )));
        };
        // The static spelling of the name, for the error.
        let name = NAMES
            .iter()
            .chain(EXTRA_NAMES.iter())
            .nth(position)
            .copied()
            .unwrap_or("word");
        match seen.get_mut(position) {
            Some(true) => return Err(located(CmdlineError::new(name, "given twice"))),
            Some(slot) => *slot = true,
            None => {}
        }
        match name {
            "vcpus" => {
                let n = number_u32(name, value).map_err(located)?;
                if n == 0 || n > MAX_VCPUS {
                    return Err(located(CmdlineError::new(name, "must be 1 to 255")));
                }
                vcpus = Some(n);
            }
            "workload" => workload = pick(name, value, &WORKLOADS).map_err(located)?,
            "lock" => lock = Some(pick(name, value, &LOCKS).map_err(located)?),
            "pv" => {
                pv = pick(
                    name,
                    value,
                    &[
                        ("off", PV_OFF),
                        ("kick", PV_KICK),
                        ("kick+yield", PV_KICK_YIELD),
                    ],
                )
                .map_err(located)?;
            }
            "guest" => {
                stock =
                    pick(name, value, &[("pvspin", false), ("stock", true)]).map_err(located)?;
            }
            "cs-mode" => {
                user_mode =
                    pick(name, value, &[("kernel", false), ("user", true)]).map_err(located)?;
            }
            "wait" => {
                wait = pick(
                    name,
                    value,
                    &[
                        ("auto", Wait::Auto),
                        ("hlt", Wait::Hlt),
                        ("doorbell", Wait::Doorbell),
                    ],
                )
                .map_err(located)?;
            }
            "budgets" => {
                spin_budgets =
                    pick(name, value, &[("time", false), ("spins", true)]).map_err(located)?;
            }
            "sched" => {
                slots =
                    pick(name, value, &[("default", false), ("slots", true)]).map_err(located)?;
            }
            "spin-threshold" => {
                let n = number_u32(name, value).map_err(located)?;
                if n == 0 || n > MAX_SPIN_THRESHOLD {
                    return Err(located(CmdlineError::new(name, "must be 1 to 16777216")));
                }
                spin_threshold = Some(n);
            }
            "iterations" => iterations = number(name, value).map_err(located)?,
            "cs-work" => cs_work = number(name, value).map_err(located)?,
            "ncs-work" => ncs_work = number(name, value).map_err(located)?,
            "cpuid-leaves" => {
                cpuid_leaves = [0; CPUID_QUERIES];
                for (count, leaf) in value.split(',').enumerate() {
                    let slot = cpuid_leaves
                        .get_mut(count)
                        .ok_or(CmdlineError::new(name, "at most 4 leaves"))
                        .map_err(located)?;
                    *slot = number_u32(name, leaf).map_err(located)?;
                }
            }
            "kick-path" => {
                kick_path = Some(
                    KICK_PATHS
                        .iter()
                        .find(|p| **p == value)
                        .copied()
                        .ok_or(CmdlineError::new(name, "unknown value"))
                        .map_err(located)?,
                );
            }
            "tsc-khz" => tsc_khz = number(name, value).map_err(located)?,
            _ => {}
        }
    }
    let lock = lock.unwrap_or(if stock {
        LockKind::Queued
    } else {
        LockKind::Ticket
    });
    let params = BootParams {
        magic: BOOT_MAGIC,
        version: BOOT_VERSION,
        workload: workload as u32,
        lock: lock as u32,
        vcpus: vcpus.unwrap_or(0),
        iterations,
        cs_work,
        ncs_work,
        tsc_khz,
        cpuid_leaves,
        pv,
        spin_threshold: spin_threshold.unwrap_or(if stock {
            STOCK_SPIN_THRESHOLD
        } else {
            DEFAULT_SPIN_THRESHOLD
        }),
        user_mode: u32::from(user_mode),
        pv_flags: if stock {
            PV_FLAG_STOCK_GUEST
        } else {
            let mut flags = 0;
            match wait {
                Wait::Auto => {}
                Wait::Hlt => flags |= PV_FLAG_WAIT_HLT,
                Wait::Doorbell => flags |= PV_FLAG_WAIT_DOORBELL,
            }
            if spin_budgets {
                flags |= PV_FLAG_SPIN_BUDGETS;
            }
            if slots {
                flags |= PV_FLAG_CS_DEPTH;
            }
            flags
        },
        virtio_mmio_base: 0,
        result: Default::default(),
    };
    check_rules(&params, vcpus, wait, stock, slots)?;
    Ok(GuestCmdline {
        params,
        vcpus,
        kick_path,
    })
}

/// The rules of `pvspin-vmm`'s run configuration that concern the guest (the host's own,
/// such as hogs or seccomp, are the VMM's business).
fn check_rules(
    params: &BootParams,
    vcpus: Option<u32>,
    wait: Wait,
    stock: bool,
    slots: bool,
) -> Result<(), CmdlineError> {
    let rule = |reason| Err(CmdlineError::new("rule", reason));
    let kicks = matches!(params.pv, PV_KICK | PV_KICK_YIELD);
    let workload = Workload::from_u32(params.workload);
    let lock = LockKind::from_u32(params.lock);
    let at_least_two = vcpus.is_none_or(|n| n >= 2);
    if workload == Some(Workload::Lock) && params.iterations == 0 {
        return rule("workload=lock needs iterations=1 or more");
    }
    if kicks && lock == Some(LockKind::Tas) {
        return rule("pv=kick needs lock=ticket, queued or backoff (tas has no PV variant)");
    }
    if workload == Some(Workload::PingPong)
        && (params.pv != PV_KICK || !at_least_two || params.iterations == 0)
    {
        return rule("workload=pingpong needs pv=kick and at least 2 vCPUs");
    }
    if workload == Some(Workload::Abuse) && (params.pv != PV_KICK_YIELD || !at_least_two) {
        return rule("workload=abuse needs pv=kick+yield and at least 2 vCPUs");
    }
    if slots && !kicks {
        return rule("sched=slots needs pv=kick or kick+yield");
    }
    if params.user_mode != 0
        && (!matches!(
            workload,
            Some(Workload::Lock | Workload::PingPong | Workload::Burn | Workload::Abuse)
        ) || wait == Wait::Hlt)
    {
        return rule("cs-mode=user needs workload=lock, pingpong, burn or abuse, and not wait=hlt");
    }
    if stock {
        if params.pv == PV_KICK_YIELD {
            return rule("guest=stock cannot take pv=kick+yield (use pv=kick)");
        }
        if wait == Wait::Doorbell {
            return rule("guest=stock cannot take wait=doorbell");
        }
        if matches!(workload, Some(Workload::PingPong | Workload::Abuse)) {
            return rule("guest=stock cannot run workload=pingpong or abuse");
        }
        if kicks && lock != Some(LockKind::Queued) {
            return rule("guest=stock with pv=kick needs lock=queued (Linux's pv qspinlock)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> CmdlineError {
        parse(text).expect_err(text)
    }

    #[test]
    fn an_empty_line_is_pvspin_vmm_runs_defaults() {
        let parsed = parse("").unwrap();
        let p = parsed.params;
        assert_eq!(p.workload, Workload::Lock as u32);
        assert_eq!(p.lock, LockKind::Ticket as u32);
        assert_eq!((p.iterations, p.cs_work, p.ncs_work), (2000, 40, 40));
        assert_eq!((p.pv, p.pv_flags, p.user_mode), (PV_OFF, 0, 0));
        assert_eq!(p.spin_threshold, DEFAULT_SPIN_THRESHOLD);
        assert_eq!(p.cpuid_leaves, [0x4000_0000, 0x4000_0001, 0, 0]);
        assert_eq!((parsed.vcpus, parsed.kick_path), (None, None));
        assert_eq!((p.magic, p.version), (BOOT_MAGIC, BOOT_VERSION));
    }

    #[test]
    fn every_name_is_read() {
        let parsed = parse(
            "vcpus=4 workload=lock lock=queued pv=kick+yield guest=pvspin cs-mode=user \
             wait=doorbell budgets=spins sched=slots spin-threshold=64 iterations=0x10 \
             cs-work=7 ncs-work=9 cpuid-leaves=1,0x40000000 kick-path=signal-msi tsc-khz=2000000",
        )
        .unwrap();
        let p = parsed.params;
        assert_eq!(parsed.vcpus, Some(4));
        assert_eq!(parsed.kick_path, Some("signal-msi"));
        assert_eq!(p.lock, LockKind::Queued as u32);
        assert_eq!(p.pv, PV_KICK_YIELD);
        assert_eq!(p.user_mode, 1);
        assert_eq!(
            p.pv_flags,
            PV_FLAG_WAIT_DOORBELL | PV_FLAG_SPIN_BUDGETS | PV_FLAG_CS_DEPTH
        );
        assert_eq!(
            (p.spin_threshold, p.iterations, p.cs_work, p.ncs_work),
            (64, 16, 7, 9)
        );
        assert_eq!(p.cpuid_leaves, [1, 0x4000_0000, 0, 0]);
        assert_eq!((p.vcpus, p.tsc_khz), (4, 2_000_000));
    }

    #[test]
    fn a_stock_guest_defaults_to_the_pv_qspinlock_and_linuxs_threshold() {
        let p = parse("guest=stock pv=kick").unwrap().params;
        assert_eq!(p.lock, LockKind::Queued as u32);
        assert_eq!(p.spin_threshold, STOCK_SPIN_THRESHOLD);
        assert_eq!(p.pv_flags, PV_FLAG_STOCK_GUEST);
    }

    #[test]
    fn a_refusal_names_the_word() {
        let text = "vcpus=2  lock=rwlock iterations=5";
        let err = refused(text);
        assert_eq!(err.word_in(text), "lock=rwlock");
        assert_eq!(refused("hogs=2").word_in("hogs=2"), "hogs=2");
        // A rule names no single word.
        assert_eq!(refused("pv=kick lock=tas").word_in("pv=kick lock=tas"), "");
    }

    #[test]
    fn linux_module_parameters_are_ignored() {
        assert!(parse("virtio_mmio.device=4K@0xd0000000:5 vcpus=2").is_ok());
        // What Firecracker appends, and its default line's parameters.
        assert_eq!(
            parse("vcpus=2 iterations=7 pci=off reboot=k panic=1")
                .unwrap()
                .params
                .iterations,
            7
        );
        assert_eq!(refused("vcpus=2 pcie=off").name, "word");
    }

    #[test]
    fn bad_values_are_refused_with_the_name() {
        for (text, name) in [
            ("vcpus=0", "vcpus"),
            ("vcpus=256", "vcpus"),
            ("vcpus=two", "vcpus"),
            ("workload=sleep", "workload"),
            ("lock=rwlock", "lock"),
            ("pv=yes", "pv"),
            ("guest=windows", "guest"),
            ("cs-mode=ring1", "cs-mode"),
            ("wait=mwait", "wait"),
            ("budgets=lots", "budgets"),
            ("sched=fifo", "sched"),
            ("spin-threshold=0", "spin-threshold"),
            ("spin-threshold=16777217", "spin-threshold"),
            ("iterations=-1", "iterations"),
            ("iterations=", "iterations"),
            ("cs-work=1e3", "cs-work"),
            ("ncs-work=0xg", "ncs-work"),
            ("cpuid-leaves=1,2,3,4,5", "cpuid-leaves"),
            ("cpuid-leaves=0x100000000", "cpuid-leaves"),
            ("kick-path=carrier-pigeon", "kick-path"),
            ("tsc-khz=fast", "tsc-khz"),
            ("hogs=2", "word"),
            ("quiet", "word"),
            ("vcpus=2 vcpus=3", "vcpus"),
        ] {
            assert_eq!(refused(text).name, name, "{text}");
        }
    }

    #[test]
    fn combinations_pvspin_vmm_refuses_are_refused() {
        for text in [
            "iterations=0",
            "pv=kick lock=tas",
            "workload=pingpong",
            "workload=pingpong pv=kick vcpus=1",
            "workload=abuse pv=kick",
            "sched=slots",
            "cs-mode=user workload=hello",
            "cs-mode=user wait=hlt",
            "guest=stock pv=kick+yield",
            "guest=stock wait=doorbell",
            "guest=stock pv=kick lock=ticket",
            "guest=stock workload=pingpong pv=kick",
        ] {
            assert_eq!(refused(text).name, "rule", "{text}");
        }
        // The same values apart are fine.
        for text in [
            "workload=pingpong pv=kick",
            "workload=abuse pv=kick+yield vcpus=2",
            "sched=slots pv=kick",
            "cs-mode=user workload=burn",
            "guest=stock lock=ticket",
        ] {
            assert!(parse(text).is_ok(), "{text}");
        }
    }
}
