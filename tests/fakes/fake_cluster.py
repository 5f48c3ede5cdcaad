"""Fake Slurm and container programs for tests: `sbatch`, `srun`, `scontrol`, `singularity`, `apptainer`.

The test fixture puts one small wrapper per program first on PATH; each runs `fake_cluster.py PROGRAM ARGS...`.
Every call appends one JSON line `{"prog", "argv", "cwd", "env"}` to `$FAKE_CLUSTER_LOG` (the `env` holds the
SLURM_* variables the call saw), then:

- `FAKE_<PROG>_RC` set (e.g. `FAKE_SRUN_RC=3`): exit with that code and run nothing;
- `srun`: run the wrapped command locally, once per task (`--ntasks`, else `--nodes`, else `$SLURM_NNODES`, else 1),
  all tasks at once, each with SLURM_PROCID/SLURM_NODEID/SLURMD_NODENAME set from the job's node list; exit with
  the first non-zero task code; SIGTERM/SIGINT/SIGUSR1 are passed on to every task (as real srun forwards them);
- `singularity|apptainer exec [options] IMAGE CMD...`: run CMD locally with every `--env K=V` applied, passing
  signals on to it (as the real runtime does); other sub-commands (`build`, `test`, `inspect`, ...) only record;
- `scontrol show hostnames [LIST]`: expand a Slurm node list (`gpu[01-03,7],login1`), default `$SLURM_JOB_NODELIST`;
  `scontrol show job ID`: one line with `EndTime=$FAKE_JOB_END_TIME` (Slurm's local-time format; `Unknown` if
  unset); other `scontrol` calls (`requeue`, ...) only record;
- `sbatch`: prints `Submitted batch job $FAKE_SBATCH_JOBID` (default 4242).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

# Options that take a separate value when written without "=", per program (everything else is a flag).
_SRUN_VALUE_OPTS = {
    "-N", "-n", "-w", "-c", "-G", "-J", "-o", "-e", "-p", "-t", "-x",
    "--nodes", "--ntasks", "--ntasks-per-node", "--nodelist", "--cpus-per-task", "--gpus", "--gpus-per-node",
    "--gres", "--job-name", "--output", "--error", "--partition", "--time", "--exclude", "--export", "--kill-on-bad-exit",
    "--wait", "--mpi", "--cpu-bind", "--mem", "--chdir", "--label",
}  # fmt: skip
_CONTAINER_VALUE_OPTS = {
    "-B", "--bind", "--env", "--env-file", "--home", "-H", "--pwd", "--overlay", "-W", "--workdir",
    "--mount", "--security", "--network", "--hostname", "--apply-cgroups",
}  # fmt: skip


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list: `node[01-03,7],login1` -> node01 node02 node03 node7 login1."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec):
        match = re.match(r"^(.*?)\[([^\]]*)\](.*)$", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                for tail in expand_hostlist(rest) if "[" in rest else [rest]:
                    hosts.append(f"{prefix}{n:0{len(lo)}d}{tail}")
    return hosts


def split_options(args: list[str], value_opts: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Split leading options from the wrapped command; return ({option: [values]}, rest)."""
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].partition("=")
        if not eq and name in value_opts and i + 1 < len(args):
            value, i = args[i + 1], i + 1
        opts.setdefault(name, []).append(value)
        i += 1
    return opts, args[i:]


def _first(opts: dict[str, list[str]], *names: str) -> str | None:
    for name in names:
        if name in opts:
            return opts[name][-1]
    return None


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def run_children(cmds: list[tuple[list[str], dict[str, str]]]) -> list[int]:
    """Start every command, pass the forwarded signals on to each, and return their exit codes in order."""
    procs = [subprocess.Popen(cmd, env=env) for cmd, env in cmds]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    # A child ended by a signal reports 128 + the signal, as a shell would.
    return [rc if rc >= 0 else 128 - rc for rc in (p.wait() for p in procs)]


def run_srun(args: list[str]) -> int:
    opts, cmd = split_options(args, _SRUN_VALUE_OPTS)
    if not cmd:
        print("srun (fake): no command given", file=sys.stderr)
        return 2
    nodes = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", "localhost"))
    nodelist = _first(opts, "-w", "--nodelist")
    if nodelist:
        nodes = expand_hostlist(nodelist)
    ntasks = _first(opts, "-n", "--ntasks") or _first(opts, "-N", "--nodes") or os.environ.get("SLURM_NNODES") or "1"

    def task_env(rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NODEID=str(rank),
            SLURM_LOCALID="0",
            SLURM_NTASKS=str(ntasks),
            SLURMD_NODENAME=nodes[rank % len(nodes)],
            SLURM_STEP_ID=os.environ.get("FAKE_SRUN_STEP_ID", "0"),
        )
        cpus = _first(opts, "-c", "--cpus-per-task")
        if cpus:
            env["SLURM_CPUS_PER_TASK"] = cpus
        return env

    codes = run_children([(cmd, task_env(r)) for r in range(int(ntasks))])
    return next((c for c in codes if c != 0), 0)


def run_container(args: list[str]) -> int:
    if not args or args[0] != "exec":
        return 0
    opts, rest = split_options(args[1:], _CONTAINER_VALUE_OPTS)
    if len(rest) < 2:
        print("singularity exec (fake): need IMAGE and COMMAND", file=sys.stderr)
        return 2
    image, cmd = rest[0], rest[1:]
    if not os.path.exists(image):
        print(f"FATAL: could not open image {image}: no such file", file=sys.stderr)
        return 255
    env = dict(os.environ)
    for pair in opts.get("--env", []):
        for item in pair.split(","):
            key, _, value = item.partition("=")
            env[key] = value
    return run_children([(cmd, env)])[0]


def run_scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        spec = args[2] if len(args) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand_hostlist(spec)))
    elif args[:2] == ["show", "job"] and len(args) > 2:
        print(
            f"JobId={args[2]} JobName=grpo-qwen3-4b EndTime={os.environ.get('FAKE_JOB_END_TIME', 'Unknown')} Restarts=0"
        )
    return 0


def run_sbatch(args: list[str]) -> int:
    print(f"Submitted batch job {os.environ.get('FAKE_SBATCH_JOBID', '4242')}")
    return 0


HANDLERS = {
    "sbatch": run_sbatch,
    "srun": run_srun,
    "scontrol": run_scontrol,
    "singularity": run_container,
    "apptainer": run_container,
}


def record(prog: str, argv: list[str]) -> None:
    log = os.environ.get("FAKE_CLUSTER_LOG")
    if not log:
        return
    entry = {
        "prog": prog,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
    }
    line = json.dumps(entry, ensure_ascii=False) + "\n"
    # One write() of a short line in append mode lands whole even with several writers.
    with open(log, "a", encoding="utf-8") as f:
        f.write(line)


def main() -> int:
    prog, argv = sys.argv[1], sys.argv[2:]
    record(prog, argv)
    forced = os.environ.get(f"FAKE_{prog.upper()}_RC")
    if forced is not None:
        return int(forced)
    return HANDLERS[prog](argv)


if __name__ == "__main__":
    sys.exit(main())
