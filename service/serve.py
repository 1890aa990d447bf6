"""`sat serve`: start the Gradio web UI and API (imports torch and gradio only when run)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from showattendtell.cli_common import add_decoding_args, add_device_args, decoding_overrides
from showattendtell.errors import UsageError, UserError

from .auth import AUTH_ENV, exposure_warning, read_auth

log = logging.getLogger(__name__)


class ServeError(UsageError):
    """Bad `sat serve` options (an unusable device, a busy port)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the web UI and API (Gradio) on 127.0.0.1:7860",
                       description="Serve the captioner in the browser and through Gradio's API "
                                   "(api_name='/caption').")
    p.add_argument("--model", action="append", metavar="MODEL",
                   help="a model file (.safetensors) or a model name (`sat models` lists them); "
                        "A+B for an ensemble; repeat for a model menu (named by file stem). "
                        "Default: $SAT_MODEL or the bundled model, then the other bundled models")
    add_device_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--auth-file", metavar="FILE",
                   help=f"require a login: FILE has one user:password a line (also "
                        f"${AUTH_ENV}=user:password; never give passwords on the command line)")
    p.add_argument("--max-upload-mb", type=float, default=10.0,
                   help="largest accepted upload in MB (default 10)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests processed at once; the rest wait in Gradio's queue (default 8)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="most concurrent requests captioned as one batch (1: no batching)")
    p.add_argument("--queue-size", type=int, default=64,
                   help="most requests waiting in the queue before new ones are refused")
    p.add_argument("--examples", nargs="*", metavar="PATH",
                   help="example images or folders shown under the upload (default: the photos "
                        "shipped in service/examples/; none: --examples with no path)")
    add_decoding_args(p)  # the defaults of the UI controls and of the API, for every model
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a server
    # Every option is checked before the (slow) imports and model loading.
    if args.max_upload_mb <= 0:
        raise ServeError("--max-upload-mb must be positive")
    decoding = decoding_overrides(args)  # DecodingError (exit 2) for a value out of range
    auth = read_auth(args.auth_file)
    missing = [p for p in args.examples or [] if not Path(p).exists()]
    if missing:
        raise ServeError(f"--examples {missing[0]}: no such file or folder")
    warning = exposure_warning(args.host, auth)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)

    from showattendtell.service.app import launch
    from showattendtell.service.uploads import find_examples
    from showattendtell.service.worker import load_service

    try:
        service = load_service(args.model, args.device, max_batch=args.max_batch,
                               decoding=decoding, precision=args.precision)
    except UserError:
        raise
    except ValueError as e:  # resolve_device: no CUDA GPU
        raise ServeError(str(e)) from None
    try:
        launch(service, args.host, args.port, args.max_upload_mb, find_examples(args.examples),
               args.concurrency, args.queue_size, auth=auth)
    except OSError as e:
        raise ServeError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    finally:
        service.close()
    return 0
