#!/usr/bin/env python3
"""The trainer's stand-in for the embedded default (`make demo`): everything of a GRPO step that runs without a GPU.

Called by helper_grpo_qwen3_4b.sh exactly where the trainer would be, with the trainer's own arguments
(`-m verl.trainer.main_ppo --config-path=config --config-name=... overrides...`), it:
1. composes that config with verl 0.6.1's Hydra config and runs verl's own checks (as the preflight does);
2. connects to this job's Ray cluster at the address the trainer would use, and counts its nodes;
3. builds verl's reward manager from that config (our reward file, loaded by path as verl loads it) and scores
   demo responses for validation prompts through the real reward server: a DataProto as verl builds it after rollout.
It exits 0 only when every step passed, and says what would need GPUs.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.preflight import compose, reward_round_trip, split_command, validate  # noqa: E402


def main(argv: list[str]) -> int:
    import ray

    t0 = time.monotonic()
    module, path, name, overrides = split_command(argv)
    config = compose(name, overrides, path)
    validate(config)
    print(f"[ok] {module} --config-name={name}: {len(overrides)} overrides compose and pass verl's own checks")

    address = next((o.split("=", 1)[1] for o in overrides if o.startswith("+ray_kwargs.ray_init.address=")), None)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    print(f"[ok] connected to this job's Ray cluster at {address}: {nodes} node(s), {ray.cluster_resources()}")
    ray.shutdown()

    lines = reward_round_trip(config)
    print(f"[ok] {lines[0]}")
    for line in lines[1:]:
        print(f"   {line}")
    print(f"demo round trip finished in {time.monotonic() - t0:.1f} s")
    print(
        "needs GPUs, not run here: SGLang rollout, Megatron actor/ref updates, checkpoints "
        "(verl 0.6.1 has no CPU rollout engine).\n"
        "to train for real: build the image (sudo singularity build verl_app.sif verl_app.def), build data with "
        "python -m data_prep.build, edit the settings at the top of run_grpo_qwen3_4b_mega_verl.sh, then "
        "sbatch run_grpo_qwen3_4b_mega_verl.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
