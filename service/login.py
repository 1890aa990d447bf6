"""The login of `sat serve` at the door: which routes need it, and a throttle on failed logins.

Gradio checks the login on the routes that run something; :func:`needs_login` extends that to
every route (the API description, ``/openapi.json``, the queue's status, the monitoring pages)
except what the login page itself needs. :class:`LoginThrottle` answers a client whose logins
keep failing with "try again in N s" (HTTP 429) instead of checking more passwords: nothing
waits, so a client guessing passwords slows no one else down.
"""

from __future__ import annotations

import base64
import binascii
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# What the login page loads before anyone has logged in: the page, its code and styles, the
# login form's own routes. Everything else answers 401 without a login.
PUBLIC_PATHS = frozenset(
    {
        "/",
        "/login",
        "/login/",
        "/logout",
        "/favicon.ico",
        "/theme.css",
        "/robots.txt",
        "/manifest.json",
        "/gradio_api/theme.css",
        "/gradio_api/login_check",
        "/gradio_api/login_check/",
        "/gradio_api/user",
        "/gradio_api/user/",
        "/gradio_api/token",
        "/gradio_api/token/",
        "/gradio_api/app_id",
        "/gradio_api/app_id/",
        "/gradio_api/startup-events",  # starts the queue once; launch() calls it unlogged
        "/healthz",  # a load balancer's probes: they say only whether the service answers
        "/readyz",
    }
)
PUBLIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon")
LOGIN_PATHS = frozenset({"/login", "/login/"})

NOT_LOGGED_IN = (
    "log in first: this service needs a login (the page: POST /login with username and "
    "password; the HTTP API: the same user:password with HTTP Basic auth, e.g. curl -u "
    "user:password)"
)
# Routes a program calls: a 401 there asks for HTTP Basic auth (a browser asks for the
# password itself); the page's routes do not, so that its login form stays the only prompt.
API_PREFIXES = ("/v1/", "/metrics", "/openapi.json", "/docs")
BASIC_CHALLENGE = {"www-authenticate": 'Basic realm="sat serve"'}


def needs_login(path: str, open_prefixes: tuple[str, ...] = ()) -> bool:
    """Whether a request for ``path`` must carry a login, on a service that has one.
    ``open_prefixes``: routes that check their own credentials."""
    if path in PUBLIC_PATHS:
        return False
    return not path.startswith(PUBLIC_PREFIXES + open_prefixes)


def logged_in(scope: dict[str, Any], app: Any = None) -> bool:
    """Whether the request carries a login Gradio issued (its access-token cookie). ``app``:
    Gradio's server app that issued it (None: the request's own app)."""
    app = app if app is not None else scope.get("app")
    cookies = parse_cookies(scope)
    cookie_id = getattr(app, "cookie_id", None)
    tokens = getattr(app, "tokens", {}) or {}
    for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
        token = cookies.get(name)
        if token and token in tokens:
            return True
    return False


def parse_cookies(scope: dict[str, Any]) -> dict[str, str]:
    """The request's cookies (Starlette's parser, as the routes themselves read them)."""
    from starlette.requests import cookie_parser

    for name, value in scope.get("headers", ()):
        if name == b"cookie":
            return cookie_parser(value.decode("latin-1"))
    return {}


def basic_credentials(scope: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """The user and password of the request's HTTP Basic auth (None: it sends none); a header
    that cannot be read counts as a wrong login (empty user and password)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() != "basic":
                return None
            try:
                user, sep, password = base64.b64decode(token, validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return b"", b""
            return (user, password) if sep else (b"", b"")
    return None


class Credentials:
    """The service's ``user:password`` pairs (``--auth-file``, ``$SAT_SERVE_AUTH``) checked as
    HTTP Basic auth: one set of credentials for the page and the API, nothing new to hand out
    or rotate. Compared in constant time."""

    def __init__(self, pairs: Sequence[tuple[str, str]] = ()):
        self.pairs = [(u.encode(), p.encode()) for u, p in pairs]

    def valid(self, user: bytes, password: bytes) -> bool:
        ok = False
        for u, p in self.pairs:  # every pair compared: the time says nothing of which matched
            ok |= secrets.compare_digest(u, user) & secrets.compare_digest(p, password)
        return ok


@dataclass
class _Failures:
    count: int = 0
    until: float = 0.0  # no login is checked for this client before this time


class LoginThrottle:
    """Failed logins per client address: after ``free`` failures in a row, each further one
    locks the address out for twice as long as the last (``base_s``, 2x, 4x, ... at most
    ``max_s``). A successful login forgets the address. At most ``capacity`` addresses are
    remembered (the least recent forgotten first), so the table cannot grow without bound."""

    def __init__(
        self,
        free: int = 5,
        base_s: float = 1.0,
        max_s: float = 300.0,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.free, self.base_s, self.max_s = free, base_s, max_s
        self.capacity, self.clock = capacity, clock
        self._clients: OrderedDict[str, _Failures] = OrderedDict()

    def wait_s(self, client: str) -> float:
        """Seconds before ``client`` may try again (0: now)."""
        found = self._clients.get(client)
        return 0.0 if found is None else max(0.0, found.until - self.clock())

    def failed(self, client: str) -> None:
        found = self._clients.pop(client, None) or _Failures()
        found.count += 1
        if found.count >= self.free:
            delay = self.base_s * 2.0 ** (found.count - self.free)
            found.until = self.clock() + min(delay, self.max_s)
        self._clients[client] = found
        while len(self._clients) > self.capacity:
            self._clients.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)


def throttled_message(wait_s: float) -> str:
    return (
        f"too many failed logins from this address: try again in {math.ceil(wait_s)} s "
        "(check the user name and password)"
    )
