#!/usr/bin/env python3
"""Confinement of directed yield's boosts (issue 9): a co-tenant's throughput beside an
abusive guest against its throughput beside a guest that only computes.

Each case runs one 2-vCPU VM (guest user mode, so at native speed) and, 0.3 s after it
starts, a co-tenant process of busy threads for a fixed time (`pvspin-vmm cotenant`); the VM
is bounded by --timeout-ms so it outlives the co-tenant. Cases are interleaved run by run.
Reported: the co-tenant's work per second (median, and its ratio to the spin-only guest in
the same cgroup setup), and the VM's CPU time over its wall time (rusage of the process).

Usage: scripts/bench_confinement.py [runs] [path to pvspin-vmm]
"""
import json
import os
import statistics
import subprocess
import sys
import time

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
VMM = sys.argv[2] if len(sys.argv) > 2 else "target/release/pvspin-vmm"
COTENANT_MS = 2000
VM_MS = 2800

COMMON = ["run", "--vcpus", "2", "--cs-mode", "user", "--iterations", "100000000",
          "--cs-work", "5000", "--ncs-work", "0", "--quiet", "--timeout-ms", str(VM_MS),
          "--watchdog-ms", str(VM_MS + 1000)]
CASES = [
    ("spin-only guest", ["--workload", "burn"], "spin-only guest"),
    ("abusive guest, boosts confined (default)", ["--workload", "abuse", "--pv", "kick+yield"],
     "spin-only guest"),
    ("abusive guest, boosts unconfined", ["--workload", "abuse", "--pv", "kick+yield",
                                          "--boosts", "unconfined"], "spin-only guest"),
    ("spin-only guest, --vm-cgroup", ["--workload", "burn", "--vm-cgroup", "--seccomp", "off"],
     "spin-only guest, --vm-cgroup"),
    ("abusive guest, --vm-cgroup (nice boosts inside it)",
     ["--workload", "abuse", "--pv", "kick+yield", "--vm-cgroup", "--seccomp", "off"],
     "spin-only guest, --vm-cgroup"),
    # Co-tenant threads pinned one per CPU, as co-tenants pinned to cores are: the arm without
    # directed yield is the spin-only guest in its own cgroup.
    ("pinned co-tenant: spin-only guest, --vm-cgroup (no directed yield)",
     ["--workload", "burn", "--vm-cgroup", "--seccomp", "off"],
     "pinned co-tenant: spin-only guest, --vm-cgroup (no directed yield)"),
    ("pinned co-tenant: abusive guest, --vm-cgroup, boosts confined",
     ["--workload", "abuse", "--pv", "kick+yield", "--vm-cgroup", "--seccomp", "off"],
     "pinned co-tenant: spin-only guest, --vm-cgroup (no directed yield)"),
    ("pinned co-tenant: abusive guest, --vm-cgroup, yield only",
     ["--workload", "abuse", "--pv", "kick+yield", "--actuator", "yield", "--vm-cgroup",
      "--seccomp", "off"],
     "pinned co-tenant: spin-only guest, --vm-cgroup (no directed yield)"),
]


def one(name, args):
    vm = subprocess.Popen([VMM] + COMMON + args, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    pin = ["--pin"] if name.startswith("pinned") else []
    cotenant = subprocess.run([VMM, "cotenant", "--threads", "2", "--ms", str(COTENANT_MS)]
                              + pin, capture_output=True, text=True, check=True)
    units = json.loads(cotenant.stdout.strip().splitlines()[-1])["units_per_sec"]
    start = time.monotonic()
    _, status, usage = os.wait4(vm.pid, 0)
    vm.returncode = os.waitstatus_to_exitcode(status)
    vm.communicate()
    cpu = usage.ru_utime + usage.ru_stime
    return units, cpu / (VM_MS / 1000.0)


def main():
    results = {name: ([], []) for name, _, _ in CASES}
    for run in range(RUNS):
        for name, args, _ in CASES:
            units, vm_cpus = one(name, args)
            results[name][0].append(units)
            results[name][1].append(vm_cpus)
            print(f"run {run + 1} {name}: co-tenant {units / 1e9:.3f} G units/s, "
                  f"VM {vm_cpus:.2f} CPUs", file=sys.stderr)
    print(f"| case | co-tenant, G units/s (median of {RUNS}) | against the spin-only guest "
          f"of the same run (median of the {RUNS} ratios, min-max) | VM's CPUs (median) |")
    print("|---|---|---|---|")
    for name, _, base in CASES:
        units = statistics.median(results[name][0])
        ratios = [a / b for a, b in zip(results[name][0], results[base][0])]
        cpus = statistics.median(results[name][1])
        print(f"| {name} | {units / 1e9:.3f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {cpus:.2f} |")


if __name__ == "__main__":
    main()
