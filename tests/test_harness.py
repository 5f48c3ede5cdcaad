"""The test harness itself: tiny models, the fake container, real Slurm, process helpers, isolation, verl on CPU.

Every other test builds on these; if one of them is wrong, the rest prove nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.plan import procs
from tests.support import REPO, free_port, http_get, start_http_server, start_process, stop_ray, wait_for_http

# --- tiny models ---------------------------------------------------------------------------------------------


def test_think_tags_are_single_non_special_tokens_that_survive_skip_special_tokens(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.reward_model)
    text = "<think>reasoning here</think>the answer<|im_end|><|endoftext|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<think>") in ids
    assert tok.convert_tokens_to_ids("</think>") in ids
    assert "<think>" not in tok.all_special_tokens and "</think>" not in tok.all_special_tokens
    # verl's reward managers decode exactly like this: the tags stay, EOS and padding go.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>reasoning here</think>the answer"
    assert tok.decode(ids) == text


def test_tiny_tokenizer_round_trips_japanese_text(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.policy)
    text = "安全な回答を書いてください。🙂 ok"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_templates_match_qwen3_and_the_thinking_policy(tiny_models):
    from transformers import AutoTokenizer

    rm = AutoTokenizer.from_pretrained(tiny_models.reward_model)
    policy = AutoTokenizer.from_pretrained(tiny_models.policy)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert rm.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    prompt = policy.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert rm.pad_token == "<|endoftext|>" and rm.eos_token == "<|im_end|>"


def test_tiny_reward_model_loads_and_scores_a_chat_templated_text(tiny_models):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_models.reward_model).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id

    def text(answer: str) -> str:
        chat = [{"role": "user", "content": "Is this safe?"}, {"role": "assistant", "content": answer}]
        return tok.apply_chat_template(chat, tokenize=False)

    texts = [text("Yes, it is safe."), text("No. " * 20)]
    with torch.inference_mode():
        single = [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]
        tok.padding_side = "right"
        batch = model(**tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits[:, 0]
    assert single[0] != pytest.approx(single[1], abs=1e-3), "different answers should get different scores"
    # Right padding with pad_token_id set: the score is read at the last real token, so batching changes nothing.
    assert batch.tolist() == pytest.approx(single, abs=1e-5)


def test_tiny_policy_loads_as_a_causal_lm(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models.policy)
    assert model.config.tie_word_embeddings and model.config.hidden_size == 64 and model.config.num_hidden_layers == 2


# --- the fake container, real Slurm -----------------------------------------------------------------------------


def test_singularity_exec_runs_the_command_in_its_pwd_with_its_env_and_fails_as_the_real_one_would(
    fake_container, tmp_path
):
    image = tmp_path / "app.sif"
    image.write_text("fake image")
    cmd = [
        "exec",
        "--nv",
        "--bind",
        f"{tmp_path}:{tmp_path}",
        "--pwd",
        str(tmp_path),
        "--env",
        "GREETING=hi",
        str(image),
        "bash",
        "-c",
        'echo "$GREETING $PWD"',
    ]
    for prog in ("singularity", "apptainer"):
        assert subprocess.run([prog, *cmd], capture_output=True, text=True).stdout == f"hi {tmp_path}\n"
    assert fake_container.calls("apptainer")[0]["argv"] == cmd
    # Where the real runtime refuses to start the container: exit 255 and its FATAL line, nothing run.
    for broken, needle in (
        (["exec", str(tmp_path / "none.sif"), "touch", "ran"], "could not open image"),
        (["exec", "--bind", "/nowhere/data", str(image), "touch", "ran"], "mount /nowhere/data"),
        (["exec", "--pwd", "/nowhere", str(image), "touch", "ran"], "could not set working directory /nowhere"),
    ):
        result = subprocess.run(["singularity", *broken], capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 255 and "FATAL:" in result.stderr and needle in result.stderr, result.stderr
    assert not (tmp_path / "ran").exists()
    forced = subprocess.run(["singularity", *cmd], env=dict(os.environ, FAKE_SINGULARITY_RC="3"))
    assert forced.returncode == 3, "a forced exit code runs nothing"


def test_the_local_slurm_cluster_hands_out_two_nodes_and_their_gpus(slurm_cluster, tmp_path):
    """What the launch tests stand on: sbatch and srun of the real Slurm, one task per node, Slurm's node names, and
    GPUs counted from the placeholder devices (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES)."""
    from tests.real_slurm import sbatch

    script = tmp_path / "probe.sh"
    script.write_text(
        "#!/bin/bash\nsrun --ntasks-per-node=1 bash -c "
        "'echo $SLURM_PROCID $SLURMD_NODENAME $SLURM_GPUS_ON_NODE $CUDA_VISIBLE_DEVICES' | sort\n"
    )
    job = sbatch(
        os.environ,
        str(script),
        cwd=tmp_path,
        out=tmp_path / "probe.out",
        options=("--nodes=2", "--mem=1G", "--gpus-per-node=2"),
    )
    fields = job.wait(120)
    assert fields["JobState"] == "COMPLETED", job.output()
    lines = [line.split() for line in job.output().splitlines()]
    assert [line[:3] for line in lines] == [["0", "n1", "2"], ["1", "n2", "2"]], job.output()
    for *_, visible in lines:
        # The GPUs Slurm gave this job (not always the first ones: another job may hold those), as indices.
        gpus = visible.split(",")
        assert len(set(gpus)) == 2 and set(gpus) <= {"0", "1", "2", "3"}, job.output()


# --- processes, ports, isolation -------------------------------------------------------------------------------


def test_start_http_server_waits_until_the_port_answers(tmp_path):
    port = free_port()
    server = start_http_server(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "http.log", port, health="/"
    )
    try:
        assert http_get(server.url + "/")[0] == 200
    finally:
        assert server.stop() is not None
    assert not server.alive()


def test_wait_for_http_fails_fast_with_the_log_when_the_process_dies(tmp_path):
    proc = start_process(
        [sys.executable, "-c", "import sys; print('boom: bad model path'); sys.exit(3)"], tmp_path / "x.log"
    )
    with pytest.raises(RuntimeError, match="boom: bad model path"):
        wait_for_http(proc, f"http://127.0.0.1:{free_port()}/health", timeout=30)


def test_a_server_that_never_gets_healthy_times_out_naming_the_url_and_is_stopped(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}/health"
    started = []
    real_start = procs.start_process
    monkeypatch.setattr(procs, "start_process", lambda *a, **k: started.append(real_start(*a, **k)) or started[-1])
    with pytest.raises(TimeoutError, match=f"the silent one was not healthy after 1 s \\(GET {url}"):
        procs.start_server(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            tmp_path / "silent.log",
            url,
            1,
            name="the silent one",
        )
    assert started[0].poll() is not None, "a server that never got healthy must not be left running"


def test_caches_and_home_point_into_the_test_tmp_dir(isolated_env):
    for key in ("HOME", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "WANDB_DIR"):
        assert Path(os.environ[key]).is_relative_to(isolated_env), key
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_real_ray_head_starts_on_loopback_in_a_private_temp_dir(ray_tmp, tmp_path):
    ray = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    start = [
        ray,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--temp-dir={ray_tmp}",
        "--num-cpus=1",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    try:
        subprocess.run(start, check=True, capture_output=True, timeout=120)
        # The head answers `ray status` with "No cluster status" for a few seconds: poll, as the launch scripts do.
        deadline, out = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "Active:" not in out:
            out = subprocess.run([ray, "status", f"--address=127.0.0.1:{port}"], capture_output=True, text=True).stdout
            time.sleep(0.5)
        active = out.split("Active:")[1].split("Pending:")[0]
        assert len(re.findall(r"\bnode_", active)) == 1, out
        assert any(ray_tmp.glob("session_*")), "Ray must write its session under the given temp dir"
    finally:
        assert not stop_ray(ray_tmp), "this test's Ray head outlived SIGKILL"


# --- verl 0.6.1 on CPU ---------------------------------------------------------------------------------------


def test_verl_composes_the_megatron_trainer_config_with_an_override():
    import verl
    from hydra import compose, initialize_config_module

    assert verl.__version__ == "0.6.1"
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=["actor_rollout_ref.rollout.name=sglang"])
    assert cfg.actor_rollout_ref.rollout.name == "sglang"
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"


def test_repository_layout_has_every_entry_point():
    for name in (
        "run_grpo_qwen3_4b_mega_verl.sh",
        "helper_grpo_qwen3_4b.sh",
        "merge_mcore_to_hf.sh",
        "verl_app.def",
        "reward_score/reward_server.py",
        "reward_score/safe_hack_reward_request.py",
        "data_prep",
        "README.md",
        "README.ja.md",
        ".ci/run",
    ):
        assert (REPO / name).exists(), name


def test_nothing_in_the_repository_points_outside_it():
    """A user's clone has only this repository: docs live in docs/, never in a sibling folder."""
    outside = "../" + "shared"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        path = REPO / name
        if path.is_file() and path.suffix in (".py", ".md", ".sh", ".txt", ".toml", ".def", ""):
            assert outside not in path.read_text(errors="replace"), f"{name} cites {outside}"


def test_a_port_of_the_jobs_block_held_by_another_jobs_process_is_not_this_jobs_leak(tmp_path):
    """assert_everything_stopped's ports: a listener that inherited this job's JOB_LOG_DIR is the job's; one that did
    not (another test's job, planned on the same free block) is not."""
    from tests.support import listening_elsewhere

    logs = tmp_path / "logs" / "1"
    serve = (
        "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(120)"
    )
    ours = subprocess.Popen(
        [sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True, env=dict(os.environ, JOB_LOG_DIR=str(logs))
    )
    other = subprocess.Popen(
        [sys.executable, "-c", serve],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JOB_LOG_DIR=str(tmp_path / "logs" / "2")),
    )
    try:
        ports = [int(ours.stdout.readline()), int(other.stdout.readline())]
        assert listening_elsewhere(ports, logs) == [ports[1]]
    finally:
        ours.kill()
        other.kill()


# --- the tiers -------------------------------------------------------------------------------------------------


def test_the_makefiles_two_tiers_hold_every_test_once_and_the_jobs_are_in_the_slow_one():
    """`make test` runs FAST_TIER, then SLOW_TIER: together they must select the whole suite, each test once, or a test
    would silently never run in CI. Two collections, in parallel (~10 s each on 2 cores)."""
    makefile = (REPO / "Makefile").read_text()
    tiers = [re.search(rf"^{name} := (.+)$", makefile, re.M).group(1) for name in ("FAST_TIER", "SLOW_TIER")]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-p", "no:xdist"]
    runs = [subprocess.Popen([*cmd, "-m", tier], cwd=REPO, stdout=subprocess.PIPE, text=True) for tier in tiers]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    counts = [re.search(r"^(\d+)/(\d+) tests collected", out, re.M) for out in outputs]
    assert all(counts), f"a tier collected nothing (-m {tiers}):\n" + "\n".join(out[-2000:] for out in outputs)
    (fast, total), (slow, total_again) = [tuple(map(int, c.groups())) for c in counts]
    assert total == total_again and fast + slow == total and fast > 0 and slow > 0, (fast, slow, total)
    fast_ids, slow_ids = [{line for line in out.splitlines() if "::" in line} for out in outputs]
    assert not fast_ids & slow_ids and len(fast_ids) == fast and len(slow_ids) == slow
    assert any("test_slurm_jobs.py::" in i for i in slow_ids) and any("test_settings.py::" in i for i in fast_ids)
