"""``FsspecStore``: any fsspec file system (``s3://``, ``gs://``, ``memory://`` ...).

fsspec (and the protocol driver, e.g. ``s3fs``) is imported only when such a store is opened, so
installs that only use local folders never need it; a missing or broken driver raises an
``ImportError`` naming the store, the package, the interpreter and what to do
(:func:`~torch_deltasync.store._base.driver_import_error`; ``pip install 'torch-deltasync[remote]'``
for S3).

Configuration, for S3 (``s3://`` / ``s3a://``), in order of precedence:

1. keyword storage options (``open_store("s3://b/run", endpoint_url=..., key=..., secret=...)``);
2. fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL=...`` or ``FSSPEC_S3='{"anon": true}'``,
   see https://filesystem-spec.readthedocs.io/en/latest/features.html#configuration);
3. the usual AWS environment: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (endpoint, e.g. MinIO,
   R2 or a local moto server), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and botocore's credential
   chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
   instance roles).

Retries: s3fs and botocore each have a retry loop of their own; this store turns both off
(``retries=1`` on the s3fs instance, ``config_kwargs={"retries": {"max_attempts": 1}}``) so that
:class:`~torch_deltasync.store.RetryPolicy` is the one place that decides. The drivers' socket
timeouts stay on (s3fs: 5 s connect, 15 s read) under the policy's per-call deadline.

Listings: s3fs caches directory listings, which would hide versions published by another process
(the trainer) from a receiver. The cache is turned off (``use_listings_cache=False``) and also
invalidated before every listing and existence check, in case the caller passed a shared instance.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..errors import TransientStoreError
from ._base import Store, check_key, check_prefix, check_range, driver_import_error, root_cause
from ._retry import RetryPolicy, call_with_retry, classify_error

__all__ = ["FsspecStore", "s3_storage_options"]

T = TypeVar("T")

_S3 = ("s3", "s3a")


def _driver_error(url: str, protocol: str, error: ImportError) -> ImportError:
    """:func:`~._base.driver_import_error` for fsspec's driver of ``protocol``: the package fsspec
    names for it (``s3fs``, ``gcsfs``), or, for a file system built into fsspec (hdfs), the module
    that failed to import (``pyarrow``)."""
    from fsspec.registry import known_implementations

    package = known_implementations.get(protocol, {}).get("class", "").partition(".")[0]
    if package in ("", "fsspec"):
        package = (getattr(root_cause(error), "name", None) or protocol).partition(".")[0]
    fix = "pip install 'torch-deltasync[remote]'" if protocol in _S3 else f"pip install {package}"
    return driver_import_error(url, package, error, fix)


def s3_storage_options(options: dict[str, Any], environ: "os._Environ[str] | dict[str, str]" = os.environ) -> dict[str, Any]:
    """Storage options for ``s3fs.S3FileSystem``: ``options`` completed from the environment.

    Args:
        options: what the caller passed (never overridden).
        environ: the environment to read (``os.environ`` by default).

    Returns:
        A new dict: ``options`` plus ``endpoint_url`` from ``AWS_ENDPOINT_URL_S3`` or
        ``AWS_ENDPOINT_URL``, ``client_kwargs["region_name"]`` from ``AWS_REGION`` or
        ``AWS_DEFAULT_REGION``, botocore retries off and the listings cache off, each only when the
        caller did not set it.
    """
    opts = dict(options)
    client = dict(opts.get("client_kwargs") or {})
    if not opts.get("endpoint_url") and not client.get("endpoint_url"):
        endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    if "region_name" not in client:
        region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
        if region:
            client["region_name"] = region
    if client:
        opts["client_kwargs"] = client
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)
    return opts


def check_fsspec_url(url: str) -> tuple[str, str]:
    """``(protocol, path)`` of an fsspec store URL, checked as :class:`FsspecStore` checks it, with
    its driver imported but no file system built (some drivers connect when built: adlfs, gcsfs).
    For a command line that should refuse a bad store before it starts anything.

    Raises:
        ValueError: no protocol, an unknown one, ``http(s)://``, an S3 URL without a bucket, or a
            path that is not a plain relative one (``..``, empty segments, odd characters).
        ImportError: fsspec or the protocol's driver is not installed (the message says what to install).
    """
    protocol, sep, path = url.partition("://")
    if not sep or not protocol:
        raise ValueError(f"expected protocol://path, got {url!r}")
    if protocol in _S3 and (not path.strip("/") or path.startswith("/")):
        raise ValueError(f"{url!r} names no bucket; expected s3://bucket/prefix")
    if protocol in ("http", "https"):
        raise ValueError(
            f"{url!r}: {protocol}:// is no store: fsspec's HTTP file system can neither list nor write "
            "atomically. For an S3-compatible server give s3://bucket/prefix with endpoint_url="
            f"'{protocol}://host:port' (or AWS_ENDPOINT_URL)")
    check_prefix(path.strip("/"), f"store {url!r}")  # no '..', '.', empty segments or odd characters
    try:
        import fsspec
    except ImportError as e:
        raise driver_import_error(url, "fsspec", e) from e
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:  # fsspec: "Protocol not known: foo", without the URI
        raise ValueError(
            f"{url!r}: unknown store scheme {protocol + '://'!r}; a store is a folder path, file://, s3://, "
            "gs://, memory://, hf://buckets/... or another fsspec protocol"
        ) from None
    except ImportError as e:  # fsspec: "Install s3fs to access S3", without the URI or the cause
        raise _driver_error(url, protocol, e) from e
    return protocol, path


class FsspecStore(Store):
    """Objects under a root of an fsspec file system.

    Object stores (S3, GCS) make a single PUT atomic (readers see the old object or all of the new
    one, never a torn write), so ``put`` writes the key directly. Use only protocols with that
    property; for a local or network folder use :class:`~torch_deltasync.LocalStore`.

    Every call runs through :func:`~torch_deltasync.store._retry.call_with_retry` (deadline,
    retries with backoff) and raises :class:`~torch_deltasync.errors.StoreError` /
    :class:`~torch_deltasync.errors.ObjectNotFoundError` naming the store, key and cause.
    Concurrent calls from several threads (the receiver's download pool) run in parallel: s3fs
    multiplexes them on its event loop.

    Whole-object reads start with one ranged GET of ``part_nbytes``; an object that fits (every
    manifest and most deltas) costs that one request. Larger objects (anchors) are read as
    ``part_nbytes`` ranges, up to ``max_parallel_parts`` at a time, each retried on its own and
    checked for length, so one slow or dropped connection costs one part, not the whole object.

    Args:
        url: ``protocol://bucket/prefix`` (``s3://my-bucket/runs/x``, ``memory://runs/x``).
        retry: retry and deadline policy (default :class:`RetryPolicy`).
        part_nbytes: size of one ranged read of a large object, in bytes.
        max_parallel_parts: ranged reads in flight per large object.
        storage_options: passed to ``fsspec.filesystem`` (``endpoint_url``, ``key``, ``secret``,
            ``client_kwargs``, ...); for S3 completed by :func:`s3_storage_options`.

    Raises:
        ValueError: ``url`` has no protocol, an unknown one, or an S3 URL names no bucket.
        ImportError: the protocol's driver is not installed.

    Every call on a bucket that does not exist raises
    :class:`~torch_deltasync.errors.StoreNotFoundError` (also listings and existence checks,
    which s3fs would answer with "nothing there").

    Example:
        >>> store = FsspecStore("s3://my-bucket/runs/x", endpoint_url="http://127.0.0.1:9000")
        >>> store.put("a/b.json", b"{}")
        >>> store.get("a/b.json", start=0, end=1)
        b'{'
    """

    def __init__(self, url: str, *, retry: RetryPolicy | None = None, part_nbytes: int = 32 << 20,
                 max_parallel_parts: int = 8, **storage_options: Any) -> None:
        if part_nbytes < 1 or max_parallel_parts < 1:
            raise ValueError("part_nbytes and max_parallel_parts must be >= 1")
        self.part_nbytes = int(part_nbytes)
        self.max_parallel_parts = int(max_parallel_parts)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

        protocol, path = check_fsspec_url(url)
        self.protocol = protocol
        self.url = f"{protocol}://{path.strip('/')}"
        self.retry = retry or RetryPolicy()
        if protocol in _S3:
            storage_options = s3_storage_options(storage_options)
        elif protocol != "memory":
            storage_options.setdefault("use_listings_cache", False)
        self.storage_options = storage_options
        import fsspec

        try:
            self.fs = fsspec.filesystem(protocol, **storage_options)
        except ImportError as e:  # a driver that imports its own dependencies late (hdfs: pyarrow)
            raise _driver_error(url, protocol, e) from e
        if protocol in _S3:
            self.fs.retries = 1  # s3fs's own retry loop off: RetryPolicy decides (see module docstring)
        self.root = self.fs._strip_protocol(self.url).rstrip("/")

    needs_deadline = False

    def describe(self) -> str:
        return self.url

    def _where(self) -> str:
        """The store's name in error messages: the URL, and the endpoint when it is not the default."""
        endpoint = self.storage_options.get("endpoint_url")
        return f"{self.url} (endpoint {endpoint})" if endpoint else self.url

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        return call_with_retry(fn, policy=self.retry, store=self._where(), op=op, key=key, nbytes=nbytes)

    def _invalidate(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache flush must never fail a call
            pass

    # --- Store -----------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        data = bytes(data)
        self._call("write", key, lambda: self.fs.pipe_file(path, data), len(data))

    def put_new(self, key: str, data: bytes) -> None:
        if self.protocol not in _S3:
            return super().put_new(key, data)
        from ..errors import ObjectExistsError

        path = self._path(key)
        data = bytes(data)

        def create() -> None:
            try:  # a conditional PUT (If-None-Match: *): atomic on S3, refused if the key exists
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                raise ObjectExistsError(f"{self.describe()}: {key!r} already exists") from None

        self._call("write", key, create, len(data))

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        check_range(key, start, end)
        if start is not None and end is not None and end <= start:
            return b""
        if not start and (end is None or end > self.part_nbytes):
            return self._get_whole(key, path, end)
        n = end - (start or 0) if end is not None else 0
        return self._call("read", key, lambda: bytes(self.fs.cat_file(path, start=start, end=end)), n)

    def _get_whole(self, key: str, path: str, end: int | None = None) -> bytes:
        """The object (or its first ``end`` bytes): one GET when it is small, else ranged parts in
        parallel, each length-checked and retried on its own."""
        part = self.part_nbytes

        def first() -> bytes:
            try:
                return bytes(self.fs.cat_file(path, start=0, end=part))
            except OSError as e:
                if isinstance(e, FileNotFoundError) or e.errno != errno.EINVAL:
                    raise
                return bytes(self.fs.cat_file(path))  # S3 answers 416 to a range on an empty object

        head = self._call("read", key, first, part)
        if len(head) < part:
            return head
        size = self.size(key) if end is None else min(self.size(key), end)
        if size <= len(head):
            return head[:size]
        ranges = [(s, min(s + part, size)) for s in range(part, size, part)]

        def read_part(r: tuple[int, int]) -> bytes:
            s, e = r

            def attempt() -> bytes:
                data = bytes(self.fs.cat_file(path, start=s, end=e))
                if len(data) != e - s:  # a truncated transfer: retry the part
                    raise TransientStoreError(f"{self._where()}: short read of {key!r} bytes [{s}, {e}): got {len(data)}")
                return data

            return self._call("read", f"{key} [{s}, {e})", attempt, e - s)

        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_parallel_parts, thread_name_prefix="deltasync-part")
        return b"".join([head, *self._pool.map(read_part, ranges)])

    def exists(self, key: str) -> bool:
        path = self._path(key)

        def stat() -> bool:
            self._invalidate(path)
            try:  # not fs.isfile: it answers False for a bucket that does not exist
                return self.fs.info(path).get("type") == "file"
            except FileNotFoundError as e:
                if classify_error(e) == "no_store":
                    raise
                return False

        return self._call("stat", key, stat)

    def size(self, key: str) -> int:
        path = self._path(key)

        def stat() -> int:
            self._invalidate(path)
            return int(self.fs.size(path))

        return self._call("stat", key, stat)

    def list(self, prefix: str = "") -> list[str]:
        check_key(prefix, allow_empty=True)
        base = self._path(prefix) if prefix else self.root
        root = self.root

        def find() -> list[str]:
            self._invalidate(base)
            try:
                return list(self.fs.find(base))
            except FileNotFoundError as e:
                if classify_error(e) == "no_store":
                    raise  # s3fs: NoSuchBucket, which must not read as an empty run
                return []

        out = []
        for p in self._call("list", prefix or "/", find):
            if p.endswith("/"):  # a "folder" marker (S3 console, s3fs.mkdir): no object of ours
                continue
            p = self.fs._strip_protocol(p)
            if root:
                if not p.startswith(root + "/"):
                    continue
                rel = p[len(root) + 1:]
            else:
                rel = p.lstrip("/")
            if rel and (not prefix or rel == prefix or rel.startswith(prefix + "/")):
                out.append(rel)
        return sorted(out)

    def delete(self, key: str) -> None:
        path = self._path(key)

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, rm)

    def delete_many(self, keys: list[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        if self.protocol not in _S3:
            return super().delete_many(keys)
        paths = [self._path(k) for k in keys]
        # One DeleteObjects request per 1000 keys; S3 treats missing keys as deleted.
        self._call("delete", f"{keys[0]} (+{len(keys) - 1} more)", lambda: self.fs.rm(paths))
