"""Unit tests of the async GRPO recipe's pieces: the versioned replay buffer (staleness accounting,
use-once sampling, group advantages; the shared sampler itself is tested in tests/integration/test_replay.py), the truncated importance-sampling weights and the GRPO
objective, the task's reward and tokenizer."""

from __future__ import annotations

import statistics

import pytest
import torch
from tensordict import TensorDict

from recipes.grpo.buffer import VersionedReplayBuffer, group_advantages
from recipes.grpo.loss import grpo_objective, truncated_is_weights
from recipes.grpo.task import CharTokenizer, CopyTask, SortTask, sort_reward


def rollout(version: int, first_group: int, rewards: list[list[float]]) -> TensorDict:
    """Samples of ``len(rewards)`` groups; sample ``j`` of group ``g`` has ``sample_id == 100 * g + j``."""
    groups, size = len(rewards), len(rewards[0])
    n = groups * size
    gid = torch.arange(first_group, first_group + groups).repeat_interleave(size)
    sid = torch.tensor([100 * (first_group + g) + j for g in range(groups) for j in range(size)])
    r = torch.tensor([x for row in rewards for x in row], dtype=torch.float32)
    return TensorDict(
        policy_version=torch.full((n,), version), group_id=gid, sample_id=sid,
        next=TensorDict(reward=r[:, None], done=torch.ones(n, 1, dtype=torch.bool), batch_size=[n]),
        batch_size=[n],
    )


class TestStaleness:
    def test_drops_exactly_the_samples_older_than_the_bound(self):
        buf = VersionedReplayBuffer(256, max_staleness=1, group_size=4)
        for v in range(4):  # 8 samples per version: 2 groups of 4
            buf.extend(rollout(v, 10 * v, [[0.0, 1.0, 0.5, 0.25], [1.0, 1.0, 0.0, 0.5]]))
        assert buf.stats()["added"] == 32
        # Trainer at version 3, bound 1: versions 0 and 1 are stale (lag 3 and 2): 16 samples.
        assert buf.num_fresh(3) == 16
        assert buf.dropped_stale == 16
        batch = buf.sample(16, 3)
        assert sorted(batch["policy_version"].tolist()) == [2] * 8 + [3] * 8
        assert batch["lag"].max().item() <= 1
        assert buf.sample(1, 3) is None  # use-once: nothing left
        assert buf.dropped_stale == 16  # dropped samples are counted once

    def test_bound_zero_keeps_only_the_current_version(self):
        buf = VersionedReplayBuffer(64, max_staleness=0, group_size=2)
        buf.extend(rollout(4, 0, [[0.0, 1.0]]))
        buf.extend(rollout(5, 1, [[0.0, 1.0]]))
        assert buf.sample(2, 5)["policy_version"].tolist() == [5, 5]
        assert buf.dropped_stale == 2
        assert buf.stats()["max_lag"] == 0

    def test_samples_are_used_once_and_oldest_first(self):
        buf = VersionedReplayBuffer(64, max_staleness=5, group_size=2, seed=3)
        buf.extend(rollout(2, 0, [[0.0, 1.0], [0.0, 1.0]]))
        buf.extend(rollout(1, 2, [[0.0, 1.0], [0.0, 1.0]]))
        buf.extend(rollout(3, 4, [[0.0, 1.0], [0.0, 1.0]]))
        seen = []
        versions = []
        while (b := buf.sample(4, 3)) is not None:
            seen += b["sample_id"].tolist()
            versions.append(sorted(set(b["policy_version"].tolist())))
        assert versions == [[1], [2], [3]]
        assert sorted(seen) == sorted(set(seen)) and len(seen) == 12
        assert buf.stats()["sampled"] == 12 and buf.dropped_stale == 0

    def test_slots_of_used_and_dropped_samples_are_reused_before_live_ones(self):
        buf = VersionedReplayBuffer(8, max_staleness=0, group_size=2)
        buf.extend(rollout(0, 0, [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]))  # full: 8 live
        assert buf.sample(2, 0) is not None  # 2 used
        assert buf.num_fresh(1) == 0  # 6 dropped: all stale at version 1
        buf.extend(rollout(1, 4, [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]))
        assert buf.stats()["overflow"] == 0  # written into the 8 consumed slots
        buf.extend(rollout(1, 8, [[0.0, 1.0]]))  # no free slot: overwrites 2 live samples
        assert buf.stats()["overflow"] == 2
        assert buf.num_fresh(1) == 8

    def test_lag_column_and_bound_checked_at_every_sample(self):
        buf = VersionedReplayBuffer(64, max_staleness=2, group_size=2)
        for v in (0, 1, 2, 3):
            buf.extend(rollout(v, v, [[0.0, 1.0]]))
        b = buf.sample(6, 3)  # version 0 has lag 3 > 2: dropped
        assert sorted(b["lag"].tolist()) == [0, 0, 1, 1, 2, 2]
        assert buf.dropped_stale == 2

    def test_bad_arguments_and_batches_are_rejected(self):
        # The sampler's own argument checks are in tests/integration/test_replay.py.
        with pytest.raises(ValueError):
            VersionedReplayBuffer(8, max_staleness=-1, group_size=2)
        with pytest.raises(ValueError):
            VersionedReplayBuffer(8, max_staleness=1, group_size=2, order="lifo")
        with pytest.raises(KeyError):
            VersionedReplayBuffer(8, max_staleness=1, group_size=2).extend(TensorDict(x=torch.zeros(2), batch_size=[2]))


class TestGroupAdvantages:
    def test_advantages_are_normalised_within_each_group(self):
        rewards = [[0.0, 1.0, 0.5, 0.5], [0.2, 0.4, 0.6, 1.0]]
        buf = VersionedReplayBuffer(64, max_staleness=0, group_size=4)
        buf.extend(rollout(0, 0, rewards))
        b = buf.sample(8, 0)
        got = {int(s): float(a) for s, a in zip(b["sample_id"], b["advantage"].reshape(-1))}
        for g, row in enumerate(rewards):
            mu, sd = statistics.mean(row), statistics.stdev(row)  # unbiased, like torch.std
            for j, r in enumerate(row):
                assert got[100 * g + j] == pytest.approx((r - mu) / sd, abs=1e-5)

    def test_identical_rewards_give_zero_advantage(self):
        buf = VersionedReplayBuffer(64, max_staleness=0, group_size=3)
        buf.extend(rollout(0, 0, [[0.7, 0.7, 0.7]]))
        assert buf.sample(3, 0)["advantage"].abs().max().item() == 0.0

    def test_an_incomplete_group_waits_for_its_other_samples(self):
        buf = VersionedReplayBuffer(64, max_staleness=0, group_size=4)
        half = rollout(0, 7, [[0.0, 1.0, 0.0, 1.0]])
        assert buf.extend(half[:2]) == 0
        assert buf.num_fresh(0) == 0
        assert buf.extend(half[2:]) == 4
        assert buf.num_fresh(0) == 4


    def test_group_advantages_of_a_flat_batch(self):
        # the LoRA recipe's workers: consecutive groups, advantages back in the rewards' order
        rewards = [0.0, 1.0, 0.5, 0.5, 0.2, 0.4, 0.6, 1.0, 0.7, 0.7, 0.7, 0.7]
        got = group_advantages(torch.tensor(rewards), 4).tolist()
        for g in range(3):
            row = rewards[4 * g:4 * g + 4]
            mu, sd = statistics.mean(row), statistics.stdev(row)
            for j, r in enumerate(row):
                assert got[4 * g + j] == pytest.approx((r - mu) / sd if sd else 0.0, abs=1e-5)
        with pytest.raises(ValueError, match="do not form whole groups of group_size 4"):
            group_advantages(torch.zeros(6), 4)


class TestImportanceWeights:
    def test_weights_are_the_truncated_probability_ratio(self):
        old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.6]]))
        gen = torch.log(torch.tensor([[0.25, 0.4, 0.3], [0.3, 0.1, 0.6]]))
        mask = torch.tensor([[True, True, True], [True, True, False]])
        w = truncated_is_weights(old, gen, mask, cap=2.5)
        expected = torch.tensor([[2.0, 0.5, 2.5], [1.0, 2.5, 0.0]])  # 0.9/0.3 = 3 and 0.3/0.1 = 3: capped
        torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)
        assert not w.requires_grad

    def test_no_cap_means_no_correction(self):
        old, gen = torch.zeros(2, 3), torch.full((2, 3), -1.0)
        mask = torch.tensor([[True, False, True], [False, False, True]])
        assert torch.equal(truncated_is_weights(old, gen, mask, cap=None), mask.float())

    def test_masked_tokens_never_overflow(self):
        old = torch.tensor([[0.0, 0.0]])
        gen = torch.tensor([[-1e4, 0.0]])  # exp(1e4) would be inf, but the token is masked
        w = truncated_is_weights(old, gen, torch.tensor([[False, True]]), cap=2.0)
        assert w.tolist() == [[0.0, 1.0]]

    def test_bad_input(self):
        with pytest.raises(ValueError):
            truncated_is_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), 2.0)
        with pytest.raises(ValueError):
            truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), 0.0)


class TestObjective:
    def test_gradient_is_the_weighted_advantage_inside_the_clip_range(self):
        logp = torch.log(torch.tensor([[0.5, 0.4], [0.2, 0.9]])).requires_grad_()
        old = logp.detach().clone()
        adv = torch.tensor([1.5, -0.5])
        mask = torch.tensor([[True, True], [True, False]])
        w = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
        loss, st = grpo_objective(logp, old, adv, mask, weights=w)
        loss.backward()
        # ratio == 1 everywhere: d loss / d logp = -w * A / (masked tokens)
        expected = -torch.tensor([[1.0 * 1.5, 2.0 * 1.5], [0.5 * -0.5, 0.0]]) / 3
        torch.testing.assert_close(logp.grad, expected)
        assert st["clip_frac"] == 0.0
        assert loss.item() == pytest.approx(-(1.5 + 3.0 - 0.25) / 3)

    def test_clipped_tokens_get_no_gradient(self):
        old = torch.zeros(1, 4)
        # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped, min picks the unclipped), same for A<0 below
        logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
        adv = torch.tensor([1.0])
        loss, st = grpo_objective(logp, old, adv, torch.ones(1, 4, dtype=torch.bool), clip=(0.8, 1.2))
        loss.backward()
        assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 2].item() == 0.0
        assert logp.grad[0, 1].item() == pytest.approx(-0.5 / 4)
        assert st["clip_frac"] == 0.5
        neg = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
        loss, _ = grpo_objective(neg, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool))
        loss.backward()
        assert neg.grad[0, 1].item() == 0.0  # A<0 and ratio below 0.8: clipped
        assert neg.grad[0, 0].item() == pytest.approx(1.5 / 2)


class TestTask:
    @pytest.mark.parametrize("response,target,reward", [
        ("11345", "11345", 1.0),
        ("11354", "11345", 0.6),   # two positions swapped
        ("1134", "11345", 0.8),    # one digit missing
        ("113456", "11345", 5 / 6),  # one digit too many
        ("", "11345", 0.0),
        ("?????", "11345", 0.0),
        (" 11345 ", "11345", 1.0),  # surrounding spaces are ignored
    ])
    def test_partial_credit(self, response, target, reward):
        assert sort_reward(response, target) == pytest.approx(reward)

    def test_problems_are_sorted_digits(self):
        import random

        task = SortTask(digits=6)
        rng = random.Random(0)
        for _ in range(20):
            prompt, answer = task.problem(rng)
            assert prompt.endswith("=") and len(prompt) == 7
            assert answer == "".join(sorted(prompt[:-1]))
            assert task.reward(answer, answer) == 1.0
        assert task.noisy_answer("12345", rng, 0.0) == "12345"

    def test_copy_problems_repeat_the_digits(self):
        import random

        rng = random.Random(1)
        for _ in range(20):
            prompt, answer = CopyTask(digits=4).problem(rng)
            assert prompt == answer + "=" and len(answer) == 4 and answer.isdigit()

    def test_tokenizer_round_trip(self):
        tok = CharTokenizer()
        ids = tok.encode("31415=")
        assert min(ids) >= 3 and tok.decode(ids) == "31415="
        assert tok.decode(tok.encode("123") + [tok.eos_id] + tok.encode("9")) == "123"
        with pytest.raises(ValueError, match="not in the tokenizer alphabet"):
            tok.encode("12a")


def test_a_checkpoint_without_tokenizer_files_is_refused_by_name(tmp_path):
    """``--model PATH`` on a folder with weights but no tokenizer files: transformers built an empty
    tokenizer (every digit encoded as nothing) and the run died in its warm start with a shape error."""
    from recipes.grpo.task import HFTokenizer
    from torch_deltasync.testing import tiny_qwen3

    tiny_qwen3("tiny").save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"the tokenizer in {tmp_path / 'ckpt'} encodes the task's digits "
                                         r"\['0', .*'9'\] as nothing .* no usable tokenizer files"):
        HFTokenizer(str(tmp_path / "ckpt"))
