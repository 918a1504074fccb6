#!/usr/bin/env python3
"""Two pvspin-vmm builds side by side: the same `run` arguments, alternating A and B run by
run, so that drift of a shared machine hits both alike. Prints each build's guest seconds, the
medians and B's median over A's.

Used to check that a change does not regress an existing table (e.g. the kernel-mode overcommit
table against the build of the previous main), where `bench` cannot put two builds in one run.

Usage: scripts/bench_ab.py --a OLD_BINARY --b NEW_BINARY [--runs 5] -- RUN_ARGS...
Example: scripts/bench_ab.py --a previous-main/target/release/pvspin-vmm --b target/release/pvspin-vmm --runs 5 \\
         -- --pv kick --iterations 1000 --hogs 2
"""
import argparse
import json
import statistics
import subprocess
import sys


def guest_seconds(binary, args):
    out = subprocess.run([binary, "run", "--quiet", *args], capture_output=True, text=True,
                         timeout=900, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["guest_seconds"]
    sys.exit(f"{binary} {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = [a for a in opts.args if a != "--"]
    a, b = [], []
    for _ in range(opts.runs):
        a.append(guest_seconds(opts.a, args))
        b.append(guest_seconds(opts.b, args))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"args: {' '.join(args)}")
    print(f"A {opts.a}: median {ma:.4f}  runs {' '.join(f'{x:.4f}' for x in a)}")
    print(f"B {opts.b}: median {mb:.4f}  runs {' '.join(f'{x:.4f}' for x in b)}")
    print(f"B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
