#!/usr/bin/env python3
"""The trainer's stand-in for the embedded default (`make demo`): everything of a GRPO step that runs without a GPU.

Called by helper_grpo_qwen3_4b.sh exactly where the trainer would be, with the trainer's own arguments
(`-m verl.trainer.main_ppo --config-path=config --config-name=... overrides...`), it:
1. composes that config with verl 0.6.1's Hydra config and runs verl's own checks (as the preflight does);
2. connects to this job's Ray cluster at the address the trainer would use, and counts its nodes;
3. builds verl's reward manager from that config (our reward file, loaded by path as verl loads it) and scores
   demo responses for validation prompts through the real reward server: a DataProto as verl builds it after rollout.
It exits 0 only when every step passed, and says what would need GPUs.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.preflight import compose, split_command, validate  # noqa: E402

DEMO_RESPONSES = [
    "The user asks about safety. I should answer carefully.</think>Store it away from children and read the label.",
    "Let me think about the risks.</think>Never mix it with other products; ask a professional if unsure.",
    "This is a long line of reasoning that was cut off before it ended",  # no </think>: penalized, not scored
    "Thinking.</think>気をつけて、説明書をよく読んでください。",
]


def demo_batch(config, tokenizer, rows: list[dict]):
    """Left-padded prompts and right-padded responses, as verl's rollout hands them to the reward manager."""
    import numpy as np
    import torch
    from verl import DataProto

    prompts = [
        tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in rows
    ]
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = [DEMO_RESPONSES[i % len(DEMO_RESPONSES)] for i in range(len(rows))]
    r_ids = [tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for r in responses]
    pl, rl, pad = max(map(len, p_ids)), max(map(len, r_ids)), tokenizer.pad_token_id
    prompt_t = torch.tensor([[pad] * (pl - len(p)) + p for p in p_ids])
    resp_t = torch.tensor([r + [pad] * (rl - len(r)) for r in r_ids])
    mask = torch.tensor(
        [[0] * (pl - len(p)) + [1] * (len(p) + len(r)) + [0] * (rl - len(r)) for p, r in zip(p_ids, r_ids, strict=True)]
    )
    data = DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": resp_t,
            "input_ids": torch.cat([prompt_t, resp_t], 1),
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array([r["data_source"] for r in rows], dtype=object),
            "reward_model": np.array([dict(r["reward_model"]) for r in rows], dtype=object),
            "extra_info": np.array([dict(r["extra_info"]) for r in rows], dtype=object),
        },
    )
    return data, responses, [len(r) for r in r_ids]


def main(argv: list[str]) -> int:
    import pandas as pd
    import ray
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    t0 = time.monotonic()
    module, path, name, overrides = split_command(argv)
    config = compose(name, overrides, path)
    validate(config)
    print(f"[ok] {module} --config-name={name}: {len(overrides)} overrides compose and pass verl's own checks")

    address = next((o.split("=", 1)[1] for o in overrides if o.startswith("+ray_kwargs.ray_init.address=")), None)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    print(f"[ok] connected to this job's Ray cluster at {address}: {nodes} node(s), {ray.cluster_resources()}")
    ray.shutdown()

    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    rows = pd.read_parquet(config.data.val_files).head(8).to_dict("records")
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0, **config.reward_model.get("reward_kwargs", {}))
    data, responses, lengths = demo_batch(config, tokenizer, rows)
    reward_tensor, extra = compute_reward(data, reward_fn)
    scores = [reward_tensor[i, lengths[i] - 1].item() for i in range(len(rows))]
    penalized = [int(x) for x in extra["penalized"]]
    expected_penalties = [int("</think>" not in r) for r in responses]
    print(f"[ok] verl's {config.reward_model.reward_manager} reward manager scored {len(rows)} demo responses "
          f"through the reward server ({config.custom_reward_function.name}):")  # fmt: skip
    for row, score, pen in zip(rows, scores, penalized, strict=True):
        print(
            f"     {score:+8.3f}{'  (penalty: cut off mid-reasoning)' if pen else ''}  {row['prompt'][-1]['content'][:50]!r}"
        )
    if penalized != expected_penalties:
        print(f"[FAIL] penalties {penalized}, expected {expected_penalties}", file=sys.stderr)
        return 1
    print(f"demo round trip finished in {time.monotonic() - t0:.1f} s")
    print(
        "needs GPUs, not run here: SGLang rollout, Megatron actor/ref updates, checkpoints "
        "(verl 0.6.1 has no CPU rollout engine).\n"
        "to train for real: build the image (sudo singularity build verl_app.sif verl_app.def), build data with "
        "python -m data_prep.build, edit the settings at the top of run_grpo_qwen3_4b_mega_verl.sh, then "
        "sbatch run_grpo_qwen3_4b_mega_verl.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
