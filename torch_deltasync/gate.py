"""The gate between a policy's calls and the commits of its weights: every call sees one version.

A receiver that updates a policy while another thread calls it (a torchrl collector's worker, an
HF generator) stages the next version outside the gate (:meth:`DeltaReceiver.prepare
<torch_deltasync.DeltaReceiver.prepare>`) and commits inside :meth:`CallGate.exclusive`; the
policy's calls run between :meth:`CallGate.enter` and :meth:`CallGate.exit`. Used by the torchrl scheme's workers
(``torch_deltasync.integrations.torchrl``).
"""

from __future__ import annotations

import contextlib
import threading


class CallGate:
    """Keeps writes to the policy's weights out of policy calls, without starving either side.

    Policy calls (forward hooks, :meth:`enter` / :meth:`exit`) never overlap a write
    (:meth:`exclusive`): a write waits for the call in progress, and a call that starts while a
    write waits waits for the write. The preference for the waiting write bounds an update's wait
    to the call in progress even in a rollout loop that calls the policy without pause (a plain
    lock held across each call is free only between two calls, and Python's locks are not fair).
    The underlying lock is held only for a few instructions per call.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0
        self._writers = 0
        self._local = threading.local()

    def enter(self) -> None:
        """A policy call starts: waits while a write is pending or running."""
        with self._cond:
            while self._writers:
                self._cond.wait()
            self._calls += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def exit(self) -> None:
        """The call that this thread entered ends (a no-op without a matching :meth:`enter`)."""
        if getattr(self._local, "depth", 0) == 0:  # enter() never ran (an earlier pre-hook raised)
            return
        self._local.depth -= 1
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """No policy call runs inside this block (calls in progress finish first)."""
        with self._cond:
            self._writers += 1
            try:
                while self._calls:
                    self._cond.wait()
                yield
            finally:
                self._writers -= 1
                self._cond.notify_all()
