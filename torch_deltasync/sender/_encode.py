"""Encoding a rank's objects of a publish: anchor blocks cast to the inference dtype, and the delta
of the changed tensors through the codec (``docs/format.md`` §4)."""

from __future__ import annotations

from typing import Callable

import torch

from ..checksum import tensor_checksum
from ..codecs import Codec
from ..detect import ChangeDetector
from ..format import encode_anchor, encode_delta
from ._job import Job


def cast_anchors(job: Job, detector: ChangeDetector, *, whole: bool = False) -> int:
    """Cast every block of ``job`` this rank uploads to the inference dtype for an anchor object
    (``job.anchors``) and fill in the checksums of blocks without a detected delta; returns the
    elements newly counted as changed: blocks without a detected delta (or all, with ``whole``)
    count whole (``job.counts``)."""
    added = 0
    for src in job.sources:
        if not src.upload:  # another rank ships this block; no snapshot here either
            continue
        block = detector.cast(src.local)
        job.anchors[src.name] = block
        if src.name not in job.partials:
            job.partials[src.name] = tensor_checksum(block, index_map=None if src.slice.is_full else src.slice.to_global)
        elif not whole:
            continue
        job.counts[src.name] = src.slice.numel
        added += src.slice.numel
    return added


def delta_parts(job: Job, codec: Codec, threads: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's changed tensors of ``job``, encoded by ``codec``: ``{name: {part: tensor}}``.

    Encoded once per job (``job.delta_parts``), on up to ``threads`` threads (``None``:
    :func:`~torch_deltasync._pool.default_threads`), largest tensor first: the compiled kernels and zstd release the GIL.
    """
    if job.delta_parts is None:
        changed = [s for s in job.sources if s.upload and job.counts.get(s.name)]
        encoded = codec.encode_many([(job.global_positions[s.name], job.changes[s.name].values,
                                      job.changes[s.name].old_values, s.slice.global_numel)
                                     for s in changed], threads=threads)
        job.delta_parts = {s.name: parts for s, parts in zip(changed, encoded)}
    return job.delta_parts


def encode_objects(job: Job, codec: Codec, dtype: torch.dtype, slot: Callable[[int], tuple[int, int]],
                   threads: int | None = None) -> list[tuple[str, int, int, bytes]]:
    """This rank's objects for ``job`` as ``[(kind, rank, world, bytes)]`` (empty when it uploads
    nothing). ``slot(part)`` names object ``part`` of this rank as ``(rank, world)``
    (``dtensor.UploadPlan.slots``): a rank may upload several anchor objects. ``threads`` as in
    :func:`delta_parts`."""
    from ..dtensor import anchor_parts

    if not any(s.upload for s in job.sources):
        return []
    out = []
    if job.kind == "anchor":
        blocks = {s.name: (job.anchors[s.name], s.slice) for s in job.sources if s.upload}
        for part, boxes in enumerate(anchor_parts(blocks)):
            rank, world = slot(part)
            out.append(("anchor", rank, world,
                        encode_anchor(boxes, version=job.version, dtype=dtype, rank=rank, world=world)))
    if job.base_version is not None:
        parts = delta_parts(job, codec, threads)
        counts = {name: job.changes[name].numel for name in parts}
        rank, world = slot(0)
        out.append(("delta", rank, world,
                    encode_delta(parts, counts, version=job.version, base_version=job.base_version,
                                 codec=codec.name, dtype=dtype, rank=rank, world=world)))
    return out
