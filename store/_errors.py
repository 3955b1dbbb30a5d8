"""The store's errors. ``store`` may not import ``pgc_daemon``, so its root is its own;
the daemon's outer layer maps these to exit codes and HTTP statuses."""


class StoreError(Exception):
    """Root of every error the store raises."""


class StoreUnavailable(StoreError, ConnectionError):
    """The database could not be reached or refused the operation (locked, down, full)."""


class StoreConflict(StoreError, ValueError):
    """A write broke a uniqueness or integrity rule."""


class NotFound(StoreError, LookupError):
    """The named row does not exist."""


class StoreConfigError(StoreError, ValueError):
    """The store URL is malformed or names a database pgc does not support."""
