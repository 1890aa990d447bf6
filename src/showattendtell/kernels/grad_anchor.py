"""The anchor of gradients that the words of a teacher-forced pass gather for one tensor.

SharedKeys (piecewise_scores.py) and DeferredLinear (deferred_linear.py) hand a parameter's
gradient to autograd only after every word's backward pass: the words gather their parts, and
one operation at the end makes the gradient. Autograd has no hook for "after every use of this
tensor", so each word's output also takes ``Anchor``'s (0,) output as an input: autograd then
runs the anchor's backward after every word's, and it returns what the gatherer has made.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.autograd.function import once_differentiable


class Gatherer(Protocol):
    def take(self) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the anchored tensors, in their order (None: none), ending the
        pass's gathering."""


class Anchor(torch.autograd.Function):
    """``Anchor.apply(gatherer, *tensors)``: a (0,) tensor in the graph after ``tensors``."""

    @staticmethod
    def forward(ctx, gatherer: Gatherer, *tensors: torch.Tensor | None) -> torch.Tensor:
        ctx.gatherer = gatherer
        return next(t for t in tensors if t is not None).new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _unused):
        return None, *ctx.gatherer.take()
