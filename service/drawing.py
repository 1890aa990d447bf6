"""Attention overlays for the web UI, on a colour scale labelled with real attention weights.

``showattendtell.captioning.overlays`` stretches every map to its own maximum (used as is for
the caption sheet). Here the scale is explicit: colour ``0 .. vmax`` where ``vmax`` is either the
largest weight over every word of the caption (the default: one fixed scale, so a nearly uniform map
looks pale next to a focused one) or the word's own largest weight, and the bar beside the large
view is labelled with ``vmax``, 0 and the uniform level ``1/L`` (L = grid cells). A map whose
largest weight is under ``FLAT_RATIO`` times the uniform level is *flat* (the model looked
almost everywhere): it is marked so on every scale, since its own scale would paint it as red as
a focused one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from showattendtell.captioning.captioner import CaptionResult
from showattendtell.captioning.overlays import (
    caption_sheet,
    colour_bar,
    label_font,
    overlay_attention,
    panel_size,
)

SCALES = ("caption", "word")  # colour scale: the caption's maximum, or each word's own
DEFAULT_SCALE = "caption"
SCALE_CHOICES = [
    ("whole caption: 0 to the largest weight of any word", "caption"),
    ("each word: 0 to its own largest weight (flat maps marked)", "word"),
]
FLAT_RATIO = 2.0  # a map whose largest weight is under this many times 1/L is flat
FLAT_TAG = "flat map"


def is_flat(grid: np.ndarray) -> bool:
    """Whether an attention map is nearly uniform: its largest weight is under ``FLAT_RATIO``
    times the uniform weight 1/L (e.g. 0.018 against 0.012 on a 9x9 grid)."""
    return float(np.max(grid)) < FLAT_RATIO / grid.size


def tagged(image: Image.Image, text: str = FLAT_TAG, top: bool = False) -> Image.Image:
    """The image with ``text`` on a dark band at its bottom left (marks a flat map): Gradio
    lays its label over the top left of an image that fills its box, which hid a tag there.
    ``top``: at the top left, in larger letters, for a gallery panel, whose caption Gradio lays
    over the bottom of the panel and which a phone shows 100 px wide."""
    out = image.copy()
    draw = ImageDraw.Draw(out)
    size = max(10, image.width // 10) if top else max(10, min(14, image.width // 20))
    font = label_font(size)
    box = draw.textbbox((0, 0), text, font=font)
    band = box[3] + 8
    y = 0 if top else max(0, image.height - band)
    draw.rectangle([0, y, box[2] + 10, y + band], fill=(20, 20, 20))
    draw.text((5, y + 3), text, fill=(255, 214, 90), font=font)  # not white: white marks a cell
    return out


# Words that say little about where to look: the page opens on the first word not among them.
FUNCTION_WORDS = frozenset(
    ("a", "an", "the", "of", "on", "in", "at", "to", "with", "and", "or", "is", "are", "was")
    + ("were", "be", "its", "his", "her", "their", "this", "that", "for", "from", "by", "near")
    + ("into", "over", "under", "while", "some", "two", "three")
)


def opening_word(words: list[str], attention: np.ndarray) -> int | None:
    """The word whose attention the page shows first: the first content word whose map is not
    flat, else the word with the most concentrated map (largest weight). Not the first word,
    usually a flat "a", which would open every caption on "the model looked almost everywhere".
    """
    if not words:
        return None
    for i, word in enumerate(words):
        if word.lower() not in FUNCTION_WORDS and not is_flat(attention[i]):
            return i
    return int(np.argmax([float(np.max(a)) for a in attention]))


@dataclass(frozen=True)
class Packed:
    """An image kept JPEG-encoded in a browser session's state, decoded when an overlay is drawn
    on it.

    Why: Gradio keeps each session's state in the server's memory for the session's life (an
    hour by default, up to --max-sessions of them). As pixels, the view and panel images of one
    captioned photo held about 0.9 MB a session (0.9 GB at the default 1,000 sessions, the
    service's memory rising with every new visitor for an hour); encoded, a tenth of that.
    Decoding one for a click costs a few milliseconds."""

    data: bytes
    size: tuple[int, int]

    QUALITY = 92  # an underlay for heatmaps: no visible loss at this quality

    @classmethod
    def of(cls, image: Image.Image) -> Packed:
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, "JPEG", quality=cls.QUALITY)
        return cls(buffer.getvalue(), image.size)

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]

    def image(self) -> Image.Image:
        with Image.open(io.BytesIO(self.data)) as img:  # our own encoding, never an upload
            return img.convert("RGB")


def unpacked(image: Image.Image | Packed) -> Image.Image:
    return image.image() if isinstance(image, Packed) else image


def readable(image: Image.Image, size: int) -> Image.Image:
    """The image with its longer side ``size`` and its shorter side no less than a third of
    that (overlays.panel_size, as the CLI's sheets): a panorama's overlays stay panels in which
    something can be seen, not strips one or two pixels high."""
    target = panel_size(image.width, image.height, size)
    return image if target == image.size else image.resize(target, Image.Resampling.BICUBIC)


def resized(image: Image.Image, size: int) -> Image.Image:
    """The image shrunk (never enlarged) so that its longer side is at most ``size``."""
    scale = min(1.0, size / max(image.size))
    return image.resize(
        (max(1, round(image.width * scale)), max(1, round(image.height * scale))),
        Image.Resampling.BICUBIC,
    )


SHEET_SIZE = 1024  # longer side of the photo the caption sheets are drawn from
# The sheet for a phone screen (the page shows it at widths up to PHONE_WIDTH CSS px, where the
# sheet is about PHONE_SHEET_SHOWN px wide): two columns of small panels with large lettering,
# so that its 16 x PHONE_TEXT px labels show at 11 px or more; five columns of 200 px panels
# (the desktop's sheet, 1,168 px wide) would show them at 5 px.
PHONE_WIDTH = 640
PHONE_SHEET_SHOWN = 334  # 400 px less the page's margins and the image's border
PHONE_PANEL, PHONE_COLUMNS, PHONE_TEXT = 160, 2, 1.3
PHONE_LABEL_WIDTH = 100  # a panel's width at least: its weight's label and most words fit


def sheets(image: Image.Image, result: CaptionResult) -> tuple[Image.Image, Image.Image]:
    """The whole-caption sheet (overlays.caption_sheet: every word on the caption's colour
    scale), for a wide screen and for a phone; the page shows the one that fits its width."""
    source = resized(image, SHEET_SIZE)
    wide = caption_sheet(source, result)
    # a portrait photo's panels: larger, to be as wide as a label needs, and as many columns of
    # them as fit where two landscape ones do
    panel = PHONE_PANEL
    if panel_size(source.width, source.height, panel)[0] < PHONE_LABEL_WIDTH:
        panel = math.ceil(panel * PHONE_LABEL_WIDTH / panel_size(*source.size, panel)[0])
    columns = PHONE_COLUMNS * (PHONE_PANEL + 8) // (panel_size(*source.size, panel)[0] + 8)
    phone = caption_sheet(source, result, panel, columns, PHONE_TEXT)
    return wide, phone


def scale_max(attention: np.ndarray, index: int, scale: str = DEFAULT_SCALE) -> float:
    """The weight drawn at the top of the colour scale for word ``index``."""
    if scale not in SCALES:
        raise ValueError(f"colour scale must be one of {', '.join(SCALES)}, not {scale!r}")
    grid = attention if scale == "caption" else attention[index]
    return max(float(np.max(grid)), 1e-12)


def weight_label(x: float) -> str:
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def with_colour_bar(image: Image.Image, vmax: float, cells: int) -> Image.Image:
    """The image with the colour scale on its right: labelled ``vmax`` at the top, 0 at the
    bottom, and a tick at the uniform level 1/cells when it lies within the scale."""
    pad, bar_w, text_w = 8, 14, 96
    out = Image.new("RGB", (image.width + pad * 2 + bar_w + text_w, image.height), "white")
    out.paste(image, (0, 0))
    x_bar = image.width + pad
    out.paste(colour_bar(image.height, bar_w), (x_bar, 0))
    draw = ImageDraw.Draw(out)
    font = label_font(12)
    x = x_bar + bar_w + pad
    black = (0, 0, 0)
    draw.text((x, 0), weight_label(vmax), fill=black, font=font)
    draw.text((x, image.height - 14), "0", fill=black, font=font)
    uniform = 1.0 / cells
    if uniform <= vmax:
        y = round((1 - uniform / vmax) * (image.height - 1))
        draw.line([(x_bar - 3, y), (x_bar + bar_w + 2, y)], fill=black, width=2)
        ty = min(max(y - 7, 16), image.height - 30)  # keep clear of the top and bottom labels
        draw.text((x, ty), f"uniform 1/{cells}", fill=black, font=font)
    return out


def located(state: dict[str, Any], i: int) -> tuple[int, int] | None:
    return tuple(state["locations"][i]) if state.get("locations") else None


def word_label(state: dict[str, Any], i: int) -> str:
    """A word's gallery label: the word, its largest weight, and the cell hard attention chose."""
    label = f"{state['words'][i]}  (max {weight_label(float(np.max(state['attention'][i])))}"
    loc = located(state, i)
    if loc is not None:
        label += f", row {loc[0]}, col {loc[1]}"
    if is_flat(state["attention"][i]):
        label += f", {FLAT_TAG}"
    return label + ")"


def overlay(
    state: dict[str, Any], i: int, scale: str, size_key: str, base: Image.Image | None = None
) -> Image.Image:
    """Word ``i``'s overlay on ``state[size_key]`` (``base``: that image, already decoded) on the
    chosen scale, a flat map tagged."""
    att = state["attention"]
    base = unpacked(state[size_key]) if base is None else base
    img = overlay_attention(base, att[i], located(state, i), vmax=scale_max(att, i, scale))
    return tagged(img, top=size_key == "small") if is_flat(att[i]) else img


def gallery(state: dict[str, Any] | None, scale: str = DEFAULT_SCALE) -> list:
    """(panel, label) for every word, on the chosen colour scale."""
    if not state:
        return []
    small = unpacked(state["small"])  # decoded once for every panel
    return [
        (overlay(state, i, scale, "small", small), word_label(state, i))
        for i in range(len(state["words"]))
    ]


def scale_note(state: dict[str, Any], i: int, scale: str, vmax: float) -> str:
    cells = int(np.prod(state["attention"].shape[1:]))
    g = state["attention"].shape[-1]
    top = float(np.max(state["attention"][i]))
    whose = (
        "the largest weight of any word of this caption"
        if scale == "caption"
        else f"the largest weight of “{state['words'][i]}”"
    )
    note = (
        f"Colour scale: 0 (photo shows through) to **{weight_label(vmax)}** (dark red) = "
        f"{whose}. Each word's weights sum to 1 over the {g}x{g} grid, so uniform "
        f"attention would be 1/{cells} = {weight_label(1 / cells)} on every cell; the "
        f"largest weight of “{state['words'][i]}” is {weight_label(top)}."
    )
    if is_flat(state["attention"][i]):
        note += (
            f" **Flat map:** that is under {FLAT_RATIO:g} times uniform, so the model "
            "looked almost everywhere for this word; the colours show small differences."
        )
    return note


def word_view(
    state: dict[str, Any] | None, index: int | None, scale: str = DEFAULT_SCALE
) -> tuple[Image.Image | None, str]:
    """The large overlay of one word with its labelled colour scale, and a line saying what the
    scale means (empty without a caption)."""
    if not state or index is None or not 0 <= int(index) < len(state["words"]):
        return None, ""
    i = int(index)
    att = state["attention"]
    vmax = scale_max(att, i, scale)
    cells = int(np.prod(att.shape[1:]))
    view = with_colour_bar(overlay(state, i, scale, "image"), vmax, cells)
    return view, scale_note(state, i, scale, vmax)
