"""verl 0.6.1's Hugging Face save of a critic -> a value model that transformers and verl's critics load.

    python -m launch.merge.critic_to_hf FOLDER --checkpoint CKPT/global_step_N/critic   # rewrites FOLDER in place

An FSDP critic's save keeps its tensors under the policy's causal-LM config: only config.json is relabelled. A
Megatron critic's `hf_model` save stores the value head as `lm_head.weight` [1, hidden]: it becomes `score.weight`
(its bias, which verl's saver drops, from the dist checkpoint's `output_layer.bias`) under a
<Model>ForTokenClassification config with num_labels=1. Why, with verl's lines: docs/merge.md.
"""

import argparse
import json
import sys
from pathlib import Path

from launch.merge import verify_hf

HEAD = "lm_head.weight"
SCORE = "score.weight"


class NotACritic(ValueError):
    """The folder does not hold verl's save of a critic (no [1, hidden] head, or a full lm_head)."""


def value_head_bias(ckpt: Path):
    """The Megatron critic's `output_layer.bias` [1] from its dist checkpoint (megatron-core's key), read alone."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder, bias = ckpt / "dist_ckpt", {"output_layer.bias": torch.empty(1)}
    missing = f"{folder} holds no output_layer.bias, the value head's bias of verl's Megatron critic"
    if not (folder / ".metadata").is_file():
        raise NotACritic(missing)
    try:
        dcp.load(bias, checkpoint_id=folder, no_dist=True)  # warns that one process reads it: meant
    except dcp.CheckpointException:  # no such key (a BaseException)
        raise NotACritic(missing) from None
    return bias["output_layer.bias"]


def to_value_model(folder: Path, checkpoint: Path) -> str:
    """Rewrite verl's critic save in `folder` (from the `checkpoint` folder) as a value model; returns what was done."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(folder)
    hidden = config.hidden_size
    weight_map, index = verify_hf.weight_map(folder), folder / "model.safetensors.index.json"
    if weight_map is None:
        raise NotACritic(f"{folder}: no model.safetensors and no model.safetensors.index.json")
    name = HEAD if HEAD in weight_map else SCORE if SCORE in weight_map else None
    if name is None:
        raise NotACritic(f"{folder} has no {HEAD} or {SCORE} [1, {hidden}]: a headless critic, its value head unsaved")
    shard = folder / weight_map[name]
    tensors = load_file(str(shard))
    head = tensors[name]
    if tuple(head.shape) != (1, hidden):
        raise NotACritic(f"{name} in {folder} has shape {list(head.shape)}, a value head is [1, {hidden}]: an actor's?")
    classes = AutoModelForTokenClassification._model_mapping
    if type(config) not in classes:
        raise NotACritic(f"transformers has no token-classification model for model_type={config.model_type}")
    if name == HEAD:  # verl's Megatron save: the head under the causal LM's name, its bias in the dist checkpoint
        bias = value_head_bias(checkpoint)
        del tensors[HEAD]
        tensors["score.weight"] = head
        tensors["score.bias"] = bias.reshape(1).to(head.dtype)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"].pop(HEAD)
            data["weight_map"].update({"score.weight": shard.name, "score.bias": shard.name})
            data.get("metadata", {}).pop("total_size", None)  # no longer exact; transformers does not need it
            index.write_text(json.dumps(data, indent=2))
        done = f"{HEAD} {list(head.shape)} -> score.weight, score.bias {float(bias):.4g} from {checkpoint}/dist_ckpt"
    else:  # verl's FSDP critic: the token-classification model's own tensors, bias included
        done = f"{SCORE} {list(head.shape)} kept as verl's FSDP critic trained it"
    config.architectures = [classes[type(config)].__name__]
    config.num_labels = 1
    config.tie_word_embeddings = False  # verl builds the critic untied (megatron_workers.py, critic init)
    config.save_pretrained(folder)
    return f"{done}, config.json -> {config.architectures[0]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--checkpoint", type=Path, required=True, help="the global_step_N/critic folder it was saved in")
    args = p.parse_args(argv)
    try:
        done = to_value_model(args.folder, args.checkpoint)
    except NotACritic as exc:
        print(f"critic_to_hf: {exc}", file=sys.stderr)
        return 1
    print(f"critic_to_hf: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
