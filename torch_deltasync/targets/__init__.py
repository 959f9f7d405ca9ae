"""Where deltas land: an ``nn.Module`` / state dict in HF naming, or vLLM TP parameters."""

from .base import Target
from .module import ModuleTarget

__all__ = ["Target", "ModuleTarget"]
