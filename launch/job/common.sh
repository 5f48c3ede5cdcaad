# shellcheck shell=bash
# launch/job/common.sh: logging, waiting and cleanup shared by the entry scripts (sourced, not run).

# Timestamped messages: log to stdout, err/die to stderr.
log() { printf '[%s] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$*"; }
err() { printf '[%s] ERROR: %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$*" >&2; }
die() {
  err "$*"
  exit 1
}

# log_phase NAME: a marker per phase, with the seconds since the script started, so the log shows where time went.
log_phase() { log "=== $* (+${SECONDS}s)"; }

# show_tail FILE [LINES]: the end of a log, indented, to stderr.
show_tail() {
  local file=$1 lines=${2:-30}
  if [[ -f "$file" ]]; then
    printf -- '--- last %s lines of %s ---\n' "$lines" "$file" >&2
    tail -n "$lines" "$file" | sed 's/^/    /' >&2
  else
    printf -- '--- (no log at %s) ---\n' "$file" >&2
  fi
}

# alive PID: the process runs (an exited child not yet reaped is a zombie: kill -0 still succeeds on it).
alive() {
  local state
  kill -0 "$1" 2>/dev/null || return 1
  state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [[ -n "$state" && "$state" != Z ]]
}

# http_probe URL TOKEN: one GET with a 5 s limit, with this job's token; prints `ours` (200 from a server that checked
# the token), `theirs` (401 to this token, or a 200 that checked none: another job's server) or the status (`000` when
# nothing answers). The header goes through stdin, never the command line. Never through a proxy: curl would send
# even 127.0.0.1 to the one http_proxy or all_proxy names.
http_probe() {
  local url=$1 token=$2 answer status
  # A failing probe is expected while a server loads: no -e here, the status is read.
  answer=$(printf 'Authorization: Bearer %s\n' "$token" |
    curl --silent --noproxy '*' --header @- --write-out '\n%{http_code}' --max-time 5 "$url" || true)
  status=${answer##*$'\n'}
  if [[ "$status" == 200 && "$answer" == *'"auth":true'* ]]; then
    echo ours
  elif [[ "$status" == 200 || "$status" == 401 ]]; then
    echo theirs
  else
    echo "${status:-000}"
  fi
}

# wait_for_http URL PID LOG TIMEOUT TOKEN: poll URL until this job's server answers 200, failing fast if PID dies.
# Only a server that checks tokens and took this one counts: another job's server answers 401 and fails the wait at
# once, naming the port.
wait_for_http() {
  local url=$1 pid=$2 logfile=$3 timeout=$4 token=$5
  local deadline=$((SECONDS + timeout)) status=""
  while ((SECONDS < deadline)); do
    if ! alive "$pid"; then
      err "the process behind $url (pid $pid) exited before it was ready"
      show_tail "$logfile"
      return 1
    fi
    status=$(http_probe "$url" "$token")
    case "$status" in
      ours) return 0 ;;
      theirs)
        err "$url is another job's server: it answers 401 to this job's token, or 200 without checking it (our" \
          "server, pid $pid, is not it)"
        return 1
        ;;
    esac
    sleep 1
  done
  err "$url not ready after ${timeout} s (last HTTP status: ${status:-none})"
  show_tail "$logfile"
  return 1
}

# wait_for_file PATH TIMEOUT: poll until PATH exists.
wait_for_file() {
  local deadline=$((SECONDS + $2))
  until [[ -e "$1" ]]; do
    ((SECONDS < deadline)) || return 1
    sleep 1
  done
}

# wait_for_log FILE TEXT PID TIMEOUT: poll until FILE contains TEXT; fail if PID dies first.
wait_for_log() {
  local file=$1 text=$2 pid=$3 timeout=$4
  local deadline=$((SECONDS + timeout))
  while ((SECONDS < deadline)); do
    grep -qF "$text" "$file" 2>/dev/null && return 0
    alive "$pid" || return 1
    sleep 1
  done
  return 1
}

# stop_pids TIMEOUT PID...: SIGTERM each process group (or the process, if it leads none), wait until every member
# is gone (a group outlives its leader: Ray's GCS after `ray start`), then SIGKILL what is left after TIMEOUT seconds.
stop_pids() {
  local timeout=$1
  shift
  local pid deadline=$((SECONDS + timeout))
  for pid in "$@"; do
    kill -TERM -- "-$pid" 2>/dev/null || { alive "$pid" && kill -TERM "$pid" 2>/dev/null; } || true
  done
  for pid in "$@"; do
    while { alive "$pid" || kill -0 -- "-$pid" 2>/dev/null; } && ((SECONDS < deadline)); do sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || { alive "$pid" && kill -KILL "$pid" 2>/dev/null; } || true
  done
  return 0
}

# start_bg LOG CMD...: run CMD in its own process group (so stop_pids ends its children too); sets BG_PID. It stays
# this shell's child (setsid execs in place: a background job of a script leads no group), so `wait` gets its status.
# START_BG_APPEND=1: append to LOG (a restarted server keeps the log of its earlier lives).
# shellcheck disable=SC2034  # BG_PID is read by the caller
start_bg() {
  local logfile=$1
  shift
  [[ "${START_BG_APPEND:-0}" == 1 ]] || : >"$logfile"
  setsid "$@" >>"$logfile" 2>&1 </dev/null &
  BG_PID=$!
}

# exit_reason STATUS LOG: why a child that died did, from its exit status (`wait PID` in the shell that started it:
# a subshell cannot wait for it) and the last error-looking line its log got since it (re)started (after the last
# `=== ... restart` marker).
exit_reason() {
  local rc=$1 logfile=$2 line why
  if ((rc > 128)); then
    why="killed by SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))"
    ((rc != 137)) || why+=" (kill -9, or the kernel's out-of-memory killer)"
  else
    why="exited with $rc"
  fi
  line=$(tac "$logfile" 2>/dev/null | sed '/^=== .* restart /Q' |
    grep -m 1 -E 'ERROR|Error|Exception|error:|Killed|out of memory|Traceback' | cut -c 1-200 || true)
  printf '%s%s\n' "$why" "${line:+; its log: $line}"
}

# check_container: CONTAINER and CONFIG_IMAGE_PATH name a program on PATH and an image that exists (none: no image).
check_container() {
  [[ "$CONTAINER" == none || -f "$CONFIG_IMAGE_PATH" ]] ||
    die "CONFIG_IMAGE_PATH=$CONFIG_IMAGE_PATH: no such image (sudo singularity build verl_app.sif verl_app.def)"
  [[ "$CONTAINER" == none ]] || command -v "$CONTAINER" >/dev/null ||
    die "CONTAINER=$CONTAINER but '$CONTAINER' is not on PATH (module load it, or CONTAINER=apptainer|none)"
}

# --- the one place to edit: the top of run_grpo_qwen3_4b_mega_verl.sh, for merge_mcore_to_hf.sh too -----------------

# load_run_settings REPO: the run script's settings block, evaluated in this shell: each `NAME="${NAME:-default}"` line
# as the user edited it (the environment still wins), so that the merge reads CONFIG_OUTPUT_DIR, CONFIG_IMAGE_PATH
# and CONTAINER where the run script has them.
load_run_settings() {
  local repo=$1  # the block's defaults are written with $repo
  # shellcheck disable=SC1090  # the block of the run script, which shellcheck reads as that script
  source <(sed -n '/^# ---- settings/,/^# ------------/p' "$repo/run_grpo_qwen3_4b_mega_verl.sh")
}

# sbatch_value FILE OPTION: the value of FILE's `#SBATCH --OPTION=` line; nothing when it has none (or `##SBATCH`).
sbatch_value() { sed -n "s/^#SBATCH --$2=\([^ ]*\).*/\1/p" "$1" | head -n 1; }

# merge_sbatch_command REPO: how to submit merge_mcore_to_hf.sh where the run script's jobs go. sbatch reads only the
# submitted script's own #SBATCH lines, and no job writes into a tracked file: the run script's --partition, --account
# and --output, where they differ from the merge's own lines, go on the command line instead.
merge_sbatch_command() {
  local opt value cmd=sbatch
  for opt in partition account output; do
    value=$(sbatch_value "$1/run_grpo_qwen3_4b_mega_verl.sh" "$opt")
    [[ -z "$value" || "$value" == "$(sbatch_value "$1/merge_mcore_to_hf.sh" "$opt")" ]] || cmd+=" --$opt=$value"
  done
  printf '%s merge_mcore_to_hf.sh\n' "$cmd"
}
