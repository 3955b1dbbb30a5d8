"""The profiler's errors (its own root: ``profiler`` does not import ``pgc_daemon``)."""


class ProfilerError(Exception):
    """Root of every error the profiler raises."""
