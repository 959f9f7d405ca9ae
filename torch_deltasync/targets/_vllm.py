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
from typing import Any, Iterator

import torch
from torch import nn

from .. import _native, _native_apply
from .._dtypes import index_copy_, narrow
from ..checksum import checksum as _checksum
from ..errors import CorruptObjectError, IncompatibleTargetError, UnsupportedLayoutError
from ._base import Target, narrow_exactly

from ._vllm_layout import DEFAULT_MOE_BACKENDS, _Entry, _flat, _holds_exactly, _Place, _same_tensor, _VLLMLayout

__all__ = ["VLLMTarget", "DEFAULT_MOE_BACKENDS"]

# Elements per step when walking every held element (checksums, anchors): bounds temporaries.
_CHUNK = 1 << 20

class VLLMTarget(_VLLMLayout, Target):
    """One vLLM worker's model (one TP rank) as a :class:`~torch_deltasync.DeltaReceiver` target.

    Build one per worker and give it to a ``DeltaReceiver``; inside a live engine the ``deltasync``
    backend uses it, through :class:`~torch_deltasync.targets.VLLMEngineTarget`, for
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
        allow_derived: map parameters of layers that also hold a *derived* copy of them (vLLM's
            CPU build gives an embedding a packed copy for the tied ``lm_head`` GEMM,
            ``dispatch_cpu_unquantized_gemm``), which an in-place write leaves stale; only for a
            caller that re-derives the copy itself (the engine target's prepared commits).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> target = VLLMTarget(worker.model_runner.get_model())
        >>> receiver = DeltaReceiver(target, "s3://bucket/runs", prefix="run-7")
        >>> receiver.update()
    """

    holds_all = False
    concurrent_reads = True  # see Target: read and owned use the maps built by check(), read-only

    def __init__(self, model: nn.Module, *, strict: bool = True,
                 moe_backends: tuple[str, ...] | list[str] = DEFAULT_MOE_BACKENDS,
                 tp_rank: int | None = None, tp_size: int | None = None, allow_derived: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected the vLLM model (an nn.Module), got {type(model).__name__}")
        self.model = model
        self.strict = strict
        self.moe_backends = tuple(moe_backends)
        self._tp_override = (tp_rank, tp_size)
        self.allow_derived = allow_derived
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
        """The held values at ``positions`` (int64 ``(k,)`` global flat, all owned), ``(k,)`` in
        ``dtype`` on ``positions``' device.

        Raises:
            CorruptObjectError: a position this rank does not hold or outside the tensor.
        """
        e = self._entry(name)
        p = self._primary(e)
        out = self._read_native(e, p, positions, dtype)
        if out is not None:
            return out
        local = self._owned_local(e, p, positions)
        return narrow(_flat(p.param)[local], dtype).to(positions.device)

    def _read_native(self, e: _Entry, p: _Place, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """:meth:`read` with the compiled kernels (the map fused with the gather, as in
        :meth:`_write_native`); ``None`` where the torch path must run: no kernels, not on the
        CPU, another dtype, or a position the place does not hold (the torch path raises then)."""
        if (not _native.enabled() or positions.device.type != "cpu" or positions.dtype != torch.int64
                or positions.dim() != 1 or p.param.device.type != "cpu" or p.param.dtype != dtype
                or (p.affine is None and p.grid is None)):
            return None
        pos = positions.contiguous()
        pos_np = pos.numpy()
        out = torch.empty(pos.shape, dtype=dtype)
        flat, o = _native_apply.np_bits(_flat(p.param)), _native_apply.np_bits(out)
        if p.affine is not None:
            lo, hi, offset = p.affine
            if pos.numel():
                pmin, pmax = (int(x) for x in torch.aminmax(pos))
                if pmin < lo or pmax >= hi:
                    return None
            return out if _native_apply.gather(flat, pos_np, o, offset) < 0 else None
        ncols, rows, cols, s0, s1 = p.grid
        if _native_apply.grid_first_bad(pos_np, math.prod(e.shape), ncols, rows, cols) >= 0:
            return None
        _native_apply.gather_grid(flat, pos_np, o, ncols, rows, cols, s0, s1, p.base)
        return out

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
                index_copy_(_flat(p.param), local, values)

    def _write_native(self, e: _Entry, positions: torch.Tensor, values: torch.Tensor) -> bool:
        """:meth:`write` with the compiled kernels: the map and the scatter fused in one pass per
        place (no offset, mask or division temporaries; ~1-3 ns per change instead of 6-10 on
        row-parallel tensors). False, writing nothing, where the torch path must run: no kernels,
        not on the CPU, a place without a 1-D/2-D map or of another dtype than ``values``. A
        position this rank does not hold makes the torch path raise its error; nothing is written."""
        places = self._places(e)
        if (not _native.enabled() or positions.device.type != "cpu" or values.device.type != "cpu"
                or positions.dtype != torch.int64 or positions.dim() != 1
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
                index_copy_(flat, local, src)
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
            total += _checksum(narrow_exactly(vals, dtype, name), gidx)
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

    def _check_coverage(self, entries: dict[str, _Entry], *, only: set[int] | None = None,
                        strict: bool | None = None) -> None:
        """Every element of every parameter (of those whose ``id`` is in ``only``, if given) must be
        written by exactly one published tensor (or be padding); counted by sizes, so a parameter two
        tensors land on is caught as over-covered. ``strict``: the target's own unless given."""
        strict = self.strict if strict is None else strict
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
            if k in seen or (only is not None and k not in only):
                continue
            seen.add(k)
            n = covered.get(k, 0)
            if n > param.numel():
                raise IncompatibleTargetError(
                    f"vLLM parameter {vname!r} would receive {n} elements but holds {param.numel()}: "
                    f"{who[k]} land on it; does vLLM tie tensors the sender publishes separately?"
                )
            if n < param.numel() and strict:
                missing.append(f"{vname} ({param.numel() - n} of {param.numel()} elements)")
        if missing:
            raise IncompatibleTargetError(
                f"vLLM parameters not covered by the published tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                f"({len(missing)} in all); publish them, or pass strict=False to leave them alone"
            )
