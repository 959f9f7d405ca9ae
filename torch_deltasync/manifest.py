"""The version manifest (JSON, format 1). Where it lives: :mod:`torch_deltasync.keys`.

Layout under a run's prefix (``docs/format.md`` has the full specification)::

    objects/<version:012d>/anchor-r<rank:05d>-of<world:05d>.safetensors
    objects/<version:012d>/delta-r<rank:05d>-of<world:05d>.safetensors
    versions/<version:012d>.json      # the manifest, written last, immutable
    LATEST                            # advisory pointer to the newest version

A version exists for readers exactly when its manifest exists. Manifests are parsed from untrusted
bytes: :meth:`Manifest.from_json` checks the manifest's digest (a SHA-256 of its content, so a
flipped byte reads as corruption, not as a model that does not fit), then every field's type and
range and every object key before anything else looks at it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ._dtypes import dtype_from_name, dtype_name
from ._memory import physical_nbytes
from .checksum import format_checksum, parse_checksum
from .codecs import codec_names
from .errors import ChecksumMismatchError, CorruptObjectError
from .keys import MAX_VERSION, Kind, check_version, manifest_key, parse_object_key
from .store import check_key

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "check_run_file",
    "check_run_files",
    "load_manifest",
    "seal_manifest",
]

FORMAT = "torch_deltasync"
FORMAT_VERSION = 1

#: Largest manifest we parse (bytes). A 1T-parameter model has ~10^5 tensors at ~200 B each.
MAX_MANIFEST_BYTES = 256 << 20
#: Most run-level objects a manifest may vouch for (:attr:`Manifest.run_files`).
MAX_RUN_FILES = 64
#: Bytes of a manifest read in one request (most manifests fit); a larger one has its size checked
#: against :data:`MAX_MANIFEST_BYTES` before the rest is read.
_MANIFEST_HEAD_BYTES = 1 << 20
#: The start of a manifest with a digest: ``{"digest": "sha256:<64 hex>",`` (docs/format.md §3).
_DIGEST_PREFIX = re.compile(rb'\{"digest": "sha256:([0-9a-f]{64})",')
_DIGEST_NBYTES = len(b'{"digest": "sha256:",') + 64
#: Top-level members of manifests written before digests: a manifest without a digest may have no
#: other member (so a digest whose name is damaged cannot pass as an old manifest).
_UNSEALED_FIELDS = frozenset({
    "format", "format_version", "version", "kind", "base_version", "anchor_version", "codec",
    "inference_dtype", "run_id", "created_at", "objects", "tensors", "aliases", "stats",
})


def load_manifest(store, version: int) -> "Manifest":
    """Read and validate the manifest of ``version`` from ``store`` (a run's prefix).

    The first MiB is read in one request; a manifest that fills it has its size checked (one more
    request) before the rest is read, so an oversized object is refused without reading it.

    Raises:
        TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``
            (:func:`~torch_deltasync.keys.check_version`).
        VersionNotFoundError: the version is not visible (never published or not retained).
        CorruptObjectError: the manifest is malformed, its digest does not match, or it is larger
            than :data:`MAX_MANIFEST_BYTES` (the message names the store, key and version).
        StoreError: the store failed.
    """
    from .errors import ObjectNotFoundError, VersionNotFoundError

    check_version(version)
    key = manifest_key(version)
    where = f"{store.describe()}: {key} (manifest of version {version})"
    try:
        head = min(_MANIFEST_HEAD_BYTES, MAX_MANIFEST_BYTES + 1)
        data = store.get(key, start=0, end=head)
        if len(data) == head:
            size = store.size(key)
            if size > MAX_MANIFEST_BYTES:
                raise CorruptObjectError(
                    f"{where} is {size:,} bytes, above the {MAX_MANIFEST_BYTES:,}-byte limit of a manifest; "
                    "not read")
            # one byte past the size it has: a manifest that grew meanwhile is refused below
            data += store.get(key, start=head, end=size + 1)
    except ObjectNotFoundError:
        raise VersionNotFoundError(f"{store.describe()}: version {version} is not visible") from None
    return Manifest.from_json(data, expected_version=version, where=where)


def read_digest(store, version: int) -> str | None:
    """The digest the stored manifest of ``version`` carries (``"sha256:<hex>"``), read from its
    first bytes in one ranged request (the digest is its first member, docs/format.md §3); ``None``
    for a manifest without one (written before digests, or damaged: :func:`load_manifest` tells).
    Cheap enough to ask on every poll whether a manifest is still the one read before.

    Raises:
        VersionNotFoundError: the version is not visible.
        CorruptObjectError: the first bytes came back short and the whole manifest is malformed.
        StoreError: the store failed.
    """
    from .errors import ObjectNotFoundError, VersionNotFoundError

    try:
        data = store.get(manifest_key(check_version(version)), start=0, end=_DIGEST_NBYTES)
    except ObjectNotFoundError:
        raise VersionNotFoundError(f"{store.describe()}: version {version} is not visible") from None
    m = _DIGEST_PREFIX.match(data)
    if m is None and len(data) < _DIGEST_NBYTES:  # no manifest is that short: a read cut short
        return load_manifest(store, version).digest  # the whole, validated read decides
    return f"sha256:{m.group(1).decode()}" if m is not None else None


def seal_manifest(doc: dict) -> bytes:
    """The manifest bytes of a JSON document: its digest member first, then the document.

    The document (any ``"digest"`` member dropped) is written as ``json.dumps(doc, indent=1)``;
    the digest is the SHA-256 of those bytes, and the manifest is ``{"digest": "sha256:<hex>",``
    followed by them without their opening ``{`` (docs/format.md §3).

    Args:
        doc: the manifest's fields, as :meth:`Manifest.to_json` writes them (a tool that edits a
            manifest parses it, changes fields and seals the result again).

    Returns:
        UTF-8 JSON bytes.
    """
    body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, indent=1, sort_keys=False).encode()
    return b'{"digest": "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def _check_digest(data: bytes, where: str) -> dict:
    """Parse manifest bytes and check their digest; returns the JSON document.

    Raises:
        CorruptObjectError: not JSON, a digest that does not match the content or is not where
            :func:`seal_manifest` puts it, or a manifest without a digest that has members
            manifests written before digests never had.
    """
    m = _DIGEST_PREFIX.match(data)
    if m is not None:
        actual = hashlib.sha256(b"{" + data[m.end():]).hexdigest()
        if actual != m.group(1).decode():
            raise CorruptObjectError(
                f"{where}: digest mismatch: the content hashes to sha256:{actual}, the manifest says "
                f"sha256:{m.group(1).decode()} (corrupted in storage or transfer)")
    try:
        doc = json.loads(data.decode("utf-8"))  # (json.loads of bytes would guess UTF-16 or -32 too)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptObjectError(f"{where} is not valid JSON: {type(e).__name__}: {e}") from None
    if m is not None:
        if not isinstance(doc, dict) or doc.get("digest") != f"sha256:{m.group(1).decode()}":
            raise CorruptObjectError(f"{where}: a second, different digest member")
        return doc
    if isinstance(doc, dict):
        if "digest" in doc:
            raise CorruptObjectError(
                f"{where}: the digest is not at the start of the manifest in its written form "
                '({"digest": "sha256:<64 hex digits>",...); the manifest was damaged or rewritten')
        unknown = sorted(set(doc) - _UNSEALED_FIELDS)
        if unknown:
            raise CorruptObjectError(
                f"{where}: no digest, and members a manifest without one never has: {unknown[:5]} (a damaged "
                "digest member?)")
    return doc


@dataclass(frozen=True)
class ObjectEntry:
    """One stored object of a version.

    Attributes:
        key: key relative to the run prefix (``objects/<v>/<kind>-r<rank>-of<world>.safetensors``).
        nbytes: exact object size in bytes.
        sha256: lower-case hex digest of the object bytes.
        rank, world: the sender rank that wrote it and the sender world size.
    """

    key: str
    nbytes: int
    sha256: str
    rank: int = 0
    world: int = 1

    @property
    def kind(self) -> str:
        """``"anchor"`` or ``"delta"``, from the key."""
        return "anchor" if "/anchor-r" in self.key else "delta"

    def to_json(self) -> dict:
        return {"key": self.key, "nbytes": self.nbytes, "sha256": self.sha256,
                "rank": self.rank, "world": self.world}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the model in HF naming.

    Attributes:
        name: HF state-dict name (``model.layers.0.self_attn.q_proj.weight``).
        shape: full (unsharded) shape in HF layout.
        checksum: :mod:`~torch_deltasync.checksum` value of the whole tensor in the inference dtype
            *after* this version.
        changed: elements whose bit pattern changed relative to ``base_version`` (``numel`` for
            an anchor without a base); the delta objects hold exactly this many changes.
    """

    name: str
    shape: tuple[int, ...]
    checksum: int
    changed: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape),
                "checksum": format_checksum(self.checksum), "changed": self.changed}


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs to know about one version.

    Attributes:
        version: this version's number (``0 <= version <= MAX_VERSION``).
        kind: ``"anchor"`` (full weights) or ``"delta"`` (changes relative to ``base_version``).
        base_version: the version the delta objects apply to. Required for deltas. An anchor that
            follows a published version also carries a delta against it (so receivers that hold
            the previous version never download the anchor); ``None`` for a run's first anchor.
        anchor_version: the anchor this version's chain starts from (itself for anchors).
        codec: name of the codec of the delta objects (``"packed"``, the default, or ``"raw"``;
            anchors are always dense).
        inference_dtype: dtype of every shipped value.
        run_id: identifies the writer session (a new writer on the same prefix gets a new one).
        tensors: every tensor of the model, in publish order.
        objects: every object of this version: anchor objects (anchors only) and delta objects
            (deltas, and anchors with a ``base_version``), told apart by their keys.
        aliases: tied names, ``{alias: canonical}``: the alias holds the same tensor and is not shipped.
        stats: informational numbers (changed elements, bytes, timings); never trusted for safety.
        created_at: Unix time in seconds.
        run_files: run-level objects this version depends on, ``{key: sha256 hex}`` (e.g. an
            adapter run's ``adapter/adapter_config.json``): readers of such a file check it
            against this (:func:`check_run_file`). Empty for plain weight runs.
        digest: ``"sha256:<hex>"``, the digest the stored manifest carries (read from the store;
            ``None`` for manifests written before digests and for one built in memory). Not part of
            equality: two manifests with the same fields are equal.
    """

    version: int
    kind: Kind
    base_version: int | None
    anchor_version: int
    codec: str
    inference_dtype: torch.dtype
    run_id: str
    tensors: tuple[TensorEntry, ...]
    objects: tuple[ObjectEntry, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    run_files: dict[str, str] = field(default_factory=dict)
    digest: str | None = field(default=None, compare=False, repr=False)

    # --- derived ---------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Total bytes of this version's objects."""
        return sum(o.nbytes for o in self.objects)

    @property
    def anchor_objects(self) -> tuple[ObjectEntry, ...]:
        return tuple(o for o in self.objects if o.kind == "anchor")

    @property
    def delta_objects(self) -> tuple[ObjectEntry, ...]:
        return tuple(o for o in self.objects if o.kind == "delta")

    @property
    def has_delta(self) -> bool:
        """Whether a receiver holding ``base_version`` can apply this version as a delta."""
        return self.base_version is not None

    @property
    def delta_nbytes(self) -> int:
        return sum(o.nbytes for o in self.delta_objects)

    @property
    def anchor_nbytes(self) -> int:
        return sum(o.nbytes for o in self.anchor_objects)

    @property
    def numel(self) -> int:
        """Total elements of the model."""
        return sum(t.numel for t in self.tensors)

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def zeros(self) -> dict[str, torch.Tensor]:
        """A CPU state dict of zeros with this version's names and shapes, in its inference dtype: a
        receiver target when no model is at hand (``deltasync verify`` and ``follow``).

        Shapes come from the store, so they are untrusted: the total is checked against this
        machine's physical memory before anything is allocated.

        Raises:
            IncompatibleTargetError: the tensors need more bytes than this machine's memory.
        """
        from .errors import IncompatibleTargetError

        need = self.numel * self.inference_dtype.itemsize
        have = physical_nbytes()
        if have is not None and need > have:
            raise IncompatibleTargetError(
                f"version {self.version} declares {need:,} bytes of tensors ({len(self.tensors)} tensors), "
                f"more than this machine's {have:,} bytes of memory")
        return {t.name: torch.zeros(t.shape, dtype=self.inference_dtype) for t in self.tensors}

    # --- wire form -------------------------------------------------------------------------------

    def to_json(self) -> bytes:
        """The manifest's bytes as stored (:func:`seal_manifest`: digest first, then the fields)."""
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "kind": self.kind,
            "base_version": self.base_version,
            "anchor_version": self.anchor_version,
            "codec": self.codec,
            "inference_dtype": dtype_name(self.inference_dtype),
            "run_id": self.run_id,
            "created_at": self.created_at,
            "objects": [o.to_json() for o in self.objects],
            "tensors": [t.to_json() for t in self.tensors],
            "aliases": dict(self.aliases),
            "stats": self.stats,
        }
        if self.run_files:  # (absent otherwise: the manifests of plain runs stay as they were)
            doc["run_files"] = dict(self.run_files)
        return seal_manifest(doc)

    @classmethod
    def from_json(cls, data: bytes, *, expected_version: int | None = None, where: str | None = None) -> "Manifest":
        """Parse and validate untrusted manifest bytes.

        Manifests with a digest (every manifest this version writes) must match it. Manifests
        written before digests existed have none; they are read as before, provided they have no
        member such manifests never had (docs/format.md §3).

        Args:
            data: the manifest object's bytes.
            expected_version: the version its key names; a manifest claiming another is refused.
            where: how errors name the manifest (default ``"manifest of version <v>"``).

        Raises:
            CorruptObjectError: anything malformed: larger than :data:`MAX_MANIFEST_BYTES`, not
                JSON, a digest that does not match, unknown format or format version, wrong types,
                negative sizes, keys escaping the prefix or not belonging to this version,
                duplicate tensor names, a delta without a valid base, and so on.
        """
        if where is None:
            where = f"manifest of version {expected_version}" if expected_version is not None else "manifest"
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptObjectError(f"{where} is {len(data):,} bytes or more, above the {MAX_MANIFEST_BYTES:,}-byte limit")
        doc = _check_digest(data, where)
        try:
            return cls._from_doc(doc, expected_version)
        except CorruptObjectError as e:
            raise CorruptObjectError(f"{where}: {e}") from None
        except (TypeError, KeyError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptObjectError(f"{where}: malformed field ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_doc(cls, doc: Any, expected_version: int | None) -> "Manifest":
        if not isinstance(doc, dict):
            raise CorruptObjectError("top level is not an object")
        if doc.get("format") != FORMAT:
            raise CorruptObjectError(f"unknown format {doc.get('format')!r} (expected {FORMAT!r})")
        fv = doc.get("format_version")
        if fv != FORMAT_VERSION:
            newer = type(fv) is int and fv > FORMAT_VERSION
            raise CorruptObjectError(
                f"unsupported format_version {fv!r}; this torch_deltasync reads format {FORMAT_VERSION}"
                + (". Upgrade torch_deltasync to read newer runs." if newer else " (the field is malformed)")
            )
        version = _int(doc["version"], "version", 0, MAX_VERSION)
        if expected_version is not None and version != expected_version:
            raise CorruptObjectError(f"claims version {version}, stored as version {expected_version}")
        kind = doc["kind"]
        if kind not in ("anchor", "delta"):
            raise CorruptObjectError(f"unknown kind {kind!r}")
        anchor_version = _int(doc["anchor_version"], "anchor_version", 0, version)
        base_raw = doc.get("base_version")
        base = None if base_raw is None and kind == "anchor" else _int(base_raw, "base_version", 0, version - 1)
        if kind == "anchor" and anchor_version != version:
            raise CorruptObjectError("an anchor is its own anchor_version")
        if kind == "delta" and anchor_version > base:
            raise CorruptObjectError(f"anchor_version {anchor_version} is after base_version {base}")
        codec = doc["codec"]
        if codec not in codec_names():
            raise CorruptObjectError(f"unknown codec {codec!r}; this reader knows {codec_names()}")
        dtype = dtype_from_name(doc["inference_dtype"])
        run_id = doc.get("run_id", "")
        if not isinstance(run_id, str):
            raise CorruptObjectError("run_id must be a string")

        objects = []
        seen_keys = set()
        for o in _list(doc["objects"], "objects"):
            key = check_key(o["key"])
            parsed = parse_object_key(key)
            if parsed is None or parsed[0] != version or (parsed[1] == "anchor" and kind != "anchor") or (
                parsed[1] == "delta" and base is None
            ):
                raise CorruptObjectError(f"object key {key!r} does not belong to {kind} version {version}")
            rank, world = _int(o["rank"], "rank", 0, 99999), _int(o["world"], "world", 1, 99999)
            if parsed[2:] != (rank, world) or rank >= world:
                raise CorruptObjectError(f"object key {key!r} does not match rank {rank} of {world}")
            sha = o["sha256"]
            if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                raise CorruptObjectError(f"bad sha256 {sha!r} for {key!r}")
            if key in seen_keys:
                raise CorruptObjectError(f"duplicate object {key!r}")
            seen_keys.add(key)
            objects.append(ObjectEntry(key, _int(o["nbytes"], "nbytes", 0, 1 << 50), sha, rank, world))
        if kind == "anchor" and not any(o.kind == "anchor" for o in objects):
            raise CorruptObjectError("an anchor without anchor objects")
        if kind == "delta" and not objects:
            raise CorruptObjectError("no objects")

        tensors = []
        names = set()
        for t in _list(doc["tensors"], "tensors"):
            name = t["name"]
            if not isinstance(name, str) or not name or len(name) > 1024 or name in names:
                raise CorruptObjectError(f"bad or duplicate tensor name {name!r}")
            names.add(name)
            shape = tuple(_int(s, f"shape of {name}", 0, 1 << 48) for s in _list(t["shape"], "shape"))
            if len(shape) > 8:
                raise CorruptObjectError(f"tensor {name!r} has {len(shape)} dims (at most 8)")
            entry = TensorEntry(name, shape, parse_checksum(t["checksum"]), 0)
            changed = _int(t.get("changed", 0), f"changed of {name}", 0, entry.numel)
            tensors.append(TensorEntry(name, shape, entry.checksum, changed))
        aliases = doc.get("aliases", {})
        if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and isinstance(c, str) and c in names and a not in names
            for a, c in aliases.items()
        ):
            raise CorruptObjectError("aliases must map unshipped names to shipped tensor names")
        stats = doc.get("stats", {})
        run_files = doc.get("run_files", {})
        if not (isinstance(run_files, dict) and len(run_files) <= MAX_RUN_FILES and all(
                isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)
                and not check_key(k).startswith(("versions/", "objects/")) for k, h in run_files.items())):
            raise CorruptObjectError(f"run_files must map at most {MAX_RUN_FILES} run-level keys to sha256 digests, "
                                     f"got {run_files!r:.120}")
        created = doc.get("created_at", 0.0)  # informational (Unix seconds); checked, never trusted
        if type(created) not in (int, float) or not 0 <= created < 1e11:
            raise CorruptObjectError(f"created_at must be Unix seconds in [0, 1e11), got {created!r:.40}")
        return cls(
            version=version, kind=kind, base_version=base, anchor_version=anchor_version,
            codec=codec, inference_dtype=dtype, run_id=run_id, tensors=tuple(tensors),
            objects=tuple(objects), aliases=dict(aliases),
            stats=stats if isinstance(stats, dict) else {},
            created_at=float(created), run_files=dict(run_files), digest=doc.get("digest"),
        )


def check_run_file(data: bytes, key: str, m: "Manifest", where: str) -> bytes:
    """Check the bytes of run-level object ``key`` against the sha256 manifest ``m`` records for it
    (:attr:`Manifest.run_files`; none recorded, as in runs written before them: unchecked).

    Returns:
        ``data``.

    Raises:
        ChecksumMismatchError: naming ``where`` (the object) and the version, when they differ:
            the object was changed or damaged after the version was published.
    """
    want = m.run_files.get(key)
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ChecksumMismatchError(
            f"{where} does not match the sha256 the manifest of version {m.version} records for it: it was changed "
            "or damaged after the run published it. Restore it, or publish the run again on a new prefix")
    return data


def check_run_files(store, m: "Manifest", seen: set[tuple[str, str]] | None = None) -> int:
    """Read every run-level object version ``m`` depends on and check it (:func:`check_run_file`).

    Args:
        seen: ``(key, sha256)`` pairs already checked (skipped); those checked here are added.

    Returns:
        How many were checked (or skipped as seen).

    Raises:
        ObjectNotFoundError: one is gone. ChecksumMismatchError: one differs. StoreError: the store failed.
    """
    seen = set() if seen is None else seen
    for key, sha in m.run_files.items():
        if (key, sha) not in seen:
            check_run_file(store.get(key), key, m, f"{store.describe()}/{key}")
            seen.add((key, sha))
    return len(m.run_files)


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptObjectError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise CorruptObjectError(f"{what} must be a list, got {type(v).__name__}")
    return v
