"""The live service: the /caption API through gradio_client against a server on 127.0.0.1
(with and without a login), and a real headless Chromium session on the page."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers.photos import noise, photo
from PIL import Image

gr = pytest.importorskip("gradio")
from helpers.service import EXPECTED, bad_inputs, free_port  # noqa: E402
from showattendtell.service.app import launch  # noqa: E402
from showattendtell.service.auth import read_auth  # noqa: E402
from showattendtell.service.captioning import caption_image  # noqa: E402
from showattendtell.service.worker import CaptionService  # noqa: E402

from showattendtell.images.files import open_image  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian chromium not installed at /usr/bin/chromium (apt-get install chromium; "
    ".ci/run does)",
)


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


def applying(service: CaptionService, name: str) -> dict:
    """A model's stored decoding as the API reports it (the options that apply to it)."""
    return {
        k: v
        for k, v in service.get(name).decoding.to_dict().items()
        if k != "rerank" and (k != "hard_mode" or service.get(name).attention_type == "hard")
    }


@pytest.mark.slow
def test_api_through_gradio_client(
    server: str,
    service: CaptionService,
    tmp_path: Path,
):
    from gradio_client import Client, handle_file

    soft, hard = service.names
    client = Client(server, verbose=False)
    d = client.predict(handle_file(str(photo(0))), api_name="/caption")
    # in this process, the photo decoded as the server decodes an upload (a path is refused
    # now that the app is launched: the server reads only what was uploaded to it)
    decoded = open_image(str(photo(0)), min_size=service.get(soft).input_size)
    direct = caption_image(service, decoded).to_json()
    assert d["caption"] == direct["caption"] and d["words"] == direct["words"]
    assert np.allclose(d["attention"], direct["attention"], atol=1e-4)
    assert d["model"] == soft and d["decoding"] == applying(service, soft)
    assert "hard_mode" not in d["decoding"] and "familiarity" in d
    # another model without options: its own defaults, not the first model's
    h = client.predict(handle_file(str(photo(0))), model=hard, api_name="/caption")
    assert h["decoding"] == applying(service, hard) and h["locations"] is None
    h = client.predict(
        handle_file(str(photo(0))),
        model=hard,
        beam_size=1,
        max_length=5,
        hard_mode="argmax",
        api_name="/caption",
    )
    assert h["model"] == hard and len(h["words"]) <= 5 and h["locations"]
    assert h["decoding"]["beam_size"] == 1
    for kw, message in [
        ({"beam_size": 0}, "beam size"),
        ({"max_length": 1000}, "maximum length"),
        ({"hard_mode": "best"}, "hard-attention mode"),
    ]:
        with pytest.raises(Exception, match=message):
            client.predict(handle_file(str(photo(0))), api_name="/caption", **kw)
    wide = tmp_path / "wide.png"
    Image.new("RGB", (900, 40), "green").save(wide)
    assert "aspect ratio" in client.predict(handle_file(str(wide)), api_name="/caption")["warning"]

    for kind, path in bad_inputs(tmp_path).items():
        with pytest.raises(Exception, match=EXPECTED[kind]):
            client.predict(handle_file(str(path)), api_name="/caption")
    big = tmp_path / "noise.png"  # over the 1 MB upload limit
    noise((800, 800)).save(big)
    with pytest.raises(Exception, match="(?i)size|large|limit"):
        client.predict(handle_file(str(big)), api_name="/caption")
    # still serving after all that
    again = client.predict(handle_file(str(photo(0))), api_name="/caption")
    assert again["caption"] == d["caption"]


@pytest.mark.slow
def test_the_api_reads_no_file_it_did_not_receive(server: str, tmp_path: Path):
    """A client that names a path on the server (an image dict without Gradio's upload marker)
    gets one message, the same whether the path is a photo, a missing file, a folder or a way
    out of Gradio's cache folder: nothing the app did not receive is read, decoded or probed."""
    from gradio.utils import get_upload_folder
    from gradio_client import Client, handle_file

    client = Client(server, verbose=False)
    outside = tmp_path / "outside.jpg"
    Image.open(photo(0)).save(outside)
    out_of_cache = f"{get_upload_folder()}/../../../../../../{outside}"
    for path in (outside, tmp_path / "missing.jpg", tmp_path, "/etc/passwd", out_of_cache):
        with pytest.raises(Exception, match="other files on the server are not read"):
            client.predict({"path": str(path)}, api_name="/caption")
    assert client.predict(handle_file(str(outside)), api_name="/caption")["caption"]  # uploaded


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
    return {
        "caption": page.input_value("#caption-text textarea"),
        "words": page.locator("#words input[type=radio]").count(),
        "gallery": page.locator("#word-gallery img").count(),
        "view": page.locator("#word-view img").count(),
        "sheet": page.locator("#caption-sheet img").count(),
        "note": page.inner_text("#scale-note").strip(),
    }


def _wait_for_outputs(page, expected: dict, timeout_s: float = 30.0) -> None:
    """The outputs settle to ``expected``: a word-selection event of the previous caption may
    still be in flight when the status line changes."""
    deadline = time.monotonic() + timeout_s
    while _outputs(page) != expected and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert _outputs(page) == expected


def _status_has(page, text: str) -> None:
    page.wait_for_function(
        f"document.querySelector('#status')?.innerText.includes({json.dumps(text)})", timeout=90_000
    )


@pytest.mark.slow
@pytest.mark.browser
@needs_chromium
def test_browser_hard_mode_frames_and_rejected_uploads(
    server: str,
    service: CaptionService,
    tmp_path: Path,
):
    playwright = pytest.importorskip("playwright.sync_api")
    hard = service.names[1]
    shot = tmp_path / "service_ui.png"
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(photo(0).read_bytes()[:3000])
    big = tmp_path / "noise.png"  # over the server's 1 MB limit: Gradio refuses it
    noise((800, 800)).save(big)
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
            # one request: no second event sent together with the first
            assert len(joins) - before == 1
            toasts = page.evaluate("window.__toasts")
            assert len(toasts) == 1 and "corrupt or truncated" in toasts[0]
            assert page.locator(".toast-count").count() == 0  # no "Warning (2)"
            box, status_box = (
                page.locator(s).first.bounding_box() for s in (".toast-body", "#status")
            )
            assert (
                box["y"] >= status_box["y"] + status_box["height"]
                or box["y"] + box["height"] <= status_box["y"]
            )
            assert "cut.jpg" in page.inner_text("#status")
            cleared = {"caption": "", "words": 0, "gallery": 0, "view": 0, "sheet": 0, "note": ""}
            expect(page.locator("#word-gallery img")).to_have_count(0)
            _wait_for_outputs(page, cleared)
            assert previous not in page.inner_text("#beams")

            # a good photo again, then one over the upload limit: refused by Gradio, cleared
            page.set_input_files(upload, str(photo(1)))
            _status_has(page, "Captioned by")
            page.set_input_files(upload, str(big))
            _status_has(page, "exceed the maximum allowed size")
            expect(page.locator("#word-gallery img")).to_have_count(0)
            _wait_for_outputs(page, cleared)
            # the reason stays (the toast fades): the image's own clear leaves the status line
            assert "exceed the maximum allowed size" in page.inner_text("#status")
            # another refused file at once, while that refusal's toast still shows (Gradio
            # shows the two in one toast): reported too
            notes = tmp_path / "notes.txt"
            notes.write_text("not a photo\n")
            page.set_input_files(upload, str(big))
            page.set_input_files(upload, str(notes))
            _status_has(page, "notes.txt")
            assert "Cannot caption this file" in page.inner_text("#status")

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
            expect(page.locator("#colour-scale input[value=caption]")).to_be_checked()

            # another model captions the shown photo again, with no click
            page.locator("#model input").click()
            page.get_by_role("option", name=f"{hard} (hard attention)").click()
            _status_has(page, f"Captioned by {hard}")
            assert page.input_value("#caption-text textarea")
            page.screenshot(path=str(tmp_path / "service_ui_model_switch.png"), full_page=True)

            # a file type Gradio's page refuses before uploading (no server event of its own):
            # the previous photo's outputs are cleared as for any file that cannot be captioned
            page.set_input_files(upload, str(notes))
            _status_has(page, "Cannot caption this file")
            assert "notes.txt" in page.inner_text("#status")
            _wait_for_outputs(page, cleared)
            expect(page.locator("#word-gallery img")).to_have_count(0)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
