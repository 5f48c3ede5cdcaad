#!/usr/bin/env bash
#SBATCH --job-name=grpo-qwen3-4b
##SBATCH --partition=your_partition    # remove one '#' to use it (your cluster's partition; sinfo lists them)
##SBATCH --account=your_account        # remove one '#' where your cluster bills GPU hours to an account (the merge too)
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=256G
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
# run_grpo_qwen3_4b_mega_verl.sh: GRPO of Qwen3-4B-Thinking with verl 0.6.1 + Megatron, an HTTP reward model, on Slurm.
#
#   sbatch run_grpo_qwen3_4b_mega_verl.sh                                  # the reference job
#   sbatch --nodes=2 --export=ALL,CONFIG_USE_SEPARATE_REWARD_NODE=true run_grpo_qwen3_4b_mega_verl.sh
#   sbatch run_grpo_qwen3_4b_mega_verl.sh trainer.total_epochs=2           # extra Hydra overrides go last and win
#   PREFLIGHT_ONLY=1 bash run_grpo_qwen3_4b_mega_verl.sh                   # check the settings now, on the login node
#   CONTAINER=none bash run_grpo_qwen3_4b_mega_verl.sh                     # one workstation, verl installed locally
#   CANARY=1 sbatch --time=01:00:00 run_grpo_qwen3_4b_mega_verl.sh         # first time on a cluster: every stage, tiny
#   salloc --nodes=1 --gpus-per-node=4 ...  then  bash run_grpo_qwen3_4b_mega_verl.sh   # in that allocation; Ctrl-C stops
#   python -m launch.watch.status [JOB_ID] [--follow]                      # where a job is, when it ends, how it learns
#
# Edit the settings below, or override them from the environment (docs/settings.md; the trainer command they make:
# logs/<job id>/trainer_command.txt). Keep #SBATCH --gpus-per-node = CONFIG_GPUS_PER_NODE and --nodes = the nodes you want (2+
# for a separate reward node). Submit from the repository root. merge_mcore_to_hf.sh reads this block too.
set -euo pipefail

# sbatch runs a copy of this script from slurmd's spool folder: then the repository is the folder it was submitted from.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -f "$repo/launch/job/common.sh" || -z "${SLURM_JOB_ID:-}" ]] || repo=${SLURM_SUBMIT_DIR:-}
[[ -f "$repo/launch/job/common.sh" ]] || {
  echo "ERROR: submitted from $repo, which is not the repository: cd to the repository, then sbatch" >&2
  exit 1
}

# ---- settings: NAME="${NAME:-default}"; UPPERCASE = override me ---------------------------------------------------
set -a  # every setting below is exported as it is set: the helper and the Python checks read these same names
# -- Your cluster and files (edit these first; docs/settings.md has every setting, with the article's names) --------
CONTAINER="${CONTAINER:-singularity}"                          # singularity | apptainer | none (verl installed here)
CONFIG_IMAGE_PATH="${CONFIG_IMAGE_PATH:-$repo/verl_app.sif}"    # built from verl_app.def (docs/image.md)
CONFIG_MODEL_PATH="${CONFIG_MODEL_PATH:-$repo/models/Qwen3-4B-Thinking-2507}"            # the policy to train
REWARD_PROMPT_OPENS_THINK="${REWARD_PROMPT_OPENS_THINK:-auto}"  # its prompt opens a think block: auto (its template) | true | false
CONFIG_REWARD_MODEL_PATH="${CONFIG_REWARD_MODEL_PATH:-$repo/models/Unsafe-Reward-Qwen3-1.7B}"  # the reward model
CONFIG_TRAIN_FILE="${CONFIG_TRAIN_FILE:-$repo/data/train.parquet}"   # training prompts (data_prep.build)
CONFIG_TEST_FILE="${CONFIG_TEST_FILE:-$repo/data/test.parquet}"      # validation prompts
CONFIG_OUTPUT_DIR="${CONFIG_OUTPUT_DIR:-$repo/checkpoints/qwen3_4b_grpo_megatron}"  # checkpoints; resume reads it
CONFIG_LOG_DIR="${CONFIG_LOG_DIR:-$repo/logs}"                   # a folder per start of a job: servers, Ray, trainer
HF_HOME="${HF_HOME:-$repo/.cache/huggingface}"                  # datasets cache (HOME may be read-only in the image)
CONFIG_GPUS_PER_NODE="${CONFIG_GPUS_PER_NODE:-4}"               # GPUs per node (= #SBATCH --gpus-per-node)
CONFIG_NETWORK_INTERFACE="${CONFIG_NETWORK_INTERFACE:-}"        # e.g. ib0: Ray, NCCL and Gloo use it; empty = hostname
WANDB_PROJECT="${WANDB_PROJECT:-llm_safe_hack}"                 # trainer.project_name
WANDB_MODE="${WANDB_MODE:-offline}"                             # offline: `wandb sync` later from the login node
# -- The reward: the reward model's score, verl's rule scorers' against the reference answer, or both ---------------
REWARD="${REWARD:-rm}"                                          # rm | rule (no reward server) | rm+rule (docs/reward.md)
REWARD_RM_WEIGHT="${REWARD_RM_WEIGHT:-1}"                       # rm+rule: score = this x the reward model's score...
REWARD_RULE_WEIGHT="${REWARD_RULE_WEIGHT:-1}"                   # ...+ this x the rule's (verl's scorers give 0..1)
REWARD_FUNCTION_PATH="${REWARD_FUNCTION_PATH:-}"                # your own rule (a .py, verl's custom_reward_function contract); empty: verl's
REWARD_FUNCTION_NAME="${REWARD_FUNCTION_NAME:-compute_score}"   # its function
# -- The reward model: where its servers run, and how it was trained ------------------------------------------------
CONFIG_USE_SEPARATE_REWARD_NODE="${CONFIG_USE_SEPARATE_REWARD_NODE:-false}"  # true: the last node serves rewards only
CONFIG_REWARD_DEVICE="${CONFIG_REWARD_DEVICE:-cuda}"            # cuda | cpu
CONFIG_REWARD_GPUS="${CONFIG_REWARD_GPUS:-0}"                   # shared placement: GPUs of the head for reward servers
REWARD_REPLICAS="${REWARD_REPLICAS:-$CONFIG_GPUS_PER_NODE}"     # separate placement: servers (one per GPU) on that node
# How the reward model was trained (python -m reward_score.check_format MODEL PAIRS says which; --help of the server):
CONFIG_REWARD_INPUT="${CONFIG_REWARD_INPUT:-conversation}"      # conversation | completion (TRL <= 0.23, prompt column)
CONFIG_REWARD_ADD_SPECIAL_TOKENS="${CONFIG_REWARD_ADD_SPECIAL_TOKENS:-auto}"  # auto | true | false: the tokenizer's BOS
CONFIG_REWARD_CHAT_TEMPLATE="${CONFIG_REWARD_CHAT_TEMPLATE:-auto}"  # auto | off (trained on plain text)
CONFIG_REWARD_APPEND_EOS="${CONFIG_REWARD_APPEND_EOS:-auto}"    # auto | true | false (plain text only)
# -- What to train: the article's GRPO by default ---------------------------------------------------------------------
ALGORITHM="${ALGORITHM:-grpo}"                                  # grpo | ppo (GAE, with a critic) | dapo
TRAINER_MODE="${TRAINER_MODE:-sync}"                            # sync | one_step_off (rollout on its own GPUs; vllm)
STRATEGY="${STRATEGY:-megatron}"                                # megatron | fsdp2
ROLLOUT_MODE="${ROLLOUT_MODE:-async}"                           # async (naive reward manager) | sync (batch manager)
ROLLOUT_ENGINE="${ROLLOUT_ENGINE:-sglang}"                      # sglang (the article's image) | vllm (the vLLM image)
REWARD_MANAGER="${REWARD_MANAGER:-auto}"                        # auto: batch (sync), naive (async), dapo (DAPO)
CRITIC_MODEL_PATH="${CRITIC_MODEL_PATH:-}"                      # PPO's critic; empty = the policy
CRITIC_LR="${CRITIC_LR:-1e-5}"                                  # PPO's critic learning rate
CRITIC_CLIPRANGE_VALUE="${CRITIC_CLIPRANGE_VALUE:-auto}"        # PPO's value clip; auto = reward range/2 (training.md)
DAPO_DYNAMIC_SAMPLING="${DAPO_DYNAMIC_SAMPLING:-false}"         # true: recipe.dapo's group filtering (sync rollout)
OVERLONG_BUFFER_LEN="${OVERLONG_BUFFER_LEN:-0}"                 # DAPO's soft length penalty zone; 0 = a quarter
OVERLONG_PENALTY_FACTOR="${OVERLONG_PENALTY_FACTOR:-auto}"      # DAPO's penalty at full length; auto = reward range/2
ROLLOUT_GPUS_PER_NODE="${ROLLOUT_GPUS_PER_NODE:-0}"             # one_step_off: GPUs per node for generation only
# -- Tuning: the article's training settings (corrected) -------------------------------------------------------------
TRAIN_BATCH_SIZE="${TRAIN_BATCH_SIZE:-256}"                     # prompts per step
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-2048}"                  # tokens; longer prompts are dropped (counted)
MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-4096}"              # tokens generated per response at most
ACTOR_LR="${ACTOR_LR:-1e-6}"                                    # the policy's learning rate
PPO_MINI_BATCH_SIZE="${PPO_MINI_BATCH_SIZE:-128}"               # prompts per policy update
MICRO_BATCH_PER_GPU="${MICRO_BATCH_PER_GPU:-auto}"              # auto | N: micro-batches of N x 6144 tokens per GPU (>= 1 sequence); auto: the Megatron plan's, fsdp2 4
ACTOR_PP="${ACTOR_PP:-2}"                                       # Megatron pipeline parallel (actor, ref and critic)
ACTOR_TP="${ACTOR_TP:-1}"                                       # Megatron tensor parallel (actor, ref and critic)
MEGATRON_RECOMPUTE="${MEGATRON_RECOMPUTE:-auto}"                # auto | full | selective | off: Megatron activation recompute (training.md)
FUSED_KERNELS="${FUSED_KERNELS:-auto}"                          # auto | on | off: verl's fused log-prob kernels, no [tokens x vocab] logits (Megatron; training.md)
OPTIMIZER_OFFLOAD="${OPTIMIZER_OFFLOAD:-auto}"                  # auto | on | off: the Megatron optimizer in host memory between updates
CONFIG_GPU_MEMORY_GIB="${CONFIG_GPU_MEMORY_GIB:-auto}"          # auto | GiB: the card the Megatron plan is for (auto: the GPU seen; none: 80 GB)
ROLLOUT_TP="${ROLLOUT_TP:-1}"                                   # rollout engine tensor parallel
ROLLOUT_N="${ROLLOUT_N:-4}"                                     # responses per prompt (the GRPO group)
ROLLOUT_GPU_MEMORY="${ROLLOUT_GPU_MEMORY:-auto}"                # rollout engine's share (SGLang: of the GPU's free memory); auto: 0.4, one_step_off 0.65-0.9
ROLLOUT_ENFORCE_EAGER="${ROLLOUT_ENFORCE_EAGER:-false}"         # true: no SGLang CUDA graphs (slower; debugging)
KL_LOSS_COEF="${KL_LOSS_COEF:-0.001}"                           # weight of the KL loss to the reference policy
# Validation sampling, the Qwen3 thinking cards' values (greedy decoding makes them repeat to the length limit):
VAL_DO_SAMPLE="${VAL_DO_SAMPLE:-true}"                          # false: greedy (async rollout: VAL_TEMPERATURE=0 too)
VAL_TEMPERATURE="${VAL_TEMPERATURE:-0.6}"                       # Instruct-2507 cards: 0.7
VAL_TOP_P="${VAL_TOP_P:-0.95}"                                  # Instruct-2507 cards: 0.8
VAL_TOP_K="${VAL_TOP_K:-20}"                                    # -1: off; sync rollout only (verl's agent loop drops it)
TOTAL_EPOCHS="${TOTAL_EPOCHS:-1}"                               # passes over the training prompts
SAVE_FREQ="${SAVE_FREQ:-auto}"                                  # save every N steps; auto: 25, or every ~30 min where a preemption saves nothing
TEST_FREQ="${TEST_FREQ:-5}"                                     # validate every N steps
VAL_BEFORE_TRAIN="${VAL_BEFORE_TRAIN:-auto}"                    # validate before step 1: auto (not on a resume) | true | false
MAX_CKPT_TO_KEEP="${MAX_CKPT_TO_KEEP:-2}"                       # actor and critic checkpoints kept (~56 GB each for 4B)
PROJECT_NAME="${PROJECT_NAME:-$WANDB_PROJECT}"                  # trainer.project_name
EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_4b_grpo_megatron}"    # trainer.experiment_name; the wandb run's name
TRAINER_LOGGER="${TRAINER_LOGGER:-[console,wandb]}"             # trainer.logger
# -- The job's own behaviour: dry runs, checks, time limits, restarts, ports ------------------------------------------
PREFLIGHT_ONLY="${PREFLIGHT_ONLY:-0}"                           # 1: run the checks, start nothing
CANARY="${CANARY:-0}"                                           # 1: train 2 steps, resume, merge, on a tiny workload
CANARY_KEEP="${CANARY_KEEP:-0}"                                 # 1: keep the canary's checkpoints when it passes
PREFLIGHT_DATA="${PREFLIGHT_DATA:-1}"                           # check every row, then read train/val through verl's RLHFDataset
PREFLIGHT_REWARD="${PREFLIGHT_REWARD:-1}"                       # score a few rows through a reward server first
PREFLIGHT_REWARD_DEVICE="${PREFLIGHT_REWARD_DEVICE:-auto}"      # the preflight's reward server: auto | cpu | cuda
CHECKPOINT_BEFORE_END="${CHECKPOINT_BEFORE_END:-1800}"          # s before the time limit verl saves (> --signal's 900)
ESI_REDUNDANT_TIME="${ESI_REDUNDANT_TIME:-auto}"                # s that window adds for validation + save; auto: measured
REQUEUE_BEFORE_TIMEOUT="${REQUEUE_BEFORE_TIMEOUT:-1}"           # on the time-limit signal, requeue unless finished
PREEMPT_SAVE="${PREEMPT_SAVE:-1}"                               # preempted: save after this step if the grace allows, requeue
REWARD_START_TIMEOUT="${REWARD_START_TIMEOUT:-900}"             # seconds for reward servers to become healthy
REWARD_RESTARTS="${REWARD_RESTARTS:-3}"                         # a reward server that dies is restarted this often; one more stops the job
RAY_JOIN_TIMEOUT="${RAY_JOIN_TIMEOUT:-600}"                     # seconds for every node to join Ray
RAY_START_RETRIES="${RAY_START_RETRIES:-3}"                     # `ray start` attempts on every node, the head too
STOP_TIMEOUT="${STOP_TIMEOUT:-20}"                              # s to stop servers and Ray (< Slurm's KillWait, 30 s)
CONFIG_REWARD_SERVER_PORT="${CONFIG_REWARD_SERVER_PORT:-}"     # first reward server port (+1, ...); empty = per job
REWARD_SERVER_TOKEN="${REWARD_SERVER_TOKEN:-}"                  # reward servers' bearer token; empty = new per job
# -- A hung trainer: the stall watchdog (docs/operations.md#a-hung-job) -------------------------------------------
# A trainer that finishes no step for too long is hung: the head's watchdog keeps every worker's stack (stall/) and
# stops the start. auto gives a step 3 x the longest so far (a validation or save 3 x its longest), >= STALL_FLOOR.
STALL_TIMEOUT="${STALL_TIMEOUT:-auto}"                          # auto | off | s a step may take (after the first)
STALL_FLOOR="${STALL_FLOOR:-1800}"                              # s: auto never gives a step less
STALL_FIRST_STEP="${STALL_FIRST_STEP:-3600}"                    # s for a start's first step, first validation, save
STALL_REQUEUE="${STALL_REQUEUE:-1}"                             # 1: requeue once on a stall (a second in a row: failed)
set +a
# ------------------------------------------------------------------------------------------------------------------
# Not settings (docs/development.md): what runs `-m verl.trainer.main_ppo ...` (a site's wrapper, `nsys profile`);
# TRAINER_IS_VERL=0 where that is no verl trainer (the tests' stand-in).
export TRAINER_LAUNCHER="${TRAINER_LAUNCHER:-python3}" TRAINER_IS_VERL="${TRAINER_IS_VERL:-1}"

# shellcheck source=launch/job/common.sh
source "$repo/launch/job/common.sh"
# shellcheck source=launch/watch/canary.sh
source "$repo/launch/watch/canary.sh"

job_id=${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}
job_log_dir="$CONFIG_LOG_DIR/${job_id}${SLURM_RESTART_COUNT:+-r$SLURM_RESTART_COUNT}"
srun_pid=""
requeued=0  # set once this start asked Slurm to requeue the job
# In an interactive allocation's shell (salloc) the job runs there: no requeue, its output also in CONFIG_LOG_DIR.
interactive=0
[[ -z "${SLURM_JOB_ID:-}" || "${ENVIRONMENT:-}" == BATCH ]] || interactive=1
step_name="grpo-$$"  # the nodes' srun step, by name, to stop it inside an interactive allocation
wrap=()  # container_cmd's prefix, once the settings are final (main)

# export_settings: the settings' paths made absolute for every node, and what the job derives from them.
export_settings() {
  local name
  for name in CONFIG_IMAGE_PATH CONFIG_MODEL_PATH CONFIG_REWARD_MODEL_PATH CONFIG_TRAIN_FILE CONFIG_TEST_FILE \
    CONFIG_OUTPUT_DIR CONFIG_LOG_DIR HF_HOME REWARD_FUNCTION_PATH; do
    [[ -z "${!name}" ]] || printf -v "$name" '%s' "$(realpath -m "${!name}")"
  done
  export JOB_LOG_DIR=$job_log_dir JOB_ID=$job_id
  # The servers require it, the health poll proves with it that a server is ours; never printed, environment only.
  [[ -n "$REWARD_SERVER_TOKEN" ]] || REWARD_SERVER_TOKEN=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
  export REWARD_SERVER_TOKEN
  # Ray 2.52+'s token authentication with a token of the job's own: a ~/.ray/auth_token left by the user's own Ray
  # would otherwise turn it on and refuse the job's clients (2.49 ignores both); nobody else can use the job's Ray.
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN
  RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  export_wandb_run
  # verl's tensorboard logger (TRAINER_LOGGER=[console,tensorboard]) writes there, per start as wandb's runs
  TENSORBOARD_DIR=$(realpath -m "${TENSORBOARD_DIR:-$job_log_dir/tensorboard}")
  export TENSORBOARD_DIR
  ((!interactive)) || export REQUEUE_BEFORE_TIMEOUT=0  # the preflight's save-deadline checks: no requeue signal
  export_checkpoint_deadline
  export RAY_TMP_DIR="${RAY_TMP_DIR:-/tmp/ray_${job_id}}"
  export_ray_cpus
}

# export_ray_cpus: Ray's CPUs per node (RAY_NUM_CPUS) and where that came from (RAY_NUM_CPUS_FROM), for the
# preflight; PREFLIGHT_ONLY=1 outside Slurm checks this header's --cpus-per-task, not the login node's CPUs.
export_ray_cpus() {
  local cpus=${SLURM_JOB_CPUS_PER_NODE:-} header
  cpus=${cpus%%[(,]*}
  header=$(sbatch_value "${BASH_SOURCE[0]}" cpus-per-task)
  if [[ -n "${RAY_NUM_CPUS:-}" ]]; then
    RAY_NUM_CPUS_FROM=RAY_NUM_CPUS
  elif [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    RAY_NUM_CPUS=$SLURM_CPUS_PER_TASK RAY_NUM_CPUS_FROM="the job's --cpus-per-task"
  elif [[ -n "$cpus" ]]; then
    RAY_NUM_CPUS=$cpus RAY_NUM_CPUS_FROM="the CPUs Slurm gave this job's node, SLURM_JOB_CPUS_PER_NODE"
  elif [[ "$PREFLIGHT_ONLY" == 1 && -n "$header" ]]; then
    RAY_NUM_CPUS=$header RAY_NUM_CPUS_FROM="#SBATCH --cpus-per-task=$header, what sbatch gives each node"
  else
    RAY_NUM_CPUS=$(nproc) RAY_NUM_CPUS_FROM="this machine's CPUs, nproc"
  fi
  # Ray's logical count, which may exceed the node's CPUs (srun's step gets the allocation's, whatever this says)
  [[ "$RAY_NUM_CPUS" =~ ^[1-9][0-9]*$ ]] || die "RAY_NUM_CPUS=$RAY_NUM_CPUS ($RAY_NUM_CPUS_FROM): Ray's CPUs per node" \
    "must be a whole number of at least 1; leave it unset for the job's --cpus-per-task. Nothing was started"
  export RAY_NUM_CPUS RAY_NUM_CPUS_FROM
}

# export_wandb_run: the wandb run of each start (docs/operations.md: online one run for the job, resumed by every
# requeue; offline each start its own, in the job's group).
export_wandb_run() {
  local run_id=${WANDB_RUN_ID:-${EXPERIMENT_NAME}-${job_id}}
  run_id=${run_id//[^A-Za-z0-9_.-]/_}
  export WANDB_RUN_GROUP="${WANDB_RUN_GROUP:-$run_id}"
  if [[ "$WANDB_MODE" == offline ]]; then
    export WANDB_RUN_ID="${run_id}${SLURM_RESTART_COUNT:+-r$SLURM_RESTART_COUNT}"
  else
    export WANDB_RUN_ID=$run_id WANDB_RESUME="${WANDB_RESUME:-allow}"
  fi
  # Per start, beside its logs; `wandb sync` reads the offline runs from there (WANDB_DIR/wandb/offline-run-*).
  WANDB_DIR=$(realpath -m "${WANDB_DIR:-$job_log_dir/wandb}")
  export WANDB_DIR
}

# export_checkpoint_deadline: the job's end (JOB_END_TIME) and verl's save-before-expiry time, CHECKPOINT_BEFORE_END
# before it (launch/plan/deadline.py); JOB_SIGNAL_LEAD: this header's --signal=B:USR1@N; for what a preemption costs,
# the job's partition (JOB_PARTITION; empty: the default), every partition and Slurm's preemption settings.
export_checkpoint_deadline() {
  local end=${SLURM_JOB_END_TIME:-}
  JOB_PARTITION=${SLURM_JOB_PARTITION:-${SBATCH_PARTITION:-$(sbatch_value "${BASH_SOURCE[0]}" partition)}}
  JOB_PARTITIONS=$(timeout 5 scontrol show partition -o 2>/dev/null || true)
  JOB_SLURM_CONFIG=$(timeout 5 scontrol show config 2>/dev/null | grep -E '^(PreemptType|SlurmctldParameters) ' || true)
  export JOB_PARTITION JOB_PARTITIONS JOB_SLURM_CONFIG
  if [[ -z "$end" && -n "${SLURM_JOB_ID:-}" ]]; then
    end=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'EndTime=[^ ]*' | cut -d= -f2 || true)
    end=$(date -d "$end" +%s 2>/dev/null || true)
  fi
  # Slurm shows a job its --signal nowhere: one given to sbatch instead of this header needs JOB_SIGNAL_LEAD=N too.
  [[ -n "${JOB_SIGNAL_LEAD:-}" ]] || JOB_SIGNAL_LEAD=$(sbatch_value "${BASH_SOURCE[0]}" signal | sed -n 's/.*@//p')
  export JOB_SIGNAL_LEAD=${JOB_SIGNAL_LEAD:-0}
  if [[ "$end" =~ ^[0-9]+$ ]]; then
    export JOB_END_TIME=$end MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP=$((end - CHECKPOINT_BEFORE_END))
    log "the job ends at $(date -d "@$end" '+%F %T') (the preflight says what verl saves before that)"
  fi
}

# container_cmd: the prefix (NUL-separated) that runs a command the way every node will: in the image, or as is.
container_cmd() {
  [[ "$CONTAINER" != none ]] || return 0
  local -a binds=(--bind "$repo" --bind "$CONFIG_LOG_DIR" --bind "$CONFIG_OUTPUT_DIR" --bind "$HF_HOME")
  [[ "$WANDB_DIR/" == "$CONFIG_LOG_DIR/"* ]] || binds+=(--bind "$WANDB_DIR")  # a WANDB_DIR set elsewhere
  [[ "$TENSORBOARD_DIR/" == "$CONFIG_LOG_DIR/"* ]] || binds+=(--bind "$TENSORBOARD_DIR")
  local dir inputs=("$CONFIG_MODEL_PATH" "$(dirname "$CONFIG_TRAIN_FILE")" "$(dirname "$CONFIG_TEST_FILE")")
  [[ "$REWARD" == rule ]] || inputs+=("$CONFIG_REWARD_MODEL_PATH")  # REWARD=rule: no reward model anywhere
  [[ -z "$REWARD_FUNCTION_PATH" ]] || inputs+=("$(dirname "$REWARD_FUNCTION_PATH")")
  # A missing one is not bound: the runtime's mount error would name no setting, the preflight's names it.
  for dir in "${inputs[@]}"; do [[ ! -d "$dir" ]] || binds+=(--bind "$dir"); done
  printf '%s\0' "$CONTAINER" exec --nv "${binds[@]}" --pwd "$repo" --env "PYTHONPATH=$repo" "$CONFIG_IMAGE_PATH"
}

# preflight: what must be checked before Python runs in the image, then launch.plan.preflight in one container start.
preflight() {
  log_phase "checks: settings, files, and the trainer config through verl's own code"
  check_container
  local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}  # salloc's shell has only the latter (e.g. gpu:4)
  gpus=${gpus##*:}
  if [[ -n "$gpus" && "$gpus" != "$CONFIG_GPUS_PER_NODE" ]]; then
    die "Slurm gave $gpus GPUs per node but CONFIG_GPUS_PER_NODE=$CONFIG_GPUS_PER_NODE: make #SBATCH --gpus-per-node match"
  fi
  # Its stderr also goes to preflight.err, the job's record of why it failed (launch.watch.status reads it): through a
  # pipe, complete when the pipeline ends (pipefail: the preflight's status); tee -i outlives a Ctrl-C to the preflight.
  { (cd "$repo" && "${wrap[@]}" python3 -m launch.plan.preflight "$@") 2>&1 >&3 |
    tee -ai "$job_log_dir/preflight.err" >&2; } 3>&1 ||
    die "the preflight failed (above: the settings, verl's config checks, the data or the reward check); nothing was started"
  # REWARD_PROMPT_OPENS_THINK=auto as the preflight read it from the chat template, for every node's trainer command.
  if [[ "$REWARD_PROMPT_OPENS_THINK" == auto && -f "$job_log_dir/prompt_opens_think" ]]; then
    REWARD_PROMPT_OPENS_THINK=$(<"$job_log_dir/prompt_opens_think")
    export REWARD_PROMPT_OPENS_THINK
  fi
  # The Megatron plan's auto knobs as the preflight chose them (launch/plan/megatron_plan.py), likewise.
  local pair
  if [[ -f "$job_log_dir/megatron_plan" ]]; then
    while IFS= read -r pair; do export "${pair?}"; done <"$job_log_dir/megatron_plan"
  fi
  log "checks passed"
}

requeue() {
  if scontrol requeue "$SLURM_JOB_ID"; then
    requeued=1
  else
    err "scontrol requeue failed; resubmit by hand to resume"
  fi
}

# preempt_time: when Slurm chose to preempt this job (scontrol show job's PreemptTime); empty when it did not.
preempt_time() {
  [[ -z "${SLURM_JOB_ID:-}" ]] ||
    timeout 5 scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* PreemptTime=\([0-9T:-]*\).*/\1/p' || true
}

# on_usr1: the job's --signal before the time limit, or a preemption (then the job has a PreemptTime).
on_usr1() {
  local preempted
  preempted=$(preempt_time)
  # if/else, not `|| { on_time_limit; return; }`: a bare return in a trap handler returns the status of the command
  # it interrupted (wait's 138), and set -e then ends the script before Slurm's SIGTERM reaches its trap.
  if [[ -n "$preempted" ]]; then
    on_preempted "$preempted"
  else
    on_time_limit
  fi
}

# on_preempted TIME: where a step, its validation, a save and the stop fit in the grace left (launch/job/preempt.py;
# never in a recipe), verl saves after the step it is in; the job requeues itself (at once where no save can come).
on_preempted() {
  local grace left line tracker="$CONFIG_OUTPUT_DIR/latest_checkpointed_iteration.txt" before="" deadline
  if [[ "$PREEMPT_SAVE" != 1 ]]; then
    log "preempted: PREEMPT_SAVE=$PREEMPT_SAVE, so no save and no requeue; Slurm stops the job when its grace ends"
    return 0
  fi
  grace=$(timeout 5 scontrol show partition "${SLURM_JOB_PARTITION:-}" 2>/dev/null | sed -n 's/.*GraceTime=\([0-9]*\).*/\1/p')
  left=$(($(date -d "$1" +%s) + ${grace:-0} - $(date +%s)))
  [[ ! -f "$tracker" ]] || before=$(<"$tracker")
  if line=$(cd "$repo" && "${wrap[@]}" python3 -m launch.job.preempt "$job_log_dir" "$left" "$STOP_TIMEOUT"); then
    log "$line"
    : >"$job_log_dir/preempt_requested"  # verl's trainer sees it at the end of the step (launch.job.preempt.install)
    deadline=$((SECONDS + left - STOP_TIMEOUT - 15))
    while alive "$srun_pid" && ((SECONDS < deadline)) && [[ "$(cat "$tracker" 2>/dev/null)" == "$before" ]]; do
      sleep 1
    done
    if [[ "$(cat "$tracker" 2>/dev/null)" != "$before" ]]; then
      log "preempted: verl saved step $(<"$tracker"); requeueing job $SLURM_JOB_ID, which resumes there"
    else
      err "preempted: no save within the grace; requeueing job $SLURM_JOB_ID, which resumes from ${before:-the start}"
    fi
  else
    log "${line:-preempted: launch.job.preempt failed (above)}; requeueing job $SLURM_JOB_ID, which resumes from" \
      "${before:-the start}"
  fi
  requeue
}

on_time_limit() {
  if [[ -e "$CONFIG_OUTPUT_DIR/TRAINING_DONE" ]]; then
    log "time-limit signal, but training already finished: no requeue"
  elif [[ "$REQUEUE_BEFORE_TIMEOUT" == 1 && -n "${SLURM_JOB_ID:-}" ]]; then
    log "time-limit signal: requeueing job $SLURM_JOB_ID; it resumes from $CONFIG_OUTPUT_DIR (resume_mode=auto)"
    requeue
  else
    log "time-limit signal: not requeueing (REQUEUE_BEFORE_TIMEOUT=$REQUEUE_BEFORE_TIMEOUT)"
  fi
}

# on_stall: the watchdog stopped this start, hung (stall.json): requeue once, unless the start before stalled too.
on_stall() {
  local restarts=${SLURM_RESTART_COUNT:-0} previous=""
  ((restarts == 0)) || previous="$CONFIG_LOG_DIR/${job_id}$( ((restarts == 1)) || printf -- '-r%s' $((restarts - 1)))"
  if [[ -n "$previous" && -s "$previous/stall.json" ]]; then
    err "the trainer stalled in two starts in a row ($previous, then this one): not requeueing; the job ends failed" \
      "(the stacks: $job_log_dir/stall)"
  elif [[ "$STALL_REQUEUE" == 1 && -n "${SLURM_JOB_ID:-}" ]] && ((!interactive)); then
    log "the trainer stalled: requeueing job $SLURM_JOB_ID once (STALL_REQUEUE=1); it resumes from $CONFIG_OUTPUT_DIR," \
      "and a second stall in a row ends it failed"
    requeue
  else
    log "the trainer stalled: not requeueing (STALL_REQUEUE=$STALL_REQUEUE; an interactive allocation never does)"
  fi
}

# on_stop_signal CODE: SIGTERM/SIGINT (scancel, Ctrl-C, a requeue, a preemption without grace): stop every node.
on_stop_signal() {
  if ((requeued)); then
    log "stopping this start for the requeue (within STOP_TIMEOUT=$STOP_TIMEOUT s); Slurm starts the job again" \
      "in a few minutes (its logs: $CONFIG_LOG_DIR/${job_id}-r$((${SLURM_RESTART_COUNT:-0} + 1)))"
  elif [[ "$1" == 143 && -n "$(preempt_time)" ]]; then
    log "preempted without a grace to save in (docs/operations.md#preemption): stopping every node; a requeued start" \
      "resumes from the last save (SAVE_FREQ=$SAVE_FREQ)"
  else
    log "stop signal: stopping the job on every node (within STOP_TIMEOUT=$STOP_TIMEOUT s)"
  fi
  exit "$1"
}

# stop_step: in an interactive allocation, SIGTERM to the nodes' srun step (srun itself would SIGKILL them), then wait.
stop_step() {
  local step deadline=$((SECONDS + STOP_TIMEOUT + 15))
  step=$(squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format='%i %j' | awk -v n="$step_name" '$2 == n {print $1}') ||
    step=""
  if [[ -z "$step" ]] || ! scancel --signal=TERM "$step"; then
    err "could not signal the nodes' step ${step:-(not found)} of job $SLURM_JOB_ID: its processes are killed instead"
    return 0
  fi
  while alive "$srun_pid" && ((SECONDS < deadline)); do sleep 0.5; done
}

cleanup() {
  local rc=$?
  # A second SIGTERM while stopping is ignored, as in the helper's cleanup; a second Ctrl-C still stops at once.
  trap - EXIT INT
  trap '' TERM
  if ((interactive)) && [[ -n "$srun_pid" ]]; then
    stop_step
  fi
  # The helpers stop their own processes within STOP_TIMEOUT: give them that and a margin before killing them.
  [[ -n "$srun_pid" ]] && stop_pids $((STOP_TIMEOUT + 15)) "$srun_pid"
  # Every start's end, for launch.watch.status: a run outside Slurm has no output file that says it.
  [[ ! -d "$job_log_dir" ]] || printf '%s\n' "$rc" >"$job_log_dir/exit" || true
  log "run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=$rc; logs: $job_log_dir)"
  exit "$rc"
}

launch() {
  local -a nodes runner
  local cpus
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else
    nodes=("$(hostname)")
  fi
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # The allocation's CPUs, explicitly: srun of Slurm 22.05-23.02 does not inherit --cpus-per-task (one core a
    # node); without one, the fewest CPUs Slurm gave a node. Not RAY_NUM_CPUS, which may exceed the allocation.
    cpus=${SLURM_CPUS_PER_TASK:-$(tr , '\n' <<<"${SLURM_JOB_CPUS_PER_NODE:-}" | sed 's/(.*//' | sort -n | head -n 1)}
    runner=(srun --nodes="${#nodes[@]}" --ntasks="${#nodes[@]}" --ntasks-per-node=1 --kill-on-bad-exit=1)
    [[ -z "$cpus" ]] || runner+=(--cpus-per-task="$cpus")
    ((!interactive)) || runner+=(--job-name="$step_name")
  fi
  log_phase "launching on ${#nodes[@]} node(s): ${nodes[*]} (head ${nodes[0]})"
  # Background + wait, so the time-limit signal's trap runs while the job is still going.
  "${runner[@]}" "${wrap[@]}" bash "$repo/helper_grpo_qwen3_4b.sh" "$@" &
  srun_pid=$!
  local rc=0
  wait "$srun_pid" || rc=$?
  # >128: a trapped signal interrupted the wait while the job itself still runs: wait again.
  while ((rc > 128)) && alive "$srun_pid"; do
    rc=0
    wait "$srun_pid" || rc=$?
  done
  srun_pid=""
  return "$rc"
}

main() {
  trap cleanup EXIT
  trap on_usr1 USR1
  trap 'on_stop_signal 130' INT
  trap 'on_stop_signal 143' TERM
  export_settings
  [[ "$CANARY" != 1 ]] || canary_settings  # its own folder and a tiny workload (launch/watch/canary.sh)
  mapfile -d '' -t wrap < <(container_cmd)
  # WANDB_DIR before anything starts: where wandb cannot write it, it logs to /tmp of some node.
  mkdir -p "$job_log_dir" "$CONFIG_OUTPUT_DIR" "$HF_HOME" "$WANDB_DIR" ||
    die "could not create the job's folders (above: CONFIG_LOG_DIR, CONFIG_OUTPUT_DIR, HF_HOME or WANDB_DIR)"
  [[ -w "$WANDB_DIR" ]] || die "WANDB_DIR=$WANDB_DIR is not writable: wandb would log to /tmp of some node instead"
  [[ "$TENSORBOARD_DIR/" == "$CONFIG_LOG_DIR/"* ]] || mkdir -p "$TENSORBOARD_DIR" ||
    die "could not create TENSORBOARD_DIR=$TENSORBOARD_DIR (the container binds it)"
  if ((interactive)); then
    # No Slurm output file in an allocation's shell: every line also goes to one, as a batch job's would.
    local out="$CONFIG_LOG_DIR/${SLURM_JOB_NAME:-interactive}-${job_id}.out"
    exec > >(trap '' INT TERM && exec tee -a "$out") 2> >(trap '' INT TERM && exec tee -a "$out" >&2)
    log "in the interactive allocation of job $job_id: the job runs here and never requeues; Ctrl-C (once) stops" \
      "everything it started; this output is also in $out"
  fi
  log_phase "job $job_id: logs in $job_log_dir"
  # What this start is, for launch.watch.status (a preflight only, the canary, or training)
  local kind=training
  [[ "$CANARY" != 1 ]] || kind=canary
  [[ "$PREFLIGHT_ONLY" != 1 ]] || kind="preflight only"
  printf '%s\n' "$kind" >"$job_log_dir/kind"
  # The Ray token for your own `ray status` into the running job (docs/operations.md, Inside a running job): yours only.
  (umask 077 && printf '%s' "$RAY_AUTH_TOKEN" >"$job_log_dir/ray_auth_token")
  log "to merge its checkpoints later: $(merge_sbatch_command "$repo") (docs/merge.md)"
  if [[ -e "$CONFIG_OUTPUT_DIR/TRAINING_DONE" && "$PREFLIGHT_ONLY" != 1 ]]; then
    log "$CONFIG_OUTPUT_DIR/TRAINING_DONE exists: this training already finished; remove it to train again"
    return 0
  fi
  preflight "$@" "${canary_train_overrides[@]}"
  if [[ "$PREFLIGHT_ONLY" == 1 ]]; then
    log "PREFLIGHT_ONLY=1: nothing started"
    if [[ -z "${SLURM_JOB_ID:-}" ]]; then
      # The checks passed: the folder held only their reward server's log (a failed preflight keeps it).
      rm -rf -- "$job_log_dir"
      job_log_dir="none kept (the checks passed; their output is above)"
    fi
    return 0
  fi
  if [[ "$CANARY" == 1 ]]; then
    run_canary "$@"
    return
  fi
  # verl prunes only its own saves: what earlier starts of this job left goes here (never the one it resumes from).
  (cd "$repo" && "${wrap[@]}" python3 -m launch.job.checkpoints "$CONFIG_OUTPUT_DIR" "$MAX_CKPT_TO_KEEP") ||
    die "could not prune old checkpoints in $CONFIG_OUTPUT_DIR (MAX_CKPT_TO_KEEP=$MAX_CKPT_TO_KEEP)"
  local rc=0
  launch "$@" || rc=$?
  [[ ! -s "$job_log_dir/stall.json" ]] || on_stall
  return "$rc"
}

main "$@"
