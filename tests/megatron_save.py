"""verl 0.6.1's own Megatron save of a tiny model on the CPU: real dist checkpoints for the merge's tests.

    python -m tests.megatron_save ROOT POLICY_DIR ROLE TP PP

Starts TP x PP processes (a gloo group on loopback, as a job's workers form it). Each builds verl's worker for ROLE
from the job's config (tests/megatron_worker.worker_config, with ACTOR_TP and ACTOR_PP; cpu/megatron_shims.install
first): `ActorRolloutRefWorker(role="actor")` for `actor`, PPO's `CriticWorker` with `hf_model` in its save contents for
`critic` (docs/merge.md). Each runs `init_model` (verl's loader reads POLICY_DIR) and `save_checkpoint` into
ROOT/global_step_1/ROLE; rank 0 writes ROOT/latest_checkpointed_iteration.txt. A critic's value-head bias is set to
0.25 first (a fresh head's is random), so a merge that drops it cannot pass by chance.

`build_policy(out, family, tied)` writes a tiny policy of another family (Llama, Qwen2) with the Qwen3 policy's
tokenizer and chat template (demo/tiny_models.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

CRITIC_BIAS = 0.25


def build_policy(out: Path, family: str, tied: bool) -> Path:
    """A tiny `family` (qwen3 | llama | qwen2) causal LM: hidden 64, 2 layers, 4 heads over 2 key/value groups, random
    weights (a Qwen2's attention biases too), the vocabulary padded to a multiple of 8 as real models pad it (TP=2
    splits it in two)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from demo.tiny_models import POLICY_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(POLICY_CHAT_TEMPLATE)
    config_class = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = config_class(
        vocab_size=-(-len(tokenizer) // 8) * 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=500_000.0,
        initializer_range=0.2,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    for name, tensor in model.named_parameters():
        if name.endswith("proj.bias"):
            torch.nn.init.normal_(tensor, std=0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save(root: str, policy: str, role: str, tp: str, pp: str) -> None:
    """One process of the group (RANK etc. in the environment): verl's worker, its init_model and its save."""
    root, policy, tp, pp = Path(root), Path(policy), int(tp), int(pp)
    from omegaconf import open_dict

    from cpu import megatron_shims
    from tests.megatron_worker import worker_config

    settings = {"ACTOR_TP": str(tp), "ACTOR_PP": str(pp), "ALGORITHM": "ppo" if role == "critic" else "grpo"}
    cfg = worker_config(policy, settings)
    megatron_shims.install()
    import torch
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.megatron_workers import ActorRolloutRefWorker, CriticWorker

    # sequence parallelism (verl's default at TP>1) is refused by the CPU layer's PyTorch norm (docs/verl-on-cpu.md)
    for megatron in (cfg.actor_rollout_ref.actor.megatron, cfg.critic.megatron):
        with open_dict(megatron):
            megatron.sequence_parallel = False
            megatron.override_transformer_config.sequence_parallel = False
    target = root / "global_step_1" / role
    if role == "critic":
        with open_dict(cfg.critic):
            cfg.critic.checkpoint.save_contents = ["model", "optimizer", "extra", "hf_model"]
            cfg.critic.megatron.param_offload = False  # the bias is set in place below
        worker = CriticWorker(config=omega_conf_to_dataclass(cfg.critic))
        worker.init_model()
        model = unwrap_model(worker.critic_module[0])
        if model.post_process:
            with torch.no_grad():
                model.output_layer.bias.fill_(CRITIC_BIAS)
        worker.save_checkpoint(str(target))
    else:
        worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        worker.save_checkpoint(str(target))
    if int(os.environ["RANK"]) == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("1\n")


def main(root: Path, policy: Path, role: str, tp: int, pp: int) -> int:
    from launch.plan.procs import free_port

    world, port = tp * pp, str(free_port())
    procs = []
    for rank in range(world):
        ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        env = dict(os.environ, **ranks, MASTER_PORT=port, PYTHONPATH=str(REPO))
        argv = [sys.executable, "-c", "import sys; from tests.megatron_save import save; save(*sys.argv[1:])"]
        procs.append(subprocess.Popen([*argv, str(root), str(policy), role, str(tp), str(pp)], cwd=REPO, env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    root, policy, role, tp, pp = sys.argv[1:6]
    sys.exit(main(Path(root), Path(policy), role, int(tp), int(pp)))
