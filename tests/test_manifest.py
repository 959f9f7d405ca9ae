"""Manifest JSON: round trip and a table of malformed or malicious manifests, each refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from torch_deltasync import CorruptObjectError, Manifest
from torch_deltasync.manifest import ObjectEntry, TensorEntry, manifest_key, object_key, parse_manifest_key

SHA = "ab" * 32


def good_doc(kind="delta"):
    m = Manifest(
        version=7, kind=kind, base_version=6 if kind == "delta" else None,
        anchor_version=5 if kind == "delta" else 7, codec="raw", inference_dtype=torch.bfloat16,
        run_id="r1", tensors=(TensorEntry("w", (4, 3), 0xDEADBEEF, 2), TensorEntry("b", (4,), 1, 0)),
        objects=(ObjectEntry(object_key(7, kind, 0, 2), 100, SHA, 0, 2),
                 ObjectEntry(object_key(7, kind, 1, 2), 50, SHA, 1, 2)),
        aliases={"tied.w": "w"},
    )
    return json.loads(m.to_json())


def test_round_trip():
    doc = good_doc()
    m = Manifest.from_json(json.dumps(doc).encode(), expected_version=7)
    assert m.version == 7 and m.base_version == 6 and m.inference_dtype == torch.bfloat16
    assert m.tensor_map()["w"].checksum == 0xDEADBEEF and m.tensor_map()["w"].shape == (4, 3)
    assert m.nbytes == 150 and m.changed == 2 and m.numel == 16
    assert json.loads(m.to_json()) == doc


def mutate(path, value):
    def f(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return doc
    return f


BAD = [
    (mutate(["format"], "other"), "unknown format"),
    (mutate(["format_version"], 2), "format_version"),
    (mutate(["version"], 8), "claims version 8"),
    (mutate(["version"], -1), "version must be"),
    (mutate(["version"], "7"), "version must be"),
    (mutate(["kind"], "snapshot"), "unknown kind"),
    (mutate(["base_version"], 7), "base_version must be"),
    (mutate(["base_version"], None), "base_version must be"),
    (mutate(["anchor_version"], 6.5), "anchor_version must be"),
    (mutate(["codec"], "zip"), "unknown codec"),
    (mutate(["inference_dtype"], "int8"), "unknown dtype"),
    (mutate(["objects", 0, "key"], "../../etc/passwd"), "invalid store key"),
    (mutate(["objects", 0, "key"], "/abs/objects/000000000007/delta-r00000-of00002.safetensors"), "invalid store key"),
    (mutate(["objects", 0, "key"], "objects/000000000006/delta-r00000-of00002.safetensors"), "does not belong"),
    (mutate(["objects", 0, "key"], "versions/000000000007.json"), "does not belong"),
    (mutate(["objects", 0, "rank"], 1), "does not match rank"),
    (mutate(["objects", 0, "sha256"], "xyz"), "bad sha256"),
    (mutate(["objects", 0, "nbytes"], -5), "nbytes must be"),
    (mutate(["objects"], []), "no objects"),
    (mutate(["tensors", 1, "name"], "w"), "duplicate tensor name"),
    (mutate(["tensors", 0, "shape"], [4, -3]), "shape of w"),
    (mutate(["tensors", 0, "shape"], "4x3"), "shape must be a list"),
    (mutate(["tensors", 0, "checksum"], "nothex!!nothex!!"), "checksum"),
    (mutate(["tensors", 0, "changed"], 13), "changed of w"),
    (mutate(["aliases"], {"x": "missing"}), "aliases"),
    (mutate(["tensors"], KeyError), "malformed"),
    (mutate(["tensors", 0, "checksum"], "0x00000000000001"), "checksum"),
    (mutate(["tensors", 0, "checksum"], " 000000000000001"), "checksum"),
    (mutate(["tensors", 0, "checksum"], "0000_00000000001"), "checksum"),
    (mutate(["created_at"], 10**400), "created_at"),  # float() would overflow
    (mutate(["created_at"], -1), "created_at"),
    (mutate(["created_at"], True), "created_at"),
    (mutate(["created_at"], "yesterday"), "created_at"),
    (mutate(["objects", 0, "key"], "objects/000000000007/delta-r00000-of00002.safetensors\n"), "invalid store key"),
]


@pytest.mark.parametrize("change,match", BAD)
def test_malformed_manifests_are_refused(change, match):
    doc = change(copy.deepcopy(good_doc()))
    with pytest.raises(CorruptObjectError, match=match):
        Manifest.from_json(json.dumps(doc).encode(), expected_version=7)


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b"\xff\xfe", json.dumps({"format": None}).encode()])
def test_garbage_is_refused(data):
    with pytest.raises(CorruptObjectError):
        Manifest.from_json(data)


def test_anchor_rules():
    doc = good_doc("anchor")
    m = Manifest.from_json(json.dumps(doc).encode())
    assert m.kind == "anchor" and m.base_version is None and len(m.anchor_objects) == 2
    # an anchor may also carry a delta against the previous version ...
    doc["base_version"] = 6
    doc["objects"].append({"key": object_key(7, "delta", 0, 1), "nbytes": 9, "sha256": SHA, "rank": 0, "world": 1})
    m = Manifest.from_json(json.dumps(doc).encode())
    assert m.has_delta and m.delta_nbytes == 9 and m.anchor_nbytes == 150
    # ... but not without saying which version it applies to
    doc["base_version"] = None
    with pytest.raises(CorruptObjectError, match="does not belong"):
        Manifest.from_json(json.dumps(doc).encode())
    doc = good_doc("anchor")
    doc["anchor_version"] = 5
    with pytest.raises(CorruptObjectError, match="own anchor_version"):
        Manifest.from_json(json.dumps(doc).encode())
    doc = good_doc("delta")
    doc["objects"][0]["key"] = object_key(7, "anchor", 0, 2)
    with pytest.raises(CorruptObjectError, match="does not belong"):
        Manifest.from_json(json.dumps(doc).encode())


def test_keys():
    assert manifest_key(12) == "versions/000000000012.json"
    assert parse_manifest_key("versions/000000000012.json") == 12
    assert parse_manifest_key("versions/000000000012.json.tmp-1") is None
    assert parse_manifest_key("versions/000000000012.json\n") is None  # `$` would match before the newline
    assert parse_manifest_key("versions/\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661\u0662.json") is None
    assert object_key(3, "delta", 1, 4) == "objects/000000000003/delta-r00001-of00004.safetensors"
