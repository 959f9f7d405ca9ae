"""In-flight weight sync with exact per-token versions: rollouts generated in chunks of ``chunk``
tokens, versions committed between chunks.

Why chunks: an engine that changes weights while a request runs cannot say, over HTTP, how many of
that request's tokens it had produced when the commit happened (the stream lags the engine). So the
generator never commits while a request is in the engine: every rollout is submitted in pieces of
at most ``chunk`` tokens (its prompt plus the tokens it has so far), and between two rounds of pieces
the generator commits the newest version its engine has staged in the background. Every token of a
piece therefore comes from the version held when the piece was submitted; that is the token's
version, exact by construction. A rollout that spans a commit continues on the new weights from its
prefix (its KV is recomputed: the commit pauses the engine with ``clear_cache=true``, so no KV
computed under older weights is reused).

Interrupt modes (``--interrupt``):

* ``keep``: commit between rounds; partial rollouts continue on the new weights (mixed versions,
  each token tagged).
* ``abort``: commit between rounds; partial rollouts are dropped and restarted from their prompt
  on the new weights (every rollout from one version; the dropped tokens are counted).

Both also commit before the first round, so a batch starts on the newest staged version.
* ``drain``: no commit inside a batch; the batch finishes on the version it started with (the
  controller updates the engine between batches).

The engine is anything with :class:`ChunkEngine`'s three members, so the attribution is tested with a
scripted engine (``tests/test_grpo_inflight.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

__all__ = ["ChunkEngine", "ChunkedRollouts", "generate_chunked", "tokens_by_lag", "INTERRUPT_MODES"]

INTERRUPT_MODES = ("keep", "drain", "abort")


class ChunkEngine(Protocol):
    """What :func:`generate_chunked` needs from an engine."""

    @property
    def version(self) -> int | None:
        """The version the engine serves now."""

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        """Sample up to ``max_tokens`` tokens after each token-id prompt: ``[{"tokens": [int],
        "logprobs": [float], "finish_reason": "length" | "stop" | ...}]`` in prompt order."""

    def sync(self) -> dict[str, Any] | None:
        """Commit the newest version the engine has staged, if it is newer than the one served;
        return the update's stats (at least ``version`` and ``stall_ms``), or ``None`` when there is
        nothing to commit. Must not wait for staging."""


@dataclass
class ChunkedRollouts:
    """The result of :func:`generate_chunked` for ``N`` rollouts of at most ``T`` tokens.

    Attributes:
        ids: ``[N, T]`` int64 response tokens, ``pad_id`` after the end.
        mask: ``[N, T]`` bool, ``True`` for tokens up to and including the first end-of-sequence.
        logprobs: ``[N, T]`` float32 behaviour log-probs of each token (0 where masked out).
        token_version: ``[N, T]`` int64 version that produced each token (``-1`` where masked out).
        syncs: one record per commit inside the call (the engine's stats plus ``round``,
            ``inflight``: some rollout was partial, ``partial_rollouts``, ``dropped_tokens``).
        rounds: rounds of pieces submitted.
        dropped_tokens: tokens thrown away by ``abort``.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    token_version: torch.Tensor
    syncs: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 0
    dropped_tokens: int = 0


def generate_chunked(engine: ChunkEngine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, chunk: int,
                     interrupt: str, eos_id: int, pad_id: int) -> ChunkedRollouts:
    """Generate one rollout per prompt in rounds of at most ``chunk`` tokens, committing staged
    versions between rounds (``keep`` / ``abort``), and tag every token with its version.

    Args:
        engine: see :class:`ChunkEngine`; it must serve a version already.
        prompts: token ids of every prompt (no padding).
        max_new_tokens: ``T``, the most tokens per rollout.
        chunk: tokens per piece (>= 1); ``drain`` submits whole rollouts (``chunk = T``).
        interrupt: ``"keep"``, ``"abort"`` or ``"drain"`` (module docstring).
        eos_id: end-of-sequence token (a rollout ends after it).
        pad_id: fill of ``ids`` after the end.

    Returns:
        :class:`ChunkedRollouts`.

    Raises:
        ValueError: an unknown ``interrupt``, ``chunk < 1``, or an engine that holds no version.
        whatever ``engine.complete`` / ``engine.sync`` raise (the engine is gone or refused).
    """
    if interrupt not in INTERRUPT_MODES:
        raise ValueError(f"interrupt must be one of {INTERRUPT_MODES}, got {interrupt!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if engine.version is None:
        raise ValueError("the engine holds no weights yet: update it to a version before generating")
    if interrupt == "drain":
        chunk = max_new_tokens
    n = len(prompts)
    toks: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    vers: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    out = ChunkedRollouts(ids=torch.empty(0), mask=torch.empty(0), logprobs=torch.empty(0),
                          token_version=torch.empty(0))
    while not all(done):
        if interrupt != "drain":
            partial = [i for i in range(n) if toks[i] and not done[i]]
            st = engine.sync()
            if st is not None:
                dropped = 0
                if interrupt == "abort":
                    for i in partial:
                        dropped += len(toks[i])
                        toks[i], lps[i], vers[i] = [], [], []
                    out.dropped_tokens += dropped
                out.syncs.append({**st, "round": out.rounds, "inflight": bool(partial),
                                  "partial_rollouts": len(partial), "dropped_tokens": dropped})
        active = [i for i in range(n) if not done[i]]
        version = engine.version
        pieces = engine.complete([list(prompts[i]) + toks[i] for i in active],
                                 max_tokens=min(chunk, max(max_new_tokens - len(toks[i]) for i in active)))
        if len(pieces) != len(active):
            raise RuntimeError(f"the engine answered {len(pieces)} completions for {len(active)} prompts")
        out.rounds += 1
        for i, piece in zip(active, pieces):
            room = max_new_tokens - len(toks[i])
            new = list(piece["tokens"])[:room]
            if len(piece["logprobs"]) < len(new):
                raise RuntimeError(f"the engine returned {len(piece['logprobs'])} log-probs for {len(new)} tokens")
            toks[i] += new
            lps[i] += [float(x) for x in piece["logprobs"][:len(new)]]
            vers[i] += [version] * len(new)
            if eos_id in new or len(toks[i]) >= max_new_tokens or piece.get("finish_reason") != "length" or not new:
                done[i] = True
    T = max_new_tokens
    out.ids = torch.full((n, T), pad_id, dtype=torch.long)
    out.mask = torch.zeros((n, T), dtype=torch.bool)
    out.logprobs = torch.zeros((n, T), dtype=torch.float32)
    out.token_version = torch.full((n, T), -1, dtype=torch.long)
    for i in range(n):
        end = toks[i].index(eos_id) + 1 if eos_id in toks[i] else len(toks[i])
        k = min(end, T)
        out.ids[i, :len(toks[i][:T])] = torch.tensor(toks[i][:T], dtype=torch.long)
        out.mask[i, :k] = True
        out.logprobs[i, :k] = torch.tensor(lps[i][:k], dtype=torch.float32)
        out.token_version[i, :k] = torch.tensor(vers[i][:k], dtype=torch.long)
    return out


def tokens_by_lag(token_version: torch.Tensor, mask: torch.Tensor, consumer_version: int) -> dict[int, int]:
    """``{lag: tokens}`` with ``lag = consumer_version - token_version`` over the ``mask``-ed tokens
    (``[N, T]`` each)."""
    lag = (consumer_version - token_version)[mask.bool()]
    vals, counts = torch.unique(lag, return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts)}

