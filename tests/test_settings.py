"""Each setting is written once: a line in the run script's settings block, which exports it, and a field in
launch.settings that reads that same name with no default of its own."""

import re
from dataclasses import MISSING, fields

import pytest

from launch.settings import FIXED_OVERRIDES, SettingError, Settings, trainer_argv
from tests.support import REPO, block_environment

RUN_SCRIPT = REPO / "run_grpo_qwen3_4b_mega_verl.sh"


def block_names() -> list[str]:
    block = RUN_SCRIPT.read_text().split("# ---- settings", 1)[1].split("\n# ------------", 1)[0]
    return re.findall(r'^([A-Z][A-Z0-9_]*)="\$\{\1:-', block, flags=re.M)


def test_every_setting_in_the_block_is_exported_by_the_block_itself():
    names, env = block_names(), block_environment()
    assert len(names) > 40
    assert [n for n in names if n not in env] == []


def test_python_reads_only_names_the_block_sets_and_invents_no_defaults():
    read = {f.metadata["env"]: f for f in fields(Settings) if "env" in f.metadata}
    assert set(read) <= set(block_names()), set(read) - set(block_names())
    assert all(f.default is MISSING and f.default_factory is MISSING for f in read.values())
    settings = Settings.from_env(block_environment())
    assert settings.train_batch_size == 256 and settings.separate_reward_node is False


def test_a_missing_or_malformed_setting_names_itself():
    env = block_environment()
    with pytest.raises(SettingError, match="TRAIN_BATCH_SIZE not set"):
        Settings.from_env({k: v for k, v in env.items() if k != "TRAIN_BATCH_SIZE"})
    with pytest.raises(SettingError, match="ACTOR_LR='fast' is not a number"):
        Settings.from_env(env | {"ACTOR_LR": "fast"})
    with pytest.raises(SettingError, match="FP8='maybe': use true or false"):
        Settings.from_env(env | {"FP8": "maybe"})


@pytest.mark.parametrize("algorithm, strategy", [("grpo", "megatron"), ("ppo", "fsdp2"), ("dapo", "megatron")])
def test_the_fixed_trainer_keys_are_in_every_command_and_no_key_is_set_twice(algorithm, strategy):
    settings = Settings.from_env(block_environment() | {"ALGORITHM": algorithm, "STRATEGY": strategy})
    argv = trainer_argv(settings)
    assert all(fixed in argv for fixed in FIXED_OVERRIDES)
    keys = [a.split("=", 1)[0].lstrip("+") for a in argv if "=" in a and not a.startswith("--")]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
