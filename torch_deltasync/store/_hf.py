"""``HFBucketStore``: a prefix of a Hugging Face Bucket (``hf://buckets/<namespace>/<bucket>/<prefix>``).

Built on ``huggingface_hub``'s Buckets API (imported only when such a store is opened):

============================  ==========================================================================
store call                    ``huggingface_hub``
============================  ==========================================================================
``put``                       ``HfApi.batch_bucket_files(bucket_id, add=[(bytes, path)])`` (Xet upload,
                              then one batch commit: the file appears whole or not at all)
``get`` (whole object)        ``HfApi.download_bucket_files(bucket_id, [(path, tmpfile)],
                              raise_on_missing_files=True)`` (Xet download, parallel inside hf_xet)
``get(start=, end=)``         HTTP ``GET {endpoint}/buckets/{bucket_id}/resolve/{path}`` with a
                              ``Range`` header (as ``HfFileSystem`` reads byte ranges)
``exists`` / ``size``         ``HfApi.get_bucket_paths_info(bucket_id, [path])``
``list``                      ``HfApi.list_bucket_tree(bucket_id, prefix, recursive=True)``
``delete`` / ``delete_many``  ``HfApi.batch_bucket_files(bucket_id, delete=[...])``
============================  ==========================================================================

Authentication is the standard Hugging Face one: the ``token`` argument, else ``HF_TOKEN``, else the
token saved by ``hf auth login``; ``HF_ENDPOINT`` selects another Hub. Every call runs through
:func:`~torch_deltasync.store._retry.call_with_retry` (deadline, retries on 429/5xx and connection
errors). ``huggingface_hub`` retries some HTTP calls itself (``http_backoff``); that loop cannot be
turned off, so a call may take a few more tries than :class:`RetryPolicy` says.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import quote

from ._http import http_status
from ._base import Store, check_key, check_prefix, check_range, driver_import_error
from ._retry import RetryPolicy, Verdict, call_with_retry, classify_error
from ..errors import StoreError, StoreNotFoundError

__all__ = ["HFBucketStore", "parse_bucket_uri"]

T = TypeVar("T")

_SCHEME = "hf://buckets/"


#: A Hub namespace or repository name, as ``huggingface_hub.utils.validate_repo_id`` accepts them.
_HUB_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def parse_bucket_uri(uri: str) -> tuple[str, str]:
    """Split ``hf://buckets/<namespace>/<bucket>[/<prefix>]`` into ``("namespace/bucket", prefix)``.

    Raises:
        ValueError: not of that form (the message shows the expected form).
    """
    if not isinstance(uri, str) or not uri.startswith(_SCHEME):
        raise ValueError(f"expected hf://buckets/<namespace>/<bucket>[/<prefix>], got {uri!r}")
    parts = uri[len(_SCHEME):].strip("/").split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"expected hf://buckets/<namespace>/<bucket>[/<prefix>], got {uri!r}")
    for what, name in (("namespace", parts[0]), ("bucket", parts[1])):
        if not _HUB_NAME.fullmatch(name) or ".." in name or "--" in name or name.endswith(".git"):
            raise ValueError(f"{uri!r}: {what} {name!r} is no Hub name (letters, digits, '-', '_' and '.', at most "
                             "96, starting and ending with a letter, digit or '_', no '--' or '..', not ending in '.git')")
    prefix = parts[2].strip("/") if len(parts) == 3 else ""
    check_prefix(prefix, f"store {uri!r}")
    return f"{parts[0]}/{parts[1]}", prefix


def classify_hf_error(e: BaseException) -> Verdict:
    """:data:`~torch_deltasync.store._retry.Classifier` for ``huggingface_hub`` errors.

    A missing entry (``EntryNotFoundError``, HTTP 404 on a file) is ``"missing"``; a missing bucket
    (``BucketNotFoundError``, ``RepositoryNotFoundError``) is ``"no_store"``; a refused token (401,
    403) and offline mode are ``"fatal"``;
    everything else is decided by :func:`~torch_deltasync.store._retry.classify_error` (429/5xx and
    connection errors are transient).
    """
    from huggingface_hub import errors as hf_errors

    if isinstance(e, (hf_errors.BucketNotFoundError, hf_errors.RepositoryNotFoundError)):
        return "no_store"
    if isinstance(e, hf_errors.OfflineModeIsEnabled):
        return "fatal"
    if isinstance(e, hf_errors.EntryNotFoundError):
        return "missing"
    status = http_status(e)
    if status == 404:
        return "missing"
    if status in (401, 403):
        return "fatal"
    return classify_error(e)


class HFBucketStore(Store):
    """Objects under a prefix of a Hugging Face Bucket.

    A batch commit makes one added file visible whole, so ``put`` has the atomicity the wire format
    relies on (the manifest is written last, docs/design.md invariant 3).

    Args:
        uri: ``hf://buckets/<namespace>/<bucket>[/<prefix>]``.
        token: a Hugging Face token; ``None`` uses ``HF_TOKEN`` or the saved login.
        endpoint: the Hub URL; ``None`` uses ``HF_ENDPOINT`` or ``https://huggingface.co``.
        retry: retry and deadline policy (default :class:`RetryPolicy`).
        api: an ``HfApi``-like object to use instead of ``HfApi(endpoint=..., token=...)`` (tests).
        tmp_dir: where whole-object downloads land before they are read (default: the system temp
            folder); each download's file is removed at once.

    Raises:
        ValueError: a malformed ``uri``.
        ImportError: ``huggingface_hub`` is not installed or fails to import (the message names the store
            and the interpreter; ``pip install 'torch-deltasync[remote]'``).

    Example:
        >>> store = HFBucketStore("hf://buckets/my-org/rl-weights/run-7")
        >>> receiver = DeltaReceiver(model, store)
    """

    def __init__(self, uri: str, *, token: str | None = None, endpoint: str | None = None,
                 retry: RetryPolicy | None = None, api: Any = None, tmp_dir: str | os.PathLike | None = None) -> None:
        self.bucket_id, self.root = parse_bucket_uri(uri)
        self.retry = retry or RetryPolicy()
        self.token = token
        self.tmp_dir = tmp_dir
        if api is None:
            try:
                from huggingface_hub import HfApi
            except ImportError as e:
                raise driver_import_error(uri, "huggingface_hub", e) from e

            api = HfApi(endpoint=endpoint, token=token, library_name="torch_deltasync")
        self.api = api

    needs_deadline = False

    def describe(self) -> str:
        base = f"hf://buckets/{self.bucket_id}"
        return f"{base}/{self.root}" if self.root else base

    def __repr__(self) -> str:
        return f"HFBucketStore({self.describe()!r})"

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        try:
            return call_with_retry(fn, policy=self.retry, store=self.describe(), op=op, key=key,
                                   classify=classify_hf_error, nbytes=nbytes)
        except StoreError as e:  # the Hub answers a private bucket without a token as a missing one
            if isinstance(e, StoreNotFoundError) or http_status(e.__cause__) in (401, 403):
                raise type(e)(f"{e}. {self._AUTH_HINT}") from e.__cause__
            raise

    _AUTH_HINT = ("If the bucket is private or the token lacks access: pass token=, set HF_TOKEN or run "
                  "`hf auth login` with a token that can read (and, for a sender, write) the bucket")

    def _info(self, path: str):
        for info in self.api.get_bucket_paths_info(self.bucket_id, [path]):
            if getattr(info, "path", None) == path:
                return info
        return None

    # --- Store -----------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        data = bytes(data)
        self._call("write", key, lambda: self.api.batch_bucket_files(self.bucket_id, add=[(data, path)]), len(data))

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        check_range(key, start, end)
        if start is None and end is None:
            return self._call("read", key, lambda: self._download(path))
        if end is not None and end <= (start or 0):
            return b""
        n = end - (start or 0) if end is not None else 0
        return self._call("read", key, lambda: self._get_range(path, start or 0, end), n)

    def _download(self, path: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="deltasync-hf-", dir=self.tmp_dir) as tmp:
            dest = Path(tmp, "object")
            self.api.download_bucket_files(self.bucket_id, [(path, str(dest))], raise_on_missing_files=True)
            return dest.read_bytes()

    def _get_range(self, path: str, start: int, end: int | None) -> bytes:
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = f"{self.api.endpoint}/buckets/{self.bucket_id}/resolve/{quote(path)}"
        headers = build_hf_headers(token=self.token, library_name="torch_deltasync")
        headers["range"] = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
        timeout = self.retry.deadline_s(0 if end is None else end - start)
        r = get_session().get(url, headers=headers, timeout=timeout, follow_redirects=True)
        if r.status_code == 416:  # range starts at or past the end of the object
            return b""
        hf_raise_for_status(r)
        data = r.content
        if r.status_code == 200:  # the server ignored the range: cut it out ourselves
            data = data[start:end]
        return bytes(data)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._call("stat", key, lambda: self._info(path) is not None)

    def size(self, key: str) -> int:
        path = self._path(key)

        def stat() -> int:
            info = self._info(path)
            if info is None:
                raise FileNotFoundError(path)
            return int(info.size)

        return self._call("stat", key, stat)

    def list(self, prefix: str = "") -> list[str]:
        check_key(prefix, allow_empty=True)
        base = self._path(prefix) if prefix else self.root

        def tree() -> list[str]:
            # huggingface_hub follows the server's "next page" links without a bound: an attempt
            # stops past its deadline (call_with_retry has given up on it by then) and on an entry
            # seen twice (the pages loop), so an abandoned attempt does not page for ever.
            deadline = self.retry.deadline_s()
            stop_at = None if deadline is None else time.monotonic() + deadline
            seen: set[str] = set()
            files = []
            for f in self.api.list_bucket_tree(self.bucket_id, prefix=base or None, recursive=True):
                if stop_at is not None and time.monotonic() > stop_at:
                    raise TimeoutError(f"listing {base or '/'!r} ran past its {deadline:.1f} s deadline")
                if f.path in seen:
                    raise StoreError(f"{self.describe()}: the listing of {base or '/'!r} returned {f.path!r} twice: the "
                                     "server's pages loop; try again later, or report it to the Hub's operator")
                seen.add(f.path)
                if getattr(f, "type", "file") == "file":
                    files.append(f.path)
            return files

        out = []
        root = self.root
        for p in self._call("list", prefix or "/", tree):
            if root:
                if not p.startswith(root + "/"):
                    continue
                p = p[len(root) + 1:]
            if p and (not prefix or p == prefix or p.startswith(prefix + "/")):
                out.append(p)
        return sorted(out)

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: list[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return

        def rm() -> None:
            from huggingface_hub import errors as hf_errors

            try:
                self.api.batch_bucket_files(self.bucket_id, delete=paths)
            except hf_errors.BucketBatchError as e:
                # deleting a missing file is not an error for a Store; anything else is
                failures = [f for f in (e.failures or []) if "not found" not in str(f.get("error", "")).lower()]
                if failures:
                    raise

        self._call("delete", keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1} more)", rm)
