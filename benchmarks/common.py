"""What the benchmarks share: the Qwen3 shapes, the word-level tokenizer, random-weight models of a shape, what a
result says about its machine, and the result's atomic write."""

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from demo.tiny_models import REWARD_CHAT_TEMPLATE, qwen3_config

# The public Qwen3 configs' dimensions, and a tiny shape for the CPU
_DIMS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
SHAPES = {
    name: dict(zip(_DIMS, dims, strict=True))
    for name, dims in {
        "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
        "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
        "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936),
        "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936),
        "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936),
        "tiny": (64, 128, 2, 4, 2, 16, 4096),
    }.items()
}
REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


def words(vocab_size: int) -> int:
    """How many plain words (w0, w1, ...) the tokenizer of `vocab_size` entries has beside its specials and [UNK]."""
    return vocab_size - len(SPECIALS) - 2


def build_tokenizer(vocab_size: int):
    """The word-level tokenizer the benchmarks' models share: the specials, then w0, w1, ... up to `vocab_size`
    entries (one word, one token), with the reward chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["[UNK]"] + [f"w{i}" for i in range(words(vocab_size))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=REWARD_CHAT_TEMPLATE,
    )


def random_model(auto_class, config, device: str, seed: int):
    """`auto_class` from `config` with random weights (seed `seed`), in bf16 on a GPU and float32 on a CPU."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device):
        return auto_class.from_config(config, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)


def random_policy(dims: dict, tokenizer, device: str):
    """A Qwen3 causal LM of `dims` with random weights (seed 1), tied embeddings as the small Qwen3 models have, the
    tokenizer's special tokens, in bf16 on a GPU and float32 on a CPU."""
    from transformers import AutoModelForCausalLM

    return random_model(AutoModelForCausalLM, qwen3_config(dims, tokenizer), device, seed=1)


def non_embedding_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def build_reward_model(shape: str, out: Path, device: str) -> tuple[Path, float, int]:
    """A randomly initialised reward model of `shape` and a word-level tokenizer in `out` (kept where `out` already
    holds one of that shape: a big checkpoint is written once); returns (dir, non-embedding params, words)."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    dims = SHAPES[shape]
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        config = Qwen3Config.from_pretrained(out)
        if all(getattr(config, k) == v for k, v in dims.items()):
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config)
            return out, float(non_embedding_params(model)), words(dims["vocab_size"])
    tokenizer = build_tokenizer(dims["vocab_size"])
    config = qwen3_config(dims, tokenizer, num_labels=1)
    model = random_model(AutoModelForSequenceClassification, config, device, seed=0)
    params = non_embedding_params(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out, float(params), words(dims["vocab_size"])


def machine_info(device: str) -> dict:
    """What a result ran on: Python, torch, transformers, the CPUs; on a GPU the card, how many are visible, its
    memory, CUDA and NCCL."""
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
    }
    if device.startswith("cuda"):
        info.update(
            gpu=torch.cuda.get_device_name(),
            gpus_visible=torch.cuda.device_count(),
            gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
            cuda=torch.version.cuda,
            nccl=str(torch.cuda.nccl.version()),
        )
    return info


def command_line(module: str, argv: list[str] | None) -> str:
    """How this run was started, for its result file."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def write_json(path: Path, result: dict) -> None:
    """`result` into `path` whole or not at all (a run cut short leaves the last complete file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)


def block_defaults(repo: str = str(REPO)) -> dict[str, str]:
    """The run script's settings block as it exports its defaults, with `repo` as the repository folder."""
    script = f'repo={repo}; source <(sed -n "/^# ---- settings/,/^# ------------/p" run_grpo_qwen3_4b_mega_verl.sh)'
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", "-c", f"{script}; env -0"], capture_output=True, text=True, check=True, cwd=REPO, env=env
    )
    return dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
