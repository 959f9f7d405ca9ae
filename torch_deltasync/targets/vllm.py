r"""``VLLMTarget``: apply versions straight onto one vLLM tensor-parallel rank's parameters.

Deltas arrive in Hugging Face names and **global flat indices** of the full HF tensor. A vLLM worker
holds fused, TP-sharded parameters (``qkv_proj``, ``gate_up_proj``, vocab shards with padding rows,
fused MoE expert stacks). This target maps every HF ``(name, global flat index)`` to the
``(vLLM parameter, local element offset)`` that this rank holds, from the live modules' own
attributes (``tp_rank``, ``tp_size``, ``num_heads``, ``num_kv_heads``, ``num_kv_head_replicas``,
``output_sizes``, ``shard_indices``, the MoE expert map, the parameters' strides), and writes with
``index_copy_`` into the live storage: no ``.data`` rebinding (CUDA graphs keep their pointers), no
dense staging copy of the model, cost proportional to the number of changed elements.

The rules are vLLM 0.33.0's weight loaders (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``fused_moe/routed_experts.py``; see
``docs/research/vllm-layout.md`` §3), and the tests check them bit-for-bit against those loaders.

**The map.** Every supported layout is *separable*: each HF dim ``d`` maps on its own, through a
lookup table ``T_d`` (HF coordinate -> local coordinate, ``-1`` where this rank holds nothing) or the
identity, so for an HF element with coordinates ``x``

.. math::

    \text{owned} = \bigwedge_d T_d[x_d] \ge 0, \qquad
    \text{local offset} = b + \sum_d T_d[x_d] \cdot s_d

with ``s_d`` the parameter's element stride for that dim and ``b`` a constant (a local expert's
offset). Worked example, Qwen2-style attention with ``H = 8`` query heads, ``K = 2`` KV heads,
``head_dim = 8``, hidden 64 at ``tp = 4`` (``Hl = 2`` heads per rank, ``rep = 2`` replicas of each KV
head); local ``qkv_proj.weight`` is ``(2*8 + 8 + 8, 64) = (32, 64)``:

======  ======================  =========================  ==========================
rank    ``q_proj`` rows held     ``k_proj`` rows held        ``v_proj`` rows held
======  ======================  =========================  ==========================
0       ``0-15`` -> local 0-15    ``0-7`` -> local 16-23      ``0-7`` -> local 24-31
1       ``16-31`` -> local 0-15   ``0-7`` -> local 16-23      ``0-7`` -> local 24-31
2       ``32-47`` -> local 0-15   ``8-15`` -> local 16-23     ``8-15`` -> local 24-31
3       ``48-63`` -> local 0-15   ``8-15`` -> local 16-23     ``8-15`` -> local 24-31
======  ======================  =========================  ==========================

so HF ``(k_proj.weight, 9 * 64 + 5)`` is local offset ``(16 + 1) * 64 + 5`` on ranks 2 and 3.

Per layer class (``r`` = the layer's ``tp_rank``, ``tp`` = its ``tp_size``):

* ``QKVParallelLinear``: q rows ``[r*Hl*d, +Hl*d)`` -> local ``0..``; k rows
  ``[(r // rep)*Kl*d, +Kl*d)`` -> local ``Hl*d..``; v likewise after k (``v_head_size``). When
  ``tp > K`` each KV element lives on ``rep = tp/K`` ranks and is written on all of them.
* ``MergedColumnParallelLinear`` (``gate_up_proj``): shard ``k`` rows ``[r*S_k, +S_k)`` ->
  local ``sum(S_j, j<k)..`` with ``S_k = output_sizes[k] / tp``.
* ``ColumnParallelLinear``: rows split; ``RowParallelLinear``: columns split, bias replicated.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: HF rows ``[org_vocab_start, org_vocab_end)``
  -> local rows ``0..``; the remaining local rows are padding (the vocab is padded to a multiple of
  64 and split evenly), kept at zero. Tied embeddings are one parameter.
* ``RMSNorm``, ``ReplicatedLinear`` (MoE router ``GateLinear``): full copies on every rank.
* ``RoutedExperts`` (fused MoE, unquantized, Triton layout): ``w13_weight[E_loc, 2*Il, H]`` holds
  ``[gate rows ; up rows]`` of each local expert, ``w2_weight[E_loc, H, Il]``; the global expert is
  mapped through the layer's own expert map (``-1`` = elsewhere, under expert parallelism), the
  intermediate dim is split by the MoE TP rank. Both HF forms are accepted: per-expert
  ``experts.{e}.{gate,up,down}_proj.weight`` and the fused 3-D ``experts.gate_up_proj``
  ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` that transformers 5 uses.

Anything else (quantized or repacked weights, CPU-prepacked linears, other MoE backends, LoRA
wrappers, unknown layer classes or weight loaders, expert load balancing, padded MoE dims) is refused
with :class:`~torch_deltasync.errors.UnsupportedLayoutError` in :meth:`VLLMTarget.check`, before
anything is downloaded or written.

**Checksums.** :meth:`VLLMTarget.checksum` counts every element this rank holds *once across the
ranks of one engine*: KV heads replicated over ``rep`` ranks count on the first replica, replicated
parameters (norms, row-parallel biases, the router) on TP rank 0, so the partials of all workers of
one engine add up (mod 2^64) to the manifest's checksum
(:func:`torch_deltasync.checksum.combine_partials`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .. import _native, _native_apply
from ..checksum import checksum as _checksum
from ..errors import CorruptObjectError, IncompatibleTargetError, UnsupportedLayoutError
from .base import Target

__all__ = ["VLLMTarget", "DEFAULT_MOE_BACKENDS"]

#: Unquantized fused-MoE backends whose runtime layout is the loader's layout (``TRITON`` and
#: ``BATCHED_TRITON`` only ``.contiguous()`` the weights; FlashInfer swaps or re-blocks them, AITER
#: shuffles, XPU transposes, CPU prepacks: ``fused_moe/oracle/unquantized.py``).
DEFAULT_MOE_BACKENDS: tuple[str, ...] = ("TRITON", "BATCHED_TRITON")

# Elements per step when walking every held element (checksums, anchors): bounds temporaries.
_CHUNK = 1 << 20

# Parameter attributes that mean "not a plain dense tensor in HF element order".
_PACKED_ATTRS = ("packed_dim", "packed_factor", "pack_factor", "marlin_tile_size", "is_sharded_weight",
                 "is_transposed", "is_shuffled")


def _holds_exactly(storage: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether every ``dtype`` value survives a round trip through ``storage``."""
    if storage == dtype:
        return True
    wider = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return storage in wider.get(dtype, ())


@dataclass(frozen=True)
class _Place:
    """Where the elements of one HF tensor land in one vLLM parameter on this rank.

    Attributes:
        param: the live parameter (never replaced; written through a flat strided alias).
        vname: its vLLM name, for messages.
        base: constant element offset added to every local offset (relative to
            ``param.storage_offset()``).
        tables: per HF dim, an int64 table ``HF coordinate -> local coordinate`` (``-1`` = not on
            this rank) on the parameter's device, or ``None`` for the identity.
        strides: per HF dim, the parameter's element stride that local coordinate is multiplied by.
        counted: whether this rank counts these elements in checksums (each element is counted on
            exactly one rank of the engine).
        pad_rows: ``(start, end)`` rows of the parameter's dim 0 that hold padding, zeroed when a
            full tensor is assigned (as vLLM's vocab loader does).
        affine: ``(lo, hi, offset)`` when the place holds exactly global flat ``[lo, hi)`` at
            local ``global + offset`` (:func:`_with_affine`), else ``None``.
        grid: the map of a 1-D or 2-D tensor on the CPU for the compiled kernels, built once in
            :meth:`VLLMTarget.check` (:func:`_with_grid`): ``(ncols, row table, column table,
            row stride, column stride)``, tables as int64 numpy arrays sharing memory with
            ``tables`` (empty = identity); ``None`` for other places (torch path).
    """

    param: torch.Tensor
    vname: str
    base: int
    tables: tuple[torch.Tensor | None, ...]
    strides: tuple[int, ...]
    counted: bool
    pad_rows: tuple[int, int] | None = None
    affine: tuple[int, int, int] | None = None
    grid: tuple | None = field(default=None, compare=False)  # numpy arrays: no == or hash

    def held_numel(self, shape: tuple[int, ...]) -> int:
        """Elements of the HF tensor held by this placement."""
        n = 1
        for t, size in zip(self.tables, shape):
            n *= size if t is None else int((t >= 0).sum())
        return n


@dataclass
class _Entry:
    """One published HF tensor on this rank: its full shape and where it lands (``places[0]`` is
    the primary; further places are untied copies of a tied alias, written but never counted)."""

    name: str
    shape: tuple[int, ...]
    places: list[_Place] = field(default_factory=list)
    ignored: bool = False  # vLLM's own name mapper drops this tensor


class _Classes:
    """vLLM classes the map understands, imported lazily (``import torch_deltasync`` needs no vLLM)."""

    def __init__(self) -> None:
        from vllm.model_executor.layers import layernorm, linear, vocab_parallel_embedding as vpe
        from vllm.model_executor.layers.fused_moe import routed_experts, unquantized_fused_moe_method
        from vllm.model_executor.layers.fused_moe.router import gate_linear
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        from vllm.model_executor.models.utils import PPMissingLayer

        self.linear = linear
        self.QKV = linear.QKVParallelLinear
        self.Merged = linear.MergedColumnParallelLinear
        self.Column = linear.ColumnParallelLinear
        self.Row = linear.RowParallelLinear
        self.Replicated = linear.ReplicatedLinear
        self.Gate = gate_linear.GateLinear
        self.Vocab = vpe.VocabParallelEmbedding
        self.LMHead = vpe.ParallelLMHead
        self.norms = tuple(getattr(layernorm, n) for n in ("RMSNorm", "GemmaRMSNorm") if hasattr(layernorm, n))
        self.linear_methods = (linear.UnquantizedLinearMethod, getattr(gate_linear, "_GateLinearMethod", None))
        self.embedding_method = vpe.UnquantizedEmbeddingMethod
        self.RoutedExperts = routed_experts.RoutedExperts
        self.moe_method = unquantized_fused_moe_method.UnquantizedFusedMoEMethod
        self.default_loader = default_weight_loader
        self.PPMissing = PPMissingLayer


_CLASSES: _Classes | None = None


def _classes() -> _Classes:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _Classes()
    return _CLASSES


class VLLMTarget(Target):
    """One vLLM worker's model (one TP rank) as a :class:`~torch_deltasync.DeltaReceiver` target.

    Build one per worker and give it to a ``DeltaReceiver``; inside a live engine the ``deltasync``
    backend uses it, through :class:`~torch_deltasync.targets.vllm_engine.VLLMEngineTarget`, for
    the parameters it writes in place. Every rank of the engine follows the same run; each applies exactly the
    elements it holds (replicated ones on every rank that holds them).

    Args:
        model: the worker's ``nn.Module`` (``worker.model_runner.get_model()``), built by vLLM
            (0.33; Llama / Qwen2 / Qwen3 / Qwen3-MoE-style layers), weights in the layout its
            loaders write.
        strict: require every element of every vLLM parameter (except vocab padding) to be covered
            by a published tensor; with ``False`` uncovered parameters are left alone.
        moe_backends: names of ``UnquantizedMoeBackend`` values whose runtime layout is the
            loader's layout (default :data:`DEFAULT_MOE_BACKENDS`). Only widen it for a model on
            which ``process_weights_after_loading`` never ran (tests build such models on CPU).
        tp_rank: this worker's rank in the engine's TP group, used only to count replicated
            elements once in checksums; ``None``: read from the model's TP-sharded layers (or 0).
        tp_size: the TP group's size; ``None``: read from the model like ``tp_rank``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> target = VLLMTarget(worker.model_runner.get_model())
        >>> receiver = DeltaReceiver(target, "s3://bucket/runs", prefix="run-7")
        >>> receiver.update()
    """

    holds_all = False

    def __init__(self, model: nn.Module, *, strict: bool = True,
                 moe_backends: tuple[str, ...] | list[str] = DEFAULT_MOE_BACKENDS,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected the vLLM model (an nn.Module), got {type(model).__name__}")
        self.model = model
        self.strict = strict
        self.moe_backends = tuple(moe_backends)
        self._tp_override = (tp_rank, tp_size)
        self._entries: dict[str, _Entry] = {}
        self._key: tuple | None = None
        self._tables: dict[tuple, torch.Tensor] = {}
        self._tp: tuple[int, int] | None = None
        self._expert_ids: dict[int, list[int]] = {}

    # --- Target interface ------------------------------------------------------------------------

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        """Build the map for the published tensors and validate it against the live model.

        Raises:
            IncompatibleTargetError: a published name the model does not know, a shape that differs
                from what the layer expects, a parameter dtype that cannot hold ``dtype`` exactly,
                tensors the sender publishes separately but vLLM ties, or (``strict``) parameter
                elements no published tensor covers.
            UnsupportedLayoutError: a layer the map does not understand (quantized, repacked,
                unknown class or loader, non-Triton MoE backend, padded MoE dims, EPLB, ...).
        """
        key = (tuple(sorted(shapes.items())), tuple(sorted(aliases.items())), dtype)
        if key == self._key:
            return
        self._expert_ids = {}  # re-read expert placement on every new map
        entries: dict[str, _Entry] = {}
        for name, shape in shapes.items():
            entries[name] = self._resolve(name, tuple(int(s) for s in shape))
        for alias, canon in aliases.items():
            if canon not in entries:
                raise IncompatibleTargetError(f"alias {alias!r} names {canon!r}, which is not published")
            mirror = self._resolve(alias, entries[canon].shape)
            self._add_mirror(entries[canon], mirror)
        for e in entries.values():
            for p in e.places:
                if not _holds_exactly(p.param.dtype, dtype):
                    raise IncompatibleTargetError(
                        f"vLLM parameter {p.vname!r} (for {e.name!r}) is {p.param.dtype}, which cannot hold every "
                        f"{dtype} value exactly"
                    )
        self._check_coverage(entries)
        self._entries = entries
        self._key = key

    def owned(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(k,)`` on ``positions``' device: which global flat indices this rank holds.

        Raises:
            CorruptObjectError: a position outside ``[0, numel)`` of the HF tensor.
        """
        e = self._entry(name)
        if not e.places:
            return torch.zeros_like(positions, dtype=torch.bool)
        self._check_range(e, positions)
        p = e.places[0]
        if p.affine is not None:  # a block of whole rows: two compares, no division
            lo, hi, _ = p.affine
            return (positions >= lo) & (positions < hi)
        if p.grid is not None and _native.enabled() and positions.device.type == "cpu" and positions.dtype == torch.int64:
            ncols, rows, cols, _, _ = p.grid  # one pass, no division per element
            out = torch.empty(positions.shape, dtype=torch.bool)
            _native_apply.grid_held(positions.contiguous().numpy(), ncols, rows, cols, out.numpy())
            return out
        mask, _ = self._map(e, p, positions.to(p.param.device))
        if mask is None:
            return torch.ones_like(positions, dtype=torch.bool)
        return mask.to(positions.device)

    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        e = self._entry(name)
        p = self._primary(e)
        local = self._owned_local(e, p, positions)
        return _flat(p.param)[local].to(dtype).to(positions.device)

    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the held elements at ``positions`` (global flat, all owned) with ``values``.

        Raises:
            CorruptObjectError: a position this rank does not hold or outside the tensor (the
                receiver only passes owned positions; nothing is written then).
        """
        e = self._entry(name)
        if positions.numel() == 0:
            return
        if values.shape != positions.shape:
            raise CorruptObjectError(f"{name!r}: {positions.numel()} positions but values of shape {tuple(values.shape)}")
        if self._write_native(e, positions, values):
            return
        locals_ = [self._owned_local(e, p, positions) for p in self._places(e)]  # validate all first
        with torch.no_grad():
            for p, local in zip(e.places, locals_):
                # index_copy_ into the live storage: cost per changed element, whatever the parameter
                # size; never `.data = ...` (CUDA graphs and torch.compile keep the storage pointers).
                _flat(p.param).index_copy_(0, local, values.to(device=p.param.device, dtype=p.param.dtype))

    def _write_native(self, e: _Entry, positions: torch.Tensor, values: torch.Tensor) -> bool:
        """:meth:`write` with the compiled kernels: the map and the scatter fused in one pass per
        place (no offset, mask or division temporaries; ~1-3 ns per change instead of 6-10 on
        row-parallel tensors). False, writing nothing, where the torch path must run: no kernels,
        not on the CPU, a place without a 1-D/2-D map or of another dtype than ``values``. A
        position this rank does not hold makes the torch path raise its error; nothing is written."""
        places = self._places(e)
        if (not _native.enabled() or positions.device.type != "cpu" or values.device.type != "cpu"
                or positions.dtype != torch.int64
                or any(p.param.device.type != "cpu" or p.param.dtype != values.dtype
                       or (p.affine is None and p.grid is None) for p in places)):
            return False
        pos = positions.contiguous()
        pos_np, vals = pos.numpy(), _native_apply.np_bits(values.contiguous())
        pmin, pmax = (int(x) for x in torch.aminmax(pos))
        offsets = []
        for p in places:  # validate every place before the first write
            if p.affine is not None:
                lo, hi, offset = p.affine
                if pmin < lo or pmax >= hi:
                    self._owned_local(e, p, positions)  # raises the specific error
                    raise AssertionError("unreachable")  # pragma: no cover
                offsets.append(offset)
            else:
                ncols, rows, cols, _, _ = p.grid
                if _native_apply.grid_first_bad(pos_np, math.prod(e.shape), ncols, rows, cols) >= 0:
                    self._owned_local(e, p, positions)
                    raise AssertionError("unreachable")  # pragma: no cover
                offsets.append(None)
        for p, offset in zip(places, offsets):
            flat = _native_apply.np_bits(_flat(p.param))
            if offset is not None:
                _native_apply.scatter(flat, pos_np, vals, offset)
            else:
                ncols, rows, cols, s0, s1 = p.grid
                _native_apply.scatter_grid(flat, pos_np, vals, ncols, rows, cols, s0, s1, p.base)
        return True

    @torch.no_grad()
    def assign(self, name: str, full: torch.Tensor) -> None:
        """Write this rank's part of ``full`` (full HF shape, inference dtype) and zero padding rows."""
        e = self._entry(name)
        if tuple(full.shape) != e.shape:
            raise CorruptObjectError(f"{name!r}: full tensor of shape {tuple(full.shape)}, expected {e.shape}")
        for p in e.places:
            flat = _flat(p.param)
            for gidx, local in self._walk(e, p):
                src = full.reshape(-1)[gidx.to(full.device)]
                flat.index_copy_(0, local, src.to(device=p.param.device, dtype=p.param.dtype))
            if p.pad_rows is not None:
                p.param.detach()[p.pad_rows[0]:p.pad_rows[1]].zero_()

    def checksum(self, name: str, dtype: torch.dtype) -> int:
        """Partial checksum of the elements of ``name`` this rank counts (see the module doc): the
        partials of all ranks of one engine add up to the full tensor's checksum."""
        e = self._entry(name)
        if not e.places or not e.places[0].counted:
            return 0
        p = e.places[0]
        flat = _flat(p.param)
        total = 0
        for gidx, local in self._walk(e, p):
            vals = flat[local]
            total += _checksum(vals if vals.dtype == dtype else vals.to(dtype), gidx)
        return total & ((1 << 64) - 1)

    # --- introspection ---------------------------------------------------------------------------

    @property
    def ignored(self) -> list[str]:
        """Published names vLLM's own name mapper drops (never written; their checksum is 0)."""
        return [n for n, e in self._entries.items() if e.ignored]

    @property
    def tp_rank_size(self) -> tuple[int, int]:
        """``(tp_rank, tp_size)`` used to count replicated elements once."""
        if self._tp is None:
            self._tp = self._find_tp()
        return self._tp

    def describe(self, name: str) -> list[dict[str, Any]]:
        """Where HF tensor ``name`` lands on this rank: one dict per vLLM parameter with its name,
        local shape, the held element count and whether this rank counts it in checksums."""
        e = self._entry(name)
        return [dict(vname=p.vname, local_shape=tuple(p.param.shape), held=p.held_numel(e.shape), counted=p.counted)
                for p in e.places]

    # --- the map ---------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            raise IncompatibleTargetError(f"tensor {name!r} is unknown to this target; call check() with the manifest first")
        return e

    @staticmethod
    def _primary(e: _Entry) -> _Place:
        if not e.places:
            raise CorruptObjectError(f"{e.name!r}: this rank holds no element of it")
        return e.places[0]

    def _places(self, e: _Entry) -> list[_Place]:
        self._primary(e)
        return e.places

    @staticmethod
    def _check_range(e: _Entry, positions: torch.Tensor) -> None:
        if positions.numel():
            lo, hi = (int(x) for x in torch.aminmax(positions))
            if lo < 0 or hi >= math.prod(e.shape):
                raise CorruptObjectError(
                    f"{e.name!r}: positions outside [0, {math.prod(e.shape)}) (min {lo}, max {hi})")

    def _map(self, e: _Entry, p: _Place, pos: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(owned mask or None for all, local offsets)`` of int64 global flat ``pos`` (on the
        parameter's device); offsets of not-owned entries are meaningless. About 6 passes over
        ``pos`` for a 2-D tensor: one integer division, one table gather, multiply-adds."""
        pos = pos.to(torch.int64)
        coords: list[torch.Tensor] = []
        rem = pos
        for size in reversed(e.shape[1:]):
            q = torch.div(rem, size, rounding_mode="floor")
            coords.append(rem - q * size)  # cheaper than a second division (rem % size)
            rem = q
        coords.append(rem)
        coords.reverse()
        local: torch.Tensor | None = None
        mask = None
        for c, t, s in zip(coords, p.tables, p.strides):
            if t is not None:
                c = t.index_select(0, c)  # ~1 ns per element; t[c] takes ~3
                m = c >= 0
                mask = m if mask is None else mask.logical_and_(m)
            term = c * s if s != 1 else c
            local = term if local is None else local.add_(term)
        assert local is not None
        if p.base:
            local = local + p.base
        if local.data_ptr() == pos.data_ptr():
            local = local.clone()  # never alias the caller's positions
        return mask, local

    def _owned_local(self, e: _Entry, p: _Place, positions: torch.Tensor) -> torch.Tensor:
        if p.affine is not None and positions.numel():
            lo, hi, offset = p.affine
            pmin, pmax = (int(x) for x in torch.aminmax(positions))
            if pmin >= lo and pmax < hi:
                return positions.to(device=p.param.device, dtype=torch.int64) + offset
        self._check_range(e, positions)
        mask, local = self._map(e, p, positions.to(p.param.device))
        if mask is not None and not bool(mask.all()):
            bad = int(positions.to(mask.device)[~mask][0])
            raise CorruptObjectError(f"{e.name!r}: global index {bad} is not held by this rank ({p.vname})")
        return local

    def _walk(self, e: _Entry, p: _Place) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every element ``p`` holds as ``(global flat indices, local offsets)`` int64 chunks of
        about ``_CHUNK`` elements, in HF row-major order (on the parameter's device)."""
        dev = p.param.device
        own = [torch.arange(n, device=dev) if t is None else torch.nonzero(t >= 0).squeeze(1)
               for t, n in zip(p.tables, e.shape)]
        loc = [o if t is None else t[o] for o, t in zip(own, p.tables)]
        if any(o.numel() == 0 for o in own):
            return
        hf_strides = [math.prod(e.shape[d + 1:]) for d in range(len(e.shape))]
        # Flatten dims 1.. once (small: a row of the tensor), then walk dim 0 in chunks.
        g_tail = torch.zeros(1, dtype=torch.int64, device=dev)
        l_tail = torch.zeros(1, dtype=torch.int64, device=dev)
        for d in range(1, len(e.shape)):
            g_tail = (g_tail[:, None] + own[d][None, :] * hf_strides[d]).reshape(-1)
            l_tail = (l_tail[:, None] + loc[d][None, :] * p.strides[d]).reshape(-1)
        rows = max(1, _CHUNK // max(1, g_tail.numel()))
        for a in range(0, own[0].numel(), rows):
            g = own[0][a:a + rows, None] * hf_strides[0] + g_tail[None, :]
            lo = p.base + loc[0][a:a + rows, None] * p.strides[0] + l_tail[None, :]
            yield g.reshape(-1), lo.reshape(-1)

    def _add_mirror(self, canon: _Entry, mirror: _Entry) -> None:
        """An alias the sender ties to ``canon``: nothing to do if vLLM ties them too (same storage),
        else its parameter is written like ``canon``'s (never counted)."""
        if mirror.ignored or not mirror.places:
            return
        if not canon.places:
            raise UnsupportedLayoutError(f"{mirror.name!r} is held here but its tied tensor {canon.name!r} is not")
        for m in mirror.places:
            if any(_same_tensor(m.param, p.param) for p in canon.places):
                continue
            c = canon.places[0]
            same = m.strides == c.strides and m.base == c.base and all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(m.tables, c.tables))
            if not same:
                raise UnsupportedLayoutError(
                    f"{mirror.name!r} (tied to {canon.name!r} by the sender) is laid out differently from it in vLLM"
                )
            canon.places.append(dataclasses.replace(m, counted=False))

    def _check_coverage(self, entries: dict[str, _Entry]) -> None:
        """Every element of every parameter must be written by exactly one published tensor (or be
        padding); counted by sizes, so a parameter two tensors land on is caught as over-covered."""
        covered: dict[int, int] = {}
        who: dict[int, list[str]] = {}
        for e in entries.values():
            for p in e.places:
                k = id(p.param)
                n = p.held_numel(e.shape) + (0 if p.pad_rows is None else
                                             (p.pad_rows[1] - p.pad_rows[0]) * math.prod(p.param.shape[1:]))
                covered[k] = covered.get(k, 0) + n
                who.setdefault(k, []).append(e.name)
        seen: set[int] = set()
        missing = []
        for vname, param in self.model.named_parameters():
            k = id(param)
            if k in seen:
                continue
            seen.add(k)
            n = covered.get(k, 0)
            if n > param.numel():
                raise IncompatibleTargetError(
                    f"vLLM parameter {vname!r} would receive {n} elements but holds {param.numel()}: "
                    f"{who[k]} land on it; does vLLM tie tensors the sender publishes separately?"
                )
            if n < param.numel() and self.strict:
                missing.append(f"{vname} ({param.numel() - n} of {param.numel()} elements)")
        if missing:
            raise IncompatibleTargetError(
                f"vLLM parameters not covered by the published tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                f"({len(missing)} in all); publish them, or pass strict=False to leave them alone"
            )

    # --- resolving one HF name -------------------------------------------------------------------

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """HF name -> (vLLM parameter name, stacked shard index) through the model's own name
        mapper (``hf_to_vllm_mapper``, vLLM >= 0.2x), else its ``packed_modules_mapping``;
        ``None`` when vLLM drops the tensor."""
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
            r = mapper._map_name_with_shard(hf_name)
            if r is None:
                return None
            vname, shard = r
            if isinstance(shard, list):
                raise UnsupportedLayoutError(f"{hf_name!r} loads into several shards {shard}; not supported")
            if isinstance(shard, str):
                shard = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
                if isinstance(shard, str):
                    raise UnsupportedLayoutError(f"{hf_name!r}: unknown shard id {shard!r}")
            return vname, shard
        for fused, parts in (getattr(self.model, "packed_modules_mapping", None) or {}).items():
            for i, part in enumerate(parts):
                if f".{part}." in hf_name:
                    return hf_name.replace(f".{part}.", f".{fused}.", 1), i
        return hf_name, None

    def _module(self, path: str) -> nn.Module | None:
        """The submodule at ``path``; ``None`` when a pipeline stage other than this one holds it.

        Raises:
            IncompatibleTargetError: no such module.
        """
        C = _classes()
        mod = self.model
        for part in path.split(".") if path else []:
            if isinstance(mod, C.PPMissing):
                return None
            child = mod._modules.get(part)
            if child is None:
                raise IncompatibleTargetError(f"the vLLM model has no module {path!r}")
            mod = child
        return None if isinstance(mod, C.PPMissing) else mod

    def _resolve(self, hf_name: str, shape: tuple[int, ...]) -> _Entry:
        e = _Entry(hf_name, shape)
        mapped = self._map_name(hf_name)
        if mapped is None:
            e.ignored = True
            return e
        vname, shard = mapped
        if ".base_layer." in vname:
            raise UnsupportedLayoutError(f"{hf_name!r}: LoRA-wrapped layers ({vname!r}) are not supported")
        mod_path, _, leaf = vname.rpartition(".")
        moe = re.match(r"^(.*\.experts)\.(.+)$", vname)
        try:
            module = self._module(mod_path)
        except IncompatibleTargetError:
            if moe is None:
                raise IncompatibleTargetError(
                    f"published tensor {hf_name!r} (vLLM name {vname!r}) is unknown to the vLLM model") from None
            module = "moe"
        if module is None:
            return e  # another pipeline stage holds it
        if module != "moe" and leaf in module._parameters and module._parameters[leaf] is not None:
            e.places = [_with_grid(_with_affine(p, shape), shape)
                        for p in self._dense(hf_name, vname, module, leaf, shard, shape)]
            return e
        if moe is not None:
            experts = self._module(moe.group(1))
            if experts is None:
                return e
            place = self._moe(hf_name, vname, experts, moe.group(2), shape)
            e.places = [] if place is None else [_with_grid(_with_affine(place, shape), shape)]
            return e
        if hasattr(module, "cpu_linear"):
            raise UnsupportedLayoutError(f"{hf_name!r}: {mod_path!r} was repacked for CPU GEMM (its weight is gone)")
        raise IncompatibleTargetError(f"published tensor {hf_name!r} (vLLM name {vname!r}) is unknown to the vLLM model")

    def _table(self, n: int, blocks: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
        """Lookup table of length ``n``: for each ``(src_start, size, dst_start)`` block,
        ``T[src_start + i] = dst_start + i``; ``-1`` elsewhere. Cached (layers share tables)."""
        key = (n, blocks, str(device))
        t = self._tables.get(key)
        if t is None:
            t = torch.full((n,), -1, dtype=torch.int64, device=device)
            for src, size, dst in blocks:
                if size > 0:
                    t[src:src + size] = torch.arange(dst, dst + size, dtype=torch.int64, device=device)
            self._tables[key] = t
        return t

    def _find_tp(self) -> tuple[int, int]:
        r, n = self._tp_override
        if r is not None and n is not None:
            return r, n
        C = _classes()
        seen = {(int(m.tp_rank), int(m.tp_size)) for m in self.model.modules()
                if isinstance(m, (C.linear.LinearBase, C.Vocab)) and int(getattr(m, "tp_size", 1)) > 1}
        if len(seen) > 1:
            raise UnsupportedLayoutError(f"layers disagree on the TP rank/size: {sorted(seen)}; pass tp_rank= and tp_size=")
        found = seen.pop() if seen else (0, 1)
        return (found[0] if r is None else r), (found[1] if n is None else n)

    def _counted(self, module_tp: int, module_rank: int, replicas: int = 1) -> bool:
        """Whether this rank counts an element that the module holds at module rank
        ``module_rank``, replicated over ``replicas`` consecutive module ranks."""
        g_rank, g_size = self.tp_rank_size
        if module_tp == 1 and g_size > 1:
            return g_rank == 0  # replicated over the whole TP group
        if module_tp != g_size:
            raise UnsupportedLayoutError(f"a layer is split over {module_tp} ranks inside a TP group of {g_size}")
        return module_rank % replicas == 0

    def _check_param(self, hf_name: str, vname: str, module: nn.Module, param: torch.Tensor,
                     loaders: tuple[Any, ...]) -> None:
        for attr in _PACKED_ATTRS:
            if getattr(param, attr, None) not in (None, False):
                raise UnsupportedLayoutError(f"{hf_name!r}: vLLM parameter {vname!r} is packed or transposed ({attr})")
        if hasattr(module, "cpu_linear") or getattr(module, "_bf16x3_weight", None) is not None:
            raise UnsupportedLayoutError(f"{hf_name!r}: {vname!r} has a derived (repacked) copy an in-place write would miss")
        if not param.is_floating_point():
            raise UnsupportedLayoutError(f"{hf_name!r}: vLLM parameter {vname!r} is {param.dtype}, not floating point")
        loader = getattr(param, "weight_loader", None)
        func = getattr(loader, "__func__", loader)
        if loader is not None and func not in loaders:
            raise UnsupportedLayoutError(
                f"{hf_name!r}: vLLM parameter {vname!r} uses weight loader {getattr(func, '__qualname__', func)!r}, "
                "whose layout this map does not know"
            )
        if not _non_overlapping(param):
            raise UnsupportedLayoutError(f"{hf_name!r}: vLLM parameter {vname!r} has an overlapping layout {param.stride()}")

    def _dense(self, hf_name: str, vname: str, module: nn.Module, leaf: str, shard: int | None,
               shape: tuple[int, ...]) -> list[_Place]:
        C = _classes()
        param = module._parameters[leaf]
        cls = type(module)
        dev = param.device

        def bad_shape(expected) -> IncompatibleTargetError:
            return IncompatibleTargetError(
                f"published tensor {hf_name!r} has shape {shape}, the vLLM layer {vname!r} expects {tuple(expected)}")

        def place(tables, counted, pad_rows=None, base=0) -> list[_Place]:
            return [_Place(param, vname, base, tuple(tables), tuple(param.stride()), counted, pad_rows)]

        if cls in C.norms:
            self._check_param(hf_name, vname, module, param, (C.default_loader,))
            if shard is not None or tuple(param.shape) != shape:
                raise bad_shape(param.shape)
            return place([None] * len(shape), self._counted(1, 0))

        if cls in (C.Replicated, C.Gate):
            self._check_linear(hf_name, vname, module, param)
            if shard is not None or tuple(param.shape) != shape:
                raise bad_shape(param.shape)
            return place([None] * len(shape), self._counted(1, 0))

        if cls in (C.Vocab, C.LMHead):
            if type(module.quant_method) is not C.embedding_method:
                raise UnsupportedLayoutError(f"{hf_name!r}: {vname!r} uses {type(module.quant_method).__name__}")
            self._check_param(hf_name, vname, module, param, (C.Vocab.weight_loader,))
            if getattr(module, "num_added_embeddings", 0) or shard is not None:
                raise UnsupportedLayoutError(f"{hf_name!r}: {vname!r} has added (LoRA) vocabulary; not supported")
            si = module.shard_indices
            start, end = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
            per = int(module.num_embeddings_per_partition)
            if shape[0] != int(module.org_vocab_size) or tuple(param.shape) != (per, *shape[1:]):
                raise bad_shape((module.org_vocab_size, *param.shape[1:]))
            rows = self._table(shape[0], ((start, end - start, 0),), dev)
            pad = (end - start, per) if end - start < per else None
            return place([rows] + [None] * (len(shape) - 1), self._counted(int(module.tp_size), int(module.tp_rank)), pad)

        if cls not in (C.QKV, C.Merged, C.Column, C.Row):
            raise UnsupportedLayoutError(f"{hf_name!r}: vLLM layer {vname!r} is a {cls.__qualname__}, which this map does not support")
        self._check_linear(hf_name, vname, module, param)
        tp, r = int(module.tp_size), int(module.tp_rank)
        is_weight = leaf == "weight"
        if is_weight and (len(shape) != 2 or param.dim() != 2):
            raise bad_shape(param.shape)
        if not is_weight and (leaf != "bias" or len(shape) != 1 or param.dim() != 1):
            raise UnsupportedLayoutError(f"{hf_name!r}: parameter {vname!r} of a {cls.__qualname__} is not supported")
        cols = [None] if is_weight else []
        if is_weight and shape[1] != int(module.input_size):
            raise bad_shape((shape[0], module.input_size))

        if cls is C.Row:
            if shard is not None:
                raise UnsupportedLayoutError(f"{hf_name!r}: stacked shard {shard} into a RowParallelLinear")
            if not is_weight:  # bias: full copy on every rank, added by rank 0 only
                if tuple(param.shape) != shape:
                    raise bad_shape(param.shape)
                return place([None], self._counted(tp, r, replicas=tp))
            s = int(module.input_size_per_partition)
            if tuple(param.shape) != (shape[0], s):
                raise bad_shape((shape[0], s * tp))
            return place([None, self._table(shape[1], ((r * s, s, 0),), dev)], self._counted(tp, r))

        if cls is C.QKV:
            if shard not in (0, 1, 2):
                raise UnsupportedLayoutError(f"{hf_name!r}: QKVParallelLinear {vname!r} needs a q/k/v shard, got {shard}")
            hl, kl, rep = int(module.num_heads), int(module.num_kv_heads), int(module.num_kv_head_replicas)
            d = int(module.head_size)
            dv = int(getattr(module, "v_head_size", d))
            sizes = (hl * d, kl * d, kl * dv)
            offsets = (0, hl * d, (hl + kl) * d)
            total = (int(module.total_num_heads) * d, int(module.total_num_kv_heads) * d, int(module.total_num_kv_heads) * dv)
            src_rank = r if shard == 0 else r // rep
            if tuple(param.shape)[0] != sum(sizes):
                raise UnsupportedLayoutError(f"{hf_name!r}: {vname!r} has {param.shape[0]} rows, expected {sum(sizes)}")
            if shape[0] != total[shard]:
                raise bad_shape((total[shard], *shape[1:]))
            rows = self._table(shape[0], ((src_rank * sizes[shard], sizes[shard], offsets[shard]),), dev)
            return place([rows] + cols, self._counted(tp, r, replicas=1 if shard == 0 else rep))

        if cls is C.Merged:
            out = [int(o) for o in module.output_sizes]
            if shard is None or not 0 <= shard < len(out):
                raise UnsupportedLayoutError(
                    f"{hf_name!r}: MergedColumnParallelLinear {vname!r} needs a shard index in [0, {len(out)}), got {shard} "
                    "(fused-on-disk tensors are not supported)")
            per = [o // tp for o in out]
            if shape[0] != out[shard] or tuple(param.shape)[0] != sum(per):
                raise bad_shape((out[shard], *shape[1:]))
            rows = self._table(shape[0], ((r * per[shard], per[shard], sum(per[:shard])),), dev)
            return place([rows] + cols, self._counted(tp, r))

        # ColumnParallelLinear
        if shard is not None:
            raise UnsupportedLayoutError(f"{hf_name!r}: stacked shard {shard} into a ColumnParallelLinear")
        s = int(module.output_size_per_partition)
        if shape[0] != s * tp or tuple(param.shape)[0] != s:
            raise bad_shape((s * tp, *shape[1:]))
        return place([self._table(shape[0], ((r * s, s, 0),), dev)] + cols, self._counted(tp, r))

    def _check_linear(self, hf_name: str, vname: str, module: nn.Module, param: torch.Tensor) -> None:
        C = _classes()
        qm = type(getattr(module, "quant_method", None))
        if qm not in C.linear_methods:
            raise UnsupportedLayoutError(
                f"{hf_name!r}: {vname!r} uses {qm.__name__} (quantized or custom weights); only unquantized layers "
                "can take element-wise deltas")
        cls = type(module)
        loaders = tuple(f for f in (getattr(cls, "weight_loader", None), getattr(cls, "weight_loader_v2", None)) if f)
        self._check_param(hf_name, vname, module, param, loaders)

    def _moe(self, hf_name: str, vname: str, experts: nn.Module, tail: str, shape: tuple[int, ...]) -> _Place | None:
        C = _classes()
        routed = experts if isinstance(experts, C.RoutedExperts) else getattr(experts, "routed_experts", None)
        if type(routed) is not C.RoutedExperts:
            raise UnsupportedLayoutError(f"{hf_name!r}: {vname!r} is not a RoutedExperts layer this map knows")
        qm = routed.quant_method
        if type(qm) is not C.moe_method:
            raise UnsupportedLayoutError(f"{hf_name!r}: MoE layer uses {type(qm).__name__}; only unquantized experts")
        backend = getattr(getattr(qm, "unquantized_backend", None), "name", None)
        if backend not in self.moe_backends:
            raise UnsupportedLayoutError(
                f"{hf_name!r}: MoE backend {backend} re-lays out the expert weights; supported: {self.moe_backends}")
        cfg = routed.moe_config
        pc = cfg.moe_parallel_config
        if getattr(pc, "enable_eplb", False):
            raise UnsupportedLayoutError(f"{hf_name!r}: expert load balancing moves experts at runtime; not supported")
        if not cfg.is_act_and_mul or getattr(routed, "is_fused_checkpoint_transposed", False):
            raise UnsupportedLayoutError(f"{hf_name!r}: non-gated or transposed MoE checkpoints are not supported")
        if getattr(routed.expert_map_manager, "num_fused_shared_experts", 0):
            raise UnsupportedLayoutError(f"{hf_name!r}: fused shared experts are not supported")
        if any(routed._parameters.get(b) is not None for b in ("w13_bias", "w2_bias")):
            raise UnsupportedLayoutError(f"{hf_name!r}: MoE expert biases are not supported")
        w13, w2 = routed.w13_weight, routed.w2_weight
        for pname, p in (("w13_weight", w13), ("w2_weight", w2)):
            self._check_param(hf_name, f"{vname} -> {pname}", routed, p, (C.RoutedExperts.weight_loader,))
        n_experts = int(routed.global_num_experts)
        e_loc, two_il, hid = (int(x) for x in w13.shape)
        il = two_il // 2
        tp, r = int(pc.tp_size), int(cfg.tp_rank)
        if tuple(w2.shape) != (e_loc, hid, il) or hid != int(routed.hidden_size):
            raise UnsupportedLayoutError(f"{hf_name!r}: padded MoE weights {tuple(w13.shape)}/{tuple(w2.shape)}")
        inter = il * tp
        if int(cfg.intermediate_size_per_partition) != il:
            raise UnsupportedLayoutError(f"{hf_name!r}: padded MoE intermediate size")
        gate, up, down = routed.ckpt_gate_proj_name, routed.ckpt_up_proj_name, routed.ckpt_down_proj_name
        dev = w13.device
        rows = ((r * il, il, 0),)
        # The loader's own global -> local expert map (-1: on another EP rank), once per layer.
        expert_ids = self._expert_ids.get(id(routed))
        if expert_ids is None or len(expert_ids) != n_experts:
            expert_ids = [int(routed._map_global_expert_id_to_local_expert_id(g)) for g in range(n_experts)]
            self._expert_ids[id(routed)] = expert_ids

        def bad(expected) -> IncompatibleTargetError:
            return IncompatibleTargetError(f"published tensor {hf_name!r} has shape {shape}, vLLM expects {tuple(expected)}")

        fused_gate_up = "gate_up_proj" if (gate, up) == ("gate_proj", "up_proj") else "w13" if (gate, up) == ("w1", "w3") else None
        if tail == fused_gate_up:
            if shape != (n_experts, 2 * inter, hid):
                raise bad((n_experts, 2 * inter, hid))
            et = self._expert_table(expert_ids, dev)
            rt = self._table(2 * inter, ((r * il, il, 0), (inter + r * il, il, il)), dev)
            return _Place(w13, f"{vname}->w13_weight", 0, (et, rt, None), tuple(w13.stride()), True)
        if tail == down:
            if shape != (n_experts, hid, inter):
                raise bad((n_experts, hid, inter))
            et = self._expert_table(expert_ids, dev)
            return _Place(w2, f"{vname}->w2_weight", 0, (et, None, self._table(inter, rows, dev)),
                          tuple(w2.stride()), True)
        m = re.fullmatch(r"(\d+)\.(\w+)\.weight", tail)
        if m is None or m.group(2) not in (gate, up, down) or int(m.group(1)) >= n_experts:
            raise IncompatibleTargetError(f"published tensor {hf_name!r} is unknown to the vLLM MoE layer {vname!r}")
        le = expert_ids[int(m.group(1))]
        which = m.group(2)
        if which == down:
            if shape != (hid, inter):
                raise bad((hid, inter))
            if le < 0:
                return None
            return _Place(w2, f"{vname}->w2_weight[{le}]", le * w2.stride(0), (None, self._table(inter, rows, dev)),
                          tuple(w2.stride()[1:]), True)
        if shape != (inter, hid):
            raise bad((inter, hid))
        if le < 0:
            return None
        dst = 0 if which == gate else il
        return _Place(w13, f"{vname}->w13_weight[{le}]", le * w13.stride(0),
                      (self._table(inter, ((r * il, il, dst),), dev), None), tuple(w13.stride()[1:]), True)

    def _expert_table(self, expert_ids: list[int], device: torch.device) -> torch.Tensor:
        key = ("experts", tuple(expert_ids), str(device))
        t = self._tables.get(key)
        if t is None:
            t = torch.tensor(expert_ids, dtype=torch.int64, device=device)
            self._tables[key] = t
        return t


def _with_affine(p: _Place, shape: tuple[int, ...]) -> _Place:
    """``p`` with its ``affine`` fast path filled in when it holds a block of whole HF rows stored
    row-major with the HF row length (column-parallel, merged, QKV, vocab and replicated tensors):
    then global flat ``[lo, hi)`` is exactly what it holds and ``local = global + offset``."""
    row = math.prod(shape[1:])
    if p.strides[0] != row and shape[0] > 1:
        return p
    for d in range(1, len(shape)):
        if p.tables[d] is not None or (shape[d] > 1 and p.strides[d] != math.prod(shape[d + 1:])):
            return p
    t = p.tables[0]
    if t is None:
        a, b, dst = 0, shape[0], 0
    else:
        held = torch.nonzero(t >= 0).squeeze(1)
        if held.numel() == 0:
            return p
        a, b = int(held[0]), int(held[-1]) + 1
        dst = int(t[a])
        if held.numel() != b - a or not torch.equal(t[a:b].cpu(), torch.arange(dst, dst + b - a)):
            return p
    return dataclasses.replace(p, affine=(a * row, b * row, p.base + (dst - a) * row))


def _with_grid(p: _Place, shape: tuple[int, ...]) -> _Place:
    """``p`` with its ``grid`` (the compiled kernels' form of its map) filled in when its tensor is
    1-D or 2-D and lives on the CPU: a 1-D tensor is one row of ``shape[0]`` columns."""
    if p.param.device.type != "cpu" or len(shape) not in (1, 2) or math.prod(shape) == 0:
        return p

    def table(t: torch.Tensor | None) -> np.ndarray:
        return np.empty(0, np.int64) if t is None else t.contiguous().numpy()

    if len(shape) == 1:
        grid = (shape[0], np.empty(0, np.int64), table(p.tables[0]), 0, p.strides[0])
    else:
        grid = (shape[1], table(p.tables[0]), table(p.tables[1]), p.strides[0], p.strides[1])
    return dataclasses.replace(p, grid=grid)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


def _non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (sorted strides each cover the dims below)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return False
        span = s * n
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D alias over the storage span of ``t`` (same memory, no copy): element offset
    ``sum(coord_d * stride_d)`` of ``t`` is index ``offset`` here. Works for padded (row-strided)
    layouts too, so writes never rebind or copy the parameter."""
    d = t.detach()
    if d.is_contiguous():
        return d.view(-1)
    span = 1 + sum((n - 1) * s for n, s in zip(d.shape, d.stride()) if n > 0)
    return d.as_strided((span,), (1,), d.storage_offset())
