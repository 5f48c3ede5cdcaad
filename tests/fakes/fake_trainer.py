"""A stand-in for `python3 -m verl.trainer.main_ppo ...` in launch tests: records what it was given and what it saw.

It writes one JSON object to $FAKE_TRAINER_LOG: its argv, the reward URLs and environment it inherited, the health of
every reward server (asked with this job's REWARD_SERVER_TOKEN, as the reward function sends it), and (with the Ray
address from `+ray_kwargs.ray_init.address=`) the alive Ray nodes and GPUs. With FAKE_TRAINER_PROBE_NODES=1 it also
runs one Ray task on every node and records what verl's workers there would see in their environment.
Then it sleeps $FAKE_TRAINER_SLEEP seconds and exits with $FAKE_TRAINER_RC (default 0).
"""

import json
import os
import sys
import time
import urllib.request

NODE_ENV = ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "WANDB_RUN_ID", "WANDB_RESUME")


def probe_nodes(ray) -> dict[str, dict]:
    """What a Ray worker process on each node inherits (verl's TaskRunner and workers run in such processes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read_env():
        return {key: os.environ.get(key) for key in NODE_ENV} | {"token": bool(os.environ.get("REWARD_SERVER_TOKEN"))}

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = [read_env.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    return dict(zip(nodes, ray.get(refs, timeout=120), strict=True))


def main() -> int:
    argv = sys.argv[1:]
    seen = {"argv": argv, "cwd": os.getcwd()}
    for key in ("REWARD_SERVER_URLS", "REWARD_LOG_PATH", "WANDB_MODE", "WANDB_DIR", "PYTHONPATH", "HF_HOME", *NODE_ENV):
        seen[key] = os.environ.get(key)
    seen["REWARD_SERVER_TOKEN"] = bool(os.environ.get("REWARD_SERVER_TOKEN"))  # whether it is set, never its value
    urls = [u for u in (os.environ.get("REWARD_SERVER_URLS") or "").split(",") if u]
    headers = {"Authorization": f"Bearer {os.environ['REWARD_SERVER_TOKEN']}"} if seen["REWARD_SERVER_TOKEN"] else {}
    seen["reward_health"] = []
    for url in urls:
        with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=10) as resp:
            seen["reward_health"].append(resp.status)
    address = next((a.split("=", 1)[1] for a in argv if a.startswith("+ray_kwargs.ray_init.address=")), None)
    if address:
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        seen["ray_nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        seen["ray_gpus"] = ray.cluster_resources().get("GPU", 0)
        if os.environ.get("FAKE_TRAINER_PROBE_NODES") == "1":
            seen["node_env"] = probe_nodes(ray)
        ray.shutdown()
    with open(os.environ["FAKE_TRAINER_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(seen) + "\n")
    print("fake trainer: step 1/1 done", flush=True)
    time.sleep(float(os.environ.get("FAKE_TRAINER_SLEEP", "0")))
    return int(os.environ.get("FAKE_TRAINER_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
