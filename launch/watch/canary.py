"""The canary: every GPU stage of the real job on a tiny workload, in one allocation, before the day-long run.

`CANARY=1 sbatch run_grpo_qwen3_4b_mega_verl.sh` runs the stages (launch/watch/canary.sh); this module holds what they
compute and check:

    python -m launch.watch.canary settings          # the tiny workload as NAME=VALUE, NUL-separated
    python -m launch.watch.canary overrides STAGE   # that training stage's extra Hydra overrides, NUL-separated
    python -m launch.watch.canary check STAGE --rc RC --seconds S --log LOG --ckpt DIR [--target DIR] --results FILE
    python -m launch.watch.canary summary --results FILE    # the table; exit 1 unless every stage passed

Each check reads verl 0.6.1's own output (step lines, what `_load_checkpoint` prints, the checkpoint folder); what it
checks and warns of: docs/operations.md#the-three-dry-runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from launch.job.checkpoints import saved_step
from launch.job.steps import ANSI, RESUMED_AT, is_training_step, parse_step_lines
from launch.plan.settings import SettingError, Settings
from launch.plan.trainer_command import megatron_plan
from launch.watch.reading import canary_results

TRAIN_STEPS = 2  # stage 1: two steps, a checkpoint after each
RESUME_STEPS = 3  # stage 2: resumes at step TRAIN_STEPS and runs one more
CLIP_RATIO_WARN = 0.05  # more than 1 response in 20 cut at MAX_RESPONSE_LENGTH: a warning in the summary
VAL_SAMPLES = 8  # validation prompts (verl pads the validation batch itself)
AGENT_LOOP_WORKERS = 8  # rollout.agent.num_workers in verl 0.6.1: async rollout splits a step's batch in as many parts

STAGES = {
    "train": f"1 train {TRAIN_STEPS} steps, save each",
    "resume": f"2 resume at step {TRAIN_STEPS}, run step {RESUME_STEPS}",
    "merge": "3 merge the last checkpoint, verify",
}

_ERROR_LINE = re.compile(r"Traceback|Error|ERROR|Exception|FAILED|error:|exited with")


def batch_size(s: Settings) -> int:
    """The fewest prompts per step that verl can split evenly with this layout: each step's B x ROLLOUT_N responses
    are cut into equal parts per training GPU (balance_batch), per agent-loop worker (async rollout, unpadded in
    training), per rollout GPU (one_step_off), and with FSDP2 per micro batch of each rank."""
    parts = [s.training_gpus_per_node * max(s.train_nodes, 1)]
    if s.rollout_mode == "async":
        parts.append(AGENT_LOOP_WORKERS)
    if s.trainer_mode == "one_step_off":
        parts.append(s.rollout_gpus_per_node * max(s.train_nodes, 1))
    if s.strategy == "fsdp2":
        # verl's FSDP workers assert ppo_micro_batch_size_per_gpu divides each rank's mini-batch (fsdp_workers.py),
        # dynamic batch sizes or not; the preflight checks it on the composed config.
        parts.append(parts[0] * megatron_plan(s)[0].micro_batch_per_gpu)  # MICRO_BATCH_PER_GPU, auto resolved
    step = math.lcm(*(max(p, 1) for p in parts))  # 0 GPUs is the settings check's to report, by name
    return step // math.gcd(step, s.rollout_n)  # the fewest prompts whose B x ROLLOUT_N responses step divides


def canary_settings(s: Settings) -> dict[str, str]:
    """The settings the canary changes; everything else (models, data, algorithm, mode, strategy, parallel layout,
    engine, the user's extra overrides) stays the user's, so the canary runs the combination the real job will."""
    b = batch_size(s)
    # MAX_RESPONSE_LENGTH stays the user's: the share of responses cut at it (the clip ratio) is what the real run will
    # see, and the memory the update needs is the real run's; shorter responses of a thinking policy would all be cut
    # off mid-reasoning and score one penalty (recipe.dapo would drop every group).
    out = {
        "TRAIN_BATCH_SIZE": str(b),
        "PPO_MINI_BATCH_SIZE": str(b),  # one optimizer step per training step
        "SAVE_FREQ": "1",
        "TEST_FREQ": str(TRAIN_STEPS),  # validation once, at the last step of stage 1
        # Enough epochs for every step even if data.filter_overlong_prompts leaves a single batch per epoch.
        "TOTAL_EPOCHS": str(RESUME_STEPS),
        "EXPERIMENT_NAME": f"{s.experiment_name}_canary",
        "TRAINER_LOGGER": "[console]",  # the steps are read from verl's console lines; no wandb run is touched
        # Every checkpoint it checks must stay: verl's checkpoint manager deletes global_step_1/actor before saving
        # step 2 when it keeps 1 (megatron_checkpoint_manager.py:379-388). The canary removes its own at the end.
        "MAX_CKPT_TO_KEEP": "0",
        "REQUEUE_BEFORE_TIMEOUT": "0",
    }
    return out


def stage_overrides(stage: str, s: Settings) -> list[str]:
    """Extra Hydra overrides of a training stage (they go after the user's, so they win)."""
    steps = {"train": TRAIN_STEPS, "resume": RESUME_STEPS}[stage]
    out = [
        "trainer.resume_mode=auto",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        # Dynamic sampling draws batches until enough groups vary: it may need more prompts than the steps.
        f"data.train_max_samples={-1 if s.uses_recipe == 'recipe.dapo' else RESUME_STEPS * s.train_batch_size}",
        f"data.val_max_samples={VAL_SAMPLES}",
    ]
    if stage == "resume":
        out.append("trainer.test_freq=-1")  # validated once already, in stage 1
    return out


def logged_steps(text: str) -> dict[int, dict[str, float]]:
    """{step: its metrics} for every training step verl's console logger printed (launch/job/steps.py reads them)."""
    return {step: metrics for step, metrics in parse_step_lines(text).items() if is_training_step(metrics)}


def response_length_report(results: dict[str, dict]) -> list[str]:
    """The clip ratio of every step the training stages logged, and a warning when it is high."""
    ratios = {
        int(k): v for stage in ("train", "resume") for k, v in results.get(stage, {}).get("clip_ratio", {}).items()
    }
    entry = next((results[s] for s in ("train", "resume") if "max_response_length" in results.get(s, {})), None)
    if entry is None:
        return []
    length = entry["max_response_length"]
    if not ratios:
        return [f"response length: verl's step lines held no response_length/clip_ratio (MAX_RESPONSE_LENGTH={length})"]
    mean = sum(ratios.values()) / len(ratios)
    steps = ", ".join(f"step {k} {v:.2f}" for k, v in sorted(ratios.items()))
    lines = [
        f"response length: verl's response_length/clip_ratio at MAX_RESPONSE_LENGTH={length}: {steps} (the share "
        f"of responses cut at the limit; {mean:.0%} on average)"
    ]
    if mean <= CLIP_RATIO_WARN:
        return lines
    return lines + [
        f"WARNING: {mean:.0%} of responses hit MAX_RESPONSE_LENGTH={length} (more than {CLIP_RATIO_WARN:.0%}): raise "
        "MAX_RESPONSE_LENGTH (docs/training.md says what a cut response does to GRPO's signal and what a longer one "
        "costs), then run the canary again"
    ]


def _checkpoint_problems(ckpt: Path, steps: range) -> list[str]:
    problems = [
        f"no checkpoint of step {n}: {ckpt}/global_step_{n}/actor is missing"
        for n in steps
        if not (ckpt / f"global_step_{n}" / "actor").is_dir()
    ]
    tracked = saved_step(ckpt)
    if tracked != steps[-1]:
        problems.append(f"{ckpt}/latest_checkpointed_iteration.txt says {tracked}, expected {steps[-1]}")
    return problems


def check_train(text: str, ckpt: Path) -> list[str]:
    """Stage 1: steps 1..TRAIN_STEPS ran from scratch (a resume would log others), validation ran, and each step was
    saved."""
    problems = []
    steps = logged_steps(text)
    expected = list(range(1, TRAIN_STEPS + 1))
    if sorted(steps) != expected:
        problems.append(
            f"verl logged steps {sorted(steps)}, expected {expected} (its 'step:N - ... timing_s/step:...' lines)"
        )
    elif not any(key.startswith("val-core/") for metrics in steps.values() for key in metrics):
        problems.append(f"no validation metrics (val-core/...) at step {TRAIN_STEPS}: validation did not run")
    return problems + _checkpoint_problems(ckpt, range(1, TRAIN_STEPS + 1))


def check_resume(text: str, ckpt: Path) -> list[str]:
    """Stage 2: verl loaded the step-TRAIN_STEPS checkpoint (not step 0), ran exactly the next step and saved it."""
    problems = []
    resumed = RESUMED_AT.search(text)
    if "Training from scratch" in text or not resumed:
        problems.append(
            f"verl started from step 0 ('Training from scratch'), not from the step-{TRAIN_STEPS} checkpoint in {ckpt}"
        )
    elif int(resumed.group(1)) != TRAIN_STEPS:
        problems.append(f"verl resumed at step {resumed.group(1)}, expected {TRAIN_STEPS}")
    steps = sorted(logged_steps(text))
    if steps != [RESUME_STEPS]:
        problems.append(f"verl logged steps {steps} after the resume, expected [{RESUME_STEPS}]")
    return problems + _checkpoint_problems(ckpt, range(RESUME_STEPS, RESUME_STEPS + 1))


def check_merge(text: str, target: Path) -> list[str]:
    """Stage 3: merge_mcore_to_hf.sh wrote the model, launch.merge.verify_hf passed on it, and so did the numeric
    check (launch.merge.check_numeric) unless NUMERIC_CHECK=0 skipped it or it cannot compare this model."""
    problems = []
    if not (target / "config.json").is_file():
        problems.append(f"no merged model at {target}")
    if "verified " not in text:
        problems.append("launch.merge.verify_hf did not report the merged model verified")
    if not re.search(r"numeric check (passed: |skipped \(NUMERIC_CHECK=|not run: )", text):
        problems.append("launch.merge.check_numeric did not report the merged model's log-probs agreeing")
    return problems


def explaining_lines(text: str, n: int = 12) -> list[str]:
    """The lines that most likely explain a failure: up to the last error-looking line (and 2 after), else the last n;
    the whole of it is in the stage's log, which the summary names."""
    lines = [line for line in ANSI.sub("", text).splitlines() if line.strip()]
    marks = [i for i, line in enumerate(lines) if _ERROR_LINE.search(line)]
    end = min(marks[-1] + 3, len(lines)) if marks else len(lines)
    return lines[max(0, end - n) : end]


def evaluate(stage: str, rc: int, text: str, ckpt: Path, target: Path | None) -> list[str]:
    """Every reason the stage failed; empty when it passed."""
    if rc != 0:
        return [f"{'merge_mcore_to_hf.sh' if stage == 'merge' else 'the training launch'} exited with {rc}"]
    if stage == "train":
        return check_train(text, ckpt)
    if stage == "resume":
        return check_resume(text, ckpt)
    return check_merge(text, target or Path("/nonexistent"))


def summary(results: dict[str, dict]) -> tuple[str, bool]:
    """The table of every stage (passed, FAILED, skipped, not run), with the reasons and log of each failure."""
    rows = [f"{'stage':<42} {'result':<8} {'time':>7}"]
    missing = {"status": "not run", "reason": "the job stopped before this stage"}
    if results.get("train", {}).get("status") == "failed":  # stages 2 and 3 need its checkpoint: never started
        missing = {"status": "skipped", "reason": "needs stage 1 (train), which failed"}
    for stage, title in STAGES.items():
        e = results.get(stage, missing)
        seconds = f"{e['seconds']} s" if "seconds" in e else "-"
        status = "FAILED" if e["status"] == "failed" else e["status"]
        rows.append(f"{title:<42} {status:<8} {seconds:>7}")
        if e["status"] != "passed":
            rows += [f"    {e['reason']}"]
        if e["status"] == "failed":
            rows += [f"    log: {e['log']}", *(f"    | {line}" for line in e.get("lines", []))]
    ok = all(results.get(stage, {}).get("status") == "passed" for stage in STAGES)
    verdict = "every stage passed" if ok else "FAILED: fix what is shown above before the real run"
    return "\n".join(["canary summary", *rows, *response_length_report(results), f"canary: {verdict}"]), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("settings")
    sub.add_parser("overrides").add_argument("stage", choices=["train", "resume"])
    c = sub.add_parser("check")
    c.add_argument("stage", choices=list(STAGES))
    for name in ("--rc", "--seconds"):
        c.add_argument(name, type=int, required=True)
    for name in ("--log", "--ckpt", "--results"):
        c.add_argument(name, type=Path, required=True)
    c.add_argument("--target", type=Path)
    sub.add_parser("summary").add_argument("--results", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "summary":
        table, ok = summary(canary_results(args.results))
        print(table)
        return 0 if ok else 1
    try:  # every other command reads the settings, but the merge's check
        s = None if args.command == "check" and args.stage == "merge" else Settings.from_env()
        if args.command in ("settings", "overrides"):
            items = (
                [f"{k}={v}" for k, v in canary_settings(s).items()]
                if args.command == "settings"
                else stage_overrides(args.stage, s)
            )
            sys.stdout.write("\0".join(items) + "\0")
            return 0
    except SettingError as exc:
        print(f"canary: {exc}", file=sys.stderr)
        return 1
    text = args.log.read_text(errors="replace") if args.log.exists() else ""
    problems = evaluate(args.stage, args.rc, text, args.ckpt, args.target)
    entry = {"stage": args.stage, "status": "failed" if problems else "passed", "seconds": args.seconds}
    if s is not None:  # the share of each step's responses cut at MAX_RESPONSE_LENGTH
        key = "response_length/clip_ratio"
        clip = {n: metrics[key] for n, metrics in logged_steps(text).items() if key in metrics}
        entry |= {"clip_ratio": clip, "max_response_length": s.max_response_length}
    if problems:
        entry |= {"reason": "; ".join(problems), "log": str(args.log), "lines": explaining_lines(text)}
    with open(args.results, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"canary: stage {STAGES[args.stage]}: {'FAILED: ' + entry['reason'] if problems else 'passed'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
