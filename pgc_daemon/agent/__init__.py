"""The agent: everything of pgc that runs inside the user's serving process.

``served`` is the request path (``lifecycle`` adds start, flush, close, status and the swap
to it, and ``live`` is what it records for the canary); ``registry`` registers the model and
exports what the profiler measured; ``swapper`` owns the deployment state machine, seeing the
served model only through the ``contract`` Protocol, with ``variants`` (build, warm, verify,
keep warm) and ``heartbeat`` (a deployment in flight stays fresh in the store) beside it, and
``canary`` judges a candidate beside what served before; ``runtime`` holds the thread, GIL and heap tricks that keep background work off the
request path; ``attach`` (in ``_attach``) puts them together. Nothing here imports ``optimizer``,
``services``, ``api`` or ``cli``.
"""

from pgc_daemon.agent._attach import attach
from pgc_daemon.agent.served import ServedModel

__all__ = ["ServedModel", "attach"]
