"""Whether a receiver's tensors share memory: with themselves (two elements in one place, e.g.
``expand()``) or with each other (two published tensors whose writes would land on the same bytes).

Decided exactly, in time that follows the layout rather than the bytes it spans: a tensor is seen as
*runs*, equal stretches of contiguous bytes (its innermost dimensions that continue each other
merged into one run; a row of a column slice, a whole contiguous tensor), and two sets of runs
overlap iff, sorted by start, some run begins before its predecessor ends. Views cut from one weight
(column slices, gate/up halves) cost one run per row; a flat buffer cut into tensors one run each.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..errors import IncompatibleTargetError

#: The most runs one tensor is seen as (16M: 128 MiB of int64 starts). Layouts that interleave more
#: finely (e.g. a transposed view sharing a large matrix with another view) are refused as unprovable.
MAX_RUNS = 1 << 24


class _Unprovable(Exception):
    """More runs than :data:`MAX_RUNS`."""


def _runs(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t``'s memory as runs: their absolute start addresses, int64 ``(R,)`` (unsorted), and their
    common length in bytes."""
    item = t.element_size()
    dims = sorted((st, size) for size, st in zip(t.shape, t.stride()) if size > 1)
    run, i = item, 0
    while i < len(dims) and dims[i][0] * item == run:  # this dimension continues the run
        run *= dims[i][1]
        i += 1
    rest = dims[i:]
    count = math.prod(size for _, size in rest)
    if count > MAX_RUNS:
        raise _Unprovable(count)
    starts = torch.full((1,), t.data_ptr(), dtype=torch.int64)
    for st, size in rest:
        starts = (starts[:, None] + torch.arange(size, dtype=torch.int64) * (st * item)).reshape(-1)
    return starts, run


def _first_overlap(runs: list[tuple[torch.Tensor, int]]) -> tuple[int, int] | None:
    """The owners (indices into ``runs``) of two runs that overlap, or ``None``. Sorted by start, an
    overlap always shows between neighbours: the run right after one it overlaps overlaps it too."""
    starts = torch.cat([s for s, _ in runs])
    ends = torch.cat([s + n for s, n in runs])
    owners = torch.cat([torch.full((s.numel(),), i, dtype=torch.int64) for i, (s, _) in enumerate(runs)])
    order = torch.argsort(starts, stable=True)
    starts, ends, owners = starts[order], ends[order], owners[order]
    hit = (starts[1:] < ends[:-1]).nonzero()
    if not hit.numel():
        return None
    i = int(hit[0, 0])
    return int(owners[i]), int(owners[i + 1])


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (``expand`` or overlapping ``as_strided`` views).

    The strides settle most layouts at once: a size-1 stride 0 is an overlap, and strides that,
    sorted ascending, each reach past the extent of the smaller ones (the rule behind torch's
    non-overlapping-and-dense layouts, permuted or sliced) are none. Others are compared as runs; a
    layout of more than :data:`MAX_RUNS` runs counts as overlapping (it cannot be proven not to).
    """
    if t.numel() <= 1:
        return False
    dims = sorted((st, size) for size, st in zip(t.shape, t.stride()) if size > 1)
    if dims and dims[0][0] == 0:
        return True
    reach = 0
    for st, size in dims:
        if st <= reach:
            break
        reach += (size - 1) * st
    else:
        return False
    try:
        return _first_overlap([_runs(t)]) is not None
    except _Unprovable:
        return True


def refuse_shared_memory(tensors: Mapping[str, torch.Tensor], written: list[str]) -> None:
    """Refuse two ``written`` tensors (published tensors and the aliases written beside them) that
    share memory: each takes its own version's values, so whichever wrote last would win, and a
    commit may write them at once (:attr:`ModuleTarget.concurrent_writes`). Addresses are compared,
    not storages, so views of one buffer through different storage objects (``torch.from_numpy``
    of numpy slices, ``torch.frombuffer``) are caught too. Views that share no byte (a flat parameter
    buffer cut into tensors, column slices, interleaved ``x[0::2]`` and ``x[1::2]``) are fine.

    Raises:
        IncompatibleTargetError: naming both tensors (or the tensor, when it overlaps itself), or
            two tensors whose layouts interleave too finely to tell (more than :data:`MAX_RUNS`
            runs).
    """
    spans = []
    for n in written:
        t = tensors[n]
        if t.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * st for size, st in zip(t.shape, t.stride()))
        spans.append((str(t.device), t.data_ptr(), t.data_ptr() + extent * t.element_size(), n))
    spans.sort()
    cluster: list[str] = []  # tensors whose spans overlap one another, one after the other
    device, end = None, 0
    for dev, start, stop, n in spans + [("", 0, 0, "")]:  # (a sentinel that ends the last cluster)
        if dev == device and start < end:
            cluster.append(n)
            end = max(end, stop)
            continue
        if len(cluster) > 1:
            _refuse_overlap_in(tensors, cluster)
        cluster, device, end = [n], dev, stop


def _refuse_overlap_in(tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
    try:
        pair = _first_overlap([_runs(tensors[n]) for n in names])
    except _Unprovable as e:
        raise IncompatibleTargetError(
            f"the receiver's tensors {names[:4]} lie in one stretch of memory in a layout of more than {MAX_RUNS} "
            f"runs ({e.args[0]} in one of them), too fine to tell whether they share memory; give each its own "
            "storage (.contiguous())"
        ) from None
    if pair is None:
        return
    a, b = names[pair[0]], names[pair[1]]
    if a == b:
        raise IncompatibleTargetError(f"tensor {a!r} has overlapping memory; give it storage of its own (.contiguous())")
    raise IncompatibleTargetError(
        f"the receiver's tensors {a!r} and {b!r} share memory, but the sender publishes them as separate "
        "tensors (or ties one of them to a third): untie them in the receiving model (give each its own "
        "storage), or tie them in the trainer as well"
    )
