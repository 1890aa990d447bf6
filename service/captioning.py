"""The function behind both the browser UI and the ``/caption`` API: decode, caption, report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr
from PIL import Image

from showattendtell.decoding import DecodingConfig
from showattendtell.errors import UserError
from showattendtell.images import full_size
from showattendtell.inference import CaptionResult, finite_or_none

from .uploads import read_upload
from .worker import CaptionService


@dataclass
class Captioned:
    """One captioned image: the upright decoded image, the result, the model that made it and
    the decoding settings it used."""

    image: Image.Image
    result: CaptionResult
    model: str
    attention_type: str
    decoding: DecodingConfig

    def to_json(self) -> dict[str, Any]:
        """What the /caption endpoint returns: ``CaptionResult.to_dict(with_attention=True)``
        (caption, words, score, log_prob, attention, warning when set) plus the beams, the
        model, the grid, the hard-attention locations (None without) and the photo's size."""
        r = self.result
        # float64 first: float32 weights rounded to 5 decimals print as 0.30799999833106995
        d = r.to_dict(with_attention=True)
        d.update(
            beams=[{"caption": c, "score": finite_or_none(s, 4)} for c, s in r.beams],
            model=self.model,
            attention_type=self.attention_type,
            grid=int(r.attention.shape[-1]),
            locations=d.get("locations"),
            image_size=list(full_size(self.image)),  # the photo's, even if decoded reduced
            decoding=self.decoding.to_dict(),
        )
        return d


def caption_image(service: CaptionService, image: Any, model: str | None = None,
                  **decoding: Any) -> Captioned:
    """Decode an untrusted image, caption it, and return everything the UI and API show.

    ``image`` is a Gradio upload (dict with a ``path``), a file path, a data URL, bytes or a PIL
    image. ``decoding``: beam_size, max_length, length_penalty, hard_mode, no_repeat_ngram,
    rerank (None: the model's default), checked by DecodingConfig before the image is read. Raises a
    UserError subclass with a one-line message for anything that is the caller's fault.
    """
    captioner = service.get(model)  # an unknown model fails before any decoding
    config = service.decoding(captioner.name, **decoding)  # so does an option out of range
    img = read_upload(image, service.max_upload_bytes, captioner.input_size)
    result = service.caption(img, captioner.name, config)
    return Captioned(img, result, captioner.name, captioner.attention_type, config)


def api_caption(service: CaptionService, image: Any, model: str | None = None,
                beam_size: float | None = None, max_length: float | None = None,
                hard_mode: str | None = None, length_penalty: float | None = None,
                no_repeat_ngram: float | None = None,
                rerank: str | None = None) -> dict[str, Any]:
    """The /caption endpoint: JSON, or a gr.Error whose message the client sees. An option not
    given (None) is the model's default; a value out of range is an error, never a default."""
    try:
        return caption_image(service, image, model, beam_size=beam_size, max_length=max_length,
                             hard_mode=hard_mode, length_penalty=length_penalty,
                             no_repeat_ngram=no_repeat_ngram, rerank=rerank).to_json()
    except UserError as e:
        raise gr.Error(str(e), print_exception=False) from None
