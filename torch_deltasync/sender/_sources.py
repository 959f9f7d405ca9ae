"""What a rank publishes: the floating tensors of a model as blocks, and tied aliases."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..errors import UnsupportedLayoutError
from ..layout import Source, TensorBlock


def _tensors_of(model: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(model, nn.Module):
        return model.state_dict(keep_vars=True)
    if callable(model) and not isinstance(model, Mapping):
        return model()
    if isinstance(model, Mapping):
        return model
    raise TypeError(f"expected an nn.Module, a state dict or a callable returning one, got {type(model).__name__}")


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def collect_sources(model: Any) -> tuple[list[Source], dict[str, str]]:
    """The floating tensors of ``model`` as sources, and tied aliases ``{alias: canonical}``.

    Plain tensors are whole (:meth:`TensorBlock.full`); ``DTensor`` parameters (FSDP2) are
    described by :func:`torch_deltasync.dtensor.local_source`. Non-floating entries (integer
    buffers) are not synced.
    """
    sources: list[Source] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in _tensors_of(model).items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
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
        sources.append(src)
    return sources, aliases
