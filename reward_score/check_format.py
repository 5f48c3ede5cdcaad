"""Which input format does this reward model need? Score preference pairs in every format the server supports and
see in which one the model ranks them best: a model scored as it was trained ranks its held-out pairs best.

    python -m reward_score.check_format MODEL PAIRS                    # PAIRS: .jsonl or .parquet
    python -m reward_score.check_format MODEL PAIRS --device cuda --input completion

PAIRS is a preference dataset in one of TRL's own layouts (a few hundred pairs the model was NOT trained on):
  {"chosen": [{"role": "user", ...}, {"role": "assistant", ...}], "rejected": [...]}      conversations
  {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
  {"chosen": "text", "rejected": "text"}         plain text (the prompt is what the two share at the start)
  {"prompt": "text", "chosen": "text", "rejected": "text"}

Every format is scored through the server's own code (docs/reward.md). Exit 0 when the given settings (flags below)
score as the recommendation (the most pairs ranked right, then the lower loss), 1 when another format is recommended,
2 for unusable input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from reward_score.server.settings import CHOICES, LAUNCH_NAMES, SETTINGS, Settings, check_model_path

Conversation = tuple[list[dict[str, str]], str]  # (messages before the answer, the answer), as the server takes them

LAYOUTS = {
    "conversation": "'chosen'/'rejected' conversations",
    "conversation_prompt": "'prompt' + 'chosen'/'rejected' conversations",
    "text": "'chosen'/'rejected' plain texts",
    "text_prompt": "'prompt' + 'chosen'/'rejected' plain texts",
}
# The server settings that decide the input format (CHOICES), with their environment and launch names.
FORMAT_SETTINGS = {name: (SETTINGS[name][0], launch) for launch, name in LAUNCH_NAMES.items() if name in CHOICES}


class PairsError(ValueError):
    """PAIRS cannot be read as preference pairs; the message names the row, the field and the fix."""


@dataclass(frozen=True)
class Pair:
    chosen: Conversation
    rejected: Conversation


# --- reading the pairs -------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL or parquet file, as dicts (parquet's None-filled struct fields dropped, as TRL does)."""
    if not path.is_file():
        raise PairsError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's own message says what is wrong with the file
            raise PairsError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
        return [_drop_none(r) for r in rows]
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PairsError(
                    f"{path} line {n}: not JSON ({exc.msg}); PAIRS is one JSON object per line, or .parquet"
                ) from None
            if not isinstance(row, dict):
                raise PairsError(
                    f"{path} line {n}: a JSON {type(row).__name__}, not an object with 'chosen'/'rejected'"
                )
            rows.append(row)
    return rows


def _drop_none(value):
    """Arrow gives every struct the union of all keys, None where a message had none (TRL's remove_none_values)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _messages(value, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise PairsError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise PairsError(f"{where}[{k}]: a message is {{'role': str, 'content': str}}, got {str(m)[:80]!r}")
        if not isinstance(m["content"], str):
            raise PairsError(
                f"{where}[{k}].content: text only (the server scores text), got {type(m['content']).__name__}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise PairsError(f"{where}: expected text like the other rows, got {type(value).__name__}")
    if not value.strip():
        raise PairsError(f"{where}: empty")
    return value


def _shared_prefix(a: str, b: str) -> int:
    """Where an implicit plain-text prompt ends: TRL's extract_prompt (the common start, minus a trailing space)."""
    n = len(os.path.commonprefix([a, b]))
    if 0 < n < min(len(a), len(b)) and a[n - 1] == " ":
        n -= 1
    return n


def layout_of(row: dict, where: str) -> str:
    for name in ("chosen", "rejected"):
        if name not in row:
            raise PairsError(
                f"{where}: no '{name}' field (fields: {', '.join(sorted(row)) or 'none'}); TRL's preference layout is "
                "'chosen' and 'rejected', with an optional 'prompt'"
            )
    conversational = isinstance(row["chosen"], list)
    if "prompt" in row:
        return "conversation_prompt" if conversational else "text_prompt"
    return "conversation" if conversational else "text"


def _side(value, where: str, layout: str, prompt: list[dict[str, str]]) -> Conversation:
    """One side of a pair (not a plain-text one without a prompt) as (messages before the answer, the answer)."""
    if layout == "text_prompt":
        return prompt, _text(value, where)
    msgs = _messages(value, where)
    if layout == "conversation":
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"].strip():
            raise PairsError(
                f"{where}: the last message is the scored answer: role 'assistant' with text, got "
                f"role {msgs[-1]['role']!r}"
            )
        return msgs[:-1], msgs[-1]["content"]
    if len(msgs) != 1 or msgs[0]["role"] != "assistant" or not msgs[0]["content"].strip():
        raise PairsError(
            f"{where}: one assistant message with text (the server scores one response after the prompt), got "
            f"{len(msgs)} message(s), roles {[m['role'] for m in msgs]}: move earlier turns into 'prompt'"
        )
    return prompt, msgs[0]["content"]


def parse_pairs(rows: list[dict]) -> tuple[str, list[Pair]]:
    """(layout, pairs) from TRL-format rows; one layout for the whole file, as TRL reads it from the first row."""
    if not rows:
        raise PairsError("no rows: PAIRS needs preference pairs ('chosen'/'rejected')")
    layout = layout_of(rows[0], "row 0")
    pairs = []
    for i, row in enumerate(rows):
        where = f"row {i}"
        this = layout_of(row, where)
        if this != layout:
            raise PairsError(f"{where}: {LAYOUTS[this]}, but row 0 has {LAYOUTS[layout]}: one layout per file")
        if layout == "text":
            chosen, rejected = _text(row["chosen"], f"{where}.chosen"), _text(row["rejected"], f"{where}.rejected")
            n = _shared_prefix(chosen, rejected)
            if n == len(chosen) or n == len(rejected):
                raise PairsError(f"{where}: 'chosen' and 'rejected' must differ after their shared start")
            user = [{"role": "user", "content": chosen[:n]}] if n else []
            pairs.append(Pair((user, chosen[n:]), (user, rejected[n:])))
            continue
        prompt: list[dict[str, str]] = []
        if layout == "text_prompt":
            prompt = [{"role": "user", "content": _text(row["prompt"], f"{where}.prompt")}]
        elif layout == "conversation_prompt":
            prompt = _messages(row["prompt"], f"{where}.prompt")
        pairs.append(Pair(*(_side(row[name], f"{where}.{name}", layout, prompt) for name in ("chosen", "rejected"))))
    return layout, pairs


# --- the formats -------------------------------------------------------------------------------------------------


def candidate_settings(layout: str, has_chat_template: bool) -> list[dict[str, str]]:
    """Every combination of the format settings for this layout: conversations through the chat template (as TRL)."""
    conversations = layout.startswith("conversation")
    if conversations and not has_chat_template:
        raise PairsError(
            f"the pairs are conversations ({LAYOUTS[layout]}) but the model's tokenizer has no chat template: TRL "
            "renders conversations with it, so this model was not trained on such pairs; give plain-text pairs"
        )
    template = "off" if has_chat_template and not conversations else "auto"
    return [
        {"input": i, "add_special_tokens": s, "chat_template": template, "append_eos": e}
        for i in CHOICES["input"]
        for s in CHOICES["add_special_tokens"]
        for e in (("auto",) if conversations else CHOICES["append_eos"])  # EOS: plain text only
    ]


def trl_versions(fmt, layout: str) -> str:
    """Which TRL versions' RewardTrainer built its sequences this way from pairs of this layout ('' for none)."""
    old_input = "completion" if layout.endswith("_prompt") else "conversation"  # TRL <= 0.23's for this layout
    if fmt.chat_template:
        new = fmt.input == "conversation" and not fmt.add_special_tokens
        old = fmt.add_special_tokens and fmt.input == old_input
    else:
        new = fmt.input == "conversation" and fmt.add_special_tokens and fmt.append_eos
        old = fmt.add_special_tokens and not fmt.append_eos and fmt.input == old_input
    return " and ".join(v for v, ok in (("<= 0.23", old), (">= 0.24", new)) if ok)


@dataclass
class FormatResult:
    """One way of building the ids (several settings may give the same ids: they are one result)."""

    settings: dict[str, str]  # the simplest settings that give these ids (most values left at auto)
    format: object  # inputs.InputFormat of those settings
    same_as: list[dict[str, str]] = field(default_factory=list)  # other settings giving the same ids
    scored: list[tuple[list[int], list[int]]] = field(default_factory=list)  # as scored (inputs.fit)
    chosen: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)
    truncated: int = 0
    refused: str = ""  # why this format cannot score some pair (then it has no scores)
    trl: str = ""

    @property
    def n(self) -> int:
        return len(self.chosen)

    @property
    def right(self) -> int:
        return sum(c > r for c, r in zip(self.chosen, self.rejected, strict=True))

    @property
    def mean_margin(self) -> float:
        return sum(c - r for c, r in zip(self.chosen, self.rejected, strict=True)) / max(1, self.n)

    @property
    def loss(self) -> float:
        """Mean -log(sigmoid(chosen - rejected)) = softplus(rejected - chosen), computed stably."""
        pairs = zip(self.chosen, self.rejected, strict=True)
        return sum(max(r - c, 0) + math.log1p(math.exp(-abs(c - r))) for c, r in pairs) / max(1, self.n)

    def matches(self, settings: dict[str, str]) -> bool:
        return settings == self.settings or settings in self.same_as


@dataclass
class Report:
    layout: str
    pairs: int
    results: list[FormatResult]  # best first; refused formats last
    given: FormatResult | None  # the result the given settings produce

    @property
    def recommended(self) -> FormatResult:
        return self.results[0]


def _simplicity(settings: dict[str, str]) -> tuple[int, int]:
    """Fewer settings away from the server's defaults first (so the defaults stay where they already match)."""
    defaults = Settings()
    changed = sum(settings[k] != getattr(defaults, k) for k in FORMAT_SETTINGS)
    return changed, -sum(v == "auto" for v in settings.values())


def evaluate(scorer, layout: str, pairs: list[Pair], given: dict[str, str] | None = None) -> Report:
    """Score `pairs` in every candidate format, one forward pass per distinct set of ids; results best first."""
    from reward_score.server.inputs import ConversationRefused, InputFormat

    given = given or {k: getattr(Settings(), k) for k in FORMAT_SETTINGS}
    base = scorer.settings
    by_ids: dict[tuple, FormatResult] = {}
    refused: list[FormatResult] = []
    candidates = sorted(candidate_settings(layout, scorer.has_chat_template), key=_simplicity)
    if given not in candidates:
        candidates.append(given)
    for values in candidates:
        fmt = InputFormat.from_settings(replace(base, **values), scorer.has_chat_template)
        try:
            texts = [scorer.render(m, r, fmt) for p in pairs for m, r in (p.chosen, p.rejected)]
        except ConversationRefused as exc:
            refused.append(FormatResult(values, fmt, refused=str(exc), trl=trl_versions(fmt, layout)))
            continue
        ids = scorer.tokenize(texts, fmt)
        fitted = [scorer.fit(x) for x in ids]
        # One result per distinct set of scored ids (fit drops trailing pad tokens, which the model reads past).
        key = tuple(tuple(e.ids) for e in fitted)
        if key in by_ids:
            by_ids[key].same_as.append(values)
            continue
        scored = [(list(c), list(r)) for c, r in zip(key[::2], key[1::2], strict=True)]
        by_ids[key] = FormatResult(values, fmt, scored=scored, truncated=sum(e.truncated for e in fitted))
    # Every format's sequences in one call: the planner batches them all.
    scores = scorer.score_ids([s for key in by_ids for s in key]) if by_ids else []
    results = list(by_ids.values())
    for k, r in enumerate(results):
        own = scores[2 * len(pairs) * k : 2 * len(pairs) * (k + 1)]
        r.chosen, r.rejected = own[::2], own[1::2]
        # The TRL versions of every setting in the group: they trained on the same ids.
        fmts = [InputFormat.from_settings(replace(base, **v), scorer.has_chat_template) for v in r.same_as]
        labels = {trl_versions(f, layout) for f in [r.format, *fmts]}
        r.trl = " and ".join(v for v in ("<= 0.23", ">= 0.24") if any(v in label for label in labels))
    results.sort(key=lambda r: (-r.right, r.loss))
    ordered = results + refused
    return Report(layout, len(pairs), ordered, next((r for r in ordered if r.matches(given)), None))


# --- the report --------------------------------------------------------------------------------------------------


def settings_line(settings: dict[str, str], launch: bool = False) -> str:
    """The settings that differ from the server's defaults, as environment assignments (or the launch names)."""
    defaults = Settings()
    changed = [
        f"{FORMAT_SETTINGS[k][1 if launch else 0]}={v}" for k, v in settings.items() if v != getattr(defaults, k)
    ]
    return " ".join(changed) or "the defaults"


def format_report(report: Report, model: str, pairs_path: str, device: str) -> str:
    lines = [
        f"check_format: {model} on {report.pairs} pairs of {pairs_path} ({LAYOUTS[report.layout]}), device {device}",
        f"  {'format':<56} {'ranked right':>15} {'mean margin':>12} {'loss':>7}  trained this way by TRL",
    ]
    for r in report.results:
        mark = "  <- the settings given" if report.given is r else ""
        if r.refused:
            lines.append(f"  {r.format.describe():<56} cannot score these pairs: {r.refused}{mark}")
            continue
        share = f"{r.right}/{r.n} {100 * r.right / max(1, r.n):5.1f}%"
        lines.append(
            f"  {r.format.describe():<56} {share:>15} {r.mean_margin:>+12.3f} {r.loss:>7.3f}  {r.trl or '-'}{mark}"
        )
        if r.truncated:
            lines.append(f"    ({r.truncated} sequences longer than REWARD_MAX_LENGTH kept their last tokens)")
    best = report.recommended
    if best.refused:
        lines.append("no format can score these pairs (above)")
        return "\n".join(lines)
    lines.append(f"recommended: {settings_line(best.settings)}")
    lines.append(f"  in run_grpo_qwen3_4b_mega_verl.sh: {settings_line(best.settings, launch=True)}")
    if report.given is best:
        lines.append("the settings given score as recommended")
    else:
        lines.append("the settings given score in another format: change them as recommended")
    return "\n".join(lines)


def load_scorer(model: str, device: str):
    from reward_score.server.runner import RewardScorer

    # No compile: one pass over a few hundred pairs does not pay for it.
    return RewardScorer.load(Settings(model_path=model, device=device, compile="off"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reward_score.check_format",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="the reward model's folder (what the server's --model-path gets)")
    parser.add_argument("pairs", type=Path, help="preference pairs, .jsonl or .parquet, in TRL's layouts (above)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto [default auto]")
    defaults = Settings()
    for name, (env, launch) in FORMAT_SETTINGS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            choices=CHOICES[name],
            default=getattr(defaults, name),
            help=f"the job's {env} ({launch}), marked in the table [default {getattr(defaults, name)}]",
        )
    args = parser.parse_args(argv)
    if problem := check_model_path(args.model):
        print(f"check_format: {problem.replace('REWARD_MODEL_PATH (or --model-path)', 'MODEL')}", file=sys.stderr)
        return 2
    try:
        layout, pairs = parse_pairs(read_rows(args.pairs))
        scorer = load_scorer(args.model, args.device)
        given = {k: getattr(args, k) for k in FORMAT_SETTINGS}
        report = evaluate(scorer, layout, pairs, given)
    except PairsError as exc:
        print(f"check_format: {args.pairs}: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, args.model, str(args.pairs), scorer.device))
    if report.recommended.refused:
        return 2
    return 0 if report.given is report.recommended else 1


if __name__ == "__main__":
    sys.exit(main())
