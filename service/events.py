"""The browser UI's event handlers: caption an upload, clear, switch model, show a word."""

from __future__ import annotations

from typing import Any

import gradio as gr

from showattendtell.decoding import DecodingConfig
from showattendtell.errors import UserError
from showattendtell.images import ImageError
from showattendtell.overlay import caption_sheet

from . import drawing
from .captioning import Captioned, caption_image
from .worker import CaptionService

VIEW_SIZE = 512  # longer side of the selected word's large overlay
PANEL_SIZE = 224  # longer side of each gallery panel
SHEET_SIZE = 1024  # longer side of the photo on the caption sheet
TOAST_SECONDS = 8

PROMPT = "Upload, paste or pick an example image."
HARD_MODE_CHOICES = [("argmax: the most likely cell", "argmax"),
                     ("sample: a cell drawn from the weights", "sample"),
                     ("expected context (like soft attention)", "expectation")]

# status, caption, state, gallery, words, view, scale note, sheet, beams
UIOutputs = tuple[Any, ...]
EMPTY: UIOutputs = ("", None, [], gr.update(choices=[], value=None), None, "", None, [])


def status_text(done: Captioned) -> str:
    """What the status line says about a caption: model, mode, grid, how to read the overlays,
    and the photo's warning."""
    r, cfg = done.result, done.decoding
    g = r.attention.shape[-1]
    hard = done.attention_type == "hard"
    mode = f", hard mode {cfg.hard_mode}" if hard else ""
    text = (f"Captioned by **{done.model}** ({done.attention_type} attention{mode}, beam "
            f"{cfg.beam_size}, {g}x{g} grid). ")
    if r.locations:
        how = ("the most likely cell" if cfg.hard_mode == "argmax"
               else "sampled from the attention weights shown")
        text += (f"White frames mark the one grid cell each word was decoded from ({how}). ")
    elif hard:
        text += ("Decoded with the **expected context**: every word used the attention-weighted "
                 "average of all cells, like soft attention, so no single cell was chosen and "
                 "none is framed. ")
    text += "Click a word or a panel to see where the model looked."
    if r.warning:
        text += f"\n\n**Warning:** {r.warning}."
    return text


def ui_caption(service: CaptionService, image: Any, model: str | None = None,
               beam_size: float | None = None, max_length: float | None = None,
               hard_mode: str | None = None, length_penalty: float | None = None,
               no_repeat_ngram: float | None = None, rerank: str | None = None,
               scale: str = "word") -> UIOutputs:
    """The UI event: status, caption, per-word state, word panels, word list, the first word's
    view and its scale note, the all-words sheet and the beams. Bad input becomes a status
    message (and one toast) and clears the previous photo's outputs; never an exception, so the
    page stays usable."""
    if image is None:
        return (PROMPT, *EMPTY)
    try:
        captioner = service.get(model)
        soft = captioner.attention_type != "hard"
        done = caption_image(service, image, model, beam_size=beam_size, max_length=max_length,
                             hard_mode=None if soft else hard_mode,
                             length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram,
                             rerank=rerank if captioner.model.consensus else None)
    except UserError as e:
        gr.Warning(str(e), duration=TOAST_SECONDS)
        what = "this file" if isinstance(e, ImageError) else "the image"
        return (f"**Cannot caption {what}:** {e}", *EMPTY)
    r = done.result
    state = {"image": drawing.resized(done.image, VIEW_SIZE),
             "small": drawing.resized(done.image, PANEL_SIZE),
             "attention": r.attention, "locations": r.locations, "words": r.words}
    beams = [[c, round(float(s), 3)] for c, s in r.beams]
    words = gr.update(choices=[(w, i) for i, w in enumerate(r.words)],
                      value=0 if r.words else None)
    view, note = drawing.word_view(state, 0, scale)
    sheet = caption_sheet(drawing.resized(done.image, SHEET_SIZE), r) if r.words else None
    return (status_text(done), r.caption, state, drawing.gallery(state, scale), words, view, note,
            sheet, beams)


def clear_outputs(image: Any) -> UIOutputs:
    """The image was removed, or Gradio refused the upload (over the size limit): clear the
    previous photo's outputs. A new image leaves them to the caption event."""
    if image is None:
        return (PROMPT, *EMPTY)
    return tuple(gr.skip() for _ in range(1 + len(EMPTY)))


def model_controls(service: CaptionService, name: str | None) -> tuple[Any, ...]:
    """The decoding controls set to a model's defaults: beam size, maximum length, hard mode
    (shown for hard-attention models only), length penalty, no-repeat n-gram size, reranking
    (shown for models with a consensus index only)."""
    captioner = service.get(name)
    d: DecodingConfig = captioner.decoding
    return (gr.update(value=d.beam_size), gr.update(value=d.max_length),
            gr.update(value=d.hard_mode, visible=captioner.attention_type == "hard"),
            gr.update(value=d.length_penalty), gr.update(value=d.no_repeat_ngram),
            gr.update(value=d.rerank, visible=captioner.model.consensus is not None))


def show_word(state: dict | None, index: int | None, scale: str = "word") -> tuple[Any, str]:
    return drawing.word_view(state, index, scale)


def rescale(state: dict | None, index: int | None, scale: str = "word") -> tuple[Any, ...]:
    """The gallery and the selected word's view redrawn on another colour scale."""
    view, note = drawing.word_view(state, index, scale)
    return drawing.gallery(state, scale), view, note
