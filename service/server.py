"""One server for the page and the HTTP API: the FastAPI app of ``http_api`` with the Gradio
page mounted at / (``app.mount``), or the API alone (``--api-only``: Gradio is never imported),
both behind the guard's middleware, run by uvicorn in a thread on a socket bound here.

Binding the socket here, not in uvicorn, turns a port taken since ``check_port`` into an
OSError for `sat serve` to word (uvicorn would log it and exit). uvicorn runs in a thread, so
it leaves the signals to `sat serve`, which drains the requests in flight through the guard
(``serve.serve_until_stopped``) before it closes the server.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from .cache import CacheBound
from .guard import Guard
from .http_api import ApiSettings, create_api
from .worker import CaptionService

CLOSE_S = 5  # after the guard's drain: how long uvicorn waits for what is still open


@dataclass
class PageSettings:
    """The page's own settings (app.prepare's), beside the API's."""

    examples: Sequence[Path] = ()
    cache: CacheBound | None = None
    session_minutes: float | None = None
    max_sessions: int = 1000


def build(
    service: CaptionService,
    settings: ApiSettings,
    page: PageSettings | None,
    guard: Guard | None = None,
) -> FastAPI:
    """The API, with the page mounted at / unless ``page`` is None (the API alone), both
    behind ``guard`` (a new one if None; `sat serve` keeps its own to drain on stop)."""
    api = create_api(service, settings, guard)
    if page is not None:
        from .app import mount  # imports gradio: only when the page is served

        mount(
            api,
            service,
            api.state.guard,
            settings.max_upload_bytes / 2**20,
            settings.auth,
            examples=page.examples,
            concurrency=settings.concurrency,
            queue_size=settings.queue_size,
            cache=page.cache,
            session_minutes=page.session_minutes,
            max_sessions=page.max_sessions,
        )
    return api


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port); an OSError if taken."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def server(app: FastAPI) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=CLOSE_S,
            server_header=False,
            lifespan="on",
        )
    )


class Background:
    """A server run in a thread of this process (`sat serve`, tests, benchmarks): ``url`` once
    it serves; ``is_running`` and ``close`` as a Gradio app's, for ``serve_until_stopped``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = server(app)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        while not self.server.started:  # started is set from the server's own loop
            if not self.thread.is_alive():
                raise RuntimeError("the server stopped while starting; its log says why")
            self.thread.join(0.01)

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(CLOSE_S + 5)
        self.sock.close()
        self.app.state.metrics.close()
