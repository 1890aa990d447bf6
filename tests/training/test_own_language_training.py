"""Training a model of another tokenizer than English PTB: the module builds its vocabulary with
that tokenizer, and refuses the English-only METEOR reward."""

import pytest

from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.training.lit_module import CaptionModule
from showattendtell.training.objectives import TrainingConfigError

WORDS = ["<pad>", "<start>", "<end>", "<unk>", "犬", "猫"]


def _module(**objective) -> CaptionModule:
    return CaptionModule(
        WORDS,
        EncoderConfig(backbone="efficientnet_lite0", weights=None, input_size=64),
        DecoderConfig("soft", 16, 32, 16, 0.0),
        objective=objective or None,
        tokenizer="unicode",
    )


def test_the_module_s_vocabulary_has_the_data_s_tokenizer():
    module = _module()
    assert module.model.vocab.tokenizer == "unicode" and module.hparams.tokenizer == "unicode"
    assert module.model.vocab.detokenize(["犬", "猫"]) == "犬猫"


def test_a_meteor_reward_is_refused_for_captions_that_are_not_english():
    module = _module(self_critical=2, self_critical_meteor=0.5)
    with pytest.raises(TrainingConfigError, match="English-only") as e:
        module.on_fit_start()
    assert "\n" not in str(e.value)
