#!/usr/bin/env bash
# Run slots for stock guests (issue 17; docs/benchmarks.md, "Run slots for guests that halt
# inside KVM"): the example guest in --guest stock mode (Linux's pv qspinlock: halts in KVM,
# kicks that stay in KVM) with and without run slots on the in-kernel and signal-msi paths,
# beside the pvspin-aware guest with slots, interleaved, RUNS runs per case, native speed
# (guest user mode), cs/ncs 15000, 80,000 acquisitions per case whatever the vCPU count.
# Every table's runs go to OUT/<table>.jsonl (`pvspin-vmm report` prints the table again) and
# its plot to OUT/<table>.svg.
# Usage: scripts/bench_stock_slots.sh [runs] [vcpus|quota|hogs|kernel|all] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
what=${2:-all}
out=${3:-target/bench-stock-slots}
mkdir -p "$out"
vmm=target/release/pvspin-vmm
save() { echo "--json-out $out/$1.jsonl --plot $out/$1.svg"; }
cargo build --release -q -p pvspin-vmm
work="--cs-mode user --cs-work 15000 --ncs-work 15000 --timeout-ms 60000"
stock=queued:kick:in-kernel@stock,queued:kick/slots:in-kernel@stock,queued:kick/slots:signal-msi@stock
aware=queued:kick/slots:userspace@pvspin,ticket:kick:in-kernel@pvspin,ticket:kick/slots:in-kernel@pvspin

if [[ $what == vcpus || $what == all ]]; then
    for v in 4 6 8 16; do
        $vmm bench $work --vcpus "$v" --iterations $((80000 / v)) --hogs 0 --runs "$runs" \
            --variants "$stock,$aware" $(save "vcpus-$v")
    done
fi
if [[ $what == quota || $what == all ]]; then
    # The VM under a 1-CPU CFS quota in its own cpu cgroup: the slots size S from it (1).
    for v in 4 8; do
        $vmm bench $work --cpu-limit 1 --vcpus "$v" --iterations $((80000 / v)) --hogs 0 \
            --runs "$runs" --variants "$stock,$aware" $(save "quota1-vcpus-$v")
    done
fi
if [[ $what == hogs || $what == all ]]; then
    # 2 vCPUs at 1x, 2x and 3x (0, 2, 4 CPU hogs on the 2 CPUs).
    $vmm bench $work --vcpus 2 --iterations 40000 --hogs 0,2,4 --runs "$runs" \
        --variants "$stock" $(save hogs)
fi
if [[ $what == kernel || $what == all ]]; then
    # Kernel mode (emulated here, about 0.5 us per instruction), for the record.
    for v in 4 8; do
        $vmm bench --vcpus "$v" --iterations $((2400 / v)) --hogs 0 --runs "$runs" \
            --timeout-ms 120000 --variants "$stock" $(save "kernel-vcpus-$v")
    done
fi
if [[ $what == vcpus || $what == all ]]; then
    # Time per acquisition against vCPUs, from the saved runs.
    $vmm report "$out"/vcpus-*.jsonl --plot "$out/vcpus.svg" > /dev/null
fi
