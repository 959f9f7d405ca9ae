"""The LoRA recipe's rollout engines (``recipes/grpo/lora_rollouts.py``) and the shared response
layout (``recipes.grpo.policy.pad_responses``). The vLLM engine runs live in
``tests/integration/test_recipe_async_grpo_lora.py`` (``--engine vllm``); here the PEFT engine's
handling of a version it cannot apply, and the pieces that need no engine."""

from __future__ import annotations

import pytest
import torch

from recipes.grpo.lora_rollouts import PeftRollouts, vllm_max_lora_rank
from recipes.grpo.policy import pad_responses


def test_max_lora_rank_is_the_smallest_vllm_accepts():
    assert vllm_max_lora_rank({"r": 8}) == 8
    assert vllm_max_lora_rank({"r": 9}) == 16
    assert vllm_max_lora_rank({"r": 4, "rank_pattern": {"q_proj": 20}}) == 32
    with pytest.raises(ValueError, match="LoRA rank 600 is above vLLM's largest --max-lora-rank \\(512\\)"):
        vllm_max_lora_rank({"r": 600})


def test_pad_responses_layout():
    ids, mask, lps = pad_responses([[5, 6, 2, 7], [9]], [[-0.5, -0.25, -1.0, -3.0], [-2.0]], max_new_tokens=5,
                                   eos_id=2, pad_id=0)
    assert ids.tolist() == [[5, 6, 2, 7, 0], [9, 0, 0, 0, 0]]
    # up to and including the first end-of-sequence; nothing after it counts
    assert mask.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]
    assert lps.tolist() == [[-0.5, -0.25, -1.0, 0.0, 0.0], [-2.0, 0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="response 0: 6 tokens \\(at most 5\\)"):
        pad_responses([[1] * 6], [[0.0] * 6], max_new_tokens=5, eos_id=2, pad_id=0)
    with pytest.raises(ValueError, match="response 0: 2 tokens \\(at most 5\\) with 1 log-probs"):
        pad_responses([[1, 1]], [[0.0]], max_new_tokens=5, eos_id=2, pad_id=0)
    with pytest.raises(ValueError):  # one list of log-probs for two responses
        pad_responses([[1], [1]], [[0.0]], max_new_tokens=5, eos_id=2, pad_id=0)


def test_a_version_that_cannot_be_applied_is_skipped_and_sampling_goes_on(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from recipes.async_grpo_lora import TOK, base_model
    from torch_deltasync.integrations.peft import AdapterSender, adapter_state_dict
    from torch_deltasync.store import LocalStore

    store = LocalStore(tmp_path / "bucket", fsync=False)
    trainer = get_peft_model(base_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    sender = AdapterSender(trainer, store)

    def held_bits(engine):
        return {n: t.detach().to(torch.bfloat16).view(torch.int16).clone()
                for n, t in adapter_state_dict(engine.model).items()}

    with pytest.raises(TimeoutError, match="bucket: no version was published within 0.2 s"):  # only the config
        PeftRollouts(store, base_model(), TOK, timeout_s=0.2)
    sender.publish()
    v0 = {n: t.detach().to(torch.bfloat16).view(torch.int16).clone() for n, t in adapter_state_dict(trainer).items()}
    engine = PeftRollouts(store, base_model(), TOK, timeout_s=5)
    assert engine.version is None and engine.refresh()["path"] == "anchor" and engine.version == 0
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.add_(0.01)
    assert sender.publish() == 1
    obj = next((tmp_path / "bucket" / "objects" / "000000000001").iterdir())
    obj.write_bytes(obj.read_bytes()[:-7] + b"garbage")
    got = engine.refresh()
    assert "error" in got and "version 1" in got["error"], got
    assert "sampling on with version 0" in capsys.readouterr().err
    held = held_bits(engine)
    assert engine.version == 0 and held.keys() == v0.keys() and all(torch.equal(held[n], v0[n]) for n in v0)
    pids = torch.tensor([[TOK.bos_id, 5, 6]] * 2)
    ids, mask, lps = engine.sample(pids, torch.ones_like(pids), max_new_tokens=4, temperature=1.0)
    assert ids.shape == mask.shape == lps.shape == (2, 4) and bool(mask[:, 0].all())
    engine.close()
    # a worker that holds no version yet has nothing to sample with: the error ends it
    fresh = PeftRollouts(store, base_model(), TOK, timeout_s=5)
    (tmp_path / "bucket" / "objects" / "000000000000").rename(tmp_path / "gone")
    with pytest.raises(Exception, match="version"):
        fresh.refresh()
    sender.close()
