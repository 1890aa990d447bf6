"""CaptionModel: encoder + decoder + vocabulary, the one nn.Module every entry point runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from showattendtell.decoder import Decoder, DecoderConfig
from showattendtell.decoding import Hypothesis, beam_search, greedy_decode
from showattendtell.encoder import Encoder, EncoderConfig
from showattendtell.vocab import Vocabulary


@dataclass
class DecodingConfig:
    """How captions are generated (defaults stored with a model; callers may override)."""

    beam_size: int = 3
    max_length: int = 20
    length_penalty: float = 0.0
    hard_mode: str = "argmax"  # hard attention at inference: argmax, sample or expectation
    no_repeat_ngram: int = 0  # > 0: no n-gram of this size twice in a caption


class CaptionModel(nn.Module):
    def __init__(
        self,
        vocab: Vocabulary,
        encoder: EncoderConfig,
        decoder: DecoderConfig,
        load_encoder_weights: bool = True,
    ):
        super().__init__()
        self.vocab = vocab
        self.encoder = Encoder(encoder, load_weights=load_encoder_weights)
        self.decoder = Decoder(len(vocab), encoder.feature_dim, decoder)

    @property
    def grid(self) -> int:
        return self.encoder.config.grid

    def generate(
        self, annotations: torch.Tensor, decoding: DecodingConfig
    ) -> list[list[Hypothesis]]:
        """Captions for a batch of annotation grids (B, L, D); beam_size 1 decodes greedily."""
        if decoding.beam_size <= 1:
            return greedy_decode(self.decoder, annotations, decoding.max_length, decoding.hard_mode,
                                 no_repeat_ngram=decoding.no_repeat_ngram)
        return beam_search(self.decoder, annotations, decoding.beam_size, decoding.max_length,
                           decoding.length_penalty, decoding.hard_mode,
                           no_repeat_ngram=decoding.no_repeat_ngram)

    def words(self, hyp: Hypothesis) -> list[str]:
        return [self.vocab.itos[t] for t in hyp.tokens]
