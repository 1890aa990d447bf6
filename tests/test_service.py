"""The web service: `sat serve` options, the captioning function on real photos and odd files, the
UI handlers, the /caption API through gradio_client against a live server on 127.0.0.1 (with and
without a login), and a real headless Chromium session.

The real photos are the example photos shipped in service/examples/, so these tests need no data
outside the repository.
"""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from showattendtell.catalog import BUNDLED_DIR, ModelNotFound
from showattendtell.cli import build_parser, main
from showattendtell.decoding import MAX_BEAM_SIZE, MAX_CAPTION_LENGTH, DecodingError
from showattendtell.images import ImageError, full_size

gr = pytest.importorskip("gradio")
from showattendtell.service import drawing, events  # noqa: E402
from showattendtell.service.app import build_app, launch  # noqa: E402
from showattendtell.service.auth import (  # noqa: E402
    AUTH_ENV,
    AuthError,
    exposure_warning,
    read_auth,
)
from showattendtell.service.captioning import api_caption, caption_image  # noqa: E402
from showattendtell.service.uploads import EXAMPLES_DIR, find_examples  # noqa: E402
from showattendtell.service.worker import CaptionService, load_service, model_paths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian chromium not installed at /usr/bin/chromium (apt-get install chromium; "
           ".ci/run does)")
needs_bundled = pytest.mark.skipif(
    not (BUNDLED_DIR / "flickr8k_lite2_hard.safetensors").is_file(),
    reason="bundled model flickr8k_lite2_hard not installed")


def photo(i: int = 0) -> Path:
    """A real photo: one of the example photos that ship with the service."""
    return sorted(EXAMPLES_DIR.glob("*.jpg"))[i]


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
def tiny_expected_file(tiny_hard_model_file: Path, tmp_path_factory) -> Path:
    """The tiny hard-attention model storing hard_mode 'expectation' (the bundled one stores
    'argmax'): the controls must start at a model's stored mode, whichever it is."""
    from showattendtell.model_file import read_model, save_model

    model, decoding, info = read_model(tiny_hard_model_file)
    return save_model(model, tmp_path_factory.mktemp("models") / "tiny_hard_expected.safetensors",
                      decoding.with_overrides(hard_mode="expectation"), info=info)


@pytest.fixture(scope="module")
def service(tiny_model_file: Path, tiny_expected_file: Path):
    """A soft model (the default) and a hard one whose stored hard mode is 'expectation'."""
    svc = load_service([tiny_model_file, tiny_expected_file], device="cpu")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def server(service: CaptionService):
    """The app served on 127.0.0.1 (a free port) exactly as `sat serve` does, 1 MB upload limit,
    with the shipped example photos."""
    port = free_port()
    app = launch(service, "127.0.0.1", port, max_upload_mb=1, block=False,
                 examples=find_examples())
    yield f"http://127.0.0.1:{port}/"
    app.close()


def black(size: tuple[int, int] = (160, 120)) -> Image.Image:
    return Image.new("RGB", size, "black")


def white_pixels(image: Image.Image) -> int:
    return int(np.all(np.asarray(image.convert("RGB")) == 255, axis=-1).sum())


# ---------------------------------------------------------------------------------------------
# `sat serve` options


def test_serve_cli_defaults_are_safe():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.device) == ("127.0.0.1", 7860, "auto")
    assert args.max_upload_mb > 0 and args.func.__module__ == "showattendtell.service.serve"
    assert args.auth_file is None
    # the decoding options of `sat caption`, each None: the model's stored value
    assert (args.beam_size, args.max_length, args.length_penalty, args.hard_mode,
            args.no_repeat_ngram) == (None,) * 5


@pytest.mark.parametrize("option, message", [
    (["--beam-size", "0"], "beam size"),
    (["--max-length", "500"], "maximum length"),
    (["--hard-mode", "best"], "hard-attention mode"),
    (["--length-penalty", "nan"], "length penalty"),
    (["--no-repeat-ngram", "-1"], "no-repeat"),
])
def test_serve_bad_decoding_option_exits_2_before_loading(option, message, monkeypatch, capsys):
    def must_not_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("showattendtell.service.worker.load_service", must_not_load)
    assert main(["serve", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def _fake_launch(monkeypatch) -> dict:
    """Patch launch: `sat serve` loads its models and returns instead of serving."""
    seen: dict = {}

    def fake(service, host, port, max_upload_mb, examples, concurrency, queue_size, auth=None):
        seen.update(service=service, host=host, examples=examples, auth=auth,
                    decoding={n: c.decoding for n, c in service.captioners.items()})
        return None

    monkeypatch.setattr("showattendtell.service.app.launch", fake)
    return seen


def test_serve_decoding_options_become_every_models_defaults(tiny_model_file, tiny_expected_file,
                                                             monkeypatch):
    seen = _fake_launch(monkeypatch)
    assert main(["serve", "--model", str(tiny_model_file), "--model", str(tiny_expected_file),
                 "--device", "cpu", "--beam-size", "1", "--max-length", "5"]) == 0
    soft, hard = seen["decoding"].values()
    assert (soft.beam_size, soft.max_length) == (hard.beam_size, hard.max_length) == (1, 5)
    assert hard.hard_mode == "expectation"  # not given: the model's stored value
    assert main(["serve", "--model", str(tiny_expected_file), "--device", "cpu",
                 "--hard-mode", "sample"]) == 0
    (hard,) = seen["decoding"].values()
    assert hard.hard_mode == "sample" and hard.beam_size == 3  # 3: stored


def test_serve_model_names(capsys):
    assert main(["serve", "--model", "no_such_model"]) == 2
    err = capsys.readouterr().err
    assert "no model of that name" in err and err.count("\n") == 1
    with pytest.raises(ModelNotFound):
        model_paths(["no_such_model"])


@needs_bundled
def test_serve_bundled_model_by_name(monkeypatch):
    hard = BUNDLED_DIR / "flickr8k_lite2_hard.safetensors"
    assert model_paths(["flickr8k_lite2_hard"]) == [[hard]]
    assert model_paths(["flickr8k_lite2_soft+flickr8k_lite2_hard"]) == [[
        BUNDLED_DIR / "flickr8k_lite2_soft.safetensors", hard]]
    seen = _fake_launch(monkeypatch)
    assert main(["serve", "--model", "flickr8k_lite2_hard", "--device", "cpu"]) == 0
    assert list(seen["decoding"]) == ["flickr8k_lite2_hard"]
    assert seen["decoding"]["flickr8k_lite2_hard"].hard_mode == "argmax"  # stored


def test_serve_warns_without_login_beyond_localhost(tiny_model_file, tmp_path, monkeypatch,
                                                    capsys):
    seen = _fake_launch(monkeypatch)
    monkeypatch.delenv(AUTH_ENV, raising=False)
    base = ["serve", "--model", str(tiny_model_file), "--device", "cpu"]
    assert main([*base, "--host", "0.0.0.0"]) == 0
    assert "warning: serving on 0.0.0.0 without a login" in capsys.readouterr().err
    assert seen["auth"] is None
    assert main(base) == 0  # 127.0.0.1: no warning
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv(AUTH_ENV, "alice:pa ss:word")
    assert main([*base, "--host", "0.0.0.0"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert seen["auth"] == [("alice", "pa ss:word")]
    monkeypatch.delenv(AUTH_ENV)
    creds = tmp_path / "logins"
    creds.write_text("# users\nbob:hunter2\n\ncarol:x\n")
    assert main([*base, "--host", "0.0.0.0", "--auth-file", str(creds)]) == 0
    assert seen["auth"] == [("bob", "hunter2"), ("carol", "x")]
    assert main([*base, "--auth-file", str(tmp_path / "missing")]) == 2
    assert "cannot read --auth-file" in capsys.readouterr().err


def test_auth_settings():
    assert read_auth(None, {}) is None
    assert read_auth(None, {AUTH_ENV: "u:p"}) == [("u", "p")]
    for bad in ("nopassword", "user:", ":pw", "two words:pw"):
        with pytest.raises(AuthError, match="expected user:password") as e:
            read_auth(None, {AUTH_ENV: bad})
        assert "pw" not in str(e.value)  # a password is never echoed
    assert exposure_warning("0.0.0.0", None) and exposure_warning("example.org", None)
    assert exposure_warning("0.0.0.0", [("u", "p")]) is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, None) is None


@pytest.mark.slow
def test_login_required_for_page_and_api(service: CaptionService, tmp_path: Path):
    from gradio_client import Client, handle_file

    creds = tmp_path / "logins"
    creds.write_text("alice:s3cret:x\n")
    port = free_port()
    app = launch(service, "127.0.0.1", port, block=False, auth=read_auth(creds, {}))
    url = f"http://127.0.0.1:{port}/"
    try:
        for path in ("config", "gradio_api/info"):  # what the client and the page need first
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(url + path)
            assert e.value.code == 401
        with pytest.raises(Exception, match="(?i)credentials|login"):
            Client(url, verbose=False)
        with pytest.raises(Exception, match="(?i)login"):
            Client(url, verbose=False, auth=("alice", "wrong"))
        client = Client(url, verbose=False, auth=("alice", "s3cret:x"))
        d = client.predict(handle_file(str(photo(0))), api_name="/caption")
        assert d["caption"] and d["model"] == service.names[0]
    finally:
        app.close()


# ---------------------------------------------------------------------------------------------
# The captioning function and the API's JSON


def test_caption_real_photo_soft_and_hard(service: CaptionService):
    soft, hard = service.names
    done = caption_image(service, str(photo(0)), soft, beam_size=3, max_length=8)
    d = json.loads(json.dumps(done.to_json(), allow_nan=False))  # strict JSON, as the API sends
    n, g = len(d["words"]), d["grid"]
    assert n >= 1 and d["caption"] == " ".join(d["words"]) and d["attention_type"] == "soft"
    att = np.array(d["attention"])
    assert att.shape == (n, g, g) and np.allclose(att.sum((1, 2)), 1, atol=1e-3)
    assert d["beams"][0]["caption"] == d["caption"] and 1 <= len(d["beams"]) <= 3
    assert d["image_size"] == list(Image.open(photo(0)).size) and d["locations"] is None
    assert "warning" not in d
    # the keys the API has always returned, now built on CaptionResult.to_dict
    expected = set(done.result.to_dict(with_attention=True)) | {
        "beams", "model", "attention_type", "grid", "locations", "image_size", "decoding"}
    assert set(d) == expected
    assert {"caption", "words", "score", "log_prob", "attention"} <= expected
    numbers = [x for word in d["attention"] for row in word for x in row]
    assert all(len(repr(x)) <= 7 for x in numbers)  # 5 decimals, not float32 noise

    h = caption_image(service, photo(0).read_bytes(), hard, beam_size=1,
                      hard_mode="argmax").to_json()
    assert h["attention_type"] == "hard" and len(h["beams"]) == 1
    assert h["decoding"]["hard_mode"] == "argmax" and len(h["locations"]) == len(h["words"])
    for (r, c), grid in zip(h["locations"], h["attention"], strict=True):
        assert 0 <= r < h["grid"] and 0 <= c < h["grid"]
        assert np.argmax(grid) == r * h["grid"] + c  # argmax mode: the chosen cell is the peak


def test_decoding_options_are_checked_never_defaulted(service: CaptionService):
    soft, hard = service.names
    for kw, message in [({"beam_size": 0}, "beam size"), ({"beam_size": 2.5}, "beam size"),
                        ({"beam_size": MAX_BEAM_SIZE + 1}, "beam size"),
                        ({"max_length": 0}, "maximum length"),
                        ({"max_length": MAX_CAPTION_LENGTH + 1}, "maximum length"),
                        ({"hard_mode": "best"}, "hard-attention mode"),
                        ({"length_penalty": -1}, "length penalty"),
                        ({"no_repeat_ngram": "2"}, "no-repeat"),
                        ({"rerank": "best"}, "reranking"),
                        ({"rerank": "consensus"}, "consensus index")]:  # it has none
        with pytest.raises(DecodingError, match=message):
            caption_image(service, str(photo(0)), hard, **kw)
        with pytest.raises(gr.Error, match=message):  # the API client gets the message
            api_caption(service, str(photo(0)), hard, **kw)
    # the limits are decoding.py's: the largest allowed values work
    d = api_caption(service, str(photo(0)), soft, beam_size=float(MAX_BEAM_SIZE), max_length=2)
    assert d["decoding"]["beam_size"] == MAX_BEAM_SIZE and len(d["words"]) <= 2
    # not given: each model's own defaults (the hard one stores 'expectation')
    d = api_caption(service, str(photo(0)), hard)
    assert d["decoding"] == service.get(hard).decoding.to_dict()
    assert d["decoding"]["hard_mode"] == "expectation" and d["locations"] is None


def test_batches_group_by_the_full_decoding_config(service: CaptionService, tiny_model_file):
    """Requests that differ in any decoding value (here only the length penalty or the
    no-repeat size) are never decoded in one batch; equal ones are."""
    svc = load_service([tiny_model_file], device="cpu", max_batch=8)
    groups: list[list[dict]] = []
    release = threading.Event()
    original = svc._run_group

    def recording(group):
        groups.append([j.decoding.to_dict() for j in group])
        if len(groups) == 1:
            release.wait(120)  # hold the worker until the other requests have queued
        original(group)

    svc._run_group = recording
    img = Image.open(photo(1)).convert("RGB")
    configs = [svc.decoding(None), svc.decoding(None, length_penalty=1.0),
               svc.decoding(None, no_repeat_ngram=2), svc.decoding(None),
               svc.decoding(None, length_penalty=1.0)]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = svc.caption(img, None, configs[i]).caption

    def wait_until(condition) -> None:  # poll (no time limit asserted: at most 10 minutes)
        for _ in range(60_000):
            if condition():
                return
            release.wait(0.01)
        raise AssertionError("the requests never queued")

    first = threading.Thread(target=run, args=(0,))
    first.start()
    wait_until(lambda: groups)  # the worker is busy with the first request
    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(configs))]
    for t in threads:
        t.start()
    wait_until(lambda: svc._queue.qsize() == len(threads))
    release.set()
    for t in [first, *threads]:
        t.join(120)
    svc.close()
    assert len(results) == len(configs)
    later = sorted((sorted(json.dumps(c, sort_keys=True) for c in g) for g in groups[1:]), key=len)
    assert [len(g) for g in later] == [1, 1, 2]  # penalty 1 twice together, the others alone
    for g in later:
        assert len(set(g)) == 1  # one batch, one config
    assert sum(len(g) for g in groups) == len(configs)


def test_degenerate_photo_warning(service: CaptionService):
    wide = Image.new("RGB", (900, 40), "green")  # aspect 22:1
    d = caption_image(service, wide).to_json()
    assert "aspect ratio" in d["warning"]
    status = events.ui_caption(service, wide)[0]
    assert "**Warning:**" in status and "aspect ratio" in status
    tiny = caption_image(service, Image.new("RGB", (12, 12), "red")).to_json()
    assert "12x12" in tiny["warning"]


def _odd_formats(source: Path, tmp: Path) -> dict[str, tuple[Path, tuple[int, int]]]:
    """Awkward but valid files made from a real photo, with the upright size each must decode to."""
    img = Image.open(source).convert("RGB")
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


def test_odd_but_valid_formats(service: CaptionService, tmp_path: Path):
    reference = Image.open(photo(2)).convert("RGB")
    reference.thumbnail((320, 320))
    for kind, (path, size) in _odd_formats(photo(2), tmp_path).items():
        done = caption_image(service, {"path": str(path), "orig_name": path.name})
        # a JPEG may be decoded reduced (the tiny model reads 64 px): the photo's size is kept
        assert done.image.mode == "RGB" and full_size(done.image) == size, kind
        assert done.to_json()["image_size"] == list(size), kind
        assert done.result.words, kind
        if kind in ("gif", "exif", "cmyk"):  # first frame / upright / right colours
            seen = np.asarray(reference.resize(done.image.size), np.float32)
            diff = np.abs(np.asarray(done.image, np.float32) - seen)
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
            status, caption, *_ = events.ui_caption(service, upload)
        assert status.startswith("**Cannot caption this file:**") and EXPECTED[kind] in status
        assert caption == ""
        with pytest.raises(gr.Error, match=EXPECTED[kind]):
            api_caption(service, upload)
    with pytest.raises(gr.Error, match="no image"):
        api_caption(service, None)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), "blue").save(buf, "PNG")
    inline = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert caption_image(service, {"url": inline}).image.size == (64, 48)  # pasted inline
    too_big = "A" * 4 * (service.max_upload_bytes // 3 + 2)  # decodes to just over the limit
    with pytest.raises(ImageError, match="MB limit"):
        caption_image(service, {"url": "data:image/png;base64," + too_big})
    with pytest.raises(gr.Error, match="unknown model"):
        api_caption(service, str(tmp_path / "notes.txt"), "nope")


def test_concurrent_requests_are_batched_with_the_same_results(service: CaptionService):
    photos = [photo(i) for i in range(4)]
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


# ---------------------------------------------------------------------------------------------
# The UI: handlers, controls, overlays


def test_ui_event_renders_every_word(service: CaptionService):
    upload = {"path": str(photo(1)), "orig_name": "photo.jpg"}
    status, caption, state, gallery, words, view, note, sheet, beams = events.ui_caption(
        service, upload, service.names[1], hard_mode="argmax")
    n = len(state["words"])
    assert caption and "hard attention" in status and len(gallery) == n
    assert [label.split()[0] for _, label in gallery] == state["words"]
    assert "row " in gallery[0][1]  # argmax: the chosen location is named
    assert words["choices"] == [(w, i) for i, w in enumerate(state["words"])]
    assert view.width > state["image"].width  # the overlay plus the colour scale
    assert "uniform attention would be 1/" in note
    assert sheet.height > 200 and beams[0][0] == caption
    # stepping through the words gives a different overlay for a different attention map
    if n > 1 and not np.allclose(state["attention"][0], state["attention"][1]):
        first, second = (np.asarray(events.show_word(state, i)[0]) for i in (0, 1))
        assert not np.array_equal(first, second)
    assert events.show_word(state, n) == (None, "") and events.show_word(None, 0) == (None, "")


def test_decoding_controls_follow_the_model(service: CaptionService):
    soft, hard = service.names
    app = build_app(service)
    props = {c["props"].get("elem_id"): c["props"] for c in app.config["components"]}
    assert props["beam-size"]["maximum"] == MAX_BEAM_SIZE  # decoding.py's limits
    assert props["max-length"]["maximum"] == MAX_CAPTION_LENGTH
    assert props["hard-mode"]["visible"] is False  # the default model is soft
    assert props["rerank"]["visible"] is False  # neither model has a consensus index
    beam, length, mode, penalty, no_repeat, rerank = events.model_controls(service, hard)
    assert rerank["visible"] is False and rerank["value"] == "none"
    assert mode["visible"] is True and mode["value"] == "expectation"  # the stored mode
    assert (beam["value"], length["value"]) == (3, 8)
    assert events.model_controls(service, soft)[2]["visible"] is False
    # a soft model ignores the (hidden) hard-mode control
    status = events.ui_caption(service, black(), soft, hard_mode="sample")[0]
    assert "soft attention" in status and "hard mode" not in status


def test_frame_only_when_decoded_from_one_cell(service: CaptionService):
    """The white frame marks a cell only in argmax / sample mode; the expected context (like
    soft attention) chooses none, and the status line says so."""
    hard = service.names[1]
    img = black()  # jet blended over black is never pure white: white pixels are frames
    for mode in ("argmax", "sample"):
        status, _, state, gallery, _, view, *_ = events.ui_caption(service, img, hard,
                                                                   hard_mode=mode)
        assert state["locations"] and "White frames mark" in status
        assert ("most likely" if mode == "argmax" else "sampled") in status
        photo_part = view.crop((0, 0, *state["image"].size))  # not the bar's white margin
        assert white_pixels(photo_part) > 0 and white_pixels(gallery[0][0]) > 0
    status, _, state, gallery, _, view, *_ = events.ui_caption(service, img, hard,
                                                               hard_mode="expectation")
    assert state["locations"] is None and "expected context" in status
    assert "no single cell was chosen" in status and "White frames" not in status
    assert white_pixels(view.crop((0, 0, *state["image"].size))) == 0
    assert white_pixels(gallery[0][0]) == 0
    assert all("row" not in label for _, label in gallery)


def test_rejected_upload_clears_every_output(service: CaptionService, tmp_path: Path):
    good = events.ui_caption(service, str(photo(0)))
    assert good[1] and good[3]
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(photo(0).read_bytes()[:2000])
    with pytest.warns(UserWarning):
        status, caption, state, gallery, words, view, note, sheet, beams = events.ui_caption(
            service, {"path": str(bad), "orig_name": "cut.jpg"})
    assert "cut.jpg" in status
    assert (caption, state, gallery, view, note, sheet, beams) == ("", None, [], None, "", None,
                                                                  [])
    assert words["choices"] == [] and words["value"] is None
    # Gradio sets the image to None when it refuses an upload (too large) or it is removed
    cleared = events.clear_outputs(None)
    assert cleared[0] == events.PROMPT and cleared[1:] == events.EMPTY
    assert all(x == gr.skip() for x in events.clear_outputs({"path": "x.jpg"}))


def test_caption_runs_once_per_upload(service: CaptionService):
    """image.change fires twice when a new file replaces a shown one (every toast showed twice):
    the caption runs on upload, the button and an example click, never on change."""
    app = build_app(service, find_examples())
    ids = {c["id"]: c["props"].get("elem_id") for c in app.config["components"]}
    caption_triggers = []
    for dep in app.config["dependencies"]:
        if len(dep["outputs"]) == 9:  # the caption event and the clear event
            caption_triggers.append({(ids.get(t[0]), t[1]) for t in dep["targets"]})
    assert {("input-image", "upload"), ("caption-button", "click")} in caption_triggers
    assert {("input-image", "change")} in caption_triggers  # the clear event
    for triggers in caption_triggers:
        assert not {("input-image", "upload"), ("input-image", "change")} <= triggers


def test_colour_scale_labelled_with_real_weights():
    g = 4
    uniform = np.full((g, g), 1 / g**2, np.float32)
    focused = np.full((g, g), 0.2 / (g**2 - 1), np.float32)
    focused[1, 2] = 0.8
    image = Image.new("RGB", (128, 128), (128, 128, 128))
    state = {"image": image, "small": image, "attention": np.stack([uniform, focused]),
             "locations": None, "words": ["sky", "dog"]}
    assert drawing.scale_max(state["attention"], 0, "word") == pytest.approx(1 / 16)
    assert drawing.scale_max(state["attention"], 0, "caption") == pytest.approx(0.8)

    def change(img: Image.Image) -> float:  # how much the overlay colours the photo
        return float(np.abs(np.asarray(img.crop((0, 0, 128, 128)), np.float32) - 128).mean())

    own, own_note = events.show_word(state, 0, "word")
    fixed, fixed_note = events.show_word(state, 0, "caption")
    # on its own scale a uniform map is as strong as a focused one; on the caption's it is pale
    assert change(fixed) < change(own) / 2
    assert "**0.062**" in own_note and "**0.800**" in fixed_note
    assert "1/16 = 0.062" in own_note and "any word of this caption" in fixed_note
    # the bar: a tick at the uniform level 1/16 on the 0..0.8 scale
    bar = drawing.with_colour_bar(image, 0.8, 16)
    y = round((1 - (1 / 16) / 0.8) * 127)
    assert bar.width > image.width + 60 and bar.getpixel((128 + 8 - 2, y)) == (0, 0, 0)
    # the gallery follows the scale too
    pale, strong = (np.asarray(p, np.float32) for p, _ in drawing.gallery(state, "caption"))
    assert np.abs(pale - 128).max() < np.abs(strong - 128).max() / 2  # the strongest colour
    assert drawing.gallery(state, "word")[1][1] == "dog  (max 0.800)"
    gallery, view, note = events.rescale(state, 1, "caption")
    assert len(gallery) == 2 and "“dog”" not in note


# ---------------------------------------------------------------------------------------------
# Example photos, package data, module layout, README


def test_example_photos_ship_with_the_package():
    examples = find_examples()
    assert len(examples) >= 3 and all(p.parent == EXAMPLES_DIR.resolve() for p in examples)
    readme = (EXAMPLES_DIR / "README.md").read_text()
    line = next(x for x in (ROOT / "pyproject.toml").read_text().splitlines()
                if x.startswith('"showattendtell.service" = ['))  # package-data (tomllib: 3.11+)
    patterns = re.findall(r'"([^"]+)"', line.split("=", 1)[1])
    for p in examples:
        assert not re.fullmatch(r"\d{12}\.jpg", p.name)  # not the COCO file name
        assert p.stat().st_size < 150_000
        with Image.open(p) as img:
            assert img.format == "JPEG" and 480 <= max(img.size) <= 640
        row = next(line for line in readme.splitlines() if f"`{p.name}`" in line)
        assert re.search(r"\| \d+ \(", row) and "staticflickr.com" in row
        assert "creativecommons.org/licenses/by" in row
        assert any(fnmatch.fnmatch(f"examples/{p.name}", pat) for pat in patterns)
    assert "resized" in readme.lower()
    assert find_examples([]) == []


def test_service_modules():
    import showattendtell.service.app as app_module

    for name in ("worker", "uploads", "drawing", "captioning", "events", "app", "auth", "serve"):
        assert (ROOT / "service" / f"{name}.py").is_file()
    source = (ROOT / "service" / "app.py").read_text()
    assert "MAX_BEAM_SIZE = " not in source and "DecompressionBombError" not in source
    assert not hasattr(app_module, "caption_image")  # app.py is the layout only


def test_readme_documents_existing_serve_options():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Web service", 1)[1].split("\n## ", 1)[0]
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    known = {s for a in serve._actions for s in a.option_strings}
    documented = set(re.findall(r"`(--[a-z-]+)", section))
    assert documented and documented <= known, documented - known
    for option in ("--auth-file", "--beam-size", "--hard-mode", "--model"):
        assert option in documented
    assert AUTH_ENV in section


# ---------------------------------------------------------------------------------------------
# Live server: the API through gradio_client, and a real browser


@pytest.mark.slow
def test_api_through_gradio_client(server: str, service: CaptionService, tmp_path: Path):
    from gradio_client import Client, handle_file

    soft, hard = service.names
    client = Client(server, verbose=False)
    d = client.predict(handle_file(str(photo(0))), api_name="/caption")
    direct = caption_image(service, str(photo(0))).to_json()
    assert d["caption"] == direct["caption"] and d["words"] == direct["words"]
    assert np.allclose(d["attention"], direct["attention"], atol=1e-4)
    assert d["model"] == soft and d["decoding"] == service.get(soft).decoding.to_dict()
    # another model without options: its own defaults, not the first model's
    h = client.predict(handle_file(str(photo(0))), model=hard, api_name="/caption")
    assert h["decoding"] == service.get(hard).decoding.to_dict() and h["locations"] is None
    h = client.predict(handle_file(str(photo(0))), model=hard, beam_size=1, max_length=5,
                       hard_mode="argmax", api_name="/caption")
    assert h["model"] == hard and len(h["words"]) <= 5 and h["locations"]
    assert h["decoding"]["beam_size"] == 1
    for kw, message in [({"beam_size": 0}, "beam size"), ({"max_length": 1000}, "maximum length"),
                        ({"hard_mode": "best"}, "hard-attention mode")]:
        with pytest.raises(Exception, match=message):
            client.predict(handle_file(str(photo(0))), api_name="/caption", **kw)
    wide = tmp_path / "wide.png"
    Image.new("RGB", (900, 40), "green").save(wide)
    assert "aspect ratio" in client.predict(handle_file(str(wide)), api_name="/caption")["warning"]

    for kind, path in _bad_inputs(tmp_path).items():
        with pytest.raises(Exception, match=EXPECTED[kind]):
            client.predict(handle_file(str(path)), api_name="/caption")
    big = tmp_path / "noise.png"  # over the 1 MB upload limit
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (800, 800, 3), np.uint8)).save(big)
    with pytest.raises(Exception, match="(?i)size|large|limit"):
        client.predict(handle_file(str(big)), api_name="/caption")
    # still serving after all that
    again = client.predict(handle_file(str(photo(0))), api_name="/caption")
    assert again["caption"] == d["caption"]


TOAST_OBSERVER = """() => {
  window.__toasts = [];
  new MutationObserver(records => {
    for (const r of records) for (const n of r.addedNodes) {
      if (n.nodeType !== 1) continue;
      const found = n.matches('.toast-body') ? [n] : [...n.querySelectorAll('.toast-body')];
      for (const t of found) window.__toasts.push(t.innerText);
    }
  }).observe(document.body, {childList: true, subtree: true});
}"""


def _outputs(page) -> dict:
    return {"caption": page.input_value("#caption-text textarea"),
            "words": page.locator("#words input[type=radio]").count(),
            "gallery": page.locator("#word-gallery img").count(),
            "view": page.locator("#word-view img").count(),
            "sheet": page.locator("#caption-sheet img").count(),
            "note": page.inner_text("#scale-note").strip()}


def _wait_for_outputs(page, expected: dict, timeout_s: float = 30.0) -> None:
    """The outputs settle to ``expected``: a word-selection event of the previous caption may
    still be in flight when the status line changes."""
    deadline = time.monotonic() + timeout_s
    while _outputs(page) != expected and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert _outputs(page) == expected


def _status_has(page, text: str) -> None:
    page.wait_for_function(
        f"document.querySelector('#status')?.innerText.includes({json.dumps(text)})",
        timeout=90_000)


@pytest.mark.slow
@pytest.mark.browser
@needs_chromium
def test_browser_hard_mode_frames_and_rejected_uploads(server: str, service: CaptionService,
                                                       tmp_path: Path):
    playwright = pytest.importorskip("playwright.sync_api")
    hard = service.names[1]
    shot = tmp_path / "service_ui.png"
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(photo(0).read_bytes()[:3000])
    big = tmp_path / "noise.png"  # over the server's 1 MB limit: Gradio refuses it
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (800, 800, 3), np.uint8)).save(big)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            joins: list[str] = []
            page.on("request", lambda r: joins.append(r.url) if "/queue/join" in r.url else None)
            page.goto(server)
            upload = "#input-image input[type=file]"
            page.wait_for_selector(upload, state="attached", timeout=60_000)
            page.evaluate(TOAST_OBSERVER)
            expect = playwright.expect

            # the hard-mode control: hidden for the soft model, the stored mode for the hard one
            expect(page.locator("#hard-mode")).to_be_hidden()
            page.locator("#model input").click()
            page.get_by_role("option", name=f"{hard} (hard attention)").click()
            expect(page.locator("#hard-mode")).to_be_visible()
            expect(page.locator("#hard-mode input[value=expectation]")).to_be_checked()

            # expected context: said so, no frame
            page.set_input_files(upload, str(photo(0)))
            _status_has(page, "Captioned by")
            status = page.inner_text("#status")
            assert "expected context" in status and "White frames" not in status
            n = len(page.input_value("#caption-text textarea").split())
            expect(page.locator("#word-gallery img")).to_have_count(n)
            assert "uniform attention would be 1/" in page.inner_text("#scale-note")

            # argmax: frames, said so
            page.locator("#hard-mode label", has_text="argmax").click()
            page.locator("#caption-button").click()
            _status_has(page, "White frames mark")
            assert "hard mode argmax" in page.inner_text("#status")
            page.wait_for_selector("#caption-sheet img", timeout=30_000)
            previous = page.input_value("#caption-text textarea")
            assert previous in page.inner_text("#beams")
            page.screenshot(path=str(shot), full_page=True)

            # a broken file replacing the photo: one event, one toast (clear of the status
            # line), and the previous photo's caption, words, overlays, sheet and beams cleared
            page.evaluate("window.__toasts = []")
            before = len(joins)
            page.set_input_files(upload, str(bad))
            _status_has(page, "Cannot caption this file")
            page.wait_for_selector(".toast-body", timeout=30_000)
            # a second event would have been sent together with the first (old code: two)
            assert len(joins) - before == 1
            toasts = page.evaluate("window.__toasts")
            assert len(toasts) == 1 and "corrupt or truncated" in toasts[0]
            assert page.locator(".toast-count").count() == 0  # no "Warning (2)"
            box, status_box = (page.locator(s).first.bounding_box()
                               for s in (".toast-body", "#status"))
            assert (box["y"] >= status_box["y"] + status_box["height"]
                    or box["y"] + box["height"] <= status_box["y"])
            assert "cut.jpg" in page.inner_text("#status")
            cleared = {"caption": "", "words": 0, "gallery": 0, "view": 0, "sheet": 0,
                       "note": ""}
            expect(page.locator("#word-gallery img")).to_have_count(0)
            _wait_for_outputs(page, cleared)
            assert previous not in page.inner_text("#beams")

            # a good photo again, then one over the upload limit: refused by Gradio, cleared
            page.set_input_files(upload, str(photo(1)))
            _status_has(page, "Captioned by")
            page.set_input_files(upload, str(big))
            _status_has(page, events.PROMPT)
            expect(page.locator("#word-gallery img")).to_have_count(0)
            _wait_for_outputs(page, cleared)

            # back to the soft model: the control hides; an example photo captions
            page.locator("#model input").click()
            page.get_by_role("option", name=f"{service.names[0]} (soft attention)").click()
            expect(page.locator("#hard-mode")).to_be_hidden()
            page.locator("#examples img").first.click()
            _status_has(page, "soft attention")
            n = len(page.input_value("#caption-text textarea").split())
            expect(page.locator("#word-gallery img")).to_have_count(n)
            if n > 1:  # clicking a word's panel selects that word and shows it
                words = page.input_value("#caption-text textarea").split()
                page.locator("#word-gallery img").nth(1).click()
                expect(page.locator("#words input:checked")).to_have_attribute("value", "1")
                expect(page.locator("#scale-note")).to_contain_text(f"“{words[1]}”")
                page.locator("#words label").nth(0).click()  # and so does a word of the list
                expect(page.locator("#scale-note")).to_contain_text(f"“{words[0]}”")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_serve_takes_the_precision_option(tiny_model_file):
    """`sat serve --precision` reaches every loaded model (bf16 autocast works on a CPU too)."""
    from showattendtell.service.worker import load_service

    args = build_parser().parse_args(["serve", "--precision", "bf16"])
    assert args.precision == "bf16"
    service = load_service([tiny_model_file], "cpu", precision="bf16")
    try:
        assert all(c.autocast is not None for c in service.captioners.values())
        assert service.caption(Image.new("RGB", (64, 64), (200, 30, 30))).words
    finally:
        service.close()


def test_a_model_with_a_consensus_index_reranks_in_the_ui_and_the_api(tiny_model_file, tmp_path):
    """The rerank control appears for a model with an index and starts at its stored value;
    the API's rerank option turns it off or on per request."""
    from showattendtell.consensus import ConsensusIndex
    from showattendtell.decoding import DecodingConfig
    from showattendtell.model_file import read_model, save_model

    model, _, _ = read_model(tiny_model_file)
    refs = [["a red circle"], ["a blue square"], ["two green circles"], ["a red square"]]
    model.consensus = ConsensusIndex(torch.randn(4, model.encoder.config.feature_dim), refs, 2)
    path = save_model(model, tmp_path / "indexed.safetensors",
                      DecodingConfig(beam_size=3, rerank="consensus"))
    svc = load_service([path, tiny_model_file], device="cpu")
    try:
        indexed, plain = svc.names
        props = {c["props"].get("elem_id"): c["props"]
                 for c in build_app(svc).config["components"]}
        assert props["rerank"]["visible"] is True and props["rerank"]["value"] == "consensus"
        assert events.model_controls(svc, plain)[-1]["visible"] is False
        for choice in ("none", "consensus", None):
            d = api_caption(svc, str(photo(0)), indexed, rerank=choice)
            assert d["decoding"]["rerank"] == (choice or "consensus") and d["caption"]
        # the UI's control (set for the first model) is ignored for a model without an index
        status = events.ui_caption(svc, str(photo(0)), plain, rerank="consensus")[0]
        assert "Cannot caption" not in status
    finally:
        svc.close()
