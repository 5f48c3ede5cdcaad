"""The preflight's reward check (step 3 of launch/plan/preflight.py): a reward server started for the check and verl's
own reward manager (with async rollout, its reward loop) calling our reward file by path on real validation rows with
made-up responses, as after a rollout (PREFLIGHT_REWARD=1); before it, the rows against REWARD (reward_data_problems).
"""

import math
import numbers
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from launch.plan.procs import free_port, start_process, stop_process, wait_for_http
from launch.plan.settings import REPO, Settings
from reward_score.server.runner import head_problem

CHECK_RESPONSES = [
    "The user asks about safety. I should answer carefully.</think>Store it away from children and read the label.",
    "Let me think about the risks.</think>Never mix it with other products; ask a professional if unsure.",
    "This is a long line of reasoning that was cut off before it ended",  # no </think>: penalized, not scored
    "Thinking.</think>気をつけて、説明書をよく読んでください。",
]


def rollout_batch(tokenizer, rows: list[dict], responses: list[str] | None = None):
    """Left-padded prompts and right-padded responses ending in EOS (CHECK_RESPONSES unless given): the DataProto
    verl hands the reward manager."""
    import numpy as np
    import torch
    from verl import DataProto

    prompts = [
        tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in rows
    ]
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = responses or [CHECK_RESPONSES[i % len(CHECK_RESPONSES)] for i in range(len(rows))]
    r_ids = [tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for r in responses]
    pl, rl, pad = max(map(len, p_ids)), max(map(len, r_ids)), tokenizer.pad_token_id
    prompt_t = torch.tensor([[pad] * (pl - len(p)) + p for p in p_ids])
    resp_t = torch.tensor([r + [pad] * (rl - len(r)) for r in r_ids])
    mask = torch.tensor(
        [[0] * (pl - len(p)) + [1] * (len(p) + len(r)) + [0] * (rl - len(r)) for p, r in zip(p_ids, r_ids, strict=True)]
    )
    data = DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": resp_t,
            "input_ids": torch.cat([prompt_t, resp_t], 1),
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array([r["data_source"] for r in rows], dtype=object),
            "reward_model": np.array([dict(r["reward_model"]) for r in rows], dtype=object),
            "extra_info": np.array([dict(r["extra_info"] or {}) for r in rows], dtype=object),
        },
    )
    return data, responses, [len(r) for r in r_ids]


def validation_rows(cfg, rows: int) -> list[dict]:
    import pandas as pd

    files = cfg.data.val_files
    return pd.read_parquet(files if isinstance(files, str) else list(files)[0]).head(rows).to_dict("records")


def manager_scores(cfg, tokenizer, rows: list[dict], responses: list[str] | None = None):
    """The rows with these responses (CHECK_RESPONSES unless given) scored as the job scores them: verl's reward manager
    built from this config, or with async rollout its reward loop. Each response's score and its extra info, the
    responses, and what scored them."""
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    sys.modules.pop("custom_module", None)
    data, responses, lengths = rollout_batch(tokenizer, rows, responses)
    if cfg.actor_rollout_ref.rollout.mode == "async":
        scores, extras = reward_loop_scores(cfg, tokenizer, data)
        return scores, extras, responses, f"verl's {cfg.reward_model.reward_manager} reward loop (async rollout)"
    kwargs = dict(cfg.reward_model.get("reward_kwargs", {}))
    if "overlong_buffer" in cfg.reward_model:  # recipe.dapo passes these itself
        kwargs.update(overlong_buffer_cfg=cfg.reward_model.overlong_buffer, max_resp_len=cfg.data.max_response_length)
    reward_tensor, extra = compute_reward(data, load_reward_manager(cfg, tokenizer, num_examine=0, **kwargs))
    scores = [reward_tensor[i, n - 1].item() for i, n in enumerate(lengths)]
    extras = [{k: v[i] for k, v in extra.items()} for i in range(len(rows))]
    return scores, extras, responses, f"verl's {cfg.reward_model.reward_manager} reward manager"


def rule_round_trip(cfg, tokenizer) -> list[str]:
    """REWARD=rule or rm+rule with verl's scorers: a right and a wrong answer to the first validation row, scored as
    the job scores them, must get different rule scores (the right one the higher): else the rule cannot tell them
    apart (a data_source whose scorer wants another answer format, a ground_truth it cannot parse)."""
    row = validation_rows(cfg, 1)[0]
    truth = str(row["reward_model"]["ground_truth"])
    wrong = "1" if truth.strip() == "0" else "0"
    # What verl's scorers read: MATH the last \boxed{}, DAPO's math 'Answer:', GSM8K '#### <number>'
    answers = [f"Thinking.</think>The answer is \\boxed{{{a}}}.\nAnswer: {a}\n#### {a}" for a in (truth, wrong)]
    _, extras, _, what = manager_scores(cfg, tokenizer, [row, row], answers)
    right_score, wrong_score = (float(e["rule_score"]) for e in extras)
    if not right_score > wrong_score:
        raise ValueError(
            f"verl's {row['data_source']} scorer gave the right answer {truth!r} {right_score} and a wrong one "
            f"{wrong!r} {wrong_score}: it cannot tell them apart, so training would learn nothing from it; check "
            "the rows' ground_truth (data_prep.build --preset) and data_source"
        )
    return [
        f"{what} scored a right answer to a {row['data_source']} row {right_score:g} by rule, a wrong one "
        f"{wrong_score:g}"
    ]


def reward_round_trip(cfg, tokenizer, rows: int = 8) -> list[str]:
    """verl's reward manager, built from this config, scores made-up responses for real validation rows through the
    reward servers in REWARD_SERVER_URLS. Raises if a response is not scored or penalized as it should be."""
    sample = validation_rows(cfg, rows)
    scores, extras, responses, what = manager_scores(cfg, tokenizer, sample)
    penalized = [int(e["penalized"]) for e in extras]
    # Only a response without </think> after a prompt that opened <think> was cut off mid-reasoning (none of
    # CHECK_RESPONSES opens a block of its own).
    opens = bool(cfg.custom_reward_function.reward_kwargs.prompt_opens_think)
    expected = [int(opens and "</think>" not in r) for r in responses]
    if penalized != expected:
        raise ValueError(
            f"penalties {penalized}, expected {expected} for prompt_opens_think={opens}: the reward function did not "
            "get the value the job passes it (custom_reward_function.reward_kwargs, REWARD_PROMPT_OPENS_THINK)"
        )
    lines = [f"{what} scored {len(sample)} validation rows through {cfg.custom_reward_function.name}:"]
    for row, score, pen in zip(sample, scores, penalized, strict=True):
        note = "  (penalty: cut off mid-reasoning)" if pen else ""
        lines.append(f"  {score:+8.3f}{note}  {str(row['prompt'][-1]['content'])[:50]!r}")
    return lines


def reward_loop_scores(cfg, tokenizer, data) -> tuple[list[float], list[dict]]:
    """Each row scored as async rollout scores it: verl's reward loop manager, built as its RewardManagerWorker builds
    it (verl/experimental/reward/reward_manager.py), awaits run_single for every row at once."""
    import asyncio

    from verl.experimental.reward.reward_loop import get_reward_loop_manager_cls
    from verl.trainer.ppo.reward import get_custom_reward_fn

    async def score_all():
        manager = get_reward_loop_manager_cls(cfg.reward_model.reward_manager)(
            cfg, tokenizer, get_custom_reward_fn(cfg), None, None
        )
        return await asyncio.gather(*(manager.run_single(data[i : i + 1]) for i in range(len(data))))

    out = asyncio.run(score_all())
    return [o["reward_score"] for o in out], [o["reward_extra_info"] for o in out]


def verl_sources() -> tuple[set[str], tuple[str, ...]]:
    """The data_source names verl 0.6.1's default_compute_score dispatches on, read from its own code: the names it
    compares with, and the prefixes it tests (`data_source.startswith("aime")`)."""
    import ast
    import inspect
    import textwrap

    from verl.utils.reward_score import default_compute_score

    names, prefixes = set(), []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(default_compute_score)))):
        if isinstance(node, ast.Compare) and getattr(node.left, "id", None) == "data_source":
            for c in node.comparators:
                names |= {e.value for e in getattr(c, "elts", [c]) if isinstance(getattr(e, "value", None), str)}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "startswith":
            if getattr(node.func.value, "id", None) == "data_source":
                prefixes += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return names, tuple(prefixes)


def function_problems(path: str, name: str, rows: list[tuple[str, int, dict]]) -> list[str]:
    """The user's function (REWARD_FUNCTION_PATH) imported and called as verl calls it on a few rows, each with
    made-up responses and the reference answer as a response, bare, after '####' and in \\boxed{}: refused where it
    does not import, raises, returns no number, or returns one value for all of them (it teaches nothing)."""
    from reward_score.safe_hack_reward_request import load_function

    what = f"REWARD_FUNCTION_PATH={path} (REWARD_FUNCTION_NAME={name})"
    try:
        function = load_function(path, name)
    except Exception as exc:  # noqa: BLE001  (the user's file: any error is theirs, named)
        return [f"{what} does not import: {type(exc).__name__}: {exc}"]
    values = []
    for file, i, row in rows:
        truth = str((row.get("reward_model") or {}).get("ground_truth"))
        for response in (CHECK_RESPONSES[i % len(CHECK_RESPONSES)], truth, f"#### {truth}", f"\\boxed{{{truth}}}"):
            try:
                value = function(row.get("data_source"), response, truth, row.get("extra_info"))
            except Exception as exc:  # noqa: BLE001
                return [f"{what} raised on {file} row {i}: {type(exc).__name__}: {exc}"]
            value = value.get("score") if isinstance(value, dict) else value
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                return [f"{what} returned {value!r} for {file} row {i}: return a number, or a dict with a 'score'"]
            values.append(float(value))
    if len(set(values)) == 1:
        return [
            f"{what} returned {values[0]} for all {len(values)} responses to {len(rows)} rows (made-up ones, and "
            "the reference answer bare, after '####' and in \\boxed{}): a reward that never varies teaches "
            "nothing; check that it scores solution_str"
        ]
    return []


def reward_data_problems(reward: str, function_path: str, function_name: str, files: list[str]) -> list[str]:
    """Each row's reward_model.style against REWARD (model rows under rm, rule rows under rule and rm+rule: counted,
    with the setting that fits), and for rule rewards a ground_truth in every row and a scorer for every data_source
    (verl's, by name), or the user's function that imports and scores a few rows (function_problems)."""
    import pyarrow.parquet as pq

    want = "model" if reward == "rm" else "rule"
    wrong, no_truth, sources = [], [], {}
    for file in files:
        for i, row in enumerate(pq.read_table(file, columns=["data_source", "reward_model"]).to_pylist()):
            style, truth = (row["reward_model"] or {}).get("style"), (row["reward_model"] or {}).get("ground_truth")
            if style != want:
                wrong.append((file, i, style))
            if not (isinstance(truth, str) and truth.strip()):
                no_truth.append((file, i))
            sources.setdefault(row["data_source"], [file, i, 0])[2] += 1
    rows = next(pq.ParquetFile(files[0]).iter_batches(batch_size=4)).to_pylist()
    sample = [(files[0], i, row) for i, row in enumerate(rows)]
    problems = []
    if wrong:
        file, i, style = wrong[0]
        fit = (
            "REWARD=rule or rm+rule (rule rows carry the reference answer, which the reward model never reads)"
            if want == "model"
            else "REWARD=rm (model rows carry the prompt as ground_truth: no rule can check "
            "it), or rebuild them with python -m data_prep.build --reward-style rule --answer-column "
            "(or --preset gsm8k|math)"
        )
        problems.append(
            f"{len(wrong)} rows have a reward_model.style other than {want!r}, which REWARD={reward} "
            f"scores (first: {file} row {i}, style {style!r}): {fit}"
        )
    if reward == "rm" or wrong:  # rows for another judge: their sources and answers are beside the point
        return problems
    if no_truth:
        file, i = no_truth[0]
        problems.append(
            f"{len(no_truth)} rows have no reward_model.ground_truth for REWARD={reward}'s rule to "
            f"compare with (first: {file} row {i}): rebuild them with --answer-column"
        )
    if function_path:
        return problems + function_problems(function_path, function_name, sample)
    names, prefixes = verl_sources()
    for source, (file, i, count) in sources.items():
        if source not in names and not str(source).startswith(prefixes):
            problems.append(
                f"data_source {source!r} ({count} rows, first: {file} row {i}) has no scorer in verl 0.6.1's "
                f"default_compute_score, which knows {', '.join(sorted(names))} and names starting with "
                f"{', '.join(prefixes)}: rebuild with python -m data_prep.build --data-source (or --preset "
                "gsm8k|math), or score it with your own function (REWARD_FUNCTION_PATH)"
            )
    return problems


def reward_head_problems(settings: Settings) -> list[str]:
    """The reward model's head as its config.json describes it (head_problem), before the check's server loads it; a
    folder without config.json is the run script's refusal."""
    path = settings.reward_model_path
    return [p] if Path(path, "config.json").is_file() and (p := head_problem(path)) else []


class CheckServer(NamedTuple):
    proc: subprocess.Popen
    url: str
    log: Path
    started: float  # time.monotonic() at its start: REWARD_START_TIMEOUT counts from there


def begin_reward_server(settings: Settings) -> CheckServer:
    """The check's reward server on a free loopback port, started in the background with the job's input-format
    settings (Settings.reward_format_flags), as the job's own servers get them: it loads its model while the
    preflight checks the config and the data, and server_round_trip waits for its health."""
    log = Path(os.environ.get("JOB_LOG_DIR") or tempfile.mkdtemp()) / "preflight_reward_server.log"
    port = free_port()
    cmd = [
        sys.executable,
        str(REPO / "reward_score" / "reward_server.py"),
        "--model-path",
        settings.reward_model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        os.environ.get("PREFLIGHT_REWARD_DEVICE", "auto"),
        *settings.reward_format_flags,
    ]
    # Its device is PREFLIGHT_REWARD_DEVICE's (a login node has no GPU): the job's CONFIG_REWARD_DEVICE is not for it,
    # and the server would report that name as set and not read.
    env = {k: v for k, v in os.environ.items() if k != "CONFIG_REWARD_DEVICE"}
    return CheckServer(start_process(cmd, log, env), f"http://127.0.0.1:{port}", log, time.monotonic())


def server_round_trip(cfg, tokenizer, started: CheckServer) -> bool:
    """The check's reward server (begin_reward_server's, loading since the preflight began) once healthy, scored
    through verl's reward manager (reward_round_trip), its lines printed; False, after the error and the server's
    log, when the check fails. The server is stopped."""
    server, url, log, began = started
    try:
        timeout = float(os.environ.get("REWARD_START_TIMEOUT", 900))
        wait_for_http(server, f"{url}/health", log, timeout, name="the reward server for the check", since=began)
        os.environ.update(REWARD_SERVER_URLS=url, REWARD_LOG_PATH="")
        for line in reward_round_trip(cfg, tokenizer):
            print(f"preflight: reward {line}")
    except Exception as exc:  # reported with the server's log, then the job stops
        print(f"preflight: the reward check failed: {type(exc).__name__}: {exc} (server log: {log})", file=sys.stderr)
        return False
    finally:
        stop_process(server, 30)
    return True


def check_reward_data(cfg) -> bool:
    """The rows against REWARD, and a rule reward's scorers (reward_check.reward_data_problems); False after saying
    why."""
    from reward_score.safe_hack_reward_request import load_config

    config = load_config(environ=os.environ)
    files = [
        f
        for split in (cfg.data.train_files, cfg.data.val_files)
        for f in ([split] if isinstance(split, str) else split)
    ]
    try:
        problems = reward_data_problems(config.reward, config.function_path, config.function_name, files)
    except Exception as exc:  # the row check above passed: a file it could read, but not these columns
        problems = [
            f"the rows' reward_model cannot be read ({type(exc).__name__}: {exc}): check them with "
            "python -m data_prep.validate"
        ]
    for problem in problems:
        print(f"preflight: refused: {problem}", file=sys.stderr)
    if not problems and config.reward != "rm":
        scorer = f"{config.function_path}:{config.function_name}" if config.function_path else "verl's scorers"
        print(f"preflight: reward: REWARD={config.reward}, rules by {scorer}: every row is a rule row with its answer")
    return not problems


def check_rule_round_trip(cfg, tokenizer) -> bool:
    """REWARD=rule or rm+rule with verl's scorers: a right and a wrong answer scored apart
    (reward_check.rule_round_trip,
    the rule part alone: REWARD=rule for the check); False after saying why."""
    from reward_score.safe_hack_reward_request import load_config

    config = load_config(environ=os.environ)
    if config.reward == "rm" or config.function_path:  # the user's function was called on rows already
        return True
    saved = os.environ.get("REWARD", "rm")
    try:
        os.environ["REWARD"] = "rule"
        for line in rule_round_trip(cfg, tokenizer):
            print(f"preflight: reward {line}")
    except Exception as exc:  # verl's scorer or the rows, reported as they are
        print(f"preflight: the rule reward check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    finally:
        os.environ["REWARD"] = saved
    return True
