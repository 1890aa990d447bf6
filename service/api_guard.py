"""What stands in front of the HTTP API's routes besides the guard (``guard.py``: the login,
the throttle, a full disk, the stop): the size of a request's body, the number of requests at
once, the metrics, and every refusal as one JSON line (``guard.refusal``).

Imports no Gradio (``sat serve --api-only``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from showattendtell.errors import UserError

from .guard import refusal
from .metrics import Metrics

log = logging.getLogger(__name__)

ROUTES = "POST /v1/captions, GET /v1/models, /healthz, /readyz, /metrics, /openapi.json"


class ApiError(Exception):
    """A request refused with ``status`` and one line saying what to do."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_response(status: int, message: str, headers: dict[str, str] | None = None):
    return JSONResponse(refusal(message), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every refusal as ``{"error": "...", "detail": "..."}`` (``guard.refusal``); anything
    unexpected as a 500 whose body says to read the server's log (where the traceback goes),
    never the traceback itself."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.headers)

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}; the API is {ROUTES}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; the API is {ROUTES}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(500, "the server failed on this request; its log says why")


class Admission:
    """At most ``concurrency`` caption requests worked on at once (decoding their photos and
    waiting for the worker), at most ``queue_size`` more waiting; beyond that a 503 at once, as
    the page's queue refuses, so that a load balancer can send the request elsewhere."""

    def __init__(self, concurrency: int, queue_size: int):
        self.slots = asyncio.Semaphore(concurrency)
        self.limit = concurrency + queue_size
        self.inside = 0  # working and waiting (the event loop is one thread: no lock)

    async def __aenter__(self) -> None:
        if self.inside >= self.limit:
            raise ApiError(
                503,
                f"the service is busy ({self.inside} requests in progress or waiting); "
                "try again in a few seconds",
                {"Retry-After": "5"},
            )
        self.inside += 1
        try:
            await self.slots.acquire()
        except BaseException:
            self.inside -= 1
            raise

    async def __aexit__(self, *exc: Any) -> None:
        self.slots.release()
        self.inside -= 1


class BodyLimit:
    """Refuses a request body over ``max_bytes`` on paths under ``prefix`` before the route
    reads it: at once by its Content-Length, or, sent in chunks without one, as soon as the
    bytes received pass the limit (nothing more is read). The 413 is sent by this middleware."""

    def __init__(self, app: ASGIApp, max_bytes: int, prefix: str = "/v1/"):
        self.app, self.max_bytes, self.prefix = app, max_bytes, prefix

    def message(self) -> str:
        return (
            f"the request is larger than the {self.max_bytes / 2**20:g} MB this server takes "
            "in one request; send fewer or smaller photos"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await error_response(413, self.message(), {"Connection": "close"})(scope, receive, send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                response = error_response(413, self.message(), {"Connection": "close"})
                await response(scope, receive, send)


class _TooLarge(Exception):
    """Raised into the route from ``receive`` once a chunked body passes the limit."""


class Measured:
    """Counts every answer by route and status, with its latency (:class:`Metrics`). The route
    is the endpoint's path template (``/v1/captions``), ``page`` for the mounted Gradio app and
    ``unmatched`` for a path nothing serves: a bounded set of labels whatever clients send."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            self.metrics.request(route_label(scope), status, time.perf_counter() - start)


def route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path is not None and path.startswith("/") and path != "/":
        return path
    if scope.get("app_root_path") is not None or route is not None:  # inside the mounted page
        return "page"
    return "unmatched"
