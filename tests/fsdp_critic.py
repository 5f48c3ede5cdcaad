"""verl 0.6.1's own FSDP2 critic worker in this process, on the CPU: its checkpoint, as a PPO job with STRATEGY=fsdp2
saves it, without a job.

    python -m tests.fsdp_critic CKPT_ROOT POLICY_DIR OUT.json

Composes the job's trainer config (ALGORITHM=ppo STRATEGY=fsdp2, cpu/verl_shims.py's overrides, as the CPU job runs
it), builds verl's `CriticWorker` from its critic block in a one-process gloo group (cpu/verl_shims.install first, as
Ray's hook does in a job), runs `init_model`, and saves through the worker's own `save_checkpoint` (verl's
FSDPCheckpointManager) to CKPT_ROOT/global_step_1/critic, with the tracker file the trainer writes beside it. OUT.json
gets the worker's value head and its values for two texts, to compare a merge with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cpu import verl_shims
from launch.plan.preflight import compose, split_command
from launch.plan.procs import free_port
from launch.plan.settings import Settings
from launch.plan.trainer_command import trainer_argv
from tests.support import block_environment

TEXTS = ["the reward model explains the answer step by step", "hello world"]


def critic_config(policy: Path):
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH=str(policy),
        CONFIG_REWARD_MODEL_PATH=str(policy),
        CONFIG_TRAIN_FILE="train.parquet",
        CONFIG_TEST_FILE="test.parquet",
        CONFIG_OUTPUT_DIR="ckpt",
        STRATEGY="fsdp2",
        ALGORITHM="ppo",
        ROLLOUT_MODE="sync",
        REWARD_PROMPT_OPENS_THINK="true",
    )
    _, path, name, overrides = split_command(trainer_argv(Settings.from_env(env), extra=verl_shims.overrides()))
    # what RayPPOTrainer sets from the data before it builds the workers (ray_trainer.py, _create_dataloader)
    return compose(name, [*overrides, "critic.optim.total_training_steps=1"], path).critic


def main(root: Path, policy: Path, out: Path) -> None:
    cfg = critic_config(policy)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    verl_shims.install()
    import torch
    from transformers import AutoTokenizer
    from verl.workers.fsdp_workers import CriticWorker

    worker = CriticWorker(config=cfg)
    worker.init_model()
    worker.save_checkpoint(local_path=str(root / "global_step_1" / "critic"), global_step=1)
    (root / "latest_checkpointed_iteration.txt").write_text("1")

    module = worker.critic_module
    tokenizer = AutoTokenizer.from_pretrained(policy)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        values = module(**batch).logits[..., 0]
    head = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in module.named_parameters()}
    out.write_text(
        json.dumps(
            {
                "class": type(module).__name__,
                "score": {k: v.tolist() for k, v in head.items() if k.startswith("score.")},
                "values": values.tolist(),
                "attention_mask": batch["attention_mask"].tolist(),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
