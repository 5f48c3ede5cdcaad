"""launch/merge/check_numeric.py: the merged model's log-probs against the checkpoint's own, read without the merger.

The checkpoints here are written in megatron-core's dist-checkpoint layout by this file's own code (torch.distributed
.checkpoint, megatron-core's names, the layer index as the first dimension, [q-group, k, v] rows, [gate; up]) from a
tiny Qwen3; the merged folders are that model saved by transformers, then broken in the ways the issue measured.
verl's real dist_ckpt and verl's real merger meet the check in `make demo` (tests/test_demo.py), the PP=2 job test
(tests/test_slurm_jobs.py) and, for an FSDP2 critic, tests/test_merge.py."""

import json
import shutil
from pathlib import Path

import pytest

from launch.merge import check_numeric


def megatron_state(sd: dict, config) -> dict:
    """A Hugging Face Qwen3 state dict under megatron-core's dist-checkpoint names and layouts."""
    import torch

    heads, groups, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].view(groups, heads // groups * dim, -1)
        k, v = (sd[p + f"self_attn.{x}_proj.weight"].view(groups, dim, -1) for x in "kv")
        layer = {
            "self_attention.linear_qkv.weight": torch.cat([q, k, v], 1).reshape(-1, config.hidden_size),
            "self_attention.linear_qkv.layer_norm_weight": sd[p + "input_layernorm.weight"],
            "self_attention.q_layernorm.weight": sd[p + "self_attn.q_norm.weight"],
            "self_attention.k_layernorm.weight": sd[p + "self_attn.k_norm.weight"],
            "self_attention.linear_proj.weight": sd[p + "self_attn.o_proj.weight"],
            "mlp.linear_fc1.weight": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
            "mlp.linear_fc1.layer_norm_weight": sd[p + "post_attention_layernorm.weight"],
            "mlp.linear_fc2.weight": sd[p + "mlp.down_proj.weight"],
        }
        for name, t in layer.items():
            per_layer.setdefault(name, []).append(t)
    out = {f"decoder.layers.{k}": torch.stack(v) for k, v in per_layer.items()}
    out |= {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": sd["model.norm.weight"]}  # fmt: skip
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    return out


def make_pair(root: Path, policy: Path, tied=True, ckpt_dtype="bfloat16", merged_dtype="bfloat16", seed=0):
    """(verl-like checkpoint folder global_step_1/actor, its honest merge) of the tiny policy."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    torch.manual_seed(seed)
    if not tied:  # an untied model (Qwen3-8B and larger): its own head
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.2)
    if seed:  # another step of training: every weight moved a little
        for t in model.parameters():
            t.data += torch.randn_like(t) * 1e-3
    model = model.to(getattr(torch, ckpt_dtype))
    ckpt, merged = root / "global_step_1" / "actor", root / "merged"
    tokenizer = AutoTokenizer.from_pretrained(policy)
    for folder in (ckpt / "huggingface", merged):
        tokenizer.save_pretrained(folder)
        model.config.save_pretrained(folder)
    state = megatron_state({k: v.clone() for k, v in model.state_dict().items()}, model.config)
    state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(3)  # not read: model only
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt / "dist_ckpt")), no_dist=True)
    model.to(getattr(torch, merged_dtype)).save_pretrained(merged)
    return ckpt, merged


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_models):
    return make_pair(tmp_path_factory.mktemp("check_numeric"), tiny_models.policy)


def broken_copy(merged: Path, dest: Path, edit=None, config=None) -> Path:
    """A copy of the merged folder with its tensors (edit(state) in place) or config.json (dict update) changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(merged, dest)
    if edit:
        state = load_file(dest / "model.safetensors")
        edit(state)
        save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    if config:
        path = dest / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return dest


def check(ckpt: Path, merged: Path, capsys) -> tuple[int, str]:
    rc = check_numeric.main(["--checkpoint", str(ckpt), "--hf", str(merged)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_honest_merge_agrees_to_float32_rounding_and_passes(pair, capsys):
    """Same bf16 weights on both sides, both computed in float32: the reference forward is Qwen3's to ~1e-5."""
    ckpt, merged = pair
    figures = check_numeric.compare(ckpt, merged)
    assert figures["max"] < 1e-4 and figures["top1"] == 0 and figures["tolerance"] == "fp32", figures
    assert figures["tokens"] > 100 and max(figures["state_gaps"]) < 1e-5, figures
    rc, out = check(ckpt, merged, capsys)
    assert rc == 0 and "numeric check passed: max |d log-prob|" in out and "top-1 changed on 0.0%" in out
    assert not (merged / check_numeric.UNVERIFIED).exists()


def _swap_down(state):
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    state[a], state[b] = state[b].clone(), state[a].clone()


def _scale_head(state):
    state["model.embed_tokens.weight"] *= 1.05  # tied: the embedding is the output head


def _zero_norm(state):
    state["model.layers.1.post_attention_layernorm.weight"].zero_()


@pytest.mark.parametrize(
    "edit, config, where",
    [
        (_swap_down, None, "after layer 0"),  # two layers' down_proj swapped: layer 0 is the first wrong one
        (_scale_head, None, "after the embedding"),  # the tied head (and so the embedding) scaled by 1.05
        (_zero_norm, None, "after layer 1"),  # one RMSNorm zeroed
        (None, {"tie_word_embeddings": False}, "the output head differs"),  # a tied model merged as untied
    ],
    ids=["down_proj_swapped", "head_scaled_1.05", "rmsnorm_zeroed", "tie_flipped"],
)
def test_a_corrupted_merge_fails_names_where_and_is_marked_unverified_not_deleted(pair, tmp_path, capsys, edit,
                                                                                 config, where):  # fmt: skip
    ckpt, merged = pair
    bad = broken_copy(merged, tmp_path / "bad", edit, config)
    rc, out = check(ckpt, bad, capsys)
    assert rc == 1 and "check_numeric: FAILED: max |d log-prob|" in out and where in out, out
    marker = (bad / check_numeric.UNVERIFIED).read_text()
    assert "failed against" in marker and where in marker
    assert (bad / "model.safetensors").is_file(), "the merged folder is kept"


def test_an_untied_model_merged_as_tied_is_caught(tmp_path, tiny_models, capsys):
    """Qwen3-8B's case: the article's --tie-word-embedding drops the lm_head; the embedding then answers for it."""
    ckpt, merged = make_pair(tmp_path, tiny_models.policy, tied=False)
    assert check(ckpt, merged, capsys)[0] == 0, "the honest untied merge passes"

    def drop_head(state):
        del state["lm_head.weight"]

    bad = broken_copy(merged, tmp_path / "as_tied", drop_head, {"tie_word_embeddings": True})
    rc, out = check(ckpt, bad, capsys)
    assert rc == 1 and "the output head differs" in out, out


def test_another_steps_merge_is_told_apart(tmp_path, tiny_models, pair, capsys):
    """Weights moved by ~1e-3 (another step): far outside float32 agreement, though every shape matches."""
    _, other = make_pair(tmp_path, tiny_models.policy, seed=1)
    rc, out = check(pair[0], other, capsys)
    assert rc == 1 and "after the embedding" in out and "a merge of another checkpoint" in out, out


def test_the_bf16_tolerance_covers_an_honest_bfloat16_merge_of_a_float32_checkpoint_and_fp32_would_not(
    tmp_path, tiny_models, capsys
):
    """The tolerance at its edge: an fp32 checkpoint merged into bfloat16 moves log-probs by bf16 rounding only:
    passes its auto-chosen bf16 tolerance, fails the fp32 one it does not meet."""
    ckpt, merged = make_pair(tmp_path, tiny_models.policy, ckpt_dtype="float32")
    figures = check_numeric.compare(ckpt, merged)
    lim = check_numeric.TOLERANCES
    assert figures["tolerance"] == "bf16" and lim["fp32"][0] < figures["max"] < lim["bf16"][0] / 3, figures
    assert check(ckpt, merged, capsys)[0] == 0
    assert any("max |d log-prob|" in p for p in check_numeric.judge(figures | {"tolerance": "fp32"}))


@pytest.mark.parametrize("tolerance", ["fp32", "bf16"])
@pytest.mark.parametrize("figure", ["max", "mean", "top1"])
def test_each_figure_passes_at_its_limit_and_fails_just_above(tolerance, figure):
    limit = dict(zip(["max", "mean", "top1"], check_numeric.TOLERANCES[tolerance][:3], strict=False))
    figures = dict(limit, tolerance=tolerance, value_model=False)
    assert check_numeric.judge(figures) == []
    figures[figure] = limit[figure] * 1.001
    (problem,) = check_numeric.judge(figures)
    assert ("top-1" if figure == "top1" else figure) in problem


def test_bad_input_is_one_line_exit_2_and_nothing_changes(pair, tmp_path, tiny_models, capsys):
    ckpt, merged = pair
    other = tmp_path / "other_model"
    broken_copy(merged, other, config={"num_hidden_layers": 3})
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
        assert not (target / check_numeric.UNVERIFIED).exists()


def test_a_critics_values_are_compared_net_of_the_bias_verls_megatron_save_drops_and_a_wrong_head_is_caught(
    tmp_path, tiny_models, capsys
):
    """A Megatron critic: output_layer [1, hidden] with its bias in dist_ckpt; its merge (launch/merge/critic_to_hf.py)
    a Qwen3ForTokenClassification whose score.bias is 0, as verl's saver keeps no bias."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_models.policy, num_labels=1, architectures=["Qwen3ForTokenClassification"])
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_models.policy, config=config).bfloat16()
    ckpt, merged = tmp_path / "global_step_1" / "critic", tmp_path / "merged"
    state = megatron_state(dict(critic.state_dict()), config)
    state |= {"output_layer.weight": critic.score.weight.data.clone(), "output_layer.bias": torch.tensor([0.25])}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt / "dist_ckpt")), no_dist=True)
    for folder in (ckpt / "huggingface", merged):
        AutoTokenizer.from_pretrained(tiny_models.policy).save_pretrained(folder)
        config.save_pretrained(folder)
    critic.score.bias.data.zero_()
    critic.save_pretrained(merged)
    rc, out = check(ckpt, merged, capsys)
    assert rc == 0 and "numeric check passed: max |d value|" in out and "net of the head's bias 0.25" in out, out

    def scale_score(state):
        state["score.weight"] *= 1.05

    rc, out = check(ckpt, broken_copy(merged, tmp_path / "bad", scale_score), capsys)
    assert rc == 1 and "max |d value|" in out and "the output head differs" in out, out
