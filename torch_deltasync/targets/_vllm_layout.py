"""How vLLM lays out each HF tensor on one TP rank: the name mapping and the place of every
element, mirroring vLLM's own weight loaders (``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``, ``FusedMoE``; see
:mod:`torch_deltasync.targets._vllm` for the rules and their sources). :class:`VLLMTarget` resolves
every published tensor through these methods once, in ``check()``."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import IncompatibleTargetError, UnsupportedLayoutError

#: Unquantized fused-MoE backends whose runtime layout is the loader's layout (``TRITON`` and
#: ``BATCHED_TRITON`` only ``.contiguous()`` the weights; FlashInfer swaps or re-blocks them, AITER
#: shuffles, XPU transposes, CPU prepacks: ``fused_moe/oracle/unquantized.py``).
DEFAULT_MOE_BACKENDS: tuple[str, ...] = ("TRITON", "BATCHED_TRITON")

#: ``<experts module>.<rest>``: the vLLM name of a fused-MoE expert tensor (per-expert
#: ``experts.{e}.gate_proj.weight`` and transformers 5's ``experts.gate_up_proj`` alike).
EXPERTS_NAME = re.compile(r"^(.*\.experts)\.(.+)$")

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
        from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer

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
        # names every model's AutoWeightsLoader drops (rotary inv_freq, cos/sin caches)
        self.dropped = getattr(AutoWeightsLoader, "REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER", None)


_CLASSES: _Classes | None = None


def _classes() -> _Classes:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _Classes()
    return _CLASSES


def routed_experts(module: nn.Module | None) -> nn.Module | None:
    """The ``RoutedExperts`` layer of a fused-MoE experts module (the module itself, or the one a
    wrapper holds as ``routed_experts``), else ``None``."""
    return module if isinstance(module, _classes().RoutedExperts) else getattr(module, "routed_experts", None)


class _VLLMLayout:
    """The layout half of :class:`~torch_deltasync.targets.VLLMTarget`: resolving HF names to
    vLLM parameters and places (uses the target's ``model``, ``strict``, ``moe_backends``,
    ``allow_derived`` and table cache)."""

    # --- resolving one HF name -------------------------------------------------------------------

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """HF name -> (vLLM parameter name, stacked shard index) through the model's own name
        mapper (``hf_to_vllm_mapper``, vLLM >= 0.2x), else its ``packed_modules_mapping``;
        ``None`` when vLLM drops the tensor (that mapper, or ``AutoWeightsLoader``'s
        ``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``, ``vllm/model_executor/models/utils.py``)."""
        dropped = _classes().dropped
        if dropped is not None and dropped._map_name(hf_name) is None:
            return None
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
        moe = EXPERTS_NAME.match(vname)
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
        if not self.allow_derived and (hasattr(module, "cpu_linear") or getattr(module, "_bf16x3_weight", None) is not None):
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
        routed = routed_experts(experts)
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
