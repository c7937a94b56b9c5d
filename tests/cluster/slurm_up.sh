#!/usr/bin/env bash
# A one-node SLURM cluster on this machine for the cluster tests: munged + slurmctld + slurmd, all files
# (generated munge key, slurm.conf, state, logs, pids) under one folder, nothing in /etc touched.
#   tests/cluster/slurm_up.sh [DIR]     (default /tmp/stnb-slurm); then: export SLURM_CONF=DIR/slurm.conf
#   tests/cluster/slurm_down.sh [DIR]   stops the three daemons and waits until they are gone
# Needs: apt-get install slurm-wlm munge (make cluster-deps). Run as root (SlurmUser=root).
set -euo pipefail
DIR=${1:-/tmp/stnb-slurm}
CPUS=${STNB_SLURM_CPUS:-2}
HOST=$(hostname -s)
for cmd in munged mungekey slurmctld slurmd sinfo; do
  command -v "$cmd" >/dev/null || { echo "slurm_up: $cmd not found; install with: make cluster-deps" >&2; exit 2; }
done
mkdir -p "$DIR"/{state,munge,log} "$DIR/spool/$HOST"
chmod 700 "$DIR/munge"
[ -s "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" --bits=1024
chmod 400 "$DIR/munge/munge.key"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cat > "$DIR/slurm.conf" <<CONF
ClusterName=stnb-test
SlurmctldHost=$HOST
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$DIR/slurm.conf"
munged --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
  --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed" --force
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 120); do
  state=$(sinfo -h -N -o '%t' 2>/dev/null | head -1 || true)
  if [ "$state" = "idle" ]; then echo "slurm_up: node $HOST idle (SLURM_CONF=$SLURM_CONF)"; exit 0; fi
  sleep 0.5
done
echo "slurm_up: the node did not become idle in 60 s (state: '${state:-none}'); logs in $DIR/log:" >&2
tail -n 20 "$DIR"/log/*.log >&2 || true
exit 1
