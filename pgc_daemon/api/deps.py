"""Dependencies shared by the routers: the store, the daemon, the settings, the token check and
the search-start rate limit."""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

import store as st
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.settings import Settings

_bearer = HTTPBearer(auto_error=False)


def get_store(request: Request) -> st.Store:
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_daemon(request: Request) -> Daemon | None:
    return request.app.state.daemon


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Mutating calls need ``Authorization: Bearer <token>``, always: the app holds a token
    from its start (PGC_API_TOKEN, the token file, or one it created; see ``create_app``)."""
    expected: str = request.app.state.api_token
    given = credentials.credentials if credentials is not None else ""
    if not expected or not secrets.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid bearer token is required (Authorization: Bearer <PGC_API_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


class SearchStartLimit:
    """At most one search started through the API per model per ``interval_s`` (``POST
    /optimize`` and policy changes that start one share it). In-process: each ``pgc serve``
    counts its own."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self, model: str) -> None:
        """Count a start for ``model`` now, or raise 429 with ``Retry-After`` (seconds)."""
        if self.interval_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            last = self._last.get(model)
            if last is not None and now - last < self.interval_s:
                wait = math.ceil(self.interval_s - (now - last))
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    f"a search of {model!r} was started {now - last:.0f} s ago; at most one per "
                    f"{self.interval_s:g} s (PGC_MIN_SEARCH_INTERVAL_S): retry in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self._last[model] = now

    def give_back(self, model: str) -> None:
        """Forget the start just taken (the request failed before starting anything)."""
        with self._lock:
            self._last.pop(model, None)


def get_search_limit(request: Request) -> SearchStartLimit:
    return request.app.state.search_limit


StoreDep = Annotated[st.Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DaemonDep = Annotated[Daemon | None, Depends(get_daemon)]
TokenDep = Depends(require_token)
SearchLimitDep = Annotated[SearchStartLimit, Depends(get_search_limit)]
