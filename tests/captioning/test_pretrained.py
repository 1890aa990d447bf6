"""Loading as the ecosystem loads: Captioner.save_pretrained / from_pretrained (the layout of
Hugging Face's ModelHubMixin, from a folder and from huggingface_hub's cache, offline) and the
torch.hub entry points of hubconf.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.photos import write_photos
from helpers.scripts import REPO, load_file

from showattendtell import Captioner
from showattendtell.captioning.catalog import ModelNotFound, bundled_models
from showattendtell.captioning.pretrained import PretrainedError
from showattendtell.cli.main import main
from showattendtell.errors import UsageError
from showattendtell.model_file import read_model


@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory) -> Path:
    """A small untrained model (EfficientNet-Lite0 at 64 px): saving and loading, not caption
    quality, is under test, and its captions are the same numbers both ways."""
    from showattendtell.model import CaptionModel, DecodingConfig
    from showattendtell.model_file import save_model
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.network.vocab import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary.build(["a red circle", "a blue square on the left"], min_count=1)
    encoder = EncoderConfig(backbone="efficientnet_lite0", weights=None, input_size=64)
    model = CaptionModel(vocab, encoder, DecoderConfig("soft", 16, 32, 16, 0.0))
    path = tmp_path_factory.mktemp("models") / "tiny.safetensors"
    return save_model(model.eval(), path, DecodingConfig(beam_size=3, max_length=6))


def captions(captioner: Captioner, photos) -> list[tuple[str, float]]:
    return [(r.caption, round(r.score, 5)) for r in captioner.caption(photos)]


def test_save_pretrained_writes_the_hub_layout_and_loads_back(tiny_model_file, tmp_path):
    photos = write_photos(tmp_path, 3)
    original = Captioner.from_pretrained(tiny_model_file, device="cpu")
    folder = original.save_pretrained(tmp_path / "hub")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "vocab.json",
    ]
    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == "showattendtell/caption-model"
    assert config["decoding"]["beam_size"] == 3 and config["vocab_size"] == len(
        original.model.vocab
    )
    assert json.loads((folder / "vocab.json").read_text()) == original.model.vocab.itos
    # the weights are a model file of model_file.py, readable on its own
    model, decoding, _ = read_model(folder / "model.safetensors")
    assert decoding == original.decoding

    loaded = Captioner.from_pretrained(folder, device="cpu")
    assert loaded.name == "hub" and loaded.files == (folder / "model.safetensors",)
    assert captions(loaded, photos) == captions(original, photos)
    # sat caption takes the folder as --model too
    assert main(["caption", photos[0], "--model", str(folder), "--format", "jsonl"]) == 0


def test_save_pretrained_keeps_existing_files_unless_overwrite(tiny_model_file, tmp_path):
    captioner = Captioner.from_pretrained(tiny_model_file, device="cpu")
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "README.md").write_text("model card")
    (folder / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="already holds config.json"):
        captioner.save_pretrained(folder)
    assert (folder / "config.json").read_text() == "{}"
    captioner.save_pretrained(folder, overwrite=True, half=True)
    assert (folder / "README.md").read_text() == "model card"  # other files are left alone
    model, _, _ = read_model(folder / "model.safetensors")
    assert model.decoder.embedding.weight.dtype == torch.float32  # read back as float32
    with pytest.raises(UsageError, match="is a file"):
        captioner.save_pretrained(folder / "README.md")


def test_an_edited_vocabulary_or_a_missing_config_is_one_clear_error(tiny_model_file, tmp_path):
    folder = Captioner.from_pretrained(tiny_model_file, device="cpu").save_pretrained(
        tmp_path / "hub"
    )
    words = json.loads((folder / "vocab.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(words[:4] + words[5:] + words[4:5]))
    with pytest.raises(PretrainedError, match="is not the vocabulary of"):
        Captioner.from_pretrained(folder)
    (folder / "config.json").unlink()
    (folder / "vocab.json").unlink()
    with pytest.raises(ModelNotFound, match="is a folder: give a model file"):
        Captioner.from_pretrained(folder)


def hub_cache(cache: Path, repo_id: str, source: Path, revision: str = "a" * 40) -> Path:
    """``source``'s files laid out as huggingface_hub caches a download of ``repo_id``: blobs,
    a snapshot of links to them, and refs/main naming the revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_from_pretrained_reads_huggingface_hubs_cache_offline(
    tiny_model_file, tmp_path, monkeypatch
):
    pytest.importorskip("huggingface_hub", reason="huggingface_hub (installed with gradio)")
    photos = write_photos(tmp_path, 2)
    original = Captioner.from_pretrained(tiny_model_file, device="cpu")
    saved = original.save_pretrained(tmp_path / "saved")
    cache = tmp_path / "cache"
    hub_cache(cache, "someone/tiny-captioner", saved)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no request leaves the machine
    loaded = Captioner.from_pretrained("someone/tiny-captioner", device="cpu", cache_dir=cache)
    assert loaded.name == "tiny-captioner"
    assert loaded.files[0].parent.parent.name == "snapshots"
    assert captions(loaded, photos) == captions(original, photos)
    # a revision by its commit, local_files_only without the variable
    monkeypatch.delenv("HF_HUB_OFFLINE")
    again = Captioner.from_pretrained(
        "someone/tiny-captioner", revision="a" * 40, cache_dir=cache, local_files_only=True
    )
    assert captions(again, photos) == captions(original, photos)
    # a name the cache does not hold: one line, saying where it looked
    with pytest.raises(PretrainedError, match="no model in the local hub cache") as e:
        Captioner.from_pretrained("someone/other", cache_dir=cache, local_files_only=True)
    assert "\n" not in str(e.value)


def test_from_pretrained_takes_a_bundled_models_name():
    captioner = Captioner.from_pretrained("flickr8k_lite2_hard", device="cpu")
    assert captioner.name == "flickr8k_lite2_hard" and captioner.attention_type == "hard"


def test_hubconf_has_one_entry_per_bundled_model_and_loads_a_captioner():
    # what torch.hub.list and torch.hub.help read (they take GitHub repositories only)
    hubconf = load_file(REPO / "hubconf.py")
    entries = [n for n in dir(hubconf) if callable(getattr(hubconf, n)) and not n.startswith("_")]
    assert sorted(entries) == sorted(p.stem for p in bundled_models())
    assert "flickr8k_lite2_soft" in hubconf.flickr8k_lite2_soft.__doc__

    captioner = torch.hub.load(str(REPO), "flickr8k_lite2_soft", source="local", device="cpu")
    assert isinstance(captioner, Captioner) and captioner.name == "flickr8k_lite2_soft"
    assert captioner.device.type == "cpu" and captioner.attention_type == "soft"


def test_sat_export_takes_a_model_folder_but_not_an_onnx_export(tiny_model_file, tmp_path, capsys):
    folder = Captioner.from_pretrained(tiny_model_file, device="cpu").save_pretrained(
        tmp_path / "hub"
    )
    out = tmp_path / "again.safetensors"
    assert main(["export", str(folder), str(out), "--beam-size", "2"]) == 0
    _, decoding, info = read_model(out)
    assert decoding.beam_size == 2 and info["re_exported_from"] == str(folder)
    onnx_like = tmp_path / "exported"
    onnx_like.mkdir()
    (onnx_like / "config.json").write_text(json.dumps({"format": "showattendtell/onnx-model"}))
    capsys.readouterr()
    assert main(["export", str(onnx_like), str(tmp_path / "x.safetensors")]) == 2
    assert "is an ONNX export: export from the model file" in capsys.readouterr().err
