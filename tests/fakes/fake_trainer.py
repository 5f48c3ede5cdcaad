"""A stand-in for `python3 -m verl.trainer.main_ppo ...` in launch tests: records what it was given and what it saw.

It writes one JSON object to $FAKE_TRAINER_LOG: its argv, the reward URLs and environment it inherited, the health of
every reward server (asked with this job's REWARD_SERVER_TOKEN, as the reward function sends it), and (with the Ray
address from `+ray_kwargs.ray_init.address=`) the alive Ray nodes and GPUs. With FAKE_TRAINER_PROBE_NODES=1 it also
runs one Ray task on every node and records what verl's workers there would see in their environment.
Then it sleeps $FAKE_TRAINER_SLEEP seconds and exits with $FAKE_TRAINER_RC (default 0).

Given `trainer.total_training_steps=N`, it also imitates what verl 0.6.1's RayPPOTrainer.fit shows from outside:
`_load_checkpoint` (resume_mode=auto: the tracker file, its messages, the step it resumes at), one console-logger line
per step (`step:N - ...`, with val-core metrics on validation steps, as Ray prints a TaskRunner actor's lines), and
`_save_checkpoint`'s layout (global_step_N/actor/{dist_ckpt,huggingface}, global_step_N/data.pt, the tracker file);
each step takes $FAKE_TRAINER_STEP_SECONDS (default 0).
$FAKE_TRAINER_BREAK breaks it on purpose: no_resume (starts from scratch although a checkpoint exists) |
crash_on_resume (the checkpoint load raises) | no_save (writes no checkpoint).
"""

import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path


def override(argv: list[str], key: str, default: str | None = None) -> str | None:
    """The last `key=value` on the command line (Hydra: the last one wins)."""
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith(key + "=")), default)


def save_checkpoint(argv: list[str], root: Path, step: int, actor: str) -> None:
    """The files RayPPOTrainer._save_checkpoint and verl's Megatron checkpoint manager write for one step."""
    folder = root / f"global_step_{step}"
    print(f"{actor} local_global_step_folder: {folder}", flush=True)
    roles = ["actor", "critic"] if override(argv, "algorithm.adv_estimator") == "gae" else ["actor"]
    model = Path(override(argv, "actor_rollout_ref.model.path"))
    for role in roles:
        (folder / role / "dist_ckpt").mkdir(parents=True, exist_ok=True)
        hf = folder / role / "huggingface"  # rank 0 saves the HF config and tokenizer, no weights
        hf.mkdir(exist_ok=True)
        for f in model.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".index.json")):
                shutil.copy(f, hf / f.name)
    (folder / "data.pt").write_bytes(b"dataloader state")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def imitate_fit(argv: list[str]) -> int:
    """verl 0.6.1's fit loop as seen from outside (resume, step lines, checkpoints); 0, or 1 on crash_on_resume."""
    broken = os.environ.get("FAKE_TRAINER_BREAK", "")
    total = int(override(argv, "trainer.total_training_steps"))
    root = Path(override(argv, "trainer.default_local_dir"))
    save_freq, test_freq = (
        int(override(argv, "trainer.save_freq", "-1")),
        int(override(argv, "trainer.test_freq", "-1")),
    )
    actor = f"(TaskRunner pid={os.getpid()})"  # Ray's prefix for lines printed in verl's TaskRunner actor
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
        time.sleep(float(os.environ.get("FAKE_TRAINER_STEP_SECONDS", "0")))  # a step's rollout and update
        step += 1
        last = step >= total
        metrics = {}
        if test_freq > 0 and (last or step % test_freq == 0):
            metrics["val-core/safe_hack/reward/mean@1"] = 0.25
        metrics |= {"training/global_step": step, "training/epoch": 0, "critic/score/mean": 0.5}
        if save_freq > 0 and (last or step % save_freq == 0) and broken != "no_save":
            save_checkpoint(argv, root, step, actor)
        print(f"{actor} step:{step} - " + " - ".join(f"{k}:{v}" for k, v in metrics.items()), flush=True)
    return 0


NODE_ENV = ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "WANDB_RUN_ID", "WANDB_RESUME")


def probe_nodes(ray) -> dict[str, dict]:
    """What a Ray worker process on each node inherits (verl's TaskRunner and workers run in such processes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read_env():
        return {key: os.environ.get(key) for key in NODE_ENV} | {"token": bool(os.environ.get("REWARD_SERVER_TOKEN"))}

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = [read_env.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    return dict(zip(nodes, ray.get(refs, timeout=120), strict=True))


def main() -> int:
    argv = sys.argv[1:]
    seen = {"argv": argv, "cwd": os.getcwd(), "started": time.time()}
    for key in ("REWARD_SERVER_URLS", "REWARD_LOG_PATH", "WANDB_MODE", "WANDB_DIR", "PYTHONPATH", "HF_HOME", *NODE_ENV):
        seen[key] = os.environ.get(key)
    seen["REWARD_SERVER_TOKEN"] = bool(os.environ.get("REWARD_SERVER_TOKEN"))  # whether it is set, never its value
    urls = [u for u in (os.environ.get("REWARD_SERVER_URLS") or "").split(",") if u]
    headers = {"Authorization": f"Bearer {os.environ['REWARD_SERVER_TOKEN']}"} if seen["REWARD_SERVER_TOKEN"] else {}
    seen["reward_health"] = []
    for url in urls:
        with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=10) as resp:
            seen["reward_health"].append(resp.status)
    address = next((a.split("=", 1)[1] for a in argv if a.startswith("+ray_kwargs.ray_init.address=")), None)
    if address:
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        seen["ray_nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        seen["ray_gpus"] = ray.cluster_resources().get("GPU", 0)
        if os.environ.get("FAKE_TRAINER_PROBE_NODES") == "1":
            seen["node_env"] = probe_nodes(ray)
        ray.shutdown()
    with open(os.environ["FAKE_TRAINER_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(seen) + "\n")
    if override(argv, "trainer.total_training_steps", "null") != "null":
        rc = imitate_fit(argv)
        if rc:
            return rc
    else:
        print("fake trainer: step 1/1 done", flush=True)
    time.sleep(float(os.environ.get("FAKE_TRAINER_SLEEP", "0")))
    return int(os.environ.get("FAKE_TRAINER_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
