"""What the web service's tests share (tests/service/test_service_*.py): odd and bad files, tiny
models served in-process and on a live port, a model with a consensus index. Their photos come
from helpers.photos.

tests/service/conftest.py registers the fixtures. The model files are made once a session; each
module loads its own services and page: a page built on a service makes it read only what was
uploaded to a page (a file path given in-process is then refused), so a module that captions
in-process must not see another module's pages.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from showattendtell.service.http_api import ApiSettings
from showattendtell.service.server import Background, PageSettings, build
from showattendtell.service.uploads import find_examples
from showattendtell.service.worker import CaptionService, load_service

from helpers.photos import encode
from helpers.processes import free_port  # noqa: F401 (the service tests import it from here)

ROOT = Path(__file__).resolve().parents[2]


def white_pixels(image: Image.Image) -> int:
    return int(np.all(np.asarray(image.convert("RGB")) == 255, axis=-1).sum())


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny PNG that claims 20000x20000 pixels (a decompression bomb): header + a zlib stream."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    idat = zlib.compress(b"\0" * (width + 1) * 64, 9)  # only the first rows: never decoded
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def bad_inputs(tmp: Path) -> dict[str, Path]:
    """Files that are not photos, or broken ones, named as a user would have them."""
    files = {"text": b"this is not an image\n", "empty": b"", "bomb": png_bomb()}
    jpeg = encode(Image.new("RGB", (400, 300), "red"))
    files["truncated"] = jpeg[: len(jpeg) // 3]
    names = {"text": "notes.txt", "empty": "empty.jpg", "bomb": "bomb.png", "truncated": "cut.jpg"}
    for k, data in files.items():
        (tmp / names[k]).write_bytes(data)
    return {k: tmp / names[k] for k in files}


EXPECTED = {
    "text": "not an image",
    "empty": "empty",
    "bomb": "too large",
    "truncated": "corrupt or truncated",
}


def indexed_model(tiny_model_file: Path, folder: Path, photos: int = 24) -> Path:
    """The tiny model with a consensus index of ``photos`` synthetic photos (their real pooled
    grids and captions), storing consensus reranking as its default: beams are reranked and
    results carry a familiarity."""
    from synthetic import make_example

    from showattendtell.images.files import preprocess
    from showattendtell.model_file import read_model, save_model
    from showattendtell.search.consensus import ConsensusIndex
    from showattendtell.search.decoding import DecodingConfig

    model, _, _ = read_model(tiny_model_file)
    rng = np.random.default_rng(1)
    examples = [make_example(rng) for _ in range(photos)]
    size = model.encoder.config.input_size
    with torch.no_grad():
        grids = model.encoder(torch.stack([preprocess(img, size) for img, _, _ in examples]))
    refs = [[caption, f"a {caption}"] for _, caption, _ in examples]
    model.consensus = ConsensusIndex(ConsensusIndex.pool(grids), refs, 4)
    return save_model(
        model, folder / "indexed.safetensors", DecodingConfig(beam_size=3, rerank="consensus")
    )


@pytest.fixture(scope="session")
def tiny_expected_file(tiny_hard_model_file: Path, tmp_path_factory) -> Path:
    """The tiny hard-attention model storing hard_mode 'expectation' (the bundled one stores
    'argmax'): the controls must start at a model's stored mode, whichever it is."""
    from showattendtell.model_file import read_model, save_model

    model, decoding, info = read_model(tiny_hard_model_file)
    return save_model(
        model,
        tmp_path_factory.mktemp("models") / "tiny_hard_expected.safetensors",
        decoding.with_overrides(hard_mode="expectation"),
        info=info,
    )


@pytest.fixture(scope="module")
def service(tiny_model_file: Path, tiny_expected_file: Path):
    """A soft model (the default) and a hard one whose stored hard mode is 'expectation'."""
    svc = load_service([tiny_model_file, tiny_expected_file], device="cpu")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def indexed_service(tiny_model_file: Path, tmp_path_factory):
    """A model with a consensus index (the default) and the plain soft model."""
    path = indexed_model(tiny_model_file, tmp_path_factory.mktemp("indexed"))
    svc = load_service([path, tiny_model_file], device="cpu")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def server(service: CaptionService):
    """The page served on 127.0.0.1 (a free port) exactly as `sat serve` does: mounted beside
    the HTTP API in one server, behind the guard, 1 MB upload limit, the shipped example
    photos."""
    settings = ApiSettings(max_upload_bytes=2**20)
    running = Background(build(service, settings, PageSettings(examples=find_examples())))
    yield running.url + "/"
    running.close()
