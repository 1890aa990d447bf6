"""A synthetic captioning task with known object positions, generated in code.

Each 64x64 image holds two coloured shapes (circle or square) in two cells of a 4x4 grid; its
caption names them in reading order, e.g. "red circle blue square". A word that names an object
is only predictable from that object's cell, so a model whose attention works looks there.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 30),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 20),
}
SHAPES = ("circle", "square")
GRID, CELL = 4, 16


def make_example(rng: np.random.Generator):
    """An image, its caption and the grid cell (row-major index) of each named object."""
    cells = sorted(rng.choice(GRID * GRID, size=2, replace=False).tolist())
    colours = rng.choice(list(COLOURS), size=2, replace=False).tolist()
    img = Image.new("RGB", (GRID * CELL, GRID * CELL), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    words, word_cells = [], []
    for cell, colour in zip(cells, colours, strict=True):
        shape = SHAPES[int(rng.integers(2))]
        r, c = divmod(cell, GRID)
        box = (c * CELL + 2, r * CELL + 2, c * CELL + CELL - 3, r * CELL + CELL - 3)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
        words += [colour, shape]
        word_cells += [cell, cell]
    return img, " ".join(words), word_cells


def cell_features(img: Image.Image) -> torch.Tensor:
    """A fixed 'encoder' for the synthetic images: per cell, mean colour, fill and position."""
    a = np.asarray(img, dtype=np.float32) / 255.0
    feats = []
    for r in range(GRID):
        for c in range(GRID):
            patch = a[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL]
            filled = (patch.sum(2) > 0.1).mean()
            corner = float(patch[2, 2].sum() > 0.1)  # squares fill their corners, circles don't
            feats.append([*patch.mean((0, 1)) * 4, filled * 2, corner * 2, r / 3, c / 3])
    return torch.tensor(feats, dtype=torch.float32)


def make_dataset(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    examples = [make_example(rng) for _ in range(n)]
    feats = torch.stack([cell_features(img) for img, _, _ in examples])
    return feats, [cap for _, cap, _ in examples], [cells for _, _, cells in examples], examples
