"""A stand-in for `python3 -m verl.trainer.main_ppo ...` in launch tests: records what it was given and what it saw.

It writes one JSON object to $FAKE_TRAINER_LOG: its argv, the reward URLs and environment it inherited, the health of
every reward server, and (with the Ray address from `+ray_kwargs.ray_init.address=`) the alive Ray nodes and GPUs.
Then it sleeps $FAKE_TRAINER_SLEEP seconds and exits with $FAKE_TRAINER_RC (default 0).
"""

import json
import os
import sys
import time
import urllib.request


def main() -> int:
    argv = sys.argv[1:]
    seen = {"argv": argv, "cwd": os.getcwd()}
    for key in ("REWARD_SERVER_URLS", "REWARD_LOG_PATH", "WANDB_MODE", "WANDB_DIR", "PYTHONPATH", "HF_HOME"):
        seen[key] = os.environ.get(key)
    urls = [u for u in (os.environ.get("REWARD_SERVER_URLS") or "").split(",") if u]
    seen["reward_health"] = []
    for url in urls:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            seen["reward_health"].append(resp.status)
    address = next((a.split("=", 1)[1] for a in argv if a.startswith("+ray_kwargs.ray_init.address=")), None)
    if address:
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        seen["ray_nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        seen["ray_gpus"] = ray.cluster_resources().get("GPU", 0)
        ray.shutdown()
    with open(os.environ["FAKE_TRAINER_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(seen) + "\n")
    print("fake trainer: step 1/1 done", flush=True)
    time.sleep(float(os.environ.get("FAKE_TRAINER_SLEEP", "0")))
    return int(os.environ.get("FAKE_TRAINER_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
