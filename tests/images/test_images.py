"""Decoding untrusted files: odd formats are handled, bad files give one-line ImageErrors."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from showattendtell.images.files import ImageError, full_size, list_images, open_image, preprocess


def photo(w=40, h=20) -> Image.Image:
    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 2] = (255, 0, 0)  # left half red, right half black
    return Image.fromarray(a)


def save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_exif_rotation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    img = open_image(save(photo(40, 20), "JPEG", exif=exif, quality=95))
    assert img.size == (20, 40)
    assert img.getpixel((10, 5))[0] > 200 and img.getpixel((10, 35))[0] < 60


@pytest.mark.parametrize(
    ("w", "h", "fmt", "size"),
    [
        (2000, 1500, "JPEG", (500, 375)),  # 1/4: both sides stay >= 260 (1/8 would not)
        (4032, 3024, "JPEG", (504, 378)),  # a 12-megapixel phone photo: 1/8
        (3000, 400, "JPEG", (3000, 400)),  # the short side is under 2 x 260: decoded whole
        (500, 375, "JPEG", (500, 375)),  # Flickr8k's and COCO's sizes: decoded whole
        (2000, 1500, "PNG", (2000, 1500)),  # PNG has no reduced decoding
    ],
)
def test_large_jpegs_decode_at_a_reduced_size_no_smaller_than_the_encoder_input(w, h, fmt, size):
    data = save(photo(w, h), fmt, quality=90) if fmt == "JPEG" else save(photo(w, h), fmt)
    assert open_image(data).size == (w, h)  # no min_size: full size
    img = open_image(data, min_size=260)
    assert img.size == size and img.mode == "RGB" and full_size(img) == (w, h)
    assert img.getpixel((size[0] // 4, size[1] // 2))[0] > 200  # the red half
    assert img.getpixel((size[0] * 3 // 4, size[1] // 2))[0] < 60
    # the encoder input barely moves: the mean absolute change is a fraction of a grey level
    full, reduced = preprocess(open_image(data), 260), preprocess(img, 260)
    assert (full - reduced).abs().mean() < 0.02  # normalised units: about 1 grey level


def test_a_reduced_jpeg_stays_upright():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    img = open_image(save(photo(2000, 1000), "JPEG", exif=exif, quality=95), min_size=260)
    assert img.size == (500, 1000)  # 1/2 of 2000 x 1000, then turned upright
    assert full_size(img) == (1000, 2000)
    assert img.getpixel((img.width // 2, img.height // 8))[0] > 200
    assert img.getpixel((img.width // 2, img.height * 7 // 8))[0] < 60


def test_every_entry_point_feeds_the_encoder_the_same_reduced_photo(tiny_model_file, tmp_path):
    from showattendtell.service.uploads import read_upload

    from showattendtell.captioning.captioner import load_model
    from showattendtell.images.files import load_image

    path = tmp_path / "big.jpg"
    path.write_bytes(save(photo(2400, 1800), "JPEG", quality=90))
    captioner = load_model(tiny_model_file, "cpu")
    s = captioner.input_size
    batch = load_image(str(path), s).tensor  # sat caption / evaluate: the pipeline's workers
    api = captioner.preprocess(str(path))  # the Python API
    service = preprocess(read_upload(str(path), None, s), s)  # the web service
    assert torch.equal(batch, api) and torch.equal(batch, service)
    assert open_image(str(path), min_size=s).size != (2400, 1800)


@pytest.mark.parametrize(
    "make",
    [
        lambda: save(photo().convert("CMYK"), "JPEG"),
        lambda: save(photo().convert("RGBA"), "PNG"),
        lambda: save(photo().convert("P"), "PNG"),
        lambda: save(photo(), "BMP"),
        lambda: save(photo(), "WEBP"),
        lambda: save(photo(), "TIFF"),
    ],
)
def test_common_modes_become_rgb(make):
    img = open_image(make())
    assert img.mode == "RGB" and img.size == (40, 20)
    r, g, b = img.getpixel((5, 5))
    assert r > 150 and g < 80  # the red half stays red: CMYK / palette conversions are right


def test_greyscale_becomes_rgb():
    img = open_image(save(photo().convert("L"), "BMP"))
    assert img.mode == "RGB" and len(set(img.getpixel((5, 5)))) == 1


def test_sixteen_bit_greyscale_keeps_its_range():
    a = np.full((10, 10), 40000, np.uint16)
    img = open_image(save(Image.fromarray(a), "PNG"))
    assert img.mode == "RGB" and abs(img.getpixel((0, 0))[0] - round(40000 / 65535 * 255)) <= 1


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert open_image(save(rgba, "PNG")).getpixel((0, 0)) == (255, 255, 255)


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = save(frames[0], "GIF", save_all=True, append_images=frames[1:])
    r, g, b = open_image(data).getpixel((0, 0))
    assert r > 200 and b < 50


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "empty"),
        (b"just some text\n", "not an image"),
        (save(photo(200, 200), "JPEG")[:300], "corrupt or truncated"),
    ],
)
def test_bad_files_give_one_line_errors(data, message):
    with pytest.raises(ImageError, match=message) as err:
        open_image(data)
    assert "\n" not in str(err.value)


def test_decompression_bomb_is_refused_before_decoding():
    # a 20000x20000 PNG header with a tiny body: refused from the header alone
    data = save(Image.new("1", (20000, 20000)), "PNG")
    assert len(data) < 200_000
    with pytest.raises(ImageError, match="too large"):
        open_image(data)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="no such file"):
        open_image(tmp_path / "nope.jpg")


def test_preprocess_shape_and_normalisation():
    x = preprocess(photo(), 64)
    assert x.shape == (3, 64, 64)
    assert x[0, 0, 0] > 2.0 and x[1, 0, 0] < -1.9  # red after ImageNet normalisation


def test_list_images_finds_by_suffix(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.jpg", "b.PNG", "notes.txt", "sub/c.webp"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in list_images([tmp_path])] == ["a.jpg", "b.PNG"]
    assert [p.name for p in list_images([tmp_path], recursive=True)] == ["a.jpg", "b.PNG", "c.webp"]


@pytest.mark.parametrize(
    "size,warned",
    [
        ((1, 1), "1x1"),
        ((31, 200), "under 32"),
        ((900, 100), "beyond 1:8"),
        ((32, 256), None),
        ((640, 480), None),
    ],
)
def test_degenerate_photos_get_a_warning(size, warned):
    from showattendtell.images.files import image_warning

    w = image_warning(Image.new("RGB", size, (200, 0, 0)))
    assert (w is None) if warned is None else (warned in w)


def test_a_one_pixel_photo_is_captioned_with_a_warning(tiny_model_file, tmp_path, capsys):
    import json

    from showattendtell import caption_images, load_model
    from showattendtell.cli.main import main

    Image.new("RGB", (1, 1), (255, 0, 0)).save(tmp_path / "pixel.png")
    Image.new("RGB", (64, 64), (255, 0, 0)).save(tmp_path / "fine.png")
    assert (
        main(
            [
                "caption",
                str(tmp_path / "pixel.png"),
                str(tmp_path / "fine.png"),
                "--model",
                str(tiny_model_file),
                "--workers",
                "0",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    pixel, fine = (json.loads(line) for line in captured.out.splitlines())
    assert pixel["caption"] and "1x1 pixels" in pixel["warning"] and "warning" not in fine
    assert f"warning: {tmp_path / 'pixel.png'}: the image is 1x1 pixels, a side" in captured.err
    result = caption_images(load_model(tiny_model_file, "cpu"), [tmp_path / "pixel.png"])[0]
    assert "1x1" in result.warning and result.to_dict()["warning"] == result.warning
    out = tmp_path / "out.csv"
    assert (
        main(
            [
                "caption",
                str(tmp_path / "pixel.png"),
                "-o",
                str(out),
                "--model",
                str(tiny_model_file),
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert "1x1 pixels" in out.read_text().splitlines()[1]


def test_recursive_listing_follows_folder_links_without_looping(tmp_path):
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    for name in ("a.jpg", "sub/b.png"):
        Image.new("RGB", (8, 8)).save(real / name)
    top = tmp_path / "top"
    top.mkdir()
    (top / "link").symlink_to(real, target_is_directory=True)  # the folder's only child
    (real / "sub" / "loop").symlink_to(real, target_is_directory=True)  # back to a parent
    found = list_images([top], recursive=True)
    assert [p.relative_to(top).as_posix() for p in found] == ["link/a.jpg", "link/sub/b.png"]
    assert list_images([top], recursive=False) == []


def test_caption_recursive_through_a_folder_link(tiny_model_file, tmp_path, capsys):
    import json

    from showattendtell.cli.main import main

    real = tmp_path / "real"
    real.mkdir()
    Image.new("RGB", (64, 64), (0, 0, 255)).save(real / "a.png")
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "photos").symlink_to(real, target_is_directory=True)
    assert (
        main(
            [
                "caption",
                str(tmp_path / "top"),
                "--recursive",
                "--model",
                str(tiny_model_file),
                "--workers",
                "0",
            ]
        )
        == 0
    )
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["path"] == str(tmp_path / "top" / "photos" / "a.png")


def test_workers_send_uint8_and_normalising_the_batch_gives_preprocess_values(tmp_path):
    """The pipeline's workers send resized uint8 images (a quarter of float32's bytes); the
    batch normalised where it arrives is bit for bit what ``preprocess`` gives per image."""
    from showattendtell.images.batches import load_batches
    from showattendtell.images.files import normalise

    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([(640, 480), (97, 301), (260, 260)]):
        path = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(path)
        paths.append(path)
    (batch,) = list(load_batches(paths, 64, batch_size=3, workers=1))
    assert batch.tensors.dtype == torch.uint8 and batch.tensors.shape == (3, 3, 64, 64)
    want = torch.stack([preprocess(open_image(p), 64) for p in paths])
    assert torch.equal(normalise(batch.tensors), want)


def test_heic_photos_are_read(tmp_path):
    """HEIC, what phones write, read through pillow-heif (the file made by pillow-heif
    itself, as an encoder of the format); and found in folder scans."""
    pillow_heif = pytest.importorskip("pillow_heif")
    rng = np.random.default_rng(0)
    pixels = np.zeros((96, 128, 3), np.uint8)
    pixels[:, :64] = (220, 30, 30)
    pixels[:, 64:] = (30, 30, 220)
    pixels += rng.integers(0, 5, pixels.shape, dtype=np.uint8)
    for name in ("phone.heic", "other.HEIF"):  # written by pillow-heif's own encoder
        pillow_heif.from_pillow(Image.fromarray(pixels)).save(tmp_path / name, quality=90)
    for name in ("phone.heic", "other.HEIF"):
        img = open_image(tmp_path / name)
        assert img.mode == "RGB" and img.size == (128, 96)
        a = np.asarray(img).astype(int)
        assert a[:, :50, 0].mean() > 180 and a[:, 80:, 2].mean() > 180  # red left, blue right
    assert open_image((tmp_path / "phone.heic").read_bytes()).size == (128, 96)  # uploads


def test_folder_scans_count_what_they_skip(tmp_path):
    from collections import Counter

    for name in ("a.jpg", "b.heic", "notes.txt", "scan.pdf", "more.txt", "README", ".DS_Store"):
        (tmp_path / name).write_bytes(b"x")
    skipped: Counter[str] = Counter()
    found = list_images([tmp_path], skipped=skipped)
    assert [p.name for p in found] == ["a.jpg", "b.heic"]
    assert skipped == {".txt": 2, ".pdf": 1, "": 1}  # hidden files are not counted


def test_a_decoding_process_is_quiet_once_the_main_process_has_gone(monkeypatch, capsys):
    """After `kill` of `sat caption`, a worker's queue thread, or the thread that hands its
    shared memory to the main process (multiprocessing's resource_sharer, which reports through
    sys.excepthook), meets a closed connection: no traceback for that, one for anything else."""
    import multiprocessing.queues
    import sys

    from showattendtell.images.batches import quiet_when_orphaned

    queue = multiprocessing.queues.Queue
    monkeypatch.setattr(queue, "_on_queue_feeder_error", queue._on_queue_feeder_error)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    quiet_when_orphaned(0)
    for error in (EOFError(), ConnectionResetError(104, "reset")):
        try:
            raise error
        except Exception:
            sys.excepthook(*sys.exc_info())  # as resource_sharer's thread does
    assert capsys.readouterr().err == ""
    try:
        raise KeyError("lost")
    except KeyError:
        sys.excepthook(*sys.exc_info())
    assert "KeyError: 'lost'" in capsys.readouterr().err
    for error in (ConnectionResetError(104, "reset"), BrokenPipeError(32, "pipe")):
        try:
            raise error
        except OSError as e:
            queue._on_queue_feeder_error(e, None)
    assert capsys.readouterr().err == ""
    try:
        raise ValueError("cannot pickle")
    except ValueError as e:
        queue._on_queue_feeder_error(e, None)
    assert "ValueError: cannot pickle" in capsys.readouterr().err


@pytest.mark.parametrize("recursive", [False, True])
def test_a_scan_keeps_broken_links_named_like_photos_and_says_what_they_are(tmp_path, recursive):
    """A broken link or a loop of links in a folder gets a record saying so, instead of
    vanishing from the run; a link to a folder is not a photo."""
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.jpg")
    (tmp_path / "dangling.jpg").symlink_to("nowhere.jpg")
    (tmp_path / "l1.jpg").symlink_to("l2.jpg")
    (tmp_path / "l2.jpg").symlink_to("l1.jpg")
    (tmp_path / "sub").mkdir()
    (tmp_path / "folder.jpg").symlink_to("sub")
    found = list_images([tmp_path], recursive=recursive)
    assert [p.name for p in found] == ["dangling.jpg", "l1.jpg", "l2.jpg", "ok.jpg"]
    with pytest.raises(
        ImageError, match="a broken symbolic link \\(to nowhere.jpg, which does not"
    ):
        open_image(tmp_path / "dangling.jpg")
    with pytest.raises(ImageError, match="l1.jpg: a loop of symbolic links"):
        open_image(tmp_path / "l1.jpg")
    with pytest.raises(ImageError, match="sub: a folder, not a file"):
        open_image(tmp_path / "sub")
    with pytest.raises(ImageError, match="none.jpg: no such file"):
        open_image(tmp_path / "none.jpg")


def test_a_file_that_cannot_be_read_says_permission_denied(tmp_path, monkeypatch):
    """Not "corrupt or truncated": the file system said no (chmod does not stop root, so the
    refusal is the one ``open`` gives a user without read permission)."""
    import builtins
    import errno

    path = tmp_path / "private.jpg"
    photo().save(path)
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(ImageError) as e:
        open_image(path)
    assert str(e.value) == f"{path}: cannot read the file: permission denied"


def test_an_unreadable_sub_folder_is_reported_not_dropped(tmp_path, monkeypatch):
    import errno
    import os

    from showattendtell.images.files import UnreadableFolder

    (tmp_path / "locked").mkdir()
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / "locked" / "b.jpg").write_bytes(b"x")
    scandir = os.scandir

    def refusing(path="."):
        if Path(os.fsdecode(path)) == tmp_path / "locked":
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    unreadable: list = []
    found = list_images([tmp_path], recursive=True, unreadable=unreadable)
    assert [p.name for p in found] == ["a.jpg"]
    assert unreadable == [(tmp_path / "locked", "permission denied")]
    with pytest.raises(UnreadableFolder, match="cannot read the folder .*locked: permission"):
        list_images([tmp_path], recursive=True)  # nobody to tell: no silent gap


PEAK_RISE = """
import resource, sys
from showattendtell.images.files import open_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
img = open_image(sys.argv[1])
assert img.mode == "RGB" and img.getpixel((0, 0)) == (117, 117, 117)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_16_bit_png_decodes_without_float64_copies(tmp_path):
    """A 16-bit PNG of 8000x8000 is 124 KB on disk and cost 1.6 GB more than a photo: it went
    through four float64 copies of the whole image (25 bytes a pixel). Now under 12 bytes a
    pixel (the file's 16-bit pixels, the 8-bit result, RGB), measured in a fresh process."""
    import subprocess
    import sys

    side = 3000
    path = tmp_path / "grey16.png"
    Image.fromarray(np.full((side, side), 30000, np.uint16)).save(path)
    assert Image.open(path).mode.startswith("I")
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RISE, str(path)], capture_output=True, text=True, check=True
    )
    rise = int(out.stdout.split()[-1]) * 1024  # ru_maxrss: KB on Linux
    assert rise < 12 * side * side, f"{rise / side**2:.1f} bytes a pixel"


def test_16_and_32_bit_greyscale_convert_to_the_same_levels_as_before():
    """round(value / 65535 x 255) (or / 255 when no value is over 255), block by block."""
    from showattendtell.images import files

    rng = np.random.default_rng(0)
    cases = [
        Image.fromarray(rng.integers(0, 65536, (70, 33), dtype=np.uint16)),
        Image.fromarray(rng.integers(0, 70000, (70, 33)).astype(np.int32)),
        Image.fromarray(rng.integers(0, 250, (70, 33)).astype(np.int32)),
        Image.fromarray((rng.random((70, 33)) * 300).astype(np.float32)),
    ]
    for img in cases:
        a = np.asarray(img).astype(np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        expected = np.clip(a / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        for rows in (33, 33 * 7, 1 << 20):  # one row, 7 rows, the whole image at a time
            files._ROWS_AT_ONCE = rows
            try:
                assert np.array_equal(files._to_8_bits(img), expected), (img.mode, rows)
            finally:
                files._ROWS_AT_ONCE = 1 << 20


def test_the_pixels_decoded_at_once_stay_within_the_budget():
    """A semaphore weighted by pixels: a decode that does not fit waits for one to end, one
    over the whole budget decodes alone, and memory is handed back once none runs."""
    import threading
    import time

    from showattendtell.images.budget import PixelBudget

    trims = []
    budget = PixelBudget(100, trim=lambda: trims.append(budget.in_use))
    first = budget.decoding(80)
    first.__enter__()
    entered = threading.Event()

    def second():
        with budget.decoding(50):
            entered.set()

    t = threading.Thread(target=second)
    t.start()
    deadline = time.monotonic() + 10
    while budget.waiting == 0 and time.monotonic() < deadline:  # until it waits on the budget
        time.sleep(0.001)
    assert budget.waiting == 1 and not entered.is_set() and budget.in_use == 80
    first.__exit__(None, None, None)
    assert entered.wait(10)
    t.join(10)
    assert budget.peak == 80 and budget.in_use == 0
    with budget.decoding(500):  # over the whole budget: alone
        assert budget.in_use == 500
    assert budget.peak == 500 and trims == []  # below TRIM_AFTER_PIXELS: nothing handed back
    with budget.decoding(9_000_000):
        pass
    assert trims == [0]  # handed back once no decode runs


def test_open_image_decodes_within_the_process_budget(monkeypatch):
    """Every decode, whichever thread asks (the service's workers), goes through one budget,
    sized by the pixels decoded (a JPEG decoded reduced: its reduced size)."""
    from showattendtell.images import files
    from showattendtell.images.budget import PixelBudget

    asked = []

    class Recording(PixelBudget):
        def decoding(self, pixels):
            asked.append(pixels)
            return super().decoding(pixels)

    monkeypatch.setattr(files, "DECODE_BUDGET", Recording(10**9))
    grey16 = Image.fromarray(np.full((30, 50), 30000, np.uint16))
    assert open_image(save(grey16, "PNG")).getpixel((0, 0)) == (117, 117, 117)
    open_image(save(photo(640, 480), "JPEG"), min_size=100)
    assert asked == [50 * 30, 160 * 120] and files.DECODE_BUDGET.in_use == 0
