"""A stand-in for `python3 -m verl.trainer.main_ppo ...` in launch tests: records what it was given and what it saw.

It writes one JSON object to $FAKE_TRAINER_LOG: its argv, the reward URLs and environment it inherited, the health of
every reward server (asked with this job's REWARD_SERVER_TOKEN, as the reward function sends it), and (with the Ray
address from `+ray_kwargs.ray_init.address=`) the alive Ray nodes and GPUs. With FAKE_TRAINER_PROBE_NODES=1 it also
runs one Ray task on every node and records what verl's workers there would see in their environment.
Then it sleeps $FAKE_TRAINER_SLEEP seconds, with $FAKE_TRAINER_WAIT_FOR waits until that file exists and records the
reward servers' health again ($FAKE_TRAINER_LOG.end), and exits with $FAKE_TRAINER_RC (default 0).

Given `trainer.total_training_steps=N` (or $FAKE_TRAINER_STEPS, for the count verl computes from the data), it also
imitates what verl 0.6.1's fit loops show from outside:
`_load_checkpoint` (resume_mode=auto: the tracker file, its messages, the step it resumes at), and each step's metrics
logged through verl's own `Tracking` (verl/utils/tracking.py, created as fit creates it, ray_trainer.py:967-972) with
the backends of `trainer.logger` that run without a service: `console` prints verl's `step:N - key:value - ...` line
(verl/utils/logger/aggregate_logger.py), behind the prefix Ray gives a TaskRunner actor's lines, and `tensorboard`
writes event files to $TENSORBOARD_DIR (wandb and the others are left out). The metrics are verl's keys with made-up
values shaped like a run that learns (the same for a step whichever start logs it), as each entry point logs them:
the main trainer's and the one-step-off recipe's with `training/global_step` (ray_trainer.py:1274-1293), recipe.dapo's
without it but with `train/num_gen_batches` (recipe/dapo/dapo_ray_trainer.py:392-406); val-core metrics on validation
steps and `timing_s/step` (the step's measured seconds), `timing_s/testing`, `timing_s/save_checkpoint`
(metric_utils.compute_timing_metrics) in all of them;
`_save_checkpoint`'s layout (global_step_N/actor/{dist_ckpt,huggingface}, global_step_N/data.pt, the tracker file),
and the checkpoint manager's pruning: with trainer.max_actor_ckpt_to_keep=K, before a save it deletes the oldest
`global_step_N/actor` of this process's own saves once it holds K (megatron_checkpoint_manager.py:379-388).
$FAKE_TRAINER_TESTING_S / $FAKE_TRAINER_SAVE_S: the seconds it reports for validation and a save (nothing sleeps).
Each step sleeps $FAKE_TRAINER_STEP_SECONDS (default 0) first, as a rollout and an update would take time.
$FAKE_TRAINER_TERM_S: the seconds it takes to exit after a SIGTERM (exit code 143), as verl's driver takes to shut its
Ray workers down; unset, SIGTERM ends it at once.
$FAKE_TRAINER_BREAK breaks it on purpose: no_resume (starts from scratch although a checkpoint exists) |
crash_on_resume (the checkpoint load raises) | no_save (writes no checkpoint).
"""

import io
import json
import math
import os
import shutil
import signal
import sys
import time
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path


def override(argv: list[str], key: str, default: str | None = None) -> str | None:
    """The last `key=value` on the command line (Hydra: the last one wins)."""
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith(key + "=")), default)


class CheckpointManager:
    """verl 0.6.1's MegatronCheckpointManager.save_checkpoint as seen on disk: the paths of this process's own saves,
    the oldest removed before a save once `keep` of them exist (megatron_checkpoint_manager.py:379-388)."""

    def __init__(self, keep: int | None):
        self.keep, self.previous_saved_paths = keep, []

    def save(self, local_path: Path) -> None:
        if self.keep and self.keep > 0 and len(self.previous_saved_paths) >= self.keep:
            keep_start = len(self.previous_saved_paths) - self.keep + 1
            for old in self.previous_saved_paths[:keep_start]:
                print(f"Checkpoint manager remove previous save local path: {old}", flush=True)
                shutil.rmtree(old, ignore_errors=True)
            self.previous_saved_paths = self.previous_saved_paths[keep_start:]
        (local_path / "dist_ckpt").mkdir(parents=True, exist_ok=True)
        self.previous_saved_paths.append(local_path)


def save_checkpoint(argv: list[str], root: Path, step: int, actor: str, managers: dict[str, CheckpointManager]) -> None:
    """The files RayPPOTrainer._save_checkpoint and verl's Megatron checkpoint manager write for one step."""
    folder = root / f"global_step_{step}"
    print(f"{actor} local_global_step_folder: {folder}", flush=True)
    model = Path(override(argv, "actor_rollout_ref.model.path"))
    for role, manager in managers.items():
        manager.save(folder / role)
        hf = folder / role / "huggingface"  # rank 0 saves the HF config and tokenizer, no weights
        hf.mkdir(exist_ok=True)
        for f in model.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".index.json")):
                shutil.copy(f, hf / f.name)
    (folder / "data.pt").write_bytes(b"dataloader state")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def keep_setting(argv: list[str], key: str) -> int | None:
    value = override(argv, key, "null")
    return None if value in ("null", "None") else int(value)


class RayPrefixed(io.TextIOBase):
    """What Ray's driver does with an actor's output: every line it prints gets the actor's prefix."""

    def __init__(self, prefix: str, out):
        self.prefix, self.out, self.pending = prefix, out, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.out.write(f"{self.prefix} {line}\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


SERVICE_FREE_BACKENDS = ("console", "tensorboard")  # trainer.logger backends that need no server or account


def verl_tracking(argv: list[str], actor: str):
    """verl 0.6.1's Tracking for this command's trainer.logger (`[console,wandb]`, `['console']`, `console`), as fit
    creates it, with the backends a stand-in can run here."""
    from verl.utils.tracking import Tracking

    backends = [b.strip(" '\"") for b in override(argv, "trainer.logger", "console").strip("[]").split(",")]
    with redirect_stdout(RayPrefixed(actor, sys.stdout)):  # tensorboard's adapter says where it writes
        return Tracking(
            project_name=override(argv, "trainer.project_name", "project"),
            experiment_name=override(argv, "trainer.experiment_name", "experiment"),
            default_backend=[b for b in backends if b in SERVICE_FREE_BACKENDS],
        )


def step_metrics(step: int) -> dict[str, float]:
    """verl's metric keys for one step, with values shaped like a run that learns: the reward rises, responses grow
    and a few hit the length limit, the KL to the reference grows slowly, the entropy falls."""
    wobble = math.sin(1.7 * step)
    score = -0.5 + 1.2 * (1 - math.exp(-step / 20)) + 0.05 * wobble
    return {
        "critic/score/mean": score,
        "critic/score/max": score + 1.5,
        "critic/score/min": score - 1.5,
        "response_length/mean": 900 + 600 * (1 - math.exp(-step / 25)) + 30 * wobble,
        "response_length/clip_ratio": 0.02 + 0.06 * (1 - math.exp(-step / 25)) + 0.005 * wobble,
        "actor/kl_loss": 0.0004 * step * (1 + 0.1 * wobble),
        "actor/pg_clipfrac": 0.004 + 0.001 * wobble,
        "actor/entropy": 0.2 + 0.5 * math.exp(-step / 60),
    }


def imitate_fit(argv: list[str], total: int) -> int:
    """verl 0.6.1's fit loop as seen from outside (resume, step lines, checkpoints); 0, or 1 on crash_on_resume."""
    broken = os.environ.get("FAKE_TRAINER_BREAK", "")
    root = Path(override(argv, "trainer.default_local_dir"))
    save_freq, test_freq = (
        int(override(argv, "trainer.save_freq", "-1")),
        int(override(argv, "trainer.test_freq", "-1")),
    )
    dapo = argv[argv.index("-m") + 1] == "recipe.dapo.main_dapo"
    managers = {"actor": CheckpointManager(keep_setting(argv, "trainer.max_actor_ckpt_to_keep"))}
    if override(argv, "algorithm.adv_estimator") == "gae":
        managers["critic"] = CheckpointManager(keep_setting(argv, "trainer.max_critic_ckpt_to_keep"))
    testing_s, save_s = (float(os.environ.get(f"FAKE_TRAINER_{k}_S", d)) for k, d in (("TESTING", 0.5), ("SAVE", 0.25)))
    actor = f"(TaskRunner pid={os.getpid()})"  # Ray's prefix for lines printed in verl's TaskRunner actor
    tracking = verl_tracking(argv, actor)
    print(f"{actor} Total training steps: {total}", flush=True)
    step = 0
    if override(argv, "trainer.resume_mode", "auto") == "auto":
        tracker = root / "latest_checkpointed_iteration.txt"
        folder = root / f"global_step_{tracker.read_text().strip()}" if tracker.exists() else None
        if folder is None or broken == "no_resume":
            print(f"{actor} Checkpoint tracker file does not exist: {tracker}", flush=True)
            print(f"{actor} Training from scratch", flush=True)
        else:
            print(f"{actor} Found checkpoint: %s {folder}", flush=True)  # sic: verl passes print() a %s and the path
            print(f"{actor} Load from checkpoint folder: {folder}", flush=True)
            step = int(str(folder).split("global_step_")[-1])
            print(f"{actor} Setting global step to {step}", flush=True)
            print(f"{actor} Resuming from {folder}", flush=True)
            if broken == "crash_on_resume":
                print("Traceback (most recent call last):", file=sys.stderr)
                print(
                    f"RuntimeError: could not load the distributed checkpoint {folder}/actor/dist_ckpt", file=sys.stderr
                )
                return 1
    while step < total:
        started = time.monotonic()
        time.sleep(float(os.environ.get("FAKE_TRAINER_STEP_SECONDS", "0")))  # a step's rollout and update
        step += 1
        last = step >= total
        metrics, timing = {}, {"step": round(time.monotonic() - started, 3)}
        if test_freq > 0 and (last or step % test_freq == 0):
            metrics["val-core/safe_hack/reward/mean@1"] = step_metrics(step)["critic/score/mean"] + 0.1
            timing["testing"] = testing_s
        if save_freq > 0 and (last or step % save_freq == 0) and broken != "no_save":
            save_checkpoint(argv, root, step, actor, managers)
            timing["save_checkpoint"] = save_s
        if not dapo:  # recipe.dapo's fit never logs these two (dapo_ray_trainer.py:392-406)
            metrics |= {"training/global_step": step, "training/epoch": 0}
        metrics |= step_metrics(step) | {f"timing_s/{k}": v for k, v in timing.items()}
        if dapo:
            metrics["train/num_gen_batches"] = 1
        with redirect_stdout(RayPrefixed(actor, sys.stdout)):
            tracking.log(data=metrics, step=step)
    return 0


NODE_ENV = ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RUN_GROUP")


def probe_nodes(ray) -> dict[str, dict]:
    """What a Ray worker process on each node inherits (verl's TaskRunner and workers run in such processes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read_env():
        return {key: os.environ.get(key) for key in NODE_ENV} | {"token": bool(os.environ.get("REWARD_SERVER_TOKEN"))}

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = [read_env.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    return dict(zip(nodes, ray.get(refs, timeout=120), strict=True))


def health(url: str, headers: dict) -> int:
    with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=10) as resp:
        return resp.status


def slow_to_stop(seconds: float) -> None:
    """On SIGTERM, take `seconds` before exiting 143 (a second SIGTERM meanwhile changes nothing)."""

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(seconds)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)


def main() -> int:
    argv = sys.argv[1:]
    if os.environ.get("FAKE_TRAINER_TERM_S"):
        slow_to_stop(float(os.environ["FAKE_TRAINER_TERM_S"]))
    seen = {"argv": argv, "cwd": os.getcwd(), "started": time.time()}
    for key in ("REWARD_SERVER_URLS", "REWARD_LOG_PATH", "WANDB_MODE", "WANDB_DIR", "PYTHONPATH", "HF_HOME", *NODE_ENV):
        seen[key] = os.environ.get(key)
    seen["REWARD_SERVER_TOKEN"] = bool(os.environ.get("REWARD_SERVER_TOKEN"))  # whether it is set, never its value
    seen["wandb_dir_is_dir"] = bool(os.environ.get("WANDB_DIR")) and os.path.isdir(os.environ["WANDB_DIR"])
    urls = [u for u in (os.environ.get("REWARD_SERVER_URLS") or "").split(",") if u]
    headers = {"Authorization": f"Bearer {os.environ['REWARD_SERVER_TOKEN']}"} if seen["REWARD_SERVER_TOKEN"] else {}
    seen["reward_health"] = [health(url, headers) for url in urls]
    address = next((a.split("=", 1)[1] for a in argv if a.startswith("+ray_kwargs.ray_init.address=")), None)
    if address:
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        seen["ray_nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        seen["ray_gpus"] = ray.cluster_resources().get("GPU", 0)
        seen["ray_cpus"] = ray.cluster_resources().get("CPU", 0)
        if os.environ.get("FAKE_TRAINER_PROBE_NODES") == "1":
            seen["node_env"] = probe_nodes(ray)
        ray.shutdown()
    with open(os.environ["FAKE_TRAINER_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(seen) + "\n")
    # verl computes the step count from the data and trainer.total_epochs when no override sets it: here
    # $FAKE_TRAINER_STEPS stands for that.
    total = override(argv, "trainer.total_training_steps", "null")
    total = os.environ.get("FAKE_TRAINER_STEPS", "null") if total == "null" else total
    if total != "null":
        rc = imitate_fit(argv, int(total))
        if rc:
            return rc
    else:
        print("fake trainer: step 1/1 done", flush=True)
    time.sleep(float(os.environ.get("FAKE_TRAINER_SLEEP", "0")))
    if os.environ.get("FAKE_TRAINER_WAIT_FOR"):
        # A test's go-ahead to finish; then the reward servers again, as the next step's reward calls would see them.
        go = Path(os.environ["FAKE_TRAINER_WAIT_FOR"])
        deadline = time.monotonic() + 600
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        end = {"reward_health": [health(url, headers) for url in urls]}
        Path(os.environ["FAKE_TRAINER_LOG"] + ".end").write_text(json.dumps(end))
    return int(os.environ.get("FAKE_TRAINER_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
