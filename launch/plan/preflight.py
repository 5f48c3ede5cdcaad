"""Preflight: check the exact trainer command with verl 0.6.1's own code before anything waits in a queue.

    python -m launch.plan.preflight [EXTRA_OVERRIDES...]     # reads the settings run_grpo_qwen3_4b_mega_verl.sh exports

The job's one check, in one process (one container start; the policy tokenizer loaded once), cheapest first (main);
docs/operations.md#a-jobs-life lists every check in that order. On failure it prints verl's message.
"""

import atexit
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from launch.plan.config_refusals import (
    batch_problems,
    parallel_problems,
    ray_cpu_problems,
    rollout_problems,
    thinking_problems,
)
from launch.plan.deadline import plan, preemption
from launch.plan.gpu_memory import (
    GpuMemoryError,
    gpu_memory_line,
    megatron_update_lines,
    reward_peak,
)
from launch.plan.megatron_plan import handed_on
from launch.plan.procs import stop_process
from launch.plan.refusals import check, context_problems, header_problems, save_deadline_problems, sbatch_header
from launch.plan.reward_check import (
    begin_reward_server,
    check_reward_data,
    check_rule_round_trip,
    reward_head_problems,
    server_round_trip,
)
from launch.plan.settings import REPO, SettingError, Settings
from launch.plan.thinking import TemplateError
from launch.plan.trainer_command import fused_kernels, megatron_plan, prompt_opens_think, trainer_argv
from launch.plan.trainer_imports import import_problems, start_import_check, trainer_modules


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


def trainer_runs_verl() -> bool:
    """False only where TRAINER_IS_VERL=0 declares that TRAINER_LAUNCHER runs something other than verl's trainer (the
    tests' fake trainer). What the launcher is called says nothing: a site wrapper, `nsys profile ...` or
    `py-spy record -- python3` runs verl's trainer and gets every refusal python3 gets."""
    return os.environ.get("TRAINER_IS_VERL", "1") != "0"


def check_data(cfg, tokenizer) -> tuple[list[str], int]:
    """Load train and val through verl's RLHFDataset as main_ppo builds them (its own overlong filter,
    data.train_max_samples / val_max_samples), and read one item of each; the lines to print and the training
    prompts verl will batch."""
    import pyarrow.parquet as pq
    from verl.utils.dataset.rl_dataset import RLHFDataset

    lines, train_rows = [], 0
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        files = [files] if isinstance(files, str) else list(files)
        total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        limit = cfg.data.get(f"{split}_max_samples", -1)  # RLHFDataset samples these first, then filters
        dataset = RLHFDataset(files, tokenizer, cfg.data, max_samples=limit)
        if len(dataset) == 0:
            raise ValueError(f"{split}: every one of {total} prompts is longer than data.max_prompt_length")
        dataset[0]
        sampled = min(total, limit) if limit > 0 else total
        lines.append(
            f"{split}: {total} rows, {sampled - len(dataset)} longer than data.max_prompt_length="
            f"{cfg.data.max_prompt_length} tokens (verl drops them)"
            + (f" of the {sampled} data.{split}_max_samples keeps" if sampled < total else "")
        )
        train_rows = len(dataset) if split == "train" else train_rows
    return lines, train_rows


def step_plan(cfg, rows: int) -> tuple[list[str], list[str], list[str]]:
    """(lines, warnings, problems) about the steps verl will train, counted as verl 0.6.1 counts them
    (ray_trainer.py _create_dataloader, :380-414): batches of data.gen_batch_size (recipe.dapo) or
    data.train_batch_size, the last incomplete one dropped (drop_last=True), times trainer.total_epochs, unless
    trainer.total_training_steps sets the total; and verl saves every trainer.save_freq steps and after the last
    (ray_trainer.py:1247-1254)."""
    batch = cfg.data.get("gen_batch_size", cfg.data.train_batch_size)
    per_epoch, dropped = divmod(rows, batch)
    epochs, override = cfg.trainer.total_epochs, cfg.trainer.get("total_training_steps")
    total = per_epoch * epochs if override is None else override
    line = (
        f"{rows} training prompts / {batch} a step = {per_epoch} steps an epoch (verl drops the last {dropped}: "
        "drop_last)"
    )
    line += (
        f" x TOTAL_EPOCHS={epochs} = {total} steps"
        if override is None
        else (f"; trainer.total_training_steps={override} sets the total: {total} steps")
    )
    problems, warnings = [], []
    if per_epoch == 0:
        problems.append(
            f"verl would train 0 steps: {rows} training prompts are fewer than data.train_batch_size={batch} "
            "(TRAIN_BATCH_SIZE) and verl drops an incomplete batch, so it stops with 'Train dataloader is empty!' "
            f"(ray_trainer.py:402) after the queue and the model load; set TRAIN_BATCH_SIZE to {rows} or less "
            "(PPO_MINI_BATCH_SIZE with it), or add prompts (python -m data_prep.build)"
        )
    elif total < 1:
        cause = f"TOTAL_EPOCHS={epochs}" if override is None else f"trainer.total_training_steps={override}"
        problems.append(
            f"verl would train 0 steps ({cause}): it would start, load the models, train nothing and the job would "
            "mark the training done; at least 1"
        )
    save_freq = cfg.trainer.save_freq
    more_steps = (
        f"more prompts, a smaller TRAIN_BATCH_SIZE or TOTAL_EPOCHS above {epochs}"
        if override is None
        else f"a trainer.total_training_steps above {override}"
    )
    if not problems and save_freq > 0 and total == 1:
        # verl saves between steps only: no SAVE_FREQ gives a checkpoint before the end of a one-step run.
        warnings.append(
            "verl will train only 1 step: its only checkpoint is that step's, at the end, whatever SAVE_FREQ is "
            "(verl saves after a step, never within one), so a crash or scancel before the end starts over; for "
            f"checkpoints along the way, train more steps: {more_steps}"
        )
    elif not problems and save_freq > 0 and save_freq >= total:
        warnings.append(
            f"SAVE_FREQ={save_freq} is not below the {total} steps verl will train: its only checkpoint is the last "
            "step's (and, in a Slurm job, one before the time limit), so a crash or scancel before the end resumes "
            f"from scratch, and there is nothing to merge until then; set SAVE_FREQ below {total}"
        )
    return [line], warnings, problems


def validation_sampling(cfg) -> str:
    """How verl 0.6.1 will decode validation, from the composed config: sync rollout reads do_sample, then top_k,
    top_p and temperature (verl/workers/rollout/sglang_rollout/sglang_rollout.py:703-727); async rollout's agent loop
    reads temperature and top_p only (verl/experimental/agent_loop/agent_loop.py:341-343)."""
    rollout = cfg.actor_rollout_ref.rollout
    v = rollout.val_kwargs
    if rollout.mode == "async":
        how = "greedy" if v.temperature == 0 else f"samples at temperature {v.temperature}, top_p {v.top_p}"
        return (
            f"{how} (async rollout: verl 0.6.1's agent loop passes validation only temperature and top_p; "
            f"VAL_TOP_K={v.top_k} and VAL_DO_SAMPLE apply to sync rollout)"
        )
    if not v.do_sample or v.temperature == 0:
        return "greedy (VAL_DO_SAMPLE=false)"
    return f"samples at temperature {v.temperature}, top_p {v.top_p}, top_k {v.top_k}"


def check_rows(cfg, tokenizer) -> bool:
    """Row by row, as data_prep.validate does: the schema verl's dataset and reward managers read, and prompt lengths
    in the policy's tokens (over-long prompts are dropped by data.filter_overlong_prompts: counted, not fatal)."""
    from data_prep.validate import validate_files

    files = [
        f
        for split in (cfg.data.train_files, cfg.data.val_files)
        for f in ([split] if isinstance(split, str) else split)
    ]
    template_kwargs = dict(cfg.data.get("apply_chat_template_kwargs") or {})
    return validate_files(files, tokenizer, cfg.data.max_prompt_length, template_kwargs)


def report_steps(cfg, train_rows: int | None) -> bool:
    """Print the steps verl will train (step_plan, from the prompts verl's own dataset kept); False when verl would
    train none. With TRAINER_IS_VERL=0 (a trainer that is not verl's builds no verl dataloader) zero steps are a
    warning, said as such, not a refusal."""
    if train_rows is None:
        print("preflight: steps: not counted (PREFLIGHT_DATA=0 reads no data)")
        return True
    lines, warnings, problems = step_plan(cfg, train_rows)
    for line in lines:
        print(f"preflight: steps: {line}")
    if problems and not trainer_runs_verl():
        warnings += [
            f"{p} (TRAINER_IS_VERL=0: TRAINER_LAUNCHER runs no verl trainer, so not refused)" for p in problems
        ]
        problems = []
    for warning in warnings:
        print(f"preflight: WARNING: steps: {warning}", file=sys.stderr)
    for problem in problems:
        print(f"preflight: refused: {problem}", file=sys.stderr)
    return not problems


def refused(problems: list[str], run_time: bool = False) -> bool:
    """Print each problem, as a refused setting or (`run_time`) as what verl would stop at after the queue and the
    model load; True when there was any, and the caller returns 1."""
    for problem in problems:
        print(
            f"preflight: verl 0.6.1 would stop at run time: {problem}" if run_time else f"setting error: {problem}",
            file=sys.stderr,
        )
    return bool(problems)


def main(argv: list[str] | None = None) -> int:
    """Every check, in the order that fails cheapest first; one line per problem, naming what to change. What runs in
    the background (the check's reward server, the trainer's imports) is stopped whatever the outcome."""
    extra = sys.argv[1:] if argv is None else argv
    with ExitStack() as background:
        settings = checked_settings()
        if settings is None:
            return 1
        try:  # the Megatron plan's auto knobs, chosen once for every check below (launch/plan/megatron_plan.py)
            settings, choice = megatron_plan(settings, extra, explain=True)
        except SettingError as exc:
            print(f"preflight: {exc}", file=sys.stderr)
            return 1
        if choice is not None and os.environ.get("JOB_LOG_DIR"):  # for every node's trainer command (run script)
            Path(os.environ["JOB_LOG_DIR"], "megatron_plan").write_text(handed_on(settings, choice))
        reward_server = None
        if os.environ.get("PREFLIGHT_REWARD", "1") == "1" and settings.uses_reward_model:  # loads meanwhile
            reward_server = begin_reward_server(settings)
            background.callback(stop_process, reward_server.proc, 30)
        lines, warnings = plan(settings, os.environ)
        for line in lines:
            print(f"preflight: save before the time limit: {line}")
        for warning in warnings:
            print(f"preflight: WARNING: save before the time limit: {warning}", file=sys.stderr)
        _, lines, warnings = preemption(settings, os.environ)  # one line: what a preemption costs this job
        for line in lines:
            print(f"preflight: preemption: {line}")
        for warning in warnings:
            print(f"preflight: WARNING: preemption: {warning}", file=sys.stderr)
        composed = checked_config(settings, extra)
        if composed is None:
            return 1
        module, name, overrides, cfg = composed
        report_config(settings, extra, cfg, f"{module} --config-name={name} with {len(overrides)} overrides")
        if not memory_fits(settings, extra, cfg, choice):
            return 1
        imports, modules = None, []
        if trainer_runs_verl():
            if refused(ray_cpu_problems(cfg, os.environ), run_time=True):
                return 1
            modules = trainer_modules(module, cfg)
            imports = start_import_check(modules)  # alongside the checks of the user's own files below
            background.callback(stop_process, imports, 5)
        else:
            print(
                f"preflight: WARNING: TRAINER_IS_VERL=0: TRAINER_LAUNCHER={os.environ.get('TRAINER_LAUNCHER')} runs "
                "no verl trainer, so verl's imports and the Ray CPUs verl holds are not checked",
                file=sys.stderr,
            )
        own_files_pass = check_own_files(settings, cfg, reward_server)
        if not (report_imports(imports, modules, cfg, own_files_pass) and own_files_pass):
            return 1
        return 0


def checked_settings() -> Settings | None:
    """Step 0: the settings read and refused where wrong (launch.plan.refusals, the models' positions, on the login
    node the sbatch header, the save deadline, the reward model's head); None once the refusals are printed."""
    login = os.environ.get("PREFLIGHT_ONLY") == "1" and not os.environ.get("SLURM_JOB_ID")  # sbatch reads the header
    header = (REPO / "run_grpo_qwen3_4b_mega_verl.sh").read_text() if login else ""
    nodes = sbatch_header(header).get("nodes", (0, ""))[1]
    if nodes.isdigit():  # the plan for the nodes the job will get (a separate reward node, trainer.nnodes)
        os.environ.setdefault("CONFIG_NUM_NODES", nodes)
    try:
        settings = Settings.from_env()
    except SettingError as exc:
        print(f"setting error: {exc}", file=sys.stderr)
        return None
    if os.environ.get("TRAINER_IS_VERL", "1") not in ("0", "1"):
        print(
            f"setting error: TRAINER_IS_VERL={os.environ['TRAINER_IS_VERL']!r}: 1 (TRAINER_LAUNCHER runs verl's "
            "trainer, a wrapper of it included) or 0 (it runs something else)",
            file=sys.stderr,
        )
        return None
    problems = check(settings) + context_problems(settings, os.environ)
    problems += header_problems(header, os.environ) if login else []
    if refused(problems):
        print(
            "preflight: fix the settings above (top of run_grpo_qwen3_4b_mega_verl.sh, or the environment)",
            file=sys.stderr,
        )
        return None
    problems = save_deadline_problems(settings, os.environ) + (
        reward_head_problems(settings) if settings.uses_reward_model else []
    )
    return None if refused(problems) else settings


def checked_config(settings: Settings, extra: list[str]) -> tuple[str, str, list[str], object] | None:
    """Step 1: the trainer command composed and validated by verl's own code, then what verl asserts only at run time
    and the thinking settings against the chat template: (module, config name, overrides, config), or None once the
    refusal is printed."""
    try:
        module, path, name, overrides = split_command(trainer_argv(settings, extra=extra))
    except SettingError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return None
    try:
        cfg = compose(name, overrides, path)
        validate(cfg)
    except Exception as exc:  # Hydra's and verl's own errors, reported as they are
        print(
            f"preflight: verl 0.6.1 rejects the trainer config ({module}, {name}):\n  {type(exc).__name__}: {exc}\n"
            "  fix the override, or the setting that feeds the key (launch/plan/trainer_command.py builds each)",
            file=sys.stderr,
        )
        return None
    if refused(batch_problems(cfg) + parallel_problems(cfg) + rollout_problems(cfg), run_time=True):
        return None
    try:
        problems = thinking_problems(cfg, settings.prompt_opens_think_setting)
    except TemplateError as exc:
        problems = [str(exc)]
    return None if refused(problems) else (module, name, overrides, cfg)


def report_config(settings: Settings, extra: list[str], cfg, command: str) -> None:
    """Print how validation decodes, how the reward reads thinking, and that `command` passes verl's checks; hand the
    resolved thinking setting on to the head node."""
    print(f"preflight: validation: {validation_sampling(cfg)}")
    opens, source = prompt_opens_think(settings, extra)
    if settings.prompt_opens_think_setting == "auto" and os.environ.get("JOB_LOG_DIR"):
        # For the run script to hand on (run_grpo_qwen3_4b_mega_verl.sh, preflight): the head node then builds the
        # trainer command without reading the template again (transformers' import alone takes seconds).
        Path(os.environ["JOB_LOG_DIR"], "prompt_opens_think").write_text(str(opens).lower() + "\n")
    told = cfg.custom_reward_function.reward_kwargs.prompt_opens_think
    print(
        f"preflight: thinking: {source}; the reward function gets prompt_opens_think={told} (a response without "
        f"</think> {'is cut off mid-reasoning: the penalty' if told else 'is all answer'})"
    )
    print(
        f"preflight: {command} composes and passes verl's checks "
        f"(adv_estimator={cfg.algorithm.adv_estimator}, reward_manager={cfg.reward_model.reward_manager}, "
        f"rollout={cfg.actor_rollout_ref.rollout.name}/{cfg.actor_rollout_ref.rollout.mode})"
    )


def memory_fits(settings: Settings, extra: list[str], cfg, choice=None) -> bool:
    """Print the GPU memory of the rollout's start (beside the reward server) and, with Megatron, of the update; False
    once a refusal is printed."""
    try:
        peak = reward_peak(settings)
    except (Exception, SystemExit) as exc:  # the reward server's settings (argparse exits) or its model's config
        print(
            f"preflight: cannot size the reward server (CONFIG_REWARD_MODEL_PATH, REWARD_*): {exc!r}", file=sys.stderr
        )
        return False
    if not estimate_printed("the rollout's GPU memory", lambda: [gpu_memory_line(settings, peak, cfg)]):
        return False
    if choice is not None:
        print(f"preflight: {choice.line(settings)}")
        if slower := choice.slower_line():
            print(f"preflight: WARNING: Megatron plan: {slower}", file=sys.stderr)
    fused, why = fused_kernels(settings, extra)  # under fsdp2 too: off, and why
    print(f"preflight: verl's fused log-prob kernels {'on' if fused else 'off'} ({why})")
    if settings.strategy != "megatron":
        return True
    return estimate_printed("the Megatron update's memory", lambda: megatron_update_lines(settings, peak, fused))


def estimate_printed(what: str, lines) -> bool:
    """Print a memory estimate's lines; False once its refusal (GpuMemoryError) is printed. A config the dense
    formulas cannot read (an MoE, no intermediate_size) is a warning."""
    try:
        for line in lines():
            print(f"preflight: {line}")
    except GpuMemoryError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return False
    except Exception as exc:
        print(
            f"preflight: WARNING: {what} is not estimated from the models' config.json ({type(exc).__name__}: {exc}); "
            "docs/training.md, GPU memory per role, says how",
            file=sys.stderr,
        )
    return True


def report_imports(imports: subprocess.Popen | None, modules: list[str], cfg, own_files_pass: bool) -> bool:
    """What the trainer's imports (started alongside the user's files' checks) found, said after those checks; False
    where they fail here. On the login node without the image (the README's check: PREFLIGHT_ONLY=1 with CONTAINER=none
    outside a Slurm job, where the engine and verl's recipes, which live in the image, need not import) they are listed
    as not checked: the job's own preflight checks them on its node, in the image, before anything starts."""
    findings = [] if imports is None else import_problems(modules, cfg.actor_rollout_ref.rollout.name, started=imports)
    env = os.environ
    login = env.get("PREFLIGHT_ONLY") == "1" and env.get("CONTAINER") == "none" and not env.get("SLURM_JOB_ID")
    unchecked, findings = (findings, []) if login else ([], findings)
    for finding in unchecked:
        print(
            f"preflight: not checked here (CONTAINER=none outside a job; the job's own preflight checks it on its "
            f"node before anything starts): the trainer's imports: {finding}"
        )
    if unchecked and own_files_pass:
        print("preflight: every check that can run here passed (what it could not check here is listed above)")
    for finding in findings:
        print(f"preflight: the trainer cannot start here: {finding}", file=sys.stderr)
    if imports is not None and not findings and not unchecked:
        print(f"preflight: the trainer's modules import here: {', '.join(modules)}")
    return not findings


def check_own_files(settings: Settings, cfg, reward_server) -> bool:
    """The data and the reward (steps 2 and 3), with the policy's tokenizer loaded once; `reward_server`:
    begin_reward_server's, or None where PREFLIGHT_REWARD=0."""
    from verl.utils import hf_tokenizer

    tokenizer, train_rows = hf_tokenizer(cfg.actor_rollout_ref.model.path), None
    data = os.environ.get("PREFLIGHT_DATA", "1") == "1"  # 0 reads no rows
    if data:
        if not check_rows(cfg, tokenizer):
            print(
                "preflight: the train/test parquet files have errors (above): fix them or rebuild with "
                "python -m data_prep.build",
                file=sys.stderr,
            )
            return False
        try:
            lines, train_rows = check_data(cfg, tokenizer)
            for line in lines:
                print(f"preflight: data {line}")
        except Exception as exc:  # verl's own dataset code, reported as it is
            print(f"preflight: verl's RLHFDataset cannot read the data: {type(exc).__name__}: {exc}", file=sys.stderr)
            return False
    return (  # each step says why it fails, and the first that fails stops the rest
        report_steps(cfg, train_rows)
        and (not data or check_reward_data(cfg))
        and (reward_server is None or server_round_trip(cfg, tokenizer, reward_server))
        and (os.environ.get("PREFLIGHT_REWARD", "1") != "1" or check_rule_round_trip(cfg, tokenizer))
    )


if __name__ == "__main__":
    code = main()
    # Python's own exit handlers, then the exit itself: the interpreter's teardown of what the checks imported (torch,
    # verl, megatron-core, transformers) takes seconds of native code after the last line, and frees nothing the OS
    # does not.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
