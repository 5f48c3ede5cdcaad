"""What verl, SGLang and the cluster do at run time, round 4: a proxy in the environment, verl's sync SGLang ports, a
tensor-parallel rollout beside a reward server, the merger's process group, PPO's critic memory.

Where verl's own code decides (the ports its SGLang engines take, its merger's fallback port), the tests run verl's
own expressions, read from the installed verl 0.6.1's source (tests/run_time_probes.py), on the environment the job
gives verl's workers. Whole jobs go through the real local Slurm (tests/slurm/local_slurm.sh), with real reward
servers and Ray; the trainer and the merger are stand-ins that look at what verl would see (run_time_probes.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from launch.job import node
from launch.plan.gpu_memory import Resident, memory_line, reward_peak, reward_server_peak, trainer_resident
from launch.plan.preflight import compose, split_command
from launch.plan.refusals import check
from launch.plan.settings import Settings
from launch.plan.stage_memory import GIB, WORKER_OVERHEAD, GpuMemoryError, ModelDims, RewardPeak, stage_parameters
from launch.plan.trainer_command import trainer_argv
from tests import run_time_probes
from tests.real_slurm import NODE_SIZE
from tests.support import (
    REPO,
    assert_everything_stopped,
    block_environment,
    free_port,
    job_dir,
    run,
    start_http_server,
)

PROBES = REPO / "tests" / "run_time_probes.py"
FAST = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}
OWN_PORTS = {"CONFIG_REWARD_SERVER_PORT": ""}  # each job's own block, as by default
PROXY_NAMES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def wrapper(bin_dir: Path, name: str, role: str) -> Path:
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{PROBES}" {role} "$@"\n')
    path.chmod(0o755)
    return path


# --- 1. a proxy in the environment ---------------------------------------------------------------------------------


class RefusingProxy:
    """A proxy that counts every connection that reaches it, records its first line, and refuses it (403)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy.seen.append(self.rfile.readline(512).decode(errors="replace").strip())
                self.wfile.write(
                    b"HTTP/1.1 403 Forbidden\r\nContent-Length: 14\r\nConnection: close\r\n\r\nproxy refused\n"
                )

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """`env` as a cluster with a proxy gives it: every proxy variable, both spellings, and no NO_PROXY at all."""
        out = {k: v for k, v in env.items() if k.lower() != "no_proxy"}
        return out | dict.fromkeys(PROXY_NAMES, self.url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy():
    p = RefusingProxy()
    yield p
    p.close()


@pytest.fixture
def probe_job(job, tmp_path, fake_container):
    """The launch tests' job with the trainer probe where the trainer runs, and ports of its own."""
    return (
        job
        | OWN_PORTS
        | {
            "TRAINER_LAUNCHER": str(wrapper(fake_container.bin_dir, "probe-trainer", "trainer")),
            "PROBE_LOG": str(tmp_path / "probe.jsonl"),
        }
    )


def probe_records(env) -> list[dict]:
    return [json.loads(line) for line in Path(env["PROBE_LOG"]).read_text().splitlines()]


def test_the_reward_client_reaches_its_servers_directly_whatever_proxy_the_environment_names(
    tiny_models, tmp_path, proxy, monkeypatch
):
    from reward_score import safe_hack_reward_request as client

    port = free_port()
    server = start_http_server(
        [
            sys.executable,
            str(REPO / "reward_score" / "reward_server.py"),
            "--model-path",
            str(tiny_models.reward_model),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        tmp_path / "server.log",
        port,
    )
    try:
        for name, value in proxy.environment(dict(os.environ)).items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setattr(client, "_session", None)  # a new session, made under this environment
        result = client.safe_hack_reward(
            "probe",
            "<think>ok</think>Read the label.",
            "How do I store bleach?",
            server_url=server.url,
            retry_seconds=5,
        )
    finally:
        server.stop()
    assert result["penalized"] == 0.0 and result["failed"] == 0.0
    assert proxy.seen == []


def test_no_proxy_keeps_what_the_environment_had_and_adds_loopback_the_jobs_hosts_and_rays_own():
    hosts = [node.host_of(h) for h in ("http://10.0.0.7:20016", "10.0.0.1:20000", "10.0.0.7", "n1")]
    assert node.no_proxy(hosts, {"no_proxy": ".corp.example,localhost", "NO_PROXY": "login1"}) == (
        "login1,.corp.example,localhost,127.0.0.1,::1,10.0.0.7,10.0.0.1,n1,"
        "169.254.169.254,metadata.google.internal,usage-stats.ray.io"
    )


def test_a_proxy_the_environment_names_sees_nothing_of_a_whole_two_node_job_on_slurm(
    probe_job, submit, tmp_path, proxy
):
    """The preflight (its reward server, verl's reward loop scoring real rows), the helpers' health polls, Ray, and
    on each node what verl's workers do: our reward function through verl's loader, a plain urllib client."""
    env = proxy.environment(probe_job | {"PREFLIGHT_DATA": "0", "REWARD_START_TIMEOUT": "90"})
    j = submit(env, out=tmp_path / "job.out", options=("--nodes=2", *NODE_SIZE))
    fields = j.wait(600)
    out = j.output()
    assert proxy.seen == [], f"reached the proxy: {proxy.seen[:5]}\n{out[-3000:]}"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "preflight: reward verl's naive reward loop (async rollout) scored 8 validation rows" in out
    (record,) = probe_records(env)
    scored, penalty = record["driver"]["scores"]
    assert len(record["nodes"]) == 2, "a Ray task on each training node"
    for seen in record["nodes"]:
        assert seen["scores"] == [scored, penalty], seen
        assert seen["health"] == [200], "a client that honours the proxy variables, with the job's NO_PROXY"
        assert seen["env"]["http_proxy"] == proxy.url, "the user's proxy stays, for what must reach the outside"
        assert seen["env"]["NO_PROXY"] == seen["env"]["no_proxy"] and "127.0.0.1" in seen["env"]["NO_PROXY"].split(",")
    assert penalty == -40.0 and scored != penalty
    assert_everything_stopped(env)


# --- 2. verl's sync SGLang engines take their ports from SGLANG_PORT ------------------------------------------------


def test_verls_sync_sglang_engine_puts_each_nodes_ranks_on_that_nodes_own_ports():
    """verl's own expressions (sglang_rollout.py: SGLANG_PORT + 2 x rank, nccl_port one above), for the ranks verl
    gives the k-th node, with the SGLANG_PORT the job exports there: inside that node's block, two per GPU."""
    addresses = ["10.0.0.9", "10.0.0.10", "10.0.0.11"]  # as strings, 10.0.0.10 < 10.0.0.11 < 10.0.0.9
    gpus, block_port = 4, 20000 + node.SGLANG_OFFSET
    for k, address in enumerate(sorted(addresses)):
        index = node.training_node_index(address, addresses)
        env = {"SGLANG_PORT": str(node.sglang_port(block_port, index, gpus))}
        ranks = range(k * gpus, (k + 1) * gpus)
        taken = sorted(p for r in ranks for p in run_time_probes.verl_sglang_ports(env, r).values())
        assert taken == list(range(block_port, block_port + 2 * gpus)), (address, taken)
    assert run_time_probes.verl_sglang_ports({}, 0) == {"port": 30000, "nccl_port": 30001}, "unset: every job's"


def test_the_node_order_is_verls_own_placement_group_order(monkeypatch):
    """verl's sort_placement_group_by_node_ip, run on stand-in placement groups: node k of ours is its k-th."""
    import ray
    from verl.single_controller.ray import base

    addresses = ["10.0.0.9", "10.0.0.10", "192.168.1.2", "10.0.0.100"]
    monkeypatch.setattr(
        ray, "nodes", lambda: [{"NodeID": f"n{i}", "NodeManagerAddress": a} for i, a in enumerate(addresses)]
    )
    tables = {f"pg{i}": {"bundles_to_node_id": {0: f"n{i}"}} for i in range(len(addresses))}
    monkeypatch.setattr(base.ray._private.state.state, "placement_group_table", lambda pg_id: tables[pg_id])
    groups = [type("PG", (), {"id": f"pg{i}"})() for i in range(len(addresses))]
    order = [int(pg.id[2:]) for pg in base.sort_placement_group_by_node_ip(groups)]
    assert [node.training_node_index(a, addresses) for a in addresses] == [
        order.index(i) for i in range(len(addresses))
    ]


def test_two_sync_rollout_jobs_on_one_node_hold_their_sglang_ports_at_once(probe_job, submit, tmp_path):
    """Two jobs on n1 with two GPUs each and sync rollout: in a Ray task on the node, each computes with verl's own
    expressions the ports its engines would take from the environment verl's workers get there, binds each
    nccl_port (the TCP store SGLang opens) and holds it until both have: none collides, each is in its job's block."""
    release = tmp_path / "release"
    envs, jobs = [], []
    for name in ("a", "b"):
        env = (
            probe_job
            | FAST
            | {
                "ROLLOUT_MODE": "sync",
                "CONFIG_GPUS_PER_NODE": "2",
                "PROBE_RELEASE": str(release),
                "PROBE_LOG": str(tmp_path / f"probe_{name}.jsonl"),
                "CONFIG_LOG_DIR": str(tmp_path / f"logs_{name}"),
                "CONFIG_OUTPUT_DIR": str(tmp_path / f"ckpt_{name}"),
                "RAY_TMP_DIR": f"{probe_job['RAY_TMP_DIR']}/{name}",
            }
        )
        envs.append(env)
        options = ("--mem=3G", "--cpus-per-task=2", "--gpus-per-node=2", "--nodelist=n1")
        jobs.append(submit(env, out=tmp_path / f"job_{name}.out", options=options))
    deadline = time.monotonic() + 400
    while len(list(tmp_path.glob("release.bound.*"))) < 2:
        finished = [j.id for j in jobs if j.show().get("JobState") not in ("PENDING", "RUNNING")]
        assert not finished and time.monotonic() < deadline, "\n".join(j.output()[-3000:] for j in jobs)
        time.sleep(1)
    release.write_text("go")
    done = [j.wait(300) for j in jobs]
    outs = [j.output() for j in jobs]
    assert [f["JobState"] for f in done] == ["COMPLETED", "COMPLETED"], "\n\n".join(o[-3000:] for o in outs)
    assert [f["NodeList"] for f in done] == ["n1", "n1"]
    bound = []
    for env in envs:
        (seen,) = probe_records(env)[0]["nodes"]
        assert seen["bind_errors"] == [], seen
        ports = sorted(p for engine in seen["engines"].values() for p in engine.values())
        plan = dict(line.split("=", 1) for line in (job_dir(env) / "ports.0").read_text().splitlines())
        base = int(plan["ray_port"])
        assert ports == list(range(int(plan["sglang_port"]), int(plan["sglang_port"]) + 4)), (ports, plan)
        assert base <= min(ports) and max(ports) < base + node.PORT_BLOCK, "in the job's own block"
        bound.append(set(ports))
    assert not bound[0] & bound[1], bound
    for env in envs:
        assert_everything_stopped(env)


# --- 3. a tensor-parallel rollout beside a reward server ------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ({"ROLLOUT_TP": "2"}, True),  # the default reward GPU 0: one GPU of a group has the server's peak less
        ({"ROLLOUT_TP": "2", "CONFIG_REWARD_GPUS": "0,1"}, True),  # Ray, not we, picks which GPUs a group gets
        ({"ROLLOUT_TP": "4"}, True),  # one group over the whole node, one GPU of it with a server
        ({"ROLLOUT_TP": "2", "CONFIG_REWARD_GPUS": "0,1,2,3"}, False),  # every GPU equally less
        ({"ROLLOUT_TP": "2", "CONFIG_REWARD_DEVICE": "cpu"}, False),  # no server on a GPU
        ({"ROLLOUT_TP": "2", "CONFIG_USE_SEPARATE_REWARD_NODE": "true", "SLURM_NNODES": "2"}, False),  # its own node
        ({"ROLLOUT_TP": "2", "ROLLOUT_ENGINE": "vllm"}, False),  # vLLM makes no such check
        ({"ROLLOUT_TP": "2", "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true"}, False),  # SGLang's own switch
        ({}, False),  # ROLLOUT_TP=1: no group to balance
        ({"ROLLOUT_TP": "2", "REWARD": "rule"}, False),  # rule rewards: no reward server at all
    ],
)
def test_a_tensor_parallel_sglang_rollout_beside_reward_servers_on_some_gpus_is_refused(overrides, refused):
    problems = check(Settings.from_env(block_environment() | overrides), check_paths=False)
    matching = [p for p in problems if "The memory capacity is unbalanced" in p]
    assert bool(matching) == refused, problems
    if refused:
        assert "CONFIG_REWARD_GPUS=0,1,2,3" in matching[0] and "CONFIG_USE_SEPARATE_REWARD_NODE=true" in matching[0]


def test_the_reward_servers_peak_follows_its_models_size_and_its_memory_cap(tiny_models):
    from transformers import AutoModelForSequenceClassification

    from reward_score.server import planner

    model = AutoModelForSequenceClassification.from_pretrained(tiny_models.reward_model, num_labels=1)
    c = model.config
    per_token = planner.activation_bytes_per_token(
        c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    )
    peak = reward_server_peak(str(tiny_models.reward_model), {})
    assert peak.weights == 2 * sum(p.numel() for p in model.parameters()), "bf16, as the server loads it on a GPU"
    assert peak.tokens == 32768 and peak.activations == int(planner.ACTIVATION_MARGIN * per_token * 32768)
    capped = reward_server_peak(str(tiny_models.reward_model), {"REWARD_GPU_MEMORY_GIB": "0.01"})
    assert capped.tokens < 32768 and capped.total <= int(0.01 * GIB), "the planner fits its budget under the cap"


def _line_settings(**overrides) -> Settings:
    return Settings.from_env(block_environment() | {"REWARD_PROMPT_OPENS_THINK": "true"} | overrides)


# What the trainer keeps on a GPU at the rollout's start and a reward server's peak, as inputs to the line
RESIDENT = [Resident((("actor weights", 4 * GIB), ("actor gradients", 8 * GIB), ("process", 2 * GIB)))]
PEAK = RewardPeak(weights=3 * GIB, activations=3 * GIB, tokens=32768, cap=0)


def test_rule_rewards_put_no_reward_server_on_any_gpu_and_one_step_off_gives_the_rollout_vllms_own_share():
    rule = _line_settings(REWARD="rule")
    assert reward_peak(rule) is None, "no reward model is sized, even one that is not there"
    line = memory_line(rule, reward_peak(rule), 80 * GIB, RESIDENT)
    assert "no reward server (REWARD=rule)" in line and "0.4 x 66.0 = 26.4 GiB" in line, line
    assert _line_settings(REWARD="rule", TRAINER_MODE="one_step_off").rollout_gpu_memory == 0.9
    assert _line_settings(TRAINER_MODE="one_step_off").rollout_gpu_memory == 0.65


def test_sglangs_share_is_of_the_memory_free_at_its_start_beside_the_trainer_and_the_reward_server():
    """SGLang 0.5.2 sizes weights + KV cache as mem_fraction_static x the memory free when it starts
    (model_runner.py:665-669, 1123-1125): on GPU 0 the trainer's 14 GiB and the reward server's 6 are not free."""
    line = memory_line(_line_settings(), PEAK, 80 * GIB, RESIDENT)
    assert line.startswith(
        "GPU memory per GPU (80.0 GiB, measured here): the trainer keeps 14.0 GiB at the rollout's "
        "start (actor weights 4.0, actor gradients 8.0, process 2.0: verl's offload settings)"
    )
    assert "a reward server ~6.0 GiB peak" in line and "on the head's GPU 0 (CONFIG_REWARD_GPUS)" in line
    assert (
        "SGLang takes ROLLOUT_GPU_MEMORY=0.4 (auto) of the memory free at its start (mem_fraction_static): "
        "0.4 x 60.0 = 24.0 GiB on GPU 0, 0.4 x 66.0 = 26.4 GiB on the 3 other(s)"
    ) in line
    assert "32.0 GiB" not in line, "not a share of the whole GPU"
    # a tensor-parallel group sizes every GPU from its least free one (model_runner.py:665-669, all_reduce MIN)
    assert "on GPU 0 and the rest of its tensor-parallel group" in memory_line(
        _line_settings(ROLLOUT_TP="2", SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK="true"), PEAK, 80 * GIB, RESIDENT
    )
    # without a GPU to measure: the share of what the trainer and the server leave
    login = memory_line(_line_settings(), PEAK, None, RESIDENT)
    assert "40% x (GPU - 20.0 GiB) on GPU 0, 40% x (GPU - 14.0 GiB) on the 3 other(s)" in login
    # pipeline stages that keep different amounts: a range
    stages = [RESIDENT[0], Resident((("actor weights", 5 * GIB), ("process", 2 * GIB)))]
    assert "the trainer keeps 7.0-14.0 GiB" in memory_line(
        _line_settings(CONFIG_REWARD_DEVICE="cpu"), None, 80 * GIB, stages
    )
    assert "0.4 x 66.0-73.0 = 26.4-29.2 GiB on every GPU" in memory_line(
        _line_settings(CONFIG_REWARD_DEVICE="cpu"), None, 80 * GIB, stages
    )


def test_vllms_share_is_of_the_whole_gpu_and_it_refuses_a_gpu_with_less_free():
    """vLLM 0.10.0 takes gpu_memory_utilization x the GPU's total and refuses to start where less is free
    (vllm/v1/worker/gpu_worker.py:163-176)."""
    line = memory_line(_line_settings(ROLLOUT_ENGINE="vllm"), PEAK, 80 * GIB, RESIDENT)
    assert (
        "vLLM takes ROLLOUT_GPU_MEMORY=0.4 (auto) of the whole GPU (gpu_memory_utilization): 32.0 GiB on every "
        "GPU; given back" in line
    )
    full = [Resident((("actor weights", 50 * GIB),))]  # 80 - 50 - 6 = 24 GiB free on GPU 0, under 0.4 x 80
    with pytest.raises(GpuMemoryError) as refused:
        memory_line(_line_settings(ROLLOUT_ENGINE="vllm"), PEAK, 80 * GIB, full)
    assert str(refused.value).startswith(
        "vLLM takes ROLLOUT_GPU_MEMORY=0.4 (auto) of the whole GPU, 32.0 GiB, but what the trainer keeps (50.0 GiB) "
        "and the reward server (6.0 GiB) on GPU 0 leaves 24.0 GiB of this GPU's 80.0 free at its start: vLLM 0.10.0 "
        "refuses to start"
    )
    assert "set ROLLOUT_GPU_MEMORY=0.3 or less, or cap the reward server (REWARD_GPU_MEMORY_GIB)" in str(refused.value)
    # without a GPU to measure nothing is refused: the line gives shares
    assert "40% on every GPU" in memory_line(_line_settings(ROLLOUT_ENGINE="vllm"), PEAK, None, full)


@pytest.mark.parametrize(
    "overrides, share, take",
    [
        ({}, "0.65 (auto)", "52.0 GiB"),  # a reward server may sit on a rollout GPU
        ({"CONFIG_REWARD_DEVICE": "cpu"}, "0.9 (auto)", "72.0 GiB"),  # the GPUs hold vLLM alone
        ({"ROLLOUT_GPU_MEMORY": "0.8"}, "0.8", "64.0 GiB"),
    ],
)
def test_one_step_off_has_rollout_gpus_with_vllm_alone_and_trainer_gpus_without_an_engine(overrides, share, take):
    s = _line_settings(
        TRAINER_MODE="one_step_off", ROLLOUT_MODE="sync", ROLLOUT_GPUS_PER_NODE="1", ROLLOUT_ENGINE="vllm", **overrides
    )
    line = memory_line(s, None if s.reward_device == "cpu" else PEAK, 80 * GIB, [])
    assert (
        f"one_step_off: the 1 rollout GPU(s) a node hold vLLM alone, ROLLOUT_GPU_MEMORY={share} of the whole GPU "
        f"(gpu_memory_utilization): {take}; the 3 trainer GPU(s) a node hold no rollout engine"
    ) in line
    assert "the trainer keeps" not in line and "SGLang" not in line
    if s.reward_device != "cpu":
        assert line.endswith("a rollout GPU with it has 74.0 GiB free at vLLM's start"), line
        # a share over what the server leaves there: vLLM refuses to start on that GPU
        with pytest.raises(
            GpuMemoryError,
            match=r"but the reward server on the head's GPU 0 \(a rollout GPU "
            r"where Ray gives it to the rollout's pool\) leaves 74.0 GiB .* ROLLOUT_GPU_MEMORY=0.92 ",
        ):
            memory_line(replace(s, rollout_gpu_memory_setting="0.95"), PEAK, 80 * GIB, [])


def test_the_trainer_keeps_what_verls_offload_settings_leave_on_the_gpu(tiny_models):
    """trainer_resident, on verl's own composed config: Megatron's actor keeps its bf16 weights and fp32 gradient
    buffer (param_offload off), not its optimizer (optimizer_offload on); an override moves them as verl would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_models.policy)
    dims = ModelDims.from_config(config)
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert stage_parameters(dims, stage=0, stages=1) == sum(p.numel() for p in model.parameters())

    def resident(env: dict, *extra: str):
        s = _line_settings(**env)
        _, path, name, overrides = split_command(trainer_argv(s, extra=list(extra)))
        cfg = compose(name, overrides, path)
        return cfg, trainer_resident(cfg, dims)

    cfg, stages = resident({"ACTOR_PP": "2"})
    assert len(stages) == 2 and dims.layers >= 2
    for k, r in enumerate(stages):
        p = stage_parameters(dims, stage=k, stages=2)
        parts = dict(r.parts)
        assert parts["actor weights"] == 2 * p and parts["actor gradients"] == 4 * p
        assert parts["actor optimizer"] == 0 and parts["process"] == WORKER_OVERHEAD
        # the job's own setting for the reference, whichever it is, read as verl reads it (megatron_workers.py:531)
        assert parts["reference"] == (0 if cfg.actor_rollout_ref.ref.megatron.param_offload else 2 * p)
    _, (kept,) = resident({"ACTOR_PP": "1"}, "actor_rollout_ref.ref.megatron.param_offload=False")
    assert dict(kept.parts)["reference"] == 2 * stage_parameters(dims, stage=0, stages=1)
    _, (offloaded,) = resident(
        {"ACTOR_PP": "1"},
        "actor_rollout_ref.actor.megatron.param_offload=True",
        "actor_rollout_ref.ref.megatron.param_offload=True",
    )
    assert {k: v for k, v in offloaded.parts if v} == {"process": WORKER_OVERHEAD}
    _, (fsdp,) = resident({"STRATEGY": "fsdp2"})
    fsdp = dict(fsdp.parts)
    assert fsdp["actor weights"] == 4 * stage_parameters(dims, stage=0, stages=1) // 4, "fp32, over the 4 GPUs"
    assert "reference" not in fsdp, "FSDP keeps the reference in host memory (fsdp_workers.py:490-492, 518)"


def test_the_docs_memory_table_gives_the_rollouts_share_the_line_computes():
    """docs/training.md's rollout row: the reference job's figures (Qwen3-4B, an 80 GB card's 79.2 GiB, the 1.7B
    reward server's 5.5 GiB estimate from the row below), from what the job's own composed config leaves resident."""
    from tests.test_megatron_memory import QWEN3_4B

    table = (REPO / "docs" / "training.md").read_text().split("## GPU memory per role", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in table.splitlines() if line.startswith("| rollout |"))
    s = _line_settings()
    _, path, name, overrides = split_command(trainer_argv(s))
    held = max(r.total for r in trainer_resident(compose(name, overrides, path), QWEN3_4B)) / GIB
    share, total, server = s.rollout_gpu_memory, 79.2, 5.5
    figure = (
        f"SGLang on an 80 GB card ({total} GiB): {share:g} x ({total} - {held:.1f} GiB the trainer keeps) = "
        f"{share * (total - held):.1f} GiB, {share:g} x {server} = {share * server:.1f} less on GPU 0 beside the "
        f"reward server; vLLM: {share:g} x {total} = {share * total:.1f} GiB"
    )
    assert figure in row, f"docs/training.md's rollout row should say: {figure}"
    line = memory_line(
        s, RewardPeak(int(server * GIB), 0, 0, 0), int(total * GIB), [Resident((("all", int(held * GIB)),))]
    )
    assert f"= {share * (total - held - server):.1f} GiB on GPU 0" in line, "the line computes as the docs say"
    assert f"= {share * (total - held):.1f} GiB on the 3 other(s)" in line


def test_the_preflight_prints_the_rollouts_memory_in_one_line(job, tiny_models, tmp_path):
    # What the login-node preflight prints, without a GPU to measure. A wider MLP in the reward model's config (sized on
    # the meta device: its weights are never read) makes a peak of GiB, to tell apart from the rounding.
    wide = tmp_path / "wide_reward_model"
    shutil.copytree(tiny_models.reward_model, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"intermediate_size": 65536}))
    env = {"CONFIG_REWARD_MODEL_PATH": str(wide), "PREFLIGHT_ONLY": "1", "CONFIG_REWARD_DEVICE": "cuda"}
    result = run(job | FAST | env)
    assert result.returncode == 0, result.stderr[-3000:]
    peak = reward_server_peak(str(wide), {})
    assert peak.total > GIB
    (printed,) = [x for x in result.stdout.splitlines() if x.startswith("preflight: GPU memory per GPU")]
    assert printed.startswith("preflight: GPU memory per GPU (no GPU here: shares of one): the trainer keeps ")
    assert "SGLang takes ROLLOUT_GPU_MEMORY=0.4 (auto) of the memory free at its start" in printed
    held = re.search(r"the trainer keeps ([\d.]+) GiB at the rollout's start \(actor weights", printed).group(1)
    gpu0 = re.search(r"40% x \(GPU - ([\d.]+) GiB\) on GPU 0", printed).group(1)
    assert abs(float(gpu0) - float(held) - peak.total / GIB) <= 0.1, "the reward server's peak is not free on GPU 0"
    # and each pipeline stage's peak in the update, from the policy's config (launch/plan/gpu_memory.update_line)
    (update,) = [x for x in result.stdout.splitlines() if x.startswith("preflight: Megatron update per GPU")]
    assert "(MEGATRON_RECOMPUTE=off, ACTOR_PP=" in update and "stage 0: ~" in update and "logits" in update


# --- 4. the merger's process group ----------------------------------------------------------------------------------


@pytest.fixture
def merge_probe_env(tmp_path, fake_container, tiny_models):
    from tests.test_merge import make_checkpoint

    image = tmp_path / "app.sif"
    image.write_text("fake")
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    return dict(
        os.environ,
        PATH=f"{fake_container.bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        CONTAINER="singularity",
        CONFIG_IMAGE_PATH=str(image),
        CKPT_ROOT=str(tmp_path / "ckpt"),
        MERGER_LAUNCHER=str(wrapper(fake_container.bin_dir, "probe-merger", "merger")),
        FAKE_MERGER_LOG=str(tmp_path / "merger.jsonl"),
        PROBE_LOG=str(tmp_path / "merger_probe"),
        NUMERIC_CHECK="0",  # the stand-in merger's checkpoint has no dist_ckpt to read (tests/test_check_numeric.py)
    )


def merger_records(env) -> list[dict]:
    log = Path(env["PROBE_LOG"])
    return [json.loads(p.read_text()) for p in sorted(log.parent.glob(log.name + ".*"))]


def test_the_merger_gets_a_one_process_world_on_loopback_and_a_port_of_its_own(merge_probe_env, tmp_path):
    """verl's own fallback (MASTER_PORT=12355 when WORLD_SIZE is unset) never fires, and 12355 held by someone else
    changes nothing."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", 12355))
        holder.listen()
        result = run_merge(merge_probe_env, TARGET_DIR=str(tmp_path / "out" / "hf"))
    assert result.returncode == 0, result.stdout + result.stderr
    ((seen,),) = [[r["env"] for r in merger_records(merge_probe_env)]]
    port = int(seen.pop("MASTER_PORT"))
    assert seen == {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert node.PORT_FIRST <= port <= node.PORT_LAST and port != 12355, "below the ephemeral range, the job's own"
    assert (tmp_path / "out" / "hf" / "model.safetensors.index.json").exists()


def run_merge(env, **extra):
    return subprocess.run(
        ["bash", str(REPO / "merge_mcore_to_hf.sh")],
        env=env | extra,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_two_merges_at_once_on_one_node_both_complete(merge_probe_env, submit, tmp_path):
    """Two sbatch merges on n1 whose process groups are up at the same time (each waits for the other's)."""
    env = merge_probe_env | {"PROBE_MERGERS": "2"}
    options = ("--mem=2G", "--cpus-per-task=1", "--gpus-per-node=1", "--nodelist=n1")
    jobs = [
        submit(
            env | {"TARGET_DIR": str(tmp_path / f"hf_{n}")},
            script="merge_mcore_to_hf.sh",
            options=options,
            out=tmp_path / f"merge_{n}.out",
        )
        for n in ("a", "b")
    ]
    done = [j.wait(300) for j in jobs]
    outs = [j.output() for j in jobs]
    assert [(f["JobState"], f["ExitCode"]) for f in done] == [("COMPLETED", "0:0")] * 2, "\n\n".join(outs)
    assert [f["NodeList"] for f in done] == ["n1", "n1"]
    records = merger_records(env)
    assert len(records) == 2 and not any("error" in r for r in records), records
    assert len({r["env"]["MASTER_PORT"] for r in records}) == 2
    for n in ("a", "b"):
        assert (tmp_path / f"hf_{n}" / "model.safetensors.index.json").exists()


# --- 5. PPO's critic --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, key",
    [("megatron", "critic.megatron.optimizer_offload"), ("fsdp2", "critic.model.fsdp_config.optimizer_offload")],
)
def test_ppos_critic_keeps_its_optimizer_in_host_memory_between_updates_like_the_actor(tiny_models, strategy, key):
    env = block_environment() | {
        "ALGORITHM": "ppo",
        "STRATEGY": strategy,
        "CONFIG_MODEL_PATH": str(tiny_models.policy),
        "CONFIG_TRAIN_FILE": "/data/train.parquet",
        "CONFIG_TEST_FILE": "/data/test.parquet",
    }
    _, path, name, overrides = split_command(trainer_argv(Settings.from_env(env)))
    cfg = compose(name, overrides, path)
    actor_key = "megatron.optimizer_offload" if strategy == "megatron" else "fsdp_config.optimizer_offload"
    node_value = cfg
    for part in key.split("."):
        node_value = node_value[part]
    assert node_value is True
    actor = cfg.actor_rollout_ref.actor
    for part in actor_key.split("."):
        actor = actor[part]
    assert actor is True


def test_the_docs_memory_table_says_what_the_trainer_command_offloads():
    """docs/training.md's memory table: each role's row names the offload override the command sets for it."""
    table = (REPO / "docs" / "training.md").read_text().split("## GPU memory per role", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    # the block's model path is a cluster's, with no chat template here to read REWARD_PROMPT_OPENS_THINK=auto from
    argv = trainer_argv(
        Settings.from_env(block_environment() | {"ALGORITHM": "ppo", "REWARD_PROMPT_OPENS_THINK": "true"})
    )
    for role, override in (
        ("actor", "actor_rollout_ref.actor.megatron.optimizer_offload=True"),
        ("ref", "actor_rollout_ref.ref.megatron.param_offload=True"),
        ("critic (PPO)", "critic.megatron.param_offload=True"),
        ("critic (PPO)", "critic.megatron.optimizer_offload=True"),
    ):
        assert override in argv
        assert f"`{override}`" in rows[role], rows.get(role)
