"""The test and demo helpers (``testing.py``): integer views of states, the first difference, the
digest of a state, the seeded synthetic step, and the tiny Qwen3 models. Every comparison here is
on integer views: ``allclose`` would call ``+0.0`` and ``-0.0`` (or two NaN payloads) equal."""

from __future__ import annotations

import hashlib

import pytest
import torch

from torch_deltasync.testing import (
    QWEN3_SIZES, adam_step, bitwise_equal, first_difference, set_full_weights, state_bits, state_digest,
    synthetic_step, tiny_qwen3,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(5, generator=g),
            "steps": torch.tensor([3, 4])}  # an integer buffer: not compared


def _flip_one_bit(state: dict[str, torch.Tensor], name: str, index: int) -> dict[str, torch.Tensor]:
    """A copy of ``state`` whose bf16 tensor ``name`` differs from it in the lowest bit of one element."""
    out = {n: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for n, t in state.items()}
    out[name].view(-1).view(torch.int16)[index] ^= 1
    return out


def test_state_bits_are_integer_views_of_the_floating_tensors():
    state = _state()
    got = state_bits(state)
    assert sorted(got) == ["a.bias", "b.weight"]
    assert got["a.bias"].dtype == torch.int16  # bf16 bits
    assert torch.equal(got["a.bias"], state["a.bias"].to(torch.bfloat16).view(torch.int16))
    assert state_bits(state, torch.float32)["b.weight"].dtype == torch.int32
    got["a.bias"][0] ^= 1  # a copy: the state is untouched
    assert not torch.equal(got["a.bias"], state_bits(state)["a.bias"])


def test_first_difference_names_the_tensor_and_counts_elements():
    state = _state()
    assert first_difference(state, {n: t.clone() for n, t in state.items()}) is None
    assert first_difference(state, _flip_one_bit(state, "b.weight", 7)) == "b.weight: 1 of 12 elements differ"
    renamed = {("c.bias" if n == "a.bias" else n): t for n, t in state.items()}
    assert first_difference(state, renamed) == "different tensor names: ['a.bias', 'c.bias']"
    reshaped = dict(state, **{"b.weight": state["b.weight"].reshape(3, 4)})
    assert first_difference(state, reshaped) == "b.weight: shape (4, 3) vs (3, 4)"


def test_bitwise_equal_tells_apart_what_allclose_does_not():
    zero, neg_zero = {"w": torch.tensor([0.0])}, {"w": torch.tensor([-0.0])}
    assert torch.allclose(zero["w"], neg_zero["w"]) and not bitwise_equal(zero, neg_zero)
    nan = {"w": torch.tensor([float("nan")])}
    assert bitwise_equal(nan, {"w": nan["w"].clone()})  # same bits, though nan != nan
    # 1 + 2**-10 rounds to 1.0 in bf16 (8 bits of mantissa): equal in bf16, not in fp32
    a, b = {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0 + 2**-10])}
    assert bitwise_equal(a, b) and not bitwise_equal(a, b, torch.float32)


def test_state_digest_is_sha256_of_sorted_names_and_bits():
    state = _state()
    h = hashlib.sha256()
    for name in ("a.bias", "b.weight"):  # sorted, floating tensors only
        h.update(name.encode())
        h.update(state[name].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    assert state_digest(state) == h.hexdigest()


def test_state_digest_is_equal_for_equal_bits_and_changes_with_one_bit():
    state = _state()
    digest = state_digest(state)
    assert state_digest(dict(reversed(list(state.items())))) == digest  # insertion order does not matter
    cast = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    assert state_digest(cast) == digest  # already in bf16: the same bits
    assert state_digest(_flip_one_bit(state, "a.bias", 0)) != digest
    assert state_digest(_flip_one_bit(state, "b.weight", 11)) != digest
    assert state_digest(state, torch.float32) != digest  # the digest is of the bits in ``dtype``


def test_synthetic_step_is_seeded_by_step_and_name_order():
    def fresh():
        g = torch.Generator().manual_seed(1)
        return {"x": torch.randn(64, 64, generator=g), "y": torch.randn(1000, generator=g)}

    a, b = fresh(), fresh()
    synthetic_step(a, step=3)
    synthetic_step(dict(reversed(list(b.items()))), step=3)  # same change whatever the dict order
    assert bitwise_equal(a, b, torch.float32)
    c = fresh()
    synthetic_step(c, step=4)
    assert not bitwise_equal(a, c, torch.float32)
    before = fresh()
    changed = (state_bits(before, torch.float32)["x"] != state_bits(a, torch.float32)["x"]).float().mean().item()
    assert 0.03 < changed < 0.07  # about density=0.05 of the elements
    d = fresh()
    synthetic_step(d, step=3, density=0.0)
    assert bitwise_equal(d, before, torch.float32)


def test_set_full_weights_copies_plain_tensors_and_skips_integers():
    target = {"w": torch.zeros(2, 2), "n": torch.tensor([1, 2])}
    full = {"w": torch.arange(4.0).reshape(2, 2)}
    set_full_weights(target, full)
    assert torch.equal(target["w"].view(torch.int32), full["w"].view(torch.int32))
    assert target["n"].tolist() == [1, 2]


def test_tiny_qwen3_is_seeded_and_adam_step_changes_it():
    model = tiny_qwen3(seed=3)
    assert model.config.hidden_size == QWEN3_SIZES["tiny"]["hidden_size"] == 64
    assert sum(p.numel() for p in model.parameters()) < 500_000
    assert state_digest(model) == state_digest(tiny_qwen3(seed=3))
    assert state_digest(model) != state_digest(tiny_qwen3(seed=4))
    tied = tiny_qwen3(tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert tiny_qwen3(dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16
    before = state_digest(model, torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = adam_step(model, opt, generator=torch.Generator().manual_seed(0))
    assert loss == pytest.approx(torch.log(torch.tensor(1000.0)).item(), rel=0.05)  # ~uniform over the vocab
    assert state_digest(model, torch.float32) != before


def test_unknown_size_is_a_key_error():
    with pytest.raises(KeyError, match="nope"):
        tiny_qwen3("nope")
