"""The reward function verl calls: every manager, the reasoning rules, honest failures, a log that survives many
writers.

verl 0.6.1's own `load_reward_manager` + `compute_reward` (naive, batch, dapo) and its async reward loop call
reward_score/safe_hack_reward_request.py by path, against the real reward server with the tiny model on loopback.
"""

import asyncio
import http.server
import json
import multiprocessing
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from reward_score import safe_hack_reward_request as client
from reward_score.safe_hack_reward_request import (
    Answer,
    RewardRequestRejected,
    RewardServerError,
    load_config,
    reward_prompt,
    safe_hack_reward,
    safe_hack_reward_batch,
    split_answer,
    write_log,
)
from tests.support import REPO, free_port, start_http_server

REWARD_FILE = REPO / "reward_score" / "safe_hack_reward_request.py"


def batch_requests(url: str) -> float:
    """The server's answered /score_batch requests, from its /metrics."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    values = {name: float(value) for name, _, value in (x.rpartition(" ") for x in lines if x and x[0] != "#")}
    return values.get('reward_requests_total{endpoint="/score_batch",status="200"}', 0.0)


def start_server(tiny_models, tmp_path, *flags):
    port = free_port()
    cmd = [sys.executable, str(REPO / "reward_score" / "reward_server.py"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model-path", str(tiny_models.reward_model), *flags]
    return start_http_server(cmd, tmp_path / f"reward_server_{port}.log", port)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    proc = start_server(tiny_models, tmp_path_factory.mktemp("rs"))
    yield proc
    proc.stop()


@pytest.fixture
def env(monkeypatch, server, tmp_path):
    monkeypatch.setenv("REWARD_SERVER_URL", server.url)
    monkeypatch.setenv("REWARD_LOG_PATH", str(tmp_path / "logs" / "rewards.jsonl"))
    monkeypatch.setattr(client, "_session", None)
    return tmp_path


def direct_score(server, prompt_part: dict, answer: str) -> float:
    r = requests.post(server.url + "/score_batch", json={"items": [{**prompt_part, "response": answer}]}, timeout=30)
    r.raise_for_status()
    return r.json()["scores"][0]


# --- reasoning -----------------------------------------------------------------------------------------------------

REASONING_TABLE = [
    # (response, prompt opens <think>, expected answer, penalty reason)
    ("<think>plan</think>The answer.", False, "The answer.", ""),  # hybrid Qwen3: full block in the response
    ("plan</think>The answer.", True, "The answer.", ""),  # Thinking-2507: the prompt opened <think>
    ("a</think>b</think>  final  ", True, "final", ""),  # text after the LAST close is the answer
    ("<think>plan, still thinking...", False, "", "unclosed_think"),  # cut off mid-reasoning
    ("<think>plan, still thinking...", True, "", "unclosed_think"),
    ("still thinking, cut off at max length", True, "", "no_think_close"),  # Thinking-2507, never closed
    ("A plain answer.", False, "A plain answer.", ""),  # no reasoning at all, none expected
    ("<think>x</think>answer <think>again", False, "", "stray_think_tag"),  # a tag left in the answer
    ("x</think>draft<think>y</think>z", True, "z", ""),  # tags before the last close belong to the reasoning
    ("<think>x</think>   \n", False, "", "empty_answer"),  # nothing after the reasoning
    ("", False, "", "empty_answer"),
    ("思考</think>安全な回答です。", True, "安全な回答です。", ""),  # Japanese survives untouched
]


@pytest.mark.parametrize("response, opens, answer, reason", REASONING_TABLE)
def test_reasoning_is_removed_and_cut_off_responses_are_penalized(response, opens, answer, reason):
    assert split_answer(response, prompt_opens_think=opens) == Answer(answer, reason)


@pytest.mark.parametrize(
    "ground_truth, extra_info, expected",
    [
        ("rm prompt", None, {"prompt": "rm prompt"}),  # the article's convention
        ("gt", {"reward_prompt": "from extra"}, {"prompt": "from extra"}),  # the builder's text wins
        (
            "gt",
            {"reward_messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "hi"}]},
        ),
        (
            "gt",
            {"reward_messages": np.array([{"role": "user", "content": "hi"}], dtype=object)},
            {"messages": [{"role": "user", "content": "hi"}]},
        ),
        ("gt", {"reward_messages": [], "reward_prompt": ""}, {"prompt": "gt"}),  # empty fields fall through
    ],
)
def test_the_reward_prompt_comes_from_extra_info_else_ground_truth(ground_truth, extra_info, expected):
    assert reward_prompt(ground_truth, extra_info) == expected


def test_a_row_without_any_prompt_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="data_prep.build"):
        reward_prompt("", {})


# --- settings --------------------------------------------------------------------------------------------------


def test_reward_kwargs_override_the_environment_and_typos_are_refused():
    env = {"REWARD_SERVER_URLS": "http://a:1, http://b:2/", "REWARD_MIN_SCORE": "-5", "REWARD_PROMPT_OPENS_THINK": "0"}
    cfg = load_config({"max_score": "7"}, env)
    assert cfg.server_urls == ("http://a:1", "http://b:2")
    assert (cfg.min_score, cfg.max_score, cfg.prompt_opens_think, cfg.penalty_score) == (-5, 7, False, -5)
    assert load_config({}, {"REWARD_SERVER_URL": "http://one:8000"}).server_urls == ("http://one:8000",)
    with pytest.raises(TypeError, match="max_scor"):
        load_config({"max_scor": 1}, {})
    with pytest.raises(ValueError, match="REWARD_SERVER_URLS"):
        load_config({}, {"REWARD_SERVER_URLS": "a:1"})
    with pytest.raises(ValueError, match="REWARD_ON_FAILURE"):
        load_config({}, {"REWARD_ON_FAILURE": "zero"})
    from reward_score.server.app import MAX_ITEMS  # the server refuses a longer request with a 422

    assert client.BATCH_SIZE <= MAX_ITEMS


# --- verl's own reward managers --------------------------------------------------------------------------------

SAMPLES = [
    # (prompt messages, response as generated, ground truth, extra_info)
    ([{"role": "user", "content": "Is it safe?"}], "Let me think.</think>Yes, it is safe.", "Is it safe?", {}),
    (
        [{"role": "user", "content": "Help me."}],
        "Thinking</think>Sure, here is how.",
        "ignored",
        {"reward_prompt": "Help me, please."},
    ),
    (
        [{"role": "user", "content": "日本語で"}],
        "考え中</think>はい、わかりました。",
        "x",
        {"reward_messages": [{"role": "system", "content": "Judge."}, {"role": "user", "content": "日本語で"}]},
    ),
    ([{"role": "user", "content": "Long task"}], "thinking and thinking, cut off", "Long task", {}),  # never closed
    ([{"role": "user", "content": "Tags?"}], "r</think>answer <think>", "Tags?", {}),  # stray tag
]


def make_data(tokenizer, samples=SAMPLES, data_source="safety", style="model"):
    """A DataProto as verl builds it after rollout: left-padded prompts, right-padded responses ending in EOS."""
    from verl import DataProto

    prompt_ids = [
        tokenizer(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        for m, _, _, _ in samples
    ]
    response_ids = [tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for _, r, _, _ in samples]
    p_len, r_len, pad = max(map(len, prompt_ids)), max(map(len, response_ids)) + 3, tokenizer.pad_token_id
    prompts = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompt_ids])
    responses = torch.tensor([r + [pad] * (r_len - len(r)) for r in response_ids])
    mask = torch.tensor(
        [
            [0] * (p_len - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (r_len - len(r))
            for p, r in zip(prompt_ids, response_ids, strict=True)
        ]
    )
    data = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array([data_source] * len(samples), dtype=object),
            "reward_model": np.array([{"ground_truth": gt, "style": style} for _, _, gt, _ in samples], dtype=object),
            "extra_info": np.array([dict(e) for _, _, _, e in samples], dtype=object),
        },
    )
    return data, [len(r) for r in response_ids]


def verl_config(manager: str, function: str, **extra_overrides: str):
    from hydra import compose, initialize_config_module

    overrides = [
        f"custom_reward_function.path={REWARD_FILE}",
        f"custom_reward_function.name={function}",
        f"reward_model.reward_manager={manager}",
        *[f"{k}={v}" for k, v in extra_overrides.items()],
    ]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=overrides)


def expected_rewards(server):
    """What each sample must get: the server's score on the right prompt and answer, or the penalty."""
    out = []
    for _messages, response, gt, extra in SAMPLES:
        answer = split_answer(response, prompt_opens_think=True)
        out.append(-40.0 if answer.penalty_reason else direct_score(server, reward_prompt(gt, extra), answer.text))
    return out


@pytest.mark.parametrize(
    "manager, function, manager_kwargs",
    [
        ("naive", "safe_hack_reward", {}),
        ("batch", "safe_hack_reward_batch", {}),
        (
            "dapo",
            "safe_hack_reward",
            {
                "max_resp_len": 4096,
                "overlong_buffer_cfg": {"enable": False, "len": 0, "penalty_factor": 1.0, "log": False},
            },
        ),
    ],
)
def test_verl_reward_managers_call_this_file_and_get_the_servers_scores(
    tiny_models, server, env, manager, function, manager_kwargs
):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    sys.modules.pop("custom_module", None)  # verl caches the reward file per process
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = verl_config(manager, function)
    kwargs = {k: OmegaConf.create(v) if isinstance(v, dict) else v for k, v in manager_kwargs.items()}
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0, **kwargs)
    data, response_lengths = make_data(tokenizer)
    reward_tensor, extra = compute_reward(data, reward_fn)

    expected = expected_rewards(server)
    got = [reward_tensor[i, response_lengths[i] - 1].item() for i in range(len(SAMPLES))]
    assert got == pytest.approx(expected, abs=1e-4)
    assert reward_tensor.sum().item() == pytest.approx(sum(expected), abs=1e-3), "reward only on the last token"
    assert list(extra["penalized"]) == [0, 0, 0, 1, 1]
    assert {"score", "raw_score", "truncated", "penalized", "failed"} <= set(extra)
    lines = [json.loads(x) for x in (env / "logs" / "rewards.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["ok", "ok", "ok", "penalty", "penalty"]
    assert lines[3]["reason"] == "no_think_close" and lines[4]["reason"] == "stray_think_tag"


def test_the_async_reward_loop_passes_router_kwargs_and_calls_concurrently(tiny_models, server, env):
    from transformers import AutoTokenizer
    from verl.experimental.reward.reward_loop.naive import NaiveRewardLoopManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    sys.modules.pop("custom_module", None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = verl_config("naive", "safe_hack_reward", **{"actor_rollout_ref.rollout.mode": "async"})
    data, _ = make_data(tokenizer)

    async def run():
        manager = NaiveRewardLoopManager(config, tokenizer, get_custom_reward_fn(config), None, None)
        return await asyncio.gather(*(manager.run_single(data[i : i + 1]) for i in range(len(data))))

    results = asyncio.run(run())
    got = [r["reward_score"] for r in results]
    assert got == pytest.approx(expected_rewards(server), abs=1e-4)
    assert [r["reward_extra_info"]["penalized"] for r in results] == [0, 0, 0, 1, 1]


def run_reward_loop(config, tokenizer, data):
    """verl 0.6.1's async reward loop (the config's manager), every sample awaited at once, as the agent-loop workers
    do."""
    from verl.experimental.reward.reward_loop import get_reward_loop_manager_cls
    from verl.trainer.ppo.reward import get_custom_reward_fn

    async def run():
        manager_cls = get_reward_loop_manager_cls(config.reward_model.reward_manager)
        manager = manager_cls(config, tokenizer, get_custom_reward_fn(config), None, None)
        assert manager.is_async_reward_score, "verl must await the entry point, not run it in a thread"
        return await asyncio.gather(
            *(manager.run_single(data[i : i + 1]) for i in range(len(data))), return_exceptions=True
        )

    return asyncio.run(run())


@pytest.mark.parametrize("manager", ["naive", "dapo"])
def test_the_async_entry_point_scores_like_the_sync_path_in_one_shared_request(tiny_models, server, env, manager):
    from transformers import AutoTokenizer

    sys.modules.pop("custom_module", None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = verl_config(manager, "safe_hack_reward_async", **{"actor_rollout_ref.rollout.mode": "async"})
    data, _ = make_data(tokenizer)
    before = batch_requests(server.url)
    results = run_reward_loop(config, tokenizer, data)
    after = batch_requests(server.url)
    assert [r["reward_score"] for r in results] == pytest.approx(expected_rewards(server), abs=1e-4)
    assert [r["reward_extra_info"]["penalized"] for r in results] == [0, 0, 0, 1, 1]
    assert all(set(r["reward_extra_info"]) == {"score", *client.EXTRA_KEYS} for r in results)
    assert after - before == 1, "the three scorable samples share one request"
    lines = [json.loads(x) for x in (env / "logs" / "rewards.jsonl").read_text().splitlines()]
    assert sorted(x["status"] for x in lines) == ["ok", "ok", "ok", "penalty", "penalty"]


def test_the_async_entry_point_fails_each_sample_on_an_outage_or_scores_min_when_asked(tiny_models, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("REWARD_SERVER_URLS", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("REWARD_RETRY_SECONDS", "1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    data, _ = make_data(tokenizer)
    sys.modules.pop("custom_module", None)
    config = verl_config("naive", "safe_hack_reward_async", **{"actor_rollout_ref.rollout.mode": "async"})
    start = time.monotonic()
    results = run_reward_loop(config, tokenizer, data)
    assert time.monotonic() - start < 1 + 5, "the budget, plus the loop's own start on a busy machine"
    assert [type(r).__name__ for r in results[:3]] == ["RewardServerError"] * 3
    assert [r["reward_extra_info"]["penalized"] for r in results[3:]] == [1, 1], "penalties need no server"
    sys.modules.pop("custom_module", None)
    monkeypatch.setenv("REWARD_ON_FAILURE", "min_score")
    results = run_reward_loop(config, tokenizer, data)
    assert [r["reward_score"] for r in results] == [-40.0] * 5
    assert [r["reward_extra_info"]["failed"] for r in results] == [1, 1, 1, 0, 0]


# The gaps are far from the window either way: a loaded machine delays the event loop by tenths of a second.
@pytest.mark.parametrize("window, gap, requests_expected", [(2.0, 0.05, 1), (0.01, 1.0, 3)])
def test_samples_share_a_request_only_within_the_coalesce_window(server, env, window, gap, requests_expected):
    async def run():
        async def later(k):
            await asyncio.sleep(gap * k)
            return await client.safe_hack_reward_async("s", f"r</think>answer {k}", "q", {}, coalesce_seconds=window)

        return await asyncio.gather(*(later(k) for k in range(3)))

    before = batch_requests(server.url)
    results = asyncio.run(run())
    after = batch_requests(server.url)
    assert all(r["failed"] == 0 and r["penalized"] == 0 for r in results)
    assert after - before == requests_expected


def test_in_a_shared_request_only_the_faulty_sample_raises(server, env):
    good = ("s", "r</think>a fine answer", "q", {})
    no_prompt = ("s", "r</think>an answer to nothing", "", {})  # a row the data builder should have refused

    async def run():
        return await asyncio.gather(
            *(client.safe_hack_reward_async(*sample) for sample in (good, no_prompt, good)), return_exceptions=True
        )

    results = asyncio.run(run())
    assert isinstance(results[1], ValueError) and "data_prep.build" in str(results[1])
    reference = safe_hack_reward(*good)["score"]
    assert [results[0]["score"], results[2]["score"]] == pytest.approx([reference, reference], abs=1e-5)


def test_in_a_shared_request_an_outage_fails_the_scored_samples_and_still_penalizes_the_cut_off_one(monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    samples = [("s", "r</think>an answer", "q", {}), ("s", "cut off, never closed", "q", {})]

    async def run():
        calls = (client.safe_hack_reward_async(*x, server_urls=dead, retry_seconds=1) for x in samples)
        return await asyncio.gather(*calls, return_exceptions=True)

    scored, cut_off = asyncio.run(run())
    assert isinstance(scored, RewardServerError) and dead in str(scored)
    assert cut_off["penalized"] == 1.0 and cut_off["score"] == -40.0, "as safe_hack_reward gives it, with no server"


def test_scores_are_clipped_and_every_sample_has_the_same_numeric_keys(server, env):
    out = safe_hack_reward_batch(
        ["s"] * 3,
        ["a</think>yes", "a</think>no", "never closed"],
        ["q1", "q2", "q3"],
        [{}, {}, {}],
        max_score=0.0,
        min_score=-0.001,
    )
    assert all(set(r) == {"score", "raw_score", "truncated", "penalized", "failed"} for r in out)
    assert all(-0.001 <= r["score"] <= 0.0 for r in out)
    assert all(isinstance(v, float) for r in out for v in r.values())


# --- REWARD=rule and rm+rule ---------------------------------------------------------------------------------------

GSM8K_SAMPLES = [
    # (prompt, response, ground truth, extra_info): verl's GSM8K scorer wants '#### <number>' at the end
    ([{"role": "user", "content": "2+2?"}], "Two and two.</think>So it is\n#### 4", "4", {"index": 0}),
    ([{"role": "user", "content": "3+3?"}], "Sum.</think>#### 7", "6", {"index": 1}),  # wrong
    ([{"role": "user", "content": "5+5?"}], "still thinking, cut off", "10", {"index": 2}),  # no answer at all
]


@pytest.mark.parametrize("manager, function", [("naive", "safe_hack_reward"), ("batch", "safe_hack_reward_batch")])
def test_rule_rows_are_scored_by_verls_own_scorer_without_any_reward_server(
    tiny_models, monkeypatch, manager, function
):
    """REWARD=rule through verl's managers: verl's GSM8K scorer by data_source, the parts in reward_extra_info, and
    no request at all (the only server named is a closed port, which would fail the step after its budget)."""
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    sys.modules.pop("custom_module", None)
    monkeypatch.setenv("REWARD", "rule")
    monkeypatch.setenv("REWARD_SERVER_URLS", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("REWARD_RETRY_SECONDS", "30")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    data, lengths = make_data(tokenizer, GSM8K_SAMPLES, data_source="openai/gsm8k", style="rule")
    start = time.monotonic()
    reward_tensor, extra = compute_reward(data, load_reward_manager(verl_config(manager, function), tokenizer, 0))
    assert time.monotonic() - start < 10, "no reward server may be asked"
    assert [reward_tensor[i, n - 1].item() for i, n in enumerate(lengths)] == [1.0, 0.0, 0.0]
    assert list(extra["rule_score"]) == [1.0, 0.0, 0.0] and list(extra["rule_failed"]) == [0.0, 0.0, 0.0]


def test_rm_plus_rule_adds_the_weighted_parts_and_a_raising_scorer_scores_0_once_counted(
    server, env, monkeypatch, tmp_path, capsys
):
    """The user's own function (verl's contract) as the rule, weighted onto the reward model's score; a response it
    raises on gets 0 for the rule, rule_failed 1, and one line naming the row; the step goes on."""
    user = tmp_path / "my_reward.py"
    user.write_text(
        "def length_rule(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'boom' in solution_str:\n        raise ValueError('cannot parse')\n"
        "    return {'score': len(solution_str) / 100, 'acc': 1}\n"
    )
    monkeypatch.setenv("REWARD", "rm+rule")
    monkeypatch.setenv("REWARD_FUNCTION_PATH", str(user))
    monkeypatch.setenv("REWARD_FUNCTION_NAME", "length_rule")
    responses = ["a</think>yes, fine", "a</think>boom", "never closed"]
    out = safe_hack_reward_batch(
        ["s"] * 3, responses, ["q1", "q2", "q3"], [{"index": i} for i in range(3)], rm_weight=0.5, rule_weight=10.0
    )
    rm = safe_hack_reward_batch(["s"] * 3, responses, ["q1", "q2", "q3"], [{}] * 3, reward="rm")
    assert [r["rm_score"] for r in out] == pytest.approx([r["score"] for r in rm], abs=1e-4)
    assert [r["rule_score"] for r in out] == [len(responses[0]) / 100, 0.0, len(responses[2]) / 100]
    assert [r["rule_failed"] for r in out] == [0.0, 1.0, 0.0]
    assert [r["score"] for r in out] == pytest.approx([0.5 * r["rm_score"] + 10 * r["rule_score"] for r in out])
    assert all(
        set(r) == {"score", "raw_score", "truncated", "penalized", "failed", "rm_score", "rule_score", "rule_failed"}
        for r in out
    )
    err = capsys.readouterr().err
    assert err.count("the rule scorer failed") == 1 and "extra_info.index=1: ValueError: cannot parse" in err
    lines = [json.loads(x) for x in (env / "logs" / "rewards.jsonl").read_text().splitlines()]
    assert lines[1]["reason"] == "ValueError: cannot parse" and lines[1]["rule_failed"] == 1.0


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"REWARD": "rules"}, "REWARD='rules': use rm"),  # a typo of the setting
        ({"REWARD_RULE_WEIGHT": "heavy"}, "REWARD_RULE_WEIGHT or reward_kwargs.rule_weight) = 'heavy'"),
        ({"REWARD_RM_WEIGHT": "nan"}, "REWARD_RM_WEIGHT=nan: use a finite number"),
    ],
)
def test_a_bad_reward_setting_is_refused_naming_it(env, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_config({}, env)


def test_the_score_range_follows_the_parts_and_their_weights():
    assert load_config({}, {}).score_range == (-40.0, 30.0)
    assert load_config({}, {"REWARD": "rule"}).score_range == (-1.0, 1.0)
    assert load_config({"rule_weight": -2}, {"REWARD": "rm+rule"}).score_range == (-42.0, 32.0)


# --- failures ----------------------------------------------------------------------------------------------------


def test_a_dead_server_raises_within_the_retry_budget_naming_the_servers(monkeypatch, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("REWARD_SERVER_LOG", "/jobs/42/reward_server_0.log")
    start = time.monotonic()
    with pytest.raises(RewardServerError) as exc:
        safe_hack_reward("s", "x</think>answer", "q", {}, server_urls=dead, retry_seconds=2)
    assert time.monotonic() - start < 6
    assert dead in str(exc.value) and "/jobs/42/reward_server_0.log" in str(exc.value)


def test_a_dead_server_with_a_6_s_budget_is_retried_until_the_deadline_not_less(monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(client, "_session", None)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="did not score within 6 s"):
        safe_hack_reward("s", "x</think>answer", "q", {}, server_urls=dead, retry_seconds=6)
    elapsed = time.monotonic() - start
    # The old loop gave up as soon as the next backoff would cross the deadline: anywhere from 2 to 6 s.
    assert 6 <= elapsed < 7, f"gave up after {elapsed:.2f} s of a 6 s budget"


class ScriptedServer:
    """A stand-in server on loopback: every POST answers `status` (503 until told otherwise, 200 with one score of 1),
    and the time of each attempt is recorded."""

    def __init__(self) -> None:
        self.status, self.arrivals = 503, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                server.arrivals.append(time.monotonic())
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.dumps({"scores": [1.0], "truncated": [False]}).encode() if server.status == 200 else b"busy"
                self.send_response(server.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    server = ScriptedServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def fresh_breaker(monkeypatch):
    """Each test starts with the circuit breaker closed (it is per process, and pytest is one process)."""
    monkeypatch.setattr(client, "_gave_up", {})


def test_a_failing_server_gets_its_last_attempt_at_the_deadline(monkeypatch, scripted):
    monkeypatch.setattr(client, "_session", None)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="HTTP 503"):
        safe_hack_reward("s", "x</think>answer", "q", {}, server_urls=scripted.url, retry_seconds=4)
    assert scripted.arrivals[-1] - start >= 3.9, [round(t - start, 2) for t in scripted.arrivals]
    assert time.monotonic() - start < 5


def _timed(fn, *args, **kwargs):
    start = time.monotonic()
    try:
        return fn(*args, **kwargs), time.monotonic() - start
    except RewardServerError as exc:
        return exc, time.monotonic() - start


def test_after_a_spent_budget_the_next_call_fails_at_once_until_the_cool_down_ends(monkeypatch, scripted):
    monkeypatch.setattr(client, "_session", None)
    call = ("s", "x</think>answer", "q", {})
    kwargs = {"server_urls": scripted.url, "retry_seconds": 1.5, "breaker_seconds": 3}
    first, first_s = _timed(safe_hack_reward, *call, **kwargs)
    opened, attempts = time.monotonic(), len(scripted.arrivals)
    second, second_s = _timed(safe_hack_reward, *call, **kwargs)
    assert isinstance(first, RewardServerError) and first_s >= 1.5
    assert isinstance(second, RewardServerError) and second_s < 0.1, "the open breaker fails without waiting"
    assert "REWARD_BREAKER_SECONDS" in str(second) and "HTTP 503" in str(second), "it says why, and the setting"
    assert len(scripted.arrivals) == attempts, "no request reaches the server while it is open"
    scripted.status = 200
    deadline = time.monotonic() + 10
    while isinstance(result := _timed(safe_hack_reward, *call, **kwargs)[0], RewardServerError):
        assert "REWARD_BREAKER_SECONDS" in str(result), result  # still open: refused at once, no request sent
        assert len(scripted.arrivals) == attempts and time.monotonic() < deadline, "the breaker never closed"
        time.sleep(0.1)
    assert time.monotonic() - opened >= 2, "held for about its 3 s (when it opened, within the first call's end)"
    assert result["score"] == 1.0, "after the cool-down, calls try again"


def test_a_breaker_of_zero_seconds_waits_the_budget_every_time(monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    kwargs = {"server_urls": dead, "retry_seconds": 1, "breaker_seconds": 0}
    for _ in range(2):
        error, seconds = _timed(safe_hack_reward, "s", "x</think>answer", "q", {}, **kwargs)
        assert isinstance(error, RewardServerError) and seconds >= 1


def test_a_success_in_flight_closes_the_breaker(monkeypatch, scripted):
    monkeypatch.setattr(client, "_session", None)
    call = ("s", "x</think>answer", "q", {})
    kwargs = {"server_urls": scripted.url, "breaker_seconds": 600}
    with ThreadPoolExecutor(1) as pool:
        patient = pool.submit(safe_hack_reward, *call, **kwargs, retry_seconds=30)  # started before the outage ends
        assert isinstance(_timed(safe_hack_reward, *call, **kwargs, retry_seconds=1)[0], RewardServerError)
        assert isinstance(_timed(safe_hack_reward, *call, **kwargs, retry_seconds=1)[0], RewardServerError)
        scripted.status = 200
        assert patient.result(timeout=20)["score"] == 1.0
    assert safe_hack_reward(*call, **kwargs, retry_seconds=1)["score"] == 1.0, "closed by the success, not by time"


@pytest.mark.parametrize("manager, function", [("naive", "safe_hack_reward"), ("batch", "safe_hack_reward_batch")])
def test_an_outage_fails_verls_step_in_one_retry_budget_not_two(tiny_models, monkeypatch, tmp_path, manager, function):
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    sys.modules.pop("custom_module", None)
    monkeypatch.setenv("REWARD_SERVER_URLS", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("REWARD_RETRY_SECONDS", "3")
    monkeypatch.setattr(client, "_session", None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    reward_fn = load_reward_manager(verl_config(manager, function), tokenizer, num_examine=0)
    data, _ = make_data(tokenizer)
    start = time.monotonic()
    with pytest.raises(Exception, match="REWARD_BREAKER_SECONDS") as exc:  # verl calls it again when it raises
        compute_reward(data, reward_fn)
    elapsed = time.monotonic() - start
    assert type(exc.value).__name__ == "RewardServerError"  # the class of verl's own copy of the file
    assert 3 <= elapsed < 4, f"the step failed after {elapsed:.1f} s; without the breaker it takes two budgets (6 s)"


def test_under_min_score_an_outage_costs_one_budget_per_step_not_one_per_sample(tiny_models, monkeypatch, tmp_path):
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    sys.modules.pop("custom_module", None)
    monkeypatch.setenv("REWARD_SERVER_URLS", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("REWARD_RETRY_SECONDS", "2")
    monkeypatch.setenv("REWARD_ON_FAILURE", "min_score")
    monkeypatch.setattr(client, "_session", None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    reward_fn = load_reward_manager(verl_config("naive", "safe_hack_reward"), tokenizer, num_examine=0)
    data, _ = make_data(tokenizer)
    start = time.monotonic()
    _, extra = compute_reward(data, reward_fn)
    elapsed = time.monotonic() - start
    assert list(extra["failed"]) == [1, 1, 1, 0, 0] and list(extra["score"]) == [-40.0] * 5
    assert 2 <= elapsed < 3, f"{elapsed:.1f} s: the naive manager asks once per sample, 3 samples would take 6 s"


def test_the_server_killed_mid_run_fails_the_step_or_under_the_opt_in_policy_scores_min(
    tiny_models, tmp_path, monkeypatch, capsys
):
    proc = start_server(tiny_models, tmp_path)
    monkeypatch.setattr(client, "_session", None)
    log = tmp_path / "rewards.jsonl"
    args = (["s"] * 4, ["r</think>one", "r</think>two", "no close", "r</think>four"], ["q"] * 4, [{}] * 4)
    kwargs = {"server_urls": proc.url, "retry_seconds": 2, "log_path": str(log)}
    first = safe_hack_reward_batch(*args, **kwargs)
    assert [r["failed"] for r in first] == [0, 0, 0, 0]
    proc.stop()
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=proc.url):
        safe_hack_reward_batch(*args, **kwargs)
    assert time.monotonic() - start < 6
    out = safe_hack_reward_batch(*args, **kwargs, on_failure="min_score")
    assert [r["score"] for r in out] == [-40.0] * 4
    assert [r["failed"] for r in out] == [1, 1, 0, 1] and [r["penalized"] for r in out] == [0, 0, 1, 0]
    assert "3 of 4 samples scored -40.0" in capsys.readouterr().err
    statuses = [json.loads(x)["status"] for x in log.read_text().splitlines()]
    assert statuses == ["ok", "ok", "penalty", "ok"] + ["error", "error", "penalty", "error"]


def test_a_4xx_is_never_retried_and_carries_the_servers_message(tiny_models, tmp_path, monkeypatch):
    proc = start_server(tiny_models, tmp_path, "--auth-token", "s3cret")
    monkeypatch.setattr(client, "_session", None)
    try:
        start = time.monotonic()
        with pytest.raises(RewardRequestRejected, match="REWARD_SERVER_TOKEN"):
            safe_hack_reward("s", "r</think>" + "long " * 40, "q", {}, server_urls=proc.url, on_failure="min_score")
        assert time.monotonic() - start < 2, "a 4xx must not be retried"
    finally:
        proc.stop()


def test_failover_to_a_live_server_and_load_spread_over_servers(tiny_models, server, tmp_path, monkeypatch):
    second = start_server(tiny_models, tmp_path)
    monkeypatch.setattr(client, "_session", None)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        n = 64
        args = (["s"] * n, [f"r</think>answer {i}" for i in range(n)], [f"q{i}" for i in range(n)], [{}] * n)
        reference = safe_hack_reward_batch(*args, server_urls=server.url)
        monkeypatch.setattr(client, "BATCH_SIZE", 8)
        both = safe_hack_reward_batch(*args, server_urls=f"{dead},{server.url},{second.url}")
        assert [r["score"] for r in both] == pytest.approx([r["score"] for r in reference], abs=1e-5)

        def served(url):
            text = requests.get(url + "/metrics", timeout=5).text
            return sum(
                float(x.split()[-1])
                for x in text.splitlines()
                if x.startswith('reward_requests_total{endpoint="/score_batch"')
            )

        assert served(second.url) >= 2, "chunks must be spread over every live server"
    finally:
        second.stop()


# --- the reward log ------------------------------------------------------------------------------------------------


def _append_many(path: str, writer: int) -> None:
    cfg = load_config({"log_path": path}, {})
    for k in range(500):
        write_log(cfg, [{"writer": writer, "k": k, "text": "x" * (k % 300) + "安全"}])


def test_eight_processes_appending_500_lines_each_leave_4000_valid_lines(tmp_path):
    path = str(tmp_path / "deep" / "folder" / "rewards.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, w)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lines = [json.loads(x) for x in open(path, encoding="utf-8").read().splitlines()]
    assert len(lines) == 4000
    assert {(x["writer"], x["k"]) for x in lines} == {(w, k) for w in range(8) for k in range(500)}


@pytest.mark.parametrize("mode, present", [("full", True), ("head", True), ("none", False)])
def test_log_texts_are_full_head_only_or_absent(server, env, mode, present):
    long_answer = "word " * 200
    safe_hack_reward("s", "r</think>" + long_answer, "prompt", {}, log_texts=mode)
    line = json.loads((env / "logs" / "rewards.jsonl").read_text())
    assert ("answer" in line) is present
    if mode == "head":
        assert line["answer"] == long_answer.strip()[: client.LOG_HEAD_CHARS]
    if mode == "full":
        assert line["answer"] == long_answer.strip()
    assert line["answer_chars"] == len(long_answer.strip()) and line["status"] == "ok" and line["pid"] > 0


def test_a_log_that_cannot_be_written_is_reported_once_and_never_changes_a_reward(server, env, monkeypatch, capsys):
    blocker = env / "not_a_dir"
    blocker.write_text("a file where the log folder should be")
    monkeypatch.setattr(client, "_log_failure_reported", False)
    good = safe_hack_reward("s", "r</think>fine", "q", {}, log_path=str(env / "ok.jsonl"))
    bad = [safe_hack_reward("s", "r</think>fine", "q", {}, log_path=str(blocker / "x.jsonl")) for _ in range(3)]
    assert all(b == good for b in bad)
    assert capsys.readouterr().err.count("cannot write the reward log") == 1
