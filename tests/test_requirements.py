"""The test environment's lock (requirements/lock.txt) agrees with the files it was resolved from, and with what is
installed: a pin moved in one and not in the other would make `make env` fail to resolve, or install a version the
tests never ran on."""

import re
from importlib import metadata

from requirements import lock
from tests.support import REPO

REQUIREMENTS = REPO / "requirements"


def pins(path) -> dict[str, str]:
    """name -> version of every exact pin in a requirements file, following its -r includes."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            found |= pins(path.parent / line[3:].strip())
        elif match := re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line):
            found[match[1].lower().replace("_", "-")] = match[2]
    return found


def names(path) -> set[str]:
    """Every package a requirements file names, pinned or not, following its -r includes."""
    found = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            found |= names(path.parent / line[3:].strip())
        elif match := re.match(r"[A-Za-z0-9_.-]+", line):
            found.add(match[0].lower().replace("_", "-"))
    return found


LOCKED = pins(REQUIREMENTS / "lock.txt")


def test_every_pin_of_the_requirements_is_the_locks_version():
    for source in ("test.txt", "constraints.txt"):
        for name, version in pins(REQUIREMENTS / source).items():
            if name != "torch":  # the local CPU build, installed first; the lock leaves it out
                assert LOCKED.get(name) == version, (
                    f"{source} pins {name}=={version}, lock.txt has {LOCKED.get(name)}: make lock"
                )


def test_every_package_the_tests_require_is_locked():
    missing = names(REQUIREMENTS / "test.txt") - set(LOCKED)
    assert not missing, f"not in requirements/lock.txt: {sorted(missing)}: run make lock"


def test_the_environment_the_tests_run_in_is_the_locked_one():
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
    wrong = {name: (version, installed.get(name)) for name, version in LOCKED.items() if installed.get(name) != version}
    wrong.pop("setuptools", None)  # the venv's own, which `make env` does not install
    assert not wrong, f"locked vs installed: {wrong}: make clean-env env"


def test_the_lock_is_written_from_pips_report_without_torch():
    report = {
        "install": [
            {"metadata": {"name": n, "version": v}}
            for n, v in [("Torch", "2.13.0+cpu"), ("PyYAML", "6"), ("pydantic_core", "2")]
        ]
    }
    assert lock.lock_lines(report) == ["pydantic-core==2", "pyyaml==6"]
