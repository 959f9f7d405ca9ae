"""Small models and steps shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torch_deltasync.store import Store


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small two-layer model (~5k parameters) with std-0.02 weights."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m.to(dtype)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randn(8, 32, generator=gen)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def payload_nbytes(data: bytes) -> int:
    """Bytes of the tensors in a safetensors file, read from its own header (an 8-byte little-endian
    header length, then JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


def delta_payloads(codec: str, states: dict[int, dict[str, torch.Tensor]], root) -> dict[int, int]:
    """``{v: bytes}`` for every ``v > 0`` of ``states`` (``{0: {name: int16 bf16 bits}, 1: ..., n: ...}``):
    the bytes of the tensors ``codec`` stores for the delta ``v - 1 -> v``, what
    ``AnchorPolicy.max_delta_ratio`` compares with the full bf16 bytes. Read back from the objects
    of a reference run under ``root`` that publishes every version as a delta (no size rule), so the
    expectation comes from stored bytes, not from calling the codec the way the sender does."""
    from torch_deltasync import AnchorPolicy, DeltaSender, LocalStore

    store = LocalStore(root, fsync=False)
    live = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in states[0].items()}
    sender = DeltaSender(live, store, codec=codec, anchor_policy=AnchorPolicy(every=None))
    out = {}
    for v in sorted(states):
        for n, t in live.items():
            t.view(torch.int16).copy_(states[v][n])
        assert sender.publish() == v
        if v:
            out[v] = sum(payload_nbytes(store.get(k)) for k in store.list(f"objects/{v:012d}") if "/delta-" in k)
    sender.close()
    return out


class PassThroughStore(Store):
    """Forwards every call to ``inner``; test stores subclass it and override the calls they fake."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def put(self, key, data):
        self.inner.put(key, data)

    def get(self, key, *, start=None, end=None):
        return self.inner.get(key, start=start, end=end)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    def size(self, key):
        return self.inner.size(key)

    def describe(self):
        return self.inner.describe()


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (a vLLM server's engine processes share its group),
    zombies excluded (Linux ``/proc``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:  # bytes: a process name need not be UTF-8
            state, _ppid, pgrp = (d / "stat").read_bytes().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # the process ended while we looked, or an odd entry
        if int(pgrp) == pgid and state != b"Z":
            out.append(int(d.name))
    return out
