//! `pvspind`: serves the pvspin virtio device over vhost-user. See `docs/pvspind.md`.
#![deny(missing_docs)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use pvspin_vhost::config::{BackendConfig, BudgetsUs, YieldMode, DEFAULT_THREAD_PATTERNS};
use pvspin_vhost::server::{Server, ServerConfig};

/// The --yield values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum YieldArg {
    /// Count spin notifications, change no thread.
    Off,
    /// Deboost the spinning vCPU's thread for a bounded time.
    Deboost,
    /// Also boost the waited-for vCPU's thread when the VMM is alone in its own cpu cgroup.
    Confined,
}

/// pvspin's vhost-user device backend: kicks, spin notifications and hint pages for VMMs
/// that attach vhost-user devices.
#[derive(Debug, Parser)]
#[command(name = "pvspind", version)]
struct Args {
    /// A vhost-user socket to serve (repeatable); each serves one frontend at a time.
    #[arg(long = "socket", required = true)]
    sockets: Vec<PathBuf>,
    /// vCPUs the device has queues for.
    #[arg(long, default_value_t = 16)]
    max_vcpus: u32,
    /// A unix socket answering "json\n" or "prometheus\n" with the telemetry document.
    #[arg(long)]
    control: Option<PathBuf>,
    /// Spin window published in hint pages, microseconds.
    #[arg(long, default_value_t = BudgetsUs::default().spin_window)]
    spin_window_us: u64,
    /// Initial wait-after budget, microseconds.
    #[arg(long, default_value_t = BudgetsUs::default().wait_after)]
    wait_after_us: u64,
    /// Floor of the wait-after budget, microseconds.
    #[arg(long, default_value_t = BudgetsUs::default().wait_after_min)]
    wait_after_min_us: u64,
    /// Ceiling of the wait-after budget, microseconds.
    #[arg(long, default_value_t = BudgetsUs::default().wait_after_max)]
    wait_after_max_us: u64,
    /// What a spin notification may do to the VMM's vCPU threads.
    #[arg(long = "yield", value_enum, default_value = "deboost")]
    yield_mode: YieldArg,
    /// How long a deboost or boost lasts, microseconds.
    #[arg(long, default_value_t = 1000)]
    adjust_us: u64,
    /// The most queue notifications per second handled for one VM; past it the VM's worker
    /// thread sleeps to the end of the millisecond (kicks wait in their eventfds, coalesced,
    /// not lost): bounds what a guest can make the daemon spend.
    #[arg(long, default_value_t = pvspin_vhost::config::DEFAULT_MAX_EVENTS_PER_SEC)]
    max_events_per_sec: u32,
    /// vCPU thread-name pattern, `{N}` = vCPU index (repeatable; default: "vcpu{N}" and
    /// "CPU {N}/KVM").
    #[arg(long = "vcpu-thread-pattern")]
    thread_patterns: Vec<String>,
}

fn block_shutdown_signals() -> Result<libc::sigset_t, String> {
    use vmm_sys_util::signal::{block_signal, create_sigset};
    for sig in [libc::SIGTERM, libc::SIGINT] {
        block_signal(sig).map_err(|e| format!("blocking signal {sig}: {e}"))?;
    }
    create_sigset(&[libc::SIGTERM, libc::SIGINT]).map_err(|e| format!("sigset: {e}"))
}

fn wait_for_signal(set: &libc::sigset_t) -> libc::c_int {
    let mut sig: libc::c_int = 0;
    loop {
        // SAFETY: `set` is an initialised sigset and `sig` a valid int to store into.
        let rc = unsafe { libc::sigwait(set, &mut sig) };
        if rc == 0 {
            return sig;
        }
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let backend = BackendConfig {
        max_vcpus: args.max_vcpus,
        budgets: BudgetsUs {
            spin_window: args.spin_window_us,
            wait_after: args.wait_after_us,
            wait_after_min: args.wait_after_min_us,
            wait_after_max: args.wait_after_max_us,
        },
        yield_mode: match args.yield_mode {
            YieldArg::Off => YieldMode::Off,
            YieldArg::Deboost => YieldMode::Deboost,
            YieldArg::Confined => YieldMode::Confined,
        },
        thread_patterns: if args.thread_patterns.is_empty() {
            DEFAULT_THREAD_PATTERNS
                .iter()
                .map(|p| p.to_string())
                .collect()
        } else {
            args.thread_patterns
        },
        adjust_for: Duration::from_micros(args.adjust_us),
        max_events_per_sec: args.max_events_per_sec,
        ..BackendConfig::default()
    };
    // Block the shutdown signals before any thread starts, so that every thread inherits the
    // mask and only sigwait below sees them.
    let signals = match block_shutdown_signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("pvspind: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = match Server::start(&ServerConfig {
        sockets: args.sockets,
        control: args.control,
        backend,
    }) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("pvspind: {e}");
            return ExitCode::FAILURE;
        }
    };
    let sig = wait_for_signal(&signals);
    log::info!("signal {sig}: shutting down");
    server.shutdown();
    log::info!("stopped");
    ExitCode::SUCCESS
}
