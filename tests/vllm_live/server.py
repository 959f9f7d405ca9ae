"""Live check of ``attach_server`` / ``update_server``: vLLM's OpenAI server (CPU build) driven only
through its RL routes.

The server runs as ``python -m vllm.entrypoints.openai.api_server ... --weight-transfer-config
'{"backend": "deltasync"}'`` with ``VLLM_SERVER_DEV_MODE=1`` on 127.0.0.1 (stopped, with its engine
process, on every exit path). A trainer publishes a chain (v1, v2); one ``update_server`` commits
the newest; completions (token-id prompts through ``/v1/completions``: greedy tokens and top-20
log-probs) must equal a fresh engine started from the trainer's v2 weights, and ``/weight_info``
must say ``"2"``. Then a version never published: the raised error carries the server's reason, and
the engine keeps serving v2 (``/weight_info`` and outputs unchanged).
Usage: ``server.py WORKDIR``.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PROMPTS, engine, outputs, perturb, report, save, tiny_qwen3  # noqa: E402

READY = "Application startup complete"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The OpenAI server in its own process group; ``stop()`` ends it and its engine process."""

    def __init__(self, model_dir: str, log_path: Path, timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--dtype", "bfloat16",
               "--enforce-eager", "--max-model-len", "256", "--seed", "0",
               "--weight-transfer-config", json.dumps({"backend": "deltasync"})]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        lines: queue.Queue = queue.Queue()

        def pump():  # copy the server's output to the log; hand lines to the waiter
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        while True:  # the server says when it listens; it may also die first
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout_s} s (log: {log_path})") from None
            if line is None:
                self.stop()
                raise RuntimeError(f"the server exited with {self.proc.wait()} before it started (log: {log_path})")
            if READY in line:
                break
        # uvicorn logs READY just before it listens on the socket vLLM bound: poll until it answers
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server does not answer on {self.url}/health (log: {log_path})")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        try:  # the engine core may outlive the API process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=120) as r:
            return json.loads(r.read())

    def completions(self, prompts=PROMPTS, max_tokens: int = 8, logprobs: int = 20):
        """Greedy completions of token-id prompts, in ``common.outputs``' format."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": logprobs, "return_token_ids": True, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choices = sorted(json.loads(r.read())["choices"], key=lambda c: c["index"])
        return [{"tokens": list(c["token_ids"]),
                 "logprobs": [sorted((int(t.split(":", 1)[1]), float(lp).hex()) for t, lp in step.items())
                              for step in c["logprobs"]["top_logprobs"]]} for c in choices]


def main() -> None:
    work = Path(sys.argv[1])
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.integrations.vllm import attach_server, update_server

    model = tiny_qwen3()
    bucket = str(work / "bucket")
    sender = DeltaSender(model, LocalStore(bucket), anchor_every=50)
    v0 = sender.publish()
    d0 = save(model, work / "v0")
    res = {}
    server = Server(d0, work / "server.log")
    try:
        server.model = d0
        res["weight_info_start"] = server.get("/weight_info")["weight_version"]
        before = server.completions()
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
        after = server.completions()
        try:
            update_server(server.url, 999, mode="keep")
            res["missing_error"] = None
        except Exception as e:  # noqa: BLE001
            res["missing_error"] = f"{type(e).__name__}: {e}"[:2000]
        res["weight_info_after_missing"] = server.get("/weight_info")["weight_version"]
        after_missing = server.completions()
        res["commits"] = [json.loads(ln) for ln in (work / "commits-0.jsonl").read_text().splitlines()]
    finally:
        server.stop()
    res["server_stopped"] = server.proc.poll() is not None
    fresh = engine(d2, backend=False)
    oracle = outputs(fresh)
    res["outputs_equal"] = after == oracle
    res["outputs_equal_after_missing"] = after_missing == oracle
    res["oracle_differs_from_v0"] = before != oracle
    res["v2"] = v2
    report(res)


if __name__ == "__main__":
    main()
