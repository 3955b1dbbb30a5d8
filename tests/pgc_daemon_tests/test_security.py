"""Safe by default: the token is always required, the Host allow-list, JSON-only bodies, the
body size limit, the search-start rate limit and the policy bounds, the token file, the
command line's bind checks, and offline API docs."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

import store as st
from compiler import Recipe
from pgc_daemon import states
from pgc_daemon.settings import Settings, TokenError

from .helpers import TEST_TOKEN, api_client, api_headers

DEPLOY = "/api/models/mini/deployments"


@pytest.fixture
def served(store: st.Store) -> st.Store:
    with store.session() as s:
        m = st.repo.upsert_model(s, "mini", spec="pkg:build")
        base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), "fp32")
        d = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        states.move(s, d.id, "active", "attached")
    return store


def _deployments(store: st.Store) -> int:
    with store.session() as s:
        return len(st.repo.list_deployments(s, st.repo.get_model(s, "mini").id))


def test_a_default_app_creates_a_private_token_and_requires_it(served: st.Store, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from pgc_daemon.api import create_app

    settings = Settings(store_url=served.url, work_dir=str(tmp_path / "work"))
    assert settings.api_token is None  # nothing configured anywhere
    c = TestClient(create_app(settings, store=served), base_url="http://127.0.0.1")
    path = tmp_path / "work" / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 40
    r = c.post(DEPLOY, json={"recipe": {}})
    assert r.status_code == 401 and "token" in r.json()["detail"]
    assert c.post(DEPLOY, json={"recipe": {}}, headers=api_headers("wrong")).status_code == 401
    assert _deployments(served) == 1
    assert c.post(DEPLOY, json={"recipe": {}}, headers=api_headers(token)).status_code == 202
    # the same file on the next start
    assert Settings(store_url=served.url, work_dir=str(tmp_path / "work")).load_token() == (token, False)


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    settings = Settings(work_dir=str(work))
    token, created = settings.load_token(create=True)
    assert created and token
    os.chmod(work / "token", 0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        settings.load_token()
    with pytest.raises(TokenError, match="does not exist"):
        Settings(api_token_file=str(tmp_path / "missing")).load_token(create=True)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "10.0.0.1", "127.0.0.1.evil.example"])
def test_a_foreign_host_header_is_400(served: st.Store, host: str) -> None:
    c = api_client(served)
    r = c.get("/api/models", headers={"host": host})
    assert r.status_code == 400 and "not allowed" in r.json()["detail"]
    assert c.post(DEPLOY, json={"recipe": {}}, headers={"host": host}).status_code == 400
    assert _deployments(served) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8765", "localhost:1", "[::1]:8765", "127.3.4.5"])
def test_loopback_hosts_are_answered(served: st.Store, host: str) -> None:
    assert api_client(served).get("/api/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_extend_the_list(served: st.Store) -> None:
    c = api_client(served, allowed_hosts="pgc.internal, other.internal")
    assert c.get("/api/models", headers={"host": "pgc.internal:8765"}).status_code == 200
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 400


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("application/x-www-form-urlencoded", b"recipe=x&variant_id=1"),
        ("multipart/form-data; boundary=x", b"--x--"),
        ("text/plain", b'{"recipe": {}}'),
        (None, b'{"recipe": {}}'),
        (None, b""),
    ],
)
def test_bodies_must_be_sent_as_json(served: st.Store, content_type: str | None, body: bytes) -> None:
    c = api_client(served)
    headers = {"content-type": content_type} if content_type else {}
    for path in (DEPLOY, "/api/models/mini/rollback", "/api/models/mini/optimize"):
        r = c.post(path, content=body, headers=headers)
        assert r.status_code == 415, (path, r.text)
        assert "application/json" in r.json()["detail"]
    r = c.put("/api/models/mini/policy", content=body, headers=headers)
    assert r.status_code == 415
    assert _deployments(served) == 1


def test_a_body_over_the_limit_is_413_by_length_and_while_streaming(
    served: st.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgc_daemon.api import security

    monkeypatch.setattr(security, "LINGER_BYTES", 0)  # no lingering: see where reading stops
    c = api_client(served)
    big = b'{"recipe": {}, "reason": "' + b"a" * (2 << 20) + b'"}'
    r = c.post(DEPLOY, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["detail"]

    # chunked: no Content-Length, the app pulls the body a piece at a time
    import asyncio

    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 65536
        return {"type": "http.request", "body": b" " * 65536, "more_body": pulled < 10 << 20}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": DEPLOY, "raw_path": DEPLOY.encode(), "query_string": b"",
        "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"transfer-encoding", b"chunked"),
                    (b"authorization", f"Bearer {TEST_TOKEN}".encode())],
    }
    asyncio.run(c.app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert pulled <= (1 << 20) + 65536  # refused as soon as it passed 1 MiB, not after 10 MiB
    assert _deployments(served) == 1


def test_a_real_server_answers_413_to_a_10_mb_body(served: st.Store, tmp_path: Path) -> None:
    """Over a socket too: the client still reads the answer (uvicorn, as pgc serve runs it)."""
    import uvicorn

    from pgc_daemon.api import create_app

    app = create_app(Settings(store_url=served.url, api_token=TEST_TOKEN), store=served)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
            time.sleep(0.05)
        big = b'{"recipe": {}, "reason": "' + b"a" * (10 << 20) + b'"}'
        headers = {**api_headers(), "content-type": "application/json"}
        r = httpx.post(f"http://127.0.0.1:{port}{DEPLOY}", content=big, headers=headers, timeout=60)
        assert r.status_code == 413
        # a client that writes its whole body before reading (urllib sends Connection: close)
        # reads the 413 too, not a connection reset
        req = urllib.request.Request(f"http://127.0.0.1:{port}{DEPLOY}", data=big, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60).close()
        err.value.close()
        assert err.value.code == 413
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert _deployments(served) == 1


def test_policy_changes_that_start_a_search_are_rate_limited(served: st.Store) -> None:
    c = api_client(served, min_search_interval_s=60)
    assert c.put("/api/models/mini/policy", json={"max_accuracy_drop": 0.02}).status_code == 200
    r = c.put("/api/models/mini/policy", json={"max_accuracy_drop": 0.03})
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60
    # deployment settings alone start no search
    ok = c.put("/api/models/mini/policy", json={"max_accuracy_drop": 0.02, "min_speedup": 1.5})
    assert ok.status_code == 200
    # another model has its own budget: unknown here, so 404 and not 429
    assert c.put("/api/models/other/policy", json={"max_accuracy_drop": 0.03}).status_code == 404


def test_optimize_is_rate_limited_per_model(served: st.Store, settings: Settings) -> None:
    from fastapi.testclient import TestClient

    from pgc_daemon.api import create_app

    class FakeDaemon:  # starts nothing: the limit is what is tested
        def __init__(self) -> None:
            self.started: list[int] = []

        def start_search(self, model_id: int, trigger: str, trials: int | None = None) -> int:
            with served.session() as s:
                run = st.repo.create_search_run(s, model_id, study_name="s", policy_version=0,
                                                trigger=trigger, trials_budget=trials or 1)
                self.started.append(run.id)
                return run.id

    daemon = FakeDaemon()
    app = create_app(settings.model_copy(update={"api_token": TEST_TOKEN}), store=served, daemon=daemon)  # type: ignore[arg-type]
    c = TestClient(app, base_url="http://127.0.0.1", headers=api_headers())
    assert c.post("/api/models/mini/optimize", json={"trials": 2}).status_code == 202
    r = c.post("/api/models/mini/optimize", json={})
    assert r.status_code == 429 and "retry" in r.json()["detail"] and r.headers["retry-after"]
    assert len(daemon.started) == 1


@pytest.mark.parametrize(
    "body, ok",
    [
        ({"max_accuracy_drop": 1, "canary_s": 0}, False),
        ({"max_accuracy_drop": 0.5}, False),
        ({"canary_s": 0}, False),
        ({"canary_s": 0.2}, False),
        ({"canary_s": 0, "allow_no_canary": True}, True),
        ({"max_accuracy_drop": 0.2, "canary_s": 0.5}, True),
    ],
)
def test_policy_bounds(served: st.Store, body: dict, ok: bool) -> None:
    r = api_client(served).put("/api/models/mini/policy", json=body)
    assert (r.status_code == 200) == ok, r.text
    if ok:
        assert "allow_no_canary" not in r.json()  # a flag of the request, not stored
    else:
        assert r.status_code == 422


def test_docs_load_swagger_ui_from_the_package(served: st.Store) -> None:
    c = api_client(served)
    page = c.get("/docs")
    assert page.status_code == 200 and "cdn" not in page.text.lower()
    assert "/docs-assets/swagger-ui-bundle.js" in page.text
    js = c.get("/docs-assets/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 500_000
    assert c.get("/docs-assets/swagger-ui.css").status_code == 200


def _pgc(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgc_daemon.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_serve_refuses_a_network_bind_without_allow_remote(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGC_")}
    env.update(PGC_WORK_DIR=str(tmp_path / "work"), PGC_STORE_URL=f"sqlite:///{tmp_path / 'pgc.db'}")
    r = _pgc("serve", "--host", "0.0.0.0", "--port", "0", env=env)
    assert r.returncode == 2 and "--allow-remote" in r.stderr
    assert "--token " not in _pgc("serve", "--help", env=env).stdout  # a token on argv shows in ps


def test_pgc_token_prints_the_token_file(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGC_")}
    env.update(PGC_WORK_DIR=str(tmp_path / "work"))
    missing = _pgc("token", env=env)
    assert missing.returncode == 1 and "pgc serve" in missing.stderr
    assert not (tmp_path / "work").exists()  # asking for a token makes no work folder
    made = _pgc("token", "--create", env=env)
    token = (tmp_path / "work" / "token").read_text().strip()
    assert stat.S_IMODE((tmp_path / "work").stat().st_mode) == 0o700
    assert made.returncode == 0 and made.stdout.strip() == token
    assert _pgc("token", env=env).stdout.strip() == token
    assert _pgc("token", env={**env, "PGC_API_TOKEN": "from-env"}).stdout.strip() == "from-env"
    (tmp_path / "other").write_text("from-file\n")
    os.chmod(tmp_path / "other", 0o600)
    assert _pgc("token", "--token-file", str(tmp_path / "other"), env=env).stdout.strip() == "from-file"


def test_a_method_no_route_takes_stays_405_whatever_the_body(served: st.Store) -> None:
    c = api_client(served)
    for path in ("/api/models", "/healthz", "/api/models/mini/front"):
        r = c.put(path)
        assert r.status_code == 405, (path, r.status_code)
    r = c.delete("/api/models/mini/policy")
    assert r.status_code == 405 and r.headers["allow"] == "GET, PUT"
