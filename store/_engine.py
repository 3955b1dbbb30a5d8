"""Opening a store: engine, pragmas, migrations, and the one session helper.

Threading contract: a :class:`Store` is shared by every thread of a process; each thread (or
request) takes its own session through :meth:`Store.session`, which commits on success, rolls
back on error and turns driver errors into :class:`StoreError` subclasses. Sessions never
outlive the ``with`` block. Objects read in a session stay readable after it (no expiry on
commit) but are not refreshed.

Write sessions: pysqlite begins a transaction lazily, at the first INSERT/UPDATE/DELETE, so a
session that reads, decides and then writes does not hold SQLite's write lock while it reads
and decides. A decision that must be exclusive (one open deployment per model) takes
``store.session(write=True)`` or calls ``store.repo.lock_model``: on SQLite both issue
``BEGIN IMMEDIATE`` (the database's one write lock, held until commit), on PostgreSQL the
latter locks the model's row (``SELECT … FOR UPDATE``).

Files: a SQLite store is created with mode 0600 (SQLite gives its -wal and -shm files the
database's mode) and an existing one is refused when another user owns it or group or others
may write to it, since pgc's worker imports the model spec named in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from store._errors import NotFound, StoreConfigError, StoreConflict, StoreError, StoreUnavailable

log = logging.getLogger("pgc.store")

DEFAULT_URL = "sqlite:///pgc.db"
_MIGRATIONS = Path(__file__).with_name("migrations")
SQLITE_BUSY_TIMEOUT_MS = 15_000
HEALTH_TIMEOUT_MS = 1_000
"""How long the health probe waits for SQLite's write lock before calling the store locked."""
VERSION_TABLE = "pgc_alembic_version"


class Store:
    """A pgc store on SQLite (one file, WAL mode) or PostgreSQL (a fleet).

    Opening applies the bundled Alembic migrations up to head, so every process that opens the
    same URL sees the same schema. Use :func:`open_store` rather than the constructor in code
    that may meet a bad URL: it reports one readable :class:`StoreError`.
    """

    def __init__(
        self, url: str = DEFAULT_URL, *, migrate: bool = True, create: bool = True
    ) -> None:
        """``create=False``: a SQLite file that does not exist is :class:`NotFound`, not made
        (a command that reads or changes what serves, run in the wrong folder)."""
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
        path = self.sqlite_path
        if path is not None and not create and not path.exists():
            raise NotFound(f"no pgc store at {path} (no such file)")
        if path is not None:
            private_file(path)
        self.engine: Engine = _make_engine(url, self.dialect)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if migrate:
            self.migrate()
        self.file_identity: tuple[int, int] | None = None
        """(st_dev, st_ino) of the SQLite file as opened: a file deleted or replaced under a
        running process is told apart from the one it still writes (see :meth:`health`)."""
        if path is not None:
            with contextlib.suppress(OSError):
                info = os.stat(path)
                self.file_identity = (info.st_dev, info.st_ino)

    @property
    def sqlite_path(self) -> Path | None:
        """The database file of a SQLite store (None for PostgreSQL or in-memory SQLite)."""
        if self.dialect != "sqlite":
            return None
        url = make_url(self.url)
        db = url.database
        if not db or db == ":memory:" or "mode=memory" in db:
            return None
        if str(url.query.get("uri", "")).lower() in ("true", "1") and db.startswith("file:"):
            db = db.removeprefix("file:").split("?", 1)[0]
        return Path(db).resolve()

    @contextlib.contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on any error.

        ``write=True``: the transaction takes SQLite's write lock before its first read
        (``BEGIN IMMEDIATE``), so what it reads cannot change before it commits; writers wait
        for each other (up to the busy timeout). On PostgreSQL it is an ordinary transaction:
        lock rows with ``store.repo.lock_model``."""
        session = self._sessions()
        try:
            if write:
                begin_immediate(session)
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
                fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
                fh = os.fdopen(fd, "a+")
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

    def health(self) -> str | None:
        """Why the store cannot serve now, in one line (None: it can).

        A SQLite file must still be the one this process opened (a deleted file keeps
        answering through open descriptors while every process that opens the path later
        gets a new, empty store), and the database must take a write: a transaction that
        takes the write lock and updates a row, then rolls back, waiting at most
        :data:`HEALTH_TIMEOUT_MS` for the lock."""
        path = self.sqlite_path
        if path is not None and self.file_identity is not None:
            try:
                info = os.stat(path)
            except FileNotFoundError:
                return f"store file {path} was deleted while this process had it open"
            except OSError as exc:
                return f"store file {path} cannot be read: {exc.strerror}"
            if (info.st_dev, info.st_ino) != self.file_identity:
                return f"store file {path} was replaced by another file while this process had it open"
        try:
            with self.engine.connect() as conn:
                if self.dialect == "sqlite":
                    conn.exec_driver_sql(f"PRAGMA busy_timeout={HEALTH_TIMEOUT_MS}")
                    try:
                        _write_probe(conn, immediate=True)
                    finally:
                        conn.exec_driver_sql(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                else:
                    _write_probe(conn, immediate=False)
        except DBAPIError as exc:
            return f"store {self.safe_url} does not take writes: {exc.orig}"
        except SQLAlchemyError as exc:
            return f"store {self.safe_url} does not take writes: {exc}"
        return None

    def tables(self) -> list[str]:
        return sorted(inspect(self.engine).get_table_names())

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str = DEFAULT_URL, *, migrate: bool = True, create: bool = True) -> Store:
    return Store(url, migrate=migrate, create=create)


def begin_immediate(session: Session) -> bool:
    """Take SQLite's write lock now, for the rest of ``session``'s transaction; True when this
    call took it. A no-op on other databases, and when the transaction already writes
    (pysqlite's implicit BEGIN comes with the first write, and that write took the lock)."""
    if session.get_bind().dialect.name != "sqlite":
        return False
    dbapi_conn = session.connection().connection.dbapi_connection
    if dbapi_conn is None or dbapi_conn.in_transaction:
        return False
    dbapi_conn.execute("BEGIN IMMEDIATE")
    return True


def _write_probe(conn: Connection, *, immediate: bool) -> None:
    """Take the write lock and update a row, then roll back: proof that the database takes
    writes (a read-only file, a read-only replica or a lock held elsewhere all fail here)."""
    if immediate:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = version_num")
    finally:
        conn.rollback()


def private_file(path: Path) -> Path:
    """Create ``path`` empty with mode 0600 (O_CREAT|O_EXCL, so never through someone else's
    file), or check an existing one (and its -wal and -shm): refused, with one readable
    :class:`StoreConfigError`, when another user owns it or group or others may write to it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        return path
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreUnavailable(f"cannot create store file {path}: {exc.strerror}") from exc
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            info = p.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreUnavailable(f"cannot read store file {p}: {exc.strerror}") from exc
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise StoreConfigError(
                f"store file {p} belongs to user {info.st_uid}, not to this user ({os.getuid()}); "
                "pgc imports the model spec named in it, so it must be yours"
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StoreConfigError(
                f"store file {p} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                f"pgc imports the model spec named in it: run 'chmod go-w {p}'"
            )
    return path


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

