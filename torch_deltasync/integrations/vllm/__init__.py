"""vLLM integration: the ``deltasync`` weight-transfer backend, the drivers that update an engine
through it, and LoRA hot-swap.

* **Backend** (worker and trainer side of vLLM's weight-transfer API, module :mod:`._backend`):
  ``LLM(..., weight_transfer_config={"backend": "deltasync"})``. vLLM's plugin entry point
  :mod:`torch_deltasync_vllm` registers it by the path of :mod:`._backend`, which imports vLLM;
  its names (``DeltaSyncInitInfo``, ``DeltaSyncWeightTransferEngine``, ...) are loaded from here
  on first use only.
* **Drivers** (:mod:`._client`): :func:`attach_llm` / :func:`update_llm` (offline ``LLM``),
  :func:`attach_async_llm` / :func:`update_async_llm` (``AsyncLLM``), :func:`attach_server` /
  :func:`update_server` (``vllm serve``), with readiness files (:func:`wait_staged`,
  :func:`read_readiness`, :mod:`._readiness`) so that an engine pauses only for the commit.
  Engines with several replicas (torchrl's ``AsyncVLLM``) go through the same drivers as a
  :class:`ReplicatedEngine` (:mod:`._replicas`). :func:`check_init_info` checks a backend
  ``init_info`` in the caller as the workers will (:mod:`._init_info`, no vLLM import), for
  integrations that build one ahead of attaching (torchrl's ``DeltaVLLMWeightSender``).
* **LoRA hot-swap** (:mod:`._lora`): :class:`VLLMAdapterLoader` loads each adapter version as a
  new LoRA adapter.

Importing this package does not import vLLM. ``docs/vllm.md`` and ``docs/lora.md`` are the guides.
"""

from ._client import (
    EngineUpdate, PauseMode, attach_async_llm, attach_llm, attach_server, update_async_llm, update_llm, update_server,
)
from ._init_info import check_init_info
from ._lora import LoadedAdapter, VLLMAdapterLoader, async_llm_lora_ops, llm_lora_ops, server_lora_ops
from ._readiness import DEFAULT_STAGE_TIMEOUT_S, read_readiness, wait_staged
from ._replicas import ReplicatedEngine, as_llm

#: Backend names, imported from :mod:`._backend` (and so from vLLM) on first use.
_BACKEND_NAMES = ("BACKEND", "DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine",
                  "DeltaSyncTrainerInitInfo", "DeltaSyncTrainerWeightTransferEngine", "register")

__all__ = [
    # drivers
    "EngineUpdate",
    "PauseMode",
    "attach_llm",
    "update_llm",
    "attach_async_llm",
    "update_async_llm",
    "attach_server",
    "update_server",
    "wait_staged",
    "read_readiness",
    "DEFAULT_STAGE_TIMEOUT_S",
    "check_init_info",
    # several replicas
    "ReplicatedEngine",
    "as_llm",
    # LoRA hot-swap
    "LoadedAdapter",
    "VLLMAdapterLoader",
    "llm_lora_ops",
    "async_llm_lora_ops",
    "server_lora_ops",
    # the backend (imports vLLM)
    *_BACKEND_NAMES,
]

for _obj in (EngineUpdate, attach_async_llm, attach_llm, attach_server, update_async_llm, update_llm, update_server,
             LoadedAdapter, VLLMAdapterLoader, async_llm_lora_ops, llm_lora_ops, server_lora_ops, read_readiness,
             wait_staged, check_init_info, ReplicatedEngine, as_llm):
    _obj.__module__ = __name__
del _obj


def __getattr__(name: str):
    if name in _BACKEND_NAMES:
        from . import _backend

        obj = getattr(_backend, name)
        if callable(obj):  # classes and functions (``register``); ``BACKEND`` is a string
            obj.__module__ = __name__  # the public path; pickles resolve it through this function
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
