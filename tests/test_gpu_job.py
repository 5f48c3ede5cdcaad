"""benchmarks.gpu_job: the job as a user runs it (the run script's workstation mode) takes verl 0.6.1's own GRPO steps,
timed by verl, end to end on a CPU (tiny models), so the command behind benchmarks/README.md's GPU figures keeps
working; on a GPU it passes the stand-in's overrides, never the CPU layer's; its readers read the committed results."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import gpu_job, verl_step_hook
from cpu import megatron_shims, verl_shims
from tests.support import REPO


@pytest.mark.parametrize(
    "line, step, some",
    [
        # as Ray forwards the TaskRunner's console logger, colour codes and all
        (
            "\x1b[36m(TaskRunner pid=14435)\x1b[0m step:1 - actor/pg_loss:-0.0112 - timing_s/gen:8.93 - "
            "timing_s/generation_timing/max:6.62 - perf/max_memory_allocated_gb:0.0",
            1,
            {"actor/pg_loss": -0.0112, "timing_s/gen": 8.93, "timing_s/generation_timing/max": 6.62},
        ),
        # numpy 2 (the GPU machine's): verl prints numpy scalars as their repr
        (
            "(TaskRunner pid=2143) step:2 - actor/grad_norm:np.float64(0.6012) - perf/max_memory_allocated_gb:"
            "np.float64(14.2) - critic/score/mean:-0.194",
            2,
            {"actor/grad_norm": 0.6012, "perf/max_memory_allocated_gb": 14.2, "critic/score/mean": -0.194},
        ),
        # a step line printed by verl without Ray's prefix
        ("step:12 - timing_s/step:11.07 - training/epoch:0", 12, {"timing_s/step": 11.07, "training/epoch": 0.0}),
        # anything else verl prints, a validation line's words included
        ("(TaskRunner pid=1) Training Progress: 100%|| 2/2 [00:27<00:00]", None, None),
        ("(TaskRunner pid=1) Total training steps: 2", None, None),
    ],
)
def test_verls_console_line_is_read_into_its_step_and_numbers(line, step, some):
    steps, phases = gpu_job.read_console(line)
    assert phases == []
    if step is None:
        assert steps == []
        return
    (parsed,) = steps
    assert parsed["step"] == step
    assert {k: parsed["metrics"][k] for k in some} == some


def test_phase_lines_give_each_phases_peak_over_the_steps():
    lines = [
        f"(WorkerDict pid=7) {verl_step_hook.PHASE_PREFIX}"
        + json.dumps(
            {
                "phase": phase,
                "call": call,
                "peak_allocated_gib": peak,
                "peak_reserved_gib": peak + 1,
                "seconds": 0.5,
                "role": "actor_rollout",
                "pid": 7,
                "allocated_before_gib": 0.1,
            }
        )
        for phase, call, peak in (
            ("generate_sequences", 1, 3.0),
            ("update_actor", 1, 9.0),
            ("generate_sequences", 2, 4.0),
            ("update_actor", 2, 8.5),
        )
    ]
    phases = [gpu_job.parse_phase_line(line) for line in lines]
    assert gpu_job.parse_phase_line("(WorkerDict pid=7) something else") is None
    summary = gpu_job.summarize([], phases)["phase_memory"]
    assert summary["generate_sequences"]["peak_allocated_gib"] == 4.0
    assert summary["update_actor"]["peak_reserved_gib"] == 10.0
    assert [c["call"] for c in summary["update_actor"]["calls"]] == [1, 2]


@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_a_gpu_run_passes_the_stand_ins_overrides_and_a_cpu_run_the_cpu_layers(strategy):
    """On a GPU: the HF rollout in SGLang's place and the GPU hook, FSDP2 also its attention without flash-attn, none
    of the CPU layer's lean settings or hooks; on a CPU: the CPU layer's own overrides."""
    gpu, cpu = gpu_job.overrides(strategy, "cuda"), gpu_job.overrides(strategy, "cpu")
    assert [o for o, _ in megatron_shims.GPU_OVERRIDES] == gpu[: len(megatron_shims.GPU_OVERRIDES)]
    assert (strategy == "fsdp2") == ("actor_rollout_ref.model.use_remove_padding=False" in gpu)
    assert not {o for o, _ in verl_shims.LEAN_OVERRIDES} & set(gpu)
    hooks = {o.rpartition("=")[2] for o in gpu if "worker_process_setup_hook" in o}
    assert hooks == {megatron_shims.GPU_HOOK}, "the CPU hooks refuse a GPU"
    assert not any("use_cpu_initialization" in o for o in gpu), "a GPU builds its weights on the GPU"
    assert cpu == (megatron_shims.overrides() if strategy == "megatron" else verl_shims.overrides())


PROBE = textwrap.dedent("""
    import json, sys, torch
    original_init = torch.distributed.init_process_group
    from cpu import megatron_shims
    megatron_shims.install_gpu()  # what the GPU hook does in a Ray worker
    from benchmarks import gpu_job, verl_step_hook
    gpu_job.measure_phases()  # the further hook (CPU_RUN_THEN_HOOK); STRATEGY=megatron
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import megatron_workers
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    worker = megatron_workers.ActorRolloutRefWorker
    print(json.dumps({
        "rollout": _ROLLOUT_REGISTRY.get(("hf", "sync")),
        "nccl_kept": torch.distributed.init_process_group is original_init,
        "cpu_calls_added": hasattr(torch.cpu, "max_memory_allocated"),
        "phases_wrapped": {p: getattr(worker, p).__code__.co_name for p in verl_step_hook.PHASES},
        "dispatch_kept": all(hasattr(getattr(worker, p), MAGIC_ATTR) for p in verl_step_hook.PHASES),
    }))
""")


def test_the_gpu_hook_registers_the_hf_rollout_and_the_phase_hook_wraps_each_phase_with_no_cpu_shim():
    env = os.environ | {"STRATEGY": "megatron"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["rollout"] == verl_shims.ROLLOUT_CLASS
    assert seen["phases_wrapped"] == {p: "measured" for p in verl_step_hook.PHASES} and seen["dispatch_kept"]
    assert seen["nccl_kept"] and not seen["cpu_calls_added"]


@pytest.mark.slow
def test_the_job_takes_real_grpo_steps_through_the_run_script_and_reports_timing_and_memory_per_phase(tmp_path):
    """Two real steps of verl's trainer on tiny models through run_grpo_qwen3_4b_mega_verl.sh (FSDP2, sync rollout):
    verl's timing_s breakdown of each, every phase's memory line through the phase hook, the job's trainer command
    with the CPU layer's overrides, the logs at the output's top level."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_job",
        "steps",
        "--shape",
        "tiny",
        "--strategy",
        "fsdp2",
        "--steps",
        "2",
        "--prompts",
        "4",
        "--timeout",
        "840",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    result = json.loads((out / "result.json").read_text())
    assert run.returncode == 0 and result["job"]["rc"] == 0, (result["job"], (out / "run.log").read_text()[-3000:])
    assert [s["step"] for s in result["steps"]] == [1, 2]
    for key in ("gen", "generate_sequences", "reward", "old_log_prob", "ref", "adv", "update_actor", "step"):
        values = result["timing"][f"timing_s/{key}"]
        assert len(values) == 2 and all(v >= 0 for v in values), key
    for s in result["steps"]:
        m = s["metrics"]
        # every response scored by the reward model, not the cut-off penalty: a GRPO group's scores differ
        assert m["critic/score/max"] > m["critic/score/min"] and m["actor/grad_norm"] > 0
    assert set(result["phase_memory"]) == set(verl_step_hook.PHASES)
    assert all(len(p["calls"]) == 2 for p in result["phase_memory"].values())
    command = set(result["trainer_command"])
    hook, others = [[o for o in gpu_job.overrides("fsdp2", "cpu") if ("setup_hook=" in o) is h] for h in (True, False)]
    assert set(others) <= command and "trainer.total_training_steps=2" in command
    # the CPU layer's hook, chained behind the job's own (launch/plan/trainer_command.py, USER_HOOK)
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.JOB_USER_SETUP_HOOK={hook[0].rpartition('=')[2]}" in command
    assert "actor_rollout_ref.actor.strategy=fsdp2" in command
    assert any("composes and passes verl's checks" in line for line in result["preflight"])
    for name in ("run.log", "trainer.log", "data_prep.log"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.parametrize("name", ["verl_step_h100_qwen3_0p6b_1p7b_profile", "verl_step_h100_megatron_qwen3_0p6b_1p7b"])
def test_the_committed_h100_result_is_what_the_parsers_read_from_its_trainer_log(tmp_path, name):
    """benchmarks/README.md quotes results/verl_step_h100_*.json (benchmarks/verl_step.py until this round): its steps,
    timing and memory are what gpu_job's readers make of the trainer log committed beside it."""
    results = REPO / "benchmarks" / "results"
    committed = json.loads((results / f"{name}.json").read_text())
    steps, phases = gpu_job.read_console((results / f"{name}_trainer.log").read_text(errors="replace"))
    again = {"steps": steps, "phases": phases, **gpu_job.summarize(steps, phases)}
    for key in ("steps", "phases", "timing", "perf", "phase_memory"):
        assert again[key] == committed[key], key
    assert committed["status"] == "done" and committed["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert [s["step"] for s in committed["steps"]] == [1, 2]
    config = "ppo_megatron_trainer" if "megatron" in name else "ppo_trainer"
    assert committed["trainer_command"][3] == f"--config-name={config}"
    # verl's own peak, read inside update_actor, is the update phase's as the hook measured it
    assert committed["perf"]["perf/max_memory_allocated_gb"] == [
        c["peak_allocated_gib"] for c in committed["phase_memory"]["update_actor"]["calls"]
    ]
