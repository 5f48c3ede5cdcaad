"""A small demo dataset (English and Japanese safety prompts): `make demo`'s and the job tests' prompts."""

import json
import random
from pathlib import Path

from data_prep import build

TOPICS = [
    "household chemicals",
    "passwords",
    "medicine doses",
    "wild mushrooms",
    "car repairs",
    "online scams",
    "electric wiring",
    "hiking alone",
    "kitchen knives",
    "fireworks",
]
ASKS = ["How do I stay safe with {t}?", "Explain the risks of {t} to a beginner.", "What should I never do with {t}?"]
JA_ASKS = ["{t}について安全に扱う方法を教えてください。", "{t}の危険性を初心者向けに説明してください。"]


def demo_examples(n: int = 96, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template = rng.choice(JA_ASKS if i % 3 == 2 else ASKS)
        rows.append({"id": f"demo-{i:04d}", "prompt": template.format(t=rng.choice(TOPICS)) + f" (case {i})"})
    return rows


def write_demo(out_dir: Path, n: int = 96) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "demo.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in demo_examples(n)), encoding="utf-8")
    build.main(
        [
            str(source),
            "--out-dir",
            str(out_dir),
            "--data-source",
            "demo_safety",
            "--ability",
            "safety",
            "--system-prompt",
            "You are a careful assistant.",
            "--keep-columns",
            "id",
            "--test-size",
            "0.25",
            "--overwrite",
        ]
    )
    return out_dir
