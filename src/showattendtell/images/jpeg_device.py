"""JPEG photos decoded by torchvision for bulk captioning: in batches on the GPU (nvJPEG), or
one at a time by a decoding process on the CPU (``load_jpeg``, PIL's pixels in less time).

On a GPU machine the CPU's decoding sets `sat caption`'s rate: batched nvJPEG decoding and
resizing on the GPU is many times one core's rate (benchmarks/README.md). With ``--decode-on
gpu`` the decoding processes only read a JPEG's bytes and header (size, EXIF orientation), and
the main process decodes the batch on the GPU.

Everything else is decoded on the CPU as before (``images.load_image``): PNG, WebP, HEIC..., and
the JPEGs nvJPEG would decode differently or not at all: progressive, CMYK/YCCK, 12-bit. A JPEG
that fails on the GPU is decoded on the CPU as any other file, so one bad file changes nothing
for the others. The photo comes out as ``open_image`` makes it: upright (EXIF orientation),
RGB, then resized as ``images.resize`` does (bilinear, antialiased, rounded to uint8); the GPU
decodes the full image where the CPU path may use libjpeg's reduced-size decoding, so pixels can
differ by a few levels (the captions almost never: tests/images/test_jpeg_device.py).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from PIL import Image

from showattendtell.images.files import (
    MAX_PIXELS,
    LoadedImage,
    load_image,
    resize_pixels,
    size_warning,
)

DECODE_CHUNK = 32  # photos decoded at once: a 12-megapixel photo is 36 MB decoded
QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def _header(path: str) -> tuple[tuple[int, int], int] | None:
    """A plain JPEG's stored size and EXIF orientation, from its header alone; None for any
    other file (PNG, progressive, CMYK/YCCK, 12-bit, too large, unreadable)."""
    try:
        with Image.open(path) as img:  # reads the header, not the pixels
            fits = (
                img.format == "JPEG"
                and img.mode in ("RGB", "L")
                and not img.info.get("progressive")
                and not img.info.get("progression")
                and img.width * img.height <= MAX_PIXELS
            )
            if not fits:
                return None
            orientation = 1
            with contextlib.suppress(Exception):  # a broken EXIF block: pixels as stored
                orientation = int(img.getexif().get(0x0112, 1))
            return img.size, orientation if orientation in range(1, 9) else 1
    except Exception:  # noqa: BLE001 - load_image gives the file's error record
        return None


def _file_bytes(path: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


def _warning(size: tuple[int, int], orientation: int) -> str | None:
    w, h = size[::-1] if orientation in QUARTER_TURNS else size
    return size_warning(w, h)


def read_jpeg(path: str, input_size: int, index: int = 0) -> LoadedImage:
    """A worker's share for a JPEG nvJPEG decodes: its bytes and EXIF orientation, checked by
    its header alone. Any other file is decoded here (``load_image``)."""
    header = _header(path)
    if header is None:
        return load_image(path, input_size, index, normalised=False)
    size, orientation = header
    try:
        data = _file_bytes(path)
    except OSError:  # gone or unreadable since its header was read: load_image's record
        return load_image(path, input_size, index, normalised=False)
    return LoadedImage(
        index, path, warning=_warning(size, orientation), jpeg=data, orientation=orientation
    )


def load_jpeg(path: str, input_size: int, index: int = 0) -> LoadedImage:
    """What a decoding process makes of a file: ``load_image``'s tensor, with a plain JPEG that
    PIL would decode at full size decoded by torchvision instead.

    Why: decoding sets `sat caption`'s rate on a GPU machine, and torchvision's decoder
    (libjpeg-turbo, as PIL's) gives the same pixels in less time: decoded and resized, a 640x426
    COCO photo takes 2.6 ms against 3.2 ms on one core here (tests/images/test_jpeg_device.py checks
    the pixels). Larger JPEGs stay with PIL, which decodes them at a reduced size
    (``open_image``'s ``draft``). The main process never comes here: importing torchvision
    would lengthen the start-up.
    """
    header = _header(path)
    if header is None or min(s // input_size for s in header[0]) >= 2:  # PIL would reduce it
        return load_image(path, input_size, index, normalised=False)
    from torchvision.io import ImageReadMode, decode_jpeg

    size, orientation = header
    try:
        data = _file_bytes(path)
        with warnings.catch_warnings():  # torchvision 0.29 announces a move to TorchCodec
            warnings.simplefilter("ignore")
            x = decode_jpeg(data, mode=ImageReadMode.RGB)  # (3, H, W) as stored
    except (RuntimeError, OSError):  # PIL's error record, or PIL's pixels where it reads it
        return load_image(path, input_size, index, normalised=False)
    tensor = resize_pixels(upright(x, orientation).permute(1, 2, 0), input_size)  # (H, W, 3)
    return LoadedImage(index, path, tensor=tensor, warning=_warning(size, orientation))


def upright(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """(C, H, W) as stored -> as seen: PIL's ``ImageOps.exif_transpose`` for EXIF
    orientations 1-8 (mirrored, turned a half, or a quarter either way)."""
    if orientation in (5, 6, 7, 8):
        x = x.transpose(1, 2)  # 5: transposed
        if orientation == 6:  # turned a quarter clockwise
            x = x.flip(2)
        elif orientation == 7:  # transverse
            x = x.flip(1, 2)
        elif orientation == 8:  # turned a quarter anticlockwise
            x = x.flip(1)
        return x
    if orientation == 2:
        return x.flip(2)
    if orientation == 3:
        return x.flip(1, 2)
    if orientation == 4:
        return x.flip(1)
    return x


def resize_on_device(x: torch.Tensor, input_size: int) -> torch.Tensor:
    """(3, H, W) uint8 -> (3, S, S) uint8: ``images.resize``'s arithmetic (bilinear,
    antialiased, on float32, rounded), wherever ``x`` is."""
    if x.shape[-2:] == (input_size, input_size):
        return x
    y = torch.nn.functional.interpolate(
        x[None].float(), size=[input_size] * 2, mode="bilinear", align_corners=False,
        antialias=True,
    )  # fmt: skip
    return y.round_().clamp_(0, 255).to(torch.uint8)[0]


def decode_jpegs(
    items: list[LoadedImage], input_size: int, device: torch.device
) -> list[torch.Tensor | None]:
    """The (3, S, S) uint8 images of ``items`` (each holding a JPEG's bytes) on ``device``,
    decoded in batches there; a photo that fails is decoded on the CPU (``load_image``), and one
    that fails there too gets its ``error`` set and None."""
    from torchvision.io import ImageReadMode, decode_jpeg

    out: list[torch.Tensor | None] = []
    for start in range(0, len(items), DECODE_CHUNK):
        chunk = items[start : start + DECODE_CHUNK]
        with warnings.catch_warnings():  # torchvision 0.29 announces a move to TorchCodec
            warnings.simplefilter("ignore")
            try:
                decoded = decode_jpeg(
                    [x.jpeg for x in chunk], mode=ImageReadMode.RGB, device=device
                )
            except RuntimeError:  # one bad file fails the whole call: each alone
                decoded = [_one(x, device, decode_jpeg, ImageReadMode.RGB) for x in chunk]
        for item, img in zip(chunk, decoded, strict=True):
            out.append(_finish(item, img, input_size, device))
    return out


def _one(item: LoadedImage, device: torch.device, decode_jpeg, mode) -> torch.Tensor | None:
    try:
        return decode_jpeg(item.jpeg, mode=mode, device=device)
    except RuntimeError:
        return None


def _finish(
    item: LoadedImage, img: torch.Tensor | None, input_size: int, device: torch.device
) -> torch.Tensor | None:
    """Upright and resized, or where the GPU failed, what the CPU path makes of the file
    (``load_image``: its tensor, or its error record)."""
    if img is not None:
        return resize_on_device(upright(img, item.orientation), input_size)
    fallback = load_image(item.path, input_size, item.index, normalised=False)
    item.error = fallback.error
    return None if fallback.tensor is None else fallback.tensor.to(device)
