"""Prove numerically that a merged Hugging Face model computes what the checkpoint it came from computes.

    python -m launch.merge.check_numeric --checkpoint CKPT/global_step_N/actor --hf MERGED_FOLDER

A probe batch (short chat-templated conversations, the merged folder's tokenizer) through both, each holding the merged
folder's numbers (the checkpoint's weights rounded to the dtype it stores) and computing in float32: the merged model
in transformers; the checkpoint as verl trained it, a Megatron dist_ckpt in megatron-core's GPTModel built, loaded and
run as verl does (a child process on the CPU, through cpu/megatron_shims.py), an FSDP checkpoint's joined shards in the
transformers model verl's FSDP workers train. Reported: max and mean |difference| of the per-token log-probs (a critic:
values), the share of changed top-1 predictions and, on failure, the first hidden state where the two diverge.
Exit 0: they agree; 1: they differ (UNVERIFIED.txt, the reason, is written into the merged folder; nothing deleted);
2: nothing could be compared (one line, its cause); 3: this model cannot be compared here (one line, why).
docs/merge.md says why each side is built so, and the tolerances.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# max |d log-prob| nats, mean |d log-prob| nats, share of top-1 changes, relative hidden-state difference: float32
# arithmetic on equal weights (docs/merge.md says why)
TOLERANCE = (1e-3, 1e-4, 0.01, 1e-4)
# The dense models verl 0.6.1 builds on Megatron (verl/models/mcore/registry.py; Qwen2.5 is Qwen2ForCausalLM)
DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PROBE = [  # (user, assistant): short, mixed scripts, as training saw them: prompt with the generation prompt, reply
    ("What is two plus three?", "Two plus three is five."),
    ("Explain why the cluster node needs a GPU.", "Because the model is large, training it needs a GPU."),
    ("こんにちは、世界。質問です。", "はい、回答します。安全です。"),
    ("Please score this answer: yes or no?", "Maybe. The reward model gives it a score of seven."),
]
UNVERIFIED = "UNVERIFIED.txt"
REPO = Path(__file__).resolve().parents[2]


class BadInput(ValueError):
    """Nothing could be compared: the message names what was expected."""


class NotComparable(ValueError):
    """This model cannot be compared here: the message says why."""


def read_checkpoint(ckpt: Path) -> tuple:
    """(its huggingface/config.json, megatron | fsdp, the stored dtype, a value model?) of verl's checkpoint folder."""
    config_file = ckpt / "huggingface" / "config.json"
    if not config_file.is_file():
        raise BadInput(f"{ckpt} is not a verl checkpoint folder: expected global_step_N/actor (or critic)")
    config = json.loads(config_file.read_text())
    if (ckpt / "dist_ckpt" / ".metadata").is_file():
        arch, scaling = (config.get("architectures") or ["?"])[0], config.get("rope_scaling") or {}
        rope = scaling.get("rope_type", scaling.get("type", "linear"))
        if arch not in DENSE:
            raise NotComparable(f"{arch}: the check builds verl 0.6.1's dense Megatron models only: {', '.join(DENSE)}")
        if rope != "linear":  # verl: seq_len_interpolation_factor whatever the type (model_initializer.py:44-47)
            raise NotComparable(f"rope_scaling {rope}: verl 0.6.1 trains any as linear interpolation, not {rope}")
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(ckpt / "dist_ckpt")).read_metadata().state_dict_metadata
        embedding = meta.get("embedding.word_embeddings.weight")
        if embedding is None:  # the model is in huggingface/ (mbridge's save), which the merge copies as it is
            raise NotComparable(f"{ckpt}/dist_ckpt holds no model weights (embedding.word_embeddings.weight)")
        head = meta.get("output_layer.weight")
        return config, "megatron", embedding.properties.dtype, head is not None and head.size[0] == 1
    if list(ckpt.glob("model_world_size_*_rank_*.pt")):
        return config, "fsdp", None, None  # both read from the shards, by fsdp_model
    raise BadInput(f"{ckpt} holds neither dist_ckpt/.metadata (Megatron) nor model_world_size_*_rank_*.pt (FSDP)")


def megatron_reference(ckpt: Path, batch: list[list[int]], dtype: str, store: Path) -> list:
    """[(hidden states as transformers reports them, outputs)] of each probe sequence from megatron-core's GPTModel
    built,
    loaded and run as verl does. In a process of its own: the CPU layer's shims are process-wide."""
    from cpu import megatron_shims

    sys.modules["transformer_engine"] = None  # an image's TE unused: megatron-core's TE-free paths, as tested here
    megatron_shims.install()
    import torch
    from megatron.core import mpu, tensor_parallel
    from transformers import AutoConfig
    from verl.models.mcore import get_mcore_forward_fn, hf_to_mcore_config
    from verl.utils.megatron.dist_checkpointing import load_dist_checkpointing
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module, unwrap_model

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mpu.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf_config = AutoConfig.from_pretrained(ckpt / "huggingface")
    _, _, stored, value_model = read_checkpoint(ckpt)
    tf_config = hf_to_mcore_config(hf_config, stored, use_cpu_initialization=True, perform_initialization=False)
    tied = getattr(hf_config, "tie_word_embeddings", False) and not value_model  # verl's critic: untied
    wrap = McoreModuleWrapperConfig(value_model, tied, wrap_with_ddp=False)  # the value head, the tie; as the merger
    (model,) = make_megatron_module(wrap, tf_config, hf_config)
    state = load_dist_checkpointing({"model": model.sharded_state_dict()}, str(ckpt / "dist_ckpt"))
    model.load_state_dict(state["model"])
    model = unwrap_model(model).eval()
    for p in model.parameters():
        p.data = p.data.to(getattr(torch, dtype)).float()
    states = []
    for module in [model.embedding, *model.decoder.layers, model.decoder.final_layernorm]:
        module.register_forward_hook(lambda _, _in, out: states.append(out[0] if isinstance(out, tuple) else out))
    forward, results = get_mcore_forward_fn(hf_config), []
    with torch.no_grad():
        for ids in batch:
            states.clear()
            x = torch.tensor([ids])
            mask, positions = torch.ones_like(x, dtype=torch.bool), torch.arange(len(ids))[None]
            out = forward(model, x, mask, positions, {}, value_model=value_model)
            layers = [s[: len(ids), 0] for s in states]  # packed [tokens, 1, hidden]
            results.append((layers[:-2] + layers[-1:], out[0]))  # the last layer's output as the final norm's
    return results


def reference(ckpt: Path, hf: Path, kind: str, batch, dtype: str):
    """The checkpoint's side: `megatron_reference` in a child process, or verl's FSDP model in this one."""
    import torch

    if kind == "megatron":
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "reference.pt"
            path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
            argv = ["-m", "launch.merge.check_numeric", "--checkpoint", ckpt, "--hf", hf, "--reference-out", out]
            run = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
            if run.returncode:
                lines = [line for line in run.stderr.splitlines() if line.strip()] or [f"exit {run.returncode}"]
                raise BadInput(f"megatron-core's forward of {ckpt}/dist_ckpt failed: {lines[-1][:300]}")
            return torch.load(out)
    return list(hf_outputs(fsdp_model(ckpt, dtype), batch))


def fsdp_model(ckpt: Path, dtype: str):
    """verl's FSDP2 save: one state dict of DTensors per rank under the model's own (Hugging Face) names, each
    tensor split along its Shard dimension; joined here in rank order, into the model verl's FSDP worker trains."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    shards = sorted(ckpt.glob("model_world_size_*_rank_*.pt"), key=lambda s: int(re.search(r"rank_(\d+)", s.name)[1]))
    world = int(re.search(r"world_size_(\d+)", shards[0].name)[1])
    if len(shards) != world:
        raise BadInput(f"{ckpt}: {len(shards)} of {world} model_world_size_{world}_rank_*.pt shards")
    parts = [torch.load(s, map_location="cpu", weights_only=False) for s in shards]
    state = {}
    for name, first in parts[0].items():
        if hasattr(first, "to_local"):
            (placement,) = first.placements
            local = [p[name].to_local() for p in parts]
            first = torch.cat(local, placement.dim) if placement.is_shard() else local[0]
        state[name] = first.to(getattr(torch, dtype)).float()
    value_model = "score.weight" in state
    config = AutoConfig.from_pretrained(ckpt / "huggingface", **({"num_labels": 1} if value_model else {}))
    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager").float().eval()
    model.load_state_dict(state, strict=not config.tie_word_embeddings)  # tied: lm_head.weight may be left out
    return model


def hf_outputs(model, batch):
    """(hidden states, outputs) of each probe sequence: logits [T, vocab], or a value model's [T]."""
    import torch

    with torch.no_grad():
        for ids in batch:
            got = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            out = got.logits[0].float()
            yield [h[0] for h in got.hidden_states], out[:, 0] if out.shape[-1] == 1 else out


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
        turn = [{"role": "user", "content": user}]
        prompt = tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        batch.append(tok(prompt + reply + (tok.eos_token or ""), add_special_tokens=False).input_ids[:96])
    return batch


def config_problem(hf: Path, config: dict, value_model: bool) -> str | None:
    """The merged folder must describe the checkpoint's model, else it was made from another one."""
    merged = json.loads((hf / "config.json").read_text())
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"]
    keys += ["vocab_size", "rope_theta", "rms_norm_eps"]
    diff = [f"{k} {merged.get(k)} (checkpoint: {config.get(k)})" for k in keys if merged.get(k) != config.get(k)]
    arch = (merged.get("architectures") or [""])[0]
    if value_model is not None and value_model != ("ForTokenClassification" in arch):
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
    """Both sides on the probe batch: the figures and the first diverging hidden state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if not (hf / "config.json").is_file():
        raise BadInput(f"{hf}/config.json is missing: expected a merged Hugging Face model folder")
    config, kind, _, value_model = read_checkpoint(ckpt)
    problem = config_problem(hf, config, value_model)
    if problem:
        raise BadInput(problem)
    batch, dtype = probe_batch(hf), merged_dtype(hf)
    want = reference(ckpt, hf, kind, batch, dtype)
    value_model = want[0][1].dim() == 1
    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    # no dtype argument (its name changed in transformers 4.56): whatever it loads in, float32 here
    model = auto.from_pretrained(hf, attn_implementation="eager").float().eval()
    got = list(hf_outputs(model, batch))
    diffs, flips, tokens, gaps = [], 0, 0, [0.0] * (config["num_hidden_layers"] + 1)
    for ids, (ref_states, b), (states, a) in zip(batch, want, got, strict=True):
        for i, (x, y) in enumerate(zip(states, ref_states, strict=True)):  # embedding, each layer, the final norm
            gaps[i] = max(gaps[i], ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
        if value_model:
            diffs.append((a - b).abs())
            continue
        target = torch.tensor(ids[1:])
        lp_a, lp_b = (x[:-1].log_softmax(-1).gather(1, target[:, None])[:, 0] for x in (a, b))
        diffs.append((lp_a - lp_b).abs())
        flips += int((a[:-1].argmax(-1) != b[:-1].argmax(-1)).sum())
        tokens += len(ids) - 1
    d = torch.cat(diffs)
    return dict(
        max=d.max().item(),
        mean=d.mean().item(),
        top1=flips / tokens if tokens else 0.0,
        tokens=int(d.numel()),
        sides=f"{dtype} weights, float32 arithmetic on the CPU; the {kind} checkpoint's model against transformers'",
        value_model=value_model,
        first_divergence=next((i for i, g in enumerate(gaps) if g > TOLERANCE[3]), None),
        layers=config["num_hidden_layers"],
        state_gaps=gaps,
    )


def judge(figures: dict) -> list[str]:
    """What exceeds the tolerance, one line each (empty: the merged model agrees)."""
    what = "value" if figures["value_model"] else "log-prob"
    over = [(name, limit) for name, limit in zip(["max", "mean"], TOLERANCE[:2], strict=True) if figures[name] > limit]
    problems = [f"{name} |d {what}| {figures[name]:.3g} > {limit:g}" for name, limit in over]
    if figures["top1"] > TOLERANCE[2]:
        problems.append(f"top-1 prediction changed on {figures['top1']:.1%} of tokens > {TOLERANCE[2]:.0%}")
    return problems


def where(figures: dict) -> str:
    i, layers = figures["first_divergence"], figures["layers"]
    if i is None:
        return "every hidden state agrees: the output head differs (lm_head, its tie to the embedding, a value head)"
    gap = figures["state_gaps"][i]
    name = "the embedding" if i == 0 else f"layer {i - 1}" if i < layers else f"layer {layers - 1} or the final norm"
    hint = ": a wrong embedding, or a merge of another checkpoint (another step or run)" if i == 0 else ""
    return f"hidden states first diverge after {name} (relative difference {gap:.2g}){hint}"


def summary(figures: dict) -> str:
    what = "value" if figures["value_model"] else "log-prob"
    top1 = "" if figures["value_model"] else f", top-1 changed on {figures['top1']:.1%}"
    return (
        f"max |d {what}| {figures['max']:.2g}, mean {figures['mean']:.2g}{top1} of {figures['tokens']} probe tokens "
        f"(tolerance fp32: {figures['sides']})"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="verl's global_step_N/actor (or critic) folder")
    p.add_argument("--hf", type=Path, required=True, help="the merged Hugging Face model folder")
    p.add_argument("--reference-out", type=Path, help=argparse.SUPPRESS)  # the child process of `reference`
    args = p.parse_args(argv)
    if args.reference_out:  # the child process of `reference`
        import torch

        batch, dtype, store = probe_batch(args.hf), merged_dtype(args.hf), args.reference_out.with_suffix(".store")
        torch.save(megatron_reference(args.checkpoint, batch, dtype, store), args.reference_out)
        return 0
    start = time.monotonic()
    try:
        figures = compare(args.checkpoint, args.hf)
    except NotComparable as exc:
        print(f"numeric check not run: {exc}: the result is verified for its structure only")
        return 3
    except Exception as exc:  # BadInput, or whatever stopped the comparison: never a verdict on the numbers
        cause = str(exc) if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
        print(f"check_numeric: could not compare: {cause.splitlines()[0][:400]}", file=sys.stderr)
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
