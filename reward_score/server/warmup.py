"""Warm-up before /health says ready: each faster way checked on the first decoder layer's output (docs/reward.md),
then the shapes served traffic starts with. What fails or differs is dropped with a warning naming its setting."""

import logging
import time

from reward_score.server.runner import RewardScorer

log = logging.getLogger("reward_server")


def warm_up(scorer: RewardScorer) -> None:
    """The checks, then the first shapes (compiling them); a compile that fails serves eager with a warning."""
    started = time.perf_counter()
    base = scorer.fit(scorer.tokenize([scorer.render([{"role": "user", "content": "warm up"}], "ready")])[0]).ids
    ids = (base * (1 + 200 // len(base)))[: min(200, scorer.settings.max_length)]
    choose_mask_path(scorer, [ids, ids[: len(ids) // 2]])
    check_compiled(scorer, [ids, ids[: len(ids) // 2], ids[:37]])
    scorer.warm_up_s["checks"] = time.perf_counter() - started
    # Padded: one row, two rows, three equal rows. Packed (two or more sequences to a row): one row, two rows.
    shapes = [
        [ids],
        [ids, ids[: len(ids) // 2]],
        [ids[:100]] * 3,
        [ids[:37]],
        [ids[:150], ids[:40]],
        [ids[:200], ids[:50], ids[:37]],
    ]
    started = time.perf_counter()
    try:
        for seqs in shapes:
            scorer.score_ids(seqs)
    except Exception as exc:
        if not scorer.compiled:
            raise
        log.warning("REWARD_COMPILE: compiling failed (%s: %s); serving eager", type(exc).__name__, exc)
        scorer.kernels.uncompile()
        for seqs in shapes:
            scorer.score_ids(seqs)
    scorer.warm_up_s["shapes"] = time.perf_counter() - started


# --- the checks ----------------------------------------------------------------------------------------------------


def first_layer_outputs(scorer: RewardScorer, seqs: list[list[int]]) -> list:
    """Score `seqs` the way the model is set now: the first decoder layer's output of each micro-batch."""
    outputs: list = []

    # Never traced: in a compiled layer the hook runs as plain Python after the compiled forward (a graph break).
    @scorer.torch.compiler.disable
    def record(module, args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())

    hook = scorer.base.layers[0].register_forward_hook(record)
    try:
        scorer.score_ids(seqs)
    finally:
        hook.remove()
    return outputs


def differs(scorer: RewardScorer, seqs: list[list[int]], expected: list, check: str) -> str:
    """Why `seqs` run the way the model is set now do not give `expected` (raised, or off by more than the dtype's
    rounding); empty when they agree. The largest relative difference goes to `scorer.checks[check]`."""
    try:
        got = first_layer_outputs(scorer, seqs)
    except Exception as exc:  # noqa: BLE001 - a forward the model does not take: the caller falls back
        return f"{type(exc).__name__}: {exc}"
    if len(got) != len(expected):
        return f"{len(got)} micro-batches instead of {len(expected)}"
    tolerance = 1e-4 if scorer.dtype == "float32" else 2e-2
    drift = 0.0
    for a, b in zip(got, expected, strict=True):
        if a.shape != b.shape:
            return f"the first decoder layer's output has the shape {tuple(a.shape)}, not {tuple(b.shape)}"
        drift = max(drift, ((a - b).norm() / b.norm().clamp(min=1e-12)).item())
    scorer.checks[check] = drift
    if drift > tolerance:
        return f"the first decoder layer's output is {drift:.2%} off (rounding in {scorer.dtype}: <= {tolerance:.2%})"
    return ""


def check_compiled(scorer: RewardScorer, seqs: list[list[int]]) -> None:
    """Keep the compiled layers only where they compute as the same layers uncompiled (they compile here first)."""
    if not scorer.compiled:
        return
    with scorer.kernels.eager():
        expected = first_layer_outputs(scorer, seqs)
    if why := differs(scorer, seqs, expected, "compile"):
        log.warning("REWARD_COMPILE: the compiled layers do not compute as the layers do (%s); serving eager", why)
        scorer.kernels.uncompile()


def choose_mask_path(scorer: RewardScorer, seqs: list[list[int]]) -> None:
    """Use the mask mapping where the model takes it and scores as it does building its own mask."""
    if not scorer.can_map_mask:
        return
    with scorer.kernels.eager():
        expected = first_layer_outputs(scorer, seqs)
        scorer.mask_mapping = True
        if why := differs(scorer, seqs, expected, "mask_mapping"):
            log.warning("the model does not take a per-layer mask mapping (%s); transformers builds masks", why)
            scorer.mask_mapping = False
