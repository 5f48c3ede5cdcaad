"""PPO, GRPO and DAPO from one script: every combination the script accepts is composed with verl 0.6.1's own Hydra
config and passes its own checks; every combination it refuses says why."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import launch.settings as settings_module
from launch.preflight import compose, split_command, validate
from launch.settings import SettingError, Settings, check, trainer_argv
from tests.support import REPO


@pytest.fixture
def env(tiny_models, tmp_path):
    """The settings block's defaults (as run_grpo_qwen3_4b_mega_verl.sh exports them), on tiny models."""
    out = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^# ---- settings/,/^# ------------/p" {REPO / "run_grpo_qwen3_4b_mega_verl.sh"}); env -0'],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    defaults = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    train.write_text("x")
    test.write_text("y")
    return defaults | {
        "CONTAINER": "none",
        "CONFIG_MODEL_PATH": str(tiny_models.policy),
        "CONFIG_REWARD_MODEL_PATH": str(tiny_models.reward_model),
        "CONFIG_TRAIN_FILE": str(train),
        "CONFIG_TEST_FILE": str(test),
    }


def settings(env, **overrides) -> Settings:
    return Settings.from_env(env | {k: str(v) for k, v in overrides.items()})


ACCEPTED = [
    # (algorithm, rollout mode, strategy): the core main_ppo entry point, no recipe needed
    (algorithm, mode, strategy)
    for algorithm in ("grpo", "ppo", "dapo")
    for mode in ("sync", "async")
    for strategy in ("megatron", "fsdp2")
]


@pytest.mark.parametrize("algorithm, mode, strategy", ACCEPTED)
def test_every_accepted_combination_composes_and_passes_verls_checks(env, algorithm, mode, strategy):
    s = settings(env, ALGORITHM=algorithm, ROLLOUT_MODE=mode, STRATEGY=strategy)
    assert check(s) == []
    module, path, name, overrides = split_command(trainer_argv(s))
    cfg = compose(name, overrides, path)
    validate(cfg)
    assert module == "verl.trainer.main_ppo"
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    assert cfg.actor_rollout_ref.rollout.mode == mode and cfg.actor_rollout_ref.rollout.name == "sglang"
    expected_manager = "dapo" if algorithm == "dapo" else ("batch" if mode == "sync" else "naive")
    assert cfg.reward_model.reward_manager == expected_manager
    assert cfg.custom_reward_function.name == (
        "safe_hack_reward_batch" if expected_manager == "batch" else "safe_hack_reward"
    )
    if algorithm == "ppo":
        assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.model.path == str(env["CONFIG_MODEL_PATH"])
        assert cfg.critic.optim.lr == 1e-5 and cfg.critic.ppo_micro_batch_size_per_gpu == 4
    else:
        assert cfg.algorithm.adv_estimator == "grpo"
    if algorithm == "dapo":
        actor = cfg.actor_rollout_ref.actor
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
        assert actor.use_kl_loss is False
        assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.enable is True
        assert cfg.reward_model.reward_kwargs.max_resp_len == cfg.data.max_response_length


# verl 0.6.1's recipe configs, verbatim (tests/fixtures/verl_v0.6.1_recipes/README.md), with their git blob ids at the tag.
RECIPES = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
RECIPE_BLOBS = {
    "recipe/dapo/config/dapo_trainer.yaml": "47ac00fd6a055d6c22e3facfa855844302345701",
    "recipe/dapo/config/dapo_megatron_trainer.yaml": "b846eaeb78ebaa29e5f4c250c2b9f25a906d90c8",
    "recipe/one_step_off_policy/config/one_step_off_ppo_trainer.yaml": "366d7b0fd72628f73ff5f901fe0b06fbff97f654",
    "recipe/one_step_off_policy/config/one_step_off_ppo_megatron_trainer.yaml": "b6ea846e200351ab20483e817fec96debccf3228",
}  # fmt: skip

RECIPE_COMBINATIONS = [
    {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync"},
    {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync", "STRATEGY": "fsdp2"},
    {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "2"},
    {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "2",
     "ALGORITHM": "ppo"},
    {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "2",
     "ALGORITHM": "dapo"},
]  # fmt: skip


@pytest.fixture
def recipes(monkeypatch):
    """verl's recipe package importable, as in the image (there, from verl's repository at the tag)."""
    monkeypatch.syspath_prepend(str(RECIPES))
    yield RECIPES
    for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
        del sys.modules[name]


def test_the_recipe_configs_here_are_verls_own_at_the_tag():
    for path, blob in RECIPE_BLOBS.items():
        data = (RECIPES / path).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{path} differs from verl v0.6.1"


@pytest.mark.parametrize("overrides", RECIPE_COMBINATIONS)
def test_recipe_combinations_compose_with_verls_recipe_configs_and_pass_its_checks(env, recipes, overrides):
    s = settings(env, **overrides)
    assert check(s) == []
    module, path, name, args = split_command(trainer_argv(s))
    assert Path(path).is_absolute() and Path(path).is_relative_to(recipes), "the recipe's own config folder"
    cfg = compose(name, args, path)
    validate(cfg)
    assert module.startswith(s.uses_recipe)
    assert cfg.actor_rollout_ref.actor.strategy == s.strategy and cfg.actor_rollout_ref.rollout.mode == "sync"
    if s.uses_recipe == "recipe.dapo":
        assert module == "recipe.dapo.main_dapo"
        assert name == ("dapo_megatron_trainer" if s.strategy == "megatron" else "dapo_trainer")
        assert cfg.algorithm.filter_groups.enable is True and cfg.algorithm.filter_groups.metric == "score"
        assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.overlong_buffer.enable is True
        assert cfg.data.gen_batch_size >= cfg.data.train_batch_size
    else:
        assert (module, name) == ("recipe.one_step_off_policy.main_ppo", "one_step_off_ppo_trainer")
        assert cfg.actor_rollout_ref.hybrid_engine is False
        assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 2)
        assert cfg.trainer.n_gpus_per_node == s.gpus_per_node - 2
    if s.algorithm == "ppo":
        assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.strategy == s.strategy


def test_a_misspelled_override_on_a_recipe_command_stops_in_verls_config_code(env, recipes):
    s = settings(env, ALGORITHM="dapo", DAPO_DYNAMIC_SAMPLING="true", ROLLOUT_MODE="sync")
    module, path, name, args = split_command(trainer_argv(s, extra=["algorithm.filter_group.enable=False"]))
    with pytest.raises(Exception, match="filter_group"):
        compose(name, args, path)


@pytest.mark.parametrize("overrides", RECIPE_COMBINATIONS[::2])
def test_recipe_combinations_are_refused_where_verl_has_no_recipes(env, overrides, monkeypatch):
    monkeypatch.setattr(settings_module, "find_recipe", lambda name: None)  # verl from PyPI: no recipe/ folder
    s = settings(env, **overrides)
    with pytest.raises(SettingError, match=f"{s.uses_recipe} is not installed here .* verl_app.def"):
        trainer_argv(s)


def test_one_step_off_splits_the_gpus_between_training_and_rollout(env, recipes):
    s = settings(env, TRAINER_MODE="one_step_off", STRATEGY="fsdp2", ROLLOUT_MODE="sync", ROLLOUT_GPUS_PER_NODE=1)
    assert s.training_gpus_per_node == 3
    assert any("is not a multiple of data-parallel size 3" in p for p in check(s)), "the batch must split over 3 GPUs"
    argv = trainer_argv(s)
    assert "actor_rollout_ref.hybrid_engine=False" in argv and "rollout.n_gpus_per_node=1" in argv
    assert "trainer.n_gpus_per_node=3" in argv


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"REWARD_MANAGER": "batch", "ROLLOUT_MODE": "async"}, "async reward loop registers only naive and dapo"),
        ({"ALGORITHM": "dapo", "REWARD_MANAGER": "naive"}, "ALGORITHM=dapo needs the dapo reward manager"),
        ({"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "async"}, "DAPO_DYNAMIC_SAMPLING=true needs ROLLOUT_MODE=sync"),
        ({"TRAINER_MODE": "one_step_off", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "1"}, "Megatron workers accept only vLLM"),
        ({"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_GPUS_PER_NODE": "1"}, "one_step_off needs ROLLOUT_MODE=sync"),
        ({"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync"}, "set ROLLOUT_GPUS_PER_NODE between 1 and 3"),
        ({"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "1", "ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true"}, "two different recipes"),
        ({"FP8": "true"}, "FP8 training arrived in verl 0.7.0"),
        ({"ALGORITHM": "reinforce"}, "ALGORITHM='reinforce': use one of grpo, ppo, dapo"),
        ({"STRATEGY": "fsdp"}, "STRATEGY='fsdp': use one of megatron, fsdp2"),
    ],
)  # fmt: skip
def test_refused_combinations_say_why(env, overrides, needle):
    assert any(needle in p for p in check(settings(env, **overrides))), check(settings(env, **overrides))


def test_the_settings_block_defaults_are_the_articles_grpo(env):
    s = settings(env)
    assert (s.algorithm, s.strategy, s.trainer_mode, s.rollout_mode) == ("grpo", "megatron", "sync", "async")
    assert (s.train_batch_size, s.max_prompt_length, s.max_response_length, s.rollout_n) == (256, 2048, 4096, 4)
    assert (s.actor_pp, s.actor_tp, s.ppo_mini_batch_size, s.micro_batch_per_gpu, s.save_freq, s.test_freq) == (
        2,
        1,
        128,
        4,
        25,
        5,
    )


def test_the_main_job_without_gpus_runs_every_check_and_the_reward_round_trip(tmp_path):
    """`make demo`: the README's first command, end to end on tiny models."""
    run = subprocess.run([sys.executable, "-m", "demo.run", "--out", str(tmp_path / "demo")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "passes verl's checks" in out and "reward servers healthy" in out and "ray cluster ready: 1/1 nodes" in out
    assert "[ok] verl's naive reward manager scored 8 validation rows" in out
    assert "(penalty: cut off mid-reasoning)" in out
    assert "needs GPUs, not run here" in out and "sbatch run_grpo_qwen3_4b_mega_verl.sh" in out
    assert "make demo: every check passed" in out
