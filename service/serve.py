"""`sat serve`: start the web page and the HTTP API in one server (imports torch, FastAPI and
Gradio only when run; Gradio not at all with ``--api-only``)."""

from __future__ import annotations

import argparse
import errno
import getpass
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from showattendtell.captioning.catalog import resolve_models
from showattendtell.cli.common import (
    add_decoding_args,
    add_device_args,
    add_model_arg,
    decoding_overrides,
)
from showattendtell.errors import UsageError, UserError

from .auth import AUTH_ENV, exposure_warning, read_auth
from .capacity import CPU, GPU, RULE, Capacity, resolve_capacity

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # on SIGTERM or Ctrl-C, how long the requests in flight may take
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ServeError(UsageError):
    """Bad `sat serve` options (an unusable device, a busy port)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start the web UI and the HTTP API on 127.0.0.1:7860",
        description="Serve the captioner in the browser, through the HTTP API (POST "
        "/v1/captions, docs/service.md) and through Gradio's API (api_name='/caption').",
    )
    add_model_arg(p, menu=True)
    add_device_args(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: all)",
    )
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument(
        "--auth-file",
        metavar="FILE",
        help=f"require a login: FILE has one user:password a line (also "
        f"${AUTH_ENV}=user:password; never give passwords on the command line)",
    )
    p.add_argument(
        "--max-upload-mb",
        type=float,
        default=10.0,
        help="largest accepted upload in MB (default 10)",
    )
    add_capacity(p)
    p.add_argument(
        "--queue-size",
        type=int,
        default=64,
        help="most requests waiting in the queue before new ones are refused (default 64)",
    )
    p.add_argument(
        "--examples",
        nargs="*",
        metavar="PATH",
        help="example images or folders shown under the upload (default: the photos "
        "shipped in service/examples/; none: --examples with no path)",
    )
    p.add_argument(
        "--api-only",
        action="store_true",
        help="serve the HTTP API (/v1/...) without the page and without importing Gradio",
    )
    p.add_argument(
        "--max-images",
        type=int,
        default=32,
        help="most photos in one POST /v1/captions request (default 32)",
    )
    add_bounds(p)
    add_decoding_args(p)  # the defaults of the UI controls and of the API, for every model
    p.set_defaults(func=cmd_serve)


def add_capacity(p: argparse.ArgumentParser) -> None:
    """What the service takes on at once: None in the parser, decided by the device the models
    load on (capacity.py)."""
    g = p.add_argument_group(
        "work at once",
        f"Defaults by the device the models run on: --concurrency / --max-batch / --threads "
        f"{RULE}. A value given here always wins.",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        help=f"requests processed at once, the page's and the HTTP API's each; the rest wait "
        f"in the queue (default {GPU.concurrency} on a GPU, {CPU.concurrency} on the CPU)",
    )
    g.add_argument(
        "--max-batch",
        type=int,
        help=f"most photos captioned as one batch (default {GPU.max_batch} on a GPU, "
        f"{CPU.max_batch} on the CPU; 1: no batching)",
    )
    g.add_argument(
        "--threads",
        type=int,
        help=f"torch's CPU threads (default {GPU.threads} on a GPU, whose CPU work is small; "
        "torch's own, one per core, on the CPU)",
    )


def add_bounds(p: argparse.ArgumentParser) -> None:
    """What bounds a service that runs for weeks: Gradio's cache folder and the sessions."""
    g = p.add_argument_group("a service that runs for weeks")
    g.add_argument(
        "--cache-mb",
        type=float,
        default=500.0,
        help="most MB of uploads and result images kept in Gradio's cache folder "
        "(default 500; the oldest go first; 0: no bound)",
    )
    g.add_argument(
        "--cache-hours",
        type=float,
        default=24.0,
        help="uploads and result images older than this are removed (default 24; "
        "0: kept until the cache bound needs the room)",
    )
    g.add_argument(
        "--session-minutes",
        type=float,
        default=60.0,
        help="how long a browser session keeps its captioned photo for the word "
        "views after its last caption (default 60)",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        default=1000,
        help="sessions remembered at once, the oldest forgotten first (default 1000; "
        "every API client is one)",
    )


def check_port(host: str, port: int) -> None:
    """A ServeError naming ``--port`` if ``port`` cannot be bound on ``host`` (checked before the
    models load, so a second `sat serve` says so at once)."""
    if not 1 <= port <= 65535:
        raise ServeError(f"--port must be from 1 to 65535, not {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: {e.strerror or e}") from None
    error: OSError | None = None
    for family, _, _, _, address in infos:  # localhost: ::1 and 127.0.0.1; one that binds will do
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ServeError(port_message(host, port, e)) from None
                error = e
                continue
        return
    if error is not None:
        raise ServeError(port_message(host, port, error))


def port_message(host: str, port: int, error: OSError) -> str:
    """One line for a port that cannot be served on: in use (try another --port), or why not."""
    if error.errno == errno.EADDRINUSE or "Cannot find empty port" in str(error):
        return (
            f"port {port} on {host} is already in use (another `sat serve`?); choose "
            f"another with --port N, e.g. --port {port + 1 if port < 65535 else 8080}"
        )
    if error.errno == errno.EACCES:
        return (
            f"no permission to serve on port {port} (ports below 1024 need root); choose "
            f"another with --port N, e.g. --port 7860"
        )
    return f"cannot serve on {host}:{port}: {error.strerror or error}"


def check_options(args: argparse.Namespace) -> None:
    """The numeric service options, before anything slow."""
    if args.max_upload_mb <= 0:
        raise ServeError("--max-upload-mb must be positive")
    for flag, value in (("--cache-mb", args.cache_mb), ("--cache-hours", args.cache_hours)):
        if not value >= 0:
            raise ServeError(f"{flag} must be 0 (no limit) or positive, not {value:g}")
    if not args.session_minutes > 0:
        raise ServeError(f"--session-minutes must be positive, not {args.session_minutes:g}")
    for flag, value in (
        ("--max-sessions", args.max_sessions),
        ("--concurrency", args.concurrency),  # 0: every request would wait for ever
        ("--max-batch", args.max_batch),
        ("--threads", args.threads),
        ("--queue-size", args.queue_size),  # 0: every request would be refused
        ("--max-images", args.max_images),
    ):
        if value is not None and value < 1:  # None: the device's default
            raise ServeError(f"{flag} must be at least 1, not {value}")
    if ":" in args.host:  # Gradio builds its own address as host:port, which breaks on these
        raise ServeError(
            f"--host {args.host}: IPv6 addresses are not supported by the web server; give an "
            "IPv4 address (127.0.0.1, 0.0.0.0) or a host name"
        )


def cache_folder() -> Path:
    """The folder of uploads and result images: $GRADIO_TEMP_DIR, else one of this user's own
    in the temporary folder (not Gradio's shared <tmp>/gradio), so that the cache bound may
    remove what earlier runs left there without touching any other app's files."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return Path(os.environ["GRADIO_TEMP_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = str(os.getuid())
    return Path(tempfile.gettempdir()) / f"showattendtell-serve-{user}"


@contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """An event set by the first SIGTERM or Ctrl-C; the signals' handlers are the previous ones
    again once it is set (a second one stops at once) and when the block ends."""
    stop = threading.Event()
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        stop.set()
        for sig, old in previous.items():
            signal.signal(sig, old)

    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def serve_until_stopped(app: Any, guard: Any, stop: threading.Event, grace_s: float) -> None:
    """Serve until ``stop`` is set (or the server ends), then refuse new requests, answer
    those in flight (at most ``grace_s`` seconds) and close the server."""
    while not stop.wait(0.5) and app.is_running:
        pass
    waiting = guard.in_flight()
    log.info(
        "stopping: finishing %d request(s) in flight (at most %.0f s); new ones are refused",
        waiting,
        grace_s,
    )
    started = time.monotonic()
    left = guard.drain(grace_s)
    if left:
        log.warning(
            "stopped after %.0f s with %d request(s) unanswered", time.monotonic() - started, left
        )
    app.close()


def use_capacity(device: str, args: argparse.Namespace) -> Capacity:
    """The options' values, each one not given the device's default (capacity.py); sets torch's
    CPU threads where there is a value for them."""
    capacity = resolve_capacity(device, args.concurrency, args.max_batch, args.threads)
    if capacity.threads is not None:
        import torch  # loaded already, with the models

        torch.set_num_threads(capacity.threads)
    log.info(
        "serving on %s: %d requests at once, batches of up to %d photos, %s CPU threads",
        device,
        capacity.concurrency,
        capacity.max_batch,
        capacity.threads or "torch's",
    )
    return capacity


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a server
    # Every option is checked before the (slow) imports and model loading.
    check_options(args)
    for spec in args.model or []:  # an unknown model name (ModelNotFound), before the imports
        resolve_models(spec)
    decoding = decoding_overrides(args)  # DecodingError (exit 2) for a value out of range
    auth = read_auth(args.auth_file)
    missing = [p for p in args.examples or [] if not Path(p).exists()]
    if missing:
        raise ServeError(f"--examples {missing[0]}: no such file or folder")
    check_port(args.host, args.port)
    warning = exposure_warning(args.host, auth)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)

    folder = cache_folder()
    os.environ["GRADIO_TEMP_DIR"] = str(folder)  # Gradio reads it as it builds the app
    from showattendtell.service.cache import CacheBound
    from showattendtell.service.guard import Guard
    from showattendtell.service.http_api import ApiSettings
    from showattendtell.service.server import Background, PageSettings, build
    from showattendtell.service.uploads import find_examples
    from showattendtell.service.worker import load_service

    try:
        service = load_service(
            args.model,
            args.device,
            max_batch=args.max_batch,
            decoding=decoding,
            precision=args.precision,
        )
    except UserError:
        raise
    except ValueError as e:  # resolve_device: no CUDA GPU
        raise ServeError(str(e)) from None
    capacity = use_capacity(service.device, args)
    settings = ApiSettings(
        int(args.max_upload_mb * 2**20),
        args.max_images,
        capacity.concurrency,
        args.queue_size,
        auth,
    )
    page = None
    if not args.api_only:
        cache = CacheBound(
            int(args.cache_mb * 2**20) or None, args.cache_hours * 3600 or None, folder=folder
        )
        page = PageSettings(
            find_examples(args.examples), cache, args.session_minutes, args.max_sessions
        )
    guard = Guard()
    with stop_requested() as stop:
        try:
            server = Background(build(service, settings, page, guard), args.host, args.port)
        except OSError as e:  # the port was taken while the models loaded
            service.close()
            raise ServeError(port_message(args.host, args.port, e)) from None
        print(f"Running on local URL:  {server.url}", flush=True)
        try:
            serve_until_stopped(server, guard, stop, STOP_GRACE_S)
        finally:
            service.close()
    return 0
