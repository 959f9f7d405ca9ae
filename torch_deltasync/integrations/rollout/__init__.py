"""HTTP rollout ingestion: a FastAPI service in front of a torchrl replay buffer.

Decoupled rollout fleets (serverless GPUs, other datacenters) post finished episodes over HTTP; the
trainer samples minibatches from the same service. Policy weights travel the other way, through
the object store (:mod:`torch_deltasync.integrations.peft` / :class:`~torch_deltasync.DeltaSender`)::

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

Modules (private; the public names are re-exported here): ``_config`` (limits and policies),
``_episodes`` (validation, collation), ``_buffer`` (the replay buffer and its accounting), ``_app``
(the FastAPI app, running it), ``_client`` (the HTTP client).
"""

from ._app import ServiceHandle, create_app, read_token, serve, start_service
from ._buffer import AddResult, BufferFull, EpisodeBuffer
from ._config import RolloutServiceConfig
from ._episodes import collate_episodes, validate_episodes
from ._client import RolloutClient

__all__ = [
    # configuration
    "RolloutServiceConfig",
    "read_token",
    # episodes and the buffer
    "validate_episodes",
    "collate_episodes",
    "EpisodeBuffer",
    "BufferFull",
    "AddResult",
    # HTTP
    "create_app",
    "start_service",
    "serve",
    "ServiceHandle",
    "RolloutClient",
]

for _obj in (ServiceHandle, create_app, read_token, serve, start_service, AddResult, BufferFull, EpisodeBuffer,
             RolloutServiceConfig, collate_episodes, validate_episodes, RolloutClient):
    _obj.__module__ = __name__
del _obj
