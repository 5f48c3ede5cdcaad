"""A job that shares a node, is stopped or is requeued touches nothing of anyone else's and leaves nothing behind:
per-job ports and token, reward GPUs within the job's own, the node address, the watchdog, stopping on a signal.

The end-to-end tests here run the real scripts on this machine without Slurm (a workstation) with real reward servers
and real Ray; the same through the real Slurm (scancel, two jobs on one node, a reward node) is test_slurm_jobs.py.
They skip the preflight, which test_launch.py covers, to stay within the machine's few cores."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.job import node
from tests.support import (
    REPO,
    assert_everything_stopped,
    block_settings,
    job_dir,
    job_processes,
    run,
    seen,
    start_http_server,
    start_job,
    tail,
    wait_for_path,
)

FAST = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}  # the preflight is test_launch.py's


def node_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.job.node", *args], capture_output=True, text=True, cwd=REPO, env=env
    )


# --- ports ---------------------------------------------------------------------------------------------------------


def test_consecutive_jobs_and_the_ranks_of_one_job_get_different_port_blocks():
    free = lambda port: False  # noqa: E731  (nothing is taken)
    plans = {(job, rank): node.plan_ports(job, rank, 1, taken=free) for job in ("1001", "1002") for rank in (0, 1)}
    bases = [p["ray_port"] for p in plans.values()]
    assert len(set(bases)) == 4, plans
    for plan in plans.values():
        ports = [v for k, v in plan.items() if k != "block_moved"]
        assert node.PORT_FIRST <= min(ports) and max(ports) <= node.PORT_LAST, "below the ephemeral range"
        assert plan["max_worker_port"] - plan["min_worker_port"] >= 400, "room for every Ray worker process"


def test_a_block_with_any_port_taken_is_passed_over_for_the_next_free_one():
    first = node.plan_ports("1001", 0, 1, taken=lambda port: False)
    held = first["min_worker_port"] + 7  # one port deep in the worker range
    moved = node.plan_ports("1001", 0, 1, taken=lambda port: port == held)
    blocks = (node.PORT_LAST + 1 - node.PORT_FIRST) // node.PORT_BLOCK
    following = (first["ray_port"] - node.PORT_FIRST) // node.PORT_BLOCK + 1
    assert moved["block_moved"] == 1
    assert moved["ray_port"] == node.PORT_FIRST + following % blocks * node.PORT_BLOCK, "the next block, wrapping"


def test_a_reward_port_set_by_hand_that_is_taken_is_refused_naming_its_setting():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = node_cli("ports", "--job-id", "5", "--reward-count", "1", "--reward-port", str(port))
    assert result.returncode == 1
    setting = "CONFIG_REWARD_SERVER_PORT"
    assert (
        f"{setting}={port}" in result.stderr and "taken" in result.stderr and f"leave {setting} empty" in result.stderr
    )


# --- reward GPUs and the node address ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "visible, indices, expected",
    [
        ("4,5,6,7", "0", "4"),  # Slurm gave this job GPUs 4-7 (no device cgroup): index 0 is GPU 4, never GPU 0
        ("4,5,6,7", "1,3", "5,7"),  # two reward servers
        ("0,1,2,3", "0", "0"),  # with a device cgroup Slurm renumbers from 0
        (None, "2", "2"),  # a workstation without CUDA_VISIBLE_DEVICES: every GPU is the job's
        ("4,5,6,7", "4", "index 4 but this job has 4 GPU(s) on this node (CUDA_VISIBLE_DEVICES=4,5,6,7)"),
        ("4,5,6,7", "gpu0", "'gpu0' is not a GPU index"),
    ],
)
def test_reward_gpus_are_indices_into_the_jobs_own_gpus(visible, indices, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = node_cli("reward-gpus", indices, env=env)
    if expected[0].isdigit():
        assert (result.returncode, result.stdout.strip()) == (0, expected), result.stderr
    else:
        assert result.returncode == 1 and expected in result.stderr and "CONFIG_REWARD_GPUS" in result.stderr


@pytest.mark.parametrize(
    "interface, nodes, resolved, iface_addr, expected",
    [
        ("", 2, ["127.0.1.1", "10.1.2.3"], None, "10.1.2.3"),  # Debian's 127.0.1.1 first: skipped
        ("", 1, ["127.0.1.1"], None, "127.0.0.1"),  # one node: loopback is fine
        ("", 2, ["127.0.1.1"], None, "set CONFIG_NETWORK_INTERFACE to one of: ib0 (10.9.0.1)"),  # never on 2+ nodes
        ("", 2, [], None, "resolves only to nothing"),  # the host name does not resolve
        ("ib0", 2, ["127.0.1.1"], "10.9.0.1", "10.9.0.1"),  # the interface wins
        ("ib9", 2, ["10.1.2.3"], None, "CONFIG_NETWORK_INTERFACE=ib9: no such interface"),  # a typo
    ],
)
def test_the_node_address_is_never_loopback_on_a_multi_node_job(interface, nodes, resolved, iface_addr, expected):
    try:
        got = node.pick_address(interface, nodes, resolved, iface_addr, "ib0 (10.9.0.1)")
    except node.NodeError as exc:
        got = str(exc)
    assert expected in got


def test_the_address_of_a_real_interface_is_read_from_the_kernel():
    assert node.interfaces()["lo"] == "127.0.0.1"
    assert "no-such-if0" not in node.interfaces()
    result = node_cli("address", "--interface", "no-such-if0", "--nodes", "2")
    assert result.returncode == 1 and "lo (127.0.0.1)" in result.stderr, "the error lists the interfaces there are"


# --- the GPUs' compute mode --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "smi, visible, expected",
    [
        # every GPU in Default mode: any number of processes, nothing to refuse
        ("0, Default\n1, Default\n", None, None),
        # Exclusive_Process: verl's worker and SGLang's scheduler share each GPU; only the GPUs in it are named
        ("0, Default\n1, Exclusive_Process\n", None, "GPU 1 in Exclusive_Process mode"),
        # Prohibited lets no process at all on a GPU
        ("0, Prohibited\n", None, "GPU 0 in Prohibited mode"),
        # the head with its reward servers: the GPUs as nvidia-smi numbers them
        ("4, Exclusive_Process\n5, Exclusive_Process\n", "4,5", "GPU 4 in Exclusive_Process mode; GPU 5 in"),
        # a GPU of another job (no device cgroup: nvidia-smi lists the node's all) is not this job's concern
        ("0, Exclusive_Process\n1, Default\n", "1", None),
        # with a device cgroup nvidia-smi lists only the job's GPUs, renumbered from 0: they are all the job's
        ("0, Exclusive_Process\n", "3", "GPU 0 in Exclusive_Process mode"),
    ],
)
def test_gpus_in_a_compute_mode_other_than_default_are_refused_naming_them_and_the_mode(smi, visible, expected):
    got = node.compute_mode_problem(smi, visible)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got, got


def test_a_node_whose_gpus_are_in_exclusive_process_mode_stops_before_it_starts_anything(job, tmp_path):
    """The real run script and helper with a fake `nvidia-smi` first on PATH, as a cluster that sets its GPUs to
    Exclusive_Process would answer: the head refuses before any reward server, port or Ray, and the job fails."""
    bin_dir, calls = tmp_path / "smi", tmp_path / "smi_calls"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\necho "$*" >>"{calls}"\n'
        '[ "$*" = "--query-gpu=index,compute_mode --format=csv,noheader" ] || exit 9\n'
        'echo "0, Exclusive_Process"\n'
    )
    (bin_dir / "nvidia-smi").chmod(0o755)
    result = run(job | FAST | {"PATH": f"{bin_dir}{os.pathsep}{job['PATH']}"})
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "GPU compute mode forbids this job's processes on" in result.stderr, out[-3000:]
    assert "GPU 0 in Exclusive_Process mode" in result.stderr, out[-3000:]
    assert calls.read_text().splitlines() == ["--query-gpu=index,compute_mode --format=csv,noheader"]
    logs = job_dir(job)
    names = {p.name for p in logs.iterdir()}
    assert {"ray_head.log", "trainer.log", "reward_urls", "ports.0", "cluster.env"} & names == set(), names
    assert not any(name.startswith("reward_server_") for name in names), names
    assert not Path(job["FAKE_TRAINER_LOG"]).exists(), "the trainer must not start"
    assert (logs / "done").read_text().strip() == "1"
    assert_everything_stopped(job)


# --- the token ------------------------------------------------------------------------------------------------------


def test_the_health_poll_with_our_token_refuses_another_jobs_server(tiny_models, tmp_path):
    """What a job sees when another job's server answers on its port: 401, at once, not a 200 taken for its own."""
    from tests.support import free_port

    port = free_port()
    env = dict(os.environ, REWARD_SERVER_TOKEN="the-other-jobs-token")
    server = start_http_server(
        [
            sys.executable,
            str(REPO / "reward_score" / "reward_server.py"),
            "--model-path",
            str(tiny_models.reward_model),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        tmp_path / "other.log",
        port,
        env=env,
    )
    probe = (
        'source launch/job/common.sh; sleep 60 & pid=$!; wait_for_http "$1" "$pid" "$2" 20 "$3"; rc=$?; '
        'kill "$pid"; exit "$rc"'
    )
    url = f"http://127.0.0.1:{port}/health"
    try:
        ours = subprocess.run(
            ["bash", "-c", probe, "_", url, str(server.log), "this-jobs-token"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        theirs = subprocess.run(
            ["bash", "-c", probe, "_", url, str(server.log), "the-other-jobs-token"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop()
    assert ours.returncode == 1
    assert "/health is another job's server: it answers 401 to this job's token" in ours.stderr
    assert "this-jobs-token" not in ours.stderr + ours.stdout, "the token is never printed"
    assert theirs.returncode == 0, theirs.stderr


# --- stopping and the watchdog (real servers, real Ray) -----------------------------------------------------------


def test_sigterm_mid_training_stops_every_process_and_port_and_a_second_one_lets_every_part_finish_its_stop(
    job, tmp_path
):
    """SIGTERM to the run script alone mid-training: what reaches the rest is up to it. SIGTERM can come twice (a
    second scancel, say): while the job stops (here a trainer that takes 5 s to exit), a second SIGTERM to the run
    script and the helper changes nothing: each finishes stopping what it started and prints its last line.
    Merged here (issue 71: one job proves both) is what was
    test_sigterm_mid_training_stops_every_process_and_port_of_the_job_and_exits_non_zero, its assertions kept: the
    run script exits 143 within STOP_TIMEOUT + 15 s of the first SIGTERM, its output says "stop signal" and
    exit_code=143, the head recorded 143 in its `done` file, no TRAINING_DONE, nothing of the job left."""
    env = job | FAST | {"FAKE_TRAINER_SLEEP": "300", "FAKE_TRAINER_TERM_S": "5"}
    log = tmp_path / "job.out"
    proc = start_job(env, log)
    try:
        wait_for_path(Path(env["FAKE_TRAINER_LOG"]), 240, proc)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the run script only: what reaches the rest is up to it
        wait_for(
            "the helper's stop",
            lambda: "[rank 0] stop signal: stopping what this node started" in log.read_text(),
            60,
            proc,
        )
        os.killpg(proc.pid, signal.SIGTERM)  # the run script and the helper again (the trainer is still stopping)
        rc = proc.wait(120)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = tail(log, 80)
    assert rc == 143, out
    assert seconds < int(env["STOP_TIMEOUT"]) + 15, f"stopped after {seconds:.0f} s:\n{out}"
    assert "stop signal" in out and "exit_code=143" in out
    assert (job_dir(env) / "done").read_text().strip() == "143", "the head recorded that it was stopped"
    assert not (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    assert "[rank 0] stopped what it started; exit code 143" in out, out
    assert "run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=143" in out, out
    assert_everything_stopped(env)


def reward_servers(env) -> list[tuple[int, str]]:
    """(pid, command line) of the job's live reward servers."""
    found = [p for p in job_processes(job_dir(env)) if "reward_server.py" in p]
    return [(int(p.split()[0]), p) for p in found]


def wait_for(what: str, probe, timeout: float, proc):
    """Poll `probe` until it returns something true; fail at the deadline saying what was seen last."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline and proc.poll() is None:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout} s (job exit code {proc.poll()}; last seen: {last!r})")


def ours_at(url: str, token: str):
    """The server at url, if it answers /health 200 to this token and checked it ("auth": true)."""
    import json
    import urllib.request

    request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            body = json.loads(resp.read())
    except OSError:
        return None
    return body if resp.status == 200 and body.get("auth") else None


def test_a_reward_server_killed_mid_training_comes_back_healthy_at_its_url_and_the_job_completes(job, tmp_path):
    go = tmp_path / "go"
    env = job | FAST | {"FAKE_TRAINER_WAIT_FOR": str(go), "REWARD_SERVER_TOKEN": "a-token-never-logged"}
    proc = start_job(env, tmp_path / "job.out")
    try:
        wait_for_path(Path(env["FAKE_TRAINER_LOG"]), 240, proc)
        ((killed, _),) = reward_servers(env)
        url = seen(env)["REWARD_SERVER_URLS"]
        os.kill(killed, signal.SIGKILL)
        wait_for("the reward server gone", lambda: ours_at(url, env["REWARD_SERVER_TOKEN"]) is None, 30, proc)
        wait_for(
            "a new reward server healthy at the same URL, with this job's token",
            lambda: ours_at(url, env["REWARD_SERVER_TOKEN"]),
            240,
            proc,
        )
        wait_for(
            "the job seeing its server back", lambda: "is back: healthy" in tail(tmp_path / "job.out", 80), 30, proc
        )
        ((restarted, _),) = reward_servers(env)
        go.touch()
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = tail(tmp_path / "job.out", 80)
    port = env["CONFIG_REWARD_SERVER_PORT"]
    log = job_dir(env) / f"reward_server_{socket.gethostname()}_{port}.log"
    assert rc == 0, out
    assert restarted != killed
    assert f"reward server (port {port}) on {socket.gethostname()} died (log: {log}): killed by SIGKILL" in out
    assert "restart 1/3, same port and token" in out and "is back: healthy at the same URL" in out
    assert "restart 1 after: killed by SIGKILL" in log.read_text(), "the log keeps every life of the server"
    assert json.loads(Path(env["FAKE_TRAINER_LOG"] + ".end").read_text())["reward_health"] == [200]
    written = [p for p in job_dir(env).rglob("*") if p.is_file()] + [tmp_path / "job.out"]
    assert not [p for p in written if b"a-token-never-logged" in p.read_bytes()], "the token is in no log or command"
    assert_everything_stopped(env)


def test_a_reward_server_that_keeps_dying_stops_the_job_naming_it_once_its_restarts_are_spent(
    job, tmp_path, tiny_models
):
    model = tmp_path / "reward_model"
    shutil.copytree(tiny_models.reward_model, model)
    env = job | FAST | {"FAKE_TRAINER_SLEEP": "600", "REWARD_RESTARTS": "2", "CONFIG_REWARD_MODEL_PATH": str(model)}
    proc = start_job(env, tmp_path / "job.out")
    try:
        wait_for_path(Path(env["FAKE_TRAINER_LOG"]), 240, proc)
        ((server, _),) = reward_servers(env)
        (model / "config.json").unlink()  # every restart now fails to load the model, and says so in its log
        os.kill(server, signal.SIGKILL)
        rc = proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = tail(tmp_path / "job.out", 120)
    port = env["CONFIG_REWARD_SERVER_PORT"]
    log = job_dir(env) / f"reward_server_{socket.gethostname()}_{port}.log"
    assert rc == 1, out
    assert "restart 1/2" in out and "restart 2/2" in out, out
    stop = f"reward server (port {port}) on {socket.gethostname()} died (log: {log}): exited with "
    assert stop in out and "3 death(s), its REWARD_RESTARTS=2 restarts spent: stopping the job" in out
    reason = out.split(stop, 1)[1].split("\n", 1)[0]
    assert "; its log: " in reason and "config.json" in reason, f"the reason is the server's own: {reason}"
    assert_everything_stopped(env)


def test_a_server_of_another_job_that_takes_the_port_while_ours_restarts_is_never_taken_for_ours(job, tmp_path):
    import http.server
    import threading

    class OtherJobsServer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            self.send_response(401)  # another token: what another job's reward server answers ours
            self.end_headers()

        def log_message(self, *args):
            pass

    env = job | FAST | {"FAKE_TRAINER_SLEEP": "300"}
    proc = start_job(env, tmp_path / "job.out")
    squatter = None
    try:
        wait_for_path(Path(env["FAKE_TRAINER_LOG"]), 240, proc)
        ((server, _),) = reward_servers(env)
        os.kill(server, signal.SIGKILL)
        # Bound within milliseconds: our restarted server is still importing torch when it tries the port.
        deadline = time.monotonic() + 10
        while squatter is None and time.monotonic() < deadline:
            try:
                squatter = http.server.HTTPServer(("0.0.0.0", int(env["CONFIG_REWARD_SERVER_PORT"])), OtherJobsServer)
            except OSError:
                time.sleep(0.01)
        assert squatter is not None, "the port never came free after the kill"
        threading.Thread(target=squatter.serve_forever, daemon=True).start()
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if squatter is not None:
            squatter.shutdown()
            squatter.server_close()
    out = tail(tmp_path / "job.out", 80)
    port = env["CONFIG_REWARD_SERVER_PORT"]
    assert rc == 1, out
    assert "restart 1/3" in out
    assert f":{port}/health is another job's server: it answers 401 to this job's token" in out
    assert f"reward server (port {port}) on {socket.gethostname()} did not become healthy again" in out
    assert "is back" not in out, "a 401 is never taken for our server"


def test_with_no_restarts_a_reward_server_that_dies_stops_the_job_at_once_naming_it(job, tmp_path):
    env = job | FAST | {"FAKE_TRAINER_SLEEP": "300", "REWARD_RESTARTS": "0"}
    proc = start_job(env, tmp_path / "job.out")
    try:
        wait_for_path(Path(env["FAKE_TRAINER_LOG"]), 240, proc)
        ((server, _),) = reward_servers(env)
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(120)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = tail(tmp_path / "job.out", 80)
    port = env["CONFIG_REWARD_SERVER_PORT"]
    log = job_dir(env) / f"reward_server_{socket.gethostname()}_{port}.log"
    assert rc == 1, out
    assert f"reward server (port {port}) on {socket.gethostname()} died (log: {log}): killed by SIGKILL" in out
    assert "REWARD_RESTARTS=0 restarts spent: stopping the job" in out
    assert seconds < 5 + int(env["STOP_TIMEOUT"]), f"the job went on for {seconds:.0f} s after its server died"
    assert_everything_stopped(env)


# --- checkpoints across requeues -----------------------------------------------------------------------------------


def test_what_a_job_writes_into_the_clone_by_default_is_ignored_by_git():
    """The run script's default HF_HOME (the datasets cache) and CONFIG_LOG_DIR lie in the clone: git status stays
    clean after a job, and `git add .` cannot commit a cache."""
    for written in (".cache/huggingface/datasets/x.arrow", "logs/local-1/trainer.log"):
        check = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", written], check=False)
        assert check.returncode == 0, f"{written} is not ignored by .gitignore"


def test_the_folders_the_settings_and_docs_tell_a_user_to_fill_are_ignored_by_git():
    """The block's default paths in the clone (models/, data/, checkpoints/, which README and docs/ tell a user to
    fill):
    a user's models, data and checkpoints never show in git status, and `git add .` cannot commit gigabytes."""
    defaults = [default.split("$repo/", 1)[1] for _, default, _ in block_settings() if "$repo/" in default]
    folders = {d.split("/", 1)[0] for d in defaults if "/" in d} - {".cache"}
    assert {"models", "data", "checkpoints"} <= folders, folders
    for folder in folders:
        written = f"{folder}/x/config.json"
        check = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", written], check=False)
        assert check.returncode == 0, f"{written} is not ignored by .gitignore"


def test_checkpoints_left_by_earlier_starts_are_pruned_but_never_the_one_verl_resumes_from(tmp_path):
    """verl prunes only the saves of its own process: after a requeue, the job prunes what earlier starts left."""
    ckpt = tmp_path / "ckpt"
    for step in (25, 50, 75, 100, 125):
        (ckpt / f"global_step_{step}" / "actor").mkdir(parents=True)
    (ckpt / "global_step_notes").mkdir()  # not a checkpoint: left alone
    (ckpt / "latest_checkpointed_iteration.txt").write_text("50")  # resume from 50 (a later save was cut short)
    result = subprocess.run(
        [sys.executable, "-m", "launch.job.checkpoints", str(ckpt), "2"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    left = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert left == ["global_step_100", "global_step_125", "global_step_50", "global_step_notes"]
    assert "removing" in result.stdout and "MAX_CKPT_TO_KEEP=2" in result.stdout
    keep_all = subprocess.run([sys.executable, "-m", "launch.job.checkpoints", str(ckpt), "0"], cwd=REPO)
    assert keep_all.returncode == 0 and len(list(ckpt.glob("global_step_*"))) == 4
