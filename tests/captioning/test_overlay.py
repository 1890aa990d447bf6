"""Attention overlays: the heatmap follows the grid, a frame marks a chosen cell only."""

from __future__ import annotations

import numpy as np
from PIL import Image

from showattendtell.captioning.captioner import CaptionResult
from showattendtell.captioning.overlays import (
    caption_sheet,
    colour_bar,
    labelled_colour_bar,
    overlay_attention,
    upsample_attention,
    word_panels,
)


def result(words=("a", "red", "circle"), g=3, locations=None) -> CaptionResult:
    att = np.full((len(words), g, g), 0.01, np.float32)
    for i in range(len(words)):
        att[i, i % g, i % g] = 1.0 - 0.01 * (g * g - 1)
    return CaptionResult(" ".join(words), list(words), -1.0, -1.0, att, locations, [])


def test_upsampled_attention_peaks_where_the_grid_does():
    grid = np.zeros((3, 3), np.float32)
    grid[0, 2] = 1.0  # top right
    heat = upsample_attention(grid, 90, 60)
    assert heat.shape == (60, 90) and heat.max() == 1.0 and heat.min() >= 0.0
    assert heat[10, 80] > 0.8 and heat[50, 10] < 0.1  # cell (0, 2) covers x 60-90, y 0-20


def test_a_frame_marks_the_chosen_cell_and_nothing_else():
    image = Image.new("RGB", (90, 90), (0, 0, 0))
    grid = np.full((3, 3), 1 / 9, np.float32)
    framed = np.asarray(overlay_attention(image, grid, location=(1, 2)))
    plain = np.asarray(overlay_attention(image, grid))
    assert (framed[30:60, 60] == 255).all()  # the left edge of cell (row 1, col 2)
    assert not (plain == 255).all(axis=2).any()  # no white pixel without a location


def test_panels_and_sheet_have_one_panel_per_word():
    image = Image.new("RGB", (320, 240), (20, 120, 200))
    r = result()
    panels = word_panels(image, r, size=100)
    assert len(panels) == 3 and all(max(p.size) == 100 for p in panels)
    sheet = caption_sheet(image, r, panel=80, columns=2)
    assert sheet.width >= 2 * 80 and sheet.height > 2 * 80
    empty = CaptionResult("", [], -1.0, -1.0, np.zeros((0, 3, 3)), None, [])
    assert caption_sheet(image, empty).size[0] > 0  # an empty caption still gives a sheet


def test_colour_bar_runs_from_high_at_the_top_to_low():
    bar = np.asarray(colour_bar(50, 10)).astype(int)
    assert bar.shape == (50, 10, 3)
    assert bar[0, 0, 0] > bar[0, 0, 2] and bar[-1, 0, 2] > bar[-1, 0, 0]  # red top, blue bottom


def test_a_panorama_gets_panels_one_can_see():
    """20000x500: panels keep a readable height (a third of their width at least), not 5 px."""
    image = Image.new("RGB", (20000, 500), (20, 120, 200))
    panels = word_panels(image, result(), size=200)
    assert all(p.size == (200, 66) for p in panels)
    tall = word_panels(Image.new("RGB", (300, 12000)), result(), size=200)
    assert all(p.size == (66, 200) for p in tall)
    sheet = caption_sheet(image, result())
    assert sheet.height >= 66 + 26 + 40  # a row of panels under the photo and caption


def test_the_colour_bar_is_labelled_with_weights():
    """As in the web UI: the largest weight at the top, 0 at the bottom, and a tick at the
    uniform weight 1/L."""
    bar = np.asarray(labelled_colour_bar(300, vmax=0.5, cells=9).convert("L")).astype(int)
    labels = bar[:, 20:]
    assert (labels[:14] < 100).any() and (labels[-14:] < 100).any()  # "0.500" and "0"
    y = round((1 - (1 / 9) / 0.5) * 299)
    assert (bar[y - 1 : y + 2, :14] < 30).any(axis=0).all()  # the tick across the bar
    assert (labels[y - 10 : y + 10] < 100).any()  # "uniform 1/9" beside it
    plain = np.asarray(labelled_colour_bar(300, vmax=0.05, cells=9).convert("L")).astype(int)
    assert not (plain[100:250, 20:] < 100).any()  # 1/9 is above this scale: no tick, no label


def test_a_sheet_draws_every_word_on_one_scale():
    """A near-uniform word next to a focused one stays pale on the caption's scale."""
    image = Image.new("RGB", (200, 200), (128, 128, 128))
    r = result(("a", "dog"), g=3)
    r.attention[0] = np.full((3, 3), 1 / 9, np.float32)  # "a": no focus
    panels = word_panels(image, r, size=90, vmax=float(np.max(r.attention)))
    flat, focused = (np.asarray(p).astype(int) for p in panels)
    assert np.abs(flat - 128).max() < np.abs(focused - 128).max() / 2


def test_a_small_photo_fills_the_top_of_its_sheet():
    """A 224 px photo is scaled up to the height a large photo gets (not left at its own size
    in the top-left corner of a band five panels wide), and centred over the panels."""
    small = Image.new("RGB", (224, 224), (200, 30, 30))
    large = Image.new("RGB", (2240, 2240), (200, 30, 30))
    sheet = caption_sheet(small, result())
    assert sheet.size == caption_sheet(large, result()).size
    pixels = np.asarray(sheet)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 80) & (pixels[..., 2] < 80)
    rows, cols = np.nonzero(red[:400])
    assert rows.max() - rows.min() + 1 >= 350  # 360 px tall, not 224
    left, right = cols.min(), sheet.width - 1 - cols.max()
    assert left > 100 and right > 100  # centred, not in the corner
