"""The bucket key layout (``keys.py``, ``docs/format.md`` §2): the exact key strings, parsing them
back, what is not a key of the layout, and the version scans over a store."""

from __future__ import annotations

import pytest

from torch_deltasync import LocalStore
from torch_deltasync.keys import (
    LATEST_KEY, MAX_VERSION, OBJECTS_DIR, VERSIONS_DIR, list_versions, manifest_key, next_free_version, object_key,
    parse_manifest_key, parse_object_key,
)


def test_layout_constants():
    assert (LATEST_KEY, VERSIONS_DIR, OBJECTS_DIR) == ("LATEST", "versions", "objects")
    assert MAX_VERSION == 999_999_999_999 and len(str(MAX_VERSION)) == 12  # the widest the 12-digit field holds


OBJECT_KEYS = [
    ((0, "anchor"), "objects/000000000000/anchor-r00000-of00001.safetensors", "defaults: rank 0 of 1"),
    ((7, "delta", 3, 8), "objects/000000000007/delta-r00003-of00008.safetensors", "rank and world, zero-padded"),
    ((123456, "anchor", 99999, 99999), "objects/000000123456/anchor-r99999-of99999.safetensors", "widest rank field"),
    ((MAX_VERSION, "delta"), "objects/999999999999/delta-r00000-of00001.safetensors", "largest version"),
]


@pytest.mark.parametrize("args, key, reason", OBJECT_KEYS, ids=[r for *_, r in OBJECT_KEYS])
def test_object_key_is_the_documented_string_and_parses_back(args, key, reason):
    assert object_key(*args) == key
    version, kind, *rest = args
    rank, world = rest or (0, 1)
    assert parse_object_key(key) == (version, kind, rank, world)


@pytest.mark.parametrize("version, key", [(0, "versions/000000000000.json"), (42, "versions/000000000042.json"),
                                          (MAX_VERSION, "versions/999999999999.json")])
def test_manifest_key_is_the_documented_string_and_parses_back(version, key):
    assert manifest_key(version) == key
    assert parse_manifest_key(key) == version


NOT_MANIFEST_KEYS = [
    ("versions/42.json", "not zero-padded to 12 digits"),
    ("versions/0000000000042.json", "13 digits"),
    ("versions/000000000042.json.tmp", "a temporary next to the manifest"),
    ("versions/-00000000042.json", "a sign is not a digit"),
    ("v/000000000042.json", "another folder"),
    ("runs/x/versions/000000000042.json", "a key under another prefix (keys are relative to the run)"),
    ("versions/00000000004a.json", "hex is not decimal"),
    ("LATEST", "the pointer"),
    ("", "empty"),
]


@pytest.mark.parametrize("key, reason", NOT_MANIFEST_KEYS, ids=[r for _, r in NOT_MANIFEST_KEYS])
def test_other_keys_are_not_manifests(key, reason):
    assert parse_manifest_key(key) is None


NOT_OBJECT_KEYS = [
    ("objects/000000000007/patch-r00000-of00001.safetensors", "an unknown kind"),
    ("objects/000000000007/delta-r0-of1.safetensors", "rank and world not zero-padded"),
    ("objects/000000000007/delta-r00000-of00001.bin", "another extension"),
    ("objects/7/delta-r00000-of00001.safetensors", "version not zero-padded"),
    ("objects/000000000007/delta-r00000-of00001.safetensors.tmp", "a temporary"),
    ("versions/000000000007.json", "a manifest"),
]


@pytest.mark.parametrize("key, reason", NOT_OBJECT_KEYS, ids=[r for _, r in NOT_OBJECT_KEYS])
def test_other_keys_are_not_objects(key, reason):
    assert parse_object_key(key) is None


def test_versions_past_the_field_do_not_round_trip():
    # The module formats without checking: a version past MAX_VERSION (or below 0) yields a key
    # the parsers refuse, which is why writers stay within MAX_VERSION.
    assert manifest_key(MAX_VERSION + 1) == "versions/1000000000000.json"
    assert parse_manifest_key(manifest_key(MAX_VERSION + 1)) is None
    assert parse_manifest_key(manifest_key(-1)) is None
    assert parse_object_key(object_key(MAX_VERSION + 1, "anchor")) is None


def test_list_versions_reads_only_manifests_in_order(tmp_path):
    store = LocalStore(tmp_path / "bucket", fsync=False)
    assert list_versions(store) == []
    for v in (10, 2, 3):
        store.put(manifest_key(v), b"{}")
    store.put("versions/notes.txt", b"x")  # not a manifest key: ignored
    store.put(object_key(11, "delta"), b"x")  # an object without its manifest is no version
    assert list_versions(store) == [2, 3, 10]


def test_next_free_version_skips_objects_left_without_a_manifest(tmp_path):
    store = LocalStore(tmp_path / "bucket", fsync=False)
    assert next_free_version(store) == 0
    store.put(manifest_key(4), b"{}")
    assert next_free_version(store) == 5
    store.put(object_key(9, "delta", 1, 2), b"x")  # a crashed writer's object: 9 is taken
    store.put("objects/000000000020/junk", b"x")  # not an object key: does not count
    assert next_free_version(store) == 10
