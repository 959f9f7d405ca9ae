"""Pieces of the async GRPO recipe (``python -m recipes.async_grpo``).

One concept per module:

- :mod:`.config`: the run configuration (one frozen dataclass, every field documented);
- :mod:`.task`: the verifiable task (sorting digits, partial-credit reward) and the in-code tokenizer;
- :mod:`.policy`: building the Qwen3 policy, the cached supervised warm start, token log-probs;
- :mod:`.loss`: the clipped GRPO objective and truncated importance-sampling weights;
- :mod:`.buffer`: the versioned replay buffer on torchrl (staleness gate, use-once sampling);
- :mod:`.generators`: generator backends (Hugging Face on CPU; the slot for vLLM on GPU);
- :mod:`.actors`: the Monarch actors (trainer, generator, replay buffer);
- :mod:`.report`: metrics JSONL, the summary and the plots.
"""
