"""Ensembles: several trained decoders over one encoder's grids, searched as one model.

Each word's distribution is the mean of the members' probabilities (log-mean-exp of their
log-probabilities), so greedy and beam search (decoding.py) run unchanged through the same two
calls, ``start`` and ``step``. The attention map shown for a word is the mean of the members'
maps. Members must share the encoder (the same backbone, weights and input size: the grids are
computed once) and the vocabulary; `--model A+B` names an ensemble (catalog.resolve_models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from showattendtell.errors import UsageError
from showattendtell.model import CaptionModel
from showattendtell.network.decoder import Decoder, DecoderState, Step


class EnsembleError(UsageError, ValueError):
    """The models cannot be combined (another encoder or vocabulary)."""


@dataclass
class EnsembleState:
    """One DecoderState per member, their rows kept in step."""

    members: tuple[DecoderState, ...]

    def select(self, rows: torch.Tensor, same_images: bool = False) -> EnsembleState:
        return EnsembleState(tuple(s.select(rows, same_images) for s in self.members))

    def regroup(
        self, rows: torch.Tensor, beams: int, images: torch.Tensor | None = None
    ) -> EnsembleState:
        return EnsembleState(tuple(s.regroup(rows, beams, images) for s in self.members))


class EnsembleDecoder(nn.Module):
    """The search's two calls over several decoders (see the module docstring)."""

    def __init__(self, decoders: Sequence[Decoder]):
        super().__init__()
        self.members = nn.ModuleList(decoders)
        hard = any(d.config.attention == "hard" for d in decoders)
        # what callers read of a decoder's config: the attention type ("hard" when any member
        # is: --hard-mode then applies to those members)
        self.config = replace(decoders[0].config, attention="hard" if hard else "soft")

    def start(self, annotations: torch.Tensor, word_gates: bool = False) -> EnsembleState:
        return EnsembleState(tuple(d.start(annotations, word_gates) for d in self.members))

    def step(
        self, prev_words: torch.Tensor, state: EnsembleState, hard_mode: str = "argmax"
    ) -> Step:
        steps = [
            d.step(prev_words, s, hard_mode)
            for d, s in zip(self.members, state.members, strict=True)
        ]
        log_probs = torch.stack([s.log_probs for s in steps])  # (M, N, V)
        log_probs = torch.logsumexp(log_probs, 0) - math.log(len(steps))  # log mean p: (N, V)
        alpha = torch.stack([s.alpha.float() for s in steps]).mean(0).to(steps[0].alpha.dtype)
        # no single attended cell: the members may each have read another one
        return Step(log_probs, alpha, None, EnsembleState(tuple(s.state for s in steps)))


class EnsembleModel(CaptionModel):
    """A CaptionModel whose decoder is an EnsembleDecoder over ``models``' decoders, with the
    first model's encoder and vocabulary (checked to be the others' too)."""

    def __init__(self, models: Sequence[CaptionModel], names: Sequence[str] | None = None):
        nn.Module.__init__(self)
        names = list(names or [f"model {i + 1}" for i in range(len(models))])
        first = models[0]
        ref = first.encoder.state_dict()
        for model, name in zip(models[1:], names[1:], strict=True):
            if (
                list(model.vocab.itos) != list(first.vocab.itos)
                or model.vocab.tokenizer != first.vocab.tokenizer
            ):
                raise EnsembleError(
                    f"{name} has another vocabulary than {names[0]}: an "
                    "ensemble needs models trained with the same vocabulary"
                )
            other = model.encoder.state_dict()
            # to float16 rounding: two exports of one frozen encoder may differ in its last bit
            if (
                model.encoder.config != first.encoder.config
                or set(other) != set(ref)
                or any(
                    not torch.allclose(other[k].float(), ref[k].float(), rtol=1e-3, atol=1e-6)
                    for k in ref
                )
            ):
                raise EnsembleError(
                    f"{name} has another encoder than {names[0]}: an ensemble "
                    "needs models with the same encoder (backbone, weights, size)"
                )
        self.vocab = first.vocab
        self.encoder = first.encoder
        self.decoder = EnsembleDecoder([m.decoder for m in models])
        self.consensus = first.consensus  # the first model's index, as its stored decoding

    def interpolate_(self, other: CaptionModel, alpha: float) -> CaptionModel:
        raise EnsembleError("an ensemble cannot be interpolated; interpolate its members")
