"""A stand-in for `python3 -m verl.model_merger merge --backend megatron ...`: writes a tiny HF checkpoint the way
verl's merger would, from the config in <local_dir>/huggingface, sharded with an index.

Like verl 0.6.1, --tie-word-embedding drops lm_head whatever the config says, and --is-value-model changes nothing
(verl builds a causal LM either way: `value=False` in verl/model_merger/megatron_model_merger.py).
$FAKE_MERGER_BREAK breaks the output on purpose: missing_shard | drop_lm_head | extra_lm_head.
$FAKE_MERGER_RIVAL=full:DIR creates DIR, with a file in it, while merging, as a second merge of the same step would.
Records its argv to $FAKE_MERGER_LOG.

`save_critic_like_verl` writes what verl's checkpoint manager saves for a critic with `hf_model` in
`critic.checkpoint.save_contents`: the causal-LM class saved with a state dict whose lm_head.weight is [1, hidden].
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def save_critic_like_verl(config_dir: Path, target: Path, head: bool = True) -> None:
    """verl/utils/checkpoint/megatron_checkpoint_manager.py: AutoModelForCausalLM(...).save_pretrained(target,
    state_dict=<verl/models/mcore/saver.py's state dict, is_value_model=True>); head=False leaves the head out."""
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if head:
        state["lm_head.weight"] = torch.randn(1, config.hidden_size)
    model.save_pretrained(target, state_dict=state)


def main() -> int:
    argv = sys.argv[1:]
    with open(os.environ["FAKE_MERGER_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\n")
    local = Path(argv[argv.index("--local_dir") + 1])
    target = Path(argv[argv.index("--target_dir") + 1])
    config = AutoConfig.from_pretrained(local / "huggingface")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings or "--tie-word-embedding" in argv:
        state.pop("lm_head.weight", None)
    broken = os.environ.get("FAKE_MERGER_BREAK", "")
    if broken == "drop_lm_head":
        state.pop("lm_head.weight", None)
    if broken == "extra_lm_head":  # a head of its own in a tied model: loading would discard it
        state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    target.mkdir(parents=True, exist_ok=True)  # as verl: os.makedirs(target_dir, exist_ok=True)
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(target / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(target)
    for f in (local / "huggingface").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, target / f.name)
    rival = os.environ.get("FAKE_MERGER_RIVAL", "")
    if rival:
        path = Path(rival.partition(":")[2])
        path.mkdir(parents=True)
        (path / "rival.txt").write_text("another merge wrote this")
    if broken == "missing_shard":
        (target / "model-00002-of-00002.safetensors").unlink()
    print(f"fake merger: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
