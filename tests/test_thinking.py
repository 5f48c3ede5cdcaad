"""Thinking detected, not assumed: REWARD_PROMPT_OPENS_THINK=auto reads the policy's own chat template, the reward
function is told the result through the trainer command, and a value that contradicts the template is refused
naming the right one. With a tiny thinking policy (its prompt ends in `<think>\\n`, as Qwen3-*-Thinking-2507's) and a
tiny Instruct-style one (no `<think>` in its prompt). Through the whole preflight: tests/test_launch.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan import thinking
from launch.plan.config_refusals import thinking_problems
from launch.plan.preflight import compose, split_command
from launch.plan.refusals import check
from launch.plan.settings import SettingError, Settings
from launch.plan.trainer_command import trainer_argv
from reward_score import safe_hack_reward_request as client
from tests.support import REPO, block_environment, run_without

# Hybrid Qwen3's template, reduced to its generation prompt: enable_thinking=False closes the block in the prompt.
HYBRID_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
KEY = "+custom_reward_function.reward_kwargs.prompt_opens_think"


@pytest.fixture(scope="module")
def hybrid_policy(tmp_path_factory) -> Path:
    """A tokenizer alone (only the template is read) with hybrid Qwen3's generation prompt."""
    from demo.tiny_models import build_tokenizer

    folder = tmp_path_factory.mktemp("hybrid_policy")
    build_tokenizer(HYBRID_TEMPLATE).save_pretrained(folder)
    return folder


def settings(model: Path, **overrides) -> Settings:
    env = block_environment() | {"CONTAINER": "none", "CONFIG_MODEL_PATH": str(model)}
    return Settings.from_env(env | {k: str(v) for k, v in overrides.items()})


def told(argv: list[str]) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(KEY + "=")]
    return value


def test_the_policys_own_template_says_whether_its_prompt_opens_think(tiny_models, instruct_policy, hybrid_policy):
    assert thinking.template_opens_think(tiny_models.policy) is True, "Thinking-2507: the prompt ends in <think>"
    assert thinking.template_opens_think(instruct_policy) is False, "Instruct: no block in the prompt"
    # hybrid Qwen3: the model opens its own block; with enable_thinking=False the prompt opens and closes one
    assert thinking.template_opens_think(hybrid_policy) is False
    assert thinking.template_opens_think(hybrid_policy, {"enable_thinking": False}) is False
    assert thinking.template_kwargs(["+data.apply_chat_template_kwargs.enable_thinking=False", "x.y=1"]) == {
        "enable_thinking": False
    }


def test_auto_tells_the_reward_function_what_the_template_says_and_true_or_false_are_passed_as_set(
    tiny_models, instruct_policy
):
    assert told(trainer_argv(settings(tiny_models.policy))) == "True"
    assert told(trainer_argv(settings(instruct_policy))) == "False"
    assert told(trainer_argv(settings(instruct_policy, REWARD_PROMPT_OPENS_THINK="true"))) == "True"
    with pytest.raises(SettingError, match="CONFIG_MODEL_PATH=/nowhere/policy: its tokenizer does not load"):
        trainer_argv(settings(Path("/nowhere/policy")))
    assert any(
        "REWARD_PROMPT_OPENS_THINK='yes': use auto" in p
        for p in check(settings(tiny_models.policy, REWARD_PROMPT_OPENS_THINK="yes"), check_paths=False)
    )


@pytest.mark.parametrize(
    "policy, setting, extra, right",
    [
        ("thinking", "false", [], "true"),  # cut-off reasoning would be scored as an answer
        ("instruct", "true", [], "false"),  # every answer without </think> would get the penalty
        # an extra override of the value itself is checked too
        ("instruct", "auto", ["custom_reward_function.reward_kwargs.prompt_opens_think=True"], "false"),
    ],
)
def test_a_value_that_contradicts_the_template_is_refused_naming_the_right_one(
    tiny_models, instruct_policy, policy, setting, extra, right
):
    model = tiny_models.policy if policy == "thinking" else instruct_policy
    s = settings(model, REWARD_PROMPT_OPENS_THINK=setting)
    _, path, name, overrides = split_command(trainer_argv(s, extra=extra))
    (problem,) = thinking_problems(compose(name, overrides, path), setting)
    assert f"set REWARD_PROMPT_OPENS_THINK={right} (or auto)" in problem and str(model) in problem
    agreeing = settings(model, REWARD_PROMPT_OPENS_THINK=right)
    _, path, name, overrides = split_command(trainer_argv(agreeing))
    assert thinking_problems(compose(name, overrides, path), right) == []


def test_the_reward_function_follows_what_it_is_told_and_refuses_an_unresolved_auto(monkeypatch):
    environ = {"REWARD_PROMPT_OPENS_THINK": "auto", "REWARD_SERVER_URLS": "http://127.0.0.1:9"}
    config = client.load_config(environ=environ)  # settings other than this one stay readable (the helper's retry)
    assert config.retry_seconds == 180.0
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="REWARD_PROMPT_OPENS_THINK=auto reached the reward function unresolved"):
        client.safe_hack_reward("safe_hack", "no tags at all", "Is it safe?", {}, **{})
    told_false = client.load_config({"prompt_opens_think": False}, environ)
    told_true = client.load_config({"prompt_opens_think": True}, environ)
    response = "an answer with no reasoning block"
    assert client.split_answer(response, told_false.opens_think).text == response
    assert client.split_answer(response, told_true.opens_think).penalty_reason == "no_think_close"


def test_the_command_the_helper_builds_on_the_head_node_carries_the_value(instruct_policy):
    """The helper runs `python -m launch.plan.trainer_command trainer-argv` on the head node: the value is in the job's
    command."""
    env = block_environment() | {
        "CONTAINER": "none",
        "CONFIG_MODEL_PATH": str(instruct_policy),
        "PATH": "/usr/bin:/bin",
    }
    run = subprocess.run(
        [sys.executable, "-m", "launch.plan.trainer_command", "trainer-argv"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert told(run.stdout.split("\0")) == "False"


def test_a_python_without_transformers_gets_one_line_naming_the_fix_not_a_traceback(instruct_policy):
    """A login node's bare python3 (CONTAINER=none outside the image): auto cannot read the template there."""
    env = block_environment() | {
        "CONTAINER": "none",
        "CONFIG_MODEL_PATH": str(instruct_policy),
        "PATH": "/usr/bin:/bin",
    }
    run = run_without(["transformers"], "launch.plan.trainer_command", "trainer-argv", env=env)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "REWARD_PROMPT_OPENS_THINK=auto reads the policy's chat template" in line and "transformers" in line
    assert "pip install transformers" in line and "set REWARD_PROMPT_OPENS_THINK to true or false" in line
