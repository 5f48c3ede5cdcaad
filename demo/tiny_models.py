"""Tiny Qwen3-shaped models built from a config, for tests and the no-GPU demo.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few thousand synthetic lines, and
the models are randomly initialised from a `Qwen3Config`. They keep the properties our code depends on:

- a Qwen3-style chat template with `<|im_start|>` / `<|im_end|>`, `<|im_end|>` as EOS and `<|endoftext|>` as pad;
- `<think>` / `</think>` as added tokens that are NOT special (as in real Qwen3), so they survive
  `decode(..., skip_special_tokens=True)` exactly as in verl's reward managers;
- the policy's template opens `<think>\\n` in the generation prompt, as Qwen3-*-Thinking-2507 does (an
  Instruct-style policy, whose prompt opens none, is built with `chat_template=INSTRUCT_POLICY_CHAT_TEMPLATE`),
  and a few supervised steps (`warm_start`) teach it to close that reasoning and answer, so a GRPO step on it
  has scores to tell apart (`make demo` and the tests train it with verl's own trainer);
- the reward model is a `Qwen3ForSequenceClassification` with `num_labels=1` and `pad_token_id` set, so batched
  scoring reads the last non-pad token.
"""

from __future__ import annotations

import random
from pathlib import Path

PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# One message per turn, Qwen style; the reward model scores the whole conversation, no generation prompt.
REWARD_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-*-Thinking-2507 opens the reasoning block in the prompt: responses then contain only `</think>`.
POLICY_CHAT_TEMPLATE = REWARD_CHAT_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
# Qwen3-*-Instruct-2507 and most other models: the generation prompt opens no reasoning block.
INSTRUCT_POLICY_CHAT_TEMPLATE = REWARD_CHAT_TEMPLATE

_WORDS = (
    "the a reward model policy answer question safe unsafe think step because therefore why how what cluster "
    "node gpu token batch score train test data prompt response user assistant system hello world please "
    "explain number one two three four five six seven eight nine ten yes no maybe "
    "安全 回答 質問 報酬 モデル 学習 データ こんにちは 世界 です ます"
).split()


def _corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(lines)]


def build_tokenizer(chat_template: str, vocab_size: int = 600, seed: int = 0):
    """A fast byte-level BPE tokenizer with Qwen3's special tokens and `<think>` tags as plain added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_CHAT, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(3000, seed), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[BOS_CHAT, EOS],
        chat_template=chat_template,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def qwen3_config(dims: dict, tokenizer, **extra):
    """A Qwen3 config of `dims` as the small Qwen3 models have it (tied embeddings unless `extra` says otherwise, RoPE
    theta 1e6) with the tokenizer's special tokens; the benchmarks' models too."""
    from transformers import Qwen3Config

    settings = {"max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "tie_word_embeddings": True} | extra
    return Qwen3Config(
        **dims, **settings, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )


def _qwen3_config(tokenizer, **extra):
    dims = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    # initializer_range wider than the default 0.02, so different texts get clearly different scores in tests.
    return qwen3_config(dims, tokenizer, max_position_embeddings=8192, initializer_range=0.2, **extra)


def build_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Qwen3ForSequenceClassification, hidden 64, 2 layers, num_labels=1, saved with its tokenizer."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    out = Path(out_dir)
    tokenizer = build_tokenizer(REWARD_CHAT_TEMPLATE, seed=seed)
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(_qwen3_config(tokenizer, num_labels=1)).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def warm_start(model, tokenizer, steps: int = 40, seed: int = 0) -> None:
    """A few supervised steps on made-up replies that close their reasoning (`... </think> answer<|im_end|>`). A
    randomly initialised policy writes `</think>` about once in 500 tokens: every response of a GRPO group would be
    cut off mid-reasoning and get the same penalty, so verl's advantages, and its update, would be zero. After these
    steps most responses hold an answer, which the reward model scores differently (about 4 s on 2 cores)."""
    import torch

    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        replies = [f"{words(1, 4)}{THINK_CLOSE}{words(2, 6)}{EOS}" for _ in range(16)]
        batch = tokenizer(replies, add_special_tokens=False, padding=True, return_tensors="pt")
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_policy_model(
    out_dir: str | Path, seed: int = 0, chat_template: str = POLICY_CHAT_TEMPLATE, tied: bool = True
) -> Path:
    """Qwen3ForCausalLM of the same shape, with a Thinking-2507-style chat template (or `chat_template`),
    warm-started (`warm_start`); `tied`: its output layer shares the embedding's weight."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(chat_template, seed=seed)
    torch.manual_seed(seed + 1)
    model = Qwen3ForCausalLM(_qwen3_config(tokenizer, tie_word_embeddings=tied))
    warm_start(model, tokenizer, seed=seed)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
