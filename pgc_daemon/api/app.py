"""The FastAPI application of ``pgc serve``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

import store as st
from pgc_daemon.api import errors, routes_deployments, routes_health, routes_models, routes_search
from pgc_daemon.api.metrics import make_registry
from pgc_daemon.daemon import Daemon
from pgc_daemon.settings import Settings

VERSION = "0.1.0"


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

    static = resources.files("dashboards").joinpath("static")
    if static.is_dir() and static.joinpath("index.html").is_file():
        app.mount("/ui", StaticFiles(directory=str(static), html=True), name="ui")

        @app.get("/", include_in_schema=False)
        def root() -> RedirectResponse:
            return RedirectResponse("/ui/")

    return app
