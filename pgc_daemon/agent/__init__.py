"""The agent: everything of pgc that runs inside the user's serving process.

``served`` is the request path; ``registry`` registers the model and exports what the
profiler measured; ``swapper`` owns the deployment state machine and ``canary`` judges a
candidate beside what served before; ``runtime`` holds the thread, GIL and heap tricks that
keep background work off the request path. Nothing here imports ``optimizer``, ``services``,
``api`` or ``cli``.
"""

from pgc_daemon.agent.served import ServedModel, attach

__all__ = ["ServedModel", "attach"]
