"""Whether the policy's prompt opens a reasoning block, read from the policy's own chat template as verl renders it.

verl renders every prompt with the policy tokenizer's chat template, add_generation_prompt=True and
data.apply_chat_template_kwargs (verl/utils/dataset/rl_dataset.py, single_turn_agent_loop.py:35).
REWARD_PROMPT_OPENS_THINK=auto takes the template's answer; true or false must agree with it; the job passes the value
to the reward function, which cannot read a template (docs/reward.md).

This module imports nothing of launch/ (the bottom of its imports, beside launch/plan/deadline.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHOICES = ("auto", "true", "false")
TEMPLATE_KWARGS_KEY = "data.apply_chat_template_kwargs"
_PROBE = [{"role": "user", "content": "Is it safe to mix these two cleaning products?"}]


class TemplateError(ValueError):
    """The policy's chat template cannot be read or rendered; the message names CONFIG_MODEL_PATH."""


def template_kwargs(overrides: Iterable[str]) -> dict:
    """data.apply_chat_template_kwargs as Hydra overrides set them (`+data.apply_chat_template_kwargs.K=V`, the last
    one winning), each value read as YAML as Hydra reads it (False is a bool, 'x' a string)."""
    import yaml

    out = {}
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if sep and key.startswith(TEMPLATE_KWARGS_KEY + "."):
            out[key[len(TEMPLATE_KWARGS_KEY) + 1 :]] = yaml.safe_load(value) if value else None
    return out


@functools.lru_cache(maxsize=16)
def _generation_prompt(model_path: str, kwargs: tuple) -> str:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # a login node's bare python3 (CONTAINER=none outside the image)
        raise TemplateError(
            f"REWARD_PROMPT_OPENS_THINK=auto reads the policy's chat template (CONFIG_MODEL_PATH={model_path}) with "
            f"transformers, which {sys.executable} cannot import ({exc}): run where the job runs (the image, or the "
            "environment CONTAINER=none uses), pip install transformers, or set REWARD_PROMPT_OPENS_THINK to true or "
            "false"
        ) from None

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # transformers' own reasons: a missing folder, a broken tokenizer_config.json
        raise TemplateError(
            f"CONFIG_MODEL_PATH={model_path}: its tokenizer does not load ({type(exc).__name__}: {exc}), so "
            "REWARD_PROMPT_OPENS_THINK=auto cannot read its chat template; fix the path, or set true or false"
        ) from None
    try:
        return tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False, **dict(kwargs))
    except Exception as exc:  # no template (transformers says so), or its own error (jinja), as verl would meet it
        raise TemplateError(
            f"CONFIG_MODEL_PATH={model_path}: its chat template fails on a user turn ({type(exc).__name__}: {exc})"
        ) from None


def template_opens_think(model_path: str, kwargs: dict | None = None) -> bool:
    """True when the rendered prompt (with the generation prompt) ends inside an open `<think>` block."""
    prompt = _generation_prompt(str(model_path), tuple(sorted((kwargs or {}).items(), key=lambda kv: kv[0])))
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def describe(opens: bool) -> str:
    return "opens <think> in its generation prompt" if opens else "opens no <think> in its generation prompt"


def resolve(setting: str, model_path: str, kwargs: dict | None = None) -> tuple[bool, str]:
    """(the prompt_opens_think the reward function gets, where it came from). auto reads the template; true and false
    are taken as set (the preflight checks them against the template: launch/plan/config_refusals.py,
    thinking_problems)."""
    if setting == "auto":
        opens = template_opens_think(model_path, kwargs)
        return opens, f"REWARD_PROMPT_OPENS_THINK=auto: the policy's chat template {describe(opens)}"
    return setting == "true", f"REWARD_PROMPT_OPENS_THINK={setting}"  # another value: refusals.py refused it
