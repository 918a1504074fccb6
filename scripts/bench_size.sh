#!/usr/bin/env bash
# Benchmarks at size (issue 19, part 6): run slots against kick at 4 (the baseline), 32, 64,
# 128 and 255 vCPUs on this host's CPUs, guest user mode (native speed), ticket lock, cs/ncs
# 5000 (about 1.6 us each), the same number of acquisitions in all at every size, every
# thread confined (--seccomp enforce); RUNS interleaved runs per table, then 4 vCPUs again
# to see whether the machine drifted. The watchdog allows 60 s without progress: with 64 or
# more vCPUs on two busy cores, a vCPU of the spinning variant can wait past the default 10 s
# for its turn at the guest's start barrier (a run was stopped so). Every table's runs go to OUT/vcpus-N.jsonl, and the time
# per acquisition against vCPUs to OUT/vcpus.svg.
# Usage: scripts/bench_size.sh [runs] [OUT] [total acquisitions]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
out=${2:-target/bench-size}
total=${3:-25600}
mkdir -p "$out"
vmm=target/release/pvspin-vmm
cargo build --release -q -p pvspin-vmm
variants=ticket:kick:in-kernel,ticket:kick/slots:userspace,queued:kick/slots:userspace
for v in 4 32 64 128 255 4; do
    name=vcpus-$v
    [[ -e $out/$name.jsonl ]] && name=$name-again
    $vmm bench --seccomp enforce --cs-mode user --vcpus "$v" --iterations $((total / v)) \
        --cs-work 5000 --ncs-work 5000 --hogs 0 --runs "$runs" --timeout-ms 120000 --watchdog-ms 60000 \
        --variants "$variants" --json-out "$out/$name.jsonl" --plot "$out/$name.svg"
done
$vmm report "$out"/vcpus-{4,32,64,128,255}.jsonl --plot "$out/vcpus.svg"
