"""python -m reward_score.check_format: TRL's dataset layouts read (or refused naming the row, the field and the fix),
every server format scored through the server's own code, and the one the model ranks best recommended.

The models here are the tiny random one and pairs it labelled itself in one format (tests/trl_cases.pairs_ranked_by);
models trained by real TRL are tests/test_trl_formats.py's."""

import json
import subprocess
import sys

import pytest

from reward_score.check_format import PairsError, evaluate, load_scorer, main, parse_pairs, read_rows
from tests.support import REPO
from tests.trl_cases import pairs_ranked_by

USER = [{"role": "user", "content": "Q?"}]


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "rows, layout, chosen",
    [
        # conversations, implicit prompt: the last message is the answer, the rest the prompt
        ([{"chosen": USER + answer("yes"), "rejected": USER + answer("no")}], "conversation", (USER, "yes")),
        # a prompt column of messages: one assistant message each side
        ([{"prompt": USER, "chosen": answer("yes"), "rejected": answer("no")}], "conversation_prompt", (USER, "yes")),
        # plain text, implicit prompt: what the two share at the start, the space going with the answer (TRL's
        # extract_prompt)
        (
            [{"chosen": "Q: x\nA: yes", "rejected": "Q: x\nA: no"}],
            "text",
            ([{"role": "user", "content": "Q: x\nA:"}], " yes"),
        ),
        # plain text with a prompt column: the server renders prompt + response, as TRL >= 0.24 concatenated them
        (
            [{"prompt": "Q: x\nA:", "chosen": " yes", "rejected": " no"}],
            "text_prompt",
            ([{"role": "user", "content": "Q: x\nA:"}], " yes"),
        ),
    ],
)
def test_each_of_trls_layouts_becomes_the_servers_messages_and_response(rows, layout, chosen):
    got_layout, pairs = parse_pairs(rows)
    assert got_layout == layout and pairs[0].chosen == chosen


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"chosen": USER + answer("a")}], "row 0: no 'rejected' field (fields: chosen); TRL's preference layout"),
        (
            [{"chosen": USER + answer("a"), "rejected": USER + answer("b")}, {"chosen": "a", "rejected": "b"}],
            "row 1: 'chosen'/'rejected' plain texts, but row 0 has 'chosen'/'rejected' conversations: one layout",
        ),
        ([{"chosen": USER, "rejected": USER + answer("b")}], "row 0.chosen: the last message is the scored answer"),
        (
            [{"prompt": USER, "chosen": answer("a") + USER + answer("c"), "rejected": answer("b")}],
            "row 0.chosen: one assistant message with text (the server scores one response after the prompt), got 3 "
            "message(s), roles ['assistant', 'user', 'assistant']: move earlier turns into 'prompt'",
        ),
        (
            [
                {
                    "prompt": USER,
                    "chosen": [{"role": "assistant", "content": [{"type": "text"}]}],
                    "rejected": answer("b"),
                }
            ],
            "row 0.chosen[0].content: text only",
        ),
        (
            [{"prompt": USER, "chosen": [{"content": "a"}], "rejected": answer("b")}],
            "row 0.chosen[0]: a message is {'role': str, 'content': str}",
        ),
        ([{"prompt": "Q", "chosen": " a", "rejected": "  "}], "row 0.rejected: empty"),
        ([{"chosen": "same", "rejected": "same"}], "row 0: 'chosen' and 'rejected' must differ"),
        ([], "no rows"),
    ],
)
def test_bad_pairs_are_refused_naming_the_row_the_field_and_the_fix(rows, needle):
    with pytest.raises(PairsError) as exc:
        parse_pairs(rows)
    assert needle in str(exc.value)


def test_a_line_that_is_not_json_and_a_file_that_is_not_parquet_are_named(tmp_path):
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text('{"chosen": "a b", "rejected": "a c"}\n\n{"chosen": "a b",\n')
    with pytest.raises(PairsError, match=r"pairs.jsonl line 3: not JSON"):
        read_rows(jsonl)
    fake = tmp_path / "pairs.parquet"
    fake.write_text("not parquet")
    with pytest.raises(PairsError, match="not a readable parquet file"):
        read_rows(fake)
    with pytest.raises(PairsError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl")


def test_parquet_reads_as_jsonl_does_without_the_none_fields_arrow_adds(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow gives every message the union of the keys: the first message gets name=None.
    rows = [
        {"prompt": USER, "chosen": answer("yes"), "rejected": answer("no")},
        {"prompt": [{"role": "user", "content": "R?", "name": "bob"}], "chosen": answer("a"), "rejected": answer("b")},
    ]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert pq.read_table(path).to_pylist()[0]["prompt"][0]["name"] is None
    layout, pairs = parse_pairs(read_rows(path))
    assert layout == "conversation_prompt" and pairs[0].chosen == (USER, "yes")


@pytest.fixture(scope="module")
def labelled(tiny_models, tmp_path_factory):
    """Pairs the tiny reward model ranks right in the completion format (REWARD_INPUT=completion), by construction."""
    rows = pairs_ranked_by(tiny_models.reward_model, input="completion")
    path = tmp_path_factory.mktemp("pairs") / "completion_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_format_the_pairs_were_ranked_in_is_recommended(tiny_models, labelled):
    scorer = load_scorer(str(tiny_models.reward_model), "cpu")
    report = evaluate(scorer, *parse_pairs(read_rows(labelled)))
    best, other = report.results
    assert best.settings["input"] == "completion" and best.right == best.n == 24
    assert other.settings["input"] == "conversation" and other.right < 24, "the other format must rank worse"
    # The tiny tokenizer adds no special tokens: with or without them is the same ids, so one row each.
    assert {v["add_special_tokens"] for v in [best.settings, *best.same_as]} == {"auto", "true", "false"}
    assert best.trl == "<= 0.23" and other.trl == ">= 0.24"
    assert report.given is other, "the defaults are the settings given"


def test_the_command_recommends_settings_and_exits_1_while_the_job_would_score_otherwise(tiny_models, labelled, capsys):
    cmd = [
        sys.executable,
        "-m",
        "reward_score.check_format",
        str(tiny_models.reward_model),
        str(labelled),
        "--device",
        "cpu",
    ]
    wrong = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 1, wrong.stderr
    assert "recommended: REWARD_INPUT=completion" in wrong.stdout
    assert "in run_grpo_qwen3_4b_mega_verl.sh: CONFIG_REWARD_INPUT=completion" in wrong.stdout
    assert "24/24 100.0%" in wrong.stdout and "<- the settings given" in wrong.stdout
    assert main([*cmd[3:], "--input", "completion"]) == 0
    assert "the settings given score as recommended" in capsys.readouterr().out


def test_conversations_for_a_tokenizer_without_a_chat_template_exit_2_saying_why(tiny_models, tmp_path, capsys):
    import shutil

    model = tmp_path / "no_template"
    shutil.copytree(tiny_models.reward_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": USER, "chosen": answer("a"), "rejected": answer("b")}) + "\n")
    assert main([str(model), str(pairs), "--device", "cpu"]) == 2
    assert "the model's tokenizer has no chat template" in capsys.readouterr().err


def test_a_missing_model_folder_exits_2_naming_it(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"chosen": "a b", "rejected": "a c"}) + "\n")
    assert main([str(tmp_path / "nowhere"), str(pairs)]) == 2
    assert "nowhere" in capsys.readouterr().err
