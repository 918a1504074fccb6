//! `minimal-vmm`: with no arguments, runs the lock and ping-pong workloads on every kick path
//! and exits 0 when all of them passed.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut failed = 0;
    for (path, workload, user_mode) in minimal_vmm::default_runs() {
        let name = minimal_vmm::run_name(path, workload, user_mode);
        match minimal_vmm::run(path, workload, user_mode) {
            Ok(summary) => println!("ok   {name}: {summary}"),
            Err(err) => {
                failed += 1;
                println!("FAIL {name}: {err}");
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
