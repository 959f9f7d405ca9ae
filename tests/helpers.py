"""Small models and steps shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import torch

from torch_deltasync.store.base import Store


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


def encoded_nbytes(codec: str, prev: dict, cur: dict) -> int:
    """Bytes of the encoded tensors of the delta ``prev -> cur`` (``{name: int16 bf16 bit view}``), as
    ``codec`` writes them: what ``AnchorPolicy.max_delta_ratio`` compares with the full bf16 bytes."""
    from torch_deltasync import get_codec

    c, total = get_codec(codec), 0
    for n in cur:
        pos = torch.nonzero((cur[n] != prev[n]).reshape(-1)).squeeze(1)
        if pos.numel():
            new, old = cur[n].reshape(-1)[pos].view(torch.bfloat16), prev[n].reshape(-1)[pos].view(torch.bfloat16)
            total += sum(t.numel() * t.element_size() for t in c.encode(pos, new, old, numel=cur[n].numel()).values())
    return total


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
