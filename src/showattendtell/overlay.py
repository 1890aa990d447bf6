"""Attention overlays: where the model looked for each word, drawn on the image.

Used by the web service (one panel per word) and by batch captioning (--overlays: one PNG per
image with every word's panel under the caption).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from showattendtell.inference import CaptionResult

CMAP = "jet"


def label_font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default(size)


def upsample_attention(grid: np.ndarray, width: int, height: int,
                       vmax: float | None = None) -> np.ndarray:
    """A (g, g) attention map -> a smooth (height, width) map in [0, 1] (bicubic): weight / vmax,
    clipped; vmax None stretches the map to its own maximum."""
    t = torch.as_tensor(np.asarray(grid), dtype=torch.float32)[None, None]
    up = F.interpolate(t, size=(height, width), mode="bicubic", align_corners=False)[0, 0]
    up = up.clamp_min(0)
    top = up.max().clamp_min(1e-12) if vmax is None else torch.tensor(max(vmax, 1e-12))
    return (up / top).clamp_max(1.0).numpy()


def colorize(heat: np.ndarray) -> np.ndarray:
    """[0, 1] map -> RGB uint8 with the colour scale of ``colour_bar``."""
    import matplotlib

    return (matplotlib.colormaps[CMAP](heat)[..., :3] * 255).astype(np.uint8)


def overlay_attention(
    image: Image.Image,
    grid: np.ndarray,
    location: tuple[int, int] | None = None,
    opacity: float = 0.55,
    vmax: float | None = None,
) -> Image.Image:
    """The image with one word's attention blended over it, colour 0..vmax (None: the map's
    own maximum); a hard-attention location is framed."""
    image = image.convert("RGB")
    w, h = image.size
    heat = upsample_attention(grid, w, h, vmax)
    rgb = np.asarray(image, dtype=np.float32)
    a = opacity * heat[..., None] ** 0.5  # stronger where attention is high
    out = Image.fromarray((rgb * (1 - a) + colorize(heat).astype(np.float32) * a).astype(np.uint8))
    if location is not None:
        g = grid.shape[0]
        r, c = location
        box = (c * w / g, r * h / g, (c + 1) * w / g - 1, (r + 1) * h / g - 1)
        ImageDraw.Draw(out).rectangle(box, outline=(255, 255, 255), width=max(2, w // 150))
    return out


def colour_bar(height: int, width: int = 14) -> Image.Image:
    """The colour scale (high attention at the top)."""
    ramp = np.linspace(1, 0, height)[:, None].repeat(width, 1)
    return Image.fromarray(colorize(ramp))


def word_panels(image: Image.Image, result: CaptionResult, size: int = 224,
                vmax: float | None = None) -> list[Image.Image]:
    """One overlay per word, resized so that the longer side is ``size`` (vmax: see
    overlay_attention)."""
    image = image.convert("RGB")
    scale = size / max(image.size)
    small = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                         Image.Resampling.BICUBIC)
    locs = result.locations or [None] * len(result.words)
    return [overlay_attention(small, grid, loc, vmax=vmax)
            for grid, loc in zip(result.attention, locs, strict=True)]


SHEET_SOURCE_SIZE = 5 * (200 + 8)  # the widest a caption sheet shows the photo (5 panels of
# 200 px and their gaps): `sat caption --overlays` decodes photos no smaller than this


def caption_sheet(image: Image.Image, result: CaptionResult, panel: int = 200,
                  columns: int = 5) -> Image.Image:
    """The image and its caption on top, then a grid of word panels labelled with each word."""
    image = image.convert("RGB")
    panels = word_panels(image, result, panel)
    pw = max([p.width for p in panels], default=panel)
    ph = max([p.height for p in panels], default=panel)
    label_h, pad = 26, 8
    cols = max(1, min(columns, len(panels)))
    rows = (len(panels) + cols - 1) // cols
    top_scale = min(1.0, (cols * (pw + pad)) / max(image.width, 1), 360 / max(image.height, 1))
    top = image.resize((max(1, round(image.width * top_scale)),
                        max(1, round(image.height * top_scale))))
    width = max(cols * (pw + pad) + pad + 30, top.width + 2 * pad)
    cap_h = 40
    height = pad + top.height + cap_h + rows * (ph + label_h + pad) + pad
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    sheet.paste(top, (pad, pad))
    draw.text((pad, pad + top.height + 8), result.caption or "(empty caption)", fill=(0, 0, 0),
              font=label_font(20))
    y0 = pad + top.height + cap_h
    for i, (p, word) in enumerate(zip(panels, result.words, strict=True)):
        r, c = divmod(i, cols)
        x, y = pad + c * (pw + pad), y0 + r * (ph + label_h + pad)
        draw.text((x, y), word, fill=(0, 0, 0), font=label_font(16))
        sheet.paste(p, (x, y + label_h))
    if panels:
        bar = colour_bar(rows * (ph + label_h + pad) - pad)
        sheet.paste(bar, (width - 22, y0))
    return sheet
