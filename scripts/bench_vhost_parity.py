#!/usr/bin/env python3
"""pvspind against in-process pvspin at native speed (issue 22): the same PV locks with the kick
in process (in-kernel path) and through pvspind (vhost-user), interleaved run by run.

1. 4, 6, 8 vCPUs on the host's CPUs, no hogs, issue 22's workload (20,000 acquisitions per
   vCPU, cs 2000, ncs 2000). Target: pvspind at most 1.3x in process.
2. 2 vCPUs at 1x/2x/3x (0, 2, 4 hogs), the §9.2 workload (300,000 acquisitions, cs 5000,
   ncs 5000). Target: 1.2x.

One pvspind (release build, its defaults unless --daemon-arg) serves every /vhost run. Prints
`pvspin-vmm bench`'s tables, then one markdown table: per case and lock, the medians, the
ratio, and each variant's slowest run; then the daemon's totals and the scheduler sampler's
cost per vCPU thread read.

Usage: scripts/bench_vhost_parity.py [--runs 5] [--vcpus 4,6,8] [--skip-2vcpu]
                                     [--locks ticket,queued] [--daemon-arg ARG ...]
       scripts/bench_vhost_parity.py --tables-from LOG   (the summary of a saved run)
Binaries come from $CARGO_TARGET_DIR (default: target/) after `cargo build --release`.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
VMM = os.path.join(TARGET, "release", "pvspin-vmm")
PVSPIND = os.path.join(TARGET, "release", "pvspind")

LINE = re.compile(r"^case (\d+)x \((\d+) hogs\)\s+(\S+)\s+(>?)\s*[\d.]+ \([\d.]+\)\s+median >?([\d.]+)"
                  r".*runs: ([\d. ]+)")


def start_daemon(directory, extra):
    sock = os.path.join(directory, "vm.sock")
    control = os.path.join(directory, "control.sock")
    # The measured setting: the kick worker at SCHED_FIFO 1 (not the daemon's default).
    daemon = subprocess.Popen([PVSPIND, "--socket", sock, "--control", control, "--max-vcpus", "8",
                               "--worker-priority", "fifo:1", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def bench(sock, vcpus, iterations, cs, ncs, hogs, runs, locks, timeout_ms):
    variants = ",".join(v for lock in locks for v in (f"{lock}:kick", f"{lock}:kick/vhost"))
    args = [VMM, "bench", "--cs-mode", "user", "--vcpus", str(vcpus), "--iterations",
            str(iterations), "--cs-work", str(cs), "--ncs-work", str(ncs), "--hogs", hogs,
            "--runs", str(runs), "--timeout-ms", str(timeout_ms),
            "--pv-backend", f"vhost-user:{sock}", "--variants", variants]
    print("$ " + " ".join(args[1:]), flush=True)
    out = subprocess.run(args, capture_output=True, text=True, timeout=7200, check=True).stdout
    text = "\n".join(line for line in out.splitlines() if not line.startswith("{"))
    print(text + "\n", flush=True)
    return parse(text, vcpus)


def parse(text, vcpus=None):
    """The case lines of `bench` output: (vCPUs, hogs, label, median, slowest, bounded). `vcpus`
    None: taken from the table headers ("lock workload on N vCPUs")."""
    rows = []
    for line in text.splitlines():
        header = re.match(r"^lock workload on (\d+) vCPUs", line)
        if header:
            vcpus = int(header.group(1))
        m = LINE.match(line)
        if m:
            runs_s = [float(x) for x in m.group(6).split()]
            rows.append((vcpus, int(m.group(2)), m.group(3), float(m.group(5)), max(runs_s),
                         m.group(4) == ">"))
    return rows


def table(rows, target):
    print(f"| vCPUs | hogs | lock | in process: median (slowest) | pvspind: median (slowest) "
          f"| ratio of medians (target {target}x) | ratio of slowest |")
    print("|---|---|---|---|---|---|---|")
    cases = {}
    for vcpus, hogs, label, median, slowest, bounded in rows:
        # Labels: `lock:pv[/option...]:path`, e.g. ticket:kick/vhost:in-kernel.
        lock, pv = label.split(":")[:2]
        key = (vcpus, hogs, lock)
        cases.setdefault(key, {})["vhost" if "/vhost" in pv else "in"] = (
            median, slowest, bounded)
    for (vcpus, hogs, lock), c in sorted(cases.items()):
        if "in" not in c or "vhost" not in c:
            continue
        (mi, si, bi), (mv, sv, bv) = c["in"], c["vhost"]
        mark = lambda b: ">" if b else ""
        print(f"| {vcpus} | {hogs} | {lock} | {mi:.3f} s ({mark(bi)}{si:.3f}) "
              f"| {mv:.3f} s ({mark(bv)}{sv:.3f}) | **{mv / mi:.2f}x** | {sv / si:.2f}x |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vcpus", default="4,6,8")
    parser.add_argument("--skip-2vcpu", action="store_true")
    parser.add_argument("--locks", default="ticket,queued")
    parser.add_argument("--daemon-arg", action="append", default=[])
    parser.add_argument("--tables-from", metavar="LOG",
                        help="print the summary tables of a saved run's output; run nothing")
    opts = parser.parse_args()
    if opts.tables_from:
        rows = parse(open(opts.tables_from).read())
        table([r for r in rows if r[0] != 2], 1.3)
        print()
        table([r for r in rows if r[0] == 2], 1.2)
        return 0
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pvspin-vmm", "-p", "pvspin-vhost"],
                   cwd=ROOT, check=True)
    locks = opts.locks.split(",")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; host CPUs: {os.cpu_count()}; "
          f"load at start: {open('/proc/loadavg').read().strip()}", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        daemon, sock, control = start_daemon(directory, opts.daemon_arg)
        try:
            many = []
            for v in [int(x) for x in opts.vcpus.split(",") if x]:
                many += bench(sock, v, 20000, 2000, 2000, "0", opts.runs, locks, 60000)
            two = []
            if not opts.skip_2vcpu:
                two = bench(sock, 2, 300000, 5000, 5000, "0,2,4", opts.runs, locks, 60000)
            print(f"load at end: {open('/proc/loadavg').read().strip()}\n")
            if many:
                table(many, 1.3)
                print()
            if two:
                table(two, 1.2)
                print()
            totals = telemetry(control)["host"]["totals"]
            print(f"pvspind host-wide totals: {json.dumps(totals)}")
            reads = totals.get("sched_thread_reads", 0)
            if reads:
                print(f"scheduler sampler: {reads} vCPU thread reads, "
                      f"{totals['sched_read_ns'] / reads / 1000:.2f} us of CPU per vCPU per read")
        finally:
            daemon.terminate()
            daemon.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
