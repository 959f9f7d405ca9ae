"""torchrl integration: a ``WeightSyncScheme`` for collectors, a weight sender for the LLM stack, and
the replay sampler of our async recipes.

Importing this package imports torchrl and registers the weight-sync backend ``"delta"``
(``WeightSyncScheme.from_backend("delta", store=...)``); ``import torch_deltasync`` alone does not.

Architecture (collectors)::

    trainer process                         object store                 collector workers
    ───────────────                         ────────────                 ─────────────────
    collector.update_policy_weights_()                                   background thread per worker:
      └ DeltaWeightSyncScheme.send()  ──▶  <prefix>/versions, objects ──▶  poll newest version, then
          DeltaSender.publish()                                            DeltaReceiver.prepare() (download,
          (anchor or sparse delta)                                         validate, stage, verify) ──▶
          [sync] wait for acks  ◀──────── ack queue (MultiCollector)       commit() in place between two
                                          or <prefix>/acks/ (others) ◀──   policy calls, stamp version

* **Sender** (``init_on_sender`` / ``connect`` / ``send``): a :class:`~torch_deltasync.DeltaSender`
  over the live policy (``collector.policy``, or the weights passed to
  ``update_policy_weights_``). ``connect`` publishes the first version (an anchor); every ``send``
  publishes the next one, an anchor or a sparse delta, and with ``sync=True`` waits until every
  worker has applied it (or failed, or died, or timed out: never hangs).
* **Receiver** (``init_on_receiver`` / ``connect`` / ``receive``): a
  :class:`~torch_deltasync.DeltaReceiver` over the worker's policy. ``connect`` materialises a
  policy that arrived without weights (torchrl sends workers a meta-device copy), waits for the
  first version and applies it; a daemon thread then follows the store. Downloading, decoding and
  verifying (:meth:`DeltaReceiver.prepare <torch_deltasync.DeltaReceiver.prepare>`) run on that
  thread while the policy keeps acting; the in-place write (:meth:`~torch_deltasync.DeltaReceiver.commit`:
  ``index_copy_`` of the changed elements) waits for the current policy call to finish, so a policy
  call never sees a mix of two versions and no second dense copy of the weights exists. The
  polling is :func:`torch_deltasync.follow.wait_for_newer`, as for ``deltasync follow``.
* **Versions**: the store's version numbers are torchrl's policy versions. After each apply the
  worker sets its collector's ``PolicyVersion`` tracker to the version, and every policy call
  overwrites the root ``"policy_version"`` entry of its output with the version whose weights
  computed that action, so collected frames name the weights that produced them exactly (the
  transform alone stamps the version current at the previous env step).

Architecture (LLM stack): :class:`DeltaVLLMWeightSender` has the shape of torchrl's vLLM senders
(``register_model``, ``register_collector``, ``update_weights``), so ``GRPOTrainer(weight_sync_sender=...)``
and ``UpdateWeights(sender=...)`` drive it; it publishes a version and has every vLLM worker commit
it through vLLM's weight-transfer calls with the ``deltasync`` backend
(:func:`torch_deltasync.integrations.vllm.update_llm`; a multi-replica engine such as torchrl's
``AsyncVLLM`` through :class:`torch_deltasync.integrations.vllm.ReplicatedEngine`).

Replay: :class:`StalenessGatedSampler`, a use-once, oldest-version-first ``ConsumingSampler``
with a staleness gate (module :mod:`._replay`).

Modules (private; everything public is re-exported here): ``_scheme`` (configuration, pickling,
sending), ``_scheme_receiver`` (receiving), ``_acks`` (the acknowledgement queues of a
MultiCollector's workers; the protocol is :mod:`torch_deltasync.acks`), :mod:`torch_deltasync.gate`
(policy calls vs writes), ``_tensors`` (weights by name), ``_collectors`` (policy-version trackers),
``_vllm_sender`` (the LLM stack's sender), ``_replay`` (the sampler).

``docs/torchrl.md`` has the configuration guide; ``research/torchrl-weight-sync.md`` the torchrl
0.14.1 API this package follows (``weight_update/weight_sync_schemes.py`` line numbers cited there).
"""

from ._replay import StalenessGatedSampler, VersionSource
from ._scheme import DeltaWeightSyncScheme
from ._tensors import named_tensors
from ._vllm_sender import DeltaVLLMWeightSender

__all__ = [
    # collectors
    "DeltaWeightSyncScheme",
    "named_tensors",
    # the LLM stack
    "DeltaVLLMWeightSender",
    # replay
    "StalenessGatedSampler",
    "VersionSource",
]

for _obj in (DeltaWeightSyncScheme, named_tensors, DeltaVLLMWeightSender, StalenessGatedSampler):
    _obj.__module__ = __name__
del _obj
