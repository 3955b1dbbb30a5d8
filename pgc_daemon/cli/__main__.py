"""``python -m pgc_daemon.cli`` is ``pgc``."""

from pgc_daemon.cli import main

main()
