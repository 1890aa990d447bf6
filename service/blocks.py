"""Gradio's Blocks and Image as the service needs them: no URL fetched for a client, and a
message, never a bare error, for every request refused.

Gradio prepares an event's inputs (``Blocks.preprocess_data``: it downloads every file dict
that names a URL into its cache) before the event's function runs, and answers an exception
that is not a ``gr.Error`` with ``{"error": null}`` and a traceback in the server's log.
:class:`ServiceBlocks` refuses URL inputs before that step, and turns what a malformed request
makes Gradio raise into a ``gr.Error`` saying what to send instead, logged in one line.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import gradio as gr
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from gradio.route_utils import FnIndexInferError

from showattendtell.errors import UserError

from .guard import DISK_FULL, SERVICE_FAILED, disk_full, refusal
from .uploads import refuse_urls

log = logging.getLogger(__name__)

EXAMPLE_PHOTO = "photo.jpg"  # the API page's example: a file on the client's machine
MAX_LOGGED = 200  # characters of a refused request's message in the log


def local_file_example(image: gr.Image) -> gr.Image:
    """``image`` with a local file as its API example (Gradio's own names a URL on the web,
    which this service refuses to fetch). Set on the instance: a subclass of a Gradio component
    makes Gradio write a type stub next to this module."""

    def example_payload() -> dict[str, Any]:
        # The API page writes a file dict's "url" as handle_file('...') (its Python example)
        return {
            "path": EXAMPLE_PHOTO,
            "url": EXAMPLE_PHOTO,
            "orig_name": EXAMPLE_PHOTO,
            "meta": {"_type": "gradio.FileData"},
        }

    image.example_payload = example_payload  # type: ignore[method-assign]
    image.example_value = lambda: EXAMPLE_PHOTO  # type: ignore[method-assign]
    return image


def one_line(text: str, limit: int = MAX_LOGGED) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def endpoint(block_fn: Any) -> str:
    api_name = getattr(block_fn, "api_name", None)
    return f"/{api_name}" if api_name else f"event {getattr(block_fn, 'name', '?')}"


def input_names(block_fn: Any) -> list[str]:
    """An endpoint's inputs as a client names them (its function's parameters)."""
    try:
        names = list(inspect.signature(block_fn.fn).parameters)
    except (TypeError, ValueError, AttributeError):
        names = []
    wanted = len(getattr(block_fn, "inputs", ()) or ())
    return names if len(names) == wanted else [f"input {i}" for i in range(wanted)]


def malformed(block_fn: Any, inputs: Any) -> str:
    """What a client whose inputs Gradio could not take should send instead."""
    where = endpoint(block_fn)
    names = input_names(block_fn)
    got = len(inputs) if isinstance(inputs, list) else type(inputs).__name__
    count = "" if got == len(names) else f" (the request sent {got})"
    return (
        f"{where} could not read its inputs{count}: send {len(names)} in this order: "
        f"{', '.join(names)}; an image as an uploaded file or a data: URL, null for an "
        "option's default"
    )


class ServiceBlocks(gr.Blocks):
    """gr.Blocks that fetches no URL for a client and answers every refusal with a message."""

    def queue(self, *args: Any, **kwargs: Any) -> ServiceBlocks:
        super().queue(*args, **kwargs)  # a new queue: its push is checked from now on
        push = self._queue.push

        async def checked_push(body: Any, request: Any, username: str | None) -> Any:
            # Gradio looks the event up by number and answers an unknown one with HTTP 500
            fn_index = getattr(body, "fn_index", None)
            if fn_index is not None and fn_index not in self.fns:
                message = (
                    f"there is no event number {one_line(repr(fn_index), 40)}; call the "
                    "API by name (api_name='/caption'), as /gradio_api/info lists it"
                )
                log.info("refused a request: %s", message)
                return False, message, "error"
            return await push(body, request, username)

        self._queue.push = checked_push  # type: ignore[method-assign]
        return self

    async def preprocess_data(
        self, block_fn: Any, inputs: list[Any], state: Any, explicit_call: bool = False
    ) -> list[Any]:
        try:
            refuse_urls(inputs)  # before Gradio downloads anything
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except (gr.Error, UserError) as e:
            raise gr.Error(str(e.message if isinstance(e, gr.Error) else e)) from None
        except Exception as e:
            if disk_full(e):
                raise
            log.debug("inputs Gradio could not take: %s", one_line(e))
            raise gr.Error(malformed(block_fn, inputs)) from None

    async def process_api(self, block_fn: Any, inputs: list[Any], *args: Any, **kw: Any) -> Any:
        fn = self.fns.get(block_fn, block_fn) if isinstance(block_fn, int) else block_fn
        try:
            return await super().process_api(block_fn, inputs, *args, **kw)
        except gr.Error as e:
            log.info("refused %s: %s", endpoint(fn), one_line(e.message))
            e.print_exception = False  # the line above is the log's record of it
            raise
        except Exception as e:
            if disk_full(e):
                log.warning("refused %s: the disk is full (%s)", endpoint(fn), one_line(e))
                raise gr.Error(DISK_FULL, print_exception=False) from None
            log.exception("%s failed", endpoint(fn))  # a fault of the service: the traceback
            raise gr.Error(SERVICE_FAILED, print_exception=False) from None


def invalid_request(request: Request, error: Exception) -> JSONResponse:
    """A request body Gradio's routes cannot parse (not JSON, a field missing or of the wrong
    type): HTTP 422 saying which field and what to send, one line in the log."""
    errors = error.errors() if isinstance(error, RequestValidationError) else []
    first = errors[0] if errors else {}
    field = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if first.get("type") == "json_invalid" or not field:
        what = "the request body is not valid JSON"
    else:
        what = f"the request's {field} is not valid ({one_line(first.get('msg', error), 80)})"
    message = (
        f"{what}; send JSON such as "
        '{"data": [image, model, options...]} as /gradio_api/info describes'
    )
    log.info("refused %s %s: %s", request.method, request.url.path, message)
    return JSONResponse(refusal(message), status_code=422)


def unknown_endpoint(request: Request, error: Exception) -> JSONResponse:
    """An API name the app does not have: HTTP 404 naming the ones it has."""
    blocks = getattr(request.app, "blocks", None)
    names = sorted(
        f"/{fn.api_name}"
        for fn in (getattr(blocks, "fns", {}) or {}).values()
        if fn.api_name and getattr(fn, "api_visibility", "public") != "private"
    )
    message = (
        f"no such API endpoint; this service has {', '.join(names) or 'none'} "
        "(see /gradio_api/info)"
    )
    log.info("refused %s %s: %s", request.method, request.url.path, message)
    return JSONResponse(refusal(message), status_code=404)


EXCEPTION_HANDLERS = {RequestValidationError: invalid_request, FnIndexInferError: unknown_endpoint}
