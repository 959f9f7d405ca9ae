"""Small deterministic "models" for the store, retention, fault and crash tests.

``state_at(step)`` is a pure function of ``(seed, step)``, so a writer subprocess killed at any
point and a fresh writer (or the test itself) agree on the exact weights of every step without
talking to each other. Consecutive steps differ in a few elements, like RL updates.
"""

from __future__ import annotations

import torch

SHAPES = {"embed.weight": (96, 32), "layers.0.mlp.weight": (64, 48), "layers.0.norm.weight": (48,),
          "lm_head.weight": (40, 64)}


class StepModel:
    """A dict of live fp32 tensors whose values at step ``s`` are :meth:`state_at` ``(s)``.

    Args:
        seed: selects the base weights and every step's changes.
        changes: elements overwritten per tensor and step (at most ``numel``).
    """

    def __init__(self, seed: int = 0, changes: int = 12, shapes: dict[str, tuple[int, ...]] = SHAPES) -> None:
        self.seed = seed
        self.changes = changes
        self.shapes = dict(shapes)
        g = torch.Generator().manual_seed(seed)
        self.base = {n: torch.randn(s, generator=g) * 0.02 for n, s in self.shapes.items()}
        self.tensors = {n: t.clone() for n, t in self.base.items()}
        self.step = 0

    def state_at(self, step: int) -> dict[str, torch.Tensor]:
        """The fp32 weights at ``step``: the base, with ``changes`` elements per tensor replaced."""
        out = {}
        for i, (n, b) in enumerate(self.base.items()):
            t = b.clone()
            if step:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + i)
                k = min(self.changes, t.numel())
                pos = torch.randperm(t.numel(), generator=g)[:k]
                t.view(-1)[pos] = torch.randn(k, generator=g) * 0.02
            out[n] = t
        return out

    def set_step(self, step: int) -> None:
        """Write :meth:`state_at` ``(step)`` into the live tensors in place."""
        for n, t in self.state_at(step).items():
            self.tensors[n].copy_(t)
        self.step = step

    def bits_at(self, step: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Integer views of the weights at ``step`` cast to ``dtype`` (what receivers must hold)."""
        return {n: t.to(dtype).view(torch.int16 if dtype.itemsize == 2 else torch.int32).clone()
                for n, t in self.state_at(step).items()}


def empty_target(shapes: dict[str, tuple[int, ...]] = SHAPES, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A receiver's state dict, all zeros (it holds nothing yet)."""
    return {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}


def bits_of(target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16 if t.dtype.itemsize == 2 else torch.int32).clone() for n, t in target.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two dicts of integer views are identical (names, shapes and every bit)."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def assert_holds(target: dict[str, torch.Tensor], model: StepModel, step: int) -> None:
    """Fail with the first differing tensor unless ``target`` holds step ``step`` bit-exactly."""
    want = model.bits_at(step)
    got = bits_of(target)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), f"{n}: {int((got[n] != want[n]).sum())} elements differ at step {step}"
