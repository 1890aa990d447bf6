"""`sat serve`: start the Gradio web UI and API (imports torch and gradio only when run)."""

from __future__ import annotations

import argparse
import logging
import os

from showattendtell.errors import UserError

log = logging.getLogger(__name__)


class ServeError(UserError):
    """Bad `sat serve` options (an unusable device, a busy port)."""

    exit_code = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the web UI and API (Gradio) on 127.0.0.1:7860",
                       description="Serve the captioner in the browser and through Gradio's API "
                                   "(api_name='/caption').")
    p.add_argument("--model", action="append", metavar="PATH",
                   help="model file (.safetensors); repeat for a model menu (named by file stem). "
                        "Default: the bundled model(s) or $SAT_MODEL")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda or cuda:N")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--max-upload-mb", type=float, default=10.0,
                   help="largest accepted upload in MB (default 10)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests processed at once; the rest wait in Gradio's queue (default 8)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="most concurrent requests captioned as one batch (1: no batching)")
    p.add_argument("--queue-size", type=int, default=64,
                   help="most requests waiting in the queue before new ones are refused")
    p.add_argument("--examples", nargs="*", metavar="PATH",
                   help="example images or folders shown under the upload (default: "
                        "service/examples/ or the COCO val subset when present)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a server
    from showattendtell.service.app import find_examples, launch, load_service

    if args.max_upload_mb <= 0:
        raise ServeError("--max-upload-mb must be positive")
    try:
        service = load_service(args.model, args.device, max_batch=args.max_batch)
    except ValueError as e:  # resolve_device: no CUDA GPU
        raise ServeError(str(e)) from None
    try:
        launch(service, args.host, args.port, args.max_upload_mb, find_examples(args.examples),
               args.concurrency, args.queue_size)
    except OSError as e:
        raise ServeError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    finally:
        service.close()
    return 0
