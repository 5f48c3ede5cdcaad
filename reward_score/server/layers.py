"""How the decoder layers run: torch.compile of each decoder layer (REWARD_COMPILE), where Inductor fuses the
elementwise work between the matmuls. Warm-up (warmup.py) checks the compiled layers against the same layers uncompiled
before it serves."""

import contextlib
import logging

log = logging.getLogger("reward_server")


class LayerKernels:
    """The switch of one model's decoder layers (`base.layers`): whether each layer is compiled (`compiled`)."""

    def __init__(self, torch, base):
        self.torch = torch
        self.base = base
        self.layers = list(getattr(base, "layers", None) or [])
        self.compiled = False

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
