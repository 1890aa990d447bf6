"""CaptionModel: encoder + decoder + vocabulary, the one nn.Module every entry point runs."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from showattendtell.network.decoder import Decoder, DecoderConfig
from showattendtell.network.encoder import Encoder, EncoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.search.confidence import ConfidenceFits
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig, DecodingError, Hypothesis, generate


class CaptionModel(nn.Module):
    # the search's strategy (decoding._strategy): "auto" picks by device; benchmarks and tests
    # force "shrink" or "fixed" to compare them on one machine
    search_strategy: str = "auto"

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
        self.consensus: ConsensusIndex | None = None  # for rerank "consensus" (consensus.py)
        self.confidence: ConfidenceFits | None = None  # how its captions' confidence is scored
        # (confidence.py); None: by the bundled default model's fits

    @property
    def grid(self) -> int:
        return self.encoder.config.grid

    def generate(
        self, annotations: torch.Tensor, decoding: DecodingConfig
    ) -> list[list[Hypothesis]]:
        """Captions for a batch of annotation grids (B, L, D), as ``decoding`` says: each
        image's hypotheses, best first (by the consensus when ``decoding`` reranks by it, each
        hypothesis then carrying its consensus score; else by their scores)."""
        self.check_decoding(decoding)
        hypotheses = generate(self.decoder, annotations, decoding, self.search_strategy)
        if decoding.reranks_by_consensus:
            hypotheses = self._rerank(annotations, hypotheses)
        return hypotheses

    def _rerank(
        self, annotations: torch.Tensor, hypotheses: list[list[Hypothesis]]
    ) -> list[list[Hypothesis]]:
        """Each image's hypotheses by their consensus score, highest first (consensus.py), each
        with its score on it; the sort is stable, so ties keep the beam's order."""
        captions = [[" ".join(self.words(h)) for h in hyps] for hyps in hypotheses]
        scores = self.consensus.rerank(ConsensusIndex.pool(annotations), captions)
        ranked = []
        for hyps, s in zip(hypotheses, scores, strict=True):
            scored = [replace(h, consensus=float(x)) for h, x in zip(hyps, s, strict=True)]
            ranked.append(sorted(scored, key=lambda h: -h.consensus))
        return ranked

    def check_decoding(self, decoding: DecodingConfig) -> None:
        """Raise DecodingError for options this model cannot decode with."""
        if decoding.rerank == "consensus" and self.consensus is None:
            raise DecodingError(
                "--rerank consensus needs a model with a consensus index; this "
                "one has none (`sat export MODEL OUT --consensus-root ...` adds "
                "one; `sat models` lists the models that have one)"
            )

    @torch.no_grad()
    def interpolate_(self, other: CaptionModel, alpha: float) -> CaptionModel:
        """Weights <- alpha * self + (1 - alpha) * other, in place: WiSE-FT (Wortsman et al.
        2022), a fine-tuned model moved back toward the model it was fine-tuned from; on
        Flickr8k the self-critical model interpolated with its start scores above both (see the
        model card). ``other`` must have the same vocabulary and architecture."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"the interpolation weight must be in [0, 1], not {alpha}")
        if list(other.vocab.itos) != list(self.vocab.itos):
            raise ValueError("the models have different vocabularies")
        ours, theirs = self.state_dict(), other.state_dict()
        for k, v in ours.items():  # check everything before changing anything
            if k not in theirs or theirs[k].shape != v.shape:
                raise ValueError(f"the models have different architectures ({k})")
        for k, v in ours.items():
            if v.is_floating_point():
                v.mul_(alpha).add_(theirs[k].to(v), alpha=1.0 - alpha)
        return self

    def words(self, hyp: Hypothesis) -> list[str]:
        return [self.vocab.itos[t] for t in hyp.tokens]
