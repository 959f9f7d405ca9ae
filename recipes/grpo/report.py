"""What a person looks at: the metrics JSONL, the summary and the two plots of a run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

__all__ = ["MetricsLog", "summarize", "plot_reward", "plot_sync", "plot_lag", "STEP_HEADER", "step_line"]


class MetricsLog:
    """Appends one JSON object per event to ``path`` (``{"event": ..., "t": seconds since start, ...}``)
    and keeps the events in memory for the summary and the plots."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"event": event, "t": round(time.perf_counter() - self.t0, 4), **fields}
        self.events.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_jsonable) + "\n")
        return rec

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


STEP_HEADER = (f"{'step':>5} {'ver':>4} {'reward':>6} {'lag':>5} {'changed':>9} {'density':>7} "
               f"{'delta B':>9} {'full B':>9} {'ratio':>6} {'pub ms':>6} {'apply ms':>8} {'gens':>4}")


def step_line(step: dict[str, Any]) -> str:
    """One row under :data:`STEP_HEADER` for a ``step`` event."""
    pub = step.get("publish") or {}
    apply_ms = step.get("apply_ms")
    if pub:
        sync = (f"{pub['changed']:>9,} {pub['density']:>7.2%} {pub['nbytes']:>9,} {pub['full_nbytes']:>9,} "
                f"{pub['ratio']:>6.3f} {pub['publish_ms']:>6.1f}")
    else:
        sync = f"{'-':>9} {'-':>7} {'-':>9} {'-':>9} {'-':>6} {'-':>6}"
    return (f"{step['step']:>5} {pub.get('version', step['version']):>4} {step['reward']:>6.3f} "
            f"{step['lag_max']:>2d}/{step['lag_mean']:<2.1f} {sync} "
            f"{'-' if apply_ms is None else f'{apply_ms:.1f}':>8} {step['generators_alive']:>4}")


def summarize(log: MetricsLog, *, cfg: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The run summary (``summary.json``).

    Syncs: ``stall`` of a sync is the time it kept its engine from generating: the pause around a
    commit inside a batch (``in_batch`` updates), or the whole update for one between batches.
    ``sync_time_frac`` is their sum over the generators' generation time plus the between-batch
    updates. ``inflight_syncs`` counts commits while some rollout of the batch was partial (its
    request not yet collected by the driver), ``syncs_across_rollouts`` those under which some
    rollout kept generating (tokens of both sides, by the engine's version tags);
    ``tokens_by_lag`` counts trained tokens by ``trainer version - token version``.

    ``reward_first`` / ``reward_last`` average the per-step mean reward of the trained batches over
    the first / last 10% of GRPO steps (at least one step). ``bytes_ratio`` is the bytes of every
    version after the initial anchor divided by the bytes of as many full bf16 copies;
    ``mean_density`` averages changed elements / model elements over the same versions.
    """
    steps = log.of("step")
    rewards = [s["reward"] for s in steps]
    k = max(1, math.ceil(0.1 * len(rewards))) if rewards else 0
    pubs = [e for e in log.of("publish") if e["version"] > 0]
    updates = log.of("update")
    live = [u for u in updates if not u.get("final")]
    in_batch = [u for u in live if u.get("in_batch")]
    between = [u for u in live if not u.get("in_batch") and u.get("blocked_ms") is not None]
    # the time each sync kept its engine from generating: the pause of a commit inside a batch, or
    # the whole update between batches (the replica waits for it)
    stalls = [u["stall_ms"] for u in in_batch] + [u["blocked_ms"] for u in between]
    gen_ms = sum(r["gen_ms"] for r in log.of("rollout"))
    lost = sum(stalls)
    by_lag: dict[int, int] = {}
    for st in steps:
        for lag, c in (st.get("tokens_by_lag") or {}).items():
            by_lag[int(lag)] = by_lag.get(int(lag), 0) + c
    return {
        "steps": len(steps),
        "versions_published": len(log.of("publish")),
        "reward_first": _mean(rewards[:k]),
        "reward_last": _mean(rewards[-k:]) if k else None,
        "mean_density": _mean(p["density"] for p in pubs),
        "bytes_ratio": (sum(p["nbytes"] for p in pubs) / sum(p["full_nbytes"] for p in pubs)) if pubs else None,
        "delta_nbytes": sum(p["nbytes"] for p in pubs),
        "full_nbytes": sum(p["full_nbytes"] for p in pubs),
        "max_policy_lag": max((s["lag_max"] for s in steps), default=0),
        "mean_policy_lag": _mean(s["lag_mean"] for s in steps),
        "max_staleness": cfg["max_staleness"],
        "mean_publish_ms": _mean(p["publish_ms"] for p in pubs),
        "mean_apply_ms": _mean(u["apply_ms"] for u in updates if u.get("apply_ms") is not None),
        "mean_update_ms": _mean(u["total_ms"] for u in updates if u.get("total_ms") is not None),
        "generator_updates": len(updates),
        "engine": cfg.get("generator_backend"),
        "interrupt": cfg.get("interrupt") or ("keep" if cfg.get("generator_backend") == "vllm" else "drain"),
        "syncs": len(stalls),
        "inflight_syncs": sum(1 for u in in_batch if u.get("inflight")),
        "syncs_across_rollouts": sum(1 for u in in_batch if u.get("rollouts_across")),
        "mean_stall_ms": _mean(stalls),
        "max_stall_ms": max(stalls, default=None),
        "sync_time_frac": lost / (gen_ms + sum(u["blocked_ms"] for u in between)) if gen_ms else None,
        "resubmitted_rollouts": sum(r.get("resubmitted", 0) for r in log.of("rollout")),
        "tokens_by_lag": dict(sorted(by_lag.items())),
        **extra,
    }


def plot_reward(log: MetricsLog, path: Path) -> None:
    """``reward.png``: per-step batch reward (and a moving average), policy lag underneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log.of("step")
    x = [s["step"] for s in steps]
    r = [s["reward"] for s in steps]
    w = max(1, len(r) // 20)
    ma = [sum(r[max(0, i - w + 1): i + 1]) / len(r[max(0, i - w + 1): i + 1]) for i in range(len(r))]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(x, r, lw=0.8, alpha=0.45, label="batch mean reward")
    ax.plot(x, ma, lw=2, label=f"moving average ({w} steps)")
    ax.set_ylabel("reward (partial credit)")
    ax.set_title("async GRPO: reward of the trained batches")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax2.plot(x, [s["lag_max"] for s in steps], lw=1, label="max lag")
    ax2.plot(x, [s["lag_mean"] for s in steps], lw=1, label="mean lag")
    ax2.set_ylabel("policy lag\n(versions)")
    ax2.set_xlabel("GRPO step")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sync(log: MetricsLog, path: Path) -> None:
    """``sync.png``: density and bytes per published version, publish and apply times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pubs = log.of("publish")
    v = [p["version"] for p in pubs]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    ax1.plot(v, [100 * p["density"] for p in pubs], marker=".", lw=1)
    ax1.set_ylabel("changed elements (%)")
    ax1.set_title("delta sync per version (version 0 is the full anchor)")
    ax1.grid(alpha=0.3)
    ax2.semilogy(v, [p["nbytes"] for p in pubs], marker=".", lw=1, label="published bytes")
    ax2.semilogy(v, [p["full_nbytes"] for p in pubs], lw=1.5, ls="--", label="full bf16 copy")
    ax2.set_ylabel("bytes")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8)
    ax3.plot(v, [p["publish_ms"] for p in pubs], marker=".", lw=1, label="publish (trainer)")
    upd = {}
    for u in log.of("update"):
        if u.get("apply_ms") is not None:
            upd.setdefault(u["version"], []).append(u["apply_ms"])
    uv = sorted(upd)
    ax3.plot(uv, [sum(upd[x]) / len(upd[x]) for x in uv], marker=".", lw=1, label="apply (generators, mean)")
    ax3.set_ylabel("ms")
    ax3.set_xlabel("version")
    ax3.grid(alpha=0.3)
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lag(log: MetricsLog, path: Path) -> None:
    """``lag.png``: trained tokens by version lag (trainer version - the version that produced the
    token), in total and per GRPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log.of("step")
    lags = sorted({int(k) for s in steps for k in (s.get("tokens_by_lag") or {})})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    totals = [sum((s.get("tokens_by_lag") or {}).get(str(k), (s.get("tokens_by_lag") or {}).get(k, 0))
                  for s in steps) for k in lags]
    ax1.bar([str(k) for k in lags], totals)
    ax1.set_xlabel("version lag at training time")
    ax1.set_ylabel("trained tokens")
    ax1.set_title("tokens by version lag")
    ax1.grid(alpha=0.3, axis="y")
    x = [s["step"] for s in steps]
    bottom = [0] * len(steps)
    for k in lags:
        ys = [(s.get("tokens_by_lag") or {}).get(str(k), (s.get("tokens_by_lag") or {}).get(k, 0)) for s in steps]
        ax2.bar(x, ys, bottom=bottom, width=1.0, label=f"lag {k}")
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("tokens")
    ax2.set_title("per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
