"""The main job on tiny models, for a machine without Slurm or GPUs (`make demo`): verl 0.6.1's own trainer on CPU.

Builds a tiny policy and reward model and the demo dataset under demo_out/, then runs the real
run_grpo_qwen3_4b_mega_verl.sh here (no container) as the canary (CANARY=1, docs/operations.md): the preflight, 2 GRPO
steps saved, a resume to step 3, then merge_mcore_to_hf.sh's merge and its numeric check, with a CPU reward server
and a real Ray head. verl's Megatron workers and merger run through cpu/megatron_shims.py, its HF rollout through
cpu/verl_shims.py (docs/verl-on-cpu.md). Exits with the job's code.

    python -m demo.run [--out demo_out]        # what `make demo` runs
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cpu import megatron_shims, verl_shims
from demo.data import write_demo
from demo.tiny_models import build_policy_model, build_reward_model
from launch.plan.procs import free_port

REPO = Path(__file__).resolve().parent.parent
# README.md's quickstart, command for command (tests/test_demo.py compares them).
NEXT_STEPS = [
    "cd /path/to/this/repository",
    "sudo singularity build verl_app.sif verl_app.def",
    "python3 -m data_prep.build prompts.jsonl --out-dir data",
    "$EDITOR run_grpo_qwen3_4b_mega_verl.sh",
    "PREFLIGHT_ONLY=1 bash run_grpo_qwen3_4b_mega_verl.sh",
    "CANARY=1 sbatch --time=01:00:00 run_grpo_qwen3_4b_mega_verl.sh",
    "sbatch run_grpo_qwen3_4b_mega_verl.sh",
    "sbatch merge_mcore_to_hf.sh",
]
# README.md's step 4: the preflight of one's own files on a login node without the image (verl from make env's .venv,
# the reward server on the CPU); tests/test_launch.py runs it where SGLang does not import.
LOGIN_NODE_CHECK = (
    'PATH="$PWD/.venv/bin:$PATH" CONTAINER=none PREFLIGHT_ONLY=1 PREFLIGHT_REWARD_DEVICE=cpu '
    "bash run_grpo_qwen3_4b_mega_verl.sh"
)
# The job's settings for a 2-core machine: the block's defaults (Megatron, async rollout) on one pipeline stage (PP=2:
# 334 s against 215 s; the Slurm job test runs it) and a tiny workload, which the canary shrinks further.
SETTINGS = {
    "STRATEGY": "megatron",
    "ACTOR_PP": "1",
    "ROLLOUT_MODE": "async",
    "ROLLOUT_N": "4",
    "MAX_PROMPT_LENGTH": "128",
    "MAX_RESPONSE_LENGTH": "32",
    "CONFIG_GPUS_PER_NODE": "1",  # Ray's placeholder GPU: verl places its one worker there, torch computes on the CPU
    "CONFIG_REWARD_DEVICE": "cpu",
    "EXPERIMENT_NAME": "tiny_demo_grpo_megatron",  # not the block's qwen3_4b_...: these are tiny random models
    # The block's 1e-6 moves almost no bf16 weight of a tiny random model in 3 steps (step 1's checkpoint and step
    # 3's merge: 9e-6 nats apart); 1e-3 moves most, so the merge's numeric check tells one step from another.
    "ACTOR_LR": "1e-3",
}
# What the canary's clip-ratio WARNING means here: a random tiny policy almost never samples EOS, so its responses
# run to MAX_RESPONSE_LENGTH; on real models the same warning is a real finding.
CLIP_NOTE = (
    "make demo: the canary's 'hit MAX_RESPONSE_LENGTH' WARNING above is expected here: a random tiny policy almost "
    "never ends a response, so nearly all of them run to MAX_RESPONSE_LENGTH={length}; on your models it is a real "
    "finding"
)


# What `make demo` shows of the job's output (all of it goes to demo_out/demo.log): the scripts' own timestamped lines
# (the phases, errors and warnings among them), Ray's readiness, verl's step lines, the preflight's warnings and
# refusals, the canary's stage lines and table. Not shown: verl's config dump, its workers' and the libraries' chatter.
SHOWN = re.compile(
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] |^ray cluster |\bstep:\d+ - |^preflight: (WARNING|refused)|^setting error"
    r"|^canary|^stage |^\d \w|^response length|^WARNING: |Traceback|Error"
)


def shown(line: str) -> bool:
    return bool(SHOWN.search(line))


def run_quietly(cmd: list[str], env: dict, log: Path) -> int:
    """The command with its whole output in `log`, the lines `shown` picks on the screen; after a failure, the log's
    last lines too."""
    with log.open("w", encoding="utf-8") as whole:
        with subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as job:
            for line in job.stdout:
                whole.write(line)
                if shown(line):
                    print(line, end="", flush=True)
    if job.returncode:
        print(f"make demo: the last lines of {log}:", *log.read_text().splitlines()[-40:], sep="\n", flush=True)
    return job.returncode


def numeric_check(out: Path) -> None:
    """The merge's numeric check as it logged it (launch/merge/check_numeric.py), and the same check of that merge
    against step 1's checkpoint, which it must tell apart (no UNVERIFIED.txt is written: the merge is right)."""
    from launch.merge import check_numeric

    logs = sorted((out / "logs").glob("*/canary/merge.log"), key=lambda p: p.stat().st_mtime)
    lines = [x for x in (logs[-1].read_text().splitlines() if logs else []) if x.startswith("numeric check")]
    print(f"make demo: the merge's {lines[-1] if lines else 'numeric check: not run (see the merge log)'}")
    roots = sorted((out / "checkpoints_canary").glob("*/hf_model/config.json"), key=lambda p: p.stat().st_mtime)
    if roots and (roots[-1].parents[1] / "checkpoints" / "global_step_1" / "actor").is_dir():
        first, merged = roots[-1].parents[1] / "checkpoints" / "global_step_1" / "actor", roots[-1].parent
        figures = check_numeric.compare(first, merged)
        told = "told apart" if check_numeric.judge(figures) else "NOT told apart: the steps did not move the weights"
        print(f"make demo: step 1's checkpoint against that merge: {check_numeric.summary(figures)}: {told}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "demo_out", help="where the demo assets and logs go")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    start = time.monotonic()
    if not (out / "reward_model" / "config.json").exists():
        build_reward_model(out / "reward_model")
    if not (out / "policy" / "config.json").exists():
        build_policy_model(out / "policy")
    write_demo(out / "data")
    for folder in out.glob("checkpoints*"):
        shutil.rmtree(folder)  # an earlier demo's: a finished marker there would skip the run
    print(f"demo assets ready in {time.monotonic() - start:.1f} s: {out}", flush=True)
    env = dict(
        os.environ,
        **SETTINGS,
        **verl_shims.ENVIRONMENT,
        CONTAINER="none",
        CANARY="1",
        CANARY_KEEP="1",  # the checkpoints and the merged model stay in demo_out/ to look at
        CONFIG_MODEL_PATH=str(out / "policy"),
        CONFIG_REWARD_MODEL_PATH=str(out / "reward_model"),
        CONFIG_TRAIN_FILE=str(out / "data" / "train.parquet"),
        CONFIG_TEST_FILE=str(out / "data" / "test.parquet"),
        CONFIG_OUTPUT_DIR=str(out / "checkpoints"),
        CONFIG_LOG_DIR=str(out / "logs"),
        CONFIG_NETWORK_INTERFACE=os.environ.get("CONFIG_NETWORK_INTERFACE", "lo"),
        CONFIG_REWARD_SERVER_PORT=str(free_port()),
        RAY_PORT=str(free_port()),
        HF_HOME=str(out / "cache" / "huggingface"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    script = REPO / "run_grpo_qwen3_4b_mega_verl.sh"
    env["MERGER_LAUNCHER"] = str(REPO / "cpu" / "megatron_merger")  # verl's merger with the shims
    rc = run_quietly(["bash", str(script), *megatron_shims.overrides()], env, out / "demo.log")
    verdict = "every stage passed" if rc == 0 else f"FAILED (exit {rc})"
    summaries = sorted((out / "logs").glob("*/canary/summary.txt"), key=lambda p: p.stat().st_mtime)
    if summaries and "hit MAX_RESPONSE_LENGTH" in summaries[-1].read_text():
        print(CLIP_NOTE.format(length=SETTINGS["MAX_RESPONSE_LENGTH"]), flush=True)
    numeric_check(out)
    print(
        f"\nmake demo: {verdict} in {time.monotonic() - start:.0f} s: verl 0.6.1's own GRPO steps on the CPU, a save,"
        f" a resume and the merge (verl's Megatron workers without Transformer Engine and HF generate here; a cluster"
        f" runs them with Transformer Engine and SGLang on GPUs)."
        f"\nthe whole output: {out / 'demo.log'}; logs: {out / 'logs'}; checkpoints and the merged model: "
        f"{out}/checkpoints_canary"
        "\nnext, on a cluster (README.md, Quickstart):\n"
        + "\n".join(f"  {line}" for line in NEXT_STEPS)
        + "\nyour own files on a login node without the image yet (README.md, step 4), from this clone:"
        f"\n  make env\n  {LOGIN_NODE_CHECK}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
