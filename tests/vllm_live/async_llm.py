"""Live check of ``update_async_llm`` on an ``AsyncLLM`` (CPU build) with requests in flight.

One live engine follows a trainer through three syncs, each made while greedy requests are being
generated (the sync starts once every request has streamed ``K`` tokens):

* ``keep`` (v0 -> v1): the requests are frozen, preempted (``clear_cache=True``) and continue under
  v1. Check, per request: its tokens and top-20 log-probs start as the engine's own v0 outputs for
  the prompt; at the first step where they differ (``k``, which must lie at or after the ``K``
  tokens seen before the sync and before the end) the rest equals what a fresh engine started from
  v1's weights generates for ``prompt + tokens[:k]``. So every token after the commit comes from v1,
  computed over a KV cache rebuilt under v1, and none from a mix.
* ``wait`` (v1 -> v2): the requests drain first: their whole outputs equal a fresh v1 engine's.
* ``abort`` (v2 -> v3): the requests end with ``finish_reason == "abort"``; afterwards the engine's
  outputs equal a fresh v3 engine's and ``get_weight_version()`` is ``"3"``.

Also reported: every ``EngineUpdate`` (stall = pause -> resume vs the whole call).
Usage: ``async_llm.py WORKDIR``.
"""

import asyncio
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PROMPTS, completion, engine, outputs, perturb, report, save, tiny_qwen3  # noqa: E402

N = 200  # tokens per request (EOS ignored): a margin of steps for the sync to land mid-request
K = 4  # tokens every request has streamed before a sync starts


async def generate_all(llm, tag, prompts=PROMPTS, on_k=None):
    """Greedy requests for ``prompts``, all submitted at once; ``on_k`` is awaited once every request
    has streamed ``K`` tokens (the requests keep streaming meanwhile). Returns the final outputs and
    how many tokens each request had streamed when ``on_k`` started."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=N, logprobs=20, detokenize=False, ignore_eos=True)
    reached = [asyncio.Event() for _ in prompts]
    seen = [0] * len(prompts)
    final = [None] * len(prompts)

    async def one(i):
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, sp, request_id=f"{tag}-{i}"):
            seen[i] = len(out.outputs[0].token_ids)
            if seen[i] >= K:
                reached[i].set()
            final[i] = out.outputs[0]
        reached[i].set()  # ended early (aborted): do not hold the driver up

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    result = None
    if on_k is not None:
        await asyncio.gather(*(e.wait() for e in reached))
        at_sync = list(seen)
        result = await on_k()
    await asyncio.gather(*tasks)
    records = [{**completion(c), "finish_reason": c.finish_reason} for c in final]
    return records, (at_sync if on_k is not None else None), result


def _common_prefix(a, b):
    """Steps at the start where token and top-20 log-probs agree."""
    k = 0
    while k < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][k] == b["tokens"][k] \
            and a["logprobs"][k] == b["logprobs"][k]:
        k += 1
    return k


async def live(work, res):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.integrations.vllm import attach_async_llm, update_async_llm, wait_staged

    model = tiny_qwen3()
    bucket = str(work / "bucket")
    sender = DeltaSender(model, LocalStore(bucket), anchor_every=50)
    v0 = sender.publish()
    d0 = save(model, work / "v0")
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=d0, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
        weight_transfer_config={"backend": "deltasync"}))
    try:
        info = await attach_async_llm(llm, bucket, assume_version=v0, metrics_path=str(work / "commits-{rank}.jsonl"))
        old, _, _ = await generate_all(llm, "v0")  # the engine loaded v0 from disk: a fresh v0 engine
        await llm.reset_prefix_cache()  # the keep run starts as cold as this one did
        res["v0"] = old
        dirs = {}
        for mode, seed in (("keep", 1), ("wait", 2), ("abort", 3)):
            perturb(model, seed=seed)
            v = sender.publish()
            dirs[v] = save(model, work / f"v{v}")
            # staged before the requests start, so the pause comes right after K tokens
            await asyncio.to_thread(wait_staged, info["status_dir"], v, 120)
            outs, at_sync, upd = await generate_all(
                llm, mode, on_k=lambda v=v, mode=mode: update_async_llm(llm, v, mode=mode))
            res[mode] = {"version": v, "outputs": outs, "at_sync": at_sync, "update": upd.to_dict(),
                         "weight_version": await llm.get_weight_version()}
        res["final_live"], _, _ = await generate_all(llm, "final")
        res["commits"] = [json.loads(ln) for ln in (work / "commits-0.jsonl").read_text().splitlines()]
    finally:
        llm.shutdown()
    return dirs


def main() -> None:
    work = Path(sys.argv[1])
    res = {}
    dirs = asyncio.run(live(work, res))
    gc.collect()
    v1, v3 = res["keep"]["version"], res["abort"]["version"]

    # keep: split every request where it leaves the v0 outputs; continue a fresh v1 engine from there
    keep = res["keep"]["outputs"]
    split = [_common_prefix(o, old) for o, old in zip(keep, res["v0"])]
    fresh = engine(dirs[v1], backend=False)
    cont_prompts = [p + o["tokens"][:k] for p, o, k in zip(PROMPTS, keep, split)]
    res["v1_fresh"] = outputs(fresh, max_tokens=N, ignore_eos=True)
    conts = [outputs(fresh, [cp], max_tokens=N - k, ignore_eos=True)[0] if k < N else None
             for cp, k in zip(cont_prompts, split)]
    res["keep_check"] = [{
        "split": k, "seen_before_sync": s, "finish_reason": o["finish_reason"], "length": len(o["tokens"]),
        "tail_equal": c is not None and c == {"tokens": o["tokens"][k:], "logprobs": o["logprobs"][k:]},
    } for o, k, s, c in zip(keep, split, res["keep"]["at_sync"], conts)]
    del fresh
    gc.collect()

    # wait: drained under v1
    res["wait_check"] = [{"equal_v1": {"tokens": o["tokens"], "logprobs": o["logprobs"]} == f,
                          "finish_reason": o["finish_reason"]} for o, f in zip(res["wait"]["outputs"], res["v1_fresh"])]
    res["v1_differs_from_v0"] = [{"tokens": o["tokens"], "logprobs": o["logprobs"]} for o in res["v0"]] != res["v1_fresh"]

    # abort: aborted; afterwards the engine serves v3
    fresh = engine(dirs[v3], backend=False)
    v3_fresh = outputs(fresh, max_tokens=N, ignore_eos=True)
    res["abort_check"] = [{"finish_reason": o["finish_reason"], "length": len(o["tokens"]), "seen_before_sync": s}
                          for o, s in zip(res["abort"]["outputs"], res["abort"]["at_sync"])]
    res["final_equal_v3"] = [{"tokens": o["tokens"], "logprobs": o["logprobs"]} for o in res["final_live"]] == v3_fresh
    res["n_tokens"] = N
    res["updates"] = {m: res[m]["update"] for m in ("keep", "wait", "abort")}
    res["weight_versions"] = {m: res[m]["weight_version"] for m in ("keep", "wait", "abort")}
    for m in ("v0", "final_live", "v1_fresh"):
        res.pop(m)
    for m in ("keep", "wait", "abort"):
        res[m].pop("outputs")
    report(res)


if __name__ == "__main__":
    main()
