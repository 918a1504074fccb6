//! `pvspind`'s command line and process entry point ([`main_process`]), in the library so that
//! tests can run the daemon as a child process of their own binary (always the code under
//! test, never a stale build of the binary).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::config::{BackendConfig, BudgetsUs, YieldMode, DEFAULT_THREAD_PATTERNS};
use crate::server::{Server, ServerConfig};
use clap::{Parser, ValueEnum};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

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
    /// Spin before a spin notification, microseconds: at start and after a useful
    /// notification (adapted per vCPU, published in hint pages; guests never notify with
    /// --yield off).
    #[arg(long, default_value_t = BudgetsUs::default().spin_window)]
    spin_window_us: u64,
    /// Ceiling of the spin window, microseconds (useless notifications double it).
    #[arg(long, default_value_t = BudgetsUs::default().spin_window_max)]
    spin_window_max_us: u64,
    /// Initial wait-after budget, microseconds (adapted per vCPU from the guests' wait
    /// reports).
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
    #[arg(long, default_value_t = crate::config::DEFAULT_MAX_EVENTS_PER_SEC)]
    max_events_per_sec: u32,
    /// How often the VMM's vCPU threads are sampled in /proc and the guests' wait reports
    /// taken, microseconds (20 times less often while a VM sends no notification, and always
    /// without --flag-not-running); 0: never.
    #[arg(long, default_value_t = crate::config::DEFAULT_SCHED_SAMPLE.as_micros() as u64)]
    sched_sample_us: u64,
    /// Set NOT_RUNNING in the hint pages of sampled vCPUs that are descheduled, so that
    /// guests wait early behind them (never where the vCPUs fit --vm-cpus). Measured to cost
    /// more than it saves on the development hosts (docs/benchmarks.md §11.4-11.5).
    #[arg(long)]
    flag_not_running: bool,
    /// The CPUs each VM gets (its affinity and CPU quota): with it, guests whose --max-vcpus
    /// fit them are told so (VCPUS_FIT), and stop waiting early behind a just-kicked lock
    /// owner. Default: not said.
    #[arg(long, value_name = "N")]
    vm_cpus: Option<u32>,
    /// Priority of each VM's queue worker thread, which forwards kicks: inherit, nice:N or
    /// fifo:P (without the privilege the thread keeps its priority; logged).
    #[arg(long, default_value = "inherit")]
    worker_priority: crate::config::WorkerPriority,
    /// vCPU thread-name pattern, `{N}` = vCPU index (repeatable; default: "vcpu{N}" and
    /// "CPU {N}/KVM").
    #[arg(long = "vcpu-thread-pattern")]
    thread_patterns: Vec<String>,
}

/// Installs handlers for SIGTERM and SIGINT (signal-hook's self-pipe iterator). A handler
/// (not a blocked signal and `sigwait`) works whichever thread the kernel delivers the signal
/// to, also in processes whose other threads this code did not start.
fn install_shutdown_handlers() -> std::io::Result<Signals> {
    Signals::new([SIGTERM, SIGINT])
}

/// Waits (sleeping, never spinning) for a shutdown signal; its number.
fn wait_for_signal(signals: &mut Signals) -> i32 {
    loop {
        if let Some(sig) = signals.forever().next() {
            return sig;
        }
    }
}

/// The default log filter: `info`, but nothing from virtio-queue, which logs an error at every
/// pop from a ring whose available index a guest corrupted (a guest could flood the log at
/// the notification rate); the backend counts and rate-limits those itself.
const DEFAULT_LOG_FILTER: &str = "info,virtio_queue=off";

/// Runs the daemon with the command line `args` (the program name first) until SIGTERM or
/// SIGINT (it installs handlers for them).
pub fn main_process<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let _ = env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or(DEFAULT_LOG_FILTER),
    )
    .try_init();
    let args = match Args::try_parse_from(args) {
        Ok(args) => args,
        Err(err) => {
            let _ = err.print();
            return if err.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let backend = BackendConfig {
        max_vcpus: args.max_vcpus,
        budgets: BudgetsUs {
            spin_window: args.spin_window_us,
            spin_window_max: args.spin_window_max_us,
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
        worker_priority: args.worker_priority,
        sched_sample: (args.sched_sample_us > 0)
            .then(|| Duration::from_micros(args.sched_sample_us)),
        flag_not_running: args.flag_not_running,
        vm_cpus: args.vm_cpus,
        ..BackendConfig::default()
    };
    let mut shutdown = match install_shutdown_handlers() {
        Ok(pipe) => pipe,
        Err(e) => {
            eprintln!("pvspind: installing the SIGTERM and SIGINT handlers: {e}");
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
    let sig = wait_for_signal(&mut shutdown);
    log::info!("signal {sig}: shutting down");
    server.shutdown();
    log::info!("stopped");
    ExitCode::SUCCESS
}
