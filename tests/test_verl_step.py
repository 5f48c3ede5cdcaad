"""benchmarks.verl_step: verl 0.6.1's own GRPO step, timed by verl, runs end to end on a CPU (tiny models), so the
command behind benchmarks/README.md's H200 figures keeps working; its hook installs no CPU shim where CUDA is."""

import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks import verl_step, verl_step_hook, verl_step_parts
from cpu import megatron_shims, verl_shims
from tests.support import REPO


@pytest.mark.parametrize(
    "line, step, some",
    [
        # as Ray forwards the TaskRunner's console logger, colour codes and all
        ("\x1b[36m(TaskRunner pid=14435)\x1b[0m step:1 - actor/pg_loss:-0.0112 - timing_s/gen:8.93 - "
         "timing_s/generation_timing/max:6.62 - perf/max_memory_allocated_gb:0.0",
         1, {"actor/pg_loss": -0.0112, "timing_s/gen": 8.93, "timing_s/generation_timing/max": 6.62}),
        # numpy 2 (the GPU machine's): verl prints numpy scalars as their repr
        ("(TaskRunner pid=2143) step:2 - actor/grad_norm:np.float64(0.6012) - perf/max_memory_allocated_gb:"
         "np.float64(14.2) - critic/score/mean:-0.194", 2,
         {"actor/grad_norm": 0.6012, "perf/max_memory_allocated_gb": 14.2, "critic/score/mean": -0.194}),
        # a step line printed by verl without Ray's prefix
        ("step:12 - timing_s/step:11.07 - training/epoch:0", 12, {"timing_s/step": 11.07, "training/epoch": 0.0}),
        # anything else verl prints, a validation line's words included
        ("(TaskRunner pid=1) Training Progress: 100%|| 2/2 [00:27<00:00]", None, None),
        ("(TaskRunner pid=1) Total training steps: 2", None, None),
    ],
)  # fmt: skip
def test_verls_console_line_is_read_into_its_step_and_numbers(line, step, some):
    steps, phases = verl_step.read_console(line)
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
        + json.dumps({"phase": phase, "call": call, "peak_allocated_gib": peak, "peak_reserved_gib": peak + 1,
                      "seconds": 0.5, "role": "actor_rollout", "pid": 7, "allocated_before_gib": 0.1})
        for phase, call, peak in (("generate_sequences", 1, 3.0), ("update_actor", 1, 9.0),
                                  ("generate_sequences", 2, 4.0), ("update_actor", 2, 8.5))
    ]  # fmt: skip
    phases = [verl_step.parse_phase_line(line) for line in lines]
    assert verl_step.parse_phase_line("(WorkerDict pid=7) something else") is None
    summary = verl_step.summarize([], phases)["phase_memory"]
    assert summary["generate_sequences"]["peak_allocated_gib"] == 4.0
    assert summary["update_actor"]["peak_reserved_gib"] == 10.0
    assert [c["call"] for c in summary["update_actor"]["calls"]] == [1, 2]


def test_a_gpu_run_passes_the_engine_overrides_and_its_own_hook_but_not_the_cpu_ones():
    gpu, cpu = verl_step_parts.benchmark_overrides(3, on_cpu=False), verl_step_parts.benchmark_overrides(3, on_cpu=True)
    engine = [o for o, _ in verl_shims.ENGINE_OVERRIDES]
    lean = [o for o, _ in verl_shims.LEAN_OVERRIDES]
    hook = f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={verl_step_hook.HOOK}"
    assert gpu[: len(engine)] == engine and hook in gpu and not set(lean) & set(gpu)
    assert set(lean) <= set(cpu) and hook in cpu
    assert not any(verl_shims.HOOK in o for o in gpu + cpu), "the CPU hook would refuse a GPU"
    assert "trainer.total_training_steps=3" in gpu
    # Ray imports the hook by this path in each worker
    assert verl_step_hook.HOOK == f"{verl_step_hook.__name__}.{verl_step_hook.install.__name__}"


HOOK_PROBE = textwrap.dedent("""
    import json, sys, torch
    if sys.argv[1] == "cuda":
        torch.cuda.is_available = lambda: True  # what the hook sees on a GPU machine
    original_init = torch.distributed.init_process_group
    from benchmarks import verl_step_hook
    verl_step_hook.install()
    import verl.utils.fsdp_utils as fsdp_utils
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import fsdp_workers
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    worker = fsdp_workers.ActorRolloutRefWorker
    print(json.dumps({
        "rollout": _ROLLOUT_REGISTRY.get(("hf", "sync")),
        "nccl_kept": torch.distributed.init_process_group is original_init,
        "cpu_calls_added": hasattr(torch.cpu, "max_memory_allocated"),
        "pinned_offload_kept": fsdp_utils.CPUOffloadPolicy is CPUOffloadPolicy,
        "phases_wrapped": {p: getattr(worker, p).__code__.co_name for p in verl_step_hook.PHASES},
        "dispatch_kept": all(hasattr(getattr(worker, p), MAGIC_ATTR) for p in verl_step_hook.PHASES),
    }))
""")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_hook_registers_the_hf_rollout_and_installs_the_cpu_shims_only_without_cuda(device):
    out = subprocess.run([sys.executable, "-c", HOOK_PROBE, device], capture_output=True, text=True, cwd=REPO,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["rollout"] == verl_shims.ROLLOUT_CLASS
    assert seen["phases_wrapped"] == {p: "measured" for p in verl_step_hook.PHASES} and seen["dispatch_kept"]
    on_cpu = device == "cpu"
    assert seen["nccl_kept"] is not on_cpu
    assert seen["cpu_calls_added"] is on_cpu
    assert seen["pinned_offload_kept"] is not on_cpu


@pytest.mark.slow
def test_the_benchmark_takes_real_grpo_steps_through_verl_and_reports_timing_and_memory_per_phase(tmp_path):
    """Two real steps of verl's trainer on tiny models: verl's timing_s breakdown of each, every phase's memory
    line, the reward server's peak, the job's trainer command with the benchmark's overrides last, nothing left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "benchmarks.verl_step", "--shape", "tiny", "--steps", "2", "--prompts", "4",
           "--timeout", "840", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    result = json.loads((out / "result.json").read_text())
    assert run.returncode == 0 and result["status"] == "done", (result["status"], run.stdout[-3000:])
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
    assert isinstance(result["reward_server_peak_gib"], float)
    tail = verl_step_parts.benchmark_overrides(2, on_cpu=True)
    assert result["trainer_command"][:2] == ["-m", "verl.trainer.main_ppo"]
    assert result["trainer_command"][-len(tail) :] == tail
    assert "actor_rollout_ref.actor.strategy=fsdp2" in result["trainer_command"]
    for name in ("trainer.log", "reward_server.log", "ray_head.log", "trainer_command.txt", "rewards.jsonl"):
        assert (out / "logs" / name).stat().st_size > 0, name
    left = subprocess.run(["pgrep", "-f", result["ray_temp_dir"]], capture_output=True, text=True).stdout
    assert not left.strip(), f"Ray processes of the run still there: {left}"


def test_a_megatron_run_takes_the_hf_rollout_and_the_megatron_hook_and_on_a_cpu_megatrons_cpu_overrides():
    gpu = verl_step_parts.benchmark_overrides(3, on_cpu=False, strategy="megatron")
    cpu = verl_step_parts.benchmark_overrides(3, on_cpu=True, strategy="megatron")
    hook = f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={verl_step_hook.MEGATRON_HOOK}"
    assert verl_shims.ENGINE_OVERRIDES[0][0] in gpu and "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in gpu
    assert hook in gpu and hook in cpu
    assert not any("use_cpu_initialization" in o for o in gpu), "a GPU builds its weights on the GPU"
    assert any("use_cpu_initialization" in o for o in cpu)
    assert not any(megatron_shims.HOOK in o or verl_shims.HOOK in o for o in gpu + cpu), "the CPU hooks refuse a GPU"


@pytest.mark.parametrize("name", ["verl_step_h100_qwen3_0p6b_1p7b_profile", "verl_step_h100_megatron_qwen3_0p6b_1p7b"])
def test_the_committed_h100_result_is_what_the_parsers_read_from_its_trainer_log(tmp_path, name):
    """benchmarks/README.md quotes results/verl_step_h100_*.json: its steps, timing, memory and NVML roles are what
    the parsers make of the trainer log committed beside it."""
    results = REPO / "benchmarks" / "results"
    committed = json.loads((results / f"{name}.json").read_text())
    steps, phases = verl_step.read_console((results / f"{name}_trainer.log").read_text(errors="replace"))
    again = {"steps": steps, "phases": phases, **verl_step.summarize(steps, phases)}
    for key in ("steps", "phases", "timing", "perf", "phase_memory"):
        assert again[key] == committed[key], key
    for row in committed["nvml"]["processes"]:
        assert row["role"] == verl_step_parts.nvml_role(row["pid"], row["cmdline"], committed["reward_server_pid"])
    assert committed["status"] == "done" and committed["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert [s["step"] for s in committed["steps"]] == [1, 2]
    config = "ppo_megatron_trainer" if "megatron" in name else "ppo_trainer"
    assert committed["trainer_command"][3] == f"--config-name={config}"
    # verl's own peak, read inside update_actor, is the update phase's as the hook measured it
    assert committed["perf"]["perf/max_memory_allocated_gb"] == [
        c["peak_allocated_gib"] for c in committed["phase_memory"]["update_actor"]["calls"]
    ]
