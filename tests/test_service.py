"""The web service: the captioning function on real photos and odd files, the /caption API through
gradio_client against a live server on 127.0.0.1, and a real headless Chromium session."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import COCO_SUBSET, needs_coco_subset
from PIL import Image

from showattendtell.images import ImageError

gr = pytest.importorskip("gradio")
from showattendtell.service.app import (  # noqa: E402
    CaptionService,
    api_caption,
    caption_image,
    launch,
    load_service,
    ui_caption,
    word_view,
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def coco_photo(i: int = 0) -> Path:
    return sorted((COCO_SUBSET / "images").glob("*.jpg"))[i]


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny PNG that claims 20000x20000 pixels (a decompression bomb): header + a zlib stream."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    idat = zlib.compress(b"\0" * (width + 1) * 64, 9)  # only the first rows: never decoded
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tiny_model_file: Path, tiny_hard_model_file: Path):
    svc = load_service([tiny_model_file, tiny_hard_model_file], device="cpu")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def server(service: CaptionService):
    """The app served on 127.0.0.1 (a free port) exactly as `sat serve` does, 1 MB upload limit."""
    port = free_port()
    app = launch(service, "127.0.0.1", port, max_upload_mb=1, block=False,
                 examples=[coco_photo(1)] if COCO_SUBSET.is_dir() else [])
    yield f"http://127.0.0.1:{port}/"
    app.close()


def test_serve_cli_defaults_are_safe():
    from showattendtell.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.device) == ("127.0.0.1", 7860, "auto")
    assert args.max_upload_mb > 0 and args.func.__module__ == "showattendtell.service.serve"


@needs_coco_subset
def test_caption_real_photo_soft_and_hard(service: CaptionService):
    soft, hard = service.names
    done = caption_image(service, str(coco_photo(0)), soft, beam_size=3, max_length=8)
    d = json.loads(json.dumps(done.to_json()))  # JSON-serialisable as the API returns it
    n, g = len(d["words"]), d["grid"]
    assert n >= 1 and d["caption"] == " ".join(d["words"]) and d["attention_type"] == "soft"
    att = np.array(d["attention"])
    assert att.shape == (n, g, g) and np.allclose(att.sum((1, 2)), 1, atol=1e-3)
    assert d["beams"][0]["caption"] == d["caption"] and 1 <= len(d["beams"]) <= 3
    assert d["image_size"] == list(Image.open(coco_photo(0)).size) and d["locations"] is None

    h = caption_image(service, coco_photo(0).read_bytes(), hard, beam_size=1).to_json()
    assert h["attention_type"] == "hard" and len(h["beams"]) == 1
    assert len(h["locations"]) == len(h["words"])
    for (r, c), grid in zip(h["locations"], h["attention"], strict=True):
        assert 0 <= r < h["grid"] and 0 <= c < h["grid"]
        assert np.argmax(grid) == r * h["grid"] + c  # argmax mode: the chosen cell is the peak


@needs_coco_subset
def test_ui_event_renders_every_word(service: CaptionService):
    upload = {"path": str(coco_photo(1)), "orig_name": "photo.jpg"}
    status, caption, state, gallery, words, view, sheet, beams = ui_caption(
        service, upload, service.names[1])
    n = len(state["words"])
    assert caption and "hard attention" in status and len(gallery) == n
    assert [label.split()[0] for _, label in gallery] == state["words"]
    assert "(row " in gallery[0][1]  # hard attention: the chosen location is named
    assert words["choices"] == [(w, i) for i, w in enumerate(state["words"])]
    assert view.width > state["image"].width  # the overlay plus the colour scale
    assert sheet.height > 200 and beams[0][0] == caption
    # stepping through the words gives a different overlay for a different attention map
    if n > 1 and not np.allclose(state["attention"][0], state["attention"][1]):
        first, second = (np.asarray(word_view(state, i)) for i in (0, 1))
        assert not np.array_equal(first, second)
    assert word_view(state, n) is None and word_view(None, 0) is None


def _odd_formats(photo: Path, tmp: Path) -> dict[str, tuple[Path, tuple[int, int]]]:
    """Awkward but valid files made from a real photo, with the upright size each must decode to."""
    img = Image.open(photo).convert("RGB")
    img.thumbnail((320, 320))
    w, h = img.size
    out = {}
    p = tmp / "cmyk.jpg"
    img.convert("CMYK").save(p, quality=90)
    out["cmyk"] = (p, (w, h))
    p = tmp / "grey16.png"
    Image.fromarray((np.asarray(img.convert("L"), np.uint16) * 257).astype(np.uint16)).save(p)
    out["16-bit"] = (p, (w, h))
    p = tmp / "rgba.png"
    rgba = img.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(p)
    out["rgba"] = (p, (w, h))
    p = tmp / "palette.png"
    img.convert("P", palette=Image.Palette.ADAPTIVE).save(p, transparency=0)
    out["palette"] = (p, (w, h))
    p = tmp / "animated.gif"
    img.save(p, save_all=True, append_images=[Image.new("RGB", (w, h), "black")], duration=100)
    out["gif"] = (p, (w, h))
    p = tmp / "rotated.jpg"  # stored sideways; EXIF orientation 6 says "rotate 90 clockwise"
    exif = Image.Exif()
    exif[0x0112] = 6
    img.transpose(Image.Transpose.ROTATE_90).save(p, exif=exif, quality=90)
    out["exif"] = (p, (w, h))
    return out


@needs_coco_subset
def test_odd_but_valid_formats(service: CaptionService, tmp_path: Path):
    photo = coco_photo(2)
    reference = Image.open(photo).convert("RGB")
    reference.thumbnail((320, 320))
    for kind, (path, size) in _odd_formats(photo, tmp_path).items():
        done = caption_image(service, {"path": str(path), "orig_name": path.name})
        assert done.image.mode == "RGB" and done.image.size == size, kind
        assert done.result.words, kind
        if kind in ("gif", "exif", "cmyk"):  # first frame / upright / right colours
            diff = np.abs(np.asarray(done.image, np.float32) - np.asarray(reference, np.float32))
            assert diff.mean() < 25, (kind, diff.mean())


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    files = {"text": b"this is not an image\n", "empty": b"", "bomb": png_bomb()}
    buf = io.BytesIO()
    Image.new("RGB", (400, 300), "red").save(buf, "JPEG")
    files["truncated"] = buf.getvalue()[: len(buf.getvalue()) // 3]
    names = {"text": "notes.txt", "empty": "empty.jpg", "bomb": "bomb.png",
             "truncated": "cut.jpg"}
    for k, data in files.items():
        (tmp / names[k]).write_bytes(data)
    return {k: tmp / names[k] for k in files}


EXPECTED = {"text": "not an image", "empty": "empty", "bomb": "too large",
            "truncated": "corrupt or truncated"}


def test_bad_input_gives_clear_messages(service: CaptionService, tmp_path: Path):
    for kind, path in _bad_inputs(tmp_path).items():
        upload = {"path": str(path), "orig_name": f"my_{path.name}"}
        with pytest.raises(ImageError, match=EXPECTED[kind]) as e:
            caption_image(service, upload)
        assert str(path) not in str(e.value) and f"my_{path.name}" in str(e.value) or \
            kind == "empty"
        with pytest.warns(UserWarning):  # the UI: a status message and a toast, no exception
            status, caption, *_ = ui_caption(service, upload)
        assert status.startswith("**Cannot caption this file:**") and EXPECTED[kind] in status
        assert caption == ""
        with pytest.raises(gr.Error, match=EXPECTED[kind]):
            api_caption(service, upload)
    with pytest.raises(gr.Error, match="no image"):
        api_caption(service, None)
    photo = io.BytesIO()
    Image.new("RGB", (64, 48), "blue").save(photo, "PNG")
    inline = "data:image/png;base64," + base64.b64encode(photo.getvalue()).decode()
    assert caption_image(service, {"url": inline}).image.size == (64, 48)  # pasted inline
    too_big = "A" * 4 * (service.max_upload_bytes // 3 + 2)  # decodes to just over the limit
    with pytest.raises(ImageError, match="MB limit"):
        caption_image(service, {"url": "data:image/png;base64," + too_big})
    with pytest.raises(gr.Error, match="unknown model"):
        api_caption(service, str(tmp_path / "notes.txt"), "nope")


@needs_coco_subset
def test_concurrent_requests_are_batched_with_the_same_results(service: CaptionService):
    photos = [coco_photo(i) for i in range(4)]
    alone = [caption_image(service, str(p)).result.caption for p in photos]
    before = len(service.batch_sizes)
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(photos))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = caption_image(service, str(photos[i])).result.caption

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(photos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(photos))] == alone
    assert sum(service.batch_sizes[before:]) == len(photos)
    assert max(service.batch_sizes[before:]) > 1  # the requests that piled up shared a batch


@pytest.mark.slow
@needs_coco_subset
def test_api_through_gradio_client(server: str, service: CaptionService, tmp_path: Path):
    from gradio_client import Client, handle_file

    client = Client(server, verbose=False)
    d = client.predict(handle_file(str(coco_photo(0))), api_name="/caption")
    direct = caption_image(service, str(coco_photo(0))).to_json()
    assert d["caption"] == direct["caption"] and d["words"] == direct["words"]
    assert np.allclose(d["attention"], direct["attention"], atol=1e-4)
    h = client.predict(handle_file(str(coco_photo(0))), model=service.names[1], beam_size=1,
                       max_length=5, api_name="/caption")
    assert h["model"] == service.names[1] and len(h["words"]) <= 5 and h["locations"]

    for kind, path in _bad_inputs(tmp_path).items():
        with pytest.raises(Exception, match=EXPECTED[kind]):
            client.predict(handle_file(str(path)), api_name="/caption")
    big = tmp_path / "noise.png"  # over the 1 MB upload limit
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (800, 800, 3), np.uint8)).save(big)
    with pytest.raises(Exception, match="(?i)size|large|limit"):
        client.predict(handle_file(str(big)), api_name="/caption")
    # still serving after all that
    again = client.predict(handle_file(str(coco_photo(0))), api_name="/caption")
    assert again["caption"] == d["caption"]


@pytest.mark.slow
@pytest.mark.browser
@needs_coco_subset
@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="Debian chromium not installed (apt-get install chromium; .ci/run does)")
def test_browser_upload_shows_caption_and_overlays(server: str, tmp_path: Path):
    playwright = pytest.importorskip("playwright.sync_api")
    shot = tmp_path / "service_ui.png"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server)
            upload = "#input-image input[type=file]"
            page.wait_for_selector(upload, state="attached", timeout=60_000)
            page.set_input_files(upload, str(coco_photo(0)))
            page.wait_for_function(
                "document.querySelector('#caption-text textarea')?.value.length > 0",
                timeout=90_000)
            caption = page.input_value("#caption-text textarea")
            n = len(caption.split())
            page.wait_for_selector("#word-gallery img", timeout=30_000)
            assert page.locator("#word-gallery img").count() == n
            assert page.locator("#words input[type=radio]").count() == n
            page.wait_for_selector("#word-view img", timeout=30_000)
            page.wait_for_selector("#caption-sheet img", timeout=30_000)
            if n > 1:  # step to the last word: the large overlay changes
                first = page.get_attribute("#word-view img", "src")
                page.locator("#words label").nth(n - 1).click()
                page.wait_for_function(
                    f"document.querySelector('#word-view img')?.src !== {json.dumps(first)}",
                    timeout=30_000)
            page.screenshot(path=str(shot), full_page=True)
            if n > 1:  # clicking a word's panel in the gallery selects that word
                before = page.get_attribute("#word-view img", "src")
                page.locator("#word-gallery img").first.click()
                page.wait_for_function(
                    f"document.querySelector('#word-view img')?.src !== {json.dumps(before)}",
                    timeout=30_000)
                assert page.locator("#words input:checked").get_attribute("value") == "0"
            # a truncated JPEG gets a clear message, and the page keeps working (the browser
            # itself refuses files that are not image/*, so a text file never reaches us here)
            bad = tmp_path / "cut.jpg"
            data = coco_photo(0).read_bytes()
            bad.write_bytes(data[: len(data) // 3])
            page.locator("#input-image button[aria-label='Remove Image']").first.click()
            page.set_input_files(upload, str(bad))
            page.wait_for_function(
                "document.querySelector('#status')?.innerText.includes('Cannot caption')",
                timeout=60_000)
            assert "cut.jpg" in page.inner_text("#status")
            assert "corrupt or truncated" in page.inner_text("#status")
            # picking an example photo captions it
            page.locator("#examples img").first.click()
            page.wait_for_function(
                "document.querySelector('#status')?.innerText.startsWith('Captioned by')",
                timeout=60_000)
            assert page.input_value("#caption-text textarea")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
