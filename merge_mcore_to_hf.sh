#!/usr/bin/env bash
#SBATCH --job-name=merge-mcore-hf
##SBATCH --partition=your_partition    # remove one '#' to use it (your cluster's partition; sinfo lists them)
##SBATCH --account=your_account        # remove one '#' where your cluster bills GPU hours to an account (the merge too)
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=02:00:00
#SBATCH --output=logs/%x-%j.out
# merge_mcore_to_hf.sh: a checkpoint of the training job (Megatron; FSDP with STRATEGY=fsdp2) -> a Hugging Face model
# folder, verified.
#
#   sbatch merge_mcore_to_hf.sh                                  # the latest step of the reference job's actor
#   sbatch --export=ALL,STEP=50,ROLE=critic merge_mcore_to_hf.sh
#   CONTAINER=none bash merge_mcore_to_hf.sh                     # on a GPU workstation, verl installed locally
#   CONTAINER=none MERGER_LAUNCHER=cpu/megatron_merger bash merge_mcore_to_hf.sh  # no GPU: docs/verl-on-cpu.md
#   python -m launch.merge.check_numeric --checkpoint CKPT/global_step_N/actor --hf hf_models/RUN-stepN  # alone
#
# What it verifies, where a failed result is kept, and what it reads from the run script's block: docs/merge.md.
set -euo pipefail

# ---- settings: NAME="${NAME:-default}"; UPPERCASE = override me ---------------------------------------------------
# The repository, found as the run script finds it: sbatch runs a copy of this script from slurmd's spool folder.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -f "$repo/launch/job/common.sh" || -z "${SLURM_JOB_ID:-}" ]] || repo=${SLURM_SUBMIT_DIR:-}
[[ -f "$repo/launch/job/common.sh" ]] || {
  echo "ERROR: submitted from $repo, which is not the repository: cd to the repository, then sbatch" >&2
  exit 1
}
# shellcheck source=launch/job/common.sh
source "$repo/launch/job/common.sh"
# CONTAINER, CONFIG_IMAGE_PATH, CONFIG_OUTPUT_DIR: as the run script's settings block has them (edit them there).
load_run_settings "$repo"
CKPT_ROOT="${CKPT_ROOT:-$CONFIG_OUTPUT_DIR}"                     # the trainer's output dir (CONFIG_OUTPUT_DIR)
STEP="${STEP:-latest}"                                           # latest (the tracker file) or a step number
ROLE="${ROLE:-actor}"                                            # actor | critic (needs hf_model saved: docs/merge.md)
TARGET_DIR="${TARGET_DIR:-}"                                     # empty: $repo/hf_models/<run>-step<N>[-critic]
NUMERIC_CHECK="${NUMERIC_CHECK:-1}"                              # 1: compare its log-probs with the checkpoint's; 0: skip
# ------------------------------------------------------------------------------------------------------------------
# Not a setting: what runs `-m verl.model_merger ...` (cpu/megatron_merger on a CPU; the tests' stand-in).
MERGER_LAUNCHER="${MERGER_LAUNCHER:-python3}"

# check_run_header: a merge without the run script's --partition or --account stops, naming the command that has them.
check_run_header() {
  [[ -n "${SLURM_JOB_ID:-}" ]] || return 0
  local opt value have
  for opt in partition account; do
    value=$(sbatch_value "$repo/run_grpo_qwen3_4b_mega_verl.sh" "$opt")
    [[ -n "$value" ]] || continue  # commented out there: Slurm's default, whatever it is
    if [[ "$opt" == partition ]]; then have=${SLURM_JOB_PARTITION:-}; else have=${SLURM_JOB_ACCOUNT:-}; fi
    [[ ",$value," == *",$have,"* ]] ||
      die "this job runs with --$opt=${have:-(none)}, but run_grpo_qwen3_4b_mega_verl.sh says #SBATCH --$opt=$value:" \
        "submit it as $(merge_sbatch_command "$repo") (sbatch reads only this script's own #SBATCH lines). Nothing was merged"
  done
}

resolve_step() {
  [[ -d "$CKPT_ROOT" ]] || die "CKPT_ROOT=$CKPT_ROOT: no such folder (the trainer's trainer.default_local_dir)"
  if [[ "$STEP" == latest ]]; then
    local tracker="$CKPT_ROOT/latest_checkpointed_iteration.txt"
    [[ -f "$tracker" ]] || die "STEP=latest but $tracker is missing: no checkpoint was saved yet; set STEP=<number>"
    STEP=$(tr -d '[:space:]' <"$tracker")
    log "latest checkpoint (from $tracker): step $STEP"
  fi
  [[ "$STEP" =~ ^[0-9]+$ ]] || die "STEP=$STEP: use latest or a step number"
  [[ "$ROLE" == actor || "$ROLE" == critic ]] || die "ROLE=$ROLE: use actor or critic"
  step_dir="$CKPT_ROOT/global_step_$STEP/$ROLE"
  if [[ ! -d "$step_dir" ]]; then
    local have
    have=$(find "$CKPT_ROOT" -maxdepth 1 -name 'global_step_*' -printf '%f ' 2>/dev/null)
    die "STEP=$STEP ROLE=$ROLE: $step_dir does not exist (found: ${have:-no global_step_* folders})"
  fi
  [[ -f "$step_dir/huggingface/config.json" ]] ||
    die "$step_dir/huggingface/config.json is missing: is CKPT_ROOT a verl checkpoint folder?"
  if [[ -z "$TARGET_DIR" ]]; then
    TARGET_DIR="$repo/hf_models/$(basename "$CKPT_ROOT")-step${STEP}$([[ "$ROLE" == critic ]] && echo -critic || true)"
  fi
  [[ ! -e "$TARGET_DIR" ]] || die "TARGET_DIR=$TARGET_DIR already exists: choose another or remove it (nothing was changed)"
}

# decide_tie: the actor's tie_word_embeddings as transformers reads config.json (no key: the model type's default).
decide_tie() {
  tie=false
  [[ "$ROLE" == actor ]] || return 0 # a critic's output layer is its [1, hidden] value head: verl builds it untied
  tie=$(cd "$repo" && "${wrap[@]}" python3 -m launch.merge.verify_hf "$step_dir/huggingface" --show-tie) ||
    die "transformers cannot read $step_dir/huggingface/config.json (output above): is it verl's save of this model?"
  log "tied embeddings: $tie (config.json says so, as transformers reads it)"
}

# has_hf_weights: the checkpoint already holds full HF weights (mbridge, or `hf_model` in checkpoint.save_contents).
has_hf_weights() {
  compgen -G "$step_dir/huggingface/*.safetensors" >/dev/null
}

# checkpoint_backend: fsdp for STRATEGY=fsdp2's shards (beside their fsdp_config.json), megatron otherwise (dist_ckpt/).
checkpoint_backend() {
  if [[ -f "$step_dir/fsdp_config.json" ]]; then echo fsdp; else echo megatron; fi
}

# refuse_critic_merge: verl 0.6.1 cannot merge a Megatron critic's dist checkpoint into a value model (an FSDP one can).
refuse_critic_merge() {
  [[ "$ROLE" == critic && "$(checkpoint_backend)" == megatron ]] && ! has_hf_weights || return 0
  die "ROLE=critic: $step_dir is a Megatron checkpoint (dist_ckpt/, no fsdp_config.json) without HF weights, and" \
    "verl/model_merger/megatron_model_merger.py builds a causal LM (value=False), losing the value head: train with" \
    "'critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]' and merge a step saved with it (docs/merge.md)"
}

merge() {
  # a folder of this job's own beside TARGET_DIR (node and PID: either alone can repeat across nodes)
  local tmp="$TARGET_DIR.tmp.${SLURMD_NODENAME:-${HOSTNAME%%.*}}.$$"
  mkdir "$tmp" || die "$tmp exists: another merge is writing there; nothing was changed"
  if has_hf_weights; then
    log_phase "the checkpoint already holds Hugging Face weights: copying $step_dir/huggingface"
    cp -r "$step_dir/huggingface/." "$tmp"
  else
    local backend
    backend=$(checkpoint_backend)
    # verl's Megatron merger's process group takes MASTER_PORT=12355 unless told, which another merge may hold: the
    # first port of this merge's own free block (launch/job/node.py; Ray's in a job); the FSDP merger ignores it.
    local master_port
    master_port=$(cd "$repo" && "${wrap[@]}" python3 -m launch.job.node ports --job-id "${SLURM_JOB_ID:-merge-$$}" |
      sed -n 's/^ray_port=//p') || {
      rm -rf "$tmp"
      die "no free port for the merger's process group on this node (above); nothing was written"
    }
    local -a cmd=(env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 "MASTER_PORT=$master_port")
    cmd+=("$MERGER_LAUNCHER" -m verl.model_merger merge --backend "$backend" --local_dir "$step_dir" --target_dir "$tmp")
    [[ "$tie" == true && "$backend" == megatron ]] && cmd+=(--tie-word-embedding)
    log_phase "merging: ${cmd[*]}"
    "${wrap[@]}" "${cmd[@]}" || { rm -rf "$tmp"; die "the merger failed (output above); nothing was written to $TARGET_DIR"; }
  fi
  local ok=1 model=(--tied "$tie")
  if [[ "$ROLE" == critic ]]; then
    model=(--value-model)
    log_phase "converting verl's critic save into a value model (launch/merge/critic_to_hf.py)"
    (cd "$repo" && "${wrap[@]}" python3 -m launch.merge.critic_to_hf "$tmp" --checkpoint "$step_dir") || ok=0
  fi
  if ((ok)); then
    log_phase "verifying"
    (cd "$repo" && "${wrap[@]}" python3 -m launch.merge.verify_hf "$tmp" "${model[@]}") || ok=0
  fi
  if ((ok)) && [[ "$NUMERIC_CHECK" == 1 ]]; then
    log_phase "numeric check: the merged model's log-probs (a critic: values) against the checkpoint's (check_numeric.py)"
    local rc=0 # check_numeric: 1 + UNVERIFIED.txt: they differ; 3: a model it cannot build (kept); else: no comparison
    (cd "$repo" && "${wrap[@]}" python3 -m launch.merge.check_numeric --checkpoint "$step_dir" --hf "$tmp") || rc=$?
    if ((rc == 1)) && [[ -f "$tmp/UNVERIFIED.txt" ]]; then ok=2; elif ((rc != 0 && rc != 3)); then ok=3; fi
  elif ((ok)); then
    log "numeric check skipped (NUMERIC_CHECK=$NUMERIC_CHECK): the result is verified for its structure only"
  fi
  if ((ok != 1)); then
    local kept="$TARGET_DIR.failed"
    # rename(2) never replaces a folder that holds anything: an earlier result stays as it is
    if ! mv -T "$tmp" "$kept" 2>/dev/null; then
      err "$kept exists already, so it is kept at $tmp"
      kept=$tmp
    fi
    ((ok != 2)) || die "the merged model does not compute what the checkpoint computes (above): kept at $kept," \
      "marked by its UNVERIFIED.txt"
    ((ok != 3)) || die "the numeric check could not compare the merged model with the checkpoint (above): kept at" \
      "$kept; fix what it names and merge again, or NUMERIC_CHECK=0 to keep the structural verification alone"
    die "the result is incomplete (above); kept for inspection at $kept"
  fi
  mv -T "$tmp" "$TARGET_DIR" 2>/dev/null ||
    die "TARGET_DIR=$TARGET_DIR appeared while this job merged (another merge of the same step?): it was left as it" \
      "is, and this job's verified result is kept at $tmp; compare them, then keep one"
  log "done: $TARGET_DIR"
}

# container_wrap: the command prefix that runs a program in the image (empty for CONTAINER=none).
container_wrap() {
  wrap=()
  mkdir -p "$(dirname "$TARGET_DIR")" # the merge writes beside TARGET_DIR; the image binds that folder
  check_container
  [[ "$CONTAINER" != none ]] || return 0
  wrap=("$CONTAINER" exec --nv --bind "$repo" --bind "$CKPT_ROOT" --bind "$(dirname "$TARGET_DIR")" --pwd "$repo"
    --env "PYTHONPATH=$repo" "$CONFIG_IMAGE_PATH")
}

# refuse_without_gpu: verl's Megatron merger needs CUDA and NCCL; another MERGER_LAUNCHER than python is on purpose.
refuse_without_gpu() {
  [[ "$(basename "$MERGER_LAUNCHER")" == python* ]] || return 0
  (cd "$repo" && "${wrap[@]}" python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())') && return 0
  die "verl's Megatron merger needs a GPU (CUDA and NCCL) and torch sees none here: submit it to a GPU node" \
    "(sbatch merge_mcore_to_hf.sh), or on purpose MERGER_LAUNCHER=cpu/megatron_merger (docs/verl-on-cpu.md)"
}

main() {
  check_run_header
  log_phase "merge ${ROLE} of $CKPT_ROOT (STEP=$STEP)"
  resolve_step
  refuse_critic_merge
  container_wrap
  decide_tie
  has_hf_weights || [[ "$(checkpoint_backend)" != megatron ]] || refuse_without_gpu
  merge
}

main "$@"
