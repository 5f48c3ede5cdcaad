"""The README's quickstart, run as written: the command lines of its first bash block, read from README.md, in a fresh
clone on the local Slurm (tests/slurm/local_slurm.sh), one after the other as a user would, each waited for.

What a user would do around them is done here the same way: the models are put where the settings block's defaults
look for them (`models/...`, tiny ones), `prompts.jsonl` holds demo prompts, and the node sizes go on each sbatch
command line (the test nodes are smaller than the script's #SBATCH lines ask for). Two lines cannot run here: the
image build (no Singularity: a file stands in for the image at the path the line builds, and the fake container runs
it) and the editor (the edits a user makes for this machine are environment variables, which the block reads the same
way: one GPU per node, the reward model on the CPU, the block's default strategy and rollout, Megatron and async, with
a tiny workload). Everything else is real, verl 0.6.1's own Megatron workers and merger included, on the CPU: each line
that runs the job gets cpu/megatron_shims.py's Hydra overrides after it (as the README says extra overrides may
follow), the merge verl's merger with the same adaptations (MERGER_LAUNCHER=cpu/megatron_merger), and the training
line a step count (2, for what verl would compute from the data).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from demo.data import demo_examples
from tests import real_slurm
from tests.support import AGENT_LOOP_TIMING, MEGATRON_TRAINER, REPO, real_trainer_args

README = REPO / "README.md"


def quickstart_lines() -> list[str]:
    """The commands of the quickstart's bash block, without their comments."""
    section = README.read_text().split("## Quickstart on a cluster", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def healthy_lines(after: str = "**A healthy job** prints") -> list[re.Pattern]:
    """The README's first text block after `after` (by default the 'A healthy job prints' block), each line a pattern:
    <...> and ... stand for anything."""
    block = README.read_text().split(after, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    patterns = []
    for line in block.splitlines():
        pattern = re.sub(r"<[^>]*>", ".+?", re.escape(line).replace(r"\<", "<").replace(r"\>", ">"))
        patterns.append(re.compile(pattern.replace(r"\.\.\.", ".*")))
    return patterns


def assert_in_order(patterns: list[re.Pattern], text: str) -> None:
    """Each pattern on a line of its own, in this order; Ray's colours (what a terminal shows as colour) aside."""
    lines, at = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines(), 0
    for pattern in patterns:
        found = next((i for i in range(at, len(lines)) if pattern.search(lines[i])), None)
        assert found is not None, (
            f"the README's healthy-job line {pattern.pattern!r} is not in the output (after line "
            f"{at}); the lines from there:\n" + "\n".join(lines[at : at + 40])
        )
        at = found + 1


def submitted(run: subprocess.CompletedProcess, env) -> real_slurm.Job:
    match = re.search(r"Submitted batch job (\d+)", run.stdout)
    assert run.returncode == 0 and match, run.stdout + run.stderr
    job = real_slurm.Job(match.group(1), Path(), dict(env))
    job.out = Path(job.show()["StdOut"])
    return job


def test_the_readmes_quickstart_commands_run_as_written_to_a_trained_and_merged_model(
    tmp_path, tiny_models, fake_container, slurm_cluster
):
    repo = real_slurm.copy_tree(REPO, tmp_path / "repo")  # a fresh clone: no logs, data or models yet
    (repo / "models").mkdir()
    (repo / "models" / "Qwen3-4B-Thinking-2507").symlink_to(tiny_models.policy)
    (repo / "models" / "Unsafe-Reward-Qwen3-1.7B").symlink_to(tiny_models.reward_model)
    prompts = "".join(f'{{"prompt": "{row["prompt"]}"}}\n' for row in demo_examples(160))
    (repo / "prompts.jsonl").write_text(prompts, encoding="utf-8")
    bin_dir = fake_container.bin_dir
    ray_tmp = Path(tempfile.mkdtemp(prefix="rayq", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "WANDB_DIR"}
    env |= MEGATRON_TRAINER | {
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # the edits of step 3, for this machine: one GPU per node, no GPU for the reward model, one network
        "CONFIG_GPUS_PER_NODE": "1",
        "ACTOR_PP": "1",
        "CONFIG_REWARD_DEVICE": "cpu",
        "CONFIG_NETWORK_INTERFACE": "lo",
        "TRAINER_LOGGER": "[console,wandb]",
        "RAY_TMP_DIR": str(ray_tmp),
        "ROLLOUT_MODE": "async",  # the settings block's default: verl's agent loop and its reward loop
        "MERGER_LAUNCHER": str(repo / "cpu" / "megatron_merger"),  # verl's Megatron merger, with the CPU's shims
    }
    cpu_args = " ".join(real_trainer_args(strategy="megatron"))
    lines, jobs, ran = quickstart_lines(), [], []
    try:
        for line in lines:
            if line.startswith("cd ") or line.startswith("$EDITOR "):
                continue  # every line runs in the clone's root; step 3's edits are in `env`
            if line.startswith("sudo singularity build "):
                image, definition = line.split()[3:5]
                assert (repo / definition).is_file(), line
                (repo / image).write_text("stands in for the image singularity would build here")
                ran.append("build")
                continue
            command = re.sub(r"\bsbatch ", f"sbatch {' '.join(real_slurm.NODE_SIZE)} ", line, count=1)
            if "run_grpo_qwen3_4b_mega_verl.sh" in line:
                steps = " trainer.total_training_steps=2" if line.startswith("sbatch ") else ""
                command += f" {cpu_args}{steps}"
            run = subprocess.run(
                ["bash", "-c", command],
                cwd=repo,
                env=real_slurm.slurm_env(env),
                capture_output=True,
                text=True,
                timeout=600,
            )
            if "sbatch" not in line:
                assert run.returncode == 0, f"{line}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
                ran.append(line)
                continue
            job = submitted(run, env)
            jobs.append(job)
            fields = job.wait(1200)
            assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{line}\n{job.output()[-4000:]}"
            ran.append(line)
        out = {line: job.output() for line, job in zip([r for r in ran if "sbatch" in r], jobs, strict=True)}
        preflight, canary, train, merge = (
            next(r for r in ran if key in r)
            for key in ("PREFLIGHT_ONLY=1", "CANARY=1", "sbatch run_grpo", "merge_mcore")
        )
    finally:
        real_slurm.cancel_all(jobs)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert ran[0] == "build" and len(ran) == 6, ran
    assert (repo / "data" / "train.parquet").is_file() and (repo / "data" / "test.parquet").is_file()
    assert ran.index(preflight) < ran.index(canary) < ran.index(train) < ran.index(merge)
    assert "canary: every stage passed" in out[canary]
    assert_in_order(healthy_lines("A passing canary"), out[canary])  # the README's table, as the canary printed it
    train_job = jobs[[r for r in ran if "sbatch" in r].index(train)]
    assert train_job.out == repo / "logs" / f"grpo-qwen3-4b-{train_job.id}.out", "the README's output file"
    assert_in_order(healthy_lines(), out[train])  # the default strategy's: Megatron's config, as the README shows
    logs = repo / "logs" / train_job.id
    assert {"trainer.log", "trainer_command.txt", "ray_head.log", "wandb"} <= {p.name for p in logs.iterdir()}
    assert any(p.name.startswith("reward_server_n") for p in logs.iterdir()), "one log per reward server"
    # verl's own trainer trained those steps, calling our reward function on the job's reward server
    assert "Training from scratch" in out[train] and "training/global_step:2" in out[train], out[train][-3000:]
    assert len((logs / "rewards.jsonl").read_text().splitlines()) >= 4, "2 steps x 2 responses scored"
    # async rollout, as the block defaults to: verl's agent loop generated (its timing is in each step's line) and its
    # reward loop awaited our coroutine function through the naive manager
    command = (logs / "trainer_command.txt").read_text().splitlines()
    for override in (
        "actor_rollout_ref.rollout.mode=async",
        "reward_model.reward_manager=naive",
        "custom_reward_function.name=safe_hack_reward_async",
    ):
        assert override in command, command
    steps = [line for line in out[train].splitlines() if "training/global_step:" in line]
    assert len(steps) == 2 and all(AGENT_LOOP_TIMING in s for s in steps), steps
    assert "ppo_megatron_trainer" in " ".join(command) and "cpu.megatron_shims.install" in " ".join(command)
    assert (checkpoints := repo / "checkpoints" / "qwen3_4b_grpo_megatron" / "global_step_2" / "actor").is_dir()
    assert (checkpoints / "dist_ckpt" / "metadata.json").is_file(), "verl's Megatron checkpoint (megatron-core's)"
    assert "-m verl.model_merger merge --backend megatron" in out[merge], "verl's Megatron merger on what verl saved"
    checkpoints = repo / "checkpoints" / "qwen3_4b_grpo_megatron"
    assert (checkpoints / "TRAINING_DONE").exists() and (
        checkpoints / "latest_checkpointed_iteration.txt"
    ).read_text() == "2"
    merged = repo / "hf_models" / "qwen3_4b_grpo_megatron-step2"
    assert (merged / "config.json").is_file(), out[merge][-3000:]
    assert f"done: {merged}" in out[merge]
