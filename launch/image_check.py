"""Check that an environment can run this project's jobs: verl 0.6.1, its recipes, the reward server's dependencies.

python3 launch/image_check.py                  # what the image's %post and %test run
python3 launch/image_check.py --skip-recipes   # a pip-installed verl (CPU tests): the wheel holds no recipes
"""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-recipes", action="store_true")
    args = parser.parse_args(argv)
    problems = []
    modules = [
        "verl",
        "verl.trainer.main_ppo",
        "verl.model_merger",
        "fastapi",
        "uvicorn",
        "pydantic",
        "prometheus_client",
        "requests",
    ]
    if not args.skip_recipes:
        modules += ["recipe.dapo.main_dapo", "recipe.one_step_off_policy.main_ppo"]
    for name in modules:
        try:
            importlib.import_module(name)
            print(f"ok   import {name}")
        except Exception as exc:  # every failure is reported, then the check fails
            problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    import verl

    if verl.__version__ != "0.6.1":
        problems.append(f"verl is {verl.__version__}, the scripts are written for 0.6.1")
    server = HERE / "reward_score" / "reward_server.py"
    run = subprocess.run([sys.executable, str(server), "--help"], capture_output=True, text=True)
    if run.returncode != 0:
        problems.append(f"{server} --help failed: {run.stderr[-500:]}")
    else:
        print(f"ok   {server} --help")
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
