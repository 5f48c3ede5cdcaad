"""verl 0.6.1's Megatron workers on a machine without a GPU and without Transformer Engine: every adaptation, here.

`make demo` and the Megatron job tests run STRATEGY=megatron through verl's own `ppo_megatron_trainer` (megatron-core
0.13.0) and verl's Megatron merger. Nothing of verl or megatron-core is copied or edited; what a CPU and the lack of
Transformer Engine (TE) stop is adapted below, as in cpu/verl_shims.py (whose shims `install` runs first): Hydra
overrides (OVERRIDES) and shims (SHIMS), some process-wide, so installed only for Megatron runs without CUDA. The
layer spec keeps TE's parameter names and checkpoint keys, so the loader, the weight sync, the dist checkpoint and the
merger see what a TE run writes. Each adaptation, and what a CPU run does not prove: docs/verl-on-cpu.md.

    python -m cpu.megatron_shims          # the overrides, one a line, each with its reason
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import sys
import types

from cpu import verl_shims

HOOK = "cpu.megatron_shims.install"

OVERRIDES = [
    (
        "++actor_rollout_ref.actor.megatron.override_transformer_config.use_cpu_initialization=True",
        "megatron-core creates weights on the GPU unless told (tensor_parallel/layers.py:254); the reference inherits "
        "the actor's override_transformer_config",
    ),
    ("++critic.megatron.override_transformer_config.use_cpu_initialization=True", "the same for PPO's critic"),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "one HF engine per worker: the HF rollout has no tensor parallelism",
    ),
    (
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
        "the shims below and cpu/verl_shims.py's, in every Ray worker process of the job",
    ),
]


def overrides() -> list[str]:
    """The Hydra overrides of a Megatron run on a CPU: cpu/verl_shims.py's HF rollout and lean settings (its other
    engine overrides are the FSDP workers' attention: Megatron packs sequences whatever they say), then these."""
    return [verl_shims.ENGINE_OVERRIDES[0][0], *(o for o, _ in verl_shims.LEAN_OVERRIDES), *(o for o, _ in OVERRIDES)]


# A Megatron run on GPUs without SGLang and Transformer Engine (benchmarks/gpu_job.py): HF generation stands in
# for SGLang, the one component replaced; the layers are the TE-free spec below; everything else is the job's own.
GPU_HOOK = "cpu.megatron_shims.install_gpu"
GPU_OVERRIDES = [
    (
        verl_shims.ENGINE_OVERRIDES[0][0],
        "SGLang's stand-in: verl's HF rollout (HF generate), which SGLang's GPUs need none of",
    ),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "one HF engine per worker: it has no tensor parallelism",
    ),
    (
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={GPU_HOOK}",
        "the HF rollout's registration and the TE-free layers in every Ray worker process of the job",
    ),
]


# --- the layer spec: megatron-core's own TE spec, built from TE-free modules with TE's names ----------------------


@functools.cache
def varlen_attention():
    """torch's variable-length flash attention (torch.nn.attention.varlen, torch 2.10 and later) as
    `attend(q, k, v, cu_seqlens, max_seqlen, scale)` over a [tokens, heads, dim] pack, causal within each sequence and
    grouped key/value heads unrepeated; None where this torch has none. Its keyword for causal masking changed
    between releases (is_causal, then window_size), so it is read from the signature; the first use on a GPU checks
    it against one SDPA per sequence and says in one line which attention the layers use."""
    import inspect

    import torch
    import torch.nn.functional as F

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        print("TE-free layer spec: attention is one SDPA per packed sequence (this torch has no varlen_attn)")
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def attend(q, k, v, cu_seqlens, max_seqlen, scale):
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **causal, **gqa)

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(48, h, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 16, 48], device="cuda", dtype=torch.int32)
    per_sequence = []
    for a, b in ((0, 16), (16, 48)):
        one = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        per_sequence.append(F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    try:
        error = (attend(q, k, v, cu, 32, 64**-0.5) - torch.cat(per_sequence)).abs().max().item()
    except RuntimeError as exc:
        error, why = float("inf"), f"{type(exc).__name__}: {exc}"
    else:
        why = f"it differs from SDPA per sequence by {error:.3g}"
    if error > 0.02:
        print(f"TE-free layer spec: one SDPA per packed sequence (torch's varlen_attn failed its check: {why})")
        return None
    print(f"TE-free layer spec: attention is torch's varlen_attn, one call a pack (checked against SDPA: {error:.1g})")
    return attend


def _te_shaped_modules():
    """The three modules a TE layer spec asks for, written with megatron-core's local parts and PyTorch."""
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class NormColumnParallelLinear(ColumnParallelLinear):
        """TE's TELayerNormColumnParallelLinear without TE: RMSNorm, then the column-parallel linear layer, its weight
        named `layer_norm_weight` as verl's loader, weight converter and merger read it; replicated as TE's is."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.eps = config.layernorm_epsilon

        def forward(self, input_, *args, **kwargs):
            # In the input's dtype: torch computes in float32 inside (a float32 copy would keep twice the memory)
            normed = F.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight.to(input_.dtype), self.eps)
            return super().forward(normed, *args, **kwargs)

    class PackedSDPAttention(MegatronModule):
        """TE's DotProductAttention for verl's packed (THD) input, which megatron-core's local one refuses
        (dot_product_attention.py:120): causal attention within each packed sequence; `_extra_state` keeps TE's keys.
        On a GPU, one call of torch's varlen flash attention over the whole pack (varlen_attention); on a CPU, and
        where torch has none, one SDPA per sequence."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
            super().__init__(config=config)
            self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise NotImplementedError("PackedSDPAttention takes verl's packed (thd) sequences only")
            params = packed_seq_params
            varlen = varlen_attention() if query.is_cuda else None
            if varlen is not None:
                out = varlen(query, key, value, params.cu_seqlens_q, params.max_seqlen_q, self.scale)
                return out.reshape(query.shape[0], -1)
            bounds = params.cu_seqlens_q.tolist()
            pieces = []
            for start, end in itertools.pairwise(bounds):
                # 4-D: SDPA's flash kernel takes no 3-D input; grouped key/value heads unrepeated (enable_gqa)
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
    """verl asks for TE's layer spec (model_initializer.py:105), which stops at `NameError: TENorm` without TE, and
    the local spec's norm names are refused by verl's loader: megatron-core's own TE spec, with TE-free modules."""
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
    """megatron-core's model-parallel RNG tracker keeps CUDA generator states (tensor_parallel/random.py:196): the
    CPU generator's instead."""
    import torch
    from megatron.core.tensor_parallel import random

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _cuda_means_cpu() -> None:
    """megatron-core hard-codes CUDA (current_device buffers, device="cuda" tensors, synchronize, `.cuda()`, streams;
    docs/verl-on-cpu.md lists where): the device "cuda" reads as the CPU, process-wide."""
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
    """`Invalid device string: 'cpu:cpu'` (verl/utils/megatron_utils.py:128): the device index reads 0 there."""
    from verl.utils import megatron_utils

    megatron_utils.get_device_id = lambda: 0


def _cuda_tensor_types() -> None:
    """megatron-core's distributed optimizer refuses any but CUDA type names (distrib_optimizer.py:361-405): for its
    callers alone, a CPU tensor's type() reads as the CUDA type of its dtype."""
    import torch

    type_ = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        if args or kwargs or not sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core"):
            return name
        return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name

    torch.Tensor.type = tensor_type


def _host_copy_for_the_param_offload() -> None:
    """verl offloads a DDP-wrapped module's parameters as `.cpu().pin_memory()`, then frees the storage
    (megatron_utils.py:341-343): pinning needs an accelerator, and on a CPU `.cpu()` is the buffer itself, which the
    free would take with it. For that module's callers alone, pin_memory returns an ordinary host copy."""
    import torch

    pin_memory = torch.Tensor.pin_memory

    def host_copy(self, *args, **kwargs):
        if self.is_cuda or sys._getframe(1).f_globals.get("__name__") != "verl.utils.megatron_utils":
            return pin_memory(self, *args, **kwargs)
        return self.clone()

    torch.Tensor.pin_memory = host_copy


# --- the optimizer and the checkpoint -----------------------------------------------------------------------------


def _adam_with_the_step_in_the_group() -> None:
    """Without TE or apex megatron-core's AdamW paths fail verl's resume (distrib_optimizer.py:614, :896): torch's
    AdamW keeping its state as FusedAdam does (the step in the parameter group): a GPU run's checkpoint keys."""
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
    """verl's checkpoint manager imports transformer_engine unguarded on resume (megatron_checkpoint_manager.py:300):
    a stand-in module with that one name, during load_checkpoint only."""
    from verl.utils.checkpoint import megatron_checkpoint_manager as manager

    load = manager.MegatronCheckpointManager.load_checkpoint

    def load_checkpoint(self, *args, **kwargs):
        names = [
            "transformer_engine",
            "transformer_engine.pytorch",
            "transformer_engine.pytorch.optimizers",
            "transformer_engine.pytorch.optimizers.fused_adam",
        ]
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
    """The critic's value head (model_initializer.py:90) is in a package whose __init__ imports flash_attn: its one
    module, loaded alone under its own name."""
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
    """verl's fused forward calls a CUDA and Triton kernel by name (model_forward_fused.py:32): in that module the name
    is verl's own pure-torch FusedLinearForPPO, with the kernel's signature, shapes and float32 outputs; TP=1 only."""
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
    """verl's Megatron workers on a GPU without TE: WITHOUT_TE alone, once a process; refused where TE imports."""
    global _installed
    if _installed:
        return
    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError(f"{__name__}.install_without_te: Transformer Engine is installed here; verl uses it as is")
    for shim in WITHOUT_TE:
        shim()
    _installed = True


def install_gpu() -> None:
    """Ray's worker_process_setup_hook for a Megatron run on GPUs without SGLang or TE (GPU_OVERRIDES): verl's HF
    rollout registered in SGLang's place, the TE-free layers, then the run's own further hook."""
    verl_shims.register_rollout()
    install_without_te()
    verl_shims.run_then_hook()


def install() -> None:
    """Ray's worker_process_setup_hook for a Megatron run: cpu/verl_shims.py's shims, then these, once a process."""
    global _installed
    if _installed:
        return
    verl_shims.install()
    for shim in SHIMS:
        shim()
    _installed = True


def run_merger(argv: list[str]) -> None:
    """`python -m verl.model_merger ARGS` with the shims: the merger builds the same model as the workers
    (cpu/megatron_merger, the CPU's MERGER_LAUNCHER)."""
    import runpy

    import torch

    install_without_te() if torch.cuda.is_available() else install()  # on a GPU: verl's own merger, NCCL and all
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
