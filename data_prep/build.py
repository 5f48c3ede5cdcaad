"""Build verl's train.parquet and test.parquet from the files people have (JSONL, JSON, CSV, parquet, HF datasets).

    python -m data_prep.build prompts.jsonl --out-dir data/safety
    python -m data_prep.build prompts.csv --prompt-column question --system-prompt "You are careful." --out-dir data/x
    python -m data_prep.build chats.parquet --messages-column messages --test-file held_out.parquet --out-dir data/y
    python -m data_prep.build qa.jsonl --reward-style rule --answer-column answer --out-dir data/z
    python -m data_prep.build gsm8k_train.parquet --preset gsm8k --test-file gsm8k_test.parquet --out-dir data/gsm8k

Each output row is what verl 0.6.1's RLHFDataset and reward managers read (the columns, the split, the presets and
what happens to bad rows: docs/data.md).
"""

import argparse
import csv
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as exc:  # a login node's bare python3: one line with the fix, not a traceback
    sys.exit(
        f"python -m data_prep.build needs pyarrow, which {sys.executable} cannot import ({exc}): pip install --user "
        "pyarrow, or run it in the image: singularity exec verl_app.sif python3 -m data_prep.build ..."
    )

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
ROLES = {"system", "user", "assistant", "tool"}
CHUNK_ROWS = 20_000
MAX_REPORTED = 1000
PROMPT_FLAGS = "--prompt-column (a str) or --messages-column (a list of {role, content})"  # the prompt's column
# --preset: what verl 0.6.1's examples/data_preprocess/{gsm8k,math_dataset}.py write, from the public sets' columns.
PRESETS = {
    "gsm8k": {
        "prompt_column": "question",
        "answer_column": "answer",
        "data_source": "openai/gsm8k",
        "instruction": 'Let\'s think step by step and output the final answer after "####".',
    },
    "math": {
        "prompt_column": "problem",
        "answer_column": "solution",
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "instruction": "Let's think step by step and output the final answer within \\boxed{}.",
    },
}


class BadRow(ValueError):
    """A row that cannot become a training example; the message says which field and why."""


@dataclass(frozen=True)
class RowSpec:
    """How input columns map to verl's row format (the command-line flags)."""

    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    system_prompt: str | None = None
    system_column: str | None = None
    answer_column: str | None = None
    source_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    data_source: str = "custom"
    ability: str = "general"
    reward_style: str = "model"
    answer_format: str = "text"  # text (as it is) | gsm8k | math: the reference answer extracted as verl's examples do
    instruction: str = ""  # appended to the last user turn after a space, as verl's examples append theirs

    def schema(self) -> pa.Schema:
        extra = [
            ("split", pa.string()),
            ("index", pa.int64()),
            ("source_row", pa.int64()),
            ("reward_messages", pa.list_(MESSAGE)),
            *[(c, pa.string()) for c in self.keep_columns],
        ]
        return pa.schema(
            [
                ("data_source", pa.string()),
                ("prompt", pa.list_(MESSAGE)),
                ("ability", pa.string()),
                ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                ("extra_info", pa.struct(extra)),
            ]
        )


def missing(example: dict, what: str, column: str) -> BadRow:
    """A row without `column`: the columns it has, each with its type, and the flag that names the right one."""
    found = ", ".join(f"{name} ({type(value).__name__})" for name, value in example.items()) or "none"
    flag = PROMPT_FLAGS if what in ("prompt", "messages") else f"--{what}-column"
    return BadRow(f"{what} column '{column}' is missing; the row's columns: {found}: name the right one with {flag}")


def _text(example: dict, column: str, what: str) -> str:
    if column not in example or example[column] is None:
        raise missing(example, what, column)
    value = example[column]
    if not isinstance(value, str):
        raise BadRow(f"{what} column '{column}' is a {type(value).__name__}, not text")
    if not value.strip():
        raise BadRow(f"{what} column '{column}' is empty")
    return value


def chat_messages(example: dict, spec: RowSpec) -> list[dict]:
    """The prompt as a chat list, system prompt first. Raises BadRow naming the column."""
    if spec.messages_column:
        raw = example.get(spec.messages_column)
        if isinstance(raw, str) and raw.lstrip().startswith("["):  # CSV cells hold JSON text
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise BadRow(f"messages column '{spec.messages_column}' is not valid JSON: {exc}") from None
        if raw is None:
            raise missing(example, "messages", spec.messages_column)
        if not isinstance(raw, list | tuple) or not raw:
            raise BadRow(f"messages column '{spec.messages_column}' must be a non-empty list of {{role, content}}")
        messages = []
        for k, m in enumerate(raw):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRow(f"{spec.messages_column}[{k}] must be {{'role': text, 'content': text}}")
            if m["role"] not in ROLES:
                raise BadRow(f"{spec.messages_column}[{k}].role is {m['role']!r}; expected one of {sorted(ROLES)}")
            if not m["content"].strip():
                raise BadRow(f"{spec.messages_column}[{k}].content is empty")
            messages.append({"role": m["role"], "content": m["content"]})
        if messages[-1]["role"] != "user":
            raise BadRow(
                f"the last message of '{spec.messages_column}' must be the user's turn, not {messages[-1]['role']}"
            )
    else:
        messages = [{"role": "user", "content": _text(example, spec.prompt_column, "prompt")}]
    if spec.instruction:
        last = max(k for k, m in enumerate(messages) if m["role"] == "user")
        messages[last] = {"role": "user", "content": f"{messages[last]['content']} {spec.instruction}"}
    system = spec.system_prompt
    if spec.system_column and example.get(spec.system_column) not in (None, ""):
        system = _text(example, spec.system_column, "system")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def make_row(example: dict, index: int, split: str, spec: RowSpec, source_row: int = 0, messages=None) -> dict:
    """One verl row from one input example (pure: unit-tested row by row)."""
    messages = messages or chat_messages(example, spec)
    if spec.reward_style == "rule":
        ground_truth = reference_answer(_text(example, spec.answer_column, "answer"), spec)
    else:
        ground_truth = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    data_source = _text(example, spec.source_column, "source") if spec.source_column else spec.data_source
    extra = {"split": split, "index": index, "source_row": source_row, "reward_messages": messages}
    extra |= {column: _as_text(example.get(column)) for column in spec.keep_columns}
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": spec.ability,
        "reward_model": {"style": spec.reward_style, "ground_truth": ground_truth},
        "extra_info": extra,
    }


def reference_answer(text: str, spec: RowSpec) -> str:
    """The answer verl's scorer compares with: GSM8K's number after '####' (examples/data_preprocess/gsm8k.py), MATH's
    last \\boxed{} (math_dataset.py, with verl's own remove_boxed/last_boxed_only_string), else the text itself."""
    if spec.answer_format == "gsm8k":
        found = re.search("#### (\\-?[0-9\\.\\,]+)", text)
        if found is None:
            raise BadRow(f"answer column '{spec.answer_column}' has no '#### <number>', GSM8K's final answer")
        return found.group(1).replace(",", "")
    if spec.answer_format == "math":
        # verl's own code: run --preset math where verl imports (the image; docs/data.md)
        from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

        boxed = last_boxed_only_string(text)
        try:
            return remove_boxed(boxed)
        except (AssertionError, TypeError):  # verl's asserts: no \boxed{...} it can take apart
            raise BadRow(f"answer column '{spec.answer_column}' has no \\boxed{{...}}, MATH's final answer") from None
    return text


def prompt_key(messages: list[dict]) -> bytes:
    """8 bytes that identify a chat (role and content of every turn), for dedup and the split."""
    text = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _as_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def split_value(key: bytes, seed: int) -> float:
    """Where a prompt falls in [0, 1) for the split: test below --test-size."""
    h = hashlib.blake2b(key, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(h, "big") / 2**64


# --- readers: (row number as a person would count it, example) ------------------------------------------------


def read_examples(path: Path) -> Iterator[tuple[int, object]]:
    fmt = detect_format(path)
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield n, BadRow(f"line is not valid JSON: {exc}")
    elif fmt == "json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise SystemExit(f"{path}: a JSON file must hold a list of objects (one a line: .jsonl)")
        yield from enumerate(data, 1)
    elif fmt == "csv":
        with open(path, encoding="utf-8", newline="") as f:
            yield from enumerate(csv.DictReader(f), 2)  # row 1 is the header
    elif fmt == "parquet":
        batches = pq.ParquetFile(path).iter_batches(batch_size=CHUNK_ROWS)
        yield from enumerate((example for batch in batches for example in batch.to_pylist()), 1)
    else:
        import datasets  # only a save_to_disk folder needs it (docs/data.md)

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise SystemExit(f"{path} holds splits {list(ds)}: save one of them alone (ds[split].save_to_disk)")
        yield from enumerate(ds, 1)


def detect_format(path: Path) -> str:
    if path.is_dir():
        if any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "hf"
        raise SystemExit(f"{path} is a folder but not a dataset saved with datasets' save_to_disk")
    suffix = path.suffix.lower()
    kinds = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    if suffix not in kinds:
        raise SystemExit(f"cannot tell the format of {path}: name it .jsonl, .json, .csv or .parquet")
    return kinds[suffix]


# --- the build -------------------------------------------------------------------------------------------------


@dataclass
class Report:
    read: int = 0
    written: dict = field(default_factory=lambda: {"train": 0, "test": 0})
    duplicates: int = 0
    bad: int = 0
    moved_to_test: int = 0  # rows of the prompt nearest to --test-size, when no row fell under it
    bad_rows: list = field(default_factory=list)

    def add_bad(self, where: str, row: int, why: str) -> None:
        self.bad += 1
        if len(self.bad_rows) < MAX_REPORTED:
            self.bad_rows.append({"file": where, "row": row, "error": why})


class SplitWriter:
    """Chunked parquet writer into `<name>.tmp`, renamed by `commit()`."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.tmp, self.schema = path, path.with_name(path.name + ".tmp"), schema
        self.rows: list[dict] = []
        self.writer: pq.ParquetWriter | None = None

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp, self.schema)
        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def commit(self) -> None:
        self.flush()
        self.writer.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)


def good_rows(path: Path, fixed_split: str | None, args, spec: RowSpec, report: Report, seen: set):
    """Each good row of `path` as (split, split value, row), its index still 0; bad rows and duplicates are counted
    in `report` (a bad row stops the build with --on-bad-row fail)."""
    for row_number, example in read_examples(path):
        report.read += 1
        try:
            if isinstance(example, BadRow):
                raise example
            if not isinstance(example, dict):
                raise BadRow(f"expected an object, got {type(example).__name__}")
            messages = chat_messages(example, spec)
            key = prompt_key(messages)
            if args.dedup:
                if key in seen:
                    report.duplicates += 1
                    continue
                seen.add(key)
            value = split_value(key, args.seed)
            split = fixed_split or ("test" if value < args.test_size else "train")
            row = make_row(example, 0, split, spec, row_number, messages)  # its index: where it is placed
        except BadRow as exc:
            if args.on_bad_row == "fail":
                raise SystemExit(f"{path} row {row_number}: {exc} (--on-bad-row skip reports and goes on)") from None
            report.add_bad(str(path), row_number, str(exc))
            continue
        yield split, value, row


def refuse_an_empty_split(report: Report) -> None:
    """SystemExit naming the split that would be empty and what to change (for train, the first bad row's error:
    a file without the prompt's column names the columns found and the flag there)."""
    for split, n in report.written.items():
        if n == 0:
            hint = "raise --test-size or give --test-file" if split == "test" else "check the column flags"
            if split == "train" and report.bad_rows:
                hint = f"row {report.bad_rows[0]['row']}: {report.bad_rows[0]['error']}"
            raise SystemExit(f"the {split} split would be empty ({report.read} rows read, {report.bad} bad): {hint}")


def build(args: argparse.Namespace, spec: RowSpec) -> Report:
    """train.parquet and test.parquet in --out-dir from the input(s), each written to a .tmp and renamed at the end;
    on failure nothing is left (not even the folders it made)."""
    out = args.out_dir
    targets = {"train": out / "train.parquet", "test": out / "test.parquet"}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not args.overwrite:
        raise SystemExit(f"{', '.join(existing)} already exist: pass --overwrite to replace them (nothing was changed)")
    # The folders this build creates, removed again if it fails (only while empty: nothing already there is lost).
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    writers = {split: SplitWriter(path, spec.schema()) for split, path in targets.items()}
    report, seen = Report(), set()
    # The train rows of the prompt nearest to the test split (the smallest split_value), held back until the end:
    # they go to test if no row did (a small input), else to train. [value, rows].
    nearest: list = [None, []]

    def place(split: str, row: dict) -> None:
        row["extra_info"] |= {"split": split, "index": report.written[split]}
        writers[split].add(row)
        report.written[split] += 1

    def hold_or_place(value: float, row: dict) -> None:
        if nearest[0] is None or value < nearest[0]:
            for held in nearest[1]:
                place("train", held)
            nearest[:] = [value, [row]]
        elif value == nearest[0]:  # another copy of the held prompt: copies never straddle the split
            nearest[1].append(row)
        else:
            place("train", row)

    def feed(path: Path, fixed_split: str | None) -> None:
        for split, value, row in good_rows(path, fixed_split, args, spec, report, seen):
            if split == "train" and not fixed_split and args.test_size > 0:
                hold_or_place(value, row)
            else:
                place(split, row)

    try:
        feed(args.input, "train" if args.test_file else None)
        if args.test_file:
            feed(args.test_file, "test")
        to_test = report.written["test"] == 0 and report.written["train"] > 0  # train keeps a row too
        for held in nearest[1]:
            place("test" if to_test else "train", held)
        report.moved_to_test = len(nearest[1]) if to_test else 0
        refuse_an_empty_split(report)
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty: someone else's files
                break
        raise
    return report


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, RowSpec]:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("input", type=Path, help="JSONL, JSON, CSV, parquet file, or a save_to_disk folder")
    p.add_argument("--out-dir", type=Path, required=True, help="receives train.parquet and test.parquet")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-column", help="column with the user prompt text (default: prompt, or the preset's)")
    g.add_argument("--messages-column", help="column with a chat list [{role, content}, ...] ending with the user")
    p.add_argument("--system-prompt", help="a system message put before every prompt")
    p.add_argument("--system-column", help="column with a per-row system message (wins over --system-prompt)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="rule rows as verl's gsm8k.py / math_dataset.py build them (its columns, data_source, answer)",
    )
    p.add_argument(
        "--reward-style",
        choices=["model", "rule"],
        help="model (default): the reward model judges, ground_truth = the prompt; rule: ground_truth = the answer",
    )
    p.add_argument("--answer-column", help="column with the reference answer (required with --reward-style rule)")
    p.add_argument("--data-source", help="data_source of every row (verl groups metrics and picks rule scorers by it)")
    p.add_argument("--source-column", help="column whose value is each row's data_source instead")
    p.add_argument("--ability", help="the ability field (default: general; math with --preset)")
    p.add_argument("--keep-columns", default="", help="comma list of columns kept in extra_info (as text)")
    p.add_argument("--test-file", type=Path, help="an explicit test set (then all of INPUT is train)")
    p.add_argument("--test-size", type=float, default=0.05, help="share of rows in test (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    p.add_argument("--dedup", action="store_true", help="drop rows whose prompt was already seen")
    p.add_argument("--on-bad-row", choices=["skip", "fail"], default="skip", help="skip and report (default), or stop")
    p.add_argument("--overwrite", action="store_true", help="replace existing train/test.parquet")
    args = p.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    defaults = {"prompt_column": "prompt", "data_source": "custom", "ability": "general", "reward_style": "model"}
    if preset:
        defaults |= {**preset, "ability": "math", "reward_style": "rule"}
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, None if name == "prompt_column" and args.messages_column else value)
    if args.reward_style == "rule" and not args.answer_column:
        p.error("--reward-style rule needs --answer-column (the reference answer the rule compares with)")
    if not 0 <= args.test_size < 1:
        p.error(f"--test-size must be in [0, 1), got {args.test_size}")
    if not args.input.exists():
        p.error(f"input {args.input} does not exist")
    if args.test_file and not args.test_file.exists():
        p.error(f"--test-file {args.test_file} does not exist")
    keep = tuple(c.strip() for c in args.keep_columns.split(",") if c.strip())
    reserved = {"split", "index", "source_row", "reward_messages"} & set(keep)
    if reserved:
        p.error(f"--keep-columns {sorted(reserved)}: these names are taken in extra_info; rename the columns")
    as_given = (
        "prompt_column",
        "messages_column",
        "system_prompt",
        "system_column",
        "answer_column",
        "source_column",
        "data_source",
        "ability",
        "reward_style",
    )
    spec = RowSpec(
        **{name: getattr(args, name) for name in as_given},
        keep_columns=keep,
        answer_format=args.preset or "text",
        instruction=preset.get("instruction", ""),
    )
    return args, spec


def main(argv: list[str] | None = None) -> int:
    args, spec = parse_args(argv)
    report = build(args, spec)
    print(
        f"read {report.read} rows: train {report.written['train']}, test {report.written['test']}, "
        f"duplicates dropped {report.duplicates}, bad rows skipped {report.bad}"
    )
    if report.moved_to_test:
        print(
            f"  no row fell under --test-size {args.test_size}: the {report.moved_to_test} row(s) of the prompt "
            "nearest to it went to test (verl needs a validation set); --test-file gives one of your own"
        )
    for bad in report.bad_rows[:20]:
        print(f"  skipped {bad['file']} row {bad['row']}: {bad['error']}", file=sys.stderr)
    path = args.out_dir / "bad_rows.jsonl"
    path.unlink(missing_ok=True)  # never leave an earlier build's list beside these outputs
    if report.bad:
        path.write_text("".join(json.dumps(b, ensure_ascii=False) + "\n" for b in report.bad_rows), encoding="utf-8")
        more = f" (first {MAX_REPORTED})" if report.bad > MAX_REPORTED else ""
        print(f"  all skipped rows{more}: {path}", file=sys.stderr)
    print(f"wrote {args.out_dir / 'train.parquet'} and {args.out_dir / 'test.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
