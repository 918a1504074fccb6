#!/usr/bin/env python3
"""Measures a validation set with the host's speed taken in the same stretch as each run.

The development hosts' speed switches 2x within seconds (docs/benchmarks.md 14.15), so one
work unit for a table measured over a quarter of an hour puts that drift into every cell.
`csv` gives each row its own work unit, the median over the row's runs of either
- `--unit in-run` (source G): the run's own, from the guest's timing of its non-critical
  sections (the report's `ncs_mean_tsc`, the mean of those under 3 medians, over ncs 15000
  units); or
- `--unit reference` (source F): the unit that short reference runs (2 vCPUs, `ticket:kick`,
  1x, 20,000 acquisitions, cs/ncs 15000 in user mode) on both sides of the run give, less the
  ticket hand-over of 1.0 us per acquisition, over cs 15000 units.

    measure-interleaved.py measure --vmm target/release/pvspin-vmm --rounds 5 --out F.jsonl
    measure-interleaved.py csv --source F F.jsonl >> measured-intel.csv
    measure-interleaved.py measure --reference none ... --out G.jsonl
    measure-interleaved.py csv --unit in-run --source G G.jsonl >> measured-intel.csv

The cells are source E's (measured-intel.csv): 2 vCPUs with 0, 2 and 4 hogs, and 4, 8 and 16
vCPUs, 80,000 acquisitions each, in a new random order every round; `--cells more` measures
what E left out (source H): 6 vCPUs, and `ticket:kick+yield` and `ticket:kick/slots` at 2
vCPUs with 0, 2 and 4 hogs.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

COMMON = ['--cs-mode', 'user', '--cs-work', '15000', '--ncs-work', '15000']
TWO_VCPUS = ['ticket:kick', 'queued:kick', 'ticket:off', 'queued:kick:in-kernel@stock',
             'queued:kick/slots:in-kernel@stock', 'queued:kick/slots:signal-msi@stock']
MORE_VCPUS = ['ticket:kick', 'queued:kick', 'queued:kick:in-kernel@stock',
              'ticket:kick/slots:signal-msi', 'queued:kick/slots:signal-msi',
              'queued:kick/slots:signal-msi@stock', 'ticket:kick/slots:in-kernel',
              'queued:kick/slots:in-kernel@stock']
CELLS = ([(2, hogs, v) for hogs in (0, 2, 4) for v in TWO_VCPUS]
         + [(n, 0, v) for n in (4, 8, 16) for v in MORE_VCPUS])
# What E left out of issue 19's list: 6 vCPUs, and directed yield and run slots for the pvspin
# guest at 1x-3x (source H).
MORE_CELLS = ([(6, 0, v) for v in MORE_VCPUS]
              + [(2, hogs, v) for hogs in (0, 2, 4)
                 for v in ('ticket:kick+yield', 'ticket:kick/slots')])
ACQUISITIONS = 80000
REF_ACQUISITIONS = 20000
TICKET_HANDOFF_S = 1.0e-6
CS_WORK = 15000


def reference(vmm):
    """Guest seconds of one reference run."""
    p = subprocess.run([vmm, 'run', '--quiet', '--workload', 'lock', '--lock', 'ticket',
                        '--pv', 'kick', '--vcpus', '2', '--iterations',
                        str(REF_ACQUISITIONS // 2), '--timeout-ms', '60000'] + COMMON,
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])['guest_seconds']


def measure(args):
    with open(args.out, 'a') as out, tempfile.TemporaryDirectory() as tmp:
        cell_json = os.path.join(tmp, 'cell.jsonl')
        cells = MORE_CELLS if args.cells == 'more' else CELLS
        for r in range(args.rounds):
            order = cells[:]
            random.Random(r).shuffle(order)
            for (n, hogs, variant) in order:
                ref_s = reference(args.vmm) if args.reference == 'ticket-1x' else None
                if os.path.exists(cell_json):
                    os.remove(cell_json)
                subprocess.run([args.vmm, 'bench', '--vcpus', str(n), '--iterations',
                                str(ACQUISITIONS // n), '--hogs', str(hogs), '--timeout-ms',
                                '60000', '--runs', '1', '--max-host-steal', '5', '--quiet',
                                '--variants', variant, '--json-out', cell_json] + COMMON,
                               capture_output=True, text=True)
                with open(cell_json) as f:
                    runs = [json.loads(line) for line in f]
                runs = [x for x in runs
                        if x.get('record') == 'run' and not x.get('discarded_for_steal')]
                for x in runs:
                    rep = x['report']
                    out.write(json.dumps(dict(
                        round=r, vcpus=n, hogs=hogs, variant=variant, ref_s=ref_s,
                        guest_seconds=x['guest_seconds'], timed_out=x['timed_out'],
                        halts=rep.get('pv_halts') or 0, iterations=rep['iterations'],
                        utc=time.strftime('%H:%M:%S', time.gmtime()), report=rep)) + '\n')
                    out.flush()
                print(r, n, hogs, variant, ref_s and round(ref_s, 3),
                      [round(x['guest_seconds'], 3) for x in runs], flush=True)


def unit_ps(ref_s):
    per_acquisition = ref_s / REF_ACQUISITIONS - TICKET_HANDOFF_S
    return per_acquisition / CS_WORK * 1e12


def in_run_unit_ps(report):
    return report['ncs_mean_tsc'] * 1e9 / report['tsc_khz'] / CS_WORK


def csv(args):
    with open(args.jsonl) as f:
        recs = [json.loads(line) for line in f]
    cells = {}
    for i, r in enumerate(recs):
        if args.unit == 'in-run':
            unit = in_run_unit_ps(r['report'])
        else:
            # The reference before this run and the one before the next.
            after = recs[i + 1]['ref_s'] if i + 1 < len(recs) else r['ref_s']
            unit = unit_ps((r['ref_s'] + after) / 2)
        key = (r['hogs'], r['vcpus'], r['iterations'], r['variant'])
        cells.setdefault(key, []).append((r['guest_seconds'], r['halts'], unit))
    # Source E's order: by vCPUs, hogs, then the variants as listed above.
    listed = CELLS + MORE_CELLS
    for key in sorted(cells, key=lambda k: (k[1], k[0], listed.index((k[1], k[0], k[3])))):
        hogs, vcpus, iterations, variant = key
        times, halts, units = zip(*cells[key])
        print(f"{hogs},{vcpus},{iterations},{variant},{statistics.median(times):.3f},"
              f"{max(times):.3f},,{CS_WORK},{CS_WORK},{args.source},60,2,"
              f"{int(statistics.median(halts))},names-holder+hybrid-trylock,"
              f"{round(statistics.median(units))}")
    if args.unit == 'in-run':
        units = [in_run_unit_ps(r['report']) for r in recs]
    else:
        units = [unit_ps(r['ref_s']) for r in recs]
    print(f"{len(recs)} runs: work unit {min(units):.0f}-{max(units):.0f} ps, "
          f"median {statistics.median(units):.0f}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    m = sub.add_parser('measure', help='run the cells, each run after a reference run')
    m.add_argument('--vmm', required=True, help='the pvspin-vmm binary')
    m.add_argument('--rounds', type=int, default=5)
    m.add_argument('--reference', choices=['ticket-1x', 'none'], default='ticket-1x',
                   help='the reference run before every run, or none')
    m.add_argument('--cells', choices=['e', 'more'], default='e',
                   help="source E's cells, or those E left out (6 vCPUs; kick+yield and slots "
                        "for the pvspin guest at 1x-3x)")
    m.add_argument('--out', required=True, help='JSON lines, appended')
    c = sub.add_parser('csv', help='measured-intel.csv rows with their own work unit')
    c.add_argument('--source', default='F')
    c.add_argument('--unit', choices=['reference', 'in-run'], default='reference')
    c.add_argument('jsonl')
    args = p.parse_args()
    measure(args) if args.cmd == 'measure' else csv(args)


if __name__ == '__main__':
    main()
