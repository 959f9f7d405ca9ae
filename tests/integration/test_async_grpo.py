"""Integration tests of ``python -m recipes.async_grpo``: a short run with an FSDP2 trainer mesh,
and a generator killed mid-run (single-process trainer). Each test runs the recipe as a subprocess
(its own Monarch client) on a small configuration and checks the summary, the metrics and the
outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Small and quick: 64-wide Qwen3, 3-digit sorting, 24-sample steps.
SMALL = ["--hidden-size", "64", "--digits", "3", "--warmstart-steps", "60", "--train-batch", "24",
         "--prompts-per-batch", "3", "--group-size", "8", "--no-progress", "--call-timeout", "120"]


def recipe(tmp_path: Path, *args: str) -> dict:
    """``subprocess`` keywords that run the recipe on the small configuration, run name ``t`` under
    ``tmp_path``: ``args`` (the command), ``cwd`` and ``env``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "recipes.async_grpo", "--runs-dir", str(tmp_path), "--run-name", "t", *SMALL, *args]
    return {"args": cmd, "cwd": REPO, "env": env}


def run_recipe(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(**recipe(tmp_path, *args), capture_output=True, text=True, timeout=timeout)
    summary_path = tmp_path / "t" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def assert_generators_hold_the_trainers_bits(tmp_path: Path, generators: list[int]) -> None:
    """Read the weights the recipe saved at the end and compare bits here, independently of its own
    ``bit_exact`` flag: every listed generator serves the trainer's fp32 weights cast to bf16."""
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "t" / "weights"
    want = {n: t.to(torch.bfloat16).view(torch.int16) for n, t in load_file(str(folder / "trainer.safetensors")).items()}
    assert want
    for i in generators:
        got = load_file(str(folder / f"generator{i}.safetensors"))
        assert got.keys() == want.keys(), i
        bad = [n for n in want if not torch.equal(got[n].view(torch.int16), want[n])]
        assert not bad, f"generator {i}: {bad[:5]}"


def ctrl_c_enabled() -> None:
    """In the child, before exec: SIGINT unblocked and back to its default disposition, as in a
    terminal. A shell without job control starts background commands (a CI script started with
    ``&``) with SIGINT ignored, the children inherit that, and a Python started so never sees the
    Ctrl-C the test sends: in the clean-clone CI run the recipe trained on to its last step (run
    under ``timeout``, which resets it, the test passed)."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def events(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_short_run_syncs_bit_exactly_and_reports(tmp_path):
    # Two trainer procs: the policy is FSDP2-sharded and every rank publishes its own shard.
    steps = 12
    stale = tmp_path / "t" / "weights" / "generator2.safetensors"  # an earlier run's (it had 3 generators)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not this run's")
    proc, s = run_recipe(tmp_path, "--steps", str(steps), "--max-staleness", "1", "--generators", "2",
                         "--trainer-procs", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert s["status"] == "ok"
    assert s["steps"] == steps
    assert s["versions_published"] == steps + 1  # version 0 (anchor) + one per step
    assert 0.0 <= s["reward_first"] <= 1.0 and 0.0 <= s["reward_last"] <= 1.0
    assert 0.0 < s["mean_density"] < 1.0
    assert 0.0 < s["bytes_ratio"] < 1.5
    assert s["max_staleness"] == 1
    assert 0 <= s["max_policy_lag"] <= 1
    assert isinstance(s["dropped_stale"], int) and s["dropped_stale"] >= 0
    assert s["bit_exact"] is True
    assert s["generators_alive"] == 2 and s["generators_lost"] == []
    assert s["trainer_procs"] == 2
    # The digests behind bit_exact: every generator holds the trainer's bf16 bits.
    d = s["digests"]
    assert d["generator0"] == d["trainer"] == d["generator1"]
    assert_generators_hold_the_trainers_bits(tmp_path, [0, 1])
    assert not stale.exists()  # an earlier run's weights cannot pass for this one's

    steps_ev = events(tmp_path, "step")
    assert [e["step"] for e in steps_ev] == list(range(steps))
    assert all(e["lag_max"] <= 1 for e in steps_ev)
    pubs = events(tmp_path, "publish")
    assert [p["version"] for p in pubs] == list(range(steps + 1))
    assert pubs[0]["kind"] == "anchor" and all(p["kind"] == "delta" for p in pubs[1:])
    assert all(0 < p["changed"] < p["numel"] for p in pubs[1:])
    # reward_first / reward_last are the means over the first / last 10% of steps (here 2 steps each).
    rewards = [e["reward"] for e in steps_ev]
    assert s["reward_first"] == pytest.approx(sum(rewards[:2]) / 2)
    assert s["reward_last"] == pytest.approx(sum(rewards[-2:]) / 2)
    ups = events(tmp_path, "update")
    assert {u["generator"] for u in ups} == {0, 1}
    assert all(u["version"] <= steps for u in ups)
    for name in ("reward.png", "sync.png"):
        assert (tmp_path / "t" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bit-exact (every live generator vs trainer bf16): YES" in proc.stdout
    assert "step  ver reward" in proc.stdout  # the per-step table


def test_killed_generator_is_reported_and_the_run_continues(tmp_path):
    steps = 16
    proc, s = run_recipe(tmp_path, "--steps", str(steps), "--generators", "2", "--kill-generator", "1",
                         "--kill-at-step", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert s["status"] == "ok" and s["steps"] == steps
    assert s["generators_alive"] == 1
    [lost] = s["generators_lost"]
    assert lost["generator"] == 1 and lost["step"] >= 2
    assert "SupervisionError" in lost["error"] or "failed" in lost["error"]
    assert f"generator 1 (pid {lost['pid']}) lost at GRPO step" in proc.stdout
    assert "continuing with 1 of 2 replicas" in proc.stdout
    assert s["bit_exact"] is True and "generator1" not in s["digests"]
    assert_generators_hold_the_trainers_bits(tmp_path, [0])
    assert not (tmp_path / "t" / "weights" / "generator1.safetensors").exists()
    assert s["max_policy_lag"] <= s["max_staleness"]


def test_losing_every_generator_stops_with_a_message(tmp_path):
    proc, s = run_recipe(tmp_path, "--steps", "200", "--generators", "1", "--kill-generator", "0",
                         "--kill-at-step", "2")
    assert proc.returncode == 1
    assert "all 1 generator replicas are lost" in proc.stdout
    assert s["status"] == "aborted" and s["bit_exact"] is None and s["steps"] < 200
    assert "bit-exact (every live generator vs trainer bf16): not checked" in proc.stdout


def test_stores_open_store_accepts_are_buckets(tmp_path, capsys):
    """What the recipe's --bucket check lets through: what ``open_store`` opens (other object stores
    where their fsspec package is installed: not built, as gcsfs and adlfs may connect then), a
    folder under ~, and a relative one. A store whose package is missing is a usage error at once
    (it was an 80-line actor traceback after the warm start)."""
    import importlib.util

    from recipes.async_grpo import build_parser, config_from_args

    parser = build_parser()
    for bucket in ("s3a://b/run", "~/runs/b", "runs/b", f"file://{tmp_path}"):
        assert config_from_args(parser.parse_args(["--bucket", bucket]), parser).bucket == bucket
    for bucket, package in (("gs://b/run", "gcsfs"), ("az://c/run", "adlfs")):
        if importlib.util.find_spec(package) is not None:
            assert config_from_args(parser.parse_args(["--bucket", bucket]), parser).bucket == bucket
        else:
            with pytest.raises(SystemExit):
                config_from_args(parser.parse_args(["--bucket", bucket]), parser)
            err = capsys.readouterr().err
            assert f"--bucket {bucket!r}: store {bucket!r} needs {package}, which is not installed" in err


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "steps must be >= 1"),
    (["--tis-cap", "-1"], "--tis-cap must be >= 0"),
    (["--model", "/nonexistent/ckpt"], "not a local Hugging Face checkpoint"),
    (["--codec", "zip"], "codec must be one of"),
    (["--call-timeout", "0"], "call_timeout_s must be > 0"),
    (["--kill-generator", "0"], "go together"),
    (["--interrupt", "keep"], "--interrupt keep needs --engine vllm"),
    (["--engine", "hf", "--kill-generator", "0", "--kill-at-step", "1", "--kill-target", "server"],
     "--kill-target server needs --engine vllm"),
    (["--engine", "vllm", "--sync-poll-ms", "0"], "sync_poll_ms must be > 0"),
    (["--engine", "vllm", "--sync-lag", "3", "--max-staleness", "2"], "sync_lag must be in [1, max(1, max_staleness) = 2]"),
    (["--tis-cap", "nan"], "tis_cap must be > 0 or None, got nan"),
    (["--temperature", "nan"], "temperature must be > 0, got nan"),
    (["--digits", "100"], "digits must be in [1, 32]"),
    (["--hidden-size", "3"], "gives 1 attention heads of 3 and 1 key/value heads"),
    (["--hidden-size", "160"], "gives 5 attention heads of 32 and 2 key/value heads"),
    (["--run-name", "../escaped"], "must be a plain name"),
    (["--bucket", ""], "--bucket '' is empty"),
    (["--bucket", "/etc/hostname"], "is a file, not a folder"),
    (["--bucket", "s3://"], "names no bucket"),
    (["--bucket", "ftp://x/y"], "use a folder, file://, s3://, gs://, az:// or hf://buckets/"),
    (["--bucket", "s3:/b/x"], "looks like a URI that lost a slash"),  # ran a whole job into ./s3:/b/x
    (["--bucket", "gs://b/../x"], "segment '..' is not allowed"),
    (["--generators", "100000"], "generators + trainer_procs must be at most 256 processes"),  # a Rust panic  # checked without building gcsfs (or needing it)
    (["--bucket", "/etc/hostname/sub"], "/etc/hostname is a file, not a folder"),
    (["--kill-generator", "0", "--kill-at-step", "-1"], "--kill-at-step -1 is not a GRPO step in [0, 200)"),
    (["--steps", "5", "--kill-generator", "0", "--kill-at-step", "5"], "--kill-at-step 5 is not a GRPO step in [0, 5)"),
    (["--engine", "foo"], "--engine 'foo' is not a generator engine; use one of ['hf', 'vllm', 'vllm-offline']"),
    (["--engine", "vllm-offline"], "--engine vllm-offline needs --model PATH"),
    (["--engine", "vllm", "--vllm-python", "/nonexistent/python"], "python '/nonexistent/python' does not exist"),
    (["--runs-dir", "/etc/hostname"], "'/etc/hostname' is a file, not a folder"),
    (["--runs-dir", "/etc/hostname/runs"], "'/etc/hostname' is a file, not a folder"),
])
def test_bad_options_are_usage_errors(argv, match, capsys):
    from recipes.async_grpo import build_parser, config_from_args

    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        config_from_args(parser.parse_args(argv), parser)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("stop,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_writes_a_summary_of_the_steps_done(tmp_path, stop, code):
    """SIGTERM (timeout, systemd, Kubernetes) killed the run: no summary, its run folder's lease left."""
    import signal

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "summary.json").write_text('{"status": "ok", "steps": 999}')  # a previous run's
    proc = subprocess.Popen(**recipe(tmp_path, "--steps", "500", "--generators", "1", "--log-every", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_enabled)
    seen = []
    for line in proc.stdout:  # a few rows of the step table: steps were trained
        seen.append(line)
        if line.lstrip().startswith("2 "):
            break
    proc.send_signal(getattr(signal, stop))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, "".join(seen)[-2000:] + out[-3000:]
    assert "summary of the steps done" in out and not (tmp_path / "t" / "OWNER").exists()
    s = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["bit_exact"] is None
    trained = events(tmp_path, "step")
    assert s["steps"] == len(trained) >= 3 and s["steps"] < 500
    assert s["versions_published"] == len(events(tmp_path, "publish")) >= 3
    assert s["message"] == f"interrupted ({'Ctrl-C' if stop == 'SIGINT' else stop}) after {s['steps']} GRPO steps"


def test_a_setup_failure_stops_with_one_line_and_a_summary(tmp_path):
    """A run that cannot start (here: no actor answers its setup in time) says why in a line or two,
    exits 1, stops its meshes and writes a summary saying so; it was a long traceback and no summary."""
    proc, s = run_recipe(tmp_path, "--steps", "2", "--generators", "1", "--warmstart-steps", "0",
                         "--call-timeout", "1e-9", timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    assert "error: setup failed: TimeoutError: " in proc.stderr and "did not answer within 1e-09 s" in proc.stderr
    assert s["status"] == "setup_failed" and s["bit_exact"] is None and s["steps"] == 0
    assert s["message"].startswith("setup failed: TimeoutError: ")
    assert not (tmp_path / "t" / "OWNER").exists()  # the run folder was released


def test_a_run_folder_in_use_is_refused_and_left_alone(tmp_path):
    """A second run with the run name of a live one refuses to start and deletes nothing (it
    emptied the live run's bucket and removed its metrics)."""
    from torch_deltasync.lease import PrefixLease
    from torch_deltasync.store import LocalStore

    folder = tmp_path / "t"
    (folder / "bucket").mkdir(parents=True)
    (folder / "bucket" / "v0").write_text("the live run's")
    (folder / "metrics.jsonl").write_text("{}\n")
    lease = PrefixLease(LocalStore(folder), "live-run")  # as the live run holds it (this pid: alive)
    try:
        proc, _ = run_recipe(tmp_path, "--steps", "1", "--generators", "1", "--warmstart-steps", "0", timeout=300)
    finally:
        lease.release()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run folder {folder} is in use by a live run (pid {os.getpid()}" in proc.stderr
    assert "choose another --run-name" in proc.stderr and "Traceback" not in proc.stderr
    assert (folder / "bucket" / "v0").read_text() == "the live run's"
    assert (folder / "metrics.jsonl").read_text() == "{}\n"
    assert not (folder / "summary.json").exists()


def test_a_default_bucket_another_live_run_writes_to_is_left_alone(tmp_path):
    """Another run (`--bucket runs/t/bucket`, its own run name) writes into this run's default
    bucket: the run emptied the bucket under it (its versions gone, its next publish failed)."""
    import torch

    from torch_deltasync import DeltaSender

    bucket = tmp_path / "t" / "bucket"
    other = DeltaSender({"w": torch.zeros(4)}, str(bucket), prefix="other-run")
    try:
        other.publish()
        proc, s = run_recipe(tmp_path, "--steps", "1", "--generators", "1", "--warmstart-steps", "0", timeout=300)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"{bucket}/other-run is in use by a running writer: run" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and s["status"] == "setup_failed"
        assert other.publish() == 1  # its run goes on
    finally:
        other.close()


def test_a_run_folder_of_a_killed_run_is_taken_over(tmp_path):
    """The record of a run killed with SIGKILL (live by its time stamp, its pid gone from this host)
    does not block the next run; a live one does, and a second claim is refused."""
    import socket
    import time

    from recipes.grpo.rundir import RunFolderInUse, claim_run_folder
    from torch_deltasync.lease import OWNER_KEY, OwnerRecord
    from torch_deltasync.store import LocalStore

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = OwnerRecord("killed", "s", socket.gethostname(), int(gone.stdout), time.time(), 60.0)
    LocalStore(tmp_path).put(OWNER_KEY, dead.to_json())
    lease = claim_run_folder(tmp_path, "next")
    try:
        with pytest.raises(RunFolderInUse, match=f"in use by a live run \\(pid {os.getpid()} on "):
            claim_run_folder(tmp_path, "third")
    finally:
        lease.release()
    claim_run_folder(tmp_path, "after").release()  # released: free again
    # a run of this host paused (Ctrl-Z) past its lease: its process lives, so it still owns the folder
    paused = OwnerRecord("paused", "s", socket.gethostname(), os.getpid(), time.time() - 600, 60.0)
    LocalStore(tmp_path).put(OWNER_KEY, paused.to_json())
    with pytest.raises(RunFolderInUse, match=f"in use by a live run \\(pid {os.getpid()} on .*renewed 600 s ago"):
        claim_run_folder(tmp_path, "fourth")
    elsewhere = OwnerRecord("other-host", "s", "no-such-host.invalid", os.getpid(), time.time() - 600, 60.0)
    LocalStore(tmp_path).put(OWNER_KEY, elsewhere.to_json())
    claim_run_folder(tmp_path, "fifth").release()  # another host's expired lease: free


def test_help_works_beside_a_file_named_runs(tmp_path):
    """`--help` built a config with the defaults, whose check of the run folder (runs/async_grpo)
    failed with a traceback in a working folder holding a file named `runs`."""
    (tmp_path / "runs").write_text("x")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "recipes.async_grpo", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--run-name" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "recipes.async_grpo", "--steps", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "'runs' is a file, not a folder" in proc.stderr, proc.stderr[-2000:]


def test_a_damaged_warm_start_cache_is_rebuilt(tmp_path):
    """An unreadable ``meta.json`` or a weights file that does not match it is rebuilt with a note
    (each was a traceback in every later run of that name); the trainer refuses weights written
    for other settings."""
    from recipes.grpo.config import GRPOConfig
    from recipes.grpo.policy import build_policy, build_tokenizer, load_warm_start, policy_key, warm_start

    cfg = GRPOConfig(runs_dir=str(tmp_path), run_name="t", hidden_size=64, digits=3, warmstart_steps=2)
    tok = build_tokenizer(cfg)
    path, info = warm_start(cfg, tok, progress=False)
    assert not info["cached"] and "rebuilt" not in info
    assert warm_start(cfg, tok, progress=False)[1]["cached"]
    meta = path.parent / "meta.json"
    meta.write_text("")  # a run killed while writing it (before: JSONDecodeError)
    _, info = warm_start(cfg, tok, progress=False)
    assert not info["cached"] and "meta.json is unreadable" in info["rebuilt"]
    with open(path, "r+b") as f:  # cut short (before: SafetensorError in the trainer's setup)
        f.truncate(1000)
    _, info = warm_start(cfg, tok, progress=False)
    assert not info["cached"] and "model.safetensors does not match the sha256 in meta.json" in info["rebuilt"]
    assert warm_start(cfg, tok, progress=False)[1]["cached"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["meta.json", "model.safetensors"]  # no temporary files
    model = build_policy(cfg, tok)
    load_warm_start(model, path, policy_key(cfg))
    with pytest.raises(RuntimeError, match="was written for other settings"):
        load_warm_start(model, path, "0" * 16)
