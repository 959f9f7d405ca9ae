r"""Re-packing vLLM modules ahead of a commit, on copies, while the engine keeps generating.

A commit into a live vLLM engine whose weights are *derived* copies (vLLM's CPU build packs every
linear weight for oneDNN, quantized GPU kernels re-block theirs) reloads each changed module through
vLLM's layerwise reload (``vllm/model_executor/model_loader/reload/layerwise.py``): restore the
module's parameters in the loader's layout, load them, run ``process_weights_after_loading`` (the
re-pack), copy the results into the kernel tensors. At RL densities every module changes, so done
inside the pause that costs about a full reload (``docs/research/vllm-live-cpu.md``).

Here the same steps run on a *shadow* of each changed module during
:meth:`~torch_deltasync.DeltaReceiver.prepare`, outside the pause:

1. :func:`shadow_tree`: a shallow copy of the model along the paths to the changed modules, each
   copy with its own parameter, buffer and child dicts (the live modules are never modified);
2. :func:`process_ahead`: each shadow gets its own copy of the parameters vLLM recorded in the
   loader's layout (``record_metadata_for_reloading``) on the meta device, with their weight
   loaders bound to the shadow, and vLLM's own online processing (``initialize_online_processing``)
   wrapped around them; the model's ``load_weights`` run on the shadow root with the new HF tensors
   then materializes, loads and processes each shadow as vLLM does for a live module, minus the
   final copy into kernel tensors;
3. :func:`place` (inside the pause): what ``_copy_and_restore_kernel_tensors`` does at the end of
   vLLM's reload: copy the shadow's tensors into the live kernel tensors (same storage, so CUDA
   graphs and aliases such as a tied ``lm_head.weight`` see the new values), and take over the
   attributes processing set on the shadow (on the CPU build: ``cpu_linear``, the closure over the
   new oneDNN handle; only attributes processing set or deleted on the shadow move). The pause
   then costs the copy of the tensors still in the loader's layout (embeddings; the caller may
   write their changes in place instead and mark them :data:`WRITTEN`), not the re-pack.

Which modules qualify: by default (:data:`AHEAD_METHODS`) those whose ``quant_method`` is vLLM's
``UnquantizedLinearMethod`` or ``UnquantizedEmbeddingMethod`` (or none): their processing
(``dispatch_cpu_unquantized_gemm`` on CPU, nothing on GPU) writes only the layer it is given, so
running it on a copy while the engine runs the original is safe. Other methods (FP8, Marlin, ...)
may keep state on the shared ``quant_method`` or across layers; those modules reload inside the
pause unless the target is told otherwise. Modules with buffers or children reload inside the pause
too, and so does everything when the model's ``load_weights`` does more than call the loaders of
the weights it is given (vLLM's classification adapters re-assign modules there: do not re-pack
those ahead). Memory: the shadows hold a second processed copy of the changed modules until the
commit.
"""

from __future__ import annotations

import copy
from types import MethodType
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["AHEAD_METHODS", "WRITTEN", "kernel_key", "Shadow", "ahead_ok", "shadow_tree", "process_ahead", "check_placeable", "place"]

#: ``quant_method`` classes (by name, from vLLM's ``linear.py`` / ``vocab_parallel_embedding.py``)
#: whose ``process_weights_after_loading`` writes only the layer passed to it.
AHEAD_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})

#: Module state that a shadow owns (copied in :func:`shadow_tree`) and :func:`place` never moves.
_OWN = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_ABSENT = object()
#: A ``done`` entry of :func:`place`: the caller wrote this kernel tensor itself (never copied).
WRITTEN = object()


def ahead_ok(module: nn.Module, *, any_method: bool = False) -> bool:
    """Whether ``module`` can be processed on a shadow while the engine runs it: a leaf (vLLM's
    finalize walks a module's children, which a shadow shares with the live one), no buffers, and
    a ``quant_method`` in :data:`AHEAD_METHODS` (or none; any with ``any_method``)."""
    if module._modules or any(b is not None for b in module._buffers.values()):
        return False
    method = getattr(module, "quant_method", None)
    return any_method or method is None or type(method).__name__ in AHEAD_METHODS


def shadow_tree(model: nn.Module, paths: Iterable[str]) -> tuple[nn.Module, dict[str, nn.Module]]:
    """Shallow copies of ``model`` and of every module on the way to each of ``paths``.

    Each copy shares the original's attributes (config, ``quant_method``, TP rank) but owns its
    ``_parameters``, ``_buffers``, ``_modules`` and ``_non_persistent_buffers_set``, so registering
    or deleting tensors on it leaves the live module untouched. A module reached twice is copied
    once. Modules off the paths are shared with the live model (nothing loads into them).

    Returns:
        ``(root copy, {path: copy of the module at path})``.
    """
    copies: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        c = copies.get(id(m))
        if c is None:
            c = copy.copy(m)
            own = c.__dict__
            own["_parameters"], own["_buffers"] = dict(m._parameters), dict(m._buffers)
            own["_modules"], own["_non_persistent_buffers_set"] = dict(m._modules), set(m._non_persistent_buffers_set)
            copies[id(m)] = c
        return c

    root = clone(model)
    shadows: dict[str, nn.Module] = {}
    for path in paths:
        parent, live = root, model
        for part in path.split("."):
            live = live._modules[part]  # type: ignore[assignment]
            child = clone(live)
            parent._modules[part] = child
            parent = child
        shadows[path] = parent
    return root, shadows


def _rebind(value: Any, live: nn.Module, shadow: nn.Module) -> Any:
    """A tensor attribute of ``live`` as the shadow's: weight loaders unwrapped from vLLM's
    ``online_process_loader`` (``layerwise._get_original_loader`` does the same) and methods bound
    to ``live`` bound to ``shadow``."""
    while callable(value) and getattr(value, "__name__", None) == "online_process_loader":
        value = value.__wrapped__
    if isinstance(value, MethodType) and value.__self__ is live:
        value = value.__func__.__get__(shadow)
    return value


def _owned_copy(t: torch.Tensor, live: nn.Module, shadow: nn.Module, *, data: bool) -> torch.Tensor:
    """A new tensor object of ``t``'s class with its attributes rebound to ``shadow``: on the meta
    device (``data=False``, as vLLM's ``to_meta_tensor``) or holding a copy of ``t`` (``data=True``)."""
    c = t.detach().clone() if data else t.data.to("meta")
    c.__class__ = t.__class__
    c.__dict__ = {k: _rebind(v, live, shadow) for k, v in t.__dict__.items()}
    return c


class Shadow:
    """A processed copy of one live module: ``module``, and ``initial``, its attributes as copied
    (so :func:`place` moves only what processing set)."""

    __slots__ = ("module", "initial")

    def __init__(self, module: nn.Module) -> None:
        self.module, self.initial = module, dict(module.__dict__)


def process_ahead(model: nn.Module, model_config: Any, paths: list[str],
                  weights: list[tuple[str, torch.Tensor]]) -> dict[str, Shadow] | None:
    """Load and process the modules at ``paths`` on shadows (module doc, steps 1-2).

    Args:
        model: the live vLLM model (``model_runner.get_model()``), loaded by vLLM (which recorded
            each module's loader layout with ``record_metadata_for_reloading``).
        model_config: the engine's ``ModelConfig`` (vLLM's ``finalize_layerwise_processing``).
        paths: module paths to process; every tensor of each must be among ``weights``.
        weights: ``(name, full HF tensor)`` as ``model.load_weights`` takes them.

    Returns:
        ``{path: processed shadow}``, or ``None`` when a module cannot be done this way (no
        recorded layout, or ``load_weights`` left a module without weights); the live model is
        unchanged either way. vLLM's per-module reload state (``LAYERWISE_INFO``) of the shadows
        is dropped before returning (it would keep them alive: its entries refer back to them).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    root, shadows = shadow_tree(model, paths)
    records = {path: Shadow(shadow) for path, shadow in shadows.items()}  # attributes before processing
    try:
        return _process(model, model_config, root, shadows, weights, records)
    finally:
        for shadow in shadows.values():
            LAYERWISE_INFO.pop(shadow, None)


def _process(model: nn.Module, model_config: Any, root: nn.Module, shadows: dict[str, nn.Module],
             weights: list[tuple[str, torch.Tensor]], records: dict[str, Shadow]) -> dict[str, Shadow] | None:
    """:func:`process_ahead` on ``shadows`` (path -> shadow module) under ``root``; returns ``records``."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO, finalize_layerwise_processing, get_layerwise_info, initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    for path, shadow in shadows.items():
        live = model.get_submodule(path)
        recorded = LAYERWISE_INFO.get(live)
        if recorded is None or not (recorded.restore_metadata[0] or recorded.restore_metadata[1]):
            return None
        info = get_layerwise_info(shadow)
        params, buffers = recorded.restore_metadata
        info.restore_metadata = ({n: _owned_copy(t, live, shadow, data=False) for n, t in params.items()},
                                 {n: _owned_copy(t, live, shadow, data=False) for n, t in buffers.items()})
        info.restore_device = recorded.restore_device
        restore_layer_on_meta(shadow, info)
        # tensors vLLM never moves to meta (a bias) are loaded in place: the shadow gets its own
        for name, t in list(get_layer_tensors(shadow).items()):
            if not t.is_meta:
                table = shadow._parameters if name in shadow._parameters else shadow._buffers
                table[name] = _owned_copy(t, live, shadow, data=True)
        initialize_online_processing(shadow)
    root.load_weights(iter(weights))
    waiting = [LAYERWISE_INFO[s] for s in shadows.values() if LAYERWISE_INFO[s].can_load()]
    if any(info.load_numel <= 0 for info in waiting):
        return None  # finalize would process a module that received nothing (uninitialized memory)
    finalize_layerwise_processing(nn.ModuleList(list({id(s): s for s in shadows.values()}.values())), model_config)
    if any(t.is_meta for s in shadows.values() for t in get_layer_tensors(s).values()):
        return None
    return records


def check_placeable(live: nn.Module, shadow: Shadow) -> str | None:
    """Why ``shadow`` cannot be placed into ``live`` (a kernel tensor without a match of the same
    shape and dtype), or ``None``."""
    for name, kernel in live._parameters.items():
        if kernel is None:
            continue
        new = shadow.module._parameters.get(name)
        if new is None or new.shape != kernel.shape or new.dtype != kernel.dtype:
            got = None if new is None else (tuple(new.shape), new.dtype)
            return f"{name}: kernel tensor {tuple(kernel.shape)} {kernel.dtype}, processed {got}"
    return None


def kernel_key(t: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of a kernel tensor: how :func:`place`'s ``done`` names it."""
    return t.data_ptr(), t.numel() * t.element_size()


@torch.no_grad()
def place(live: nn.Module, shadow: Shadow, done: dict[Any, Any] | None = None, source: Any = None,
          retired: list | None = None) -> int:
    """Move a processed shadow into the live module (module doc, step 3; the caller has run
    :func:`check_placeable`).

    Args:
        done: (address, bytes) -> ``source`` of the kernel tensors copied so far in this commit; a
            kernel tensor already copied from a module loaded from the same ``source`` (the HF
            tensors it loads: a tied ``lm_head`` and the embedding share one weight) is not copied
            again, nor is one marked :data:`WRITTEN` (the caller wrote its changes in place).
        retired: receives the attribute values replaced (e.g. the old oneDNN handle's closure), so
            the caller decides when to free them (freeing packed weights takes time).

    Returns:
        The bytes copied into kernel tensors.
    """
    nbytes = 0
    done = {} if done is None else done
    for name, kernel in live._parameters.items():
        if kernel is None or not kernel.numel():
            continue
        key = kernel_key(kernel)
        if done.get(key) is WRITTEN or (source is not None and done.get(key) == source):
            continue
        kernel.data.copy_(shadow.module._parameters[name])
        done[key] = source
        nbytes += key[1]
    # the attributes processing set or deleted on the shadow (not those it left as copied)
    state, new, initial = live.__dict__, shadow.module.__dict__, shadow.initial
    retired = [] if retired is None else retired
    for key in [k for k in initial if k not in new and k not in _OWN]:
        retired.append(state.pop(key, None))
    for key, value in new.items():
        if key not in _OWN and initial.get(key, _ABSENT) is not value:
            retired.append(state.get(key))
            state[key] = value
    return nbytes
