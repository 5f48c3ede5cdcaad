"""Reward models trained by real TRL, scored by our server exactly as TRL trained them.

For each TRL version (requirements/trl-*.txt: 0.23.x, 0.24.x and the newest, each installed in a folder of its own by
`make test`), each of TRL's dataset layouts and each kind of tokenizer (tests/trl_cases.py: Qwen3's chat template with
its think block, and a tokenizer that adds a BOS), a tiny reward model is trained here by that version's own
RewardTrainer (tests/trl_train.py, in a subprocess; a few steps on the CPU), saved with save_model, and then:
- python -m reward_score.check_format, on the pairs, recommends the settings that TRL's source says that version
  trained with (trl_cases.expected_settings);
- with those settings the server builds exactly the token ids TRL's preprocessing produced;
- the server started with the recommended settings scores every pair as TRL's compute_loss does (float tolerance).
The models memorise random pairs, so each ranks them right only in its own format (the pairs are the training pairs:
what a user passes is held-out pairs, which only a real model generalises to). The BOS-adding tokenizer's models are
GPT-2-shaped (learned absolute positions): one token more or less at the start moves every position, as a missing or
extra BOS moves a real LLM; a tiny RoPE model trained for seconds scores alike with one BOS or two, and check_format
cannot tell formats apart that the model scores alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from reward_score.check_format import evaluate, format_report, load_scorer, parse_pairs
from reward_score.server.app import create_app
from reward_score.server.runner import RewardScorer
from reward_score.server.settings import Settings
from tests.support import REPO, once_per_run
from tests.trl_cases import LAYOUTS, base_pairs, build_base_model, expected_settings, rows_for

# The folder `make test` installs each version into (first on PYTHONPATH of the training subprocess).
STACKS = {"0.23": "trl-0.23", "0.24": "trl-0.24", "newest": "trl-newest"}
KINDS = ("qwen3", "llama3")
# The chat templates as TRL ships them (trl/chat_templates/, compared by TRL with Qwen's and Meta's own): the newest
# TRL's copies, checked so that a change of template is a failure here, not a silent change of what is tested.
TEMPLATES = {
    "qwen3": ("qwen3.jinja", "ae518d20e400c6e67716982491e5c37d"),
    "llama3": ("llama3.jinja", "5a19f7fb717915ba7196d6b92b722475"),
}
TRAINING = {"steps": 20, "batch": 16, "lr": 1e-2, "seed": 0}  # ~1 s a model on one core
PAIRS = 32
CASES = [(stack, layout, kind) for stack in STACKS for layout in LAYOUTS for kind in KINDS]


def _pinned(stack: str) -> str:
    """The version requirements/trl-<stack>.txt pins for this Python."""
    from packaging.requirements import Requirement

    for line in (REPO / "requirements" / f"{STACKS[stack]}.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate():
                return str(req.specifier).removeprefix("==")
    raise AssertionError(f"requirements/{STACKS[stack]}.txt pins no TRL for this Python")


def _stack_folder(stack: str) -> Path:
    """The installed folder; its TRL's own requirements must hold in this environment (it was installed --no-deps)."""
    from importlib.metadata import PathDistribution, version

    from packaging.requirements import Requirement

    folder = Path(sys.prefix) / STACKS[stack]
    dists = list(folder.glob("trl-*.dist-info"))
    if not (folder / ".installed").exists() or not dists:
        pytest.fail(f"TRL for {stack!r} is not installed in {folder}: run `make trl` (`make test` does it)")
    dist = PathDistribution(dists[0])
    assert dist.version == _pinned(stack), f"{folder} holds TRL {dist.version}; requirements pin {_pinned(stack)}"
    unmet = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = version(req.name)
        except Exception:  # noqa: BLE001 - not installed at all
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (have {have})")
    assert not unmet, f"TRL {dist.version} needs {', '.join(unmet)}: the test environment does not satisfy it"
    return folder


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict:
    """Every case trained, the three TRL versions in parallel: {(stack, layout, kind): (rows, model, TRL's record)}.
    Once per run: xdist hands these tests to every worker, and each would train them all again."""
    cases = once_per_run(tmp_path_factory, "trl", train_every_case)
    return {tuple(case): (rows, Path(model), record) for case, rows, model, record in cases}


def train_every_case(root: Path) -> list:
    """[(stack, layout, kind), rows, model folder, TRL's record] for every case, trained in `root`."""
    folders = {stack: _stack_folder(stack) for stack in STACKS}
    templates = {}
    for kind, (name, md5) in TEMPLATES.items():
        text = (folders["newest"] / "trl" / "chat_templates" / name).read_text()
        assert hashlib.md5(text.encode()).hexdigest() == md5, f"TRL's {name} changed: check what the tests cover"
        templates[kind] = text
    # Conversations need the template; plain text goes without one for llama3 (the server's plain-text fallback)
    # and with Qwen3's for qwen3 (a plain-text dataset on a templated tokenizer: REWARD_CHAT_TEMPLATE=off).
    bases = {
        (kind, chat): build_base_model(root / f"base_{kind}_{chat}", kind, templates[kind] if chat else None)
        for kind in KINDS
        for chat in (True, False)
        if chat or kind == "llama3"
    }
    pairs = base_pairs(PAIRS, seed=1)
    procs, specs = {}, {}
    for stack, folder in folders.items():
        cases = []
        for layout in LAYOUTS:
            for kind in KINDS:
                chat = layout.startswith("conversation") or kind == "qwen3"
                cases.append(
                    {
                        "name": f"{layout}-{kind}",
                        "base_model": str(bases[(kind, chat)]),
                        "out": str(root / stack / f"{layout}-{kind}"),
                        "rows": rows_for(layout, pairs),
                        **TRAINING,
                    }
                )
        spec = root / f"spec-{stack}.json"
        spec.write_text(json.dumps({"trl_version": _pinned(stack), "cases": cases}))
        specs[stack] = (spec, root / f"result-{stack}.json", cases)
        env = dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        log = open(root / f"train-{stack}.log", "w")  # noqa: SIM115  (closed below)
        procs[stack] = (
            subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "trl_train.py"), str(spec), str(specs[stack][1])],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log,
        )
    started, out = time.monotonic(), []
    for stack, (proc, log) in procs.items():
        code = proc.wait(timeout=max(1, 600 - (time.monotonic() - started)))
        log.close()
        text = Path(log.name).read_text()
        assert code == 0, f"training with TRL {stack} failed (exit {code}):\n{text[-4000:]}"
        result = json.loads(specs[stack][1].read_text())
        assert Path(result["trl_file"]).is_relative_to(folders[stack]), result["trl_file"]
        for case, record in zip(specs[stack][2], result["cases"], strict=True):
            layout, kind = case["name"].split("-")
            out.append([[stack, layout, kind], case["rows"], case["out"], record])
    return out


@pytest.fixture(scope="session")
def reports(trained):
    """check_format's report for a case, computed once."""
    cache = {}

    def report(case):
        if case not in cache:
            rows, model, _ = trained[case]
            cache[case] = evaluate(load_scorer(str(model), "cpu"), *parse_pairs(rows))
        return cache[case]

    return report


def _case_id(case) -> str:
    return "-".join(case)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_check_format_recommends_the_settings_that_trl_version_trained_with(trained, reports, case):
    stack, layout, kind = case
    report = reports(case)
    expected = expected_settings(_pinned(stack), layout, kind)
    assert report.recommended.matches(expected), format_report(report, str(trained[case][1]), layout, "cpu")
    assert report.recommended.right == report.pairs, "a model ranks its own training pairs right, as trained"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_settings_read_from_trls_source_give_exactly_the_ids_trl_trained_on(trained, case):
    stack, layout, kind = case
    rows, model, record = trained[case]
    settings = Settings(model_path=str(model), device="cpu", **expected_settings(_pinned(stack), layout, kind))
    scorer = RewardScorer.load(settings)
    _, pairs = parse_pairs(rows)
    chosen = scorer.tokenize([scorer.render(*p.chosen) for p in pairs])
    rejected = scorer.tokenize([scorer.render(*p.rejected) for p in pairs])
    assert chosen == record["chosen_ids"] and rejected == record["rejected_ids"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_server_with_the_recommended_settings_scores_every_pair_as_trl_does(trained, reports, case):
    rows, model, record = trained[case]
    _, pairs = parse_pairs(rows)
    report = reports(case)
    settings = replace(Settings(model_path=str(model), device="cpu"), **report.recommended.settings)
    # What the model read in training: TRL's ids up to the last token that is not the pad token.
    pad = record["pad_token_id"]

    def read(ids):
        while len(ids) > 1 and ids[-1] == pad:
            ids = ids[:-1]
        return ids

    assert report.recommended.scored == [
        (read(c), read(r)) for c, r in zip(record["chosen_ids"], record["rejected_ids"], strict=True)
    ]
    items = [{"messages": m, "response": r} for p in pairs for m, r in (p.chosen, p.rejected)]
    with TestClient(create_app(settings)) as client:
        health = client.get("/health").json()
        body = client.post("/score_batch", json={"items": items})
    assert body.status_code == 200, body.text
    assert health["input"] == settings.input
    scores = body.json()["scores"]
    assert scores[::2] == pytest.approx(record["chosen_scores"], rel=1e-5, abs=1e-5)
    assert scores[1::2] == pytest.approx(record["rejected_scores"], rel=1e-5, abs=1e-5)


def test_models_that_trl_024_and_later_trained_on_conversations_need_no_setting(reports):
    """The defaults stay what they were for the models that already matched."""
    for stack in ("0.24", "newest"):
        for layout in ("conversation", "conversation_prompt"):
            for kind in KINDS:
                report = reports((stack, layout, kind))
                assert report.given is report.recommended, (stack, layout, kind, report.recommended.settings)
