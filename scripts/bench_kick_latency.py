#!/usr/bin/env python3
"""Kick-to-wake latency of pvspin's three wake paths, side by side with the C probe.

Runs, interleaved round by round, the C probe `e2b_doorbell` (shared/kvm-probes, built in a
temporary folder) and `pvspin-vmm run --workload pingpong` for each wake path, with and without
halt polling, and prints the median over rounds of each run's p50 and p99 (guest TSC, us) and
the ratio of pvspin's p50 to the probe's.

Usage: scripts/bench_kick_latency.py [--rounds 5] [--samples 400] [--probes ../shared/kvm-probes]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMM = os.path.join(ROOT, "target", "release", "pvspin-vmm")

# The probe's delay loop iteration is 2 instructions, a ping-pong work unit about 4: the
# probe's `delay` d blocks the waiter about as long as `--cs-work d/2`.
PROBE_DELAY = 20
CS_WORK = PROBE_DELAY // 2

# (label, probe mode, probe halt-poll arg, probe user-spin ns, pvspin path, halt-poll ns, park-spin us)
CASES = [
    ("in-kernel, no halt polling", "irqfd", "0", None, "in-kernel", 0, 0),
    ("in-kernel, halt polling 200 us", "irqfd", "200000", None, "in-kernel", 200000, 0),
    ("signal-msi, no halt polling", "msi", "0", None, "signal-msi", 0, 0),
    ("signal-msi, halt polling 200 us", "msi", "200000", None, "signal-msi", 200000, 0),
    ("userspace, no spin", "user", "-1", None, "userspace", None, 0),
    ("userspace, spin 50 us", "user", "-1", "50000", "userspace", None, 50),
]


def run_probe(probes, mode, poll, spin, samples):
    args = [os.path.join(probes, "e2b_doorbell"), mode, "0", str(samples), str(PROBE_DELAY), poll, "0"]
    if spin:
        args.append(spin)
    out = subprocess.run(args, cwd=probes, capture_output=True, text=True, timeout=120).stdout
    match = re.search(r"kick->wake latency.*?p50=([\d.]+) p90=([\d.]+)", out)
    if not match:
        raise RuntimeError(f"no latency in probe output:\n{out}")
    return float(match.group(1)), None


def run_pvspin(path, poll, spin, samples):
    args = [VMM, "run", "--workload", "pingpong", "--pv", "kick", "--kick-path", path,
            "--iterations", str(samples + 1), "--cs-work", str(CS_WORK), "--ncs-work", "0",
            "--park-spin-us", str(spin), "--quiet"]
    if poll is not None:
        args += ["--halt-poll-ns", str(poll)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    report = json.loads(out.splitlines()[1])
    latency = report["kick_to_wake"]
    return latency["p50_us"], latency["p99_us"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--probes", default=os.path.join(ROOT, "..", "shared", "kvm-probes"))
    opts = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pvspin-vmm"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as probes:
        shutil.copytree(opts.probes, probes, dirs_exist_ok=True)
        for root, dirs, files in os.walk(probes):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o755)
        subprocess.run(["sh", os.path.join(probes, "build.sh")], check=True, capture_output=True)
        results = {case[0]: {"probe": [], "pvspin": [], "pvspin_p99": []} for case in CASES}
        for round_ in range(opts.rounds):
            for label, mode, ppoll, pspin, path, poll, spin in CASES:
                p50, _ = run_probe(probes, mode, ppoll, pspin, opts.samples)
                ours, ours_p99 = run_pvspin(path, poll, spin, opts.samples)
                results[label]["probe"].append(p50)
                results[label]["pvspin"].append(ours)
                results[label]["pvspin_p99"].append(ours_p99)
            print(f"round {round_ + 1}/{opts.rounds} done", file=sys.stderr)
    print(f"kick-to-wake latency, guest TSC, us; median over {opts.rounds} rounds of each run's "
          f"p50 ({opts.samples} handoffs per run); probe delay {PROBE_DELAY}, pvspin --cs-work {CS_WORK}")
    print(f"{'case':34} {'C probe p50':>12} {'pvspin p50':>11} {'ratio':>6} {'pvspin p99':>11}  pvspin p50 per round")
    for label, *_ in CASES:
        r = results[label]
        probe, ours = statistics.median(r["probe"]), statistics.median(r["pvspin"])
        rounds = " ".join(f"{x:.1f}" for x in r["pvspin"])
        print(f"{label:34} {probe:12.1f} {ours:11.1f} {ours / probe:6.2f} "
              f"{statistics.median(r['pvspin_p99']):11.1f}  {rounds}")


if __name__ == "__main__":
    main()
