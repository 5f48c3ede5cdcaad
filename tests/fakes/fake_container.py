"""A stand-in for `singularity` and `apptainer`, which cannot run on the test machines (Slurm is real: see
tests/real_slurm.py). The test fixture puts one small wrapper per program first on PATH; each runs
`fake_container.py PROGRAM ARGS...`, appends one JSON line `{"prog", "argv", "cwd", "env"}` to `$FAKE_CLUSTER_LOG`
(the `env` holds the SLURM_* variables the call saw), then:

- `FAKE_<PROG>_RC` set (e.g. `FAKE_SINGULARITY_RC=3`): exit with that code and run nothing;
- `exec [options] IMAGE CMD...`: fails as the real runtime does where it would (exit 255 with its FATAL line: the
  image missing, a `--bind` source missing, a `--pwd` folder missing), else runs CMD here in the `--pwd` folder with
  the caller's environment and every `--env K=V` applied, passing SIGTERM/SIGINT/SIGUSR1 on to it (the runtime's
  starter forwards signals to the container's process), and exits with its code;
- other sub-commands (`build`, `test`, `inspect`, ...) only record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

_VALUE_OPTS = {
    "-B",
    "--bind",
    "--env",
    "--env-file",
    "--home",
    "-H",
    "--pwd",
    "--overlay",
    "-W",
    "--workdir",
    "--mount",
    "--security",
    "--network",
    "--hostname",
    "--apply-cgroups",
}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def split_options(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Split leading options from IMAGE CMD...; return ({option: [values]}, rest)."""
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].partition("=")
        if not eq and name in _VALUE_OPTS and i + 1 < len(args):
            value, i = args[i + 1], i + 1
        opts.setdefault(name, []).append(value)
        i += 1
    return opts, args[i:]


def fatal(message: str) -> int:
    print(f"FATAL:   {message}", file=sys.stderr)
    return 255


def run_exec(args: list[str]) -> int:
    opts, rest = split_options(args)
    if len(rest) < 2:
        return fatal("exec needs an image and a command")
    image, cmd = rest[0], rest[1:]
    if not os.path.exists(image):
        return fatal(f"could not open image {image}: failed to retrieve path for {image}: no such file or directory")
    for spec in opts.get("--bind", []) + opts.get("-B", []):
        for item in spec.split(","):
            source = item.split(":", 1)[0]
            if not os.path.exists(source):
                return fatal(
                    f"container creation failed: mount hook function failure: mount {source}->{source} "
                    "error: while mounting: no such file or directory"
                )
    cwd = (opts.get("--pwd") or [None])[-1]
    if cwd and not os.path.isdir(cwd):
        return fatal(f"container creation failed: could not set working directory {cwd}: no such file or directory")
    env = dict(os.environ)
    for pair in opts.get("--env", []):
        for item in pair.split(","):
            key, _, value = item.partition("=")
            env[key] = value
    child = subprocess.Popen(cmd, env=env, cwd=cwd)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc  # a command ended by a signal reports 128 + the signal, as a shell would


def record(prog: str, argv: list[str]) -> None:
    log = os.environ.get("FAKE_CLUSTER_LOG")
    if not log:
        return
    entry = {
        "prog": prog,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("SLURM")},
    }
    # One write() of a short line in append mode lands whole even with several writers.
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, ensure_ascii=False) + "\n")


def main() -> int:
    prog, argv = sys.argv[1], sys.argv[2:]
    record(prog, argv)
    forced = os.environ.get(f"FAKE_{prog.upper()}_RC")
    if forced is not None:
        return int(forced)
    return run_exec(argv[1:]) if argv[:1] == ["exec"] else 0


if __name__ == "__main__":
    sys.exit(main())
