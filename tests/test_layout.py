"""The repository's layout: a product file stays small enough to read in one go (issue #47)."""

import subprocess

from tests.support import REPO

MAX_LINES = 600


def test_no_product_python_file_is_over_600_lines():
    """Every git-tracked *.py outside tests/ (launch/, reward_score/, benchmarks/, demo/, data_prep/, ...)."""
    tracked = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    names = [n for n in tracked.stdout.split("\0") if n and not n.startswith("tests/")]
    assert names, "git ls-files found no Python file"
    lengths = {n: len((REPO / n).read_text().splitlines()) for n in names}
    over = [f"{n}: {lines} lines" for n, lines in sorted(lengths.items()) if lines > MAX_LINES]
    assert not over, (
        f"over {MAX_LINES} lines: {'; '.join(over)}. Split each along its parts into modules of its package, "
        "the callers importing from where the code then lives"
    )
