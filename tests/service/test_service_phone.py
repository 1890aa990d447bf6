"""The page in a real headless Chromium at a phone's width (400 px): everything stacks within
the screen, the phone's caption sheet is readable, and a HEIC upload gets a preview."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.photos import photo
from PIL import Image

pytest.importorskip("gradio")
from showattendtell.service import drawing  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
WIDTH = 400

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="Debian chromium not installed at /usr/bin/chromium (apt-get install chromium; "
        ".ci/run does)",
    ),
]

# The left and right edges (CSS px) of what must be on screen, and the page's own width.
BOXES = """() => {
  const box = e => { const b = e.getBoundingClientRect(); return [b.left, b.right, b.width]; };
  const all = s => [...document.querySelectorAll(s)].map(box);
  const sheet = document.querySelector('#caption-sheet-phone img');
  return {
    page: document.documentElement.scrollWidth,
    gallery: all('#word-gallery .thumbnail-item'),
    tables: all('#beams table'),
    sheet: sheet ? [...box(sheet), sheet.naturalWidth] : null,
    wide_sheet: all('#caption-sheet img').filter(b => b[2] > 0),
  };
}"""

STYLE = "e => [getComputedStyle(e).fontSize, getComputedStyle(e).color]"


def _status_has(page, text: str) -> None:
    page.wait_for_function(
        f"document.querySelector('#status')?.innerText.includes({json.dumps(text)})", timeout=90_000
    )


def test_the_page_fits_a_phone(server: str, service, tmp_path: Path):
    pillow_heif = pytest.importorskip("pillow_heif")
    playwright = pytest.importorskip("playwright.sync_api")
    heic = tmp_path / "phone.heic"  # what a phone uploads; no browser shows it
    pillow_heif.from_pillow(Image.open(photo(1)).convert("RGB")).save(heic, quality=90)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 800})
            page.goto(server)
            upload = "#input-image input[type=file]"
            page.wait_for_selector(upload, state="attached", timeout=60_000)
            page.set_input_files(upload, str(heic))
            _status_has(page, "Captioned by")
            n = len(page.input_value("#caption-text textarea").split())
            expect = playwright.expect
            expect(page.locator("#word-gallery .thumbnail-item")).to_have_count(n)
            # the HEIC's preview, decoded by the server, shows (the input panel cannot)
            expect(page.locator("#input-preview img")).to_be_visible()
            page.wait_for_function(
                "document.querySelector('#input-preview img')?.naturalWidth > 0", timeout=30_000
            )
            page.wait_for_selector("#caption-sheet-phone img", state="attached", timeout=30_000)
            page.locator("#caption-sheet-phone img").scroll_into_view_if_needed()
            page.wait_for_function(
                "document.querySelector('#caption-sheet-phone img')?.naturalWidth > 0",
                timeout=30_000,
            )
            page.screenshot(path=str(tmp_path / "phone.png"), full_page=True)
            boxes = page.evaluate(BOXES)
            # the hard-attention control's help: the size and colour of the status line's text
            page.locator("#model input").click()
            page.get_by_role("option", name=f"{service.names[1]} (hard attention)").click()
            expect(page.locator("#hard-mode .info-text")).to_be_visible()
            help_text, body = (
                page.eval_on_selector(s, STYLE) for s in ("#hard-mode .info-text", "#status p")
            )
            # the photo removed: the prompt, no outputs, no preview
            _status_has(page, "hard attention")  # the other model's caption arrived
            page.locator('#input-image button[aria-label="Remove Image"]').click()
            _status_has(page, "Upload, paste or pick")
            expect(page.locator("#word-gallery .thumbnail-item")).to_have_count(0)
            expect(page.locator("#input-preview")).to_be_hidden()
        finally:
            browser.close()
    assert boxes["page"] <= WIDTH  # nothing makes the page scroll sideways
    for left, right, _ in boxes["gallery"] + boxes["tables"]:
        assert left >= 0 and right <= WIDTH, boxes
    assert len(boxes["gallery"]) == n and boxes["tables"]
    left, right, shown, natural = boxes["sheet"]
    assert left >= 0 and right <= WIDTH and boxes["wide_sheet"] == []  # the phone's sheet
    assert 16 * drawing.PHONE_TEXT * shown / natural >= 11  # its labels at 11 px or more
    assert help_text == body, (help_text, body)  # not 12 px pale grey
