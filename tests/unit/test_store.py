"""Stores: key validation, atomic puts, listing, byte ranges, prefixes."""

from __future__ import annotations

import re

import pytest

from torch_deltasync import LocalStore, open_store
from torch_deltasync.errors import CorruptObjectError, ObjectNotFoundError
from torch_deltasync.store import check_key

BAD_KEYS = [
    ("", r"'': empty", "empty"),
    ("/etc/passwd", "absolute", "absolute path"),
    ("../x", r"segment '\.\.' is not allowed", "parent directory"),
    ("a/../../x", r"segment '\.\.' is not allowed", "parent directory inside"),
    ("a//b", "segment '' is not allowed", "empty segment"),
    ("a/./b", r"segment '\.' is not allowed", "dot segment"),
    ("a\\b", r"segment 'a\\\\b' is not allowed", "backslash"),
    ("a/b\x00", r"segment 'b\\x00' is not allowed", "control character"),
    ("a/", "ends with '/'", "trailing slash"),
    ("x" * 2000, "2000 characters, at most 1024", "too long"),
]


@pytest.mark.parametrize("key,match,why", BAD_KEYS, ids=[w for *_, w in BAD_KEYS])
def test_bad_keys_are_refused(key, match, why):
    with pytest.raises(CorruptObjectError, match=match):
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


def test_bad_byte_ranges_and_prefixes_are_named(any_store):
    """A negative start reached the OS (EINVAL), a float a bare TypeError; "/abs" was taken as "abs"."""
    any_store.put("k", b"hello")
    for kwargs, error, match in [(dict(start=-3), ValueError, r"get\('k'\): the byte range must be non-negative, got \[-3, None\)"),
                                 (dict(end=-1), ValueError, "must be non-negative"),
                                 (dict(start=1.5), TypeError, r"get\('k'\): start must be an int >= 0 or None, got float 1.5"),
                                 (dict(end=True), TypeError, "end must be an int")]:
        with pytest.raises(error, match=match):
            any_store.get("k", **kwargs)
    assert any_store.get("k", start=1, end=99) == b"ello" and any_store.get("k", start=4, end=2) == b""
    for prefix in ("/abs", "/", "runs//a"):
        if prefix == "/":
            assert any_store.sub(prefix) is any_store  # the root
            continue
        with pytest.raises(ValueError, match=f"prefix of .*{prefix!r} is not a valid path inside a store"):
            any_store.sub(prefix)
        with pytest.raises(ValueError, match="is not a valid path inside a store"):
            any_store.sub("runs").sub(prefix)
    assert any_store.sub("runs/a/").describe() == any_store.sub("runs").sub("a").describe()


def test_prefix_views_are_isolated(any_store):
    a, b = any_store.sub("runs/a"), any_store.sub("runs/b")
    a.put("LATEST", b"1")
    b.put("LATEST", b"2")
    assert a.get("LATEST") == b"1" and b.get("LATEST") == b"2"
    assert a.list() == ["LATEST"]
    with pytest.raises(ValueError, match=r"prefix of .*: '\.\./escape' is not a valid path inside a store: "
                                         r"segment '\.\.' is not allowed") as e:
        any_store.sub("../escape")
    assert not isinstance(e.value, CorruptObjectError)  # a bad argument, not a corrupt store


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


def test_local_list_skips_folders_removed_while_it_walks(tmp_path, monkeypatch):
    # Retention removes a version's folder once it deleted its last object; a listing that saw the
    # folder a moment before must skip it, not fail (collect_garbage from two processes, a sender
    # starting while gc runs).
    import errno
    import os

    store = LocalStore(tmp_path)
    for v in ("000000000001", "000000000002", "000000000003"):
        store.put(f"objects/{v}/delta.safetensors", b"x")
    scandir = os.scandir

    def racing(path):
        if str(path).endswith("000000000002"):
            store.delete("objects/000000000002/delta.safetensors")  # the folder goes with its last object
        return scandir(path)

    monkeypatch.setattr(os, "scandir", racing)
    assert store.list("objects") == ["objects/000000000001/delta.safetensors",
                                     "objects/000000000003/delta.safetensors"]

    def stale(path):  # NFS: removed by another host
        if str(path).endswith("000000000003"):
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", stale)
    assert store.list("objects") == ["objects/000000000001/delta.safetensors"]


def test_local_list_names_the_store_when_a_folder_cannot_be_read(tmp_path, monkeypatch):
    import os

    from torch_deltasync.errors import StoreError

    store = LocalStore(tmp_path)
    store.put("objects/000000000001/delta.safetensors", b"x")
    scandir = os.scandir

    def locked(path):  # (chmod 0 does not stop root, who runs CI)
        if str(path).endswith("000000000001"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", locked)
    with pytest.raises(StoreError, match=r"cannot list 'objects'.*Permission denied"):
        store.list("objects")


def test_put_new_never_replaces(any_store):
    from torch_deltasync.errors import ObjectExistsError

    any_store.put_new("versions/000000000001.json", b"first")
    with pytest.raises(ObjectExistsError):
        any_store.put_new("versions/000000000001.json", b"second")
    assert any_store.get("versions/000000000001.json") == b"first"


def test_sweep_removes_only_old_temporaries(tmp_path):
    import os
    import time

    s = LocalStore(tmp_path / "s")
    s.put("objects/1/a", b"kept")
    folder = tmp_path / "s" / "objects" / "1"
    old, young = folder / f"b.tmp-{'d' * 32}", folder / f"c.tmp-{'e' * 32}"
    not_ours = folder / "report.tmp-final"  # a marker in the name, but not a name `put` writes
    for p in (old, young, not_ours):
        p.write_bytes(b"x")
    for p in (old, not_ours):
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    assert s.sweep_temporaries(older_than_s=3600) == 1
    assert not old.exists() and young.exists() and not_ours.exists() and s.get("objects/1/a") == b"kept"


@pytest.mark.parametrize("uri,match", [
    ("file://", "a file URI names an absolute folder"),
    ("file://relative/path", "a file URI names an absolute folder"),
    ("memory://a/../b", r"segment '\.\.' is not allowed"),
    ("memory://a//b", "segment '' is not allowed"),
    ("foo://bucket/run", r"'foo://bucket/run': unknown store scheme 'foo://'"),  # fsspec: "Protocol not known: foo"
    ("file:relative", r"'file:relative': a file URI names an absolute folder"),  # was the folder ./file:relative
    ("http://example.com/x", r"http:// is no store: .* endpoint_url='http://host:port'"),  # fsspec reads only
    ("https://example.com/x", r"https:// is no store"),
    ("s3:///x", r"'s3:///x' names no bucket"),  # was read as the bucket x
    ("~nosuchuser-of-this-machine/x", r"LocalStore '~nosuchuser-of-this-machine/x': .* give the folder's path "
                                      "without ~user"),  # was RuntimeError: Could not determine home directory.
])
def test_malformed_uris_are_refused(uri, match):
    with pytest.raises(ValueError, match=match) as e:
        open_store(uri)
    assert not isinstance(e.value, CorruptObjectError)  # a bad argument, not a corrupt store


@pytest.mark.parametrize("uri,error,match", [
    ("", ValueError, "store '' is empty"),
    ("   ", ValueError, "store '   ' is empty"),
    ("s3://Bad_Bucket!/x", ValueError, r"store 's3://Bad_Bucket!/x': 'Bad_Bucket!/x' is not a valid path inside a "
                                       r"store: segment 'Bad_Bucket!' is not allowed"),
    ("/data/run\x00x", ValueError, "contains a NUL character"),
    (5, TypeError, "a store is a folder path, a URI .* got int 5"),
])
def test_store_arguments_are_named_when_wrong(uri, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match) as e:
        open_store(uri)
    assert not isinstance(e.value, CorruptObjectError)
    with pytest.raises(ValueError, match="LocalStore needs a folder path, got ''"):
        LocalStore("")
    assert list(tmp_path.iterdir()) == []  # nothing was written into the current folder


def test_check_prefix_names_the_argument():
    from torch_deltasync.store import check_prefix

    assert check_prefix("runs/a", "X") == "runs/a" and check_prefix("", "X") == ""
    with pytest.raises(TypeError, match="X: a path inside a store is a string, got int 5"):
        check_prefix(5, "X")
    with pytest.raises(ValueError, match=r"X: '/abs' is not a valid path inside a store: absolute"):
        check_prefix("/abs", "X")


@pytest.mark.timeout(60)  # a FIFO opened the plain way would block here forever
def test_local_reads_refuse_special_files_and_skip_broken_links(tmp_path):
    """What is not a regular file is no object: a FIFO (opening one the plain way waits for a
    writer), a folder or a socket at a key, links that dangle or loop are refused by get (without blocking,
    without leaking the descriptor) and left out by list and exists. A byte range is clipped to the
    file (the end may come from an untrusted manifest: no allocation of its size)."""
    import os
    import socket

    s = LocalStore(tmp_path / "s")
    s.put("versions/000000000001.json", b"{}")
    os.mkfifo(tmp_path / "s" / "versions" / "000000000002.json")
    os.symlink("gone.json", tmp_path / "s" / "versions" / "000000000009.json")  # dangling
    os.symlink("loop.json", tmp_path / "s" / "versions" / "loop.json")  # a loop
    (tmp_path / "s" / "objects" / "k").mkdir(parents=True)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(ObjectNotFoundError, match=r"'versions/000000000002.json' is not a regular file \(a FIFO\)"):
            s.get("versions/000000000002.json")
        with pytest.raises(ObjectNotFoundError, match=r"'objects/k' is not a regular file \(a folder\)"):
            s.get("objects/k")
    assert len(os.listdir("/proc/self/fd")) == fds  # every descriptor closed
    assert s.list() == ["versions/000000000001.json"]
    assert not s.exists("versions/000000000002.json") and not s.exists("objects/k")
    with pytest.raises(ObjectNotFoundError, match="'versions/loop.json' is a symbolic link in a loop, so no object"):
        s.get("versions/loop.json")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "s" / "objects" / "sock"))
        with pytest.raises(ObjectNotFoundError, match="'objects/sock' is a socket"):
            s.get("objects/sock")
        assert "objects/sock" not in s.list()
    assert s.get("versions/000000000001.json", start=0, end=2**50) == b"{}"
    assert s.get("versions/000000000001.json", start=1, end=2**62) == b"}"


# --- a store that is not there, a file in the way, links leading outside ----------------------------


def _receiver(store):
    import torch

    from torch_deltasync import DeltaReceiver

    return DeltaReceiver({"w": torch.zeros(3, dtype=torch.bfloat16)}, store)


def test_a_missing_folder_reads_as_no_version_and_says_the_folder_does_not_exist(tmp_path):
    from torch_deltasync.errors import VersionNotFoundError

    missing = tmp_path / "no" / "such" / "bucket"
    with pytest.raises(VersionNotFoundError, match=rf"no version has been published yet: the folder {missing} does not exist"):
        _receiver(str(missing)).update()
    existing = tmp_path / "empty"
    existing.mkdir()
    with pytest.raises(VersionNotFoundError) as e:
        _receiver(str(existing)).update()
    assert str(e.value).endswith("no version has been published yet")  # a run that has not started
    # an explicit version (e.g. the vLLM backend's assume_version) says so too
    with pytest.raises(VersionNotFoundError, match=rf"version 0 is not visible: the folder {missing} does not exist"):
        _receiver(str(missing)).update(0)
    with pytest.raises(VersionNotFoundError) as e:
        _receiver(str(existing)).update(0)
    assert str(e.value).endswith("version 0 is not visible")
    assert not (tmp_path / "no").exists()  # readers create nothing


def test_a_file_in_the_path_is_named_and_not_hidden_by_the_clean_up(tmp_path):
    """``put`` used to raise a bare NotADirectoryError about its own temporary file (the clean-up
    failing inside the error handler hid the real error)."""
    from torch_deltasync.errors import StoreError, StoreNotFoundError

    (tmp_path / "afile").write_bytes(b"x")
    s = LocalStore(tmp_path / "afile" / "bucket")
    msg = rf"{tmp_path / 'afile'} is a file, not a folder, so no store can be there"
    with pytest.raises(StoreNotFoundError, match=msg):
        s.put("objects/000000000001/a.safetensors", b"data")
    for read in (lambda: s.list("versions"), lambda: s.get("LATEST"), lambda: s.exists("LATEST"),
                 lambda: s.size("LATEST")):
        with pytest.raises(StoreNotFoundError, match=msg):
            read()
    with pytest.raises(StoreNotFoundError, match=msg):
        _receiver(s).update()
    # inside a store: the file that stands where a folder should be is named
    inside = LocalStore(tmp_path / "ok")
    inside.put("objects", b"not a folder")
    with pytest.raises(StoreError, match=rf"{tmp_path / 'ok' / 'objects'} \(inside the store\) is a file"):
        inside.put("objects/000000000001/a.safetensors", b"data")
    with pytest.raises(ObjectNotFoundError, match="no object 'objects/000000000001/a.safetensors'"):
        inside.get("objects/000000000001/a.safetensors")
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["objects"]  # no temporary file left


def test_links_leading_outside_the_root_are_not_followed(tmp_path):
    import os

    from torch_deltasync.errors import StoreError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret bytes")
    s = LocalStore(tmp_path / "s")
    s.put("versions/000000000000.json", b"{}")
    os.symlink(outside / "secret", tmp_path / "s" / "versions" / "000000000001.json")  # a linked file
    os.symlink(outside, tmp_path / "s" / "objects")  # a linked folder
    os.symlink(tmp_path / "s" / "versions" / "000000000000.json", tmp_path / "s" / "inside-link")
    for call in (lambda: s.get("versions/000000000001.json"), lambda: s.size("versions/000000000001.json"),
                 lambda: s.exists("versions/000000000001.json"), lambda: s.get("objects/secret"),
                 lambda: s.put("objects/000000000001/a.safetensors", b"x")):
        with pytest.raises(StoreError, match=rf"leads outside the store through a symbolic link \(to {outside}"):
            call()
    assert s.list() == ["inside-link", "versions/000000000000.json"]  # the links to elsewhere are left out
    assert s.get("inside-link") == b"{}"  # a link that stays inside is an ordinary key
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]  # nothing was written outside
    s.delete("versions/000000000001.json")  # deleting removes the link, never its target
    assert (outside / "secret").read_bytes() == b"secret bytes"


# --- deadlines on every store call ------------------------------------------------------------------


class _Hangs(LocalStore):
    """A custom store (a subclass the library does not know) whose ``get`` blocks until released."""

    needs_deadline = True

    def __init__(self, root):
        import threading

        super().__init__(root, fsync=False)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.hang = False  # set once the writer is done (its lease reads the store too)

    def get(self, key, *, start=None, end=None):
        if self.hang:
            self.entered.set()
            self.release.wait()
        return super().get(key, start=start, end=end)


@pytest.fixture
def hangs(tmp_path):
    s = _Hangs(tmp_path / "h")
    yield s
    s.release.set()  # let the abandoned call finish


@pytest.mark.timeout(60)
def test_a_store_call_that_never_returns_fails_at_its_deadline(hangs):
    import torch

    from torch_deltasync import DeltaReceiver, DeltaSender
    from torch_deltasync.errors import TransientStoreError
    from torch_deltasync.store import DeadlineStore

    sender = DeltaSender({"w": torch.ones(3)}, hangs)
    sender.publish()
    sender.close()  # releases its lease; from here on every read hangs
    hangs.hang = True
    receiver = DeltaReceiver({"w": torch.zeros(3, dtype=torch.bfloat16)}, open_store(hangs, timeout_s=0.2))
    with pytest.raises(TransientStoreError, match=r"cannot read '.*': no answer within 0\.2 s \(the store call deadline"):
        receiver.update()
    assert hangs.entered.is_set() and not hangs.release.is_set()  # it returned while the call still hung
    assert receiver.version is None
    # without options, a custom store gets the default deadline
    default = DeltaReceiver({"w": torch.zeros(3, dtype=torch.bfloat16)}, hangs).store
    assert isinstance(default, DeadlineStore) and default.inner is hangs and default.timeout_s == 120.0


def test_open_store_deadlines(tmp_path):
    from torch_deltasync.store import DeadlineStore, FsspecStore

    local = LocalStore(tmp_path)
    assert open_store(local) is local and open_store(str(tmp_path)).needs_deadline is False
    wrapped = open_store(str(tmp_path), timeout_s=5)
    assert isinstance(wrapped, DeadlineStore) and wrapped.timeout_s == 5 and isinstance(wrapped.inner, LocalStore)
    mem = open_store("memory://deadline/x", timeout_s=7)
    assert isinstance(mem, FsspecStore) and mem.retry.timeout_s == 7
    with pytest.raises(ValueError, match="already has its deadline"):
        open_store(local, timeout_s=3)
    with pytest.raises(ValueError, match="either timeout_s or retry"):
        from torch_deltasync.store import RetryPolicy

        open_store("memory://deadline/y", timeout_s=3, retry=RetryPolicy())
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        open_store(str(tmp_path), timeout_s=0)
    custom = _Hangs(tmp_path / "c")
    custom.release.set()
    assert open_store(custom, timeout_s=None) is custom  # explicitly no deadline


@pytest.mark.parametrize("uri, missing, match", [
    ("s3://bucket/run", "s3fs", r"store 's3://bucket/run' needs s3fs, which is not installed in this environment "
                                r"\(.*python.*\): pip install 'torch-deltasync\[remote\]' there"),
    ("s3://bucket/run", "fsspec", r"store 's3://bucket/run' needs fsspec, .*pip install 'torch-deltasync\[remote\]'"),
    ("gs://bucket/run", "gcsfs", r"store 'gs://bucket/run' needs gcsfs, which is not installed in this environment "
                                 r"\(.*\): pip install gcsfs there"),
    ("hf://buckets/org/b/run", "huggingface_hub", r"store 'hf://buckets/org/b/run' needs huggingface_hub, which is not "
                                                  r"installed .*pip install 'torch-deltasync\[remote\]' there"),
    # s3fs is there but one of its own imports fails (fsspec says only "Install s3fs to access S3")
    ("s3://bucket/run", "aiobotocore", r"store 's3://bucket/run' needs s3fs, which is installed in this environment "
                                       r"\(.*\) but fails to import: ModuleNotFoundError: .*aiobotocore.*; repair that "
                                       r"environment"),
])
def test_a_missing_store_driver_names_the_store_and_the_install(uri, missing, match):
    """An engine's environment without the ``remote`` extra, or with a broken one (a real import
    failure in a fresh interpreter: the module is blocked, fsspec's lazy driver import fails as it
    would)."""
    import subprocess
    import sys

    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from torch_deltasync import open_store\n"
            "try:\n"
            f"    open_store({uri!r})\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    print('opened')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(match, out.stdout), out.stdout
