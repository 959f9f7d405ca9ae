r"""``VLLMEngineTarget``: a live vLLM worker's model, with a host copy of the weights in HF layout.

A running vLLM engine does not always keep its weights in the layout its loaders write. After
loading, ``process_weights_after_loading`` may turn a parameter into a *derived* copy: vLLM's CPU
build re-packs every linear weight for oneDNN (``dispatch_cpu_unquantized_gemm`` empties
``layer.weight`` and keeps only the packed handle; embeddings gain a packed copy), and quantized GPU
kernels (FP8, Marlin, ...) re-block theirs. An in-place write into ``param.data`` cannot update such
a module (``docs/research/vllm-live-cpu.md``).

This target therefore keeps the published state on the host, in HF names and layout, one full
tensor per published name (``host``), and pushes each commit into the engine per vLLM module:

* **in place** where the live parameter is the loader's layout (norms; embeddings and linears when
  nothing re-packs them, e.g. bf16 on GPU): the changed elements are written with ``index_copy_``
  through :class:`~torch_deltasync.targets.VLLMTarget`'s TP map, ``O(changed elements)``;
* **reload** where it is derived: the module is reloaded whole from the host copy through vLLM's
  layerwise reload (``vllm/model_executor/model_loader/reload/layerwise.py``:
  ``initialize_layerwise_reload`` on the changed modules → ``model.load_weights`` of the HF tensors
  those modules load → ``finalize_layerwise_reload``), which re-runs the module's own
  ``process_weights_after_loading`` (the re-pack) and copies the result into the existing kernel
  tensors, as vLLM's ``nccl`` and ``ipc`` engines do. Modules that nothing changed keep their
  kernel tensors.

The choice is made per module by :meth:`VLLMEngineTarget.check` (``in_place="auto"``): a module the TP
map accepts is written in place, one it refuses as derived or packed
(:class:`~torch_deltasync.errors.UnsupportedLayoutError`) is reloaded.

Because the host copy holds every element, the target is ``holds_all``: the receiver checks the
full per-tensor checksums of every version in ``O(changed elements)`` (``C' = C - partial(old) +
partial(new)``) and no checksum pass over the model is ever needed. Cost: one host copy of the
published weights per worker (the model's bytes in the inference dtype).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import nn

from ..checksum import tensor_checksum
from ..errors import CorruptObjectError, IncompatibleTargetError, UnsupportedLayoutError
from ._base import Target
from ._vllm import VLLMTarget

__all__ = ["VLLMEngineTarget"]

log = logging.getLogger(__name__)

InPlace = Literal["auto", "never"]


class VLLMEngineTarget(Target):
    """A live vLLM worker's model (one TP rank) plus a host copy of every published tensor.

    Args:
        model: the worker's model (``model_runner.get_model()``).
        model_config: the engine's ``ModelConfig`` (``finalize_layerwise_reload`` needs it).
        in_place: ``"auto"``: write in place every module whose live layout is the loader's,
            reload the others; ``"never"``: reload every changed module.
        tp_rank, tp_size: override the TP rank and size read from the model's layers.

    Attributes:
        host: HF name -> full tensor (HF shape, inference dtype, CPU): the state the receiver verifies.
        engine_writes: when False, commits update only the host copy (used to build it for an
            engine that already serves that version, see ``assume_version`` in
            :mod:`torch_deltasync.integrations.vllm`).
        last_reload: ``{"modules": int, "tensors": int, "ms": float}`` of the last :meth:`finish`.
    """

    holds_all = True
    concurrent_reads = True  # see Target: reads gather from the host copy

    def __init__(self, model: nn.Module, model_config: Any, *, in_place: InPlace = "auto",
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        if in_place not in ("auto", "never"):
            raise ValueError(f"in_place must be 'auto' or 'never', got {in_place!r}")
        self.model = model
        self.model_config = model_config
        self.in_place = in_place
        self.host: dict[str, torch.Tensor] = {}
        self.engine_writes = True
        self.last_reload: dict[str, Any] = {"modules": 0, "tensors": 0, "ms": 0.0}
        self._tp = VLLMTarget(model, strict=False, tp_rank=tp_rank, tp_size=tp_size)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._inplace: set[str] = set()  # HF names written in place
        self._module_of: dict[str, str] = {}  # HF name (or alias) -> vLLM module path it reloads into
        self._loads: dict[str, list[tuple[str, str]]] = {}  # module path -> [(name to load, host name)]
        self._paths_of: dict[str, set[str]] = {}  # host name -> module paths that load it
        self._dirty: set[str] = set()  # module paths to reload at finish()
        self._key: tuple | None = None

    # --- Target interface ------------------------------------------------------------------------

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        """Classify every published tensor as written in place or reloaded with its module.

        Raises:
            IncompatibleTargetError: a published name the model does not know, or a shape that
                differs from what its layer expects (checked for in-place tensors by the TP map,
                for reloaded ones by the layer's own loader at the first reload).
            UnsupportedLayoutError: a tensor that can be neither written in place nor reloaded.
        """
        key = (tuple(sorted(shapes.items())), tuple(sorted(aliases.items())), dtype)
        if key == self._key:
            return
        inplace: set[str] = set()
        module_of: dict[str, str] = {}
        for name, shape in list(shapes.items()) + [(a, shapes[c]) for a, c in aliases.items() if c in shapes]:
            mapped = self._tp._map_name(name)
            if mapped is None:
                continue  # vLLM's own name mapper drops it (e.g. rotary inv_freq)
            if self.in_place == "auto" and name in shapes and self._in_place_ok(name, tuple(shape)):
                inplace.add(name)
                continue
            vname = mapped[0]
            path = vname.rpartition(".")[0]
            if self._tp._module(path) is None:
                continue  # another pipeline stage holds it
            module_of[name] = path
        # A tensor and its tied alias share one host tensor: in place only if both are.
        for alias, canon in aliases.items():
            if canon not in shapes:
                raise IncompatibleTargetError(f"alias {alias!r} names {canon!r}, which is not published")
            if (alias in module_of) or (canon in module_of):
                inplace.discard(canon)
                if canon not in module_of and self._tp._map_name(canon) is not None:
                    module_of[canon] = self._tp._map_name(canon)[0].rpartition(".")[0]
        if inplace:
            self._tp.check({n: shapes[n] for n in inplace},
                           {a: c for a, c in aliases.items() if c in inplace and a not in module_of}, dtype)
        for name, path in module_of.items():
            # The layer's own loader checks a reloaded tensor's shape only inside a reload, after
            # the commit has begun: check it here, against the layer's full (unsharded) sizes.
            expected = _full_shape(self._tp._module(path), self._tp._map_name(name))
            got = tuple(shapes[aliases.get(name, name)])
            if expected is not None and expected != got:
                raise IncompatibleTargetError(
                    f"published tensor {name!r} has shape {got}, the vLLM layer {path!r} expects {expected}: "
                    "the run publishes another model than the engine serves (check the store and prefix)")
        loads: dict[str, list[tuple[str, str]]] = {}
        paths_of: dict[str, set[str]] = {}
        for name, path in module_of.items():
            src = aliases.get(name, name)
            loads.setdefault(path, []).append((name, src))
            paths_of.setdefault(src, set()).add(path)
        self._paths_of = paths_of
        self._shapes = {n: tuple(s) for n, s in shapes.items()}
        self._inplace, self._module_of, self._loads = inplace, module_of, loads
        self._dirty = set()
        self._key = key
        log.info("vLLM engine target: %d tensors in place, %d modules reloaded", len(inplace), len(loads))

    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._host(name).view(-1)[positions].to(dtype)

    @torch.no_grad()
    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        host = self._host(name)
        host.view(-1).index_copy_(0, positions, values.to(host.dtype))
        if not self.engine_writes:
            return
        if name in self._inplace:
            owned = self._tp.owned(name, positions)
            self._tp.write(name, positions[owned], values[owned])
        self._mark(name)

    @torch.no_grad()
    def assign(self, name: str, full: torch.Tensor) -> None:
        shape = self._shapes.get(name)
        if shape is None:
            raise IncompatibleTargetError(f"{name!r} is not a published tensor of this target")
        if tuple(full.shape) != shape:
            raise CorruptObjectError(f"{name!r}: full tensor of shape {tuple(full.shape)}, expected {shape}")
        host = self.host.get(name)
        if host is None or host.dtype != full.dtype:
            self.host[name] = full.detach().to("cpu").contiguous().clone()
        else:
            host.copy_(full)
        if not self.engine_writes:
            return
        if name in self._inplace:
            self._tp.assign(name, full)
        self._mark(name)

    def finish(self, written: frozenset[str]) -> None:
        """Reload every module a write of this commit touched, from the host copy (module doc)."""
        dirty, self._dirty = self._dirty, set()
        if not dirty or not self.engine_writes:
            self.last_reload = {"modules": 0, "tensors": 0, "ms": 0.0}
            return
        import time

        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload, initialize_layerwise_reload,
        )

        t = time.perf_counter()
        paths = sorted(dirty)
        for path in paths:
            initialize_layerwise_reload(self.model.get_submodule(path))
        weights = [(name, self.host[src]) for path in paths for name, src in self._loads[path]]
        try:
            self.model.load_weights(iter(weights))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self.last_reload = {"modules": len(paths), "tensors": len(weights), "ms": (time.perf_counter() - t) * 1e3}

    def checksum(self, name: str, dtype: torch.dtype) -> int:
        """Full checksum of the host copy of ``name`` (every element: the target ``holds_all``)."""
        host = self._host(name)
        return tensor_checksum(host if host.dtype == dtype else host.to(dtype))

    # --- introspection ---------------------------------------------------------------------------

    @property
    def in_place_names(self) -> frozenset[str]:
        """Published names written in place (the rest reload with their module)."""
        return frozenset(self._inplace)

    @property
    def reloaded_modules(self) -> frozenset[str]:
        """vLLM module paths a change reloads."""
        return frozenset(self._loads)

    # --- internals -------------------------------------------------------------------------------

    def _host(self, name: str) -> torch.Tensor:
        host = self.host.get(name)
        if host is None:
            raise IncompatibleTargetError(
                f"{name!r}: the host copy holds no version yet (the first update takes an anchor path)")
        return host

    def _mark(self, name: str) -> None:
        self._dirty |= self._paths_of.get(name, set())

    def _in_place_ok(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the TP map can write ``name`` in place (its live layout is the loader's)."""
        try:
            e = self._tp._resolve(name, shape)
        except UnsupportedLayoutError as err:
            log.debug("%s: reloaded (%s)", name, err)
            return False
        return not e.ignored and bool(e.places)


def _full_shape(module: nn.Module | None, mapped: tuple[str, int | None] | None) -> tuple[int, ...] | None:
    """The full HF shape a reloaded tensor must have, from its vLLM layer's unsharded sizes
    (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``; the same attributes
    the TP map of :mod:`torch_deltasync.targets._vllm` reads); ``None`` for layers not known here (the
    layer's loader checks those at the reload)."""
    from ._vllm_layout import _classes

    if module is None or mapped is None:
        return None
    vname, shard = mapped
    leaf = vname.rpartition(".")[2]
    C = _classes()
    cls = type(module)
    if cls in (C.Vocab, C.LMHead):
        return (int(module.org_vocab_size), int(module.embedding_dim)) if leaf == "weight" else None
    if cls is C.QKV:
        if shard not in (0, 1, 2):
            return None
        d = int(module.head_size)
        heads = int(module.total_num_heads) if shard == 0 else int(module.total_num_kv_heads)
        rows = heads * (int(getattr(module, "v_head_size", d)) if shard == 2 else d)
    elif cls is C.Merged:
        out = [int(o) for o in module.output_sizes]
        if shard is None or not 0 <= shard < len(out):
            return None
        rows = out[shard]
    elif cls in (C.Column, C.Row, C.Replicated):
        if shard is not None:
            return None
        rows = int(module.output_size)
    else:
        return None
    if leaf == "weight":
        return (rows, int(module.input_size))
    return (rows,) if leaf == "bias" else None
