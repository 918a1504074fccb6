#!/usr/bin/env bash
# Cloud Hypervisor (CH) with pvspin: applies this directory's patch series to a fresh worktree
# of CH at ae44c2971c83, builds CH (release), runs CH's unit tests of the crates the series
# touches, then boots pvspin's example guest (PVH ELF) under CH with PV off, kick, kick+yield
# and run slots, stock and pvspin guest modes, printing each result line and pvspin's
# telemetry, which `ch-remote counters` (CH's vm.counters API) scrapes while the guest runs,
# then pauses and resumes one boot on a single run slot. Every boot runs under a timeout.
#
# usage: run.sh CH_GIT_DIR [WORK_DIR]
#   CH_GIT_DIR  a clone (bare or not) of cloud-hypervisor/cloud-hypervisor holding ae44c2971c83
#   WORK_DIR    where the worktree, target dir and outputs go (default: a new temporary dir)
# environment:
#   MICRO_HTTP_GIT, RUST_VMM_CI_GIT  local clones of firecracker-microvm/micro-http and
#       rust-vmm/rust-vmm-ci, for hosts where cargo cannot reach GitHub (CH's one git dependency
#       and its submodule): mapped with git's insteadOf
#   GUEST_ELF, GUEST_CMDLINE_TOOL  the PVH guest image and the pvspin-vmm binary whose
#       `guest-cmdline` prints its command line (default: built from this checkout)
#   CH_TARGET_DIR  cargo's target dir for CH (default WORK_DIR/target; keep it out of this repo)
#   SKIP_TESTS=1  skip CH's unit tests; BOOT_TIMEOUT (s, default 300); CH_JOBS (cargo -j);
#   ITERATIONS  lock acquisitions per vCPU (default 2000); PAUSE_ITERATIONS  the same for the
#   boot that is paused and resumed (default 6000: long enough for three pauses)
set -euo pipefail

CH_COMMIT=ae44c2971c83
here=$(cd "$(dirname "$0")" && pwd)
pvspin_root=$(cd "$here/../.." && pwd)
ch_git=${1:?usage: run.sh CH_GIT_DIR [WORK_DIR]}
work=${2:-$(mktemp -d -t pvspin-ch.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
ch="$work/ch"
target=${CH_TARGET_DIR:-$work/target}
boot_timeout=${BOOT_TIMEOUT:-300}
jobs=${CH_JOBS:+-j $CH_JOBS}

echo "== worktree of CH $CH_COMMIT at $ch"
if [ -e "$ch" ]; then
    git -C "$ch" reset -q --hard "$CH_COMMIT"
    git -C "$ch" clean -qfdx
else
    git -C "$ch_git" worktree add --detach "$ch" "$CH_COMMIT"
fi

echo "== applying $(ls "$here"/patches/*.patch | wc -l) patches"
git -C "$ch" -c user.name=pvspin -c user.email=pvspin@localhost am -q "$here"/patches/*.patch
# The series names a pvspin checkout beside CH's; point it at this one.
sed -i "s|^pvspin = { path = \"[^\"]*\"|pvspin = { path = \"$pvspin_root/crates/pvspin\"|" \
    "$ch/vmm/Cargo.toml"
grep -q "^pvspin = { path = \"$pvspin_root/crates/pvspin\"" "$ch/vmm/Cargo.toml"

gitconfig="$work/gitconfig"
: >"$gitconfig"
if [ -n "${MICRO_HTTP_GIT:-}" ]; then
    printf '[url "%s"]\n\tinsteadOf = https://github.com/firecracker-microvm/micro-http\n' \
        "$MICRO_HTTP_GIT" >>"$gitconfig"
fi
if [ -n "${RUST_VMM_CI_GIT:-}" ]; then
    printf '[url "%s"]\n\tinsteadOf = https://github.com/rust-vmm/rust-vmm-ci.git\n' \
        "$RUST_VMM_CI_GIT" >>"$gitconfig"
fi
printf '[protocol "file"]\n\tallow = always\n' >>"$gitconfig"
export GIT_CONFIG_GLOBAL="$gitconfig" CARGO_NET_GIT_FETCH_WITH_CLI=true CARGO_TARGET_DIR="$target"

echo "== building CH (release): cloud-hypervisor and ch-remote"
(cd "$ch" && nice -n 19 cargo build $jobs --release --bin cloud-hypervisor --bin ch-remote)
chbin="$target/release/cloud-hypervisor"
chremote="$target/release/ch-remote"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    # The crates the series touches: vmm (config, cpu, interrupt, seccomp, vm.counters, the
    # pvspin module), hypervisor (the KVM fd accessors) and cloud-hypervisor (the option).
    # As CH's scripts/run_unit_tests.sh runs them (--lib --bins, release, the kvm feature).
    echo "== CH's unit tests: vmm, hypervisor, cloud-hypervisor"
    (cd "$ch" && nice -n 19 cargo test $jobs --release --lib --bins -p vmm -p hypervisor \
        -p cloud-hypervisor --features vmm/kvm,hypervisor/kvm)
fi

tool=${GUEST_CMDLINE_TOOL:-}
if [ -z "$tool" ]; then
    echo "== building pvspin-vmm (for the guest image and its command line)"
    # CARGO_TARGET_DIR is CH's (exported above): the binary lands there.
    (cd "$pvspin_root" && nice -n 19 cargo build $jobs --release -p pvspin-vmm)
    tool="$target/release/pvspin-vmm"
fi
if ! "$tool" guest-cmdline --help >/dev/null 2>&1; then
    echo "$tool has no guest-cmdline: it needs the PVH guest (pvspin-vmm guest-image)" >&2
    exit 2
fi
elf=${GUEST_ELF:-$work/pvspin-guest.elf}
[ -n "${GUEST_ELF:-}" ] || "$tool" guest-image --out "$elf"

# scrape SOCKET OUT: while CH runs, polls `ch-remote counters` every 0.05 s and keeps the last
# answer that has pvspin's counters in OUT, a line per answer in OUT.n. Killed when the boot
# ends.
scrape() {
    local sock=$1 out=$2
    while :; do
        if [ -S "$sock" ] && "$chremote" --api-socket "$sock" counters >"$out.tmp" 2>/dev/null &&
            grep -q '"pvspin"' "$out.tmp"; then
            mv "$out.tmp" "$out"
            echo >>"$out.n"
        fi
        sleep 0.05
    done
}

# boot NAME VCPUS GUEST_OPTS PVSPIN_OPT: one boot, its result line and pvspin's telemetry.
results="$work/results.txt"
: >"$results"
boot() {
    local name=$1 vcpus=$2 guest_opts=$3 pvspin_opt=$4
    local cmdline log tele="$work/$name.counters.json" sock="$work/$name.sock"
    # shellcheck disable=SC2086
    cmdline=$("$tool" guest-cmdline --vcpus "$vcpus" $guest_opts)
    log="$work/$name.log"
    rm -f "$tele" "$tele.n" "$tele.tmp" "$sock"
    local args=(--kernel "$elf" --cmdline "$cmdline" --cpus "boot=$vcpus"
        --memory size=64M --serial tty --console off --api-socket "path=$sock")
    [ -z "$pvspin_opt" ] || args+=(--pvspin "$pvspin_opt")
    local start rc=0 scraper
    scrape "$sock" "$tele" &
    scraper=$!
    start=$(date +%s.%N)
    timeout --kill-after=10 "$boot_timeout" "$chbin" "${args[@]}" >"$log" 2>&1 || rc=$?
    kill "$scraper" 2>/dev/null || true
    wait "$scraper" 2>/dev/null || true
    local secs
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    local result summary
    result=$(grep -a -o 'pvspin-guest: result .*' "$log" | tail -1 || true)
    summary=$(printf '%s' "${result#pvspin-guest: result }" | python3 -c '
import json, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
print("%s %s, counter %s/%s, %s acq/s, pv halts %s kicks %s" % (r["guest"], r["pv"],
    r["counter"], r["expected"], r["acquisitions_per_sec"], r["pv_halts"], r["pv_kicks"]))')
    printf '%-28s rc=%-3s %6.2fs %s\n' "$name" "$rc" "$secs" \
        "${summary:-NO RESULT (see $log)}" | tee -a "$results"
    if [ -s "$tele" ]; then
        python3 - "$tele" "$(wc -l <"$tele.n" 2>/dev/null || echo 0)" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
short = lambda d: json.dumps(d, separators=(",", ":"))[:400]
print("   ch-remote counters while the guest ran (%s scrapes), the last:" % sys.argv[2])
print("   pvspin:", short(c["pvspin"]))
for name in sorted(k for k in c if k.startswith("pvspin-vcpu")):
    v = c[name]
    kicks = v.get("kicks_pvspin_delivered")
    print("   %s: runs=%s exits io/hlt/interrupted=%s/%s/%s kicks=%s halt wakeups=%s "
          "configured=%s" % (name, v.get("runs"), v.get("exits_io"), v.get("exits_hlt"),
          v.get("exits_interrupted"), kicks, v.get("kvm_halt_wakeups"), v.get("configured")))
EOF
    elif [ -n "$pvspin_opt" ]; then
        echo "   $name: no pvspin counters scraped while the guest ran" | tee -a "$results"
        rc=no-counters
    fi
    # CH exits 0 on any guest power-off: the guest's status line says whether the run passed.
    [ "$rc" = 0 ] && [ -n "$summary" ] && grep -aq 'pvspin-guest: status 0 ' "$log"
}

failed=0
lock="--workload lock --iterations ${ITERATIONS:-2000}"
for guest in pvspin stock; do
    g="--guest $guest"
    for vcpus in 2 4; do
        boot "$guest-${vcpus}v-pv-off" "$vcpus" "$g $lock --pv off" "" || failed=1
        boot "$guest-${vcpus}v-kick" "$vcpus" "$g $lock --pv kick" "path=in-kernel" || failed=1
        [ "$guest" = stock ] ||
            boot "$guest-${vcpus}v-kick+yield" "$vcpus" "$g $lock --pv kick+yield" \
                "path=in-kernel,yield=on" || failed=1
    done
    # Run slots: 2 vCPUs on 2 slots (1x) and on 1 slot (2x overcommit), 4 vCPUs on 2.
    boot "$guest-2v-kick-slots2" 2 "$g $lock --pv kick" "path=in-kernel,slots=2" || failed=1
    boot "$guest-2v-kick-slots1" 2 "$g $lock --pv kick" "path=in-kernel,slots=1" || failed=1
    boot "$guest-4v-kick-slots2" 4 "$g $lock --pv kick" "path=in-kernel,slots=2" || failed=1
done
boot "pvspin-2v-kick-signal-msi" 2 "--guest pvspin $lock --pv kick --kick-path signal-msi" \
    "path=signal-msi" || failed=1
# Pause and resume (ch-remote) three times during a boot on one run slot: a vCPU waiting for
# the slot must not keep the pause from completing (the paused vCPU gives its slot up).
pause_resume() {
    local name=$1 vcpus=$2 pvspin_opt=$3 sock="$work/$1.sock" log="$work/$1.log"
    local cmdline ch rc=0 cycles=0
    rm -f "$sock"
    cmdline=$("$tool" guest-cmdline --vcpus "$vcpus" --guest pvspin --workload lock \
        --iterations "${PAUSE_ITERATIONS:-6000}" --pv kick)
    timeout --kill-after=10 "$boot_timeout" "$chbin" --kernel "$elf" --cmdline "$cmdline" \
        --cpus "boot=$vcpus" --memory size=64M --serial tty --console off \
        --api-socket "path=$sock" --pvspin "$pvspin_opt" >"$log" 2>&1 &
    ch=$!
    sleep 1
    for _ in 1 2 3; do
        if "$chremote" --api-socket "$sock" pause >>"$log.remote" 2>&1 && sleep 0.3 &&
            "$chremote" --api-socket "$sock" resume >>"$log.remote" 2>&1; then
            cycles=$((cycles + 1))
        fi
        sleep 0.3
    done
    wait "$ch" || rc=$?
    printf '%-28s rc=%-3s %s/3 pause+resume, %s\n' "$name" "$rc" "$cycles" \
        "$(grep -a -o 'pvspin-guest: status [0-9]*' "$log" || echo 'NO STATUS')" | tee -a "$results"
    [ "$rc" = 0 ] && [ "$cycles" = 3 ] && grep -aq 'pvspin-guest: status 0 ' "$log"
}
pause_resume "pvspin-2v-kick-slots1-pause" 2 "path=in-kernel,slots=1" || failed=1

# CH's in-kernel LAPIC keeps HLT in KVM: the userspace path is refused, naming the rule.
if timeout 60 "$chbin" --kernel "$elf" --cpus boot=2 --memory size=64M --serial tty \
    --console off --pvspin path=userspace >"$work/userspace.log" 2>&1; then
    echo "path=userspace was not refused" | tee -a "$results"
    failed=1
else
    printf '%-28s refused: %s\n' "userspace-path" \
        "$(grep -a -o 'rule: .*' "$work/userspace.log" | head -1)" | tee -a "$results"
fi

echo "== results ($results)"
cat "$results"
exit "$failed"
