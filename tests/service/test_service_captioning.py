"""The captioning function behind the UI and the API (service/captioning.py, worker.py,
uploads.py): real photos and odd files, the API's JSON, decoding options, batching, consensus
beams and familiarity."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.photos import encode, photo, photos
from PIL import Image

from showattendtell.images.files import ImageError, full_size
from showattendtell.search.decoding import MAX_BEAM_SIZE, MAX_CAPTION_LENGTH, DecodingError

gr = pytest.importorskip("gradio")
from helpers.service import EXPECTED, bad_inputs  # noqa: E402
from showattendtell.service import events  # noqa: E402
from showattendtell.service.captioning import api_caption, caption_image  # noqa: E402
from showattendtell.service.worker import CaptionService, ServiceError, load_service  # noqa: E402


def test_caption_real_photo_soft_and_hard(service: CaptionService):
    soft, hard = service.names
    done = caption_image(service, str(photo(0)), soft, beam_size=3, max_length=8)
    d = json.loads(json.dumps(done.to_json(), allow_nan=False))  # strict JSON, as the API sends
    n, g = len(d["words"]), d["grid"]
    assert n >= 1 and d["caption"] == " ".join(d["words"]) and d["attention_type"] == "soft"
    att = np.array(d["attention"])
    assert att.shape == (n, g, g) and np.allclose(att.sum((1, 2)), 1, atol=1e-3)
    assert d["beams"][0]["caption"] == d["caption"] and 1 <= len(d["beams"]) <= 3
    assert d["ranked_by"] == "score" and "consensus" not in d["beams"][0]
    assert d["image_size"] == list(Image.open(photo(0)).size) and d["locations"] is None
    assert "warning" not in d and d["familiarity"] is None  # no index: no familiarity
    expected = set(done.result.to_dict(with_attention=True)) | {
        "beams",
        "ranked_by",
        "model",
        "attention_type",
        "grid",
        "locations",
        "image_size",
        "decoding",
    }
    assert set(d) == expected
    assert {"caption", "words", "score", "log_prob", "attention", "familiarity"} <= expected
    numbers = [x for word in d["attention"] for row in word for x in row]
    assert all(len(repr(x)) <= 7 for x in numbers)  # 5 decimals, not float32 noise

    h = caption_image(
        service, photo(0).read_bytes(), hard, beam_size=1, hard_mode="argmax"
    ).to_json()
    assert h["attention_type"] == "hard" and len(h["beams"]) == 1
    assert h["decoding"]["hard_mode"] == "argmax" and len(h["locations"]) == len(h["words"])
    for (r, c), grid in zip(h["locations"], h["attention"], strict=True):
        assert 0 <= r < h["grid"] and 0 <= c < h["grid"]
        assert np.argmax(grid) == r * h["grid"] + c  # argmax mode: the chosen cell is the peak


def test_soft_model_reports_no_hard_mode(service: CaptionService):
    """The API's decoding lists only the settings that shaped the caption: a soft model has no
    hard-attention mode (given or not), a model without an index no reranking."""
    soft, hard = service.names
    for kw in ({}, {"hard_mode": "sample"}):
        d = api_caption(service, str(photo(0)), soft, **kw)
        assert "hard_mode" not in d["decoding"] and "rerank" not in d["decoding"]
        assert d["decoding"]["beam_size"] == service.get(soft).decoding.beam_size
    assert api_caption(service, str(photo(0)), hard)["decoding"]["hard_mode"] == "expectation"
    # a mode asked of a soft model neither errs nor splits its batches
    assert service.decoding(soft, hard_mode="sample") == service.decoding(soft)


def test_decoding_options_are_checked_never_defaulted(service: CaptionService):
    soft, hard = service.names
    for kw, message in [
        ({"beam_size": 0}, "beam size"),
        ({"beam_size": 2.5}, "beam size"),
        ({"beam_size": MAX_BEAM_SIZE + 1}, "beam size"),
        ({"max_length": 0}, "maximum length"),
        ({"max_length": MAX_CAPTION_LENGTH + 1}, "maximum length"),
        ({"hard_mode": "best"}, "hard-attention mode"),
        ({"length_penalty": -1}, "length penalty"),
        ({"no_repeat_ngram": "2"}, "no-repeat"),
        ({"rerank": "best"}, "reranking"),
        ({"rerank": "consensus"}, "consensus index"),
        ({"min_length": -1}, "minimum length"),
        ({"min_length": 9, "max_length": 8}, "more than the maximum length"),
    ]:  # it has none
        with pytest.raises(DecodingError, match=message):
            caption_image(service, str(photo(0)), hard, **kw)
        with pytest.raises(gr.Error, match=message):  # the API client gets the message
            api_caption(service, str(photo(0)), hard, **kw)
    # the limits are decoding.py's: the largest allowed values work
    d = api_caption(service, str(photo(0)), soft, beam_size=float(MAX_BEAM_SIZE), max_length=2)
    assert d["decoding"]["beam_size"] == MAX_BEAM_SIZE and len(d["words"]) <= 2
    # not given: each model's own defaults (the hard one stores 'expectation')
    d = api_caption(service, str(photo(0)), hard)
    assert d["decoding"] == {
        k: v for k, v in service.get(hard).decoding.to_dict().items() if k != "rerank"
    }
    assert d["decoding"]["hard_mode"] == "expectation" and d["locations"] is None


def test_consensus_beams_are_ranked_by_the_score_that_decided(
    indexed_service: CaptionService,
):
    """With consensus reranking the beams come in the order the consensus chose, each with its
    consensus score (the number that decided, highest first), and ranked_by says so; without
    it they are ordered by their score."""
    indexed, plain = indexed_service.names
    for i in range(3):
        done = caption_image(indexed_service, str(photo(i)), indexed, beam_size=3)
        d = done.to_json()
        assert d["ranked_by"] == "consensus" and d["decoding"]["rerank"] == "consensus"
        consensus = [b["consensus"] for b in d["beams"]]
        assert (
            consensus == sorted(consensus, reverse=True)
            and d["beams"][0]["caption"] == d["caption"]
        )
        scores = [s for _, s in done.result.beams]
        assert len(scores) == len(consensus)
        d = api_caption(indexed_service, str(photo(i)), indexed, rerank="none")
        assert d["ranked_by"] == "score" and "consensus" not in d["beams"][0]
        scores = [b["score"] for b in d["beams"]]
        assert scores == sorted(scores, reverse=True)
    # greedy: one caption, nothing reranked
    assert api_caption(indexed_service, str(photo(0)), indexed, beam_size=1)["ranked_by"] == "score"


def test_min_length_reaches_the_api(service: CaptionService):
    soft, _ = service.names
    d = api_caption(service, str(photo(0)), soft, beam_size=2, max_length=7, min_length=7)
    assert len(d["words"]) == 7 and all(len(b["caption"].split()) == 7 for b in d["beams"])
    assert d["decoding"]["min_length"] == 7


def test_the_consensus_is_computed_once_a_request(indexed_service: CaptionService, monkeypatch):
    """The beams' consensus scores the API shows are the reranking's own, carried on the
    hypotheses: no second scoring to show them."""
    from showattendtell.search.consensus import ConsensusIndex

    calls = []
    real = ConsensusIndex.rerank
    monkeypatch.setattr(
        ConsensusIndex, "rerank", lambda self, *a: calls.append(1) or real(self, *a)
    )
    indexed, _ = indexed_service.names
    d = api_caption(indexed_service, str(photo(0)), indexed, beam_size=3)
    assert d["ranked_by"] == "consensus" and "consensus" in d["beams"][0] and calls == [1]


def test_familiarity_and_its_warning_reach_the_api(
    indexed_service: CaptionService,
    monkeypatch,
):
    indexed, _ = indexed_service.names
    d = api_caption(indexed_service, str(photo(0)), indexed)
    assert 0.0 <= d["familiarity"] <= 1.0
    from showattendtell.search import familiarity

    monkeypatch.setattr(familiarity.Familiarity, "warning", lambda self, *a: familiarity.WARNING)
    d = api_caption(indexed_service, str(photo(0)), indexed)
    assert familiarity.WARNING in d["warning"]


def test_batches_group_by_the_full_decoding_config(tiny_model_file):
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
    configs = [
        svc.decoding(None),
        svc.decoding(None, length_penalty=1.0),
        svc.decoding(None, no_repeat_ngram=2),
        svc.decoding(None),
        svc.decoding(None, length_penalty=1.0),
    ]
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
    wait_until(lambda: svc.queue_depth == len(threads))
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
    out = dict(zip(events.OUTPUTS, events.ui_caption(service, wide), strict=True))
    assert "aspect ratio" in out["warning"]["value"] and out["warning"]["visible"] is True
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


def test_bad_input_gives_clear_messages(service: CaptionService, tmp_path: Path):
    for kind, path in bad_inputs(tmp_path).items():
        upload = {"path": str(path), "orig_name": f"my_{path.name}"}
        with pytest.raises(ImageError, match=EXPECTED[kind]) as e:
            caption_image(service, upload)
        assert (
            str(path) not in str(e.value) and f"my_{path.name}" in str(e.value) or kind == "empty"
        )
        with pytest.warns(UserWarning):  # the UI: a status message and a toast, no exception
            status, _, caption, *_ = events.ui_caption(service, upload)
        assert status.startswith("**Cannot caption this file:**") and EXPECTED[kind] in status
        assert caption == ""
        with pytest.raises(gr.Error, match=EXPECTED[kind]):
            api_caption(service, upload)
    with pytest.raises(gr.Error, match="no image"):
        api_caption(service, None)
    png = encode(Image.new("RGB", (64, 48), "blue"), "PNG")
    inline = "data:image/png;base64," + base64.b64encode(png).decode()
    assert caption_image(service, {"url": inline}).image.size == (64, 48)  # pasted inline
    # Gradio checks that a "path" is an upload; a "url" naming a file on the server is refused
    # unread (an image there, a text file or none give the same answer)
    secret = photo(0)
    for url in (str(secret), f"file://{secret}", "/etc/passwd", str(tmp_path / "none.jpg")):
        with pytest.raises(ServiceError, match="other URLs are not read"):
            caption_image(service, {"url": url})
        with pytest.raises(gr.Error, match="other URLs are not read"):
            api_caption(service, {"url": url, "orig_name": "x.jpg"})
    too_big = "A" * 4 * (service.max_upload_bytes // 3 + 2)  # decodes to just over the limit
    with pytest.raises(ImageError, match="MB limit"):
        caption_image(service, {"url": "data:image/png;base64," + too_big})
    with pytest.raises(gr.Error, match="unknown model"):
        api_caption(service, str(tmp_path / "notes.txt"), "nope")
    # an upload removed from Gradio's cache since (cache.py): say to upload it again
    with pytest.raises(gr.Error, match="no longer on the server.*upload it again"):
        api_caption(service, {"path": str(tmp_path / "gone.jpg"), "orig_name": "mine.jpg"})


def test_concurrent_requests_are_batched_with_the_same_results(
    service: CaptionService,
):
    shots = photos(4)
    alone = [caption_image(service, str(p)).result.caption for p in shots]
    before = len(service.batch_sizes)
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(shots))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = caption_image(service, str(shots[i])).result.caption

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(shots))] == alone
    assert sum(list(service.batch_sizes)[before:]) == len(shots)


def test_the_confidence_reaches_the_api_and_the_status_line(indexed_service: CaptionService):
    """Every reply carries the caption's confidence (confidence.py), with an index or
    without, and the UI's status line gives it."""
    for name in indexed_service.names:
        done = caption_image(indexed_service, str(photo(0)), name)
        d = json.loads(json.dumps(done.to_json(), allow_nan=False))
        assert 0.0 <= d["confidence"] <= 1.0 and d["confidence"] == round(done.result.confidence, 4)
        assert f"Confidence **{done.result.confidence:.2f}**" in events.status_text(done)


def _poll(condition, event: threading.Event) -> None:
    """Until ``condition()`` (no time limit asserted: at most 10 minutes)."""
    for _ in range(60_000):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("never happened")


@pytest.fixture
def gathering(tiny_model_file):
    """A service whose batch waits up to 10 minutes for requests still arriving (a bound no
    test reaches: each releases them), and the sizes of its batches."""
    svc = load_service([tiny_model_file], device="cpu", max_batch=8)
    svc.gather_s = 600.0
    sizes: list[int] = []
    svc.on_batch.append(sizes.append)
    yield svc, sizes
    svc.close()


def test_a_batch_waits_for_requests_still_decoding(gathering):
    """Two requests sent together, the second still decoding its photo when the worker takes
    the first: captioned as one batch, not one after the other (the HTTP API's 8 clients at
    once were batches of 4 on average: the latency of two batches)."""
    svc, sizes = gathering
    img = Image.open(photo(1)).convert("RGB")
    decoded, results = threading.Event(), {}

    def second() -> None:
        with svc.arriving() as arrival:  # received; its photo is being decoded
            decoded.wait(120)
            results["second"] = svc.submit(img, arrival=arrival).result(120).caption

    t = threading.Thread(target=second)
    t.start()
    _poll(lambda: svc._arriving == 1, decoded)
    first = svc.submit(img)
    _poll(lambda: svc.queue_depth == 0, decoded)  # the worker has taken the first
    decoded.set()
    assert first.result(120).caption
    t.join(120)
    assert results["second"] == first.result().caption
    assert sizes == [2]  # without the wait: [1, 1]


def test_a_refused_arrival_lets_the_batch_go(gathering):
    """A request that is refused while decoding (a bad photo) never submits: the batch waiting
    for it starts once it is refused, not after the gather bound."""
    svc, sizes = gathering
    img = Image.open(photo(1)).convert("RGB")
    refused = threading.Event()

    def bad() -> None:
        with pytest.raises(ImageError), svc.arriving():
            refused.wait(120)
            raise ImageError("the image: cannot be decoded")

    t = threading.Thread(target=bad)
    t.start()
    _poll(lambda: svc._arriving == 1, refused)
    first = svc.submit(img)
    _poll(lambda: svc.queue_depth == 0, refused)
    refused.set()
    assert first.result(120).caption and sizes == [1]
    t.join(120)
    assert svc._arriving == 0


def test_the_gather_wait_is_bounded(gathering):
    """A request that takes longer to arrive than ``gather_s`` does not hold the batch."""
    svc, sizes = gathering
    svc.gather_s = 0.01
    img = Image.open(photo(1)).convert("RGB")
    with svc.arriving():  # never submits while the first is captioned
        assert svc.submit(img).result(120).caption
    assert sizes == [1]


def test_under_load_the_queued_requests_go_at_once(gathering):
    """Requests queued while a batch runs are taken when it ends, without waiting for those
    still decoding: they join the next batch, their decoding overlapping this one."""
    svc, sizes = gathering
    img = Image.open(photo(1)).convert("RGB")
    running, release = threading.Event(), threading.Event()
    original = svc._run_group

    def held(group):
        if not running.is_set():
            running.set()
            release.wait(120)  # the first batch runs until the others are queued
        original(group)

    svc._run_group = held
    first = svc.submit(img)
    assert running.wait(120)  # the worker is busy with the first batch
    with svc.arriving():  # another request decoding for as long as the batch takes
        queued = svc.submit(img)
        release.set()
        assert queued.result(120).caption  # not held for the 600 s gather bound
    assert first.result().caption and sizes == [1, 1]


def test_the_batch_sizes_kept_are_bounded(tiny_model_file, monkeypatch):
    """A service that runs for weeks keeps the latest batches' sizes, not every one."""
    from showattendtell.service import worker

    monkeypatch.setattr(worker, "BATCHES_KEPT", 2)
    svc = load_service([tiny_model_file], device="cpu")
    try:
        img = Image.open(photo(1)).convert("RGB")
        for _ in range(3):
            svc.caption(img)
        assert list(svc.batch_sizes) == [1, 1]
    finally:
        svc.close()
