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
    (:meth:`exclusive`): a write waits for the calls in progress, and a call that starts while a
    write waits waits for the write. The preference for the waiting write bounds an update's wait
    to the call in progress even in a rollout loop that calls the policy without pause (a plain
    lock held across each call is free only between two calls, and Python's locks are not fair).
    The underlying lock is held only for a few instructions per call and per write.

    Reentrant where waiting would wait for itself: a call nested in a call of the same thread, a
    call made by the thread inside its own write, and a write nested in its own write go ahead at
    once. A write inside a call of the same thread raises :class:`RuntimeError` (the call in
    progress would have to end first). Per thread: asyncio tasks of one thread count as one caller.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0
        self._writers = 0  # waiting or writing
        self._writer: threading.Thread | None = None  # the thread writing, if any (not its ident: idents are reused)
        self._local = threading.local()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def enter(self) -> None:
        """A policy call starts: waits while a write is pending or running (unless this thread is
        already in a call, or is the one writing)."""
        depth = self._depth()
        with self._cond:
            if not depth and self._writer is not threading.current_thread():
                while self._writers:
                    self._cond.wait()
            self._calls += 1
        self._local.depth = depth + 1

    def exit(self) -> None:
        """The call that this thread entered ends (a no-op without a matching :meth:`enter`)."""
        if self._depth() == 0:  # enter() never ran (an earlier pre-hook raised)
            return
        self._local.depth -= 1
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """No policy call of another thread runs inside this block (calls in progress finish
        first; writes take turns).

        Raises:
            RuntimeError: this thread is inside a policy call (it would wait for itself).
        """
        me = threading.current_thread()
        if self._writer is me:  # nested in this thread's own write
            yield
            return
        if self._depth():
            raise RuntimeError("CallGate.exclusive: this thread is inside a policy call, which would have to end "
                               "before the write; write the weights outside the call (e.g. after the forward pass)")
        with self._cond:
            self._writers += 1
            try:
                while self._calls or self._writer is not None:
                    self._cond.wait()
            except BaseException:
                self._writers -= 1
                self._cond.notify_all()
                raise
            self._writer = me
        try:
            yield
        finally:  # (on whichever thread closes the block)
            with self._cond:
                self._writer = None
                self._writers -= 1
                self._cond.notify_all()
