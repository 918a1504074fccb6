//! `pvspind`: serves the pvspin virtio device over vhost-user. See `docs/pvspind.md`; the
//! command line is `pvspin_vhost::cli`.

fn main() -> std::process::ExitCode {
    pvspin_vhost::cli::main_process(std::env::args_os())
}
