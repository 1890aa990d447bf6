"""JPEGs decoded in batches on the device (jpeg_device, `sat caption --decode-on gpu`).

The path runs on a CPU too (torchvision's decode_jpeg there), so everything but nvJPEG itself is
tested here: which files go to it, EXIF orientation, the resize, the fallback to the CPU for a
file the device cannot decode, and that the pipeline's records and captions are the CPU path's.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.pipeline import caption_files
from showattendtell.images.batches import load_batches
from showattendtell.images.files import LoadedImage, load_image
from showattendtell.images.jpeg_device import decode_jpegs, read_jpeg, upright

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "service" / "examples").glob("*.jpg"))
CPU = torch.device("cpu")


def quadrants(path: Path, orientation: int = 1, **save) -> Path:
    """A 40x24 JPEG with four coloured quadrants (every turn and mirror looks different)."""
    a = np.zeros((24, 40, 3), np.uint8)
    a[:12, :20], a[:12, 20:], a[12:, 20:] = (255, 0, 0), (0, 255, 0), (0, 0, 255)
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    Image.fromarray(a).save(path, quality=95, exif=exif, **save)
    return path


@pytest.mark.filterwarnings("ignore:.*TorchCodec")  # torchvision 0.29's notice
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_pil_applies_it(tmp_path, orientation):
    from torchvision.io import decode_jpeg

    path = quadrants(tmp_path / "q.jpg", orientation)
    item = read_jpeg(str(path), 16)
    assert item.jpeg is not None and item.orientation == orientation
    stored = decode_jpeg(item.jpeg)
    want = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    got = upright(stored, orientation).permute(1, 2, 0).numpy()
    assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("orientation", [1, 6, 8])
def test_decoded_photos_are_the_cpu_paths_within_one_level(tmp_path, orientation):
    """Same size, upright, resized: the arithmetic differs only in rounding."""
    photo = Image.open(EXAMPLES[0]).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "p.jpg"
    photo.save(path, quality=90, exif=exif)
    item = read_jpeg(str(path), 260)
    (got,) = decode_jpegs([item], 260, CPU)
    want = load_image(str(path), 260, normalised=False)
    assert item.warning == want.warning
    assert got.shape == want.tensor.shape == (3, 260, 260)
    assert (got.int() - want.tensor.int()).abs().max() <= 1


def test_large_photos_decode_in_full_and_stay_close_to_the_reduced_cpu_decoding(tmp_path):
    """The CPU decodes a large JPEG at a reduced size (libjpeg's DCT scaling); the device
    decodes it in full and resizes with antialiasing: the same photo within a few levels."""
    path = tmp_path / "big.jpg"
    Image.open(EXAMPLES[1]).convert("RGB").resize((1680, 1260)).save(path, quality=92)
    (got,) = decode_jpegs([read_jpeg(str(path), 260)], 260, CPU)
    want = load_image(str(path), 260, normalised=False).tensor
    assert (got.float() - want.float()).abs().mean() < 2.0


def test_only_jpegs_the_device_decodes_alike_are_left_to_it(tmp_path):
    """PNG, progressive and CMYK JPEGs are decoded by the worker as before."""
    quadrants(tmp_path / "base.jpg")
    img = Image.open(tmp_path / "base.jpg")
    img.save(tmp_path / "a.png")
    img.save(tmp_path / "progressive.jpg", progressive=True)
    img.convert("CMYK").save(tmp_path / "cmyk.jpg")
    assert read_jpeg(str(tmp_path / "base.jpg"), 16).jpeg is not None
    for name in ("a.png", "progressive.jpg", "cmyk.jpg"):
        item = read_jpeg(str(tmp_path / name), 16)
        want = load_image(str(tmp_path / name), 16, normalised=False)
        assert item.jpeg is None and torch.equal(item.tensor, want.tensor), name


def test_a_jpeg_the_device_cannot_decode_gets_the_cpu_paths_record(tmp_path):
    """A header that reads and data that does not: one error record, the batch goes on."""
    good = quadrants(tmp_path / "good.jpg")
    data = good.read_bytes()
    (tmp_path / "broken.jpg").write_bytes(data[: len(data) // 2])  # truncated scan data
    (tmp_path / "text.jpg").write_text("not a photo")
    paths = [str(good), str(tmp_path / "broken.jpg"), str(tmp_path / "text.jpg"), str(good)]
    expected = next(load_batches(paths, 16, 4, 0))
    (batch,) = list(load_batches(paths, 16, 4, 0, jpeg_on_device=True))
    images = batch.images(CPU, 16)
    assert batch.failures() == expected.failures()
    assert batch.decoded() == expected.decoded()
    assert images.shape == expected.tensors.shape
    assert (images.int() - expected.tensors.int()).abs().max() <= 1


def test_captions_of_the_pipeline_are_the_cpu_paths(tmp_path):
    """`sat caption --decode-on gpu`'s pipeline, run on a CPU: the same records in the same
    order, and the same captions for the example photos and a PNG between them."""
    Image.open(EXAMPLES[2]).save(tmp_path / "third.png")
    paths = [str(EXAMPLES[0]), str(tmp_path / "third.png"), *map(str, EXAMPLES[1:])]
    captioner = load_model(None, "cpu")
    run = {
        flag: list(
            caption_files(
                captioner,
                paths,
                3,
                1,
                jpeg_on_device=flag,
                decoding=captioner.check_decoding(beam_size=1),
            )
        )
        for flag in (False, True)
    }
    assert [r.path for r in run[True]] == [r.path for r in run[False]] == paths
    assert [r.result.caption for r in run[True]] == [r.result.caption for r in run[False]]


def test_batches_are_page_locked_where_the_dataloader_pins_them(monkeypatch):
    """DataLoader(pin_memory=True) calls a batch's own pin_memory(); without one a batch
    object stays pageable and the copy to the GPU cannot overlap its work."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from showattendtell.images.batches import collate_images

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pinned.append(self) or self)
    batch = collate_images([load_image(str(p), 32, i, normalised=False) for i, p in
                            enumerate(EXAMPLES[:2])])  # fmt: skip
    assert pin_memory(batch) is batch and len(pinned) == 1 and pinned[0] is batch.tensors


def test_decoding_on_the_gpu_without_one_is_a_usage_error(tmp_path, capsys):
    """One line saying what to do, exit 2, and no output file made."""
    from showattendtell.cli.main import main

    out = tmp_path / "out.jsonl"
    rc = main(["caption", str(EXAMPLES[0]), "--decode-on", "gpu", "--device", "cpu",
               "-o", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "error: --decode-on gpu needs a CUDA GPU (--device cuda); without one, leave it out"
    ]
    assert not out.exists()


def test_a_decoding_process_decodes_as_the_main_process(tmp_path, monkeypatch):
    """Decoding processes decode plain JPEGs with torchvision (``load_jpeg``), the main process
    with PIL (``load_image``): the same pixels, warnings and error records for every kind of
    file. Only the plain JPEGs that PIL decodes at full size take torchvision's way."""
    from showattendtell.images import jpeg_device

    plain = [quadrants(tmp_path / f"turned{o}.jpg", o) for o in range(1, 9)]
    Image.fromarray(np.arange(24 * 40, dtype=np.uint8).reshape(24, 40)).save(tmp_path / "l.jpg")
    plain.append(tmp_path / "l.jpg")
    big = quadrants(tmp_path / "big.jpg")
    Image.open(big).resize((80, 48)).save(big)  # twice 16 and more on both sides: PIL reduces
    others = [big]
    img = Image.open(plain[0])
    img.save(tmp_path / "a.png")
    img.save(tmp_path / "progressive.jpg", progressive=True)
    img.convert("CMYK").save(tmp_path / "cmyk.jpg")
    data = plain[0].read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.jpg").write_text("not a photo")
    for name in ("a.png", "progressive.jpg", "cmyk.jpg", "truncated.jpg", "text.jpg"):
        others.append(tmp_path / name)
    others.append(tmp_path / "missing.jpg")

    by_pil = []
    monkeypatch.setattr(
        jpeg_device,
        "load_image",
        lambda path, *a, **k: by_pil.append(path) or load_image(path, *a, **k),
    )
    cases = [(path, 16) for path in plain + others] + [(path, 260) for path in EXAMPLES]
    for path, size in cases:  # the example photos: 560 x 420 and 331 x 560, at the model's 260
        got = jpeg_device.load_jpeg(str(path), size, 3)
        want = load_image(str(path), size, 3, normalised=False)
        assert (got.index, got.error, got.warning) == (want.index, want.error, want.warning)
        assert (got.tensor is None) == (want.tensor is None), path.name
        assert got.tensor is None or torch.equal(got.tensor, want.tensor), path.name
    assert sorted(Path(p).name for p in by_pil) == sorted(p.name for p in others)


def test_decoding_processes_take_torchvision_s_way(monkeypatch):
    from showattendtell.images import batches

    calls = []
    monkeypatch.setattr(batches, "load_jpeg", lambda *a: calls.append(a) or "decoded")
    files = batches.ImageFiles([EXAMPLES[0]], 16)
    assert files[0].tensor is not None and calls == []  # the main process: PIL
    monkeypatch.setattr(batches, "get_worker_info", lambda: object())  # as in a DataLoader worker
    assert files[0] == "decoded" and calls == [(str(EXAMPLES[0]), 16, 0)]


def test_a_file_gone_after_its_header_was_read_is_an_error_record(tmp_path, monkeypatch):
    """Between the header and the bytes the file went away: a record, not a crashed worker."""
    from showattendtell.images import jpeg_device

    path = str(quadrants(tmp_path / "q.jpg"))

    def gone(self):
        raise FileNotFoundError(self)

    monkeypatch.setattr(Path, "read_bytes", gone)
    for read in (jpeg_device.read_jpeg, jpeg_device.load_jpeg):
        monkeypatch.setattr(
            jpeg_device, "load_image", lambda *a, **k: LoadedImage(0, path, error="gone")
        )
        item = read(path, 16)
        assert item.error == "gone" and item.tensor is None and item.jpeg is None


@pytest.mark.filterwarnings("ignore:.*TorchCodec")  # torchvision 0.29's notice
def test_a_batch_leaves_a_decoding_process_as_one_tensor_of_each_kind(tmp_path):
    """Each tensor a decoding process hands over costs its own shared-memory file and a
    descriptor fetched over a socket: a batch's pixels and its JPEGs' bytes go as one tensor
    each, whatever the number of photos, and the JPEGs come back byte for byte."""
    from showattendtell.images.batches import collate_images

    jpegs = [quadrants(tmp_path / f"{i}.jpg", 1 + i) for i in range(5)]
    Image.open(jpegs[0]).save(tmp_path / "a.png")  # decoded by the process: pixels
    paths = [str(p) for p in (*jpegs[:2], tmp_path / "a.png", *jpegs[2:])]
    for workers, on_device in ((0, False), (1, True)):
        items = [read_jpeg(p, 16, i) if on_device else load_image(p, 16, i, False)
                 for i, p in enumerate(paths)]  # fmt: skip
        batch = collate_images(items)
        assert all(x.tensor is None and x.jpeg is None for x in batch.items)
        assert batch.tensors.shape[0] == (1 if on_device else len(paths))
        (loaded,) = list(load_batches(paths, 16, len(paths), workers, jpeg_on_device=on_device))
        images = loaded.images(CPU, 16)
        assert images.shape == (len(paths), 3, 16, 16)
        if on_device:
            assert batch.jpegs.numel() == sum(p.stat().st_size for p in jpegs)
            sent = [bytes(x.jpeg.numpy()) for x in loaded.items if x.jpeg is not None]
            assert sent == [p.read_bytes() for p in jpegs]
