"""Reward model server: scores (prompt, response) pairs exactly as TRL trained the model, batched across requests.

    python reward_score/reward_server.py --model-path /models/Unsafe-Reward-Qwen3-1.7B --port 8000
    REWARD_MODEL_PATH=... REWARD_DEVICE=cuda:0 REWARD_PORT=8000 python -m reward_score.reward_server

API
    GET  /health       200 {model_path, device, dtype, max_length, ...} once the model is loaded and warmed up
                       (401 if an Authorization header is sent with another token);
                       before that the port is closed (the model loads before uvicorn binds it).
    POST /score        {"prompt": str | "messages": [{role, content}], "response": str} -> {"score", "truncated"}
    POST /score_batch  {"items": [ ...same items... ]} -> {"scores": [...], "truncated": [...]} in order
    GET  /metrics      Prometheus text

How a pair is scored (what TRL's RewardTrainer did at training time; `python -m reward_score.check_format` measures
which of TRL's ways a model needs): by default as TRL >= 0.24 did, the reward model tokenizer's own chat template over
[user prompt (or the given messages), assistant response], no generation prompt, tokenized without adding special
tokens again; a tokenizer without a chat template (or `REWARD_CHAT_TEMPLATE=off`) takes TRL's plain-text rule
(prompt + response + EOS, with the tokenizer's special tokens). `REWARD_INPUT=completion` scores the response alone,
rendered as the assistant turn, as TRL <= 0.23 did for a dataset with a `prompt` column; `REWARD_ADD_SPECIAL_TOKENS`
and `REWARD_APPEND_EOS` (auto: what TRL did for that input) cover the rest. /health and the startup log say which
format runs. The score is read where the model's own forward reads it: the last token that is not its pad token.
Over-long input keeps its LAST `max_length` tokens, or is rejected with 413 when `REWARD_TRUNCATION=reject`.

Throughput: requests are rendered and tokenized off the event loop, all that wait in one pass; then one GPU thread
plans every waiting row into micro-batches (sorted by length, padded to a multiple of `REWARD_PAD_MULTIPLE` tokens,
each under `REWARD_TOKEN_BUDGET` tokens, cut where the fewest padded tokens are computed; where lengths are mixed, several short sequences share
a row, each with its own positions and a block-diagonal causal mask), keeps two of them on the GPU, answers each
request as soon as its own rows are scored, and plans the next micro-batch from whatever waits then, oldest request
first. When idle it waits at most `REWARD_MAX_WAIT_MS` for a burst to gather; while one micro-batch runs, the next goes
in behind it once a full budget or `REWARD_MAX_WAIT_MS` has passed. Every score is read at the row's last real token.
Launching does not wait for the running micro-batch (pinned inputs; the model gets its mask mapping from us, not one
built by transformers that synchronises). q/k/v and gate/up run as one matmul each, built from the checkpoint's weights
(`REWARD_FUSE`); on a GPU a synthetic full-budget step runs before /health is ready (`REWARD_WARMUP`), so the first
real step runs warm. A CUDA out-of-memory error splits the micro-batch and retries. The event
loop never runs model code.

Settings come from the environment (names below); each has a command-line flag that wins (`--help`). The launch
scripts' CONFIG_REWARD_* names (the article's CONFIG_REWARD_MODEL_PATH, CONFIG_REWARD_DEVICE) are not read: the
helper passes them as --model-path, --device and the format flags, and a server started by hand with one of them set
says so.

The code is in reward_score/server/, one job a file, each importing only the ones before it:
settings.py (every setting) -> planner.py (how rows are grouped into micro-batches; no torch) -> runner.py (the
model) -> batcher.py (the GPU thread and request queue) -> app.py (HTTP). This file only starts it.
"""

import importlib.util
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
    settings = load_settings(argv, description=__doc__)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    problem = check_model_path(settings.model_path)
    if problem:
        log.error("%s", problem)
        return 2
    for note in launch_names_not_read(settings):
        log.warning("%s", note)
    # Many batch shapes come and go: expandable segments keep the allocator from fragmenting (set before torch loads).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Every waiting request is tokenized in one pass on all cores. TOKENIZERS_PARALLELISM=false, which training
    # scripts export to quiet the tokenizers fork warning, would leave the server one core: on an H200 0.8 s a
    # 1024-pair step instead of 0.15 s, 8 to 10 points of the matmul ceiling (benchmarks/README.md). No fork follows.
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "no", "off"):
        log.warning("TOKENIZERS_PARALLELISM=%s inherited: this server tokenizes on all cores regardless (set true)",
                    os.environ["TOKENIZERS_PARALLELISM"])  # fmt: skip
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    shown = {k: ("(set)" if k == "auth_token" and v else v) for k, v in asdict(settings).items()}
    log.info("starting with %s", shown)
    import uvicorn

    # uvicorn takes uvloop and httptools (C parsers, less CPU per request) when they are installed.
    log.info(
        "HTTP: uvicorn %s, event loop %s, parser %s", uvicorn.__version__,
        "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "httptools" if importlib.util.find_spec("httptools") else "h11 (pure Python; pip install httptools)",
    )  # fmt: skip
    # uvicorn runs the lifespan (model load + warm-up) before it binds the port: until then, connections are refused.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
