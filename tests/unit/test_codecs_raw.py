"""The raw codec (format 1): round trips and strict validation of untrusted parts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_deltasync import get_codec
from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.codecs import codec_names

RAW = get_codec("raw")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.floats(0, 1), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       st.integers(0, 2**31))
def test_round_trip(numel, density, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(numel, generator=g) < density
    pos = mask.nonzero().squeeze(1)
    vals = torch.randn(pos.numel(), generator=g).to(dtype)
    parts = RAW.encode(pos, vals, vals, numel=numel)
    assert parts["idx"].dtype == torch.int32
    d = RAW.decode(parts, numel=numel, count=pos.numel(), dtype=dtype)
    assert torch.equal(d.positions, pos)
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(d.resolve().view(width), vals.view(width))


def test_int64_positions_from_2_31_elements():
    pos = torch.tensor([0, 2**31 + 5])
    parts = RAW.encode(pos, torch.ones(2, dtype=torch.bfloat16), None, numel=2**31 + 6)
    assert parts["idx"].dtype == torch.int64
    d = RAW.decode(parts, numel=2**31 + 6, count=2, dtype=torch.bfloat16)
    assert d.positions.tolist() == [0, 2**31 + 5]
    with pytest.raises(CorruptObjectError, match="int64"):
        RAW.decode({"idx": pos.to(torch.int32), "val": parts["val"]}, numel=2**31 + 6, count=2, dtype=torch.bfloat16)


V = torch.ones(3, dtype=torch.bfloat16)
BAD = [
    ({"idx": torch.tensor([0, 1, 10], dtype=torch.int32), "val": V}, "outside", "index out of range"),
    ({"idx": torch.tensor([-1, 1, 2], dtype=torch.int32), "val": V}, "outside", "negative index"),
    ({"idx": torch.tensor([0, 2, 2], dtype=torch.int32), "val": V}, "strictly increasing", "duplicate"),
    ({"idx": torch.tensor([0, 3, 2], dtype=torch.int32), "val": V}, "strictly increasing", "unsorted"),
    ({"idx": torch.tensor([0, 1, 2], dtype=torch.int32), "val": V.float()}, "values must be", "wrong value dtype"),
    ({"idx": torch.tensor([0.0, 1, 2]), "val": V}, "int32/int64", "float indices"),
    ({"idx": torch.tensor([[0, 1, 2]], dtype=torch.int32), "val": V}, "1-D", "2-D indices"),
    ({"idx": torch.tensor([0, 1], dtype=torch.int32), "val": V[:2]}, "declared 3", "count mismatch"),
    ({"idx": torch.tensor([0, 1, 2], dtype=torch.int32)}, "expected parts", "missing values"),
    ({"idx": torch.tensor([0, 1, 2], dtype=torch.int32), "val": V, "x": V}, "expected parts", "extra part"),
]


@pytest.mark.parametrize("parts,match,why", BAD)
def test_decode_rejects(parts, match, why):
    with pytest.raises(CorruptObjectError, match=match):
        RAW.decode(parts, numel=10, count=3, dtype=torch.bfloat16)


def test_unknown_codec_lists_the_known_ones():
    with pytest.raises(ValueError, match="raw"):
        get_codec("nope")
    assert "raw" in codec_names()


@pytest.mark.parametrize("pos, numel, match", [
    ([0, 2**32 + 1], 10, "outside"),  # would wrap to 1 in int32: a corrupt object, found only by a receiver
    ([-1, 2], 10, "outside"),
    ([3, 3], 10, "strictly increasing"),
    ([5, 1], 10, "strictly increasing"),
])
def test_encode_rejects_bad_positions(pos, numel, match):
    with pytest.raises(ValueError, match=match) as e:
        RAW.encode(torch.tensor(pos), V[:2], V[:2], numel=numel)
    assert not isinstance(e.value, CorruptObjectError)  # the caller's input, not a store object
    with pytest.raises(ValueError, match="same length"):
        RAW.encode(torch.tensor([0, 1]), V, V, numel=numel)


@pytest.mark.parametrize("codec", ["raw", "packed"])
@pytest.mark.parametrize("pos, got", [
    (torch.tensor([0.9, 1.9]), "torch.float32"),  # were truncated to [0, 1]
    (torch.tensor([True, True]), "torch.bool"),  # were read as [1, 1]
    (torch.tensor([[0, 1]]), r"\(1, 2\)"),  # were flattened
    ([0, 1], "list"),
])
def test_encoders_refuse_positions_they_would_convert(codec, pos, got):
    with pytest.raises(TypeError, match=rf"{codec} codec: positions must be a 1-D integer tensor \(int64\), got .*{got}"):
        get_codec(codec).encode(pos, V[:2], V[:2], numel=10)
    assert get_codec(codec).encode(torch.tensor([0, 1], dtype=torch.int32), V[:2], V[:2], numel=10)
