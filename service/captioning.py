"""The function behind both the browser UI and the ``/caption`` API: decode, caption, report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr
from PIL import Image

from showattendtell.captioning.captioner import CaptionResult, finite_or_none
from showattendtell.errors import UserError
from showattendtell.images.files import full_size
from showattendtell.search.decoding import DecodingConfig

from . import options
from .uploads import read_upload, upload_path
from .worker import CaptionService

CAPTION_TIMEOUT_S = 300.0  # a caption not made by then is an error, not a hung request

# How the beams are ordered, as the API's ``ranked_by`` and the UI's table say it.
RANKED_BY_SCORE = "score"  # log p / length**length_penalty, highest first
RANKED_BY_CONSENSUS = "consensus"  # agreement with the captions of similar training photos


@dataclass
class Captioned:
    """One captioned image: the upright decoded image, the result, the model that made it, the
    decoding settings it used (those that apply to the model) and, when the beams were reranked
    by consensus, each beam's consensus score."""

    image: Image.Image
    result: CaptionResult
    model: str
    attention_type: str
    decoding: DecodingConfig
    settings: dict[str, Any]  # the options that apply to this model (options.reported)

    @property
    def consensus(self) -> list[float] | None:
        """Each beam's consensus score (4 decimals) when reranked by it, else None: carried on
        the result from the reranking itself (``CaptionResult.consensus``)."""
        c = self.result.consensus
        return None if c is None else [round(x, 4) for x in c]

    @property
    def ranked_by(self) -> str:
        return RANKED_BY_CONSENSUS if self.consensus is not None else RANKED_BY_SCORE

    def beam_rows(self) -> list[dict[str, Any]]:
        """The beams in the order that chose the caption (the first is the caption), each with
        its score and, when reranked, its consensus score."""
        rows = []
        consensus = self.consensus
        for i, (caption, score) in enumerate(self.result.beams):
            row: dict[str, Any] = {"caption": caption, "score": finite_or_none(score, 4)}
            if consensus is not None:
                row["consensus"] = consensus[i]
            rows.append(row)
        return rows

    def to_json(self) -> dict[str, Any]:
        """What the /caption endpoint returns: ``CaptionResult.to_dict(with_attention=True)``
        (caption, words, score, log_prob, familiarity, confidence, attention, warning when
        set) plus the beams in the order that decided (``ranked_by``: "score" or "consensus"),
        the model, the grid, the hard-attention locations (None without), the photo's size and
        the decoding settings that apply to the model."""
        r = self.result
        d = r.to_dict(with_attention=True)
        d.update(
            beams=self.beam_rows(),
            ranked_by=self.ranked_by,
            model=self.model,
            attention_type=self.attention_type,
            grid=int(r.attention.shape[-1]),
            locations=d.get("locations"),
            image_size=list(full_size(self.image)),  # the photo's, even if decoded reduced
            decoding=self.settings,
        )
        return d


def caption_image(
    service: CaptionService, image: Any, model: str | None = None, **decoding: Any
) -> Captioned:
    """Decode an untrusted image, caption it, and return everything the UI and API show.

    ``image`` is a Gradio upload (dict with a ``path``), a file path, a data URL, bytes or a PIL
    image. ``decoding``: DecodingConfig's options (None: the model's default), checked before
    the image is read. Raises a UserError subclass with a one-line message for anything that is
    the caller's fault. While the photo is captioned, its upload stays in Gradio's cache.
    """
    captioner = service.get(model)  # an unknown model fails before any decoding
    config = service.decoding(captioner.name, **decoding)  # so does an option out of range
    with service.arriving() as arrival:  # a batch about to start waits for this photo
        with service.cache.using(upload_path(image)):
            img = read_upload(image, service.max_upload_bytes, captioner.input_size, service.cache)
        future = service.submit(img, captioner.name, config, arrival)
    result = future.result(timeout=CAPTION_TIMEOUT_S)
    return Captioned(
        img,
        result,
        captioner.name,
        captioner.attention_type,
        config,
        options.reported(captioner, config),
    )


def api_caption(
    service: CaptionService, image: Any, model: str | None = None, **decoding: Any
) -> dict[str, Any]:
    """The /caption endpoint: JSON, or a gr.Error whose message the client sees. An option not
    given (None) is the model's default; a value out of range is an error, never a default."""
    try:
        return caption_image(service, image, model, **decoding).to_json()
    except UserError as e:
        raise gr.Error(str(e), print_exception=False) from None
