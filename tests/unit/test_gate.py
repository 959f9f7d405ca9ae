"""``CallGate``: a write waits for the call in progress; a call that starts while a write waits
waits for the write (so writes are never starved by back-to-back calls)."""

from __future__ import annotations

import threading

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
