"""HTTP rollout ingestion: a FastAPI service in front of a torchrl replay buffer.

Decoupled rollout fleets (serverless GPUs, other datacenters) post finished episodes over HTTP; the
trainer samples minibatches from the same service. Policy weights travel the other way, through
the object store (:mod:`torch_deltasync.lora` / :class:`~torch_deltasync.DeltaSender`)::

    rollout workers ──POST /episodes──▶ ┌───────────────────────────────┐ ◀──POST /sample── trainer
    (any number, anywhere)   429 + Retry-After when full │ EpisodeBuffer: torchrl ReplayBuffer │ ──POST /version──
                                        │  ListStorage(capacity), use-once │
    GET /stats, GET /healthz ─────────▶ │  sampler, staleness gate      │
                                        └───────────────────────────────┘

Start it with ``deltasync serve-buffer`` (or :func:`start_service` in a thread, :func:`create_app`
for your own ASGI server); talk to it with :class:`RolloutClient`.

**Episodes.** A JSON object: ``prompt`` (token ids, may be empty), ``completion`` (token ids, at
least one), ``logprobs`` (one float per completion token: the log-probability the rollout policy
gave it), ``reward`` (a finite number), ``policy_version`` (the adapter/weights version that
generated it), optional ``advantage`` (a finite number, e.g. GRPO's group-normalised reward),
``group`` (an id shared by completions of one prompt) and ``worker`` (who produced it). Unknown
keys, wrong types (``true`` is not a token, ``1.0`` is not an integer), tokens outside
``[0, vocab_size)``, lengths over the limits and non-finite numbers are rejected with HTTP 422 and a
message naming the episode and field; bodies over ``max_body_bytes`` with 413; nothing of a rejected
batch is stored. Log-probs are stored as float32 (the dtype they are computed in); rewards and
advantages as float64 (exactly as posted).

**Staleness.** The trainer tells the service its version (``POST /version``, or with each
``/sample``). An episode with ``trainer_version - policy_version > max_lag`` is never handed out:
it is dropped and counted (``dropped_stale``), whether it is already stale when posted (counted as
accepted, then dropped at once; the response says so, so the worker knows it lags), goes stale
while buffered, or would be sampled. Sampling returns the oldest ``policy_version`` first (then
arrival order), so episodes are trained on before they go stale whenever the trainer keeps up.

**Accounting (exact, checked on every /stats).** Every accepted episode is in exactly one state:
``accepted == sampled + dropped_stale + evicted + size`` (``unaccounted`` in ``/stats`` is the
difference and is always 0). Each episode is sampled at most once (torchrl ``ConsumingSampler``
semantics: a sampled slot is free for the next write). When the ring is full (after dropping what
is stale):

* ``on_full="reject"`` (default): the whole POST is refused with **429** and ``Retry-After``;
  nothing of it is accepted (``rejected_full`` counts those episodes) and nothing is overwritten,
  so ``evicted`` stays 0: no accepted episode is ever lost while the service runs;
* ``on_full="evict"``: the oldest buffered episodes are evicted (counted in ``evicted``) to make
  room, the ring semantics of a plain replay buffer: producers never wait.

**Auth.** With a token configured, ``POST /episodes``, ``/sample``, ``/version`` and ``/close``
need ``Authorization: Bearer <token>`` (401 otherwise, compared in constant time); ``GET /stats``
and ``/healthz`` stay open (they reveal counts only). Serve plain HTTP on loopback or a private
network, or put TLS in front.

``fastapi``, ``uvicorn`` and ``httpx`` are imported lazily (the ``service`` extra); the buffer
itself needs only torch, tensordict and torchrl.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

from ..errors import EpisodeError, RolloutServiceError, ServiceClosedError

__all__ = [
    "RolloutServiceConfig",
    "read_token",
    "EpisodeBuffer",
    "BufferFull",
    "AddResult",
    "validate_episodes",
    "collate_episodes",
    "create_app",
    "start_service",
    "ServiceHandle",
    "RolloutClient",
]

_INT32_LIMIT = 2**31
_EPISODE_KEYS = {"prompt", "completion", "logprobs", "reward", "policy_version", "advantage", "group", "worker"}
_REQUIRED_KEYS = ("prompt", "completion", "logprobs", "reward", "policy_version")
#: Log-probs may exceed 0 by this much (float rounding of log_softmax); anything larger is an error.
_LOGPROB_TOLERANCE = 1e-4


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RolloutServiceConfig:
    """Limits and policies of a rollout service. Every field is checked when the config is built."""

    capacity: int = 4096
    """Episodes the ring holds (live, not yet sampled)."""

    max_lag: int = 2
    """Staleness threshold in versions: ``trainer_version - policy_version > max_lag`` is dropped."""

    on_full: Literal["reject", "evict"] = "reject"
    """What a POST gets when the ring is full: ``"reject"`` = HTTP 429 + Retry-After (nothing lost),
    ``"evict"`` = the oldest buffered episodes are evicted (counted)."""

    max_episodes_per_post: int = 512
    """Episodes in one ``POST /episodes``."""

    max_prompt_tokens: int = 8192
    """Tokens in one episode's prompt."""

    max_completion_tokens: int = 8192
    """Tokens in one episode's completion (and log-probs)."""

    vocab_size: int | None = None
    """Token ids must be in ``[0, vocab_size)``; ``None``: in ``[0, 2**31)``."""

    max_body_bytes: int = 32 << 20
    """Largest request body in bytes (HTTP 413 above)."""

    max_sample: int = 4096
    """Largest ``batch_size`` of one ``/sample``."""

    max_wait_s: float = 30.0
    """Longest ``wait_s`` a ``/sample`` may ask for (seconds)."""

    retry_after_s: float = 1.0
    """How long a 429 asks producers to wait (seconds): the ``Retry-After`` header rounds it up to a
    whole second (RFC 9110); the JSON body's ``retry_after_s`` has the exact value."""

    token: str | None = None
    """Shared secret for the write endpoints (``Authorization: Bearer <token>``); ``None``: open."""

    def __post_init__(self) -> None:
        for name in ("capacity", "max_episodes_per_post", "max_prompt_tokens", "max_completion_tokens",
                     "max_body_bytes", "max_sample"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"RolloutServiceConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if type(self.max_lag) is not int or self.max_lag < 0:
            raise ValueError(f"RolloutServiceConfig.max_lag must be an integer >= 0, got {self.max_lag!r}")
        if self.on_full not in ("reject", "evict"):
            raise ValueError(f"RolloutServiceConfig.on_full must be 'reject' or 'evict', got {self.on_full!r}")
        if self.vocab_size is not None and (type(self.vocab_size) is not int or not 1 <= self.vocab_size <= _INT32_LIMIT):
            raise ValueError(f"RolloutServiceConfig.vocab_size must be in [1, 2**31] or None, got {self.vocab_size!r}")
        if not self.retry_after_s > 0 or not self.max_wait_s >= 0:
            raise ValueError("RolloutServiceConfig.retry_after_s must be > 0 and max_wait_s >= 0")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 8):
            raise ValueError("RolloutServiceConfig.token must be a string of at least 8 characters (or None)")

    def public(self) -> dict[str, Any]:
        """The config without the token (for ``/stats`` and logs)."""
        d = asdict(self)
        d["token"] = "<set>" if self.token else None
        return d


# --- validation ----------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass: excluded on purpose


def _is_number(x: Any) -> bool:
    return (type(x) is int or type(x) is float) and math.isfinite(x)


def _check_tokens(v: Any, where: str, lo_len: int, hi_len: int, vocab: int) -> list[int]:
    if not isinstance(v, list):
        raise EpisodeError(f"{where} must be a list of token ids, got {type(v).__name__}")
    if not lo_len <= len(v) <= hi_len:
        raise EpisodeError(f"{where} has {len(v)} tokens; allowed {lo_len} to {hi_len}")
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < vocab:
            raise EpisodeError(f"{where}[{i}] is {t!r}; token ids are integers in [0, {vocab})")
    return v


def validate_episodes(batch: Any, config: RolloutServiceConfig) -> list[dict[str, Any]]:
    """Validate an untrusted batch ``{"episodes": [episode, ...]}`` (parsed JSON).

    Args:
        batch: the parsed request body.
        config: the limits.

    Returns:
        The episodes (the same dicts), each checked.

    Raises:
        EpisodeError: the first rule broken, e.g. ``episodes[3].logprobs has 7 values for 8
            completion tokens``. See the module docstring for the schema.
    """
    if not isinstance(batch, dict) or set(batch) != {"episodes"}:
        raise EpisodeError('the body must be a JSON object {"episodes": [...]} and nothing else')
    eps = batch["episodes"]
    if not isinstance(eps, list) or not 1 <= len(eps) <= config.max_episodes_per_post:
        n = len(eps) if isinstance(eps, list) else type(eps).__name__
        raise EpisodeError(f"episodes must be a list of 1 to {config.max_episodes_per_post} episodes, got {n}")
    vocab = config.vocab_size or _INT32_LIMIT
    for i, ep in enumerate(eps):
        w = f"episodes[{i}]"
        if not isinstance(ep, dict):
            raise EpisodeError(f"{w} must be an object, got {type(ep).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in ep]
        if missing:
            raise EpisodeError(f"{w} lacks {missing}")
        unknown = sorted(set(ep) - _EPISODE_KEYS)
        if unknown:
            raise EpisodeError(f"{w} has unknown fields {unknown}; allowed: {sorted(_EPISODE_KEYS)}")
        _check_tokens(ep["prompt"], f"{w}.prompt", 0, config.max_prompt_tokens, vocab)
        comp = _check_tokens(ep["completion"], f"{w}.completion", 1, config.max_completion_tokens, vocab)
        lp = ep["logprobs"]
        if not isinstance(lp, list) or len(lp) != len(comp):
            n = len(lp) if isinstance(lp, list) else type(lp).__name__
            raise EpisodeError(f"{w}.logprobs has {n} values for {len(comp)} completion tokens; one per token")
        for j, x in enumerate(lp):
            if not _is_number(x) or x > _LOGPROB_TOLERANCE:
                raise EpisodeError(f"{w}.logprobs[{j}] is {x!r}; log-probabilities are finite numbers <= 0")
        if not _is_number(ep["reward"]):
            raise EpisodeError(f"{w}.reward is {ep['reward']!r}; a finite number")
        pv = ep["policy_version"]
        if not _is_int(pv) or not 0 <= pv < 10**12:
            raise EpisodeError(f"{w}.policy_version is {pv!r}; an integer in [0, 10**12)")
        if "advantage" in ep and not _is_number(ep["advantage"]):
            raise EpisodeError(f"{w}.advantage is {ep['advantage']!r}; a finite number")
        for k in ("group", "worker"):
            if k in ep and not ((_is_int(ep[k]) and abs(ep[k]) < 2**63) or (isinstance(ep[k], str) and len(ep[k]) <= 128)):
                raise EpisodeError(f"{w}.{k} must be an integer or a string of at most 128 characters")
    return eps


# --- the buffer ----------------------------------------------------------------------------------


class BufferFull(Exception):
    """No room for a batch (``on_full="reject"``). ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class AddResult:
    """What one accepted batch did.

    Attributes:
        accepted: episodes accepted (the whole batch).
        stored: of those, buffered for sampling.
        dropped_stale: of those, already stale on arrival (dropped and counted).
        evicted: buffered episodes evicted to make room (``on_full="evict"``).
        trainer_version: the service's trainer version when the batch arrived (``None``: not known yet).
    """

    accepted: int
    stored: int
    dropped_stale: int
    evicted: int
    trainer_version: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EpisodeBuffer:
    """The service's state: a torchrl ``ReplayBuffer`` of episodes with exact accounting.

    Storage is ``torchrl.data.ListStorage(capacity)`` holding one ``TensorDict`` per episode
    (``prompt`` int64 ``[P]``, ``completion`` int64 ``[T]``, ``logprobs`` float32 ``[T]``,
    ``reward`` / ``advantage`` float64 ``[]`` (JSON numbers, kept exactly), ``policy_version`` int64 ``[]``; ``group`` and
    ``worker`` as non-tensor data), ragged across episodes. Use-once, oldest-version-first sampling,
    stale drops and evictions are :class:`~torch_deltasync.integrations.replay.StalenessGatedSampler`
    (versions kept in a side tensor by slot, ties in arrival order). Thread-safe: every method holds
    one lock.

    Args:
        config: limits and policies (:class:`RolloutServiceConfig`).

    Example:
        >>> buf = EpisodeBuffer(RolloutServiceConfig(capacity=8, max_lag=1))
        >>> buf.add(validate_episodes({"episodes": [ep]}, buf.config))
        >>> buf.sample(1, trainer_version=0)          # [episode dict] or None
    """

    def __init__(self, config: RolloutServiceConfig) -> None:
        from torchrl.data import ListStorage, ReplayBuffer

        from .replay import StalenessGatedSampler

        self.config = config
        cap = config.capacity
        # Versions by storage slot: a ListStorage of ragged episodes cannot be read column-wise, so
        # the sampler reads them here (written right after each ReplayBuffer.extend).
        self._versions = torch.zeros(cap, dtype=torch.int64)
        # Oldest version first, then arrival order; the sampler's consumer_version is the trainer's.
        self.sampler = StalenessGatedSampler(config.max_lag, versions=self._versions, order="fifo", ties="arrival")
        self.rb = ReplayBuffer(storage=ListStorage(cap), sampler=self.sampler, collate_fn=lambda x: x)
        self._lock = threading.Lock()
        self.closed = False
        self.started = time.time()
        self.counts: Counter[str] = Counter()  # accepted, sampled, dropped_stale_on_arrival, ...
        self.lag_sampled: Counter[int] = Counter()
        self.workers: Counter[str] = Counter()

    @property
    def trainer_version(self) -> int | None:
        """The trainer's version (``None`` until told): the sampler's ``consumer_version``."""
        return self.sampler.consumer_version

    @trainer_version.setter
    def trainer_version(self, version: int | None) -> None:
        self.sampler.consumer_version = version

    # --- internals (lock held) -------------------------------------------------------------------

    def _live(self) -> torch.Tensor:
        return self.sampler.live_index(self.rb.storage)

    def _dropped_stale(self) -> int:
        """Stale drops: on arrival (never stored) plus those the sampler consumed."""
        return self.counts["dropped_stale_on_arrival"] + self.sampler.dropped_stale

    @staticmethod
    def _to_td(ep: dict[str, Any]):
        from tensordict import TensorDict

        td = TensorDict({
            "prompt": torch.tensor(ep["prompt"], dtype=torch.int64),
            "completion": torch.tensor(ep["completion"], dtype=torch.int64),
            "logprobs": torch.tensor(ep["logprobs"], dtype=torch.float32),
            "reward": torch.tensor(float(ep["reward"]), dtype=torch.float64),
            "advantage": torch.tensor(float(ep.get("advantage", math.nan)), dtype=torch.float64),
            "policy_version": torch.tensor(ep["policy_version"], dtype=torch.int64),
        }, batch_size=[])
        td.set_non_tensor("group", ep.get("group"))
        td.set_non_tensor("worker", ep.get("worker"))
        return td

    @staticmethod
    def _from_td(td, lag: int) -> dict[str, Any]:
        adv = float(td["advantage"])
        out = {
            "prompt": td["prompt"].tolist(), "completion": td["completion"].tolist(),
            "logprobs": td["logprobs"].tolist(), "reward": float(td["reward"]),
            "policy_version": int(td["policy_version"]), "lag": lag,
        }
        if not math.isnan(adv):
            out["advantage"] = adv
        for k in ("group", "worker"):
            v = td.get_non_tensor(k)
            if v is not None:
                out[k] = v
        return out

    # --- API -------------------------------------------------------------------------------------

    def add(self, episodes: Sequence[dict[str, Any]]) -> AddResult:
        """Accept a validated batch (:func:`validate_episodes`), all or nothing.

        Raises:
            BufferFull: ``on_full="reject"`` and fewer than ``len(episodes)`` free slots after
                dropping stale episodes (counted in ``rejected_full``; nothing accepted).
            ServiceClosedError: the service was closed.
        """
        with self._lock:
            if self.closed:
                self.counts["rejected_closed"] += len(episodes)
                raise ServiceClosedError("the rollout service is closed (the trainer finished)")
            versions = torch.tensor([ep["policy_version"] for ep in episodes], dtype=torch.int64)
            stale = self.sampler.stale_mask(versions)
            fresh = [ep for ep, s in zip(episodes, stale.tolist()) if not s]
            evicted = 0
            cap = self.config.capacity
            live = self._live()
            if live.numel() + len(fresh) > cap:
                self.sampler.drop_stale(self.rb.storage)
                live = self._live()
            if len(fresh) > cap:
                raise EpisodeError(f"a batch of {len(fresh)} fresh episodes can never fit a ring of {cap}; post fewer")
            if live.numel() + len(fresh) > cap:
                if self.config.on_full == "reject":
                    self.counts["rejected_full"] += len(episodes)
                    raise BufferFull(
                        f"the ring is full: {live.numel()} of {cap} episodes buffered and {len(fresh)} more "
                        f"posted; retry after {self.config.retry_after_s:g} s",
                        self.config.retry_after_s,
                    )
                victims = self.sampler.oldest(self.rb.storage, live.numel() + len(fresh) - cap)
                self.sampler.consume(victims)
                evicted = victims.numel()
                self.counts["evicted"] += evicted
            if fresh:
                n_live = self._live().numel()  # after any eviction above
                index = self.rb.extend([self._to_td(ep) for ep in fresh]).reshape(-1)
                # torchrl writes consumed slots first, then its cursor; both must be free here: then
                # every written slot is distinct and adds one live episode.
                assert index.unique().numel() == index.numel() and self._live().numel() == n_live + len(fresh), \
                    "overwrote a live episode"
                self._versions[index] = versions[~stale]
            n_stale = len(episodes) - len(fresh)
            self.counts["accepted"] += len(episodes)
            self.counts["stored"] += len(fresh)
            self.counts["dropped_stale_on_arrival"] += n_stale
            for ep in episodes:
                self.workers[str(ep.get("worker", "?"))] += 1
            return AddResult(len(episodes), len(fresh), n_stale, evicted, self.trainer_version)

    def set_version(self, version: int) -> int:
        """Record the trainer's version (never goes back) and drop what became stale; returns it."""
        if not _is_int(version) or version < 0:
            raise EpisodeError(f"trainer version must be an integer >= 0, got {version!r}")
        with self._lock:
            if self.trainer_version is None or version > self.trainer_version:
                self.trainer_version = version
            self.sampler.drop_stale(self.rb.storage)
            return self.trainer_version

    def sample(self, batch_size: int, trainer_version: int | None = None) -> list[dict[str, Any]] | None:
        """Hand out ``batch_size`` fresh episodes (each once), oldest policy version first.

        Args:
            batch_size: episodes wanted.
            trainer_version: the trainer's version (recorded as by :meth:`set_version`).

        Returns:
            ``batch_size`` episode dicts (the posted fields plus ``lag`` = trainer version minus
            ``policy_version``, always ``<= max_lag``), or ``None`` while fewer are fresh (nothing
            is consumed then).
        """
        if not _is_int(batch_size) or not 1 <= batch_size <= self.config.max_sample:
            raise EpisodeError(f"batch_size must be an integer in [1, {self.config.max_sample}], got {batch_size!r}")
        if trainer_version is not None:
            self.set_version(trainer_version)
        with self._lock:
            self.sampler.drop_stale(self.rb.storage)
            if self._live().numel() < batch_size:
                return None
            tds = self.rb.sample(batch_size)
            tv = self.trainer_version
            out = []
            for td in tds:
                lag = 0 if tv is None else tv - int(td["policy_version"])
                assert lag <= self.config.max_lag, "the staleness gate let a stale episode through"
                self.lag_sampled[lag] += 1
                out.append(self._from_td(td, lag))
            self.counts["sampled"] += len(out)
            return out

    def close(self) -> None:
        """Refuse further episodes (HTTP 410); buffered ones can still be sampled."""
        with self._lock:
            self.closed = True

    def stats(self) -> dict[str, Any]:
        """Counts, state and the accounting check (``unaccounted`` is always 0)."""
        with self._lock:
            size = int(self._live().numel())
            c = self.counts
            return {
                "accepted": c["accepted"], "stored": c["stored"], "sampled": c["sampled"],
                "dropped_stale": self._dropped_stale(), "dropped_stale_on_arrival": c["dropped_stale_on_arrival"],
                "evicted": c["evicted"], "size": size, "capacity": self.config.capacity,
                "unaccounted": c["accepted"] - (c["sampled"] + self._dropped_stale() + c["evicted"] + size),
                "rejected_full": c["rejected_full"], "rejected_closed": c["rejected_closed"],
                "trainer_version": self.trainer_version, "max_lag": self.config.max_lag,
                "on_full": self.config.on_full, "closed": self.closed,
                "lag_sampled": {str(k): v for k, v in sorted(self.lag_sampled.items())},
                "workers": dict(self.workers), "uptime_s": time.time() - self.started,
            }


# --- HTTP ----------------------------------------------------------------------------------------


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
        async for chunk in request.stream():
            n += len(chunk)
            if n > config.max_body_bytes:
                raise _HTTPError(413, "too_large", f"body over {config.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as e:
            raise _HTTPError(422, "invalid_json", f"the body is not JSON: {e}") from None

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
        if not _is_number(wait_s) or not 0 <= wait_s <= config.max_wait_s:
            raise EpisodeError(f"wait_s must be a number in [0, {config.max_wait_s}]")
        tv = body.get("trainer_version")
        deadline = time.monotonic() + wait_s
        while True:
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
    return sock


def _server(config: RolloutServiceConfig, log_level: str):
    import uvicorn

    app = create_app(config)
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off")), app


def read_token(token_file: str | os.PathLike | None = None) -> str | None:
    """The shared token for write endpoints: the stripped contents of ``token_file``, else
    ``$DELTASYNC_BUFFER_TOKEN``; ``None`` when neither is set (the service is then open)."""
    token = Path(token_file).read_text().strip() if token_file else os.environ.get("DELTASYNC_BUFFER_TOKEN")
    return token or None


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
    if port_file:
        with open(port_file, "w") as f:
            f.write(str(bound))
    server.run(sockets=[sock])


# --- client --------------------------------------------------------------------------------------


class RolloutClient:
    """Talks to a rollout service (rollout workers post, the trainer samples).

    Args:
        url: the service's root URL.
        token: the shared token (``None`` for an open service).
        timeout_s: seconds per HTTP request.

    Example:
        >>> client = RolloutClient("http://10.0.0.5:8088", token=os.environ["BUFFER_TOKEN"])
        >>> client.post_episodes([{"prompt": [1, 2], "completion": [3], "logprobs": [-0.1],
        ...                        "reward": 1.0, "policy_version": 4}])
        >>> batch = client.sample(64, trainer_version=5, wait_s=10)   # None while too few are fresh
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def _post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        import httpx

        try:
            r = self._http.post(path, json=body, **({"timeout": timeout} if timeout else {}))
        except httpx.HTTPError as e:
            raise RolloutServiceError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        return r

    @staticmethod
    def _fail(r) -> None:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        cls = ServiceClosedError if r.status_code == 410 else RolloutServiceError
        raise cls(f"{r.request.method} {r.request.url.path} -> HTTP {r.status_code}: {detail}")

    def post_episodes(self, episodes: list[dict[str, Any]], *, max_wait_s: float = 600.0) -> dict[str, Any]:
        """Post a batch; on 429 wait ``Retry-After`` and post it again, up to ``max_wait_s`` seconds.

        Returns:
            :class:`AddResult` as a dict (``accepted``, ``stored``, ``dropped_stale``, ...).

        Raises:
            ServiceClosedError: the trainer closed the service (stop producing).
            RolloutServiceError: refused (invalid: the message says why), unreachable, or still
                full after ``max_wait_s``.
        """
        deadline = time.monotonic() + max_wait_s
        while True:
            r = self._post("/episodes", {"episodes": episodes})
            if r.status_code == 200:
                return r.json()
            if r.status_code == 429:
                try:
                    wait = float(r.json()["retry_after_s"])
                except (ValueError, KeyError, TypeError):
                    wait = float(r.headers.get("retry-after", "1"))
                wait = min(max(wait, 0.0), 60.0)
                if time.monotonic() + wait <= deadline:
                    time.sleep(wait)
                    continue
            self._fail(r)

    def sample(self, batch_size: int, *, trainer_version: int | None = None, wait_s: float = 0.0) -> list[dict] | None:
        """``batch_size`` fresh episodes (oldest policy first, each handed out once), or ``None`` if
        fewer were fresh within ``wait_s`` seconds. Each has ``lag`` (versions behind the trainer)."""
        body: dict[str, Any] = {"batch_size": batch_size, "wait_s": wait_s}
        if trainer_version is not None:
            body["trainer_version"] = trainer_version
        r = self._post("/sample", body, timeout=wait_s + 60.0)
        if r.status_code != 200:
            self._fail(r)
        eps = r.json()["episodes"]
        return eps or None

    def set_version(self, version: int) -> int:
        """Tell the service the trainer's version (episodes more than ``max_lag`` behind are dropped)."""
        r = self._post("/version", {"version": version})
        if r.status_code != 200:
            self._fail(r)
        return r.json()["trainer_version"]

    def close_service(self) -> None:
        """Refuse further episodes (workers get :class:`ServiceClosedError`)."""
        r = self._post("/close", {})
        if r.status_code != 200:
            self._fail(r)

    def stats(self) -> dict[str, Any]:
        """``GET /stats``."""
        import httpx

        try:
            r = self._http.get("/stats")
        except httpx.HTTPError as e:
            raise RolloutServiceError(f"{self.url}/stats: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            self._fail(r)
        return r.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def collate_episodes(episodes: Sequence[dict[str, Any]], *, pad_id: int = 0):
    """Pad a list of sampled episodes into one ``TensorDict`` of batch size ``[N]``.

    Returns:
        ``TensorDict`` with ``input_ids`` int64 ``[N, L]`` (prompt then completion, right-padded
        with ``pad_id``), ``attention_mask`` bool ``[N, L]``, ``completion_mask`` bool ``[N, L]``
        (true on completion tokens), ``logprobs`` float32 ``[N, L]`` (the rollout log-prob at each
        completion token's position, 0 elsewhere), ``reward``, ``advantage`` (NaN where none was
        posted) float32 ``[N]``, ``policy_version`` and ``lag`` int64 ``[N]``. ``L`` is the longest
        prompt + completion.
    """
    from tensordict import TensorDict

    n = len(episodes)
    length = max(len(e["prompt"]) + len(e["completion"]) for e in episodes)
    ids = torch.full((n, length), pad_id, dtype=torch.int64)
    attn = torch.zeros((n, length), dtype=torch.bool)
    cmask = torch.zeros((n, length), dtype=torch.bool)
    lps = torch.zeros((n, length), dtype=torch.float32)
    for i, e in enumerate(episodes):
        p, c = len(e["prompt"]), len(e["completion"])
        ids[i, :p + c] = torch.tensor(e["prompt"] + e["completion"], dtype=torch.int64)
        attn[i, :p + c] = True
        cmask[i, p:p + c] = True
        lps[i, p:p + c] = torch.tensor(e["logprobs"], dtype=torch.float32)
    f = lambda k, d=math.nan: torch.tensor([float(e.get(k, d)) for e in episodes], dtype=torch.float32)  # noqa: E731
    return TensorDict({
        "input_ids": ids, "attention_mask": attn, "completion_mask": cmask, "logprobs": lps,
        "reward": f("reward"), "advantage": f("advantage"),
        "policy_version": torch.tensor([e["policy_version"] for e in episodes], dtype=torch.int64),
        "lag": torch.tensor([e.get("lag", 0) for e in episodes], dtype=torch.int64),
    }, batch_size=[n])
