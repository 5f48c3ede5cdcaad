"""REWARD=rule and rm+rule (docs/reward.md): verl's own scorers or the user's function, and the mix. The reward function
loads this file by path; it imports the standard library, and verl where the rule is verl's."""

from __future__ import annotations

import importlib.util
import itertools
import math
import numbers
import sys

_scorers: dict[tuple[str, str], object] = {}  # (REWARD_FUNCTION_PATH, REWARD_FUNCTION_NAME) -> the rule scorer
_rule_errors = itertools.count()  # rule scorer failures this process printed
RULE_ERRORS_PRINTED = 20


def load_function(path: str, name: str):
    """The user's function from its file, loaded as verl loads custom_reward_function: a module of its own."""
    spec = importlib.util.spec_from_file_location(f"user_reward_{len(_scorers)}", path)
    if spec is None:
        raise ValueError(f"REWARD_FUNCTION_PATH={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"REWARD_FUNCTION_NAME={name}: {path} defines no function of that name")
    return function


def rule_scorer(config):
    """The user's function (REWARD_FUNCTION_PATH), else verl's default_compute_score; loaded once per process."""
    key = (config.function_path, config.function_name)
    if key not in _scorers:
        if config.function_path:
            _scorers[key] = load_function(*key)
        else:
            from verl.utils.reward_score import default_compute_score

            _scorers[key] = default_compute_score
    return _scorers[key]


def rule_score(config, data_source, solution_str, ground_truth, extra_info) -> tuple[float, str]:
    """(the rule's score of the whole response, ""), or (0, the error) where the scorer raised or returned no number."""
    scorer = rule_scorer(config)  # a function that does not load is the job's error: raised
    try:
        value = scorer(data_source, solution_str, ground_truth, extra_info)
        value = value["score"] if isinstance(value, dict) else value
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"returned {value!r}, not a finite number")
        return float(value), ""
    except Exception as exc:  # noqa: BLE001  (one response's scorer error: scored 0 and counted, rule_failed)
        error = f"{type(exc).__name__}: {exc}"[:300]
        if next(_rule_errors) < RULE_ERRORS_PRINTED:
            index = extra_info.get("index") if isinstance(extra_info, dict) else None
            print(
                f"[reward] the rule scorer failed on the {data_source} row with extra_info.index={index}: {error}; "
                "scored 0 (counted in rule_failed)",
                file=sys.stderr,
            )
        return 0.0, error


def mixed(config, rm: dict | None, rule: tuple[float, str]) -> dict:
    """REWARD=rule's result, or rm+rule's: the weighted sum, and each part for verl's reward_extra_info."""
    parts = {"rule_score": rule[0], "rule_failed": float(bool(rule[1]))}
    if rm is None:
        return {"score": rule[0], **parts}
    return {
        **rm,
        "score": config.rm_weight * rm["score"] + config.rule_weight * rule[0],
        "rm_score": rm["score"],
        **parts,
    }
