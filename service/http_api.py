"""The HTTP API of `sat serve`: ``POST /v1/captions``, ``GET /v1/models``, ``/healthz``,
``/readyz``, ``/metrics`` and the OpenAPI schema at ``/openapi.json`` (FastAPI).

A caption request goes through the same :class:`CaptionService` worker as the page, so
concurrent requests of both share batches. Its answer holds the records `sat caption` writes
(``record_dict``: caption, words, scores, familiarity, confidence, warning, model, model_sha256,
decoding, and the attention grids on request), field for field. The form's decoding fields and
their schema are made from the option table (``DECODING_OPTIONS``): nothing here names an option.
Nothing is kept between requests: an upload lives in the request's memory or spooled temporary
file only, so any number of processes behind a load balancer answer alike.

Imports no Gradio (``sat serve --api-only``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from PIL import Image
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from showattendtell.captioning.captioner import Captioner
from showattendtell.captioning.pipeline import Record
from showattendtell.captioning.records import record_dict
from showattendtell.images.files import ImageError
from showattendtell.search.decoding import DECODING_OPTIONS, DecodingError, DecodingOption

from .api_guard import (
    Admission,
    ApiError,
    BodyLimit,
    Measured,
    error_response,
    install_error_handlers,
)
from .guard import Guard, GuardMiddleware
from .metrics import Metrics
from .uploads import read_upload
from .worker import CaptionService

IMAGES = "images"  # the repeated multipart field of the photos
FIELDS = ("model", "with_attention")  # the form's fields besides the photos and the options
JSONL = "application/x-ndjson"  # asked for in Accept: the answer as `sat caption`'s JSON Lines
DECODE_ON = "cpu"  # photos are decoded by Pillow, as `sat caption --decode-on cpu` records
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


@dataclass
class ApiSettings:
    """The limits and login of the API: `sat serve`'s options, shared with the page."""

    max_upload_bytes: int = 10 * 2**20  # one photo
    max_images: int = 32  # photos in one request
    concurrency: int = 8  # requests worked on at once
    queue_size: int = 64  # requests waiting beyond those
    auth: Sequence[tuple[str, str]] | None = None  # the page's user:password pairs (Basic auth)

    @property
    def max_body_bytes(self) -> int:
        """The most a request may send: every photo at the limit, plus room for the fields."""
        return self.max_images * self.max_upload_bytes + 2**20


def create_api(
    service: CaptionService, settings: ApiSettings, guard: Guard | None = None
) -> FastAPI:
    """The API as a FastAPI app; ``sat serve`` mounts the page in it unless ``--api-only``.
    ``guard``'s middleware stands in front of every route, the page's too: the login (HTTP
    Basic auth with ``settings.auth``'s pairs, or the page's cookie), the failed-login
    throttle, 507 on a full disk, 503 while stopping."""
    app = FastAPI(
        title="Show, Attend and Tell",
        summary="Caption photos; every word with where the model looked.",
        version="1",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.metrics = Metrics(service, settings.concurrency)
    app.state.admission = Admission(settings.concurrency, settings.queue_size)
    app.state.guard = guard = guard or Guard()
    guard.require(settings.auth)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(GuardMiddleware, guard=guard)  # the login before a body is read
    app.add_middleware(Measured, metrics=app.state.metrics)  # outermost: counts every refusal
    service_routes(app, service)
    caption_routes(app, service, settings)  # last: its catch-all
    return app


def caption_routes(app: FastAPI, service: CaptionService, settings: ApiSettings) -> None:
    """POST /v1/captions, and the API's own 404 and 405 for any other path under /v1/ (not the
    page's, mounted at /)."""
    admission: Admission = app.state.admission

    @app.post(
        "/v1/captions",
        summary="Caption one or more photos",
        description=CAPTIONS_DESCRIPTION,
        openapi_extra=captions_schema(service, settings),
        response_class=JSONResponse,
    )
    async def captions(request: Request) -> Response:
        async with admission:
            form = await read_form(request, settings.max_images)
            try:
                records = await caption_form(service, settings, form)
            finally:
                await form.close()
        if JSONL in request.headers.get("accept", ""):
            lines = "".join(
                json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records
            )
            return Response(lines, media_type=JSONL)
        return JSONResponse({"records": records})

    @app.api_route(
        "/v1/{rest:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )
    async def elsewhere(request: Request, rest: str) -> Response:
        known = request.url.path in ("/v1/captions", "/v1/models")
        raise StarletteHTTPException(405 if known else 404)


def service_routes(app: FastAPI, service: CaptionService) -> None:
    """GET /v1/models, /healthz, /readyz and /metrics."""
    metrics: Metrics = app.state.metrics

    @app.get(
        "/v1/models",
        summary="The models served, each with its decoding defaults",
    )
    async def models() -> dict[str, Any]:
        return {"models": [describe(c, i == 0) for i, c in enumerate(service.captioners.values())]}

    @app.get("/healthz", summary="Alive: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", summary="Ready: the models are loaded and the worker runs")
    async def readyz() -> JSONResponse:
        if not service.running:
            return error_response(
                503, "not ready: the captioning worker has stopped; restart sat serve"
            )
        return JSONResponse({"status": "ready", "models": service.names})

    @app.get("/metrics", summary="Prometheus metrics (text format)")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)


CAPTIONS_DESCRIPTION = (
    "Send the photos as multipart/form-data, the field `images` repeated (one file each), and "
    "any decoding option as a form field; an option left out is the model's own setting "
    '(GET /v1/models lists each model\'s). The answer is `{"records": [...]}`, one record per '
    "photo in the order sent, each the record `sat caption` writes to its JSON Lines: path (the "
    "file name sent), caption, score, log_prob, words, familiarity, confidence (0..1: the chance "
    "that the caption is good), warning (when there is one), model, model_sha256, decoding "
    "and, with `with_attention=true`, attention (one grid per word) and, for hard attention, "
    "locations. With `Accept: application/x-ndjson` the answer is those JSON Lines themselves. "
    "Refusals are 4xx (5xx when the service cannot answer) with "
    '`{"error": "...", "detail": "..."}`, the same line in both.'
)


async def read_form(request: Request, max_images: int) -> FormData:
    """The multipart form, or a 400 saying how to send one."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, f"send the photos as multipart/form-data, {USAGE}")
    try:
        return await request.form(max_files=max_images, max_fields=100)
    except StarletteHTTPException as e:  # python-multipart's refusals
        if "files" in str(e.detail):
            raise ApiError(
                400,
                f"at most {max_images} photos in one request (sat serve --max-images); "
                "send the others in another request",
            ) from None
        raise ApiError(400, f"the form cannot be read ({e.detail}); {USAGE}") from None


USAGE = "the field images repeated, one photo each (curl -F images=@photo.jpg)"


async def caption_form(
    service: CaptionService, settings: ApiSettings, form: FormData
) -> list[dict[str, Any]]:
    """Check everything, then decode every photo and caption them together (one batch when
    the worker is free); the records in the order the photos came."""
    unknown = sorted(set(form) - {IMAGES, *FIELDS, *DECODING_OPTIONS})
    if unknown:
        raise ApiError(
            400,
            f"unknown field {unknown[0]!r}; the fields are {IMAGES}, {', '.join(FIELDS)} and "
            f"the decoding options {', '.join(DECODING_OPTIONS)}",
        )
    for name in (*FIELDS, *DECODING_OPTIONS):
        if len(form.getlist(name)) > 1:
            raise ApiError(400, f"{name} is given {len(form.getlist(name))} times; give it once")
    captioner = service.get(text_field(form, "model"))  # an unknown model: 400, naming them
    overrides = {
        name: option_value(opt, text_field(form, name))
        for name, opt in DECODING_OPTIONS.items()
        if text_field(form, name) is not None
    }
    config = service.decoding(captioner.name, **overrides)  # e.g. consensus without an index
    with_attention = flag(text_field(form, "with_attention"), "with_attention")
    uploads = form.getlist(IMAGES)
    if not uploads:
        raise ApiError(400, f"no image: {USAGE}")
    for upload in uploads:
        if not isinstance(upload, UploadFile):
            raise ApiError(400, f"{IMAGES} must be files, not text: {USAGE}")
        if upload.size is not None and upload.size > settings.max_upload_bytes:
            raise ApiError(413, too_large(upload, settings.max_upload_bytes))
    with service.arriving() as arrival:  # a batch about to start waits for these photos
        images = [await decode(u, captioner.input_size, settings.max_upload_bytes) for u in uploads]
        # preprocessed (resized, normalised) in a thread: the event loop stays free meanwhile
        futures = await run_in_threadpool(
            service.submit_all, images, captioner.name, config, arrival
        )
    results = [await asyncio.wrap_future(f) for f in futures]
    made_by = captioner.made_by(config)
    made_by["decoding"]["decode_on"] = DECODE_ON
    return [
        record_dict(Record(name_of(u), r), with_attention, made_by)
        for u, r in zip(uploads, results, strict=True)
    ]


def text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if isinstance(value, UploadFile):
        raise ApiError(400, f"{name} must be a plain form field, not a file")
    return value


def option_value(opt: DecodingOption, text: str) -> Any:
    """A form field's text as the option's value, checked against the option table's range;
    the message names the field as the form does (beam_size, not --beam-size)."""
    value: Any = text.strip()
    if opt.kind in ("int", "float"):
        for parse in (int, float):
            try:
                value = parse(value)
                break
            except ValueError:
                continue
    try:
        return opt.check(value)
    except DecodingError as e:
        raise ApiError(400, str(e).replace(f"{opt.label} ({opt.flag})", opt.name, 1)) from None


def flag(text: str | None, name: str) -> bool:
    if text is None or text.strip().lower() in FALSE:
        return False
    if text.strip().lower() in TRUE:
        return True
    raise ApiError(400, f"{name} must be true or false, not {text!r}")


def name_of(upload: UploadFile) -> str:
    return upload.filename or IMAGES


def too_large(upload: UploadFile, max_bytes: int) -> str:
    return (
        f"{name_of(upload)} is larger than the {max_bytes / 2**20:g} MB a photo may have on "
        "this server; send a smaller one"
    )


async def decode(upload: UploadFile, min_size: int, max_bytes: int) -> Image.Image:
    """Read an uploaded photo (its size checked again as read: a part without a size) and decode
    it, in a worker thread, by ``read_upload`` (as the page's uploads: decompression bombs
    refused before their pixels); an ImageError names the file as sent."""
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ApiError(413, too_large(upload, max_bytes))
    try:
        return await run_in_threadpool(read_upload, data, max_bytes, min_size)
    except ImageError as e:
        message = str(e).removeprefix("the image: ")
        raise ApiError(400, f"{name_of(upload)}: {message}") from None


def describe(captioner: Captioner, default: bool) -> dict[str, Any]:
    """A model as GET /v1/models lists it: what its records' made-by fields will say with no
    option given, and the options that change its captions."""
    made_by = captioner.made_by()
    return {
        "name": captioner.name,
        "default": default,
        "attention": captioner.attention_type,
        "model_sha256": made_by.get("model_sha256"),
        "decoding": made_by["decoding"],
        "options": [name for name, opt in DECODING_OPTIONS.items() if captioner.applies(opt)],
    }


def option_schema(opt: DecodingOption, default: Any) -> dict[str, Any]:
    """An option's JSON schema, from the option table: its type, range or choices, help and
    the default model's value (what a request that leaves it out gets from that model)."""
    schema: dict[str, Any] = {"description": opt.help, "default": default}
    if opt.kind == "choice":
        schema.update(type="string", enum=list(opt.choices))
    else:
        schema.update(
            type="integer" if opt.kind == "int" else "number",
            minimum=int(opt.low) if opt.kind == "int" else opt.low,
            maximum=int(opt.high) if opt.kind == "int" else opt.high,
        )
    if opt.needs:
        need = "hard-attention models" if opt.needs == "hard" else "models with a consensus index"
        schema["description"] += f" (only {need}; other models ignore it)"
    return schema


def captions_schema(service: CaptionService, settings: ApiSettings) -> dict[str, Any]:
    """The request body of POST /v1/captions in the OpenAPI schema."""
    default = next(iter(service.captioners.values())).decoding
    properties: dict[str, Any] = {
        IMAGES: {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "minItems": 1,
            "maxItems": settings.max_images,
            "description": f"the photos, one file each (at most "
            f"{settings.max_upload_bytes / 2**20:g} MB a photo)",
        },
        "model": {
            "type": "string",
            "enum": service.names,
            "default": service.names[0],
            "description": "the model (GET /v1/models)",
        },
        "with_attention": {
            "type": "boolean",
            "default": False,
            "description": "add each word's attention grid (and hard-attention locations)",
        },
    }
    for name, opt in DECODING_OPTIONS.items():
        properties[name] = option_schema(opt, getattr(default, name))
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {"type": "object", "required": [IMAGES], "properties": properties}
                }
            },
        }
    }
