"""The photos the tests make, made in one place: synthetic shape photos written to a folder, noise
pictures, encoded bytes, real photos (the service's shipped examples and variants of them) and
folders of links to real photos.

A test says which photos it needs (``write_photos(tmp_path, 3)``, ``encode(noise((800, 800)))``)
instead of repeating how they are drawn, saved or linked. A one-colour picture is PIL's own
``Image.new("RGB", size, colour)``.
"""

from __future__ import annotations

import atexit
import functools
import io
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image
from synthetic import make_example


def write_photos(folder: Path, n: int, seed: int = 1, name: str = "{i}.png") -> list[str]:
    """``n`` synthetic shape photos (tests/synthetic.py, drawn in turn from one generator seeded
    with ``seed``) saved as ``folder/name`` with ``{i}`` the photo's index; their paths, as
    strings, in order. The suffix of ``name`` picks the format."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        path = folder / name.format(i=i)
        make_example(rng)[0].save(path)
        paths.append(str(path))
    return paths


def noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """An RGB picture of uniform random pixels, ``size`` = (width, height): it does not compress,
    so its file is about 3 bytes a pixel (an upload over a size limit)."""
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encode(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    """The file ``image`` would be as ``fmt``, in memory (``options`` go to ``Image.save``)."""
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def _examples() -> list[Path]:
    """The service's example photos. Imported here, not at the top: the service package loads the
    captioner, which tests of other parts need not pay for."""
    from showattendtell.service.uploads import EXAMPLES_DIR

    return sorted(EXAMPLES_DIR.glob("*.jpg"))


def photo(i: int = 0) -> Path:
    """A real photo: one of the example photos that ship with the service (in the repository).
    There are only a few: ``photos(n)`` makes as many distinct ones as a test needs."""
    examples = _examples()
    if not 0 <= i < len(examples):
        raise IndexError(
            f"photo({i}): the service ships {len(examples)} example photos; use photos(n) for more"
        )
    return examples[i]


@functools.cache
def _made() -> Path:
    """The folder that ``photos`` keeps its photos in until the tests end."""
    folder = Path(tempfile.mkdtemp(prefix="sat-test-photos-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def photos(n: int) -> list[Path]:
    """``n`` distinct real photos, made from the service's example photos (crops at other offsets,
    some mirrored) and kept for the session, so tests need no data outside the repository."""
    sources = _examples()
    made = []
    for i in range(n):
        path = _made() / f"photo_{i:02d}.jpg"
        if not path.is_file():
            im = Image.open(sources[i % len(sources)]).convert("RGB")
            shift = 0.04 * (i // len(sources))
            w, h = im.size
            im = im.crop((int(w * shift), int(h * shift / 2), w - int(w * shift / 2), h))
            if (i // len(sources)) % 2:
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            im.save(path, quality=90)
        made.append(path)
    return made


def link_photos(folder: Path, sources: Iterable[Path]) -> Path:
    """``folder`` (made here) holding a link to each of ``sources`` under its own name: real
    photos read in place, never copied."""
    folder.mkdir(parents=True)
    for source in sources:
        (folder / source.name).symlink_to(source)
    return folder
