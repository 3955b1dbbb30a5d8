"""The API's outer guard, one pure-ASGI middleware: what a request must be before any route
reads it.

- **Host allow-list** (DNS rebinding: a web page whose name resolves to 127.0.0.1 can reach a
  loopback server, but its requests carry its own name in ``Host``): loopback names and
  addresses (127.0.0.0/8, ``localhost``, ``[::1]``, any port) and ``Settings.allowed_hosts``
  (plus the bind address under ``--allow-remote``); anything else is 400.
- **JSON only** for ``POST``, ``PUT`` and ``PATCH``, an empty body included: an HTML form
  (``application/x-www-form-urlencoded``, ``multipart/form-data``, ``text/plain``) is the one
  cross-site request a browser sends without asking the server first, so it never reaches a
  handler (415).
- **Body size**: a ``Content-Length`` over ``Settings.max_body_bytes`` is refused without
  handing the body to any route (413), and a chunked body is counted as it streams in and
  refused as soon as it passes the limit. What the client still sends is discarded chunk by
  chunk, within bounds (``_drain``), so that it reads the 413 instead of a connection reset.

The bearer token (``deps.require_token``) and the search-start rate limit (``deps``) are
checked per route, after this.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from pgc_daemon.settings import is_loopback

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPES = frozenset({"application/json"})


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit; FastAPI passes
    ``HTTPException`` through its body parsing, so the client gets 413, not 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


def host_name(host: str) -> str:
    """The name in a Host header, lower case, without port or IPv6 brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


class Guard:
    """Host allow-list, JSON-only bodies and the body size limit (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[BaseRoute],
        allowed_hosts: frozenset[str],
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.routes = routes
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        name = host_name(host)
        if not (is_loopback(name) or name in self.allowed_hosts):
            await _refuse(
                send, 400,
                f"Host {host!r} is not allowed: use 127.0.0.1, localhost or [::1], or add it to "
                "PGC_ALLOWED_HOSTS",
            )
            return
        if scope["method"] not in WITH_BODY or not self._routed(scope):
            # no handler takes this method here: the app answers 404 or 405 without reading
            # a body (the limit still applies, should anything read it)
            receive = self._counting(receive) if scope["method"] in WITH_BODY else receive
            await self.app(scope, receive, send)
            return
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media not in JSON_TYPES:
            shown = media or "none"
            await _refuse(
                send, 415,
                f"{scope['method']} needs Content-Type: application/json (got {shown}), even "
                "for an empty body",
            )
            return
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _refuse(send, 400, f"Content-Length {length!r} is not a number")
                return
            if declared > self.max_body_bytes:
                await _drain(receive)
                await _refuse(send, 413, f"request body is larger than {self.max_body_bytes} bytes")
                return
        await self.app(scope, self._counting(receive), send)

    def _routed(self, scope: Scope) -> bool:
        """Whether a route takes this method at this path (a 405 must stay a 405)."""
        return any(route.matches(scope)[0] == Match.FULL for route in self.routes)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body_bytes

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive)
                    raise BodyTooLarge(limit)
            return message

        return counted


LINGER_BYTES = 32 << 20
LINGER_S = 10.0


async def _drain(receive: Receive) -> None:
    """Discard what the client is still sending, one chunk at a time, up to
    :data:`LINGER_BYTES` or :data:`LINGER_S` (a lingering close, as nginx does): a client that
    writes its whole body before it reads (urllib, most scripts) would otherwise meet a
    connection reset instead of the 413. Nothing is kept; past either bound the connection
    is closed with what was read."""
    import asyncio

    drained = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_S
    while drained < LINGER_BYTES:
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except (asyncio.TimeoutError, OSError):
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
