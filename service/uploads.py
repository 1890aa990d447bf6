"""Reading an untrusted upload as Gradio hands it over, and the example photos.

Uploads reach the service as file paths inside Gradio's upload folder (the events run with
``preprocess=False``), or as inline data URLs; :func:`read_upload` decodes them only with
``showattendtell.images.files.open_image``, which refuses decompression bombs before reading pixels.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from showattendtell.images.files import IMAGE_SUFFIXES, ImageError, open_image

from .cache import CacheBound
from .worker import ServiceError

MAX_EXAMPLES = 8
EXAMPLES_DIR = Path(__file__).parent / "examples"  # shipped with the package (README.md there)

NO_IMAGE = "no image: upload, paste or pick an example image first"
NOT_AN_UPLOAD = "an image comes as an upload or inline (a data: URL); other URLs are not read"
NOT_OURS = (
    "an image comes as an upload to this server or inline (a data: URL); "
    "other files on the server are not read"
)


def upload_source(upload: Any, max_bytes: int | None = None) -> str | bytes:
    """The file path (or data-URL bytes) of an upload as Gradio hands it over unprocessed."""
    if upload is None or upload == "" or upload == {}:
        raise ServiceError(NO_IMAGE)
    if isinstance(upload, dict):
        if upload.get("path"):
            if is_url(upload["path"]):
                raise ServiceError(NOT_AN_UPLOAD)
            return str(upload["path"])
        upload = upload.get("url") or ""
        if upload and not str(upload).startswith("data:"):
            # Gradio checks that a "path" is an upload, but leaves "url" to us: read as a path,
            # it would caption (and serve the overlays of) any image on the server
            raise ServiceError(NOT_AN_UPLOAD)
    if isinstance(upload, (str, Path)) and str(upload).startswith("data:"):
        try:
            data = base64.b64decode(str(upload).split(",", 1)[1], validate=False)
        except (IndexError, binascii.Error):
            raise ImageError("the pasted image data is not valid base64") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise ImageError(f"the image is larger than the {max_bytes / 2**20:g} MB limit")
        return data
    if isinstance(upload, (str, Path)) and str(upload):
        if is_url(upload):
            raise ServiceError(NOT_AN_UPLOAD)
        return str(upload)
    raise ServiceError(NO_IMAGE)


def is_url(value: Any) -> bool:
    """Whether ``value`` names something to fetch (``scheme://...``) rather than a file."""
    return isinstance(value, str) and "://" in value[:32]


def refuse_urls(inputs: Any) -> None:
    """Refuse, before Gradio fetches anything, a request whose inputs name a URL as a file.

    Gradio downloads every file dict (``{"path": "https://...", "meta": {"_type":
    "gradio.FileData"}}``, what gradio_client's ``handle_file(URL)`` sends) into its cache while
    it prepares an event's inputs, before the event's function runs: a server that fetches
    what clients name can be made to reach hosts only it can reach. Inline images (data: URLs)
    and uploads are the ways in."""

    stack = [inputs]  # every level, as Gradio's own traversal goes (no recursion limit)
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if is_url(value.get("path")):  # what Gradio fetches ("url" is the page's link)
                raise ServiceError(NOT_AN_UPLOAD)
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def upload_path(upload: Any) -> str | None:
    """The file an upload names in Gradio's cache (None for inline data and images)."""
    if isinstance(upload, dict):
        upload = upload.get("path")
    if isinstance(upload, (str, Path)) and str(upload) and not str(upload).startswith("data:"):
        return str(upload)
    return None


def read_upload(
    upload: Any,
    max_bytes: int | None = None,
    min_size: int | None = None,
    cache: CacheBound | None = None,
) -> Image.Image:
    """Decode an upload (a Gradio file dict, a path, a data URL, bytes or a PIL image) to an
    upright RGB image (a large JPEG at a reduced size no smaller than ``min_size``, as
    ``open_image`` does for `sat caption`: the same encoder input from both). An ImageError
    names the file as the user knows it, not by its path on the server.

    A path is read only if ``cache`` says Gradio placed it in this app's cache: any other path
    a client names is refused before it is touched, with one message whether or not it exists
    (a client must not learn which files the server has, nor make it decode them)."""
    source = (
        upload if isinstance(upload, (bytes, Image.Image)) else upload_source(upload, max_bytes)
    )
    name = upload.get("orig_name") if isinstance(upload, dict) else None
    outside = isinstance(source, str) and cache is not None and not cache.holds(source)
    if outside and not cache.removed(source):
        raise ServiceError(NOT_OURS)
    if isinstance(source, str) and not Path(source).exists():
        # removed from Gradio's cache (cache.py) since it was uploaded: the page still shows it
        raise ServiceError(
            f"{name or Path(source).name} is no longer on the server (uploads "
            "are removed after a while); upload it again"
        )
    try:
        return open_image(source, min_size=min_size)
    except ImageError as e:
        if not isinstance(source, str):
            raise
        raise ImageError(str(e).replace(source, name or Path(source).name)) from None


def find_examples(
    paths: Sequence[str | Path] | None = None, limit: int = MAX_EXAMPLES
) -> list[Path]:
    """Example photos: the given files/folders (None: the photos shipped in service/examples)."""
    candidates = [EXAMPLES_DIR] if paths is None else [Path(p) for p in paths]
    found: list[Path] = []
    for p in candidates:
        if p.is_dir():
            found += sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        elif p.is_file():
            found.append(p)
    return [f.resolve() for f in found[:limit]]
