"""data_prep: rows in verl's format from every input format, bad rows reported, Unicode exact, outputs protected,
and the files load through verl 0.6.1's own RLHFDataset."""

import json
import re
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.build import (
    BadRow,
    RowSpec,
    chat_messages,
    make_row,
    prompt_key,
    split_value,
)
from data_prep.build import main as build_main
from data_prep.validate import main as validate_main
from tests.support import REPO, run_without

UNICODE = "安全に使う方法は？ 🙂 e\u0301 עברית \u200b tab\tend"


def rows_of(path):
    return pq.read_table(path).to_pylist()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# --- one row ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "example, spec, prompt, ground_truth",
    [
        # plain prompt text: one user turn, the article's ground_truth = the prompt
        ({"prompt": "Hi?"}, RowSpec(), [{"role": "user", "content": "Hi?"}], "Hi?"),
        # a fixed system prompt goes first; ground_truth stays the user's text
        (
            {"prompt": "Hi?"},
            RowSpec(system_prompt="Be safe."),
            [{"role": "system", "content": "Be safe."}, {"role": "user", "content": "Hi?"}],
            "Hi?",
        ),
        # a per-row system column wins over the fixed one
        (
            {"q": "Hi?", "sys": "Row sys"},
            RowSpec(prompt_column="q", system_prompt="x", system_column="sys"),
            [{"role": "system", "content": "Row sys"}, {"role": "user", "content": "Hi?"}],
            "Hi?",
        ),
        # a chat list, last turn the user's
        (
            {
                "m": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            },
            RowSpec(prompt_column=None, messages_column="m"),
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
            "c",
        ),
        # rule style: ground_truth is the reference answer
        (
            {"prompt": "2+2?", "ans": "4"},
            RowSpec(reward_style="rule", answer_column="ans"),
            [{"role": "user", "content": "2+2?"}],
            "4",
        ),
    ],
)
def test_make_row_builds_verls_format(example, spec, prompt, ground_truth):
    row = make_row(example, 7, "train", spec, source_row=9)
    assert row["prompt"] == prompt
    assert row["reward_model"] == {"style": spec.reward_style, "ground_truth": ground_truth}
    assert row["extra_info"] | {"reward_messages": None} == {
        "split": "train",
        "index": 7,
        "source_row": 9,
        "reward_messages": None,
    }
    assert row["extra_info"]["reward_messages"] == prompt, "the reward model must still see the prompt verl pops"
    assert row["data_source"] == "custom" and row["ability"] == "general"


def test_source_and_kept_columns_land_where_verl_and_people_read_them():
    spec = RowSpec(source_column="src", keep_columns=("id", "meta"))
    row = make_row({"prompt": "x", "src": "safety_v2", "id": 17, "meta": {"k": "値"}}, 0, "test", spec)
    assert row["data_source"] == "safety_v2"
    assert row["extra_info"]["id"] == "17" and json.loads(row["extra_info"]["meta"]) == {"k": "値"}


@pytest.mark.parametrize(
    "example, spec, needle",
    [
        ({}, RowSpec(), "prompt column 'prompt' is missing"),  # no prompt at all
        ({"prompt": "   "}, RowSpec(), "prompt column 'prompt' is empty"),  # blank
        ({"prompt": 42}, RowSpec(), "is a int, not text"),  # wrong type
        ({"m": "not json"}, RowSpec(prompt_column=None, messages_column="m"), "non-empty list"),
        ({"m": "[bad"}, RowSpec(prompt_column=None, messages_column="m"), "not valid JSON"),  # CSV cell
        (
            {"m": [{"role": "robot", "content": "x"}]},
            RowSpec(prompt_column=None, messages_column="m"),
            "m[0].role is 'robot'",
        ),
        (
            {"m": [{"role": "user", "content": ""}]},
            RowSpec(prompt_column=None, messages_column="m"),
            "m[0].content is empty",
        ),
        (
            {"m": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            RowSpec(prompt_column=None, messages_column="m"),
            "must be the user's turn",
        ),
        (
            {"prompt": "x"},
            RowSpec(prompt_column=None, messages_column="m"),
            "messages column 'm' is missing; the row's columns: prompt (str): name the right one with --prompt-column "
            "(a str) or --messages-column",
        ),
        (
            {"prompt": "x"},
            RowSpec(reward_style="rule", answer_column="ans"),
            "answer column 'ans' is missing; the row's columns: prompt (str): name the right one with --answer-column",
        ),
    ],
)
def test_bad_rows_name_the_field_and_the_problem(example, spec, needle):
    with pytest.raises(BadRow, match=re.escape(needle)):
        make_row(example, 0, "train", spec) if "answer" in needle else chat_messages(example, spec)


def test_the_split_is_deterministic_by_seed_and_keyed_by_prompt():
    keys = [prompt_key([{"role": "user", "content": f"p{i}"}]) for i in range(2000)]
    a = [split_value(k, 0) < 0.1 for k in keys]
    assert a == [split_value(k, 0) < 0.1 for k in keys]
    assert a != [split_value(k, 1) < 0.1 for k in keys]
    assert 150 < sum(a) < 250


# --- whole files ------------------------------------------------------------------------------------------------


@pytest.fixture
def examples():
    return [{"id": i, "prompt": f"question {i}: {UNICODE}" if i % 5 == 0 else f"question {i}"} for i in range(60)]


def build(tmp_path, *args):
    return build_main(
        [*map(str, args), "--out-dir", str(tmp_path / "out"), "--keep-columns", "id", "--test-size", "0.2"]
    )


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "hf"])
def test_every_input_format_gives_the_same_rows(tmp_path, examples, fmt):
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        write_jsonl(src, examples)
    elif fmt == "json":
        src.write_text(json.dumps(examples, ensure_ascii=False), encoding="utf-8")
    elif fmt == "csv":
        pd.DataFrame(examples).to_csv(src, index=False)
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(examples), src)
    else:
        import datasets

        src = tmp_path / "saved"
        datasets.Dataset.from_list(examples).save_to_disk(str(src))
    assert build(tmp_path, src) == 0
    train, test = rows_of(tmp_path / "out" / "train.parquet"), rows_of(tmp_path / "out" / "test.parquet")
    assert len(train) + len(test) == 60 and test
    got = sorted(r["prompt"][0]["content"] for r in train + test)
    assert got == sorted(e["prompt"] for e in examples), "Unicode and every row must survive exactly"
    assert sorted(int(r["extra_info"]["id"]) for r in train + test) == list(range(60))
    assert [r["extra_info"]["index"] for r in train] == list(range(len(train)))


def test_messages_in_a_csv_cell_are_read_as_json(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": UNICODE}]
    src = tmp_path / "in.csv"
    pd.DataFrame(
        [{"chat": json.dumps(chat, ensure_ascii=False)}] * 3
        + [{"chat": json.dumps([{"role": "user", "content": f"u{i}"}])} for i in range(9)]
    ).to_csv(src, index=False)
    assert (
        build_main([str(src), "--messages-column", "chat", "--out-dir", str(tmp_path / "o"), "--test-size", "0.5"]) == 0
    )
    rows = rows_of(tmp_path / "o" / "train.parquet") + rows_of(tmp_path / "o" / "test.parquet")
    assert [r["prompt"] for r in rows if r["prompt"][0]["role"] == "system"] == [chat] * 3


def test_bad_rows_are_skipped_and_reported_with_row_numbers(tmp_path, examples, capsys):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps(e, ensure_ascii=False) for e in examples[:20]]
    lines[3] = json.dumps({"id": 3, "prompt": ""})
    lines[7] = "{not json"
    lines[11] = json.dumps({"id": 11, "prompt": ["a list"]})
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert build(tmp_path, src) == 0
    err = capsys.readouterr().err
    assert "row 4: prompt column 'prompt' is empty" in err
    assert "row 8: line is not valid JSON" in err
    assert "row 12: prompt column 'prompt' is a list, not text" in err
    bad = [json.loads(x) for x in (tmp_path / "out" / "bad_rows.jsonl").read_text().splitlines()]
    assert [b["row"] for b in bad] == [4, 8, 12]
    kept = rows_of(tmp_path / "out" / "train.parquet") + rows_of(tmp_path / "out" / "test.parquet")
    assert len(kept) == 17 and {r["extra_info"]["source_row"] for r in kept}.isdisjoint({4, 8, 12})


def test_on_bad_row_fail_stops_naming_the_row_and_writes_nothing(tmp_path, examples):
    src = write_jsonl(tmp_path / "in.jsonl", examples[:5] + [{"id": 99}] + examples[5:10])
    with pytest.raises(SystemExit, match="row 6: prompt column 'prompt' is missing"):
        build(tmp_path, src, "--on-bad-row", "fail")
    assert not list((tmp_path / "out").glob("*.parquet*")), "no output, not even a .tmp"


def test_existing_outputs_are_kept_unless_overwrite(tmp_path, examples):
    src = write_jsonl(tmp_path / "in.jsonl", examples)
    assert build(tmp_path, src) == 0
    before = (tmp_path / "out" / "train.parquet").read_bytes()
    write_jsonl(src, [{"id": i, "prompt": f"changed {i % 25}"} for i in range(50)])
    with pytest.raises(SystemExit, match="--overwrite"):
        build(tmp_path, src)
    assert (tmp_path / "out" / "train.parquet").read_bytes() == before
    assert build(tmp_path, src, "--overwrite", "--dedup") == 0
    rows = rows_of(tmp_path / "out" / "train.parquet") + rows_of(tmp_path / "out" / "test.parquet")
    assert sorted(r["prompt"][0]["content"] for r in rows) == sorted(f"changed {i}" for i in range(25))


def test_an_empty_test_split_is_refused_and_an_explicit_test_file_is_used(tmp_path, examples):
    src = write_jsonl(tmp_path / "in.jsonl", examples[:3])
    with pytest.raises(SystemExit, match="test split would be empty"):
        build_main([str(src), "--out-dir", str(tmp_path / "out"), "--test-size", "0"])
    held = write_jsonl(tmp_path / "held.jsonl", examples[50:])
    assert build_main([str(src), "--test-file", str(held), "--out-dir", str(tmp_path / "out")]) == 0
    assert len(rows_of(tmp_path / "out" / "test.parquet")) == 10
    assert {r["extra_info"]["split"] for r in rows_of(tmp_path / "out" / "test.parquet")} == {"test"}


def none_under(test_size: float, n: int) -> list[dict]:
    """n prompts of which no hash falls under test_size with seed 0: a small file the split leaves no test row."""
    prompts = (f"How should I store household product {i}?" for i in range(10_000))
    keep = (p for p in prompts if split_value(prompt_key([{"role": "user", "content": p}]), 0) >= test_size)
    return [{"prompt": next(keep)} for _ in range(n)]


@pytest.mark.parametrize("n", [2, 20])
def test_a_small_file_keeps_one_test_row_the_one_nearest_the_split(tmp_path, n, capsys):
    rows = none_under(0.05, n)
    src = write_jsonl(tmp_path / "prompts.jsonl", rows)
    assert build_main([str(src), "--out-dir", str(tmp_path / "out")]) == 0  # the README's step 2, as written
    train, test = rows_of(tmp_path / "out" / "train.parquet"), rows_of(tmp_path / "out" / "test.parquet")
    assert (len(train), len(test)) == (n - 1, 1)
    nearest = min(rows, key=lambda r: split_value(prompt_key([{"role": "user", "content": r["prompt"]}]), 0))
    assert test[0]["prompt"][0]["content"] == nearest["prompt"]
    assert test[0]["extra_info"]["split"] == "test" and test[0]["extra_info"]["index"] == 0
    assert sorted(r["extra_info"]["index"] for r in train) == list(range(n - 1))
    assert "no row fell under --test-size 0.05: the 1 row(s) of the prompt nearest to it went to test" in (
        capsys.readouterr().out
    )


def test_copies_of_the_nearest_prompt_go_to_test_together_and_a_split_that_has_test_rows_is_left_alone(tmp_path):
    rows = none_under(0.05, 5)
    nearest = min(rows, key=lambda r: split_value(prompt_key([{"role": "user", "content": r["prompt"]}]), 0))
    src = write_jsonl(tmp_path / "prompts.jsonl", [*rows, dict(nearest)])
    assert build_main([str(src), "--out-dir", str(tmp_path / "out")]) == 0
    test = rows_of(tmp_path / "out" / "test.parquet")
    assert [r["prompt"][0]["content"] for r in test] == [nearest["prompt"]] * 2, "identical prompts never straddle"
    # a file whose hashes put rows in test keeps exactly those
    examples = [{"prompt": f"question {i}"} for i in range(60)]
    under = [e for e in examples if split_value(prompt_key([{"role": "user", "content": e["prompt"]}]), 0) < 0.05]
    assert under, "some of 60 prompts fall under 5%"
    big = write_jsonl(tmp_path / "big.jsonl", examples)
    assert build_main([str(big), "--out-dir", str(tmp_path / "big")]) == 0
    assert len(rows_of(tmp_path / "big" / "test.parquet")) == len(under)


def test_one_row_cannot_be_split_and_the_refusal_names_the_flags(tmp_path):
    src = write_jsonl(tmp_path / "one.jsonl", none_under(0.05, 1))
    with pytest.raises(SystemExit, match="test split would be empty .*raise --test-size or give --test-file"):
        build_main([str(src), "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "train.parquet").exists(), "nothing written"


@pytest.mark.parametrize(
    "name, content, found, flag",
    [
        # a JSONL of chat lists, built with the default --prompt-column prompt
        (
            "chats.jsonl",
            "".join(
                json.dumps({"id": i, "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(12)
            ),
            "id (int), messages (list)",
            "--messages-column messages",
        ),
        # a CSV whose prompts are in a "question" column
        (
            "qa.csv",
            "id,question,answer\n" + "".join(f"{i},q{i}?,a{i}\n" for i in range(12)),
            "id (str), question (str), answer (str)",
            "--prompt-column question",
        ),
    ],
)
def test_a_file_without_the_prompt_column_names_the_columns_found_and_the_flags_and_creates_no_folder(
    tmp_path, name, content, found, flag
):
    src = tmp_path / name
    src.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as refused:
        build_main([str(src), "--out-dir", str(tmp_path / "data" / "out")])
    message = str(refused.value)
    assert "the train split would be empty (12 rows read, 12 bad)" in message
    assert re.search(r"row [12]: prompt column 'prompt' is missing; the row's columns: ", message)
    assert message.endswith(
        f"columns: {found}: name the right one with --prompt-column (a str) or --messages-column (a list of "
        "{role, content})"
    ), message
    assert not (tmp_path / "data").exists(), "no empty output folder left behind"
    # a folder that was already there, with someone's files, is left as it was
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        build_main([str(src), "--out-dir", str(tmp_path / "kept")])
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
    assert build_main([str(src), "--out-dir", str(tmp_path / "data" / "out"), *flag.split()]) == 0


@pytest.mark.parametrize(
    "preset, fmt, example, data_source, ground_truth, right, wrong",
    [
        # GSM8K's columns; its answer's last line '#### 1,000' becomes '1000' (verl's gsm8k.py); verl's strict scorer
        (
            "gsm8k",
            "jsonl",
            {"question": "How many?", "answer": "500 + 500 = <<500+500=1000>>1000\n#### 1,000"},
            "openai/gsm8k",
            "1000",
            "So the total is\n#### 1000",
            "#### 999",
        ),
        # MATH's columns; the last \boxed{}, nested braces whole (verl's math_dataset.py with its remove_boxed)
        (
            "math",
            "parquet",
            {"problem": "Half of 1?", "solution": "First \\boxed{2}, no: $\\boxed{\\frac{1}{2}}$."},
            "DigitalLearningGmbH/MATH-lighteval",
            "\\frac{1}{2}",
            "It is \\boxed{\\frac12}.",
            "It is \\boxed{2}.",
        ),
    ],
)
def test_a_preset_builds_rule_rows_that_verls_own_scorer_scores(
    tmp_path, preset, fmt, example, data_source, ground_truth, right, wrong, capsys
):
    """The rows verl's examples build: a right answer scores 1 and a wrong one 0 by verl's default_compute_score
    (whole solution text as ground_truth, which the build wrote before, scores the right answer 0). A row without the
    final answer the preset extracts is skipped, naming the column."""
    from verl.utils.reward_score import default_compute_score

    question, answer = list(example)  # the public set's column names
    examples = [{question: f"{example[question]} ({i})", answer: example[answer], "id": i} for i in range(8)]
    src = tmp_path / f"in.{fmt}"
    examples.append({question: "Why?", answer: "no final answer", "id": 8})
    write_jsonl(src, examples) if fmt == "jsonl" else pq.write_table(pa.Table.from_pylist(examples), src)
    assert build(tmp_path, src, "--preset", preset) == 0
    rows = rows_of(tmp_path / "out" / "train.parquet") + rows_of(tmp_path / "out" / "test.parquet")
    assert len(rows) == 8 and {r["data_source"] for r in rows} == {data_source} and rows[0]["ability"] == "math"
    assert {r["reward_model"]["style"] for r in rows} == {"rule"}
    assert {r["reward_model"]["ground_truth"] for r in rows} == {ground_truth}
    assert rows[0]["prompt"][0]["content"].startswith(f"{example[question]} (")
    assert rows[0]["prompt"][0]["content"].endswith(
        ") Let's think step by step and output the final answer "
        + ('after "####".' if preset == "gsm8k" else "within \\boxed{}.")
    )
    assert default_compute_score(data_source, right, ground_truth) == 1.0
    assert default_compute_score(data_source, wrong, ground_truth) == 0.0
    assert default_compute_score(data_source, right, example[answer]) == 0.0, "the whole solution as ground_truth"
    assert "row 9: answer column" in capsys.readouterr().err


def test_the_command_line_has_help_and_rejects_contradictions(tmp_path):
    run = subprocess.run([sys.executable, "-m", "data_prep.build", "--help"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0 and "--messages-column" in run.stdout
    src = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a"}])
    with pytest.raises(SystemExit):
        build_main([str(src), "--out-dir", str(tmp_path), "--reward-style", "rule"])


# --- verl reads them --------------------------------------------------------------------------------------------


def test_outputs_load_with_verls_rlhf_dataset_and_carry_the_prompt(tiny_models, tmp_path, examples):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    src = write_jsonl(tmp_path / "in.jsonl", examples)
    assert (
        build_main(
            [str(src), "--out-dir", str(tmp_path / "out"), "--system-prompt", "Be careful.", "--test-size", "0.2"]
        )
        == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    config = OmegaConf.create(
        {
            "max_prompt_length": 512,
            "truncation": "error",
            "filter_overlong_prompts": True,
            "return_raw_chat": True,
            "prompt_key": "prompt",
        }
    )
    dataset = RLHFDataset(str(tmp_path / "out" / "train.parquet"), tokenizer, config)
    rows = rows_of(tmp_path / "out" / "train.parquet")
    assert len(dataset) == len(rows)
    for i in (0, len(rows) - 1):
        item = dataset[i]
        expected = tokenizer.apply_chat_template(rows[i]["prompt"], add_generation_prompt=True, tokenize=False)
        ids = item["input_ids"][item["attention_mask"].bool()]
        assert tokenizer.decode(ids) == expected
        assert list(item["raw_prompt"]) == rows[i]["prompt"]
        assert item["reward_model"]["ground_truth"] == rows[i]["prompt"][-1]["content"]
        assert list(item["extra_info"]["reward_messages"]) == rows[i]["prompt"]


# --- validate ---------------------------------------------------------------------------------------------------


def test_validate_passes_built_files_and_measures_prompts_as_verl_does(tiny_models, tmp_path, examples, capsys):
    from transformers import AutoTokenizer

    src = write_jsonl(tmp_path / "in.jsonl", examples)
    build(tmp_path, src)
    train = tmp_path / "out" / "train.parquet"
    assert validate_main([str(train)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)) for r in rows_of(train)]
    limit = sorted(lengths)[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    capsys.readouterr()
    args = [str(train), "--tokenizer", str(tiny_models.policy), "--max-prompt-length", str(limit)]
    assert validate_main(args) == 0  # over-long prompts are dropped by every job's data.filter_overlong_prompts
    out = capsys.readouterr().out
    assert f"max {max(lengths)}; {over} over the limit of {limit}" in out
    assert f"warning: {over} prompts over the limit will be dropped" in out


def test_validate_reports_broken_rows_by_number_and_duplicates(tmp_path, capsys):
    good = {
        "prompt": [{"role": "user", "content": "x"}],
        "data_source": "d",
        "reward_model": {"style": "model", "ground_truth": "x"},
    }
    rows = [
        good,
        good,
        {**good, "prompt": []},
        {**good, "reward_model": {"style": "model", "ground_truth": ""}},
        {**good, "data_source": ""},
    ]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert validate_main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "5 rows, 3 with errors, 1 duplicate prompts" in out
    assert "row 3: prompt must be a non-empty chat list" in out
    assert "row 4: reward_model.ground_truth is missing or empty" in out
    assert "row 5: data_source must be non-empty text" in out
    pq.write_table(pa.Table.from_pylist([{"text": "no verl columns"}]), path)
    assert validate_main([str(path)]) == 1
    assert "columns ['data_source', 'prompt', 'reward_model'] are missing" in capsys.readouterr().out


def test_the_data_builders_import_neither_the_launch_code_nor_the_demo():
    """data_prep/ is what a user runs to build data: it must not pull in the launch scripts' code or the demo's."""
    import ast

    for path in sorted((REPO / "data_prep").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for name in names:
                assert name.split(".")[0] not in ("launch", "demo"), f"{path.name} imports {name}"


def test_a_file_that_is_not_parquet_is_an_error_naming_the_file_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "train.parquet"
    bad.write_text("x")
    assert validate_main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: 0 rows, 1 with errors" in out and "cannot be read as parquet" in out


@pytest.mark.parametrize("command", ["data_prep.build", "data_prep.validate"])
def test_a_python_without_pyarrow_gets_one_line_naming_the_install_not_a_traceback(tmp_path, command):
    """A login node's bare python3: the line names pyarrow, how to install it and the image to run it in instead."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    args = [str(src), "--out-dir", str(tmp_path / "out")] if command == "data_prep.build" else [str(src)]
    run = run_without(["pyarrow", "pyarrow.parquet"], command, *args)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert f"python -m {command} needs pyarrow" in line and "pip install --user pyarrow" in line
    assert f"singularity exec verl_app.sif python3 -m {command}" in line
    assert not (tmp_path / "out").exists()
