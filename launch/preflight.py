"""Preflight: compose the exact trainer command's config with verl 0.6.1's own Hydra config and check it with verl's
own code, in seconds, before anything waits in a queue or starts on a GPU.

    python -m launch.preflight [EXTRA_OVERRIDES...]     # reads the settings run_grpo_qwen3_4b_mega_verl.sh exports

What it runs: Hydra composition of ppo_megatron_trainer with every override (a misspelled key stops here), resolution
of every interpolation, then verl's `validate_config` (batch and micro-batch arithmetic, parallel sizes) and the
typed config dataclasses (wrong types). On failure it prints verl's message and the settings that feed that key.
"""

import sys
from pathlib import Path

from launch.settings import SettingError, Settings, trainer_argv

# Which of our settings feed which trainer keys, so an error from verl can name what to change.
SETTING_OF_KEY = {
    "data.train_batch_size": "TRAIN_BATCH_SIZE",
    "ppo_mini_batch_size": "PPO_MINI_BATCH_SIZE",
    "micro_batch_size": "MICRO_BATCH_PER_GPU",
    "pipeline_model_parallel_size": "ACTOR_PP",
    "tensor_model_parallel_size": "ACTOR_TP / ROLLOUT_TP",
    "rollout.n": "ROLLOUT_N",
    "n_gpus_per_node": "CONFIG_GPUS_PER_NODE",
    "max_prompt_length": "MAX_PROMPT_LENGTH",
    "max_response_length": "MAX_RESPONSE_LENGTH",
}


def split_command(argv: list[str]) -> tuple[str, str, str, list[str]]:
    """(module, config path, config name, overrides) from `-m MODULE --config-path=P --config-name=N overrides...`."""
    module = argv[argv.index("-m") + 1]
    path = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-path="))
    name = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-name="))
    overrides = [
        a for a in argv[argv.index("-m") + 2 :] if not a.startswith("--config-") and not a.startswith("hydra.")
    ]
    return module, path, name, overrides


def compose(config_name: str, overrides: list[str], config_path: str = "config"):
    """verl's own Hydra config (or a recipe's, from its absolute folder) with these overrides, resolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    if Path(config_path).is_absolute():
        # A recipe's YAML extends ppo_*_trainer through a searchpath relative to the cwd; the package path works
        # from anywhere.
        init = initialize_config_dir(config_dir=config_path, version_base=None)
        overrides = [*overrides, "hydra.searchpath=[pkg://verl.trainer.config]"]
    else:
        init = initialize_config_module(config_module="verl.trainer.config", version_base=None)
    with init:
        cfg = hydra_compose(config_name, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def validate(cfg) -> None:
    """verl 0.6.1's own checks, as main_ppo runs them before it builds any worker."""
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    use_ref = bool(cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss)
    validate_config(cfg, use_reference_policy=use_ref, use_critic=need_critic(cfg))
    omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    omega_conf_to_dataclass(cfg.algorithm)


def explain(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    hints = sorted({setting for key, setting in SETTING_OF_KEY.items() if key in str(exc)})
    if hints:
        text += f"\n  settings that feed this: {', '.join(hints)}"
    return text


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    try:
        settings = Settings.from_env()
    except SettingError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 1
    try:
        module, path, name, overrides = split_command(trainer_argv(settings, extra=extra))
    except SettingError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 1
    try:
        cfg = compose(name, overrides, path)
        validate(cfg)
    except Exception as exc:  # Hydra's and verl's own errors, reported as they are
        print(
            f"preflight: verl 0.6.1 rejects the trainer config ({module}, {name}):\n  {explain(exc)}", file=sys.stderr
        )
        return 1
    print(
        f"preflight: {module} --config-name={name} with {len(overrides)} overrides composes and passes verl's checks "
        f"(adv_estimator={cfg.algorithm.adv_estimator}, reward_manager={cfg.reward_model.reward_manager}, "
        f"rollout={cfg.actor_rollout_ref.rollout.name}/{cfg.actor_rollout_ref.rollout.mode})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
