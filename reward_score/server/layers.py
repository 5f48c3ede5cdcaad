"""How the decoder layers run. Two switches over the same weights, each of which warm-up (warmup.py) checks against
transformers' own forward before it serves:

- fused projections (REWARD_FUSE): q/k/v as one matmul and gate/up as one, built from the checkpoint's weights (the
  layout serving engines use);
- torch.compile of each decoder layer (REWARD_COMPILE): Inductor fuses the elementwise work between the matmuls.

Each module's own forward is transformers' while a switch is off; on, the module gets a forward of ours (an
instance attribute), so off is always one `pop` away and the check can run both ways on one model."""

import contextlib
import logging
import sys
import types

log = logging.getLogger("reward_server")

# Layers whose forward we know (transformers 4.55 to 5.x): q/k/v and gate/up can each run as one matmul.
_FUSABLE_ATTENTION = ("Qwen3Attention", "Qwen2Attention", "LlamaAttention")
_FUSABLE_MLP = ("Qwen3MLP", "Qwen2MLP", "LlamaMLP")


def _fused_linear(torch, parts):
    """One Linear whose output is the parts' outputs side by side; each part's weight (and bias) becomes a view into
    it, so the model holds no second copy and the unfused forward still reads the same numbers."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    bias = torch.cat([p.bias.detach() for p in parts]) if has_bias else None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for part in parts:
        n = part.weight.shape[0]
        part.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
        if has_bias:
            part.bias = torch.nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return fused, [p.weight.shape[0] for p in parts]


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The attention of Qwen3/Qwen2/Llama as transformers writes it, with q, k and v from one matmul (`qkv_proj`, where
    `use_qkv`). A KV cache (never used by the server) takes the original forward."""
    if kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    for name in ("past_key_values", "past_key_value", "cache_position"):
        kwargs.pop(name, None)
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if self.use_qkv:
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head of q and k
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    implementation = self.config._attn_implementation
    attention = (
        module.eager_attention_forward if implementation == "eager" else module.ALL_ATTENTION_FUNCTIONS[implementation]
    )
    if getattr(self, "sliding_window", None) is not None:
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _mlp_forward(self, x):
    """SwiGLU with gate and up from one matmul (`gate_up_proj`, where `use_gate_up`)."""
    if self.use_gate_up:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(self.act_fn(gate) * up)


class LayerKernels:
    """The switches of one model's decoder layers (`base.layers`): which modules run fused projections (`fused`),
    whether each layer is compiled (`compiled`)."""

    def __init__(self, torch, base):
        self.torch = torch
        self.base = base
        self.layers = list(getattr(base, "layers", None) or [])
        self.fused: list = []  # the attention and MLP modules that hold fused projections
        self.fused_on = False  # and run them
        self.compiled = False

    # -- fused projections --

    def fuse_projections(self) -> int:
        """q/k/v as one projection and gate/up as one in every layer we know the forward of: one larger matmul
        instead of three and two. Built from the loaded weights, whose tensors become views into the fused ones (no
        extra memory). Returns the modules fused."""
        torch = self.torch
        for layer in self.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if self._knows_attention(attention) and not hasattr(attention, "qkv_proj"):
                parts = [attention.q_proj, attention.k_proj, attention.v_proj]
                attention.qkv_proj, attention.qkv_sizes = _fused_linear(torch, parts)
                self.fused.append(attention)
            if type(mlp).__name__ in _FUSABLE_MLP and not hasattr(mlp, "gate_up_proj"):
                mlp.gate_up_proj, _ = _fused_linear(torch, [mlp.gate_proj, mlp.up_proj])
                self.fused.append(mlp)
        self.fused_on = bool(self.fused)
        self._install()
        return len(self.fused)

    def set_fused(self, on: bool) -> None:
        """Run the fused projections (on) or the separate ones over the same weights (off)."""
        self.fused_on = on
        self._install()

    def unfuse_projections(self) -> None:
        """Drop the fused projections (the separate ones hold the same weights as views of them)."""
        for module in self.fused:
            for name in ("qkv_proj", "gate_up_proj"):
                if name in module._modules:
                    delattr(module, name)
        self.fused = []
        self._install()

    # -- which forward each attention and MLP module runs --

    @staticmethod
    def _knows_attention(attention) -> bool:
        if type(attention).__name__ not in _FUSABLE_ATTENTION:
            return False
        module = sys.modules[type(attention).__module__]
        return all(hasattr(module, n) for n in ("apply_rotary_pos_emb", "eager_attention_forward",
                                                "ALL_ATTENTION_FUNCTIONS"))  # fmt: skip

    def _install(self) -> None:
        """Our forward where a module runs a fused projection, transformers' own elsewhere."""
        for layer in self.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if self._knows_attention(attention):
                qkv = self.fused_on and "qkv_proj" in attention._modules
                self._set_forward(attention, _attention_forward, qkv, use_qkv=qkv)
            if type(mlp).__name__ in _FUSABLE_MLP:
                gate_up = self.fused_on and "gate_up_proj" in mlp._modules
                self._set_forward(mlp, _mlp_forward, gate_up, use_gate_up=gate_up)

    @staticmethod
    def _set_forward(module, forward, ours: bool, **attributes) -> None:
        if ours:
            module.__dict__.update(attributes, forward=types.MethodType(forward, module))
        else:
            for name in ("forward", *attributes):
                module.__dict__.pop(name, None)

    # -- torch.compile of each layer --

    def compile(self) -> bool:
        """torch.compile each decoder layer (dynamic shapes): fused kernels, far fewer launches. False if unavailable."""
        torch = self.torch
        if not self.layers or not hasattr(torch, "compile") or not hasattr(self.layers[0], "compile"):
            log.warning(
                "REWARD_COMPILE: this model or torch %s cannot compile per layer; serving eager", torch.__version__
            )
            return False
        for layer in self.layers:
            layer.compile(dynamic=True)
        self.compiled = True
        return True

    def uncompile(self) -> None:
        for layer in self.layers:
            layer._compiled_call_impl = None
        self.compiled = False

    @contextlib.contextmanager
    def eager(self):
        """The decoder layers' own (uncompiled) forward while a path is checked, so that a compile failure is not
        mistaken for the path's."""
        compiled = [getattr(layer, "_compiled_call_impl", None) for layer in self.layers]
        for layer in self.layers:
            layer._compiled_call_impl = None
        try:
            yield
        finally:
            for layer, call in zip(self.layers, compiled, strict=True):
                layer._compiled_call_impl = call
