"""The REST API of ``pgc serve``."""

from pgc_daemon.api.app import create_app

__all__ = ["create_app"]
