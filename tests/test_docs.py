"""The documentation says what the code does: docs/settings.md lists every setting of the block once with its default,
each row of docs/operations.md's Messages names a message the code still prints, README.ja.md names the commands and
settings README.md names, every link in the docs points at a file that exists, and README.md's file list names what is
there and every file of a clone."""

import ast
import fnmatch
import re
import subprocess
from pathlib import Path

from tests.support import REPO, RUN, block_settings


def test_the_settings_page_lists_every_setting_of_the_block_once_with_its_default():
    """docs/settings.md is written by hand: a setting added to the block, or a default changed there, fails here until
    the page has its row, with the default as the block writes it (`(empty)` for none)."""
    settings = block_settings()
    names = [name for name, _, _ in settings]
    block = RUN.read_text().split("# ---- settings", 1)[1].split("\n# ------------", 1)[0]
    assert len(names) == len(set(names)) == len(re.findall(r'^[A-Z][A-Z0-9_]*="\$\{', block, flags=re.M))
    assert all(comment for _, _, comment in settings), "every setting of the block has its comment"
    page = (REPO / "docs" / "settings.md").read_text()
    tables, articles = page.split("## The article's names\n")
    rows = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \| (.*?) \|", tables, flags=re.M)
    shown = [name for name, _ in rows]
    assert [n for n in names if shown.count(n) != 1] == [], "a row each, once"
    assert set(shown) <= set(names), set(shown) - set(names)
    expected = {name: f"`{default}`".replace("|", "\\|") if default else "(empty)" for name, default, _ in settings}
    wrong = [(name, cell, expected[name]) for name, cell in rows if cell != expected[name]]
    assert wrong == [], "docs/settings.md shows another default than the block (the row's, the block's)"
    named = re.findall(r"^\| `([A-Z0-9_]+)` \|", articles.split("\n## ")[0], re.M)
    assert named and set(named) <= set(names), set(named) - set(names)


# --- docs/operations.md's Messages: each row's key is a message of the code ------------------------------------------


def code_text() -> str:
    """The product code's text: each shell script as written, each Python module's string literals as Python reads
    them (an implicitly joined literal whole, an f-string's pieces between its values)."""
    listed = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=REPO, capture_output=True, text=True, check=True)
    texts = []
    for name in listed.stdout.split():
        if name.startswith(("tests/", "benchmarks/")):
            continue
        source = (REPO / name).read_text()
        if name.endswith(".sh"):
            texts.append(source)
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return "\n".join(texts)


def test_every_row_of_the_messages_index_names_a_message_the_code_still_prints():
    """The index is of the messages users meet, not every one; a row whose message was reworded or removed would send
    a reader searching for text no job prints."""
    page = (REPO / "docs" / "operations.md").read_text()
    keys = re.findall(r"^\| `([^`]+)` \|", page.split("\n## Messages\n", 1)[1], flags=re.M)
    assert len(keys) >= 60, "the Messages section: a table row per message, its key in backticks in the first cell"
    code = code_text()
    assert [k for k in keys if k.replace("\\|", "|") not in code] == []


# --- links -----------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def test_every_link_of_the_readmes_and_docs_points_at_a_file_and_heading_that_exist():
    pages = [REPO / "README.md", REPO / "README.ja.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(REPO)}: ({target})")
    assert broken == []


def test_the_readmes_canary_table_is_what_a_passing_canary_prints():
    from launch.watch import canary

    english = (REPO / "README.md").read_text()
    block = english.split("A passing canary", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    passed = {stage: {"stage": stage, "status": "passed", "seconds": "<s>"} for stage in canary.STAGES}
    assert block == canary.summary(passed)[0] + "\n"


def test_the_readme_fits_a_first_hour_and_links_the_japanese_one_first():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert "(README.ja.md)" in "\n".join(lines[:4])
    quickstart = next(i for i, line in enumerate(lines) if line == "## Quickstart on a cluster")
    assert quickstart < 25 and "not** run on GPUs yet" in "\n".join(lines[:quickstart]), "the status before the steps"
    status = next(i for i, line in enumerate(lines) if line.startswith("**Status.**"))
    assert lines[status + 3] == "" and "`make demo`" in "\n".join(lines[:quickstart]), "3 lines, then the first command"


# --- README.ja.md keeps up with README.md -------------------------------------------------------------------------


def code_blocks(text: str, language: str) -> list[list[str]]:
    """Each ```language block's lines, a bash line without its comment (the comments are each README's language)."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)
    return [[line.split("  #", 1)[0].rstrip() for line in block.splitlines()] for block in blocks]


NAME = re.compile(r"\b[A-Z][A-Z0-9_]{2,}\b|#SBATCH --[a-z-]+|--[a-z][a-z-]+")


def names(text: str) -> set[str]:
    """The setting names, #SBATCH lines and options a README names in its code spans and blocks."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return {n for span in spans for n in NAME.findall(span)}


def test_the_japanese_readme_has_the_english_ones_commands_settings_output_and_links():
    english, japanese = (REPO / "README.md").read_text(), (REPO / "README.ja.md").read_text()
    assert code_blocks(japanese, "bash") == code_blocks(english, "bash"), "the same commands, block by block"
    assert code_blocks(japanese, "text") == code_blocks(english, "text"), "the same healthy-job output"
    assert names(japanese) == names(english), (names(english) - names(japanese), names(japanese) - names(english))
    links = re.compile(r"\]\((docs/[^)#]+)")
    assert set(links.findall(japanese)) == set(links.findall(english))
    assert {"CONFIG_MODEL_PATH", "CONFIG_REWARD_MODEL_PATH", "TRAINING_DONE", "#SBATCH --partition"} <= names(english)


def step_3_settings(readme) -> list[str]:
    """The setting names in the first column of a README's step-3 table (the settings to edit first)."""
    text = readme.read_text()
    table = re.split(r"\n\*\*(?:Step 3|手順 3)", text, maxsplit=1)[1].split("\n\n", 2)[1]
    return [n for row in table.splitlines()[2:] for n in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])]


def test_the_step_3_tables_name_settings_of_the_block_and_the_thinking_one_among_them():
    block = {name for name, _, _ in block_settings()}
    for readme in (REPO / "README.md", REPO / "README.ja.md"):
        names = step_3_settings(readme)
        assert "REWARD_PROMPT_OPENS_THINK" in names, readme.name
        assert set(names) <= block, (readme.name, set(names) - block)


def test_the_quickstarts_steps_are_numbered_in_order_in_both_readmes():
    for readme in ("README.md", "README.ja.md"):
        section = (REPO / readme).read_text().split("```bash\n", 1)[1].split("```", 1)[0]
        numbers = [re.search(r"  # (\S+)\. ", line).group(1) for line in section.splitlines() if "  # " in line]
        assert numbers == [str(n) for n in range(1, len(numbers) + 1)], (readme, numbers)


def test_the_nccl_section_has_the_infiniband_settings_and_what_the_job_sets_itself():
    ops = (REPO / "docs" / "operations.md").read_text()
    section = ops.split("### NCCL timeouts and hangs", 1)[1].split("\n### ", 1)[0]
    for name in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG=INFO"):
        assert name in section, name
    # the section says the job sets NCCL_SOCKET_IFNAME from CONFIG_NETWORK_INTERFACE: the helper does
    assert "export NCCL_SOCKET_IFNAME=$CONFIG_NETWORK_INTERFACE" in (REPO / "helper_grpo_qwen3_4b.sh").read_text()


def test_every_code_fence_of_the_readmes_and_docs_is_closed():
    """A fence left open renders the rest of the page as code (docs/image.md had a stray line and a lone fence)."""
    pages = [
        REPO / "README.md",
        REPO / "README.ja.md",
        REPO / "benchmarks" / "README.md",
        REPO / "benchmarks" / "HISTORY.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]
    for page in pages:
        fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
        assert len(fences) % 2 == 0, f"{page.relative_to(REPO)}: a code fence is not closed"
        assert all(line == "```" for line in fences[1::2]), (
            f"{page.relative_to(REPO)}: a closing fence names a language"
        )


def test_the_benchmarks_page_leads_with_todays_figures_and_every_link_into_it_or_its_history_resolves():
    """benchmarks/README.md is today's figures and commands (a page, not a journal); the rounds behind them are in
    benchmarks/HISTORY.md. The READMEs, docs and both pages link into their sections: every anchor names a heading."""
    bench = REPO / "benchmarks"
    assert len((bench / "README.md").read_text().splitlines()) <= 150, "benchmarks/README.md: move rounds to HISTORY.md"
    targets = {(bench / "README.md").resolve(), (bench / "HISTORY.md").resolve()}
    pages = [REPO / "README.md", REPO / "README.ja.md", *sorted((REPO / "docs").glob("*.md")), *sorted(targets)]
    checked, broken = 0, []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if file in targets and anchor:
                checked += 1
                if anchor not in anchors(file):
                    broken.append(f"{page.relative_to(REPO)}: ({target})")
    assert broken == [] and checked >= 6, (broken, checked)


def test_the_speed_table_lives_in_the_benchmarks_readme_and_the_readmes_quote_its_first_row():
    english, japanese = (REPO / "README.md").read_text(), (REPO / "README.ja.md").read_text()
    bench = (REPO / "benchmarks" / "README.md").read_text()
    row = re.search(r"^\| Qwen3-1\.7B shape \| ([0-9.]+) \| ([0-9.]+) ", bench, flags=re.M)
    assert row, "the latest round's table in benchmarks/README.md"
    seconds, share = f"{float(row.group(1)):.1f}", f"{float(row.group(2)):.0f}%"
    for readme, unit in ((english, " s"), (japanese, " 秒")):
        assert "% of ceiling" not in readme and "性能比" not in readme, "no speed table in the README"
        (line,) = [x for x in readme.splitlines() if "benchmarks/README.md" in x and x.startswith("- ")]
        assert f"{seconds}{unit}" in line and share in line, (line, seconds, share)


def test_the_japanese_readme_says_what_the_canary_is_where_it_first_names_it():
    japanese = (REPO / "README.ja.md").read_text()
    after = japanese.split("カナリア", 1)[1]
    assert after.startswith("（"), "カナリア is explained at its first use, in parentheses"
    explanation = after[1 : after.index("）")]
    assert "試運転" in explanation and "CANARY=1" in explanation, explanation


# --- README.md's Files block: every path it names is there, and every file of the clone is on a line -----------------

# Files of the clone that the block leaves out on purpose, with the reason.
NOT_IN_FILES = {".gitignore": "git's own: what a clone leaves out"}


def files_block() -> list[tuple[str, list[str]]]:
    """README.md's `## Files` block, a line per path group (`path[, more names]  what it is`): each line with its paths,
    the first token and the comma-separated names after it, which are relative to the first one's folder."""
    block = (REPO / "README.md").read_text().split("## Files\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    rows = []
    for line in block.splitlines():
        first, *more = line.split("  ", 1)[0].split(", ")
        folder = first.rstrip("/").rpartition("/")[0]
        rows.append((line, [first, *(f"{folder}/{m}" if folder else m for m in more)]))
    return rows


def files_of(path: str, files: list[str]) -> list[str]:
    """The files a path of the block stands for: itself, everything under a folder (`dir/`), or a glob's matches."""
    if path.endswith("/"):
        return [f for f in files if f.startswith(path)]
    if "*" in path:
        return [f for f in files if fnmatch.fnmatch(f, path) and f.count("/") == path.count("/")]
    return [path] if path in files else []


def test_the_readmes_files_block_names_what_is_there_and_every_file_of_the_clone():
    """What a user's clone holds (tracked and unignored files, as tests/real_slurm.py copies it): each path the block
    names is among them, and each of them is on a line: named, under a folder the block names, or a package's
    __init__.py beside a module a line names."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    files = sorted(f for f in listed if f and (REPO / f).is_file())
    rows = files_block()
    assert len(rows) >= 20, "README.md's Files block: a fenced block right under `## Files`"
    problems, covered = [], set()
    for line, paths in rows:
        if "  " not in line.strip():
            problems.append(f"no description on the line {line!r}: write `path[, more names]  what it is`")
            continue
        for path in paths:
            found = files_of(path, files)
            if not found and files_of(path.rstrip("/") + "/", files):
                problems.append(f"{path} is a folder: write it {path}/ on the line {line!r}")
                found = files_of(path.rstrip("/") + "/", files)
            elif not found:
                problems.append(f"{path} is not in the repository: fix or drop it on the line {line!r}")
            covered.update(found)
    folders = {}  # a folder -> the first line that names a file in it: where another file of it goes
    for line, paths in rows:
        for path in (p for p in paths if p in files and "  " in line.strip()):
            folders.setdefault(str(Path(path).parent), line)
    for f in files:
        folder, name = str(Path(f).parent), Path(f).name
        if f in covered or f in NOT_IN_FILES or (name == "__init__.py" and folder in folders):
            continue
        where = (
            f"add `, {name}` to the line {folders[folder]!r}"
            if folder in folders and folder != "."
            else f"add a line `{f}  what it is`"
        )
        problems.append(f"{f} is on no line: {where} (or list it in NOT_IN_FILES with the reason)")
    assert problems == [], "README.md's Files block:\n" + "\n".join(problems)
    assert all(f in files for f in NOT_IN_FILES), "NOT_IN_FILES names a file that is gone"


def test_the_japanese_readme_has_no_file_list_of_its_own_and_points_at_the_english_one():
    """One list to keep: README.ja.md links README.md's Files block instead of a tree of its own (which this file's
    test would then have to check the same way)."""
    japanese = (REPO / "README.ja.md").read_text()
    assert "(README.md#files)" in japanese, "README.ja.md: keep its link to README.md#files (the file list)"
    tree = re.search(r"^run_grpo_qwen3_4b_mega_verl\.sh {2,}", japanese, flags=re.M)
    assert not tree, "README.ja.md has a file tree now: check it as README.md's is checked, or link README.md#files"


def test_the_development_page_shows_launchs_layout_as_the_readme_does():
    """docs/development.md's layout block repeats the README's launch/ lines word for word, so the two cannot drift."""

    def launch_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("launch/")]

    readme = launch_lines((REPO / "README.md").read_text().split("## Files\n", 1)[1].split("```", 2)[1])
    page = launch_lines((REPO / "docs" / "development.md").read_text().split("## Where the code is\n", 1)[1])
    assert readme and page == readme, (
        "docs/development.md's `## Where the code is` block: copy README.md's launch/ lines"
    )
