"""What the swapper and the canary need from the model they deploy for.

:class:`~pgc_daemon.agent.served.ServedModel` is the one implementation; the swapper and the
canary see it only through :class:`Served`, so they never import the request path.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from pgc_daemon.agent.live import LiveRecord
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.slot import Slot
from profiler import Profiler


class Served(Protocol):
    """A served model, as its swapper thread sees it.

    Threading rules an implementation keeps:

    - ``swap`` and ``base_slot`` are called by the swapper thread only (one writer); ``swap``
      is one reference write, so request threads read either the old slot or the new one;
    - ``serving_now`` and ``take_variant_failure`` are called from the swapper's threads
      while requests run, and must not lock anything the request path holds;
    - ``registry``, ``live`` and ``profiler`` are the objects themselves, shared with the
      request path under their own rules (see :mod:`~pgc_daemon.agent.live`).
    """

    @property
    def base(self) -> nn.Module:
        """The user's own module (fp32 eager): the reference every variant is checked against."""
        ...

    @property
    def registry(self) -> Registry: ...

    @property
    def calls(self) -> int:
        """Calls served so far (the replica row reports it)."""
        ...

    @property
    def live(self) -> LiveRecord: ...

    @property
    def profiler(self) -> Profiler:
        """Only ``paused()`` is used: no per-layer hooks while a deployment runs."""
        ...

    @property
    def slot(self) -> Slot:
        """What serves now."""
        ...

    def swap(self, new: Slot) -> Slot:
        """Make ``new`` the serving slot; returns the one it replaced."""
        ...

    def base_slot(self, deployment_id: int | None = None) -> Slot:
        """A slot serving the base module (as the baseline variant, once registered)."""
        ...

    def serving_now(self) -> bool:
        """Whether a request is in flight (background work yields to it)."""
        ...

    def at_its_threads(self, slot: Slot) -> bool:
        """Whether calls of ``slot`` run at the intra-op thread count decided for its variant
        (or none is tuned for it): a canary compares two arms only then."""
        ...

    def serving_threads(self, slot: Slot) -> int:
        """The intra-op thread count calls of ``slot`` run at (decided for its variant, or
        the configured one)."""
        ...

    def other_load(self) -> float | None:
        """Cores busy outside this process now (None: not known); cheap, from any thread."""
        ...

    def take_variant_failure(self) -> str | None:
        """The error of a pgc variant that failed a request since the last call, if any."""
        ...
