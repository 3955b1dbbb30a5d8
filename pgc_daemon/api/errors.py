"""Mapping errors to HTTP at the edge, and the error responses the OpenAPI document lists."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import store as st
from compiler import CompilerError
from pgc_daemon.api.schemas import ErrorBody, ValidationErrorBody
from pgc_daemon.errors import PgcError, SearchError
from pgc_daemon.services.deployments import Conflict

Responses = dict[int | str, dict[str, Any]]

RESPONSES_422: Responses = {
    422: {"model": ValidationErrorBody, "description": "invalid body or parameters"}
}
RESPONSES_404: Responses = {
    404: {"model": ErrorBody, "description": "no such model (or variant)"},
    **RESPONSES_422,
}
RESPONSES_MUTATING: Responses = {
    400: {"model": ErrorBody, "description": "the body could not be read (not UTF-8 JSON)"},
    401: {
        "model": ErrorBody,
        "description": "missing or wrong bearer token (the server always has one: PGC_API_TOKEN "
        "or its token file, see `pgc token`)",
        "headers": {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    },
    413: {"model": ErrorBody, "description": "the body is larger than PGC_MAX_BODY_BYTES"},
    415: {"model": ErrorBody, "description": "the body is not sent as application/json"},
    **RESPONSES_422,
}
RESPONSES_429: Responses = {
    429: {
        "model": ErrorBody,
        "description": "a search of this model started less than PGC_MIN_SEARCH_INTERVAL_S ago",
        "headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
    }
}
RESPONSES_409: Responses = {409: {"model": ErrorBody, "description": "conflicts with work in progress"}}
RESPONSES_503: Responses = {503: {"model": ErrorBody, "description": "the store is unavailable"}}


def _json(code: int, detail: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": detail, **extra}, status_code=code, headers=headers)


def _documented_methods(app: FastAPI, path: str) -> list[str]:
    table = getattr(app.state, "allow_table", None)
    if table is None:
        table = []
        for template, operations in app.openapi()["paths"].items():
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            table.append((re.compile(f"^{pattern}$"), [m.upper() for m in operations]))
        app.state.allow_table = table
    return sorted({m for rx, methods in table if rx.match(path) for m in methods})


def install(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            # Starlette names the methods of one route only; a path served by two routes
            # (GET and PUT policy) must list both, as the OpenAPI document does.
            allow = ", ".join(_documented_methods(req.app, req.url.path))
            return _json(405, str(exc.detail), headers={"Allow": allow})
        return await http_exception_handler(req, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "request"
        return _json(422, f"{where}: {first['msg']}", errors=errors)

    @app.exception_handler(st.NotFound)
    async def _not_found(_req: Request, exc: st.NotFound) -> JSONResponse:
        return _json(status.HTTP_404_NOT_FOUND, str(exc))

    @app.exception_handler(st.StoreConflict)
    async def _conflict(_req: Request, exc: st.StoreConflict) -> JSONResponse:
        return _json(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(st.StoreError)
    async def _store(_req: Request, exc: st.StoreError) -> JSONResponse:
        return _json(status.HTTP_503_SERVICE_UNAVAILABLE, f"store unavailable: {exc}")

    @app.exception_handler(SearchError)
    async def _search(_req: Request, exc: SearchError) -> JSONResponse:
        return _json(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(CompilerError)
    async def _compiler(_req: Request, exc: CompilerError) -> JSONResponse:
        return _json(422, str(exc))

    @app.exception_handler(Conflict)
    async def _operation_conflict(_req: Request, exc: Conflict) -> JSONResponse:
        return _json(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(PgcError)
    async def _pgc(_req: Request, exc: PgcError) -> JSONResponse:
        code = 422 if isinstance(exc, ValueError) else 500
        return _json(code, str(exc))
