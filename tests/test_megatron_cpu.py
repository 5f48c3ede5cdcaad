"""verl 0.6.1's own Megatron workers on the CPU (cpu/megatron_shims.py): the worker's model against the HF model, the
names a Transformer Engine run writes, each shim against the megatron-core or verl call it works around, and the
overrides through verl's config checks. `make demo` (tests/test_demo.py) runs all of it inside verl's trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpu import megatron_shims
from launch.plan.config_refusals import rollout_problems
from launch.plan.preflight import compose, split_command, validate
from launch.plan.refusals import check
from launch.plan.settings import SettingError, Settings
from launch.plan.trainer_command import FUSED_OVERRIDES, PREEMPT_HOOK, USER_HOOK, fused_kernels, trainer_argv
from tests.support import REPO, SHIM_OUTCOME, block_environment, once_per_run


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """One policy for the whole run (the workers compare reports built from it)."""
    from demo.tiny_models import build_policy_model

    return Path(once_per_run(tmp_path_factory, "megatron_policy", lambda d: str(build_policy_model(d / "policy"))))


def run_worker(tmp, policy, *settings: str) -> dict:
    """tests/megatron_worker.py: verl's ActorRolloutRefWorker built from the job's own command (KEY=VALUE settings
    on the block's defaults), init_model, compute_log_prob and one update_actor, in a fresh interpreter (the shims
    are process-wide)."""
    out = tmp / "report.json"
    env = {"HOME": str(tmp), "HF_HOME": str(tmp / "hf"), "TMPDIR": str(tmp), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.megatron_worker", str(out), str(policy), *settings],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(out.read_text()) | {"stdout": run.stdout}


@pytest.fixture(scope="module")
def worker_report(tmp_path_factory, tiny_policy):
    """Built once per run: xdist hands this module's tests to every worker, and each would build its own."""

    # full recompute, the article's (auto keeps every activation where it fits): the report checks recompute's path
    def build(folder):
        return run_worker(folder, tiny_policy, "MEGATRON_RECOMPUTE=full")

    return once_per_run(tmp_path_factory, "megatron_worker", build)


def largest_gap(report: dict, reference: str) -> float:
    return max(
        abs(a - b)
        for got, want, mask in zip(report["megatron"], report[reference], report["response_mask"], strict=True)
        for a, b, m in zip(got, want, mask, strict=True)
        if m
    )


def test_the_megatron_actors_log_probs_match_the_hf_models_within_bfloat16_rounding(worker_report):
    """The packed forward of verl's Megatron actor (bf16, the TE-shaped layers, SDPA over each packed sequence) gives
    the HF model's log-probs for the same tokens: 0.012 apart on the tiny policy, where HF's own bf16 run is 0.015
    from its fp32 one. A wrong norm, rope or attention mask puts them whole nats apart."""
    scale = largest_gap({**worker_report, "megatron": worker_report["hf_bfloat16"]}, "hf_float32")
    assert largest_gap(worker_report, "hf_float32") < max(0.05, 2 * scale), worker_report
    assert any(v < -1 for row in worker_report["megatron"] for v in row), "log-probs of real tokens, not zeros"


def test_the_megatron_model_has_transformer_engines_names_for_the_loader_sync_checkpoint_and_merger(worker_report):
    keys = [k for k in worker_report["state_dict_keys"] if ".layers.0." in k]
    layer = "decoder.layers.0."
    for key in (
        "self_attention.linear_qkv.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_weight",
        "self_attention.core_attention._extra_state",
        "self_attention.q_layernorm.weight",
        "self_attention.linear_proj.weight",
        "mlp.linear_fc2.weight",
    ):
        assert layer + key in keys, (key, keys)
    assert not [k for k in keys if "input_layernorm" in k or "pre_mlp_layernorm" in k], keys


def test_the_running_worker_holds_the_jobs_megatron_settings(worker_report):
    """Read from verl's running worker: what the settings block's Megatron defaults become there."""
    tf = worker_report["transformer_config"]
    assert tf["bf16"] == "True" and tf["params_dtype"] == "torch.bfloat16" and tf["use_cpu_initialization"] == "True"
    assert (tf["pipeline_model_parallel_size"], tf["tensor_model_parallel_size"]) == ("1", "1")
    # the actor's weights stay (its update and the rollout's weight sync use them); its optimizer waits in host memory
    assert worker_report["optimizer_offload"] is True and worker_report["param_offload"] is False
    assert [verb for name, verb in worker_report["moves"] if name == "actor"] == []
    # MEGATRON_RECOMPUTE=full: each layer's forward again in the backward, one layer a checkpoint
    recompute = (tf["recompute_granularity"], tf["recompute_method"], tf["recompute_num_layers"])
    assert recompute == ("full", "uniform", "1")


def test_the_reference_waits_offloaded_between_its_passes_and_gives_the_resident_actors_log_probs(worker_report):
    """With the job's defaults the reference is built with ref.megatron.param_offload (verl's own flag on the running
    worker), moved out at the end of init_model (megatron_workers.py:531-532) and in and out around each
    compute_ref_log_prob (:722-723, :733-734), nothing else: between its passes its weights are in host memory. Both
    passes give exactly the log-probs of the actor, built from the same weights and never offloaded."""
    ref = worker_report["ref"]
    assert ref["param_offload"] is True
    moves = [verb for name, verb in worker_report["moves"] if name == "ref"]
    assert moves == ["offload", "init_model done", "load", "offload", "load", "offload"], worker_report["moves"]
    for log_probs in ref["log_probs"]:
        assert log_probs == worker_report["megatron"]
    assert any(v < -1 for row in worker_report["megatron"] for v in row), "log-probs of real tokens, not zeros"


def test_ppos_critic_frees_its_weights_and_gradients_between_passes_and_gives_the_resident_critics_values(
    worker_report,
):
    """PPO's critic, built by verl's CriticWorker from the job's ALGORITHM=ppo command: critic.megatron.param_offload
    is on, verl frees its DDP buffers' storage (weights and gradients) after init_model and after each compute_values
    (megatron_workers.py:1035-1036, :1078-1084; megatron_utils.py:341-350), through cpu/megatron_shims.py's host copy on
    the CPU. Its values, both passes, are those of the same critic built with param_offload=False, whose buffers stay.
    A host copy that shared the freed storage would give whatever the resized memory holds."""
    critic, resident = worker_report["critic"], worker_report["critic_resident"]
    assert (critic["param_offload"], resident["param_offload"]) == (True, False)
    moves = {name: [verb for n, verb in worker_report["moves"] if n == name] for name in ("critic", "critic_resident")}
    assert moves == {
        "critic": ["offload", "init_model done", "load", "offload", "load", "offload"],
        "critic_resident": ["init_model done"],
    }
    for sizes in critic["buffer_sizes"]:
        assert sizes["param"] and set(sizes["param"]) == {0} and set(sizes["grad"]) == {0}, critic["buffer_sizes"]
    assert all(min(sizes["param"]) > 0 for sizes in resident["buffer_sizes"]), resident["buffer_sizes"]
    mask = worker_report["response_mask"]

    def masked(values):
        return [[v for v, m in zip(row, keep, strict=True) if m] for row, keep in zip(values, mask, strict=True)]

    want = masked(resident["values"][0])
    assert len({v for row in want for v in row}) > 1, "values of the tokens, not a constant"
    for values in critic["values"] + resident["values"][1:]:
        assert masked(values) == want


def test_the_update_recomputes_each_layer_and_gets_the_gradient_it_gets_keeping_every_activation(
    worker_report, tiny_policy, tmp_path
):
    """verl's update_actor on the running worker, with full recompute (the article's) and with MEGATRON_RECOMPUTE=off:
    megatron-core re-runs each of the 2 layers' forward in the backward (CheckpointFunction.backward, counted), through
    cpu/megatron_shims.py's RNG tracker on the CPU, and the step's losses and grad norm are the same as without it.
    Recompute trades compute for memory; it never changes the update."""
    off = run_worker(tmp_path, tiny_policy, "MEGATRON_RECOMPUTE=off")
    assert off["transformer_config"]["recompute_granularity"] == "None"
    full, kept = dict(worker_report["update"]), dict(off["update"])
    assert (full.pop("recomputed_chunks"), kept.pop("recomputed_chunks")) == (2, 0)
    assert full["actor/grad_norm"][0] > 0 and full["actor/pg_loss"] != [0.0], full
    assert full.keys() == kept.keys()
    for key in full:
        assert full[key] == pytest.approx(kept[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_fused_log_probs_reach_the_actor_and_the_reference_and_agree_with_the_logits_path(tmp_path_factory):
    """FUSED_KERNELS on an untied tiny policy at PP=1 (where a tied one keeps verl 0.6.1's fused forward off): verl's
    running actor and reference both take the fused path (the `+` key reaches the reference), through
    cpu/megatron_shims.py's FusedLinearForPPO in place of the Triton kernel (its line in the worker's output), and give
    the unfused path's log-probs within bf16 rounding: the worker runs in bf16, the logits path rounds the logits to
    bf16 before its float32 log-softmax while the fused one computes them in float32 as the kernel does, 0.013 apart
    here, under HF's own bf16-against-float32 gap (0.016); a wrong weight, label shift or temperature puts them whole
    nats apart. The update's policy loss is the same (-1: each run's ratio to its own old log-probs is 1, which holds
    only where the update's fused log-probs are the pass's) and its grad norm within 1% (0.07% measured: the fused
    backward from float32 logits)."""
    from demo.tiny_models import build_policy_model

    tmp = tmp_path_factory.mktemp("fused")
    policy = build_policy_model(tmp / "untied", tied=False)
    runs = {}
    for value in ("off", "on"):
        (tmp / value).mkdir()
        runs[value] = run_worker(tmp / value, policy, f"FUSED_KERNELS={value}")
    off, on = runs["off"], runs["on"]
    assert (on["use_fused_kernels"], on["ref"]["use_fused_kernels"]) == (True, True)
    assert (off["use_fused_kernels"], off["ref"]["use_fused_kernels"]) == (False, False)
    assert (
        megatron_shims.FUSED_STAND_IN_LINE in on["stdout"] and megatron_shims.FUSED_STAND_IN_LINE not in off["stdout"]
    )
    scale = largest_gap({**off, "megatron": off["hf_bfloat16"]}, "hf_float32")
    assert largest_gap({**on, "logits": off["megatron"]}, "logits") < max(0.05, 2 * scale)
    for fused, logits in zip(on["ref"]["log_probs"], off["ref"]["log_probs"], strict=True):
        assert largest_gap({**on, "megatron": fused, "logits": logits}, "logits") < max(0.05, 2 * scale)
    assert on["update"]["actor/pg_loss"] == off["update"]["actor/pg_loss"]
    assert on["update"]["actor/grad_norm"] == pytest.approx(off["update"]["actor/grad_norm"], rel=0.01)
    assert on["update"]["actor/grad_norm"][0] > 0


ADAM_CHECK = r"""
import torch
from cpu import megatron_shims
megatron_shims._adam_with_the_step_in_the_group()
from megatron.core import optimizer
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
ours, torchs = optimizer.Adam(params, lr=0.1), torch.optim.AdamW(twins, lr=0.1)
for step in range(3):
    for group in (params, twins):
        for p in group:
            p.grad = torch.full_like(p, 0.5 + step)
    ours.step(); torchs.step()
    if step == 1:  # a resume in a fresh optimizer, from the saved state
        saved = ours.state_dict()
        ours = optimizer.Adam(params, lr=0.1); ours.load_state_dict(saved)
state = ours.state_dict()
print(sorted(state["state"][0]), state["param_groups"][0]["step"],
      max((a - b).abs().max().item() for a, b in zip(params, twins)))
"""


def test_the_cpu_adam_keeps_fused_adams_state_and_steps_as_torchs_adamw_across_a_resume():
    """megatron-core's FusedAdam paths expect exp_avg and exp_avg_sq per parameter and the step in the group
    (distrib_optimizer.py:612-614, 753-760, 896): the CPU's optimizer keeps that shape, and its updates are torch
    AdamW's, also after a state_dict round trip into a new optimizer (torch's __setstate__ reads a per-parameter
    step)."""
    run = subprocess.run([sys.executable, "-c", ADAM_CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    keys, step, gap = run.stdout.split("]")[0] + "]", *run.stdout.split("]")[1].split()
    assert keys == "['exp_avg', 'exp_avg_sq']" and int(step) == 3
    assert float(gap) < 1e-6


SHIMS_CHECK = (
    SHIM_OUTCOME
    + r"""
import sys
from cpu import megatron_shims

def calls():
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    spec = lambda: gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    yield outcome("te spec", spec)
    yield outcome("cuda buffer", lambda: torch.zeros(2, device=torch.cuda.current_device()))
    yield outcome("cuda tensor", lambda: torch.tensor([1.0], device="cuda"))
    yield outcome("rng", lambda: torch.cuda.get_rng_state())
    yield outcome("value head", lambda: __import__("verl.models.llama.megatron.layers.parallel_linear"))
    # verl's offload of a DDP buffer, from its module: a host copy that survives the buffer's resize to 0
    buffer = torch.ones(3)
    def offload():
        scope = {"__name__": "verl.utils.megatron_utils", "buffer": buffer}
        exec("copy = buffer.data.cpu().pin_memory(); buffer.storage().resize_(0)", scope)
        assert scope["copy"].tolist() == [1.0, 1.0, 1.0]
        buffer.storage().resize_(3)
        buffer.fill_(1.0)
    yield outcome("param offload", offload)

print("before", *calls(), sep="|")
megatron_shims.install()
print("after", *calls(), sep="|")
print("qkv", __import__("megatron.core.models.gpt.gpt_layer_specs", fromlist=["x"])
      .get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True).submodules.self_attention.submodules.linear_qkv.__name__)
"""
)


def test_without_the_megatron_shims_megatron_core_stops_where_they_say_and_with_them_it_goes_on():
    run = subprocess.run([sys.executable, "-c", SHIMS_CHECK], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = (line.split("|")[1:] for line in run.stdout.splitlines() if line.startswith(("before", "after")))
    # torch's CPU build refuses CUDA with "Torch not compiled with CUDA enabled", an AssertionError
    # pinning without an accelerator: "Cannot access accelerator device when none is available", a RuntimeError
    assert before == [
        "te spec: NameError",
        "cuda buffer: AssertionError",
        "cuda tensor: AssertionError",
        "rng: AssertionError",
        "value head: ModuleNotFoundError",
        "param offload: RuntimeError",
    ]
    assert after == [
        "te spec: ok",
        "cuda buffer: ok",
        "cuda tensor: ok",
        "rng: ok",
        "value head: ok",
        "param offload: ok",
    ]
    assert "qkv NormColumnParallelLinear" in run.stdout


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_megatron_cpu_overrides_compose_with_the_default_command_and_pass_verls_checks(mode):
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH="m",
        CONFIG_REWARD_MODEL_PATH="r",
        CONFIG_TRAIN_FILE="train.parquet",
        CONFIG_TEST_FILE="test.parquet",
        CONFIG_OUTPUT_DIR="ckpt",
        ROLLOUT_MODE=mode,
        REWARD_PROMPT_OPENS_THINK="true",
    )
    assert env["STRATEGY"] == "megatron", "the settings block's default"
    module, path, name, overrides = split_command(
        trainer_argv(Settings.from_env(env), extra=megatron_shims.overrides())
    )
    cfg = compose(name, overrides, path)
    validate(cfg)
    assert name == "ppo_megatron_trainer" and cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config.use_cpu_initialization is True
    assert cfg.actor_rollout_ref.ref.megatron.override_transformer_config.use_cpu_initialization is True
    runtime_env = cfg.ray_kwargs.ray_init.runtime_env  # the job's hook, which calls the CPU run's first
    assert (runtime_env.worker_process_setup_hook, runtime_env.env_vars[USER_HOOK]) == (
        PREEMPT_HOOK,
        megatron_shims.HOOK,
    )
    assert rollout_problems(cfg) == []


@pytest.mark.parametrize(
    "recompute, want",
    [
        # the block's default: every layer's forward again in the backward, one layer a checkpoint
        (None, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
        # only recompute_modules (verl's yaml: core_attn); megatron-core wants no method or layer count there
        ("selective", {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None}),
        # verl's own default: every activation kept
        ("off", {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}),
    ],
)
def test_megatron_recompute_reaches_the_actor_the_reference_and_the_critic_through_verls_config(recompute, want):
    """Composed with verl's own Hydra config, PPO (the only algorithm with a critic): the actor's keys are set, the
    reference inherits them (its override_transformer_config is an oc.select of the actor's), and the critic, whose
    block has nulls of its own, gets them set too."""
    env = (
        block_environment()
        | dict(
            CONTAINER="none",
            CONFIG_MODEL_PATH="m",
            CONFIG_REWARD_MODEL_PATH="r",
            CONFIG_TRAIN_FILE="train.parquet",
            CONFIG_TEST_FILE="test.parquet",
            CONFIG_OUTPUT_DIR="ckpt",
            REWARD_PROMPT_OPENS_THINK="true",
            ALGORITHM="ppo",
        )
        | ({"MEGATRON_RECOMPUTE": recompute} if recompute else {})
    )
    _, path, name, overrides = split_command(trainer_argv(Settings.from_env(env), extra=megatron_shims.overrides()))
    cfg = compose(name, overrides, path)
    validate(cfg)
    for engine in (cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.ref.megatron, cfg.critic.megatron):
        tf = engine.override_transformer_config
        assert {key: tf[key] for key in want} == want, engine
        assert list(tf.recompute_modules) == ["core_attn"], "verl's yaml, what selective recomputes"


def test_an_unknown_megatron_recompute_is_refused_naming_the_setting_and_its_values():
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH="m",
        CONFIG_REWARD_MODEL_PATH="r",
        CONFIG_TRAIN_FILE="train.parquet",
        CONFIG_TEST_FILE="test.parquet",
        CONFIG_OUTPUT_DIR="ckpt",
        REWARD_PROMPT_OPENS_THINK="true",
        MEGATRON_RECOMPUTE="partial",
    )
    s = Settings.from_env(env)
    needle = "MEGATRON_RECOMPUTE='partial': use one of auto, full, selective, off"
    assert needle in check(s, check_paths=False)  # the preflight's, before any trainer command is built


CPU = megatron_shims.overrides()


@pytest.mark.parametrize(
    "setting, pp, tied, hidden, extra, want",
    [
        # auto where the kernels could run (Qwen3-4B's shape, PP=2: the last stage's own copy of the tied weight): the
        # Megatron plan keeps verl's logits, faster where they fit (launch/plan/megatron_plan.py)
        ("auto", 2, True, 2560, [], "the Megatron plan's"),
        # PP=1 tied: verl 0.6.1 reads output_layer.weight, None there
        ("auto", 1, True, 2560, [], "tie_word_embeddings"),
        ("on", 1, True, 2560, [], SettingError),
        # untied (Qwen3-8B's shape) at PP=1: its own output weight
        ("auto", 1, False, 4096, [], "the Megatron plan's"),
        ("on", 1, False, 4096, [], True),
        # the Triton kernel asserts hidden % 128; the CPU stand-in has no such limit
        ("auto", 2, True, 64, [], "not a multiple of 128"),
        ("on", 2, True, 64, [], SettingError),
        ("auto", 2, True, 64, CPU, "the Megatron plan's"),
        ("on", 1, False, 64, CPU, True),
        # off is off, whatever the plan
        ("off", 2, True, 2560, [], "FUSED_KERNELS=off"),
    ],
)
def test_fused_kernels_run_where_verl_0_6_1_can_and_on_is_refused_where_it_cannot(
    tmp_path, setting, pp, tied, hidden, extra, want
):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "tie_word_embeddings": tied}))
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH=str(tmp_path),
        CONFIG_REWARD_MODEL_PATH="r",
        CONFIG_TRAIN_FILE="t",
        CONFIG_TEST_FILE="v",
        CONFIG_OUTPUT_DIR="o",
        REWARD_PROMPT_OPENS_THINK="true",
        FUSED_KERNELS=setting,
        ACTOR_PP=str(pp),
    )
    s = Settings.from_env(env)
    if want is SettingError:
        with pytest.raises(SettingError, match=r"FUSED_KERNELS=on, but .*: set FUSED_KERNELS=auto or off") as refused:
            trainer_argv(s, extra=extra)
        assert ("ACTOR_PP=2 or more" in str(refused.value)) == (pp == 1 and tied)
        return
    on, why = fused_kernels(s, extra)
    keys = [a for a in trainer_argv(s, extra=extra) if "use_fused_kernels" in a]
    assert on is (want is True) and keys == (FUSED_OVERRIDES if on else []), why
    assert want is True or want in why


def test_fsdp2_refuses_fused_kernels_on_and_auto_keeps_its_logits_saying_why():
    """docs/training.md: under STRATEGY=fsdp2 the setting is Megatron's; on is refused in the preflight, naming the
    fix, not turned off in silence; auto is off with the reason the preflight prints. An unknown value is refused."""
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH="m",
        CONFIG_REWARD_MODEL_PATH="r",
        CONFIG_TRAIN_FILE="t",
        CONFIG_TEST_FILE="v",
        CONFIG_OUTPUT_DIR="o",
        REWARD_PROMPT_OPENS_THINK="true",
        STRATEGY="fsdp2",
    )
    refused = check(Settings.from_env(env | {"FUSED_KERNELS": "on"}), check_paths=False)
    assert [p for p in refused if p.startswith("FUSED_KERNELS")] == [
        "FUSED_KERNELS=on, but STRATEGY=fsdp2 keeps verl's logits: set FUSED_KERNELS=auto or off, or STRATEGY=megatron"
    ]
    assert not [p for p in check(Settings.from_env(env), check_paths=False) if "FUSED_KERNELS" in p], "auto passes"
    assert fused_kernels(Settings.from_env(env)) == (False, "FUSED_KERNELS=auto: STRATEGY=fsdp2 keeps verl's logits")
    env["STRATEGY"] = "megatron"
    s = Settings.from_env(env | {"FUSED_KERNELS": "yes"})
    assert "FUSED_KERNELS='yes': use one of auto, on, off" in check(s, check_paths=False)
