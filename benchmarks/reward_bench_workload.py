"""The reward benchmark's workload (docs/reward-benchmark.md): one GRPO step's (prompt, response) lengths for a seed,
their texts in the benchmark tokenizer's words (one word, one token), and when each pair reaches verl's reward loop
in the rows whose rollouts finish over a window."""

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


def arrival_offsets(pairs: list[tuple[int, int]], window: float) -> list[float]:
    """When each sample reaches the reward loop: its rollout finishes at a time proportional to its response length,
    the longest at the end of the window (0: the whole step at once)."""
    longest = max(r for _, r in pairs)
    return [window * r / longest for _, r in pairs]
