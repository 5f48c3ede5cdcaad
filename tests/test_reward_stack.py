"""The reward server's web stack, on both version sets `make test` runs it on, and where verl 0.6.1's way of starting
its async rollout servers stops working.

`make test` runs this file twice: in the test environment (requirements/reward-newest.txt), and with
REWARD_STACK=oldest and requirements/reward-oldest.txt installed first on PYTHONPATH (the base images' versions).
"""

import asyncio
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import threading
import time

from packaging.requirements import Requirement
from packaging.version import Version

from launch.plan.image_check import UVICORN_FIRST_BREAKING, read_pins
from launch.plan.procs import http_get
from tests.support import REPO

REQ = REPO / "requirements"
STACK = os.environ.get("REWARD_STACK", "newest")
WEB_STACK = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "prometheus-client", "requests")
MODEL_STACK = ("transformers", "tokenizers", "huggingface-hub")  # the oldest set only: the newest is verl's pin
LINE = Version(UVICORN_FIRST_BREAKING)


def declared(stack: str) -> dict[str, str]:
    return read_pins(REQ / f"reward-{stack}.txt")


def test_the_stack_under_test_is_the_one_declared():
    """A second run that silently imported the environment's own versions would test the newest set twice."""
    assert STACK in ("newest", "oldest"), f"REWARD_STACK must be newest or oldest, got {STACK!r}"
    for name, version in declared(STACK).items():
        assert importlib.metadata.version(name) == version, f"{name}: imported {importlib.metadata.version(name)}"


def test_the_lower_bounds_admit_both_stacks_and_both_base_images():
    """requirements/reward.txt (what the image installs) accepts the oldest and newest sets and every base's."""
    bounds = [Requirement(line) for line in (REQ / "reward.txt").read_text().splitlines() if line[:1].isalpha()]
    assert {r.name for r in bounds} == set(WEB_STACK) - {"pydantic-core"}
    for source in ("reward-oldest.txt", "reward-newest.txt", "base-images/sglang.txt", "base-images/vllm.txt"):
        pins = read_pins(REQ / source)
        for req in bounds:
            assert req.name in pins, f"{source} has no {req.name}"
            assert req.specifier.contains(pins[req.name]), f"{source}: {req.name}=={pins[req.name]} vs {req}"


def test_the_oldest_stack_is_the_oldest_base_images():
    """The oldest set we test is, package by package, the older of the two base images' versions."""
    bases = [read_pins(REQ / "base-images" / f"{name}.txt") for name in ("sglang", "vllm")]
    oldest = declared("oldest")
    assert set(declared("newest")) == set(WEB_STACK)
    assert set(oldest) == set(WEB_STACK + MODEL_STACK)
    for name in WEB_STACK + MODEL_STACK:
        assert oldest[name] == str(min(Version(b[name]) for b in bases)), name


def test_the_two_stacks_lie_on_either_side_of_the_uvicorn_line():
    """So that `make test` shows both sides: the base images' uvicorn works with verl's pattern, the newest does not."""
    assert Version(declared("oldest")["uvicorn"]) < LINE <= Version(declared("newest")["uvicorn"])
    for base in ("sglang", "vllm"):
        assert Version(read_pins(REQ / "base-images" / f"{base}.txt")["uvicorn"]) < LINE, base


def verl_style_server_listens(timeout: float = 20.0) -> bool:
    """Start a FastAPI app with verl's own run_unvicorn, as its async rollout servers are, and GET it once."""
    from fastapi import FastAPI
    from verl.workers.rollout.utils import run_unvicorn

    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"pong": True}

    started: dict = {}
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            port, _task = await run_unvicorn(app, None, "127.0.0.1")
            started["port"] = port
            while not stop.is_set():
                await asyncio.sleep(0.05)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while "port" not in started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "port" in started, f"verl's run_unvicorn did not return within {timeout:.0f} s"
    time.sleep(0.3)  # a server that shuts itself down does so right after start-up
    try:
        status, body = http_get(f"http://127.0.0.1:{started['port']}/ping", timeout=5)
        return status == 200 and json.loads(body) == {"pong": True}
    except OSError:
        return False
    finally:
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # its lifespan task is cancelled on stop
        stop.set()
        thread.join(timeout=5)


def test_verl_run_unvicorn_keeps_listening_exactly_below_uvicorn_0_41():
    """verl 0.6.1's own run_unvicorn (the installed verl) with this stack's uvicorn: listening or closed at once. The
    image check compares the uvicorn version with this line, measured here on both sides of it."""
    uvicorn_version = Version(importlib.metadata.version("uvicorn"))
    assert verl_style_server_listens() == (uvicorn_version < LINE), f"uvicorn {uvicorn_version}"


def test_the_image_check_passes_on_the_oldest_stack_and_names_the_uvicorn_problem_on_the_newest():
    """launch/plan/image_check.py, as the image's %test runs it (here: PyPI verl, no engine, no Megatron, no
    recipes)."""
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch" / "plan" / "image_check.py"),
            "--engine",
            "none",
            "--skip-recipes",
            "--skip-megatron",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "ok   import verl.model_merger" in run.stdout
    assert "ok   reward server on CPU + reward client: one pair scored" in run.stdout, run.stdout + run.stderr
    if STACK == "oldest":
        assert run.returncode == 0, run.stdout + run.stderr
        assert "verl's run_unvicorn keeps a server listening with uvicorn 0.35.0" in run.stdout
    else:
        assert run.returncode == 1
        assert "FAIL verl's run_unvicorn (verl/workers/rollout/utils.py)" in run.stderr
        assert f"uvicorn {declared('newest')['uvicorn']}" in run.stderr
