"""Logins for `sat serve`: credentials from a file or an environment variable, never from the
command line (where every user of the machine can read them in the process list)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path

from showattendtell.errors import UsageError

AUTH_ENV = "SAT_SERVE_AUTH"


class AuthError(UsageError):
    """Unusable login settings (--auth-file, $SAT_SERVE_AUTH); the message never shows a
    password."""


def parse_credentials(text: str, source: str) -> list[tuple[str, str]]:
    """``user:password`` pairs, one a line (blank lines and ``#`` comments skipped); the password
    is everything after the first colon."""
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password or any(c.isspace() for c in user):
            raise AuthError(
                f"{source} line {n}: expected user:password (a user name without "
                "spaces, a colon, a non-empty password)"
            )
        pairs.append((user, password))
    return pairs


def read_auth(
    auth_file: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str]] | None:
    """The logins from ``auth_file`` and ``$SAT_SERVE_AUTH`` (both may be given), or None when
    neither is set: the service then needs no login."""
    environ = os.environ if environ is None else environ
    pairs: list[tuple[str, str]] = []
    if auth_file is not None:
        try:
            text = Path(auth_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise AuthError(
                f"cannot read --auth-file {auth_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
        found = parse_credentials(text, f"--auth-file {auth_file}")
        if not found:
            raise AuthError(f"--auth-file {auth_file} has no user:password line")
        pairs += found
    if environ.get(AUTH_ENV):
        pairs += parse_credentials(environ[AUTH_ENV], f"${AUTH_ENV}")
    return pairs or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.x, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, auth: object) -> str | None:
    """A warning when the service listens beyond this machine without a login."""
    if auth or is_loopback(host):
        return None
    return (
        f"serving on {host} without a login: anyone who can reach this machine can use "
        f"the service; set ${AUTH_ENV}=user:password or pass --auth-file FILE"
    )
