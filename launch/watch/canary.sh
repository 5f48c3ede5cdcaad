# shellcheck shell=bash
# shellcheck disable=SC2154  # repo, job_id, job_log_dir and the settings come from the run script that sources it
# launch/watch/canary.sh: the canary's stages (CANARY=1), sourced by run_grpo_qwen3_4b_mega_verl.sh, not run.
#
# Every stage runs what the real job runs (launch, then merge_mcore_to_hf.sh), with the user's models, data and layout,
# on a tiny workload in its own folder; launch/watch/canary.py holds the workload, the checks of verl's output and the table.
# Uses from the run script: repo, job_id, job_log_dir, container_cmd, launch.

canary_dir=""                 # the canary's checkpoints and merged model: ${CONFIG_OUTPUT_DIR}_canary/<job id>
canary_train_overrides=()     # stage 1's extra Hydra overrides (the preflight checks them too)

canary_py() {
  local -a wrap
  mapfile -d '' -t wrap < <(container_cmd)
  (cd "$repo" && "${wrap[@]}" python3 -m launch.watch.canary "$@")
}

# canary_settings: the canary's own folder, experiment name and tiny workload, before anything is created.
canary_settings() {
  local real=$CONFIG_OUTPUT_DIR pair
  local -a pairs
  canary_dir="${CONFIG_OUTPUT_DIR}_canary/$job_id"
  CONFIG_OUTPUT_DIR="$canary_dir/checkpoints"
  mkdir -p "$CONFIG_OUTPUT_DIR" "$job_log_dir" "$HF_HOME" "$WANDB_DIR"  # the container binds them
  mapfile -d '' -t pairs < <(canary_py settings)
  ((${#pairs[@]})) || die "CANARY=1: could not work out the canary's workload (above)"
  for pair in "${pairs[@]}"; do
    export "${pair?}"
  done
  mapfile -d '' -t canary_train_overrides < <(canary_py overrides train)
  ((${#canary_train_overrides[@]})) || die "CANARY=1: could not work out the canary's trainer overrides (above)"
  log "CANARY=1: $TRAIN_BATCH_SIZE prompts x $ROLLOUT_N responses of up to $MAX_RESPONSE_LENGTH tokens per step," \
    "into $canary_dir (experiment $EXPERIMENT_NAME); $real is not touched"
}

# run_logged LOG CMD...: run CMD in this shell (so the traps and saved PIDs stay the script's), its output also in LOG.
run_logged() {
  local logfile=$1 rc=0 out err tee_pid
  shift
  exec {out}>&1 {err}>&2
  exec > >(tee -a "$logfile") 2>&1
  tee_pid=$!
  "$@" || rc=$?
  exec 1>&"$out" 2>&"$err" {out}>&- {err}>&-
  local deadline=$((SECONDS + 10))
  while alive "$tee_pid" && ((SECONDS < deadline)); do sleep 0.2; done  # let tee write the last lines
  return "$rc"
}

# canary_train STAGE ARGS...: one training stage through launch, in its own log folder (the nodes meet through files
# there), then checked from verl's output and its checkpoint folder.
canary_train() {
  local stage=$1 start=$SECONDS rc=0
  shift
  local job_log_dir="$canary_logs/$stage"
  local -x JOB_LOG_DIR=$job_log_dir
  local -a overrides
  mapfile -d '' -t overrides < <(canary_py overrides "$stage")
  mkdir -p "$job_log_dir"
  # The marker of a finished run: stage 2 is that run, started again to resume, as a requeued job would be.
  rm -f "$CONFIG_OUTPUT_DIR/TRAINING_DONE"
  log_phase "canary: stage $stage, logs in $job_log_dir"
  run_logged "$job_log_dir/launch.log" launch "$@" "${overrides[@]}" || rc=$?
  canary_py check "$stage" --rc "$rc" --seconds $((SECONDS - start)) --log "$job_log_dir/launch.log" \
    --ckpt "$CONFIG_OUTPUT_DIR" --results "$canary_logs/results.jsonl"
}

# canary_merge: merge_mcore_to_hf.sh itself on the canary's latest checkpoint, with its verification and numeric check.
canary_merge() {
  local start=$SECONDS rc=0 target="$canary_dir/hf_model"
  log_phase "canary: stage merge, log in $canary_logs/merge.log"
  run_logged "$canary_logs/merge.log" env CKPT_ROOT="$CONFIG_OUTPUT_DIR" STEP=latest ROLE=actor \
    TARGET_DIR="$target" bash "$repo/merge_mcore_to_hf.sh" || rc=$?
  canary_py check merge --rc "$rc" --seconds $((SECONDS - start)) --log "$canary_logs/merge.log" \
    --ckpt "$CONFIG_OUTPUT_DIR" --target "$target" --results "$canary_logs/results.jsonl"
}

# run_canary ARGS...: the stages in this allocation, then the summary table; its exit code is the job's.
run_canary() {
  local canary_logs="$job_log_dir/canary" rc=0
  mkdir -p "$canary_logs"
  if canary_train train "$@"; then
    canary_train resume "$@" || true
    canary_merge || true  # needs only a checkpoint: a failed resume still leaves step 2's to merge
  fi # else the summary shows resume and merge skipped
  canary_py summary --results "$canary_logs/results.jsonl" | tee "$canary_logs/summary.txt" || rc=$?
  if ((rc == 0)) && [[ "$CANARY_KEEP" != 1 ]]; then
    log "removing the canary's checkpoints and merged model ($(du -sh "$canary_dir" | cut -f1)): CANARY_KEEP=1 keeps them"
    rm -rf -- "$canary_dir"
    rmdir -- "${canary_dir%/*}" 2>/dev/null || true  # ${CONFIG_OUTPUT_DIR}_canary, when no other canary is kept
  elif ((rc != 0)); then
    log "kept for inspection: $canary_dir; logs and this summary: $canary_logs"
  fi
  return "$rc"
}
