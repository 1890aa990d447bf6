"""Decoding untrusted image files into upright RGB, and turning them into encoder input."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import platform
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from showattendtell.errors import UsageError, UserError
from showattendtell.images.budget import DECODE_BUDGET
from showattendtell.network.encoder import IMAGENET_MEAN, IMAGENET_STD

IMAGE_SUFFIXES = (
    ".jpg",
    ".jpeg",
    ".png",
    ".webp",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".heic",
    ".heif",
    ".avif",
)
HEIF_SUFFIXES = (".heic", ".heif")  # what phones write; decoded by pillow-heif's PIL opener


def _register_heif() -> bool:
    """Let PIL open HEIC/HEIF (pillow-heif, a dependency). Done when this module is imported,
    so in every process that decodes images (DataLoader workers, the web service). False where
    the wheel is missing: such photos then get a one-line error saying what to install."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


HEIF_SUPPORTED = _register_heif()
MAX_PIXELS = 64_000_000  # 8000x8000; larger files are refused before they are decoded
MIN_SIDE = 32  # smaller photos are captioned, with a warning: there is almost nothing to see
MAX_ASPECT = 8.0  # the square resize squashes wider (or taller) photos beyond recognition


class ImageError(UserError, ValueError):
    """The input is not an image we can decode; the message says why in one line."""


def open_image(
    source: str | Path | bytes | Image.Image,
    max_pixels: int = MAX_PIXELS,
    min_size: int | None = None,
) -> Image.Image:
    """Decode a file, bytes or PIL image to an upright 8-bit RGB image.

    Handles EXIF orientation, the first frame of animations, CMYK, 16-bit greyscale and
    transparency (composited on white). Anything else raises ImageError. ``min_size``: a JPEG
    may be decoded at 1/2, 1/4 or 1/8 of its size as long as both sides stay >= min_size
    (libjpeg's DCT scaling, PIL's ``draft``, as ``Image.thumbnail`` does), several times faster
    for a phone photo; photos under twice min_size on a side (COCO's, Flickr's) decode at full
    size.
    """
    if isinstance(source, Image.Image):
        img = source
        if not img.width or not img.height:
            raise ImageError(f"the image is empty ({img.width}x{img.height} pixels)")
    elif not isinstance(source, (str, Path, bytes)):
        raise ImageError(f"a path, bytes or a PIL image, not a {type(source).__name__}")
    else:
        name = "the image" if isinstance(source, bytes) else str(source)
        if isinstance(source, bytes):
            if not source:
                raise ImageError("the file is empty (0 bytes)")
            fp: io.BytesIO | str = io.BytesIO(source)
        else:
            p = Path(source)
            if not p.is_file():
                raise ImageError(f"{name}: {_missing(p)}")
            if p.stat().st_size == 0:
                raise ImageError(f"{name}: the file is empty (0 bytes)")
            fp = str(p)
        try:
            img = Image.open(fp)
        except UnidentifiedImageError:
            if not HEIF_SUPPORTED and str(source).lower().endswith(HEIF_SUFFIXES):
                raise ImageError(
                    f"{name}: HEIC/HEIF is not supported without pillow-heif "
                    "(pip install pillow-heif)"
                ) from None
            raise ImageError(f"{name}: not an image file (or a format we cannot read)") from None
        except Image.DecompressionBombError:
            raise ImageError(
                f"{name}: too large (over {max_pixels:,} pixels); resize it first"
            ) from None
        except OSError as e:
            if e.errno is not None:  # the file system's refusal (EACCES, EIO), not bad data
                raise ImageError(f"{name}: cannot read the file: {os_reason(e)}") from None
            raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
        if img.width * img.height > max_pixels:
            raise ImageError(
                f"{name}: {img.width}x{img.height} is too large (limit {max_pixels:,} pixels); "
                "resize it first"
            )
        stored_size = img.size
        try:
            img.seek(0)  # first frame of an animated GIF/WebP/TIFF
            if min_size:
                img.draft(None, (min_size, min_size))  # a no-op but for JPEG
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
        # the pixels decoded (after draft: a JPEG's reduced size), within the process's budget
        with DECODE_BUDGET.decoding(img.width * img.height):
            try:
                img.load()
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
            if img.size != stored_size:  # decoded reduced: keep the photo's own size, upright
                upright = stored_size
                with contextlib.suppress(Exception):
                    if img.getexif().get(0x0112) in (5, 6, 7, 8):  # turned a quarter
                        upright = stored_size[::-1]
                img.info["full_size"] = upright
            return _upright_rgb(img, own=True)
    with DECODE_BUDGET.decoding(img.width * img.height):
        return _upright_rgb(img, own=False)


def _upright_rgb(img: Image.Image, own: bool) -> Image.Image:
    """``img`` upright and RGB. ``own``: an image decoded here, turned in place and returned
    as it is when it is RGB already (each copy of an 8000x8000 photo is 256 MB); a caller's
    image is copied, never changed."""
    with contextlib.suppress(Exception):  # a broken EXIF block: keep the pixels as stored
        if own:
            ImageOps.exif_transpose(img, in_place=True)
        else:
            img = ImageOps.exif_transpose(img)
    # not one that still holds an open file (the other frames of a GIF or TIFF): copied
    if own and img.mode == "RGB" and isinstance(getattr(img, "fp", None), (type(None), io.BytesIO)):
        return img
    return _to_rgb(img)


def _missing(p: Path) -> str:
    """Why ``p``, not a file, cannot be read."""
    if not p.is_symlink():
        return "a folder, not a file" if p.is_dir() else "no such file"
    try:
        p.resolve(strict=True)
    except RuntimeError:  # Python < 3.13 raises this for a loop
        return "a loop of symbolic links"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a loop of symbolic links"
        return f"a broken symbolic link (to {os.readlink(p)}, which does not exist)"
    return "a symbolic link to something that is not a file"


def full_size(img: Image.Image) -> tuple[int, int]:
    """The photo's upright size in pixels, also when ``open_image`` decoded it reduced."""
    return tuple(img.info.get("full_size", img.size))


_ROWS_AT_ONCE = 1 << 20  # pixels converted at once from 16/32 bits (8 MB as float64)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = Image.fromarray(_to_8_bits(img), "L")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _to_8_bits(img: Image.Image) -> np.ndarray:
    """A 16-bit (or 32-bit integer, or float) greyscale image as 8 bits, rounded: value / 65535
    (or / 255 when it holds none over 255) x 255. Converted a block of rows at a time: the
    whole image as float64, as one expression, took eight bytes a pixel for each of its four
    steps (1.6 GB for an 8000x8000 PNG of 124 KB); here the pixels' own copy and the result."""
    a = np.asarray(img)
    hi = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
    out = np.empty(a.shape, dtype=np.uint8)
    step = max(1, _ROWS_AT_ONCE // max(1, a.shape[1]))
    for top in range(0, a.shape[0], step):
        block = a[top : top + step].astype(np.float64)
        block /= hi  # the operations of the whole-image expression, in its order
        block *= 255.0
        block += 0.5
        np.clip(block, 0, 255, out=block)
        out[top : top + step] = block  # truncates, as astype(np.uint8) did
    return out


def image_warning(img: Image.Image) -> str | None:
    """Why a caption of this photo deserves little trust (None: no reason to think so)."""
    return size_warning(*img.size)


def size_warning(w: int, h: int) -> str | None:
    """``image_warning`` for an upright photo of w x h pixels."""
    if min(w, h) < MIN_SIDE:
        return (
            f"the image is {w}x{h} pixels, a side under {MIN_SIDE}: the caption is "
            "little more than a guess"
        )
    if max(w, h) / min(w, h) > MAX_ASPECT:
        return (
            f"the image is {w}x{h} pixels, an aspect ratio beyond 1:{MAX_ASPECT:g}: it is "
            "squashed to a square for the model, so the caption may be wrong"
        )
    return None


def preprocess(img: Image.Image, input_size: int) -> torch.Tensor:
    """RGB image -> (3, S, S) float tensor, resized (aspect not kept) and ImageNet-normalised."""
    return normalise(resize(img, input_size))


def resize(img: Image.Image, input_size: int) -> torch.Tensor:
    """RGB image -> (3, S, S) uint8 tensor, resized with antialiasing (aspect not kept).

    torchvision's ``resize(pil_to_tensor(img), ..., antialias=True)`` written with torch alone,
    the same values (tests/cli/test_startup.py): importing torchvision takes a large part of
    `sat caption`'s start-up. Bilinear on uint8 runs natively where torch has a vectorised
    kernel (a channels-last view, as torchvision passes it), else in float32, rounded back.
    """
    pixels = torch.as_tensor(np.array(img, copy=True)).view(img.height, img.width, -1)
    return resize_pixels(pixels, input_size)


def resize_pixels(x: torch.Tensor, input_size: int) -> torch.Tensor:
    """``resize`` of pixels (H, W, C) uint8."""
    x = x.permute(2, 0, 1).unsqueeze(0)  # (1, C, H, W)
    if x.shape[-2:] == (input_size, input_size):
        return x[0]
    vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    native = vectorised or platform.machine() in ("aarch64", "arm64")
    y = torch.nn.functional.interpolate(
        x if native else x.float(),
        size=[input_size] * 2,
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )
    return (y if native else y.round_().to(torch.uint8))[0]


def normalise(x: torch.Tensor) -> torch.Tensor:
    """uint8 images (..., 3, S, S) -> float32, ImageNet-normalised. The image pipeline's workers
    send uint8 (a quarter of the bytes) and this runs on whole batches where they arrive, on the
    GPU when there is one: the same operations as ``preprocess``, the same values."""
    x = x.to(torch.float32).mul_(1.0 / 255)  # as torchvision's to_dtype(scale=True)
    mean = torch.as_tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    std = torch.as_tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return x.sub(mean).div_(std)  # as torchvision's normalize


class UnreadableFolder(UsageError):
    """A folder named on the command line that cannot be listed (permissions, a lost network
    mount): nothing in it can be captioned, so the run stops before it starts (exit 2)."""


def list_images(
    paths: list[str | Path],
    recursive: bool = False,
    skipped: Counter[str] | None = None,
    unreadable: list[tuple[Path, str]] | None = None,
) -> list[Path]:
    """Image files named directly, or found in folders (sorted), by suffix.

    ``recursive`` follows symbolic links to folders, each real folder once (a link back to a
    parent is not a loop). Written with os.walk because Path.rglob follows no folder links
    before Python 3.13. ``skipped``, when given, counts the files of the folders that are left
    out, by suffix ("" for none), so that a caller can say what a scan did not caption;
    hidden files (.DS_Store, ._photo.jpg) are left out without being counted.

    A folder of ``paths`` that cannot be listed raises UnreadableFolder. A sub-folder that
    cannot be listed (``recursive``) is appended to ``unreadable`` (with why) and left out,
    so that the caller can say so; without that list it raises UnreadableFolder too: no photo
    goes missing without a word.
    """
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            found.append(p)
            continue
        if not recursive:
            try:
                files = [f for f in p.iterdir() if _is_file_entry(f)]
            except OSError as e:
                raise UnreadableFolder(f"cannot read the folder {p}: {os_reason(e)}") from None
        else:
            files = _walk(p, unreadable)
        found += sorted(f for f in files if f.suffix.lower() in IMAGE_SUFFIXES)
        if skipped is not None:
            skipped.update(
                f.suffix.lower()
                for f in files
                if f.suffix.lower() not in IMAGE_SUFFIXES and not f.name.startswith(".")
            )
    return found


def _walk(top: Path, unreadable: list[tuple[Path, str]] | None) -> list[Path]:
    """The files under ``top`` (list_images with ``recursive``)."""

    def failed(e: OSError) -> None:
        where = Path(e.filename) if e.filename is not None else top
        if unreadable is None or where == top:
            raise UnreadableFolder(f"cannot read the folder {where}: {os_reason(e)}") from None
        unreadable.append((where, os_reason(e)))

    files: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for folder, dirs, names in os.walk(top, onerror=failed, followlinks=True):
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:  # reached again through a link
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()  # the first path to a folder reached twice names it, always the same
        files += [Path(folder, n) for n in names if _is_file_entry(Path(folder, n))]
    return files


def os_reason(e: OSError) -> str:
    """Why the file system said no, in the words a user expects ("permission denied")."""
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return (e.strerror or str(e)).lower()


def _is_file_entry(f: Path) -> bool:
    """A file of a folder scan: a file, or a link that leads to no folder. A broken link or a
    loop of links named like a photo is kept, so that its record says what is wrong with it
    instead of the photo vanishing from the run without a word."""
    return f.is_file() or (f.is_symlink() and not f.is_dir())


# -- one file as a decoding process reads it (batches.py) ----


@dataclass
class LoadedImage:
    """One input after the worker stage: a preprocessed tensor, or why there is none."""

    index: int
    path: str
    tensor: torch.Tensor | None = None
    error: str | None = None  # without the path, which is its own field
    warning: str | None = None  # see image_warning
    jpeg: torch.Tensor | None = None  # the file's bytes, to be decoded on the GPU (jpeg_device)
    orientation: int = 1  # the JPEG's EXIF orientation, applied once it is decoded


def load_image(path: str, input_size: int, index: int = 0, normalised: bool = True) -> LoadedImage:
    """Decode and preprocess one file (``normalised``: False keeps the resized uint8 image);
    never raises: a bad file gives a LoadedImage with an error (a decoder bug on one file must
    not stop a run over thousands)."""
    try:
        img = open_image(path, min_size=input_size)
        x = preprocess(img, input_size) if normalised else resize(img, input_size)
        return LoadedImage(index, path, tensor=x, warning=image_warning(img))
    except ImageError as e:
        return LoadedImage(index, path, error=_strip_path(str(e), path))
    except Exception as e:  # noqa: BLE001
        return LoadedImage(index, path, error=f"{type(e).__name__}: {e}".strip())


def _strip_path(message: str, path: str) -> str:
    """'photos/a.jpg: not an image file' -> 'not an image file' (the path is its own field)."""
    return message[len(path) + 2 :] if message.startswith(path + ": ") else message
