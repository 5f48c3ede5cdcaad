"""verl 0.6.1's own trainer on a machine without a GPU: every adaptation it needs, in this one module.

The CPU job tests, and `make demo` through cpu/megatron_shims.py, run the real `python -m verl.trainer.main_ppo`.
Two kinds of adaptation (docs/verl-on-cpu.md: each one, and where verl stopped without it):
- Hydra overrides (OVERRIDES): settings verl already has, chosen for a CPU, passed after the job's own as a user's
  are, so the preflight checks, and trainer_command.txt records, the command that runs.
- Shims (SHIMS, applied by `install`): what verl 0.6.1 cannot do on a CPU without a change to its code, each naming
  the verl line it works around. verl's workers are Ray actors in other processes: `install` runs in each as Ray's
  worker_process_setup_hook, which one of the overrides sets.
The HF rollout (HFEngineRollout) also stands in for SGLang on a GPU (benchmarks/gpu_job.py), with ENGINE_OVERRIDES.

    python -m cpu.verl_shims          # the overrides, one a line, each with its reason
"""

from __future__ import annotations

import importlib
import os
import sys

HOOK = "cpu.verl_shims.install"
THEN_HOOK = "CPU_RUN_THEN_HOOK"  # `module.function` that install calls in every Ray worker after the shims, if set
ROLLOUT = "hf"  # the name verl's FSDP worker already gives its HF rollout (fsdp_workers.py:479, 600)
ROLLOUT_CLASS = "cpu.verl_shims.HFEngineRollout"  # what get_rollout_class imports for ROLLOUT, sync or async

# (override, why). They go after the job's own overrides, so they win. ENGINE_OVERRIDES are what any run without
# SGLang, vLLM and flash-attn needs (benchmarks/gpu_job.py passes them on a GPU too); LEAN_OVERRIDES and the hook
# are for a CPU.
ENGINE_OVERRIDES = [
    (f"actor_rollout_ref.rollout.name={ROLLOUT}", "HF generate: HFEngineRollout below, registered by install"),
    (
        "actor_rollout_ref.model.use_remove_padding=False",
        "the unpadded path needs flash-attn (verl/utils/attention_utils.py:27-30 imports it on CUDA only)",
    ),
    ("critic.model.use_remove_padding=False", "the same for PPO's critic"),
    (
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "verl loads models with flash_attention_2 unless told (fsdp_workers.py:318)",
    ),
    ("+critic.model.override_config.attn_implementation=sdpa", "the same for PPO's critic (fsdp_workers.py:1254)"),
]
LEAN_OVERRIDES = [
    (
        "actor_rollout_ref.actor.use_torch_compile=False",
        "lean: compiling the entropy function (dp_actor.py:80-83) takes longer on 2 cores than the steps it speeds up",
    ),
    (
        "data.dataloader_num_workers=0",
        "lean: verl's default 8 loader processes, each a copy of the dataset, on a 2-core machine",
    ),
    (
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "lean: async rollout's agent loop starts this many Ray actors, each with a reward-loop actor of its own "
        "(agent_loop.py:295, 734-746), every one a process that imports verl and torch: 16 of them by default",
    ),
]
OVERRIDES = [
    *ENGINE_OVERRIDES,
    *LEAN_OVERRIDES,
    (
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
        "the shims below, in every Ray worker process of the job (verl's TaskRunner and workers run there)",
    ),
]

# The environment of the job (the run script's, which every node's `ray start` inherits): Ray's, not verl's.
ENVIRONMENT = {
    # lean: Ray starts an idle worker per CPU with the raylet and one more for the first driver
    # (ray/_private/services.py:2019-2021), which verl's actors cannot use (their runtime env, verl's env_vars and
    # this hook, differs): on a 2-core machine they only take CPU and memory.
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}


def overrides() -> list[str]:
    """The Hydra overrides of a CPU run, to pass after everything else."""
    return [override for override, _ in OVERRIDES]


def _gloo_for_nccl() -> None:
    """verl's process groups ask for NCCL (fsdp_workers.py:150, :1155); patching get_nccl_backend alone would give
    `cpu:gloo,cpu:gloo`, which torch refuses."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if backend is not None and "nccl" in backend:
            backend = "gloo"
        return original(backend, *args, **kwargs)

    dist.init_process_group = init_process_group


def _gather_like_nccl() -> None:
    """A 0-d timing tensor gathered into 1-element ones (profiler/performance.py:231-234): gloo refuses the shapes."""
    import torch.distributed as dist

    original = dist.all_gather

    def all_gather(tensor_list, tensor, *args, **kwargs):
        if tensor_list and tensor.shape != tensor_list[0].shape and tensor.numel() == tensor_list[0].numel():
            tensor = tensor.reshape(tensor_list[0].shape)
        return original(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = all_gather


def _cpu_device_calls() -> None:
    """verl's get_torch_device() is torch.cpu here (device.py:55-65), which lacks empty_cache, the memory counters
    (read 0) and the random state calls; added to torch.cpu itself, since verl tells a CPU by `== torch.cpu`."""
    import torch

    calls = {
        "empty_cache": lambda: None,
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
        "manual_seed": torch.manual_seed,
        "memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
    }
    for name, call in calls.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, call)


def _unpinned_offload() -> None:
    """The reference is always offloaded with pinned memory (fsdp_workers.py:518), which needs an accelerator."""
    import verl.utils.fsdp_utils as fsdp_utils  # before fsdp_workers imports the name from it

    pinned = fsdp_utils.CPUOffloadPolicy

    class CPUOffloadPolicy(pinned):
        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    fsdp_utils.CPUOffloadPolicy = CPUOffloadPolicy


def _critic_attention() -> None:
    """verl's FSDP critic is loaded with flash_attention_2 whatever its config says (verl/utils/model.py:623-629), and
    without flash-attn falls back to trl: the same call with the config's attention."""
    import verl.utils.model as model_utils  # fsdp_workers imports the name from it inside the critic's builder

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=model_config._attn_implementation,
            trust_remote_code=trust_remote_code,
        )

    model_utils.load_valuehead_model = load_valuehead_model


def register_rollout() -> None:
    """verl 0.6.1 registers only vLLM and SGLang (rollout/base.py:81-86); async rollout also asks for a replica
    class (replica.py:193-246). The one shim a GPU run needs too (benchmarks/gpu_job.py)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    for mode in ("sync", "async"):
        base._ROLLOUT_REGISTRY[(ROLLOUT, mode)] = ROLLOUT_CLASS
    RolloutReplicaRegistry.register(ROLLOUT, _replica_class)


SHIMS = (_gloo_for_nccl, _gather_like_nccl, _cpu_device_calls, _unpinned_offload, _critic_attention, register_rollout)
_installed = False


def install() -> None:
    """Ray's worker_process_setup_hook: every shim, once per process, before verl's modules are imported there."""
    global _installed
    if _installed:
        return
    import torch

    if torch.cuda.is_available():
        raise RuntimeError(
            f"{HOOK} adapts verl for a machine without CUDA; this one has GPUs: drop the overrides of cpu/verl_shims.py"
        )
    for shim in SHIMS:
        shim()
    _installed = True
    run_then_hook()


def run_then_hook() -> None:
    """The run's own further hook (THEN_HOOK: the job's preemption save, a test's delays in verl's worker methods)."""
    then = os.environ.get(THEN_HOOK, "")
    if then:
        module, _, name = then.rpartition(".")
        getattr(importlib.import_module(module), name)()


def _rollout_class():
    """HFEngineRollout: verl's own HFRollout (HF generate) behind the engine interface verl's FSDP worker calls, which
    its older __init__ predates (hf_rollout.py:40-42): it builds the policy on the worker's device (float32 on a CPU,
    rollout.dtype on a GPU) and takes the actor's weights in update_weights, as the vLLM and SGLang engines do."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.utils.device import get_device_id, get_device_name
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.hf_rollout import HFRollout

    class HFEngineRollout(HFRollout):
        def __init__(self, config, model_config, device_mesh):
            BaseRollout.__init__(self, config, model_config, device_mesh)
            on_cpu = get_device_name() == "cpu"
            self.device = torch.device("cpu") if on_cpu else torch.device(get_device_name(), get_device_id())
            self.dtype = torch.float32 if on_cpu else PrecisionType.to_dtype(self.config.dtype)
            with self.device:
                self.module = AutoModelForCausalLM.from_config(
                    self.model_config.hf_config, dtype=self.dtype, attn_implementation="sdpa"
                )
            self.synced = False

        async def resume(self, tags: list[str]):
            """The weights stay between rollouts; HF's KV cache lives only inside generate: nothing to bring back."""

        async def release(self):
            """Nothing to free: see resume."""

        async def update_weights(self, weights, peft_config=None, **kwargs):
            if peft_config is not None:
                raise NotImplementedError("HFEngineRollout takes full weights only, not LoRA adapters")
            state = {name: tensor.detach().to(self.device, self.dtype) for name, tensor in weights}
            missing, unexpected = self.module.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if self.module.config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise RuntimeError(
                    f"HFEngineRollout: the actor's weights do not fit: missing {missing}, unexpected {unexpected}"
                )
            self.synced = True

        def generate_sequences(self, prompts):
            """Sync rollout: a batch, through verl's own HFRollout."""
            self._check_synced()
            return super().generate_sequences(prompts)

        async def generate(self, prompt_ids, sampling_params, request_id, image_data=None):
            """Async rollout: one prompt's tokens in, its response's out, as SGLang's server answers (:224-253)."""
            from verl.workers.rollout.replica import TokenOutput

            self._check_synced()
            if sampling_params.get("logprobs") or image_data:
                raise NotImplementedError("HFEngineRollout.generate returns tokens only: no log-probs, no images")
            limit = self.config.max_model_len or self.module.config.max_position_embeddings
            generation = self.model_config.generation_config
            tokenizer = self.model_config.tokenizer
            with torch.no_grad():
                out = self.module.generate(
                    torch.tensor([prompt_ids], device=self.device),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=self.device),
                    max_new_tokens=min(self.config.response_length, limit - len(prompt_ids) - 1),
                    eos_token_id=generation.eos_token_id if generation is not None else tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    **_hf_sampling(sampling_params),
                )
            return TokenOutput(token_ids=out[0, len(prompt_ids) :].tolist())

        def _check_synced(self):
            if not self.synced:
                raise RuntimeError("HFEngineRollout: generate before the actor's weights arrived (update_weights)")

    return HFEngineRollout


def _hf_sampling(sampling_params: dict) -> dict:
    """The agent loop's sampling parameters as HF generate's: greedy at temperature 0, no top-k as the engines'."""
    temperature = sampling_params.get("temperature", 1.0)
    sampling = dict(do_sample=temperature > 0, top_p=sampling_params.get("top_p", 1.0), top_k=0)
    return sampling | ({"temperature": temperature} if temperature > 0 else {})


def _replica_class():
    """The agent loop's rollout servers for HFEngineRollout: each is the hybrid worker itself, which holds the engine
    and answers `generate` (fsdp_workers.py:1952-1961); wake_up and sleep are its own weight sync."""
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class HFReplica(RolloutReplica):
        def get_ray_class_with_init_args(self):
            raise NotImplementedError("HFReplica serves from the hybrid workers only (hybrid_engine=True)")

        async def launch_servers(self):
            if self.rollout_mode != RolloutMode.HYBRID or len(self.workers) != 1:
                raise NotImplementedError("HFReplica: hybrid mode, one worker per replica (rollout TP, DP and PP 1)")
            self.servers = list(self.workers)
            self._server_handle = self.workers[0]
            self._server_address = f"hf-rollout-{self.replica_rank}"  # no HTTP server: only the handle answers

    return HFReplica


def __getattr__(name: str):
    # The rollout class only where verl asks for it (get_rollout_class imports ROLLOUT_CLASS): importing this module
    # for its overrides (make demo, the tests, the benchmark's hook) stays free of verl and torch.
    if name == "HFEngineRollout":
        return _rollout_class()
    raise AttributeError(name)


def main() -> int:
    for override, why in OVERRIDES:
        print(f"{override}\n    {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
