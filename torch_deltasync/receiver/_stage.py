"""Staging an update: decode, validate and compose versions into what a commit writes, and verify
the result against the published checksums. Reads the target (old values), never writes it."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from .._dtypes import bits
from .._pool import map_largest_first
from ..checksum import checksum_change, combine, tensor_checksum
from ..codecs import TensorDelta
from ..errors import ChecksumMismatchError, CorruptObjectError, IncompatibleTargetError, ObjectNotFoundError
from ..errors import VersionNotFoundError
from ..format import DAMAGED_HINT, EncodedDelta, decode_anchor, read_delta, verify_bytes
from ..manifest import Manifest, load_manifest
from ..store import Store
from ..targets import Target
from ..targets._base import PreparedCommit, allows_concurrent, prepare_commit
from ._plan import UpdatePlan

log = logging.getLogger("torch_deltasync.receiver")
T = TypeVar("T")

#: Reads of one object before a size/sha256 mismatch counts as corruption (not a bad transfer).
REREAD_ATTEMPTS = 3


def reread(store: Store, read: Callable[[], T]) -> T:
    """``read()``, called again (up to :data:`REREAD_ATTEMPTS` times in all) while it raises
    :class:`CorruptObjectError`: a truncated or garbled transfer fails the size/sha256 or JSON
    check, and a store that lost bytes once usually delivers them next time."""
    for attempt in range(REREAD_ATTEMPTS):
        try:
            return read()
        except CorruptObjectError as e:
            if attempt + 1 == REREAD_ATTEMPTS:
                raise
            log.debug("%s: %s; reading it again", store.describe(), e)
    raise AssertionError("unreachable")  # pragma: no cover


def failed_part(plan: UpdatePlan, error: BaseException) -> tuple[int, str] | None:
    """``(version, "anchor" | "delta")``: the part of ``plan`` whose object ``error`` names
    (``object_key``: set by :func:`download`, by :func:`read_version` and by the delta readers of
    :mod:`torch_deltasync.format`), or ``None`` when it names none (a checksum failure: the held
    state or any version of the chain may be wrong; an anchor that does not decode)."""
    key = getattr(error, "object_key", None)
    for m, step in zip(plan.manifests, plan.steps):
        if any(o.key == key for o in step.objects):
            return m.version, step.kind
    return None


def download(store: Store, plan: UpdatePlan, pool: Executor) -> dict[str, bytes]:
    """``{key: bytes}`` of every object of ``plan``, read on ``pool`` (in parallel) and checked
    against its manifest entry (size, sha256), each read again as :func:`reread` does.

    Raises:
        CorruptObjectError: an object fails its check on every read (naming version and key).
        ObjectNotFoundError: an object is missing.
        StoreError: the store failed.

        The first two carry the object's key as ``object_key`` (the receiver's recovery avoids the
        paths that need it: :func:`failed_part`).
    """
    entries = [(m, o) for m, step in zip(plan.manifests, plan.steps) for o in step.objects]

    def read(m: Manifest, o) -> tuple[str, bytes]:
        try:
            # at most one byte more than declared: an oversized object is refused unread
            data = store.get(o.key, start=0, end=o.nbytes + 1)
            verify_bytes(data, o, f"{store.describe()}: version {m.version}")
        except (CorruptObjectError, ObjectNotFoundError) as e:
            e.object_key = o.key
            raise
        return o.key, data

    return dict(pool.map(lambda mo: reread(store, lambda: read(*mo)), entries))


def read_manifest(store: Store, cache: dict[int, Manifest], version: int, fresh: bool) -> Manifest:
    """``DeltaReceiver.manifest``: the validated manifest of ``version`` through ``cache`` (at most
    512 entries, oldest dropped first; all dropped when a manifest read ``fresh`` differs from its
    cached copy: a new run on a wiped prefix)."""
    cached = cache.get(version)
    if cached is not None and not fresh:
        return cached
    try:
        m = reread(store, lambda: load_manifest(store, version))
    except VersionNotFoundError as e:
        why = store.absent()  # a mistyped path reads differently from a version not published
        if why:
            raise VersionNotFoundError(f"{e}: {why}") from None
        raise
    if cached is not None and cached != m:
        log.warning("%s: the manifest of version %d changed (a new run on a wiped prefix?); "
                    "forgetting every cached manifest", store.describe(), version)
        cache.clear()
    if len(cache) >= 512:
        cache.pop(next(iter(cache)))
    cache[version] = m
    return m


@dataclass
class UpdateStats:
    """Numbers of one update (``DeltaReceiver.last_stats``; the ``update`` events of
    ``ReceiverConfig.metrics_path``).

    Attributes:
        version: the version now held.
        from_version: the version held before (``None``: nothing, or unknown after a failed write).
        path: ``"delta"`` (delta parts from the version held) or ``"anchor"`` (an anchor, then the
            delta parts after it); see :class:`~torch_deltasync.receiver.UpdatePlan`.
        versions_applied: the versions whose objects were read (the anchor counts as one).
        nbytes: bytes of the objects of the path taken (a recovered update also read some of the
            failed path's).
        changed: elements written (delta path) or elements of the model (anchor path).
        plan_ms, download_ms, decode_ms, verify_ms: planning (manifests), reading the objects,
            decoding and staging them, checking the staged state's checksums, ms.
        ahead_ms: the target's work ahead of the commit in ``prepare`` (e.g. re-packing vLLM
            modules), ms.
        apply_ms: the commit: every write plus the target's ``finish`` (e.g. a vLLM re-pack), ms.
        total_ms: the whole update, ms.
        recovered: the planned path failed and another one (avoiding what failed) was taken.
        recovered_from: when ``recovered``, why the first path failed (``"Type: message"``).
    """

    version: int
    from_version: int | None
    path: str
    versions_applied: int
    nbytes: int
    changed: int
    plan_ms: float = 0.0
    download_ms: float = 0.0
    decode_ms: float = 0.0
    verify_ms: float = 0.0
    ahead_ms: float = 0.0
    apply_ms: float = 0.0
    total_ms: float = 0.0
    recovered: bool = False
    recovered_from: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The fields as one JSON-ready dict (the metrics line)."""
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
        prepared: what the target built ahead of the commit
            (:class:`~torch_deltasync.targets._base.PreparedCommit`), or ``None``.
        touched: a commit of it began writing the target (a write or assign returned, or a
            prepared commit was tried); a refusal (``IncompatibleTargetError``) of a commit that
            has not touched the target left it as it was.
    """

    plan: UpdatePlan
    base_version: int | None
    stats: UpdateStats | None
    _dense: dict[str, torch.Tensor] | None = None
    _sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    _checksums: dict[str, int] | None = None
    _generation: int = -1
    prepared: PreparedCommit | None = None
    touched: bool = False

    def release_prepared(self) -> None:
        """Free what the target built ahead of this update's commit (a commit of it then writes
        the usual way, e.g. re-packing vLLM modules inside the pause)."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared.release()

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


@contextmanager
def _naming(store: Store) -> Iterator[None]:
    """Errors about the objects read (decoding and checksums name the version, object and tensor)
    also name the store they came from."""
    try:
        yield
    except CorruptObjectError as e:
        where = store.describe()
        if str(e).startswith(where):
            raise
        try:  # the same type and attributes (e.g. object_key, for failed_part), the store in front
            named = type(e)(f"{where}: {e}")
            named.__dict__.update(e.__dict__)
        except Exception:  # noqa: BLE001 - a subclass built otherwise (a Target's own): as it is
            named = None
        if named is None:
            raise
        raise named from e


def stage(store: Store, target: Target, plan: UpdatePlan, checksums: dict[str, int], ahead: bool,
          pool: Executor, threads: int) -> StagedUpdate:
    """One staging pass of :meth:`DeltaReceiver.prepare`: download ``plan``'s objects on ``pool``,
    decode and validate them, compose what a commit writes and verify it against the published
    checksums, on top of the held state whose checksums are ``checksums``; with ``ahead``, let the
    target prepare its commit (``Target.prepare_commit``). The caller has checked the target.
    Writes nothing.

    Raises:
        CorruptObjectError: the chain's manifests disagree on tensors or dtype, or an object is
            damaged (what :func:`download`, :func:`stage_anchor` and :func:`stage_deltas` raise).
        ChecksumMismatchError: the staged state is not the published one (:func:`verify_checksums`).
    """
    final = plan.manifests[-1]
    shapes = {t.name: t.shape for t in final.tensors}
    for m in plan.manifests:
        other = {t.name: t.shape for t in m.tensors}
        if other != shapes or m.inference_dtype != final.inference_dtype:
            diff = (f"dtype {m.inference_dtype} vs {final.inference_dtype}" if other == shapes else
                    next(f"tensor {n!r}: {other.get(n, 'absent')} vs {shapes.get(n, 'absent')}"
                         for n in [*shapes, *other] if other.get(n) != shapes.get(n)))
            raise CorruptObjectError(
                f"{store.describe()}: versions {m.version} and {final.version} are on one chain but their manifests "
                f"list different tensors ({diff}); a chain keeps its tensors, so one of the manifests is damaged or "
                "forged (`deltasync verify` lists the damaged versions; the writer's next anchor starts a sound chain)"
            )
    t = time.perf_counter()
    blobs = download(store, plan, pool)
    download_ms = (time.perf_counter() - t) * 1e3

    with _naming(store):
        t = time.perf_counter()
        dense = sparse = base = None
        if plan.path == "anchor":
            dense = stage_anchor(plan, blobs, shapes, threads)
        else:
            sparse, base = stage_deltas(target, plan.manifests, blobs, final.inference_dtype, threads)
        del blobs
        decode_ms = (time.perf_counter() - t) * 1e3

        t = time.perf_counter()
        new_checksums = verify_checksums(target, final, dense, sparse, checksums, base, threads)
        verify_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    prepared = prepare_commit(target, sparse, dense) if ahead else None
    stats = UpdateStats(final.version, plan.from_version, plan.path, len(plan.manifests), plan.nbytes, 0,
                        download_ms=download_ms, decode_ms=decode_ms, verify_ms=verify_ms,
                        ahead_ms=(time.perf_counter() - t) * 1e3)
    return StagedUpdate(plan, plan.from_version, stats, dense, sparse, new_checksums, prepared=prepared)


def write_staged(target: Target, staged: StagedUpdate, threads: int) -> int:
    """The writes of :meth:`DeltaReceiver.commit`: what the target prepared ahead if it still
    applies, else ``assign`` of every full tensor (anchor path) or ``write`` of every changed one
    (delta path; different tensors on ``threads`` threads where the target declares
    ``concurrent_writes``, largest first), then ``finish``. Returns the elements written."""
    prepared, staged.prepared = staged.prepared, None
    staged.touched = prepared is not None

    def touching(call: Callable, *args: Any) -> None:  # a target refuses before it writes anything
        call(*args)
        staged.touched = True

    if staged._dense is not None:
        changed = sum(full.numel() for full in staged._dense.values())
        if prepared is None or not prepared.commit():
            for name, full in staged._dense.items():
                touching(target.assign, name, full)
            target.finish(staged.written)
        return changed
    writes = [(name, pos, val) for name, (pos, val) in (staged._sparse or {}).items() if pos.numel()]
    if prepared is None or not prepared.commit():
        # a write costs a cache line per change at RL densities: tensors at once where allowed
        threads = threads if allows_concurrent(target, "writes") else 1
        map_largest_first(lambda w: touching(target.write, *w), writes, [w[1].numel() for w in writes], threads)
        target.finish(staged.written)
    return sum(w[1].numel() for w in writes)


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


def read_version(m: Manifest, blobs: dict[str, bytes]) -> dict[str, list[EncodedDelta]]:
    """Read every delta object of ``m`` (:func:`~torch_deltasync.format.read_delta`, nothing
    decoded yet) and check the declared counts against the manifest.

    Returns:
        ``{name: [EncodedDelta per object]}`` for the tensors ``m`` changes, in ``m``'s order.

    Raises:
        CorruptObjectError: as ``read_delta``, or a tensor whose objects declare another number of
            changes than the manifest (each decode then checks its blob holds what it declares).
    """
    per_tensor: dict[str, list[EncodedDelta]] = {}
    for o in m.delta_objects:
        for name, e in read_delta(blobs[o.key], m, o).items():
            per_tensor.setdefault(name, []).append(e)
    out = {}
    for entry in m.tensors:
        parts = per_tensor.get(entry.name, [])
        n = sum(p.count for p in parts)
        if n != entry.changed:
            e = CorruptObjectError(
                f"version {m.version}: tensor {entry.name!r} has {n} changes in its objects, manifest says {entry.changed}"
            )
            if m.delta_objects:
                e.object_key = m.delta_objects[0].key  # the version's delta part (failed_part)
            raise e
        if parts:
            out[entry.name] = parts
    return out


def _decode(version: int, name: str, parts: list[EncodedDelta]) -> TensorDelta:
    """One tensor's changes in one version, from all of the version's objects."""
    return concat([p.decode() for p in parts], f"version {version} tensor {name!r}")


def stage_deltas(target: Target, manifests: tuple[Manifest, ...], blobs: dict[str, bytes], dtype: torch.dtype,
                 threads: int | None = None):
    """Compose a delta chain without touching the target.

    Each changed tensor is staged on its own: its changes decoded version by version, the entries
    it holds selected, its old values read from the target, steps resolved, versions merged. The
    tensors are shared out over ``threads`` threads largest first
    (:func:`~torch_deltasync._pool.map_largest_first`): the compiled kernels, zstd and the torch
    ops behind the reads release the GIL, and a tensor's decoded changes are still in cache when
    its old values are read and resolved. That calls :meth:`Target.read` and ``owned`` for
    different tensors at once, so it is done for targets that declare ``concurrent_reads = True``
    (the library's do); for others the tensors are decoded on the threads and staged on the
    calling thread, in order.

    Every object of the chain is read and checked (:func:`read_version`) before any tensor is
    staged; of the tensors whose staging fails, the error of the first in the order the manifests
    list them is raised, whatever its kind (a target's error on one tensor comes before a corrupt
    blob of a later one).

    Args:
        threads: tensors staged at once; ``None``: :func:`~torch_deltasync._pool.default_threads`
            (one per CPU core the process may use within its CPU quota, at most 8); 1: all on the calling
            thread, in order.

    Returns:
        ``(staged, base)``: ``staged`` maps each changed tensor to ``(positions, final values)``
        (int64 and ``dtype``, ``(k,)``, sorted); ``base`` maps the tensors changed by exactly one
        version of the chain with a relative codec to the target's values at those positions, read
        once here and reused by :func:`verify_checksums`.

    Raises:
        CorruptObjectError: as :func:`read_version` and the codec's decoder (naming the version,
            object and tensor), or a position the target refuses.
        ChecksumMismatchError: the target's old values are not the chain's base (a relative delta's
            ``base_checksum``), naming the version and tensor.
        IncompatibleTargetError: the target's ``read`` returned values of another shape or dtype.
    """
    chains: dict[str, list[tuple[int, list[EncodedDelta]]]] = {}
    for m in manifests:
        for name, parts in read_version(m, blobs).items():
            chains.setdefault(name, []).append((m.version, parts))
    names = list(chains)
    sizes = [sum(p.count for _, parts in chains[n] for p in parts) for n in names]
    if allows_concurrent(target, "reads"):
        # chains.pop: each tensor's encoded parts are let go once it is staged
        results = map_largest_first(lambda n: _stage_tensor(target, n, _decoded(n, chains.pop(n)), dtype),
                                    names, sizes, threads)
    else:
        decoded = map_largest_first(lambda n: list(_decoded(n, chains.pop(n))), names, sizes, threads)
        results = [_stage_tensor(target, n, d, dtype) for n, d in zip(names, decoded)]
    staged = dict(zip(names, (s for s, _ in results)))
    base = {n: b for n, (_, b) in zip(names, results) if b is not None}
    return staged, base


def _decoded(name: str, chain: list[tuple[int, list[EncodedDelta]]]) -> Iterator[tuple[int, TensorDelta]]:
    """``(version, delta)`` of one tensor's chain, each version decoded when it is asked for."""
    return ((version, _decode(version, name, parts)) for version, parts in chain)


def _stage_tensor(target: Target, name: str, chain: Iterable[tuple[int, TensorDelta]], dtype: torch.dtype):
    """One tensor's part of :func:`stage_deltas`: ``((positions, final values), base or None)``
    from its ``(version, delta)`` chain."""
    staged: tuple[torch.Tensor, torch.Tensor] | None = None
    base = None
    for version, d in chain:
        if not target.holds_all:
            d = d.select(target.owned(name, d.positions))
        if d.needs_base and d.numel:  # (a rank that holds none of the changes has nothing to read)
            d_old = _lookup(target, name, staged, d.positions, dtype)
            # after earlier versions of the chain, the base is the held weights plus those
            with _named_mismatch(version, name, "" if staged is None else (
                    " (the base is the held version with the chain's earlier versions of this tensor "
                    "applied: the held weights or one of those versions is wrong)")):
                new = d.resolve(d_old)
            if staged is None:
                base = d_old
        else:
            new = d.values
        if staged is None:
            staged = (d.positions, new)
        else:
            staged = merge(*staged, d.positions, new)
            base = None  # the union's old values are no longer one read
    assert staged is not None
    return staged, base


def _lookup(target: Target, name: str, staged: tuple[torch.Tensor, torch.Tensor] | None, pos: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Values at ``pos`` as of the staged state: staged values where present, else the target's."""
    if staged is None:
        return _read(target, name, pos, dtype)
    spos, sval = staged
    out = torch.empty(pos.shape, dtype=dtype)
    if spos.numel():
        i = torch.searchsorted(spos, pos).clamp_(max=spos.numel() - 1)
        hit = spos[i] == pos
    else:
        i = torch.zeros_like(pos)
        hit = torch.zeros_like(pos, dtype=torch.bool)
    # (masks on the integer views: torch's masked writes do not take every float dtype, e.g. fp8)
    bits(out)[hit] = bits(sval)[i[hit]]
    miss = ~hit
    if bool(miss.any()):
        bits(out)[miss] = bits(_read(target, name, pos[miss], dtype))
    return out


def _read(target: Target, name: str, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``target.read``, its result checked: ``(k,)`` in ``dtype``.

    Raises:
        IncompatibleTargetError: the target returned something else (named, with what it must be).
    """
    out = target.read(name, pos, dtype)
    if not isinstance(out, torch.Tensor) or out.shape != pos.shape or out.dtype != dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise IncompatibleTargetError(
            f"{type(target).__name__}.read({name!r}, ...) returned {got} for {pos.numel()} positions; "
            f"a Target's read must return the values at the positions, {dtype} ({pos.numel()},)")
    return out


@contextmanager
def _named_mismatch(version: int, name: str, note: str = "") -> Iterator[None]:
    """Re-raise a :class:`ChecksumMismatchError` naming ``version`` and tensor ``name`` (+ ``note``)."""
    try:
        yield
    except ChecksumMismatchError as e:
        raise ChecksumMismatchError(f"version {version} tensor {name!r}: {e}{note}") from None

def stage_anchor(plan: UpdatePlan, blobs: dict[str, bytes], shapes: dict[str, tuple[int, ...]],
                 threads: int | None = None):
    """Rebuild full tensors from the anchor's blocks, then apply the chain's deltas to them (the
    tensors of each version on ``threads`` threads, as :func:`stage_deltas`)."""
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
                raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap ({DAMAGED_HINT})")
            full[idx] = block
            cover[idx] = True
        if not bool(cover.all()):
            raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap or leave gaps "
                                     f"({DAMAGED_HINT})")
        dense[name] = full
    for m in plan.manifests[1:]:
        changed = read_version(m, blobs)

        def apply(name: str, version: int = m.version) -> None:
            # decode, then one compiled pass: checksum of the old values, steps, write
            with _named_mismatch(version, name, f" (on this anchor path the base is anchor version {anchor.version}"
                                 " with the chain's earlier versions applied: that anchor's data or one of those "
                                 "versions is damaged, not weights held here)"):
                _decode(version, name, changed[name]).apply_to(dense[name].view(-1))

        map_largest_first(apply, list(changed), [sum(p.count for p in parts) for parts in changed.values()], threads)
    return dense

def verify_checksums(target: Target, final: Manifest, dense, staged, checksums: dict[str, int],
                     base: dict[str, torch.Tensor] | None = None, threads: int | None = None) -> dict[str, int]:
    """Checksums of the staged state, from the held state's ``checksums`` and the changes;
    raise if they differ from ``final``'s manifest. Tensors are checked on ``threads`` threads
    (one when the check may read a target without ``concurrent_reads``, as :func:`stage_deltas`)."""
    if not target.holds_all:
        return {}  # partial holders cannot see whole tensors; sha256 protected the bytes
    base = base or {}

    def one(name: str) -> int:
        if dense is not None:
            return tensor_checksum(dense[name])
        c = checksums.get(name)
        if c is None:
            raise CorruptObjectError(f"no checksum held for {name!r}")
        if name in staged:
            pos, val = staged[name]
            old = base.get(name)
            if old is None:  # not read while staging
                old = _read(target, name, pos, final.inference_dtype)
            c = combine(c, checksum_change(pos, old, val))
        return c

    names = [entry.name for entry in final.tensors]
    sizes = [dense[n].numel() if dense is not None else staged[n][0].numel() if n in staged else 0 for n in names]
    if dense is None and not allows_concurrent(target, "reads"):
        threads = 1  # one() may read the target (tensors changed by several versions)
    new = dict(zip(names, map_largest_first(one, names, sizes, threads)))
    bad = [entry.name for entry in final.tensors if new[entry.name] != entry.checksum]
    if bad:
        raise ChecksumMismatchError(
            f"version {final.version}: the staged state differs from the published checksums for "
            f"{len(bad)} tensors, e.g. {bad[:3]}; nothing was applied (the objects read, or the held weights "
            "they apply to, are not what the writer published: an update recovers from an anchor where one "
            "exists; `deltasync verify` tells damaged versions, `verify()` weights changed behind the receiver)"
        )
    return new
