"""Per-token version attribution of ``recipes.grpo.inflight.generate_chunked`` against a scripted
engine whose every sampled token carries the version that produced it in its log-prob, so the
expected versions come from the engine, not from the code under test."""

from __future__ import annotations

import pytest
import torch

from recipes.grpo.inflight import generate_chunked, tokens_by_lag

EOS, PAD = 2, 0


class ScriptedEngine:
    """Serves versions ``start, start+1, ...``; a newer version becomes staged before each round in
    ``stage_at`` (counting ``complete`` calls). Rollout ``r`` (its prompt is ``[1000 + r]``) ends
    with EOS after ``lengths[r]`` tokens. A token's log-prob is ``-(version + 1) - pos / 1000``."""

    def __init__(self, lengths: list[int], stage_at: set[int], start: int = 3, chunk: int = 2) -> None:
        self.lengths, self.stage_at, self.chunk = lengths, stage_at, chunk
        self._version = start
        self.staged = start
        self.calls = 0
        self.committed: list[int] = []
        self.requests: list[list[list[int]]] = []

    @property
    def version(self) -> int:
        return self._version

    def sync(self):
        if self.calls in self.stage_at and self.staged == self._version:
            self.staged += 1  # the background stager got a new version
        if self.staged > self._version:
            self._version = self.staged
            self.committed.append(self._version)
            return {"version": self._version, "stall_ms": 1.0}
        return None

    def complete(self, prompts, max_tokens):
        assert max_tokens <= self.chunk or self.chunk == 0
        self.requests.append([list(p) for p in prompts])
        self.calls += 1
        out = []
        for p in prompts:
            r, have = p[0] - 1000, len(p) - 1
            n = min(max_tokens, self.lengths[r] - have)
            toks = [10 + (have + j) % 5 for j in range(n)]
            finish = "length"
            if have + n == self.lengths[r]:
                toks[-1], finish = EOS, "stop"
            out.append({"tokens": toks, "logprobs": [-(self._version + 1) - (have + j) / 1000 for j in range(n)],
                        "finish_reason": finish})
        return out


def versions_from_logprobs(res) -> torch.Tensor:
    v = torch.round(-res.logprobs - 1).long()
    return torch.where(res.mask, v, -1)


def test_keep_tags_every_token_with_the_version_that_produced_it():
    eng = ScriptedEngine(lengths=[7, 3, 5], stage_at={2, 3}, chunk=2)
    res = generate_chunked(eng, [[1000], [1001], [1002]], max_new_tokens=8, chunk=2, interrupt="keep",
                           eos_id=EOS, pad_id=PAD)
    assert eng.committed == [4, 5]
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    # rollout 0 spans both commits: tokens 0-3 at v3, 4-5 at v4, 6 at v5
    assert res.token_version[0].tolist() == [3, 3, 3, 3, 4, 4, 5, -1]
    assert res.mask.sum(1).tolist() == [7, 3, 5]
    assert res.ids[0, 6] == EOS and res.ids[0, 7] == PAD
    assert [s["inflight"] for s in res.syncs] == [True, True]
    assert [s["partial_rollouts"] for s in res.syncs] == [2, 1]
    # each piece continued the rollout from its prompt plus every token it had so far
    assert eng.requests[2][0] == [1000, 10, 11, 12, 13]
    assert tokens_by_lag(res.token_version, res.mask, 5) == {2: 4 + 3 + 4, 1: 2 + 1, 0: 1}


def test_abort_restarts_partial_rollouts_on_the_new_version():
    eng = ScriptedEngine(lengths=[7, 3], stage_at={2}, chunk=2)
    res = generate_chunked(eng, [[1000], [1001]], max_new_tokens=8, chunk=2, interrupt="abort", eos_id=EOS, pad_id=PAD)
    assert eng.committed == [4]
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    # rollout 0 had 4 tokens at v3 when v4 was committed: dropped, regenerated from its prompt on v4
    assert res.token_version[0, :7].tolist() == [4] * 7
    assert res.token_version[1, :3].tolist() == [3] * 3  # finished before the commit
    assert res.dropped_tokens == 4 and res.syncs[0]["dropped_tokens"] == 4
    assert eng.requests[2][0] == [1000]


def test_drain_commits_nothing_inside_the_batch():
    eng = ScriptedEngine(lengths=[7, 3], stage_at={0, 1, 2}, chunk=8)
    res = generate_chunked(eng, [[1000], [1001]], max_new_tokens=8, chunk=2, interrupt="drain", eos_id=EOS, pad_id=PAD)
    assert eng.committed == [] and res.syncs == [] and res.rounds == 1
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    assert set(res.token_version[res.mask].tolist()) == {3}


def test_truncation_at_max_new_tokens_and_bad_arguments():
    eng = ScriptedEngine(lengths=[20], stage_at=set(), chunk=3)
    res = generate_chunked(eng, [[1000]], max_new_tokens=5, chunk=3, interrupt="keep", eos_id=EOS, pad_id=PAD)
    assert res.mask.sum().item() == 5 and EOS not in res.ids[0].tolist()
    with pytest.raises(ValueError, match="interrupt must be one of"):
        generate_chunked(eng, [[1000]], max_new_tokens=5, chunk=3, interrupt="pause", eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        generate_chunked(eng, [[1000]], max_new_tokens=5, chunk=0, interrupt="keep", eos_id=EOS, pad_id=PAD)
