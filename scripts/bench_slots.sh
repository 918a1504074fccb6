#!/usr/bin/env bash
# Run slots against the host scheduler alone (docs/benchmarks.md §8): 4, 6 and 8 vCPUs on
# the host's CPUs, and 2 vCPUs at 2x/3x with CPU hogs; kick (in-kernel), kick+yield
# (in-kernel, today's directed yield), kick on the userspace path (the path the slots use),
# and run slots; interleaved, RUNS runs per case. Then two 2-vCPU VMs side by side.
# Usage: scripts/bench_slots.sh [runs] [user|kernel|vms|all]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
what=${2:-all}
vmm=target/release/pvspin-vmm
cargo build --release -q -p pvspin-vmm
variants=ticket:kick:in-kernel,ticket:kick+yield:in-kernel,ticket:kick:userspace,ticket:kick/slots:userspace

if [[ $what == user || $what == all ]]; then
    for v in 4 6 8; do
        $vmm bench --cs-mode user --vcpus "$v" --iterations $((80000 / v)) --cs-work 5000 \
            --ncs-work 5000 --hogs 0 --runs "$runs" --timeout-ms 30000 --variants "$variants" \
            | grep -v '^{'
    done
    $vmm bench --cs-mode user --vcpus 2 --iterations 300000 --cs-work 5000 --ncs-work 5000 \
        --hogs 0,2,4 --runs "$runs" --timeout-ms 30000 --variants "$variants" | grep -v '^{'
fi
if [[ $what == kernel || $what == all ]]; then
    for v in 4 6 8; do
        $vmm bench --vcpus "$v" --iterations $((2400 / v)) --hogs 0 --runs "$runs" \
            --timeout-ms 60000 --variants "$variants" | grep -v '^{'
    done
    $vmm bench --vcpus 2 --iterations 1000 --hogs 0,2,4 --runs "$runs" --timeout-ms 60000 \
        --variants "$variants" | grep -v '^{'
fi
if [[ $what == vms || $what == all ]]; then
    $vmm bench --vms 2 --cs-mode user --vcpus 2 --iterations 300000 --cs-work 5000 \
        --ncs-work 5000 --hogs 0 --runs "$runs" --timeout-ms 30000 \
        --variants ticket:kick:in-kernel,ticket:kick/slots:userspace | grep -v '^{'
fi
