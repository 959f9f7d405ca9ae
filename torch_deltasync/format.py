"""Anchor and delta objects: safetensors files with strict validation on read.

Only safetensors and JSON are ever read from a store (never pickle). An object is checked in this
order before any tensor leaves this module:

1. its size and sha256 against the manifest (:func:`verify_bytes`);
2. the safetensors header: length below :data:`MAX_HEADER_BYTES` and inside the object, valid JSON,
   string-only ``__metadata__`` that names this format, kind, version and rank;
3. the tensors (parsed by ``safetensors`` itself, which bounds-checks offsets and dtypes), their
   names against the manifest, and (for deltas) every part through the codec's validating decoder.

Object layouts (``docs/format.md`` is the full specification):

* **anchor**: one tensor per model tensor, named as in HF, holding this rank's block of the full
  tensor in the inference dtype; ``__metadata__["slices"]`` is a JSON map
  ``{name: {"offsets": [...], "shape": [...]}}`` giving the block's place in the full tensor.
* **delta**: for each changed tensor, the codec's parts as ``<name>:<part>``;
  ``__metadata__["counts"]`` is a JSON map ``{name: changed elements in this object}``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ._dtypes import dtype_name
from ._pool import map_largest_first
from .codecs import Codec, TensorDelta, get_codec
from .errors import CorruptObjectError
from .layout import TensorSlice
from .manifest import FORMAT, FORMAT_VERSION, Manifest, ObjectEntry

__all__ = [
    "MAX_HEADER_BYTES",
    "encode_anchor",
    "decode_anchor",
    "encode_delta",
    "decode_delta",
    "read_delta",
    "EncodedDelta",
    "read_header",
    "verify_bytes",
    "verify_stored",
    "sha256_hex",
]

#: Largest safetensors header we accept (bytes). The header lists every tensor (~150 B each).
MAX_HEADER_BYTES = 64 << 20
#: Bytes per element of safetensors' dtypes (``safetensors/src/tensor.rs``, ``Dtype::size``).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: What to do about an object that fails its check (the end of the messages about damaged objects).
DAMAGED_HINT = ("damaged or replaced in the store: receivers take another path where one exists (an anchor), else "
            "the writer's next anchor rebuilds them; `deltasync verify` lists every damaged version")


def verify_bytes(data: bytes, entry: ObjectEntry, where: str) -> None:
    """Check an object's size and sha256 against its manifest entry.

    Raises:
        CorruptObjectError: size or digest differ (truncated, corrupted or replaced object).
    """
    if len(data) != entry.nbytes:  # (readers fetch one byte more than the entry: a longer object shows)
        size = f"{len(data):,} bytes" if len(data) < entry.nbytes else f"more than {entry.nbytes:,} bytes"
        raise CorruptObjectError(f"{where}: {entry.key} is {size}, manifest says {entry.nbytes:,} ({DAMAGED_HINT})")
    digest = sha256_hex(data)
    if digest != entry.sha256:
        raise CorruptObjectError(f"{where}: {entry.key} has sha256 {digest}, manifest says {entry.sha256} ({DAMAGED_HINT})")


def verify_stored(store, entry: ObjectEntry, where: str, *, part_nbytes: int = 64 << 20) -> None:
    """Check an object in ``store`` against its manifest entry without holding it in memory: its
    size first (one stat), then its bytes in ranges of ``part_nbytes``, hashed as they come.

    Args:
        store: the run's store.
        entry: the object's manifest entry (key, nbytes, sha256).
        where: names the version in messages (``"version 12"``).
        part_nbytes: bytes per ranged read (the memory held at once).

    Raises:
        CorruptObjectError: the size or the sha256 differs from the manifest.
        ObjectNotFoundError: the object is missing.
        StoreError: the store failed.
    """
    size = store.size(entry.key)
    if size != entry.nbytes:
        raise CorruptObjectError(f"{where}: {entry.key} is {size} bytes, manifest says {entry.nbytes} ({DAMAGED_HINT})")
    h = hashlib.sha256()
    for start in range(0, entry.nbytes, part_nbytes):
        end = min(start + part_nbytes, entry.nbytes)
        data = store.get(entry.key, start=start, end=end)
        if len(data) != end - start:
            raise CorruptObjectError(f"{where}: {entry.key} bytes [{start}, {end}) read as {len(data)} bytes")
        h.update(data)
    if h.hexdigest() != entry.sha256:
        raise CorruptObjectError(f"{where}: {entry.key} has sha256 {h.hexdigest()}, manifest says {entry.sha256} ({DAMAGED_HINT})")


def _metadata(kind: str, version: int, rank: int, world: int, dtype: torch.dtype, extra: dict) -> dict[str, str]:
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "kind": kind,
        "version": str(version),
        "rank": str(rank),
        "world": str(world),
        "inference_dtype": dtype_name(dtype),
    }
    meta.update({k: json.dumps(v, separators=(",", ":")) for k, v in extra.items()})
    return meta


def read_header(data: bytes, where: str = "object", *, size: int | None = None) -> tuple[dict, dict[str, str]]:
    """Parse and bound-check a safetensors header without touching tensor data.

    Args:
        data: the object, or its first bytes through the end of its header.
        where: what ``data`` is, for messages (store and key).
        size: the whole object's length in bytes when ``data`` is only its beginning (default:
            ``len(data)``).

    Returns:
        ``(tensor_index, metadata)``: the header's tensor entries and its ``__metadata__``.

    Raises:
        CorruptObjectError: truncated object, oversized or non-JSON header, non-string metadata.
    """
    total = len(data) if size is None else size
    if total < 8 or len(data) < 8:
        raise CorruptObjectError(f"{where}: {min(total, len(data))} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > total:
        raise CorruptObjectError(
            f"{where}: not a safetensors file, or a corrupt one: its header length field says {n} bytes, "
            f"the object has {total} bytes and headers may have at most {MAX_HEADER_BYTES}"
        )
    if 8 + n > len(data):  # fewer bytes came than the object's size promised: it changed while read
        raise CorruptObjectError(f"{where}: {len(data)} bytes read of a header that ends at byte {8 + n}: the "
                                 "object changed or was cut short while it was read; read it again")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptObjectError(f"{where}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptObjectError(f"{where}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptObjectError(f"{where}: __metadata__ must map strings to strings")
    for name, entry in header.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list) and all(type(d) is int for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(type(o) is int for o in entry["data_offsets"])):
            raise CorruptObjectError(f"{where}: malformed header entry for tensor {name!r}")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= total - 8 - n:
            raise CorruptObjectError(f"{where}: tensor {name!r} lies at bytes [{begin}, {end}) of the data, which has "
                                     f"{total - 8 - n} bytes: the object is truncated or corrupt")
        size = _DTYPE_BYTES.get(entry["dtype"])
        if size is None or any(d < 0 for d in entry["shape"]) or math.prod(entry["shape"]) * size != end - begin:
            raise CorruptObjectError(f"{where}: tensor {name!r} ({entry['dtype']}, shape {entry['shape']}) does not fill "
                                     f"its {end - begin} bytes: the object is corrupt")
    # safetensors' layout: the tensors' byte ranges tile the data exactly, in some order
    at = 0
    for begin, end in sorted(tuple(e["data_offsets"]) for e in header.values()):
        if begin != at:
            raise CorruptObjectError(f"{where}: the tensors' byte ranges {'overlap' if begin < at else 'leave a gap'} "
                                     f"at byte {min(begin, at)} of the data: the object is corrupt")
        at = end
    if at != total - 8 - n:
        raise CorruptObjectError(f"{where}: {total - 8 - n - at} bytes after the last tensor: the object is corrupt")
    return header, meta


def _load(data: bytes, manifest: Manifest, entry: ObjectEntry, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    where = f"version {manifest.version} object {entry.key}"
    _, meta = read_header(data, where)
    expected = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": kind,
                "version": str(manifest.version), "rank": str(entry.rank), "world": str(entry.world),
                "inference_dtype": dtype_name(manifest.inference_dtype)}
    for k, v in expected.items():
        if meta.get(k) != v:
            raise CorruptObjectError(f"{where}: metadata {k}={meta.get(k)!r}, expected {v!r}")
    try:
        tensors = _st_load(bytes(data))
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError and others
        raise CorruptObjectError(f"{where}: unreadable safetensors data: {e}") from None
    return tensors, meta


def json_meta(meta: Mapping[str, str], key: str, where: str) -> dict:
    """The JSON object stored as string metadata ``key`` of an object (``slices``, ``counts``).

    Raises:
        CorruptObjectError: the value is not JSON or not a JSON object (named with ``where``).
    """
    try:
        value = json.loads(meta.get(key, "{}"))
    except (ValueError, RecursionError):
        raise CorruptObjectError(f"{where}: metadata {key!r} is not JSON") from None
    if not isinstance(value, dict):
        raise CorruptObjectError(f"{where}: metadata {key!r} must be a JSON object")
    return value


# --- anchors ---------------------------------------------------------------------------------------


def encode_anchor(
    blocks: Mapping[str, tuple[torch.Tensor, TensorSlice]],
    *,
    version: int,
    dtype: torch.dtype,
    rank: int = 0,
    world: int = 1,
) -> bytes:
    """Serialize one rank's anchor object.

    Args:
        blocks: ``{name: (block, slice)}``: ``block`` is this rank's part of the tensor in the
            inference dtype (CPU or device; copied to CPU), shaped ``slice.shape``.
        version, rank, world: recorded in the metadata and checked on read.
    """
    tensors = {name: t.detach().to("cpu").contiguous().reshape(s.shape) for name, (t, s) in blocks.items()}
    slices = {name: s.to_json() for name, (_, s) in blocks.items()}
    return _st_save(tensors, metadata=_metadata("anchor", version, rank, world, dtype, {"slices": slices}))


def decode_anchor(data: bytes, manifest: Manifest, entry: ObjectEntry) -> dict[str, tuple[TensorSlice, torch.Tensor]]:
    """Read one verified anchor object of ``manifest``.

    Returns:
        ``{name: (slice, block)}`` with ``block`` shaped ``slice.shape`` in the inference dtype.

    Raises:
        CorruptObjectError: unknown tensor names, a block whose dtype or shape disagrees with its
            slice or the manifest, or a slice outside the tensor.
    """
    where = f"version {manifest.version} object {entry.key}"
    tensors, meta = _load(data, manifest, entry, "anchor")
    slices = json_meta(meta, "slices", where)
    specs = manifest.tensor_map()
    if set(slices) != set(tensors):
        raise CorruptObjectError(f"{where}: tensors and slice metadata name different tensors")
    out = {}
    for name, block in tensors.items():
        if name not in specs:
            raise CorruptObjectError(f"{where}: tensor {name!r} is not in the manifest")
        try:
            s = TensorSlice.from_json(slices[name], specs[name].shape)
        except CorruptObjectError as e:
            raise CorruptObjectError(f"{where}: tensor {name!r}: {e}") from None
        if block.dtype != manifest.inference_dtype or tuple(block.shape) != s.shape:
            raise CorruptObjectError(
                f"{where}: tensor {name!r} is {block.dtype} {tuple(block.shape)}, expected "
                f"{manifest.inference_dtype} {s.shape}"
            )
        out[name] = (s, block)
    return out


# --- deltas ----------------------------------------------------------------------------------------


def encode_delta(
    parts: Mapping[str, Mapping[str, torch.Tensor]],
    counts: Mapping[str, int],
    *,
    version: int,
    base_version: int,
    codec: str,
    dtype: torch.dtype,
    rank: int = 0,
    world: int = 1,
) -> bytes:
    """Serialize one rank's delta object.

    Args:
        parts: ``{name: {part: tensor}}`` as returned by the codec's ``encode``.
        counts: ``{name: changed elements}`` for the tensors in ``parts``.
    """
    tensors = {f"{name}:{p}": t.contiguous() for name, ps in parts.items() for p, t in ps.items()}
    meta = _metadata("delta", version, rank, world, dtype, {"counts": dict(counts)})
    meta["base_version"] = str(base_version)
    meta["codec"] = codec
    return _st_save(tensors, metadata=meta)


@dataclass(frozen=True, eq=False)
class EncodedDelta:
    """One tensor's changes as one verified delta object stores them, checked but not decoded yet
    (what :func:`read_delta` returns; :meth:`decode` does the rest).

    Attributes:
        name: the tensor's HF name.
        parts: the codec's ``{part: tensor}`` as parsed from the object (CPU, owning their bytes).
        numel: elements of the full tensor (from the manifest).
        count: changed elements the object declares for this tensor, in ``[0, numel]``.
        codec: the manifest's codec (:func:`~torch_deltasync.codecs.get_codec`).
        dtype: the inference dtype.
        where: the object, for error messages (``"version V object KEY"``).
        key: the object's store key (set as ``object_key`` on the errors of :meth:`decode`).
    """

    name: str
    parts: Mapping[str, torch.Tensor]
    numel: int
    count: int
    codec: Codec
    dtype: torch.dtype
    where: str
    key: str

    def decode(self) -> TensorDelta:
        """The codec's validating decode.

        Returns:
            A :class:`~torch_deltasync.codecs.TensorDelta` of ``count`` changes: int64 global flat
            positions ``(count,)``, sorted; values ``(count,)`` in ``dtype``; steps and the
            relative mask where the codec codes steps (see ``TensorDelta``).

        Raises:
            CorruptObjectError: anything the codec's decoder rejects (out-of-range, unsorted or
                duplicate indices, wrong dtypes, ...), or a decoded count other than ``count``
                (whatever the codec checks itself), naming the object and the tensor; its
                ``object_key`` is :attr:`key`.
        """
        try:
            d = self.codec.decode(self.parts, numel=self.numel, count=self.count, dtype=self.dtype)
        except CorruptObjectError as e:
            raise _of_object(CorruptObjectError(f"{self.where}: tensor {self.name!r}: {e}"), self.key) from None
        if d.numel != self.count:
            raise _of_object(CorruptObjectError(f"{self.where}: tensor {self.name!r}: {d.numel} changes decoded, "
                                                f"the object declares {self.count}"), self.key)
        return d


def _of_object(e: CorruptObjectError, key: str) -> CorruptObjectError:
    """``e`` with ``object_key = key``: the object it condemns (a receiver's recovery then avoids
    every path through that object, :func:`torch_deltasync.receiver._stage.failed_part`)."""
    e.object_key = key
    return e


def read_delta(data: bytes, manifest: Manifest, entry: ObjectEntry) -> dict[str, EncodedDelta]:
    """Read and check one verified delta object of ``manifest``, without decoding its tensors.

    Returns:
        ``{name: EncodedDelta}`` for the tensors this object changes, in the object's order.

    Raises:
        CorruptObjectError: metadata that disagrees with the manifest, unknown tensor names,
            counts missing, extra or outside ``[0, numel]``; its ``object_key`` is ``entry.key``.
        ValueError: the manifest names a codec that is not registered here.
    """
    try:
        return _read_delta(data, manifest, entry)
    except CorruptObjectError as e:
        raise _of_object(e, entry.key)


def _read_delta(data: bytes, manifest: Manifest, entry: ObjectEntry) -> dict[str, EncodedDelta]:
    """:func:`read_delta` but for the ``object_key`` of its errors."""
    where = f"version {manifest.version} object {entry.key}"
    tensors, meta = _load(data, manifest, entry, "delta")
    if meta.get("codec") != manifest.codec or meta.get("base_version") != str(manifest.base_version):
        raise CorruptObjectError(
            f"{where}: its metadata (codec {meta.get('codec')!r}, base_version {meta.get('base_version')!r}) disagrees "
            f"with the manifest ({manifest.codec!r}, {str(manifest.base_version)!r}) ({DAMAGED_HINT})")
    counts = json_meta(meta, "counts", where)
    specs = manifest.tensor_map()
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, sep, part = key.rpartition(":")
        if not sep or name not in specs:
            raise CorruptObjectError(f"{where}: entry {key!r} names no tensor of the manifest")
        grouped.setdefault(name, {})[part] = t
    if set(counts) != set(grouped):
        raise CorruptObjectError(f"{where}: counts metadata and tensors name different tensors")
    codec = get_codec(manifest.codec)  # an unknown codec fails here, for the whole object
    out = {}
    for name, ps in grouped.items():
        count = counts[name]
        if type(count) is not int or not 0 <= count <= specs[name].numel:
            raise CorruptObjectError(f"{where}: bad count {count!r} for {name!r}")
        out[name] = EncodedDelta(name, ps, specs[name].numel, count, codec, manifest.inference_dtype, where, entry.key)
    return out


def decode_delta(data: bytes, manifest: Manifest, entry: ObjectEntry, *,
                 threads: int | None = None) -> dict[str, TensorDelta]:
    """Read and validate one verified delta object of ``manifest``: :func:`read_delta`, then
    :meth:`EncodedDelta.decode` of its tensors on ``threads`` threads (the compiled kernels and
    zstd release the GIL; ``None``: :func:`~torch_deltasync._pool.default_threads`).

    Returns:
        ``{name: TensorDelta}`` for the tensors this object changes (global flat positions).

    Raises:
        CorruptObjectError: as :func:`read_delta` and :meth:`EncodedDelta.decode` (the first
            failing tensor in the object's order).
    """
    encoded = read_delta(data, manifest, entry)
    decoded = map_largest_first(EncodedDelta.decode, list(encoded.values()), [e.count for e in encoded.values()],
                                threads)
    return dict(zip(encoded, decoded))
