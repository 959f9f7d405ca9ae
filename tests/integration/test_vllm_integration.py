"""The client helpers (``integrations/vllm/``) driving the real ``deltasync`` backend (CPU, no inference).

Each engine is scripted (``vllm_scripted``): its workers are real vLLM 0.33 models built at their TP
rank, each with a real ``DeltaSyncWeightTransferEngine`` made by vLLM's factory, so the backend code
runs as in an engine; the front ends record calls, and the HTTP tests go through vLLM's own RL
routes served on loopback. Weights are compared bit for bit with vLLM's ``load_weights`` of the
trainer's bf16 weights. The same helpers against a live engine: ``tests/integration/test_vllm_live.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401  the CPU oracle; tools/setup.sh installs it, so a missing wheel fails here

from torch_deltasync import DeltaSender, DeltaSyncError, LocalStore
from torch_deltasync.errors import SyncTimeoutError, VersionNotFoundError
from torch_deltasync.integrations.vllm import (
    attach_async_llm,
    attach_llm,
    attach_server,
    read_readiness,
    update_async_llm,
    update_llm,
    update_server,
    wait_staged,
)
from torch_deltasync.integrations.vllm._readiness import Attachment
from torch_deltasync.keys import manifest_key
from torch_deltasync.testing import adam_step
from torch_deltasync.testing_vllm import (TINY_VLLM_CONFIGS, build_vllm_model, hf_model, load_hf_weights, vllm_config,
                                          vllm_state_bits)
from vllm_scripted import RLServer, ScriptedAsyncLLM, ScriptedLLM, ScriptedWorker

TP = 2


def _bf16(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}


@pytest.fixture
def run(tmp_path):
    """A trainer (tiny Qwen2) that published anchor v0, and TP workers that loaded v0 with vLLM."""
    spec = TINY_VLLM_CONFIGS["qwen2"]
    hf = hf_model(spec, seed=11)
    bucket = str(tmp_path / "bucket")
    sender = DeltaSender(hf, LocalStore(bucket), anchor_every=1000)
    v0 = sender.publish()
    anchor = _bf16(hf)
    vc = vllm_config(spec, tmp_path / "cfg")
    workers = [ScriptedWorker(vc, r, TP, anchor) for r in range(TP)]
    opt = torch.optim.Adam(hf.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> int:
        """One Adam step on the trainer, published; returns the version."""
        adam_step(hf, opt, batch=2, seq=16, generator=gen)
        return sender.publish()

    def assert_serves(state: dict[str, torch.Tensor]) -> None:
        """Every worker's parameters equal vLLM's own load_weights of ``state`` at its rank."""
        for w in workers:
            ref = build_vllm_model(vc, w.rank, TP)
            load_hf_weights(ref, state)
            want, got = vllm_state_bits(ref), w.bits()
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            assert not bad, f"rank {w.rank}: {bad[:5]}"

    yield SimpleNamespace(hf=hf, bucket=bucket, v0=v0, anchor=anchor, workers=workers, step=step,
                          assert_serves=assert_serves, path=tmp_path)
    for w in workers:
        w.shutdown_weight_transfer_engine()


def test_offline_llm_commits_the_staged_version(run):
    llm = ScriptedLLM(run.workers)
    info = attach_llm(llm, run.bucket, assume_version=run.v0, threads=1)
    assert info["store"] == run.bucket and info["assume_version"] == run.v0
    assert sorted(read_readiness(info["status_dir"])) == ["rank-0", "rank-1"]
    assert [w.engine.receiver.receiver_config.threads for w in run.workers] == [1, 1]  # passed to each worker
    run.step()
    v2 = run.step()
    out = update_llm(llm)  # the newest version in the store
    assert out.version == v2 and out.staged is True and out.mode is None
    assert llm.calls[1:] == [("start_weight_update",), ("update_weights", {"version": v2}),
                             ("finish_weight_update", str(v2)), ("reset_prefix_cache", True)]
    # the commit found the update staged: the pause would have covered the writes only
    assert [w.engine.last_commit["staged_ahead"] for w in run.workers] == [True, True]
    assert [w.engine.last_commit["path"] for w in run.workers] == ["delta", "delta"]
    assert 0 <= out.stall_ms <= out.total_ms and 0 <= out.wait_ms <= out.total_ms
    # the stall by step, in the order the engine saw them; together they are the stall
    assert list(out.steps_ms) == ["start", "update", "finish", "reset_cache"]
    assert all(ms >= 0 for ms in out.steps_ms.values()) and sum(out.steps_ms.values()) <= out.stall_ms
    assert llm.get_weight_version() == str(v2)
    assert {s["held"] for s in read_readiness(info["status_dir"]).values()} == {v2}
    run.assert_serves(_bf16(run.hf))
    json.dumps(out.to_dict())
    # after a commit the stager stages the next version again
    v3 = run.step()
    assert update_llm(llm).staged is True
    assert [w.engine.last_commit["staged_ahead"] for w in run.workers] == [True, True]
    assert llm.get_weight_version() == str(v3)
    run.assert_serves(_bf16(run.hf))


def test_failed_update_changes_nothing_and_names_the_version(run):
    llm = ScriptedLLM(run.workers)
    attach_llm(llm, run.bucket, assume_version=run.v0)
    v1 = run.step()
    update_llm(llm, v1)
    llm.calls.clear()
    with pytest.raises(VersionNotFoundError, match="version 999 is not visible"):
        update_llm(llm, 999)
    assert llm.calls == [("start_weight_update",), ("update_weights", {"version": 999})]
    assert llm.get_weight_version() == str(v1)
    run.assert_serves(_bf16(run.hf))
    # the session was closed by the error: the next update goes through, staged ahead (the stager,
    # which stages nothing while a commit runs, went on after the failed one)
    v2 = run.step()
    out = update_llm(llm, v2)
    assert out.version == v2 and out.staged is True
    assert [w.engine.last_commit["staged_ahead"] for w in run.workers] == [True, True]
    run.assert_serves(_bf16(run.hf))


def test_bad_init_info_installs_nothing(run):
    llm = ScriptedLLM(run.workers)
    # checked in the caller, as the workers check it: no engine call, no readiness directory
    tmp_before = set(Path(tempfile.gettempdir()).glob("deltasync-ready-*"))
    with pytest.raises(TypeError, match=r"attach: unknown deltasync init_info option\(s\) \['poll_secs'\]; "
                                        r"the backend takes \['store', .*'poll_s'"):
        attach_llm(llm, run.bucket, poll_secs=1)
    with pytest.raises(ValueError, match=r"init_info 'max_workers' must be an int in \[1, 256\], got 0"):
        attach_llm(llm, run.bucket, max_workers=0)
    with pytest.raises(ValueError, match=r"init_info 'threads' must be an int in \[1, 256\] or null \(one per CPU core, at most 8, shared among local ranks\), got 0"):
        attach_llm(llm, run.bucket, threads=0)
    with pytest.raises(TypeError, match="status_dir must be a path, None .* or False .*, got 0"):
        attach_llm(llm, run.bucket, status_dir=0)  # 0 == False, but it is not False
    with pytest.raises(ValueError, match=r"init_info 'reload_ahead' must be 'auto', 'always' or 'never', got True"):
        attach_llm(llm, run.bucket, reload_ahead=True)
    with pytest.raises(TypeError, match=r"attach_llm: expected a vllm\.LLM \(an engine with vLLM's weight-transfer API, "
                                        r"init_weight_transfer_engine\), got NoneType"):
        attach_llm(None, run.bucket)
    with pytest.raises(TypeError, match=r"attach_async_llm: expected a vllm AsyncLLM .*got str"):
        asyncio.run(attach_async_llm("engine", run.bucket))
    assert llm.calls == [] and set(Path(tempfile.gettempdir()).glob("deltasync-ready-*")) == tmp_before
    with pytest.raises(DeltaSyncError, match="not attached to a run: call attach_llm first"):
        update_llm(llm, 0)
    # an assumed version is trusted, so it is never rounded into one (0.9 is not version 0)
    with pytest.raises(ValueError, match=r"init_info 'assume_version' must be a version \(int >= 0\) or null, got 0\.9"):
        attach_llm(llm, run.bucket, assume_version=0.9)
    # paths the workers write from then on are checked by the init, and named
    blocker = run.path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"init_info 'metrics_path' '{blocker}/m-0.jsonl' cannot be written"):
        attach_llm(llm, run.bucket, assume_version=run.v0, metrics_path=str(blocker / "m-{rank}.jsonl"))
    with pytest.raises(ValueError, match=rf"init_info 'status_dir' '{blocker}/st' cannot be written"):
        attach_llm(llm, run.bucket, assume_version=run.v0, status_dir=str(blocker / "st"))
    assert all(w.engine.receiver is None for w in run.workers)


def test_async_llm_pauses_commits_and_always_resumes(run):
    engine = ScriptedAsyncLLM(run.workers)

    async def go():
        await attach_async_llm(engine, run.bucket, assume_version=run.v0)
        v1 = run.step()
        engine.calls.clear()
        out = await update_async_llm(engine, mode="keep")
        assert out.version == v1 and out.staged is True and out.mode == "keep"
        assert list(out.steps_ms) == ["pause", "update", "finish", "resume"]
        assert sum(out.steps_ms.values()) <= out.stall_ms
        # start first, while the engine generates: vLLM's update session is what two drivers contend for
        assert engine.calls == [("start_weight_update",), ("pause_generation", "keep", True),
                                ("update_weights", {"version": v1}), ("finish_weight_update", str(v1)),
                                ("resume_generation",)]
        run.assert_serves(_bf16(run.hf))
        engine.calls.clear()
        with pytest.raises(VersionNotFoundError, match="version 7 is not visible"):
            await update_async_llm(engine, 7, mode="abort")
        assert engine.calls[:2] == [("start_weight_update",), ("pause_generation", "abort", True)]
        assert engine.calls[-1] == ("resume_generation",) and not engine.paused
        assert ("finish_weight_update", "7") not in engine.calls
        assert await engine.get_weight_version() == str(v1)
        run.assert_serves(_bf16(run.hf))
        engine.calls.clear()
        with pytest.raises(ValueError, match="mode must be one of"):
            await update_async_llm(engine, v1, mode="drain")
        assert engine.calls == []  # nothing paused
        # a pause that fails after the session started: the session is ended (no version), the engine resumed
        real_pause = engine.pause_generation

        async def failing_pause(**kw):
            raise RuntimeError("pause failed")

        engine.pause_generation = failing_pause
        v2 = run.step()
        with pytest.raises(RuntimeError, match="pause failed"):
            await update_async_llm(engine, v2, mode="keep")
        assert engine.calls[-3:] == [("start_weight_update",), ("finish_weight_update", None), ("resume_generation",)]
        assert await engine.get_weight_version() == str(v1)
        engine.pause_generation = real_pause
        # Paused by someone else between the check and the start (a driver that finished its update
        # and is about to resume): the session is ended again and nothing else touched.
        real_start = engine.start_weight_update

        async def start_then_paused_elsewhere():
            await real_start()
            engine.paused = True

        engine.start_weight_update = start_then_paused_elsewhere
        engine.calls.clear()
        with pytest.raises(DeltaSyncError, match=r"paused by someone else while this driver started its update: nothing "
                                                 r"was changed"):
            await update_async_llm(engine, v2, mode="keep")
        assert engine.calls == [("start_weight_update",), ("finish_weight_update", None)] and engine.paused
        engine.start_weight_update = real_start
        await engine.resume_generation()
        assert (await update_async_llm(engine, v2, mode="keep")).version == v2
        run.assert_serves(_bf16(run.hf))

    asyncio.run(go())


def test_http_server_through_vllm_rl_routes_only(run):
    engine = ScriptedAsyncLLM(run.workers)
    server = RLServer(engine)
    try:
        with pytest.raises(TypeError, match=r"unknown deltasync init_info option\(s\) \['bogus'\]"):
            attach_server(server.url, run.bucket, bogus=1)
        assert server.requests == []  # refused before anything was sent
        attach_server(server.url, run.bucket, assume_version=run.v0)
        v1 = run.step()
        server.requests.clear()
        out = update_server(server.url, mode="wait")
        assert out.version == v1 and out.staged is True
        assert server.requests == [
            ("GET", "/is_paused", ""),
            ("POST", "/start_weight_update", ""),
            ("GET", "/is_paused", ""),
            ("POST", "/pause", "mode=wait&clear_cache=true"),
            ("POST", "/update_weights", ""),
            ("POST", "/finish_weight_update", ""),
            ("POST", "/resume", ""),
            ("GET", "/weight_info", ""),
        ]
        assert engine.calls[-2:] == [("finish_weight_update", str(v1)), ("resume_generation",)]
        run.assert_serves(_bf16(run.hf))
        # a version never published: the server's reason comes back, the engine keeps serving v1
        server.requests.clear()
        with pytest.raises(DeltaSyncError, match=r"/update_weights: HTTP 500: .*version 999 is not visible"):
            update_server(server.url, 999, mode="keep")
        assert [p for _, p, _ in server.requests] == ["/is_paused", "/start_weight_update", "/is_paused", "/pause",
                                                      "/update_weights", "/resume"]
        assert not engine.paused and asyncio.run(engine.get_weight_version()) == str(v1)
        run.assert_serves(_bf16(run.hf))
        # Another driver paused the engine for its update: a second driver used to resume it (its
        # "always resume" after its own start failed), so the first one committed into a running engine.
        asyncio.run(engine.pause_generation(mode="wait"))
        server.requests.clear()
        with pytest.raises(DeltaSyncError, match=r"the engine is paused already \(another driver is updating it.*"
                                                 r"nothing was changed"):
            update_server(server.url, v1, mode="keep")
        assert [p for _, p, _ in server.requests] == ["/is_paused"] and engine.paused
        asyncio.run(engine.resume_generation())
        # Another driver's update session is open (it got past the check at the same time, or it died
        # mid-update): this driver's start fails before it paused anything, so it resumes nothing
        # (resuming would put the other driver's commit on a generating engine), and says how to
        # recover from a dead driver.
        asyncio.run(engine.start_weight_update())
        server.requests.clear()
        with pytest.raises(DeltaSyncError, match=r"start_weight_update failed: .*/start_weight_update: HTTP 500: .*already "
                                                 r"active.*nothing was changed.*POST /finish_weight_update.*POST /resume"):
            update_server(server.url, v1, mode="keep")
        assert [p for _, p, _ in server.requests] == ["/is_paused", "/start_weight_update"] and not engine.paused
        asyncio.run(engine.finish_weight_update(str(v1)))  # the recovery the message gives
        assert update_server(server.url, mode="keep").version == v1 and not engine.paused
    finally:
        server.close()


def test_unreachable_server_is_named():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    with pytest.raises(DeltaSyncError, match=r"GET http://127\.0\.0\.1:\d+/is_paused: "
                       r"cannot reach the server \(.*Connection refused"):
        update_server(url, 3, timeout=5)
    for bad in ("not a url", "127.0.0.1:8000", "ftp://host", None):  # urllib's "unknown url type" before
        with pytest.raises(ValueError, match=r"base_url must be the server's http\(s\) URL, e\.g\. http://127\.0\.0\.1:8000"):
            attach_server(bad, "bucket")
        with pytest.raises(ValueError, match="base_url must be"):
            update_server(bad, 3)


def _write(d, rank, **state):
    (d / f"rank-{rank}.json").write_text(json.dumps({"held": None, "staged": None, "newest": None, "error": None,
                                                     **state}))


def test_wait_staged_reads_every_worker(tmp_path):
    _write(tmp_path, 0, held=3, staged=4, newest=4)
    _write(tmp_path, 1, held=3, staged=3, newest=4)
    with pytest.raises(SyncTimeoutError, match=r"did not stage version 4 within 0 s \(rank-1: staged 3, held 3"):
        wait_staged(tmp_path, 4, timeout_s=0)
    _write(tmp_path, 1, held=3, staged=4, newest=4)
    assert sorted(wait_staged(tmp_path, 4, timeout_s=0)) == ["rank-0", "rank-1"]
    with pytest.raises(SyncTimeoutError, match="2 of 3 readiness files present"):
        wait_staged(tmp_path, 4, timeout_s=0, workers=3)
    _write(tmp_path, 2, held=4, newest=4)  # holds it already
    assert len(wait_staged(tmp_path, 4, timeout_s=0, workers=3)) == 3
    # a worker that saw the version and failed to stage it does not hold the driver up: the commit
    # will raise its reason
    failed = tmp_path / "failed"
    failed.mkdir()
    _write(failed, 0, held=3, staged=5, newest=5)
    _write(failed, 1, held=3, newest=5, error="CorruptObjectError: sha256 mismatch in version 5")
    assert wait_staged(failed, 5, timeout_s=0, workers=2)["rank-1"]["error"].startswith("CorruptObjectError")
    _write(failed, 1, held=3, newest=4, error="CorruptObjectError: sha256 mismatch in version 4")
    with pytest.raises(SyncTimeoutError, match="error CorruptObjectError"):  # not seen yet: still waiting
        wait_staged(failed, 5, timeout_s=0)
    # a worker that staged a newer version will not stage this one (its stager stages the newest):
    # nothing to wait for, and the driver learns it was not staged (the commit prepares it)
    newer = tmp_path / "newer"
    newer.mkdir()
    _write(newer, 0, held=164, staged=200, newest=200)
    t0 = time.monotonic()
    assert wait_staged(newer, 165, timeout_s=30, workers=1)["rank-0"]["staged"] == 200
    assert time.monotonic() - t0 < 5
    _write(newer, 0, held=164, staged=164, newest=200)  # still staging the newest: keep waiting
    with pytest.raises(SyncTimeoutError, match=r"did not stage version 165 within 0 s \(rank-0: staged 164"):
        wait_staged(newer, 165, timeout_s=0, workers=1)
    # a worker that staged a newer version after this one kept this one: staged, the commit takes it
    kept = tmp_path / "kept"
    kept.mkdir()
    _write(kept, 0, held=164, staged=166, kept=165, newest=166)
    _write(kept, 1, held=164, staged=165, newest=166)
    assert wait_staged(kept, 165, timeout_s=0, workers=2)["rank-0"]["kept"] == 165
    # the driver's EngineUpdate.staged: True when every worker staged or kept it
    LocalStore(tmp_path / "store").sub("run").put(manifest_key(165), b"{}")  # published
    assert Attachment(str(tmp_path / "store"), "run", str(kept), 2).wait(165, 0) is True
    assert Attachment(str(tmp_path / "store"), "run", str(newer), 1).wait(165, 0) is False  # staged 164: timeout
    _write(newer, 0, held=164, staged=200, newest=200)
    assert Attachment(str(tmp_path / "store"), "run", str(newer), 1).wait(165, 0) is False  # ready, not staged
    (tmp_path / "rank-9.json").write_text("[1, 2")
    with pytest.raises(DeltaSyncError, match="rank-9.json: unreadable readiness file"):
        wait_staged(tmp_path, 4, timeout_s=0)
    with pytest.raises(ValueError, match="version must be a published version"):
        wait_staged(tmp_path, -1)
    # bad arguments and a wrong directory fail at once, saying what is wrong
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds >= 0, got nan"):
        wait_staged(kept, 165, float("nan"))
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds"):
        wait_staged(kept, 165, None)
    with pytest.raises(TypeError, match="workers must be an int >= 1"):
        wait_staged(kept, 165, 0, workers="2")
    with pytest.raises(ValueError, match="poll_s must be a finite number of seconds > 0"):
        wait_staged(kept, 165, 0, poll_s=-1)
    for wrong in (tmp_path / "missing", tmp_path / "rank-0.json"):
        with pytest.raises(DeltaSyncError, match=r"no such directory of readiness files; pass the status_dir"):
            wait_staged(wrong, 165, 30)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SyncTimeoutError, match=r"no readiness files there \(each worker writes rank-<r>.json"):
        wait_staged(empty, 165, 0)
    assert Attachment(str(tmp_path / "store"), "run", str(tmp_path / "missing"), 1).wait(165, 30) is False  # no wait
    # version fields are ints: a float, a string or true is not a version
    odd = tmp_path / "odd"
    odd.mkdir()
    for version, state in ((165, dict(held=164, staged="165")), (165, dict(held=164, kept=165.0)),
                           (165, dict(held=165.0)), (1, dict(held=0, staged=True))):
        _write(odd, 0, newest=166, **state)
        with pytest.raises(SyncTimeoutError, match=f"did not stage version {version}"):
            wait_staged(odd, version, 0)
    _write(odd, 0, held=164, staged="165", newest=166)
    with pytest.raises(SyncTimeoutError, match=r"rank-0: staged '165', held 164"):
        wait_staged(odd, 165, 0)


def test_worker_errors_are_raised_as_their_own_types():
    """vLLM hands a worker's error to an offline LLM's or AsyncLLM's driver as a plain Exception with
    its message (the forms below are vLLM 0.32's, seen on live engines): `except VersionNotFoundError`
    never fired."""
    from torch_deltasync.errors import ChecksumMismatchError, CorruptObjectError
    from torch_deltasync.integrations.vllm._steps import typed_error

    one = Exception("Call to collective_rpc method failed: Worker failed with error 'VersionNotFoundError: "
                    "file:///b: version 999 is not visible', please check the stack trace above for the root cause")
    got = typed_error(one)
    assert type(got) is VersionNotFoundError and got.__cause__ is one and "version 999 is not visible" in str(got)
    tp = DeltaSyncError("update_weights failed on 2 of 2 workers; nothing was changed on any: worker 0: "
                        "CorruptObjectError: a; worker 1: CorruptObjectError: b")
    assert type(typed_error(tp)) is CorruptObjectError
    mixed = Exception("worker 0: CorruptObjectError: a; worker 1: ChecksumMismatchError: b")
    assert type(typed_error(mixed)) is DeltaSyncError
    typed = ChecksumMismatchError("x")
    assert typed_error(typed) is typed
    for other in (ValueError("KeyError: not ours"), KeyboardInterrupt()):
        assert typed_error(other) is other
