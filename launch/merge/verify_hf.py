"""Prove a merged Hugging Face checkpoint is complete: files, shards, tensor names and shapes, head, parameter count.

    python -m launch.merge.verify_hf TARGET_DIR --tied true|false     # an actor (a causal LM)
    python -m launch.merge.verify_hf TARGET_DIR --value-model         # a critic (a value model)
    python -m launch.merge.verify_hf CONFIG_DIR --show-tie            # print true|false: what transformers reads

The expected tensors come from the checkpoint's own config.json: the model is built on the meta device (no memory),
and every tensor it has must be in the safetensors files with the same shape, nothing missing, nothing extra.
An actor has `lm_head.weight` exactly when its embeddings are untied, or, tied, as a copy equal to the embedding (what
verl's FSDP merger writes). A critic is a <Model>ForTokenClassification with num_labels=1 (what verl's FSDP critic
loads, and a head verl's Megatron critic loader accepts): its value head `score.weight` is [1, hidden]. Exit 1 with
every mismatch listed.
"""

import argparse
import json
import math
import sys
from pathlib import Path

TOKENIZER_ONE_OF = ("tokenizer.json", "vocab.json", "tokenizer.model")


def weight_map(folder: Path) -> dict[str, str] | None:
    """{tensor name: shard file}: model.safetensors.index.json's, else the single model.safetensors'; None without
    either."""
    from safetensors import safe_open

    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    if not single.exists():
        return None
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


def stored_tensors(target: Path) -> tuple[dict[str, tuple[int, ...]], list[str], int]:
    """{name: shape} from the safetensors headers (no tensor is loaded), problems, and the number of shards."""
    from safetensors import safe_open

    names = weight_map(target)
    if names is None:
        return {}, ["no model.safetensors and no model.safetensors.index.json"], 0
    shards, problems = sorted(set(names.values())), []
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        path = target / shard
        if not path.exists():
            problems.append(f"shard {shard} is listed in the index but missing")
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    for name, shard in names.items():
        if (target / shard).exists() and name not in shapes:
            problems.append(f"{name} is indexed in {shard} but not stored there")
    return shapes, problems, len(shards)


def config_tie(config_dir: Path) -> bool:
    """tie_word_embeddings as transformers reads config.json: without the key, the config class's default for that
    model type (Qwen3 and Llama: untied; Gemma: tied), not PretrainedConfig's True."""
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(config_dir).tie_word_embeddings)


def value_model_problems(config) -> list[str]:
    """A critic's config must describe a token-classification model with one output: the value."""
    arch = (config.architectures or ["(none)"])[0]
    if "ForTokenClassification" not in arch or config.num_labels != 1:
        return [
            f"config.json describes {arch} with num_labels={config.num_labels}: a critic is saved as "
            "<Model>ForTokenClassification with num_labels=1 (its value head); is this an actor's checkpoint?"
        ]
    return []


def expected_tensors(config, tied: bool, value_model: bool) -> tuple[dict[str, tuple[int, ...]], str]:
    """{name: shape} of every tensor the config's model stores, and the state-dict name of its input embedding
    (model.embed_tokens.weight for Qwen3 and Llama)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    if not value_model:
        config.tie_word_embeddings = tied
    with torch.device("meta"):
        model = auto.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied and not value_model:
        # save_pretrained stores a tied lm_head once, as the embedding
        shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    weight = model.get_input_embeddings().weight
    return shapes, next(name for name, t in model.state_dict(keep_vars=True).items() if t is weight)


def read_tensor(target: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(target / weight_map(target)[name]), framework="pt") as f:
        return f.get_tensor(name)


def tied_head_copy(target: Path, stored: dict, embedding: str) -> str | None:
    """A tied model's lm_head.weight stored beside its embedding: verl's FSDP merger writes both (its
    --tie-word-embedding is Megatron's only, verl/model_merger/base_model_merger.py:44-46), and transformers ties
    the head to the embedding on load. Harmless only when the two are the same tensor: a problem when they differ
    (the head the config would silently discard), None when they are equal."""
    import torch

    if embedding not in stored or stored[embedding] != stored["lm_head.weight"]:
        return "unexpected tensor lm_head.weight {} (the config says the embeddings are tied)".format(
            list(stored["lm_head.weight"])
        )
    if not torch.equal(read_tensor(target, "lm_head.weight"), read_tensor(target, embedding)):
        return (
            f"lm_head.weight differs from {embedding} although the config says they are tied: loading would "
            "discard the head"
        )
    return None


def verify(target: Path, tied: bool, value_model: bool = False) -> tuple[list[str], str]:
    from transformers import AutoConfig

    problems = []
    if not (target / "config.json").is_file():
        return [f"{target}/config.json is missing"], ""
    if not (target / "tokenizer_config.json").is_file() or not any((target / f).is_file() for f in TOKENIZER_ONE_OF):
        problems.append(f"tokenizer files missing (need tokenizer_config.json and one of {TOKENIZER_ONE_OF})")
    stored, shard_problems, shards = stored_tensors(target)
    problems += shard_problems
    config = AutoConfig.from_pretrained(target)
    if value_model and (config_problems := value_model_problems(config)):
        return problems + config_problems, ""
    expected, embedding = expected_tensors(config, tied, value_model)
    head = "tied embeddings, no lm_head" if tied else "untied embeddings, lm_head present"
    if tied and not value_model and "lm_head.weight" in stored and not shard_problems:
        problem = tied_head_copy(target, stored, embedding)
        if problem:
            problems.append(problem)
        else:
            head = "tied embeddings, lm_head stored too and equal to the embedding"
        stored = {k: v for k, v in stored.items() if k != "lm_head.weight"}
    for name in sorted(set(expected) - set(stored)):
        problems.append(f"missing tensor {name} {list(expected[name])}")
    for name in sorted(set(stored) - set(expected)):
        why = " (the config says the embeddings are tied)" if name == "lm_head.weight" else ""
        problems.append(f"unexpected tensor {name} {list(stored[name])}{why}")
    for name in sorted(set(expected) & set(stored)):
        if expected[name] != stored[name]:
            problems.append(f"{name} has shape {list(stored[name])}, the config implies {list(expected[name])}")
    if value_model and "score.weight" not in stored:
        shape = list(expected.get("score.weight", ()))
        problems.append(f"the value head score.weight {shape} is missing: a critic without its head")
    if not tied and not value_model and "lm_head.weight" not in stored:
        problems.append(
            "lm_head.weight is missing although the embeddings are untied (merged with --tie-word-embedding?)"
        )
    params = sum(math.prod(s) for s in stored.values())
    expected_params = sum(math.prod(s) for s in expected.values())
    if not problems and params != expected_params:
        problems.append(f"{params} parameters stored, the config implies {expected_params}")
    if value_model:
        head = f"value model, value head score.weight {list(stored.get('score.weight', ()))}"
    summary = f"{target}: {len(stored)} tensors in {shards} shard(s), {params / 1e9:.3f}e9 parameters, {head}"
    return problems, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", type=Path)
    p.add_argument("--tied", choices=["true", "false"], help="an actor's embeddings (required unless --value-model)")
    p.add_argument("--value-model", action="store_true", help="a critic: a token-classification model, one label")
    p.add_argument("--show-tie", action="store_true", help="print tie_word_embeddings as transformers reads it; exit")
    args = p.parse_args(argv)
    if args.show_tie:
        print(str(config_tie(args.target)).lower())
        return 0
    if args.tied is None and not args.value_model:
        p.error("--tied true|false is required for an actor (or pass --value-model for a critic)")
    problems, summary = verify(args.target, args.tied == "true", args.value_model)
    for problem in problems:
        print(f"verify: {problem}", file=sys.stderr)
    if problems:
        print(f"verify: FAILED, {len(problems)} problem(s) in {args.target}", file=sys.stderr)
        return 1
    print(f"verified {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
