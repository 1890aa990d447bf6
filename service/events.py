"""The browser UI's event handlers: caption an upload, clear, switch model, show a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from showattendtell.errors import UserError
from showattendtell.images.files import ImageError

from . import drawing, options
from .captioning import Captioned, caption_image
from .uploads import read_upload, upload_path
from .worker import CaptionService

VIEW_SIZE = 512  # longer side of the selected word's large overlay
PANEL_SIZE = 224  # longer side of each gallery panel
PREVIEW_SIZE = 1024  # longer side of the preview of a photo the browser cannot show
TOAST_SECONDS = 8
# Photos the page takes that browsers do not show (Chromium and Firefox show no HEIC or TIFF):
# the input panel would show a broken image, so the page shows a converted preview below it.
NOT_SHOWN = (".heic", ".heif", ".tif", ".tiff")

PROMPT = "Upload, paste or pick an example image."
REFUSED = "Gradio refused the file before it reached the captioner"

# What every caption event returns, in this order (app.py wires the components the same way).
OUTPUTS = (
    "status",
    "warning",
    "caption",
    "state",
    "gallery",
    "words",
    "view",
    "note",
    "sheet",
    "phone_sheet",
    "beams",
)
UIOutputs = tuple[Any, ...]
BEAM_COLUMNS = ["rank", "caption", "consensus", "score"]  # fixed: the page keeps one table


def no_beams() -> Any:
    """The beam table emptied (same columns, no rows)."""
    return gr.update(value=pd.DataFrame(columns=BEAM_COLUMNS), label="Top beam captions")


def cleared() -> UIOutputs:
    """Everything after the status line, cleared: made anew for every event, since Gradio
    consumes the update dicts it is given (it pops their values)."""
    return (
        gr.update(value="", visible=False),
        "",
        None,
        [],
        gr.update(choices=[], value=None),
        None,
        "",
        None,
        None,
        no_beams(),
    )


def status_text(done: Captioned) -> str:
    """What the status line says about a caption: model, mode, grid, familiarity, confidence and
    how to read the overlays."""
    r, cfg = done.result, done.decoding
    g = r.attention.shape[-1]
    hard = done.attention_type == "hard"
    mode = f", hard mode {cfg.hard_mode}" if hard else ""
    text = (
        f"Captioned by **{done.model}** ({done.attention_type} attention{mode}, beam "
        f"{cfg.beam_size}, {g}x{g} grid). "
    )
    if r.familiarity is not None:
        text += (
            f"Familiarity **{r.familiarity:.2f}** (0 to 1: how much the photo looks like the "
            "photos the model learnt from; about 0.5 for a typical one). "
        )
    if r.confidence is not None:
        text += (
            f"Confidence **{r.confidence:.2f}** (0 to 1: the chance that the caption is good; "
            "of captions given 0.8, about 8 in 10 are). "
        )
    if r.locations:
        how = (
            "the most likely cell"
            if cfg.hard_mode == "argmax"
            else "sampled from the attention weights shown"
        )
        text += f"White frames mark the one grid cell each word was decoded from ({how}). "
    elif hard:
        text += (
            "Decoded with the **expected context**: every word used the attention-weighted "
            "average of all cells, like soft attention, so no single cell was chosen and "
            "none is framed. "
        )
    return text + "Click a word or a panel to see where the model looked."


def warning_update(done: Captioned) -> Any:
    """The warning box above the caption: shown only when the result has a warning (a photo
    unlike the training photos, a degenerate one)."""
    w = done.result.warning
    return gr.update(value=f"**Warning:** {w}." if w else "", visible=bool(w))


def beam_table(done: Captioned) -> Any:
    """The beams in the order that chose the caption (the caption first), with the score that
    decided it and a label that says which one that is (consensus: empty without reranking)."""
    rows = done.beam_rows()
    penalty = done.decoding.length_penalty
    score = "log p / length^" + f"{penalty:g}" if penalty else "log p"
    frame = pd.DataFrame(
        [[i + 1, b["caption"], b.get("consensus", ""), b["score"]] for i, b in enumerate(rows)],
        columns=BEAM_COLUMNS,
    )
    if done.consensus is not None:
        label = (
            "Top beam captions, ranked by consensus reranking: their agreement (CIDEr-D) with the "
            f"captions of the most similar training photos decided, not their score ({score})"
        )
    else:
        label = f"Top beam captions, ranked by score ({score}: higher is more likely)"
    return gr.update(value=frame, label=label)


def ui_caption(
    service: CaptionService,
    image: Any,
    model: str | None = None,
    scale: str = drawing.DEFAULT_SCALE,
    **decoding: Any,
) -> UIOutputs:
    """The UI event: the ``OUTPUTS``. ``decoding``: the controls' values; those of options that
    do not apply to the model (its hidden controls) are ignored. Bad input becomes a status
    message (and one toast) and clears the previous photo's outputs; never an exception, so the
    page stays usable."""
    if image is None:
        return (PROMPT, *cleared())
    try:
        captioner = service.get(model)
        done = caption_image(service, image, model, **options.applicable(captioner, decoding))
    except UserError as e:
        gr.Warning(str(e), duration=TOAST_SECONDS)
        what = "this file" if isinstance(e, ImageError) else "the image"
        return (f"**Cannot caption {what}:** {e}", *cleared())
    r = done.result
    state = {
        "image": drawing.Packed.of(drawing.readable(done.image, VIEW_SIZE)),
        "small": drawing.Packed.of(drawing.readable(done.image, PANEL_SIZE)),
        "attention": r.attention,
        "locations": r.locations,
        "words": r.words,
    }
    first = drawing.opening_word(r.words, r.attention)
    words = gr.update(choices=[(w, i) for i, w in enumerate(r.words)], value=first)
    view, note = drawing.word_view(state, first, scale)
    sheet, phone_sheet = drawing.sheets(done.image, r) if r.words else (None, None)
    return (
        status_text(done),
        warning_update(done),
        r.caption,
        state,
        drawing.gallery(state, scale),
        words,
        view,
        note,
        sheet,
        phone_sheet,
        beam_table(done),
    )


def removed() -> UIOutputs:
    """The user removed the photo (the image's clear button): the prompt, outputs cleared."""
    return (PROMPT, *cleared())


def clear_outputs(image: Any) -> UIOutputs:
    """The image became None: removed (``removed`` sets the prompt), or Gradio refused the
    upload (over the size limit; ``refused_upload`` says why): clear the previous photo's
    outputs and leave the status line to those, so that the refusal's reason stays in it
    whichever answer arrives last. A new image leaves them to the caption event."""
    if image is None:
        return (gr.skip(), *cleared())
    return tuple(gr.skip() for _ in OUTPUTS)


def refused_upload(message: str | None = None) -> UIOutputs:
    """Gradio's page refused a file before uploading it (not an image type: .txt, .pdf) and
    said so in a toast; the page then reports it here (app.REFUSAL_JS), and the previous photo's
    outputs are cleared as for any other file that cannot be captioned."""
    reason = (message or "").strip() or "the file is not an image"
    return (
        f"**Cannot caption this file:** {reason} ({REFUSED}; any photo shown is the previous one).",
        *cleared(),
    )


def model_controls(service: CaptionService, name: str | None) -> tuple[Any, ...]:
    """The decoding controls set to a model's defaults, each shown only where it applies to the
    model (options.control_updates)."""
    return options.control_updates(service.get(name))


def show_word(
    state: dict | None, index: int | None, scale: str = drawing.DEFAULT_SCALE
) -> tuple[Any, str]:
    return drawing.word_view(state, index, scale)


def rescale(
    state: dict | None, index: int | None, scale: str = drawing.DEFAULT_SCALE
) -> tuple[Any, ...]:
    """The gallery and the selected word's view redrawn on another colour scale."""
    view, note = drawing.word_view(state, index, scale)
    return drawing.gallery(state, scale), view, note


def upload_name(upload: Any) -> str:
    """The upload's file name as the user knows it ("" for inline data)."""
    name = upload.get("orig_name") if isinstance(upload, dict) else None
    return name or Path(upload_path(upload) or "").name


def preview_upload(service: CaptionService, upload: Any) -> Any:
    """The preview beside the input panel: for a photo the browser cannot show (NOT_SHOWN), the
    upload decoded as `sat caption` decodes it (uploads.read_upload: only a file uploaded to this
    page, decompression bombs refused) and shrunk; hidden for any other photo. A file that
    cannot be decoded gets no preview: the caption event says why."""
    name = upload_name(upload)
    if not name.lower().endswith(NOT_SHOWN):
        return gr.update(value=None, visible=False)
    try:
        image = read_upload(upload, service.max_upload_bytes, cache=service.cache)
    except UserError:
        return gr.update(value=None, visible=False)
    return gr.update(
        value=drawing.resized(image, PREVIEW_SIZE),
        visible=True,
        label=f"Preview of {name}",  # short: clear of the image's buttons on a phone
    )


def hide_preview(upload: Any) -> Any:
    """The photo was removed or replaced by one the browser shows (an example): no preview.
    A new photo it cannot show keeps it until its upload event has drawn the new one."""
    if upload is not None and upload_name(upload).lower().endswith(NOT_SHOWN):
        return gr.skip()
    return gr.update(value=None, visible=False)
