"""Checks by name for a target that reloads whole vLLM modules (:class:`~torch_deltasync.targets.
VLLMEngineTarget`): which vLLM parameter, and which part of it, each published tensor loads into;
the full shape it must have; and whether a module to reload gets every part of every parameter.

Why a reloaded module needs all of its tensors: vLLM's layerwise reload
(``vllm/model_executor/model_loader/reload/layerwise.py``) rebuilds the module's parameters empty
(``restore_layer_on_meta`` -> ``materialize_layer``) and fills them from the tensors handed to
``model.load_weights``; a layer that received only some of its elements is processed as it is
("Delayed processing" in ``finalize_layerwise_processing``), so the rows no tensor filled hold
whatever the fresh memory held. The TP map of :class:`~torch_deltasync.targets.VLLMTarget` checks
coverage element by element; a reload is checked here by parts: the shards of a fused parameter
(``QKVParallelLinear``: q, k, v; ``MergedColumnParallelLinear``: one per output size), else the
whole parameter.
"""

from __future__ import annotations

from torch import nn

from ..errors import IncompatibleTargetError, UnsupportedLayoutError
from ._vllm_layout import EXPERTS_NAME, _classes, _VLLMLayout, routed_experts


def parts(module: nn.Module) -> tuple[int | None, ...]:
    """The parts a parameter of ``module`` is loaded in, as the shard ids its weight loader takes:
    ``(0, 1, 2)`` for ``QKVParallelLinear`` (q, k, v), ``0 .. n-1`` for a
    ``MergedColumnParallelLinear`` of ``n`` output sizes, ``(None,)`` (the whole tensor) otherwise."""
    C = _classes()
    if type(module) is C.QKV:
        return (0, 1, 2)
    if type(module) is C.Merged:
        return tuple(range(len(module.output_sizes)))
    return (None,)


def experts_of(layout: _VLLMLayout, vname: str) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the fused-MoE experts layer that the vLLM name ``vname`` loads into
    (``vllm/model_executor/layers/fused_moe``: per-expert ``experts.{e}.gate_proj.weight`` and
    transformers 5's ``experts.gate_up_proj`` alike), or ``None`` for any other name."""
    m = EXPERTS_NAME.match(vname)
    if m is None:
        return None
    try:
        module = layout._module(m.group(1))
    except IncompatibleTargetError:
        return None
    return (m.group(1), module) if routed_experts(module) is not None else None


def experts_params(model: nn.Module) -> set[int]:
    """``id`` of every parameter of the fused-MoE experts layers of ``model`` (``w13_weight``, ...)."""
    return {id(p) for m in model.modules() if isinstance(m, _classes().RoutedExperts) for p in m.parameters(recurse=False)}


def module_path(layout: _VLLMLayout, vname: str) -> str:
    """The path of the vLLM module that loads the vLLM name ``vname``: its experts layer for a
    fused-MoE expert tensor, else the module the parameter sits on."""
    experts = experts_of(layout, vname)
    return experts[0] if experts is not None else vname.rpartition(".")[0]


def check_names(layout: _VLLMLayout, names, aliases: dict[str, str], *, strict: bool) -> None:
    """Check published names against the vLLM parameters (and parts) they load into, by name alone.

    Args:
        layout: the TP map whose model and name mapping to use.
        names: the published tensors' names; ``aliases``: their tied names, ``{alias: canonical}``.
        strict: also require every part of every parameter of this rank's model to receive a
            published tensor (fused-MoE experts count as loaded when any expert tensor is published:
            :meth:`~torch_deltasync.targets.VLLMEngineTarget.check` then checks them element by
            element through the TP map, which writes them).

    Raises:
        IncompatibleTargetError: a published tensor the model has no parameter for (vLLM's loaders
            would drop it without a word: e.g. biases the engine's layers do not have); two published
            tensors (not tied by the sender) that load into one parameter under different vLLM names
            (vLLM ties them, e.g. ``lm_head`` to ``embed_tokens``, and a reload would keep only one);
            or (``strict``) parameters, or parts of fused ones, that no published tensor loads into
            (they would keep their values while the engine reports each new version).
    """
    loaded: dict[int, tuple[str, str]] = {}  # id(parameter) -> (published name, vLLM name)
    got: dict[int, set[int | None]] = {}  # id(parameter) -> parts loaded
    for name in [*names, *aliases]:
        mapped = layout._map_name(name)
        if mapped is None:
            continue  # dropped by vLLM's name mapper
        vname, shard = mapped
        experts = experts_of(layout, vname)
        if experts is not None:
            for p in routed_experts(experts[1]).parameters(recurse=False):  # not the router's gate a wrapper may hold
                got.setdefault(id(p), set()).add(None)
                loaded.setdefault(id(p), (name, vname))
            continue
        path, _, leaf = vname.rpartition(".")
        module = layout._module(path)
        if module is None:
            continue  # held by another pipeline stage
        param = module._parameters.get(leaf)
        if param is None:
            raise IncompatibleTargetError(
                f"published tensor {name!r} (vLLM name {vname!r}) is unknown to the vLLM model: its layer {path!r} "
                f"({type(module).__name__}) has no parameter {leaf!r}, and vLLM's loader would drop it without an "
                "error. The run publishes another model than the engine serves (compare the trainer's config, e.g. "
                "attention_bias, with the engine's)")
        other = loaded.setdefault(id(param), (name, vname))
        if other[1] != vname and aliases.get(name, name) != aliases.get(other[0], other[0]):
            raise IncompatibleTargetError(
                f"published tensors {other[0]!r} and {name!r} both load into the vLLM parameter {other[1]!r}: "
                f"vLLM ties {vname!r} to it (e.g. tie_word_embeddings) but the sender publishes them "
                "separately, so the engine would serve only one of them. Tie them in the trainer, or serve a "
                "model that does not tie them")
        got.setdefault(id(param), set()).add(shard)
    if not strict:
        return
    missing = sorted({n for n, p in layout.model.named_parameters() if id(p) not in loaded})
    if missing:
        raise IncompatibleTargetError(
            f"vLLM parameters no published tensor loads into: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} in all); they would keep their values while the engine reports each new "
            "version. Publish them, or pass strict=False to leave them alone")
    partly = [f"{n} (parts {sorted(set(parts(m)) - got[id(p)])} of {list(parts(m))})"
              for mn, m in layout.model.named_modules() for pn, p in m.named_parameters(recurse=False)
              if (n := f"{mn}.{pn}" if mn else pn) and not set(parts(m)) <= got.get(id(p), set())]
    if partly:
        raise IncompatibleTargetError(
            f"vLLM parameters that the published tensors fill only in part: {partly[:3]}{' ...' if len(partly) > 3 else ''} "
            "(a fused layer's part is the q / k / v or gate / up tensor); the missing parts would keep their "
            "values while the engine reports each new version. Publish them, or pass strict=False")


def check_reloaded(layout: _VLLMLayout, module_of: dict[str, str]) -> None:
    """Check that every module to reload gets every part of every parameter it loads from a
    checkpoint (module doc), whatever ``strict`` says: a reload cannot leave a parameter alone.

    Args:
        layout: the TP map whose model and name mapping to use.
        module_of: published name (or alias) -> path of the vLLM module it reloads into.

    Raises:
        UnsupportedLayoutError: fused-MoE experts to reload (only written in place, through the TP
            map, where the MoE backend keeps the loader's layout: ``TRITON`` and ``BATCHED_TRITON``).
        IncompatibleTargetError: a module to reload that the published tensors leave partly empty,
            naming its parameters and parts.
    """
    C = _classes()
    known = (C.linear.LinearBase, C.Vocab, *C.norms)
    by_path: dict[str, list[str]] = {}
    for name, path in module_of.items():
        by_path.setdefault(path, []).append(name)
    for path, names in sorted(by_path.items()):
        module = layout._module(path)
        if module is None:
            continue
        if routed_experts(module) is not None:
            raise UnsupportedLayoutError(
                f"published tensor {names[0]!r}: the fused-MoE experts {path!r} would have to be reloaded (their "
                "backend re-lays out the weights), which VLLMEngineTarget does not do; it writes experts only in "
                f"place, with the MoE backends {layout.moe_backends}")
        got: dict[str, set[int | None]] = {}
        for name in names:
            vname, shard = layout._map_name(name)
            got.setdefault(vname.rpartition(".")[2], set()).add(shard)
        if not isinstance(module, known):
            continue  # vLLM's loader for this layer decides (checked at the reload)
        want = set(parts(module))
        short = [f"{leaf} (parts {sorted(want - got.get(leaf, set()), key=str)})"
                 for leaf in ("weight", "bias") if module._parameters.get(leaf) is not None
                 and not want <= got.get(leaf, set())]
        if short:
            raise IncompatibleTargetError(
                f"the vLLM layer {path!r} ({type(module).__name__}) is reloaded whole, but the published tensors "
                f"{sorted(names)} leave out {', '.join(short)}: a reload would fill those with whatever fresh memory "
                "holds. Publish every tensor of the layer (e.g. v_proj next to q_proj and k_proj)")


def full_shape(module: nn.Module | None, mapped: tuple[str, int | None] | None) -> tuple[int, ...] | None:
    """The full HF shape a reloaded tensor must have, from its vLLM layer's unsharded sizes
    (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``; the same attributes
    the TP map of :mod:`torch_deltasync.targets._vllm` reads); ``None`` for layers not known here (the
    layer's loader checks those at the reload)."""
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
