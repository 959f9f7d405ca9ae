"""``CallGate``: a write waits for the call in progress; a call that starts while a write waits
waits for the write (so writes are never starved by back-to-back calls)."""

from __future__ import annotations

import threading

import pytest

from torch_deltasync.gate import CallGate


def test_a_write_waits_for_the_call_in_progress_and_blocks_new_calls():
    gate = CallGate()
    order: list[str] = []
    in_call, second_trying = threading.Event(), threading.Event()

    def first_call():
        gate.enter()
        order.append("call 1 starts")
        in_call.set()
        second_trying.wait(10)  # the writer and the second call are both waiting on this call now
        order.append("call 1 ends")
        gate.exit()

    def writer():
        in_call.wait(10)
        with gate.exclusive():
            order.append("write")

    def second_call():
        in_call.wait(10)
        while not gate._writers:  # the writer registered (it cannot finish before call 1 ends)
            pass
        second_trying.set()
        gate.enter()
        order.append("call 2")
        gate.exit()

    threads = [threading.Thread(target=f) for f in (first_call, writer, second_call)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["call 1 starts", "call 1 ends", "write", "call 2"]


def test_exit_without_enter_is_a_no_op_and_nested_calls_count():
    gate = CallGate()
    gate.exit()
    gate.enter()
    gate.enter()
    gate.exit()
    gate.exit()
    with gate.exclusive():  # would wait forever if a call were still counted
        pass


def _finishes(target, timeout_s: float = 5.0) -> bool:
    t = threading.Thread(target=target, daemon=True)  # a deadlock leaves a daemon thread, not a hung run
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def test_a_nested_call_does_not_wait_for_a_write_that_waits_for_its_outer_call():
    """Regression: the inner enter() waited for the pending write, which waited for the outer call."""
    gate = CallGate()
    order: list[str] = []
    writer_waiting = threading.Event()

    def policy():
        gate.enter()
        writer_waiting.wait(5)
        while not gate._writers:
            pass
        gate.enter()  # nested: the outer call is in progress in this thread
        order.append("inner call")
        gate.exit()
        gate.exit()

    def writer():
        writer_waiting.set()
        with gate.exclusive():
            order.append("write")

    t = threading.Thread(target=policy, daemon=True)
    t.start()
    assert _finishes(writer) and _finishes(t.join)
    assert order == ["inner call", "write"]


def test_calls_of_other_threads_wait_for_the_write_but_the_writers_own_calls_do_not():
    gate = CallGate()
    order: list[str] = []
    writing, other_trying = threading.Event(), threading.Event()

    def other_call():
        writing.wait(5)
        other_trying.set()
        gate.enter()
        order.append("other thread's call")
        gate.exit()

    def writer():
        with gate.exclusive():
            writing.set()
            other_trying.wait(5)
            gate.enter()  # the writer's own policy call (e.g. a check after loading)
            order.append("writer's own call")
            gate.exit()
            with gate.exclusive():  # a nested write of the same thread
                order.append("nested write")
            order.append("write ends")

    t = threading.Thread(target=other_call, daemon=True)
    t.start()
    assert _finishes(writer) and _finishes(t.join)
    assert order == ["writer's own call", "nested write", "write ends", "other thread's call"]


def test_a_write_inside_a_call_of_the_same_thread_is_refused_not_a_deadlock():
    gate = CallGate()
    gate.enter()
    with pytest.raises(RuntimeError, match=r"CallGate.exclusive: this thread is inside a policy call"):
        with gate.exclusive():
            pass
    gate.exit()
    assert _finishes(lambda: gate.exclusive().__enter__())


def test_writes_of_two_threads_take_turns():
    gate = CallGate()
    inside, overlaps = [0], []

    def writer():
        for _ in range(200):
            with gate.exclusive():
                inside[0] += 1
                if inside[0] != 1:
                    overlaps.append(inside[0])
                threading.Event().wait(0.0001)
                inside[0] -= 1

    threads = [threading.Thread(target=writer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    assert all(_finishes(t.join, 20) for t in threads)
    assert overlaps == [] and gate._writer is None and gate._writers == 0


def test_a_write_closed_on_another_thread_leaves_no_writer_behind():
    """The write is the gate's, not the thread's: closing it elsewhere (an ExitStack handed over)
    lets other threads' calls wait for writes again."""
    gate = CallGate()
    block = gate.exclusive()
    block.__enter__()
    assert _finishes(lambda: block.__exit__(None, None, None))
    assert gate._writer is None and gate._writers == 0
    with gate.exclusive():  # a write of this thread again: no stale "already writing"
        assert gate._writer is threading.current_thread()
