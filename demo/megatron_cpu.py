"""verl 0.6.1's Megatron workers on a machine without a GPU and without Transformer Engine: every adaptation, here.

`make demo` and the Megatron job tests run the settings block's default strategy, STRATEGY=megatron, through verl's
own `ppo_megatron_trainer`: its Megatron actor, reference and PPO critic (megatron-core 0.13.0, the image's version)
build the model, load the HF weights, run the packed forward and backward (PP=2 over two Ray workers where asked),
step megatron-core's distributed optimizer with offload, sync the weights into the rollout, save verl's dist
checkpoint, resume it, and verl's Megatron merger turns it into a HuggingFace model. Nothing of verl or
megatron-core is copied or edited; what a CPU and the lack of Transformer Engine (TE) stop is adapted below, each
with the file and line it works around (verl v0.6.1, megatron-core 0.13.0). demo/verl_cpu.py's adaptations (gloo,
the HF rollout, torch.cpu's device calls) apply as well: `install` runs them first.

Two kinds, as in demo/verl_cpu.py:
- Hydra overrides (OVERRIDES): settings verl has, chosen for a CPU.
- Shims (SHIMS, applied by `install` in every Ray worker process of a Megatron run, and by `merger_main` in the
  merger's process). Some are process-wide ("cuda" read as the CPU): they are installed only for Megatron runs on a
  machine without CUDA, never in the image.

The layer spec keeps TE's parameter names and checkpoint keys (`self_attention.linear_qkv.layer_norm_weight`,
`mlp.linear_fc1.layer_norm_weight`, `core_attention._extra_state`), so verl's HF->mcore loader, the weight sync into
the rollout, the dist checkpoint and the merger see what a TE run writes. What a CPU run does not prove (TE's kernels
and fp8 state, FusedAdam's own state, TP>1 with sequence parallelism, NCCL, SGLang's weight update, 4B shapes):
docs/verl-on-cpu.md.

    python -m demo.megatron_cpu          # the overrides, one a line, each with its reason
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys
import types

from demo import verl_cpu

HOOK = "demo.megatron_cpu.install"

OVERRIDES = [
    ("++actor_rollout_ref.actor.megatron.override_transformer_config.use_cpu_initialization=True",
     "megatron-core creates weights on the GPU unless told (tensor_parallel/layers.py:254); the reference inherits "
     "the actor's override_transformer_config"),
    ("++critic.megatron.override_transformer_config.use_cpu_initialization=True", "the same for PPO's critic"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=1",
     "one HF engine per worker: the HF rollout has no tensor parallelism"),
    (f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
     "the shims below and demo/verl_cpu.py's, in every Ray worker process of the job"),
]  # fmt: skip


def overrides() -> list[str]:
    """The Hydra overrides of a Megatron run on a CPU: demo/verl_cpu.py's HF rollout and lean settings (its other
    engine overrides are the FSDP workers' attention: Megatron packs sequences whatever they say), then these."""
    return [verl_cpu.ENGINE_OVERRIDES[0][0], *(o for o, _ in verl_cpu.LEAN_OVERRIDES), *(o for o, _ in OVERRIDES)]


# --- the layer spec: megatron-core's own TE spec, built from TE-free modules with TE's names ----------------------


def _te_shaped_modules():
    """The three modules a TE layer spec asks for, written with megatron-core's local parts and PyTorch."""
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class NormColumnParallelLinear(ColumnParallelLinear):
        """TE's TELayerNormColumnParallelLinear without TE: RMSNorm fused into the following column-parallel linear
        layer, owning its weight as `layer_norm_weight` (the name verl's loader, loader.py:406,441, weight converter,
        weight_converter.py, and merger, megatron_model_merger.py:183-200, read). Replicated across tensor-parallel
        ranks like TE's: the checkpoint shards only `weight` and `bias` (tensor_parallel/layers.py, sharded_state_dict)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.eps = config.layernorm_epsilon

        def forward(self, input_, *args, **kwargs):
            # In the input's dtype: torch computes in float32 inside and, on CUDA, runs one fused kernel that keeps
            # the input and the inverse RMS for the backward, as TE's does (a float32 copy would keep twice that)
            normed = F.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight.to(input_.dtype), self.eps)
            return super().forward(normed, *args, **kwargs)

    class PackedSDPAttention(MegatronModule):
        """TE's DotProductAttention for the packed input verl always sends (THD with cu_seqlens,
        verl/models/mcore/model_forward.py:56-63, util.py:90-97), which megatron-core's local DotProductAttention
        refuses (transformer/dot_product_attention.py:120): causal attention within each packed sequence, through
        PyTorch's SDPA, with grouped key/value heads. Its `_extra_state` (None) stands where TE keeps fp8 metadata,
        so the checkpoint has TE's keys."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
            super().__init__(config=config)
            self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise NotImplementedError("PackedSDPAttention takes verl's packed (thd) sequences only")
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            pieces = []
            for start, end in itertools.pairwise(bounds):
                # [1, heads, tokens, dim]: SDPA's flash kernel takes 4-D input only (3-D falls back to the math
                # kernel, which keeps every [tokens x tokens] score); grouped key/value heads as they are
                # (enable_gqa): the kernel keeps them unrepeated, as TE's does
                q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
                pieces.append(out[0].transpose(0, 1))
            padding = query.shape[0] - bounds[-1]
            if padding:
                pieces.append(query.new_zeros(padding, *query.shape[1:]))
            return torch.cat(pieces).reshape(query.shape[0], -1)

        def get_extra_state(self):
            return None

        def set_extra_state(self, state):
            pass

    return NormColumnParallelLinear, PackedSDPAttention


def _te_shaped_layer_spec() -> None:
    """verl asks every model for `get_gpt_decoder_block_spec(..., use_transformer_engine=True)`
    (verl/models/mcore/model_initializer.py:105, :114, :138, ...), which without TE stops at `NameError: TENorm`
    (megatron-core models/gpt/gpt_layer_specs.py:404). megatron-core's local spec would build, but names the norms
    `input_layernorm` / `pre_mlp_layernorm`, which verl's loader and weight sync refuse. So megatron-core's own TE
    spec runs, with a spec provider of TE-free modules in TESpecProvider's place: the layer's structure and every
    parameter name are TE's."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm_linear, attention = _te_shaped_modules()

    class TEShapedSpecProvider(LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return WrappedTorchNorm  # torch's RMSNorm: `weight`, as TENorm names it

        def core_attention(self):
            return attention

    gpt_layer_specs.TESpecProvider = TEShapedSpecProvider
    gpt_layer_specs.TENorm = WrappedTorchNorm  # the final norm of the block (gpt_layer_specs.py:404)


# --- "cuda" read as the CPU ----------------------------------------------------------------------------------------


def _cpu_rng_tracker() -> None:
    """verl seeds megatron-core's model-parallel RNG tracker (megatron_workers.py:96 ->
    tensor_parallel.model_parallel_cuda_manual_seed), which keeps CUDA generator states (tensor_parallel/random.py:196,
    and the same states around recompute): `Torch not compiled with CUDA`. The tracker keeps the CPU generator's."""
    import torch
    from megatron.core.tensor_parallel import random

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _cuda_means_cpu() -> None:
    """megatron-core hard-codes CUDA where verl's CPU path cannot reach: buffers on `torch.cuda.current_device()`
    (distributed/param_and_grad_buffer.py:650-673, optimizer/distrib_optimizer.py:724), tensors made with
    device="cuda" (pipeline_parallel/schedules.py:497, optimizer/optimizer.py:421-433,852), `torch.cuda.synchronize`
    (dist_checkpointing/strategies/filesystem_async.py:229), `weight.data.cuda()` for the tied embedding across
    pipeline stages (models/common/language_module/language_module.py:173) and its gradient buffer's CUDA streams. In
    a process without CUDA every such call fails, so the device "cuda" is read as the CPU: process-wide, which is why
    this is installed only for Megatron runs on a machine without CUDA."""
    import torch

    def cpu_device(device):
        if device is None:
            return None
        if isinstance(device, int) or str(device).startswith("cuda"):
            return torch.device("cpu")
        return device

    def on_cpu(factory):
        def make(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = cpu_device(kwargs["device"])
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))

    to = torch.Tensor.to

    def tensor_to(self, *args, **kwargs):
        if args and (isinstance(args[0], (str, int, torch.device))):
            args = (cpu_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        return to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to
    torch.Tensor.cuda = lambda self, *a, **k: self

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def synchronize(self):
            pass

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _device_index() -> None:
    """verl's Megatron utilities place modules on f"{get_device_name()}:{get_device_id()}" (verl/utils/megatron_utils.py
    :128), and on a CPU get_device_id() is torch.cpu.current_device(), "cpu": `Invalid device string: 'cpu:cpu'`. In
    that module the device index reads 0, as on a one-GPU node ("cpu:0"; its bare `.to(0)` and `device=0` calls,
    :379-850, land on the CPU through _cuda_means_cpu)."""
    from verl.utils import megatron_utils

    megatron_utils.get_device_id = lambda: 0


def _cuda_tensor_types() -> None:
    """megatron-core's distributed optimizer sorts parameters by their CUDA type names
    (optimizer/distrib_optimizer.py:361-405: 'torch.cuda.BFloat16Tensor' ...) and refuses any other: `Wrapped
    parameters must be one of torch.cuda.FloatTensor...`. For its callers alone, a CPU tensor's type() reads as the
    CUDA type of the same dtype."""
    import torch

    type_ = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        if args or kwargs or not sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core"):
            return name
        return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name

    torch.Tensor.type = tensor_type


def _host_copy_for_the_param_offload() -> None:
    """verl offloads a DDP-wrapped Megatron module's parameters (the critic's with param_offload, the job's default for
    PPO; the actor's where asked) by copying each buffer to pinned host memory and freeing its device storage
    (verl/utils/megatron_utils.py:341-343, `buffer.param_data.data.cpu().pin_memory()` then `storage().resize_(0)`).
    Pinning needs an accelerator: `Cannot access accelerator device when none is available`. And on a CPU `.cpu()`
    returns the buffer itself, so a copy that only skipped the pinning would be freed by the resize, the weights with
    it. For that module's callers alone, pin_memory returns a copy in ordinary host memory: what the pinned copy
    holds on a GPU (the page-locking only speeds the copy back, :376). The reference is not DDP-wrapped and moves with
    `.to()` (:353-354, 380-381), which needs nothing here. Like every shim, it is installed only without CUDA: a GPU
    run pins as verl does."""
    import torch

    pin_memory = torch.Tensor.pin_memory

    def host_copy(self, *args, **kwargs):
        if self.is_cuda or sys._getframe(1).f_globals.get("__name__") != "verl.utils.megatron_utils":
            return pin_memory(self, *args, **kwargs)
        return self.clone()

    torch.Tensor.pin_memory = host_copy


# --- the optimizer and the checkpoint -----------------------------------------------------------------------------


def _adam_with_the_step_in_the_group() -> None:
    """Without TE or apex megatron-core falls back to torch's AdamW (optimizer/__init__.py:25) and to code paths
    that read AdamW's per-parameter `step` (distrib_optimizer.py:612-614, 753-760), which fail verl's resume:
    `KeyError: 'step'` loading a checkpoint after a step (distrib_optimizer.py:896) and `assert len(steps) == 1`
    resuming in a new process (:614). The optimizer here is torch's AdamW keeping its state as TE's and apex's
    FusedAdam do (exp_avg and exp_avg_sq per parameter, the step in the parameter group), and megatron-core takes its
    FusedAdam paths: the checkpoint holds the same keys as a GPU run's."""
    import torch
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    class GroupStepAdamW(torch.optim.AdamW):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state:
                        state["step"] = torch.tensor(float(group.get("step", 0)))
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and "step" in state:
                        group["step"] = int(state.pop("step").item())
            return loss

        def __setstate__(self, state):
            """torch's load_state_dict ends here, and Adam's reads each parameter's `step` (torch/optim/adam.py:127)."""
            added = []
            for group in state["param_groups"]:
                for p in group["params"]:
                    param_state = state["state"].get(p)
                    if param_state and "step" not in param_state:
                        param_state["step"] = torch.tensor(float(group.get("step", 0)))
                        added.append(param_state)
            super().__setstate__(state)
            for param_state in added:
                del param_state["step"]

    optimizer.Adam = GroupStepAdamW
    distrib_optimizer.HAVE_APEX_OR_TE = True


def _transformer_engine_for_the_resume() -> None:
    """verl's Megatron checkpoint manager imports transformer_engine, unguarded, to allow-list FusedAdam for
    torch.load (verl/utils/checkpoint/megatron_checkpoint_manager.py:300-303): without TE every resume stops there. A
    stand-in module with that one name is present for the duration of load_checkpoint only (verl's own dist
    checkpoint helper guards the same import, verl/utils/megatron/dist_checkpointing.py:55-61)."""
    from verl.utils.checkpoint import megatron_checkpoint_manager as manager

    load = manager.MegatronCheckpointManager.load_checkpoint

    def load_checkpoint(self, *args, **kwargs):
        names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers",
                 "transformer_engine.pytorch.optimizers.fused_adam"]  # fmt: skip
        modules = [types.ModuleType(name) for name in names]
        for parent, child in itertools.pairwise(modules):
            setattr(parent, child.__name__.rsplit(".", 1)[1], child)
        modules[-1].FusedAdam = type("FusedAdam", (), {})  # only allow-listed; a CPU checkpoint holds AdamW's
        sys.modules.update(zip(names, modules, strict=True))
        try:
            return load(self, *args, **kwargs)
        finally:
            for name in names:
                sys.modules.pop(name, None)

    manager.MegatronCheckpointManager.load_checkpoint = load_checkpoint


def _value_head_without_flash_attn() -> None:
    """The critic's value head is verl's LinearForLastLayer (model_initializer.py:90), in a package whose __init__
    imports its legacy Llama layers and with them flash_attn (verl/models/llama/megatron/layers/parallel_attention.py
    :27). The module itself needs only torch and megatron-core: it is loaded alone, under its own name."""
    name = "verl.models.llama.megatron.layers.parallel_linear"
    if name in sys.modules:
        return
    path = importlib.util.find_spec("verl.models").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(name, f"{path}/llama/megatron/layers/parallel_linear.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


# --- verl's fused log-prob kernels (FUSED_KERNELS) ----------------------------------------------------------------

FUSED_STAND_IN_LINE = "fused log-probs: verl's FusedLinearForPPO (CPU stand-in)"


def _fused_log_probs_in_torch() -> None:
    """verl's fused forward (use_fused_kernels, verl/models/mcore/model_forward_fused.py:201) calls the Triton kernel
    it imports by name (:32, verl.utils.kernel.linear_cross_entropy), which needs CUDA and Triton
    (linear_cross_entropy.py:66 NVTX, kernels.py:518 asserts is_cuda, :608 Triton). In that module the name is
    verl's own pure-torch FusedLinearForPPO (verl/utils/experimental/torch_functional.py:196: the same log-probs and
    entropy, chunk by chunk, with its own backward), with the kernel's signature and shapes: hidden [tokens, 1,
    hidden] or [b, s, hidden] flattened to its rows, labels to one row, float32 log-probs and entropy per token (the
    kernel's, kernels.py:543-551), computed in float32 as the kernel accumulates. Tensor parallelism is refused: a CPU
    run has TP=1."""
    import torch
    from verl.models.mcore import model_forward_fused
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    said = []

    def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        if reduction != "none" or (
            dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1
        ):
            raise NotImplementedError("the CPU stand-in of verl's fused kernel: reduction='none' and TP=1 only")
        if not said:
            print(FUSED_STAND_IN_LINE, flush=True)
            said.append(True)
        rows = hidden.reshape(-1, hidden.shape[-1]).float()
        return FusedLinearForPPO()(rows, weight.float(), labels.reshape(-1), float(temperature))

    model_forward_fused.linear_cross_entropy = linear_cross_entropy


SHIMS = (
    _te_shaped_layer_spec,
    _cpu_rng_tracker,
    _cuda_means_cpu,
    _device_index,
    _cuda_tensor_types,
    _host_copy_for_the_param_offload,
    _adam_with_the_step_in_the_group,
    _transformer_engine_for_the_resume,
    _value_head_without_flash_attn,
    _fused_log_probs_in_torch,
)
# What a GPU machine without Transformer Engine (benchmarks/ on the H200) needs of these: the layer spec, the
# optimizer's state as FusedAdam keeps it, the resume's import, the value head's module. No device shim.
WITHOUT_TE = (
    _te_shaped_layer_spec,
    _adam_with_the_step_in_the_group,
    _transformer_engine_for_the_resume,
    _value_head_without_flash_attn,
)
_installed = False


def install_without_te() -> None:
    """verl's Megatron workers on a GPU without TE: WITHOUT_TE alone, once a process. Refuses where TE imports (the
    image): there verl's own TE spec runs and nothing here must replace it."""
    global _installed
    if _installed:
        return
    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError(f"{__name__}.install_without_te: Transformer Engine is installed here; verl uses it as is")
    for shim in WITHOUT_TE:
        shim()
    _installed = True


def install() -> None:
    """Ray's worker_process_setup_hook for a Megatron run: demo/verl_cpu.py's shims, then these, once a process."""
    global _installed
    if _installed:
        return
    verl_cpu.install()
    for shim in SHIMS:
        shim()
    _installed = True


def run_merger(argv: list[str]) -> None:
    """`python -m verl.model_merger ARGS` in this process, with the shims: verl's Megatron merger builds the same model
    as the workers (the layer spec, the RNG tracker, "cuda" as the CPU) to read the checkpoint. demo/megatron_merger
    is the MERGER_LAUNCHER that runs it (merge_mcore_to_hf.sh)."""
    import runpy

    install()
    sys.argv = ["verl.model_merger", *argv]
    runpy.run_module("verl.model_merger", run_name="__main__", alter_sys=True)


def main() -> int:
    if sys.argv[1:3] == ["-m", "verl.model_merger"]:
        run_merger(sys.argv[3:])
        return 0
    for override, why in OVERRIDES:
        print(f"{override}\n    {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
