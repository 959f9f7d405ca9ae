"""Where deltas land: an ``nn.Module`` / state dict in HF naming, vLLM TP parameters in place, or a
live vLLM worker (a host copy in HF layout, re-packing the modules a commit changed)."""

from ._base import Target
from ._module import ModuleTarget
from ._vllm import VLLMTarget  # vLLM itself is imported lazily, on first use
from ._vllm_engine import VLLMEngineTarget

__all__ = ["Target", "ModuleTarget", "VLLMTarget", "VLLMEngineTarget"]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
