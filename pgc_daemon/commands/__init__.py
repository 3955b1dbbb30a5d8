"""One module per ``pgc`` command; each has ``register(subparsers)`` and a ``run(args)``.
``COMMANDS`` is the order they appear in ``pgc --help``."""

COMMANDS = ["demo", "serve"]
