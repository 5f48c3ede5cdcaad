"""The main job's embedded default, for a machine without Slurm or GPUs (`make demo`).

Builds a tiny policy and reward model from configs and the demo dataset under demo_out/, then runs the real
run_grpo_qwen3_4b_mega_verl.sh on this machine (no container): its checks and verl's own config checks of the full
GRPO command, a reward server polled until healthy, a real Ray head, and, where the trainer would start, the reward
round trip through verl's reward manager on demo responses (demo/round_trip.py). Exits with the job's code.

    python -m demo.run [--out demo_out]        # what `make demo` runs
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from demo.data import write_demo
from demo.tiny_models import build_policy_model, build_reward_model
from launch.procs import free_port

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "demo_out", help="where the demo assets and logs go")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    start = time.monotonic()
    if not (out / "reward_model" / "config.json").exists():
        build_reward_model(out / "reward_model")
    if not (out / "policy" / "config.json").exists():
        build_policy_model(out / "policy")
    write_demo(out / "data")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a finished marker there would skip the run
    print(f"demo assets ready in {time.monotonic() - start:.1f} s: {out}", flush=True)
    env = dict(
        os.environ,
        CONTAINER="none",
        CONFIG_MODEL_PATH=str(out / "policy"),
        CONFIG_REWARD_MODEL_PATH=str(out / "reward_model"),
        CONFIG_TRAIN_FILE=str(out / "data" / "train.parquet"),
        CONFIG_TEST_FILE=str(out / "data" / "test.parquet"),
        CONFIG_OUTPUT_DIR=str(out / "checkpoints"),
        CONFIG_LOG_DIR=str(out / "logs"),
        CONFIG_REWARD_DEVICE="cpu",
        CONFIG_GPUS_PER_NODE="1",  # declared to Ray only: the demo runs nothing on a GPU
        ACTOR_PP="1",
        CONFIG_NETWORK_INTERFACE=os.environ.get("CONFIG_NETWORK_INTERFACE", "lo"),
        CONFIG_REWARD_SERVER_PORT=str(free_port()),
        RAY_PORT=str(free_port()),
        TRAINER_LAUNCHER=str(REPO / "demo" / "round_trip.py"),
        HF_HOME=str(out / "cache" / "huggingface"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    rc = subprocess.call(["bash", str(REPO / "run_grpo_qwen3_4b_mega_verl.sh")], env=env, cwd=REPO)
    print(
        f"\nmake demo: {'every check passed' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - start:.0f} s"
    )
    print(
        "next, on a cluster: CANARY=1 sbatch run_grpo_qwen3_4b_mega_verl.sh (every GPU stage in one tiny job; docs/operations.md)"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
