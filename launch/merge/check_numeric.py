"""Prove numerically that a merged Hugging Face model computes what the checkpoint it came from computes.

    python -m launch.merge.check_numeric --checkpoint CKPT/global_step_N/actor --hf MERGED_FOLDER

The merged model through transformers, against a plain-torch Qwen3 forward over the checkpoint's own tensors (sharing
nothing with verl's merger), on a fixed probe batch: docs/merge.md says how and why the tolerances. A failure writes
UNVERIFIED.txt into the merged folder and exits 1; bad input exits 2 with one line.
"""

import argparse
import json
import re
import sys
import time
import warnings
from pathlib import Path

# name: (max |d log-prob| nats, mean |d log-prob| nats, share of top-1 changes, relative hidden-state difference)
TOLERANCES = {"fp32": (1e-3, 1e-4, 0.01, 1e-4), "bf16": (0.1, 0.01, 0.05, 3e-2)}
PROBE = [  # (user, assistant): short, mixed scripts, as training saw them: prompt with the generation prompt, reply
    ("What is two plus three?", "Two plus three is five."),
    ("Explain why the cluster node needs a GPU.", "Because the model is large, training it needs a GPU."),
    ("こんにちは、世界。質問です。", "はい、回答します。安全です。"),
    ("Please score this answer: yes or no?", "Maybe. The reward model gives it a score of seven."),
]
UNVERIFIED = "UNVERIFIED.txt"


class BadInput(ValueError):
    """Not what the check can compare: the message names what was expected."""


def load_checkpoint(ckpt: Path) -> tuple[dict, dict, str]:
    """(config, reference weights {embed, norm, head, layers: [{ln1, q, k, v, qn, kn, o, ln2, gate, up, down}]},
    the stored dtype) from verl's checkpoint folder, read without verl's merger."""
    config_file = ckpt / "huggingface" / "config.json"
    if not config_file.is_file():
        raise BadInput(f"{ckpt} is not a verl checkpoint folder: expected global_step_N/actor (or critic) with "
                       "huggingface/config.json and dist_ckpt/ or model_world_size_*_rank_*.pt")  # fmt: skip
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "qwen3" or config.get("rope_scaling") or config.get("attention_bias"):
        raise BadInput(f"{config_file}: model_type={config.get('model_type')}: the reference forward is Qwen3's "
                       "(no rope_scaling, no attention bias)")  # fmt: skip
    if (ckpt / "dist_ckpt" / ".metadata").is_file():
        return config, *_megatron_weights(ckpt / "dist_ckpt", config)
    shards = sorted(ckpt.glob("model_world_size_*_rank_*.pt"))
    if shards:
        return config, *_fsdp_weights(shards, config)
    raise BadInput(f"{ckpt} holds neither dist_ckpt/.metadata (Megatron) nor model_world_size_*_rank_*.pt (FSDP)")


def _megatron_weights(folder: Path, config: dict) -> tuple[dict, str]:
    """megatron-core's dist checkpoint: decoder.layers.* carry the layer index as their first dimension; linear_qkv
    rows are grouped per key/value head [its queries; k; v]; linear_fc1 is [gate; up]; the RMSNorms before attention
    and MLP are the layer_norm_weight of the linear they feed."""
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process reads it all: meant
    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if (k.startswith(("embedding.", "decoder.", "output_layer.")) and hasattr(m, "size"))}  # fmt: skip
    dcp.load(sd, storage_reader=reader, no_dist=True)
    dtype = str(sd["embedding.word_embeddings.weight"].dtype).removeprefix("torch.")
    sd = {k: v.float() for k, v in sd.items()}
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], _head_dim(config)
    layers = []
    for i in range(config["num_hidden_layers"]):
        t = {k.removeprefix("decoder.layers."): v[i] for k, v in sd.items() if k.startswith("decoder.layers.")}
        qkv = t["self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * dim, -1)
        q, k, v = qkv.split([heads // groups * dim, dim, dim], dim=1)
        gate, up = t["mlp.linear_fc1.weight"].chunk(2)
        layers.append(dict(
            ln1=t["self_attention.linear_qkv.layer_norm_weight"], q=q.reshape(heads * dim, -1), k=k.reshape(groups * dim, -1),
            v=v.reshape(groups * dim, -1), qn=t["self_attention.q_layernorm.weight"], kn=t["self_attention.k_layernorm.weight"],
            o=t["self_attention.linear_proj.weight"], ln2=t["mlp.linear_fc1.layer_norm_weight"], gate=gate, up=up,
            down=t["mlp.linear_fc2.weight"],
        ))  # fmt: skip
    embed = sd["embedding.word_embeddings.weight"][: config["vocab_size"]]  # Megatron may pad the vocabulary
    head = sd.get("output_layer.weight", embed)[: config["vocab_size"]]  # a critic's: [1, hidden], with a bias
    return dict(embed=embed, norm=sd["decoder.final_layernorm.weight"], head=head, layers=layers,
                bias=sd.get("output_layer.bias")), dtype  # fmt: skip


def _fsdp_weights(shards: list[Path], config: dict) -> tuple[dict, str]:
    """verl's FSDP2 save: one state dict of DTensors per rank under the model's own (Hugging Face) names, each
    tensor split along its Shard dimension; joined here in rank order."""
    import torch

    world = int(re.search(r"world_size_(\d+)", shards[0].name)[1])
    if len(shards) != world:
        raise BadInput(f"{shards[0].parent}: {len(shards)} of {world} model_world_size_{world}_rank_*.pt shards")
    parts = [torch.load(s, map_location="cpu", weights_only=False) for s in
             sorted(shards, key=lambda s: int(re.search(r"rank_(\d+)", s.name)[1]))]  # fmt: skip
    sd = {}
    for name, first in parts[0].items():
        if hasattr(first, "to_local"):
            (placement,) = first.placements
            local = [p[name].to_local() for p in parts]
            sd[name] = torch.cat(local, placement.dim) if placement.is_shard() else local[0]
        else:
            sd[name] = first
    dtype = str(sd["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    sd = {k: v.float() for k, v in sd.items()}
    p = "model.layers.{}."
    layers = [{key: sd[p.format(i) + name + ".weight"] for key, name in (
        ("ln1", "input_layernorm"), ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
        ("qn", "self_attn.q_norm"), ("kn", "self_attn.k_norm"), ("o", "self_attn.o_proj"),
        ("ln2", "post_attention_layernorm"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"),
    )} for i in range(config["num_hidden_layers"])]  # fmt: skip
    embed = sd["model.embed_tokens.weight"]
    head = sd.get("score.weight", sd.get("lm_head.weight", embed))
    return dict(embed=embed, norm=sd["model.norm.weight"], head=head, layers=layers, bias=sd.get("score.bias")), dtype


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def reference_forward(w: dict, config: dict, ids) -> tuple[list, object]:
    """Qwen3 in plain torch over one sequence: (hidden states as transformers reports them, head outputs [T, out]
    without the head's bias)."""
    import torch

    eps, dim = config["rms_norm_eps"], _head_dim(config)
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    n = len(ids)
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    cos, sin = (torch.cat([f(angles)] * 2, -1).float().to(w["embed"].device) for f in (torch.cos, torch.sin))

    def rope(x):  # [heads, n, dim]
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    mask = torch.ones(n, n, dtype=torch.bool, device=cos.device).tril()
    h = w["embed"][torch.as_tensor(ids, device=cos.device)]
    states = [h]
    for layer in w["layers"]:
        x = rms(h, layer["ln1"])
        q = rms((x @ layer["q"].T).view(n, heads, dim), layer["qn"]).transpose(0, 1)
        k = rms((x @ layer["k"].T).view(n, groups, dim), layer["kn"]).transpose(0, 1)
        v = (x @ layer["v"].T).view(n, groups, dim).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // groups, 0) for t in (k, v))
        scores = (q @ k.transpose(1, 2)) / dim**0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        h = h + attn.transpose(0, 1).reshape(n, heads * dim) @ layer["o"].T
        x = rms(h, layer["ln2"])
        h = h + (torch.nn.functional.silu(x @ layer["gate"].T) * (x @ layer["up"].T)) @ layer["down"].T
        states.append(h)
    states[-1] = rms(h, w["norm"])
    return states, states[-1] @ w["head"].T


def probe_batch(hf: Path) -> list[list[int]]:
    """The probe's token ids: each conversation's prompt (chat template, generation prompt) followed by its reply."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(hf)
    except Exception as exc:  # any reason transformers gives: the folder cannot tokenize
        raise BadInput(f"{hf}: no usable tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not tok.chat_template:
        raise BadInput(f"{hf}: the tokenizer has no chat_template (training formats prompts with it)")
    batch = []
    for user, reply in PROBE:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        batch.append(tok(prompt + reply + (tok.eos_token or ""), add_special_tokens=False).input_ids[:96])
    return batch


def config_problem(hf: Path, config: dict, value_model: bool) -> str | None:
    """The merged folder must describe the checkpoint's model, else it was made from another one."""
    merged = json.loads((hf / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rope_theta", "rms_norm_eps")  # fmt: skip
    diff = [f"{k} {merged.get(k)} (checkpoint: {config.get(k)})" for k in keys if merged.get(k) != config.get(k)]
    arch = (merged.get("architectures") or [""])[0]
    if value_model != ("ForTokenClassification" in arch):
        diff.append(f"architecture {arch} for a{' critic' if value_model else 'n actor'} checkpoint")
    return f"{hf} was not merged from this checkpoint: {', '.join(diff)}" if diff else None


def merged_dtype(hf: Path) -> str:
    from safetensors import safe_open

    first = sorted(hf.glob("*.safetensors"))
    if not first:
        raise BadInput(f"{hf}: no *.safetensors: not a merged Hugging Face model folder")
    with safe_open(str(first[0]), framework="pt") as f:
        return str(f.get_tensor(next(iter(f.keys()))).dtype).removeprefix("torch.")


def compare(ckpt: Path, hf: Path) -> dict:
    """Both sides on the probe batch: the figures, the tolerance used, and the first diverging hidden state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if not (hf / "config.json").is_file():
        raise BadInput(f"{hf}/config.json is missing: expected a merged Hugging Face model folder")
    config, weights, ckpt_dtype = load_checkpoint(ckpt)
    value_model = weights["head"].shape[0] == 1
    problem = config_problem(hf, config, value_model)
    if problem:
        raise BadInput(problem)
    batch, hf_dtype = probe_batch(hf), merged_dtype(hf)
    tolerance = "fp32" if hf_dtype == ckpt_dtype else "bf16"
    # both copies in float32 on the GPU when they fit in 80% of it (Qwen3-4B: 32 GB), else on the CPU
    layer = sum(t.numel() for t in weights["layers"][0].values())
    size = 8 * (layer * config["num_hidden_layers"] + weights["embed"].numel() + weights["head"].numel())
    fits = torch.cuda.is_available() and size < 0.8 * torch.cuda.get_device_properties(0).total_memory
    device = "cuda" if fits else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    # no dtype argument (its name changed in transformers 4.56): whatever it loads in, float32 here
    model = auto.from_pretrained(hf, attn_implementation="eager").float().to(device).eval()
    weights = {k: v if v is None or k == "layers" else v.to(device) for k, v in weights.items()}
    weights["layers"] = [{k: t.to(device) for k, t in layer.items()} for layer in weights["layers"]]
    diffs, flips, tokens, state_gaps = [], 0, 0, [0.0] * (config["num_hidden_layers"] + 1)
    with torch.no_grad():
        for ids in batch:
            got = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
            states, want = reference_forward(weights, config, ids)
            for i, (a, b) in enumerate(zip(got.hidden_states, states, strict=False)):  # embedding, each layer
                state_gaps[i] = max(state_gaps[i], ((a[0] - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
            a, b = got.logits[0].float(), want
            if value_model:  # net of each side's bias: verl's Megatron save drops it (compared below)
                diffs.append((a[:, 0] - _bias(model) - b[:, 0]).abs())
                continue
            target = torch.tensor(ids[1:], device=device)
            lp_a, lp_b = (x[:-1].log_softmax(-1).gather(1, target[:, None])[:, 0] for x in (a, b))
            diffs.append((lp_a - lp_b).abs())
            flips += int((a[:-1].argmax(-1) != b[:-1].argmax(-1)).sum())
            tokens += len(ids) - 1
    d = torch.cat(diffs)
    bias = weights.get("bias")  # the checkpoint's own value-head bias; None where it was not saved
    biases = (None if bias is None else float(bias.reshape(-1)[0]), _bias(model)) if value_model else None
    limit = TOLERANCES[tolerance]
    first = next((i for i, g in enumerate(state_gaps) if g > limit[3]), None)
    return dict(max=d.max().item(), mean=d.mean().item(), top1=flips / tokens if tokens else 0.0, tokens=int(d.numel()),
                tolerance=tolerance, dtypes=(ckpt_dtype, hf_dtype), value_model=value_model, device=device,
                first_divergence=first, biases=biases, layers=config["num_hidden_layers"], state_gaps=state_gaps)  # fmt: skip


def _bias(model) -> float:
    """A value model's head bias (score.bias; 0 without one)."""
    bias = getattr(getattr(model, "score", None), "bias", None)
    return 0.0 if bias is None else float(bias.detach().reshape(-1)[0])


def judge(figures: dict) -> list[str]:
    """What exceeds the tolerance, one line each (empty: the merged model agrees)."""
    max_lim, mean_lim, top1_lim, _ = TOLERANCES[figures["tolerance"]]
    what = "value" if figures["value_model"] else "log-prob"
    problems = [f"{name} |d {what}| {figures[key]:.3g} > {lim:g}" for name, key, lim in
                (("max", "max", max_lim), ("mean", "mean", mean_lim)) if figures[key] > lim]  # fmt: skip
    ckpt_bias, merged_bias = figures.get("biases") or (None, None)
    if ckpt_bias is not None and merged_bias != 0 and abs(ckpt_bias - merged_bias) > max_lim:
        problems.append(f"value head bias {merged_bias:.4g}, the checkpoint's {ckpt_bias:.4g}")
    if figures["top1"] > top1_lim:
        problems.append(f"top-1 prediction changed on {figures['top1']:.1%} of tokens > {top1_lim:.0%}")
    return problems


def where(figures: dict) -> str:
    i, layers = figures["first_divergence"], figures["layers"]
    if i is None:
        return (
            "every hidden state agrees: the output head differs (lm_head, its tie to the embedding, or the value head)"
        )
    gap = figures["state_gaps"][i]
    name = "the embedding" if i == 0 else f"layer {i - 1}" if i < layers else f"layer {layers - 1} or the final norm"
    hint = ": a wrong embedding, or a merge of another checkpoint (another step or run)" if i == 0 else ""
    return f"hidden states first diverge after {name} (relative difference {gap:.2g}){hint}"


def summary(figures: dict) -> str:
    what = "value" if figures["value_model"] else "log-prob"
    top1 = "" if figures["value_model"] else f", top-1 changed on {figures['top1']:.1%}"
    ckpt_bias, merged_bias = figures.get("biases") or (None, None)
    if ckpt_bias is not None and merged_bias == 0 and ckpt_bias != 0:
        top1 = f" (net of the head's bias {ckpt_bias:.3g}, which the merged model lacks: verl's save drops it)"
    return (f"max |d {what}| {figures['max']:.2g}, mean {figures['mean']:.2g}{top1} of {figures['tokens']} probe "
            f"tokens (tolerance {figures['tolerance']}: checkpoint {figures['dtypes'][0]}, merged {figures['dtypes'][1]};"
            f" {figures['device']})")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="verl's global_step_N/actor (or critic) folder")
    p.add_argument("--hf", type=Path, required=True, help="the merged Hugging Face model folder")
    args = p.parse_args(argv)
    start = time.monotonic()
    try:
        figures = compare(args.checkpoint, args.hf)
    except BadInput as exc:
        print(f"check_numeric: {exc}", file=sys.stderr)
        return 2
    problems = judge(figures)
    line = f"{summary(figures)} in {time.monotonic() - start:.1f} s"
    if not problems:
        print(f"numeric check passed: {line}")
        return 0
    reason = f"{'; '.join(problems)}: {where(figures)}"
    (args.hf / UNVERIFIED).write_text(
        f"The numeric check (launch/merge/check_numeric.py) failed against {args.checkpoint.resolve()}:\n{reason}\n"
        f"{line}\n"
    )
    print(f"check_numeric: FAILED: {reason}; {line}; marked {args.hf / UNVERIFIED}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
