#!/usr/bin/env bash
# helper_grpo_qwen3_4b.sh: one per node (srun starts it, inside the container): reward servers, Ray, the trainer.
#
# Started by run_grpo_qwen3_4b_mega_verl.sh with every setting in the environment; not meant to be run by hand.
#   rank 0            Ray head; reward servers too when CONFIG_USE_SEPARATE_REWARD_NODE=false; runs the trainer
#   last rank         with CONFIG_USE_SEPARATE_REWARD_NODE=true and 2+ nodes: reward servers only, no training
#   other ranks       Ray workers
# Nodes talk through files in the job's log folder (shared filesystem): reward_urls, cluster.env, done.
# Arguments: extra Hydra overrides for the trainer (passed last).
set -euo pipefail
unset RAY_ADDRESS  # never attach to another job's cluster by accident
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$here/launch/common.sh"

rank=${SLURM_PROCID:-0}
nnodes=${SLURM_NNODES:-1}
job_log_dir=${JOB_LOG_DIR:?JOB_LOG_DIR is set by run_grpo_qwen3_4b_mega_verl.sh}
host=$(hostname)
separate=false
[[ "${CONFIG_USE_SEPARATE_REWARD_NODE}" == true ]] && separate=true
reward_rank=-1
if [[ "$separate" == true ]]; then
  ((nnodes >= 2)) || die "CONFIG_USE_SEPARATE_REWARD_NODE=true needs 2+ nodes; this job has $nnodes"
  reward_rank=$((nnodes - 1))
fi
train_nodes=$nnodes
[[ "$separate" == false ]] || train_nodes=$((nnodes - 1))
pids=()          # everything this node started, stopped by cleanup
ray_pid=""
exit_code=0

cleanup() {
  local rc=$?
  ((exit_code != 0)) || exit_code=$rc
  trap - EXIT INT TERM
  # The head's exit code tells every other node to stop; a failed reward node tells the head.
  if ((rank == 0)); then
    printf '%s\n' "$exit_code" >"$job_log_dir/done"
  elif ((rank == reward_rank && exit_code != 0)); then
    printf '%s\n' "$exit_code" >"$job_log_dir/reward_failed"
  fi
  ((${#pids[@]})) && stop_pids "${STOP_TIMEOUT}" "${pids[@]}"
  log "[rank $rank] stopped what it started; exit code $exit_code"
  exit "$exit_code"
}
on_signal() {
  exit_code=143
  cleanup
}

# start_reward_servers GPU_LIST: one server per GPU (or one on the CPU), each polled on /health; writes reward_urls.
start_reward_servers() {
  local address=$1 gpu port i=0 urls=()
  local -a gpus
  IFS=',' read -r -a gpus <<<"$2"
  # CONFIG_REWARD_DEVICE=cpu: as many servers, on the CPU (workstations, the demo, tests)
  [[ "$CONFIG_REWARD_DEVICE" != cpu ]] || gpus=("${gpus[@]/*/cpu}")
  for gpu in "${gpus[@]}"; do
    port=$((CONFIG_REWARD_SERVER_PORT + i))
    local logfile="$job_log_dir/reward_server_${host}_${port}.log"
    local device=cuda visible=$gpu
    if [[ "$gpu" == cpu ]]; then
      device=cpu
      visible=""
    fi
    log "[rank $rank] reward server on ${gpu} port $port (log: $logfile)"
    CUDA_VISIBLE_DEVICES=$visible start_bg "$logfile" python3 "$here/reward_score/reward_server.py" \
      --model-path "$CONFIG_REWARD_MODEL_PATH" --device "$device" --port "$port" --host 0.0.0.0
    pids+=("$BG_PID")
    urls+=("http://${address}:${port}")
    wait_for_http "http://127.0.0.1:${port}/health" "$BG_PID" "$logfile" "$REWARD_START_TIMEOUT" ||
      die "reward server on $host port $port did not become healthy (log: $logfile)"
    i=$((i + 1))
  done
  local IFS=,
  printf '%s\n' "${urls[*]}" >"$job_log_dir/reward_urls.tmp"
  mv "$job_log_dir/reward_urls.tmp" "$job_log_dir/reward_urls"
  log "[rank $rank] reward servers healthy: ${urls[*]}"
}

# export_worker_env: what verl's Ray workers must inherit, exported before `ray start` on every node.
export_worker_env() {
  export REWARD_SERVER_URLS=$1
  export REWARD_SERVER_LOG="$job_log_dir/reward_server_*.log"
  export REWARD_LOG_PATH=${REWARD_LOG_PATH:-$job_log_dir/rewards.jsonl}
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
  export WANDB_MODE WANDB_DIR HF_HOME
  # Nothing to drain at the end of a job: without this, recent Ray waits 30 s on SIGTERM before it stops.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
  if [[ -n "${CONFIG_NETWORK_INTERFACE}" ]]; then
    export NCCL_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE GLOO_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE
    export TP_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE
  fi
}

ray_args() {
  printf '%s\0' --num-cpus="${RAY_NUM_CPUS}" --num-gpus="${CONFIG_GPUS_PER_NODE}" --disable-usage-stats --block
}

run_head() {
  local address
  address=$(node_address "$CONFIG_NETWORK_INTERFACE")
  log_phase "[rank 0] head on $host ($address), $nnodes node(s), $train_nodes training"
  if [[ "$separate" == true ]]; then
    log "[rank 0] waiting for the reward node's servers"
    local found
    found=$(wait_for_any "$REWARD_START_TIMEOUT" "$job_log_dir/reward_urls" "$job_log_dir/reward_failed") ||
      die "the reward node reported no servers within ${REWARD_START_TIMEOUT} s (REWARD_START_TIMEOUT)"
    if [[ "$found" == */reward_failed ]]; then
      for f in "$job_log_dir"/reward_server_*.log; do show_tail "$f" 20; done
      die "the reward node failed to start its servers (logs above)"
    fi
  else
    start_reward_servers "$address" "$CONFIG_REWARD_GPUS"
  fi
  export_worker_env "$(cat "$job_log_dir/reward_urls")"

  log_phase "[rank 0] Ray head on ${address}:${RAY_PORT} (temp dir ${RAY_TMP_DIR})"
  local -a args
  mapfile -d '' -t args < <(ray_args)
  start_bg "$job_log_dir/ray_head.log" ray start --head --node-ip-address="$address" --port="$RAY_PORT" \
    --temp-dir="$RAY_TMP_DIR" --include-dashboard=false "${args[@]}"
  ray_pid=$BG_PID
  pids+=("$ray_pid")
  printf 'RAY_ADDRESS_FOR_TRAINER=%s\nREWARD_SERVER_URLS=%s\n' "${address}:${RAY_PORT}" "$REWARD_SERVER_URLS" \
    >"$job_log_dir/cluster.env.tmp"
  mv "$job_log_dir/cluster.env.tmp" "$job_log_dir/cluster.env"
  python3 -m launch.ray_cluster wait --address "${address}:${RAY_PORT}" --nodes "$train_nodes" \
    --gpus $((CONFIG_GPUS_PER_NODE * train_nodes)) --timeout "$RAY_JOIN_TIMEOUT" --watch-pid "$ray_pid" || {
    err "Ray logs: head $job_log_dir/ray_head.log, workers $job_log_dir/ray_worker_*.log"
    show_tail "$job_log_dir/ray_head.log" 15
    die "not every node joined the Ray cluster"
  }

  log_phase "[rank 0] trainer"
  local -a cmd
  mapfile -d '' -t cmd < <(RAY_ADDRESS_FOR_TRAINER="${address}:${RAY_PORT}" python3 -m launch.settings trainer-argv "$@")
  ((${#cmd[@]})) || die "could not build the trainer command"
  cmd=("$TRAINER_LAUNCHER" "${cmd[@]}")
  printf '%s\n' "${cmd[@]}" >"$job_log_dir/trainer_command.txt"
  log "[rank 0] trainer command (one argument per line): $job_log_dir/trainer_command.txt"
  set +e  # the trainer's exit code is the job's, so take it instead of exiting on it
  (cd "$job_log_dir" && "${cmd[@]}") 2>&1 | tee "$job_log_dir/trainer.log"
  exit_code=${PIPESTATUS[0]}
  set -e
  if ((exit_code == 0)); then
    touch "$CONFIG_OUTPUT_DIR/TRAINING_DONE"
    log_phase "[rank 0] trainer finished"
  else
    err "trainer exited with $exit_code (log: $job_log_dir/trainer.log)"
  fi
}

run_reward_node() {
  local address
  address=$(node_address "$CONFIG_NETWORK_INTERFACE")
  log_phase "[rank $rank] reward node $host ($address): $REWARD_REPLICAS server(s), no training"
  local gpus
  gpus=$(seq -s, 0 $((REWARD_REPLICAS - 1)))
  start_reward_servers "$address" "$gpus"
  wait_until_done
}

run_worker() {
  log_phase "[rank $rank] Ray worker on $host: waiting for the head"
  local found
  found=$(wait_for_any "$RAY_JOIN_TIMEOUT" "$job_log_dir/cluster.env" "$job_log_dir/done") ||
    die "[rank $rank] the head wrote no cluster.env within ${RAY_JOIN_TIMEOUT} s (RAY_JOIN_TIMEOUT)"
  if [[ "$found" == */done ]]; then
    log "[rank $rank] the head finished before this node joined; nothing to do"
    return
  fi
  local ray_address reward_urls address attempt logfile="$job_log_dir/ray_worker_${host}.log"
  ray_address=$(sed -n 's/^RAY_ADDRESS_FOR_TRAINER=//p' "$job_log_dir/cluster.env")
  reward_urls=$(sed -n 's/^REWARD_SERVER_URLS=//p' "$job_log_dir/cluster.env")
  export_worker_env "$reward_urls"
  address=$(node_address "$CONFIG_NETWORK_INTERFACE")
  local -a args
  mapfile -d '' -t args < <(ray_args)
  for attempt in $(seq 1 "$RAY_START_RETRIES"); do
    start_bg "$logfile" ray start --address="$ray_address" --node-ip-address="$address" "${args[@]}"
    ray_pid=$BG_PID
    # `ray start --block` never returns while it runs: its log says when the node is up.
    if wait_for_log "$logfile" "Ray runtime started" "$ray_pid" 60; then
      break
    fi
    err "[rank $rank] ray start failed (attempt $attempt/$RAY_START_RETRIES)"
    show_tail "$logfile" 10
    stop_pids 10 "$ray_pid"
    ray_pid=""
  done
  [[ -n "$ray_pid" ]] || die "[rank $rank] could not join the Ray head at $ray_address"
  pids+=("$ray_pid")
  log "[rank $rank] joined $ray_address"
  wait_until_done
}

# wait_until_done: a worker or reward node lives until the head writes `done`, or its own Ray process dies.
wait_until_done() {
  while [[ ! -e "$job_log_dir/done" ]]; do
    if [[ -n "$ray_pid" ]] && ! alive "$ray_pid"; then
      err "[rank $rank] Ray on this node exited before the head finished"
      show_tail "$job_log_dir/ray_worker_${host}.log" 10
      exit_code=1
      return
    fi
    sleep 2
  done
  log "[rank $rank] the head finished (exit code $(cat "$job_log_dir/done")); stopping"
}

main() {
  trap cleanup EXIT
  trap on_signal INT TERM
  if ((rank == 0)); then
    run_head "$@"
  elif ((rank == reward_rank)); then
    run_reward_node
  else
    run_worker
  fi
}

main "$@"
