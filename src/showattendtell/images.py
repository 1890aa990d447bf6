"""Decoding untrusted image files into upright RGB, and turning them into encoder input."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

from showattendtell.encoder import IMAGENET_MEAN, IMAGENET_STD
from showattendtell.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MAX_PIXELS = 64_000_000  # 8000x8000; larger files are refused before they are decoded


class ImageError(UserError, ValueError):
    """The input is not an image we can decode; the message says why in one line."""


def open_image(
    source: str | Path | bytes | Image.Image, max_pixels: int = MAX_PIXELS
) -> Image.Image:
    """Decode a file, bytes or PIL image to an upright 8-bit RGB image.

    Handles EXIF orientation, the first frame of animations, CMYK, 16-bit greyscale and
    transparency (composited on white). Anything else raises ImageError.
    """
    if isinstance(source, Image.Image):
        img = source
    else:
        name = "the image" if isinstance(source, bytes) else str(source)
        if isinstance(source, bytes):
            if not source:
                raise ImageError("the file is empty (0 bytes)")
            fp: io.BytesIO | str = io.BytesIO(source)
        else:
            p = Path(source)
            if not p.is_file():
                raise ImageError(f"{name}: no such file")
            if p.stat().st_size == 0:
                raise ImageError(f"{name}: the file is empty (0 bytes)")
            fp = str(p)
        try:
            img = Image.open(fp)
        except UnidentifiedImageError:
            raise ImageError(f"{name}: not an image file (or a format we cannot read)") from None
        except Image.DecompressionBombError:
            raise ImageError(f"{name}: the image is too large (over {max_pixels:,} pixels); "
                             "resize it first") from None
        except OSError as e:
            raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
        if img.width * img.height > max_pixels:
            raise ImageError(
                f"{name}: {img.width}x{img.height} is too large (limit {max_pixels:,} pixels); "
                "resize it first"
            )
        try:
            img.seek(0)  # first frame of an animated GIF/WebP/TIFF
            img.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
    with contextlib.suppress(Exception):  # a broken EXIF block: keep the pixels as stored
        img = ImageOps.exif_transpose(img)
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        img = Image.fromarray(np.clip(a / hi * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess(img: Image.Image, input_size: int) -> torch.Tensor:
    """RGB image -> (3, S, S) float tensor, resized (aspect not kept) and ImageNet-normalised."""
    x = TF.pil_to_tensor(img)
    x = TF.resize(x, [input_size, input_size], antialias=True)
    x = TF.to_dtype(x, torch.float32, scale=True)
    return TF.normalize(x, list(IMAGENET_MEAN), list(IMAGENET_STD))


def list_images(paths: list[str | Path], recursive: bool = False) -> list[Path]:
    """Image files named directly, or found in folders (sorted), by suffix."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            it = p.rglob("*") if recursive else p.iterdir()
            found += sorted(f for f in it if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            found.append(p)
    return found
