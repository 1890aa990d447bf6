"""The browser UI without a browser (service/events.py, drawing.py, options.py, app.py): the
handlers' outputs, the controls made from the option table, the events' wiring, overlays, the
colour scale and flat maps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.photos import photo
from PIL import Image

from showattendtell.search.decoding import DECODING_OPTIONS, MAX_BEAM_SIZE, MAX_CAPTION_LENGTH

gr = pytest.importorskip("gradio")
from helpers.service import white_pixels  # noqa: E402
from showattendtell.service import drawing, events, options  # noqa: E402
from showattendtell.service.app import build_app  # noqa: E402
from showattendtell.service.cache import CacheBound  # noqa: E402
from showattendtell.service.uploads import find_examples  # noqa: E402
from showattendtell.service.worker import CaptionService  # noqa: E402


def outputs(values) -> dict:
    """A caption event's outputs by name."""
    return dict(zip(events.OUTPUTS, values, strict=True))


def is_cleared(values) -> bool:
    """Whether a caption event's outputs clear everything after the status line."""
    out = outputs(values)
    return (
        out["warning"]["visible"] is False
        and (out["caption"], out["state"], out["gallery"], out["view"], out["note"])
        == ("", None, [], None, "")
        and out["sheet"] is None
        and out["phone_sheet"] is None
        and out["words"]["choices"] == []
        and out["beams"]["value"].empty
    )


def components(app) -> dict:
    return {c["props"].get("elem_id"): c for c in app.config["components"]}


def test_ui_event_renders_every_word(service: CaptionService):
    upload = {"path": str(photo(1)), "orig_name": "photo.jpg"}
    out = outputs(events.ui_caption(service, upload, service.names[1], hard_mode="argmax"))
    state, gallery = out["state"], out["gallery"]
    n = len(state["words"])
    assert out["caption"] and "hard attention" in out["status"] and len(gallery) == n
    assert [label.split()[0] for _, label in gallery] == state["words"]
    assert "row " in gallery[0][1]  # argmax: the chosen location is named
    assert out["words"]["choices"] == [(w, i) for i, w in enumerate(state["words"])]
    assert out["view"].width > state["image"].width  # the overlay plus the colour scale
    assert "uniform attention would be 1/" in out["note"]
    assert out["sheet"].height > 200
    assert out["beams"]["value"].iloc[0]["caption"] == out["caption"]
    assert out["warning"]["visible"] is False  # a fine photo, a model without an index
    if n > 1 and not np.allclose(state["attention"][0], state["attention"][1]):
        first, second = (np.asarray(events.show_word(state, i)[0]) for i in (0, 1))
        assert not np.array_equal(first, second)
    assert events.show_word(state, n) == (None, "") and events.show_word(None, 0) == (None, "")


def test_controls_come_from_the_option_table(service: CaptionService):
    """Every DecodingConfig option is a UI control (elem_id: its flag) and an API input (named
    after its field), with the table's range; nothing in app.py names an option."""
    app = build_app(service)
    comps = components(app)
    for name, opt in DECODING_OPTIONS.items():
        assert options.elem_id(opt) in comps, name
    labels = {c["props"].get("label") for c in app.config["components"]}
    assert set(DECODING_OPTIONS) <= labels  # the API's hidden inputs
    assert comps["beam-size"]["props"]["maximum"] == MAX_BEAM_SIZE  # decoding.py's limits
    assert comps["max-length"]["props"]["maximum"] == MAX_CAPTION_LENGTH
    assert comps["min-length"]["props"]["maximum"] == MAX_CAPTION_LENGTH
    source = (Path(options.__file__).parent / "app.py").read_text()
    for name in DECODING_OPTIONS:
        assert name not in source and options.elem_id(DECODING_OPTIONS[name]) not in source


def test_a_new_option_in_the_table_reaches_the_ui_and_the_api(service, monkeypatch):
    from dataclasses import replace

    extra = replace(DECODING_OPTIONS["beam_size"], name="top_k", label="top k")
    table = {**DECODING_OPTIONS, "top_k": extra}
    monkeypatch.setattr(options, "DECODING_OPTIONS", table)
    for captioner in service.captioners.values():  # as if DecodingConfig had the field
        stored = SimpleNamespace(**captioner.decoding.to_dict(), top_k=0)
        monkeypatch.setattr(captioner, "decoding", stored)
    app = build_app(service)
    assert "top-k" in components(app)
    assert "top_k" in {c["props"].get("label") for c in app.config["components"]}
    assert len(options.control_updates(service.get(None))) == len(table)


def test_decoding_controls_follow_the_model(service: CaptionService):
    soft, hard = service.names
    comps = components(build_app(service))
    assert comps["hard-mode"]["props"]["visible"] is False  # the default model is soft
    assert comps["rerank"]["props"]["visible"] is False  # neither model has a consensus index
    updates = dict(zip(DECODING_OPTIONS, events.model_controls(service, hard), strict=True))
    assert updates["rerank"]["visible"] is False and updates["rerank"]["value"] == "none"
    assert updates["hard_mode"]["visible"] is True
    assert updates["hard_mode"]["value"] == "expectation"  # the stored mode
    assert (updates["beam_size"]["value"], updates["max_length"]["value"]) == (3, 8)
    soft_updates = dict(zip(DECODING_OPTIONS, events.model_controls(service, soft), strict=True))
    assert soft_updates["hard_mode"]["visible"] is False
    # a soft model ignores the (hidden) hard-mode control
    status = events.ui_caption(service, Image.new("RGB", (160, 120)), soft, hard_mode="sample")[0]
    assert "soft attention" in status and "hard mode" not in status


def test_choosing_another_model_captions_the_photo_again(service: CaptionService):
    """The model menu's change sets the controls to the model's defaults and then runs the
    caption event on the shown photo, so the caption never stays under another model's name."""
    app = build_app(service)
    ids = {c["id"]: c["props"].get("elem_id") for c in app.config["components"]}
    deps = app.config["dependencies"]
    first = next(
        d for d in deps if ("model", "change") in {(ids.get(t[0]), t[1]) for t in d["targets"]}
    )
    then = [d for d in deps if d.get("trigger_after") == first["id"]]
    assert len(then) == 1 and len(then[0]["outputs"]) == len(events.OUTPUTS)
    caption_inputs = {ids.get(i) for i in then[0]["inputs"]}
    assert {"input-image", "model", "colour-scale", "beam-size"} <= caption_inputs
    # and what that event does: the other model's caption, named after it
    soft, hard = service.names
    status = events.ui_caption(service, str(photo(0)), hard)[0]
    assert f"**{hard}**" in status and "hard attention" in status


def test_a_model_with_a_consensus_index_reranks_in_the_ui(
    indexed_service: CaptionService,
):
    """The rerank control appears for a model with an index and starts at its stored value;
    the beam table is ordered by the consensus score it shows and says that it decided."""
    indexed, plain = indexed_service.names
    comps = components(build_app(indexed_service))
    assert comps["rerank"]["props"]["visible"] is True
    assert comps["rerank"]["props"]["value"] == "consensus"
    assert (
        dict(zip(DECODING_OPTIONS, events.model_controls(indexed_service, plain), strict=True))[
            "rerank"
        ]["visible"]
        is False
    )
    out = outputs(events.ui_caption(indexed_service, str(photo(0)), indexed, beam_size=3))
    table, label = out["beams"]["value"], out["beams"]["label"]
    decided = table["consensus"].tolist()
    assert decided == sorted(decided, reverse=True) and table.iloc[0]["caption"] == out["caption"]
    assert "consensus reranking" in label and "not their score" in label
    assert "Familiarity **" in out["status"]
    out = outputs(events.ui_caption(indexed_service, str(photo(0)), indexed, rerank="none"))
    table = out["beams"]["value"]
    scores = table[[c for c in table.columns if c.startswith("score")][0]].tolist()
    assert scores == sorted(scores, reverse=True) and "ranked by score" in out["beams"]["label"]
    # the UI's control (set for the first model) is ignored for a model without an index
    status = events.ui_caption(indexed_service, str(photo(0)), plain, rerank="consensus")[0]
    assert "Cannot caption" not in status


def test_familiarity_warning_is_shown(
    indexed_service: CaptionService,
    monkeypatch,
):
    from showattendtell.search import familiarity

    monkeypatch.setattr(familiarity.Familiarity, "warning", lambda self, *a: familiarity.WARNING)
    indexed, _ = indexed_service.names
    out = outputs(events.ui_caption(indexed_service, str(photo(0)), indexed))
    assert out["warning"]["visible"] is True and familiarity.WARNING in out["warning"]["value"]


def test_frame_only_when_decoded_from_one_cell(service: CaptionService):
    """The white frame marks a cell only in argmax / sample mode; the expected context (like
    soft attention) chooses none, and the status line says so."""
    hard = service.names[1]
    # black: jet blended over black is never pure white, so white pixels are frames
    img = Image.new("RGB", (160, 120))
    for mode in ("argmax", "sample"):
        out = outputs(events.ui_caption(service, img, hard, hard_mode=mode))
        state, gallery, view = out["state"], out["gallery"], out["view"]
        assert state["locations"] and "White frames mark" in out["status"]
        assert ("most likely" if mode == "argmax" else "sampled") in out["status"]
        photo_part = view.crop((0, 0, *state["image"].size))  # not the bar's white margin
        assert white_pixels(photo_part) > 0 and white_pixels(gallery[0][0]) > 0
    out = outputs(events.ui_caption(service, img, hard, hard_mode="expectation"))
    state, gallery, view = out["state"], out["gallery"], out["view"]
    assert state["locations"] is None and "expected context" in out["status"]
    assert "no single cell was chosen" in out["status"] and "White frames" not in out["status"]
    assert white_pixels(view.crop((0, 0, *state["image"].size))) == 0
    assert white_pixels(gallery[0][0]) == 0
    assert all("row" not in label for _, label in gallery)


def test_rejected_upload_clears_every_output(service: CaptionService, tmp_path: Path):
    good = outputs(events.ui_caption(service, str(photo(0))))
    assert good["caption"] and good["gallery"]
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(photo(0).read_bytes()[:2000])
    with pytest.warns(UserWarning):
        out = outputs(events.ui_caption(service, {"path": str(bad), "orig_name": "cut.jpg"}))
    assert "cut.jpg" in out["status"]
    assert (
        out["caption"],
        out["state"],
        out["gallery"],
        out["view"],
        out["note"],
        out["sheet"],
    ) == ("", None, [], None, "", None)
    assert out["beams"]["value"].empty and out["warning"]["visible"] is False
    assert out["words"]["choices"] == [] and out["words"]["value"] is None
    # Gradio sets the image to None when it refuses an upload (too large) or it is removed
    # (the status line is left to the refusal's reason, or to the removal's prompt)
    cleared = events.clear_outputs(None)
    assert cleared[0] == gr.skip() and is_cleared(cleared)
    assert events.removed()[0] == events.PROMPT and is_cleared(events.removed())
    assert all(x == gr.skip() for x in events.clear_outputs({"path": "x.jpg"}))
    # Gradio pops the values of the update dicts it is given: each clear gets its own
    first = events.cleared()
    first[-1].pop("value")
    assert "value" in events.cleared()[-1]


def test_file_type_refused_by_gradio_clears_the_outputs(service: CaptionService):
    """Gradio's page refuses a .txt or .pdf before uploading it (a toast, no server event);
    the page's script reports it through a hidden button whose event clears the outputs."""
    out = events.refused_upload("Invalid file type: notes.txt. Only image/* allowed.")
    assert out[0].startswith("**Cannot caption this file:**") and "notes.txt" in out[0]
    assert is_cleared(out)
    app = build_app(service)
    ids = {c["id"]: c["props"].get("elem_id") for c in app.config["components"]}
    refusal = [
        d
        for d in app.config["dependencies"]
        if ("refused-upload", "click") in {(ids.get(t[0]), t[1]) for t in d["targets"]}
    ]
    assert len(refusal) == 1 and len(refusal[0]["outputs"]) == len(events.OUTPUTS)
    assert "__satRefused" in refusal[0]["js"]
    from showattendtell.service.app import CSS, REFUSAL_JS

    assert "#refused-upload" in REFUSAL_JS and "Invalid file type" in REFUSAL_JS
    # an upload over the limit: Gradio's toast fades; its reason stays in the status line
    assert "File\\(s\\) exceed the maximum allowed size" in REFUSAL_JS
    reason = "File(s) exceed the maximum allowed size of 20 MB: huge.png"
    assert reason in events.refused_upload(reason)[0]
    assert "#refused-upload {display: none" in CSS


def test_caption_runs_once_per_upload(service: CaptionService):
    """image.change fires twice when a new file replaces a shown one (every toast showed twice):
    the caption runs on upload, the button and an example click, never on change."""
    app = build_app(service, find_examples())
    ids = {c["id"]: c["props"].get("elem_id") for c in app.config["components"]}
    caption_triggers = []
    for dep in app.config["dependencies"]:
        if len(dep["outputs"]) == len(events.OUTPUTS):
            caption_triggers.append({(ids.get(t[0]), t[1]) for t in dep["targets"]})
    assert {("input-image", "upload"), ("caption-button", "click")} in caption_triggers
    assert {("input-image", "change")} in caption_triggers  # the clear event
    assert {("input-image", "clear")} in caption_triggers  # the removal: the prompt
    for triggers in caption_triggers:
        assert not {("input-image", "upload"), ("input-image", "change")} <= triggers


def _state(maps: list[np.ndarray], words: list[str]) -> dict:
    image = Image.new("RGB", (128, 128), (128, 128, 128))
    return {
        "image": image,
        "small": image,
        "attention": np.stack(maps),
        "locations": None,
        "words": words,
    }


def _change(img: Image.Image) -> float:
    """How much an overlay colours the (grey) photo."""
    return float(np.abs(np.asarray(img.crop((0, 0, 128, 128)), np.float32) - 128).mean())


def test_colour_scale_labelled_with_real_weights():
    g = 4
    uniform = np.full((g, g), 1 / g**2, np.float32)
    focused = np.full((g, g), 0.2 / (g**2 - 1), np.float32)
    focused[1, 2] = 0.8
    state = _state([uniform, focused], ["sky", "dog"])
    assert drawing.scale_max(state["attention"], 0, "word") == pytest.approx(1 / 16)
    assert drawing.scale_max(state["attention"], 0, "caption") == pytest.approx(0.8)
    own, own_note = events.show_word(state, 0, "word")
    fixed, fixed_note = events.show_word(state, 0, "caption")
    # on its own scale a uniform map is as strong as a focused one; on the caption's it is pale
    assert _change(fixed) < _change(own) / 2
    assert "**0.062**" in own_note and "**0.800**" in fixed_note
    assert "1/16 = 0.062" in own_note and "any word of this caption" in fixed_note
    bar = drawing.with_colour_bar(state["image"], 0.8, 16)
    y = round((1 - (1 / 16) / 0.8) * 127)
    assert bar.width > 128 + 60 and bar.getpixel((128 + 8 - 2, y)) == (0, 0, 0)
    # below the "flat map" tag of the uniform map: its strongest colour is pale
    pale, strong = (
        np.asarray(p.crop((0, 40, 128, 128)), np.float32)
        for p, _ in drawing.gallery(state, "caption")
    )
    assert np.abs(pale - 128).max() < np.abs(strong - 128).max() / 2
    assert drawing.gallery(state, "word")[1][1] == "dog  (max 0.800)"
    assert drawing.gallery(state, "word")[0][1] == "sky  (max 0.062, flat map)"
    gallery, view, note = events.rescale(state, 1, "caption")
    assert len(gallery) == 2 and "any word of this caption" in note
    assert "the largest weight of “dog” is 0.800" in note  # the word is named on every scale


def test_near_uniform_map_is_not_painted_red_by_default():
    """ "a" with max 0.018 against uniform 0.012 (9x9) beside a focused word: the default scale
    (the caption's) leaves it pale, and on any scale it is marked as a flat map."""
    g = 9
    flat = np.full((g, g), (1 - 0.018) / (g * g - 1), np.float32)
    flat[4, 4] = 0.018
    focused = np.full((g, g), 0.5 / (g * g - 1), np.float32)
    focused[2, 3] = 0.5
    state = _state([flat, focused], ["a", "dog"])
    assert drawing.DEFAULT_SCALE == "caption" and drawing.is_flat(flat)
    assert not drawing.is_flat(focused)
    default_view, default_note = events.show_word(state, 0)
    focused_view, _ = events.show_word(state, 1)
    own_view, own_note = events.show_word(state, 0, "word")

    def strongest(view: Image.Image) -> float:  # the photo above the tag's band
        return float(np.abs(np.asarray(view.crop((0, 0, 128, 88)), np.float32) - 128).max())

    # its own scale paints the flat map as strongly as a focused one; the default does not
    assert strongest(own_view) > 0.8 * strongest(focused_view)
    assert strongest(default_view) < strongest(focused_view) / 3
    assert "Flat map" in default_note and "Flat map" in own_note
    for view in (default_view, own_view):  # a dark "flat map" tag at the bottom left, clear
        # of the label Gradio lays over the top left of an image that fills its box
        assert np.asarray(view.crop((0, 116, 40, 128)), np.float32).mean() < 90
        assert np.asarray(view.crop((0, 0, 40, 12)), np.float32).mean() > 90
    panels = drawing.gallery(state, "word")
    # a gallery panel's tag at the top left, clear of the caption Gradio lays over its bottom
    flat_panel = panels[0][0]
    assert np.asarray(flat_panel.crop((0, 0, 40, 12)), np.float32).mean() < 90
    assert np.asarray(flat_panel.crop((0, 116, 40, 128)), np.float32).mean() > 90
    labels = [label for _, label in panels]
    assert "flat map" in labels[0] and "flat map" not in labels[1]
    comps = {c["props"].get("elem_id"): c for c in build_app_scale_only()}
    assert comps["colour-scale"]["props"]["value"] == "caption"


def build_app_scale_only() -> list:
    """The colour-scale control as the page builds it (no model needed)."""
    from showattendtell.service.app import output_column

    with gr.Blocks() as demo:
        output_column(None)
    return demo.config["components"]


def test_session_state_expires():
    """The per-session state (the captioned photo and its maps) has a time to live."""
    comps = build_app_scale_only()
    state = next(c for c in comps if c["type"] == "state")
    assert state is not None
    from showattendtell.service.app import output_column

    with gr.Blocks():
        _, out = output_column(600.0)
    assert out["state"].time_to_live == 600.0


def test_the_api_endpoint_is_named_caption(service: CaptionService):
    """The UI's private events never take the name: clients call api_name="/caption"."""
    endpoints = build_app(service).get_api_info()["named_endpoints"]
    assert list(endpoints) == ["/caption"]
    names = [p["parameter_name"] for p in endpoints["/caption"]["parameters"]]
    assert names == ["image", "model", *DECODING_OPTIONS]


def test_the_page_opens_on_a_word_that_shows_where_the_model_looked():
    """Not on the first word, usually a flat "a": on the first content word whose map is not
    flat, else on the most concentrated map."""
    g = 3
    flat = np.full((g, g), 1 / g**2, np.float32)
    focused = np.full((g, g), 0.1 / (g**2 - 1), np.float32)
    focused[0, 0] = 0.9
    half = np.full((g, g), 0.5 / (g**2 - 1), np.float32)
    half[1, 1] = 0.5
    words = ["a", "dog", "on", "grass"]
    assert drawing.opening_word(words, np.stack([focused, flat, half, focused])) == 3
    assert drawing.opening_word(words, np.stack([flat, half, focused, focused])) == 1
    assert drawing.opening_word(["a", "the"], np.stack([half, focused])) == 1
    assert drawing.opening_word([], np.zeros((0, g, g))) is None


def test_the_caption_event_selects_the_opening_word(service: CaptionService, monkeypatch):
    picked = []

    def opening(words, attention):
        picked.append(len(words) - 1)
        return len(words) - 1

    monkeypatch.setattr(drawing, "opening_word", opening)
    monkeypatch.setattr(service, "cache", CacheBound(None))  # no page built: any file reads
    upload = {"path": str(photo(1)), "orig_name": "photo.jpg"}
    out = outputs(events.ui_caption(service, upload))
    assert out["words"]["value"] == picked[0]
    assert np.array_equal(
        np.asarray(out["view"]), np.asarray(events.show_word(out["state"], picked[0])[0])
    )


def test_a_panorama_s_overlays_are_panels_one_can_see(service: CaptionService, tmp_path: Path):
    """As the CLI's sheets (overlays.panel_size): a 4000x100 photo's gallery panels and large
    view keep a shorter side of a third of the longer, not 224x6 strips."""
    path = tmp_path / "panorama.png"
    Image.new("RGB", (4000, 100), (30, 140, 60)).save(path)
    out = outputs(events.ui_caption(service, {"path": str(path), "orig_name": "panorama.png"}))
    panels = [p for p, _ in out["gallery"]]
    assert panels and all(p.size == (224, 74) for p in panels)
    assert out["state"]["image"].size == (512, 170)


def test_help_text_is_body_size_and_the_gallery_fits_a_phone():
    from showattendtell.service.app import CSS

    assert ".info-text {" in CSS and "var(--text-md)" in CSS  # Gradio 6's help text
    assert "@media (max-width: 640px)" in CSS and "#word-gallery .grid-container" in CSS
    # one sheet or the other: the phone's below 640 px, the wide one above
    assert "@media (min-width: 641px)" in CSS and "#caption-sheet-phone {display: none" in CSS


@pytest.mark.parametrize("size", [(640, 480), (331, 560), (4000, 100), (100, 4000)])
def test_the_phone_sheet_is_readable_at_400_px(size):
    """The whole-caption sheet for a phone: shown about 334 px wide, its word labels at 11 px
    or more (the wide sheet's would be 5 px); a long caption wraps within the sheet, and a
    long word stays within its panel (nothing drawn in the sheet's right margin)."""
    words = [
        "a",
        "skateboarder",
        "in",
        "a",
        "black",
        "shirt",
        "is",
        "doing",
        "a",
        "trick",
        "on",
        "a",
        "skateboard",
        "ramp",
    ]
    g = 4
    attention = np.full((len(words), g, g), 1 / g**2, np.float32)
    attention[:, 1, 2] += 0.2
    result = SimpleNamespace(
        caption=" ".join(words), words=words, attention=attention, locations=None
    )
    image = Image.new("RGB", size, (128, 128, 128))
    wide, phone = drawing.sheets(image, result)
    shown = drawing.PHONE_SHEET_SHOWN / phone.width  # the sheet's scale on a 400 px screen
    assert 16 * drawing.PHONE_TEXT * shown >= 11, phone.size
    assert 16 * drawing.PHONE_SHEET_SHOWN / wide.width < 11  # why the phone has its own
    right = np.asarray(phone.convert("L"))[:, -6:]
    assert (right > 250).all()  # white: no caption or label runs off the sheet


def test_the_caption_event_draws_both_sheets(service: CaptionService):
    out = outputs(events.ui_caption(service, {"path": str(photo(0)), "orig_name": "p.jpg"}))
    assert out["sheet"].width > out["phone_sheet"].width
    assert out["phone_sheet"].height > 200


# What each example photo shows, in words the caption must use: the examples show what the
# model does well; the last one what it does not, under its warning.
EXAMPLE_WORDS = {"1-skateboard.jpg": {"skateboard"}, "2-tennis.jpg": {"tennis"}}


@pytest.mark.slow
def test_the_examples_are_captioned_right_but_the_last_which_is_warned_about():
    from showattendtell import load_model

    examples = find_examples()
    assert [p.name for p in examples[:-1]] == sorted(EXAMPLE_WORDS)
    results = load_model(None, "cpu").caption(examples)
    for path, result in zip(examples[:-1], results, strict=False):
        assert EXAMPLE_WORDS[path.name] & set(result.words), (path.name, result.caption)
        assert not result.warning, (path.name, result.warning)
    assert results[-1].warning  # the pizzas: unlike the training photos, and said so


def test_the_page_alone_prints_its_address_and_no_gradio_hint(service: CaptionService, capfd):
    """launch() on Gradio's own server: one line with the address, as `sat serve` prints it;
    not Gradio's "* To create a public link, set `share=True` in `launch()`." (a hint about a
    call the user of this service does not make)."""
    from helpers.processes import free_port
    from showattendtell.service.app import launch

    port = free_port()
    app = launch(service, "127.0.0.1", port, block=False, quiet=False)
    try:
        out = capfd.readouterr()
    finally:
        app.close(verbose=False)
    lines = (out.out + out.err).splitlines()
    assert f"Running on local URL:  http://127.0.0.1:{port}" in lines
    assert not [line for line in lines if "share=True" in line or line.startswith("* ")], lines


def test_the_blocking_page_closes_quietly_on_ctrl_c(capsys):
    """launch(block=True) waits itself: Ctrl-C closes the server without Gradio's line."""
    from showattendtell.service.app import wait

    closed = []

    class Interrupted:
        @property
        def is_running(self) -> bool:
            raise KeyboardInterrupt

        def close(self, verbose: bool = True) -> None:
            closed.append(verbose)

    wait(Interrupted())
    assert closed == [False] and capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_sat_serve_prints_only_its_own_lines(tiny_model_file: Path, tmp_path: Path):
    """The real `sat serve`: started, its page and API used, stopped. Every line it prints is
    one of the project's (INFO/WARNING: ..., the address): no Gradio hint to set share=True, no
    library's INFO lines (httpx's HTTP Request)."""
    import os
    import re
    import signal
    import urllib.request

    from helpers.processes import free_port, start_sat

    port = free_port()
    args = ["serve", "--device", "cpu", "--model", str(tiny_model_file), "--port", str(port)]
    env = {**os.environ, "GRADIO_TEMP_DIR": str(tmp_path / "cache")}
    proc = start_sat(args, tmp_path, env=env)
    try:
        first = proc.stdout.readline()  # the address, once it serves
        assert first == f"Running on local URL:  http://127.0.0.1:{port}\n", first
        url = f"http://127.0.0.1:{port}"
        for path in ("/", "/config", "/gradio_api/info"):  # what the page loads first
            assert urllib.request.urlopen(url + path, timeout=60).status == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    lines = (first + out + err).splitlines()
    own = re.compile(r"(INFO|WARNING|warning): |Running on local URL:  http://")
    assert all(own.match(line) for line in lines), lines
    assert not any("share=True" in line or "HTTP Request" in line for line in lines)


def test_a_heic_upload_gets_a_preview_the_browser_can_show(
    service: CaptionService, tmp_path, monkeypatch
):
    """Browsers show no HEIC: the page shows the upload decoded by the project's own reader
    (as the captioner reads it) beside the input panel; other photos get none."""
    from showattendtell.service.cache import CacheBound

    pillow_heif = pytest.importorskip("pillow_heif")
    monkeypatch.setattr(service, "cache", CacheBound(None))  # no page: every path an upload
    heic = tmp_path / "phone.heic"
    pillow_heif.from_pillow(Image.open(photo(0)).convert("RGB")).save(heic, quality=90)
    shown = events.preview_upload(service, {"path": str(heic), "orig_name": "IMG_1.HEIC"})
    assert shown["visible"] is True and "IMG_1.HEIC" in shown["label"]
    preview = shown["value"]
    expected = Image.open(photo(0)).convert("RGB")
    assert preview.size == expected.size  # a small photo: not enlarged
    diff = np.abs(np.asarray(preview, np.float32) - np.asarray(expected, np.float32)).mean()
    assert diff < 8  # the photo, through HEIC's lossy coding
    jpeg = {"path": str(photo(0)), "orig_name": "photo.jpg"}
    assert events.preview_upload(service, jpeg)["visible"] is False
    broken = tmp_path / "cut.heic"
    broken.write_bytes(heic.read_bytes()[:100])  # the caption event says why; no preview
    assert events.preview_upload(service, str(broken))["visible"] is False
    # removed, or replaced by a photo the browser shows (an example): hidden
    assert events.hide_preview(None)["visible"] is False
    assert events.hide_preview(jpeg)["visible"] is False
    assert events.hide_preview({"path": str(heic)}) == gr.skip()


def test_the_preview_reads_only_uploads(service: CaptionService, tmp_path, monkeypatch):
    """As the caption event: a path Gradio did not place in the page's cache is not opened."""
    pillow_heif = pytest.importorskip("pillow_heif")
    heic = tmp_path / "elsewhere.heic"
    pillow_heif.from_pillow(Image.new("RGB", (64, 48), (200, 30, 30))).save(heic)
    opened = []
    monkeypatch.setattr(service.cache, "pages", [SimpleNamespace(temp_file_sets=[set()])])
    monkeypatch.setattr("showattendtell.service.uploads.open_image", opened.append)
    assert events.preview_upload(service, {"path": str(heic)})["visible"] is False
    assert opened == []
    app = build_app(service)
    ids = {c["id"]: c["props"].get("elem_id") for c in app.config["components"]}
    wired = [
        d
        for d in app.config["dependencies"]
        if [ids.get(o) for o in d["outputs"]] == ["input-preview"]
    ]
    assert {("input-image", "upload"), ("input-image", "change")} == {
        (ids.get(t[0]), t[1]) for d in wired for t in d["targets"]
    }


def test_a_session_keeps_its_photo_encoded(service: CaptionService, monkeypatch):
    """Gradio keeps each session's state in memory for an hour (up to --max-sessions): the
    view and panel images are kept JPEG-encoded (about 0.9 MB a session as pixels), and the
    overlays drawn from them are the photo's."""
    monkeypatch.setattr(service, "cache", CacheBound(None))  # no page built: any file reads
    upload = {"path": str(photo(1)), "orig_name": "photo.jpg"}
    out = outputs(events.ui_caption(service, upload))
    state = out["state"]
    assert state is not None, out["status"]
    kept = sum(
        len(v.data) if isinstance(v, drawing.Packed) else getattr(v, "nbytes", 0)
        for v in state.values()
    )
    assert isinstance(state["image"], drawing.Packed) and isinstance(state["small"], drawing.Packed)
    assert kept < 200_000, kept
    original = drawing.readable(drawing.unpacked(state["image"]), events.PANEL_SIZE)
    small = np.asarray(state["small"].image(), np.float32)
    assert small.shape[:2] == (state["small"].height, state["small"].width)
    assert np.abs(small - np.asarray(original.resize(state["small"].size), np.float32)).mean() < 6
