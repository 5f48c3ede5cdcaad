"""The documentation says what the code does: the generated pages are what the code makes now, every message the scripts
can print has an entry in docs/operations.md, README.ja.md names the commands and settings README.md names, and every
link in the docs points at a file that exists."""

import re

from launch import reference
from tests.support import REPO


def test_the_settings_and_trainer_command_pages_are_what_the_code_makes_now():
    for page, make in reference.PAGES.items():
        assert page.read_text() == make(), f"{page.name} is stale: run python -m launch.reference write"


def test_the_settings_page_lists_every_setting_of_the_block_once_and_the_articles_names_only_for_settings():
    names = [s.name for s in reference.block_settings()]
    block = reference.block_text()
    assert len(names) == len(set(names)) == len(re.findall(r'^[A-Z][A-Z0-9_]*="\$\{', block, flags=re.M))
    rows = [line.split(" | ", 1)[0] for line in (REPO / "docs" / "settings.md").read_text().splitlines()]
    assert all(rows.count(f"| `{name}`") == 1 for name in names)
    assert set(reference.ARTICLE_NAMES) <= set(names), set(reference.ARTICLE_NAMES) - set(names)
    assert all(s.section and s.comment for s in reference.block_settings()), "every setting has a section and a comment"


def test_each_override_of_the_trainer_command_page_names_the_settings_that_move_it():
    lines = (REPO / "docs" / "trainer-command.md").read_text().split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    fed = {line.split("=", 1)[0]: line.split("# ", 1)[1] for line in lines[1:]}
    assert lines[0] == "python3 -m verl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer"
    assert fed["data.train_batch_size"] == "TRAIN_BATCH_SIZE"
    assert fed["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == "STRATEGY, ACTOR_PP"
    assert fed["trainer.nnodes"] == "CONFIG_USE_SEPARATE_REWARD_NODE, #SBATCH --nodes"
    assert fed["trainer.resume_mode"] == "every job (FIXED_OVERRIDES)"
    assert "/path/to/repo/reward_score/safe_hack_reward_request.py" in " ".join(lines), "no path of this machine"
    assert str(REPO) not in " ".join(lines)
