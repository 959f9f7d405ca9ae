"""The receiver: plan, download, validate, stage, verify, then apply in place.

:class:`DeltaReceiver` is the face; the modules behind it follow an update:

* ``_config``: :class:`ReceiverConfig`, the receiver's options, each documented and checked where
  it is declared (``DeltaReceiver`` also takes them as keywords);
* ``_plan``: :class:`UpdatePlan`, the chain walk that picks the smallest download (delta or anchor path);
* ``_stage``: decode, validate and compose versions into a :class:`StagedUpdate`, and verify it
  against the published checksums (reads the target, never writes it);
* ``_receiver``: :class:`DeltaReceiver`: discovery, download, ``prepare`` / ``commit`` / ``update``,
  recovery, metrics.
"""

from ._config import ReceiverConfig
from ._plan import PlanStep, UpdatePlan
from ._receiver import DeltaReceiver
from ._stage import StagedUpdate, UpdateStats

__all__ = ["DeltaReceiver", "ReceiverConfig", "StagedUpdate", "UpdatePlan", "PlanStep", "UpdateStats"]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
