"""The sender: detect -> encode -> upload -> publish, one version at a time.

:class:`DeltaSender` is the face; the modules behind it follow a publish:

* ``_config``: :class:`SenderConfig`, the publish options, each documented and checked where it
  is declared (``DeltaSender`` also takes them as keywords);
* ``_sources``: what a rank publishes (tensors or FSDP2/TP shards as blocks, tied aliases);
* ``_policy``: :class:`AnchorPolicy`, when a version is an anchor instead of a delta;
* ``_job``: what a publish carries from reading the live weights to its commit;
* ``_group``: the collectives protocol (single process by default; ``torch_deltasync.dtensor``
  provides the torch.distributed one);
* ``_commit``: rank 0's manifest, written last, and the advisory ``LATEST`` pointer;
* ``_sender``: the publish state machine, the background upload thread and the prefix lease;
* ``_stats``: :class:`PublishStats`, one metrics record per version.
"""

from ._config import SenderConfig
from ._policy import AnchorPolicy
from ._sender import DeltaSender
from ._sources import collect_sources
from ._stats import PublishStats

__all__ = ["DeltaSender", "SenderConfig", "AnchorPolicy", "PublishStats", "collect_sources"]

for _name in ("DeltaSender", "SenderConfig", "AnchorPolicy", "PublishStats"):
    globals()[_name].__module__ = __name__
del _name
collect_sources.__module__ = __name__
