#!/usr/bin/env bash
# The lock table under Cloud Hypervisor beside the same table under pvspin-vmm: the same PVH
# guest image and workload parameters, each configuration booted REPS times in each VMM,
# interleaved (CH, pvspin-vmm, CH, ...). Prints, per configuration, the guest's own
# acquisitions/s (TSC-timed inside the guest, identical in both VMMs): median and slowest run
# in each VMM and the ratio of the medians.
#
# usage: compare.sh CLOUD_HYPERVISOR PVSPIN_VMM [REPS]
#   CLOUD_HYPERVISOR  a CH binary built by run.sh (with the patch series)
#   PVSPIN_VMM        a pvspin-vmm binary with `run --boot pvh`, `guest-image`, `guest-cmdline`
# environment: ITERATIONS (default 2000), BOOT_TIMEOUT (s, default 300)
set -euo pipefail

ch=${1:?usage: compare.sh CLOUD_HYPERVISOR PVSPIN_VMM [REPS]}
vmm=${2:?usage: compare.sh CLOUD_HYPERVISOR PVSPIN_VMM [REPS]}
reps=${3:-5}
iterations=${ITERATIONS:-2000}
boot_timeout=${BOOT_TIMEOUT:-300}
work=$(mktemp -d -t pvspin-compare.XXXXXX)
elf="$work/pvspin-guest.elf"
"$vmm" guest-image --out "$elf"

# name | vCPUs | guest options (both VMMs) | CH --pvspin | pvspin-vmm run options
configs=(
    "pv off|2|--pv off||"
    "kick|2|--pv kick|path=in-kernel|"
    "kick+yield|2|--pv kick+yield|path=in-kernel,yield=on|"
    "kick, slots 2 (1x)|2|--pv kick|path=in-kernel,slots=2|--sched slots --slots 2"
    "kick, slots 1 (2x)|2|--pv kick|path=in-kernel,slots=1|--sched slots --slots 1"
    "pv off, 4 vCPUs|4|--pv off||"
    "kick, 4 vCPUs|4|--pv kick|path=in-kernel|"
    "kick, 4 vCPUs, slots 2|4|--pv kick|path=in-kernel,slots=2|--sched slots --slots 2"
)

rate() { grep -a -o '"acquisitions_per_sec":[0-9]*' "$1" | head -1 | cut -d: -f2; }

printf '| configuration | CH acq/s median (slowest) | pvspin-vmm acq/s median (slowest) | CH / pvspin-vmm |\n'
printf '|---|---|---|---|\n'
for config in "${configs[@]}"; do
    IFS='|' read -r name vcpus guest pvspin vmm_opts <<<"$config"
    common="--vcpus $vcpus --workload lock --iterations $iterations $guest"
    ch_rates=()
    vmm_rates=()
    for _ in $(seq "$reps"); do
        # shellcheck disable=SC2086
        cmdline=$("$vmm" guest-cmdline $common)
        args=(--kernel "$elf" --cmdline "$cmdline" --cpus "boot=$vcpus" --memory size=64M
            --serial tty --console off)
        [ -z "$pvspin" ] || args+=(--pvspin "$pvspin")
        timeout --kill-after=10 "$boot_timeout" "$ch" "${args[@]}" >"$work/ch.out" 2>&1 || true
        ch_rates+=("$(rate "$work/ch.out" || echo 0)")
        # shellcheck disable=SC2086
        timeout --kill-after=10 "$boot_timeout" "$vmm" run --boot pvh --quiet $common $vmm_opts \
            >"$work/vmm.out" 2>&1 || true
        vmm_rates+=("$(rate "$work/vmm.out" || echo 0)")
    done
    python3 - "$name" "${ch_rates[*]}" "${vmm_rates[*]}" <<'EOF'
import statistics, sys
name, ch, vmm = sys.argv[1], [int(x or 0) for x in sys.argv[2].split()], [int(x or 0) for x in sys.argv[3].split()]
mc, mv = statistics.median(ch), statistics.median(vmm)
ratio = "%.2f" % (mc / mv) if mv else "n/a"
print("| %s | %d (%d) | %d (%d) | %s |" % (name, mc, min(ch), mv, min(vmm), ratio))
EOF
done
echo "runs per VMM and configuration: $reps, $iterations acquisitions per vCPU; outputs in $work"
