"""`sat export MODEL OUT --format onnx` and captioning with the folder through onnxruntime: the
graphs pass onnx.checker, and the same search gives the torch path's captions and maps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.data import COCO_SUBSET, needs_coco_subset
from helpers.photos import write_photos

from showattendtell.captioning.captioner import Captioner, DeviceError, load_model
from showattendtell.captioning.catalog import resolve_model
from showattendtell.cli.main import main
from showattendtell.search.decoding import DecodingError

onnx = pytest.importorskip("onnx", reason='the [onnx] extra: pip install "showattendtell[onnx]"')
pytest.importorskip("onnxruntime", reason='the [onnx] extra: pip install "showattendtell[onnx]"')

from showattendtell.captioning import onnx_model  # noqa: E402
from showattendtell.captioning.onnx_export import export_onnx  # noqa: E402
from showattendtell.model_file import read_model  # noqa: E402


def export(model_file: Path, folder: Path) -> Path:
    assert main(["export", str(model_file), str(folder), "--format", "onnx"]) == 0
    return folder


def lite_model(folder: Path, attention: str, attend: str = "before", steps: int = 60) -> Path:
    """tiny_model.py's trained model on EfficientNet-Lite0 (a sixth of ResNet-50's graph)."""
    from tiny_model import train_tiny_model

    path = folder / f"tiny_{attention}_{attend}.safetensors"
    return train_tiny_model(path, steps, attention, attend=attend, backbone="efficientnet_lite0")


@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory) -> Path:
    return lite_model(tmp_path_factory.mktemp("models"), "soft")


@pytest.fixture(scope="module")
def tiny_hard_model_file(tmp_path_factory) -> Path:
    return lite_model(tmp_path_factory.mktemp("models"), "hard")


@pytest.fixture(scope="module")
def soft_export(tiny_model_file, tmp_path_factory) -> Path:
    return export(tiny_model_file, tmp_path_factory.mktemp("onnx") / "tiny_onnx")


@pytest.fixture(scope="module")
def hard_export(tiny_hard_model_file, tmp_path_factory) -> Path:
    return export(tiny_hard_model_file, tmp_path_factory.mktemp("onnx") / "tiny_hard_onnx")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[str]:
    return write_photos(tmp_path_factory.mktemp("photos"), 8, seed=3)


def assert_same(torch_path: Captioner, onnx_path: Captioner, photos, **decoding) -> None:
    """The same captions, scores and beams; maps within 1e-4; hard attention: each word's
    location is the cell torch's map puts first (the tiny test models' 2x2 maps are nearly
    flat, so between cells within float rounding of each other either is the argmax)."""
    a, b = torch_path.caption(photos, **decoding), onnx_path.caption(photos, **decoding)
    for x, y in zip(a, b, strict=True):
        assert x.caption == y.caption
        assert (x.locations is None) == (y.locations is None)
        for t, (row, col) in enumerate(y.locations or []):
            assert x.attention[t, row, col] >= x.attention[t].max() - 1e-5
        assert [c for c, _ in x.beams] == [c for c, _ in y.beams]
        assert x.score == pytest.approx(y.score, abs=1e-4)
        assert np.abs(x.attention - y.attention).max() < 1e-4
        assert x.confidence == pytest.approx(y.confidence, abs=1e-4)  # its signals from the graphs


@pytest.mark.slow
def test_the_export_passes_the_checker_and_captions_as_torch(tiny_model_file, soft_export, photos):
    names = sorted(p.name for p in soft_export.iterdir())
    assert names == sorted(["config.json", "vocab.json", *onnx_model.GRAPH_FILES])
    for name in onnx_model.GRAPH_FILES:
        onnx.checker.check_model(str(soft_export / name), full_check=True)
    config = json.loads((soft_export / "config.json").read_text())
    model, stored, _ = read_model(tiny_model_file)
    assert config["decoding"] == stored.to_dict()
    assert json.loads((soft_export / "vocab.json").read_text()) == model.vocab.itos

    torch_path = load_model(tiny_model_file, "cpu")
    onnx_path = load_model(soft_export)
    assert onnx_path.name == soft_export.name and onnx_path.device.type == "cpu"
    assert onnx_path.decoding == stored
    assert_same(torch_path, onnx_path, photos, beam_size=1)  # greedy
    assert_same(torch_path, onnx_path, photos)  # the stored beam (3)
    assert_same(torch_path, onnx_path, photos, beam_size=4, no_repeat_ngram=1)
    assert_same(torch_path, onnx_path, photos, beam_size=3, length_penalty=1.0, max_length=5)


@pytest.mark.slow
def test_hard_attention_runs_with_the_argmax_location(tiny_hard_model_file, hard_export, photos):
    torch_path, onnx_path = load_model(tiny_hard_model_file, "cpu"), load_model(hard_export)
    assert onnx_path.attention_type == "hard"
    results = onnx_path.caption(photos, beam_size=1)
    assert all(r.locations is not None and len(r.locations) == len(r.words) for r in results)
    assert_same(torch_path, onnx_path, photos, beam_size=1)
    assert_same(torch_path, onnx_path, photos)
    assert_same(torch_path, onnx_path, photos, hard_mode="expectation")  # the expected context
    with pytest.raises(DecodingError, match="--hard-mode sample is not available"):
        onnx_path.caption(photos, hard_mode="sample")


@pytest.mark.slow
def test_attend_after_models_export_their_image_gates(tmp_path, photos):
    model_file = lite_model(tmp_path, "soft", attend="after", steps=40)
    model, decoding, _ = read_model(model_file)
    folder = export_onnx(model, decoding, tmp_path / "after_onnx")
    assert "image_gates" in json.loads((folder / "config.json").read_text())["step_inputs"]
    assert_same(load_model(model_file, "cpu"), load_model(folder), photos[:4])
    assert_same(load_model(model_file, "cpu"), load_model(folder), photos[:4], beam_size=1)


@pytest.mark.slow
def test_the_export_keeps_the_models_own_confidence_fits(tiny_model_file, tmp_path, photos):
    """A model file's own fits travel in config.json: the export's captions are scored and
    warned by them, as the model file's are; a damaged fit is one clear error."""
    from showattendtell.search.confidence import ConfidenceFit, ConfidenceFits

    model, decoding, _ = read_model(tiny_model_file)
    features = ("log_prob_per_word", "words")
    fit = ConfidenceFit(features, (0.0, 0.0), (1.0, 1.0), (0.5, 0.1), -0.25, 0.4)
    model.confidence = ConfidenceFits((fit,), "a test")
    folder = export_onnx(model, decoding, tmp_path / "fits_onnx")
    loaded = load_model(folder)
    assert loaded.own_fits and loaded.confidence_fits == model.confidence
    torch_path = Captioner(model, decoding, "cpu")
    assert_same(torch_path, loaded, photos[:4], beam_size=1)
    assert [r.warning for r in loaded.caption(photos[:4], beam_size=1)] == [
        r.warning for r in torch_path.caption(photos[:4], beam_size=1)
    ]
    config = json.loads((folder / "config.json").read_text())
    config["confidence"]["fits"][0]["features"] = ["shoe size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(onnx_model.OnnxModelError, match="damaged ONNX model description"):
        load_model(folder)


@pytest.mark.slow
def test_sat_caption_takes_the_folder_as_a_model(tiny_model_file, soft_export, photos, capsys):
    assert main(["caption", *photos[:2], "--model", str(tiny_model_file), "--format", "jsonl"]) == 0
    by_torch = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(["caption", *photos[:2], "--model", str(soft_export), "--format", "jsonl"]) == 0
    by_onnx = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["caption"] for r in by_onnx] == [r["caption"] for r in by_torch]
    assert by_onnx[0]["model"] == soft_export.name
    assert main(["caption", photos[0], "--model", str(soft_export), "--device", "cuda"]) == 2
    assert "an ONNX model runs on the CPU" in capsys.readouterr().err


@pytest.mark.slow
def test_an_export_is_replaced_only_with_overwrite(tiny_model_file, soft_export, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(tiny_model_file), str(out), "--format", "onnx"]) == 0
    before = (out / onnx_model.STEP_FILE).stat().st_ino
    assert main(["export", str(tiny_model_file), str(out), "--format", "onnx"]) == 2
    assert "already holds an ONNX export; add --overwrite" in capsys.readouterr().err
    argv = ["export", str(tiny_model_file), str(out), "--format", "onnx", "--overwrite"]
    assert main(argv) == 0
    assert (out / onnx_model.STEP_FILE).stat().st_ino != before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.parametrize(
    ("setup", "extra", "said"),
    [
        ("file", [], "is a file: --format onnx writes a folder"),
        ("other", [], "is a folder with other files in it: give a new or empty folder"),
        ("other", ["--overwrite"], "is a folder with other files in it"),
        ("none", ["--half"], "--half is for model files"),
    ],
)
def test_bad_onnx_outputs_are_refused_before_the_model_is_read(
    tiny_model_file, tmp_path, capsys, setup, extra, said
):
    out = tmp_path / "out"
    if setup == "file":
        out.write_text("notes")
    elif setup == "other":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    argv = ["export", str(tiny_model_file), str(out), "--format", "onnx", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err
    if setup == "file":
        assert out.read_text() == "notes"
    elif setup == "other":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_cli_knows_the_folders_format_tag_without_importing_torch():
    from showattendtell.cli import export

    assert export.ONNX_FORMAT == onnx_model.FORMAT


@pytest.mark.slow
def test_without_onnxruntime_loading_says_how_to_install_it(soft_export, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    with pytest.raises(onnx_model.OnnxModelError, match=r'pip install "showattendtell\[onnx\]"'):
        load_model(soft_export)


@pytest.mark.slow
def test_a_damaged_graph_is_one_clear_error(soft_export, tmp_path):
    import shutil

    copy = shutil.copytree(soft_export, tmp_path / "copy")
    (copy / onnx_model.STEP_FILE).write_bytes(b"not a graph")
    with pytest.raises(onnx_model.OnnxModelError, match="cannot be loaded by onnxruntime"):
        load_model(copy)
    loaded = load_model(soft_export)
    with pytest.raises(DeviceError, match="in float32"):
        Captioner(loaded.model, loaded.decoding, "cpu", precision="bf16")


BUNDLED = ("flickr8k_lite2_soft", "flickr8k_lite2_hard")


@pytest.mark.slow
@needs_coco_subset
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_models_caption_the_coco_photos_as_torch(name, tmp_path):
    """Every COCO photo present: greedy and the stored beam (5, no repeated 2-grams, consensus
    reranking) give the torch path's captions, familiarity and, for hard attention, the
    argmax locations; maps within 1e-4."""
    photos = sorted((COCO_SUBSET / "images").glob("*.jpg"))
    model, decoding, info = read_model(resolve_model(name))
    folder = export_onnx(model, decoding, tmp_path / name, info)
    torch_path, onnx_path = load_model(name, "cpu"), load_model(folder)
    assert onnx_path.decoding.rerank == "consensus"
    for options in ({"beam_size": 1}, {}):
        a, b = torch_path.caption(photos, **options), onnx_path.caption(photos, **options)
        assert [r.caption for r in b] == [r.caption for r in a]
        assert [r.locations for r in b] == [r.locations for r in a]
        maps = zip([r.attention for r in a], [r.attention for r in b], strict=True)
        assert max(np.abs(x - y).max() for x, y in maps) < 1e-4
        assert [r.familiarity for r in b] == pytest.approx([r.familiarity for r in a], abs=1e-4)
