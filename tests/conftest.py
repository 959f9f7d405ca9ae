"""Shared fixtures: small models, stores and helpers for bitwise comparison."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import make_mlp

# Tests are many small processes on a 2-core machine: keep each one to a single intra-op thread
# unless it asks for more, so parallel workers and child processes do not oversubscribe the CPU.
torch.set_num_threads(int(os.environ.get("DELTASYNC_TEST_THREADS", "1")))


@pytest.fixture
def store(tmp_path):
    from torch_deltasync import LocalStore

    return LocalStore(tmp_path / "bucket")


@pytest.fixture
def mlp_pair():
    """(trainer model fp32, receiver model bf16 with other weights)."""
    return make_mlp(0), make_mlp(1, torch.bfloat16)
