"""launch/merge/check_numeric.py: the merged model against megatron-core's forward of the dist checkpoint it came from.

The checkpoints are verl 0.6.1's own Megatron saves (tests/megatron_save.py: verl's workers, TP=2 or PP=2 in a gloo
group of two processes, on the CPU) of tiny Llama-, Qwen2- and Qwen3-shaped models, tied and untied, a critic too; the
merges are merge_mcore_to_hf.sh's, through verl's own merger (cpu/megatron_merger). Broken copies of a merged folder
stand for the merges the check must catch. The refusals and the judge need no checkpoint."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.merge import check_numeric
from tests.megatron_save import CRITIC_BIAS, build_policy
from tests.support import REPO

# (family, tied, role, TP, PP): every dense family verl 0.6.1 builds on Megatron, tied and untied, TP=2 and PP=2
CASES = [
    ("qwen3", True, "actor", 2, 1),
    ("qwen3", False, "actor", 1, 2),
    ("llama", False, "actor", 2, 1),
    ("llama", True, "actor", 1, 2),
    ("qwen2", False, "actor", 2, 1),  # Qwen2 and Qwen2.5: attention biases
    ("llama", False, "critic", 2, 1),  # PPO's critic: a value head with its bias
]


@pytest.fixture(scope="session")
def megatron_merges(tmp_path_factory):
    """`merged(case) -> (checkpoint folder, merged folder, the merge's output)`: verl's save of the case's tiny model,
    then merge_mcore_to_hf.sh with its numeric check; each case once a session."""
    done = {}

    def merged(case):
        if case not in done:
            family, tied, role, tp, pp = case
            root = tmp_path_factory.mktemp(f"{family}_{role}_tp{tp}pp{pp}")
            policy = build_policy(root / "policy", family, tied)
            argv = ["-m", "tests.megatron_save", root / "ckpt", policy, role, str(tp), str(pp)]
            saved = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
            assert saved.returncode == 0, saved.stderr[-3000:]
            env = dict(
                os.environ,
                CONTAINER="none",
                MERGER_LAUNCHER=str(REPO / "cpu" / "megatron_merger"),
                CKPT_ROOT=str(root / "ckpt"),
                TARGET_DIR=str(root / "merged"),
                ROLE=role,
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            )
            script = REPO / "merge_mcore_to_hf.sh"
            merge = subprocess.run(["bash", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
            done[case] = (root / "ckpt" / "global_step_1" / role, root / "merged", merge)
        return done[case]

    return merged


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_dense_family_merged_from_verls_own_save_agrees_with_megatron_cores_forward(megatron_merges, case):
    """The merge of each verl save ends verified and numerically checked, to float32 rounding: the check built the
    checkpoint's model with megatron-core (resharded from TP=2 or PP=2), the merged one with transformers. Before,
    only Qwen3 was compared: a Llama or Qwen2 merge ended as TARGET_DIR.failed."""
    ckpt, merged, merge = megatron_merges(case)
    out = merge.stdout + merge.stderr
    assert merge.returncode == 0 and f"done: {merged}" in merge.stdout, out[-4000:]
    what = "value" if case[2] == "critic" else "log-prob"
    (line,) = [x for x in merge.stdout.splitlines() if x.startswith("numeric check passed:")]
    figure = float(re.search(rf"max \|d {what}\| (\S+),", line)[1])
    assert figure < 1e-4 and "tolerance fp32: bfloat16 weights, float32 arithmetic on the CPU" in line, line
    assert "the megatron checkpoint's model against transformers'" in line, line
    assert what == "value" or "top-1 changed on 0.0%" in line, line
    print(f"{case}: {line}")  # the figures docs/merge.md quotes (pytest -s)


def test_a_megatron_critics_value_head_keeps_the_bias_it_was_trained_with(megatron_merges, tmp_path, capsys):
    """verl's saver drops the critic's output_layer.bias; the merge reads it from the dist checkpoint, and the check
    compares the values bias included. Before, the merged critic's score.bias was 0 and the check waived it."""
    import torch
    from safetensors.torch import load_file

    ckpt, merged, merge = megatron_merges(CASES[-1])
    assert merge.returncode == 0, (merge.stdout + merge.stderr)[-4000:]
    (bias,) = [t["score.bias"] for f in merged.glob("*.safetensors") if "score.bias" in (t := load_file(f))]
    assert torch.equal(bias.float(), torch.tensor([CRITIC_BIAS])), bias
    assert f"score.bias {CRITIC_BIAS:.4g} from {ckpt}/dist_ckpt" in merge.stdout

    def zero_bias(state):  # the merge as it was
        state["score.bias"].zero_()

    rc, out = check(ckpt, broken_copy(merged, tmp_path / "bias_0", zero_bias), capsys)
    assert rc == 1 and f"max |d value| {CRITIC_BIAS:.3g} > " in out and "the output head differs" in out, out


def broken_copy(merged: Path, dest: Path, edit=None, config=None) -> Path:
    """A copy of the merged folder with its tensors (edit(state) in place) or config.json (dict update) changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(merged, dest)
    if edit:
        (shard,) = dest.glob("*.safetensors")
        state = load_file(shard)
        edit(state)
        save_file(state, shard, metadata={"format": "pt"})
    if config:
        path = dest / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return dest


def check(ckpt: Path, merged: Path, capsys) -> tuple[int, str]:
    rc = check_numeric.main(["--checkpoint", str(ckpt), "--hf", str(merged)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _swap_down(state):
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    state[a], state[b] = state[b].clone(), state[a].clone()


def _scale_embedding(state):
    state["model.embed_tokens.weight"] *= 1.05  # tied: the output head too


def _zero_norm(state):
    state["model.layers.1.post_attention_layernorm.weight"].zero_()


def _swap_k_and_v(state):
    a, b = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    state[a], state[b] = state[b].clone(), state[a].clone()


@pytest.mark.parametrize(
    "edit, config, where",
    [
        (_swap_down, None, "after layer 0"),  # two layers' down_proj swapped: layer 0 is the first wrong one
        (_swap_k_and_v, None, "after layer 0"),  # a qkv split that mixes up key and value
        (_scale_embedding, None, "after the embedding"),  # the tied embedding (and so the head) scaled by 1.05
        (_zero_norm, None, "after layer 1"),  # one RMSNorm zeroed
        (None, {"tie_word_embeddings": False}, "the output head differs"),  # a tied model merged as untied
    ],
    ids=["down_proj_swapped", "k_v_swapped", "embedding_scaled_1.05", "rmsnorm_zeroed", "tie_flipped"],
)
def test_a_corrupted_merge_fails_names_where_and_is_marked_unverified_not_deleted(
    megatron_merges, tmp_path, capsys, edit, config, where
):
    ckpt, merged, _ = megatron_merges(CASES[0])
    bad = broken_copy(merged, tmp_path / "bad", edit, config)
    rc, out = check(ckpt, bad, capsys)
    assert rc == 1 and "check_numeric: FAILED: max |d log-prob|" in out and where in out, out
    marker = (bad / check_numeric.UNVERIFIED).read_text()
    assert "failed against" in marker and where in marker
    assert list(bad.glob("*.safetensors")), "the merged folder is kept"


def test_an_untied_model_merged_as_tied_is_caught(megatron_merges, tmp_path, capsys):
    """Qwen3-8B's case: the article's --tie-word-embedding drops the lm_head; the embedding then answers for it."""
    ckpt, merged, _ = megatron_merges(CASES[1])

    def drop_head(state):
        del state["lm_head.weight"]

    bad = broken_copy(merged, tmp_path / "as_tied", drop_head, {"tie_word_embeddings": True})
    rc, out = check(ckpt, bad, capsys)
    assert rc == 1 and "the output head differs" in out, out


def test_bad_input_is_one_line_exit_2_and_nothing_changes(megatron_merges, tmp_path, capsys):
    ckpt, merged, _ = megatron_merges(CASES[0])
    other = broken_copy(merged, tmp_path / "other_model", config={"num_hidden_layers": 3})
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(merged, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special*", "vocab*", "chat*"))
    cases = [
        (merged, merged, "is not a verl checkpoint folder: expected global_step_N/actor"),  # the merge as checkpoint
        (ckpt.parent, merged, "is not a verl checkpoint folder"),  # the step folder, not its actor
        (ckpt, other, "was not merged from this checkpoint: num_hidden_layers 3 (checkpoint: 2)"),
        (ckpt, no_tokenizer, "no usable tokenizer"),
        (ckpt, tmp_path / "missing", "config.json is missing: expected a merged Hugging Face model folder"),
    ]
    for source, target, needle in cases:
        rc, out = check(source, target, capsys)
        assert rc == 2 and needle in out and len(out.strip().splitlines()) == 1, (source, target, out)
        assert "could not compare" in out and not (target / check_numeric.UNVERIFIED).exists()


def a_checkpoint(root: Path, config: dict, metadata: bytes = b"") -> Path:
    """verl's checkpoint folder layout with the given huggingface/config.json and dist_ckpt/.metadata bytes."""
    ckpt = root / "global_step_1" / "actor"
    (ckpt / "huggingface").mkdir(parents=True)
    (ckpt / "dist_ckpt").mkdir()
    (ckpt / "huggingface" / "config.json").write_text(json.dumps(config))
    (ckpt / "dist_ckpt" / ".metadata").write_bytes(metadata)
    return ckpt


@pytest.mark.parametrize(
    "config, why",
    [
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM: the check builds verl 0.6.1's dense Megatron"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3MoeForCausalLM: the check builds"),
        (  # Llama 3.1's: verl builds every rope_scaling as linear interpolation, transformers as its type
            {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling llama3: verl 0.6.1 trains any as linear interpolation, not llama3",
        ),
    ],
    ids=["mistral", "moe", "llama3_rope"],
)
def test_a_model_the_check_cannot_build_is_one_line_exit_3(tmp_path, tiny_models, capsys, config, why):
    """Not a failure of the merge: merge_mcore_to_hf.sh keeps its structurally verified result (tests/test_merge.py)."""
    ckpt = a_checkpoint(tmp_path, config)
    rc, out = check(ckpt, tiny_models.policy, capsys)
    assert rc == 3 and out.startswith(f"numeric check not run: {why}") and len(out.strip().splitlines()) == 1, out
    assert "the result is verified for its structure only" in out


def test_an_unreadable_checkpoint_is_could_not_compare_with_its_cause_never_a_difference(tmp_path, tiny_models, capsys):
    """A dist checkpoint whose metadata is not torch's: the exception's cause in one line, exit 2. Before, any
    exception but the check's own BadInput escaped (exit 1), which the merge reports as "does not compute"."""
    ckpt = a_checkpoint(tmp_path, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, b"not a pickle")
    rc, out = check(ckpt, tiny_models.policy, capsys)
    assert rc == 2 and out.startswith("check_numeric: could not compare: ") and len(out.strip().splitlines()) == 1, out
    assert "Error" in out and not (tiny_models.policy / check_numeric.UNVERIFIED).exists()


@pytest.mark.parametrize("figure", ["max", "mean", "top1"])
def test_each_figure_passes_at_its_limit_and_fails_just_above(figure):
    limit = dict(zip(["max", "mean", "top1"], check_numeric.TOLERANCE[:3], strict=False))
    figures = dict(limit, value_model=False)
    assert check_numeric.judge(figures) == []
    figures[figure] = limit[figure] * 1.001
    (problem,) = check_numeric.judge(figures)
    assert ("top-1" if figure == "top1" else figure) in problem
