"""Settings of pgc processes, from the environment (``PGC_*``) or passed in explicitly.

Libraries take a :class:`Settings` as an argument; nothing deep inside reads the environment.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from compiler import private_dir
from pgc_daemon.errors import PgcError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class TokenError(PgcError, ValueError):
    """The API token cannot be read or kept safely (exit code 2)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine
    only: 127.0.0.0/8, ::1 or localhost."""
    import ipaddress

    h = host.strip().lower().strip("[]")
    if h in LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PGC_", extra="ignore")

    store_url: str = Field("sqlite:///pgc.db", description="pgc store (SQLite file or PostgreSQL)")
    optuna_url: str | None = Field(
        None, description="Optuna study storage; default: <store>.optuna.db beside a SQLite store"
    )
    host: str = Field("127.0.0.1", description="API bind address")
    port: int = Field(8765, ge=0, le=65535, description="API port (0 picks a free one)")
    api_token: str | None = Field(
        None,
        description="bearer token required by mutating calls; default: the token file "
        "(api_token_file, else <work_dir>/token, created by the first pgc serve)",
    )
    api_token_file: str | None = Field(None, description="a file holding the bearer token")
    allowed_hosts: str = Field(
        "",
        description="comma-separated Host header values the API answers besides loopback "
        "(127.0.0.1, localhost, [::1]); ports are ignored",
    )
    allow_remote: bool = Field(
        False, description="allow binding an address other than loopback (pgc serve --allow-remote)"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body the API reads")
    min_search_interval_s: float = Field(
        60.0, ge=0, description="at most one search started through the API per model this often"
    )
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
    artifact_dir: str | None = Field(
        None,
        description="where search workers leave the variants they built (AOTInductor packages, "
        "ONNX models) for serving processes to load; a fleet on several hosts points every "
        "host at one mounted path. Default: <work_dir>/compile-cache/artifacts",
    )
    gc_freeze: bool = Field(
        True,
        description="after building a variant in the serving process, collect and gc.freeze() "
        "long-lived objects so full garbage collections do not stall requests",
    )
    executor: bool | None = Field(
        None,
        description="attached models serve on one inference thread each, which request threads "
        "hand their calls to (attach(executor=...) overrides it); default: on when torch runs "
        "more than one intra-op thread",
    )

    thread_tuning: bool = Field(
        True,
        description="with the executor, serve each variant at the intra-op thread count "
        "(configured, half, one) measured fastest on live traffic; off: always the configured count",
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

    def artifact_path(self) -> Path | None:
        """``artifact_dir`` when set (created private), else None: the compile cache's own
        ``artifacts/`` folder."""
        return private_dir(self.artifact_dir) if self.artifact_dir else None

    def token_path(self) -> Path:
        """Where the API token is kept: ``api_token_file``, else ``<work_dir>/token``. Makes
        no folder: reading a token (every client command does) leaves none behind where
        there is none; :meth:`load_token` makes the work dir when it creates the token."""
        if self.api_token_file:
            return Path(self.api_token_file).expanduser()
        return Path(self.work_dir).expanduser() / "token"

    def load_token(self, *, create: bool = False) -> tuple[str | None, bool]:
        """The API token and whether this call created it: ``api_token`` (PGC_API_TOKEN) if
        set, else the token file. With ``create``, a missing ``<work_dir>/token`` is made
        (``secrets.token_urlsafe(32)``, O_CREAT|O_EXCL, mode 0600); a token file named by
        ``api_token_file`` is never created. A token file that others may read or that
        another user owns is refused."""
        if self.api_token:
            return self.api_token, False
        path = self.token_path()
        created = False
        if create and not self.api_token_file:
            self.work_path()  # created private, or refused when others may write to it
            token = secrets.token_urlsafe(32)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                pass
            except OSError as exc:
                raise TokenError(f"cannot create the API token file {path}: {exc.strerror}") from exc
            else:
                with os.fdopen(fd, "w") as fh:
                    fh.write(token + "\n")
                created = True
        try:
            info = path.stat()
            text = path.read_text()
        except FileNotFoundError:
            if self.api_token_file:
                raise TokenError(f"the API token file {path} does not exist") from None
            return None, False
        except OSError as exc:
            raise TokenError(f"cannot read the API token file {path}: {exc.strerror}") from exc
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise TokenError(f"the API token file {path} belongs to user {info.st_uid}, not to this user")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenError(
                f"the API token file {path} may be read by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):o}): run 'chmod 600 {path}'"
            )
        token = text.strip()
        if not token:
            raise TokenError(f"the API token file {path} is empty")
        return token, created

    def allowed_host_names(self) -> frozenset[str]:
        """Host header values (lower case, without port) the API answers besides loopback:
        ``allowed_hosts``, and the bind address when binding off loopback is allowed."""
        names = {h.strip().lower().strip("[]") for h in self.allowed_hosts.split(",") if h.strip()}
        if self.allow_remote and self.host not in ("0.0.0.0", "::", ""):
            names.add(self.host.lower().strip("[]"))
        return frozenset(names)

    def work_path(self) -> Path:
        """The work dir, created private (0700); refused when another user owns it or others
        may write to it, since pgc loads pickled graphs and generated code from below it."""
        return private_dir(self.work_dir)
