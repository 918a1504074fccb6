#!/usr/bin/env bash
# Validation runs for pvspin-sim: cs/ncs 15000 user mode, 3 runs, interleaved.
set -u
cd "$(dirname "$0")"
vmm=${VMM:-../../../../target/release/pvspin-vmm}
work="--cs-mode user --cs-work 15000 --ncs-work 15000 --timeout-ms 10000 --quiet"
hv=ticket:off,tas:off,ticket:kick,ticket:kick+yield,queued:kick,queued:kick+yield,queued:kick:in-kernel@stock,queued:kick/slots:signal-msi@stock
vv=tas:off,ticket:kick,ticket:kick+yield,queued:kick,queued:kick+yield,queued:kick:in-kernel@stock,queued:kick/slots:userspace@pvspin,ticket:kick/slots:in-kernel@pvspin
echo "start $(date -u +%H:%M:%S) $(cat /proc/loadavg)" > log.txt
$vmm bench $work --vcpus 2 --iterations 40000 --hogs 0,2,4 --runs 3 --variants "$hv" --json-out hogs.jsonl > hogs.txt 2>hogs.err
echo "hogs done $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> log.txt
for v in 4 6 8 16; do
  $vmm bench $work --vcpus $v --iterations $((80000 / v)) --hogs 0 --runs 3 --variants "$vv" --json-out vcpus-$v.jsonl > vcpus-$v.txt 2>vcpus-$v.err
  echo "vcpus $v done $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> log.txt
done
