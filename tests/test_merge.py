"""merge_mcore_to_hf.sh: picks the right step, decides the tie flag from the config, and proves the result complete.

The merger is a fake that writes a tiny HF checkpoint as verl's would (tests/fakes/fake_merger.py); the script, the
checks and the verification are real."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

MERGE = REPO / "merge_mcore_to_hf.sh"


def make_checkpoint(root: Path, policy: Path, steps=(10, 20), tied=True, roles=("actor",)) -> Path:
    """The folder layout verl 0.6.1's trainer writes: tracker file, global_step_N/<role>/huggingface (+ dist_ckpt)."""
    for step in steps:
        for role in roles:
            hf = root / f"global_step_{step}" / role / "huggingface"
            shutil.copytree(policy, hf)
            for weights in hf.glob("*.safetensors"):
                weights.unlink()  # by default only config and tokenizer are saved beside dist_ckpt
            config = json.loads((hf / "config.json").read_text())
            config["tie_word_embeddings"] = tied
            (hf / "config.json").write_text(json.dumps(config))
            (hf.parent / "dist_ckpt").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text(f"{steps[-1]}\n")
    return root


@pytest.fixture
def merge_env(tmp_path, fake_cluster):
    merger = fake_cluster.bin_dir / "fake-merger"
    merger.write_text(
        f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{REPO / "tests" / "fakes" / "fake_merger.py"}" "$@"\n'
    )
    merger.chmod(0o755)
    image = tmp_path / "app.sif"
    image.write_text("fake")
    return dict(
        os.environ,
        PATH=f"{fake_cluster.bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        CONTAINER="singularity",
        CONFIG_IMAGE_PATH=str(image),
        CKPT_ROOT=str(tmp_path / "ckpt"),
        MERGER_LAUNCHER=str(merger),
        FAKE_MERGER_LOG=str(tmp_path / "merger.jsonl"),
    )


def run(env, **extra):
    return subprocess.run(["bash", str(MERGE)], env=env | extra, cwd=REPO, capture_output=True, text=True, timeout=300)


def merger_calls(env) -> list[list[str]]:
    path = Path(env["FAKE_MERGER_LOG"])
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_latest_step_tied_config_merges_with_the_flag_and_verifies(merge_env, tiny_models, tmp_path, fake_cluster):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    target = tmp_path / "out" / "hf"
    result = run(merge_env, TARGET_DIR=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert argv[argv.index("--local_dir") + 1] == str(tmp_path / "ckpt" / "global_step_20" / "actor")
    assert "--tie-word-embedding" in argv and "--is-value-model" not in argv
    assert "tied embeddings: true (config.json says true" in result.stdout
    assert "verified" in result.stdout and "tied embeddings, no lm_head" in result.stdout
    assert (target / "model.safetensors.index.json").exists() and (target / "tokenizer_config.json").exists()
    assert not list(target.parent.glob("hf.tmp.*"))
    calls = [c["argv"] for c in fake_cluster.calls("singularity")]
    assert calls and all(c[:2] == ["exec", "--nv"] for c in calls), "the merger runs in the image, on a GPU"


def test_an_untied_model_keeps_its_lm_head(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=False)
    result = run(merge_env, STEP="10", VERIFY_LOAD="1")
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert "--tie-word-embedding" not in argv and "global_step_10" in argv[argv.index("--local_dir") + 1]
    assert "untied embeddings, lm_head present" in result.stdout
    assert (REPO / "hf_models" / "ckpt-step10").exists()
    shutil.rmtree(REPO / "hf_models" / "ckpt-step10")
    if not any((REPO / "hf_models").iterdir()):
        (REPO / "hf_models").rmdir()


@pytest.mark.parametrize(
    "tied, broken, needle",
    [
        (False, "drop_lm_head", "lm_head.weight is missing although the embeddings are untied"),
        (True, "extra_lm_head", "unexpected tensor lm_head.weight"),
        (True, "missing_shard", "shard model-00002-of-00002.safetensors is listed in the index but missing"),
    ],
)
def test_broken_output_is_rejected_and_kept_aside(merge_env, tiny_models, tmp_path, tied, broken, needle):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=tied)
    target = tmp_path / "hf"
    result = run(merge_env, TARGET_DIR=str(target), FAKE_MERGER_BREAK=broken)
    assert result.returncode == 1
    assert needle in result.stderr
    assert not target.exists() and (tmp_path / "hf.failed").exists()


def test_the_critic_is_merged_as_a_value_model(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True, roles=("actor", "critic"))
    result = run(merge_env, ROLE="critic", TARGET_DIR=str(tmp_path / "critic_hf"))
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert "--is-value-model" in argv and argv[argv.index("--local_dir") + 1].endswith("global_step_20/critic")
    assert "value head ['lm_head.weight']" in result.stdout


def test_a_checkpoint_that_already_holds_hf_weights_is_copied_and_verified(merge_env, tiny_models, tmp_path):
    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    for weights in Path(tiny_models.policy).glob("*.safetensors"):
        shutil.copy(weights, root / "global_step_20" / "actor" / "huggingface")
    result = run(merge_env, TARGET_DIR=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert merger_calls(merge_env) == [], "no merge needed"
    assert "already holds Hugging Face weights" in result.stdout and "verified" in result.stdout


@pytest.mark.parametrize(
    "setup, extra, needle",
    [
        ("no_tracker", {}, "latest_checkpointed_iteration.txt is missing"),
        ("ok", {"STEP": "99"}, "STEP=99 ROLE=actor: "),
        ("ok", {"ROLE": "critic"}, "global_step_20/critic does not exist"),
        ("ok", {"CKPT_ROOT": "/nowhere"}, "CKPT_ROOT=/nowhere: no such folder"),
        ("not_verl", {}, "huggingface/config.json is missing: is CKPT_ROOT a verl checkpoint folder?"),
        ("target_exists", {}, "already exists: choose another or remove it"),
        ("ok", {"TIE_WORD_EMBEDDINGS": "maybe"}, "TIE_WORD_EMBEDDINGS=maybe"),
    ],
)
def test_bad_input_names_the_setting_and_changes_nothing(merge_env, tiny_models, tmp_path, setup, extra, needle):
    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy)
    target = tmp_path / "hf"
    if setup == "no_tracker":
        (root / "latest_checkpointed_iteration.txt").unlink()
    if setup == "not_verl":
        (root / "global_step_20" / "actor" / "huggingface" / "config.json").unlink()
    if setup == "target_exists":
        target.mkdir()
        (target / "keep.txt").write_text("mine")
    result = run(merge_env, TARGET_DIR=str(target), **extra)
    assert result.returncode == 1
    assert needle in result.stderr
    assert merger_calls(merge_env) == []
    if setup == "target_exists":
        assert (target / "keep.txt").read_text() == "mine"
    if extra.get("STEP") == "99":
        assert "global_step_10" in result.stderr and "global_step_20" in result.stderr
