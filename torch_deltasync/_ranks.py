"""Run a function on ``world`` local CPU processes joined by a gloo process group (tests, benchmarks).

``torchrun`` is the way to launch real jobs (see ``recipes/torchrun_fsdp2.py``); this helper exists so
that tests and ``tools/bench_fsdp2.py`` can start many small process groups from one Python process,
with a deadline, and get every rank's result or traceback back instead of a hang:

* processes are forked from a ``forkserver`` that has imported torch (``spawn`` on request), so each
  rank starts in a fraction of a second and in a clean state (no threads, no process group);
* the rendezvous is a ``FileStore`` in a fresh temporary folder, so concurrent runs on one machine never
  collide on a TCP port;
* each rank's return value (JSON) or traceback comes back through a file; when any rank fails or the
  deadline passes, the remaining ranks are killed (by their own process ids) and the error names the
  rank.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_ranks"]


def _entry(fn: Callable[..., Any], rank: int, world: int, folder: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the CPU cores
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it: every rank runs on this host
    out = Path(folder) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a rank that died mid-collective leaves a broken group
                pass
        out.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise SystemExit(1)


_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch_deltasync"]


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0,
              allow_exit: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes (one torch thread each) in one gloo
    process group. A forkserver that imported torch once forks every rank (~0.1 s instead of
    seconds of imports per rank on a loaded machine; nothing has run there, so no threads exist).

    Args:
        fn: a module-level function (spawned processes import it by name, so a script that calls
            ``run_ranks`` needs the ``if __name__ == "__main__":`` guard of multiprocessing); its
            return value must be JSON-serialisable.
        world: number of processes (ranks ``0 .. world-1``).
        args: extra arguments, picklable.
        timeout_s: deadline for the whole run (seconds); then every process still alive is killed.
        allow_exit: ranks that may end without a result (a test that kills a rank on purpose); their
            entry in the returned list is ``None``.

    Returns:
        ``[result of rank 0, ..., result of rank world-1]``.

    Raises:
        RuntimeError: a rank raised (the message holds its traceback), exited without a result, or
            the deadline passed.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="deltasync-ranks-") as folder:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, folder, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed: str | None = None
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    failed = f"timed out after {timeout_s} s"
                    break
                for r, p in enumerate(procs):
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in allow_exit:
                        failed = f"rank {r} exited with code {p.exitcode}"
                if failed:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # only the processes started here, by their own handles
                if p.is_alive():
                    p.kill()
                p.join(10)
        results, errors = [], []
        for r in range(world):
            f = Path(folder) / f"rank{r}.json"
            if not f.exists():
                results.append(None)
                if r not in allow_exit:
                    errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                continue
            rec = json.loads(f.read_text())
            if rec["ok"]:
                results.append(rec["result"])
            else:
                results.append(None)
                errors.append(f"rank {r} raised:\n{rec['error']}")
        if failed or errors:
            raise RuntimeError(f"run_ranks({getattr(fn, '__name__', fn)}, world={world}): "
                               f"{failed or 'failed'}\n" + "\n".join(errors))
        return results

