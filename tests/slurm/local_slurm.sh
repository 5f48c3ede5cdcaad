#!/usr/bin/env bash
# tests/slurm/local_slurm.sh: a real Slurm 22.05 cluster on this one machine, for the launch tests (and for trying the
# job by hand): one controller and two node daemons, n1 and n2, with 4 GPUs each as GRES over placeholder devices.
#
#   sudo tests/slurm/local_slurm.sh start    # install (apt, Debian 12) if missing, configure, start; idempotent
#   tests/slurm/local_slurm.sh status        # exit 0 when the cluster answers with both nodes usable
#   sudo tests/slurm/local_slurm.sh stop     # stop the daemons (the configuration and state stay)
#   export SLURM_CONF=/var/lib/local-slurm/slurm.conf   # then sbatch, srun, squeue, scontrol talk to it
#   LOCAL_SLURM_DIR=/var/lib/local-slurm-2 LOCAL_SLURM_PORT=16827 LOCAL_SLURM_NODE_PORTS="17011 17012" $0 start
#                                            # a second cluster beside the first (pytest with the same three names uses it)
#
# Everything lives in LOCAL_SLURM_DIR (config, state, logs, spools, the placeholder devices): nothing of a real
# Slurm installation's /etc/slurm is touched, and the clients find this cluster through SLURM_CONF only.
# The nodes report more CPUs and memory than a 2-core CI machine has (SlurmdParameters=config_overrides): tests run
# several small jobs at once, and the job scripts read the node's size from Slurm, never from the hardware.
set -euo pipefail

dir=${LOCAL_SLURM_DIR:-/var/lib/local-slurm}
conf=$dir/slurm.conf
nodes=(n1 n2 n3)  # n3: the preemption test's alone (partitions preemptible and urgent only)
read -r -a node_ports <<<"${LOCAL_SLURM_NODE_PORTS:-17001 17002 17003}"  # other ports: a second cluster beside this one
ctld_port=${LOCAL_SLURM_PORT:-16817}
cpus=${LOCAL_SLURM_CPUS:-8}
mem_mb=${LOCAL_SLURM_MEM_MB:-16000}
export SLURM_CONF=$conf

log() { printf '[local_slurm] %s\n' "$*"; }
die() {
  printf '[local_slurm] ERROR: %s\n' "$*" >&2
  exit 1
}

install_packages() {
  local missing=() prog
  for prog in slurmctld slurmd sbatch munged; do
    command -v "$prog" >/dev/null || PATH=$PATH:/usr/sbin command -v "$prog" >/dev/null || missing+=("$prog")
  done
  ((${#missing[@]})) || return 0
  ((EUID == 0)) || die "Slurm is not installed (${missing[*]} missing) and installing it needs root: sudo $0 start"
  command -v apt-get >/dev/null ||
    die "Slurm is not installed (${missing[*]} missing) and this machine has no apt-get: install Slurm 22.05+ and munge"
  log "installing slurmctld slurmd slurm-client munge (apt)"
  apt-get update -qq >"$dir/apt.log" 2>&1 || { tail -20 "$dir/apt.log" >&2; die "apt-get update failed (log: $dir/apt.log)"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge \
    >>"$dir/apt.log" 2>&1 || { tail -20 "$dir/apt.log" >&2; die "apt-get install failed (log: $dir/apt.log)"; }
}

write_config() {
  local host i
  host=$(hostname -s)
  mkdir -p "$dir/state" "$dir/dev"
  for i in 0 1 2 3; do
    # The null device's numbers: Slurm counts GPUs by device files and never opens them.
    [[ -c "$dir/dev/nvidia$i" ]] || mknod "$dir/dev/nvidia$i" c 1 3
  done
  cat >"$conf.tmp" <<EOF
# Written by tests/slurm/local_slurm.sh: a two-node test cluster on one host.
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdSpoolDir=$dir/spool-%n
SlurmdLogFile=$dir/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
JobRequeue=1
MpiDefault=none
# A finished job stays in 'scontrol show job' this long (the tests read its state there; no accounting database).
MinJobAge=3600
# Slurm's defaults, said out loud: what a job gets between SIGTERM and SIGKILL (scancel, time limit).
KillWait=30
# A job that asks for no memory gets this much per node, not the whole node (which would queue every other job).
DefMemPerNode=2000
NodeName=${nodes[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${node_ports[0]} CPUs=$cpus RealMemory=$mem_mb Gres=gpu:4
NodeName=${nodes[1]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${node_ports[1]} CPUs=$cpus RealMemory=$mem_mb Gres=gpu:4
NodeName=${nodes[2]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${node_ports[2]} CPUs=$cpus RealMemory=$mem_mb Gres=gpu:4
# Preemption as a cluster runs it: a job in 'urgent' (the higher PriorityTier) that needs a node preempts the jobs of
# 'preemptible' there: GraceTime seconds, then SIGTERM, SIGKILL KillWait later, and back in the queue. At the grace's
# start preempt_send_user_signal sends the job's own --signal to its batch script (not SIGTERM to every task): the job
# saves and requeues itself (launch/job/preempt.py). 'debug' (n1, n2), every other
# test's, is never preempted; n3 is in 'preemptible' and 'urgent' only, so no other test's job can keep the urgent
# one from running once the preemptible one is gone (else Slurm would not preempt it).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
PartitionName=debug Nodes=${nodes[0]},${nodes[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PreemptMode=OFF
PartitionName=preemptible Nodes=${nodes[2]} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=120
PartitionName=urgent Nodes=${nodes[2]} MaxTime=INFINITE State=UP PriorityTier=2
EOF
  printf 'NodeName=%s Name=gpu File=%s/dev/nvidia[0-3]\n' "${nodes[0]},${nodes[1]},${nodes[2]}" "$dir" >"$dir/gres.conf"
  if ! cmp -s "$conf.tmp" "$conf"; then
    mv "$conf.tmp" "$conf"
    return 0  # changed: daemons that run must be restarted
  fi
  rm -f "$conf.tmp"
  return 1
}

# Node names must resolve to this host (Slurm looks them up, srun connects to them).
resolve_nodes() {
  local n
  for n in "${nodes[@]}"; do
    getent hosts "$n" >/dev/null && continue
    ((EUID == 0)) || die "node name $n does not resolve; as root this adds '127.0.0.1 ${nodes[*]}' to /etc/hosts"
    printf '127.0.0.1 %s\n' "${nodes[*]}" >>/etc/hosts
    log "added '127.0.0.1 ${nodes[*]}' to /etc/hosts"
    return
  done
}

running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  [[ -f /etc/munge/munge.key ]] || /usr/sbin/mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  # As root munged refuses to run without --force (it wants its own user); a test machine is fine with root.
  /usr/sbin/munged --force 2>>"$dir/munged.err" || die "munged did not start ($(tail -3 "$dir/munged.err"))"
  wait_until 10 "munge authenticates" bash -c 'munge -n | unmunge >/dev/null'
}

# wait_until SECONDS WHAT CMD...: poll CMD until it succeeds; fail naming WHAT after SECONDS.
wait_until() {
  local timeout=$1 what=$2 deadline=$((SECONDS + $1))
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
  : "$what" "$timeout"
}

nodes_usable() {
  local states
  states=$(sinfo --noheader --Node --format='%N %t' 2>/dev/null | sort -u) || return 1
  [[ $(grep -cE '^n[123] (idle|mix|alloc)' <<<"$states") == 3 ]]
}

start() {
  mkdir -p "$dir"
  install_packages
  PATH=$PATH:/usr/sbin
  local changed=0
  write_config && changed=1
  resolve_nodes
  start_munge
  if ((changed)); then
    stop_daemons
  fi
  if ! running "$dir/slurmctld.pid"; then
    log "starting slurmctld (port $ctld_port, config $conf)"
    slurmctld || die "slurmctld did not start (log: $dir/slurmctld.log)"
  fi
  wait_until 30 "slurmctld answers" scontrol ping ||
    die "slurmctld does not answer after 30 s: $(tail -5 "$dir/slurmctld.log")"
  local i
  for i in "${!nodes[@]}"; do
    running "$dir/slurmd-${nodes[$i]}.pid" && continue
    log "starting slurmd -N ${nodes[$i]} (port ${node_ports[$i]})"
    slurmd -N "${nodes[$i]}" || die "slurmd -N ${nodes[$i]} did not start (log: $dir/slurmd-${nodes[$i]}.log)"
  done
  # A node left down or drained by an earlier start (or a daemon killed with jobs on it) comes back here.
  local deadline=$((SECONDS + 60))
  until nodes_usable; do
    scontrol update nodename="${nodes[0]},${nodes[1]},${nodes[2]}" state=resume >/dev/null 2>&1 || true
    if ((SECONDS >= deadline)); then
      sinfo --Node --long >&2 || true
      die "the nodes are not usable after 60 s (above; logs: $dir/slurmd-n1.log, $dir/slurmd-n2.log)"
    fi
    sleep 1
  done
  log "ready: $(sinfo --noheader --format='%P %a %D nodes %t' | head -1) (SLURM_CONF=$conf)"
}

stop_daemons() {
  local pidfile pid deadline
  for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
    running "$pidfile" || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid"
    deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

status() {
  [[ -f "$conf" ]] || { echo "no local cluster configured ($conf missing): sudo $0 start"; return 1; }
  if nodes_usable; then
    sinfo --Node --format='%N %t %c CPUs %m MB %G'
    return 0
  fi
  echo "the local cluster is not usable (SLURM_CONF=$conf):"
  sinfo --Node --long 2>&1 || true
  return 1
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons && log "stopped" ;;
  status) status ;;
  *)
    sed -n '2,11p' "$0" >&2
    exit 2
    ;;
esac
