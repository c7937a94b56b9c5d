#!/usr/bin/env bash
# Stop what tests/cluster/slurm_up.sh started (slurmd, slurmctld, munged, by their pid files) and wait
# until each is gone; exit 1 if one is still there after 20 s.
set -uo pipefail
DIR=${1:-/tmp/stnb-slurm}
left=0
for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || continue
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then echo "slurm_down: $pidfile ($pid) still running" >&2; left=1; fi
done
exit $left
