"""Golden bytes of anchor and delta objects (docs/format.md §4, codec ``raw`` §5).

safetensors writes ``__metadata__`` in hash-map order, so two encodings of the same object may
differ in the order of the metadata members (and so in sha256): the golden checks pin everything
else byte for byte (length field, tensor entries, padding, data section) and the metadata as a JSON
object. In the other direction, objects written by hand from the specification, with the members in
an order our writer never uses, must decode to the exact values.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from torch_deltasync.codecs import get_codec
from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.format import decode_anchor, decode_delta, encode_anchor, encode_delta
from torch_deltasync.layout import TensorSlice
from torch_deltasync.manifest import Manifest, ObjectEntry, TensorEntry

# w = [[1.0, -2.0, 0.5], [3.0, 0.0, -0.25]] in bf16, little-endian bit patterns:
# 0x3f80 0xc000 0x3f00 0x4040 0x0000 0xbe80
W_BYTES = bytes.fromhex("803f00c0003f4040000080be")
W_BITS = [0x3F80, 0xC000, 0x3F00, 0x4040, 0x0000, 0xBE80]
# A delta of w: elements 1 and 4 become -1.0 (0xbf80) and 0.125 (0x3e00).
DELTA_DATA = bytes.fromhex("01000000" "04000000" "80bf" "003e")

ANCHOR_META = {"format": "torch_deltasync", "format_version": "1", "kind": "anchor", "version": "3", "rank": "0",
               "world": "1", "inference_dtype": "bfloat16", "slices": '{"w":{"offsets":[0,0],"shape":[2,3]}}'}
DELTA_META = {"format": "torch_deltasync", "format_version": "1", "kind": "delta", "version": "4", "rank": "0",
              "world": "1", "inference_dtype": "bfloat16", "base_version": "3", "codec": "raw",
              "counts": '{"w":2}'}


def _w() -> torch.Tensor:
    return torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -0.25]], dtype=torch.bfloat16)


def _split(data: bytes) -> tuple[int, bytes, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8:8 + n], data[8 + n:]


def _handmade(meta: dict, entries: dict, payload: bytes) -> bytes:
    """A safetensors object written from the specification, members in reverse order."""
    header = {name: entries[name] for name in reversed(list(entries))}
    header["__metadata__"] = {k: meta[k] for k in reversed(list(meta))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + payload


def _manifest(version: int, kind: str, codec: str = "raw") -> Manifest:
    key = f"objects/{version:012d}/{kind}-r00000-of00001.safetensors"
    return Manifest(version=version, kind=kind, base_version=3 if kind == "delta" else None,
                    anchor_version=3, codec=codec, inference_dtype=torch.bfloat16, run_id="golden",
                    tensors=(TensorEntry("w", (2, 3), 0, 2 if kind == "delta" else 6),),
                    objects=(ObjectEntry(key, 1, "ab" * 32, 0, 1),), aliases={}, stats={}, created_at=0.0)


def test_anchor_object_golden_bytes():
    data = encode_anchor({"w": (_w(), TensorSlice.full((2, 3)))}, version=3, dtype=torch.bfloat16)
    n, header, payload = _split(data)
    assert n % 8 == 0 and header.rstrip(b" ").endswith(b"}") and len(header) - len(header.rstrip(b" ")) < 8
    doc = json.loads(header)
    assert doc.pop("__metadata__") == ANCHOR_META
    assert doc == {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}
    assert payload == W_BYTES
    assert len(data) == 8 + n + 12


def test_delta_object_golden_bytes():
    parts = get_codec("raw").encode(torch.tensor([1, 4]), torch.tensor([-1.0, 0.125], dtype=torch.bfloat16),
                                    None, numel=6)
    data = encode_delta({"w": parts}, {"w": 2}, version=4, base_version=3, codec="raw", dtype=torch.bfloat16)
    n, header, payload = _split(data)
    doc = json.loads(header)
    assert n % 8 == 0 and doc.pop("__metadata__") == DELTA_META
    assert doc == {"w:idx": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
                   "w:val": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}
    assert payload == DELTA_DATA


def test_handmade_anchor_decodes_to_exact_bits():
    data = _handmade(ANCHOR_META, {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}, W_BYTES)
    out = decode_anchor(data, _manifest(3, "anchor"), _manifest(3, "anchor").objects[0])
    s, block = out["w"]
    assert (s.offsets, s.shape) == ((0, 0), (2, 3))
    assert block.view(torch.int16).flatten().tolist() == [b - 0x10000 if b >= 0x8000 else b for b in W_BITS]


def test_handmade_delta_decodes_to_exact_bits():
    entries = {"w:idx": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
               "w:val": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}
    m = _manifest(4, "delta")
    d = decode_delta(_handmade(DELTA_META, entries, DELTA_DATA), m, m.objects[0])["w"]
    assert d.positions.tolist() == [1, 4]
    assert d.values.view(torch.int16).tolist() == [0xBF80 - 0x10000, 0x3E00]


def test_a_codec_that_decodes_another_count_than_declared_is_refused(monkeypatch):
    """The count an object declares is checked on every decode, not left to each codec."""
    from torch_deltasync.codecs import TensorDelta, get_codec

    raw = type(get_codec("raw"))
    decode = raw.decode

    def one_short(self, parts, **kw):
        d = decode(self, parts, **kw)
        return TensorDelta(d.positions[:-1], d.values[:-1])

    monkeypatch.setattr(raw, "decode", one_short)
    entries = {"w:idx": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
               "w:val": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}
    m = _manifest(4, "delta")
    with pytest.raises(CorruptObjectError, match=r"tensor 'w': 1 changes decoded, the object declares 2"):
        decode_delta(_handmade(DELTA_META, entries, DELTA_DATA), m, m.objects[0])


@pytest.mark.parametrize("member, value, why", [
    ("version", "5", "metadata version='5', expected '4'"),
    ("codec", "packed", r"its metadata \(codec 'packed', base_version '3'\) disagrees with the manifest \('raw', '3'\)"),
    ("counts", '{"w":3}', "declared 3 changes"),
    ("format_version", "2", "metadata format_version='2'"),
])
def test_handmade_delta_with_a_wrong_member_is_refused(member, value, why):
    entries = {"w:idx": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
               "w:val": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}
    m = _manifest(4, "delta")
    with pytest.raises(CorruptObjectError, match=why):
        decode_delta(_handmade({**DELTA_META, member: value}, entries, DELTA_DATA), m, m.objects[0])


def test_a_truncated_object_is_named_as_such_from_its_header():
    """`deltasync inspect` listed every tensor of a truncated local object (its header was whole)
    and exited 0; the header's offsets are now checked against the bytes there are."""
    from safetensors.torch import save

    from torch_deltasync.errors import CorruptObjectError
    from torch_deltasync.format import read_header

    data = save({"a": torch.arange(1000, dtype=torch.int32)})
    assert set(read_header(data)[0]) == {"a"}
    with pytest.raises(CorruptObjectError, match=r"x: tensor 'a' lies at bytes \[0, 4000\) of the data, which has "
                                                 r"\d+ bytes: the object is truncated or corrupt"):
        read_header(data[:-1], "x")


@pytest.mark.parametrize("edit, error", [
    (lambda h: h["b"].update(data_offsets=[3996, 4000]), "overlap"),
    (lambda h: h["a"].update(shape=[100]), r"does not fill its 4000 bytes"),
    (lambda h: h["a"].update(dtype="Q99"), r"\(Q99, shape \[1000\]\) does not fill"),
    (lambda h: h["a"].update(shape=[-2]), "does not fill"),
    (lambda h: h.pop("b"), "4 bytes after the last tensor"),
])
def test_headers_that_safetensors_refuses_are_refused(edit, error):
    """`deltasync inspect` listed objects with overlapping or ill-sized tensors and exited 0."""
    from safetensors.torch import save

    from torch_deltasync.format import read_header

    data = save({"a": torch.arange(1000, dtype=torch.int32), "b": torch.zeros(1, dtype=torch.int32)})
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    with pytest.raises(CorruptObjectError, match=error):
        read_header(struct.pack("<Q", len(raw)) + raw + data[8 + n:], "x")
