"""The reward benchmark's workload (docs/reward-benchmark.md): one GRPO step's (prompt, response) lengths for a seed,
and their texts in the benchmark tokenizer's words (one word, one token)."""

import numpy as np


def workload(seed: int, n: int) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) per pair."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 601, size=n)
    responses = np.clip(np.round(rng.lognormal(np.log(300), 0.8, size=n)), 10, 1800).astype(int)
    responses = np.minimum(responses, 2048 - prompts)
    return list(zip(prompts.tolist(), responses.tolist(), strict=True))


def texts(pairs: list[tuple[int, int]], seed: int, words: int) -> list[tuple[str, str]]:
    """Each pair's prompt and response: as many random words of w0 .. w{words - 1} as its lengths say."""
    rng = np.random.default_rng(seed + 1)
    return [
        (" ".join(f"w{i}" for i in rng.integers(0, words, p)), " ".join(f"w{i}" for i in rng.integers(0, words, r)))
        for p, r in pairs
    ]
