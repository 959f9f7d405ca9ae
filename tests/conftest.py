"""Shared fixtures: small models, stores and helpers for bitwise comparison."""

from __future__ import annotations

import os

# vLLM picks its platform when first imported, and torchrl's LLM modules import it as a side
# effect; the CPU oracle (torch_deltasync.testing_vllm) needs the CPU platform whichever comes first.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import make_mlp  # noqa: E402

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


@pytest.fixture(scope="module")
def s3():
    """Endpoint URL of a local S3 server (moto, loopback) for the tests of one module."""
    from s3_server import s3_server

    with s3_server() as endpoint:
        yield endpoint
