"""Fan-out benchmark: one writer, R receivers, through an S3-protocol server (moto) on 127.0.0.1.

For R in ``--fanout`` (default 1, 4, 8) and two ways of shipping each new version:

* **delta**: ``DeltaSender`` -> ``s3://`` -> R ``DeltaReceiver``\\ s (sparse deltas, anchors every
  ``--anchor-every`` versions);
* **full**: the baseline, a full bf16 snapshot per version (one safetensors object, as a plain
  checkpoint sync would ship it) -> ``s3://`` -> R receivers that load it and copy it in.

it reports, per version, the bytes every receiver read from the store (counted on the wire side of
the store, manifests and pointers included) and the time from the start of the writer's publish until
the last of the R receivers holds the new version, and the ratios full / delta measured in the same
run. Delta receivers are checked bit-exact at the end.

The weights are synthetic (``--numel`` bf16 elements in 8 tensors); each version changes a random
``--density`` fraction of elements, like an RL step (~1% of bf16 weights change per step, see
``docs/research/anchors.md``). The moto server runs in its own process so it does not share the GIL with
the writer and receivers, which are threads of this process.

Run (about a minute on 2 CPU cores)::

    PYTHONPATH=. python tools/bench_fanout.py --numel 4000000 --versions 6 --fanout 1,4,8

Writes one JSON line per (mode, fanout) to ``--metrics`` (default ``runs/bench_fanout.jsonl``) and
prints a Markdown table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from s3_server import S3_ENV, make_bucket  # noqa: E402

from torch_deltasync import DeltaReceiver, DeltaSender, RetryPolicy, open_store  # noqa: E402
from torch_deltasync.store import Store  # noqa: E402


class Counting(Store):
    """Pass-through store that counts the bytes and calls of reads (thread-safe), and optionally
    emulates this client's network link: every transfer of ``n`` bytes also waits
    ``n * 8 / (link_mbit * 1e6)`` seconds (loopback itself is ~free)."""

    def __init__(self, inner: Store, link_mbit: float | None = None) -> None:
        self.inner, self.nbytes, self.calls = inner, 0, 0
        self.link_mbit = link_mbit
        self._lock = threading.Lock()

    def _wire(self, n: int) -> None:
        if self.link_mbit:
            time.sleep(n * 8 / (self.link_mbit * 1e6))

    def get(self, key, *, start=None, end=None):
        data = self.inner.get(key, start=start, end=end)
        self._wire(len(data))
        with self._lock:
            self.nbytes += len(data)
            self.calls += 1
        return data

    def put(self, key, data):
        self.inner.put(key, data)
        self._wire(len(data))

    def put_new(self, key, data):  # the sender's path: a conditional PUT, not exists + put
        self.inner.put_new(key, data)
        self._wire(len(data))

    def exists(self, key):
        with self._lock:
            self.calls += 1
        return self.inner.exists(key)

    def list(self, prefix=""):
        with self._lock:
            self.calls += 1
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    def describe(self):
        return self.inner.describe()


def start_server() -> tuple[subprocess.Popen, str]:
    code = ("import logging,sys,time; logging.getLogger('werkzeug').setLevel(logging.ERROR);"
            "from moto.server import ThreadedMotoServer as S; s=S(ip_address='127.0.0.1', port=0, verbose=False);"
            "s.start(); h,p=s.get_host_and_port(); print(f'http://{h}:{p}', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                            env={**os.environ, **S3_ENV})
    endpoint = proc.stdout.readline().strip()
    assert endpoint.startswith("http://127.0.0.1:"), endpoint
    return proc, endpoint


def make_weights(numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = numel // 8
    return {f"layers.{i}.weight": (torch.randn(per, generator=g) * 0.02) for i in range(8)}


def step(weights: dict[str, torch.Tensor], density: float, g: torch.Generator) -> None:
    """Change a random ``density`` fraction of each tensor by a visible amount (a few bf16 ULPs)."""
    for t in weights.values():
        k = max(1, int(t.numel() * density))
        pos = torch.randint(0, t.numel(), (k,), generator=g)
        t[pos] *= 1.0 + 0.05 * torch.rand(k, generator=g)


class FullSync:
    """Baseline: a full bf16 snapshot per version under ``full/<v>.safetensors`` plus a pointer."""

    def __init__(self, weights, store: Store) -> None:
        self.weights, self.store, self.version = weights, store, -1

    def publish(self) -> int:
        from safetensors.torch import save

        self.version += 1
        data = save({n: t.to(torch.bfloat16).contiguous() for n, t in self.weights.items()})
        self.store.put(f"full/{self.version:012d}.safetensors", data)
        self.store.put("FULL_LATEST", str(self.version).encode())
        return self.version


class FullReceiver:
    def __init__(self, target: dict[str, torch.Tensor], store: Store) -> None:
        self.target, self.store, self.version = target, store, None

    def newest(self) -> int | None:
        try:
            return int(self.store.get("FULL_LATEST"))
        except FileNotFoundError:
            return None

    def update(self, version: int) -> None:
        from safetensors.torch import load

        for n, t in load(self.store.get(f"full/{version:012d}.safetensors")).items():
            self.target[n].copy_(t)
        self.version = version


def run_mode(mode: str, fanout: int, endpoint: str, args, link_mbit: float | None) -> dict:
    url = f"s3://{make_bucket(endpoint)}/{mode}"
    retry = RetryPolicy(timeout_s=120)
    weights = make_weights(args.numel, seed=0)
    g = torch.Generator().manual_seed(1)
    wstore = Counting(open_store(url, endpoint_url=endpoint, retry=retry), link_mbit)
    writer = (DeltaSender(weights, wstore, anchor_every=args.anchor_every) if mode == "delta"
              else FullSync(weights, wstore))
    stores = [Counting(open_store(url, endpoint_url=endpoint, retry=retry), link_mbit) for _ in range(fanout)]
    targets = [{n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in weights.items()} for _ in range(fanout)]
    receivers = [DeltaReceiver(t, s) if mode == "delta" else FullReceiver(t, s) for t, s in zip(targets, stores)]

    def newest(r):
        # Both modes poll one small pointer object per check (LATEST / FULL_LATEST), so polling
        # costs the same; DeltaReceiver.newest_version() would also confirm it with two HEADs.
        if mode == "full":
            return r.newest()
        try:
            return int(r.store.get("LATEST"))
        except FileNotFoundError:
            return None

    # warm-up: the first version (an anchor for delta) is loaded by everyone, not measured
    writer.publish()
    for r in receivers:
        r.update(newest(r))

    times_s, publish_s, spread_s, bytes_per_receiver = [], [], [], []
    for _ in range(args.versions):
        step(weights, args.density, g)
        before = [s.nbytes for s in stores]
        done = [0.0] * fanout
        target_v = (writer.version + 1) if mode == "full" else writer._next_version
        start = threading.Barrier(fanout + 1)

        def follow(i: int) -> None:
            r = receivers[i]
            start.wait()
            while (n := newest(r)) is None or n < target_v:
                time.sleep(args.poll_s)
            r.update(target_v)
            done[i] = time.perf_counter()

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(fanout)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        v = writer.publish()
        t1 = time.perf_counter()
        assert v == target_v, (v, target_v)
        for t in threads:
            t.join()
        times_s.append(max(done) - t0)
        publish_s.append(t1 - t0)
        spread_s.append(max(done) - t1)
        bytes_per_receiver.append(sum(s.nbytes - b for s, b in zip(stores, before)) / fanout)

    if mode == "delta":
        want = {n: t.to(torch.bfloat16).view(torch.int16) for n, t in weights.items()}
        for tgt in targets:
            assert all(torch.equal(tgt[n].view(torch.int16), want[n]) for n in want), "delta receiver not bit-exact"
    return {"mode": mode, "fanout": fanout, "numel": args.numel, "density": args.density, "link_mbit": link_mbit,
            "versions": args.versions, "median_time_s": median(times_s), "times_s": times_s,
            "median_publish_s": median(publish_s), "publish_s": publish_s,
            "median_spread_s": median(spread_s), "spread_s": spread_s,
            "median_bytes_per_receiver": median(bytes_per_receiver), "bytes_per_receiver": bytes_per_receiver,
            "full_nbytes": args.numel * 2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=4_000_000, help="model elements (bf16 on the wire)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of elements changed per version")
    p.add_argument("--versions", type=int, default=6, help="measured versions per (mode, fanout)")
    p.add_argument("--anchor-every", type=int, default=50, help="delta mode: anchor cadence (versions)")
    p.add_argument("--fanout", default="1,4,8")
    p.add_argument("--poll-s", type=float, default=0.005, help="receivers' polling interval")
    p.add_argument("--link-mbit", default="0,1000",
                   help="emulated per-client link speeds in Mbit/s, comma-separated (0: loopback only)")
    p.add_argument("--metrics", default="runs/bench_fanout.jsonl")
    args = p.parse_args()
    if args.numel < 1 or args.versions < 1 or args.anchor_every < 1 or not 0 < args.density <= 1 or args.poll_s < 0:
        p.error("--numel, --versions and --anchor-every must be >= 1, 0 < --density <= 1, --poll-s >= 0")
    try:
        if min(int(x) for x in args.fanout.split(",")) < 1 or min(float(x) for x in args.link_mbit.split(",")) < 0:
            raise ValueError
    except ValueError:
        p.error(f"--fanout takes comma-separated counts >= 1 and --link-mbit speeds >= 0 "
                f"(got {args.fanout!r}, {args.link_mbit!r})")

    os.environ.update(S3_ENV)
    server, endpoint = start_server()
    rows = []
    try:
        for link in [float(x) or None for x in args.link_mbit.split(",")]:
            for fanout in [int(x) for x in args.fanout.split(",")]:
                for mode in ("full", "delta"):
                    r = run_mode(mode, fanout, endpoint, args, link)
                    rows.append(r)
                    print(f"link {link or 'loopback'} {mode:5s} x{fanout}: {r['median_time_s'] * 1e3:8.1f} ms to reach "
                          f"a version (publish {r['median_publish_s'] * 1e3:.1f} ms), "
                          f"{r['median_bytes_per_receiver'] / 2**20:8.3f} MiB read per receiver", flush=True)
    finally:
        server.stdin.close()
        server.terminate()
        server.wait(10)
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    with open(args.metrics, "a") as f:
        for r in rows:
            f.write(json.dumps({"event": "bench_fanout", **r}) + "\n")

    by = {(r["link_mbit"], r["mode"], r["fanout"]): r for r in rows}
    print(f"\n{args.numel / 1e6:g}M elements ({args.numel * 2 / 2**20:.1f} MiB bf16), density {args.density:g}, "
          f"median of {args.versions} versions. Time to new version: from the start of the writer's publish until "
          f"the last receiver holds it. Fan-out: from publish() returning (the version visible) until the last "
          f"receiver holds it.\n")
    print("| link | receivers | MiB read / receiver: full | delta | full/delta "
          "| time to new version: full | delta | full/delta | fan-out: full | delta | full/delta |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for link, _, fanout in sorted({(r["link_mbit"] or 0, 0, r["fanout"]) for r in rows}):
        link = link or None
        f, d = by[(link, "full", fanout)], by[(link, "delta", fanout)]
        print(f"| {f'{link:g} Mbit/s' if link else 'loopback'} | {fanout} "
              f"| {f['median_bytes_per_receiver'] / 2**20:.3f} | {d['median_bytes_per_receiver'] / 2**20:.3f} "
              f"| {f['median_bytes_per_receiver'] / d['median_bytes_per_receiver']:.1f}x "
              f"| {f['median_time_s'] * 1e3:.0f} ms | {d['median_time_s'] * 1e3:.0f} ms "
              f"| {f['median_time_s'] / d['median_time_s']:.2f}x "
              f"| {f['median_spread_s'] * 1e3:.0f} ms | {d['median_spread_s'] * 1e3:.0f} ms "
              f"| {f['median_spread_s'] / d['median_spread_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
