"""PPO, GRPO and DAPO from one script: every combination the script accepts is composed with verl 0.6.1's own Hydra
config and passes its own checks; every combination it refuses says why."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import launch.plan.trainer_command as trainer_command_module
from cpu import verl_shims
from launch.plan.config_refusals import (
    batch_problems,
    parallel_problems,
    ray_cpu_problems,
    ray_cpus_needed,
    rollout_problems,
)
from launch.plan.preflight import compose, split_command, validate
from launch.plan.refusals import check
from launch.plan.settings import SettingError, Settings
from launch.plan.trainer_command import trainer_argv
from launch.plan.trainer_imports import import_problems, trainer_modules
from tests.support import REPO


@pytest.fixture
def env(tiny_models, tmp_path):
    """The settings block's defaults (as run_grpo_qwen3_4b_mega_verl.sh exports them), on tiny models."""
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'source <(sed -n "/^# ---- settings/,/^# ------------/p" {REPO / "run_grpo_qwen3_4b_mega_verl.sh"}); env '
            f"-0",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
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
    # (algorithm, rollout mode, strategy, engine): the core main_ppo entry point, no recipe needed; verl 0.6.1
    # registers both engines in both modes (verl/workers/rollout/base.py, _ROLLOUT_REGISTRY)
    (algorithm, mode, strategy, engine)
    for algorithm in ("grpo", "ppo", "dapo")
    for mode in ("sync", "async")
    for strategy in ("megatron", "fsdp2")
    for engine in ("sglang", "vllm")
]


@pytest.mark.parametrize("algorithm, mode, strategy, engine", ACCEPTED)
def test_every_accepted_combination_composes_and_passes_verls_checks(env, algorithm, mode, strategy, engine):
    s = settings(env, ALGORITHM=algorithm, ROLLOUT_MODE=mode, STRATEGY=strategy, ROLLOUT_ENGINE=engine)
    assert check(s) == []
    module, path, name, overrides = split_command(trainer_argv(s))
    cfg = compose(name, overrides, path)
    validate(cfg)
    assert batch_problems(cfg) == [] and parallel_problems(cfg) == []
    assert module == "verl.trainer.main_ppo"
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    assert cfg.actor_rollout_ref.rollout.mode == mode and cfg.actor_rollout_ref.rollout.name == engine
    expected_manager = "dapo" if algorithm == "dapo" else ("batch" if mode == "sync" else "naive")
    assert cfg.reward_model.reward_manager == expected_manager
    # async rollout: the coroutine verl's reward loop awaits; sync: the batch function, or the plain one for dapo
    expected_function = {"batch": "safe_hack_reward_batch"}.get(
        expected_manager, "safe_hack_reward_async" if mode == "async" else "safe_hack_reward"
    )
    assert cfg.custom_reward_function.name == expected_function
    if algorithm == "ppo":
        assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.model.path == str(env["CONFIG_MODEL_PATH"])
        # the critic's micro-batch is the actor's, as MICRO_BATCH_PER_GPU resolves (auto: the Megatron plan's)
        actor_micro = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        assert cfg.critic.optim.lr == 1e-5 and cfg.critic.ppo_micro_batch_size_per_gpu == actor_micro
        assert actor_micro == (1 if strategy == "megatron" else 4), "auto: the plan's 1 x 6144 on Megatron"
    else:
        assert cfg.algorithm.adv_estimator == "grpo"
    if algorithm == "dapo":
        actor = cfg.actor_rollout_ref.actor
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
        assert actor.use_kl_loss is False
        assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.enable is True
        assert cfg.reward_model.reward_kwargs.max_resp_len == cfg.data.max_response_length


# verl 0.6.1's recipe configs and code, verbatim (tests/fixtures/verl_v0.6.1_recipes/README.md), with their git blob ids
# at the tag.
RECIPES = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
RECIPE_BLOBS = {
    "recipe/dapo/config/dapo_trainer.yaml": "47ac00fd6a055d6c22e3facfa855844302345701",
    "recipe/dapo/config/dapo_megatron_trainer.yaml": "b846eaeb78ebaa29e5f4c250c2b9f25a906d90c8",
    "recipe/one_step_off_policy/config/one_step_off_ppo_trainer.yaml": "366d7b0fd72628f73ff5f901fe0b06fbff97f654",
    "recipe/one_step_off_policy/config/one_step_off_ppo_megatron_trainer.yaml": (
        "b6ea846e200351ab20483e817fec96debccf3228"
    ),
    "recipe/one_step_off_policy/main_ppo.py": "ec87e924ce353b539755195f816d9784d4ef9c8d",
    "recipe/one_step_off_policy/ray_trainer.py": "f5c1c4612f1ae23b0898958803a369378a05021d",
    "recipe/one_step_off_policy/fsdp_workers.py": "ec28279652aeddb02c5ac559d7d6452b992604ff",
    "recipe/one_step_off_policy/megatron_workers.py": "8d72edf2138596f252d9fb8370c7d8bad7782ef4",
    "recipe/one_step_off_policy/distributed_util.py": "75403ae1423bf42ce10d47daf39edb1928a2b455",
    "recipe/one_step_off_policy/utils.py": "1879b0672fa68eda19a1b8e6553f4354b17816fe",
    "recipe/dapo/main_dapo.py": "3fdfeb36fb206f3ba46dd04c8a8e896930d2cfdd",
    "recipe/dapo/dapo_ray_trainer.py": "18995f677871f78e57f35aba8c645d2f165c8e2f",
}

RECIPE_COMBINATIONS = [
    # recipe.dapo (dynamic sampling): sync rollout, either strategy, either engine
    {
        "ALGORITHM": "dapo",
        "DAPO_DYNAMIC_SAMPLING": "true",
        "ROLLOUT_MODE": "sync",
        "STRATEGY": strategy,
        "ROLLOUT_ENGINE": engine,
    }
    for strategy in ("megatron", "fsdp2")
    for engine in ("sglang", "vllm")
] + [
    # recipe.one_step_off_policy: sync rollout on vLLM (its weight sync imports vllm), either strategy (the Megatron
    # rollout worker asserts vllm and sync), every algorithm
    {
        "TRAINER_MODE": "one_step_off",
        "STRATEGY": strategy,
        "ROLLOUT_MODE": "sync",
        "ROLLOUT_GPUS_PER_NODE": "2",
        "ROLLOUT_ENGINE": "vllm",
        "ALGORITHM": algorithm,
    }
    for strategy in ("megatron", "fsdp2")
    for algorithm in ("grpo", "ppo", "dapo")
]


@pytest.fixture
def recipes(monkeypatch):
    """verl's recipe package importable, as in the image (there, from verl's repository at the tag)."""
    monkeypatch.syspath_prepend(str(RECIPES))
    yield RECIPES
    for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
        del sys.modules[name]


def test_the_recipe_files_here_are_verls_own_at_the_tag():
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
    assert batch_problems(cfg) == [] and parallel_problems(cfg) == []
    assert module.startswith(s.uses_recipe)
    assert cfg.actor_rollout_ref.rollout.name == s.rollout_engine
    assert cfg.actor_rollout_ref.actor.strategy == s.strategy and cfg.actor_rollout_ref.rollout.mode == "sync"
    if s.uses_recipe == "recipe.dapo":
        assert module == "recipe.dapo.main_dapo"
        assert name == ("dapo_megatron_trainer" if s.strategy == "megatron" else "dapo_trainer")
        assert cfg.algorithm.filter_groups.enable is True and cfg.algorithm.filter_groups.metric == "score"
        assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.overlong_buffer.enable is True
        assert cfg.data.gen_batch_size >= cfg.data.train_batch_size
    else:
        assert module == "recipe.one_step_off_policy.main_ppo"
        assert name == ("one_step_off_ppo_megatron_trainer" if s.strategy == "megatron" else "one_step_off_ppo_trainer")
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
    monkeypatch.setattr(trainer_command_module, "find_recipe", lambda name: None)  # verl from PyPI: no recipe/ folder
    s = settings(env, **overrides)
    with pytest.raises(SettingError, match=f"{s.uses_recipe} is not installed here .* verl_app.def"):
        trainer_argv(s)


def test_one_step_off_splits_the_gpus_between_training_and_rollout(env, recipes):
    s = settings(
        env,
        TRAINER_MODE="one_step_off",
        STRATEGY="fsdp2",
        ROLLOUT_MODE="sync",
        ROLLOUT_GPUS_PER_NODE=1,
        ROLLOUT_ENGINE="vllm",
    )
    assert s.training_gpus_per_node == 3
    split = batch_problems(composed(s))
    assert any("do not split evenly over the 3 training GPUs" in p for p in split), "the batch must split over 3 GPUs"
    argv = trainer_argv(s)
    assert "actor_rollout_ref.hybrid_engine=False" in argv and "rollout.n_gpus_per_node=1" in argv
    assert "trainer.n_gpus_per_node=3" in argv


ONE_STEP_OFF = {
    "TRAINER_MODE": "one_step_off",
    "ROLLOUT_MODE": "sync",
    "ROLLOUT_GPUS_PER_NODE": "2",
    "ROLLOUT_ENGINE": "vllm",
}


@pytest.mark.parametrize(
    "overrides, share",
    [
        ({}, 0.4),  # the hybrid engine: the rollout shares each GPU with the update
        (ONE_STEP_OFF, 0.65),  # its own GPUs, one of which may hold the head's reward server (CONFIG_REWARD_GPUS)
        (ONE_STEP_OFF | {"CONFIG_USE_SEPARATE_REWARD_NODE": "true", "SLURM_NNODES": "2"}, 0.9),  # alone: vLLM's default
        (ONE_STEP_OFF | {"CONFIG_REWARD_DEVICE": "cpu"}, 0.9),
        (ONE_STEP_OFF | {"ROLLOUT_GPU_MEMORY": "0.5"}, 0.5),  # a number is taken as it is
    ],
)
@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_rollout_gpu_memory_auto_gives_one_step_offs_own_rollout_gpus_what_vllm_takes_alone(
    env, recipes, overrides, share, strategy
):
    """The composed command, through verl's (or the recipe's) config: one_step_off's RolloutWorker builds vLLM from
    actor_rollout_ref.rollout (recipe ray_trainer.py:182-189, fsdp_workers.py:247, megatron_workers.py:181), so its
    gpu_memory_utilization is the share each dedicated rollout GPU gives vLLM (vllm_rollout_spmd.py:238)."""
    s = settings(env, **({"STRATEGY": strategy, "ROLLOUT_GPU_MEMORY": "auto"} | overrides))
    assert check(s) == []
    _, path, name, args = split_command(trainer_argv(s))
    cfg = compose(name, args, path)
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == share
    assert cfg.actor_rollout_ref.hybrid_engine is (s.trainer_mode == "sync")


@pytest.mark.parametrize("raw", ["0", "1", "0.95x", "nan", "-0.3"])
def test_a_rollout_gpu_memory_that_is_no_share_is_refused_naming_auto(env, raw):
    s = settings(env, ROLLOUT_GPU_MEMORY=raw)
    assert f"ROLLOUT_GPU_MEMORY={raw!r}: use auto or a share of GPU memory in (0, 1)" in "\n".join(check(s))
    with pytest.raises(SettingError, match="ROLLOUT_GPU_MEMORY="):
        trainer_argv(s)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"REWARD_MANAGER": "batch", "ROLLOUT_MODE": "async"}, "async reward loop registers only naive and dapo"),
        ({"ALGORITHM": "dapo", "REWARD_MANAGER": "naive"}, "ALGORITHM=dapo needs the dapo reward manager"),
        (
            {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "async"},
            "DAPO_DYNAMIC_SAMPLING=true needs ROLLOUT_MODE=sync",
        ),
        # one-step-off on SGLang, with either strategy: the recipe's weight sync imports vllm
        (
            {"TRAINER_MODE": "one_step_off", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "2"},
            "recipe/one_step_off_policy/distributed_util.py, which imports vllm.distributed",
        ),
        (
            {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "1"},
            "with ROLLOUT_ENGINE=sglang: verl 0.6.1's one-step-off recipe",
        ),
        # one-step-off with async rollout, either strategy, even on vLLM
        (
            {
                "TRAINER_MODE": "one_step_off",
                "STRATEGY": "fsdp2",
                "ROLLOUT_GPUS_PER_NODE": "1",
                "ROLLOUT_ENGINE": "vllm",
            },
            "one_step_off needs ROLLOUT_MODE=sync",
        ),
        (
            {"TRAINER_MODE": "one_step_off", "ROLLOUT_GPUS_PER_NODE": "2", "ROLLOUT_ENGINE": "vllm"},
            "asserts rollout.mode == 'sync'",
        ),
        (
            {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_ENGINE": "vllm"},
            "set ROLLOUT_GPUS_PER_NODE between 1 and 3",
        ),
        (
            {
                "TRAINER_MODE": "one_step_off",
                "STRATEGY": "fsdp2",
                "ROLLOUT_MODE": "sync",
                "ROLLOUT_GPUS_PER_NODE": "1",
                "ROLLOUT_ENGINE": "vllm",
                "ALGORITHM": "dapo",
                "DAPO_DYNAMIC_SAMPLING": "true",
            },
            "two different recipes",
        ),
        ({"ROLLOUT_ENGINE": "trtllm"}, "ROLLOUT_ENGINE='trtllm': use one of sglang, vllm"),
        # the critic shares the actor's Megatron parallel state: a different size is refused, an equal one accepted
        (
            {"ALGORITHM": "ppo", "CRITIC_PP": "1"},
            "CRITIC_PP=1 differs from ACTOR_PP=2: verl 0.6.1 sets Megatron's parallel state once",
        ),
        ({"ALGORITHM": "ppo", "CRITIC_TP": "2"}, "CRITIC_TP=2 differs from ACTOR_TP=1"),
        (
            {"ALGORITHM": "dapo", "OVERLONG_PENALTY_FACTOR": "big"},
            "OVERLONG_PENALTY_FACTOR='big': use auto or a number",
        ),
        (
            {"ALGORITHM": "dapo", "OVERLONG_PENALTY_FACTOR": "-1"},
            "OVERLONG_PENALTY_FACTOR='-1': use auto or a number, 0 or more",
        ),
        # PPO's value clip: a number above 0, or auto
        (
            {"ALGORITHM": "ppo", "CRITIC_CLIPRANGE_VALUE": "wide"},
            "CRITIC_CLIPRANGE_VALUE='wide': use auto (half the reward range) or a number above 0",
        ),
        ({"ALGORITHM": "ppo", "CRITIC_CLIPRANGE_VALUE": "0"}, "CRITIC_CLIPRANGE_VALUE='0': use auto"),
        (
            {"ALGORITHM": "ppo", "CRITIC_CLIPRANGE_VALUE": "-2", "STRATEGY": "fsdp2"},
            "CRITIC_CLIPRANGE_VALUE='-2': use auto",
        ),
        ({"ALGORITHM": "ppo", "CRITIC_CLIPRANGE_VALUE": "nan"}, "CRITIC_CLIPRANGE_VALUE='nan': use auto"),
        (
            {"ALGORITHM": "dapo", "OVERLONG_BUFFER_LEN": "5000"},
            "OVERLONG_BUFFER_LEN=5000: between 0 (a quarter of the response) and MAX_RESPONSE_LENGTH=4096",
        ),
        ({"ALGORITHM": "dapo", "OVERLONG_BUFFER_LEN": "-1"}, "OVERLONG_BUFFER_LEN=-1: between 0"),
        ({"ALGORITHM": "reinforce"}, "ALGORITHM='reinforce': use one of grpo, ppo, dapo"),
        ({"STRATEGY": "fsdp"}, "STRATEGY='fsdp': use one of megatron, fsdp2"),
        ({"REWARD_RESTARTS": "-1"}, "REWARD_RESTARTS=-1: restarts of a reward server that dies, 0 or more"),
        (
            {"CONFIG_GPUS_PER_NODE": "17"},
            "CONFIG_GPUS_PER_NODE=17 with ROLLOUT_ENGINE=sglang: a job's port block holds",
        ),
    ],
)
def test_refused_combinations_say_why(env, overrides, needle):
    assert any(needle in p for p in check(settings(env, **overrides))), check(settings(env, **overrides))


@pytest.mark.parametrize(
    "overrides",
    [{"ROLLOUT_MODE": "async"}, {"ROLLOUT_MODE": "sync", "ROLLOUT_ENGINE": "vllm"}],
    ids=["sglang-async", "vllm-sync"],
)
def test_enforce_eager_is_accepted_where_the_engine_reads_it(env, overrides):
    s = settings(env, ROLLOUT_ENFORCE_EAGER="true", **overrides)
    assert check(s) == []
    cfg = composed(s)
    assert cfg.actor_rollout_ref.rollout.enforce_eager is True
    assert rollout_problems(cfg) == []


def test_eager_or_sglang_engine_kwargs_are_refused_where_sync_sglang_drops_them(env):
    s = settings(env, ROLLOUT_MODE="sync")
    # sync SGLang never passes enforce_eager on (sglang_rollout.py:426-477): the setting, refused on the composed config
    (eager,) = rollout_problems(composed(settings(env, ROLLOUT_MODE="sync", ROLLOUT_ENFORCE_EAGER="true")))
    assert "actor_rollout_ref.rollout.enforce_eager=True (ROLLOUT_ENFORCE_EAGER) with sync SGLang rollout" in eager
    extra = [
        "actor_rollout_ref.rollout.enforce_eager=True",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_cuda_graph=True",
    ]
    eager, kwargs = rollout_problems(composed(s, extra))
    assert "actor_rollout_ref.rollout.enforce_eager=True (ROLLOUT_ENFORCE_EAGER) with sync SGLang rollout" in eager
    assert "engine_kwargs.sglang.{disable_cuda_graph} with sync SGLang rollout" in kwargs
    backend = ["+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=flashinfer"]
    assert rollout_problems(composed(s, backend)) == [], "the one key sync SGLang does read"


def test_the_settings_block_defaults_are_the_articles_grpo(env):
    s = settings(env)
    assert (s.algorithm, s.strategy, s.trainer_mode, s.rollout_mode) == ("grpo", "megatron", "sync", "async")
    assert (s.rollout_engine, s.overlong_penalty_factor, s.critic_pp, s.critic_tp) == ("sglang", 35.0, None, None)
    assert (s.train_batch_size, s.max_prompt_length, s.max_response_length, s.rollout_n) == (256, 2048, 4096, 4)
    assert (s.actor_pp, s.actor_tp, s.ppo_mini_batch_size, s.save_freq_setting, s.test_freq) == (2, 1, 128, "auto", 5)
    # the Megatron update's plan is chosen for the card (launch/plan/megatron_plan.py), each knob auto
    knobs = (s.micro_batch_setting, s.megatron_recompute_setting, s.fused_kernels_setting, s.optimizer_offload_setting)
    assert knobs == ("auto", "auto", "auto", "auto")


def test_an_equal_critic_size_is_accepted_and_the_critic_gets_the_actors_sizes(env):
    s = settings(env, ALGORITHM="ppo", CRITIC_PP=2, CRITIC_TP=1)
    assert check(s) == []
    module, path, name, overrides = split_command(trainer_argv(s))
    cfg = compose(name, overrides, path)
    critic, actor = cfg.critic.megatron, cfg.actor_rollout_ref.actor.megatron
    assert (critic.pipeline_model_parallel_size, critic.tensor_model_parallel_size) == (2, 1)
    assert (critic.pipeline_model_parallel_size, critic.tensor_model_parallel_size) == (
        actor.pipeline_model_parallel_size,
        actor.tensor_model_parallel_size,
    )


def composed(s: Settings, extra: list[str] | None = None):
    module, path, name, overrides = split_command(trainer_argv(s, extra=extra))
    return compose(name, overrides, path)


@pytest.mark.parametrize(
    "overrides, extra, needle",
    [
        # a Hydra override on the command line that sets a critic or ref size the run would not follow
        (
            {"ALGORITHM": "ppo"},
            ["critic.megatron.tensor_model_parallel_size=2"],
            "critic.megatron.tensor_model_parallel_size=2 differs from "
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        ),
        (
            {},
            ["actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1"],
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1 differs",
        ),
    ],
)
def test_ref_and_critic_parallel_sizes_other_than_the_actors_are_refused(env, overrides, extra, needle):
    cfg = composed(settings(env, **overrides), extra)
    validate(cfg)  # verl's own checks let it through
    problems = parallel_problems(cfg)
    assert any(needle in p for p in problems), problems


# The issue's batch: 4 GPUs, PP 2, micro-batch 2, 100 prompts x 5 responses, mini-batch 50. It passes validate_config
# and every relation of the update; only async rollout's agent loop cannot split it.
ISSUE_SPLIT = {"TRAIN_BATCH_SIZE": 100, "ROLLOUT_N": 5, "PPO_MINI_BATCH_SIZE": 50, "MICRO_BATCH_PER_GPU": 2}

BATCH_CASES = [
    # (settings, extra Hydra overrides, what the preflight says): each passes verl's validate_config and would stop at
    # (or silently change) the first update. Defaults: 4 GPUs, Megatron PP 2 (2 data-parallel ranks), batch 256 x 4.
    # the issue's own case: mini-batch 3 of 4 prompts (x2 = 6 of 8 sequences, 3 of 4 per rank): make_iterator asserts
    (
        {"TRAIN_BATCH_SIZE": 4, "ROLLOUT_N": 2, "PPO_MINI_BATCH_SIZE": 3, "MICRO_BATCH_PER_GPU": 1},
        [],
        "ppo_mini_batch_size=3 (PPO_MINI_BATCH_SIZE) does not divide data.train_batch_size",
    ),
    # the same through an extra Hydra override, on the defaults (12 sequences a mini-batch, 6 per rank, 512 per rank)
    (
        {},
        ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
        "each of 2 data-parallel ranks gets 512 sequences a step and updates in mini-batches of 6",
    ),
    # FSDP2 on 4 ranks: 3 x 2 = 6 sequences cannot split over 4 ranks; verl would round down to 1 each
    (
        {
            "STRATEGY": "fsdp2",
            "TRAIN_BATCH_SIZE": 8,
            "ROLLOUT_N": 2,
            "PPO_MINI_BATCH_SIZE": 3,
            "MICRO_BATCH_PER_GPU": 1,
        },
        [],
        "verl rounds each rank's mini-batch down to 1",
    ),
    # FSDP2: mini-batch per rank 2 x 4 / 4 = 2, micro-batch 4 per GPU: fsdp_workers asserts divisibility
    (
        {"STRATEGY": "fsdp2", "TRAIN_BATCH_SIZE": 8, "PPO_MINI_BATCH_SIZE": 2},
        [],
        "ppo_micro_batch_size_per_gpu=4 (MICRO_BATCH_PER_GPU) does not divide the mini-batch per rank, 2",
    ),
    # FSDP2 with dynamic batches skips validate_config's batch check: 1024 sequences over 3 GPUs
    (
        {"STRATEGY": "fsdp2"},
        ["trainer.n_gpus_per_node=3"],
        "1024 sequences do not split evenly over the 3 training GPUs",
    ),
    # one prompt x one response a mini-batch on 4 ranks: 0 sequences each
    (
        {"STRATEGY": "fsdp2", "ROLLOUT_N": 1, "PPO_MINI_BATCH_SIZE": 1},
        [],
        "= 1 sequences is less than one per data-parallel rank (4)",
    ),
    # ppo_epochs 0: the update loop runs no step
    ({}, ["actor_rollout_ref.actor.ppo_epochs=0"], "actor_rollout_ref.actor.ppo_epochs=0: at least 1"),
    # log-prob micro-batches of 0 rows (Megatron, fixed micro-batches put back by overrides)
    (
        {},
        [
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
        ],
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0 (MICRO_BATCH_PER_GPU): at least 1",
    ),
    # dynamic log-prob batches with a token budget under one sequence (2048 + 4096 tokens)
    (
        {"STRATEGY": "fsdp2"},
        ["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4000"],
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4000 is less than one whole sequence",
    ),
    # PPO's critic: its own mini-batch on the actor's data-parallel ranks (Megatron shares the parallel state)
    (
        {"ALGORITHM": "ppo"},
        ["critic.ppo_mini_batch_size=3"],
        "critic.ppo_mini_batch_size=3 (PPO_MINI_BATCH_SIZE) does not divide",
    ),
    (
        {"ALGORITHM": "ppo", "STRATEGY": "fsdp2"},
        ["critic.ppo_max_token_len_per_gpu=1024"],
        "critic.ppo_max_token_len_per_gpu=1024 is less than one whole sequence",
    ),
    # async rollout: 100 x 5 = 500 sequences over the agent loop's 8 workers (agent_loop.py:764, protocol.py:880-883)
    (ISSUE_SPLIT, [], "500 sequences do not split over the agent loop's 8 workers"),
    # the worker count as verl will use it: an extra override of it counts
    (
        {},
        ["actor_rollout_ref.rollout.agent.num_workers=6"],
        "1024 sequences do not split over the agent loop's 6 workers",
    ),
]


@pytest.mark.parametrize("overrides, extra, needle", BATCH_CASES)
def test_batch_relations_verl_asserts_at_run_time_are_refused_before_anything_starts(env, overrides, extra, needle):
    cfg = composed(settings(env, **overrides), extra)
    validate(cfg)  # verl's own config checks pass: the run would stop (or update differently) only later
    problems = batch_problems(cfg)
    assert any(needle in p for p in problems), problems


def test_a_batch_the_agent_loop_cannot_split_is_refused_naming_the_worker_counts_that_divide(env):
    (problem,) = batch_problems(composed(settings(env, **ISSUE_SPLIT)))
    assert (
        "TRAIN_BATCH_SIZE" in problem
        and "ROLLOUT_N" in problem
        and "actor_rollout_ref.rollout.agent.num_workers" in problem
    )
    assert "set TRAIN_BATCH_SIZE x ROLLOUT_N to a multiple of 8" in problem
    assert "override actor_rollout_ref.rollout.agent.num_workers with 5 or 10, which divide 500" in problem
    for fixed in ({"TRAIN_BATCH_SIZE": 200}, {"ROLLOUT_MODE": "sync"}):  # sync rollout has no agent loop
        assert batch_problems(composed(settings(env, **ISSUE_SPLIT | fixed))) == []
    assert (
        batch_problems(composed(settings(env, **ISSUE_SPLIT), ["actor_rollout_ref.rollout.agent.num_workers=10"])) == []
    )


def test_the_preflight_stops_a_batch_the_agent_loop_cannot_split_before_anything_starts(env):
    job = (
        env
        | {k: str(v) for k, v in ISSUE_SPLIT.items()}
        | {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0", "TRAINER_LAUNCHER": "stand-in", "TRAINER_IS_VERL": "0"}
    )
    run = subprocess.run(
        [sys.executable, "-m", "launch.plan.preflight"], cwd=REPO, env=job, capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "verl 0.6.1 would stop at run time" in run.stderr and "agent loop's 8 workers" in run.stderr


def test_a_mini_batch_that_divides_the_batch_passes(env):
    s = settings(env, TRAIN_BATCH_SIZE=4, ROLLOUT_N=2, PPO_MINI_BATCH_SIZE=2, MICRO_BATCH_PER_GPU=1)
    assert check(s) == [] and batch_problems(composed(s)) == []


def test_the_preflight_stops_the_issues_batch_before_anything_starts(env, tmp_path):
    """PREFLIGHT_ONLY=1 TRAIN_BATCH_SIZE=4 ROLLOUT_N=2 PPO_MINI_BATCH_SIZE=3 used to pass every check."""
    job = env | {
        "TRAIN_BATCH_SIZE": "4",
        "ROLLOUT_N": "2",
        "PPO_MINI_BATCH_SIZE": "3",
        "PREFLIGHT_DATA": "0",
        "PREFLIGHT_REWARD": "0",
        "TRAINER_LAUNCHER": "stand-in",
        "TRAINER_IS_VERL": "0",
    }
    run = subprocess.run(
        [sys.executable, "-m", "launch.plan.preflight"], cwd=REPO, env=job, capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "verl 0.6.1 would stop at run time" in run.stderr and "PPO_MINI_BATCH_SIZE" in run.stderr
    fixed = subprocess.run(
        [sys.executable, "-m", "launch.plan.preflight"],
        cwd=REPO,
        env=job | {"PPO_MINI_BATCH_SIZE": "2"},
        capture_output=True,
        text=True,
    )
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "TRAINER_IS_VERL=0: TRAINER_LAUNCHER=stand-in runs no verl trainer, so verl's imports" in fixed.stderr


RAY_CPU_CASES = [
    # (settings, extra overrides, Ray CPUs verl holds on a node): its TaskRunner 1, a bundle of 1 CPU per GPU, and
    # with async rollout one CPU per SGLang or vLLM server on the node (one per replica of ROLLOUT_TP GPUs there)
    ({}, [], 1 + 4 + 4),  # the defaults: 4 GPUs, async SGLang, ROLLOUT_TP=1
    ({"ROLLOUT_MODE": "sync"}, [], 1 + 4),
    ({"ROLLOUT_TP": 2}, [], 1 + 4 + 2),
    ({"ROLLOUT_TP": 4, "ROLLOUT_ENGINE": "vllm"}, [], 1 + 4 + 1),
    ({"CONFIG_GPUS_PER_NODE": 8, "ACTOR_PP": 2}, [], 1 + 8 + 8),
    # the CPU runs' hf replica serves from the hybrid worker itself: no server actor
    ({"CONFIG_GPUS_PER_NODE": 1, "ACTOR_PP": 1, "STRATEGY": "fsdp2"}, ["actor_rollout_ref.rollout.name=hf"], 1 + 1),
]


@pytest.mark.parametrize("overrides, extra, need", RAY_CPU_CASES)
def test_the_ray_cpus_verl_holds_on_a_node_follow_its_gpus_and_rollout_servers(env, overrides, extra, need):
    cfg = composed(settings(env, **overrides), extra)
    assert ray_cpus_needed(cfg)[0] == need
    assert ray_cpu_problems(cfg, {"RAY_NUM_CPUS": str(need)}) == []
    (problem,) = ray_cpu_problems(
        cfg, {"RAY_NUM_CPUS": str(need - 1), "RAY_NUM_CPUS_FROM": "the job's --cpus-per-task"}
    )
    assert problem.startswith(
        f"RAY_NUM_CPUS={need - 1} Ray CPUs per node (the job's --cpus-per-task), but verl 0.6.1 holds {need} on a node"
    )
    assert f"#SBATCH --cpus-per-task={need} or more" in problem and "waits for ever" in problem


def test_one_step_offs_rollout_pool_takes_a_cpu_beside_each_of_its_gpus_too(env, recipes):
    s = one_step_off(env)  # 4 GPUs a node: 2 train, 2 generate, sync rollout
    assert ray_cpus_needed(composed(s))[0] == 1 + 2 + 2


PLACEMENT = r"""
import inspect, sys, threading
import ray
from verl.trainer import main_ppo
from verl.trainer.ppo.ray_trainer import ResourcePoolManager

gpus, cpus = int(sys.argv[1]), int(sys.argv[2])
assert "ray.remote(num_cpus=1)(TaskRunner)" in inspect.getsource(main_ppo.run_ppo), "verl's TaskRunner takes 1 CPU"
ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, _temp_dir=sys.argv[3])

class Holder:
    def ping(self):
        return True

runner = ray.remote(num_cpus=1)(Holder).remote()  # the TaskRunner's CPU, as main_ppo asks for it
blocker = ray.remote(num_cpus=1)(Holder).remote()  # one CPU fewer, until it goes
ray.get([runner.ping.remote(), blocker.ping.remote()])
manager = ResourcePoolManager(resource_pool_spec={"global_pool": [gpus]}, mapping={})  # as main_ppo builds it
manager.create_resource_pool()
placing = threading.Thread(target=manager.resource_pool_dict["global_pool"].get_placement_groups, daemon=True)
placing.start()
placing.join(15)
print(f"{cpus - 1} CPUs:", "waiting" if placing.is_alive() else "placed", flush=True)
ray.kill(blocker)
placing.join(120)
print(f"{cpus} CPUs:", "waiting" if placing.is_alive() else "placed", flush=True)
"""


def test_verls_own_placement_waits_with_one_ray_cpu_fewer_than_the_refusal_asks_and_proceeds_with_them(env, ray_tmp):
    """verl 0.6.1's ResourcePoolManager for a node of 2 GPUs (sync rollout, as main_ppo builds it) on a real Ray, beside
    a 1-CPU actor as its TaskRunner: with one CPU fewer than ray_cpus_needed its placement group waits (verl would
    wait for ever: ray.get(pg.ready()) without a timeout); once that CPU is free, verl places its workers."""
    cfg = composed(settings(env, CONFIG_GPUS_PER_NODE=2, ACTOR_PP=1, ROLLOUT_MODE="sync"))
    need, _ = ray_cpus_needed(cfg)
    run = subprocess.run(
        [sys.executable, "-c", PLACEMENT, "2", str(need), str(ray_tmp)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line for line in run.stdout.splitlines() if "CPUs:" in line] == [
        f"{need - 1} CPUs: waiting",
        f"{need} CPUs: placed",
    ], run.stdout + run.stderr[-2000:]


def test_fsdp2_carries_verls_padding_removal_and_dynamic_batches(env):
    s = settings(env, STRATEGY="fsdp2", ALGORITHM="ppo")
    argv = trainer_argv(s)
    assert "actor_rollout_ref.model.use_remove_padding=True" in argv and "critic.model.use_remove_padding=True" in argv
    cfg = composed(s)
    validate(cfg)
    assert batch_problems(cfg) == []
    arr, seq = cfg.actor_rollout_ref, s.max_prompt_length + s.max_response_length
    assert arr.model.use_remove_padding and cfg.critic.model.use_remove_padding
    assert arr.actor.use_dynamic_bsz and arr.ref.log_prob_use_dynamic_bsz and arr.rollout.log_prob_use_dynamic_bsz
    assert cfg.critic.use_dynamic_bsz
    budgets = {
        arr.actor.ppo_max_token_len_per_gpu,
        arr.ref.log_prob_max_token_len_per_gpu,
        arr.rollout.log_prob_max_token_len_per_gpu,
        cfg.critic.ppo_max_token_len_per_gpu,
        cfg.critic.forward_max_token_len_per_gpu,
    }
    assert budgets == {4 * seq}, "at the article's lengths: MICRO_BATCH_PER_GPU=auto's 4 fixed micro-batches' tokens"
    # Megatron batches by the same token budget and packs without padding on its own: no use_remove_padding there.
    megatron = trainer_argv(settings(env))
    assert "actor_rollout_ref.actor.use_dynamic_bsz=True" in megatron
    assert not any("use_remove_padding" in a for a in megatron)


@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_the_token_budget_packs_full_length_sequences_as_verl_splits_them(env, strategy):
    """verl's dynamic batching (seqlen_balancing.rearrange_micro_batches, what the Megatron actor and dp_actor use) on a
    rank's share of sequences: no micro-batch holds more tokens than the budget, so memory stays at the article's
    MICRO_BATCH_PER_GPU full sequences at worst; 16k-token responses go one to a micro-batch, short ones pack."""
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    s = settings(env, STRATEGY=strategy, MAX_RESPONSE_LENGTH=16384)
    budget, seq = composed(s).actor_rollout_ref.actor.ppo_max_token_len_per_gpu, 2048 + 16384
    assert budget == seq, "four of the article's 6144-token sequences hold one of 18432 tokens"
    full = TensorDict(
        {"input_ids": torch.zeros(8, seq, dtype=torch.long), "attention_mask": torch.ones(8, seq, dtype=torch.long)},
        batch_size=[8],
    )
    micro, _ = rearrange_micro_batches(full, max_token_len=budget)
    assert [len(m) for m in micro] == [1] * 8
    short_mask = torch.zeros(8, seq, dtype=torch.long)
    short_mask[:, :3000] = 1
    short = TensorDict(
        {"input_ids": torch.zeros(8, seq, dtype=torch.long), "attention_mask": short_mask}, batch_size=[8]
    )
    micro, _ = rearrange_micro_batches(short, max_token_len=budget)
    assert [len(m) for m in micro] == [4, 4], "eight 3000-token sequences: two micro-batches of 12000 tokens"


def dapo_batch(tokenizer, response_lengths: list[int], max_response: int):
    """Responses of these token lengths, right-padded to the full response width, as after a rollout."""
    import numpy as np
    import torch
    from verl import DataProto

    prompt = tokenizer("Is it safe?", add_special_tokens=False)["input_ids"]
    filler = tokenizer(" word", add_special_tokens=False)["input_ids"][0]
    rows = len(response_lengths)
    responses = torch.full((rows, max_response), tokenizer.pad_token_id)
    mask = torch.zeros(rows, len(prompt) + max_response, dtype=torch.long)
    mask[:, : len(prompt)] = 1
    for i, n in enumerate(response_lengths):
        responses[i, :n] = filler
        mask[i, len(prompt) : len(prompt) + n] = 1
    prompts = torch.tensor([prompt] * rows)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array(["safety"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": "q"}] * rows, dtype=object),
            "extra_info": np.array([{} for _ in range(rows)], dtype=object),
        },
    )


def middle_score(**kwargs) -> float:
    return 0.0  # a mid-range score; what is added to it is verl's overlong penalty alone


@pytest.mark.parametrize("path", ["dapo manager", "async reward loop", "recipe.dapo"])
def test_dapos_overlong_penalty_is_a_meaningful_share_of_the_reward_range(env, recipes, tiny_models, path):
    """verl's own DAPO code on our command: a response that runs to MAX_RESPONSE_LENGTH loses half the reward range
    (35 of -40..30), one that stops before the buffer loses nothing, one halfway into the buffer half of it.
    verl's default factor of 1.0 would be 1.4% of the range."""
    import asyncio

    from verl.experimental.reward.reward_loop.dapo import DAPORewardLoopManager
    from verl.utils import hf_tokenizer
    from verl.workers.reward_manager.dapo import DAPORewardManager

    extra = {"DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync"} if path == "recipe.dapo" else {}
    s = settings(env, ALGORITHM="dapo", MAX_RESPONSE_LENGTH=400, **extra)
    assert s.overlong_penalty_factor == 35.0
    cfg = composed(s)
    tokenizer = hf_tokenizer(str(tiny_models.policy))
    lengths = [300, 350, 400]  # expected length 300 (a quarter of 400 is the buffer), halfway, the limit
    data = dapo_batch(tokenizer, lengths, 400)
    if path == "async reward loop":

        async def score_each():
            manager = DAPORewardLoopManager(cfg, tokenizer, compute_score=middle_score)
            return [(await manager.run_single(data[i : i + 1]))["reward_score"] for i in range(len(data))]

        rewards = asyncio.run(score_each())
    else:
        if path == "recipe.dapo":  # what recipe/dapo/main_dapo.py hands load_reward_manager
            kwargs = {
                "overlong_buffer_cfg": cfg.reward_model.overlong_buffer,
                "max_resp_len": cfg.data.max_response_length,
            }
        else:
            kwargs = dict(cfg.reward_model.reward_kwargs)
        manager = DAPORewardManager(tokenizer, num_examine=0, compute_score=middle_score, **kwargs)
        tensor = manager(data)
        rewards = [tensor[i, n - 1].item() for i, n in enumerate(lengths)]
    assert rewards == pytest.approx([0.0, -17.5, -35.0])
    low, high = s.reward_score_range
    assert -rewards[-1] / (high - low) == pytest.approx(0.5)


def test_the_overlong_penalty_follows_the_reward_range_and_an_explicit_factor_wins(env):
    assert settings(env, ALGORITHM="dapo", REWARD_MIN_SCORE=-1, REWARD_MAX_SCORE=1).overlong_penalty_factor == 1.0
    explicit = settings(env, ALGORITHM="dapo", OVERLONG_PENALTY_FACTOR="5")
    assert "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=5.0" in trainer_argv(explicit)
    with pytest.raises(SettingError, match="REWARD_MIN_SCORE"):
        settings(env, REWARD_MIN_SCORE="low")


@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_ppo_sizes_the_critics_value_clip_from_the_reward_range_and_a_number_wins(env, strategy):
    # verl's 0.5 would let the value head move 0.7% of a -40..30 range an update (core_algos.py:1403-1406)
    assert "critic.cliprange_value=35.0" in trainer_argv(settings(env, ALGORITHM="ppo", STRATEGY=strategy))
    narrow = settings(env, ALGORITHM="ppo", STRATEGY=strategy, REWARD_MIN_SCORE=-1, REWARD_MAX_SCORE=1)
    assert "critic.cliprange_value=1.0" in trainer_argv(narrow)
    # rule rewards span -1..1 (verl's scorers), a weighted mix the sum of the weighted ranges: (-40 - 10, 30 + 10)
    assert "critic.cliprange_value=1.0" in trainer_argv(
        settings(env, ALGORITHM="ppo", STRATEGY=strategy, REWARD="rule")
    )
    mix = settings(env, ALGORITHM="ppo", STRATEGY=strategy, REWARD="rm+rule", REWARD_RULE_WEIGHT="10")
    assert "critic.cliprange_value=45.0" in trainer_argv(mix)
    explicit = settings(env, ALGORITHM="ppo", STRATEGY=strategy, CRITIC_CLIPRANGE_VALUE="0.5")
    assert "critic.cliprange_value=0.5" in trainer_argv(explicit)
    assert check(explicit) == []


def test_the_value_clip_reaches_verls_composed_critic_config_and_only_ppo_has_a_critic(env):
    assert composed(settings(env, ALGORITHM="ppo")).critic.cliprange_value == 35.0
    grpo = settings(env, CRITIC_CLIPRANGE_VALUE="junk")  # no critic: the setting is not read
    assert not any(a.startswith("critic.cliprange_value") for a in trainer_argv(grpo))
    assert not any("CRITIC_CLIPRANGE_VALUE" in p for p in check(grpo))


@pytest.fixture
def fake_vllm(tmp_path):
    """A folder with a stand-in `vllm` package holding just what the one-step-off recipe's weight sync imports
    (neither SGLang nor vLLM installs on a CPU machine); put it on PYTHONPATH to make vllm importable."""
    root = tmp_path / "fake_engines"
    files = {
        "vllm/__init__.py": "",
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/utils.py": "class StatelessProcessGroup:\n    pass\n",
        "vllm/distributed/device_communicators/__init__.py": "",
        "vllm/distributed/device_communicators/pynccl.py": "class PyNcclCommunicator:\n    pass\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def one_step_off(env, strategy="fsdp2"):
    return settings(
        env,
        TRAINER_MODE="one_step_off",
        STRATEGY=strategy,
        ROLLOUT_MODE="sync",
        ROLLOUT_GPUS_PER_NODE=2,
        ROLLOUT_ENGINE="vllm",
    )


def test_the_import_check_covers_the_one_step_off_recipes_modules_and_its_vllm_imports(env, recipes):
    for strategy in ("fsdp2", "megatron"):
        s = one_step_off(env, strategy)
        module, *_ = split_command(trainer_argv(s))
        workers = "fsdp_workers" if strategy == "fsdp2" else "megatron_workers"
        assert trainer_modules(module, composed(s)) == [
            "vllm",
            "recipe.one_step_off_policy.main_ppo",
            "recipe.one_step_off_policy.ray_trainer",
            f"recipe.one_step_off_policy.{workers}",
            "recipe.one_step_off_policy.distributed_util",
            "vllm.distributed.device_communicators.pynccl",
            "vllm.distributed.utils",
        ]
    assert trainer_modules("verl.trainer.main_ppo", composed(settings(env))) == [
        "sglang",
        "verl.trainer.main_ppo",
        "verl.experimental.agent_loop",  # the default, async rollout
    ]
    assert trainer_modules("verl.trainer.main_ppo", composed(settings(env, ROLLOUT_MODE="sync"))) == [
        "sglang",
        "verl.trainer.main_ppo",
    ]
    dapo = settings(env, ALGORITHM="dapo", DAPO_DYNAMIC_SAMPLING="true", ROLLOUT_MODE="sync", ROLLOUT_ENGINE="vllm")
    assert trainer_modules("recipe.dapo.main_dapo", composed(dapo)) == [
        "vllm",
        "recipe.dapo.main_dapo",
        "recipe.dapo.dapo_ray_trainer",
    ]


def test_one_step_off_imports_where_vllm_and_the_recipe_are_installed(env, recipes, fake_vllm, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{fake_vllm}:{recipes}:{REPO}")
    s = one_step_off(env)
    module, *_ = split_command(trainer_argv(s))
    assert import_problems(trainer_modules(module, composed(s)), "vllm") == []


def test_a_missing_engine_or_recipe_module_stops_the_import_check_naming_it(env, recipes, fake_vllm, monkeypatch):
    s = one_step_off(env)
    module, *_ = split_command(trainer_argv(s))
    modules = trainer_modules(module, composed(s))
    monkeypatch.setenv("PYTHONPATH", f"{recipes}:{REPO}")  # the recipe, no vLLM (the SGLang image)
    problems = import_problems(modules, "vllm")
    assert any(p.startswith("import vllm fails (ModuleNotFoundError") and "use the vllm image" in p for p in problems)
    assert any(p.startswith("import vllm.distributed.device_communicators.pynccl fails") for p in problems)
    monkeypatch.setenv("PYTHONPATH", f"{fake_vllm}:{REPO}")  # vLLM, no recipes (verl from PyPI)
    problems = import_problems(modules, "vllm")
    assert any(
        p.startswith("import recipe.one_step_off_policy.main_ppo fails (ModuleNotFoundError")
        and "verl's recipes come from its git tag" in p
        for p in problems
    ), problems
    assert not any(p.startswith("import vllm") for p in problems)


def test_async_rollout_is_refused_where_verls_agent_loop_does_not_import_as_without_cachetools(env, tmp_path):
    """verl 0.6.1's agent loop imports cachetools without declaring it: an environment without it (here hidden by a
    module of that name that fails, as a missing one does) cannot run async rollout, and the preflight says so before
    the queue; with it (this environment's), the same command passes the import check."""
    missing = tmp_path / "no_cachetools"
    missing.mkdir()
    (missing / "cachetools.py").write_text("raise ModuleNotFoundError(\"No module named 'cachetools'\")\n")
    job = env | {
        "STRATEGY": "fsdp2",
        "CONFIG_GPUS_PER_NODE": "1",
        "ACTOR_PP": "1",
        "PREFLIGHT_DATA": "0",
        "PREFLIGHT_REWARD": "0",
        "TRAINER_LAUNCHER": "python3",
        "RAY_NUM_CPUS": "2",
    }

    def preflight(pythonpath):
        return subprocess.run(
            [sys.executable, "-m", "launch.plan.preflight", *verl_shims.overrides()],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=job | {"PYTHONPATH": pythonpath},
        )

    refused = preflight(f"{missing}:{REPO}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert (
        "the trainer cannot start here: import verl.experimental.agent_loop fails (ModuleNotFoundError: No module "
        "named 'cachetools'): ROLLOUT_MODE=async runs verl's agent loop" in refused.stderr
    ), refused.stderr[-3000:]
    ok = preflight(str(REPO))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (
        "import here: verl.workers.rollout.hf_rollout, verl.trainer.main_ppo, verl.experimental.agent_loop" in ok.stdout
    )


def test_the_preflight_stops_a_job_whose_engine_does_not_import_where_the_trainer_runs(env, recipes, fake_vllm):
    job = env | {
        "TRAINER_MODE": "one_step_off",
        "STRATEGY": "fsdp2",
        "ROLLOUT_MODE": "sync",
        "ROLLOUT_ENGINE": "vllm",
        "ROLLOUT_GPUS_PER_NODE": "2",
        "PREFLIGHT_DATA": "0",
        "PREFLIGHT_REWARD": "0",
        "TRAINER_LAUNCHER": "python3",
    }

    def preflight(pythonpath):
        return subprocess.run(
            [sys.executable, "-m", "launch.plan.preflight"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=job | {"PYTHONPATH": pythonpath},
        )

    missing = preflight(f"{recipes}:{REPO}")
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert "the trainer cannot start here: import vllm fails" in missing.stderr
    ok = preflight(f"{fake_vllm}:{recipes}:{REPO}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "the trainer's modules import here: vllm, recipe.one_step_off_policy.main_ppo" in ok.stdout


def test_batches_need_not_be_multiples_of_the_micro_batch_since_both_strategies_batch_by_tokens(env):
    # 6 x 2 = 12 sequences on 4 GPUs: 3 each, in per-rank mini-batches of 2 x 2 / 4 = 1; no micro-batch count involved
    # (sync rollout: async's agent loop could not cut 12 sequences into 8 equal parts)
    s = settings(
        env,
        STRATEGY="fsdp2",
        TRAIN_BATCH_SIZE=6,
        ROLLOUT_N=2,
        PPO_MINI_BATCH_SIZE=2,
        MICRO_BATCH_PER_GPU=1,
        ROLLOUT_MODE="sync",
    )
    assert check(s) == []
    cfg = composed(s)
    validate(cfg)
    assert batch_problems(cfg) == []
    # Megatron too (2 data-parallel ranks x micro-batch 4 would not divide 12): verl's validate_config skips the
    # micro-batch with use_dynamic_bsz, and so does the check
    megatron = settings(
        env, TRAIN_BATCH_SIZE=6, ROLLOUT_N=2, PPO_MINI_BATCH_SIZE=2, MICRO_BATCH_PER_GPU=4, ROLLOUT_MODE="sync"
    )
    assert check(megatron) == []
    cfg = composed(megatron)
    validate(cfg)
    assert batch_problems(cfg) == []
    five = composed(settings(env, TRAIN_BATCH_SIZE=5, ROLLOUT_N=1, PPO_MINI_BATCH_SIZE=5, ROLLOUT_MODE="sync"))
    assert any("= 5 sequences do not split evenly over the 4 training GPUs" in p for p in batch_problems(five))


def test_the_ppo_canarys_training_stage_passes_verls_own_checks(env):
    """The canary's overrides on a PPO job: verl's validate_config accepts them, the critic trains as the job does."""
    from launch.watch.canary import stage_overrides

    s = settings(env, ALGORITHM="ppo")
    cfg = composed(s, stage_overrides("train", s))
    validate(cfg)
    assert cfg.critic.ppo_epochs == cfg.actor_rollout_ref.actor.ppo_epochs == 1
