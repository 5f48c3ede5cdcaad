"""A stand-in for `python3 -m verl.model_merger merge --backend megatron ...`: writes a tiny HF checkpoint the way
verl's merger would, from the config in <local_dir>/huggingface, sharded with an index.

Like verl 0.6.1, --tie-word-embedding drops lm_head whatever the config says. $FAKE_MERGER_BREAK breaks the output
on purpose: missing_shard | drop_lm_head | extra_lm_head. Records its argv to $FAKE_MERGER_LOG.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


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
    if "--is-value-model" in argv:
        state["lm_head.weight"] = torch.zeros(1, config.hidden_size)  # a value head: one output
    broken = os.environ.get("FAKE_MERGER_BREAK", "")
    if broken == "drop_lm_head":
        state.pop("lm_head.weight", None)
    if broken == "extra_lm_head":
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    target.mkdir(parents=True)
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
    if broken == "missing_shard":
        (target / "model-00002-of-00002.safetensors").unlink()
    print(f"fake merger: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
