"""A writer process for the crash tests (``test_crash.py``); not a test module.

Publishes ``StepModel(seed).state_at(step)`` for ``steps`` consecutive steps to ``--url`` and prints
``published <version> <step>`` after each publish returns. With ``--kill-at-op N`` it sends itself
SIGKILL right before (or, with ``--kill-after``, right after) its N-th store call, so every point of
a publish (before the object, between object and manifest, between manifest and ``LATEST``) can be
hit; without it the parent kills it at a random time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remote_helpers import StepModel  # noqa: E402

from torch_deltasync import DeltaSender, open_store  # noqa: E402
from torch_deltasync.store import Store  # noqa: E402


class KillAt(Store):
    """Counts store calls and SIGKILLs this process at call ``n`` (before or after it runs)."""

    def __init__(self, inner: Store, n: int | None, after: bool) -> None:
        self.inner, self.n, self.after, self.count = inner, n, after, 0

    def _op(self, fn, *args, **kw):
        self.count += 1
        hit = self.count == self.n
        if hit and not self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = fn(*args, **kw)
        if hit and self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def put(self, key, data):
        return self._op(self.inner.put, key, data)

    def put_new(self, key, data):
        return self._op(self.inner.put_new, key, data)

    def get(self, key, *, start=None, end=None):
        return self._op(self.inner.get, key, start=start, end=end)

    def exists(self, key):
        return self._op(self.inner.exists, key)

    def list(self, prefix=""):
        return self._op(self.inner.list, prefix)

    def delete(self, key):
        return self._op(self.inner.delete, key)

    def delete_many(self, keys):
        return self._op(self.inner.delete_many, keys)

    def describe(self):
        return self.inner.describe()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--anchor-every", type=int, default=4)
    p.add_argument("--pause-s", type=float, default=0.02)
    p.add_argument("--kill-at-op", type=int, default=None)
    p.add_argument("--kill-after", action="store_true")
    args = p.parse_args()

    model = StepModel(seed=args.seed)
    store = KillAt(open_store(args.url), args.kill_at_op, args.kill_after)
    sender = DeltaSender(model.tensors, store, anchor_every=args.anchor_every)
    print("ready", flush=True)
    for step in range(args.steps):
        model.set_step(step)
        v = sender.publish()
        print(f"published {v} {step}", flush=True)
        time.sleep(args.pause_s)
    print("done", flush=True)


if __name__ == "__main__":
    main()
