"""merge_mcore_to_hf.sh: picks the right step, decides the tie flag from the config, and proves the result complete.

The merger is a fake that writes a tiny HF checkpoint as verl's would (tests/fakes/fake_merger.py); the script, the
checks, the critic conversion and the verification are real."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.merge import verify_hf
from tests.fakes.fake_merger import save_critic_like_verl
from tests.support import REPO

MERGE = REPO / "merge_mcore_to_hf.sh"


def make_checkpoint(
    root: Path, policy: Path, steps=(10, 20), tied=True, roles=("actor",), model_type=None, fsdp=False
) -> Path:
    """The folder layout verl 0.6.1's trainer writes: tracker file, global_step_N/<role>/huggingface (+ dist_ckpt; with
    fsdp=True, STRATEGY=fsdp2's fsdp_config.json instead). tied=None leaves tie_word_embeddings out of config.json;
    model_type="gemma" swaps in a tiny Gemma config."""
    for step in steps:
        for role in roles:
            hf = root / f"global_step_{step}" / role / "huggingface"
            shutil.copytree(policy, hf)
            for weights in hf.glob("*.safetensors"):
                weights.unlink()  # by default only config and tokenizer are saved beside dist_ckpt
            config = json.loads((hf / "config.json").read_text())
            if model_type == "gemma":
                config = dict(
                    model_type="gemma",
                    architectures=["GemmaForCausalLM"],
                    vocab_size=config["vocab_size"],
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    head_dim=8,
                )
            config.pop("tie_word_embeddings", None)
            if tied is not None:
                config["tie_word_embeddings"] = tied
            (hf / "config.json").write_text(json.dumps(config))
            if fsdp:
                (hf.parent / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')
            else:
                (hf.parent / "dist_ckpt").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text(f"{steps[-1]}\n")
    return root


@pytest.fixture
def merge_env(tmp_path, fake_container):
    merger = fake_container.bin_dir / "fake-merger"
    merger.write_text(
        f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{REPO / "tests" / "fakes" / "fake_merger.py"}" "$@"\n'
    )
    merger.chmod(0o755)
    image = tmp_path / "app.sif"
    image.write_text("fake")
    return dict(
        os.environ,
        PATH=f"{fake_container.bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        CONTAINER="singularity",
        CONFIG_IMAGE_PATH=str(image),
        CKPT_ROOT=str(tmp_path / "ckpt"),
        MERGER_LAUNCHER=str(merger),
        FAKE_MERGER_LOG=str(tmp_path / "merger.jsonl"),
        # make_checkpoint's dist_ckpt/ holds no tensors to compare with (tests/test_check_numeric.py)
        NUMERIC_CHECK="0",
    )


def run(env, **extra):
    return subprocess.run(["bash", str(MERGE)], env=env | extra, cwd=REPO, capture_output=True, text=True, timeout=300)


def merger_calls(env) -> list[list[str]]:
    path = Path(env["FAKE_MERGER_LOG"])
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_latest_step_tied_config_merges_with_the_flag_and_verifies(merge_env, tiny_models, tmp_path, fake_container):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    target = tmp_path / "out" / "hf"
    result = run(merge_env, TARGET_DIR=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert argv[argv.index("--local_dir") + 1] == str(tmp_path / "ckpt" / "global_step_20" / "actor")
    assert "--tie-word-embedding" in argv and "--is-value-model" not in argv
    assert "tied embeddings: true (config.json says so" in result.stdout
    assert "verified" in result.stdout and "tied embeddings, no lm_head" in result.stdout
    assert (target / "model.safetensors.index.json").exists() and (target / "tokenizer_config.json").exists()
    assert not list(target.parent.glob("hf.tmp.*"))
    calls = [c["argv"] for c in fake_container.calls("singularity")]
    assert calls and all(c[:2] == ["exec", "--nv"] for c in calls), "the merger runs in the image, on a GPU"


def test_sbatch_merge_from_a_fresh_clone_merges_the_latest_step_into_hf_models_and_logs_to_its_output_file(
    merge_env, tiny_models, tmp_path, submit, clone
):
    """The article's last step as a user types it, through the real Slurm: only the node size on the command line,
    the script's own --output=logs/%x-%j.out (which needs logs/ in the clone) and its default TARGET_DIR."""
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    j = submit(merge_env, script="merge_mcore_to_hf.sh", options=("--mem=2G", "--cpus-per-task=1", "--gpus-per-node=1"))
    fields = j.wait(300)
    out = j.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert j.out == clone / "logs" / f"merge-mcore-hf-{j.id}.out"
    target = clone / "hf_models" / "ckpt-step20"
    assert "verified" in out and str(target) in out, out[-3000:]
    assert (target / "model.safetensors.index.json").exists()
    assert not list(target.parent.glob("ckpt-step20.tmp.*")), "the node-named temporary folder is gone"


def test_a_megatron_merge_where_torch_sees_no_gpu_is_refused_before_verls_merger_naming_both_ways(
    merge_env, tiny_models, tmp_path
):
    """CONTAINER=none on a machine without a GPU: verl's Megatron merger would end in PyTorch's "Distributed package
    doesn't have NCCL built in"; the merge stops before it starts, naming sbatch on a GPU node and the CPU path."""
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    target = tmp_path / "out" / "hf"
    env = merge_env | dict(CONTAINER="none", MERGER_LAUNCHER="python3", CUDA_VISIBLE_DEVICES="")
    result = run(env, TARGET_DIR=str(target))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "verl's Megatron merger needs a GPU (CUDA and NCCL) and torch sees none here" in result.stderr
    assert "(sbatch merge_mcore_to_hf.sh)" in result.stderr and "MERGER_LAUNCHER=cpu/megatron_merger" in result.stderr
    assert "merging:" not in result.stdout and not list(target.parent.glob("hf*")), "verl's merger never started"


def test_an_untied_model_keeps_its_lm_head(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=False)
    target = tmp_path / "hf_models" / "ckpt-step10"  # not the repository's hf_models/: other tests run beside this one
    result = run(merge_env, STEP="10", TARGET_DIR=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert "--tie-word-embedding" not in argv and "global_step_10" in argv[argv.index("--local_dir") + 1]
    assert "untied embeddings, lm_head present" in result.stdout
    assert (target / "config.json").exists()


def test_an_fsdp_checkpoint_goes_to_verls_fsdp_merger_without_the_megatron_only_tie_flag(
    merge_env, tiny_models, tmp_path
):
    """STRATEGY=fsdp2: verl's FSDP checkpoint manager writes fsdp_config.json beside its shards, which only its FSDP
    merger reads (--backend megatron would look for dist_ckpt); --tie-word-embedding is the Megatron merger's only."""
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True, fsdp=True)
    result = run(merge_env, TARGET_DIR=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    (call,) = merger_calls(merge_env)
    assert call[call.index("--backend") + 1] == "fsdp" and "--tie-word-embedding" not in call, call
    assert (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    "tied, broken, needle",
    [
        (False, "drop_lm_head", "lm_head.weight is missing although the embeddings are untied"),
        # a tied model's lm_head of its own (verl's FSDP merger stores one equal to the embedding: accepted)
        (True, "extra_lm_head", "lm_head.weight differs from model.embed_tokens.weight although the config says"),
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


def test_a_numeric_check_that_cannot_read_the_checkpoint_says_so_not_a_mismatch_and_keeps_the_result(
    merge_env, tiny_models, tmp_path
):
    """check_numeric's exit 2 (bad input: here make_checkpoint's dist_ckpt/ holds no tensors) is told apart from its
    exit 1 (the numbers differ): the merge fails naming the check and both ways on, and keeps the verified result."""
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    target = tmp_path / "hf"
    result = run(merge_env, TARGET_DIR=str(target), NUMERIC_CHECK="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the numeric check could not compare the merged model with the checkpoint" in result.stderr, result.stderr
    assert "NUMERIC_CHECK=0" in result.stderr and "does not compute what the checkpoint computes" not in result.stderr
    assert not target.exists() and (tmp_path / "hf.failed" / "model.safetensors.index.json").exists()


def test_a_model_the_numeric_check_cannot_build_is_said_in_one_line_and_kept_verified_by_structure(
    merge_env, tiny_models, tmp_path
):
    """check_numeric's exit 3 (here a Gemma, which verl 0.6.1 builds no Megatron model of): the merge names it in the
    check's one line and keeps its structurally verified result as TARGET_DIR. It used to end as TARGET_DIR.failed."""
    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True, model_type="gemma")
    (root / "global_step_20" / "actor" / "dist_ckpt" / ".metadata").write_bytes(b"")
    target = tmp_path / "hf"
    result = run(merge_env, TARGET_DIR=str(target), NUMERIC_CHECK="1")
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [x for x in result.stdout.splitlines() if "numeric check" in x and "===" not in x]
    assert line.startswith("numeric check not run: GemmaForCausalLM: the check builds verl 0.6.1's dense"), line
    assert line.endswith("the result is verified for its structure only") and "could not compare" not in result.stderr
    assert f"done: {target}" in result.stdout and not (tmp_path / "hf.failed").exists()


@pytest.mark.parametrize(
    "model_type, tied, flag",
    [
        (None, None, False),  # Qwen3 without the key: transformers reads it untied, so lm_head must be kept
        ("gemma", None, True),  # Gemma without the key: tied by its config class's default
    ],
)
def test_a_config_without_the_tie_key_is_read_as_transformers_reads_it(
    merge_env, tiny_models, tmp_path, model_type, tied, flag
):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=tied, model_type=model_type)
    target = tmp_path / "hf"
    result = run(merge_env, TARGET_DIR=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    (argv,) = merger_calls(merge_env)
    assert ("--tie-word-embedding" in argv) is flag
    assert f"tied embeddings: {str(flag).lower()} (config.json says so" in result.stdout
    stored, _, _ = verify_hf.stored_tensors(target)
    assert ("lm_head.weight" in stored) is not flag


def test_a_critic_with_only_megatron_weights_is_refused_naming_verl_s_merger(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True, roles=("actor", "critic"))
    result = run(merge_env, ROLE="critic", TARGET_DIR=str(tmp_path / "critic_hf"))
    assert result.returncode == 1
    assert "is a Megatron checkpoint (dist_ckpt/, no fsdp_config.json)" in result.stderr, "the backend it found"
    assert "verl/model_merger/megatron_model_merger.py" in result.stderr and "value=False" in result.stderr
    assert "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]" in result.stderr
    assert merger_calls(merge_env) == [], "verl's merger would drop the value head: it is never started"
    assert not (tmp_path / "critic_hf").exists() and not list(tmp_path.glob("critic_hf*"))


def test_an_fsdp2_critic_merges_through_verls_fsdp_merger_into_the_value_model_verl_trained(
    merge_env, tiny_models, tmp_path
):
    """STRATEGY=fsdp2's critic: verl's own CriticWorker saves it through its FSDP checkpoint manager
    (tests/fsdp_critic.py: a causal-LM config holding score.weight), verl's real FSDP merger merges it, critic_to_hf
    relabels it, and the result is verl's critic: its head as trained (bias too) and its values."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from tests.fsdp_critic import TEXTS

    root, worker = tmp_path / "ckpt", tmp_path / "worker.json"
    saved = subprocess.run(
        [sys.executable, "-m", "tests.fsdp_critic", str(root), str(tiny_models.policy), str(worker)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    critic = root / "global_step_1" / "critic"
    assert (critic / "fsdp_config.json").is_file() and (critic / "model_world_size_1_rank_0.pt").is_file()
    assert json.loads((critic / "huggingface" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    target = tmp_path / "critic_hf"
    env = merge_env | dict(CONTAINER="none", MERGER_LAUNCHER=sys.executable)  # verl's real merger, on this CPU
    result = run(env, ROLE="critic", TARGET_DIR=str(target), NUMERIC_CHECK="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "-m verl.model_merger merge --backend fsdp" in result.stdout
    # the values against the FSDP2 shards' own in verl's model class, rounded to the bfloat16 the merger stores
    assert "numeric check passed: max |d value|" in result.stdout and "tolerance fp32" in result.stdout
    assert "score.weight [1, 64] kept as verl's FSDP critic trained it" in result.stdout
    assert "value model, value head score.weight [1, 64]" in result.stdout
    trained = json.loads(worker.read_text())
    assert trained["class"] == "FSDPQwen3ForTokenClassification", "FSDP2 (fully_shard) over verl's value model"
    model = AutoModelForTokenClassification.from_pretrained(target, dtype=torch.float32).eval()
    for name in ("score.weight", "score.bias"):  # verl's merger stores bfloat16 (fsdp_model_merger.py:169-181)
        expected = torch.tensor(trained["score"][name]).bfloat16().float()
        assert torch.equal(model.state_dict()[name], expected), name
    batch = AutoTokenizer.from_pretrained(target)(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        values = model(**batch).logits[..., 0]
    mask = batch["attention_mask"].bool()
    assert mask.tolist() == [[bool(x) for x in row] for row in trained["attention_mask"]]
    torch.testing.assert_close(values[mask], torch.tensor(trained["values"])[mask], atol=0.05, rtol=0.05)


def test_verl_s_merger_still_builds_a_causal_lm_so_a_critic_merge_stays_refused():
    """The refusal's premise, read from the installed verl: if a release builds value models, revisit ROLE=critic."""
    import verl

    source = (Path(verl.__file__).parent / "model_merger" / "megatron_model_merger.py").read_text()
    assert verl.__version__ == "0.6.1"
    assert "value=False," in source and "value=self.config.is_value_model" not in source


def test_an_actor_s_lm_head_is_not_taken_for_a_value_head(tiny_models, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from launch.merge.critic_to_hf import NotACritic, to_value_model

    config = AutoConfig.from_pretrained(tiny_models.policy, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "actor")
    with pytest.raises(NotACritic, match=r"lm_head.weight in .* has shape \[\d+, \d+\], a value head is \[1, "):
        to_value_model(tmp_path / "actor", tmp_path)
    assert "ForTokenClassification" not in (tmp_path / "actor" / "config.json").read_text(), "nothing rewritten"


@pytest.mark.parametrize("tied", [True, False])
def test_verl_s_critic_save_becomes_a_value_model_transformers_loads(merge_env, tiny_models, tmp_path, tied):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=tied, roles=("actor", "critic"))
    saved = root / "global_step_20" / "critic" / "huggingface"
    save_critic_like_verl(saved, saved, head=True)
    (head,) = [t["lm_head.weight"] for f in saved.glob("*.safetensors") if "lm_head.weight" in (t := load_file(f))]
    # the head's bias, which verl's saver drops, in the dist checkpoint beside it under megatron-core's key
    dcp.save({"output_layer.bias": torch.tensor([-0.375])}, checkpoint_id=saved.parent / "dist_ckpt", no_dist=True)
    target = tmp_path / "critic_hf"
    result = run(merge_env, ROLE="critic", TARGET_DIR=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    assert merger_calls(merge_env) == [] and "already holds Hugging Face weights" in result.stdout
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    assert f"value head score.weight [1, {hidden}]" in result.stdout
    model, info = AutoModelForTokenClassification.from_pretrained(target, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForTokenClassification" and model.config.num_labels == 1
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(model.score.weight.detach(), head), "the trained head, not a fresh one"
    assert model.score.bias.item() == -0.375, "its trained bias, not 0"


def test_a_headless_critic_save_is_rejected_and_kept_aside(merge_env, tiny_models, tmp_path):
    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True, roles=("actor", "critic"))
    saved = root / "global_step_20" / "critic" / "huggingface"
    save_critic_like_verl(saved, saved, head=False)
    target = tmp_path / "critic_hf"
    result = run(merge_env, ROLE="critic", TARGET_DIR=str(target))
    assert result.returncode == 1
    assert "a headless critic" in result.stderr
    assert not target.exists() and (tmp_path / "critic_hf.failed").exists()


@pytest.mark.parametrize("drop", [("score.weight", "score.bias"), ()])
def test_verify_requires_the_value_head_of_a_critic(tiny_models, tmp_path, drop):
    """A token-classification model with num_labels=1 saved without its score layer fails; with it, it passes."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(tiny_models.policy, num_labels=1, architectures=None)
    model = AutoModelForTokenClassification.from_config(config)
    state = {k: v for k, v in model.state_dict().items() if k not in drop}
    model.save_pretrained(tmp_path / "critic", state_dict=state)
    for f in Path(tiny_models.policy).glob("tokenizer*"):
        shutil.copy(f, tmp_path / "critic")
    problems, _ = verify_hf.verify(tmp_path / "critic", tied=False, value_model=True)
    if drop:
        assert any("value head score.weight" in p and "is missing" in p for p in problems), problems
    else:
        assert problems == []


def test_verify_rejects_an_actor_passed_as_a_critic(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=False)
    target = tmp_path / "hf"
    assert run(merge_env, TARGET_DIR=str(target)).returncode == 0
    problems, _ = verify_hf.verify(target, tied=False, value_model=True)
    assert any("describes Qwen3ForCausalLM with num_labels=2" in p for p in problems), problems


def test_a_target_that_appears_during_the_merge_is_left_alone_and_the_result_kept(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    target = tmp_path / "hf"
    result = run(merge_env, TARGET_DIR=str(target), FAKE_MERGER_RIVAL=f"full:{target}")
    assert result.returncode == 1, result.stdout
    assert f"TARGET_DIR={target} appeared while this job merged" in result.stderr
    assert [p.name for p in target.iterdir()] == ["rival.txt"]
    (kept,) = tmp_path.glob("hf.tmp.*")
    assert str(kept) in result.stderr and "done:" not in result.stdout
    assert verify_hf.verify(kept, tied=True)[0] == [], "the verified result is kept whole"


def test_a_failed_result_never_lands_inside_an_existing_failed_folder(merge_env, tiny_models, tmp_path):
    make_checkpoint(tmp_path / "ckpt", tiny_models.policy, tied=True)
    (tmp_path / "hf.failed").mkdir()
    (tmp_path / "hf.failed" / "old.txt").write_text("an earlier failure")
    result = run(merge_env, TARGET_DIR=str(tmp_path / "hf"), FAKE_MERGER_BREAK="missing_shard")
    assert result.returncode == 1
    assert "hf.failed exists already, so it is kept at" in result.stderr
    assert [p.name for p in (tmp_path / "hf.failed").iterdir()] == ["old.txt"]
    assert len(list(tmp_path.glob("hf.tmp.*"))) == 1


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
        ("bad_config", {}, "transformers cannot read"),
    ],
)
def test_bad_input_names_the_setting_and_changes_nothing(merge_env, tiny_models, tmp_path, setup, extra, needle):
    root = make_checkpoint(tmp_path / "ckpt", tiny_models.policy)
    target = tmp_path / "hf"
    if setup == "no_tracker":
        (root / "latest_checkpointed_iteration.txt").unlink()
    if setup == "not_verl":
        (root / "global_step_20" / "actor" / "huggingface" / "config.json").unlink()
    if setup == "bad_config":
        (root / "global_step_20" / "actor" / "huggingface" / "config.json").write_text('{"model_type": "no-such"}')
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


# --- one place to edit: the top of the run script --------------------------------------------------------------------


def edit_run_script(repo: Path, **lines: str) -> None:
    """What a user does in step 3: change lines at the top of the run script (each key: the start of the line)."""
    script = repo / "run_grpo_qwen3_4b_mega_verl.sh"
    text = script.read_text().splitlines()
    for start, line in lines.items():
        (i,) = [n for n, old in enumerate(text) if old.startswith(start)]
        text[i] = line
    script.write_text("\n".join(text) + "\n")


USER_EDITS = {  # CONFIG_OUTPUT_DIR and the image elsewhere, an account to bill, the Slurm output in another folder
    "CONFIG_OUTPUT_DIR=": 'CONFIG_OUTPUT_DIR="${CONFIG_OUTPUT_DIR:-$repo/checkpoints/my_run}"  # checkpoints',
    "CONFIG_IMAGE_PATH=": 'CONFIG_IMAGE_PATH="${CONFIG_IMAGE_PATH:-$repo/images/verl_app.sif}"  # the image',
    "##SBATCH --account=": "#SBATCH --account=team_a        # billed to the team",
    "#SBATCH --output=": "#SBATCH --output=slurm_logs/%x-%j.out",
}


def edited_clone(tmp_path: Path, tiny_models) -> Path:
    from tests import real_slurm

    repo = real_slurm.copy_tree(REPO, tmp_path / "repo")
    edit_run_script(repo, **USER_EDITS)
    make_checkpoint(repo / "checkpoints" / "my_run", tiny_models.policy, tied=True)
    (repo / "images").mkdir()
    (repo / "images" / "verl_app.sif").write_text("fake image")
    (repo / "slurm_logs").mkdir()
    return repo


def merge_only_env(merge_env) -> dict:
    """The merge's environment with nothing of the run script's settings in it: the block must say them."""
    return {k: v for k, v in merge_env.items() if k not in ("CKPT_ROOT", "CONFIG_IMAGE_PATH", "CONFIG_OUTPUT_DIR")}


def read_only(repo: Path, *argv: str) -> list[str]:
    """argv run with `repo` read-only: a read-only bind mount of its own (root writes through file modes), else every
    file and folder in it without write permission."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(repo)], check=True)
        return list(argv)
    remount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", remount, str(repo), *argv]


def test_both_scripts_start_in_a_read_only_checkout_and_leave_git_status_clean(
    merge_env, tiny_models, tmp_path, fake_container
):
    """A job never writes into the repository's files (a group's shared checkout, a `git pull` after the first job):
    the run script's start on a login node and a whole merge, in a checkout they cannot write, take the output folder
    and the image from the top of the run script, and the run script prints the merge's sbatch line with its --account
    and --output. They used to copy those #SBATCH lines into merge_mcore_to_hf.sh."""
    repo = edited_clone(tmp_path, tiny_models)
    git = ["git", "-C", str(repo), "-c", "user.name=u", "-c", "user.email=u@x"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the user's edits"]):
        subprocess.run([*git, *args], check=True)
    elsewhere = {
        "CONFIG_LOG_DIR": str(tmp_path / "logs"),
        "HF_HOME": str(tmp_path / "hf"),
        "TARGET_DIR": str(tmp_path / "merged"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONFIG_"))}
    start = subprocess.run(
        read_only(repo, "bash", "run_grpo_qwen3_4b_mega_verl.sh"),
        cwd=repo,
        capture_output=True,
        text=True,
        env=env | elsewhere | {"CONTAINER": "none"},
        timeout=300,
    )
    assert start.returncode == 1 and "setting error: CONFIG_MODEL_PATH=" in start.stderr, "no models: refused"
    line = "to merge its checkpoints later: sbatch --account=team_a --output=slurm_logs/%x-%j.out merge_mcore_to_hf.sh"
    assert line in start.stdout, start.stdout[-2000:]
    merge = subprocess.run(
        read_only(repo, "bash", "merge_mcore_to_hf.sh"),
        cwd=repo,
        capture_output=True,
        text=True,
        env=merge_only_env(merge_env) | elsewhere,
        timeout=300,
    )
    assert merge.returncode == 0, merge.stdout[-2000:] + merge.stderr[-2000:]
    assert f"done: {tmp_path / 'merged'}" in merge.stdout
    calls = [c["argv"] for c in fake_container.calls("singularity")]
    assert calls and all(str(repo / "images" / "verl_app.sif") in c for c in calls), "the run script's image"
    assert "Read-only file system" not in start.stderr + merge.stderr, start.stderr[-2000:] + merge.stderr[-2000:]
    subprocess.run(["chmod", "-R", "u+w", str(repo)], check=True)
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, check=True)
    assert status.stdout == "", status.stdout


def test_sbatch_merge_in_a_fresh_clone_after_editing_only_the_run_script(
    merge_env, tiny_models, tmp_path, fake_container, slurm_cluster
):
    """A user edits the top of the run script in a fresh clone and submits the merge. Submitted plain, it runs
    without the run script's account: it stops, merging nothing, printing the sbatch line the run script's start logs;
    submitted with that line, it runs billed to that account, writes its output where the run script's --output says
    and merges from its CONFIG_OUTPUT_DIR with its image."""
    from tests import real_slurm

    repo = edited_clone(tmp_path, tiny_models)
    env, jobs = merge_only_env(merge_env), []
    options = ("--mem=2G", "--cpus-per-task=1", "--gpus-per-node=1")
    try:
        first = real_slurm.sbatch(env, "merge_mcore_to_hf.sh", cwd=repo, options=options)
        jobs.append(first)
        fields = first.wait(300)
        assert first.out == repo / "logs" / f"merge-mcore-hf-{first.id}.out", "the merge's own header"
        assert fields["JobState"] == "FAILED", first.output()[-3000:]
        line = "submit it as sbatch --account=team_a --output=slurm_logs/%x-%j.out merge_mcore_to_hf.sh"
        assert line in first.output(), first.output()[-3000:]
        assert not (repo / "hf_models").exists(), "nothing merged"
        printed = line.split()[4:-1]  # the line's options, as a user pastes them
        second = real_slurm.sbatch(env, "merge_mcore_to_hf.sh", cwd=repo, options=(*options, *printed))
        jobs.append(second)
        fields = second.wait(300)
    finally:
        real_slurm.cancel_all(jobs)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), second.output()[-3000:]
    assert fields["Account"] == "team_a"
    assert second.out == repo / "slurm_logs" / f"merge-mcore-hf-{second.id}.out"
    assert f"done: {repo / 'hf_models' / 'my_run-step20'}" in second.output()
    assert all(str(repo / "images" / "verl_app.sif") in c["argv"] for c in fake_container.calls("singularity"))
