"""vLLM integration, client side: thin helpers over vLLM's weight-transfer API with the ``deltasync``
backend (:mod:`._backend`), for an offline ``LLM``, an ``AsyncLLM`` and the OpenAI-compatible HTTP
server.

Every helper drives the same calls vLLM's own RL examples use; nothing of ours runs through
``collective_rpc``::

    trainer ─DeltaSender.publish()─▶ store ◀─ every vLLM worker stages the newest version in the
                                               background (download, decode, validate, checksums)
    driver:  [wait_staged: readiness files say every worker staged v]       engine keeps serving
             start_weight_update ─ pause ─ update_weights({"version": v}) ─ finish_weight_update(str(v)) ─ resume
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

The attach and update protocols are written once (:func:`_attach_steps`, :func:`_update_steps`) and
run against each engine kind's calls by :mod:`._steps`' drivers.
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
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ...errors import DeltaSyncError
from ...keys import MAX_VERSION
from ._init_info import check_init_info
from ._readiness import DEFAULT_STAGE_TIMEOUT_S, Attachment, read_readiness
from ._steps import Steps, drive, drive_async

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "keep", "abort"]
_MODES = ("wait", "keep", "abort")


@dataclass
class EngineUpdate:
    """What one update of an engine did (times in milliseconds, wall clock on the driver).

    Attributes:
        version: the version the engine now serves (its ``weight_version`` is ``str(version)``).
        staged: every worker had staged ``version`` before the pause (so the pause covered only the
            commit); ``False``: some prepared it inside the pause (the wait timed out or a worker
            reported a staging error); ``None``: no readiness files (workers on another host, or
            ``status_dir=False``).
        wait_ms: waiting for the workers to stage ``version`` and checking that the engine is not paused
            already (the engine serves meanwhile).
        stall_ms: pause → resume, i.e. how long the engine did not generate (``AsyncLLM``, server);
            for an offline ``LLM``, which has no pause, ``start_weight_update`` → prefix-cache reset.
        total_ms: the whole call (version lookup, wait, stall, checks).
        mode: the pause mode (``None`` for an offline ``LLM``).
        steps_ms: the stall by step, in order: ``pause`` (until the engine stopped scheduling:
            vLLM finishes the step it is in, then sleeps 20 ms), ``update`` (the commit on every
            worker), ``finish``, ``resume``; for an offline ``LLM`` ``start``, ``update``,
            ``finish``, ``reset_cache``. (With a pause, ``start_weight_update`` comes first, while
            the engine still generates, and counts in ``wait_ms``.)
    """

    version: int
    staged: bool | None = None
    wait_ms: float = 0.0
    stall_ms: float = 0.0
    total_ms: float = 0.0
    mode: str | None = None
    steps_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_ENGINES: "weakref.WeakKeyDictionary[Any, Attachment]" = weakref.WeakKeyDictionary()
_SERVERS: dict[str, Attachment] = {}


def _init_info(store: str | os.PathLike, prefix: str, assume_version: int | None, status_dir: Any,
               extra: dict[str, Any]) -> tuple[dict[str, Any], str | None, bool]:
    """The backend's ``init_info``, the readiness directory and whether this call created it."""
    if not isinstance(store, (str, os.PathLike)) or not str(store):
        raise TypeError(f"store must be the store URI or path the workers open (a string), got {store!r}")
    if status_dir is not None and status_dir is not False and not isinstance(status_dir, (str, os.PathLike)):
        raise TypeError(f"status_dir must be a path, None (a new temporary directory) or False (no readiness "
                        f"files), got {status_dir!r}")
    info: dict[str, Any] = {"store": store, "prefix": prefix, **extra}
    if assume_version is not None:
        info["assume_version"] = assume_version  # as given: a non-int is refused, not rounded
    if status_dir is not None and status_dir is not False:
        info["status_dir"] = status_dir
    # Checked here as the workers will check it: a misspelt option or a bad value names itself in
    # the caller, before any engine call (and before a readiness directory is made).
    info = check_init_info(info, "attach")
    created = False
    if status_dir is None:
        info["status_dir"], created = tempfile.mkdtemp(prefix="deltasync-ready-"), True
    return info, info.get("status_dir"), created


def _attachment(info: dict[str, Any], status_dir: str | None, created: bool) -> Attachment:
    """Count the readiness files the workers wrote during init (none: they run on another host)."""
    workers = len(read_readiness(status_dir)) if status_dir is not None else 0
    if status_dir is not None and workers == 0:
        log.info("no readiness files in %s after init (workers on another host?): updates will not wait "
                 "for staging", status_dir)
        if created:
            shutil.rmtree(status_dir, ignore_errors=True)
        status_dir = None
    return Attachment(info["store"], info["prefix"], status_dir, workers, owned=created)


def _remember(engine: Any, att: Attachment) -> None:
    old = _ENGINES.get(engine)
    _ENGINES[engine] = att
    if old is not None and old.status_dir != att.status_dir:
        old.discard()


def _attached(engine: Any, what: str) -> Attachment:
    try:
        return _ENGINES[engine]
    except (KeyError, TypeError):
        raise DeltaSyncError(f"this {type(engine).__name__} is not attached to a run: call {what} first") from None


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


def _version(version: Any) -> int:
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be a published version (int in 0 ... {MAX_VERSION}) or None, got {version!r}")
    return version



# --- the protocols (one per operation, for every engine kind) ---------------------------------------


def _attach_steps(store: str | os.PathLike, prefix: str, assume_version: int | None, status_dir: Any,
                  extra: dict[str, Any]) -> Steps:
    """Attach: ``("init", init_info)`` on the engine, then count the readiness files. Returns
    ``(init_info, Attachment)``; a temporary readiness directory is removed if the init fails."""
    info, sdir, created = _init_info(store, prefix, assume_version, status_dir, extra)
    try:
        yield ("init", info)
        att = _attachment(info, sdir, created)
    except BaseException:
        if created:
            shutil.rmtree(sdir, ignore_errors=True)
        raise
    return info, att


#: What to do about an engine a driver left paused or mid-update (it died).
_STUCK = ("If no other driver is updating the engine, end the dead driver's update with POST /finish_weight_update "
          "(finish_weight_update()) if it started one, resume the engine with POST /resume (resume_generation()), "
          "then update again")


def _update_steps(version: int | None, stage_timeout_s: float | None, *, pause: bool, mode: str | None) -> Steps:
    """Update: pick the version (``("newest",)`` when ``None``), ``("wait", v, timeout)`` until staged,
    then ``is_paused`` (refused if so) → ``start`` → ``is_paused`` again (refused, ``end``, if so) →
    ``pause`` → ``update`` → ``finish`` → ``resume``
    (``resume`` also after a failed step; ``end``, a finish without a version, after a failed
    pause), or without a pause ``start`` → ``update`` → ``finish`` → ``reset_cache``; then
    ``("check", v)``. Returns the :class:`EngineUpdate`.

    ``start`` comes before the pause: vLLM's update session admits one driver at a time, so a
    driver that loses it to another has paused nothing and resumes nothing (resuming would let the
    other driver's commit land on a generating engine). Our backend's ``start_weight_update`` does
    nothing on the workers, so the engine generates on meanwhile."""
    t0 = time.perf_counter()
    v = (yield ("newest",)) if version is None else _version(version)
    staged = yield ("wait", v, stage_timeout_s)
    if pause and (yield ("is_paused",)):  # resuming a pause this driver did not make would end another's
        raise DeltaSyncError(
            "the engine is paused already (another driver is updating it, or whoever paused it has not resumed "
            f"it): nothing was changed. Update once it resumes; only one driver should update an engine. {_STUCK}")
    steps_ms: dict[str, float] = {}
    ts = time.perf_counter()
    try:
        yield ("start",)
    except Exception as e:
        # vLLM: "start_weight_update called while a weight update is already active"
        active = "already active" in str(e)
        raise DeltaSyncError(
            f"start_weight_update failed: {str(e).rstrip('.')}; nothing was changed."
            + (" Another driver's update is under way, or a driver died mid-update. " + _STUCK if active else "")) from e
    if pause and (yield ("is_paused",)):
        # Paused between the check and our start: a driver that finished its update but has not
        # resumed yet (its resume would land in the middle of ours), or someone else's pause.
        yield ("end",)
        raise DeltaSyncError("the engine was paused by someone else while this driver started its update: nothing "
                             f"was changed (the update session is ended again). Update once it resumes. {_STUCK}")
    if not pause:
        steps_ms["start"] = (time.perf_counter() - ts) * 1e3  # an offline LLM's "stall" is its whole commit
    t1 = ts if not pause else time.perf_counter()  # with a pause, the stall starts at the pause
    steps = ([("pause", mode)] if pause else []) + [("update", v), ("finish", v)]
    step = steps[0]
    try:
        for step in steps:
            ts = time.perf_counter()
            yield step
            steps_ms[step[0]] = (time.perf_counter() - ts) * 1e3
    except BaseException:
        cleanup = ([("end",)] if step[0] == "pause" else []) + ([("resume",)] if pause else [])
        for last in cleanup:  # a failed update ends the session on vLLM's side; a failed pause does not
            try:
                yield last
            except Exception as e:  # noqa: BLE001 (the update's error is the one to raise)
                log.error("%s after a failed update failed: %s", last[0], e)
        raise
    ts = time.perf_counter()
    last = ("resume",) if pause else ("reset_cache",)
    yield last
    t2 = time.perf_counter()
    steps_ms[last[0]] = (t2 - ts) * 1e3
    yield ("check", v)
    return EngineUpdate(version=v, staged=staged, wait_ms=(t1 - t0) * 1e3, stall_ms=(t2 - t1) * 1e3,
                        total_ms=(time.perf_counter() - t0) * 1e3, mode=mode, steps_ms=steps_ms)


def _readiness_ops(att: Attachment | None) -> dict[str, Any]:
    """The steps every engine kind takes from the driver's side (store listing, readiness files)."""
    return {"newest": att.newest, "wait": att.wait, "check": att.check_held}


def _threaded(ops: dict[str, Any]) -> dict[str, Any]:
    """Blocking steps as coroutines run on a worker thread (for an ``async`` driver)."""
    return {name: (lambda fn: lambda *a: asyncio.to_thread(fn, *a))(fn) for name, fn in ops.items()}


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
            ``max_workers``, ``threads``, ``metrics_path``;
            :class:`~torch_deltasync.integrations.vllm.DeltaSyncInitInfo`).

    Returns:
        The ``init_info`` sent.

    Raises:
        TypeError: an ``init_info`` option the backend does not take (the valid names are listed;
            checked here, before any engine call).
        ValueError: a bad option value, naming it (checked here as the workers check it).
        whatever the workers raise (a path they cannot write, a store or version that does not
        fit: a :class:`~torch_deltasync.DeltaSyncError`); nothing is installed then.
    """
    _check_engine(llm, "attach_llm", "a vllm.LLM")
    info, att = drive(_attach_steps(store, prefix, assume_version, status_dir, init_info),
                      {"init": lambda info: llm.init_weight_transfer_engine({"init_info": info})})
    _remember(llm, att)
    return info


def _check_engine(engine: Any, where: str, kind: str) -> None:
    """Refuse an ``engine`` without vLLM's weight-transfer API before anything is sent.

    Raises:
        TypeError: naming what was passed and what is expected.
    """
    if not callable(getattr(engine, "init_weight_transfer_engine", None)):
        raise TypeError(f"{where}: expected {kind} (an engine with vLLM's weight-transfer API, "
                        f"init_weight_transfer_engine), got {type(engine).__name__}")


def update_llm(llm: Any, version: int | None = None, *,
               stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S) -> EngineUpdate:
    """Commit ``version`` (the newest published when ``None``) on an attached offline ``vllm.LLM``.

    Steps: wait until every worker staged it (:func:`wait_staged`) → ``start_weight_update()`` →
    ``update_weights({"update_info": {"version": v}})`` → ``finish_weight_update(weight_version=str(v))``
    → ``reset_prefix_cache(reset_running_requests=True)`` (no KV computed with the old weights is
    reused). An offline ``LLM`` generates only inside ``generate()``, so there is nothing to pause.

    Raises:
        VersionNotFoundError, CorruptObjectError, ChecksumMismatchError, StoreError, ...: from the
            workers (vLLM passes on their message only; the type is taken from it, the original
            exception is the ``__cause__``); the engine keeps serving the version it had.
        DeltaSyncError: not attached, or a worker reports another version after the commit (also
            the type when TP workers fail with different errors).
    """
    att = _attached(llm, "attach_llm")
    return drive(_update_steps(version, stage_timeout_s, pause=False, mode=None), {
        **_readiness_ops(att),
        "start": llm.start_weight_update,
        "update": lambda v: llm.update_weights({"update_info": {"version": v}}),
        "finish": lambda v: llm.finish_weight_update(weight_version=str(v)),
        "reset_cache": lambda: llm.reset_prefix_cache(reset_running_requests=True),
    })


# --- AsyncLLM ---------------------------------------------------------------------------------------


async def attach_async_llm(engine: Any, store: str | os.PathLike, prefix: str = "", *,
                           assume_version: int | None = None,
                           status_dir: str | os.PathLike | Literal[False] | None = None,
                           **init_info: Any) -> dict[str, Any]:
    """:func:`attach_llm` for a ``vllm.v1.engine.async_llm.AsyncLLM`` (or any ``EngineClient``):
    ``await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=...))``."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    _check_engine(engine, "attach_async_llm", "a vllm AsyncLLM")
    info, att = await drive_async(
        _attach_steps(store, prefix, assume_version, status_dir, init_info),
        {"init": lambda info: engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))})
    _remember(engine, att)
    return info


async def update_async_llm(engine: Any, version: int | None = None, *, mode: PauseMode = "wait",
                           stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S) -> EngineUpdate:
    """Commit ``version`` (the newest published when ``None``) on an attached ``AsyncLLM``.

    Steps: wait until every worker staged it (the engine keeps generating) → ``is_paused()`` (an
    engine paused already is refused) → ``start_weight_update()`` (vLLM's update session: one
    driver at a time; the engine still generates) → ``is_paused()`` again (paused meanwhile: the
    session is ended and the update refused) → ``pause_generation(mode=mode, clear_cache=True)``
    → ``update_weights(...{"version": v})`` → ``finish_weight_update(weight_version=str(v))`` →
    ``resume_generation()`` (always once paused, also when a step fails).

    ``mode``: ``"wait"`` drains in-flight requests first (each completion comes from one version);
    ``"keep"`` freezes them, and ``clear_cache=True`` preempts them so that they recompute their KV
    under the new weights and continue there; ``"abort"`` drops them.

    Raises:
        ValueError: an unknown ``mode`` (nothing is paused).
        DeltaSyncError: the engine is paused already (another driver's update, or a pause this
            driver did not make: nothing is changed, and it is not resumed).
        the workers' errors, as :func:`update_llm`; the engine resumes on the version it had.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    _check_mode(mode)
    att = _attached(engine, "attach_async_llm")
    return await drive_async(_update_steps(version, stage_timeout_s, pause=True, mode=mode), {
        **_threaded(_readiness_ops(att)),
        "is_paused": engine.is_paused,
        "end": engine.finish_weight_update,
        "pause": lambda m: engine.pause_generation(mode=m, clear_cache=True),
        "start": engine.start_weight_update,
        "update": lambda v: engine.update_weights(WeightTransferUpdateRequest(update_info={"version": v})),
        "finish": lambda v: engine.finish_weight_update(weight_version=str(v)),
        "resume": engine.resume_generation,
    })


# --- HTTP server ------------------------------------------------------------------------------------


class _Server:
    """vLLM's RL routes on one server (``vllm/entrypoints/rl/online/api_router.py``)."""

    def __init__(self, base_url: str, timeout: float, headers: dict[str, str] | None) -> None:
        url = urllib.parse.urlsplit(base_url) if isinstance(base_url, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"base_url must be the server's http(s) URL, e.g. http://127.0.0.1:8000, got {base_url!r}")
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
        TypeError, ValueError: an unknown option or a bad value, as :func:`attach_llm` (nothing is sent).
        DeltaSyncError: the server refused (the message carries its reason) or cannot be reached.
    """
    server = _Server(base_url, timeout, headers)
    info, att = drive(_attach_steps(store, prefix, assume_version, status_dir, init_info),
                      {"init": lambda info: server.call("POST", "/init_weight_transfer_engine", body={"init_info": info})})
    old = _SERVERS.get(server.base)
    _SERVERS[server.base] = att
    if old is not None and old.status_dir != att.status_dir:
        old.discard()
    return info


def update_server(base_url: str, version: int | None = None, *, mode: PauseMode = "wait",
                  stage_timeout_s: float | None = DEFAULT_STAGE_TIMEOUT_S, timeout: float = 600.0,
                  headers: dict[str, str] | None = None) -> EngineUpdate:
    """:func:`update_async_llm` over vLLM's RL routes only: ``GET /is_paused`` → ``POST
    /start_weight_update`` → ``POST /pause?mode=...&clear_cache=true`` → ``POST /update_weights {"update_info": {"version": v}}`` →
    ``POST /finish_weight_update {"weight_version": "v"}`` → ``POST /resume`` (always), then
    ``GET /weight_info`` must report ``v``.

    ``version=None`` (the newest in the store) needs :func:`attach_server` in this process (it
    knows the store); otherwise pass the version.

    Raises:
        DeltaSyncError: the server refused a step (the message carries its reason: e.g.
            ``version 7 is not visible``; the error is of the type the reason names, e.g.
            ``VersionNotFoundError``), cannot be reached, reports another version after, or is
            paused already (``GET /is_paused``: another driver's update; nothing is changed).
        ValueError: an unknown ``mode`` (nothing is paused).
    """
    _check_mode(mode)
    server = _Server(base_url, timeout, headers)
    att = _SERVERS.get(server.base)
    if version is None and att is None:
        raise DeltaSyncError(f"{server.base} was not attached by this process: pass version=, or call "
                             "attach_server first")

    def check(v: int) -> None:
        served = (server.call("GET", "/weight_info") or {}).get("weight_version")
        if served != str(v):
            raise DeltaSyncError(f"{server.base}/weight_info reports {served!r} after committing version {v}")
        if att is not None:
            att.check_held(v)

    return drive(_update_steps(version, stage_timeout_s, pause=True, mode=mode), {
        **(_readiness_ops(att) if att is not None else {"wait": lambda v, t: None}),
        "check": check,
        "is_paused": lambda: bool((server.call("GET", "/is_paused") or {}).get("is_paused")),
        "end": lambda: server.call("POST", "/finish_weight_update", body={}),
        "pause": lambda m: server.call("POST", "/pause", {"mode": m, "clear_cache": "true"}),
        "start": lambda: server.call("POST", "/start_weight_update"),
        "update": lambda v: server.call("POST", "/update_weights", body={"update_info": {"version": v}}),
        "finish": lambda v: server.call("POST", "/finish_weight_update", body={"weight_version": str(v)}),
        "resume": lambda: server.call("POST", "/resume"),
    })
