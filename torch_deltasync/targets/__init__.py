"""Where deltas land: an ``nn.Module`` / state dict in HF naming, or vLLM TP parameters."""

from .base import Target
from .module import ModuleTarget
from .vllm import VLLMTarget  # vLLM itself is imported lazily, on first use

__all__ = ["Target", "ModuleTarget", "VLLMTarget"]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
