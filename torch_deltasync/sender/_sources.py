"""What a rank publishes: the floating tensors of a model as blocks, and tied aliases."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import UnsupportedLayoutError
from ..layout import Source, TensorBlock

log = logging.getLogger("torch_deltasync.sender")


def _tensors_of(model: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(model, nn.Module):
        return model.state_dict(keep_vars=True)
    if callable(model) and not isinstance(model, Mapping):
        tensors = model()
        if not isinstance(tensors, Mapping):
            raise TypeError(f"the model callable must return a state dict {{name: tensor}}, got {type(tensors).__name__}")
        return tensors
    if isinstance(model, Mapping):
        return model
    raise TypeError(f"expected an nn.Module, a state dict or a callable returning one, got {type(model).__name__}")


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def collect_sources(model: Any) -> tuple[list[Source], dict[str, str]]:
    """The floating tensors of ``model`` as sources, and tied aliases ``{alias: canonical}``.

    Plain tensors are whole (:meth:`TensorBlock.full`); ``DTensor`` parameters (FSDP2) are
    described by :func:`torch_deltasync.dtensor.local_source`. Other entries (integer and bool
    buffers, complex tensors, values that are not tensors) are not synced.

    Raises:
        TypeError: a name that is not a string.
        UnsupportedLayoutError: a sparse or meta-device tensor (no strided data to read).
    """
    sources, aliases, _ = _collect(model)
    return sources, aliases


def _collect(model: Any) -> tuple[list[Source], dict[str, str], dict[str, str]]:
    """:func:`collect_sources`, and the entries it passes over, ``{name: what}`` in its order
    (``"int64 tensor"``, ``"complex64 tensor"``, ``"list"``, ...), from one read of ``model``."""
    out: list[Source] = []
    aliases: dict[str, str] = {}
    skipped: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in _tensors_of(model).items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names are strings (state-dict keys), got {type(name).__name__} {name!r}")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            is_tensor = isinstance(t, torch.Tensor)
            skipped[name] = f"{str(t.dtype).removeprefix('torch.')} tensor" if is_tensor else type(t).__name__
            continue
        if t.is_meta:
            raise UnsupportedLayoutError(f"tensor {name!r} is on the meta device (no data to publish); "
                                         "materialise the model first (e.g. model.to_empty(device=...) and load it)")
        param, t = t, t.detach()
        if type(t).__name__ == "DTensor":
            from ..dtensor import local_source

            src = local_source(name, t)
            if src.local.numel():
                key = ("dtensor", _storage_key(src.local), tuple(src.slice.global_shape))
            else:  # empty shards share no storage to compare: tied parameters are the same object
                key = ("dtensor-empty", id(param))
        else:
            if t.is_sparse or t.layout != torch.strided:
                raise UnsupportedLayoutError(f"tensor {name!r} has layout {t.layout}; only strided tensors sync")
            src = Source(name, t, TensorBlock.full(t.shape))
            key = _storage_key(t)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out.append(src)
    return out, aliases, skipped


def warn_not_synced(skipped: Mapping[str, str]) -> None:
    """Log the entries ``_collect`` passes over that a user may have meant to sync: complex tensors and
    values that are not tensors (integer and bool buffers, e.g. position ids, are skipped by
    design)."""
    odd = {n: w for n, w in skipped.items() if not (w.endswith(" tensor") and not w.startswith("complex"))}
    if odd:
        shown = ", ".join(f"{n!r} ({w})" for n, w in list(odd.items())[:5]) + (" and more" if len(odd) > 5 else "")
        log.warning("not published: %s. Only real floating-point tensors sync; publish a complex tensor as its real "
                    "view (torch.view_as_real) under its own name, and keep other values out of the state dict",
                    shown)


def check_publishable(sources: list[Source], skipped: Mapping[str, str] | None = None) -> None:
    """The limits of docs/format.md §3, checked when a sender is built (before anything is written).

    Args:
        skipped: the entries ``_collect`` passed over, ``{name: what}``, named when there is no source.

    Raises:
        ValueError: no source (no floating-point tensor), a name outside 1-1024 characters, the name
            ``__metadata__`` (safetensors' metadata entry: an anchor object's tensor of that name
            would replace it), or a tensor of more than 8 dimensions (naming it).
    """
    if not sources:
        held = ", ".join(f"{n!r} ({w})" for n, w in list((skipped or {}).items())[:5])
        more = " and more" if len(skipped or {}) > 5 else ""
        raise ValueError("the model has no floating-point tensors to publish"
                         + (f"; it holds {held}{more}" if held else " (it is empty)"))
    for s in sources:
        if not s.name or len(s.name) > 1024 or len(s.slice.global_shape) > 8:
            raise ValueError(f"tensor {s.name[:80]!r}: names must be 1-1024 characters and tensors at most 8-D "
                             "to publish")
        if s.name == "__metadata__":
            raise ValueError("tensor '__metadata__': safetensors reserves that name for an object's metadata; "
                             "rename the tensor (e.g. publish a state dict with another key)")


def warn_unchanged(model: Any, version: int, base: int | None) -> bool:
    """Log that delta ``version`` changed nothing since ``base`` when ``model`` is a
    ``{name: tensor}`` mapping, whose tensors may be stale: ``module.state_dict()`` is no longer the
    module's memory after ``module.to(...)`` or ``load_state_dict(..., assign=True)``. Returns
    whether it warned (the sender warns once)."""
    if not isinstance(model, Mapping):
        return False
    log.warning("version %d: no element changed since version %s. If the model's tensors were replaced "
                "(module.to(...), load_state_dict(..., assign=True)), a state dict taken before still holds "
                "the old ones: pass the module itself", version, base)
    return True


def warn_if_another_model(store: Any, sources: list[Source], dtype: torch.dtype, next_version: int) -> None:
    """Log when the newest version on ``store`` (a prefix that holds versions, which a sender then
    continues from ``next_version``) is of another model than ``sources``: receivers that hold
    that model refuse every version of the new one."""
    from ..errors import DeltaSyncError, VersionNotFoundError
    from ..keys import list_versions
    from ..manifest import load_manifest

    try:  # the newest manifest is next_version - 1 unless a crashed writer left objects above it
        try:
            newest = load_manifest(store, next_version - 1)
        except VersionNotFoundError:
            versions = list_versions(store)
            newest = load_manifest(store, versions[-1]) if versions else None
    except DeltaSyncError:  # damaged or gone meanwhile: nothing to compare (the sender starts with an anchor)
        return
    change = newest and model_change(sources, dtype, newest)
    if change:
        log.warning("%s: its newest version %d is of another model (%s). This sender publishes its own from version "
                    "%d on, and receivers that hold the old model will refuse it (IncompatibleTargetError): publish "
                    "under a new prefix unless the model changed on purpose", store.describe(), newest.version,
                    change, next_version)


def model_change(sources: list[Source], dtype: torch.dtype, manifest: Any) -> str | None:
    """How the model of ``sources`` (published in ``dtype``) differs from the one ``manifest`` (a
    version already on the prefix) lists: the first few names and shapes that differ, ``None``
    when it is the same model."""
    ours = {s.name: tuple(s.slice.global_shape) for s in sources}
    theirs = {t.name: tuple(t.shape) for t in manifest.tensors}
    diffs = [f"{n!r}: {theirs.get(n, 'absent')} -> {ours.get(n, 'absent')}"
             for n in [*theirs, *(n for n in ours if n not in theirs)] if ours.get(n) != theirs.get(n)]
    if str(dtype).removeprefix("torch.") != str(manifest.inference_dtype).removeprefix("torch."):
        diffs.insert(0, f"inference dtype {manifest.inference_dtype} -> {dtype}")
    if not diffs:
        return None
    return ", ".join(diffs[:3]) + (f" ({len(diffs)} differences)" if len(diffs) > 3 else "")
