"""Live check of the ``deltasync`` backend on an offline ``vllm.LLM`` (CPU build).

A trainer publishes versions of a tiny Qwen3; engine A follows them through vLLM's weight-transfer
calls (anchor assumed, a chain of deltas, a single delta, a corrupted version and a missing one
refused, recovery through the next anchor); a late engine C starts from the original checkpoint
without ``assume_version`` and catches up through the anchor path. The oracle for every checked
version is a fresh engine started from the trainer's weights (``save_pretrained``): greedy tokens,
top-20 log-probs and vLLM's own weight checksums must be identical. For version 0 the oracle is A
itself before its first weight-transfer call (started from version 0's checkpoint, with the backend
configured, which touches no weight until a transfer: one engine start less); so "assumed" checks
that initialising with ``assume_version`` changes nothing, and any difference between an engine
with and without the backend would show in every later check against the plain fresh engines. (vLLM's own
``reload_weights`` from disk is not used as an oracle: on the CPU build its outputs differ from a
fresh engine's.)
Usage: ``offline.py WORKDIR [TP]``.
"""

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from common import engine, outputs, perturb, report, save, tiny_qwen3  # noqa: E402
from helpers import PassThroughStore  # noqa: E402


class FlipOnPut(PassThroughStore):
    """A store that flips one byte of the objects whose key starts with ``flip`` as it writes them
    (the manifest keeps the sha256 of the intended bytes)."""

    flip: str | None = None

    def put(self, key, data):
        if self.flip is not None and key.startswith(self.flip):
            raw = bytearray(data)
            raw[len(raw) // 2] ^= 0x40
            data = bytes(raw)
        self.inner.put(key, data)


def main() -> None:
    work = Path(sys.argv[1])
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.integrations.vllm import wait_staged

    model = tiny_qwen3()
    bucket = str(work / "bucket")
    corrupting = FlipOnPut(LocalStore(bucket))
    sender = DeltaSender(model, corrupting, anchor_every=5)  # v0 and v5 are anchors
    v0 = sender.publish()
    d0 = save(model, work / "v0")
    res = {"tp": tp, "checks": []}

    a = engine(d0, tp=tp)
    # A has not touched a weight yet: a fresh engine on version 0's checkpoint, the v0 oracle. Its
    # prefix cache is dropped, so "assumed" below cannot reuse KV computed before the transfer init.
    oracles = {v0: (outputs(a), a.collective_rpc("compute_weight_checksums"))}
    a.reset_prefix_cache()

    def refused(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"[:2000]
        return None

    # Refused on every worker before init; each must leave vLLM's executor in step (with TP > 1 a
    # failure raised by every worker used to leave stale answers queued for the next call).
    res["before_init_error"] = refused(lambda: (a.start_weight_update(),
                                                a.update_weights({"update_info": {"version": v0}})))
    res["bad_init_error"] = refused(lambda: a.init_weight_transfer_engine(
        {"init_info": {"store": bucket, "in_place": "sometimes"}}))
    a.init_weight_transfer_engine({"init_info": {"store": bucket, "assume_version": v0,
                                                 "status_dir": str(work / "status-a"),
                                                 "metrics_path": str(work / "a-{rank}.jsonl")}})

    def commit(llm, v):
        if llm is a:  # staged (and its modules re-packed) before the pause, as a driver would wait
            wait_staged(work / "status-a", v, timeout_s=120)
        t = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": v}})
        llm.finish_weight_update(weight_version=str(v))
        llm.reset_prefix_cache()
        return (time.perf_counter() - t) * 1e3

    def oracle(v):
        """Outputs and vLLM checksums of a fresh engine on the trainer's weights at ``v``."""
        if v not in oracles:
            d = save(model, work / f"v{v}")
            fresh = engine(d, backend=False, tp=tp)
            oracles[v] = (outputs(fresh), fresh.collective_rpc("compute_weight_checksums"))
            del fresh
            gc.collect()
        return oracles[v]

    def compare(tag, v):
        oa, ca = outputs(a), a.collective_rpc("compute_weight_checksums")
        ob, cb = oracle(v)
        res["checks"].append({"tag": tag, "version": v, "outputs_equal": oa == ob, "checksums_equal": ca == cb,
                              "weight_version": a.get_weight_version(), "tokens": oa[0]["tokens"]})

    compare("assumed", v0)
    perturb(model, seed=1)
    sender.publish()
    perturb(model, seed=2)
    v2 = sender.publish()
    res["chain_ms"] = commit(a, v2)
    compare("chain", v2)
    res["oracle_v0_differs_from_v2"] = oracle(v0)[0] != oracle(v2)[0]
    perturb(model, seed=3)
    v3 = sender.publish()
    oracle(v3)  # before the model moves on
    res["delta_ms"] = commit(a, v3)
    compare("delta", v3)

    # A corrupted version: one byte of its delta object flipped on its way into the store (so no
    # worker can stage it before the flip); refused, engine keeps v3.
    perturb(model, seed=4)
    corrupting.flip = "objects/000000000004/delta-"
    v4 = sender.publish()
    corrupting.flip = None
    try:
        a.start_weight_update()
        a.update_weights({"update_info": {"version": v4}})
        res["corrupt_error"] = None
    except Exception as e:  # noqa: BLE001
        res["corrupt_error"] = f"{type(e).__name__}: {e}"[:2000]
    compare("after_corrupt", v3)
    res["version_after_corrupt"] = a.get_weight_version()

    # Bad update_info: a version never published.
    try:
        a.start_weight_update()
        a.update_weights({"update_info": {"version": 999}})
        res["missing_error"] = None
    except Exception as e:  # noqa: BLE001
        res["missing_error"] = f"{type(e).__name__}: {e}"[:2000]
    compare("after_missing", v3)
    res["bad_update_info_error"] = refused(lambda: (a.start_weight_update(),
                                                    a.update_weights({"update_info": {"version": "4"}})))

    # v5 is an anchor (anchor_every=5): the way past the unreadable v4.
    perturb(model, seed=5)
    v5 = sender.publish()
    res["recover_ms"] = commit(a, v5)
    compare("recovered", v5)

    # A late engine: starts from v0's checkpoint, no assume_version -> anchor path to the newest.
    # It re-packs inside the commit (reload_ahead "never"), as vLLM's layerwise reload does; A re-packs
    # on copies while staging (the default).
    c = engine(d0, tp=tp)
    c.init_weight_transfer_engine({"init_info": {"store": bucket, "reload_ahead": "never",
                                                 "metrics_path": str(work / "c-{rank}.jsonl")}})
    commit(c, v5)
    res["late_equal"] = outputs(c) == oracle(v5)[0]
    res["late_version"] = c.get_weight_version()

    # vLLM's stateful trainer API, backend "deltasync": send_weights() publishes and commits.
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from torch_deltasync.integrations.vllm import DeltaSyncTrainerInitInfo

    class Client:  # vLLM's VLLMWeightSyncClient protocol over the offline LLM
        def init_weight_transfer_engine(self, init_info):
            a.init_weight_transfer_engine({"init_info": init_info})

        def start_weight_update(self):
            a.start_weight_update()

        def update_weights(self, update_info):
            a.update_weights({"update_info": update_info})

        def finish_weight_update(self, weight_version=None):
            a.finish_weight_update(weight_version=weight_version)
            a.reset_prefix_cache()

    sender.close()  # the trainer engine publishes from here on, as the next versions of the run
    trainer = WeightTransferTrainerFactory.trainer_init(
        DeltaSyncTrainerInitInfo(store=bucket, anchor_every=5, rank=0), client=Client(), source=ModuleSource(model))
    perturb(model, seed=6)
    v6 = trainer.send_weights()
    compare("trainer_engine", v6)
    trainer.shutdown()
    for name in ("a", "c"):  # how each commit reloaded the re-packed modules, per worker
        res[f"{name}_reloads"] = [[{"version": e["version"], "staged_ahead": e["staged_ahead"], **e["reload"]}
                                   for e in map(json.loads, f.read_text().splitlines()) if e["event"] == "commit"]
                                  for f in sorted(work.glob(f"{name}-*.jsonl"))]
    report(res)


if __name__ == "__main__":
    main()
