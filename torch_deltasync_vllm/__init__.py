"""vLLM plugin entry point of torch_deltasync: registers the ``deltasync`` weight-transfer backend.

vLLM calls :func:`register` in every engine process (``vllm.general_plugins`` entry point in
``pyproject.toml``) early in each worker's start-up. It registers the worker and trainer engines by
module path only, so ``torch_deltasync`` (and numba, which its kernels use) is imported when an
engine with ``weight_transfer_config={"backend": "deltasync"}`` is created, not before: vLLM 0.32's
CPU worker scans every imported module for Triton kernels to override at start-up
(``vllm/triton_utils/dispatcher.py``), and that scan fails on an llvmlite object
(``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``), which would stop every
engine from starting. The engines live in :mod:`torch_deltasync.integrations.vllm._backend`.
"""

BACKEND = "deltasync"
_MODULE = "torch_deltasync.integrations.vllm._backend"


def register() -> None:
    """Register the ``deltasync`` worker and trainer engines with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _MODULE, "DeltaSyncWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, _MODULE, "DeltaSyncTrainerWeightTransferEngine")
