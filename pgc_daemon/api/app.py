"""The FastAPI application of ``pgc serve``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

import store as st
from pgc_daemon.api import errors, routes_deployments, routes_health, routes_models, routes_search
from pgc_daemon.api.metrics import make_registry
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.settings import Settings

VERSION = "0.1.0"

DESCRIPTION = """pgc profiles live traffic per layer, searches compiled and quantized variants under
an accuracy budget, and hot-swaps the winner through a canary. This API is how a platform
team reads what pgc found and sets its targets.

Mutating calls (`PUT`, `POST`) need `Authorization: Bearer <PGC_API_TOKEN>` when the server
has a token; reads are open. Errors have a one-line `detail`; 422 adds every problem in
`errors`. The dashboard is at `/`, Prometheus metrics at `/metrics`."""


def dashboard_dir() -> Path | None:
    """The dashboard's static files (``dashboards/static``), wherever the package is
    installed (wheel, editable install or source tree); None without an ``index.html``."""
    import dashboards

    for base in getattr(dashboards, "__path__", []):
        path = Path(base) / "static"
        if (path / "index.html").is_file():
            return path
    return None


def create_app(
    settings: Settings,
    *,
    store: st.Store | None = None,
    daemon: Daemon | None = None,
    run_daemon: bool = False,
) -> FastAPI:
    """The API over ``store``. With ``run_daemon`` the optimizer loop starts and stops with
    the app (``pgc serve``); pass a ``daemon`` to share one that runs elsewhere."""
    store = store or st.open_store(settings.store_url)
    if daemon is None and run_daemon:
        daemon = Daemon(settings, store)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if run_daemon and daemon is not None:
            daemon.start()
        try:
            yield
        finally:
            if run_daemon and daemon is not None:
                daemon.stop()

    app = FastAPI(
        title="pgc",
        version=VERSION,
        summary="Profile-guided compilation daemon for PyTorch inference",
        description=DESCRIPTION,
        generate_unique_id_function=lambda route: route.name,  # operationId: the function's name
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.daemon = daemon
    app.state.registry = make_registry(store)
    errors.install(app)
    app.include_router(routes_health.router)
    app.include_router(routes_models.router)
    app.include_router(routes_search.router)
    app.include_router(routes_deployments.router)

    static = dashboard_dir()
    if static is not None:
        app.mount("/ui", StaticFiles(directory=static, html=True), name="ui")

        @app.get("/", include_in_schema=False)
        def root(request: Request) -> RedirectResponse:
            query = request.url.query
            return RedirectResponse("/ui/" + (f"?{query}" if query else ""))

    return app
