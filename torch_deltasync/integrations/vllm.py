"""vLLM integration, client side: thin helpers over vLLM's weight-transfer API with the ``deltasync``
backend (:mod:`torch_deltasync.integrations.vllm_transfer`), for an offline ``LLM``, an ``AsyncLLM``
and the OpenAI-compatible HTTP server.

Every helper drives the same calls vLLM's own RL examples use; nothing of ours runs through
``collective_rpc``::

    trainer ─DeltaSender.publish()─▶ store ◀─ every vLLM worker stages the newest version in the
                                               background (download, decode, validate, checksums)
    driver:  [wait_staged: readiness files say every worker staged v]       engine keeps serving
             pause ─ start_weight_update ─ update_weights({"version": v}) ─ finish_weight_update(str(v)) ─ resume
                                          └ commit: the only work inside the pause (the stall)

* :func:`attach_llm` / :func:`attach_async_llm` / :func:`attach_server` call
  ``init_weight_transfer_engine`` with the backend's ``init_info``, give the workers a readiness
  directory (a new temporary one unless ``status_dir`` is given) and remember it, with the store, for
  the engine's updates.
* :func:`update_llm` / :func:`update_async_llm` / :func:`update_server` pick the version (``None``:
  the newest in the store), wait until every worker has staged it (:func:`wait_staged`; the engine
  keeps serving meanwhile), then pause, commit and resume. They return an :class:`EngineUpdate` with
  the stall (pause → resume) apart from the wait.

The engine must run the backend: ``LLM(..., weight_transfer_config={"backend": "deltasync"})``,
``AsyncEngineArgs(weight_transfer_config=...)``, or ``--weight-transfer-config '{"backend":
"deltasync"}'`` for the server, whose RL routes exist only with ``VLLM_SERVER_DEV_MODE=1``
(``docs/vllm.md``). A failed update raises with the reason (over HTTP: the server's message) and
the engine keeps serving the version it had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import DeltaSyncError, SyncTimeoutError, VersionNotFoundError

__all__ = ["EngineUpdate", "wait_staged", "read_readiness", "attach_llm", "update_llm", "attach_async_llm",
           "update_async_llm", "attach_server", "update_server"]

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "keep", "abort"]
_MODES = ("wait", "keep", "abort")

#: Default bound on :func:`wait_staged` inside ``update_*`` (seconds). Past it the update goes on
#: and the workers prepare the version inside the pause (correct, only slower).
DEFAULT_STAGE_TIMEOUT_S = 60.0


@dataclass
class EngineUpdate:
    """What one update of an engine did (times in milliseconds, wall clock on the driver).

    Attributes:
        version: the version the engine now serves (its ``weight_version`` is ``str(version)``).
        staged: every worker had staged ``version`` before the pause (so the pause covered only the
            commit); ``False``: some prepared it inside the pause (the wait timed out or a worker
            reported a staging error); ``None``: no readiness files (workers on another host, or
            ``status_dir=False``).
        wait_ms: waiting for the workers to stage ``version`` (the engine serves meanwhile).
        stall_ms: pause → resume, i.e. how long the engine did not generate (``AsyncLLM``, server);
            for an offline ``LLM``, which has no pause, ``start_weight_update`` → prefix-cache reset.
        total_ms: the whole call (version lookup, wait, stall, checks).
        mode: the pause mode (``None`` for an offline ``LLM``).
    """

    version: int
    staged: bool | None = None
    wait_ms: float = 0.0
    stall_ms: float = 0.0
    total_ms: float = 0.0
    mode: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- readiness files (written by every worker of the backend) ---------------------------------------


def read_readiness(status_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every worker's readiness file in ``status_dir``: ``{"rank-<r>": {"held", "staged", "newest",
    "error", "time"}}`` (format: :mod:`torch_deltasync.integrations.vllm_transfer`; workers replace
    their file atomically, so a read never sees half of one).

    Raises:
        DeltaSyncError: a readiness file that is not a JSON object.
    """
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(status_dir).glob("rank-*.json")):
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise DeltaSyncError(f"{path}: unreadable readiness file ({e}); is {status_dir} shared with "
                                 "something other than one engine's deltasync workers?") from e
        if not isinstance(state, dict):
            raise DeltaSyncError(f"{path}: a readiness file holds a JSON object, got {type(state).__name__}")
        out[path.stem] = state
    return out


def _ready(state: dict[str, Any], version: int) -> bool:
    """A worker is ready for ``version`` when it staged or holds it, or when it has seen the version
    and reports a staging error (then the commit prepares it again and raises the reason)."""
    held, staged, newest = state.get("held"), state.get("staged"), state.get("newest")
    if staged == version or (isinstance(held, int) and held >= version):
        return True
    return bool(state.get("error")) and isinstance(newest, int) and newest >= version


def wait_staged(status_dir: str | os.PathLike, version: int, timeout_s: float = DEFAULT_STAGE_TIMEOUT_S, *,
                workers: int | None = None, poll_s: float = 0.005) -> dict[str, dict[str, Any]]:
    """Block until every worker's readiness file reports ``version`` staged (or held), so that a
    pause that follows covers only the commit.

    Drivers on the same host as the engine's workers read the files the ``deltasync`` backend keeps
    in ``init_info["status_dir"]`` (one per worker, ``rank-<r>.json``). A worker that has seen
    ``version`` but failed to stage it (its ``error`` is set) counts as ready: the commit then
    prepares the version again and raises the reason.

    Args:
        status_dir: the backend's ``status_dir``.
        version: the version about to be committed.
        timeout_s: give up after this many seconds.
        workers: how many readiness files to expect (``None``: whatever is there, at least one).
        poll_s: seconds between reads of the files.

    Returns:
        The readiness of every worker when the wait ended (:func:`read_readiness`).

    Raises:
        SyncTimeoutError: not every worker was ready within ``timeout_s``; the message names the
            workers that were not and what they reported.
        ValueError: a negative version or timeout, or fewer than one expected worker.
    """
    if type(version) is not int or version < 0:
        raise ValueError(f"version must be a published version (int >= 0), got {version!r}")
    if timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1 (or None), got {workers}")
    deadline = time.monotonic() + timeout_s
    while True:
        states = read_readiness(status_dir)
        pending = {w: s for w, s in states.items() if not _ready(s, version)}
        if states and not pending and (workers is None or len(states) >= workers):
            return states
        if time.monotonic() >= deadline:
            missing = "" if workers is None or len(states) >= workers else \
                f"; {len(states)} of {workers} readiness files present"
            detail = ", ".join(f"{w}: staged {s.get('staged')}, held {s.get('held')}, newest {s.get('newest')}"
                               + (f", error {s['error']}" if s.get("error") else "") for w, s in pending.items())
            raise SyncTimeoutError(f"{status_dir}: workers did not stage version {version} within {timeout_s} s"
                                   f"{missing}" + (f" ({detail})" if detail else ""))
        time.sleep(poll_s)


# --- what attach_* remember per engine --------------------------------------------------------------


@dataclass
class _Attachment:
    store: str
    prefix: str
    status_dir: str | None  # None: no readiness files here
    workers: int  # readiness files present right after init
    owned: bool = False  # status_dir is a temporary directory attach_* created

    def __post_init__(self) -> None:
        # A directory attach_* created goes with this record (engine gone, re-attached, or exit).
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.status_dir, ignore_errors=True) \
            if self.owned and self.status_dir is not None else None

    def discard(self) -> None:
        """Remove the readiness directory if attach_* created it."""
        if self._cleanup is not None:
            self._cleanup()

    def _store(self):
        from ..store import open_store

        return open_store(self.store).sub(self.prefix)

    def newest(self) -> int:
        """The newest version published in the run (the store's listing)."""
        from ..keys import list_versions

        versions = list_versions(self._store())
        if not versions:
            raise VersionNotFoundError(f"{self.store} (prefix {self.prefix!r}): no version has been published yet")
        return versions[-1]

    def _published(self, version: int) -> bool:
        """Whether ``version``'s manifest is in the store (``True`` when the store cannot be read
        from here: the workers will tell)."""
        from ..keys import manifest_key

        try:
            return self._store().exists(manifest_key(version))
        except Exception:  # noqa: BLE001 (a driver may not reach the workers' store URI)
            return True

    def wait(self, version: int, timeout_s: float | None) -> bool | None:
        """:func:`wait_staged` for ``version``; ``None`` without readiness files, ``False`` when some
        worker is not ready at the timeout (the update then goes on: the commit prepares it) or the
        version is not published (no wait: the commit raises the workers' reason)."""
        if self.status_dir is None:
            return None
        if not self._published(version):
            return False
        try:
            states = wait_staged(self.status_dir, version, DEFAULT_STAGE_TIMEOUT_S if timeout_s is None else timeout_s,
                                 workers=self.workers)
        except SyncTimeoutError as e:
            log.warning("%s; committing anyway (the workers prepare it inside the pause)", e)
            return False
        return all(s.get("staged") == version or s.get("held") == version for s in states.values())

    def check_held(self, version: int) -> None:
        """After a commit: every worker's readiness file says it holds ``version``."""
        if self.status_dir is None:
            return
        held = {w: s.get("held") for w, s in read_readiness(self.status_dir).items()}
        if len(held) < self.workers or set(held.values()) != {version}:
            raise DeltaSyncError(f"after committing version {version} the workers report holding {held} "
                                 f"({len(held)} of {self.workers} readiness files)")


_ENGINES: "weakref.WeakKeyDictionary[Any, _Attachment]" = weakref.WeakKeyDictionary()
_SERVERS: dict[str, _Attachment] = {}


def _init_info(store: str | os.PathLike, prefix: str, assume_version: int | None, status_dir: Any,
               extra: dict[str, Any]) -> tuple[dict[str, Any], str | None, bool]:
    """The backend's ``init_info``, the readiness directory and whether this call created it."""
    if not isinstance(store, (str, os.PathLike)) or not str(store):
        raise TypeError(f"store must be the store URI or path the workers open (a string), got {store!r}")
    created = False
    if status_dir is None:
        status_dir, created = tempfile.mkdtemp(prefix="deltasync-ready-"), True
    elif status_dir is False:
        status_dir = None
    info: dict[str, Any] = {"store": str(store), "prefix": prefix, **extra}
    if status_dir is not None:
        info["status_dir"] = str(status_dir)
    if assume_version is not None:
        info["assume_version"] = assume_version  # as given: the backend refuses a non-int, naming it
    return info, (None if status_dir is None else str(status_dir)), created


def _attachment(info: dict[str, Any], status_dir: str | None, created: bool) -> _Attachment:
    """Count the readiness files the workers wrote during init (none: they run on another host)."""
    workers = len(read_readiness(status_dir)) if status_dir is not None else 0
    if status_dir is not None and workers == 0:
        log.info("no readiness files in %s after init (workers on another host?): updates will not wait "
                 "for staging", status_dir)
        if created:
            shutil.rmtree(status_dir, ignore_errors=True)
        status_dir = None
    return _Attachment(info["store"], info["prefix"], status_dir, workers, owned=created)


def _remember(engine: Any, att: _Attachment) -> None:
    old = _ENGINES.get(engine)
    _ENGINES[engine] = att
    if old is not None and old.status_dir != att.status_dir:
        old.discard()


def _attached(engine: Any, what: str) -> _Attachment:
    try:
        return _ENGINES[engine]
    except (KeyError, TypeError):
        raise DeltaSyncError(f"this {type(engine).__name__} is not attached to a run: call {what} first") from None


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


# --- offline LLM ------------------------------------------------------------------------------------


def attach_llm(llm: Any, store: str | os.PathLike, prefix: str = "", *, assume_version: int | None = None,
               status_dir: str | os.PathLike | Literal[False] | None = None, **init_info: Any) -> dict[str, Any]:
    """Make every worker of an offline ``vllm.LLM`` (started with ``weight_transfer_config={"backend":
    "deltasync"}``) follow the run at ``store`` / ``prefix``: ``llm.init_weight_transfer_engine``.

    Args:
        llm: the engine (or anything with ``vllm.LLM``'s weight-transfer methods).
        store: store URI or path as the workers open it (the sender's).
        prefix: the run's sub-path.
        assume_version: the engine loaded the checkpoint the trainer published as this version;
            later versions are applied as deltas (the claim is trusted: compare outputs).
        status_dir: the workers' readiness directory; ``None``: a new temporary directory (removed
            with the engine object); ``False``: none (updates then do not wait for staging).
        init_info: further backend fields (``in_place``, ``stage_ahead``, ``poll_s``,
            ``max_workers``, ``metrics_path``; :class:`~torch_deltasync.integrations.vllm_transfer.DeltaSyncInitInfo`).

    Returns:
        The ``init_info`` sent.

    Raises:
        whatever the workers raise (a bad field: ``ValueError`` naming it; a store or version that
        does not fit: a :class:`~torch_deltasync.DeltaSyncError`); nothing is installed then.
    """
    info, sdir, created = _init_info(store, prefix, assume_version, status_dir, init_info)
    try:
        llm.init_weight_transfer_engine({"init_info": info})
        att = _attachment(info, sdir, created)
    except BaseException:
        if created:
            shutil.rmtree(sdir, ignore_errors=True)
        raise
    _remember(llm, att)
    return info


def update_llm(llm: Any, version: int | None = None, *,
               stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S) -> EngineUpdate:
    """Commit ``version`` (the newest published when ``None``) on an attached offline ``vllm.LLM``.

    Steps: wait until every worker staged it (:func:`wait_staged`) → ``start_weight_update()`` →
    ``update_weights({"update_info": {"version": v}})`` → ``finish_weight_update(weight_version=str(v))``
    → ``reset_prefix_cache(reset_running_requests=True)`` (no KV computed with the old weights is
    reused). An offline ``LLM`` generates only inside ``generate()``, so there is nothing to pause.

    Raises:
        VersionNotFoundError, CorruptObjectError, ChecksumMismatchError, StoreError, ...: from the
            workers; the engine keeps serving the version it had.
        DeltaSyncError: not attached, or a worker reports another version after the commit.
    """
    att = _attached(llm, "attach_llm")
    t0 = time.perf_counter()
    v = att.newest() if version is None else _version(version)
    staged = att.wait(v, stage_timeout_s)
    t1 = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": v}})
    llm.finish_weight_update(weight_version=str(v))
    llm.reset_prefix_cache(reset_running_requests=True)
    t2 = time.perf_counter()
    att.check_held(v)
    return EngineUpdate(version=v, staged=staged, wait_ms=(t1 - t0) * 1e3, stall_ms=(t2 - t1) * 1e3,
                        total_ms=(time.perf_counter() - t0) * 1e3)


def _version(version: Any) -> int:
    if type(version) is not int or version < 0:
        raise ValueError(f"version must be a published version (int >= 0) or None, got {version!r}")
    return version


# --- AsyncLLM ---------------------------------------------------------------------------------------


async def attach_async_llm(engine: Any, store: str | os.PathLike, prefix: str = "", *,
                           assume_version: int | None = None,
                           status_dir: str | os.PathLike | Literal[False] | None = None,
                           **init_info: Any) -> dict[str, Any]:
    """:func:`attach_llm` for a ``vllm.v1.engine.async_llm.AsyncLLM`` (or any ``EngineClient``):
    ``await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=...))``."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    info, sdir, created = _init_info(store, prefix, assume_version, status_dir, init_info)
    try:
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        att = _attachment(info, sdir, created)
    except BaseException:
        if created:
            shutil.rmtree(sdir, ignore_errors=True)
        raise
    _remember(engine, att)
    return info


async def update_async_llm(engine: Any, version: int | None = None, *, mode: PauseMode = "wait",
                           stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S) -> EngineUpdate:
    """Commit ``version`` (the newest published when ``None``) on an attached ``AsyncLLM``.

    Steps: wait until every worker staged it (the engine keeps generating) →
    ``pause_generation(mode=mode, clear_cache=True)`` → ``start_weight_update()`` →
    ``update_weights(...{"version": v})`` → ``finish_weight_update(weight_version=str(v))`` →
    ``resume_generation()`` (always, also when a step fails).

    ``mode``: ``"wait"`` drains in-flight requests first (each completion comes from one version);
    ``"keep"`` freezes them, and ``clear_cache=True`` preempts them so that they recompute their KV
    under the new weights and continue there; ``"abort"`` drops them.

    Raises:
        ValueError: an unknown ``mode`` (nothing is paused).
        the workers' errors, as :func:`update_llm`; the engine resumes on the version it had.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    _check_mode(mode)
    att = _attached(engine, "attach_async_llm")
    t0 = time.perf_counter()
    v = await asyncio.to_thread(att.newest) if version is None else _version(version)
    staged = await asyncio.to_thread(att.wait, v, stage_timeout_s)
    t1 = time.perf_counter()
    try:
        await engine.pause_generation(mode=mode, clear_cache=True)
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": v}))
        await engine.finish_weight_update(weight_version=str(v))
    except BaseException:
        try:
            await engine.resume_generation()
        except Exception as e:  # noqa: BLE001 (the update's error is the one to raise)
            log.error("resume_generation failed after a failed update: %s", e)
        raise
    await engine.resume_generation()
    t2 = time.perf_counter()
    await asyncio.to_thread(att.check_held, v)
    return EngineUpdate(version=v, staged=staged, wait_ms=(t1 - t0) * 1e3, stall_ms=(t2 - t1) * 1e3,
                        total_ms=(time.perf_counter() - t0) * 1e3, mode=mode)


# --- HTTP server ------------------------------------------------------------------------------------


class _Server:
    """vLLM's RL routes on one server (``vllm/entrypoints/rl/online/api_router.py``)."""

    def __init__(self, base_url: str, timeout: float, headers: dict[str, str] | None) -> None:
        self.base = base_url.rstrip("/")
        self.timeout, self.headers = timeout, dict(headers or {})

    def call(self, method: str, path: str, params: dict[str, str] | None = None, body: Any = None) -> Any:
        """One request; the JSON answer. HTTP and connection errors raise :class:`DeltaSyncError`
        with the server's reason."""
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 (the caller's server)
                raw = resp.read()
        except urllib.error.HTTPError as e:
            reason = _reason(e.read())
            hint = ("; the RL routes exist only when the server runs with VLLM_SERVER_DEV_MODE=1"
                    if e.code == 404 else "")
            raise DeltaSyncError(f"{method} {url}: HTTP {e.code}: {reason}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise DeltaSyncError(f"{method} {url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
        return json.loads(raw) if raw.strip() else None


def _reason(raw: bytes) -> str:
    """The message in a vLLM error body: ``{"error": {"message": ...}}`` (its exception handlers),
    ``{"error": "..."}`` (``/pause``), ``{"detail": ...}`` (FastAPI), else the text itself."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:4000] or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return err if isinstance(err, str) else json.dumps(err)
    return text[:4000]


def attach_server(base_url: str, store: str | os.PathLike, prefix: str = "", *, assume_version: int | None = None,
                  status_dir: str | os.PathLike | Literal[False] | None = None, timeout: float = 600.0,
                  headers: dict[str, str] | None = None, **init_info: Any) -> dict[str, Any]:
    """:func:`attach_llm` for a vLLM HTTP server at ``base_url`` (e.g. ``http://127.0.0.1:8000``)
    started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend":
    "deltasync"}'``: ``POST /init_weight_transfer_engine {"init_info": ...}``.

    Readiness files help only a driver on the server's host: when none appear in ``status_dir``
    after init, updates do not wait for staging.

    Args:
        timeout: seconds per HTTP request.
        headers: extra request headers (e.g. for a proxy in front of the server).

    Raises:
        DeltaSyncError: the server refused (the message carries its reason) or cannot be reached.
    """
    server = _Server(base_url, timeout, headers)
    info, sdir, created = _init_info(store, prefix, assume_version, status_dir, init_info)
    try:
        server.call("POST", "/init_weight_transfer_engine", body={"init_info": info})
        att = _attachment(info, sdir, created)
    except BaseException:
        if created:
            shutil.rmtree(sdir, ignore_errors=True)
        raise
    old = _SERVERS.get(server.base)
    _SERVERS[server.base] = att
    if old is not None and old.status_dir != att.status_dir:
        old.discard()
    return info


def update_server(base_url: str, version: int | None = None, *, mode: PauseMode = "wait",
                  stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S, timeout: float = 600.0,
                  headers: dict[str, str] | None = None) -> EngineUpdate:
    """:func:`update_async_llm` over vLLM's RL routes only: ``POST /pause?mode=...&clear_cache=true``
    → ``POST /start_weight_update`` → ``POST /update_weights {"update_info": {"version": v}}`` →
    ``POST /finish_weight_update {"weight_version": "v"}`` → ``POST /resume`` (always), then
    ``GET /weight_info`` must report ``v``.

    ``version=None`` (the newest in the store) needs :func:`attach_server` in this process (it
    knows the store); otherwise pass the version.

    Raises:
        DeltaSyncError: the server refused a step (the message carries its reason: e.g.
            ``version 7 is not visible``), cannot be reached, or reports another version after.
        ValueError: an unknown ``mode`` (nothing is paused).
    """
    _check_mode(mode)
    server = _Server(base_url, timeout, headers)
    att = _SERVERS.get(server.base)
    t0 = time.perf_counter()
    if version is None:
        if att is None:
            raise DeltaSyncError(f"{server.base} was not attached by this process: pass version=, or call "
                                 "attach_server first")
        v = att.newest()
    else:
        v = _version(version)
    staged = att.wait(v, stage_timeout_s) if att is not None else None
    t1 = time.perf_counter()
    try:
        server.call("POST", "/pause", {"mode": mode, "clear_cache": "true"})
        server.call("POST", "/start_weight_update")
        server.call("POST", "/update_weights", body={"update_info": {"version": v}})
        server.call("POST", "/finish_weight_update", body={"weight_version": str(v)})
    except BaseException:
        try:
            server.call("POST", "/resume")
        except Exception as e:  # noqa: BLE001 (the update's error is the one to raise)
            log.error("POST /resume failed after a failed update: %s", e)
        raise
    server.call("POST", "/resume")
    t2 = time.perf_counter()
    served = (server.call("GET", "/weight_info") or {}).get("weight_version")
    if served != str(v):
        raise DeltaSyncError(f"{server.base}/weight_info reports {served!r} after committing version {v}")
    if att is not None:
        att.check_held(v)
    return EngineUpdate(version=v, staged=staged, wait_ms=(t1 - t0) * 1e3, stall_ms=(t2 - t1) * 1e3,
                        total_ms=(time.perf_counter() - t0) * 1e3, mode=mode)
