"""verl_app.def, checked as far as a machine without Singularity allows: its structure, %post through shellcheck,
its pins against the project's, and its %test's check run here against the test environment."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

DEF = (REPO / "verl_app.def").read_text()


def section(name: str) -> str:
    match = re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", DEF, re.S | re.M)
    assert match, f"verl_app.def has no %{name} section"
    return match.group(1)


def test_the_image_builds_on_the_articles_base_with_every_section():
    assert re.search(r"^Bootstrap: docker$", DEF, re.M)
    assert "From: verlai/verl:app-verl0.6-transformers4.56.1-sglang0.5.2-mcore0.13.0-te2.2" in DEF
    for name in ("help", "labels", "files", "post", "environment", "test"):
        assert section(name).strip(), name


def test_post_passes_shellcheck(tmp_path):
    script = tmp_path / "post.sh"
    script.write_text("#!/bin/sh\n" + section("post"))
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    run = subprocess.run([shellcheck, "--shell=sh", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


def test_the_image_pins_agree_with_the_projects():
    post, files = section("post"), section("files")
    verl_pin = re.search(r"^verl==(\S+)", (REPO / "requirements" / "test.txt").read_text(), re.M).group(1)
    assert f"VERL_TAG=v{verl_pin}" in post, "the image's verl tag must be the version the tests pin"
    assert "requirements/reward.txt /opt/verl-slurm/requirements/reward.txt" in files
    assert "pip install -r /opt/verl-slurm/requirements/reward.txt" in post
    # Nothing else is pip-installed by name, so no second, drifting set of pins.
    installs = [line.strip() for line in post.splitlines() if "pip install" in line]
    assert all("-r " in i or "--no-deps -e /opt/verl" in i or "--upgrade pip" in i for i in installs), installs
    for line in (REPO / "requirements" / "reward.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][^ ]*", line), f"unpinned run-time dependency: {line}"


def test_the_files_the_image_copies_exist():
    for line in section("files").strip().splitlines():
        assert (REPO / line.split()[0]).is_file(), line


def test_the_images_check_passes_in_the_test_environment():
    """The %test runs launch/image_check.py; here verl comes from the wheel, which holds no recipes."""
    assert "python3 /opt/verl-slurm/launch/image_check.py" in section("test")
    run = subprocess.run(
        [sys.executable, str(REPO / "launch" / "image_check.py"), "--skip-recipes"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok   import verl.model_merger" in run.stdout


def test_the_servers_files_the_image_copies_are_all_it_needs(tmp_path):
    """%files copies parts of the repository to /opt/verl-slurm; the reward server there must start (--help) alone."""
    for line in section("files").strip().splitlines():
        source, dest = line.split()
        target = tmp_path / Path(dest).relative_to("/opt/verl-slurm")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / source, target)
    run = subprocess.run(
        [sys.executable, str(tmp_path / "reward_score" / "reward_server.py"), "--help"],
        cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "REWARD_TOKEN_BUDGET" in run.stdout
