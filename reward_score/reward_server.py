"""Reward model server: scores (prompt, response) pairs as TRL trained the model, batched across requests.

    python reward_score/reward_server.py --model-path /models/Unsafe-Reward-Qwen3-1.7B --device cuda:0 --port 8000

Its settings (`--help`, `--help-all`), API and how it scores: docs/reward.md. The code is in reward_score/server/;
this file only starts it.
"""

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

if not __package__:  # run by path (python reward_score/reward_server.py): the repository root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reward_score.server.app import create_app  # noqa: E402
from reward_score.server.settings import check_model_path, launch_names_not_read, load_settings  # noqa: E402

log = logging.getLogger("reward_server")


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for note in launch_names_not_read(settings):
        log.warning("%s", note)
    if problem := check_model_path(settings.model_path):
        log.error("%s", problem)
        return 2
    # Many batch shapes come and go: expandable segments keep the allocator from fragmenting (set before torch loads).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Tokenizing runs on every core; TOKENIZERS_PARALLELISM=false, which training scripts export, would cost a 1024-pair
    # step 0.8 s instead of 0.15 s on an H200 (benchmarks/HISTORY.md). No fork follows.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    shown = {k: ("(set)" if k == "auth_token" and v else v) for k, v in asdict(settings).items()}
    log.info("starting with %s", shown)
    import uvicorn

    # uvicorn runs the lifespan (model load + warm-up) before it binds the port: until then, connections are refused.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
