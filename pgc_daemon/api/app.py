"""The FastAPI application of ``pgc serve``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

import store as st
from pgc_daemon.api import errors, routes_deployments, routes_health, routes_models, routes_search
from pgc_daemon.api.cache import TickCache
from pgc_daemon.api.deps import SearchStartLimit
from pgc_daemon.api.metrics import make_registry
from pgc_daemon.api.security import Guard
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.settings import Settings

VERSION = "0.1.0"

DESCRIPTION = """pgc profiles live traffic per layer, searches compiled and quantized variants under
an accuracy budget, and hot-swaps the winner through a canary. This API is how a platform
team reads what pgc found and sets its targets.

Mutating calls (`PUT`, `POST`) need `Authorization: Bearer <token>` (always: `pgc token` shows
it) and a JSON body sent as `Content-Type: application/json` (`{}` where nothing else is
needed), at most 1 MiB; reads are open. Requests must name this server as `127.0.0.1`,
`localhost` or `[::1]` (or a host in `PGC_ALLOWED_HOSTS`) in `Host`. Errors have a one-line
`detail`; 422 adds every problem in `errors`. The dashboard is at `/`, Prometheus metrics at
`/metrics`."""


def docs_assets_dir() -> Path:
    """Swagger UI's script and stylesheet, shipped by ``fastapi-offline`` (no CDN)."""
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"



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
    the app (``pgc serve``); pass a ``daemon`` to share one that runs elsewhere.

    Mutations always need a token: ``settings.api_token``, else the token file, created in
    the work dir when missing (``Settings.load_token``)."""
    token, _created = settings.load_token(create=True)
    if not token:  # only a named --token-file that is missing gets here, and that raises
        raise RuntimeError("no API token")
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
        docs_url=None,  # served below from the package's own copy of Swagger UI
        redoc_url=None,
    )
    app.add_middleware(
        Guard,
        routes=app.router.routes,  # the list itself: routes added below count too
        allowed_hosts=settings.allowed_host_names(),
        max_body_bytes=settings.max_body_bytes,
    )
    app.state.api_token = token
    app.state.search_limit = SearchStartLimit(settings.min_search_interval_s)
    app.state.settings = settings
    app.state.store = store
    app.state.daemon = daemon
    app.state.registry = make_registry(store)
    app.state.models_cache = TickCache(lambda: routes_models.all_model_summaries(store))
    errors.install(app)
    app.include_router(routes_health.router)
    app.include_router(routes_models.router)
    app.include_router(routes_search.router)
    app.include_router(routes_deployments.router)

    app.mount("/docs-assets", StaticFiles(directory=docs_assets_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="pgc - Swagger UI",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon.png",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def docs_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    static = dashboard_dir()
    if static is not None:
        app.mount("/ui", StaticFiles(directory=static, html=True), name="ui")

        @app.get("/", include_in_schema=False)
        def root(request: Request) -> RedirectResponse:
            query = request.url.query
            return RedirectResponse("/ui/" + (f"?{query}" if query else ""))

    return app
