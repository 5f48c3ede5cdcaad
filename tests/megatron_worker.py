"""verl 0.6.1's own Megatron actor worker in this process, on the CPU, for tests that need the worker's own view.

    python -m tests.megatron_worker OUT.json POLICY_DIR [KEY=VALUE ...]

Composes the job's trainer config from the settings block's defaults with KEY=VALUE settings on top
(launch.plan.trainer_command.trainer_argv, with cpu/megatron_shims.py's overrides, as make demo runs it), builds verl's
`ActorRolloutRefWorker(role="actor_rollout")` (the hybrid worker of a job, its HF rollout included) from it in a
one-process gloo group (cpu/megatron_shims.install first, as Ray's
hook does in a job), runs `init_model` and `compute_log_prob` on two texts of different lengths, and writes what the
running worker holds: its TransformerConfig, whether its parameters and optimizer are offloaded, the parameter
names of its layers, and its log-probs beside the HF model's (float32 and bfloat16) for the same tokens; then one
`update_actor` on them (with the job's recompute setting), and its actor/ metrics (grad_norm, pg_loss, ...).

In the same process, as a job colocates them: the reference, `ActorRolloutRefWorker(role="ref")` from the same
config, with its `compute_ref_log_prob` twice on the same tokens; and PPO's critic, verl's `CriticWorker` from the
job's command with ALGORITHM=ppo, with its `compute_values` twice, beside a second critic built with
`critic.megatron.param_offload=False`. Each reports verl's own offload flag, every move verl's worker makes of a
module between host and device (its calls of megatron_utils' offload/load, in order), and for the critic the size of
its DDP buffers' storage between passes (0: freed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cpu import megatron_shims
from launch.plan.preflight import compose, split_command
from launch.plan.procs import free_port
from launch.plan.settings import Settings
from launch.plan.trainer_command import trainer_argv
from tests.support import block_environment

TEXTS = ["the reward model explains the answer step by step", "hello world"]
TF_FIELDS = [
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "num_layers",
    "hidden_size",
    "pipeline_model_parallel_size",
    "tensor_model_parallel_size",
    "bf16",
    "params_dtype",
    "use_cpu_initialization",
]


def worker_config(policy: Path, settings: dict[str, str]):
    env = (
        block_environment()
        | dict(
            CONTAINER="none",
            CONFIG_MODEL_PATH=str(policy),
            CONFIG_REWARD_MODEL_PATH=str(policy),
            CONFIG_TRAIN_FILE="train.parquet",
            CONFIG_TEST_FILE="test.parquet",
            CONFIG_OUTPUT_DIR="ckpt",
            STRATEGY="megatron",
            ROLLOUT_MODE="sync",
            REWARD_PROMPT_OPENS_THINK="true",
            ACTOR_PP="1",
            ACTOR_TP="1",
        )
        | settings
    )
    _, path, name, overrides = split_command(trainer_argv(Settings.from_env(env), extra=megatron_shims.overrides()))
    # what RayPPOTrainer sets from the data before it builds the workers (ray_trainer.py, _create_dataloader)
    steps = ["actor_rollout_ref.actor.optim.total_training_steps=1", "critic.optim.total_training_steps=1"]
    return compose(name, [*overrides, *steps], path)


def hf_log_probs(policy: Path, batch, dtype) -> list[list[float]]:
    """Each response token's log-prob under the HF model, as verl computes it (logits at t-1 for token t)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return logp[:, -batch["responses"].shape[1] :].tolist()


def update_metrics(worker, batch: dict, old_log_probs) -> dict:
    """One update_actor, as the trainer calls it (ray_trainer.py: old and reference log-probs, advantages, the
    temperature and token counts in meta_info), on one mini-batch: the two texts repeated to the worker's own
    ppo_mini_batch_size (after it scales it by rollout.n over data-parallel ranks), opposite advantages for each."""
    import torch
    from verl import DataProto

    rows = worker.config.actor.ppo_mini_batch_size
    pick = torch.arange(rows) % len(TEXTS)
    tensors = {key: value[pick] for key, value in batch.items()}
    sign = torch.where(pick % 2 == 0, 1.0, -1.0)[:, None]
    tensors |= dict(
        old_log_probs=old_log_probs[pick],
        ref_log_prob=old_log_probs[pick],
        advantages=sign * tensors["response_mask"].float(),
    )
    meta = {"temperature": 1.0, "global_token_num": tensors["attention_mask"].sum(-1).tolist()}
    # megatron-core recomputes a checkpointed chunk of layers in CheckpointFunction.backward (tensor_parallel/
    # random.py:440): counted, since a module in eval mode skips recompute silently (transformer_block.py:562)
    from megatron.core.tensor_parallel import random as mcore_random

    recomputed, backward = [], mcore_random.CheckpointFunction.backward
    mcore_random.CheckpointFunction.backward = staticmethod(lambda ctx, *a: recomputed.append(1) or backward(ctx, *a))
    metrics = worker.update_actor(DataProto.from_dict(tensors=tensors, meta_info=meta)).meta_info["metrics"]
    mcore_random.CheckpointFunction.backward = staticmethod(backward)
    flat = lambda v: [x for item in v for x in flat(item)] if isinstance(v, list | tuple) else [float(v)]  # noqa: E731
    out = {key: flat(value) for key, value in metrics.items() if key.startswith("actor/")}
    return out | {"recomputed_chunks": len(recomputed)}


def record_moves(workers_module) -> list[list]:
    """Every offload/load verl's worker module makes (megatron_workers.py imports both names from megatron_utils), in
    order, as [the module's chunk list, "offload" | "load"]; `named` labels them once the workers hold them."""
    moves = []
    for verb, attr in (("offload", "offload_megatron_model_to_cpu"), ("load", "load_megatron_model_to_gpu")):
        call = getattr(workers_module, attr)

        def move(models, *args, _call=call, _verb=verb, **kwargs):
            moves.append([models, _verb])
            return _call(models, *args, **kwargs)

        setattr(workers_module, attr, move)
    return moves


def buffer_sizes(module) -> dict[str, list[int]]:
    """The storage size of each DDP buffer's parameters and gradients (megatron_utils.py:343,350 resize them to 0)."""
    buffers = [b for chunk in module for b in chunk.buffers]
    return {
        "param": [b.param_data.storage().size() for b in buffers],
        "grad": [b.grad_data.storage().size() for b in buffers],
    }


def reference_and_critic(policy: Path, settings: dict[str, str], cfg, data, moves, names) -> dict:
    """The reference and PPO's critic, as the job's settings make them, in this process (see the module's doc)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.megatron_workers import ActorRolloutRefWorker, CriticWorker

    ref = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="ref")
    ref.init_model()
    names[id(ref.ref_module)] = "ref"
    moves.append(["ref", "init_model done"])
    ref_passes = [ref.compute_ref_log_prob(data).batch["ref_log_prob"].tolist() for _ in range(2)]

    ppo = worker_config(policy, settings | {"ALGORITHM": "ppo"}).critic
    critics = {}
    for offload in (True, False):
        critic_cfg = ppo.copy()
        if not offload:
            with open_dict(critic_cfg):
                critic_cfg.megatron.param_offload = False
        critic = CriticWorker(config=omega_conf_to_dataclass(critic_cfg))
        critic.init_model()
        name = "critic" if offload else "critic_resident"
        names[id(critic.critic_module)] = name
        moves.append([name, "init_model done"])
        sizes = [buffer_sizes(critic.critic_module)]
        passes = []
        for _ in range(2):
            passes.append(critic.compute_values(data).batch["values"].tolist())
            sizes.append(buffer_sizes(critic.critic_module))
        critics[name] = {"param_offload": critic._is_offload_param, "values": passes, "buffer_sizes": sizes}
    return {
        "ref": {
            "param_offload": ref._ref_is_offload_param,
            "log_probs": ref_passes,
            "use_fused_kernels": ref.ref_policy.use_fused_kernels,
        },
        **critics,
    }


def main(out: Path, policy: Path, settings: dict[str, str]) -> None:
    cfg = worker_config(policy, settings)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    megatron_shims.install()
    import torch
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.workers import megatron_workers
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    names: dict[int, str] = {}
    moves = record_moves(megatron_workers)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    names[id(worker.actor_module)] = "actor"

    # Two sequences, left-padded prompts and right-padded responses as verl's rollout returns them.
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    prompt_len, response_len = 4, max(len(i) for i in ids) - 4
    input_ids = torch.full((len(ids), prompt_len + response_len), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(ids):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, prompt_len:],
        response_mask=attention_mask[:, prompt_len:],
    )
    data = DataProto.from_dict(tensors=batch, meta_info={})
    old_log_probs = worker.compute_log_prob(data).batch["old_log_probs"]
    megatron = old_log_probs.tolist()
    mask = attention_mask[:, prompt_len:].tolist()

    tf = worker.actor.tf_config if hasattr(worker, "actor") else worker.tf_config
    layer = worker.actor_module[0]
    report = {
        "transformer_config": {f: str(getattr(tf, f, None)) for f in TF_FIELDS},
        "param_offload": worker._is_offload_param,
        "optimizer_offload": worker._is_offload_optimizer,
        "parameter_names": [name for name, _ in layer.named_parameters()],
        "state_dict_keys": list(layer.state_dict().keys()),
        "megatron": megatron,
        "hf_float32": hf_log_probs(policy, batch, torch.float32),
        "hf_bfloat16": hf_log_probs(policy, batch, torch.bfloat16),
        "response_mask": mask,
        "update": update_metrics(worker, batch, old_log_probs),
        **reference_and_critic(policy, settings, cfg, data, moves, names),
        "moves": [[m if isinstance(m, str) else names.get(id(m), "other"), verb] for m, verb in moves],
        "use_fused_kernels": worker.actor.use_fused_kernels,  # MegatronPPOActor's own (megatron_actor.py:132)
    }
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), dict(arg.split("=", 1) for arg in sys.argv[3:]))
