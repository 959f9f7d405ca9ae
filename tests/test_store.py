"""Stores: key validation, atomic puts, listing, byte ranges, prefixes."""

from __future__ import annotations

import pytest

from torch_deltasync import CorruptObjectError, LocalStore, ObjectNotFoundError, open_store
from torch_deltasync.store.base import check_key

BAD_KEYS = [
    ("", "empty"),
    ("/etc/passwd", "absolute path"),
    ("../x", "parent directory"),
    ("a/../../x", "parent directory inside"),
    ("a//b", "empty segment"),
    ("a/./b", "dot segment"),
    ("a\\b", "backslash"),
    ("a/b\x00", "control character"),
    ("a/", "trailing slash"),
    ("x" * 2000, "too long"),
]


@pytest.mark.parametrize("key,why", BAD_KEYS)
def test_bad_keys_are_refused(key, why):
    with pytest.raises(CorruptObjectError):
        check_key(key)


@pytest.fixture(params=["local", "memory"])
def any_store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "s")
    import uuid

    return open_store(f"memory://test-{uuid.uuid4().hex}")


def test_put_get_list_delete(any_store):
    s = any_store
    s.put("objects/1/a.safetensors", b"hello")
    s.put("versions/000000000001.json", b"{}")
    assert s.get("objects/1/a.safetensors") == b"hello"
    assert s.get("objects/1/a.safetensors", start=1, end=3) == b"el"
    assert s.size("objects/1/a.safetensors") == 5
    assert s.list() == ["objects/1/a.safetensors", "versions/000000000001.json"]
    assert s.list("versions") == ["versions/000000000001.json"]
    assert s.exists("versions/000000000001.json") and not s.exists("versions/x")
    s.delete("versions/000000000001.json")
    s.delete("versions/000000000001.json")  # missing is fine
    assert s.list("versions") == []
    with pytest.raises(ObjectNotFoundError, match="versions/x"):
        s.get("versions/x")


def test_prefix_views_are_isolated(any_store):
    a, b = any_store.sub("runs/a"), any_store.sub("runs/b")
    a.put("LATEST", b"1")
    b.put("LATEST", b"2")
    assert a.get("LATEST") == b"1" and b.get("LATEST") == b"2"
    assert a.list() == ["LATEST"]
    with pytest.raises(CorruptObjectError):
        any_store.sub("../escape")


def test_local_put_is_atomic_and_leaves_no_temp_files(tmp_path):
    s = LocalStore(tmp_path / "s")
    s.put("k", b"old")
    s.put("k", b"new")
    assert s.get("k") == b"new"
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["k"]


def test_open_store_routes(tmp_path):
    assert isinstance(open_store(str(tmp_path / "a")), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/b"), LocalStore)
    s = open_store(f"file://{tmp_path}/b")
    assert open_store(s) is s


def test_readers_do_not_create_folders_and_deletes_prune_empty_ones(tmp_path):
    s = LocalStore(tmp_path / "s")
    assert s.list() == [] and not s.exists("a") and not (tmp_path / "s").exists()
    s.put("objects/000000000001/a.safetensors", b"x")
    s.delete("objects/000000000001/a.safetensors")
    assert list((tmp_path / "s").iterdir()) == []


def test_put_new_never_replaces(any_store):
    from torch_deltasync import ObjectExistsError

    any_store.put_new("versions/000000000001.json", b"first")
    with pytest.raises(ObjectExistsError):
        any_store.put_new("versions/000000000001.json", b"second")
    assert any_store.get("versions/000000000001.json") == b"first"


def test_sweep_removes_only_old_temporaries(tmp_path):
    import os
    import time

    s = LocalStore(tmp_path / "s")
    s.put("objects/1/a", b"kept")
    old = tmp_path / "s" / "objects" / "1" / "b.tmp-dead"
    young = tmp_path / "s" / "objects" / "1" / "c.tmp-live"
    old.write_bytes(b"x")
    young.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert s.sweep_temporaries(older_than_s=3600) == 1
    assert not old.exists() and young.exists() and s.get("objects/1/a") == b"kept"


@pytest.mark.parametrize("uri", ["file://", "file://relative/path", "memory://a/../b", "memory://a//b"])
def test_malformed_uris_are_refused(uri):
    with pytest.raises((ValueError, CorruptObjectError)):
        open_store(uri)
