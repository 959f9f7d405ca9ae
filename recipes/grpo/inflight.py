"""In-flight weight sync with exact per-token versions: whole rollouts run in the engine while the
generator commits staged versions under them, and the engine labels every token with the weights
that sampled it.

Where the versions come from: vLLM (0.32+) labels every step's outputs with the engine's weight
version (``finish_weight_update {"weight_version": "v"}`` sets it, inside the pause), and its token
API (``/inference/v1/generate``, served with ``--enable-scale-out``) returns, per completion, the
contiguous spans ``{"version", "start", "end"}`` of output tokens each version sampled. A token's
version is therefore the engine's own record, not an estimate from commit times and stream
counts (which race over HTTP: the stream lags the engine).

The loop (:func:`generate_inflight`): submit every rollout (identical prompts as one request with
``n`` completions), then, until all have finished, poll every ``poll_s`` seconds: collect finished
requests, and (``keep`` / ``abort``) ask the engine to commit the newest version it has staged
(:meth:`InflightEngine.sync`: a no-op when nothing newer is staged; it never waits for staging, so
the pause covers the commit only).

Interrupt modes (``--interrupt``):

* ``keep``: the pause freezes running requests (``/pause?mode=keep&clear_cache=true``); they resume
  on the new weights, their KV recomputed (``clear_cache`` preempts them and resets the prefix
  cache), so one rollout's tokens may come from several versions, each tagged.
* ``abort``: the pause aborts running requests (``mode=abort``); each returns the tokens it had
  (``finish_reason == "abort"``), and once the commit is done the rollout is **re-submitted with
  its prefix** (prompt + tokens so far) on the new weights. Prefix tokens keep the version that
  sampled them, new tokens get the new one; the prefix's KV is recomputed under the new weights
  (the pause reset the prefix cache), so no KV from older weights is reused.
* ``drain``: no commit inside a batch; the batch finishes on the version it started with (the
  controller updates the engine between batches).

The engine is anything with :class:`InflightEngine`'s members, so the attribution and the
re-submission are tested with a scripted engine (``tests/integration/test_grpo_inflight.py``); the live server
is :class:`recipes.grpo.generators.VLLMServerGenerator`.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .policy import pad_responses

__all__ = ["InflightEngine", "InflightRollouts", "generate_inflight", "commit_target", "token_versions",
           "tokens_by_lag", "INTERRUPT_MODES"]

INTERRUPT_MODES = ("keep", "drain", "abort")


class InflightEngine(Protocol):
    """What :func:`generate_inflight` needs from an engine."""

    @property
    def version(self) -> int | None:
        """The version the engine serves now."""

    def generate(self, prompt: list[int], max_tokens: int, n: int) -> list[dict[str, Any]]:
        """Sample ``n`` completions of up to ``max_tokens`` tokens after the token-id ``prompt``
        (blocking; called from several threads at once): ``[{"tokens": [int], "logprobs": [float],
        "finish_reason": "length" | "stop" | "abort" | ..., "versions": [{"version", "start",
        "end"}]}]``; ``versions`` are the engine's spans of output-token indexes per weight version."""

    def sync(self, mode: str) -> dict[str, Any] | None:
        """Commit the newest version the engine has staged, if newer than the one served, pausing
        with ``mode`` (``"keep"`` or ``"abort"``); return the update's stats (at least ``version``
        and ``stall_ms``), or ``None`` when there is nothing to commit. Must not wait for staging."""


@dataclass
class InflightRollouts:
    """The result of :func:`generate_inflight` for ``N`` rollouts of at most ``T`` tokens.

    Attributes:
        ids: ``[N, T]`` int64 response tokens, ``pad_id`` after the end.
        mask: ``[N, T]`` bool, ``True`` for tokens up to and including the first end-of-sequence.
        logprobs: ``[N, T]`` float32 behaviour log-probs of each token (0 where masked out).
        token_version: ``[N, T]`` int64 version that sampled each token (``-1`` where masked out).
        syncs: one record per commit inside the call: the engine's stats plus ``inflight`` (some
            request was not yet collected by the driver: running, or finished in the engine but not
            yet answered), ``partial_rollouts`` (the rollouts of those requests), ``rollouts_across``
            (rollouts holding tokens sampled before the commit and after it, by the engine's own
            version tags: the commit certainly happened under them) and ``poll`` (its poll index).
        requests: requests submitted (a group of identical prompts is one request).
        resubmitted: rollouts re-submitted with their prefix after an ``abort`` commit.
        polls: poll rounds of the loop.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    token_version: torch.Tensor
    syncs: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    resubmitted: int = 0
    polls: int = 0


def commit_target(staged: Sequence[Any], served: int | None, min_lag: int = 1) -> int | None:
    """The version a generator should commit now, or ``None``.

    A version can be committed only once every worker staged it (the newest common one, ``min``
    of the workers' ``staged``); it is worth a pause only when it is at least ``min_lag`` versions
    newer than the served one (``--sync-lag``: 1 commits every new version; ``k`` lets the served
    version fall ``k - 1`` behind and commits the newest one when it falls ``k`` behind, one pause
    for ``k`` versions).

    Args:
        staged: every worker's staged version from its readiness file (``None`` / missing: not yet).
        served: the version the engine serves (``None``: none yet, any staged version goes).
        min_lag: >= 1.

    Raises:
        ValueError: ``min_lag < 1``.
    """
    if min_lag < 1:
        raise ValueError(f"min_lag must be >= 1 version, got {min_lag}")
    if not staged or not all(isinstance(v, int) for v in staged):
        return None
    v = min(staged)
    if served is not None and v - served < min_lag:
        return None
    return v


def token_versions(spans: Sequence[dict[str, Any]], n_tokens: int) -> list[int]:
    """Per-token versions from an engine's spans ``[{"version": "3", "start": 0, "end": 4}, ...]``.

    Args:
        spans: contiguous, in order, covering ``[0, n_tokens)`` (vLLM's ``weight_versions``).
        n_tokens: output tokens of the completion.

    Returns:
        ``n_tokens`` ints.

    Raises:
        RuntimeError: the spans are missing, not integers, or do not tile ``[0, n_tokens)`` (an
            engine that does not label versions: vLLM < 0.32, or a server without
            ``--enable-scale-out``).
    """
    if n_tokens == 0:
        return []
    out: list[int] = []
    for s in spans or []:
        try:
            v, a, b = int(s["version"]), int(s["start"]), int(s["end"])
        except (KeyError, TypeError, ValueError):
            raise RuntimeError(f"the engine labelled tokens with {s!r}; weight versions must be integers "
                               "(commit with finish_weight_update(weight_version=str(v)))") from None
        if a != len(out) or b < a:
            break
        out += [v] * (b - a)
    if len(out) != n_tokens:
        raise RuntimeError(f"the engine's weight-version spans {spans!r} do not cover its {n_tokens} output tokens; "
                           "per-token versions need vLLM >= 0.32 serving /inference/v1/generate (--enable-scale-out)")
    return out


def generate_inflight(engine: InflightEngine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                      interrupt: str, eos_id: int, pad_id: int, poll_s: float = 0.02) -> InflightRollouts:
    """Generate one rollout per prompt, committing staged versions while they run (``keep`` /
    ``abort``), and tag every token with the version that sampled it (module docstring).

    Args:
        engine: see :class:`InflightEngine`; it must serve a version already.
        prompts: token ids of every prompt (no padding); identical prompts go out as one request.
        max_new_tokens: ``T``, the most tokens per rollout.
        interrupt: ``"keep"``, ``"abort"`` or ``"drain"``.
        eos_id: end-of-sequence token (a rollout ends after it).
        pad_id: fill of ``ids`` after the end.
        poll_s: seconds between two looks for finished requests and staged versions.

    Returns:
        :class:`InflightRollouts`.

    Raises:
        ValueError: an unknown ``interrupt``, ``poll_s <= 0``, or an engine that holds no version.
        RuntimeError: the engine answered the wrong number of completions, fewer log-probs than
            tokens, no version spans, or aborted a request that no ``abort`` commit explains.
        whatever ``engine.generate`` / ``engine.sync`` raise (the engine is gone or refused).
    """
    if interrupt not in INTERRUPT_MODES:
        raise ValueError(f"interrupt must be one of {INTERRUPT_MODES}, got {interrupt!r}")
    if not poll_s > 0:
        raise ValueError(f"poll_s must be > 0 seconds, got {poll_s}")
    if engine.version is None:
        raise ValueError("the engine holds no weights yet: update it to a version before generating")
    n = len(prompts)
    toks: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    vers: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    out = InflightRollouts(ids=torch.empty(0), mask=torch.empty(0), logprobs=torch.empty(0),
                           token_version=torch.empty(0))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    running: dict[Future, tuple[list[int], int]] = {}  # request -> (its rollouts, abort commits before it)
    aborts = 0  # abort commits so far

    with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="rollout") as pool:

        def submit(rows: list[int]) -> None:
            i = rows[0]
            room = max_new_tokens - len(toks[i])
            fut = pool.submit(engine.generate, list(prompts[i]) + toks[i], room, len(rows))
            running[fut] = (rows, aborts)
            out.requests += 1

        try:
            for rows in groups.values():
                submit(rows)
            while running:
                finished, _ = wait(list(running), timeout=poll_s, return_when=FIRST_COMPLETED)
                out.polls += 1
                again: list[int] = []
                for fut in finished:
                    rows, aborts_before = running.pop(fut)
                    comps = fut.result()
                    if len(comps) != len(rows):
                        raise RuntimeError(f"the engine answered {len(comps)} completions for {len(rows)} requested")
                    for i, c in zip(rows, comps):
                        room = max_new_tokens - len(toks[i])
                        new = [int(t) for t in c["tokens"]][:room]
                        if len(c["logprobs"]) < len(new):
                            raise RuntimeError(f"the engine returned {len(c['logprobs'])} log-probs for {len(new)} tokens")
                        v = token_versions(c.get("versions") or [], len(c["tokens"]))[:len(new)]
                        toks[i] += new
                        lps[i] += [float(x) for x in c["logprobs"][:len(new)]]
                        vers[i] += v
                        if c.get("finish_reason") == "abort" and eos_id not in new and len(toks[i]) < max_new_tokens:
                            if aborts == aborts_before:
                                raise RuntimeError(f"the engine aborted rollout {i} after {len(toks[i])} tokens, but no "
                                                   "abort commit happened meanwhile (was the server stopped?)")
                            again.append(i)
                        else:
                            done[i] = True
                for i in again:  # the commit has returned: the prefix goes to the new weights
                    submit([i])
                    out.resubmitted += 1
                if interrupt != "drain" and running:
                    partial = sum(len(r) for r, _ in running.values())
                    st = engine.sync(interrupt)
                    if st is not None:
                        if interrupt == "abort":
                            aborts += 1
                        out.syncs.append({**st, "poll": out.polls, "inflight": partial > 0,
                                          "partial_rollouts": partial})
        finally:
            for fut in running:
                fut.cancel()
    if not all(done):  # unreachable: every request either finished its rollouts or was re-submitted
        raise RuntimeError(f"rollouts {[i for i in range(n) if not done[i]]} did not finish")
    for st in out.syncs:  # from the engine's own version tags: rollouts with tokens on both sides
        v = st.get("version")
        st["rollouts_across"] = sum(1 for vs in vers if vs and vs[0] < v <= vs[-1]) if isinstance(v, int) else 0
    out.ids, out.mask, out.logprobs = pad_responses(toks, lps, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                                    pad_id=pad_id)
    out.token_version = torch.full(out.ids.shape, -1, dtype=torch.long)
    for i in range(n):
        k = int(out.mask[i].sum())
        out.token_version[i, :k] = torch.tensor(vers[i][:k], dtype=torch.long)
    return out


def tokens_by_lag(token_version: torch.Tensor, mask: torch.Tensor, consumer_version: int) -> dict[int, int]:
    """``{lag: tokens}`` with ``lag = consumer_version - token_version`` over the ``mask``-ed tokens
    (``[N, T]`` each)."""
    lag = (consumer_version - token_version)[mask.bool()]
    vals, counts = torch.unique(lag, return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts)}
