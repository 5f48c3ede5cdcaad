"""Watching a job (launch/watch/: reading.py, health.py, status.py): where it is, when it ends, whether it learns,
read from its log folders and Slurm.

The trainer output here is printed by verl 0.6.1's own console logger (verl.utils.tracking.Tracking with the console
backend), behind the prefix Ray gives a TaskRunner actor's lines, never written by hand; the jobs on the local Slurm run
the stand-in trainer, which logs its steps through the same Tracking."""

import io
import json
import math
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from launch.job.steps import is_training_step, number, parse_step_lines
from launch.plan import trainer_imports
from launch.watch import health, reading, status
from tests.fakes.fake_trainer import RayPrefixed, step_metrics
from tests.real_slurm import NODE_SIZE, slurm_env
from tests.support import REPO, assert_everything_stopped, run
from tests.test_docs import anchors

ACTOR = "\x1b[36m(TaskRunner pid=4711)\x1b[0m"  # Ray's prefix for a TaskRunner actor's lines, coloured
LOCAL_ID = "local-20260101-000000-1"  # a job id no Slurm has: its status comes from the folders alone


def verl_console(steps: dict[int, dict], prefix: str = ACTOR) -> str:
    """What verl 0.6.1's Tracking with the console backend prints for these steps, as the driver shows it."""
    from verl.utils.tracking import Tracking

    out = io.StringIO()
    with redirect_stdout(RayPrefixed(prefix, out)):
        tracking = Tracking(project_name="p", experiment_name="e", default_backend="console")
        for step, metrics in steps.items():
            tracking.log(data=metrics, step=step)
    return out.getvalue()


# REWARD=rm+rule's parts at validation, as verl 0.6.1 logs reward_extra_info (val-aux/<data_source>/<key>/<stat>)
RULE_PART, RM_PART = "val-aux/safe_hack/rule_score/mean@1", "val-aux/safe_hack/rm_score/mean@1"


def training(first: int, last: int, parts: bool = False, **changes) -> dict[int, dict]:
    """Steps first..last as the stand-in logs them (status's metrics, val-core every 5; with `parts` the reward's
    parts too), each key of `changes` set to its value, or to what its function of the step gives."""
    steps = {}
    for n in range(first, last + 1):
        metrics = step_metrics(n) | {"training/global_step": n, "timing_s/step": 100.0}
        if n % 5 == 0:
            metrics |= {"val-core/safe_hack/reward/mean@1": metrics["critic/score/mean"] + 0.1, "timing_s/testing": 40}
            metrics |= {RULE_PART: n / 100, RM_PART: 0.5, "val-aux/safe_hack/rule_score/std@1": 0.1} if parts else {}
        for key, value in changes.items():
            metrics[key] = value(n) if callable(value) else value
        steps[n] = metrics
    return steps


def start_folder(
    logs: Path,
    name: str,
    steps: dict[int, dict],
    total: int | None = 100,
    resumed: int | None = 0,
    ckpt: Path | None = None,
    done: int | None = None,
    extra: str = "",
    overrides: tuple[str, ...] = (),
) -> Path:
    """One start's folder as the job leaves it: trainer.log (verl's lines), trainer_command.txt, `done`."""
    folder = logs / name
    folder.mkdir(parents=True)
    head = [f"{ACTOR} Total training steps: {total}"] if total else []
    head += [f"{ACTOR} Training from scratch"] if resumed == 0 else [f"{ACTOR} Setting global step to {resumed}"]
    (folder / "trainer.log").write_text("\n".join(head) + "\n" + verl_console(steps) + extra)
    command = [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        *overrides,
        f"trainer.default_local_dir={ckpt or logs.parent / 'ckpt'}",
    ]
    (folder / "trainer_command.txt").write_text("\n".join(command) + "\n")
    if done is not None:
        (folder / "done").write_text(f"{done}\n")
    return folder


def saved(ckpt: Path, step: int, payload: int = 1000) -> None:
    """A checkpoint as verl's trainer leaves it: global_step_N/actor/... and the tracker file."""
    (ckpt / f"global_step_{step}" / "actor" / "dist_ckpt").mkdir(parents=True)
    (ckpt / f"global_step_{step}" / "actor" / "dist_ckpt" / "shard").write_bytes(b"x" * payload)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """A machine without Slurm's programs (a workstation, the inside of the image): only Python is on PATH."""
    bin_dir = tmp_path / "noslurm"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def status_of(target: str) -> dict:
    return health.report(reading.load(target))


# --- reading verl's output ----------------------------------------------------------------------------------------


def test_every_kind_of_value_verls_console_logger_prints_is_read_back():
    metrics = {
        "critic/score/mean": np.float64(0.125),
        "response_length/mean": np.float32(1500.5),
        "training/global_step": 7,
        "actor/kl_loss": float("nan"),
        "actor/lr": 1e-6,
        "big": 1e20,
        "flag": True,
        "timing_s/step": 41.2,
    }
    text = "Training Progress:  7%|7    | 7/100 [01:02<12:00, 8.1s/it]\r" + verl_console({7: metrics})
    (back,) = parse_step_lines(text).values()
    assert set(back) == set(metrics)
    assert math.isnan(back.pop("actor/kl_loss"))
    assert back == {k: float(v) for k, v in metrics.items() if k != "actor/kl_loss"}
    assert number("np.float64(0.25)") == 0.25, "numpy 2's repr, as pprint prints it there"


def test_a_folder_alone_gives_the_step_the_total_the_checkpoint_and_the_metrics(tmp_path, no_slurm, capsys):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    saved(ckpt, 10, payload=4096)
    folder = start_folder(logs, "424242", training(1, 12, parts=True), ckpt=ckpt)  # a Slurm job id, without Slurm
    r = status_of(str(folder))
    assert (r["state"], r["slurm"]) == ("running", None)
    assert r["slurm_notes"] == ["scontrol is not on PATH"]
    p = r["progress"]
    assert (p["step"], p["total"], p["saved_step"], p["remaining_steps"]) == (12, 100, 10, 88)
    assert p["step_s"] == 100.0 and p["wall_per_step_s"] == pytest.approx(100 + 40 * 2 / 12)
    assert p["starts_left"] == 1 and p["eta"] == pytest.approx(r["now"] + 88 * p["wall_per_step_s"], abs=1)
    assert (r["checkpoint"]["step"], r["checkpoint"]["bytes"]) == (10, 4096)
    score = r["metrics"]["critic/score/mean"]
    assert score["step"] == 12 and score["value"] == pytest.approx(step_metrics(12)["critic/score/mean"])
    assert score["change"] > 0, "the stand-in's reward rises"
    assert r["metrics"]["val-core/safe_hack/reward/mean@1"]["step"] == 10
    assert r["metrics"][RULE_PART]["value"] == 0.1 and r["metrics"][RULE_PART]["change"] > 0
    assert RM_PART in r["metrics"] and not [k for k in r["metrics"] if "std@" in k], "the parts' means only"
    assert r["warnings"] == []
    assert status.main([str(folder)]) == 0
    text = capsys.readouterr().out
    assert "job 424242: RUNNING" in text and "progress: step 12 of 100 (12%), 88 to go" in text


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"response_length/clip_ratio": 0.8}, "responses mostly cut off: 80% of the responses of the last 5 steps"),
        ({"critic/score/max": 0.0, "critic/score/min": 0.0}, "reward flat: every response of step 30 scored 0.0"),
        ({"critic/score/mean": 0.5}, "reward flat: critic/score/mean is 0.5 in each of the last 10 steps"),
        ({"critic/score/mean": float("nan")}, "critic/score/mean is nan at step 30"),
        ({"actor/kl_loss": 2.5}, "KL climbing: actor/kl_loss is 2.5 (above 1.0)"),
        ({"actor/pg_clipfrac": 0.4}, "the updates are too large; lower ACTOR_LR"),
        ({"actor/entropy": lambda n: 0.6 if n < 25 else 0.01}, "actor/entropy fell to 0.01 (from 0.6)"),
        # PPO's critic held by its value clip; a command that does not say its updates a step: the ceiling is 1
        ({"critic/vf_clipfrac": 0.95}, "critic/vf_clipfrac averaged 0.95 over the last 5 steps"),
    ],
    ids=["cut-off", "one-score", "flat-mean", "nan", "kl-high", "clipfrac", "entropy", "vf-clipfrac"],
)
def test_a_run_that_does_not_learn_is_named_with_the_metric_and_what_to_change(
    tmp_path, no_slurm, capsys, changes, needle
):
    folder = start_folder(tmp_path / "logs", LOCAL_ID, training(1, 30, **changes))
    warnings = status_of(str(folder))["warnings"]
    assert any(needle in w for w in warnings), warnings
    assert len(warnings) == 1 or "nan" in needle, warnings


# The PPO job's own command: 256 prompts a step in mini-batches of 128, so two critic updates a step.
PPO_COMMAND = (
    "algorithm.adv_estimator=gae",
    "critic.model.path=/models/policy",
    "data.train_batch_size=256",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "critic.cliprange_value=0.5",
)


@pytest.mark.parametrize("clipfrac, warned", [(0.5, True), (0.46, True), (0.1, False), (0.0, False)])
def test_a_ppo_critic_held_by_its_value_clip_is_named_with_the_setting_against_what_the_clip_can_reach(
    tmp_path, no_slurm, capsys, clipfrac, warned
):
    # the first of a step's two critic updates predicts with the old weights: 0.5 is every prediction it could clip
    folder = start_folder(
        tmp_path / "logs", LOCAL_ID, training(1, 30, **{"critic/vf_clipfrac": clipfrac}), overrides=PPO_COMMAND
    )
    warnings = status_of(str(folder))["warnings"]
    if not warned:
        assert warnings == []
        return
    (warning,) = warnings
    assert f"critic/vf_clipfrac averaged {clipfrac:.2f} over the last 5 steps (the most it can read is 0.50)" in warning
    assert "the critic cannot follow the rewards" in warning and "PPO runs as REINFORCE" in warning
    assert "Raise CRITIC_CLIPRANGE_VALUE" in warning


@pytest.mark.parametrize(
    "overrides, updates",
    [
        (PPO_COMMAND, 2),  # the defaults: two mini-batches, one epoch
        ((*PPO_COMMAND, "critic.ppo_epochs=2"), 4),  # the critic's own epochs
        ((*PPO_COMMAND, "actor_rollout_ref.actor.ppo_epochs=3"), 6),  # the actor's, which the critic follows
        ((*PPO_COMMAND, "critic.ppo_mini_batch_size=256"), 1),  # the critic's own mini-batch: nothing can clip
        ((*PPO_COMMAND, "data.train_batch_size=512"), 4),  # the last override of a key wins, as in Hydra
        (PPO_COMMAND[2:], None),  # GRPO and DAPO: no critic
        (PPO_COMMAND[:2], None),  # a command that does not say its batch sizes
    ],
)
def test_the_critics_updates_a_step_are_read_from_the_trainer_command(overrides, updates):
    assert reading.critic_updates_per_step(list(overrides)) == updates


def test_one_critic_update_a_step_cannot_be_clipped_and_is_never_warned_about():
    steps = {n: {"timing_s/step": 1.0, "critic/vf_clipfrac": 1.0} for n in range(1, 6)}
    assert not [w for w in health.metric_warnings(steps, critic_updates=1) if "vf_clipfrac" in w]


@pytest.mark.parametrize(
    "line, what",
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB",
            "the trainer ran out of GPU memory",
        ),
        (
            "[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=2, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600006 milliseconds",
            "NCCL timed out",
        ),
        (
            "[2026-01-01 10:00:00] Rank 0 scheduler is dead. Please check if there are relevant logs.",
            "SGLang failed to start",
        ),
        (
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
            "vLLM failed to start",
        ),
        (
            "The node with node id: 1f2e and address: 10.0.0.2 and node name: 10.0.0.2 has been marked dead because "
            "the detector has missed too many heartbeats from it.",
            "a node was lost",
        ),
        (
            "safe_hack_reward_request.RewardServerError: reward server(s) http://10.0.0.1:8000 did not score within "
            "180 s (12 attempts); last error: http://10.0.0.1:8000/score: ConnectionError",
            "the reward servers did not",
        ),
    ],
    ids=["oom", "nccl", "sglang", "vllm", "node", "reward-client"],
)
def test_a_failed_start_says_why_from_the_first_failure_the_trainer_logged(tmp_path, no_slurm, capsys, line, what):
    later = "Traceback (most recent call last):\nRuntimeError: NCCL communicator was aborted on rank 1\n"
    extra = f"{ACTOR} {line}\n" + ("" if what.startswith("NCCL") else later)  # what the other ranks say afterwards
    folder = start_folder(tmp_path / "logs", LOCAL_ID, training(1, 3), done=1, extra=extra)
    r = status_of(str(folder))
    assert r["state"] == "failed"
    (failure,) = [s["failure"] for s in r["starts"]]
    assert failure["what"].startswith(what) and line[:60] in failure["line"], failure
    assert r["why"].startswith(f"{failure['what']} ({failure['docs']})")
    page, anchor = failure["docs"].split("#")
    assert anchor in anchors(REPO / page), f"{failure['docs']}: no such section"


def test_every_failure_the_status_names_points_at_a_section_that_says_what_to_do():
    sections = anchors(REPO / reading.OPERATIONS)
    assert [a for _, a, _ in reading.FAILURES if a not in sections] == []


def test_reward_server_restarts_are_counted_from_the_marker_each_restart_leaves_in_the_servers_log(tmp_path):
    folder = start_folder(tmp_path / "logs", LOCAL_ID, training(1, 5))
    # what helper_grpo_qwen3_4b.sh's restart_reward_server appends to the server's log before starting it again
    marker = (
        "=== 2026-01-01 10:00:00 restart 1 after: killed by SIGKILL (kill -9, or the kernel's out-of-memory killer) ==="
    )
    (folder / "reward_server_n1_20016.log").write_text(f"INFO: serving\n{marker}\nINFO: serving\n")
    r = health.report(reading.load(str(folder)))
    (restart,) = r["starts"][0]["reward_restarts"]
    assert restart["reason"].startswith("killed by SIGKILL") and restart["log"].endswith("reward_server_n1_20016.log")
    assert any(
        w.startswith(
            "reward servers restarted 1 time(s) in this job, the last at 2026-01-01 10:00 after: killed by SIGKILL"
        )
        for w in r["warnings"]
    )


# --- the time it takes ------------------------------------------------------------------------------------------


def test_the_eta_in_starts_counts_each_starts_startup_and_the_save_before_its_limit(tmp_path, capsys):
    """A start of 3600 s, a startup of 600 s, verl's save 1800 s before the limit: each start saves (3600 - 600 -
    1800) / 100 = 12 steps of 100 s; the one that runs now saves until its own expiry."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    folder = start_folder(logs, LOCAL_ID, training(1, 4, **{"timing_s/testing": 0}), ckpt=ckpt)
    began = float(int(time.time()) - 1000)  # 600 s of startup, then 4 steps of 100 s (whole seconds: the log's)
    os.utime(folder / "trainer.log", (began + 1000, began + 1000))
    output = logs / f"grpo-qwen3-4b-{LOCAL_ID}.out"  # where the run script's --output puts it
    output.write_text(
        f"[{time.strftime('%F %T', time.localtime(began))}] === job {LOCAL_ID}: logs in {folder} (+0s)\n"
        f"[{time.strftime('%F %T', time.localtime(began))}] the job ends at "
        f"{time.strftime('%F %T', time.localtime(began + 3600))} (the preflight says what verl saves before that)\n"
        "preflight: verl saves after any step that ends within 60 s + its longest step + trainer.esi_redundant_time=600"
        " s of x (CHECKPOINT_BEFORE_END=1800 s before the time limit); ...\n"
    )
    job = reading.load(str(folder), now=began + 1000)
    assert job.output == output and job.checkpoint_before_end == 1800
    job.slurm = {"state": "RUNNING", "time_limit": 3600, "end": began + 3600}  # as scontrol says
    p = health.progress(job)
    assert p["startup_s"] == pytest.approx(600, abs=2) and p["time_limit_s"] == 3600
    assert p["steps_per_start"] == 12
    # this start: until began + 3600 - 1800, from began + 1000: 8 more steps; then 96 - 8 = 88 steps: 8 more starts
    assert p["this_start_saves"] == 8 and p["starts_left"] == 1 + 8
    last = 88 - 7 * 12  # the last start trains 4 steps after its startup
    assert p["eta"] == pytest.approx(began + 3600 + 7 * 3600 + 600 + last * 100, abs=2)


def test_a_step_trained_again_after_a_requeue_counts_once_with_its_newest_values(tmp_path, no_slurm):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    start_folder(logs, LOCAL_ID, training(1, 14), ckpt=ckpt, done=143)
    start_folder(logs, f"{LOCAL_ID}-r1", training(13, 30, **{"critic/score/mean": 9.0}), resumed=12, ckpt=ckpt)
    steps = health.merged_steps(reading.load(LOCAL_ID, log_dir=logs))
    assert sorted(steps) == list(range(1, 31)), "steps 13-14, trained twice, once each"
    assert [steps[n]["critic/score/mean"] for n in (12, 13, 14)] == [training(12, 12)[12]["critic/score/mean"], 9, 9]


def test_each_kind_of_start_is_shown_as_what_it_was_with_the_end_the_run_script_recorded(tmp_path, no_slurm, capsys):
    """A finished preflight only (sbatch keeps its folder), the canary, and a start that ended without a step: the run
    script's `kind` and `exit` (every start's end, where no Slurm output says it)."""
    logs = tmp_path / "logs"
    for name, kind in (("41", "preflight only"), ("42", "canary")):
        folder = logs / name
        folder.mkdir(parents=True)
        (folder / "kind").write_text(f"{kind}\n")
        (folder / "exit").write_text("0\n")
    (logs / "42" / "canary" / "train").mkdir(parents=True)
    (logs / "42" / "canary" / "summary.txt").write_text("canary summary\n...\ncanary: every stage passed\n")
    (logs / "43" / "canary" / "resume").mkdir(parents=True)  # a canary in its second stage: no table yet
    (logs / "43" / "kind").write_text("canary\n")
    (logs / "43" / "canary" / "results.jsonl").write_text('{"stage": "train", "status": "passed", "seconds": 95}\n')
    (logs / "43" / "exit").write_text("0\n")  # a stage failed but the start ended 0 (its parent was killed): failed
    with open(logs / "43" / "canary" / "results.jsonl", "a") as f:
        f.write(
            '{"stage": "resume", "status": "failed", "seconds": 98, "reason": "the training launch exited with 141"}\n'
        )
    assert status_of(str(logs / "43"))["why"] == (
        "the canary's stage resume failed: the training launch exited with 141"
    )
    (logs / "43" / "exit").unlink()
    (logs / "43" / "canary" / "results.jsonl").write_text('{"stage": "train", "status": "passed", "seconds": 95}\n')
    assert status.main([str(logs / "43")]) == 0
    summary = logs / "43" / "canary" / "summary.txt"
    assert f"  a canary job (CANARY=1): its table comes at its end, {summary}\n" in capsys.readouterr().out
    assert status_of(str(logs / "41"))["why"] == (
        "preflight only (PREFLIGHT_ONLY=1): every check passed; nothing was started"
    )
    assert status_of(str(logs / "42"))["why"] == "the canary passed (CANARY=1): its table below"
    assert status.main([str(logs / "42")]) == 0
    out = capsys.readouterr().out
    assert "progress: no steps yet\n" in out and "[canary]" in out, out


def test_a_canary_reads_as_one_run_with_its_stages_from_its_folder_a_stage_or_the_demos_top_folder(
    tmp_path, no_slurm, capsys
):
    """make demo's demo_out/: a canary trains steps 1-2 (canary/train), resumes at 2 and trains 3 (canary/resume) into
    one checkpoint folder. Its top folder, its job folder and a stage's folder all read as that one run: step 3 of 3
    beside checkpoint step 3, and the log it names exists."""
    top, ckpt = tmp_path / "demo_out", tmp_path / "demo_out" / "checkpoints_canary"
    job = top / "logs" / LOCAL_ID
    canary = job / "canary"
    start_folder(canary, "train", training(1, 2), total=2, ckpt=ckpt, done=0)
    start_folder(canary, "resume", training(3, 3), total=3, resumed=2, ckpt=ckpt, done=0)
    saved(ckpt, 3)
    (job / "kind").write_text("canary\n")
    (job / "exit").write_text("0\n")
    (canary / "summary.txt").write_text("canary summary\n...\ncanary: every stage passed\n")
    for target in (top, job, canary / "train"):
        assert status.main([str(target)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"job {LOCAL_ID}: FINISHED: the canary passed"), out
        assert "[canary] steps 1-3; exit code 0" in out and "progress: step 3 of 3 (100%)" in out, out
        assert "checkpoint: step 3, " in out, out
        (logs,) = [line.removeprefix("logs: ") for line in out.splitlines() if line.startswith("logs: ")]
        assert logs == str(canary / "resume" / "trainer.log") and Path(logs).is_file()


def test_a_failed_preflight_only_is_shown_failed_before_training_with_its_refusal(job, capsys, tmp_path):
    """PREFLIGHT_ONLY=1 outside Slurm refused by the Python preflight: its folder stays, with the refusal and the end
    recorded; a bare `launch.watch.status` (the newest job) used to call it RUNNING with step 0 and a trainer.log."""
    result = run(job | {"PREFLIGHT_ONLY": "1", "ALGORITHM": "reinforce"})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    logs = Path(job["CONFIG_LOG_DIR"])
    r = health.report(reading.load(None, logs))
    assert r["state"] == "failed", r
    assert r["why"].startswith("before training, in the preflight: setting error: ALGORITHM='reinforce': use one"), r
    (start,) = r["starts"]
    assert (start["kind"], start["exit_code"], start["steps"]) == ("preflight only", 1, [])
    assert status.main(["--log-dir", str(logs)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"job {r['job']}: FAILED: before training, in the preflight: setting error: ALGORITHM=")
    assert "  a local run, outside Slurm\n" in text and "[preflight only]" in text
    assert "progress: no steps yet\n" in text


# --- bad input, docs --------------------------------------------------------------------------------------------------


def test_a_job_that_is_nowhere_is_an_error_naming_where_it_was_looked_for(tmp_path, no_slurm, capsys):
    assert status.main([LOCAL_ID, "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"status: no job {LOCAL_ID}: no folder {tmp_path / LOCAL_ID} (CONFIG_LOG_DIR={tmp_path})" in err
    assert status.main(["--log-dir", str(tmp_path / "empty")]) == 1
    assert "no job folders in" in capsys.readouterr().err


def test_follow_ends_by_itself_once_the_job_has_ended(tmp_path, no_slurm, capsys):
    folder = start_folder(tmp_path / "logs", LOCAL_ID, training(1, 100), done=0)
    assert status.main([str(folder), "--follow", "0.1"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"job {LOCAL_ID}: FINISHED") == 1


def test_the_docs_list_every_metric_the_status_watches_with_its_healthy_range():
    page = (REPO / reading.OPERATIONS).read_text()
    for key, healthy in health.METRICS.items():
        assert f"| `{key}{'*' if key.endswith('/') else ''}` | {healthy} |" in page, key


# --- TensorBoard ----------------------------------------------------------------------------------------------------


def test_with_tensorboard_in_trainer_logger_verls_logger_writes_each_start_under_its_log_folder(job):
    """The stand-in logs through verl's own Tracking, whose tensorboard backend writes where TENSORBOARD_DIR says:
    the run script points it into the start's folder, and the values are the console line's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = job | {"TRAINER_LOGGER": "[console,tensorboard]", "FAKE_TRAINER_STEPS": "3", "PREFLIGHT_REWARD": "0"}
    result = run(env)
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = Path(env["CONFIG_LOG_DIR"]).iterdir()
    assert f"Saving tensorboard log to {folder / 'tensorboard'}." in (folder / "trainer.log").read_text()
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    console = parse_step_lines((folder / "trainer.log").read_text())
    scores = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert scores == [(n, pytest.approx(console[n]["critic/score/mean"])) for n in (1, 2, 3)]


def test_the_preflight_checks_that_tensorboard_imports_where_the_trainer_runs(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "sglang", "mode": "sync"}}, "trainer": {"logger": ["console"]}}
    )
    assert trainer_imports.TENSORBOARD_WRITER not in trainer_imports.trainer_modules("verl.trainer.main_ppo", cfg)
    cfg.trainer.logger = ["console", "tensorboard"]
    assert trainer_imports.trainer_modules("verl.trainer.main_ppo", cfg)[-1] == trainer_imports.TENSORBOARD_WRITER
    broken = tmp_path / "site" / "tensorboard"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no tensorboard in this image')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    (problem,) = trainer_imports.import_problems([trainer_imports.TENSORBOARD_WRITER], "sglang")
    assert problem.startswith("import torch.utils.tensorboard fails (")
    assert problem.endswith(
        "TRAINER_LOGGER has tensorboard, which needs the tensorboard package there: drop it from it"
    )


# --- jobs on the local Slurm -----------------------------------------------------------------------------------------

FAST = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}  # the preflight's data and reward checks are test_launch's


def status_cmd(env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m launch.watch.status ARGS` as a user runs it on the login node: Slurm's programs on PATH."""
    return subprocess.run(
        [sys.executable, "-m", "launch.watch.status", *args],
        cwd=REPO,
        env=slurm_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status_json(env, job_id: str) -> dict:
    """health.report as the login node's Python computes it, with Slurm's programs on PATH."""
    code = (
        "import json, sys, pathlib; from launch.watch import health, reading; "
        "print(json.dumps(health.report(reading.load(sys.argv[1], pathlib.Path(sys.argv[2])))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, job_id, env["CONFIG_LOG_DIR"]],
        cwd=REPO,
        env=slurm_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for_steps(j, log: Path, count: int, timeout: float) -> dict[int, dict]:
    """Until verl's logger has printed `count` training steps into the start's trainer.log (the job still running)."""
    deadline = time.monotonic() + timeout
    while True:
        steps = [n for n, m in parse_step_lines(log.read_text() if log.exists() else "").items() if is_training_step(m)]
        if len(steps) >= count:
            return steps
        state = j.show().get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"job {j.id}: {len(steps)} of {count} steps after {timeout:.0f} s (JobState={state})\n{j.output()[-3000:]}"
        )
        time.sleep(1)


def test_a_running_job_shows_its_step_eta_checkpoint_and_metrics_and_scancel_ends_it_cancelled_and_follow_with_it(
    job, submit, tmp_path
):
    """One job, mid-training, watched and then cancelled. Merged here (issue 71: one job proves both) is what was
    test_slurm_jobs.py::test_scancel_mid_training_ends_the_job_cancelled_with_nothing_of_it_left, its assertions
    kept: the job ends CANCELLED; the batch script's own stop line ("stop signal: stopping the job on every node
    (within STOP_TIMEOUT=20 s)") and exit line (exit_code=143) are in its output, and no "preempted" (a scancel has
    no PreemptTime: no save is waited for); no TRAINING_DONE; nothing of the job left (assert_everything_stopped).
    Slurm sends SIGTERM to every process of the job at once, srun included, and srun answers a SIGTERM by SIGKILLing
    its tasks (src/srun/srun_job.c: "forcing job termination"): the helpers' own stop races that, and their last
    lines may never reach the output. What holds: the batch script's own stop and exit lines, and nothing of the job
    left (what the helpers did not stop, Slurm's SIGTERM and, after KillWait, its SIGKILL did)."""
    env = job | FAST | {"FAKE_TRAINER_STEP_SECONDS": "1", "STOP_TIMEOUT": "20"}
    j = submit(
        env,
        "trainer.total_training_steps=300",
        "trainer.save_freq=4",
        "trainer.test_freq=4",
        out=tmp_path / "job.out",
        options=(*NODE_SIZE, "--time=60"),
    )
    log = Path(env["CONFIG_LOG_DIR"]) / j.id / "trainer.log"
    wait_for_steps(j, log, 6, 300)
    r = status_json(env, j.id)
    assert (r["state"], r["slurm"]["state"]) == ("running", "RUNNING"), r
    p = r["progress"]
    assert 6 <= p["step"] < 300 and p["total"] == 300 and p["time_limit_s"] == 3600
    assert p["starts_left"] == 1, "300 steps of about a second fit in the hour"
    assert r["now"] + 0.5 * p["remaining_steps"] < p["eta"] < r["now"] + 3 * p["remaining_steps"]
    assert r["checkpoint"]["step"] in (4, 8, 12) and r["checkpoint"]["path"].endswith(
        f"global_step_{r['checkpoint']['step']}"
    )
    logged = parse_step_lines(log.read_text())
    score = r["metrics"]["critic/score/mean"]
    assert score["value"] == pytest.approx(logged[score["step"]]["critic/score/mean"]), (
        "the value verl's logger printed"
    )
    assert r["output"] == str(tmp_path / "job.out") and [s["name"] for s in r["starts"]] == [j.id]

    follow_log = tmp_path / "follow.txt"
    with open(follow_log, "w") as out:
        follow = subprocess.Popen(
            [sys.executable, "-m", "launch.watch.status", j.id, "--follow", "1", "--log-dir", env["CONFIG_LOG_DIR"]],
            cwd=REPO,
            env=slurm_env(env),
            stdout=out,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 60
        while follow_log.read_text().count(f"job {j.id}: RUNNING") < 2:  # it refreshes while the job runs
            assert follow.poll() is None and time.monotonic() < deadline, follow_log.read_text()
            time.sleep(0.5)
        j.scancel()
        fields = j.wait(90)
        assert follow.wait(timeout=60) == 0, "--follow ends by itself once the job has"
    finally:
        if follow.poll() is None:
            follow.kill()
    reports = follow_log.read_text().split(f"job {j.id}: ")
    assert reports[-1].startswith("CANCELLED: scancel"), reports[-1][:300]
    out = j.output()
    assert fields["JobState"] == "CANCELLED", out[-4000:]
    assert "stop signal: stopping the job on every node (within STOP_TIMEOUT=20 s)" in out, out[-4000:]
    assert "preempted" not in out, "a scancel has no PreemptTime: no save is waited for (docs/operations.md#preemption)"
    assert "run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=143" in out, out[-4000:]
    assert not (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    assert_everything_stopped(env)


def test_a_requeued_job_shows_where_it_resumes_then_both_starts_once_it_has_finished(job, submit, tmp_path):
    """`scontrol requeue` (what the time-limit signal does, without waiting for the limit): the job goes back to
    PENDING, its next start resumes from the newest checkpoint."""
    env = job | FAST | {"FAKE_TRAINER_STEP_SECONDS": "1"}
    j = submit(
        env,
        "trainer.total_training_steps=40",
        "trainer.save_freq=4",
        "trainer.test_freq=4",
        out=tmp_path / "job.out",
        options=(*NODE_SIZE, "--time=30"),
    )
    ckpt = Path(env["CONFIG_OUTPUT_DIR"])
    wait_for_steps(j, Path(env["CONFIG_LOG_DIR"]) / j.id / "trainer.log", 13, 300)
    j.scontrol("requeue", j.id)
    j.wait_until("requeued", lambda f: f.get("Restarts") == "1" and f["JobState"] == "PENDING", 120)
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    r = status_json(env, j.id)
    assert r["state"] == "requeued" and "waiting to start again (Reason=BeginTime)" in r["why"], r["why"]
    assert r["progress"]["step"] == saved and saved % 4 == 0 and saved >= 12, "the next start resumes from there"
    (first,) = r["starts"]
    assert first["how"] == "requeued (scontrol requeue, or by Slurm after a node failure)" and first["steps"][-1] >= 13

    j.scontrol("update", f"JobId={j.id}", "StartTime=now")  # no need to wait out Slurm's hold
    fields = j.wait(300)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), j.output()[-3000:]
    r = status_json(env, j.id)
    assert (r["state"], r["why"]) == ("finished", "training finished (TRAINING_DONE)")
    assert [(s["name"], s["resumed_from"]) for s in r["starts"]] == [(j.id, 0), (f"{j.id}-r1", saved)]
    assert r["starts"][1]["steps"] == list(range(saved + 1, 41))
    assert (r["progress"]["step"], r["checkpoint"]["step"], r["checkpoint"]["training_done"]) == (40, 40, True)


def test_a_failed_job_says_why_from_its_own_messages(job, submit, tmp_path):
    env = job | FAST | {"FAKE_TRAINER_RC": "3"}
    j = submit(env, "trainer.total_training_steps=5", "trainer.save_freq=2", out=tmp_path / "job.out")
    fields = j.wait()
    assert fields["JobState"] == "FAILED", j.output()[-3000:]
    result = status_cmd(env, j.id, "--log-dir", env["CONFIG_LOG_DIR"])
    assert result.returncode == 0, result.stderr
    trainer_log = Path(env["CONFIG_LOG_DIR"]) / j.id / "trainer.log"
    assert result.stdout.startswith(f"job {j.id}: FAILED: trainer exited with 3 (log: {trainer_log})"), result.stdout
    assert f"  {j.id:<12}" in result.stdout and "steps 1-5 from scratch" in result.stdout
    assert "checkpoint: step 5, " in result.stdout, "verl saves the last step too"
