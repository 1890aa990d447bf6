"""The ASGI middleware in front of the page and the HTTP API: the login on every route (the
page's cookie or HTTP Basic auth with the same credentials), the failed-login throttle, a clear
answer when the disk is full, and the drain when the service stops.

It is plain ASGI (not Starlette's BaseHTTPMiddleware) so that the queue's event streams pass
through unbuffered. `sat serve` puts it in front of the one FastAPI app that serves both
(``server.build``); ``app.launch``, the page alone on Gradio's own server, hands it to Gradio
through ``app_kwargs``. A :class:`Guard` shared with `sat serve` holds its state.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .login import (
    API_PREFIXES,
    BASIC_CHALLENGE,
    LOGIN_PATHS,
    NOT_LOGGED_IN,
    Credentials,
    LoginThrottle,
    basic_credentials,
    logged_in,
    needs_login,
    throttled_message,
)

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DISK_FULL = (
    "the server's disk is full, so it cannot take the image now; try again later "
    "(whoever runs the service: free space in its upload folder, $GRADIO_TEMP_DIR)"
)
STOPPING = "the service is stopping; try again in a minute"
SERVICE_FAILED = (
    "the service failed on this request (its log has the details); try again, and tell "
    "whoever runs it if it happens again"
)
# Gradio's routes that answer an event in the HTTP response itself, with 500 for any error
DIRECT_PREFIXES = ("/gradio_api/run/", "/gradio_api/api/")
# Open requests that belong to work already taken: the queue's event streams, and any POST.
STREAM_PREFIXES = ("/gradio_api/queue/data", "/gradio_api/call/")


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from or groups, is a full disk."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        grouped = getattr(error, "exceptions", None)  # an ExceptionGroup (anyio's task groups)
        if isinstance(grouped, tuple):
            return any(disk_full(e) for e in grouped)
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class Guard:
    """What the middleware and the stopping service share: the login settings and throttle,
    whether the service is draining, and how many requests are in flight."""

    def __init__(
        self,
        login_required: bool = False,
        throttle: LoginThrottle | None = None,
        open_prefixes: tuple[str, ...] = (),
        credentials: Credentials | None = None,
    ):
        self.login_required = login_required
        self.throttle = throttle or LoginThrottle()
        self.open_prefixes = open_prefixes  # routes that check their own credentials
        self.credentials = credentials or Credentials()  # for HTTP Basic auth
        self.draining = False
        self.open_requests = 0  # POSTs and event streams being answered now
        self.blocks: Any = None  # the Gradio app: its queue holds the events not yet answered
        self.page_app: Any = None  # Gradio's server app when mounted: it issues the logins

    def require(self, auth: Any) -> None:
        """Ask for a login on every route when ``auth`` has (user, password) pairs."""
        self.login_required = bool(auth)
        self.credentials = Credentials(auth or ())

    def queued(self) -> int:
        """Events the queue took and has not yet delivered (waiting, running or sending)."""
        if self.blocks is None:
            return 0
        pending = getattr(self.blocks._queue, "pending_event_ids_session", {})
        return sum(len(ids) for ids in list(pending.values()))

    def in_flight(self) -> int:
        return self.open_requests + self.queued()

    def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuse new work, then wait up to ``timeout_s`` for the requests in flight to be
        answered; returns how many were still unanswered (0: all were)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(poll_s)  # the main thread: the server runs in its own
        return self.in_flight()


class GuardMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]], guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guard, path, method = self.guard, scope.get("path", ""), scope.get("method", "GET")
        client = (scope.get("client") or ("unknown", 0))[0]
        if guard.draining and method == "POST":
            log.info("refused %s %s from %s: the service is stopping", method, path, client)
            await answer(send, 503, STOPPING, {"retry-after": "60"})
            return
        if guard.login_required and path in LOGIN_PATHS and method == "POST":
            await self.login(scope, receive, send, client)
            return
        if (
            guard.login_required
            and needs_login(path, guard.open_prefixes)
            and not await self.admitted(scope, send, client)
        ):
            return
        if not (method == "POST" or path.startswith(STREAM_PREFIXES)):
            await self.answered(scope, receive, send, client)
            return
        # in flight until its answer's last byte is sent: a client that has its answer is not
        # waited for, though the app may still be finishing the request
        guard.open_requests += 1
        done = False

        async def sent(message: Message) -> None:
            nonlocal done
            await send(message)
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and not done:
                done = True
                guard.open_requests -= 1

        try:
            await self.answered(scope, receive, sent, client)
        finally:
            if not done:
                guard.open_requests -= 1

    async def admitted(self, scope: Scope, send: Send, client: str) -> bool:
        """Whether the request is logged in: the page's cookie, or HTTP Basic auth with the
        service's credentials (a wrong one counted by the throttle). Answers it if not."""
        guard, path = self.guard, scope.get("path", "")
        basic = basic_credentials(scope)
        if basic is None:
            if logged_in(scope, guard.page_app):
                return True
            log.info("refused %s %s from %s: not logged in", scope.get("method"), path, client)
            challenge = BASIC_CHALLENGE if path.startswith(API_PREFIXES) else None
            await answer(send, 401, NOT_LOGGED_IN, challenge)
            return False
        wait = guard.throttle.wait_s(client)
        if wait > 0:
            log.info("refused a login from %s: locked out for %.0f s more", client, wait)
            await answer(send, 429, throttled_message(wait), {"retry-after": f"{wait:.0f}"})
            return False
        if guard.credentials.valid(*basic):
            guard.throttle.succeeded(client)
            return True
        guard.throttle.failed(client)
        log.info("failed login from %s (HTTP Basic auth on %s)", client, path)
        await answer(send, 401, NOT_LOGGED_IN, BASIC_CHALLENGE)
        return False

    async def answered(self, scope: Scope, receive: Receive, send: Send, client: str) -> None:
        """The app's answer; a full disk before the answer started becomes a 507 that says so
        (and the next request, with space back, is served as usual). A 500 is held until the
        app returns: a mounted app's error middleware sends its 500 before raising the error,
        which may be a full disk."""
        started = False
        direct = scope.get("method") == "POST" and scope["path"].startswith(DIRECT_PREFIXES)
        held: list[Message] = []  # a 500 (start and body) until the app has returned

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                if message["status"] == 500:
                    held.append(message)
                    return
                started = True
            elif held:
                held.append(message)
                return
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if not disk_full(e):
                await self.release(held, direct, send)
                raise
            log.warning("refused %s from %s: the disk is full (%s)", scope["path"], client, e)
            if not started:
                await answer(send, 507, DISK_FULL)
            return
        await self.release(held, direct, send)

    @staticmethod
    async def release(held: list[Message], direct: bool, send: Send) -> None:
        """Send a held 500; a direct route's with the status its body says (refused_status)."""
        if not held:
            return
        if direct:
            held[0]["status"] = refused_status(b"".join(m.get("body", b"") for m in held[1:]))
        for message in held:
            await send(message)

    async def login(self, scope: Scope, receive: Receive, send: Send, client: str) -> None:
        """A login attempt: refused unchecked while the client is locked out; its result
        counted otherwise (Gradio answers a wrong password with 400)."""
        throttle = self.guard.throttle
        wait = throttle.wait_s(client)
        if wait > 0:
            log.info("refused a login from %s: locked out for %.0f s more", client, wait)
            await answer(send, 429, throttled_message(wait), {"retry-after": f"{wait:.0f}"})
            return
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, watched)
        if status == 400:
            throttle.failed(client)
            log.info("failed login from %s", client)
        elif 200 <= status < 300:
            throttle.succeeded(client)


def refused_status(body: bytes) -> int:
    """The status of a direct route's error (Gradio sends 500 for every one): 507 for a full
    disk, 500 for a fault of the service, 400 for a request refused with a message."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return 500
    if error == DISK_FULL:
        return 507
    return 500 if not error or error == SERVICE_FAILED else 400


def refusal(message: str) -> dict[str, str]:
    """The body of every refusal, the page's and the HTTP API's, the guard's and the routes':
    ``{"error": message, "detail": message}``, the one line in both (``detail`` is where
    FastAPI clients look)."""
    return {"error": message, "detail": message}


async def answer(send: Send, status: int, message: str, headers: dict[str, str] | None = None):
    """A JSON refusal (:func:`refusal`) sent straight from ASGI."""
    body = json.dumps(refusal(message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
