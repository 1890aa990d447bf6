"""The Gradio app behind `sat serve`: caption an image and show where the model looked per word.

One function, :func:`caption_image`, does the work for both the browser UI and the ``/caption``
API endpoint. Uploads reach it as file paths inside Gradio's upload folder (the events run with
``preprocess=False``), so Gradio never decodes them itself: :func:`open_image` is the only decoder
and refuses decompression bombs before reading their pixels. The models run on one worker thread
that batches requests arriving together (see :class:`CaptionService`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import torch
from PIL import Image, ImageDraw

from showattendtell.catalog import bundled_models, default_model_path
from showattendtell.errors import UserError
from showattendtell.images import IMAGE_SUFFIXES, ImageError, open_image, preprocess
from showattendtell.inference import Captioner, CaptionResult, load_model
from showattendtell.overlay import (
    caption_sheet,
    colour_bar,
    label_font,
    overlay_attention,
    word_panels,
)

log = logging.getLogger(__name__)

MAX_BEAM_SIZE = 10
MAX_CAPTION_LENGTH = 50
VIEW_SIZE = 512  # longer side of the selected word's large overlay
PANEL_SIZE = 224  # longer side of each gallery panel
MAX_EXAMPLES = 8
EXAMPLE_DIRS = (
    Path(__file__).parent / "examples",
    Path(__file__).resolve().parents[1].parent / "shared/data/coco2017_val_subset/images",
)


class ServiceError(UserError):
    """A request the service cannot answer (no image, an unknown model, bad settings)."""


# ---------------------------------------------------------------------------------------------
# Models and the batching worker


@dataclass
class _Job:
    captioner: Captioner
    tensor: torch.Tensor
    beam_size: int
    max_length: int
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.captioner.name, self.beam_size, self.max_length)


class CaptionService:
    """Loaded models plus one worker thread that runs them.

    Requests decode and preprocess their image on their own (Gradio worker) thread, then queue
    the tensor. The worker takes everything queued at that moment (up to ``max_batch``), groups
    it by model and decoding settings, and encodes + decodes each group as one batch. A lone
    request therefore waits for nothing, and under load the requests that piled up during the
    previous batch share the next one. Running torch on a single thread also keeps concurrent
    requests from oversubscribing the CPU cores.
    """

    def __init__(self, captioners: dict[str, Captioner], max_batch: int = 8,
                 max_upload_bytes: int = 10 * 2**20):
        if not captioners:
            raise ServiceError("no model to serve")
        self.captioners = captioners
        self.max_upload_bytes = max_upload_bytes  # for images sent inline (data URLs)
        self.max_batch = max(1, max_batch)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="caption-worker", daemon=True)
        self._worker.start()
        self.batch_sizes: list[int] = []  # observed batch sizes (for tests and benchmarks)

    @property
    def names(self) -> list[str]:
        return list(self.captioners)

    def get(self, name: str | None) -> Captioner:
        if not name:
            return next(iter(self.captioners.values()))
        if name not in self.captioners:
            raise ServiceError(f"unknown model {name!r}; available: {', '.join(self.captioners)}")
        return self.captioners[name]

    def caption(self, image: Image.Image, model: str | None = None, beam_size: int | None = None,
                max_length: int | None = None, timeout: float = 300.0) -> CaptionResult:
        """Caption one decoded RGB image (batched with concurrent requests)."""
        captioner = self.get(model)
        beam = int(beam_size or captioner.decoding.beam_size)
        length = int(max_length or captioner.decoding.max_length)
        if not 1 <= beam <= MAX_BEAM_SIZE:
            raise ServiceError(f"beam size must be between 1 and {MAX_BEAM_SIZE} (got {beam})")
        if not 1 <= length <= MAX_CAPTION_LENGTH:
            raise ServiceError(
                f"maximum length must be between 1 and {MAX_CAPTION_LENGTH} (got {length})")
        job = _Job(captioner, preprocess(image, captioner.input_size), beam, length)
        self._queue.put(job)
        return job.future.result(timeout=timeout)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stop = [first], False
            while len(jobs) < self.max_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            groups: dict[tuple[str, int, int], list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._run_group(group)
            if stop:
                return

    def _run_group(self, group: list[_Job]) -> None:
        self.batch_sizes.append(len(group))
        first = group[0]
        try:
            annotations = first.captioner.encode(torch.stack([j.tensor for j in group]))
            results = first.captioner.caption_annotations(
                annotations, beam_size=first.beam_size, max_length=first.max_length)
        except Exception as e:  # keep serving; every waiting request gets the error
            log.exception("captioning failed")
            for job in group:
                job.future.set_exception(e)
            return
        for job, result in zip(group, results, strict=True):
            job.future.set_result(result)


def model_paths(paths: Sequence[str | Path] | None) -> list[Path]:
    """The --model files, or the default model and any other bundled ones."""
    if paths:
        return [Path(p) for p in paths]
    found = [default_model_path()]
    return found + [p for p in bundled_models() if p != found[0]]


def load_service(paths: Sequence[str | Path] | None = None, device: str = "auto",
                 max_batch: int = 8) -> CaptionService:
    """Load every model (named by file stem) onto ``device`` and start the worker."""
    captioners: dict[str, Captioner] = {}
    for path in model_paths(paths):
        captioner = load_model(path, device)
        name = path.stem
        if name in captioners:  # same stem in two folders
            name = f"{path.parent.name}/{path.stem}"
        captioner.name = name
        captioners[name] = captioner
        log.info("loaded %s (%s attention) on %s", name, captioner.attention_type,
                 captioner.device)
    return CaptionService(captioners, max_batch=max_batch)


# ---------------------------------------------------------------------------------------------
# The function behind the UI and the API


@dataclass
class Captioned:
    """One captioned image: the upright decoded image, the result and the model that made it."""

    image: Image.Image
    result: CaptionResult
    model: str
    attention_type: str

    def to_json(self) -> dict[str, Any]:
        """What the /caption endpoint returns (JSON-serialisable)."""
        r = self.result
        return {
            "caption": r.caption,
            "words": r.words,
            "score": round(float(r.score), 4),
            "log_prob": round(float(r.log_prob), 4),
            "beams": [{"caption": c, "score": round(float(s), 4)} for c, s in r.beams],
            "model": self.model,
            "attention_type": self.attention_type,
            "grid": int(r.attention.shape[-1]),
            "attention": np.round(r.attention.astype(np.float64), 5).tolist(),
            "locations": [list(map(int, x)) for x in r.locations] if r.locations else None,
            "image_size": list(self.image.size),
        }


def upload_source(upload: Any, max_bytes: int | None = None) -> str | bytes:
    """The file path (or data-URL bytes) of an upload as Gradio hands it over unprocessed."""
    if upload is None or upload == "" or upload == {}:
        raise ServiceError("no image: upload, paste or pick an example image first")
    if isinstance(upload, dict):
        if upload.get("path"):
            return str(upload["path"])
        upload = upload.get("url") or ""
    if isinstance(upload, (str, Path)) and str(upload).startswith("data:"):
        try:
            data = base64.b64decode(str(upload).split(",", 1)[1], validate=False)
        except (IndexError, binascii.Error):
            raise ImageError("the pasted image data is not valid base64") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise ImageError(f"the image is larger than the {max_bytes / 2**20:g} MB limit")
        return data
    if isinstance(upload, (str, Path)) and str(upload):
        return str(upload)
    raise ServiceError("no image: upload, paste or pick an example image first")


def caption_image(service: CaptionService, image: Any, model: str | None = None,
                  beam_size: int | float | None = None,
                  max_length: int | float | None = None) -> Captioned:
    """Decode an untrusted image, caption it, and return everything the UI and API show.

    ``image`` is a Gradio upload (dict with a ``path``), a file path, bytes or a PIL image.
    Raises a UserError subclass with a one-line message for anything that is the caller's fault.
    """
    captioner = service.get(model)  # an unknown model fails before any decoding
    source = (image if isinstance(image, (bytes, Image.Image))
              else upload_source(image, service.max_upload_bytes))
    try:
        try:
            img = open_image(source)
        except Image.DecompressionBombError as e:  # PIL refuses > 2x its limit already in open()
            raise ImageError(f"{source if isinstance(source, str) else 'the image'}: too large "
                             f"to decode safely ({e})") from None
    except ImageError as e:  # name the file as the user knows it, not by its server path
        if not isinstance(source, str):
            raise
        name = image.get("orig_name") if isinstance(image, dict) else None
        raise ImageError(str(e).replace(source, name or Path(source).name)) from None
    result = service.caption(img, captioner.name, int(beam_size) if beam_size else None,
                             int(max_length) if max_length else None)
    return Captioned(img, result, captioner.name, captioner.attention_type)


# ---------------------------------------------------------------------------------------------
# Rendering for the UI


def with_colour_bar(image: Image.Image) -> Image.Image:
    """The image with the attention colour scale (labelled high/low) on its right."""
    pad, bar_w, text_w = 8, 14, 40
    out = Image.new("RGB", (image.width + pad * 2 + bar_w + text_w, image.height), "white")
    out.paste(image, (0, 0))
    out.paste(colour_bar(image.height, bar_w), (image.width + pad, 0))
    draw = ImageDraw.Draw(out)
    font = label_font(12)
    x = image.width + pad * 2 + bar_w
    draw.text((x, 0), "high", fill=(0, 0, 0), font=font)
    draw.text((x, image.height - 14), "low", fill=(0, 0, 0), font=font)
    return out


def _resized(image: Image.Image, size: int) -> Image.Image:
    scale = min(1.0, size / max(image.size))
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                        Image.Resampling.BICUBIC)


def word_label(result: CaptionResult, i: int) -> str:
    """A word's label; hard attention adds the chosen grid cell."""
    if result.locations:
        r, c = result.locations[i]
        return f"{result.words[i]}  (row {r}, col {c})"
    return result.words[i]


def word_view(state: dict | None, index: int | None) -> Image.Image | None:
    """The large overlay of one word, with the colour scale."""
    if not state or index is None or not 0 <= int(index) < len(state["words"]):
        return None
    i = int(index)
    loc = state["locations"][i] if state["locations"] else None
    return with_colour_bar(overlay_attention(state["image"], state["attention"][i], loc))


UIOutputs = tuple[str, str, dict | None, list, dict, Image.Image | None, Image.Image | None, list]


def api_caption(service: CaptionService, image: Any, model: str | None = None,
                beam_size: float | None = None, max_length: float | None = None) -> dict[str, Any]:
    """The /caption endpoint: JSON, or a gr.Error whose message the client sees."""
    try:
        return caption_image(service, image, model, beam_size, max_length).to_json()
    except UserError as e:
        raise gr.Error(str(e), print_exception=False) from None


def ui_caption(service: CaptionService, image: Any, model: str | None = None,
               beam_size: float | None = None, max_length: float | None = None) -> UIOutputs:
    """The UI event: status, caption, per-word state, word panels, word list, the first word's
    view, the all-words sheet and the beams. Bad input becomes a status message (and a toast),
    never an exception, so the page stays usable."""
    empty = ("", None, [], gr.update(choices=[], value=None), None, None, [])
    if image is None:
        return ("Upload, paste or pick an example image.", *empty)
    try:
        done = caption_image(service, image, model, beam_size, max_length)
    except UserError as e:
        gr.Warning(str(e))
        return (f"**Cannot caption this file:** {e}", *empty)
    r = done.result
    small = _resized(done.image, PANEL_SIZE)
    panels = word_panels(small, r, PANEL_SIZE)
    gallery = [(p, word_label(r, i)) for i, p in enumerate(panels)]
    state = {"image": _resized(done.image, VIEW_SIZE), "attention": r.attention,
             "locations": r.locations, "words": r.words}
    beams = [[c, round(float(s), 3)] for c, s in r.beams]
    note = (" White frames mark the location hard attention chose for each word."
            if r.locations else "")
    g = r.attention.shape[-1]
    status = (f"Captioned by **{done.model}** ({done.attention_type} attention, {g}x{g} grid). "
              f"Click a word or a panel to see where the model looked.{note}")
    words = gr.update(choices=[(w, i) for i, w in enumerate(r.words)],
                      value=0 if r.words else None)
    sheet = caption_sheet(_resized(done.image, 1024), r) if r.words else None
    return (status, r.caption, state, gallery, words, word_view(state, 0), sheet, beams)


# ---------------------------------------------------------------------------------------------
# The Blocks app

CSS = """
#caption-text textarea {font-size: 1.35em; font-weight: 600}
"""


def find_examples(paths: Sequence[str | Path] | None = None,
                  limit: int = MAX_EXAMPLES) -> list[Path]:
    """Example photos: the given files/folders (None: service/examples or the COCO subset)."""
    if paths is None:
        candidates = [d for d in EXAMPLE_DIRS if d.is_dir()][:1]
    else:  # an empty list: no examples
        candidates = [Path(p) for p in paths]
    found: list[Path] = []
    for p in candidates:
        if p.is_dir():
            found += sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        elif p.is_file():
            found.append(p)
    return [f.resolve() for f in found[:limit]]


def build_app(service: CaptionService, examples: Sequence[Path] = (),
              concurrency: int = 8) -> gr.Blocks:
    """The UI (upload -> caption, word overlays, beams) and the /caption API endpoint."""
    names = service.names
    default = service.get(None)

    def model_choice(name: str) -> tuple[str, str]:
        return (f"{name} ({service.get(name).attention_type} attention)", name)

    with gr.Blocks(title="Show, Attend and Tell") as app:
        gr.Markdown("# Show, Attend and Tell\nUpload, paste or pick a photo: the model writes a "
                    "caption and shows, for every word, where in the image it looked.")
        state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(label="Image", type="filepath", image_mode=None,
                                 sources=["upload", "clipboard"], height=360, elem_id="input-image")
                with gr.Row():
                    model = gr.Dropdown([model_choice(n) for n in names], value=names[0],
                                        label="Model", interactive=len(names) > 1)
                with gr.Row():
                    beam = gr.Slider(1, MAX_BEAM_SIZE, value=default.decoding.beam_size, step=1,
                                     label="Beam size (1: greedy)")
                    length = gr.Slider(1, MAX_CAPTION_LENGTH, value=default.decoding.max_length,
                                       step=1, label="Maximum length (words)")
                button = gr.Button("Caption", variant="primary", elem_id="caption-button")
                if examples:
                    gr.Examples([[str(p)] for p in examples], inputs=[image],
                                label="Examples", examples_per_page=MAX_EXAMPLES,
                                elem_id="examples")
            with gr.Column(scale=2):
                status = gr.Markdown("Upload, paste or pick an example image.",
                                     elem_id="status")
                caption = gr.Textbox(label="Caption", interactive=False, elem_id="caption-text")
                words = gr.Radio([], label="Words: click one to see its attention",
                                 elem_id="words")
                view = gr.Image(label="Attention for the selected word", type="pil",
                                interactive=False, format="png", elem_id="word-view", height=400)
        gallery = gr.Gallery(label="Every word's attention (click to step through)", columns=6,
                             height="auto", object_fit="contain", format="jpeg",
                             elem_id="word-gallery")
        sheet = gr.Image(label="The whole caption with all word overlays", type="pil",
                         interactive=False, format="jpeg", elem_id="caption-sheet")
        beams = gr.Dataframe(headers=["caption", "score"], label="Top beam captions",
                             interactive=False, elem_id="beams")
        api_out = gr.JSON(label="result", visible=False)
        api_button = gr.Button(visible=False)

        inputs = [image, model, beam, length]
        gr.on([button.click, image.change], partial(ui_caption, service), inputs=inputs,
              outputs=[status, caption, state, gallery, words, view, sheet, beams],
              preprocess=False, concurrency_limit=concurrency, concurrency_id="caption",
              trigger_mode="always_last", api_visibility="private")
        words.change(word_view, inputs=[state, words], outputs=[view], queue=False,
                     api_visibility="private")

        def select_word(evt: gr.SelectData) -> int:
            return int(evt.index)

        gallery.select(select_word, None, words, queue=False, api_visibility="private")
        api_button.click(partial(api_caption, service), inputs=inputs, outputs=[api_out],
                         api_name="caption", preprocess=False, concurrency_limit=concurrency,
                         concurrency_id="caption",
                         api_description="Caption an image: caption, words, score, top beams "
                                         "and each word's attention grid (and hard-attention "
                                         "locations).")
    return app


def launch(service: CaptionService, host: str = "127.0.0.1", port: int = 7860,
           max_upload_mb: float = 10.0, examples: Sequence[Path] = (), concurrency: int = 8,
           queue_size: int = 64, block: bool = True) -> gr.Blocks:
    """Build and start the app; ``block=False`` returns once it serves (tests, benchmarks).

    Gradio copies the example photos into its cache when the app is built; requests can only
    name files in its upload folder or cache, so no other file on the machine is served or read.
    """
    service.max_upload_bytes = int(max_upload_mb * 2**20)
    app = build_app(service, examples, concurrency=concurrency)
    app.queue(max_size=queue_size)
    app.launch(server_name=host, server_port=port, max_file_size=int(max_upload_mb * 2**20),
               css=CSS, footer_links=["api"],
               prevent_thread_lock=not block, quiet=not block)
    return app
