"""Integrations with host frameworks (vLLM worker extension, torchrl, Monarch), each in its own
module and imported lazily: ``import torch_deltasync`` needs none of them."""
