"""A vLLM OpenAI-compatible server as a child of a generator actor: started, health-checked, stopped,
and never left behind.

Process tree (one per generator replica)::

    generator actor (Monarch proc, .venv)
      └─ supervisor: <vllm python> recipes/grpo/vllm_server.py --log L -- <server args>   (stdin: a pipe)
           └─ python -m vllm.entrypoints.openai.api_server ...  (own process group, with its engine core)

The supervisor holds the only reference to the server's process group. It ends the group (SIGTERM,
then SIGKILL after ``--grace`` seconds) when its stdin reaches end-of-file, which happens whenever the
actor's process goes away, however it goes (``stop()``, an exception, Ctrl-C, SIGKILL: the kernel
closes the pipe), and when it receives SIGTERM/SIGINT itself; then it deletes ``--remove-when-done``
(the temporary checkpoint the server loaded). When the server exits on its own the
supervisor exits with its status, so :meth:`VLLMServer.alive` turns false and the actor reports the
replica as lost.

This file runs under the vLLM environment's Python as a script (standard library only at import);
:class:`VLLMServer` is what the actor uses (it needs no vLLM import).

Server flags (``docs/vllm.md``): ``VLLM_SERVER_DEV_MODE=1`` enables the RL routes (``/pause``,
``/init_weight_transfer_engine``, ``/update_weights``, ...) and must only be exposed on a private
interface: the server binds 127.0.0.1. ``--weight-transfer-config '{"backend": "deltasync"}'`` selects
torch_deltasync's backend; ``--logprobs-mode processed_logprobs`` (the default of
:class:`VLLMServer`) returns the log-probs of the distribution actually sampled from (after
temperature), which truncated importance sampling needs;
``--enable-scale-out`` serves vLLM's token API (``/inference/v1/generate``), whose completions carry
the weight version of every output token (:meth:`VLLMServer.generate`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["VLLMServer", "ServerDied", "default_vllm_python", "free_port"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_vllm_python() -> str:
    """``$TORCH_DELTASYNC_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of this checkout, else the one
    beside the running environment (``tools/setup.sh`` builds ``.venv`` and ``.venv-vllm`` side by side)."""
    env = os.environ.get("TORCH_DELTASYNC_VLLM_PYTHON")
    if env:
        return env
    for root in (REPO_ROOT, Path(sys.prefix).parent):
        cand = root / ".venv-vllm" / "bin" / "python"
        if cand.exists():
            return str(cand)
    return str(REPO_ROOT / ".venv-vllm" / "bin" / "python")


class ServerDied(RuntimeError):
    """The server process is gone (or never came up); the message has its exit status and log path."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM OpenAI server on 127.0.0.1 under a supervisor (see the module docstring).

    Args:
        model_dir: Hugging Face checkpoint folder the server loads (``config.json`` + safetensors).
        log_path: the server's stdout/stderr go here.
        python: the vLLM environment's interpreter (:func:`default_vllm_python`).
        seed: the engine's sampling seed.
        max_model_len: context length (tokens); ``None``: the checkpoint's ``max_position_embeddings``.
        deltasync: run the ``deltasync`` weight-transfer backend (``False``: a plain engine, e.g. a
            fresh oracle).
        start_timeout_s: seconds to wait for ``/health``.
        extra_args: further server flags.
        remove_when_done: a folder the supervisor deletes once the server has ended (e.g. the
            temporary checkpoint it loaded), whichever way the server ends.
        cpus: the cores the engine's OpenMP threads are bound to (vLLM's
            ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-3"``; the environment's value wins).
            ``None``: vLLM's automatic binding, which puts every single-rank CPU server on core 0.
        logprobs_mode: vLLM's ``--logprobs-mode``: ``"processed_logprobs"`` (after temperature, what
            truncated importance sampling needs) or ``"raw_logprobs"`` (the model's, as an offline
            ``vllm.LLM`` returns them by default).
        env: further environment variables of the server (e.g. ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

    Raises:
        ServerDied: the server exited before answering ``/health``, or did not answer within
            ``start_timeout_s`` (then it is stopped); the message names the log.
        FileNotFoundError: ``python`` does not exist (build ``.venv-vllm`` with ``tools/setup.sh``).
    """

    def __init__(self, model_dir: str, log_path: str | Path, *, python: str | None = None, seed: int = 0,
                 max_model_len: int | None = None, deltasync: bool = True, start_timeout_s: float = 600.0,
                 extra_args: list[str] | None = None, remove_when_done: str | None = None,
                 cpus: str | None = None, logprobs_mode: str = "processed_logprobs",
                 env: dict[str, str] | None = None) -> None:
        python = python or default_vllm_python()
        if not Path(python).exists():
            raise FileNotFoundError(f"vLLM interpreter {python} does not exist: run `bash tools/setup.sh` (it builds "
                                    ".venv-vllm) or set TORCH_DELTASYNC_VLLM_PYTHON")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log_path = Path(log_path)
        args = ["--model", self.model, "--served-model-name", "policy", "--host", "127.0.0.1", "--port",
                str(self.port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
                *(["--max-model-len", str(max_model_len)] if max_model_len else []), "--seed", str(seed), "--logprobs-mode", logprobs_mode,
                "--disable-log-stats", "--uvicorn-log-level", "warning", "--enable-scale-out", *(extra_args or [])]
        if deltasync:
            args += ["--weight-transfer-config", json.dumps({"backend": "deltasync"})]
        extra_env, env = env, {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
                       filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        if cpus is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # the caller's setting wins
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        env.update(extra_env or {})
        sup = [python, __file__, "--log", str(self.log_path)]
        if remove_when_done:
            sup += ["--remove-when-done", str(remove_when_done)]
        self.proc = subprocess.Popen([*sup, "--", *args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.server_pid: int | None = None
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerDied(f"the vLLM server {_status(self.proc.returncode)} before it answered "
                                 f"/health (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerDied(f"the vLLM server did not answer {self.url}/health within {start_timeout_s:.0f} s "
                                 f"(log: {self.log_path})")
            time.sleep(0.1)
        pid_file = self.log_path.with_suffix(".pid")
        if pid_file.exists():
            self.server_pid = int(pid_file.read_text())

    def alive(self) -> bool:
        """Whether the server (its supervisor) is still running."""
        return self.proc.poll() is None

    def check_alive(self) -> None:
        """Raises:
            ServerDied: the server is gone (exit status and log path in the message)."""
        if not self.alive():
            raise ServerDied(f"the vLLM server at {self.url} (pid {self.server_pid}) "
                             f"{_status(self.proc.returncode)} (log: {self.log_path})")

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the server and its engine processes; idempotent. Closing the supervisor's stdin is the
        signal; SIGKILL to the supervisor's group if it does not finish in ``timeout_s``."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            for pgid in (self.proc.pid, self.server_pid):
                if pgid:
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.proc.wait(30)

    # -- HTTP ---------------------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 120.0) -> Any:
        """GET ``path`` (e.g. ``/weight_info``), return the JSON answer.

        Raises:
            ServerDied: the server is gone.
            RuntimeError: an HTTP error (the server's message) or an unreachable live server.
        """
        return self._call(urllib.request.Request(self.url + path), timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> Any:
        """POST JSON, return the JSON answer.

        Raises:
            ServerDied: the server is gone.
            RuntimeError: an HTTP error (the server's message) or an unreachable live server.
        """
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        return self._call(req, timeout)

    def _call(self, req: urllib.request.Request, timeout: float) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (our own child)
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{req.get_method()} {req.full_url}: HTTP {e.code}: {e.read()[:2000]!r}") from None
        except OSError as e:
            try:  # a server that just died: let its supervisor finish, then say so
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self.check_alive()
            raise RuntimeError(f"{req.get_method()} {req.full_url}: {e}") from None

    def generate(self, prompt: list[int], *, max_tokens: int, temperature: float, n: int = 1,
                 stop_token_ids: list[int] | None = None) -> list[dict[str, Any]]:
        """vLLM's token API (``POST /inference/v1/generate``, served with ``--enable-scale-out``): ``n``
        sampled completions of one token-id prompt, each with its per-token weight versions.

        Returns:
            ``[{"tokens": [int], "logprobs": [float], "finish_reason": str, "versions": [{"version":
            str, "start": int, "end": int}]}]`` in choice order: sampled token ids, their log-probs
            (as ``logprobs_mode`` sets them; by default processed: after temperature), why it ended
            (``"abort"``: a ``/pause?mode=abort`` cut it short) and the engine's spans of output
            tokens per weight version.
        """
        body = {"token_ids": list(prompt), "sampling_params": {
            "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "logprobs": 0,
            "stop_token_ids": list(stop_token_ids or []), "skip_special_tokens": False}}
        out = []
        for c in sorted(self.post("/inference/v1/generate", body)["choices"], key=lambda c: c["index"]):
            content = (c.get("logprobs") or {}).get("content") or []
            out.append({"tokens": list(c.get("token_ids") or []), "logprobs": [float(x["logprob"]) for x in content],
                        "finish_reason": c.get("finish_reason"), "versions": c.get("weight_versions") or []})
        return out

    def complete(self, prompts: list[list[int]], *, max_tokens: int, temperature: float,
                 stop_token_ids: list[int] | None = None, logprobs: int = 0,
                 top_logprobs: bool = False, model: str = "policy") -> list[dict[str, Any]]:
        """``/v1/completions`` on token-id prompts, one choice each, in prompt order. ``model``: the
        served model (``"policy"``) or a LoRA adapter the server loaded (its ``lora_name``).

        Returns:
            ``[{"tokens": [int], "logprobs": [float], "finish_reason": str, "top": [...]}]``:
            sampled token ids, their log-probs (as ``logprobs_mode`` sets them; by default processed:
            after temperature) and, with ``top_logprobs``, the top-``logprobs`` ``{token: logprob}``
            of every step.
        """
        body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": 1.0, "logprobs": logprobs, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "stop_token_ids": list(stop_token_ids or []), "skip_special_tokens": False}
        choices = sorted(self.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            lp = c.get("logprobs") or {}
            rec = {"tokens": list(c["token_ids"]), "logprobs": [float(x) for x in lp.get("token_logprobs") or []],
                   "finish_reason": c.get("finish_reason")}
            if top_logprobs:
                rec["top"] = [sorted((int(t.split(":", 1)[1]), float(v).hex()) for t, v in step.items())
                              for step in lp.get("top_logprobs") or []]
            out.append(rec)
        return out


# --- the supervisor (runs under the vLLM environment's Python) --------------------------------------


def _status(code: int | None) -> str:
    """How the server ended, from its supervisor's exit status (which passes the server's on: a
    server killed by signal ``n`` is ``128 + n``, as in a shell)."""
    if code is not None and code > 128:
        try:
            return f"was killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exited with status {code}"


def _supervise(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="run a vLLM OpenAI server; end it when stdin closes")
    p.add_argument("--log", required=True)
    p.add_argument("--grace", type=float, default=20.0)
    p.add_argument("--remove-when-done", default=None)
    p.add_argument("server_args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    args = [a for a in ns.server_args if a != "--"] if ns.server_args[:1] == ["--"] else ns.server_args
    log = open(ns.log, "w")
    child = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    Path(ns.log).with_suffix(".pid").write_text(str(child.pid))
    done = threading.Event()
    # A second caller (the main thread once the server exits, while the stdin thread is still in its
    # grace period) waits until the first has ended the group, so the process never exits before
    # the SIGKILL that takes the engine core with it. Re-entrant: a signal handler runs in the main
    # thread, possibly while it holds the lock.
    ending = threading.RLock()

    def end(*_: Any) -> None:
        with ending:
            if done.is_set():
                return
            done.set()
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                child.wait(ns.grace)
            except subprocess.TimeoutExpired:
                pass
            try:  # the engine core may outlive the API process
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(1024):
                pass
        except OSError:
            pass
        end()

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    threading.Thread(target=watch_stdin, daemon=True).start()
    rc = child.wait()
    end()  # the group's other processes (engine core) go with the server
    if ns.remove_when_done:
        import shutil

        shutil.rmtree(ns.remove_when_done, ignore_errors=True)
    return 128 - rc if rc < 0 else rc  # killed by signal n: 128 + n, as a shell reports it


if __name__ == "__main__":
    code = _supervise(sys.argv[1:])
    sys.stdout.flush()
    # Not sys.exit: the stdin thread may still be blocked in a read, and interpreter shutdown then
    # aborts (SIGABRT, "could not acquire lock for <_io.BufferedReader name='<stdin>'>"), which hid
    # the server's own status behind -6. Everything the supervisor owns has ended by now.
    os._exit(code)
