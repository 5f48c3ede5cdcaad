"""Write requirements/lock.txt: every package of the test environment at the version pip resolved (`make lock`).

`make env` installs with the lock as constraints, so pip has one candidate per package and never backtracks. Without
it, pip walked back through a dozen virtualenv releases (ray[default] asks only virtualenv>=20.0.24) downloading each,
and one truncated download failed CI's install after 8 minutes. The input is the JSON report of
`pip install --dry-run --ignore-installed --report FILE -r requirements/test.txt -c requirements/constraints.txt`.
torch stays out: it is the local CPU build that constraints.txt pins and the Makefile installs first.

    python requirements/lock.py REPORT.json > requirements/lock.txt
"""

import json
import sys

HEADER = """\
# Every package of the test environment at the version pip resolved, as constraints for `make env`: one candidate
# each, so pip never backtracks (it downloaded a dozen virtualenv releases before). Written by `make lock` from
# requirements/test.txt and requirements/constraints.txt; tests/test_requirements.py checks the two agree.
"""


def lock_lines(report: dict) -> list[str]:
    pins = {}
    for item in report["install"]:
        name = item["metadata"]["name"].lower().replace("_", "-")
        if name != "torch":
            pins[name] = item["metadata"]["version"]
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def main() -> None:
    with open(sys.argv[1]) as handle:
        report = json.load(handle)
    sys.stdout.write(HEADER + "\n".join(lock_lines(report)) + "\n")


if __name__ == "__main__":
    main()
