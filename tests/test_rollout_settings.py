"""What verl 0.6.1 does with the rollout's settings, on its own code: validation sampled as the Qwen3 cards say (not
verl's greedy default), and micro-batches by token count on the Megatron path as on FSDP2, so that a longer
MAX_RESPONSE_LENGTH does not grow a micro-batch."""

import asyncio
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.plan.config_refusals import batch_problems
from launch.plan.preflight import validate, validation_sampling
from launch.plan.refusals import check
from tests.support import REPO
from tests.test_algorithms import composed, env, recipes, settings  # noqa: F401  (env: the tiny-model settings; recipes: verl's recipe package)

# --- validation sampling -----------------------------------------------------------------------------------------


def test_validation_samples_with_the_qwen3_cards_values_not_verls_greedy_default(env):  # noqa: F811
    for mode in ("async", "sync"):
        cfg = composed(settings(env, ROLLOUT_MODE=mode))
        validate(cfg)
        v = cfg.actor_rollout_ref.rollout.val_kwargs
        assert (v.do_sample, v.temperature, v.top_p, v.top_k, v.n) == (True, 0.6, 0.95, 20, 1)
    assert validation_sampling(composed(settings(env, ROLLOUT_MODE="sync"))) == (
        "samples at temperature 0.6, top_p 0.95, top_k 20"
    )
    assert "agent loop passes validation only temperature and top_p" in validation_sampling(composed(settings(env)))


def agent_loop_worker(cfg):
    """verl 0.6.1's AgentLoopWorker without its servers: generate_sequences as it is, up to each sample's loop,
    which records the sampling parameters it is handed."""
    if "cachetools" not in sys.modules and importlib.util.find_spec("cachetools") is None:
        # The LLM server manager's sticky-session cache; this environment lacks the package and nothing here uses it.
        sys.modules.setdefault("cachetools", types.SimpleNamespace(LRUCache=dict))
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorkerBase

    worker, seen = object.__new__(AgentLoopWorkerBase), []
    worker.config = cfg

    async def run_agent_loop(sampling_params, trajectory, **kwargs):
        seen.append(dict(sampling_params))

    worker._run_agent_loop, worker._postprocess = run_agent_loop, lambda outputs: outputs
    return worker, seen


@pytest.mark.parametrize("validate_batch", [True, False])
def test_verls_agent_loop_samples_validation_at_the_cards_temperature_and_top_p(env, validate_batch):  # noqa: F811
    """Async rollout (the default): the agent loop overrides temperature and top_p for validation
    (agent_loop.py:341-343); top_k and do_sample never reach the engine there, which the preflight says."""
    from verl import DataProto

    worker, seen = agent_loop_worker(composed(settings(env)))
    batch = DataProto.from_dict(
        tensors={"index_tensor": torch.arange(2)},
        non_tensors={"raw_prompt": np.array([[{"role": "user", "content": "hi"}]] * 2, dtype=object)},
        meta_info={"validate": validate_batch, "global_steps": 1},
    )
    asyncio.run(worker.generate_sequences(batch))
    assert len(seen) == 2
    expected = (0.6, 0.95) if validate_batch else (1.0, 1.0)  # training rollouts keep rollout.temperature/top_p
    assert {(p["temperature"], p["top_p"]) for p in seen} == {expected}
    assert all("top_k" not in p for p in seen)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            {"VAL_DO_SAMPLE": "false"},
            "VAL_DO_SAMPLE=false with ROLLOUT_MODE=async: verl 0.6.1's agent loop never reads",
        ),
        ({"VAL_TEMPERATURE": "0"}, "VAL_DO_SAMPLE=true with VAL_TEMPERATURE=0 decodes greedily all the same"),
        ({"VAL_TOP_K": "0"}, "VAL_TOP_K=0: -1 (off) or 1 or more"),
        ({"VAL_TOP_P": "1.5"}, "VAL_TOP_P=1.5: a share of the probability mass in (0, 1]"),
    ],
)
def test_validation_settings_verl_would_not_follow_are_refused_naming_the_fix(env, overrides, needle):  # noqa: F811
    assert any(needle in p for p in check(settings(env, **overrides))), check(settings(env, **overrides))


def test_greedy_validation_is_still_possible_where_verl_follows_it(env):  # noqa: F811
    assert check(settings(env, VAL_DO_SAMPLE="false", VAL_TEMPERATURE="0")) == []
    sync = settings(env, VAL_DO_SAMPLE="false", ROLLOUT_MODE="sync")
    assert check(sync) == [] and validation_sampling(composed(sync)) == "greedy (VAL_DO_SAMPLE=false)"
    assert batch_problems(composed(sync)) == []


# --- micro-batches by token count on the Megatron path ---------------------------------------------------------------

# What verl 0.6.1's Megatron workers read of each budget, as it is written in their source: the actor's update
# (megatron_actor.py:682-690), the rollout's and the ref's log-probs (megatron_workers.py:727-728, 749-750, then
# megatron_actor.py:186-191), the critic's values and update (megatron_workers.py:1075-1076,
# megatron_critic.py:306-314).
MEGATRON_READS = {
    "workers/actor/megatron_actor.py": [
        "self.config.use_dynamic_bsz",
        "self.config.ppo_max_token_len_per_gpu",
        'data.meta_info.get("use_dynamic_bsz", False)',
        'data.meta_info.get("max_token_len", None)',
    ],
    "workers/megatron_workers.py": [
        "self.config.rollout.log_prob_use_dynamic_bsz",
        "self.config.rollout.log_prob_max_token_len_per_gpu",
        "self.config.ref.log_prob_use_dynamic_bsz",
        "self.config.ref.log_prob_max_token_len_per_gpu",
        "self.config.forward_max_token_len_per_gpu",
    ],
    "workers/critic/megatron_critic.py": ["self.config.use_dynamic_bsz", "self.config.ppo_max_token_len_per_gpu"],
}


def test_the_megatron_path_batches_by_tokens_with_the_keys_verls_megatron_workers_read(env):  # noqa: F811
    import verl
    from verl.utils.config import omega_conf_to_dataclass

    root = importlib.util.find_spec("verl").submodule_search_locations[0]
    for path, reads in MEGATRON_READS.items():
        source = open(f"{root}/{path}").read()
        assert [r for r in reads if r not in source] == [], f"verl {verl.__version__} {path} no longer reads them"
    cfg = composed(settings(env, ALGORITHM="ppo", MICRO_BATCH_PER_GPU=4))  # the article's micro-batch, auto's aside
    validate(cfg)
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == "megatron" and cfg.critic.strategy == "megatron"
    assert arr.actor.use_dynamic_bsz and arr.rollout.log_prob_use_dynamic_bsz and arr.ref.log_prob_use_dynamic_bsz
    assert cfg.critic.use_dynamic_bsz
    budgets = {
        arr.actor.ppo_max_token_len_per_gpu,
        arr.rollout.log_prob_max_token_len_per_gpu,
        arr.ref.log_prob_max_token_len_per_gpu,
        cfg.critic.ppo_max_token_len_per_gpu,
        cfg.critic.forward_max_token_len_per_gpu,
    }
    assert budgets == {4 * (2048 + 4096)}
    actor = omega_conf_to_dataclass(arr.actor)  # verl's typed Megatron actor config takes them as they are
    assert type(actor).__name__ == "McoreActorConfig" and actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu


@pytest.mark.parametrize(
    "response, budget",
    [
        (4096, 4 * 6144),  # the article's: its fixed micro-batches of 4 full sequences, as a budget
        (8192, 2 * 10240),  # two whole sequences fit 24576 tokens
        (16384, 18432),  # one
        (32768, 34816),  # one sequence is more than 24576: the budget holds it (verl asserts one fits)
    ],
)
def test_a_longer_response_packs_fewer_sequences_into_a_micro_batch_not_more_tokens(env, response, budget):  # noqa: F811
    cfg = composed(settings(env, MAX_RESPONSE_LENGTH=response, MICRO_BATCH_PER_GPU=4))
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == budget
    assert batch_problems(cfg) == [], "each budget holds a whole sequence"


# --- vLLM's batched tokens ---------------------------------------------------------------------------------------

# The check verl 0.6.1's sync vLLM rollout makes before it builds its engine (vllm_rollout_spmd.py:195-201).
VLLM_SPMD_CHECK = "if max_num_batched_tokens < max_model_len and self.config.enable_chunked_prefill:"


def vllm_spmd_accepts(rollout) -> bool:
    """What vllm_rollout_spmd.py:160, 195-197 computes from the rollout's typed config, without vLLM."""
    max_model_len = int(rollout.max_model_len or rollout.prompt_length + rollout.response_length)
    return not (rollout.max_num_batched_tokens < max_model_len and rollout.enable_chunked_prefill)


@pytest.mark.parametrize(
    "overrides, batched_tokens",
    [
        # sync vLLM past verl's 8192: one whole sequence (2048 + 16384), else its check raises after the model load
        ({"ROLLOUT_ENGINE": "vllm", "ROLLOUT_MODE": "sync", "MAX_RESPONSE_LENGTH": 16384}, 18432),
        # the same on FSDP2
        ({"ROLLOUT_ENGINE": "vllm", "ROLLOUT_MODE": "sync", "STRATEGY": "fsdp2", "MAX_RESPONSE_LENGTH": 8192}, 10240),
        # one_step_off's rollout is sync vLLM too (through the recipe's config)
        (
            {
                "TRAINER_MODE": "one_step_off",
                "ROLLOUT_MODE": "sync",
                "ROLLOUT_GPUS_PER_NODE": "2",
                "ROLLOUT_ENGINE": "vllm",
                "MAX_RESPONSE_LENGTH": 8192,
            },
            10240,
        ),
        # the article's 2048 + 4096 fit verl's 8192, which stays (more tokens a prefill step)
        ({"ROLLOUT_ENGINE": "vllm", "ROLLOUT_MODE": "sync"}, 8192),
        # exactly 8192: verl's default holds it
        ({"ROLLOUT_ENGINE": "vllm", "ROLLOUT_MODE": "sync", "MAX_RESPONSE_LENGTH": 6144}, 8192),
        # async vLLM: verl's server passes the value to vLLM with no such check; left at verl's default
        ({"ROLLOUT_ENGINE": "vllm", "MAX_RESPONSE_LENGTH": 16384}, 8192),
        # SGLang never reads the key
        ({"ROLLOUT_MODE": "sync", "MAX_RESPONSE_LENGTH": 16384}, 8192),
    ],
)
def test_sync_vllm_batches_a_whole_sequence_so_verls_chunked_prefill_check_passes(
    env,  # noqa: F811
    recipes,  # noqa: F811
    overrides,
    batched_tokens,
):
    from verl.utils.config import omega_conf_to_dataclass

    root = importlib.util.find_spec("verl").submodule_search_locations[0]
    source = open(f"{root}/workers/rollout/vllm_rollout/vllm_rollout_spmd.py").read()
    assert VLLM_SPMD_CHECK in source, "verl's sync vLLM rollout no longer makes this check: reread it"
    s = settings(env, **overrides)
    assert check(s) == []
    cfg = composed(s)
    validate(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # as verl's workers build it
    assert rollout.max_num_batched_tokens == batched_tokens
    if s.rollout_engine == "vllm" and s.rollout_mode == "sync":
        assert vllm_spmd_accepts(rollout), (
            f"{rollout.max_num_batched_tokens} tokens, sequence {s.max_prompt_length + s.max_response_length}"
        )


# --- what async vLLM decodes past the response length (docs/training.md) ---------------------------------------------

# (file under verl/, line, what it holds, how docs/training.md cites it)
ASYNC_DECODE_LIMITS = [
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        155,
        "self.config.max_model_len = self.config.prompt_length + self.config.response_length",
        "vllm_rollout/vllm_async_server.py:155",
    ),
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        382,
        "max_tokens = self.config.max_model_len - len(prompt_ids)",
        "`max_tokens = max_model_len - len(prompt_ids)` (`:382`)",
    ),
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        385,
        "sampling_params = SamplingParams(max_tokens=max_tokens, **sampling_params)",
        "vllm_async_server.py:385",
    ),
    (
        "workers/rollout/sglang_rollout/async_sglang_server.py",
        233,
        "max_new_tokens = min(self.config.response_length, self.config.max_model_len - len(prompt_ids) - 1)",
        "sglang_rollout/async_sglang_server.py:233",
    ),
    (
        "experimental/agent_loop/single_turn_agent_loop.py",
        73,
        "response_ids=output.token_ids[: self.response_length],",
        "agent_loop/single_turn_agent_loop.py:73-75",
    ),
    (
        "workers/rollout/vllm_rollout/vllm_rollout_spmd.py",
        258,
        "max_tokens=config.response_length,",
        "vllm_rollout_spmd.py:258",
    ),
    (
        "workers/rollout/sglang_rollout/sglang_rollout.py",
        499,
        "max_new_tokens=self.config.response_length,",
        "sglang_rollout.py:499",
    ),
]


def test_async_vllm_asks_for_the_prompts_unused_room_too_and_sglang_only_for_the_response_length_as_the_docs_say():
    """docs/training.md's account of async vLLM's extra decode, line by line against the installed verl: vLLM's async
    server asks for max_model_len - len(prompt) new tokens, the agent loop keeps the response length, SGLang's async
    server and both sync rollouts ask for the response length; and the agent loop's sampling parameters (the only
    thing a setting reaches) hold no token limit, so no verl setting narrows it."""
    import verl

    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    docs = (REPO / "docs" / "training.md").read_text()
    for path, line, text, cited in ASYNC_DECODE_LIMITS:
        assert (root / path).read_text().splitlines()[line - 1].strip() == text, (
            f"verl {verl.__version__} {path}:{line}"
        )
        assert cited in docs, f"docs/training.md no longer cites {path}:{line} as {cited!r}"
    loop = (root / "experimental/agent_loop/agent_loop.py").read_text().splitlines()
    params = "\n".join(loop[332:343])  # agent_loop.py:333-343, the rollout's sampling parameters
    assert params.lstrip().startswith("sampling_params = dict(") and "max_tokens" not in params
    assert "agent_loop/agent_loop.py:333-343" in docs
