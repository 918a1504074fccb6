#!/usr/bin/env bash
# The native-speed tables of docs/benchmarks.md §7: the lock workload in guest user mode (which
# runs natively on the development hosts) at 1x/2x/3x with 2 vCPUs, and with 4, 6 and 8 vCPUs
# on the host's CPUs; the kernel-mode table for regressions; user-mode ping-pong latency per
# kick path. Every table interleaves its variants run by run. Output in $OUT (default
# bench-out/), per table: NAME.txt (the table), NAME.jsonl (every run's record, for
# `pvspin-vmm report`), NAME.svg (its plot), NAME.log (stderr).
#
# Usage: scripts/bench_native.sh [runs]       (default 5; about 35 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
cargo build --release -p pvspin-vmm >/dev/null
VMM=target/release/pvspin-vmm
LOCKS=ticket:off,tas:off,backoff:off,backoff:kick,ticket:kick,ticket:kick+yield,queued:kick,queued:kick+yield

table() {
    local name=$1
    shift
    echo "== $name: $VMM bench $*"
    "$VMM" bench "$@" --json-out "$OUT/$name.jsonl" --plot "$OUT/$name.svg" \
        >"$OUT/$name.txt" 2>"$OUT/$name.log" || true
    cat "$OUT/$name.txt"
}

# 2 vCPUs at 1x/2x/3x: critical sections of about 1.6 us, 1x runs of about 1 s.
table user-2vcpu --cs-mode user --vcpus 2 --iterations 300000 --cs-work 5000 --ncs-work 5000 \
    --hogs 0,2,4 --runs "$RUNS" --timeout-ms 60000 --variants "$LOCKS,queued:off"
# vCPUs beyond the host's CPUs, no hogs: the VM overcommits itself.
for v in 4 6 8; do
    table "user-${v}vcpu" --cs-mode user --vcpus "$v" --iterations 25000 --cs-work 5000 \
        --ncs-work 5000 --hogs 0 --runs "$RUNS" --timeout-ms 20000 --variants "$LOCKS"
done
# Kernel mode (emulated here): the table of §1, for regressions.
table kernel-2vcpu --vcpus 2 --iterations 1000 --hogs 0,2,4 --runs "$RUNS" --timeout-ms 120000 \
    --variants ticket:off,ticket:kick/spins,ticket:kick,ticket:kick+yield/spins,ticket:kick+yield,queued:kick/spins,queued:kick,queued:kick+yield,backoff:off,backoff:kick
# Against the previous main's build, if one is given (OLD=path/to/pvspin-vmm): kernel mode.
if [ -n "${OLD:-}" ]; then
    for h in 0 2; do
        for pv in kick kick+yield; do
            python3 scripts/bench_ab.py --a "$OLD" --b "$VMM" --runs "$RUNS" -- --pv "$pv" \
                --iterations 1000 --hogs "$h" | tee -a "$OUT/kernel-ab.txt"
        done
    done
fi
# Kick-to-wake at native speed: the user-mode token ring, each handoff one WAIT and one KICK.
for path in in-kernel signal-msi userspace; do
    echo "== pingpong user mode $path"
    "$VMM" run --quiet --workload pingpong --pv kick --cs-mode user --kick-path "$path" \
        --iterations 20000 --cs-work 0 --ncs-work 2000 | head -1 | tee -a "$OUT/pingpong.txt"
done
