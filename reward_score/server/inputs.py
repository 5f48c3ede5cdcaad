"""How a (messages, response) pair becomes the token ids the model scores, in one of TRL's formats. No torch."""

import os
import threading
from dataclasses import dataclass

from reward_score.server.settings import Settings


class InputTooLong(ValueError):
    """An item cannot fit in GPU memory alone."""


class ConversationRefused(ValueError):
    """The chat template raised on these messages (e.g. Qwen3's "No user query found in messages.")."""


@dataclass
class Encoded:
    ids: list[int]
    truncated: bool


@dataclass(frozen=True)
class InputFormat:
    """One of the ways TRL's RewardTrainer built a training sequence (docs/reward.md, the format check): TRL >= 0.24
    prompt + completion, through the chat template without special tokens or as plain text + EOS; TRL <= 0.23 with a
    `prompt` column the completion alone, always with special tokens, plain text without EOS."""

    input: str  # "conversation": prompt + response; "completion": the response alone
    chat_template: bool  # through the tokenizer's chat template; False: TRL's plain-text rule
    add_special_tokens: bool
    append_eos: bool  # plain text only

    @classmethod
    def from_settings(cls, settings: Settings, has_chat_template: bool) -> "InputFormat":
        """The `auto` values resolved: for each input, what the TRL versions that produce it did."""
        template = has_chat_template and settings.chat_template == "auto"
        # Only TRL >= 0.24's apply_chat_template(tokenize=True) tokenized without them; every tokenizer(text) adds.
        auto_special = not (template and settings.input == "conversation")
        special = auto_special if settings.add_special_tokens == "auto" else settings.add_special_tokens == "true"
        eos = settings.input == "conversation" if settings.append_eos == "auto" else settings.append_eos == "true"
        return cls(settings.input, template, special, eos and not template)

    def describe(self) -> str:
        how = "chat template" if self.chat_template else "plain text" + (" + EOS" if self.append_eos else "")
        special = "with" if self.add_special_tokens else "without"
        return f"{self.input} ({how}, {special} special tokens)"


class PairEncoder:
    """`render` a pair as the text the model was trained on, `tokenize` texts, `fit` ids to max_length; any thread."""

    def __init__(self, tokenizer, settings: Settings, read_pad_id: int | None):
        import jinja2

        self._template_error = jinja2.TemplateError
        self.tokenizer = tokenizer
        self.settings = settings
        # The model's own forward (what TRL trained) reads its score at the last token that is not this one (`fit`).
        self.read_pad_id = read_pad_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.format = InputFormat.from_settings(settings, self.has_chat_template)
        self.backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        if self.backend is not None:
            # Never mutated after this, so threads may encode concurrently.
            self.backend.no_truncation()
            self.backend.no_padding()
        self._slow_lock = threading.Lock()

    def render(self, messages: list[dict[str, str]], response: str, fmt: InputFormat | None = None) -> str:
        """The exact text the reward model was trained on for this conversation, in `fmt` (default: the server's)."""
        fmt = fmt or self.format
        if fmt.chat_template:
            try:
                return self._render_template(messages, response, fmt.input == "completion")
            except self._template_error as exc:  # the template's own raise_exception(...): a wrong conversation
                raise ConversationRefused(f"the reward model's chat template refused these messages: {exc}") from None
        eos = self.tokenizer.eos_token or ""
        text = response if fmt.input == "completion" else "\n".join(m["content"] for m in messages) + response
        return text + eos if fmt.append_eos and not text.endswith(eos) else text

    def _render_template(self, messages: list[dict[str, str]], response: str, completion: bool) -> str:
        apply = self.tokenizer.apply_chat_template
        full = apply(
            [*messages, {"role": "assistant", "content": response}], tokenize=False, add_generation_prompt=False
        )
        if not completion:
            return full
        # TRL <= 0.23's apply_chat_template (data_utils.py): the prompt with its generation prompt (or its last
        # assistant message continued), then the completion is what the whole conversation adds after the longest
        # common prefix of the two (Qwen3: "<think>\n\n</think>\n\n" + response + "<|im_end|>\n").
        last = messages[-1]["role"] if messages else None
        if last not in ("user", "assistant"):
            raise ConversationRefused(
                f"REWARD_INPUT=completion needs the prompt's last message from the user or the assistant, as TRL did "
                f"(it raised 'Invalid role in the last message'); got {last!r}"
            )
        prompt = apply(
            messages, tokenize=False, add_generation_prompt=last == "user", continue_final_message=last == "assistant"
        )
        return full[len(os.path.commonprefix([prompt, full])) :]

    def tokenize(self, texts: list[str], fmt: InputFormat | None = None) -> list[list[int]]:
        """Token ids of each text, on every core without the GIL; `encode_batch_fast` (tokenizers >= 0.21) skips the
        character offsets."""
        special = (fmt or self.format).add_special_tokens
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=special)]
        with self._slow_lock:
            return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def fit(self, ids: list[int]) -> Encoded:
        """`ids` as scored: without trailing pad tokens (the model's forward reads before them), within max_length
        (over-long input keeps its last tokens)."""
        end = len(ids)
        while end > 1 and ids[end - 1] == self.read_pad_id:
            end -= 1
        ids = ids[:end] if end < len(ids) else ids
        limit = self.settings.max_length
        if len(ids) <= limit:
            return Encoded(ids, False)
        return Encoded(ids[-limit:], True)
