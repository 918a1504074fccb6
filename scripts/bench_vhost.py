#!/usr/bin/env python3
"""pvspin through the out-of-process backend (pvspind, vhost-user) beside the in-process paths.

1. Kick-to-wake: `pvspin-vmm run --workload pingpong` on each in-process kick path and with
   `--pv-backend vhost-user:SOCKET`, interleaved round by round, in guest user mode (native) and
   kernel mode (emulated); the median over rounds of each run's p50/p90/p99 (guest TSC, us)
   and of the guest time per handoff.
2. The 2x/3x lock table: `pvspin-vmm bench` with in-process and `/vhost` variants in one
   interleaved table (guest user mode, 2 vCPUs, 0/2/4 hogs).

One pvspind (release build) serves every vhost-user run. Usage:
scripts/bench_vhost.py [--rounds 5] [--handoffs 20000] [--kernel-handoffs 1000] [--table-runs 5]
                       [--skip-table]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMM = os.path.join(ROOT, "target", "release", "pvspin-vmm")
PVSPIND = os.path.join(ROOT, "target", "release", "pvspind")

PATHS = ["in-kernel", "signal-msi", "userspace", "vhost-user", "vhost-unpaced"]


def start_daemon(directory, name="vm", extra=()):
    sock = os.path.join(directory, f"{name}.sock")
    control = os.path.join(directory, f"{name}-control.sock")
    daemon = subprocess.Popen([PVSPIND, "--socket", sock, "--control", control, "--max-vcpus", "4",
                               *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not (os.path.exists(sock) and os.path.exists(control)):
        if time.time() > deadline:
            daemon.kill()
            raise RuntimeError("pvspind did not start")
        time.sleep(0.01)
    return daemon, sock, control


def telemetry(control):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(control)
        s.sendall(b"json\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def pingpong(path, socks, user, handoffs):
    args = [VMM, "run", "--workload", "pingpong", "--pv", "kick", "--vcpus", "2",
            "--iterations", str(handoffs), "--cs-work", "10", "--ncs-work", "0", "--quiet"]
    if user:
        args += ["--cs-mode", "user"]
    if path in socks:
        args += ["--pv-backend", f"vhost-user:{socks[path]}"]
    else:
        args += ["--kick-path", path]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True).stdout
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    latency = report["kick_to_wake"]
    per_handoff_us = report["guest_seconds"] * 1e6 / handoffs
    waits_per_handoff = report["pv_halts"] / handoffs
    return (latency["p50_us"], latency["p90_us"], latency["p99_us"], per_handoff_us,
            waits_per_handoff)


def latency_table(socks, rounds, handoffs, user):
    results = {path: [] for path in PATHS}
    for round_ in range(rounds):
        for path in PATHS:
            results[path].append(pingpong(path, socks, user, handoffs))
        print(f"  {'user' if user else 'kernel'} mode: round {round_ + 1}/{rounds} done", file=sys.stderr)
    mode = "guest user mode (native)" if user else "guest kernel mode (emulated)"
    print(f"\nkick-to-wake, {mode}: 2-vCPU ping-pong, {handoffs} handoffs per run, "
          f"median over {rounds} interleaved rounds (guest TSC, us)")
    print(f"{'path':13} {'p50':>8} {'p90':>8} {'p99':>8} {'us/handoff':>11} {'waits/handoff':>14}"
          "  p50 per round")
    base = None
    for path in PATHS:
        rows = results[path]
        med = [statistics.median(r[i] for r in rows) for i in range(5)]
        if base is None:
            base = med[3]
        per_round = " ".join(f"{r[0]:.1f}" for r in rows)
        print(f"{path:13} {med[0]:8.1f} {med[1]:8.1f} {med[2]:8.1f} {med[3]:11.1f} {med[4]:14.2f}"
              f"  {per_round}"
              f"  (handoff x{med[3] / base:.2f} of in-kernel)")


def lock_table(sock, runs):
    variants = ",".join([
        "ticket:off", "ticket:kick", "ticket:kick/vhost",
        "queued:kick", "queued:kick/vhost",
        "ticket:kick+yield", "ticket:kick+yield/vhost",
    ])
    args = [VMM, "bench", "--cs-mode", "user", "--vcpus", "2", "--iterations", "300000",
            "--cs-work", "5000", "--ncs-work", "5000", "--hogs", "0,2,4", "--runs", str(runs),
            "--timeout-ms", "30000", "--pv-backend", f"vhost-user:{sock}", "--variants", variants]
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600, check=True).stdout
    print("\n" + "\n".join(line for line in out.splitlines() if not line.startswith("{")))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=20000)
    parser.add_argument("--kernel-handoffs", type=int, default=1000)
    parser.add_argument("--table-runs", type=int, default=5)
    parser.add_argument("--skip-table", action="store_true")
    opts = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pvspin-vmm", "-p", "pvspin-vhost"],
                   cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as directory:
        daemon, sock, control = start_daemon(directory)
        # The same daemon without its per-VM event pacing (--max-events-per-sec), to show
        # what the pacing costs a guest that kicks this often.
        unpaced, unpaced_sock, _ = start_daemon(directory, "unpaced",
                                                ("--max-events-per-sec", "10000000"))
        socks = {"vhost-user": sock, "vhost-unpaced": unpaced_sock}
        try:
            latency_table(socks, opts.rounds, opts.handoffs, user=True)
            latency_table(socks, opts.rounds, opts.kernel_handoffs, user=False)
            if not opts.skip_table:
                lock_table(sock, opts.table_runs)
            totals = telemetry(control)["host"]["totals"]
            print(f"\npvspind host-wide totals: {json.dumps(totals)}")
        finally:
            for d in (daemon, unpaced):
                d.terminate()
                d.wait(timeout=10)


if __name__ == "__main__":
    main()
