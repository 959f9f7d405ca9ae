"""Per-token version attribution and re-submission of ``recipes.grpo.inflight.generate_inflight``
against a scripted engine. The engine samples every token at the version it serves at that moment,
writes that version into the token's log-prob and reports it in its spans (as vLLM does), so the
expected versions come from the engine, not from the code under test. Rollouts that should span a
commit block inside the engine at scripted positions until the driver commits (events, no sleeps)."""

from __future__ import annotations

import threading

import pytest
import torch

from recipes.grpo.inflight import commit_target, generate_inflight, token_versions, tokens_by_lag

EOS, PAD = 2, 0


class ScriptedEngine:
    """Serves versions ``start, start+1, ...``. Rollout ``r`` (its prompt starts with ``1000 + r``)
    ends with EOS after ``lengths[r]`` tokens; before sampling its token at a position in
    ``holds[r]`` (once per position) the request waits for the next commit, which :meth:`sync`
    makes only while some request waits. A commit with ``mode="abort"`` makes the waiting request
    return what it has (``finish_reason="abort"``). A token's log-prob is ``-(version + 1) - pos / 1000``."""

    def __init__(self, lengths: list[int], holds: dict[int, set[int]] | None = None, start: int = 3) -> None:
        self.lengths, self.holds = lengths, {r: set(p) for r, p in (holds or {}).items()}
        self._version = start
        self.cond = threading.Condition()
        self.waiting = 0
        self.aborting = False
        self.committed: list[tuple[int, str]] = []
        self.requests: list[tuple[list[int], int, int]] = []  # (prompt, max_tokens, n)

    @property
    def version(self) -> int:
        return self._version

    def sync(self, mode):
        with self.cond:
            if not self.waiting:
                return None
            self._version += 1
            self.waiting = 0  # every waiting request is released by this commit (not by a later poll)
            self.committed.append((self._version, mode))
            self.aborting = mode == "abort"
            self.cond.notify_all()
            return {"version": self._version, "stall_ms": 1.0}

    def _one(self, prompt, max_tokens):
        r, have = prompt[0] - 1000, len(prompt) - 1
        toks, lps, vers, finish = [], [], [], "length"
        for pos in range(have, min(have + max_tokens, self.lengths[r])):
            with self.cond:
                if pos in self.holds.get(r, ()):
                    self.holds[r].discard(pos)
                    v0 = self._version
                    self.waiting += 1
                    self.cond.wait_for(lambda: self._version != v0)
                    if self.aborting:
                        self.aborting = False
                        finish = "abort"
                        break
                v = self._version
            toks.append(EOS if pos == self.lengths[r] - 1 else 10 + pos % 5)
            lps.append(-(v + 1) - pos / 1000)
            vers.append(v)
        if toks and toks[-1] == EOS:
            finish = "stop"
        spans = []
        for j, v in enumerate(vers):
            if spans and spans[-1]["version"] == str(v):
                spans[-1]["end"] = j + 1
            else:
                spans.append({"version": str(v), "start": j, "end": j + 1})
        return {"tokens": toks, "logprobs": lps, "finish_reason": finish, "versions": spans}

    def generate(self, prompt, max_tokens, n):
        with self.cond:
            self.requests.append((list(prompt), max_tokens, n))
        return [self._one(prompt, max_tokens) for _ in range(n)]


def versions_from_logprobs(res) -> torch.Tensor:
    v = torch.round(-res.logprobs - 1).long()
    return torch.where(res.mask, v, -1)


def run(eng, prompts, interrupt, max_new_tokens=8):
    return generate_inflight(eng, prompts, max_new_tokens=max_new_tokens, interrupt=interrupt, eos_id=EOS,
                             pad_id=PAD, poll_s=0.001)


def test_keep_tags_every_token_with_the_version_that_sampled_it():
    eng = ScriptedEngine(lengths=[7, 3, 5], holds={0: {4, 6}})
    res = run(eng, [[1000], [1001], [1002]], "keep")
    assert eng.committed == [(4, "keep"), (5, "keep")]
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    # rollout 0 ran through both commits in one request: tokens 0-3 at v3, 4-5 at v4, 6 at v5
    assert res.token_version[0].tolist() == [3, 3, 3, 3, 4, 4, 5, -1]
    assert res.mask.sum(1).tolist() == [7, 3, 5]
    assert res.ids[0, :7].tolist() == [10, 11, 12, 13, 14, 10, EOS] and res.ids[0, 7] == PAD
    assert res.requests == 3 and res.resubmitted == 0  # keep never re-submits
    assert [s["inflight"] for s in res.syncs] == [True, True]
    assert all(s["partial_rollouts"] >= 1 for s in res.syncs)
    assert [s["rollouts_across"] for s in res.syncs] == [1, 1]  # rollout 0: v3 | v4 | v5 tokens
    want = {}
    for v in versions_from_logprobs(res)[res.mask].tolist():
        want[5 - v] = want.get(5 - v, 0) + 1
    assert tokens_by_lag(res.token_version, res.mask, 5) == want


def test_abort_resubmits_the_prefix_on_the_new_weights():
    eng = ScriptedEngine(lengths=[7, 3], holds={0: {4}})
    res = run(eng, [[1000], [1001]], "abort")
    assert eng.committed == [(4, "abort")]
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    # rollout 0 was aborted after 4 tokens at v3: those keep v3; the rest was sampled on v4 after
    # the prompt plus the 4 tokens went back to the engine
    assert res.token_version[0, :7].tolist() == [3, 3, 3, 3, 4, 4, 4]
    assert res.ids[0, :7].tolist() == [10, 11, 12, 13, 14, 10, EOS]
    assert ([1000, 10, 11, 12, 13], 4, 1) in eng.requests
    assert res.resubmitted == 1 and res.requests == 3
    assert res.syncs[0]["inflight"] is True and res.syncs[0]["version"] == 4
    assert res.syncs[0]["rollouts_across"] == 1  # the re-submitted one: prefix at v3, the rest at v4


def test_drain_commits_nothing_and_sends_identical_prompts_as_one_request():
    eng = ScriptedEngine(lengths=[7, 3])
    res = run(eng, [[1000], [1000], [1001]], "drain")
    assert eng.committed == [] and res.syncs == []
    assert sorted(eng.requests) == [([1000], 8, 2), ([1001], 8, 1)] and res.requests == 2
    assert torch.equal(res.token_version, versions_from_logprobs(res))
    assert set(res.token_version[res.mask].tolist()) == {3}
    assert res.mask.sum(1).tolist() == [7, 7, 3]


def test_truncation_at_max_new_tokens():
    eng = ScriptedEngine(lengths=[20])
    res = run(eng, [[1000]], "keep", max_new_tokens=5)
    assert res.mask.sum().item() == 5 and EOS not in res.ids[0].tolist()
    assert res.token_version[0].tolist() == [3] * 5


def test_bad_arguments_and_engine_answers():
    eng = ScriptedEngine(lengths=[3])
    with pytest.raises(ValueError, match="interrupt must be one of"):
        run(eng, [[1000]], "pause")
    with pytest.raises(ValueError, match="poll_s must be > 0"):
        generate_inflight(eng, [[1000]], max_new_tokens=5, interrupt="keep", eos_id=EOS, pad_id=PAD, poll_s=0)

    class Unlabelled(ScriptedEngine):
        def generate(self, prompt, max_tokens, n):
            return [{**c, "versions": []} for c in super().generate(prompt, max_tokens, n)]

    with pytest.raises(RuntimeError, match="do not cover its 3 output tokens"):
        run(Unlabelled(lengths=[3]), [[1000]], "keep")

    class Aborting(ScriptedEngine):  # an abort no commit of ours explains (e.g. a server shutting down)
        def generate(self, prompt, max_tokens, n):
            return [{**c, "finish_reason": "abort"} for c in super().generate(prompt, 1, n)]

    with pytest.raises(RuntimeError, match="no abort commit happened"):
        run(Aborting(lengths=[5]), [[1000]], "abort")


def test_token_versions_from_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    assert token_versions(spans, 3) == [3, 3, 5]
    assert token_versions([], 0) == []
    with pytest.raises(RuntimeError, match="must be integers"):
        token_versions([{"version": "default", "start": 0, "end": 1}], 1)
    with pytest.raises(RuntimeError, match="do not cover"):
        token_versions([{"version": "3", "start": 1, "end": 2}], 2)


def test_commit_target_waits_for_every_worker_and_the_lag():
    assert commit_target([7, 6], None) == 6  # the newest version every worker staged
    assert commit_target([7, None], 5) is None and commit_target([], 5) is None  # a worker has not staged
    assert commit_target([6, 6], 6) is None and commit_target([7, 7], 6) == 7
    assert commit_target([7, 7], 6, min_lag=2) is None  # one version behind: not worth a pause yet
    assert commit_target([9, 8], 6, min_lag=2) == 8  # two behind: the newest staged, one pause for both
    with pytest.raises(ValueError, match="min_lag must be >= 1"):
        commit_target([7], 6, min_lag=0)
