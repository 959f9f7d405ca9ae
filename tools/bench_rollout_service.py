"""Rollout service throughput: episodes per second in and out over HTTP, against the same work in process.

``--clients`` threads post ``--episodes`` episodes in batches of ``--post-batch`` (``--prompt`` +
``--completion`` tokens each) to a service on loopback (``start_service``: uvicorn, one event loop)
while a trainer thread samples batches of ``--sample-batch``; the ring is large enough that nobody
waits on a 429 and ``max_lag`` keeps every episode fresh, so this is the service's own cost:
JSON parsing, validation, tensordict conversion, torchrl storage, and the HTTP stack. Baseline, in
the same run: ``validate_episodes`` + ``EpisodeBuffer.add`` / ``sample`` called directly on the same
batches (no HTTP, no JSON). Ratios of the two are what a deployment pays for the decoupling.

Run (about half a minute on 2 cores)::

    PYTHONPATH=. python tools/bench_rollout_service.py
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time


def _episodes(n: int, prompt: int, completion: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(32000) for _ in range(prompt)],
             "completion": [rng.randrange(32000) for _ in range(completion)],
             "logprobs": [-rng.random() for _ in range(completion)], "reward": rng.random(),
             "advantage": rng.uniform(-1, 1), "policy_version": 0, "group": i, "worker": f"w{seed}"}
            for i in range(n)]


def main() -> None:
    from torch_deltasync.integrations.rollout import (
        EpisodeBuffer,
        RolloutClient,
        RolloutServiceConfig,
        start_service,
        validate_episodes,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--episodes", type=int, default=4000)
    p.add_argument("--post-batch", type=int, default=16)
    p.add_argument("--sample-batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=256)
    args = p.parse_args()
    if min(args.clients, args.post_batch, args.sample_batch, args.prompt, args.completion) < 1:
        p.error("--clients, --post-batch, --sample-batch, --prompt and --completion must be >= 1")
    if args.episodes < args.clients:
        p.error(f"--episodes must be >= --clients ({args.clients}), got {args.episodes}")
    cfg = RolloutServiceConfig(capacity=args.episodes, max_lag=10, vocab_size=32000)
    per = args.episodes // args.clients
    data = [_episodes(per, args.prompt, args.completion, k) for k in range(args.clients)]
    batches = [d[i:i + args.post_batch] for d in data for i in range(0, per, args.post_batch)]
    total = per * args.clients

    # baseline: the same batches, in process
    buf = EpisodeBuffer(cfg)
    t = time.perf_counter()
    for b in batches:
        buf.add(validate_episodes({"episodes": b}, cfg))
    add_s = time.perf_counter() - t
    t = time.perf_counter()
    out = 0
    while out < total:
        out += len(buf.sample(min(args.sample_batch, total - out)))
    sample_s = time.perf_counter() - t
    direct = {"in_eps_per_s": total / add_s, "out_eps_per_s": total / sample_s}

    # over HTTP: clients post concurrently, a trainer samples concurrently
    with start_service(cfg) as svc:
        sampled = [0]
        t_end = [0.0]

        def trainer():
            with RolloutClient(svc.url) as c:
                while sampled[0] < total:
                    got = c.sample(min(args.sample_batch, total - sampled[0]), wait_s=1.0)
                    sampled[0] += len(got or [])
            t_end[0] = time.perf_counter()

        def client(k):
            with RolloutClient(svc.url) as c:
                for i in range(0, per, args.post_batch):
                    c.post_episodes(data[k][i:i + args.post_batch])

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        tt = threading.Thread(target=trainer)
        for th in threads + [tt]:
            th.start()
        for th in threads:
            th.join()
        t_in = time.perf_counter() - t0
        tt.join()
        t_all = t_end[0] - t0
        st = svc.buffer.stats()
    assert st["accepted"] == total and st["sampled"] == total and st["unaccounted"] == 0
    http = {"in_eps_per_s": total / t_in, "end_to_end_eps_per_s": total / t_all}
    body = len(json.dumps({"episodes": batches[0]}))
    print(f"{total} episodes of {args.prompt}+{args.completion} tokens, {args.clients} posting clients, "
          f"batches of {args.post_batch} (~{body / 1024:.0f} KiB per POST), samples of {args.sample_batch}\n")
    print("| path | episodes/s in | episodes/s out |")
    print("|---|---:|---:|")
    print(f"| in process (validate + EpisodeBuffer.add / sample) | {direct['in_eps_per_s']:,.0f} | {direct['out_eps_per_s']:,.0f} |")
    print(f"| HTTP, concurrent posting and sampling | {http['in_eps_per_s']:,.0f} | {http['end_to_end_eps_per_s']:,.0f} (end to end) |")
    print(f"\nHTTP / in-process ingest: {http['in_eps_per_s'] / direct['in_eps_per_s']:.2f}")


if __name__ == "__main__":
    main()
