//! `pvspin-vmm`: see `pvspin-vmm --help`.

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    #[allow(clippy::exit)] // the process's result is its exit code; nothing is left to drop
    std::process::exit(pvspin_vmm::cli::main_process(std::env::args_os()));
}
