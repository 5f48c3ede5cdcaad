"""verl_app.def, checked as far as a machine without Singularity allows: its structure and build arguments, %post
through shellcheck, its install line resolved against each base image's versions, and the build-time check that
nothing of the base moved, run here against this environment."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan import image_check
from tests.support import REPO

DEF = (REPO / "verl_app.def").read_text()
SGLANG_BASE = "verlai/verl:app-verl0.6-transformers4.56.1-sglang0.5.2-mcore0.13.0-te2.2"
VLLM_BASE = "verlai/verl:app-verl0.5-transformers4.55.4-vllm0.10.0-mcore0.13.0-te2.2"
PYTHON_OF_BASE = {"sglang": "3.12", "vllm": "3.10"}  # NGC pytorch 25.03 and 24.08


def section(name: str, text: str = DEF) -> str:
    match = re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", text, re.S | re.M)
    assert match, f"verl_app.def has no %{name} section"
    return match.group(1)


def arguments() -> dict[str, str]:
    lines = [line.strip() for line in section("arguments").splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def rendered(**build_args: str) -> str:
    """The def as `singularity build --build-arg K=V` sees it: every {{ NAME }} replaced."""
    values = {**arguments(), **build_args}
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], DEF)


def pip_installs(post: str) -> list[list[str]]:
    return [shlex.split(line)[4:] for line in post.splitlines() if line.strip().startswith("python3 -m pip install")]


def test_the_image_builds_on_the_articles_sglang_base_by_default_with_every_section():
    assert re.search(r"^Bootstrap: docker\nFrom: \{\{ BASE \}\}$", DEF, re.M)
    assert arguments()["BASE"] == SGLANG_BASE
    for name in ("arguments", "help", "labels", "files", "post", "environment", "test"):
        assert section(name).strip(), name


def test_every_build_argument_used_has_a_default():
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", DEF))
    assert used == set(arguments()), used ^ set(arguments())


def test_the_help_gives_one_build_command_per_flavour():
    help_text = section("help")
    assert "sudo singularity build verl_app.sif verl_app.def" in help_text
    assert f"sudo singularity build --build-arg BASE={VLLM_BASE} verl_app_vllm.sif verl_app.def" in help_text
    assert f"--build-arg BASE={VLLM_BASE}" in section("arguments")


def test_the_package_index_is_a_build_setting_and_the_bases_mirror_is_ignored():
    assert arguments()["PIP_INDEX"] == "https://pypi.org/simple"
    post = section("post", rendered(PIP_INDEX="https://pypi.example.org/simple"))
    assert "export PIP_CONFIG_FILE=/dev/null" in post  # the base's `pip config set global.index-url` mirror
    assert "export PIP_INDEX_URL='https://pypi.example.org/simple'" in post
    assert "pip.index https://pypi.example.org/simple" in section(
        "labels", rendered(PIP_INDEX="https://pypi.example.org/simple")
    )


@pytest.mark.parametrize("base", [SGLANG_BASE, VLLM_BASE])
def test_post_passes_shellcheck(tmp_path, base):
    script = tmp_path / "post.sh"
    script.write_text("#!/bin/sh\n" + section("post", rendered(BASE=base)))
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    run = subprocess.run([shellcheck, "--shell=sh", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


def test_post_records_the_base_first_installs_under_its_constraints_and_checks_last():
    post = [line.strip() for line in section("post").splitlines() if line.strip() and not line.strip().startswith("#")]
    record = post.index("python3 /opt/verl-slurm/launch/plan/image_check.py --record-base /opt/verl_app")
    installs = [i for i, line in enumerate(post) if "pip install" in line]
    freeze = post.index("python3 -m pip freeze > /opt/verl_app/pip-freeze.txt")
    check = post.index("python3 /opt/verl-slurm/launch/plan/image_check.py --base /opt/verl_app")
    assert record < min(installs) and max(installs) < freeze < check == len(post) - 1
    assert section("test").strip() == "python3 /opt/verl-slurm/launch/plan/image_check.py --base /opt/verl_app"


def test_post_never_upgrades_or_downgrades_a_base_package():
    installs = pip_installs(section("post"))
    verl, reward = installs  # exactly two installs: nothing else is pip-installed by name
    assert verl == ["--no-deps", "-e", "/opt/verl"]
    assert reward == [
        "--upgrade-strategy",
        "only-if-needed",
        "-c",
        "/opt/verl_app/base-constraints.txt",
        "-r",
        "/opt/verl-slurm/requirements/reward.txt",
    ]
    for args in installs:
        assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"} & set(args), args
    assert "--upgrade pip" not in section("post")  # pip is a base package too


def test_the_image_installs_lower_bounds_only():
    for line in (REPO / "requirements" / "reward.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+>=[0-9][^ ,]*", line), f"not a plain lower bound: {line}"


def test_the_images_verl_tag_is_the_version_the_tests_pin():
    verl_pin = re.search(r"^verl==(\S+)", (REPO / "requirements" / "test.txt").read_text(), re.M).group(1)
    assert f"VERL_TAG=v{verl_pin}" in section("post") and '--branch "$VERL_TAG"' in section("post")
    assert f"verl/tree/v{verl_pin}" in section("labels")


def test_the_files_the_image_copies_exist_and_cover_what_its_check_loads():
    copied = {}
    for line in section("files").strip().splitlines():
        src, dest = line.split()
        assert (REPO / src).is_file(), line
        assert dest == f"/opt/verl-slurm/{src}", line  # the same layout, so image_check finds them from its own path
        copied[src] = dest
    loaded = re.findall(r'HERE((?: / "[\w.]+")+)', (REPO / "launch" / "plan" / "image_check.py").read_text())
    assert loaded, "image_check.py loads nothing by path?"
    for path in ("/".join(re.findall(r'"([\w.]+)"', parts)) for parts in loaded):
        assert path in copied, f"image_check.py needs {path}: add it to %files"
    assert "launch/plan/image_check.py" in copied and "requirements/reward.txt" in copied


def resolve_post_install(tmp_path: Path, base: str, requirements: str) -> subprocess.CompletedProcess:
    """%post's reward install line, resolved (not installed) from PyPI for the base's Python, with the base's
    versions (requirements/base-images/) as the constraints the build takes from the image itself."""
    reward_line = next(args for args in pip_installs(section("post")) if "-r" in args)
    args = [
        a.replace(
            "/opt/verl_app/base-constraints.txt", str(REPO / "requirements" / "base-images" / f"{base}.txt")
        ).replace("/opt/verl-slurm/requirements/reward.txt", requirements)
        for a in reward_line
    ]
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull  # as %post: no local pip configuration
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--report",
        str(tmp_path / "report.json"),
        "--index-url",
        "https://pypi.org/simple",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_OF_BASE[base],
        "--target",
        str(tmp_path / "target"),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("base", ["sglang", "vllm"])
def test_the_install_line_resolves_on_each_base_without_moving_anything_it_holds(tmp_path, base):
    """Needs PyPI (as `make env` does). The report lists what pip would install into an empty target: every package
    the base holds comes out at the base's version, so on the image itself there is nothing to install."""
    run = resolve_post_install(tmp_path, base, str(REPO / "requirements" / "reward.txt"))
    assert run.returncode == 0, run.stderr[-3000:]
    held = image_check.read_pins(REPO / "requirements" / "base-images" / f"{base}.txt")
    report = json.loads((tmp_path / "report.json").read_text())
    resolved = {image_check.normalise(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for name in ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "prometheus-client", "requests"):
        assert resolved[name] == held[name], f"{name} would move: {held[name]} -> {resolved[name]}"
    assert not image_check.moved_packages({n: v for n, v in held.items() if n in resolved}, resolved)


def test_the_old_exact_pins_would_have_failed_the_build_instead_of_upgrading_the_base(tmp_path):
    """What the image installed before (fastapi 0.165, uvicorn 0.54 ...): under the base's constraints pip refuses."""
    run = resolve_post_install(tmp_path, "sglang", str(REPO / "requirements" / "reward-newest.txt"))
    assert run.returncode != 0
    assert "ResolutionImpossible" in run.stderr or "conflict" in run.stderr.lower(), run.stderr[-2000:]


def test_the_sglang_image_checks_sglangs_servers_and_the_vllm_image_checks_one_step_offs_weight_sync():
    sglang = {m.name for m in image_check.modules_to_check("sglang", recipes=True, megatron=True)}
    vllm = {m.name for m in image_check.modules_to_check("vllm", recipes=True, megatron=True)}
    for common in (
        "verl.workers.megatron_workers",
        "megatron.core",
        "transformer_engine",
        "recipe.dapo.main_dapo",
        "recipe.one_step_off_policy.main_ppo",
        "verl.model_merger",
        "uvicorn",
    ):
        assert common in sglang and common in vllm, common
    assert {"sglang", "sgl_kernel", "verl.workers.rollout.sglang_rollout.async_sglang_server"} <= sglang
    assert {"vllm", "verl.workers.rollout.vllm_rollout.vllm_async_server"} <= vllm
    # recipe/one_step_off_policy/distributed_util.py imports vllm.distributed: one-step-off runs on the vLLM image only
    assert "recipe.one_step_off_policy.distributed_util" in vllm
    # ...which imports vllm only inside its function, so the check imports what that function imports
    assert {"vllm.distributed.utils", "vllm.distributed.device_communicators.pynccl"} <= vllm
    assert not any(name.startswith("vllm") or "distributed_util" in name for name in sglang)


def test_without_a_gpu_a_gpu_module_that_fails_is_skipped_and_any_other_fails(capsys):
    mods = [image_check.Module("no_such_module_xyz", gpu=True), image_check.Module("no_such_module_abc", why="x")]
    problems = image_check.check_imports(mods, gpu=False)
    assert problems == ["import no_such_module_abc (x): ModuleNotFoundError: No module named 'no_such_module_abc'"]
    assert "skip import no_such_module_xyz (no GPU visible" in capsys.readouterr().out
    assert len(image_check.check_imports(mods, gpu=True)) == 2  # on a GPU node both count


def test_the_engine_is_detected_from_what_is_installed(monkeypatch):
    monkeypatch.setattr(image_check, "installed", lambda dist: "0.10.0" if dist == "vllm" else None)
    assert image_check.detect_engine() == "vllm"
    monkeypatch.setattr(image_check, "installed", lambda dist: None)
    with pytest.raises(RuntimeError, match="exactly one rollout engine"):
        image_check.detect_engine()


def test_the_build_check_passes_when_nothing_moved_and_names_a_package_that_did(tmp_path, capsys):
    """The real record/compare on this environment: recorded now, nothing moved; a record that held another
    version of a package (as if the build had upgraded it) is reported with both versions."""
    image_check.record_base(tmp_path)
    assert (tmp_path / "base-constraints.txt").read_text().strip()
    assert image_check.check_base_untouched(tmp_path) == []
    record = tmp_path / "base-packages.txt"
    requests_version = image_check.read_pins(record)["requests"]
    record.write_text(record.read_text().replace(f"requests=={requests_version}", "requests==0.0.1"))
    problems = image_check.check_base_untouched(tmp_path)
    assert problems == [f"the build changed a base package: requests 0.0.1 -> {requests_version}"]


def test_pip_check_lines_the_build_added_fail_except_verls_own_requirements():
    before = "torch-memory-saver 0.0.9rc1 has requirement x, but you have y.\n"
    after = before + (
        "verl 0.6.1 has requirement tensordict<=0.10.0,!=0.9.0,>=0.8.0, but you have tensordict 0.6.2.\n"
        "fastapi 0.117.1 has requirement starlette<0.49.0,>=0.40.0, but you have starlette 1.10.0.\n"
    )
    broken, notes = image_check.new_pip_check_lines(before, after)
    assert broken == ["fastapi 0.117.1 has requirement starlette<0.49.0,>=0.40.0, but you have starlette 1.10.0."]
    assert notes == ["verl 0.6.1 has requirement tensordict<=0.10.0,!=0.9.0,>=0.8.0, but you have tensordict 0.6.2."]


def test_post_on_a_base_holding_the_oldest_stack_adds_nothing_and_a_pinned_upgrade_is_caught(tmp_path):
    """%post's own steps, run against a stand-in base (a venv holding the older base image's web stack, from PyPI):
    record the base, the install line as written, then the check. Nothing is added or moved; then an upgrade like
    the old def's exact pins (fastapi 0.165) is named by the same check."""
    base, record = tmp_path / "base", tmp_path / "verl_app"
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True)
    python = str(base / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PYTHONPATH")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="https://pypi.org/simple", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def sh(*cmd: str) -> subprocess.CompletedProcess:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return run

    reward_txt = str(REPO / "requirements" / "reward.txt")
    sh(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "packaging",
        "-r",
        reward_txt,
        "-c",
        str(REPO / "requirements" / "base-images" / "vllm.txt"),
    )
    sh(python, str(REPO / "launch" / "plan" / "image_check.py"), "--record-base", str(record))
    reward_line = next(args for args in pip_installs(section("post")) if "-r" in args)
    args = [
        a.replace("/opt/verl_app", str(record)).replace("/opt/verl-slurm/requirements/reward.txt", reward_txt)
        for a in reward_line
    ]
    sh(python, "-m", "pip", "install", *args)
    compare = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
        f"from launch.plan import image_check; print(image_check.check_base_untouched(Path({str(record)!r})))"
    )
    out = sh(python, "-c", compare).stdout
    assert "base packages unchanged; added: -" in out and out.strip().endswith("[]"), out
    assert "fastapi==0.116.1" in (record / "base-constraints.txt").read_text().splitlines()

    sh(python, "-m", "pip", "install", "-q", "fastapi==0.165.0")  # what the image installed before
    out = sh(python, "-c", compare).stdout
    assert "the build changed a base package: fastapi 0.116.1 -> 0.165.0" in out, out


def test_the_servers_files_the_image_copies_are_all_it_needs(tmp_path):
    """%files copies parts of the repository to /opt/verl-slurm; the reward server there must start (--help-all) alone,
    every part of it imported."""
    for line in section("files").strip().splitlines():
        source, dest = line.split()
        target = tmp_path / Path(dest).relative_to("/opt/verl-slurm")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / source, target)
    run = subprocess.run(
        [sys.executable, str(tmp_path / "reward_score" / "reward_server.py"), "--help-all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
    )
    assert run.returncode == 0, run.stderr
    assert "REWARD_MICRO_BATCH_COST" in run.stdout
