"""Check verl parquet files before training: schema row by row, duplicates, and prompt lengths as verl counts them.

    python -m data_prep.validate data/safety/train.parquet data/safety/test.parquet
    python -m data_prep.validate data/safety/train.parquet --tokenizer /models/Qwen3-4B --max-prompt-length 2048

With a tokenizer, each prompt is measured exactly as verl 0.6.1's RLHFDataset does: the chat template with the
generation prompt, tokenized without adding special tokens again. Prompts over --max-prompt-length are counted and
warned of: every job sets data.filter_overlong_prompts, which drops them. Exits 1 when any file has errors.
"""

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import pyarrow.parquet as pq
except ImportError as exc:  # a login node's bare python3: one line with the fix, not a traceback
    sys.exit(
        f"python -m data_prep.validate needs pyarrow, which {sys.executable} cannot import ({exc}): pip install "
        "--user pyarrow, or run it in the image: singularity exec verl_app.sif python3 -m data_prep.validate ..."
    )

MAX_SHOWN = 20


@dataclass
class FileReport:
    path: Path
    rows: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    duplicates: int = 0
    lengths: list[int] = field(default_factory=list)
    over_limit: int = 0

    def error(self, row: int, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_SHOWN:
            self.errors.append(f"row {row}: {message}")


def check_row(row: dict) -> list[str]:
    """What is wrong with one row, in the words of the field that is wrong (empty when nothing is)."""
    problems = []
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        problems.append("prompt must be a non-empty chat list [{role, content}, ...] (verl reads it as messages)")
    else:
        for k, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                problems.append(f"prompt[{k}] must be {{'role': text, 'content': text}}")
            elif not m["content"].strip():
                problems.append(f"prompt[{k}].content is empty")
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        problems.append("data_source must be non-empty text (verl's reward managers read it)")
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        problems.append("reward_model must be {'style': 'model'|'rule', 'ground_truth': ...}")
    else:
        if reward.get("style") not in ("model", "rule"):
            problems.append(f"reward_model.style is {reward.get('style')!r}; expected 'model' or 'rule'")
        truth = reward.get("ground_truth")
        if truth is None or (isinstance(truth, str) and not truth.strip()):
            problems.append("reward_model.ground_truth is missing or empty (naive/dapo managers raise KeyError)")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        problems.append("extra_info must be a dict")
    elif isinstance(extra, dict) and extra.get("index") is not None and not isinstance(extra["index"], int):
        problems.append("extra_info.index must be an integer")
    return problems


def prompt_lengths(tokenizer, prompts: list[list[dict]], template_kwargs: dict) -> list[int]:
    """Token counts as RLHFDataset computes them: chat template + generation prompt, no special tokens added."""
    texts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **template_kwargs) for p in prompts
    ]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def validate_file(path: Path, tokenizer=None, max_prompt_length: int | None = None, template_kwargs=None) -> FileReport:
    report = FileReport(path)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        report.error(0, f"cannot be read as parquet ({exc}); build it with python -m data_prep.build")
        return report
    missing = {"prompt", "data_source", "reward_model"} - set(pf.schema_arrow.names)
    if missing:
        report.error(
            0, f"columns {sorted(missing)} are missing (found {pf.schema_arrow.names}); build with data_prep.build"
        )
        return report
    seen: set[str] = set()
    for batch in pf.iter_batches(batch_size=10_000):
        rows = batch.to_pylist()
        good_prompts = []
        for row in rows:
            report.rows += 1
            problems = check_row(row)
            for p in problems:
                report.error(report.rows, p)
            if problems:
                continue
            key = json.dumps(row["prompt"], ensure_ascii=False, sort_keys=True)
            report.duplicates += key in seen
            seen.add(key)
            good_prompts.append(row["prompt"])
        if tokenizer is not None and good_prompts:
            report.lengths += prompt_lengths(tokenizer, good_prompts, template_kwargs or {})
    if max_prompt_length is not None:
        report.over_limit = sum(n > max_prompt_length for n in report.lengths)
    return report


def summary(report: FileReport, max_prompt_length: int | None) -> str:
    lines = [
        f"{report.path}: {report.rows} rows, {report.error_count} with errors, {report.duplicates} duplicate prompts"
    ]
    lines += [f"  {e}" for e in report.errors]
    if report.error_count > len(report.errors):
        lines.append(f"  ... and {report.error_count - len(report.errors)} more")
    if report.lengths:
        xs = sorted(report.lengths)
        p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
        line = f"  prompt tokens: p50 {statistics.median(xs):.0f}, p95 {p95}, max {xs[-1]}"
        if max_prompt_length is not None:
            line += f"; {report.over_limit} over the limit of {max_prompt_length}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.validate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", type=Path, nargs="+", help="parquet files to check")
    p.add_argument("--tokenizer", type=Path, help="the policy model folder: measure prompts as verl does")
    p.add_argument("--max-prompt-length", type=int, help="data.max_prompt_length of the run")
    args = p.parse_args(argv)
    if args.max_prompt_length is not None and args.tokenizer is None:
        p.error("--max-prompt-length needs --tokenizer (lengths are in the policy's tokens)")
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return 0 if validate_files(args.files, tokenizer, args.max_prompt_length) else 1


def validate_files(paths, tokenizer=None, max_prompt_length=None, template_kwargs=None) -> bool:
    """Check each file and print its summary; False when any has errors (over-long prompts are a warning)."""
    failed, over = False, 0
    for path in map(Path, paths):
        report = validate_file(path, tokenizer, max_prompt_length, template_kwargs)
        print(summary(report, max_prompt_length))
        over += report.over_limit
        failed |= report.error_count > 0 or report.rows == 0
        if report.rows == 0:
            print(f"  {path} has no rows", file=sys.stderr)
    if over:
        print(f"warning: {over} prompts over the limit will be dropped by data.filter_overlong_prompts")
    print("FAILED" if failed else "OK")
    return not failed


if __name__ == "__main__":
    sys.exit(main())
