"""What tests/test_trl_formats.py trains with real TRL: tokenizers, base models and preference datasets, built here.

Two tokenizers, the two kinds a reward model's tokenizer comes in:
- qwen3: Qwen3's own chat template (the file TRL ships as trl/chat_templates/qwen3.jinja, read from the installed
  newest TRL, which compares it byte for byte with Qwen's): it puts an empty think block in the final assistant
  turn; no BOS; pad <|endoftext|>, EOS <|im_end|>.
- llama3: adds a BOS itself (<|begin_of_text|>, as Llama's tokenizers do) and its template writes one too (TRL's
  llama3.jinja); EOS <|eot_id|>, no pad token, so TRL pads with the EOS and the model reads its score before the
  final <|eot_id|>. For plain text it is saved without a chat template.
Four dataset layouts, each built from the same pairs: TRL's conversational 'chosen'/'rejected' (implicit prompt),
'prompt' + 'chosen'/'rejected' conversations, and the two plain-text ones. The pairs are random words: a tiny model
can only memorise them, so it ranks them right only in the format it was trained on.
"""

from __future__ import annotations

import random
from pathlib import Path

INIT = {"qwen3": 0.1, "llama3": 0.1}  # wider than the default 0.02: the models memorise in 20 steps
ARCH = {"llama3": "gpt2"}
LAYOUTS = ("conversation", "conversation_prompt", "text", "text_prompt")

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu red green blue black white one two three four"
).split()


def _corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(lines)]


def build_tokenizer(kind: str, chat_template: str | None):
    """A byte-level BPE tokenizer trained here, with qwen3's or llama3's special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen3":
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        special = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(2000, 0), trainer)
    if kind == "qwen3":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
        names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    else:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
        names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=special,
        chat_template=chat_template,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        **names,
    )


def build_base_model(out: Path, kind: str, chat_template: str | None, seed: int = 0) -> Path:
    """A randomly initialised sequence classifier (hidden 64, 2 layers, one label) with the tokenizer, saved:
    Qwen3-shaped for qwen3; GPT-2-shaped for llama3 (ARCH)."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, Qwen3Config, Qwen3ForSequenceClassification

    tokenizer = build_tokenizer(kind, chat_template)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    torch.manual_seed(seed)
    if ARCH.get(kind, "qwen3") == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=1024,
            n_embd=64,
            n_layer=2,
            n_head=4,
            num_labels=1,
            initializer_range=INIT[kind],
            **ids,
        )
        model = GPT2ForSequenceClassification(config)
    else:
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            num_labels=1,
            initializer_range=INIT[kind],
            **ids,
        )
        model = Qwen3ForSequenceClassification(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def base_pairs(n: int, seed: int) -> list[dict]:
    """(prompt messages, chosen text, rejected text): single turns, some with a system prompt, some multi-turn,
    some answers with a reasoning block (Qwen3's template moves it into the think block)."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    pairs = []
    for i in range(n):
        prompt = [{"role": "user", "content": words(3, 8) + "?"}]
        if i % 4 == 1:
            prompt.insert(0, {"role": "system", "content": words(2, 5) + "."})
        if i % 4 == 2:
            prompt = [{"role": "user", "content": words(2, 5)}, {"role": "assistant", "content": words(2, 5)}, *prompt]
        chosen, rejected = words(2, 6), words(2, 6)
        if i % 4 == 3:
            chosen = f"<think>\n{words(2, 4)}\n</think>\n\n{chosen}"
            rejected = f"<think>\n{words(2, 4)}\n</think>\n\n{rejected}"
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def plain_prompt(messages: list[dict]) -> str:
    """A plain-text dataset's prompt: the turns as text, ending where the answer starts."""
    return "".join(f"{m['role'].title()}: {m['content']}\n" for m in messages) + "Assistant:"


def rows_for(layout: str, pairs: list[dict]) -> list[dict]:
    """The pairs in one of TRL's dataset layouts."""
    rows = []
    for p in pairs:
        chosen = [{"role": "assistant", "content": p["chosen"]}]
        rejected = [{"role": "assistant", "content": p["rejected"]}]
        text = plain_prompt(p["prompt"])
        if layout == "conversation":
            rows.append({"chosen": p["prompt"] + chosen, "rejected": p["prompt"] + rejected})
        elif layout == "conversation_prompt":
            rows.append({"prompt": p["prompt"], "chosen": chosen, "rejected": rejected})
        elif layout == "text":
            rows.append({"chosen": f"{text} {p['chosen']}", "rejected": f"{text} {p['rejected']}"})
        else:
            rows.append({"prompt": text, "chosen": " " + p["chosen"], "rejected": " " + p["rejected"]})
    return rows


# What each TRL version trained on, per layout, as the server's settings (read from TRL's source; see
# reward_score/check_format.py). Tokenizer kinds where a setting makes no difference to the ids (qwen3 adds no
# special tokens) are compared by ids, so the simplest settings that give them are the expected ones.
def expected_settings(trl: str, layout: str, kind: str) -> dict[str, str]:
    old = tuple(int(x) for x in trl.split(".")[:2]) < (0, 24)
    conversational = layout.startswith("conversation")
    s = {"input": "conversation", "add_special_tokens": "auto", "chat_template": "auto", "append_eos": "auto"}
    if not conversational and kind == "qwen3":
        s["chat_template"] = "off"  # a plain-text dataset: TRL never used the template
    if old:
        if layout.endswith("_prompt"):
            s["input"] = "completion"  # only the completion was tokenized; auto: special tokens, no EOS
        elif conversational:
            if kind == "llama3":
                s["add_special_tokens"] = "true"  # tokenizer(templated text): a second BOS
        else:
            s["append_eos"] = "false"  # the text as it is
    return s


def pairs_ranked_by(model: Path, n: int = 24, seed: int = 2, **settings: str) -> list[dict]:
    """Preference rows ('prompt' + 'chosen'/'rejected' conversations) labelled by `model` itself, scored in the format
    of `settings` (server settings): in that format it ranks every pair right, by construction. For check_format's
    tests and the preflight's, where no TRL-trained model is needed."""
    from reward_score.server.inputs import InputFormat
    from reward_score.server.runner import RewardScorer
    from reward_score.server.settings import Settings

    cfg = Settings(model_path=str(model), device="cpu", compile="off", **settings)
    scorer = RewardScorer.load(cfg)
    fmt = InputFormat.from_settings(cfg, scorer.has_chat_template)
    rows = []
    for p in base_pairs(n, seed):
        texts = [scorer.render(p["prompt"], p[side], fmt) for side in ("chosen", "rejected")]
        a, b = scorer.score_ids([scorer.fit(ids).ids for ids in scorer.tokenize(texts)])
        first, second = ("chosen", "rejected") if a > b else ("rejected", "chosen")
        rows.append(
            {
                "prompt": p["prompt"],
                "chosen": [{"role": "assistant", "content": p[first]}],
                "rejected": [{"role": "assistant", "content": p[second]}],
            }
        )
    return rows
