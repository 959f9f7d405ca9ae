"""The rollout service over HTTP: the FastAPI application and the ways to run it (a background
thread, the foreground). ``fastapi`` and ``uvicorn`` are imported when a service is built."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import EpisodeError, RolloutServiceError, ServiceClosedError
from ._buffer import BufferFull, EpisodeBuffer
from ._config import RolloutServiceConfig, is_number
from ._episodes import validate_episodes

log = logging.getLogger(__name__)


def create_app(config: RolloutServiceConfig, buffer: EpisodeBuffer | None = None):
    """The FastAPI application of a rollout service.

    Endpoints (JSON bodies; errors are ``{"error": code, "detail": message}``):

    ================  =======  ====================================================================
    path              auth     what
    ================  =======  ====================================================================
    POST /episodes    token    ``{"episodes": [...]}`` → 200 :class:`AddResult`; 422 invalid, 413 too
                               large, 429 + ``Retry-After`` full, 410 closed, 401 no/bad token
    POST /sample      token    ``{"batch_size", "trainer_version"?, "wait_s"?}`` → 200
                               ``{"episodes": [...] (empty if fewer were fresh after wait_s), "trainer_version"}``
    POST /version     token    ``{"version": v}`` → 200 ``{"trainer_version"}``
    POST /close       token    refuse further episodes (rollout workers stop on 410)
    GET /stats        open     :meth:`EpisodeBuffer.stats` plus request counters and the config
    GET /healthz      open     ``{"ok": true}``
    ================  =======  ====================================================================

    Args:
        config: the service config.
        buffer: the buffer to serve (a new one by default; pass one to inspect it in-process).
    """
    from fastapi import FastAPI, Request
    from starlette.requests import ClientDisconnect
    from fastapi.responses import JSONResponse

    buf = buffer or EpisodeBuffer(config)
    app = FastAPI(title="torch_deltasync rollout service", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.buffer = buf
    requests: Counter[str] = Counter()

    def error(status: int, code: str, detail: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
        requests[f"http_{status}"] += 1
        return JSONResponse({"error": code, "detail": detail, **extra}, status_code=status, headers=headers)

    def authorized(request: Request) -> bool:
        if config.token is None:
            return True
        got = request.headers.get("authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), config.token.encode())

    async def read_json(request: Request) -> Any:
        """The body as JSON, read with the size limit enforced while streaming (413 above it)."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
            raise _HTTPError(413, "too_large", f"body of {declared} bytes; at most {config.max_body_bytes}")
        chunks, n = [], 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                if n > config.max_body_bytes:
                    raise _HTTPError(413, "too_large", f"body over {config.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:  # the client went away mid-body: nobody reads the answer, nothing is wrong here
            raise _HTTPError(400, "disconnected", f"the client disconnected after {n} bytes of the body") from None
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise _HTTPError(422, "invalid_json", f"the body is not JSON we read: {type(e).__name__}: {e}") from None

    def guarded(handler):
        async def endpoint(request: Request):
            if not authorized(request):
                return error(401, "unauthorized", "missing or wrong 'Authorization: Bearer <token>'",
                             {"WWW-Authenticate": "Bearer"})
            try:
                out = await handler(request)
            except _HTTPError as e:
                return error(e.status, e.code, e.detail)
            except EpisodeError as e:
                return error(422, "invalid", str(e))
            except BufferFull as e:
                # Retry-After is whole seconds (RFC 9110); the body has the exact value for our client.
                return error(429, "full", str(e), {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))},
                             retry_after_s=e.retry_after_s)
            except ServiceClosedError as e:
                return error(410, "closed", str(e))
            except Exception as e:  # noqa: BLE001 - a bug: answered (and counted) as such, the service goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return error(500, "internal", f"{type(e).__name__}: {e}")
            requests["http_200"] += 1
            return out

        # FastAPI injects the request by annotation; with postponed annotations (this module's
        # ``from __future__ import annotations``) the string "Request" would not resolve here.
        endpoint.__annotations__ = {"request": Request}
        return endpoint

    async def post_episodes(request: Request):
        episodes = validate_episodes(await read_json(request), config)
        return buf.add(episodes).to_dict()

    async def post_sample(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not set(body) <= {"batch_size", "trainer_version", "wait_s"}:
            raise EpisodeError('body must be {"batch_size": int, "trainer_version"?: int, "wait_s"?: number}')
        wait_s = body.get("wait_s", 0.0)
        if not is_number(wait_s) or not 0 <= wait_s <= config.max_wait_s:
            raise EpisodeError(f"wait_s must be a number in [0, {config.max_wait_s}]")
        tv = body.get("trainer_version")
        deadline = time.monotonic() + wait_s
        while True:
            if await request.is_disconnected():  # (a trainer killed mid-wait) sampling now would lose the batch
                return {"episodes": [], "trainer_version": buf.trainer_version}
            got = buf.sample(body.get("batch_size"), tv)
            if got is not None or time.monotonic() >= deadline:
                return {"episodes": got or [], "trainer_version": buf.trainer_version}
            await asyncio.sleep(0.02)

    async def post_version(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or set(body) != {"version"}:
            raise EpisodeError('body must be {"version": int}')
        return {"trainer_version": buf.set_version(body["version"])}

    async def post_close(request: Request):
        buf.close()
        return {"closed": True}

    app.post("/episodes")(guarded(post_episodes))
    app.post("/sample")(guarded(post_sample))
    app.post("/version")(guarded(post_version))
    app.post("/close")(guarded(post_close))

    @app.get("/stats")
    async def stats():
        return {**buf.stats(), "requests": dict(requests), "config": config.public()}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    return app


class _HTTPError(Exception):
    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


@dataclass
class ServiceHandle:
    """A service running on a background thread (:func:`start_service`).

    Attributes:
        url: ``http://host:port``.
        buffer: the :class:`EpisodeBuffer` it serves (for in-process inspection).
    """

    url: str
    buffer: EpisodeBuffer
    _server: Any = field(repr=False, default=None)
    _thread: threading.Thread | None = field(repr=False, default=None)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down and join its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> "ServiceHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections queue from now on, before uvicorn's loop accepts them (--port-file)
    return sock


def _server(config: RolloutServiceConfig, log_level: str):
    import uvicorn

    app = create_app(config)
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off")), app


def read_token(token_file: str | os.PathLike | None = None) -> str | None:
    """The shared token for write endpoints: the stripped contents of ``token_file``, else
    ``$DELTASYNC_BUFFER_TOKEN`` (stripped too); ``None`` when neither is set (the service is then open).

    Raises:
        ValueError: ``token_file`` holds nothing but white space (a service meant to be closed
            would be open to anyone).
    """
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"token file {os.fspath(token_file)!r} is empty: write the shared token into it "
                             "(or leave --token-file out for a service open to writes)")
        return token
    return (os.environ.get("DELTASYNC_BUFFER_TOKEN") or "").strip() or None


def start_service(config: RolloutServiceConfig, *, host: str = "127.0.0.1", port: int = 0,
                  log_level: str = "warning", timeout_s: float = 30.0) -> ServiceHandle:
    """Run a rollout service on a background thread (uvicorn), e.g. inside the trainer process.

    Args:
        config: the service config.
        host: interface to bind (loopback by default).
        port: TCP port; ``0`` picks a free one (see ``ServiceHandle.url``).
        log_level: uvicorn's log level.
        timeout_s: how long to wait for the server to start.

    Raises:
        RolloutServiceError: it did not start within ``timeout_s``.
    """
    sock = _bind(host, port)
    server, app = _server(config, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rollout-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()  # (listening already: clients would connect and hang)
            raise RolloutServiceError(f"the rollout service did not start on {host}:{port}")
        time.sleep(0.01)
    bound = sock.getsockname()
    h = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return ServiceHandle(f"http://{h}:{bound[1]}", app.state.buffer, server, thread)


def serve(config: RolloutServiceConfig, *, host: str = "127.0.0.1", port: int = 8088, log_level: str = "info",
          port_file: str | None = None) -> None:
    """Run a rollout service in the foreground until interrupted (``deltasync serve-buffer``).

    Args:
        port_file: write the bound port there once listening (useful with ``port=0``).
    """
    sock = _bind(host, port)
    server, _ = _server(config, log_level)
    bound = sock.getsockname()[1]
    print(f"rollout service on http://{host}:{bound} ({'token required' if config.token else 'open'} for writes): "
          f"capacity {config.capacity}, max lag {config.max_lag}, on full: {config.on_full}", flush=True)
    if port_file:  # whole or absent for a reader polling for it
        tmp = f"{port_file}.tmp-{os.getpid()}"
        Path(tmp).write_text(str(bound))
        os.replace(tmp, port_file)
    server.run(sockets=[sock])
