"""Opening a store: engine, pragmas, migrations, and the one session helper.

Threading contract: a :class:`Store` is shared by every thread of a process; each thread (or
request) takes its own session through :meth:`Store.session`, which commits on success, rolls
back on error and turns driver errors into :class:`StoreError` subclasses. Sessions never
outlive the ``with`` block. Objects read in a session stay readable after it (no expiry on
commit) but are not refreshed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from store._errors import StoreConfigError, StoreConflict, StoreError, StoreUnavailable

log = logging.getLogger("pgc.store")

DEFAULT_URL = "sqlite:///pgc.db"
_MIGRATIONS = Path(__file__).with_name("migrations")
SQLITE_BUSY_TIMEOUT_MS = 15_000
VERSION_TABLE = "pgc_alembic_version"


class Store:
    """A pgc store on SQLite (one file, WAL mode) or PostgreSQL (a fleet).

    Opening applies the bundled Alembic migrations up to head, so every process that opens the
    same URL sees the same schema. Use :func:`open_store` rather than the constructor in code
    that may meet a bad URL: it reports one readable :class:`StoreError`.
    """

    def __init__(self, url: str = DEFAULT_URL, *, migrate: bool = True) -> None:
        self.url = url
        try:
            parsed = make_url(url)
        except ArgumentError as exc:
            raise StoreConfigError(f"not a database URL: {url!r}") from exc
        self.dialect = parsed.get_backend_name()
        if self.dialect not in ("sqlite", "postgresql"):
            raise StoreConfigError(
                f"unsupported store {self.dialect!r}: use sqlite:/// or postgresql://"
            )
        self.engine: Engine = _make_engine(url, self.dialect)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if migrate:
            self.migrate()

    @property
    def sqlite_path(self) -> Path | None:
        """The database file of a SQLite store (None for PostgreSQL or in-memory SQLite)."""
        if self.dialect != "sqlite":
            return None
        db = make_url(self.url).database
        return Path(db).resolve() if db and db != ":memory:" else None

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on any error."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except IntegrityError as exc:
            session.rollback()
            raise StoreConflict(f"conflicting write: {exc.orig}") from exc
        except DBAPIError as exc:
            session.rollback()
            raise StoreUnavailable(f"store {self.safe_url} failed: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            session.rollback()
            raise StoreError(f"store {self.safe_url} failed: {exc}") from exc
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @property
    def safe_url(self) -> str:
        """The URL with any password hidden, for messages and logs."""
        return make_url(self.url).render_as_string(hide_password=True)

    def migrate(self) -> None:
        """Apply the bundled migrations up to head, once, even with several processes opening
        the same store at the same moment (a file lock on SQLite, an advisory lock on
        PostgreSQL)."""
        with self._migration_lock():
            try:
                _upgrade(self.engine)
            except DBAPIError as exc:
                raise StoreUnavailable(f"cannot open store {self.safe_url}: {exc.orig}") from exc

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        path = self.sqlite_path
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fh = open(str(path) + ".lock", "a+")  # noqa: SIM115 - closed below
            except OSError as exc:
                raise StoreUnavailable(f"cannot open store {self.safe_url}: {exc}") from exc
            with fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
        elif self.dialect == "postgresql":
            try:
                with self.engine.connect() as conn:
                    conn.execute(text("SELECT pg_advisory_lock(7355608)"))
                    try:
                        yield
                    finally:
                        conn.execute(text("SELECT pg_advisory_unlock(7355608)"))
            except DBAPIError as exc:
                raise StoreUnavailable(f"cannot open store {self.safe_url}: {exc.orig}") from exc
        else:
            yield

    def tables(self) -> list[str]:
        return sorted(inspect(self.engine).get_table_names())

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str = DEFAULT_URL, *, migrate: bool = True) -> Store:
    return Store(url, migrate=migrate)


def _make_engine(url: str, dialect: str) -> Engine:
    if dialect == "sqlite":
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            pool_pre_ping=False,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def _upgrade(engine: Engine) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()

