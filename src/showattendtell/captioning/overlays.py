"""Attention overlays: where the model looked for each word, drawn on the image.

Used by the web service (one panel per word) and by batch captioning (--overlays: one PNG per
image with every word's panel under the caption).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from showattendtell.captioning.captioner import CaptionResult
from showattendtell.captioning.pipeline import Record
from showattendtell.images.files import open_image

CMAP = "jet"


def label_font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default(size)


def upsample_attention(
    grid: np.ndarray, width: int, height: int, vmax: float | None = None
) -> np.ndarray:
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


def weight_label(x: float) -> str:
    """An attention weight as the colour bars label it (the web UI's form)."""
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


LABELLED_BAR_WIDTH = 14 + 6 + 92  # the bar, a gap, its labels


def labelled_bar_width(text: float = 1.0) -> int:
    """The width of ``labelled_colour_bar`` with its labels ``text`` times the usual size."""
    return 14 + 6 + round(92 * text)


def labelled_colour_bar(height: int, vmax: float, cells: int, text: float = 1.0) -> Image.Image:
    """The colour scale with its numbers, as the web UI labels it: ``vmax`` at the top, 0 at
    the bottom, and a tick at the uniform weight 1/cells (attention spread evenly over the
    grid) when it lies within the scale: colour near that tick means no focus at all.
    ``text``: the labels' size, times the usual 12 px."""
    bar_w, gap = 14, 6
    size = round(12 * text)
    out = Image.new("RGB", (labelled_bar_width(text), height), "white")
    out.paste(colour_bar(height, bar_w), (0, 0))
    draw = ImageDraw.Draw(out)
    font, black, x = label_font(size), (0, 0, 0), bar_w + gap
    draw.text((x, 0), weight_label(vmax), fill=black, font=font)
    draw.text((x, height - size - 2), "0", fill=black, font=font)
    uniform = 1.0 / max(cells, 1)
    if uniform <= vmax and height >= 5 * size:
        y = round((1 - uniform / vmax) * (height - 1))
        draw.line([(0, y), (bar_w + 2, y)], fill=black, width=2)
        ty = min(max(y - size // 2 - 1, size + 4), height - 2 * size - 6)  # clear of the others
        draw.text((x, ty), f"uniform 1/{cells}", fill=black, font=font)
    return out


def panel_size(width: int, height: int, size: int) -> tuple[int, int]:
    """A word panel's size: the photo with its longer side ``size``, but the shorter side never
    under a third of it. A 20000x500 panorama gives 200x66 panels (squashed, as the model sees
    every photo squashed to a square), not 200x5 strips in which nothing can be seen."""
    scale = size / max(width, height, 1)
    w, h = max(1, round(width * scale)), max(1, round(height * scale))
    least = max(1, size // 3)
    return max(w, least), max(h, least)


def word_panels(
    image: Image.Image, result: CaptionResult, size: int = 224, vmax: float | None = None
) -> list[Image.Image]:
    """One overlay per word, resized so that the longer side is ``size`` (``panel_size``;
    vmax: see overlay_attention)."""
    image = image.convert("RGB")
    small = image.resize(panel_size(image.width, image.height, size), Image.Resampling.BICUBIC)
    locs = result.locations or [None] * len(result.words)
    return [
        overlay_attention(small, grid, loc, vmax=vmax)
        for grid, loc in zip(result.attention, locs, strict=True)
    ]


SHEET_PHOTO_HEIGHT = 360  # the height of the photo at the top of a caption sheet, at most
SHEET_SOURCE_SIZE = 5 * (200 + 8)  # the widest a caption sheet shows the photo (5 panels of
# 200 px and their gaps): `sat caption --overlays` decodes photos no smaller than this


def caption_sheet(
    image: Image.Image,
    result: CaptionResult,
    panel: int = 200,
    columns: int = 5,
    text: float = 1.0,
) -> Image.Image:
    """The image and its caption on top, then a grid of word panels labelled with each word and
    its largest weight. One colour scale for the whole caption (0 to the largest weight of any
    word), labelled on the bar with that weight and the uniform level: a word whose attention
    is spread evenly stays pale instead of being stretched to look as focused as any other.
    ``text``: the lettering's size, times the usual (16 px labels, a 20 px caption): the web
    page's sheet for a phone screen is narrow with large lettering, to be read at 400 px. A
    label wider than its panel puts the weight on a second line."""
    image = image.convert("RGB")
    maxima = [float(np.max(a)) for a in result.attention]
    vmax = max(maxima, default=1.0)
    panels = word_panels(image, result, panel, vmax=vmax)
    pw = max([p.width for p in panels], default=panel)
    ph = max([p.height for p in panels], default=panel)
    pad = 8
    font, line = label_font(round(16 * text)), round(20 * text)
    labels = [(word, weight_label(m)) for word, m in zip(result.words, maxima, strict=True)]
    fits = all(font.getlength(f"{w}  {x}") <= pw for w, x in labels)
    label_h = round(26 * text) if fits else line + round(26 * text)
    cols = max(1, min(columns, len(panels)))
    rows = (len(panels) + cols - 1) // cols
    # the photo as large as the band of panels and SHEET_PHOTO_HEIGHT allow: a small photo (a
    # 224 px thumbnail) is scaled up, not left at its own size in a corner of the band
    band = cols * (pw + pad) - pad
    top_scale = min(band / max(image.width, 1), SHEET_PHOTO_HEIGHT / max(image.height, 1))
    top = image.resize(
        (max(1, round(image.width * top_scale)), max(1, round(image.height * top_scale))),
        Image.Resampling.BICUBIC,
    )
    bar_w = labelled_bar_width(text)
    width = max(cols * (pw + pad) + pad + bar_w + pad, top.width + 2 * pad)
    cap_font, cap_line = label_font(round(20 * text)), round(26 * text)
    caption = wrapped(result.caption or "(empty caption)", cap_font, width - 2 * pad)
    cap_h = round(14 * text) + len(caption) * cap_line
    height = pad + top.height + cap_h + rows * (ph + label_h + pad) + pad
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    sheet.paste(top, (pad + (band - top.width) // 2, pad))  # centred over the panels
    for k, words in enumerate(caption):
        y = pad + top.height + round(8 * text) + k * cap_line
        draw.text((pad, y), words, fill=(0, 0, 0), font=cap_font)
    y0 = pad + top.height + cap_h
    for i, (p, (word, weight)) in enumerate(zip(panels, labels, strict=True)):
        r, c = divmod(i, cols)
        x, y = pad + c * (pw + pad), y0 + r * (ph + label_h + pad)
        if fits:
            draw.text((x, y), f"{word}  {weight}", fill=(0, 0, 0), font=font)
        else:  # a word still wider than its panel in smaller letters, not cut by the next
            wide = font.getlength(word) > pw
            size = max(8, int(round(16 * text) * pw / font.getlength(word))) if wide else 0
            draw.text((x, y), word, fill=(0, 0, 0), font=label_font(size) if wide else font)
            draw.text((x, y + line), weight, fill=(0, 0, 0), font=font)
        sheet.paste(p, (x, y + label_h))
    if panels:
        cells = int(np.asarray(result.attention[0]).size)
        bar = labelled_colour_bar(rows * (ph + label_h + pad) - pad, vmax, cells, text)
        sheet.paste(bar, (width - bar_w - pad, y0))
    return sheet


def wrapped(text: str, font: ImageFont.ImageFont, width: float) -> list[str]:
    """``text`` in lines no wider than ``width`` (broken between words; a longer word alone)."""
    lines: list[str] = []
    for word in text.split() or [text]:
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def overlay_names(paths: list[str]) -> dict[str, str]:
    """A flat PNG name for each input path, after the file: 'photos/a.jpg' -> 'a.jpg.png'.
    Where two inputs share a file name, their folders are added until the names differ
    ('2023/a.jpg' -> '2023__a.jpg.png', '2024/a.jpg' -> '2024__a.jpg.png'); compared without
    case, for file systems that ignore it; names still alike get -2, -3. The same inputs give
    the same names, so a resumed run writes the sheets the first one would have."""
    parts = {}
    for path in paths:
        kept = [p for p in Path(path).parts if p not in ("/", ".", "..") and not p.endswith(":\\")]
        parts[path] = kept or ["image"]
    depth = dict.fromkeys(paths, 1)
    while True:
        names = {p: "__".join(parts[p][-depth[p] :]) for p in paths}
        groups: dict[str, list[str]] = {}
        for p, name in names.items():
            groups.setdefault(name.lower(), []).append(p)
        grew = False
        for group in groups.values():
            for p in group if len(group) > 1 else ():
                if depth[p] < len(parts[p]):
                    depth[p] += 1
                    grew = True
        if not grew:
            break
    out: dict[str, str] = {}
    used: set[str] = set()
    for p in dict.fromkeys(paths):  # a path given twice has one sheet
        name, k = names[p], 2
        while name.lower() in used:
            name, k = f"{names[p]}-{k}", k + 1
        used.add(name.lower())
        out[p] = name + ".png"
    return out


def write_overlay(path: Path, rec: Record) -> None:
    assert rec.result is not None  # a 12-megapixel JPEG decodes at half size: 4x fewer pixels
    photo = open_image(rec.path, min_size=SHEET_SOURCE_SIZE)
    caption_sheet(photo, rec.result).save(path)
