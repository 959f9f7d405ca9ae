"""Runnable jobs built on torch_deltasync (run from the repository root, e.g.
``python -m recipes.async_grpo``)."""
