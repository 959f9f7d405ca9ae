"""Pieces of the GRPO recipes: the main job (``python -m recipes.async_grpo``) and the LoRA recipe
(``recipes/async_grpo_lora.py``), which share the task, tokenizer, sampling, log-probs, objective
and group advantages below.

One concept per module:

- :mod:`.config`: the run configuration (one frozen dataclass, every field documented);
- :mod:`.task`: the verifiable task (sorting digits, partial-credit reward) and the in-code tokenizer;
- :mod:`.policy`: building the Qwen3 policy, the cached supervised warm start, token log-probs;
- :mod:`.loss`: the clipped GRPO objective and truncated importance-sampling weights;
- :mod:`.buffer`: the versioned replay buffer on torchrl (staleness gate, use-once sampling);
- :mod:`.generators`: generator backends (Hugging Face on CPU; vLLM servers; offline vLLM on GPU);
- :mod:`.vllm_server`: a vLLM OpenAI server process under a supervisor (no orphans);
- :mod:`.inflight`: rollouts with commits in flight and the engine's per-token versions;
- :mod:`.actors`: the Monarch actors (trainer, generator, replay buffer);
- :mod:`.report`: metrics JSONL, the summary and the plots.
"""
