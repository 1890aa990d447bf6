"""The additive attention scores: on a CPU a few images at a time, forward and backward; in one
piece elsewhere (``whole_scores``).

    e_ti = 2 w^T sigmoid(2 (W_a a_i + b + U_a h_{t-1}))        (attention.py says why 2 and 2)

Why not autograd over the plain expression: on a CPU each of its operations (add, scale,
sigmoid, product with w, and their gradients) is a pass over a (B, L, A) tensor in memory,
25 MB per word at batch 64, and these passes took a third of a training step. Here a piece of
``per_piece`` images stays in the core's cache from the add to the scores; the backward pass
recomputes the piece's sigmoid rather than storing it, and every word's gradient of W_a a + b is
added into one buffer (``SharedKeys``) rather than into a fresh 25 MB tensor per word that
autograd would then add up.
"""

from __future__ import annotations

import copy

import torch
from torch.autograd.function import once_differentiable

from showattendtell.kernels.grad_anchor import Anchor


class PassKeys:
    """W_a a + b (B, L, A) of one teacher-forced pass as the scores of every word read it.
    ``keys[:n]`` are the first n images' keys (the packed recurrence's shrinking batch),
    sharing everything else with ``keys``."""

    values: torch.Tensor

    def __getitem__(self, rows: slice):
        if rows.start not in (None, 0) or rows.step not in (None, 1):
            raise TypeError(f"{type(self).__name__} takes the first rows only: keys[:n]")
        first = copy.copy(self)
        first.values = self.values[rows]
        return first

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def element_size(self) -> int:
        return self.values.element_size()


class SharedKeys(PassKeys):
    """W_a a + b (B, L, A) of one teacher-forced pass, read by the scores of every word, with
    one gradient buffer that they all add into.

    ``keys[:n]`` are the first n captions' keys (the shrinking batch of the packed recurrence):
    they share the buffer. The words' backward passes run from the last word to the first, so the
    rows holding a gradient only grow (``filled``); an ``Anchor`` hands the buffer to autograd
    after every word's backward pass, because every word's scores take its output as input.
    """

    def __init__(self, projected: torch.Tensor):
        self.values = projected.detach()  # (B, L, A)
        self.store = _Store(self.values if projected.requires_grad else None)
        # (0,): a tensor that ties the words' scores to projected's place in the graph
        self.anchor = Anchor.apply(self.store, projected) if self.store.needed else None


class _Store:
    """The gradient buffer of SharedKeys: rows [0, filled) hold the sum so far."""

    def __init__(self, like: torch.Tensor | None):
        self.like = like  # (B, L, A), the shape of the gradient; None: no gradient needed
        self.grad: torch.Tensor | None = None
        self.filled = 0

    @property
    def needed(self) -> bool:
        return self.like is not None

    def add(self, first: int, grad: torch.Tensor) -> None:
        """Rows [first, first + len(grad)) += grad; rows not yet filled are assigned."""
        if self.grad is None:
            self.grad = torch.empty_like(self.like)
        end = first + grad.size(0)
        k = max(0, min(end, self.filled) - first)  # rows already holding a sum
        if k:
            self.grad[first : first + k] += grad[:k]
        if first + k < end:
            self.grad[first + k : end] = grad[k:]
        self.filled = max(self.filled, end)

    def take(self) -> tuple[torch.Tensor | None]:
        grad, self.grad = self.grad, None
        if grad is not None:
            grad[self.filled :] = 0  # rows no word read
        self.filled = 0
        return (grad,)


def piecewise_scores(
    keys: SharedKeys | torch.Tensor, u: torch.Tensor, w: torch.Tensor, per_piece: int
) -> torch.Tensor:
    """e (G, beams, L) from the keys (G, L, A), u = U_a h (G, beams, 1, A) and w (A,)."""
    w2 = 2 * w
    if not torch.is_grad_enabled():  # inference: no graph, no buffer
        values = keys.values if isinstance(keys, SharedKeys) else keys
        return _forward(values, u, w2, per_piece)
    if not isinstance(keys, SharedKeys):  # a single call: its own buffer
        keys = SharedKeys(keys)
    return _Scores.apply(keys.anchor, u, w2, keys, per_piece)


def whole_scores(p: torch.Tensor, u: torch.Tensor, w: torch.Tensor, tanh: bool) -> torch.Tensor:
    """The scores in one piece, by autograd (a GPU, torch.compile, autocast): (n, L, A),
    (n, beams, 1, A), (A,) -> (n, beams, L). ``tanh``: w^T tanh(p + u); otherwise the same
    scores shifted by sum(w), 2 w^T sigmoid(2 (p + u)) (attention.py says why)."""
    if tanh:
        return torch.tanh(p.unsqueeze(1) + u) @ w
    return _sigmoids(p, u) @ (2 * w)


def _forward(keys: torch.Tensor, u: torch.Tensor, w2: torch.Tensor, per_piece: int):
    G, L, _ = keys.shape
    e = keys.new_empty(G, u.size(1), L)  # (G, beams, L)
    for g in range(0, G, per_piece):
        rows = slice(g, g + per_piece)
        torch.matmul(_sigmoids(keys[rows], u[rows]), w2, out=e[rows])
    return e


def _sigmoids(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sigmoid(2 (p_i + u)), (n, L, A), (n, beams, 1, A) -> (n, beams, L, A), in place."""
    return torch.add(p.unsqueeze(1), u).mul_(2).sigmoid_()


class _Scores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, u, w2, keys: SharedKeys, per_piece: int):
        ctx.save_for_backward(u, w2)
        ctx.keys, ctx.per_piece = keys, per_piece
        return _forward(keys.values, u, w2, per_piece)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_e):  # (G, beams, L)
        u, w2 = ctx.saved_tensors
        keys: SharedKeys = ctx.keys
        G, L, A = keys.shape
        grad_e = grad_e.contiguous()
        grad_u = torch.empty_like(u)  # (G, beams, 1, A)
        grad_w2 = torch.zeros_like(w2)  # (A,)
        w4 = 2 * w2  # d e / d s, times d(2x) / dx
        for g in range(0, G, ctx.per_piece):
            rows = slice(g, g + ctx.per_piece)
            s = _sigmoids(keys.values[rows], u[rows])  # (n, beams, L, A), recomputed
            ge = grad_e[rows]  # (n, beams, L)
            grad_w2.addmv_(s.view(-1, A).t(), ge.reshape(-1))
            grad_x = ge.unsqueeze(3) * w4  # (n, beams, L, A), then d e / d(p + u) in place:
            torch.ops.aten.sigmoid_backward.grad_input(grad_x, s, grad_input=grad_x)
            grad_u[rows] = grad_x.sum(2, keepdim=True)
            if keys.store.needed:  # the beams of an image share its keys
                grad_p = grad_x.squeeze(1) if u.size(1) == 1 else grad_x.sum(1)
                keys.store.add(g, grad_p)
        return None, grad_u, grad_w2, None, None
