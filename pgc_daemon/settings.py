"""Settings of pgc processes, from the environment (``PGC_*``) or passed in explicitly.

Libraries take a :class:`Settings` as an argument; nothing deep inside reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PGC_", extra="ignore")

    store_url: str = Field("sqlite:///pgc.db", description="pgc store (SQLite file or PostgreSQL)")
    optuna_url: str | None = Field(
        None, description="Optuna study storage; default: <store>.optuna.db beside a SQLite store"
    )
    host: str = Field("127.0.0.1", description="API bind address")
    port: int = Field(8765, ge=0, le=65535, description="API port (0 picks a free one)")
    api_token: str | None = Field(None, description="bearer token required by mutating calls")
    sample_every: int = Field(100, ge=1, description="profile one call in N per layer")
    window_s: float = Field(10.0, gt=0, description="statistics window")
    reservoir_size: int = Field(128, ge=8, le=4096, description="live inputs kept per model")
    poll_s: float = Field(1.0, gt=0, description="how often agents and the daemon look for work")
    num_threads: int | None = Field(None, ge=1, description="torch threads of search workers")
    min_profile_calls: int = Field(50, ge=1, description="calls seen before the first search")
    reoptimize_interval_s: float = Field(
        1800.0, ge=0, description="at most one automatic re-search per model this often"
    )
    drift_window_s: float = Field(600.0, gt=0, description="window for traffic drift and regression")
    regression_tolerance: float = Field(
        0.3, gt=0, description="live p50 this much worse than after deployment re-optimizes"
    )
    retention_h: float = Field(72.0, gt=0, description="statistics older than this are pruned")
    work_dir: str = Field(".pgc", description="worker logs and caches")
    gc_freeze: bool = Field(
        True,
        description="after building a variant in the serving process, collect and gc.freeze() "
        "long-lived objects so full garbage collections do not stall requests",
    )

    def optuna_storage(self) -> str:
        """Optuna keeps its own tables (their names collide with nothing of ours, but a study
        store grows differently); beside a SQLite store it gets its own file."""
        if self.optuna_url:
            return self.optuna_url
        url = make_url(self.store_url)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            path = Path(url.database)
            return f"sqlite:///{path.with_name(path.stem + '.optuna.db')}"
        return self.store_url

    def compile_cache_path(self) -> Path:
        """Built variants and Inductor's kernels, shared by search workers and agents on one
        machine (``compiler.CompileCache``): the agent rebuilding what a worker measured reuses
        its work."""
        return self.work_path() / "compile-cache"

    def work_path(self) -> Path:
        path = Path(self.work_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
