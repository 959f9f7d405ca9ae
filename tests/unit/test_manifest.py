"""Manifest JSON: round trip, golden bytes (with and without a digest), the digest catching every
flipped byte, a table of malformed or malicious manifests (each refused for its own reason), and
the size limit checked before a manifest is read."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

from torch_deltasync import Manifest
from torch_deltasync.errors import ChecksumMismatchError, CorruptObjectError
from torch_deltasync.keys import manifest_key, object_key, parse_manifest_key
from torch_deltasync.manifest import ObjectEntry, TensorEntry, check_run_file, seal_manifest

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
    m = Manifest.from_json(seal_manifest(doc), expected_version=7)
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
    (mutate(["run_files"], ["adapter/adapter_config.json"]), "run_files must map"),
    (mutate(["run_files"], {"adapter/adapter_config.json": "AB" * 32}), "run_files must map"),
    (mutate(["run_files"], {"adapter/adapter_config.json": SHA[:-1]}), "run_files must map"),
    (mutate(["run_files"], {"versions/000000000003.json": SHA}), "run_files must map"),
    (mutate(["run_files"], {"objects/000000000007/delta-r00000-of00002.safetensors": SHA}), "run_files must map"),
    (mutate(["run_files"], {"../x": SHA}), "invalid store key"),
    (mutate(["run_files"], {"objects/adapter_config.json": SHA}), "run_files must map"),
    (mutate(["run_files"], {f"a/{i}": SHA for i in range(65)}), "run_files must map at most 64"),
]


def test_run_files_round_trip_and_are_absent_from_plain_manifests():
    assert "run_files" not in good_doc()  # plain runs: the manifest's bytes are as before
    doc = {k: v for k, v in good_doc().items() if k != "digest"}
    doc["run_files"] = {"adapter/adapter_config.json": SHA}
    m = Manifest.from_json(seal_manifest(doc), expected_version=7)
    assert m.run_files == {"adapter/adapter_config.json": SHA} and json.loads(m.to_json()) == json.loads(seal_manifest(doc))
    data = b"{}"
    m = Manifest.from_json(seal_manifest({**doc, "run_files": {"a/c.json": hashlib.sha256(data).hexdigest()}}), expected_version=7)
    assert check_run_file(data, "a/c.json", m, "x") == data
    assert check_run_file(b"anything", "other.json", m, "x") == b"anything"  # none recorded: unchecked
    with pytest.raises(ChecksumMismatchError, match=r"store/a/c.json does not match the sha256 the manifest of version 7"):
        check_run_file(b"{ }", "a/c.json", m, "store/a/c.json")
    with pytest.raises(CorruptObjectError, match="members a manifest without one never has"):
        Manifest.from_json(json.dumps(doc).encode())  # manifests without a digest never had run_files


@pytest.mark.parametrize("change,match", BAD)
def test_malformed_manifests_are_refused(change, match):
    doc = change(copy.deepcopy(good_doc()))
    with pytest.raises(CorruptObjectError, match=match):
        Manifest.from_json(seal_manifest(doc), expected_version=7)  # a valid digest: the field is refused


@pytest.mark.parametrize("data,match", [
    (b"", "not valid JSON"),
    (b"not json", "not valid JSON"),
    (b"[]", "top level is not an object"),
    (b"\xff\xfe", "not valid JSON"),
    (b"\x00garbage{{{", "not valid JSON: JSONDecodeError"),  # (read as UTF-16 before: "'utf-16-be' codec")
    ('{"é": 1}'.encode("utf-16"), "not valid JSON: UnicodeDecodeError: 'utf-8' codec"),  # manifests are UTF-8
    (json.dumps({"format": None}).encode(), "unknown format"),
])
def test_garbage_is_refused(data, match):
    with pytest.raises(CorruptObjectError, match=match):
        Manifest.from_json(data)


def test_anchor_rules():
    doc = good_doc("anchor")
    m = Manifest.from_json(seal_manifest(doc))
    assert m.kind == "anchor" and m.base_version is None and len(m.anchor_objects) == 2
    # an anchor may also carry a delta against the previous version ...
    doc["base_version"] = 6
    doc["objects"].append({"key": object_key(7, "delta", 0, 1), "nbytes": 9, "sha256": SHA, "rank": 0, "world": 1})
    m = Manifest.from_json(seal_manifest(doc))
    assert m.has_delta and m.delta_nbytes == 9 and m.anchor_nbytes == 150
    # ... but not without saying which version it applies to
    doc["base_version"] = None
    with pytest.raises(CorruptObjectError, match="does not belong"):
        Manifest.from_json(seal_manifest(doc))
    doc = good_doc("anchor")
    doc["anchor_version"] = 5
    with pytest.raises(CorruptObjectError, match="own anchor_version"):
        Manifest.from_json(seal_manifest(doc))
    doc = good_doc("delta")
    doc["objects"][0]["key"] = object_key(7, "anchor", 0, 2)
    with pytest.raises(CorruptObjectError, match="does not belong"):
        Manifest.from_json(seal_manifest(doc))


def test_keys():
    assert manifest_key(12) == "versions/000000000012.json"
    assert parse_manifest_key("versions/000000000012.json") == 12
    assert parse_manifest_key("versions/000000000012.json.tmp-1") is None
    assert parse_manifest_key("versions/000000000012.json\n") is None  # `$` would match before the newline
    assert parse_manifest_key("versions/\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661\u0662.json") is None
    assert object_key(3, "delta", 1, 4) == "objects/000000000003/delta-r00001-of00004.safetensors"


# --- digest: golden bytes, old manifests, every flipped byte ------------------------------------

#: A manifest as torch_deltasync wrote it before manifests had a digest (byte for byte).
UNSEALED = (
    b'{\n "format": "torch_deltasync",\n "format_version": 1,\n "version": 3,\n "kind": "delta",\n'
    b' "base_version": 2,\n "anchor_version": 0,\n "codec": "raw",\n "inference_dtype": "bfloat16",\n'
    b' "run_id": "golden",\n "created_at": 1700000000.5,\n "objects": [\n  {\n'
    b'   "key": "objects/000000000003/delta-r00000-of00001.safetensors",\n   "nbytes": 42,\n'
    b'   "sha256": "abababababababababababababababababababababababababababababababab",\n   "rank": 0,\n'
    b'   "world": 1\n  }\n ],\n "tensors": [\n  {\n   "name": "w",\n   "shape": [\n    2,\n    3\n   ],\n'
    b'   "checksum": "0123456789abcdef",\n   "changed": 2\n  }\n ],\n "aliases": {},\n "stats": {}\n}'
)
#: sha256 of UNSEALED (pinned: the digest a conforming writer puts in front of that content).
UNSEALED_SHA256 = "4b2039b4de064f517cbd26087587a6e49462e6ed114ecb09874f73893b48fb54"
#: The same manifest as written now: the digest member first, then the content without its "{".
SEALED = b'{"digest": "sha256:' + UNSEALED_SHA256.encode() + b'",' + UNSEALED[1:]


def golden() -> Manifest:
    return Manifest(
        version=3, kind="delta", base_version=2, anchor_version=0, codec="raw", inference_dtype=torch.bfloat16,
        run_id="golden", tensors=(TensorEntry("w", (2, 3), 0x0123456789ABCDEF, 2),),
        objects=(ObjectEntry(object_key(3, "delta"), 42, "ab" * 32),), created_at=1700000000.5,
    )


def test_golden_bytes_with_digest():
    assert hashlib.sha256(UNSEALED).hexdigest() == UNSEALED_SHA256
    assert SEALED.startswith(b'{"digest": "sha256:4b2039b4de064f51') and SEALED[85:87] == b'\n '
    assert golden().to_json() == SEALED
    assert Manifest.from_json(SEALED, expected_version=3) == golden()
    assert json.loads(SEALED)["digest"] == "sha256:" + UNSEALED_SHA256  # plain JSON for any reader


def test_manifests_written_before_digests_are_still_read():
    assert Manifest.from_json(UNSEALED, expected_version=3) == golden()
    # any JSON layout of the old fields is fine without a digest (hand-written or other writers)
    assert Manifest.from_json(json.dumps(json.loads(UNSEALED)).encode(), expected_version=3) == golden()


FLIP_REASONS = ("digest mismatch", "not valid JSON", "digest is not at the start",
                "no digest, and members a manifest without one never has", "second, different digest")


@pytest.mark.parametrize("mask", [0x01, 0x20, 0x80])
def test_every_flipped_byte_is_corruption(mask):
    """Flip each byte of a manifest in turn: every copy is refused as corrupt (never parsed into a
    manifest that differs from the one written), and the error says why."""
    good = SEALED
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= mask
        with pytest.raises(CorruptObjectError) as e:
            Manifest.from_json(bytes(bad), expected_version=3)
        assert any(r in str(e.value) for r in FLIP_REASONS), (i, str(e.value))
        assert "manifest of version 3" in str(e.value)


def test_an_edited_manifest_must_be_sealed_again():
    doc = json.loads(SEALED)
    doc["tensors"][0]["name"] = "v"
    with pytest.raises(CorruptObjectError, match="digest mismatch"):
        Manifest.from_json(json.dumps(doc).encode())  # json.dumps keeps the digest first: its old value
    with pytest.raises(CorruptObjectError, match="digest is not at the start"):
        Manifest.from_json(json.dumps(doc, indent=2).encode())
    assert Manifest.from_json(seal_manifest(doc)).tensors[0].name == "v"


def test_a_flipped_byte_in_a_stored_manifest_is_corruption_not_a_wrong_model(tmp_path):
    """One flipped byte in a tensor name used to read as "build the receiver from the same
    architecture" (IncompatibleTargetError); it is corruption, named by key and version."""
    from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore

    store = LocalStore(tmp_path)
    g = torch.Generator().manual_seed(0)
    w = {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(4, generator=g)}
    sender = DeltaSender(w, store)
    sender.publish()  # 0
    w["layer.weight"][0, 0] += 1.0
    sender.publish()  # 1
    data = bytearray(store.get(manifest_key(1)))
    data[data.index(b'"layer.weight"') + 1] ^= 0x01  # 'l' -> 'm'
    store.put(manifest_key(1), bytes(data))
    target = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in w.items()}
    receiver = DeltaReceiver(target, store)
    receiver.update(0)
    before = {n: t.view(torch.int16).clone() for n, t in target.items()}
    with pytest.raises(CorruptObjectError, match=r"versions/000000000001\.json \(manifest of version 1\): digest mismatch"):
        receiver.update(1)
    assert receiver.version == 0
    assert all(torch.equal(target[n].view(torch.int16), before[n]) for n in target)


def test_oversized_manifest_is_refused_by_its_size_before_reading(tmp_path, monkeypatch):
    """The size is checked before the rest is read, and the error names the version, the key and
    the manifest's real size (it used to read up to the limit and report limit + 1 bytes)."""
    from torch_deltasync import LocalStore
    from torch_deltasync import manifest as mf
    from torch_deltasync.manifest import load_manifest

    from helpers import PassThroughStore

    class Counting(PassThroughStore):
        read = 0

        def get(self, key, *, start=None, end=None):
            data = super().get(key, start=start, end=end)
            self.read += len(data)
            return data

    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 4096)
    monkeypatch.setattr(mf, "_MANIFEST_HEAD_BYTES", 256)
    store = Counting(LocalStore(tmp_path))
    big = seal_manifest(good_doc())[:-1] + b" " * 10_000 + b"}"
    store.put(manifest_key(7), big)
    with pytest.raises(CorruptObjectError) as e:
        load_manifest(store, 7)
    assert f"versions/000000000007.json (manifest of version 7) is {len(big):,} bytes" in str(e.value)
    assert store.read == 256
    # a manifest under the limit but larger than the first read is read whole and parses
    ok = seal_manifest(good_doc())
    assert 256 < len(ok) < 4096
    store.put(manifest_key(7), ok)
    assert load_manifest(store, 7) == Manifest.from_json(ok)


@pytest.mark.parametrize("version,error", [(-1, ValueError), (10**12, ValueError), (True, TypeError),
                                           ("3", TypeError), (2.0, TypeError)])
def test_load_manifest_refuses_a_version_that_cannot_exist(tmp_path, version, error):
    from torch_deltasync import LocalStore
    """Not "not visible" (VersionNotFoundError): no version could have that number, as the receiver
    and the vLLM helpers say (keys.check_version)."""
    from torch_deltasync.manifest import load_manifest

    store = LocalStore(tmp_path / "b")
    with pytest.raises(error, match="version"):
        load_manifest(store, version)
