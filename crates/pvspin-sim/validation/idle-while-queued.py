#!/usr/bin/env python3
"""How long the host's CPUs stand idle while a vCPU thread waits on another CPU's run queue.

The simulator's `Report::idle_while_queued_ns` (printed by `pvspin-sim run`) against the
host's, read off a scheduler trace of one real run (docs/simulator.md, "Source K"):

    perf sched record -o run.data -- target/release/pvspin-vmm run --workload lock \\
        --lock queued --pv kick --guest stock --cs-mode user --vcpus 8 --iterations 10000 \\
        --cs-work 15000 --ncs-work 15000 --quiet
    python3 crates/pvspin-sim/validation/idle-while-queued.py run.data

It replays `sched_switch`, `sched_waking` and `sched_migrate_task` for the threads named
`vcpu*` and prints: the span from the first to the last vCPU switch; the idle stretches of a
CPU that began while a vCPU thread was runnable on another CPU, their lengths (from the idle
task's switch-in to its switch-out) and how many ended with a pull (a migration onto the idle
CPU); how long before each such stretch began the waiting vCPU thread had last run (Linux does not pull a thread
that ran within `sysctl_sched_migration_cost`, 0.5 ms, into a newly idle CPU); and the
wake-ups of a vCPU thread onto a CPU where another vCPU thread runs: how many preempted it at
once (the simulator's `Report::wakeups_onto_vcpu`), by how long it had run since its switch-in.
"""
import re
import subprocess
import sys

LINE = re.compile(r'\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)')
SWITCH = re.compile(r'prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+) ==> '
                    r'next_comm=(.*?) next_pid=(\d+)')
WAKING = re.compile(r'comm=(.*?) pid=(\d+) .*target_cpu=(\d+)')
AGES_US = ((0, 500), (500, 1500), (1500, 4000), (4000, float('inf')))
MIGRATE = re.compile(r'pid=(\d+) .*dest_cpu=(\d+)')


def percentile(xs, p):
    return xs[min(len(xs) - 1, int(len(xs) * p))] if xs else float('nan')


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        trace = subprocess.run(['perf', 'script', '-i', sys.argv[1], '-F',
                                'comm,tid,cpu,time,event,trace'],
                               capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        sys.exit('perf is not installed (Debian: linux-perf)')
    except subprocess.CalledProcessError as e:
        sys.exit(f'perf script -i {sys.argv[1]} failed: {e.stderr.strip()}')
    vcpus = set()
    waiting = {}        # runnable, not running vCPU thread -> the CPU it waits on
    last_ran = {}       # vCPU thread -> when it last left a CPU
    idle_cpus = {}      # idle CPU -> (since, a vCPU waited elsewhere, pulled since)
    stretches = []      # (length s, pulled)
    ages_us = []        # per stretch: since the waiting vCPU (most recent) last ran
    first = last = None
    running = {}        # CPU -> (pid, vCPU?, since)
    wakes = []          # pending: (wakee, CPU, the running vCPU, how long it had run, us)
    onto_vcpu = []      # (how long the running vCPU had run, us; preempted at once)
    for line in trace.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        _, _, cpu, t, event, fields = m.groups()
        cpu, t = int(cpu), float(t)
        if event == 'sched:sched_switch':
            s = SWITCH.search(fields)
            if not s:
                continue
            pcomm, ppid, pstate, ncomm, npid = s.groups()
            ppid, npid = int(ppid), int(npid)
            for comm, pid in ((pcomm, ppid), (ncomm, npid)):
                if comm.startswith('vcpu'):
                    vcpus.add(pid)
            still = []
            for wakee, wcpu, ran, ran_us in wakes:
                if wcpu != cpu:
                    still.append((wakee, wcpu, ran, ran_us))
                elif ppid == ran or npid == wakee:
                    preempted = ppid == ran and npid == wakee and pstate.startswith('R')
                    onto_vcpu.append((ran_us, preempted))
                else:
                    still.append((wakee, wcpu, ran, ran_us))
            wakes = still
            running[cpu] = (npid, npid in vcpus, t)
            if ppid in vcpus:
                last_ran[ppid] = t
                if pstate.startswith('R'):
                    waiting[ppid] = cpu
            waiting.pop(npid, None)
            if vcpus:
                first = t if first is None else first
                last = t
            if npid == 0:
                elsewhere = [p for p, c in waiting.items() if c != cpu]
                idle_cpus[cpu] = (t, bool(elsewhere), False)
                if elsewhere:
                    ages_us.append(min(t - last_ran.get(p, 0.0) for p in elsewhere) * 1e6)
            elif ppid == 0 and cpu in idle_cpus:
                since, had_waiting, pulled = idle_cpus.pop(cpu)
                if had_waiting:
                    stretches.append((t - since, pulled))
        elif event == 'sched:sched_waking':
            s = WAKING.search(fields)
            if s and s.group(1).startswith('vcpu'):
                wakee, target = int(s.group(2)), int(s.group(3))
                vcpus.add(wakee)
                waiting[wakee] = target
                pid, is_vcpu, since = running.get(target, (0, False, t))
                if is_vcpu and pid != wakee:
                    wakes.append((wakee, target, pid, (t - since) * 1e6))
        elif event == 'sched:sched_migrate_task':
            s = MIGRATE.search(fields)
            if s:
                pid, dest = int(s.group(1)), int(s.group(2))
                if pid in waiting:
                    waiting[pid] = dest
                if dest in idle_cpus:
                    since, had_waiting, _ = idle_cpus[dest]
                    idle_cpus[dest] = (since, had_waiting, True)
    if first is None:
        sys.exit('no vcpu* threads in the trace')
    lengths = sorted(s for s, _ in stretches)
    ages_us.sort()
    print(f'vCPU span {last - first:.3f} s; {len(stretches)} idle stretches began while a vCPU '
          f'thread waited on another CPU: {sum(lengths) * 1e3:.1f} ms in all, '
          f'p50 {percentile(lengths, 0.5) * 1e6:.0f} us, '
          f'p90 {percentile(lengths, 0.9) * 1e6:.0f} us, '
          f'max {lengths[-1] * 1e6 if lengths else 0:.0f} us; '
          f'{sum(1 for _, p in stretches if p)} ended by a pull')
    print(f'the waiting vCPU last ran before: p10 {percentile(ages_us, 0.1):.0f} us, '
          f'p50 {percentile(ages_us, 0.5):.0f} us, p90 {percentile(ages_us, 0.9):.0f} us; '
          f'{sum(1 for a in ages_us if a < 500)} of {len(ages_us)} within 0.5 ms')
    print(f'{len(onto_vcpu)} wake-ups of a vCPU thread onto a CPU running another: '
          f'{sum(1 for _, p in onto_vcpu if p)} preempted it at once; by how long it had run:')
    for lo, hi in AGES_US:
        sel = [p for a, p in onto_vcpu if lo <= a < hi]
        if sel:
            print(f'  {lo}-{hi} us: {sum(sel)} of {len(sel)}')


if __name__ == '__main__':
    main()
