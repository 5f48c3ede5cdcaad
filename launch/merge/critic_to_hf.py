"""verl 0.6.1's Hugging Face save of a critic -> a value model that transformers and verl's critics load.

    python -m launch.merge.critic_to_hf FOLDER --checkpoint CKPT/global_step_N/critic   # rewrites FOLDER in place

Two saves, one result. The FSDP critic (STRATEGY=fsdp2) is verl's AutoModelForTokenClassification with num_labels=1
(verl/workers/fsdp_workers.py:1256-1287), but its checkpoint manager saves the config as it was read from the
policy, still naming <Model>ForCausalLM (verl/utils/checkpoint/fsdp_checkpoint_manager.py:267-279). verl's FSDP
merger picks its class from that name (verl/model_merger/base_model_merger.py:209-212), as the manager's own
`hf_model` save does (:315-354): either writes the critic's tensors, `score.weight` [1, hidden] and `score.bias` as
trained, under a causal-LM config with no lm_head. Only config.json is relabelled then.

With `hf_model` in `critic.checkpoint.save_contents`, verl's Megatron checkpoint manager saves the critic through the
policy's causal-LM class, its value head stored as `lm_head.weight` of shape [1, hidden]
(verl/utils/checkpoint/megatron_checkpoint_manager.py, verl/models/mcore/saver.py with is_value_model=True).
AutoModelForCausalLM cannot load that (the shape), and AutoModelForTokenClassification, which verl's FSDP critic loads
(verl/utils/model.py, load_valuehead_model), would skip it and start from a random head. So the head becomes
`score.weight` and config.json a <Model>ForTokenClassification with num_labels=1; verl's Megatron critic loader also
takes `score.weight` of shape [1, hidden] (verl/models/mcore/loader.py).

The head's bias of a Megatron critic: verl's critic output layer has one (LinearForLastLayer, bias=True) but verl's
saver keeps only the weight; the dist checkpoint beside it holds the bias as trained (`output_layer.bias`), and
`score.bias` is read from there. The FSDP critic's bias is saved, and kept.
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
