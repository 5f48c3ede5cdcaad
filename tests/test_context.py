"""Prompt + response against the positions the models have (launch/plan/refusals.py context_problems): a policy too
short for MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH is refused by the preflight, on the login node, instead of by verl's
rollout when the engine starts on the GPUs after the queue. The models are config.json files alone: only that is
read."""

import json
from pathlib import Path

import pytest

from launch.plan import preflight
from launch.plan.refusals import check, context_problems, model_positions
from launch.plan.settings import Settings
from tests.support import block_environment

POLICY_REFUSED = "but the policy has"
REWARD_REFUSED = "is above the reward model's"


def model(folder: Path, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return folder


@pytest.fixture
def job_env(tmp_path) -> dict[str, str]:
    """The settings block's defaults (MAX_PROMPT_LENGTH=2048, MAX_RESPONSE_LENGTH=4096) with files that exist, and
    models of 8192 positions (demo/tiny_models.py's figure) that each test replaces."""
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    train.write_text("x")
    test.write_text("y")
    return block_environment() | {
        "CONTAINER": "none",
        "CONFIG_MODEL_PATH": str(model(tmp_path / "policy", max_position_embeddings=8192)),
        "CONFIG_REWARD_MODEL_PATH": str(model(tmp_path / "reward", max_position_embeddings=8192)),
        "CONFIG_TRAIN_FILE": str(train),
        "CONFIG_TEST_FILE": str(test),
    }


def settings(env: dict[str, str], **overrides) -> Settings:
    return Settings.from_env(env | {k: str(v) for k, v in overrides.items()})


@pytest.mark.parametrize(
    "config, positions",
    [
        ({"max_position_embeddings": 4096}, 4096),  # the model
        ({"max_position_embeddings": 8192}, 8192),  # demo/tiny_models.py's
        ({"text_config": {"max_position_embeddings": 4096}}, 4096),  # a multimodal config: verl reads text_config
        ({"llm_config": {"max_position_embeddings": 4096}}, 4096),  # and llm_config
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 8192),  # verl's rule
        ({"max_position_embeddings": 4096, "rope_scaling": None}, 4096),  # null rope_scaling: no factor
        ({"hidden_size": 64}, None),  # no figure: the engine's to read, not refused here
    ],
)
def test_the_positions_are_read_from_config_json_as_verls_rollout_reads_them(tmp_path, config, positions):
    assert model_positions(str(model(tmp_path / "m", **config))) == positions


def test_a_missing_or_unreadable_config_json_gives_no_figure(tmp_path):
    assert model_positions(str(tmp_path / "nowhere")) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert model_positions(str(tmp_path / "bad")) is None


@pytest.mark.parametrize(
    "policy_positions, overrides, refused",
    [
        (4096, {}, True),  # the defaults' 2048 + 4096 = 6144 on a 4096-position model: the issue's case
        (8192, {}, False),  # the same settings on 8192 positions
        (6144, {}, False),  # exactly the sum fits
        (4096, {"MAX_PROMPT_LENGTH": 1024, "MAX_RESPONSE_LENGTH": 3072}, False),  # the fix the message gives
    ],
)
def test_prompt_plus_response_beyond_the_policys_positions_is_refused(
    job_env, tmp_path, policy_positions, overrides, refused
):
    policy = model(tmp_path / "policy", max_position_embeddings=policy_positions)
    s = settings(job_env, CONFIG_MODEL_PATH=policy, **overrides)
    problems = check(s) + context_problems(s, {})
    assert any(POLICY_REFUSED in p for p in problems) == refused, problems
    if not refused:
        assert problems == []


def test_the_policy_refusal_names_both_settings_their_sum_the_models_figure_and_path_and_the_fix(job_env, tmp_path):
    policy = model(tmp_path / "policy", max_position_embeddings=4096)
    (problem,) = context_problems(settings(job_env, CONFIG_MODEL_PATH=policy), {})
    assert problem.startswith(
        "MAX_PROMPT_LENGTH=2048 + MAX_RESPONSE_LENGTH=4096 = 6144 tokens, but the policy has 4096"
    )
    assert f"CONFIG_MODEL_PATH={policy}/config.json" in problem
    assert "until their sum is at most 4096" in problem


def test_the_preflight_refuses_a_too_short_policy_before_composing_verls_config(job_env, tmp_path, monkeypatch, capsys):
    policy = model(tmp_path / "policy", max_position_embeddings=4096)
    for name, value in (job_env | {"CONFIG_MODEL_PATH": str(policy)}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(preflight, "compose", lambda *a, **k: pytest.fail("composed verl's config after a refusal"))
    assert preflight.main([]) == 1
    err = capsys.readouterr().err
    assert "setting error: MAX_PROMPT_LENGTH=2048 + MAX_RESPONSE_LENGTH=4096 = 6144 tokens" in err
    assert "preflight: fix the settings above" in err


@pytest.mark.parametrize(
    "reward_positions, environ, refused",
    [
        (2048, {}, True),  # REWARD_MAX_LENGTH's default 4096 past 2048 positions, with 6144-token pairs
        (2048, {"REWARD_MAX_LENGTH": "2048"}, False),  # the server keeps the last 2048 tokens: deliberate, no refusal
        (4096, {}, False),  # the server keeps 4096 of the 6144: its documented truncation, within the model
        (8192, {"REWARD_MAX_LENGTH": "16384"}, False),  # pairs of 6144 tokens never reach past 8192
        (2048, {"REWARD_MAX_LENGTH": "many"}, False),  # malformed: the reward server names it itself
    ],
)
def test_a_reward_max_length_past_the_reward_models_positions_is_refused_when_pairs_reach_there(
    job_env, tmp_path, reward_positions, environ, refused
):
    reward = model(tmp_path / "reward", max_position_embeddings=reward_positions)
    problems = context_problems(settings(job_env, CONFIG_REWARD_MODEL_PATH=reward), environ)
    assert any(REWARD_REFUSED in p for p in problems) == refused, problems
    if refused:
        (problem,) = problems
        assert f"CONFIG_REWARD_MODEL_PATH={reward}/config.json" in problem
        assert "set REWARD_MAX_LENGTH=2048" in problem and "= 6144 tokens" in problem


def test_models_without_a_config_json_are_left_to_the_model_check(job_env, tmp_path):
    s = settings(job_env, CONFIG_MODEL_PATH=tmp_path / "none", CONFIG_REWARD_MODEL_PATH=tmp_path / "none2")
    assert context_problems(s, {}) == []
    assert any("no config.json there" in p for p in check(s))
