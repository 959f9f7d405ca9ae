"""Where deltas land: an ``nn.Module`` / state dict in HF naming, vLLM TP parameters in place, or a
live vLLM worker (a host copy in HF layout, re-packing the modules a commit changed)."""

from .._moved import alias_moved as _alias_moved
from ._base import Target
from ._module import ModuleTarget
from ._vllm import VLLMTarget  # vLLM itself is imported lazily, on first use
from ._vllm_engine import VLLMEngineTarget

__all__ = ["Target", "ModuleTarget", "VLLMTarget", "VLLMEngineTarget"]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name

_alias_moved(__name__, ("base", "module", "vllm", "vllm_engine"))  # the 0.1 module paths, deprecated
