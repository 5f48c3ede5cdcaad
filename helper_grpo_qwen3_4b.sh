#!/usr/bin/env bash
# helper_grpo_qwen3_4b.sh: one per node (srun starts it, inside the container): reward servers, Ray, the trainer.
#
# Started by run_grpo_qwen3_4b_mega_verl.sh with every setting in the environment; not meant to be run by hand.
#   rank 0            Ray head; reward servers too when CONFIG_USE_SEPARATE_REWARD_NODE=false; runs the trainer
#   last rank         with CONFIG_USE_SEPARATE_REWARD_NODE=true and 2+ nodes: reward servers only, no training
#   other ranks       Ray workers
# Nodes talk through files in the job's log folder (shared filesystem): reward_urls, address.RANK, cluster.env, done.
# Arguments: extra Hydra overrides for the trainer (passed last).
set -euo pipefail
unset RAY_ADDRESS  # never attach to another job's cluster by accident
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/job/common.sh
source "$here/launch/job/common.sh"
# die MESSAGE: as launch/job/common.sh's, and the message is what this node reports to the others when it exits
# (failure, written to node_failed.RANK by cleanup).
die() {
  failure=${*#"[rank $rank] "}
  failure=${failure%": stopping the job"}
  err "$*"
  exit 1
}

rank=${SLURM_PROCID:-0}
nnodes=${SLURM_NNODES:-1}
job_log_dir=${JOB_LOG_DIR:?JOB_LOG_DIR is set by run_grpo_qwen3_4b_mega_verl.sh}
# This node's name: Slurm's where there is one (two nodes can share a host name), for the per-node files.
host=${SLURMD_NODENAME:-$(hostname)}
separate=false reward_rank=-1 train_nodes=$nnodes
if [[ "${CONFIG_USE_SEPARATE_REWARD_NODE}" == true ]]; then
  ((nnodes >= 2)) || die "CONFIG_USE_SEPARATE_REWARD_NODE=true needs 2+ nodes; this job has $nnodes"
  separate=true reward_rank=$((nnodes - 1)) train_nodes=$((nnodes - 1))
fi
pids=()          # everything this node started, stopped by cleanup
ray_pid=""
exit_code=0
failure=""       # what went wrong on this node, for the head's message
# What this node watches (watch): pid, name, log, and a reward server's index in srv_* (-1: any other part).
watch_pids=() watch_names=() watch_logs=() watch_server=()
# This node's reward servers: port, GPU (or cpu), log, deaths, first pid, start.
srv_port=() srv_gpu=() srv_log=() srv_deaths=() srv_pid=() srv_started=()
declare -A port  # this job's ports on this node (launch/job/node.py ports)

cleanup() {
  local rc=$?
  ((exit_code != 0)) || exit_code=$rc
  # A second SIGTERM would kill this shell before it stopped its servers and Ray: ignored (Slurm's SIGKILL after
  # KillWait still ends it); a second Ctrl-C still stops it at once.
  trap - EXIT INT
  trap '' TERM
  # The head's exit code tells every other node to stop; a failed node tells the head (and why).
  if ((rank == 0)); then
    printf '%s\n' "$exit_code" >"$job_log_dir/done"
  elif ((exit_code != 0)); then
    printf '%s\n' "${failure:-exited with $exit_code (see the job output)} (rank $rank on $host)" \
      >"$job_log_dir/node_failed.$rank"
  fi
  ((${#pids[@]})) && stop_pids "${STOP_TIMEOUT}" "${pids[@]}"
  # Ray's own logs are in the node-local RAY_TMP_DIR, which a cluster may wipe after the job: kept per node.
  if [[ -d "$RAY_TMP_DIR/session_latest/logs" ]]; then
    timeout 10 cp -rL "$RAY_TMP_DIR/session_latest/logs" "$job_log_dir/ray_logs_$host" 2>/dev/null ||
      err "[rank $rank] Ray's logs were not all copied from $RAY_TMP_DIR/session_latest/logs (10 s, or unreadable)"
  fi
  log "[rank $rank] stopped what it started; exit code $exit_code"
  exit "$exit_code"
}

# on_signal CODE: SIGTERM/SIGINT (scancel, the time limit, a requeue; srun's --kill-on-bad-exit once a node's helper
# exited): stop everything; report the failed node's reason (node_failed.N) or exit with the head's code (done).
on_signal() {
  trap '' INT TERM  # Slurm and srun may signal more than once: one stop is enough
  exit_code=$1
  local f
  for f in "$job_log_dir"/node_failed.*; do
    [[ -e "$f" && "$f" != "$job_log_dir/node_failed.$rank" ]] || continue
    err "[rank $rank] $(cat "$f"): stopping the job"
    exit_code=1
  done
  if ((rank != 0)) && [[ -s "$job_log_dir/done" ]]; then
    # srun stops the other nodes when the head has exited: the head's exit code is the job's
    exit_code=$(cat "$job_log_dir/done")
    log "[rank $rank] the head finished (exit code $exit_code); stopping"
  elif ((exit_code != 1)); then
    log "[rank $rank] stop signal: stopping what this node started"
  fi
  cleanup
}

# watch PID NAME LOG [SERVER]: check PID on every pass until the job ends (SERVER: a reward server, restarted).
watch() {
  watch_pids+=("$1")
  watch_names+=("$2")
  watch_logs+=("$3")
  watch_server+=("${4:--1}")
}

# check_watched: restart a reward server that died, and die naming the part, the node and its log if anything else
# this node watches died or another node failed.
check_watched() {
  local i f
  for i in "${!watch_pids[@]}"; do
    alive "${watch_pids[$i]}" && continue
    if ((watch_server[i] >= 0)); then
      restart_reward_server "$i" "${watch_server[$i]}"
    else
      show_tail "${watch_logs[$i]}" 20
      die "[rank $rank] ${watch_names[$i]} on $host died (log: ${watch_logs[$i]}): stopping the job"
    fi
  done
  for f in "$job_log_dir"/node_failed.*; do
    [[ -e "$f" ]] || continue
    die "[rank $rank] $(cat "$f"): stopping the job"
  done
  ((rank == 0)) || dump_stacks_if_asked
}

# dump_stacks_if_asked: once the head's stall watchdog asks (stall/request), this node's stacks go beside the head's.
stacks_dumped=0
dump_stacks_if_asked() {
  [[ -e "$job_log_dir/stall/request" ]] && ((!stacks_dumped)) || return 0
  stacks_dumped=1
  log "[rank $rank] the head found the trainer stalled: keeping this node's stacks"
  (cd "$here" && python3 -m launch.job.watchdog dump "$job_log_dir" "$host") ||
    err "[rank $rank] could not keep the stacks of $host (above)"
}

# check_stall: the stall watchdog exited: the trainer hung (stall.json; the job stops), or it failed (no watch now).
stall_pid=""
check_stall() {
  [[ -n "$stall_pid" ]] && ! alive "$stall_pid" || return 0
  local rc=0
  wait "$stall_pid" || rc=$?
  stall_pid=""
  if [[ -s "$job_log_dir/stall.json" ]]; then
    failure=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["message"])' "$job_log_dir/stall.json")
    die "[rank 0] the trainer stalled: $failure: stopping the job"
  fi
  ((rc == 0)) || err "[rank 0] the stall watchdog exited with $rc (log: $job_log_dir/stall_watchdog.log):" \
    "a hang is not caught in this start"
}

# plan_ports REWARD_COUNT: this job's free ports on this node into `port` (a port set by hand is checked, not moved).
plan_ports() {
  local plan key value
  plan=$(node_info ports --job-id "$JOB_ID" --rank "$rank" --reward-count "$1" \
    --reward-port "${CONFIG_REWARD_SERVER_PORT}") || die "[rank $rank] no ports for this job on $host (above); nothing was started here"
  while IFS='=' read -r key value; do
    port[$key]=$value
  done <<<"$plan"
  # Which ports this job holds on this node, for whoever looks at the node (and the tests' check that all are freed).
  printf '%s\nreward_count=%s\ngpus=%s\nnode=%s\n' "$plan" "$1" "$CONFIG_GPUS_PER_NODE" "$host" >"$job_log_dir/ports.$rank"
  [[ "${port[block_moved]}" == 0 ]] || log "[rank $rank] this job's usual ports on $host are taken: moved ${port[block_moved]} block(s) on"
}

# launch_reward_server K: start reward server K on its GPU and port (the token is in the environment); sets BG_PID.
launch_reward_server() {
  local k=$1 device=cuda visible=${srv_gpu[$1]}
  [[ "$visible" != cpu ]] || device=cpu visible=""
  CUDA_VISIBLE_DEVICES=$visible start_bg "${srv_log[$k]}" python3 "$here/reward_score/reward_server.py" \
    --model-path "$CONFIG_REWARD_MODEL_PATH" --device "$device" --port "${srv_port[$k]}" --host 0.0.0.0 \
    --input "$CONFIG_REWARD_INPUT" --add-special-tokens "$CONFIG_REWARD_ADD_SPECIAL_TOKENS" \
    --chat-template "$CONFIG_REWARD_CHAT_TEMPLATE" --append-eos "$CONFIG_REWARD_APPEND_EOS"
}

# restart_reward_server I K: watched process I, reward server K, died: up to REWARD_RESTARTS times in the job start it
# again on the same GPU, port and token, logging why, and wait until it is healthy (this node's other checks wait that
# long: a model's load; one that dies while it loads counts one more death); past that, stop the job.
restart_reward_server() {
  local i=$1 k=$2 reason rc=0 started=$SECONDS
  wait "${watch_pids[$i]}" 2>/dev/null || rc=$?  # here, not in $(...): only this shell can wait for its child
  reason=$(exit_reason "$rc" "${srv_log[$k]}")
  srv_deaths[k]=$((srv_deaths[k] + 1))
  if ((srv_deaths[k] > REWARD_RESTARTS)); then
    show_tail "${srv_log[$k]}" 20
    failure="${watch_names[$i]} on $host died (log: ${srv_log[$k]}): $reason; ${srv_deaths[k]} death(s),"
    failure+=" its REWARD_RESTARTS=$REWARD_RESTARTS restarts spent"
    die "[rank $rank] $failure: stopping the job"
  fi
  err "[rank $rank] ${watch_names[$i]} on $host died (log: ${srv_log[$k]}): $reason;" \
    "restart ${srv_deaths[k]}/$REWARD_RESTARTS, same port and token"
  printf '=== %s restart %s after: %s ===\n' "$(date '+%F %T')" "${srv_deaths[k]}" "$reason" >>"${srv_log[$k]}"
  START_BG_APPEND=1 launch_reward_server "$k"
  watch_pids[i]=$BG_PID
  pids+=("$BG_PID")
  if wait_for_http "http://127.0.0.1:${srv_port[$k]}/health" "$BG_PID" "${srv_log[$k]}" "$REWARD_START_TIMEOUT" \
    "$REWARD_SERVER_TOKEN"; then
    log "[rank $rank] ${watch_names[$i]} on $host is back: healthy at the same URL after $((SECONDS - started)) s"
  elif ! alive "$BG_PID"; then
    restart_reward_server "$i" "$k"
  else
    die "[rank $rank] ${watch_names[$i]} on $host did not become healthy again (above; REWARD_START_TIMEOUT," \
      "log: ${srv_log[$k]}): stopping the job"
  fi
}

# node_info ARGS...: launch/job/node.py (ports, reward GPUs, the node address) from the repository.
node_info() { (cd "$here" && python3 -m launch.job.node "$@"); }

# launch_reward_servers ADDRESS INDICES: start one server per GPU index (or on the CPU) and set srv_urls, not waiting
# (wait_reward_servers): the head starts Ray while they load. Until healthy, a death is a failed start.
srv_urls=""
launch_reward_servers() {
  local address=$1 gpu p i=0 urls=() mapped
  local -a gpus
  IFS=',' read -r -a gpus <<<"$2"
  plan_ports "${#gpus[@]}"
  if [[ "$CONFIG_REWARD_DEVICE" == cpu ]]; then
    # CONFIG_REWARD_DEVICE=cpu: as many servers, on the CPU (workstations, the demo, tests)
    gpus=("${gpus[@]/*/cpu}")
  else
    mapped=$(node_info reward-gpus "$2") || die "[rank $rank] CONFIG_REWARD_GPUS does not fit this job's GPUs (above)"
    log "[rank $rank] reward GPUs on $host: job GPU index ${2} -> GPU ${mapped} (this job's GPUs: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
    IFS=',' read -r -a gpus <<<"$mapped"
  fi
  for gpu in "${gpus[@]}"; do
    p=$((port[reward_port] + i))
    srv_port[i]=$p srv_gpu[i]=$gpu srv_log[i]="$job_log_dir/reward_server_${host}_${p}.log" srv_deaths[i]=0
    log "[rank $rank] reward server on ${gpu} port $p (log: ${srv_log[i]})"
    srv_started[i]=$SECONDS
    launch_reward_server "$i"
    srv_pid[i]=$BG_PID
    pids+=("$BG_PID")
    urls+=("http://${address}:${p}")
    i=$((i + 1))
  done
  local IFS=,
  srv_urls="${urls[*]}"
}

# wait_reward_servers: each server healthy with this job's token (another job's answers 401), then watched; writes
# reward_urls.
wait_reward_servers() {
  local i p left
  for i in "${!srv_pid[@]}"; do
    p=${srv_port[i]} left=$((REWARD_START_TIMEOUT - (SECONDS - srv_started[i])))
    wait_for_http "http://127.0.0.1:${p}/health" "${srv_pid[i]}" "${srv_log[i]}" $((left > 1 ? left : 1)) \
      "$REWARD_SERVER_TOKEN" ||
      die "reward server on $host port $p did not become healthy within REWARD_START_TIMEOUT=${REWARD_START_TIMEOUT} s of its start (log: ${srv_log[i]})"
    watch "${srv_pid[i]}" "reward server (port $p)" "${srv_log[i]}" "$i"
  done
  printf '%s\n' "$srv_urls" >"$job_log_dir/reward_urls.tmp"
  mv "$job_log_dir/reward_urls.tmp" "$job_log_dir/reward_urls"
  log "[rank $rank] reward servers healthy: ${srv_urls//,/ }"
}

# export_worker_env URLS RAY_ADDRESS ADDRESS ADDRESSES: what verl's Ray workers inherit, exported before `ray start`.
export_worker_env() {
  export REWARD_SERVER_URLS=$1
  # The job's own servers are reached directly; a cluster's proxy stays for the outside (wandb online).
  NO_PROXY=$(node_info no-proxy "$1" "$2" "$4" "$host" "$(hostname)") || die "[rank $rank] could not build NO_PROXY (above)"
  export NO_PROXY no_proxy=$NO_PROXY
  # verl's sync SGLang engines take their ports from SGLANG_PORT, 30000 for every job when unset (launch/job/node.py).
  if [[ "$ROLLOUT_ENGINE" == sglang ]]; then
    SGLANG_PORT=$(node_info sglang-port --block-port "${port[sglang_port]}" --gpus "$CONFIG_GPUS_PER_NODE" \
      --address "$3" --addresses "$4") || die "[rank $rank] no SGLang ports for this node (above)"
    export SGLANG_PORT
  fi
  export REWARD_SERVER_LOG="$job_log_dir/reward_server_*.log"
  export REWARD_LOG_PATH=${REWARD_LOG_PATH:-$job_log_dir/rewards.jsonl}
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
  export WANDB_MODE WANDB_DIR HF_HOME
  # Slurm may set ROCR_VISIBLE_DEVICES beside CUDA_VISIBLE_DEVICES; verl 0.6.1's workers refuse both (worker.py:241).
  [[ -z "${CUDA_VISIBLE_DEVICES:-}" ]] || unset ROCR_VISIBLE_DEVICES
  # Nothing to drain at the end of a job: without this, recent Ray waits 30 s on SIGTERM before it stops.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
  # Every thread's stack of a Ray worker on a fatal signal: the stall watchdog's way in without py-spy.
  export PYTHONFAULTHANDLER=1
  if [[ -n "${CONFIG_NETWORK_INTERFACE}" ]]; then
    export NCCL_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE GLOO_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE
    export TP_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE
  fi
}

# start_ray LOG TIMEOUT ARGS...: `ray start ARGS` + ray_args in the background until its log says it is up, in
# RAY_START_RETRIES attempts (Ray's fixed 30 s for the raylet runs out on a loaded node); sets ray_pid (empty: failed).
start_ray() {
  local logfile=$1 timeout=$2 attempt
  local -a common
  shift 2
  mapfile -d '' -t common < <(ray_args)
  for attempt in $(seq 1 "$RAY_START_RETRIES"); do
    START_BG_APPEND=$((attempt > 1)) start_bg "$logfile" ray start "$@" "${common[@]}"
    ray_pid=$BG_PID
    pids+=("$ray_pid") # a stop signal while it starts stops it too
    wait_for_log "$logfile" "Ray runtime started" "$ray_pid" "$timeout" && return 0
    err "[rank $rank] ray start failed (attempt $attempt/$RAY_START_RETRIES)"
    show_tail "$logfile" 10
    stop_pids 10 "$ray_pid"
    ray_pid=""
  done
}

# ray_args: what every node's `ray start` gets; each port is this job's (Ray's defaults collide between jobs).
ray_args() {
  printf '%s\0' --num-cpus="${RAY_NUM_CPUS}" --num-gpus="${CONFIG_GPUS_PER_NODE}" --disable-usage-stats --block \
    --dashboard-agent-listen-port="${port[dashboard_agent_listen_port]}" \
    --dashboard-agent-grpc-port="${port[dashboard_agent_grpc_port]}" --node-manager-port="${port[node_manager_port]}" \
    --object-manager-port="${port[object_manager_port]}" --metrics-export-port="${port[metrics_export_port]}" \
    --runtime-env-agent-port="${port[runtime_env_agent_port]}" --min-worker-port="${port[min_worker_port]}" \
    --max-worker-port="${port[max_worker_port]}"
}

# collect_addresses ADDRESS: every training node's address (address.<rank>) into node_addresses, the head's first.
node_addresses=""
collect_addresses() {
  local r f deadline=$((SECONDS + RAY_JOIN_TIMEOUT))
  node_addresses=$1
  for ((r = 1; r < train_nodes; r++)); do
    f="$job_log_dir/address.$r"
    while [[ ! -s "$f" ]]; do
      check_watched  # a node that failed first says why
      ((SECONDS < deadline)) ||
        die "[rank 0] node $r (of $train_nodes training nodes) wrote no address.$r within ${RAY_JOIN_TIMEOUT} s (RAY_JOIN_TIMEOUT): is its helper running? (the job output shows each node's lines)"
      sleep 1
    done
    node_addresses+=",$(cat "$f")"
  done
}

# head_rewards ADDRESS: the head's side of the reward servers: wait for the reward node's (a reward node that fails
# exits non-zero, and srun stops this node: on_signal names why), or start its own (not waited for here: Ray starts
# while they load their models), or none (REWARD=rule: verl's workers score by rule).
head_rewards() {
  if [[ "$separate" == true ]]; then
    log "[rank 0] waiting for the reward node's servers"
    wait_for_file "$job_log_dir/reward_urls" "$REWARD_START_TIMEOUT" ||
      die "the reward node reported no servers within ${REWARD_START_TIMEOUT} s (REWARD_START_TIMEOUT)"
    plan_ports 0
    srv_urls=$(cat "$job_log_dir/reward_urls")
  elif [[ "$REWARD" == rule ]]; then
    plan_ports 0
  else
    launch_reward_servers "$1" "$CONFIG_REWARD_GPUS"
  fi
}

# start_ray_head ADDRESS RAY_ADDRESS: the Ray head, the head's reward servers healthy, cluster.env for the workers,
# then every training node's GPUs in Ray.
start_ray_head() {
  log_phase "[rank 0] Ray head on $2 (temp dir ${RAY_TMP_DIR}; worker ports ${port[min_worker_port]}-${port[max_worker_port]})"
  # The dashboard's own process starts even with --include-dashboard=false: it gets this job's port too.
  start_ray "$job_log_dir/ray_head.log" 120 --head --node-ip-address="$1" --port="${port[ray_port]}" \
    --ray-client-server-port="${port[ray_client_server_port]}" --dashboard-port="${port[dashboard_port]}" \
    --temp-dir="$RAY_TMP_DIR" --include-dashboard=false
  [[ -n "$ray_pid" ]] || die "[rank 0] could not start the Ray head (log: $job_log_dir/ray_head.log)"
  watch "$ray_pid" "the Ray head" "$job_log_dir/ray_head.log"
  [[ "$separate" == true || "$REWARD" == rule ]] || wait_reward_servers
  printf 'RAY_ADDRESS_FOR_TRAINER=%s\nREWARD_SERVER_URLS=%s\nNODE_ADDRESSES=%s\n' "$2" \
    "$REWARD_SERVER_URLS" "$node_addresses" >"$job_log_dir/cluster.env.tmp"
  mv "$job_log_dir/cluster.env.tmp" "$job_log_dir/cluster.env"
  python3 -m launch.job.ray_cluster wait --address "$2" --nodes "$train_nodes" \
    --gpus $((CONFIG_GPUS_PER_NODE * train_nodes)) --timeout "$RAY_JOIN_TIMEOUT" --watch-pid "$ray_pid" || {
    local -a workers=("$job_log_dir"/ray_worker_*.log)
    err "Ray logs: head $job_log_dir/ray_head.log, workers ${workers[*]}"
    show_tail "$job_log_dir/ray_head.log" 15
    die "not every node joined the Ray cluster"
  }
}

# run_trainer RAY_ADDRESS OVERRIDES...: the trainer (and the stall watchdog beside it) in the background, so a stop
# signal's trap runs at once; every part is checked while it runs, and its exit code is the job's.
run_trainer() {
  log_phase "[rank 0] trainer"
  local -a cmd
  mapfile -d '' -t cmd < <(RAY_ADDRESS_FOR_TRAINER="$1" python3 -m launch.plan.trainer_command trainer-argv "${@:2}")
  ((${#cmd[@]})) || die "could not build the trainer command"
  cmd=("$TRAINER_LAUNCHER" "${cmd[@]}")
  printf '%s\n' "${cmd[@]}" >"$job_log_dir/trainer_command.txt"
  log "[rank 0] trainer command (one argument per line): $job_log_dir/trainer_command.txt"
  local trainer_pid tail_pid
  # shellcheck disable=SC2016  # $1 and $@ are the inner bash's own arguments
  start_bg "$job_log_dir/trainer.log" bash -c 'cd "$1" && shift && exec "$@"' trainer "$job_log_dir" "${cmd[@]}"
  trainer_pid=$BG_PID
  pids+=("$trainer_pid")
  tail --pid="$trainer_pid" -n +1 -F "$job_log_dir/trainer.log" 2>/dev/null &  # the log in the job's output too
  tail_pid=$!
  pids+=("$tail_pid")
  if [[ "$STALL_TIMEOUT" != off ]]; then
    # The repository is on PYTHONPATH (export_worker_env), whatever the folder.
    start_bg "$job_log_dir/stall_watchdog.log" \
      python3 -m launch.job.watchdog watch "$job_log_dir" "$trainer_pid" "$host"
    stall_pid=$BG_PID
    pids+=("$stall_pid")
  fi
  while alive "$trainer_pid"; do
    check_watched
    check_stall
    sleep 1
  done
  wait "$trainer_pid" && exit_code=0 || exit_code=$?  # taken, not exited on
  wait "$tail_pid" || true  # tail ends by itself within a second of the trainer, after its last lines
  if ((exit_code == 0)); then
    touch "$CONFIG_OUTPUT_DIR/TRAINING_DONE"
    log_phase "[rank 0] trainer finished"
  else
    err "trainer exited with $exit_code (log: $job_log_dir/trainer.log)"
  fi
}

run_head() {
  log_phase "[rank 0] head on $host ($address), $nnodes node(s), $train_nodes training"
  head_rewards "$address"
  collect_addresses "$address"
  local ray_address="${address}:${port[ray_port]}"
  export_worker_env "$srv_urls" "$ray_address" "$address" "$node_addresses"
  start_ray_head "$address" "$ray_address"
  run_trainer "$ray_address" "$@"
}

run_reward_node() {
  log_phase "[rank $rank] reward node $host ($address): $REWARD_REPLICAS server(s), no training"
  launch_reward_servers "$address" "$(seq -s, 0 $((REWARD_REPLICAS - 1)))"
  wait_reward_servers
  wait_until_done
}

run_worker() {
  printf '%s\n' "$address" >"$job_log_dir/address.$rank.tmp"
  mv "$job_log_dir/address.$rank.tmp" "$job_log_dir/address.$rank"
  log_phase "[rank $rank] Ray worker on $host ($address): waiting for the head"
  # The head writes cluster.env once its reward servers are healthy and its Ray head runs: allow for both. A head
  # that fails first exits non-zero, and srun stops this node.
  local wait_s=$((REWARD_START_TIMEOUT + RAY_JOIN_TIMEOUT))
  wait_for_file "$job_log_dir/cluster.env" "$wait_s" ||
    die "[rank $rank] the head wrote no cluster.env within ${wait_s} s (REWARD_START_TIMEOUT + RAY_JOIN_TIMEOUT)"
  local ray_address reward_urls addresses logfile="$job_log_dir/ray_worker_${host}.log"
  ray_address=$(sed -n 's/^RAY_ADDRESS_FOR_TRAINER=//p' "$job_log_dir/cluster.env")
  reward_urls=$(sed -n 's/^REWARD_SERVER_URLS=//p' "$job_log_dir/cluster.env")
  addresses=$(sed -n 's/^NODE_ADDRESSES=//p' "$job_log_dir/cluster.env")
  plan_ports 0
  export_worker_env "$reward_urls" "$ray_address" "$address" "$addresses"
  start_ray "$logfile" 60 --address="$ray_address" --node-ip-address="$address"
  [[ -n "$ray_pid" ]] || die "[rank $rank] could not join the Ray head at $ray_address"
  watch "$ray_pid" "the Ray worker" "$logfile"
  log "[rank $rank] joined $ray_address"
  wait_until_done
}

# wait_until_done: a worker or reward node lives until the head writes `done`, or the watchdog stops it.
wait_until_done() {
  while [[ ! -e "$job_log_dir/done" ]]; do
    check_watched
    sleep 1
  done
  log "[rank $rank] the head finished (exit code $(cat "$job_log_dir/done")); stopping"
}

# check_gpu_modes: before a training node starts anything, refuse its GPUs in a compute mode other than Default
# (launch/job/node.py gpu-modes); without nvidia-smi (CPU runs) nothing is checked, where it fails the node says so.
check_gpu_modes() {
  local modes problem
  ((rank != reward_rank)) && command -v nvidia-smi >/dev/null 2>&1 || return 0
  if ! modes=$(nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader 2>&1); then
    err "[rank $rank] nvidia-smi failed on $host (${modes##*$'\n'}): GPU compute modes not checked"
    return 0
  fi
  problem=$(node_info gpu-modes <<<"$modes")
  [[ -z "$problem" ]] || die "[rank $rank] GPU compute mode forbids this job's processes on $host: $problem"
}

main() {
  trap cleanup EXIT
  trap 'on_signal 130' INT
  trap 'on_signal 143' TERM
  check_gpu_modes
  # This node's address that the other nodes reach, for every role.
  address=$(node_info address --interface "$CONFIG_NETWORK_INTERFACE" --nodes "$nnodes") ||
    die "[rank $rank] no address for $host that the other nodes can reach (above)"
  if ((rank == 0)); then
    run_head "$@"
  elif ((rank == reward_rank)); then
    run_reward_node
  else
    run_worker
  fi
}

main "$@"
