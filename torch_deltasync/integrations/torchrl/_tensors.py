"""Weights of a torchrl policy by name: the live tensors of a module, a TensorDict or state dict
flattened to dotted names, and the materialisation of a policy that arrived without data."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDictBase
from torch import nn

from ...errors import IncompatibleTargetError


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its ``state_dict`` name, tied names included.

    This is the naming both sides of the scheme use: the same names as
    ``TensorDict.from_module(module).flatten_keys(".")`` (non-persistent buffers included, unlike
    ``state_dict``), and the live tensors themselves (no copies). Tied tensors appear under every
    name; the sender ships them once (see :func:`torch_deltasync.sender.collect_sources`).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        out[name] = b
    return out


def flat_tensors(weights: TensorDictBase | Mapping) -> dict[str, torch.Tensor]:
    """A TensorDict or (nested) mapping of weights as ``{dotted name: tensor}``; non-tensors dropped
    (``WeightStrategy`` adds ``"__extra_state__"``, which is not a weight)."""
    if isinstance(weights, TensorDictBase):
        weights = weights.flatten_keys(".")
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        if k.startswith("__extra_state__"):
            continue
        if isinstance(v, (Mapping, TensorDictBase)):
            out.update({f"{k}.{kk}": vv for kk, vv in flat_tensors(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def materialize(module: nn.Module, *, device: torch.device | str, dtype: torch.dtype | None) -> None:
    """Give every meta-device tensor of ``module`` real (uninitialised) storage on ``device``, and
    cast floating tensors to ``dtype`` (when given), in place of the module's entries.

    torchrl's multi-process collectors send workers a copy of the policy whose parameters live on
    the meta device (``collectors/utils.py:_make_meta_policy``); the scheme fills them from an
    anchor right after. Tied tensors stay tied (one new tensor per original object).

    Raises:
        IncompatibleTargetError: a non-floating tensor is on the meta device (the scheme syncs
            floating tensors only; build such policies in the worker with ``policy_factory``).
    """
    memo: dict[int, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in memo:
                    table[name] = memo[id(t)]
                    continue
                floating = t.is_floating_point()
                want = dtype if (dtype is not None and floating) else t.dtype
                new = t
                if t.is_meta:
                    if not floating:
                        full = f"{mod_name}.{name}" if mod_name else name
                        raise IncompatibleTargetError(
                            f"{full!r} is a {t.dtype} tensor without data (meta device); the delta scheme only "
                            "syncs floating tensors: build the policy inside the worker with policy_factory"
                        )
                    new = torch.empty(t.shape, dtype=want, device=device)
                elif t.dtype != want:
                    new = t.detach().to(want)
                if new is not t:
                    new = nn.Parameter(new, requires_grad=False) if is_param else new
                    table[name] = new
                memo[id(t)] = new
