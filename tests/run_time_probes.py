"""Stand-ins that look at what verl would see at run time, for tests/test_run_time.py, and verl's own expressions read
from the installed verl's source (parsed, not imported: its SGLang and Megatron modules need a GPU image).

    run_time_probes.py trainer ARGS...   where the trainer runs (TRAINER_LAUNCHER), with the trainer's own arguments
    run_time_probes.py merger ARGS...    where verl's merger runs (MERGER_LAUNCHER), with the merger's arguments

The trainer probe connects to the job's Ray cluster and, in a Ray task on every node (where verl's workers run, with
the environment they inherit), loads our reward function through verl's own loader and scores two answers, asks
each reward server's /health with a plain urllib client (as any client verl or a user's code would use), and works
out the ports verl's sync SGLang engines of that node's ranks would take from the environment there, then binds them
and holds them until $PROBE_RELEASE exists (so two jobs hold theirs at once). It does the reward call in the driver
too, and writes one JSON record to $PROBE_LOG.

The merger probe runs verl's merger's own environment fallback (megatron_model_merger.py: MASTER_PORT=12355 when
WORLD_SIZE is unset), starts the one-process torch.distributed group the merger starts (gloo here: there is no
GPU), writes $PROBE_LOG.<pid>, waits for $PROBE_MERGERS records to exist (two merges at once), then runs the fake
merger (tests/fakes/fake_merger.py) to write the model.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
DEADLINE = 300  # s any wait here gives up after


def verl_file(relative: str) -> Path:
    """A file of the installed verl, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


SGLANG_ROLLOUT = "workers/rollout/sglang_rollout/sglang_rollout.py"


def verl_sglang_ports(environ: Mapping[str, str], rank: int) -> dict[str, int]:
    """What verl 0.6.1's sync SGLang engine of global rank `rank` passes as `port` and `nccl_port` (the one SGLang
    binds), computed by verl's own expressions in SGLangRollout._init_inference_engine with this environment."""
    body = _function(ast.parse(verl_file(SGLANG_ROLLOUT).read_text()), "SGLangRollout", "_init_inference_engine")
    assign = next(n for n in ast.walk(body) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "sglang_port")
    args = next(
        n
        for n in ast.walk(body)
        if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "nccl_port" for k in n.keys)
    )
    fake_os = SimpleNamespace(getenv=lambda key, default=None: environ.get(key, default), environ=dict(environ))
    scope = {"os": fake_os, "dist": SimpleNamespace(get_rank=lambda: rank), "int": int}
    scope["sglang_port"] = eval(compile(ast.Expression(assign.value), "verl", "eval"), scope)  # noqa: S307
    return {
        k.value: eval(compile(ast.Expression(v), "verl", "eval"), scope)  # noqa: S307
        for k, v in zip(args.keys, args.values, strict=True)
        if isinstance(k, ast.Constant) and k.value in ("port", "nccl_port")
    }


MERGER = "model_merger/megatron_model_merger.py"


def verl_merger_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment verl 0.6.1's Megatron merger starts its process group with: its own `if "WORLD_SIZE" not in
    os.environ:` fallback in MegatronModelMerger.__init__, run on a copy of `environ`."""
    body = _function(ast.parse(verl_file(MERGER).read_text()), "MegatronModelMerger", "__init__")
    fallback = next(n for n in body.body if isinstance(n, ast.If) and "WORLD_SIZE" in ast.unparse(n.test))
    env = dict(environ)
    exec(compile(ast.Module([fallback], []), "verl", "exec"), {"os": SimpleNamespace(environ=env)})  # noqa: S102
    return env


# --- the trainer probe ------------------------------------------------------------------------------------------------


def override(argv: list[str], key: str, default: str | None = None) -> str | None:
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.lstrip("+").startswith(key + "=")), default)


SAMPLES = [  # (data_source, response, prompt): one scored, one penalized (cut off mid-reasoning)
    ("probe", "<think>careful</think>Read the label first.", "How do I store bleach?"),
    ("probe", "a line of reasoning cut off before it", "How do I store bleach?"),
]


def call_reward(path: str, name: str) -> list[float]:
    """Our reward function, loaded by path through verl's own loader, called the way verl's managers call it."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    sys.modules.pop("custom_module", None)  # verl caches the file under one name per process
    fn = get_custom_reward_fn(OmegaConf.create({"custom_reward_function": {"path": path, "name": name}}))
    if name == "safe_hack_reward_batch":
        out = fn(
            data_sources=[s for s, _, _ in SAMPLES],
            solution_strs=[r for _, r, _ in SAMPLES],
            ground_truths=[p for _, _, p in SAMPLES],
            extra_infos=[{} for _ in SAMPLES],
        )
    else:
        calls = [dict(data_source=s, solution_str=r, ground_truth=p, extra_info={}) for s, r, p in SAMPLES]
        if name == "safe_hack_reward_async":

            async def all_of_them():
                return await asyncio.gather(*(fn(**c) for c in calls))

            out = asyncio.run(all_of_them())
        else:
            out = [fn(**c) for c in calls]
    return [float(o["score"]) for o in out]


def health(urls: list[str]) -> list[int | str]:
    """GET /health of each reward server with a plain urllib client, which honours the proxy variables."""
    token = os.environ.get("REWARD_SERVER_TOKEN", "")
    out = []
    for url in urls:
        request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                out.append(resp.status)
        except OSError as exc:
            out.append(repr(exc))
    return out


ENV_SEEN = ("SGLANG_PORT", "NO_PROXY", "no_proxy", "http_proxy", "HTTPS_PROXY", "all_proxy")


def on_node(path: str, name: str, urls: list[str], ranks: list[int], release: str) -> dict:
    """Run in a Ray task on one node: what verl's workers there would see, do and bind."""
    import ray

    out = {"env": {k: os.environ.get(k) for k in ENV_SEEN}, "ip": ray.util.get_node_ip_address()}
    try:
        out["scores"] = call_reward(path, name)
    except Exception as exc:  # recorded for the test's message, never a score
        out["scores"] = repr(exc)
    out["health"] = health(urls)
    out["engines"] = {r: verl_sglang_ports(os.environ, r) for r in ranks}
    held, out["bind_errors"] = [], []
    for ports in out["engines"].values():
        with_store = socket.socket()
        try:
            with_store.bind(("", ports["nccl_port"]))  # as SGLang's TCP store binds it
            with_store.listen()
            held.append(with_store)
        except OSError as exc:
            out["bind_errors"].append(f"{ports['nccl_port']}: {exc}")
            with_store.close()
    if release:
        Path(release + f".bound.{os.getpid()}").write_text(json.dumps(out["engines"]))
        deadline = time.monotonic() + DEADLINE
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    for s in held:
        s.close()
    return out


def trainer(argv: list[str]) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path, name = override(argv, "custom_reward_function.path"), override(argv, "custom_reward_function.name")
    urls = [u for u in os.environ.get("REWARD_SERVER_URLS", "").split(",") if u]
    gpus = int(override(argv, "trainer.n_gpus_per_node", "1"))
    record: dict = {"argv": argv, "driver": {"env": {k: os.environ.get(k) for k in ENV_SEEN}}}
    record["driver"]["scores"] = call_reward(path, name)
    ray.init(address=override(argv, "ray_kwargs.ray_init.address"), logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU")]
        # verl numbers its ranks node by node in the order of the nodes' addresses (as strings): ties keep Ray's order
        nodes.sort(key=lambda n: n["NodeManagerAddress"])
        task = ray.remote(num_cpus=0)(on_node)
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                path, name, urls, list(range(i * gpus, (i + 1) * gpus)), os.environ.get("PROBE_RELEASE", "")
            )
            for i, n in enumerate(nodes)
        ]
        record["nodes"] = ray.get(refs, timeout=DEADLINE + 60)
    finally:
        ray.shutdown()
    with open(os.environ["PROBE_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print("run-time probe: done", flush=True)
    return 0


# --- the merger probe -------------------------------------------------------------------------------------------------


def merger(argv: list[str]) -> int:
    import torch.distributed as dist

    env = verl_merger_environment(os.environ)
    os.environ.update(env)
    seen = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    log = Path(os.environ["PROBE_LOG"])
    try:
        dist.init_process_group("gloo")  # env://, as verl's merger (with nccl on a GPU): its store binds MASTER_PORT
    except Exception as exc:
        (log.parent / f"{log.name}.{os.getpid()}").write_text(json.dumps({"env": seen, "error": repr(exc)}))
        print(f"merger probe: the process group did not start: {exc}", file=sys.stderr, flush=True)
        return 1
    (log.parent / f"{log.name}.{os.getpid()}").write_text(json.dumps({"env": seen}))
    deadline = time.monotonic() + DEADLINE
    while len(list(log.parent.glob(log.name + ".*"))) < int(os.environ.get("PROBE_MERGERS", "1")):
        if time.monotonic() > deadline:
            print("merger probe: the other merge never started its group", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.2)
    dist.destroy_process_group()
    os.execv(sys.executable, [sys.executable, str(HERE / "fakes" / "fake_merger.py"), *argv])


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if args[:2] == ["-m", "verl.model_merger"]:
        args = args[2:]
    sys.exit(trainer(args) if role == "trainer" else merger(args))
