"""The additive attention scores on a GPU as three Triton kernels (triton_kernels.py).

    e_ti = w^T tanh(W_a a_i + b + U_a h_{t-1})

Why: by autograd, each word's scores are 5 passes over a (B, L, A) tensor forward (add, tanh,
the product with w) and 9 backward (w's outer product, tanh's gradient, the sums for U_a h and
w, and adding the word's gradient of W_a a + b to those of the other words): 25 MB a pass at
batch 64, about a quarter of a float32 training step on an H100 (benchmarks/README.md). Here a
word's scores read W_a a + b once forward and once backward (for the gradient of U_a h, which
the previous word's backward pass needs), and one kernel after the last word's backward pass
makes the gradients of W_a a + b and w for all the words at once, from each word's U_a h and
gradient of e, which are small (``FusedKeys``). torch.compile would fuse each word's operations
too, but not gather the words' gradients, and it compiles for minutes.

Used where gpu_kernels.applies (CUDA devices where Triton runs); a CPU takes
piecewise_scores.py, and torch.compile the plain expression. The kernels are checked against
autograd on a CPU by Triton's interpreter (tests/kernels/test_fused_scores.py), and so on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from showattendtell.kernels import gpu_kernels
from showattendtell.kernels.gpu_kernels import kernels
from showattendtell.kernels.grad_anchor import Anchor
from showattendtell.kernels.piecewise_scores import PassKeys


class FusedKeys(PassKeys):
    """W_a a + b (G, L, A) and w (A,) of one teacher-forced pass, read by every word's scores.

    Each word's backward pass leaves its U_a h (N, A) and gradient of e (N, L) here; after the
    last of them, an ``Anchor`` over W_a a + b and w asks ``take`` for their gradients, which
    one kernel makes for all the words. ``keys[:n]``: the first n images' keys (the packed
    recurrence's shrinking batch); their words' rows are padded with zero gradients.
    """

    def __init__(self, projected: torch.Tensor, w: torch.Tensor):
        self.values = projected.detach().contiguous()  # (G, L, A)
        self.w = w.detach().reshape(-1)  # (A,), from any shape of w (nn.Linear's is (1, A))
        self.gathered: _Gathered = _Gathered(
            self, projected.requires_grad, w.requires_grad, w.shape
        )
        needed = projected.requires_grad or w.requires_grad
        self.anchor = Anchor.apply(self.gathered, projected, w) if needed else None


class _Gathered:
    """Every word's U_a h and gradient of e, until ``take`` makes the keys' and w's gradients."""

    def __init__(self, keys: FusedKeys, keys_grad: bool, w_grad: bool, w_shape: torch.Size):
        self.keys, self.needs, self.w_shape = keys, (keys_grad, w_grad), w_shape
        self.us: list[torch.Tensor] = []  # T x (N, A)
        self.grad_es: list[torch.Tensor] = []  # T x (N, L)

    def add(self, u: torch.Tensor, grad_e: torch.Tensor, beams: int) -> None:
        missing = (self.keys.values.size(0) - u.size(0) // beams) * beams  # images gone by now
        if missing:  # zero gradients: no word of theirs
            u, grad_e = F.pad(u, (0, 0, 0, missing)), F.pad(grad_e, (0, 0, 0, missing))
        self.us.append(u)
        self.grad_es.append(grad_e)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.us:
            return None, None
        us, grad_es = torch.stack(self.us), torch.stack(self.grad_es)  # (T, N, A), (T, N, L)
        self.us, self.grad_es = [], []
        keys = self.keys
        grad_p, grad_w = kernels().keys_grad(keys.values, us, grad_es, keys.w)
        return (
            grad_p if self.needs[0] else None,
            grad_w.to(keys.w.dtype).view(self.w_shape) if self.needs[1] else None,
        )


def applies(projected: torch.Tensor | FusedKeys) -> bool:
    """Whether the scores of these keys take the kernels: FusedKeys, or where
    gpu_kernels.applies."""
    return isinstance(projected, FusedKeys) or gpu_kernels.applies(projected)


def scores(projected: torch.Tensor | FusedKeys, u: torch.Tensor, w: torch.Tensor, beams: int):
    """e (N, L) float32 from the keys (G, L, A), u = U_a h (N = G beams, A) and w (A,)."""
    if u.stride(1) != 1:
        u = u.contiguous()
    if not torch.is_grad_enabled():  # inference: no graph, nothing gathered
        values = projected.values if isinstance(projected, FusedKeys) else projected
        return kernels().scores(values.detach().contiguous(), u, w.detach())
    if not isinstance(projected, FusedKeys):  # a single word: its own gathering
        projected = FusedKeys(projected, w)
    if projected.anchor is None and not u.requires_grad:
        return kernels().scores(projected.values, u, projected.w)
    return _Scores.apply(projected.anchor, u, projected, beams)


class _Scores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, u, keys: FusedKeys, beams: int):
        ctx.save_for_backward(u)
        ctx.keys, ctx.beams = keys, beams
        return kernels().scores(keys.values, u, keys.w)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_e):  # (N, L)
        (u,) = ctx.saved_tensors
        keys: FusedKeys = ctx.keys
        grad_e = grad_e.float().contiguous()
        grad_u = None
        if ctx.needs_input_grad[1]:
            grad_u = kernels().hidden_grad(keys.values, u, keys.w, grad_e)
        if keys.anchor is not None:
            keys.gathered.add(u, grad_e, ctx.beams)
        return None, grad_u, None, None
