"""Prove a merged Hugging Face checkpoint is complete: files, shards, tensor names and shapes, lm_head, parameter count.

    python -m launch.verify_hf TARGET_DIR --tied true|false [--value-model] [--load]

The expected tensors come from the checkpoint's own config.json: the model is built on the meta device (no memory),
and every tensor it has must be in the safetensors files with the same shape, nothing missing, nothing extra.
`lm_head.weight` must be present exactly when the embeddings are untied. Exit 1 with every mismatch listed.
"""

import argparse
import json
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer_config.json",)
TOKENIZER_ONE_OF = ("tokenizer.json", "vocab.json", "tokenizer.model")


def stored_tensors(target: Path) -> tuple[dict[str, tuple[int, ...]], list[str], int]:
    """{name: shape} from the safetensors headers (no tensor is loaded), problems, and the number of shards."""
    from safetensors import safe_open

    problems = []
    index = target / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    elif (target / "model.safetensors").exists():
        weight_map, shards = None, ["model.safetensors"]
    else:
        return {}, ["no model.safetensors and no model.safetensors.index.json"], 0
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        path = target / shard
        if not path.exists():
            problems.append(f"shard {shard} is listed in the index but missing")
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if weight_map is not None:
        for name, shard in weight_map.items():
            if (target / shard).exists() and name not in shapes:
                problems.append(f"{name} is indexed in {shard} but not stored there")
    return shapes, problems, len(shards)


def expected_tensors(target: Path, tied: bool, value_model: bool) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(target)
    config.tie_word_embeddings = tied
    arch = (config.architectures or [""])[0]
    auto = AutoModelForTokenClassification if "ForTokenClassification" in arch else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied:
        # save_pretrained stores a tied lm_head once, as the embedding
        shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    if value_model:
        shapes = {k: v for k, v in shapes.items() if not k.startswith(("lm_head.", "score."))}
    return shapes


def verify(target: Path, tied: bool, value_model: bool = False, load: bool = False) -> tuple[list[str], str]:
    problems = []
    if not (target / "config.json").is_file():
        return [f"{target}/config.json is missing"], ""
    if not all((target / f).is_file() for f in TOKENIZER_FILES) or not any(
        (target / f).is_file() for f in TOKENIZER_ONE_OF
    ):
        problems.append(
            f"tokenizer files missing in {target} (need {TOKENIZER_FILES[0]} and one of {TOKENIZER_ONE_OF})"
        )
    stored, shard_problems, shards = stored_tensors(target)
    problems += shard_problems
    expected = expected_tensors(target, tied, value_model)
    heads = {k: v for k, v in stored.items() if k.startswith(("lm_head.", "score."))} if value_model else {}
    body = {k: v for k, v in stored.items() if k not in heads}
    for name in sorted(set(expected) - set(body)):
        problems.append(f"missing tensor {name} {list(expected[name])}")
    for name in sorted(set(body) - set(expected)):
        why = " (the config says the embeddings are tied)" if name == "lm_head.weight" else ""
        problems.append(f"unexpected tensor {name} {list(body[name])}{why}")
    for name in sorted(set(expected) & set(body)):
        if expected[name] != body[name]:
            problems.append(f"{name} has shape {list(body[name])}, the config implies {list(expected[name])}")
    if not tied and not value_model and "lm_head.weight" not in stored:
        problems.append(
            "lm_head.weight is missing although the embeddings are untied (merged with --tie-word-embedding?)"
        )
    params = sum(_numel(s) for s in stored.values())
    expected_params = sum(_numel(s) for s in expected.values()) + sum(_numel(s) for s in heads.values())
    if not problems and params != expected_params:
        problems.append(f"{params} parameters stored, the config implies {expected_params}")
    if load and not problems:
        problems += _load_on_meta(target)
    summary = (
        f"{target}: {len(stored)} tensors in {shards} shard(s), {params / 1e9:.3f}e9 parameters, "
        f"{'tied embeddings, no lm_head' if tied else 'untied embeddings, lm_head present'}"
        + (f", value head {sorted(heads)}" if value_model else "")
    )
    return problems, summary


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _load_on_meta(target: Path) -> list[str]:
    try:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(target, device_map="meta")
    except Exception as exc:  # reported as a verification failure, with transformers' words
        return [f"transformers cannot load it: {type(exc).__name__}: {exc}"]
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", type=Path)
    p.add_argument("--tied", choices=["true", "false"], required=True)
    p.add_argument("--value-model", action="store_true")
    p.add_argument("--load", action="store_true", help="also load it with transformers on the meta device")
    args = p.parse_args(argv)
    problems, summary = verify(args.target, args.tied == "true", args.value_model, args.load)
    for problem in problems:
        print(f"verify: {problem}", file=sys.stderr)
    if problems:
        print(f"verify: FAILED, {len(problems)} problem(s) in {args.target}", file=sys.stderr)
        return 1
    print(f"verified {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
