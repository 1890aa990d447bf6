"""A model of another tokenizer than English PTB: the model file keeps its tokenizer, captioning
joins its words as the language writes them, and older model files load as PTB English."""

from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from showattendtell.captioning.captioner import load_model
from showattendtell.model import CaptionModel, DecodingConfig
from showattendtell.model_file import read_model, save_model
from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.vocab import Vocabulary

BUNDLED = Path(__file__).resolve().parents[2] / "src" / "showattendtell" / "bundled"


def _japanese_model(path: Path) -> Path:
    """An untrained model whose vocabulary is Japanese characters (its captions are random
    characters of it: what matters here is how they are joined)."""
    torch.manual_seed(0)
    vocab = Vocabulary.build(["赤い丸と青い四角", "緑の丸と黄色い四角"], 1, "unicode")
    enc = EncoderConfig(backbone="efficientnet_lite0", weights=None, input_size=64)
    model = CaptionModel(vocab, enc, DecoderConfig("soft", 16, 32, 16, 0.0))
    return save_model(model.eval(), path, DecodingConfig(beam_size=2, max_length=6, min_length=3))


@pytest.mark.slow
def test_the_model_file_keeps_the_tokenizer_and_captions_are_joined_by_it(tmp_path):
    path = _japanese_model(tmp_path / "ja.safetensors")
    model, _, _ = read_model(path)
    assert model.vocab.tokenizer == "unicode"
    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(photo)
    [result] = load_model(path, device="cpu").caption([str(photo)])
    assert len(result.words) >= 3
    assert result.caption == "".join(result.words)  # no spaces between Japanese characters
    assert all(caption == caption.replace(" ", "") for caption, _ in result.beams)


def test_a_model_file_without_a_tokenizer_loads_as_ptb_english():
    """The bundled models were written before tokenizers were a choice: their vocabulary is a
    word list, read as read_model reads it (the header alone: the weights are 40 MB)."""
    with safe_open(str(BUNDLED / "flickr8k_lite2_soft.safetensors"), framework="pt") as f:
        vocab = Vocabulary.from_json(f.metadata()["vocab"])
    assert vocab.tokenizer == "ptb" and vocab.english
    assert vocab.detokenize(["a", "dog", "runs"]) == "a dog runs"


@pytest.mark.slow
def test_a_consensus_index_holds_the_captions_as_the_model_tokenises_them(tmp_path):
    from showattendtell.captioning.consensus_index import build_index

    model, _, _ = read_model(_japanese_model(tmp_path / "ja.safetensors"))
    (tmp_path / "data").mkdir()
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        Image.new("RGB", (64, 64), colour).save(tmp_path / "data" / f"{i}.png")
    (tmp_path / "data" / "captions.csv").write_text(
        "image,caption,split\n0.png,赤い丸。,train\n1.png,青い四角,train\n", encoding="utf-8"
    )
    index = build_index(model, "captions", tmp_path / "data", "train", neighbours=1)
    assert index.references == [["赤 い 丸"], ["青 い 四 角"]]
