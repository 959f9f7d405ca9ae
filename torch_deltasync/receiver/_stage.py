"""Staging an update: decode, validate and compose versions into what a commit writes, and verify
the result against the published checksums. Reads the target (old values), never writes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..checksum import checksum_change, combine, tensor_checksum
from ..codecs import TensorDelta
from ..errors import ChecksumMismatchError, CorruptObjectError
from ..format import decode_anchor, decode_delta
from ..manifest import Manifest
from ..targets import Target
from ._plan import UpdatePlan


@dataclass
class UpdateStats:
    """Numbers of one update. Times in milliseconds."""

    version: int
    from_version: int | None
    path: str
    versions_applied: int
    nbytes: int  # downloaded
    changed: int  # elements written (delta path) or elements of the model (anchor path)
    plan_ms: float = 0.0
    download_ms: float = 0.0
    decode_ms: float = 0.0
    verify_ms: float = 0.0
    apply_ms: float = 0.0  # commit: every write, plus the target's finish (e.g. a vLLM re-pack)
    total_ms: float = 0.0
    recovered: bool = False  # a delta path failed verification and the anchor path was used

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class StagedUpdate:
    """A version downloaded, decoded, validated and checked against the published checksums, not yet
    written: the result of :meth:`DeltaReceiver.prepare`, the input of :meth:`DeltaReceiver.commit`.

    Attributes:
        plan: how it was reached (``plan.path == "noop"``: nothing to write).
        base_version: the version the target held when it was staged (``None``: nothing).
        version: the version a commit makes the target hold.
        stats: times so far (plan, download, decode, verify; ms); ``commit`` adds the apply time.
        written: HF names of the tensors a commit writes.
        nbytes_staged: bytes of staged positions and values held in memory (host).
    """

    plan: UpdatePlan
    base_version: int | None
    stats: UpdateStats | None
    _dense: dict[str, torch.Tensor] | None = None
    _sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    _checksums: dict[str, int] | None = None
    _generation: int = -1

    @property
    def version(self) -> int:
        return self.plan.to_version

    @property
    def written(self) -> frozenset[str]:
        if self._dense is not None:
            return frozenset(self._dense)
        return frozenset(n for n, (pos, _) in (self._sparse or {}).items() if pos.numel())

    @property
    def nbytes_staged(self) -> int:
        if self._dense is not None:
            return sum(t.numel() * t.element_size() for t in self._dense.values())
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size()
                   for p, v in (self._sparse or {}).values())


def merge(pos_a: torch.Tensor, val_a: torch.Tensor, pos_b: torch.Tensor, val_b: torch.Tensor):
    """Union of two sorted change sets; where both have a position, ``b`` (the later) wins."""
    if pos_a.numel() == 0:
        return pos_b, val_b
    if pos_b.numel() == 0:
        return pos_a, val_a
    pos = torch.cat([pos_a, pos_b])
    val = torch.cat([val_a, val_b])
    pos, order = torch.sort(pos, stable=True)
    val = val[order]
    last = torch.ones_like(pos, dtype=torch.bool)
    last[:-1] = pos[1:] != pos[:-1]  # keep the last of equal positions: b's, by stability
    return pos[last], val[last]


def concat(parts: list[TensorDelta], what: str) -> TensorDelta:
    """One tensor's changes from several rank objects (disjoint positions) as one sorted delta."""
    if len(parts) == 1:
        return parts[0]
    pos = torch.cat([p.positions for p in parts])
    val = torch.cat([p.values for p in parts])
    steps = rel = None
    if any(p.steps is not None for p in parts):
        steps = torch.cat([p.steps if p.steps is not None else torch.zeros(p.numel, dtype=torch.int64) for p in parts])
        rel = torch.cat([
            (p.relative if p.relative is not None else torch.ones(p.numel, dtype=torch.bool))
            if p.steps is not None else torch.zeros(p.numel, dtype=torch.bool)
            for p in parts
        ])
    pos, order = torch.sort(pos)
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise CorruptObjectError(f"{what}: two objects change the same element")
    # Partial checksums of disjoint position sets add up (mod 2**64) to the checksum of the union.
    base = combine(*(p.base_checksum for p in parts)) if all(p.base_checksum is not None for p in parts) else None
    return TensorDelta(pos, val[order], None if steps is None else steps[order], None if rel is None else rel[order],
                       base)


def decode_version(m: Manifest, blobs: dict[str, bytes]) -> dict[str, TensorDelta]:
    """Decode every delta object of ``m`` and check the counts against the manifest."""
    per_tensor: dict[str, list[TensorDelta]] = {}
    for o in m.delta_objects:
        for name, d in decode_delta(blobs[o.key], m, o).items():
            per_tensor.setdefault(name, []).append(d)
    out = {}
    for entry in m.tensors:
        parts = per_tensor.get(entry.name, [])
        n = sum(p.numel for p in parts)
        if n != entry.changed:
            raise CorruptObjectError(
                f"version {m.version}: tensor {entry.name!r} has {n} changes in its objects, manifest says {entry.changed}"
            )
        if parts:
            out[entry.name] = concat(parts, f"version {m.version} tensor {entry.name!r}")
    return out

def stage_deltas(target: Target, manifests: tuple[Manifest, ...], blobs: dict[str, bytes], dtype: torch.dtype):
    """Compose a delta chain without touching the target.

    Returns:
        ``(staged, base)``: ``staged`` maps each changed tensor to ``(positions, final values)``
        (int64 and ``dtype``, ``(k,)``, sorted); ``base`` maps the tensors changed by exactly one
        version of the chain with a relative codec to the target's values at those positions, read
        once here and reused by :func:`verify_checksums`.
    """
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    base: dict[str, torch.Tensor] = {}
    for m in manifests:
        for name, d in decode_version(m, blobs).items():
            if not target.holds_all:
                d = d.select(target.owned(name, d.positions))
            if d.needs_base:
                d_old = _lookup(target, name, staged.get(name), d.positions, dtype)
                new = d.resolve(d_old)
                if name not in staged:
                    base[name] = d_old
            else:
                new = d.values
            if name in staged:
                staged[name] = merge(*staged[name], d.positions, new)
                base.pop(name, None)  # the union's old values are no longer one read
            else:
                staged[name] = (d.positions, new)
    return staged, base


def _lookup(target: Target, name: str, staged: tuple[torch.Tensor, torch.Tensor] | None, pos: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Values at ``pos`` as of the staged state: staged values where present, else the target's."""
    if staged is None:
        return target.read(name, pos, dtype)
    spos, sval = staged
    out = torch.empty(pos.shape, dtype=dtype)
    if spos.numel():
        i = torch.searchsorted(spos, pos).clamp_(max=spos.numel() - 1)
        hit = spos[i] == pos
    else:
        i = torch.zeros_like(pos)
        hit = torch.zeros_like(pos, dtype=torch.bool)
    out[hit] = sval[i[hit]]
    miss = ~hit
    if bool(miss.any()):
        out[miss] = target.read(name, pos[miss], dtype)
    return out

def stage_anchor(plan: UpdatePlan, blobs: dict[str, bytes], shapes: dict[str, tuple[int, ...]]):
    """Rebuild full tensors from the anchor's blocks, then apply the chain's deltas to them."""
    anchor = plan.manifests[0]
    blocks: dict[str, list] = {}
    for o in anchor.anchor_objects:
        for name, sb in decode_anchor(blobs[o.key], anchor, o).items():
            blocks.setdefault(name, []).append(sb)
    dense: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        parts = blocks.get(name)
        if not parts:
            raise CorruptObjectError(f"version {anchor.version}: anchor has no data for tensor {name!r}")
        if len(parts) == 1 and parts[0][0].is_full:
            dense[name] = parts[0][1].reshape(shape)
            continue
        full = torch.empty(shape, dtype=anchor.inference_dtype)
        cover = torch.zeros(shape, dtype=torch.bool)  # every element exactly once
        for s, block in parts:
            idx = tuple(slice(off, off + n) for off, n in zip(s.offsets, s.shape))
            if bool(cover[idx].any()):
                raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap")
            full[idx] = block
            cover[idx] = True
        if not bool(cover.all()):
            raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap or leave gaps")
        dense[name] = full
    for m in plan.manifests[1:]:
        for name, d in decode_version(m, blobs).items():
            d.apply_to(dense[name].view(-1))  # one compiled pass: checksum of the old values, steps, write
    return dense

def verify_checksums(target: Target, final: Manifest, dense, staged, checksums: dict[str, int],
                     base: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
    """Checksums of the staged state, from the held state's ``checksums`` and the changes;
    raise if they differ from ``final``'s manifest."""
    if not target.holds_all:
        return {}  # partial holders cannot see whole tensors; sha256 protected the bytes
    new: dict[str, int] = {}
    bad = []
    for entry in final.tensors:
        if dense is not None:
            c = tensor_checksum(dense[entry.name])
        else:
            c = checksums.get(entry.name)
            if c is None:
                raise CorruptObjectError(f"no checksum held for {entry.name!r}")
            if entry.name in staged:
                pos, val = staged[entry.name]
                old = (base or {}).get(entry.name)
                if old is None:  # not read while staging
                    old = target.read(entry.name, pos, final.inference_dtype)
                c = combine(c, checksum_change(pos, old, val))
        if c != entry.checksum:
            bad.append(entry.name)
        new[entry.name] = c
    if bad:
        raise ChecksumMismatchError(
            f"version {final.version}: the staged state differs from the published checksums for "
            f"{len(bad)} tensors, e.g. {bad[:3]}; nothing was applied"
        )
    return new
