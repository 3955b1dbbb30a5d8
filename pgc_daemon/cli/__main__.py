"""``python -m pgc_daemon.cli`` is ``pgc``."""

from pgc_daemon.cli import main

if __name__ == "__main__":  # not again in a ``spawn`` child (``pgc optimize``'s search)
    main()
