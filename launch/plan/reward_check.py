"""The preflight's reward check (step 3 of launch/plan/preflight.py): python -m reward_score.check_format on the user's
preference pairs with the job's input-format settings (PREFLIGHT_REWARD_PAIRS), then a reward server started for the
check and verl's own reward manager (with async rollout, its reward loop) calling our reward file by path on real
validation rows with made-up responses, as after a rollout (PREFLIGHT_REWARD=1).
"""

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


def rollout_batch(tokenizer, rows: list[dict]):
    """Left-padded prompts and right-padded responses ending in EOS: the DataProto verl hands the reward manager."""
    import numpy as np
    import torch
    from verl import DataProto

    prompts = [
        tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in rows
    ]
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = [CHECK_RESPONSES[i % len(CHECK_RESPONSES)] for i in range(len(rows))]
    r_ids = [tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for r in responses]
    pl, rl, pad = max(map(len, p_ids)), max(map(len, r_ids)), tokenizer.pad_token_id
    prompt_t = torch.tensor([[pad] * (pl - len(p)) + p for p in p_ids])
    resp_t = torch.tensor([r + [pad] * (rl - len(r)) for r in r_ids])
    mask = torch.tensor(
        [[0] * (pl - len(p)) + [1] * (len(p) + len(r)) + [0] * (rl - len(r)) for p, r in zip(p_ids, r_ids, strict=True)]
    )
    data = DataProto.from_dict(
        tensors={"prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], 1), "attention_mask": mask},
        non_tensors={
            "data_source": np.array([r["data_source"] for r in rows], dtype=object),
            "reward_model": np.array([dict(r["reward_model"]) for r in rows], dtype=object),
            "extra_info": np.array([dict(r["extra_info"] or {}) for r in rows], dtype=object),
        },
    )  # fmt: skip
    return data, responses, [len(r) for r in r_ids]


def reward_round_trip(cfg, tokenizer=None, rows: int = 8) -> list[str]:
    """verl's reward manager, built from this config, scores made-up responses for real validation rows through the
    reward servers in REWARD_SERVER_URLS. Raises if a response is not scored or penalized as it should be."""
    import pandas as pd
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager
    from verl.utils import hf_tokenizer

    sys.modules.pop("custom_module", None)
    tokenizer = tokenizer or hf_tokenizer(cfg.actor_rollout_ref.model.path)
    files = cfg.data.val_files
    sample = pd.read_parquet(files if isinstance(files, str) else list(files)[0]).head(rows).to_dict("records")
    kwargs = dict(cfg.reward_model.get("reward_kwargs", {}))
    if "overlong_buffer" in cfg.reward_model:  # recipe.dapo passes these itself
        kwargs.update(overlong_buffer_cfg=cfg.reward_model.overlong_buffer, max_resp_len=cfg.data.max_response_length)
    data, responses, lengths = rollout_batch(tokenizer, sample)
    if cfg.actor_rollout_ref.rollout.mode == "async":
        scores, penalized = reward_loop_scores(cfg, tokenizer, data)
        what = f"verl's {cfg.reward_model.reward_manager} reward loop (async rollout)"
    else:
        manager = load_reward_manager(cfg, tokenizer, num_examine=0, **kwargs)
        reward_tensor, extra = compute_reward(data, manager)
        scores = [reward_tensor[i, n - 1].item() for i, n in enumerate(lengths)]
        penalized = [int(x) for x in extra["penalized"]]
        what = f"verl's {cfg.reward_model.reward_manager} reward manager"
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


def reward_loop_scores(cfg, tokenizer, data) -> tuple[list[float], list[int]]:
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
    return [o["reward_score"] for o in out], [int(o["reward_extra_info"]["penalized"]) for o in out]


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
    cmd = [sys.executable, str(REPO / "reward_score" / "reward_server.py"), "--model-path", settings.reward_model_path,
           "--host", "127.0.0.1", "--port", str(port), "--device", os.environ.get("PREFLIGHT_REWARD_DEVICE", "auto"),
           *settings.reward_format_flags]  # fmt: skip
    # Its device is PREFLIGHT_REWARD_DEVICE's (a login node has no GPU): the job's CONFIG_REWARD_DEVICE is not for it,
    # and the server would report that name as set and not read.
    env = {k: v for k, v in os.environ.items() if k != "CONFIG_REWARD_DEVICE"}
    return CheckServer(start_process(cmd, log, env), f"http://127.0.0.1:{port}", log, time.monotonic())


def check_reward_format(settings: Settings, pairs: str, timeout: float = 3600) -> bool:
    """python -m reward_score.check_format on the user's preference pairs, with the job's format settings: False
    (after its table and recommendation) when the reward model ranks the pairs best in another format."""
    cmd = [sys.executable, "-m", "reward_score.check_format", settings.reward_model_path, pairs,
           "--device", os.environ.get("PREFLIGHT_REWARD_DEVICE", "auto"), *settings.reward_format_flags]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    for line in run.stdout.splitlines():
        print(f"preflight: reward format {line}")
    if run.returncode == 0:
        return True
    if run.returncode == 1:
        print(
            "preflight: the reward model ranks PREFLIGHT_REWARD_PAIRS best in another input format than this job's "
            "settings: set the CONFIG_REWARD_* settings recommended above (top of run_grpo_qwen3_4b_mega_verl.sh)",
            file=sys.stderr,
        )
    else:
        print(f"preflight: PREFLIGHT_REWARD_PAIRS: {run.stderr.strip()[-2000:]}", file=sys.stderr)
    return False


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
