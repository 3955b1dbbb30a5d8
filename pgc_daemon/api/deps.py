"""Dependencies shared by the routers: the store, the daemon, the settings, the token check."""

from __future__ import annotations

import secrets
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
    """Mutating calls need ``Authorization: Bearer <PGC_API_TOKEN>`` when a token is set."""
    expected = request.app.state.settings.api_token
    if not expected:
        return
    given = credentials.credentials if credentials is not None else ""
    if not secrets.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid bearer token is required (Authorization: Bearer <PGC_API_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


StoreDep = Annotated[st.Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DaemonDep = Annotated[Daemon | None, Depends(get_daemon)]
TokenDep = Depends(require_token)
