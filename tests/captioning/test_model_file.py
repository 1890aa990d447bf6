"""The exported model file: pickle-free, self-describing, same captions as the checkpoint."""

import json

import numpy as np
import pytest
import torch
from helpers.photos import write_photos
from synthetic import make_example

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import DEFAULT_BUNDLED, bundled_models
from showattendtell.model_file import ModelFileError, NotAModelFile, read_model, save_model


def test_export_round_trip_keeps_captions(tiny_model_file, tmp_path):
    captioner = load_model(tiny_model_file, device="cpu")
    rng = np.random.default_rng(3)
    images = [make_example(rng)[0] for _ in range(4)]
    before = captioner.caption(images, beam_size=3)
    again = save_model(captioner.model, tmp_path / "again.safetensors", captioner.decoding)
    after = load_model(again, device="cpu").caption(images, beam_size=3)
    assert [r.caption for r in before] == [r.caption for r in after]
    for b, a in zip(before, after, strict=True):
        assert abs(b.log_prob - a.log_prob) < 1e-5
        np.testing.assert_allclose(b.attention, a.attention, atol=1e-6)


def test_half_precision_file_is_smaller_and_captions_alike(tiny_model_file, tmp_path):
    model, decoding, _ = read_model(tiny_model_file)
    full = save_model(model, tmp_path / "full.safetensors", decoding)
    half = save_model(model, tmp_path / "half.safetensors", decoding, half=True)
    assert half.stat().st_size < 0.6 * full.stat().st_size
    rng = np.random.default_rng(4)
    images = [make_example(rng)[0] for _ in range(6)]
    a = load_model(full, "cpu").caption(images, beam_size=3)
    b = load_model(half, "cpu").caption(images, beam_size=3)
    assert sum(x.caption == y.caption for x, y in zip(a, b, strict=True)) >= 5


def test_interpolation_needs_the_same_vocabulary_and_architecture(tiny_model_file):
    from showattendtell.network.vocab import Vocabulary

    model, _, _ = read_model(tiny_model_file)
    other, _, _ = read_model(tiny_model_file)
    with torch.no_grad():
        for p in other.decoder.parameters():
            p.add_(1.0)
    w = model.decoder.out_vocab.weight.clone()
    model.interpolate_(other, 0.5)
    torch.testing.assert_close(model.decoder.out_vocab.weight, w + 0.5)
    other.vocab = Vocabulary([*other.vocab.itos[:-1], "zebra"])
    with pytest.raises(ValueError, match="different vocabularies"):
        model.interpolate_(other, 0.5)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        model.interpolate_(model, -0.1)


def test_file_carries_its_configuration(tiny_model_file):
    from safetensors import safe_open

    with safe_open(str(tiny_model_file), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "showattendtell/caption-model"
    assert json.loads(meta["encoder"])["backbone"] == "resnet50"
    assert json.loads(meta["vocab"])[:4] == ["<pad>", "<start>", "<end>", "<unk>"]


@pytest.mark.parametrize(
    "kind", ["missing", "text", "truncated", "foreign", "checkpoint", "mismatch"]
)
def test_bad_model_files_give_clear_errors(kind, tiny_model_file, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    if kind == "text":
        path.write_text("hello")
    elif kind == "truncated":
        path.write_bytes(tiny_model_file.read_bytes()[:5000])
    elif kind == "foreign":
        save_file({"w": torch.zeros(3)}, str(path), metadata={"format": "other"})
    elif kind == "checkpoint":
        path = tmp_path / "last.ckpt"
        path.write_bytes(b"x")
    elif kind == "mismatch":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(tiny_model_file), framework="pt") as f:
            meta = f.metadata()
        state = load_file(str(tiny_model_file))
        state.pop(next(iter(state)))
        save_file(state, str(path), metadata=meta)
    with pytest.raises(ModelFileError) as err:
        read_model(path)
    assert "\n" not in str(err.value) and str(path.name) in str(err.value)


def _not_a_model(kind: str, folder) -> tuple:
    """(a file of ``kind`` that is not a model file, what the error line calls it)."""
    from PIL import Image
    from safetensors.torch import save_file

    path = folder / f"{kind}.safetensors"
    if kind == "text":
        path = folder / "README.md"
        path.write_text("# Notes\nnot a model\n")
        return path, "a text file"
    if kind == "photo":
        path = folder / "photo.jpg"
        Image.new("RGB", (8, 8)).save(path)
        return path, "an image"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "an empty file"
    if kind == "pytorch":
        path = folder / "weights.pt"
        torch.save({"w": torch.zeros(2)}, path)
        return path, "a PyTorch or zip file"
    save_file({"w": torch.zeros(3)}, str(path), metadata={"format": "other"})
    return path, "a safetensors file but not a showattendtell model"


@pytest.mark.parametrize("kind", ["text", "photo", "empty", "pytorch", "foreign"])
def test_a_file_that_is_no_model_is_a_one_line_usage_error(kind, tmp_path, monkeypatch, capsys):
    """`sat caption --model README.md photo.jpg` (a mistyped argument, a photo given as the
    model) exits 2 with one line saying what the file is, as a bad --model name does; the file
    is never unpickled."""
    from showattendtell.cli.main import main

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called on a --model file")

    monkeypatch.setattr(torch, "load", no_unpickling)
    path, what = _not_a_model(kind, tmp_path)
    with pytest.raises(NotAModelFile) as e:
        read_model(path)
    assert isinstance(e.value, ModelFileError) and e.value.exit_code == 2
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    assert main(["caption", img, "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path} is {what}") and "\n" not in err, err


def test_every_command_that_reads_a_model_refuses_one_that_is_not(
    tiny_model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    from showattendtell.cli import evaluate_job
    from showattendtell.cli.main import main

    monkeypatch.setattr(evaluate_job, "require_java", lambda *args, **kwargs: None)
    text, _ = _not_a_model("text", tmp_path)
    evaluate = ["evaluate", "--dataset", "flickr8k", "--root", str(synthetic_flickr), "--split"]
    commands = [
        [*evaluate, "dev", "--output", str(tmp_path / "r.json"), "--model", str(text)],
        ["serve", "--device", "cpu", "--model", str(text)],
        [
            "export",
            str(tiny_model_file),
            str(tmp_path / "m.safetensors"),
            "--interpolate",
            str(text),
        ],
    ]
    line = (
        f"error: {text} is a text file, not a model file: give a model file (.safetensors) or "
        "the name of a model (`sat models` lists them)"
    )
    for argv in commands:
        assert main(argv) == 2, argv[0]
        assert capsys.readouterr().err.strip() == line, argv[0]
    monkeypatch.setenv("SAT_MODEL", str(text))
    assert main(["models"]) == 0  # the list, with a warning: what a user reads to mend it
    err = capsys.readouterr().err
    assert err.startswith("warning: $SAT_MODEL: ") and f"{text} is a text file" in err


# COCO val2017 photos and the words that name what is in them (either one will do); the
# bundled models are trained on Flickr8k only, so these are out-of-domain photos.
SENSIBLE_WORDS = {
    "000000126107.jpg": {"bird", "birds", "gull", "seagull"},  # a gull over a beach
    # a skier on a slope (the hard model, from one 9x9 cell a word, sees a snowboarder: the sport
    # is wrong, the scene is not)
    "000000136334.jpg": {"skier", "skiing", "skis", "ski", "snowboarder", "snowboarding"},
    "000000189775.jpg": {"tennis", "racket"},  # a tennis player on a court
    "000000217285.jpg": {"baseball", "batter", "bat"},  # a baseball batter
}


@pytest.mark.slow
@pytest.mark.parametrize("model_file", bundled_models(), ids=lambda p: p.stem)
def test_bundled_models_caption_real_photos_sensibly(model_file):
    from helpers.data import COCO_SUBSET

    photos = [COCO_SUBSET / "images" / name for name in SENSIBLE_WORDS]
    if not all(p.is_file() for p in photos):
        pytest.skip(f"{COCO_SUBSET} not found (COCO val2017 subset in ../shared)")
    captioner = load_model(model_file, device="cpu")
    grid = captioner.model.grid
    for photo, result in zip(photos, captioner.caption(photos), strict=True):
        assert SENSIBLE_WORDS[photo.name] & set(result.words), (photo.name, result.caption)
        assert result.attention.shape == (len(result.words), grid, grid)


def test_a_model_is_bundled_and_is_the_default():
    assert bundled_models(), "no bundled model: the package data is missing"
    assert bundled_models()[0].name == DEFAULT_BUNDLED


def test_bundled_files_are_float16_and_100_mb_together():
    """The bundled files stay under 100 MB together: a re-export without --half doubles a file."""
    from safetensors import safe_open

    files = bundled_models()
    assert sum(f.stat().st_size for f in files) <= 100e6
    for f in files:
        with safe_open(f, "pt") as st:
            sizes = {}
            for k in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                if k.startswith("consensus."):  # the index: int8 rows, their scales
                    continue
                t = st.get_slice(k)
                sizes[t.get_dtype()] = sizes.get(t.get_dtype(), 0) + int(np.prod(t.get_shape()))
        assert sizes.get("F16", 0) >= 0.95 * sum(sizes.values()), (f.name, sizes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_with_nan_or_inf_are_refused_at_load(bad, tiny_model_file, tmp_path, capsys):
    from showattendtell.cli.main import main

    model, decoding, _ = read_model(tiny_model_file)
    with torch.no_grad():
        model.decoder.out_vocab.weight[0, 0] = bad
    path = save_model(model, tmp_path / "diverged.safetensors", decoding)
    with pytest.raises(ModelFileError, match="NaN or Inf") as e:
        read_model(path)
    assert "diverged.safetensors" in str(e.value) and "\n" not in str(e.value)
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    assert main(["caption", str(img), "--model", str(path), "--beam-size", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "NaN or Inf" in err and "\n" not in err


@pytest.mark.slow
def test_a_spatial_attention_model_round_trips_and_joins_an_ensemble(tiny_model_file, tmp_path):
    """decoder.attend "after" travels in the file; files written before the option (the bundled
    ones too) read as "before"; models of both kinds caption together as one ensemble."""
    from tiny_model import train_tiny_model

    after = train_tiny_model(tmp_path / "after.safetensors", attend="after")
    assert read_model(after)[0].decoder.config.attend == "after"
    assert read_model(tiny_model_file)[0].decoder.config.attend == "before"
    assert all(read_model(f)[0].decoder.config.attend == "before" for f in bundled_models())
    rng = np.random.default_rng(5)
    images = [make_example(rng)[0] for _ in range(4)]
    captioner = load_model(after, device="cpu")
    before = captioner.caption(images, beam_size=3)
    assert all(r.caption for r in before)
    again = save_model(captioner.model, tmp_path / "again.safetensors", captioner.decoding)
    assert [r.caption for r in load_model(again, "cpu").caption(images, beam_size=3)] == [
        r.caption for r in before
    ]
    both = load_model(f"{tiny_model_file}+{after}", "cpu").caption(images, beam_size=3)
    assert all(r.caption and r.attention.shape == before[0].attention.shape for r in both)


def _with_description(source, path, section: str, **changes):
    """``source``'s weights under a header whose ``section`` (encoder, decoder) says otherwise."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(source), framework="pt") as f:
        meta = f.metadata()
    meta[section] = json.dumps({**json.loads(meta[section]), **changes})
    save_file(load_file(str(source)), str(path), metadata=meta)
    return path


@pytest.mark.parametrize(
    "section, changes, said",
    [
        ("decoder", {"hidden_dim": 12_000}, "(64, 2048) in the file, (12000, 2048) described"),
        ("decoder", {"hidden_dim": 200_000}, "the weights do not match"),
        ("decoder", {"hidden_dim": "32"}, "decoder.hidden_dim is '32', not a whole number"),
        ("decoder", {"embed_dim": 3.5}, "decoder.embed_dim is 3.5"),
        ("decoder", {"attention_dim": 0}, "decoder.attention_dim 0: must be 1 or more"),
        ("encoder", {"input_size": 10**9}, "encoder.input_size 1000000000: must be 1..4096"),
        ("encoder", {"grid_size": "7"}, "encoder.grid_size is '7'"),
    ],
)
def test_sizes_a_header_asks_for_are_checked_before_anything_is_allocated(
    section, changes, said, tiny_model_file, tmp_path, monkeypatch
):
    """A 2 MB file whose header asks for a hidden size of 12,000 allocated 3.3 GB before it was
    refused; 200,000 (640 GB) ended in a traceback. The description is checked against the
    file's tensors (their shapes in the safetensors header) before the model is built."""
    import showattendtell.model_file as model_file

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the sizes were checked")

    monkeypatch.setattr(model_file, "CaptionModel", no_model)
    monkeypatch.setattr(model_file, "load_file", no_model)
    path = _with_description(tiny_model_file, tmp_path / "big.safetensors", section, **changes)
    with pytest.raises(ModelFileError) as err:
        read_model(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and said in message


def test_a_full_disk_while_saving_is_an_os_error_and_keeps_the_old_file(
    tiny_model_file, tmp_path, monkeypatch
):
    """safetensors reports a full disk as a SafetensorError: as the OSError it is (which `sat
    export` says in one line), the half-written file removed, the file at the path untouched."""
    import errno

    from safetensors import SafetensorError

    import showattendtell.model_file as model_file

    def full(state, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    model, decoding, _ = read_model(tiny_model_file)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the old model")
    monkeypatch.setattr(model_file, "save_file", full)
    with pytest.raises(OSError) as e:
        save_model(model, path, decoding)
    assert e.value.errno == errno.ENOSPC and "No space left on device" in str(e.value)
    assert path.read_bytes() == b"the old model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
