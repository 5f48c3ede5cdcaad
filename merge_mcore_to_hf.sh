#!/usr/bin/env bash
#SBATCH --job-name=merge-mcore-hf
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=02:00:00
#SBATCH --output=logs/%x-%j.out
# merge_mcore_to_hf.sh: a Megatron checkpoint of the training job -> a Hugging Face model folder, verified.
#
#   sbatch merge_mcore_to_hf.sh                                  # the latest step of the reference job's actor
#   sbatch --export=ALL,STEP=50,ROLE=critic merge_mcore_to_hf.sh
#   CONTAINER=none bash merge_mcore_to_hf.sh                     # on a GPU workstation, verl installed locally
#
# verl 0.6.1's merger needs one GPU and NCCL (no Ray). Tied embeddings are read from the checkpoint's config, not
# assumed: passing --tie-word-embedding for an untied model (Qwen3-8B and larger) silently drops its lm_head.
set -euo pipefail

# ---- settings: NAME="${NAME:-default}"; UPPERCASE = override me ---------------------------------------------------
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -n "${SLURM_SUBMIT_DIR:-}" && -f "${SLURM_SUBMIT_DIR}/merge_mcore_to_hf.sh" ]] && repo=$SLURM_SUBMIT_DIR
CONTAINER="${CONTAINER:-singularity}"                           # singularity | apptainer | none
CONFIG_IMAGE_PATH="${CONFIG_IMAGE_PATH:-$repo/verl_app.sif}"
CKPT_ROOT="${CKPT_ROOT:-${CONFIG_OUTPUT_DIR:-$repo/checkpoints/qwen3_4b_grpo_megatron}}"  # the trainer's output dir
STEP="${STEP:-latest}"                                           # latest (the tracker file) or a step number
ROLE="${ROLE:-actor}"                                            # actor | critic (a value model)
TARGET_DIR="${TARGET_DIR:-}"                                     # empty: $repo/hf_models/<run>-step<N>[-critic]
TIE_WORD_EMBEDDINGS="${TIE_WORD_EMBEDDINGS:-auto}"               # auto (from the config) | true | false
VERIFY_LOAD="${VERIFY_LOAD:-0}"                                  # 1: also load the result with transformers (meta)
MERGER_LAUNCHER="${MERGER_LAUNCHER:-python3}"                    # what runs `-m verl.model_merger ...`
# ------------------------------------------------------------------------------------------------------------------

# shellcheck source=launch/common.sh
source "$repo/launch/common.sh"

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

decide_tie() {
  local from_config
  from_config=$(python3 -c 'import json,sys; print(str(json.load(open(sys.argv[1])).get("tie_word_embeddings", True)).lower())' \
    "$step_dir/huggingface/config.json")
  case "$TIE_WORD_EMBEDDINGS" in
    auto) tie=$from_config ;;
    true | false) tie=$TIE_WORD_EMBEDDINGS ;;
    *) die "TIE_WORD_EMBEDDINGS=$TIE_WORD_EMBEDDINGS: use auto, true or false" ;;
  esac
  log "tied embeddings: $tie (config.json says $from_config; TIE_WORD_EMBEDDINGS=$TIE_WORD_EMBEDDINGS)"
  [[ "$tie" == "$from_config" ]] ||
    err "TIE_WORD_EMBEDDINGS=$tie overrides the checkpoint's config.json ($from_config): the result follows your setting"
}

# has_hf_weights: the checkpoint already holds full HF weights (mbridge, or `hf_model` in checkpoint.save_contents).
has_hf_weights() {
  compgen -G "$step_dir/huggingface/*.safetensors" >/dev/null
}

merge() {
  local tmp="$TARGET_DIR.tmp.$$"
  mkdir -p "$(dirname "$TARGET_DIR")"
  rm -rf "$tmp"
  if has_hf_weights; then
    log_phase "the checkpoint already holds Hugging Face weights: copying $step_dir/huggingface"
    cp -r "$step_dir/huggingface" "$tmp"
  else
    local -a cmd
    cmd=("$MERGER_LAUNCHER" -m verl.model_merger merge --backend megatron --local_dir "$step_dir" --target_dir "$tmp")
    [[ "$tie" == true ]] && cmd+=(--tie-word-embedding)
    [[ "$ROLE" == critic ]] && cmd+=(--is-value-model)
    log_phase "merging: ${cmd[*]}"
    "${wrap[@]}" "${cmd[@]}" || { rm -rf "$tmp"; die "the merger failed (output above); nothing was written to $TARGET_DIR"; }
  fi
  local -a verify=(python3 -m launch.verify_hf "$tmp" --tied "$tie")
  [[ "$ROLE" == critic ]] && verify+=(--value-model)
  [[ "$VERIFY_LOAD" == 1 ]] && verify+=(--load)
  log_phase "verifying"
  if ! (cd "$repo" && "${wrap[@]}" "${verify[@]}"); then
    mv "$tmp" "$TARGET_DIR.failed"
    die "the merged model is incomplete; kept for inspection at $TARGET_DIR.failed"
  fi
  mv "$tmp" "$TARGET_DIR"
  log "done: $TARGET_DIR"
}

main() {
  log_phase "merge ${ROLE} of $CKPT_ROOT (STEP=$STEP)"
  resolve_step
  decide_tie
  wrap=()
  if [[ "$CONTAINER" != none ]]; then
    [[ -f "$CONFIG_IMAGE_PATH" ]] || die "CONFIG_IMAGE_PATH=$CONFIG_IMAGE_PATH: no such image"
    command -v "$CONTAINER" >/dev/null || die "CONTAINER=$CONTAINER is not on PATH (module load it, or CONTAINER=none)"
    wrap=("$CONTAINER" exec --nv --bind "$repo" --bind "$CKPT_ROOT" --bind "$(dirname "$TARGET_DIR")" --pwd "$repo"
      --env "PYTHONPATH=$repo" "$CONFIG_IMAGE_PATH")
  fi
  merge
}

main "$@"
