"""Fault injection: a writer and 8 receivers run concurrently for 100 versions through a store that
fails calls, loses replies, stalls past deadlines and truncates reads, while retention deletes old
versions. Every version a receiver holds, and the last one, must be bit-exact."""

from __future__ import annotations

import random
import re
import threading
import time

from torch_deltasync import DeltaReceiver, DeltaSender, DeltaSyncError, LocalStore, RetentionPolicy, RetryPolicy
from torch_deltasync.errors import CorruptObjectError, PublishError, StoreError, VersionNotFoundError
from torch_deltasync.keys import manifest_key
from torch_deltasync.store import RetryingStore
from torch_deltasync.store.faults import FaultyStore

from remote_helpers import StepModel, bits_of, same_bits, empty_target

#: What a read truncated on every attempt looks like: an object shorter than its manifest entry,
#: or a manifest cut short (its digest no longer matches, or it is no JSON).
TRUNCATED = re.compile(r"is (more than )?[\d,]+ bytes, manifest says [\d,]+|manifest of version \d+ is not valid JSON"
                       r"|digest mismatch: the content hashes to")  # (a manifest cut short: its digest is checked first)


def tolerated(e: DeltaSyncError) -> bool:
    """Whether an update may fail this way under the injected faults (see the test)."""
    if isinstance(e, StoreError):
        return True
    return type(e) is CorruptObjectError and bool(TRUNCATED.search(str(e)))


POLICY = RetryPolicy(attempts=6, base_delay_s=0.002, max_delay_s=0.02, timeout_s=0.15)
LAGS_S = [0.0, 0.0, 0.005, 0.01, 0.03, 0.1, 0.3, 1.0]


def test_8_receivers_follow_a_writer_through_faults(tmp_path):
    base = LocalStore(tmp_path / "bucket", fsync=False)
    writer_faults = FaultyStore(base, error_rate=0.05, lost_ack_rate=0.05, latency_s=(0.0, 0.001), seed=1)
    reader_faults = [
        FaultyStore(base, error_rate=0.05, truncate_rate=0.05, stall_rate=0.005, stall_s=0.4,
                    latency_s=(0.0, 0.002), seed=100 + i)
        for i in range(len(LAGS_S))
    ]
    model = StepModel(seed=31)
    published: dict[int, int] = {}  # version -> step whose weights it holds
    done = threading.Event()
    failures: list[str] = []
    surfaced = [0] * len(LAGS_S)  # update() calls that raised (the loop just tries again)
    errors: list[str] = []
    held = [0] * len(LAGS_S)
    recovered = [0] * len(LAGS_S)
    targets = [empty_target() for _ in LAGS_S]

    def follow(i: int) -> None:
        receiver = DeltaReceiver(targets[i], RetryingStore(reader_faults[i], POLICY), max_workers=2)
        check = StepModel(seed=31)
        rng = random.Random(i)
        try:
            while True:
                finished = done.is_set()
                try:
                    v = receiver.update()
                except VersionNotFoundError:
                    v = None
                except DeltaSyncError as e:
                    # Only what these faults can cause may surface (the target is then unchanged and
                    # the next update catches up): a store call that failed past its retries, or a
                    # read truncated on every attempt. A checksum mismatch, a refused target or any
                    # other corruption would be a bug.
                    if not tolerated(e):
                        failures.append(f"receiver {i}: {type(e).__name__}: {e}")
                        return
                    surfaced[i] += 1
                    errors.append(f"{type(e).__name__}: {e}")
                    v = None
                if v is not None:
                    deadline = time.monotonic() + 10
                    while v not in published and time.monotonic() < deadline:
                        time.sleep(0.001)  # the manifest is visible a moment before publish() returns
                    want = check.bits_at(published[v])
                    if not same_bits(bits_of(targets[i]), want):
                        failures.append(f"receiver {i}: version {v} is not bit-exact")
                        return
                    held[i] += 1
                    st = receiver.last_stats
                    # held a version retention had already deleted, and recovered from an anchor
                    recovered[i] += bool(st and st.path == "anchor" and st.from_version is not None
                                         and not base.exists(manifest_key(st.from_version)))
                if finished and v is not None and v == max(published):
                    return
                time.sleep(LAGS_S[i] * rng.random())
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            failures.append(f"receiver {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(LAGS_S))]
    for t in threads:
        t.start()
    sender = DeltaSender(model.tensors, RetryingStore(writer_faults, POLICY), anchor_every=10,
                         retention=RetentionPolicy())
    publish_errors = 0
    step = 0
    while len(published) < 100:
        model.set_step(step)
        try:
            v = sender.publish()
            published[v] = step
        except PublishError:
            publish_errors += 1  # nothing visible; the next publish recovers
        step += 1
        time.sleep(0.002)
    done.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a receiver never reached the last version"
    assert not failures, failures
    last = max(published)
    for i, target in enumerate(targets):
        assert same_bits(bits_of(target), model.bits_at(published[last])), f"receiver {i} is not bit-exact at the end"
    # the faults really happened, on both sides
    assert writer_faults.injected["error"] > 0 and writer_faults.injected["lost_ack"] > 0
    injected = sum((f.injected for f in reader_faults), start=type(writer_faults.injected)())
    assert injected["error"] > 20 and injected["truncate"] > 10 and injected["stall"] > 0
    assert recovered[-1] >= 1  # the slowest receiver fell behind retention and recovered from an anchor
    assert all(h >= 2 for h in held)
    print(f"publish errors {publish_errors}, update errors surfaced {surfaced}, held {held}, "
          f"recovered {recovered}, injected writer {dict(writer_faults.injected)} readers {dict(injected)}")
    # An update may give up now and then (e.g. a manifest truncated on all 3 reads: p ~ 1e-4 per
    # read here); the target is then unchanged and the next update catches up. What must never
    # happen is checked above: a held version that is not bit-exact.
    print("\n".join(errors))
