"""``recipes/async_grpo_lora.py`` end to end on CPU: a LoRA GRPO trainer, two rollout worker
processes, the HTTP rollout service and adapter versions through a local store. The short
configuration runs in CI; the default one (behind ``slow``) must also learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def run_recipe(run_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "async_grpo_lora.py"), "--run-dir", str(run_dir),
                           *extra], env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + "".join(
        p.read_text()[-2000:] for p in run_dir.glob("worker-*.log"))
    return proc, json.loads((run_dir / "summary.json").read_text())


# hf: PEFT workers, the adapter updated in place; vllm: a live vllm serve per worker (.venv-vllm), every
# version hot-swapped in through the runtime LoRA routes
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_short_configuration_reports_reward_bytes_and_lag(tmp_path, engine):
    steps, max_lag = 10, 2
    proc, s = run_recipe(tmp_path, "--steps", str(steps), "--batch", "16", "--prompts", "4", "--group", "4",
                         "--max-lag", str(max_lag), "--engine", engine)
    assert "reward" in proc.stdout and "adapter bytes per version" in proc.stdout and "lag: mean" in proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps)) and [r["version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0 <= r["lag_mean"] <= r["lag_max"] <= max_lag
        assert r["adapter_nbytes"] > r["adapter_objects_nbytes"] > 0 and r["kind"] in ("anchor", "delta")
    # one row per version (0 .. steps), bytes as published in the store
    versions = s["adapter_bytes_per_version"]
    assert [v for v, _, _ in versions] == list(range(steps + 1)) and all(b > 0 for _, _, b in versions)
    assert s["adapter_full_nbytes"] == 2 * 16384  # rank 8 on 7 projections of 2 layers, bf16
    assert 0.0 <= s["reward_first"] <= 1.0 and 0.0 <= s["reward_last"] <= 1.0
    assert 0 <= s["lag_mean"] <= s["lag_max"] <= max_lag
    e = s["episodes"]
    assert e["unaccounted"] == 0 and e["sampled"] == 16 * steps
    assert e["accepted"] == e["sampled"] + e["dropped_stale"] + e["evicted"] + e["size"]
    assert s["final_adapter_bit_exact"] is True and s["workers_exit_codes"] == [0, 0]
    # The recipe's own flag aside: the adapter materialised from the store is the trainer's, bit for bit.
    import torch
    from safetensors.torch import load_file

    want = {n: t.to(torch.bfloat16).view(torch.int16) for n, t in load_file(str(tmp_path / "trainer_adapter.safetensors")).items()}
    got = load_file(str(tmp_path / "final_adapter" / "adapter_model.safetensors"))
    assert want and got.keys() == want.keys()
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n].view(torch.int16), want[n]) for n in want)
    # Each worker that posted followed the adapter versions from the anchor on. On 2 busy cores a
    # worker can start after the trainer's last step (its first post then meets a closed service and it
    # exits 0 without a line), so only one of the two must have posted.
    posted = 0
    for i in range(2):
        lines = [json.loads(x) for x in (tmp_path / f"worker-{i}.jsonl").read_text().splitlines()]
        if lines:
            posted += 1
            assert lines[0]["update"]["path"] == "anchor"
            assert [x["version"] for x in lines] == sorted(x["version"] for x in lines)
            updates = [x["update"] for x in lines if x["update"]]
            # a vLLM worker's update is a whole swap: store reads, apply, folder write, the server's load
            assert all((u.get("load_ms", 0) > 0) == (engine == "vllm") for u in updates)
        assert "stopped by the trainer" in (tmp_path / f"worker-{i}.log").read_text()
    assert posted >= 1
    assert s["engine"] == engine and s["worker_updates"]["count"] >= posted
    assert ("load_ms" in s["worker_updates"]) == (engine == "vllm")
    assert sorted(p.name for p in tmp_path.glob("vllm-worker-*.log")) == (
        ["vllm-worker-0.log", "vllm-worker-1.log"] if engine == "vllm" else [])
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert len((tmp_path / "publish.jsonl").read_text().splitlines()) == steps + 1


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_default_configuration_learns(tmp_path, engine):
    _, s = run_recipe(tmp_path, "--engine", engine)
    assert s["steps"] == 150 and s["reward_last"] > s["reward_first"] + 0.05, s


@pytest.mark.parametrize("args, message", [
    (["--batch", "16"], "the service ring holds 32 episodes (2 x --batch), fewer than one worker post of --prompts x "
                        "--group = 64"),  # the workers used to die on HTTP 422, the trainer saying only that one exited
    (["--capacity", "10"], "the service ring holds 10 episodes (--capacity)"),
    (["--group", "1"], "--group must be at least 2 (completions per prompt, compared with each other), got 1"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--startup-timeout", "0"], "--startup-timeout must be a positive finite number, got 0.0"),
    (["--max-lag", "-1"], "--max-lag and --warmup-steps must be >= 0, got -1 and 15"),
    (["--prefix", "../x"], "--prefix: '../x' is not a valid path inside a store: segment '..' is not allowed"),
    (["--store", "memory://x"], "--store memory://... lives inside one process"),  # waited out --startup-timeout
    (["--store", "s3:/b/x"], "'s3:/b/x' looks like a URI that lost a slash"),
    (["--engine", "vllm", "--vllm-python", "/nonexistent/python"], "--engine vllm: vLLM's interpreter /nonexistent/python "
                                                                   "does not exist"),
    (["--digits", "33"], "--digits must be at most 32, got 33"),  # was a ValueError traceback after start-up
    (["--engine", "vllm", "--rank", "513"], "--engine vllm: --rank 513 is above vLLM's largest --max-lora-rank (512)"),
])
def test_bad_arguments_are_named_before_anything_starts(args, message, capsys):
    from recipes.async_grpo_lora import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--batch", "16", "--prompts", "4", "--group", "4"]).batch == 16


@pytest.mark.parametrize("role", ["trainer", "run"])
def test_a_prefix_holding_an_earlier_run_is_refused_before_anything_starts(tmp_path, role, capsys):
    """A trainer restarted on a prefix silently trained on the earlier run's episodes (the service
    still held them, tagged with versions that looked fresh) and its workers kept the earlier base."""
    from recipes.async_grpo_lora import main
    from torch_deltasync import DeltaSender

    store = tmp_path / "store"
    sender = DeltaSender({"w": torch.zeros(4)}, str(store), prefix="lora-grpo")
    sender.publish()
    sender.publish()
    sender.close()
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    extra = ["--service-url", "http://127.0.0.1:9"] if role == "trainer" else []
    assert main([role, "--store", str(store), "--run-dir", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert f"{store} prefix 'lora-grpo' already holds adapter versions 0..1 of an earlier run" in err
    assert "Use a new --prefix" in err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("role", ["trainer", "worker"])
def test_the_apart_roles_need_a_service_and_a_store(tmp_path, role, capsys):
    from recipes.async_grpo_lora import main

    with pytest.raises(SystemExit) as e:
        main([role, "--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2  # a usage error (it exited 1)
    assert f"{role}: --service-url and --store are required" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
