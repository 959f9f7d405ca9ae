"""Integrations with host frameworks, one per host and each imported only when used:
``import torch_deltasync`` needs none of the hosts.

* :mod:`.torchrl`: the ``"delta"`` ``WeightSyncScheme`` for collectors, the LLM stack's weight
  sender, the replay sampler (imports torchrl);
* :mod:`.vllm`: the ``deltasync`` weight-transfer backend, the drivers that update an engine
  through it, LoRA hot-swap (vLLM is imported by the backend only);
* :mod:`.peft`: LoRA adapter versions (PEFT imported when an adapter is read or written);
* :mod:`.rollout`: the HTTP rollout service (FastAPI, uvicorn and httpx imported when used).

They are thin: publishing, receiving, staging and polling are the core's
(:class:`~torch_deltasync.DeltaSender`, :class:`~torch_deltasync.DeltaReceiver`'s
``prepare``/``commit``, :func:`torch_deltasync.follow.wait_for_newer`).
"""
