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

**Reloading ahead** (``reload_ahead``): the reload need not wait for the pause. During
:meth:`~torch_deltasync.DeltaReceiver.prepare` (the backend's background stager) the target builds
the new host tensors and runs vLLM's reload of the changed modules on shadow copies of them
(:mod:`torch_deltasync.targets._vllm_ahead`); the commit then swaps the host tensors and moves the
processed shadows into the live modules: an attribute each (the new packed handle), instead of a
re-pack of every changed module. A parameter that stays in the loader's layout next to its derived
copy (the CPU build's embedding, whose packed copy serves the tied ``lm_head``) is *patched*: the
commit writes its changed elements in place through the TP map, ``O(changed elements)``, rather
than copying the shadow's whole tensor (``in_place="auto"`` only). That processing leaves such a
parameter as loaded is checked once per published layout, on the first prepared commit that changes
it on this rank, bit for bit against the shadow (else it is copied, logged). Cost: memory for the
new host tensors and the shadows (about the model's bytes twice) per prepared update, from prepare
to commit; after a commit, the replaced host tensors (reused as the next update's buffers), packed
handles and the shadows' own tensors (the embedding's loader-layout copy) until the next
``prepare_commit``, so that nothing is freed inside the pause. ``DeltaReceiver.update`` (prepare
and commit at once) does not prepare ahead.

Because the host copy holds every element, the target is ``holds_all``: the receiver checks the
full per-tensor checksums of every version in ``O(changed elements)`` (``C' = C - partial(old) +
partial(new)``) and no checksum pass over the model is ever needed. Cost: one host copy of the
published weights per worker (the model's bytes in the inference dtype).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch
from torch import nn

from .._dtypes import bits, index_copy_, narrow
from ..checksum import tensor_checksum
from ..errors import CorruptObjectError, IncompatibleTargetError, UnsupportedLayoutError
from . import _vllm_ahead as ahead
from ._base import Target, narrow_exactly
from ._vllm import VLLMTarget
from ._vllm_layout import DEFAULT_MOE_BACKENDS
from ._vllm_reload import check_names, check_reloaded, experts_params, full_shape, module_path

__all__ = ["VLLMEngineTarget"]

log = logging.getLogger(__name__)

InPlace = Literal["auto", "never"]
ReloadAhead = Literal["auto", "always", "never"]


class VLLMEngineTarget(Target):
    """A live vLLM worker's model (one TP rank) plus a host copy of every published tensor.

    Args:
        model: the worker's model (``model_runner.get_model()``).
        model_config: the engine's ``ModelConfig`` (``finalize_layerwise_reload`` needs it).
        in_place: ``"auto"``: write in place every module whose live layout is the loader's,
            reload the others (and patch, at prepared commits, the reloaded parameters that stay
            as loaded: module doc); ``"never"``: reload every changed module, copying every kernel
            tensor from its reloaded copy.
        reload_ahead: reload the changed modules on shadows during ``prepare`` (module doc):
            ``"auto"``: when every one of them qualifies (:func:`~._vllm_ahead.ahead_ok`: vLLM's
            unquantized linear and embedding methods, no buffers), else all inside the commit;
            ``"always"``: also modules with other quant methods (no buffers; their
            processing must touch only the layer); ``"never"``: inside the commit, as vLLM's
            layerwise reload does.
        tp_rank, tp_size: override the TP rank and size read from the model's layers.
        strict: refuse a run that leaves parameters of the model, or parts of fused ones, without
            a published tensor (``check``); ``False`` leaves them as they are (a module to reload
            must get all of its tensors either way: :func:`~._vllm_reload.check_reloaded`).
        moe_backends: fused-MoE backends whose experts are written in place (as
            :class:`~torch_deltasync.targets.VLLMTarget`'s); experts are never reloaded.

    Attributes:
        host: HF name -> full tensor (HF shape, inference dtype, CPU): the state the receiver verifies.
        engine_writes: when False, commits update only the host copy (used to build it for an
            engine that already serves that version, see ``assume_version`` in
            :mod:`torch_deltasync.integrations.vllm`).
        last_reload: of the last commit: ``{"modules": int, "tensors": int, "ms": float,
            "ahead": bool}`` (``ms``: the reload inside the commit, or with ``ahead`` the placing
            of the shadows; then also ``"prepare_ms"``, the work done in ``prepare`` (of which
            ``"prepare_host_ms"`` building the new host tensors),
            ``"copied_mb"``, kernel tensors copied inside the commit, and ``"patched"``, changed
            elements written in place into reloaded parameters instead).
    """

    holds_all = True
    concurrent_reads = True  # see Target: reads gather from the host copy

    def __init__(self, model: nn.Module, model_config: Any, *, in_place: InPlace = "auto",
                 reload_ahead: ReloadAhead = "auto", tp_rank: int | None = None, tp_size: int | None = None,
                 strict: bool = True, moe_backends: tuple[str, ...] | list[str] = DEFAULT_MOE_BACKENDS) -> None:
        if in_place not in ("auto", "never"):
            raise ValueError(f"in_place must be 'auto' or 'never', got {in_place!r}")
        if reload_ahead not in ("auto", "always", "never"):
            raise ValueError(f"reload_ahead must be 'auto', 'always' or 'never', got {reload_ahead!r}")
        self.model = model
        self.model_config = model_config
        self.in_place = in_place
        self.reload_ahead, self.strict = reload_ahead, strict
        self._generation = 0  # bumped by every change of the host copy or the engine (prepared commits check it)
        self._retired: list = []  # replaced by the last prepared commit, freed by the next prepare_commit
        self._spare: dict[str, torch.Tensor] = {}  # host tensors it replaced: the next one's buffers
        self.host: dict[str, torch.Tensor] = {}
        self.engine_writes = True
        self.last_reload: dict[str, Any] = {"modules": 0, "tensors": 0, "ms": 0.0}
        self._tp = VLLMTarget(model, strict=False, tp_rank=tp_rank, tp_size=tp_size, moe_backends=moe_backends)
        # the same map, also onto parameters with a derived copy: patched by prepared commits
        self._patch = VLLMTarget(model, strict=False, tp_rank=tp_rank, tp_size=tp_size, allow_derived=True,
                                 moe_backends=moe_backends)
        self._patch_groups: dict[str, tuple[str, ...]] = {}  # reloaded vLLM parameter -> HF names _patch maps into it
        self._patch_ok: dict[str, bool] = {}  # vLLM parameter -> processing leaves it as loaded (checked once)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._inplace: set[str] = set()  # HF names written in place
        self._inplace_paths: set[str] = set()  # vLLM module paths of those
        self._module_of: dict[str, str] = {}  # HF name (or alias) -> vLLM module path it reloads into
        self._loads: dict[str, list[tuple[str, str]]] = {}  # module path -> [(name to load, host name)]
        self._paths_of: dict[str, set[str]] = {}  # host name -> module paths that load it
        self._dirty: set[str] = set()  # module paths to reload at finish()
        self._key: tuple | None = None

    # --- Target interface ------------------------------------------------------------------------

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        """Classify every published tensor as written in place or reloaded with its module.

        Raises:
            IncompatibleTargetError: a published name the model has no parameter for, a shape that
                differs from what its layer expects (checked for in-place tensors by the TP map,
                for reloaded ones against the layer's full sizes), tensors vLLM ties that the
                sender publishes separately, (``strict``) parameters or parts of fused ones no
                published tensor loads into (:func:`~._vllm_reload.check_names`), or a module to
                reload that the published tensors leave partly empty
                (:func:`~._vllm_reload.check_reloaded`).
            UnsupportedLayoutError: a tensor that can be neither written in place nor reloaded
                (fused-MoE experts whose backend re-lays them out, among others).
        """
        key = (tuple(sorted(shapes.items())), tuple(sorted(aliases.items())), dtype)
        if key == self._key:
            return
        check_names(self._tp, shapes, aliases, strict=self.strict)
        inplace: set[str] = set()
        module_of: dict[str, str] = {}
        for name, shape in list(shapes.items()) + [(a, shapes[c]) for a, c in aliases.items() if c in shapes]:
            mapped = self._tp._map_name(name)
            if mapped is None:
                continue  # vLLM's own name mapper drops it (e.g. rotary inv_freq)
            if self.in_place == "auto" and name in shapes:
                ok = self._in_place_ok(name, tuple(shape))
                if ok is None:
                    continue  # another rank holds it (an expert elsewhere under expert parallelism)
                if ok:
                    inplace.add(name)
                    continue
            path = module_path(self._tp, mapped[0])
            if self._tp._module(path) is None:
                continue  # another pipeline stage holds it
            module_of[name] = path
        # A tensor and its tied alias share one host tensor: in place only if both are.
        for alias, canon in aliases.items():
            if canon not in shapes:
                raise IncompatibleTargetError(f"alias {alias!r} names {canon!r}, which is not published")
            if (alias in module_of) or (canon in module_of):
                inplace.discard(canon)
                if canon not in module_of and (mapped := self._tp._map_name(canon)) is not None:
                    module_of[canon] = module_path(self._tp, mapped[0])
        if inplace:
            self._tp.check({n: shapes[n] for n in inplace},
                           {a: c for a, c in aliases.items() if c in inplace and a not in module_of}, dtype)
        for name, path in module_of.items():
            # The layer's own loader checks a reloaded tensor's shape only inside a reload, after
            # the commit has begun: check it here, against the layer's full (unsharded) sizes.
            expected = full_shape(self._tp._module(path), self._tp._map_name(name))
            got = tuple(shapes[aliases.get(name, name)])
            if expected is not None and expected != got:
                raise IncompatibleTargetError(
                    f"published tensor {name!r} has shape {got}, the vLLM layer {path!r} expects {expected}: "
                    "the run publishes another model than the engine serves (check the store and prefix)")
        check_reloaded(self._tp, module_of)
        if self.strict and inplace:  # experts by element: check_names counts them as loaded by any expert tensor
            self._tp._check_coverage(self._tp._entries, only=experts_params(self.model), strict=True)
        try:  # an optimisation of prepared commits: whatever fails here, they copy instead
            patch_groups = self._find_patchable(module_of, shapes, aliases, dtype) if self.in_place == "auto" else {}
        except Exception as err:  # noqa: BLE001
            log.warning("vLLM engine target: reloaded tensors are copied whole at prepared commits (%s: %s)",
                        type(err).__name__, err)
            patch_groups = {}
        loads: dict[str, list[tuple[str, str]]] = {}
        paths_of: dict[str, set[str]] = {}
        for name, path in module_of.items():
            src = aliases.get(name, name)
            loads.setdefault(path, []).append((name, src))
            paths_of.setdefault(src, set()).add(path)
        self._paths_of = paths_of
        self._shapes = {n: tuple(s) for n, s in shapes.items()}
        self._inplace, self._module_of, self._loads = inplace, module_of, loads
        # modules with a tensor written in place: never re-packed ahead (placing would undo the write)
        self._inplace_paths = {module_path(self._tp, m[0]) for n in inplace if (m := self._tp._map_name(n)) is not None}
        self._patch_groups, self._patch_ok = patch_groups, {}
        self._dirty = set()
        self._key = key
        self._generation += 1
        log.info("vLLM engine target: %d tensors in place, %d modules reloaded", len(inplace), len(loads))

    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return narrow(self._host(name).view(-1)[positions], dtype)

    @torch.no_grad()
    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        self._generation += 1
        host = self._host(name)
        index_copy_(host.view(-1), positions, values)
        if not self.engine_writes:
            return
        if name in self._inplace:
            self._write_in_place(name, positions, values)
        self._mark(name)
        self._generation += 1

    @torch.no_grad()
    def assign(self, name: str, full: torch.Tensor) -> None:
        shape = self._shapes.get(name)
        if shape is None:
            raise IncompatibleTargetError(f"{name!r} is not a published tensor of this target")
        if tuple(full.shape) != shape:
            raise CorruptObjectError(f"{name!r}: full tensor of shape {tuple(full.shape)}, expected {shape}")
        self._generation += 1
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
        self._generation += 1

    def finish(self, written: frozenset[str]) -> None:
        """Reload every module a write of this commit touched, from the host copy (module doc)."""
        dirty, self._dirty = self._dirty, set()
        self._generation += 1
        if not dirty or not self.engine_writes:
            self.last_reload = {"modules": 0, "tensors": 0, "ms": 0.0, "ahead": False}
            return
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
        self._generation += 1
        self.last_reload = {"modules": len(paths), "tensors": len(weights), "ms": (time.perf_counter() - t) * 1e3,
                            "ahead": False}

    def prepare_commit(self, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
                       dense: dict[str, torch.Tensor] | None) -> _PreparedReload | None:
        """Build a commit's new host tensors and reload its changed modules on shadows, writing
        nothing live (module doc, "Reloading ahead"; the receiver calls this at the end of
        ``prepare``, see :func:`~torch_deltasync.targets._base.prepare_commit`).

        Args:
            sparse: HF name -> (positions ``(k,)`` int64, values ``(k,)``) of a delta path.
            dense: HF name -> full tensor (HF shape) of an anchor path.

        Returns:
            A prepared commit, or ``None`` (no module to reload, ``reload_ahead="never"``, a
            module that does not qualify, the host-only mode, or vLLM's reload could not run on
            shadows: logged); the commit then reloads inside the pause.
        """
        # What the last prepared commit replaced: attributes are freed here, outside the pause; the
        # old host tensors become the buffers of the new ones (memory already mapped: writing
        # fresh pages costs more than the copy).
        spare, self._spare = self._spare, {}
        self._retired = []
        if not self.engine_writes or self.reload_ahead == "never":
            return None
        try:
            return self._prepare_commit(sparse, dense, spare)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory, or vLLM internals that differ
            log.warning("vLLM engine target: reloading ahead failed (%s: %s); reloading inside the commit",
                        type(e).__name__, e)
            return None

    def _prepare_commit(self, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
                        dense: dict[str, torch.Tensor] | None, spare: dict[str, torch.Tensor]) -> _PreparedReload | None:
        if dense is not None:
            names = list(dense)
        else:
            names = [n for n, (pos, _) in (sparse or {}).items() if pos.numel()]
        paths = sorted({p for n in names for p in self._paths_of.get(n, ())})
        if not paths or not all(ahead.ahead_ok(self.model.get_submodule(p), any_method=self.reload_ahead == "always")
                                for p in paths):
            return None
        if self._inplace_paths.intersection(paths):
            return None  # placing the copy would undo the in-place writes of the same module
        t = time.perf_counter()
        generation = self._generation
        new_host: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in names:
                if dense is not None:  # the staged full tensor becomes the host tensor (no copy)
                    new_host[name] = dense[name].detach().to("cpu").contiguous()
                else:
                    pos, val = sparse[name]  # type: ignore[index]
                    old, new = self._host(name), spare.pop(name, None)
                    if new is None or new is old or new.shape != old.shape or new.dtype != old.dtype:
                        new = old.clone()
                    else:
                        new.copy_(old)
                    index_copy_(new.view(-1), pos, val)
                    new_host[name] = new
        spare.clear()
        host_ms = (time.perf_counter() - t) * 1e3
        weights = [(name, new_host.get(src, self.host.get(src))) for path in paths for name, src in self._loads[path]]
        if any(w is None for _, w in weights):
            return None  # a module also loads a tensor the host copy does not hold yet
        shadows = ahead.process_ahead(self.model, self.model_config, paths, weights)  # type: ignore[arg-type]
        if shadows is None:
            log.warning("vLLM engine target: vLLM's reload cannot run on copies of %s; reloading inside the "
                        "commit", paths)
            return None
        for path, shadow in shadows.items():
            why = ahead.check_placeable(self.model.get_submodule(path), shadow)
            if why is not None:
                log.warning("vLLM engine target: %s cannot take its reloaded copy (%s); reloading inside the "
                            "commit", path, why)
                return None
        sources = {path: tuple(sorted(src for _, src in self._loads[path])) for path in paths}
        if dense is not None:
            writes, patched = [], frozenset()
        else:  # the owned changes, found now: the commit only writes them
            writes = [(self._tp, name, *self._owned(self._tp, name, *sparse[name])) for name in self._inplace & new_host.keys()]
            patch, patched = self._patches(shadows, sparse, generation)  # type: ignore[arg-type]
            writes += [(self._patch, name, pos, val) for name, (pos, val) in patch.items()]
        return _PreparedReload(self, generation, new_host, dense, shadows, sources, len(weights), writes, patched,
                               {"prepare_ms": (time.perf_counter() - t) * 1e3, "prepare_host_ms": host_ms})

    @staticmethod
    def _owned(tp: VLLMTarget, name: str, positions: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The changes of ``name`` that this TP rank holds, as ``tp`` maps them."""
        owned = tp.owned(name, positions)
        return positions[owned], values[owned]

    def _find_patchable(self, module_of: dict[str, str], shapes: dict[str, tuple[int, ...]],
                        aliases: dict[str, str], dtype: torch.dtype) -> dict[str, tuple[str, ...]]:
        """vLLM parameter name -> the HF names loaded into it, for the reloaded parameters the TP
        map can write in place once derived copies are allowed (module doc: patched by prepared
        commits). A parameter that some tensor the map refuses also loads into is left out."""
        names = set()
        for name in module_of:
            if name not in shapes:
                continue  # an alias follows its published tensor
            try:
                e = self._patch._resolve(name, tuple(int(s) for s in shapes[name]))
            except (UnsupportedLayoutError, IncompatibleTargetError):
                continue  # e.g. a CPU linear: its weight is gone, only the packed handle is left
            if not e.ignored and e.places and all(p.param.numel() and p.param.is_contiguous() for p in e.places):
                names.add(name)
        if not names:
            return {}
        try:
            self._patch.check({n: shapes[n] for n in names}, {a: c for a, c in aliases.items() if c in names}, dtype)
        except (UnsupportedLayoutError, IncompatibleTargetError) as err:
            log.debug("vLLM engine target: reloaded tensors copied whole at prepared commits (%s)", err)
            return {}
        loaded: dict[str, set[str]] = {}  # vLLM parameter -> every published tensor loaded into it
        for name in module_of:
            if (m := self._tp._map_name(name)) is not None:
                loaded.setdefault(m[0], set()).add(aliases.get(name, name))
        groups: dict[str, set[str]] = {}
        for name in names:
            for p in self._patch._entry(name).places:
                groups.setdefault(p.vname, set()).add(name)
        return {v: tuple(sorted(g)) for v, g in groups.items() if loaded.get(v, set()) <= g}

    def _patches(self, shadows: dict[str, ahead.Shadow], sparse: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 generation: int) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], frozenset[tuple[int, int]]]:
        """The changes a prepared commit writes in place instead of copying kernel tensors whole:
        ``({HF name: (owned positions, values)}, {(address, bytes) of the kernel tensors patched})``.

        Whether processing leaves a parameter as loaded is checked on its first prepared commit
        that changes some of its elements on this rank (an element-wise transform shows only
        there: the unchanged ones went through it on both sides); until then it is copied. A
        verdict reached while the target changed (``generation``: a commit or ``check`` beside
        this prepare) is not kept."""
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        patch, keys = {}, set()
        for vname, names in self._patch_groups.items():
            path = vname.rpartition(".")[0]
            if path not in shadows:
                continue
            for name in names:
                if name not in changes:
                    none = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=self._host(name).dtype))
                    changes[name] = self._owned(self._patch, name, *(sparse.get(name) or none))
            group = {name: changes[name] for name in names}
            ok = self._patch_ok.get(vname)
            if ok is None:
                if not any(pos.numel() for pos, _ in group.values()):
                    continue  # nothing to check it on: copied this time
                ok = self._as_loaded(vname, shadows[path], group)
                if self._generation != generation:
                    continue  # read beside a commit: no verdict (this prepared commit is stale anyway)
                self._patch_ok[vname] = ok
                if not ok:
                    log.warning("vLLM engine target: processing changes %r after loading; it is copied whole at "
                                "every commit", vname)
            if ok:
                patch.update(group)
                param = self._place_of(names[0], vname).param
                keys.add(ahead.kernel_key(param))
        return patch, frozenset(keys)

    def _place_of(self, name: str, vname: str):
        """The place of HF tensor ``name`` in the vLLM parameter ``vname`` (patch map)."""
        return next(p for p in self._patch._entry(name).places if p.vname == vname)

    def _as_loaded(self, vname: str, shadow: ahead.Shadow, changes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the shadow's processed ``vname`` equals the live parameter with ``changes``
        (HF name -> owned positions, values) written, bit for bit: processing left it as loaded."""
        live = self._place_of(next(iter(changes)), vname).param
        new = shadow.module._parameters.get(vname.rpartition(".")[2])
        if new is None or new.shape != live.shape or new.dtype != live.dtype or not new.is_contiguous():
            return False
        a, b = bits(new.detach().reshape(-1)), bits(live.detach().reshape(-1))
        differ = a != b
        for name, (pos, val) in changes.items():
            local = self._patch._owned_local(self._patch._entry(name), self._place_of(name, vname), pos)
            differ[local] = False
            if not torch.equal(a[local], bits(val.to(live.dtype))):
                return False
        return not bool(differ.any())

    def checksum(self, name: str, dtype: torch.dtype) -> int:
        """Full checksum of the host copy of ``name`` (every element: the target ``holds_all``)."""
        host = self._host(name)
        return tensor_checksum(narrow_exactly(host, dtype, name))

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

    def _write_in_place(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write the elements of ``name`` this TP rank owns into its loader-layout parameter."""
        self._tp.write(name, *self._owned(self._tp, name, positions, values))

    def _mark(self, name: str) -> None:
        self._dirty |= self._paths_of.get(name, set())

    def _in_place_ok(self, name: str, shape: tuple[int, ...]) -> bool | None:
        """Whether the TP map can write ``name`` in place (its live layout is the loader's);
        ``None`` when it maps to no place on this rank (held by another rank or stage)."""
        try:
            e = self._tp._resolve(name, shape)
        except UnsupportedLayoutError as err:
            log.debug("%s: reloaded (%s)", name, err)
            return False
        return False if e.ignored else (True if e.places else None)


class _PreparedReload:
    """A commit prepared by :meth:`VLLMEngineTarget.prepare_commit`: new host tensors and processed
    shadows of the modules to reload (:class:`~torch_deltasync.targets._base.PreparedCommit`)."""

    def __init__(self, target: VLLMEngineTarget, generation: int, new_host: dict[str, torch.Tensor],
                 dense: dict[str, torch.Tensor] | None, shadows: dict[str, ahead.Shadow],
                 sources: dict[str, tuple[str, ...]], tensors: int,
                 writes: list[tuple[VLLMTarget, str, torch.Tensor, torch.Tensor]], patched: frozenset[tuple[int, int]],
                 times: dict[str, float]) -> None:
        self.target, self.generation = target, generation
        self.new_host, self.dense, self.shadows = new_host, dense, shadows
        self.sources, self.tensors, self.writes, self.patched, self.times = sources, tensors, writes, patched, times

    @torch.no_grad()
    def commit(self) -> bool:
        target = self.target
        if not self.shadows or target._generation != self.generation or not target.engine_writes:
            return False  # released, or the target changed since: the receiver writes the usual way
        live = {path: target.model.get_submodule(path) for path in self.shadows}
        if any(ahead.check_placeable(live[p], s) is not None for p, s in self.shadows.items()):
            return False
        t = time.perf_counter()
        target._generation += 1
        if self.dense is not None:  # modules written in place (norms)
            for name in target._inplace & self.new_host.keys():
                target._tp.assign(name, self.dense[name])
        # What this replaces (old host tensors, old packed handles) is freed or reused by the next
        # prepare_commit, off the pause: freeing a model's worth of memory takes milliseconds.
        target._spare = {name: target.host[name] for name in self.new_host if name in target.host}
        retired: list = []
        target.host.update(self.new_host)
        # The changes of modules written in place (norms) and of the kernel tensors still in the
        # loader's layout (not copied whole; a place of them that is copied below gets the shadow's
        # values over these).
        for tp, name, pos, val in self.writes:
            tp.write(name, pos, val)
        # A kernel tensor shared by modules that load the same HF tensors (a tied lm_head and the
        # embedding) gets the same values from each: copied once.
        done: dict[Any, Any] = {key: ahead.WRITTEN for key in self.patched}
        copied = sum(ahead.place(live[p], s, done, self.sources[p], retired) for p, s in self.shadows.items())
        target._retired = retired
        target._dirty = set()
        target._generation += 1  # again after the writes: a prepare that read them half done is stale
        target.last_reload = {"modules": len(self.shadows), "tensors": self.tensors,
                              "ms": (time.perf_counter() - t) * 1e3, "ahead": True, **self.times,
                              "copied_mb": copied / 2**20,
                              "patched": sum(int(w[2].numel()) for w in self.writes if w[0] is target._patch)}
        self.release(retired)  # the shadows' tensors too are freed by the next prepare_commit
        return True

    def release(self, retired: list | None = None) -> None:
        """Drop what was prepared; the shadows' tensors go to ``retired`` if given (freed later by
        whoever holds it), else are freed now."""
        for shadow in self.shadows.values():  # a processed parameter's loader refers to its shadow: a cycle
            if retired is not None:
                retired.append(shadow.module.__dict__["_parameters"])
            shadow.module.__dict__["_parameters"] = {}
        self.new_host, self.dense, self.shadows, self.writes = {}, None, {}, []
