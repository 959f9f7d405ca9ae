"""Live check of ``attach_server`` / ``update_server``: vLLM's OpenAI server (CPU build) driven only
through its RL routes.

The server is the GRPO recipe's :class:`~recipes.grpo.vllm_server.VLLMServer` (``python -m
vllm.entrypoints.openai.api_server ... --weight-transfer-config '{"backend": "deltasync"}'`` with
``VLLM_SERVER_DEV_MODE=1`` on 127.0.0.1, under a supervisor that stops it, with its engine process,
on every exit path), here with raw log-probs. A trainer publishes a chain (v1, v2); one ``update_server`` commits
the newest; completions (token-id prompts through ``/v1/completions``: greedy tokens and top-20
log-probs) must equal a fresh engine started from the trainer's v2 weights, and ``/weight_info``
must say ``"2"``. Then a version never published: the raised error carries the server's reason, and
the engine keeps serving v2 (``/weight_info`` and outputs unchanged).
Usage: ``server.py WORKDIR [STORE]``: the run's store, a local folder under ``WORKDIR`` by default, or a
URI (``s3://bucket/prefix``: endpoint and credentials from the environment, ``AWS_ENDPOINT_URL``, ...),
which the trainer here and the server's engine each open.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository root: recipes
from common import PROMPTS, engine, outputs, perturb, report, save, tiny_qwen3  # noqa: E402

from helpers import group_members  # noqa: E402
from recipes.grpo.vllm_server import VLLMServer  # noqa: E402  (the recipe's server, supervised: no orphans)


def completions(server: VLLMServer, prompts=PROMPTS, max_tokens: int = 8, logprobs: int = 20):
    """Greedy completions of token-id prompts through ``/v1/completions``, in ``common.outputs``' format."""
    out = server.complete(prompts, max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, top_logprobs=True)
    return [{"tokens": c["tokens"], "logprobs": c["top"]} for c in out]


def main() -> None:
    work = Path(sys.argv[1])
    from torch_deltasync import DeltaSender, open_store
    from torch_deltasync.integrations.vllm import attach_server, update_server

    model = tiny_qwen3()
    bucket = sys.argv[2] if len(sys.argv) > 2 else str(work / "bucket")
    sender = DeltaSender(model, open_store(bucket), anchor_every=50)
    v0 = sender.publish()
    d0 = save(model, work / "v0")
    res = {}
    # raw log-probs, as the offline oracle engine returns them
    server = VLLMServer(d0, work / "server.log", python=sys.executable, max_model_len=256, start_timeout_s=300,
                        logprobs_mode="raw_logprobs")
    try:
        res["weight_info_start"] = server.get("/weight_info")["weight_version"]
        before = completions(server)
        info = attach_server(server.url, bucket, assume_version=v0, metrics_path=str(work / "commits-{rank}.jsonl"))
        res["readiness_files"] = sorted(p.name for p in Path(info["status_dir"]).glob("rank-*.json"))
        perturb(model, seed=1)
        sender.publish()
        perturb(model, seed=2)
        v2 = sender.publish()
        d2 = save(model, work / f"v{v2}")
        upd = update_server(server.url, mode="wait")  # the newest: v2
        res["update"] = upd.to_dict()
        res["weight_info"] = server.get("/weight_info")["weight_version"]
        after = completions(server)
        try:
            update_server(server.url, 999, mode="keep")
            res["missing_error"] = None
        except Exception as e:  # noqa: BLE001
            res["missing_error"] = f"{type(e).__name__}: {e}"[:2000]
        res["weight_info_after_missing"] = server.get("/weight_info")["weight_version"]
        after_missing = completions(server)
        res["commits"] = [json.loads(ln) for ln in (work / "commits-0.jsonl").read_text().splitlines()]
    finally:
        server.stop()
    # stop() ends the supervisor; the API server's process group, engine core included, must go too
    deadline = time.monotonic() + 10
    while server.server_pid is not None and group_members(server.server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    res["server_stopped"] = not server.alive() and server.server_pid is not None and not group_members(server.server_pid)
    fresh = engine(d2, backend=False)
    oracle = outputs(fresh)
    res["outputs_equal"] = after == oracle
    res["outputs_equal_after_missing"] = after_missing == oracle
    res["oracle_differs_from_v0"] = before != oracle
    res["v2"] = v2
    res["published"] = sorted(sender.store.list(""))
    report(res)


if __name__ == "__main__":
    main()
