"""Crash tests: a writer process publishing through ``s3://`` (moto on 127.0.0.1) is killed with
SIGKILL at random points, half the trials at a random store call (before or after it: between
object and manifest, between manifest and ``LATEST``, ...), half at a random time. After each kill:

* no partial version is visible: every visible version rebuilds bit-exactly from the store;
* every version the writer reported as published is visible;
* a new writer on the same prefix continues after the newest visible version, with an anchor;
* a receiver that followed the dead writer and a fresh one both reach the new writer's newest
  version bit-exactly, with no manual step.

4 trials run by default, 30 with ``pytest -m slow``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torch_deltasync import DeltaReceiver, DeltaSender, open_store
from torch_deltasync.errors import VersionNotFoundError
from torch_deltasync.keys import list_versions
from torch_deltasync.manifest import load_manifest

from remote_helpers import StepModel, assert_holds, bits_of, empty_target, same_bits
from s3_server import S3_ENV, make_bucket

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
STEPS = 12
# The lease record and two listings, then object, owner check, manifest and LATEST per publish (the
# anchors 4 and 8 write one object more, so a kill at any of these calls lands before the run ends).
OPS_PER_RUN = 3 + 4 * STEPS
#: Steps of a writer killed by a timer: it cannot finish within the at most 0.5 s before the kill.
TIMER_STEPS = 1_000_000


def crash_trial(endpoint: str, trial: int) -> dict:
    rng = random.Random(trial)
    url = f"s3://{make_bucket(endpoint)}/run"
    self_kill = trial % 2 == 0
    cmd = [sys.executable, str(TESTS / "crash_writer.py"), "--url", url, "--seed", str(trial),
           "--steps", str(STEPS if self_kill else TIMER_STEPS), "--anchor-every", "4", "--pause-s", "0.02"]
    if self_kill:
        cmd += ["--kill-at-op", str(rng.randint(1, OPS_PER_RUN))]
        if rng.random() < 0.5:
            cmd.append("--kill-after")
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    model = StepModel(seed=trial)
    follower_target = empty_target()
    follower = DeltaReceiver(follower_target, open_store(url, endpoint_url=endpoint))
    kill_at = None
    if not self_kill:
        deadline = time.monotonic() + 120
        while "ready\n" not in lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        kill_at = time.monotonic() + rng.uniform(0.0, 0.5)
    try:
        while proc.poll() is None:
            if kill_at is not None and time.monotonic() >= kill_at:
                proc.send_signal(signal.SIGKILL)
                kill_at = None
            try:
                v = follower.update()
                assert same_bits(bits_of(follower_target), model.bits_at(v)), f"follower at {v} is not bit-exact"
            except VersionNotFoundError:
                pass
            time.sleep(0.005)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    stderr = proc.stderr.read()
    killed = proc.returncode == -signal.SIGKILL
    # Every trial is a crash: a writer that finished first would test nothing.
    assert killed, (f"the writer was not killed (rc {proc.returncode}"
                    + (f", to kill itself at store call {cmd[cmd.index('--kill-at-op') + 1]}" if self_kill else "")
                    + f")\n{stderr}")

    # 1. nothing partial is visible, and everything reported as published is
    store = open_store(url, endpoint_url=endpoint)
    reported = {int(line.split()[1]): int(line.split()[2]) for line in lines if line.startswith("published")}
    assert all(v == step for v, step in reported.items())  # one writer, no failed publish: version == step
    visible = list_versions(store)
    assert set(reported) <= set(visible), f"published but not visible: {set(reported) - set(visible)}"
    assert visible == list(range(len(visible))), f"visible versions have a gap: {visible}"
    for v in visible:
        target = empty_target()
        DeltaReceiver(target, store).update(v)
        assert_holds(target, model, v)

    # 2. a new writer continues with an anchor after the newest visible version, and after the
    #    number the killed writer left objects under (object keys are never reused)
    model.set_step(100)
    leftover = [int(k.split("/")[1]) for k in store.list("objects")]
    expected_first = max(visible + leftover) + 1 if visible + leftover else 0
    # Right after the kill the dead writer's lease is still live: the restart takes the prefix over.
    sender = DeltaSender(model.tensors, open_store(url, endpoint_url=endpoint), anchor_every=4, takeover=True)
    first = sender.publish()
    assert first == expected_first
    assert load_manifest(store, first).kind == "anchor"
    for step in (101, 102):
        model.set_step(step)
        sender.publish()

    # 3. receivers follow with no manual step, bit-exactly
    fresh_target = empty_target()
    for receiver, target in ((follower, follower_target), (DeltaReceiver(fresh_target, store), fresh_target)):
        assert receiver.update() == first + 2
        assert_holds(target, model, 102)
    sender.close()  # frees the prefix while the S3 server still runs
    return {"killed": killed, "visible": len(visible), "reported": len(reported), "self_kill": self_kill}


@pytest.mark.parametrize("trial", range(4))
def test_writer_killed_then_resumed(s3, trial):
    crash_trial(s3, trial)


@pytest.mark.slow
def test_writer_killed_30_times(s3):
    results = [crash_trial(s3, trial) for trial in range(100, 130)]
    assert all(r["killed"] for r in results), results
    # kills landed at different points of the run, not always before the first version
    assert len({r["visible"] for r in results}) >= 5, results
