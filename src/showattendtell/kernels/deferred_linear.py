"""A linear layer as every word of one teacher-forced pass uses it, its weight's gradient taken
once, after every word's backward pass.

By autograd, each word's backward pass computes its own gradient of the weight, a product of
only B rows, (out, B) x (B, in), and adds it into the weight's gradient: two operations and a
pass over the whole weight per word and layer (16 MB for the decoder's 2048 x 2048 context
weights). Here each word keeps its input and its output's gradient, and after the last of them
one product of all T x B rows gives the weight's gradient. On a CPU, 20 products of 64 rows
took 98 ms where one of 1,280 rows took 55 ms (the (2048, 2048) weight); on a GPU a word's
backward pass launches four kernels fewer, and the one product fills the GPU where 64 rows do
not.

Under autocast the weight is cast once per pass: autocast would cast it for every word (it
cannot keep its cast weights inside a CUDA graph, graphed.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from showattendtell.kernels.grad_anchor import Anchor


class DeferredLinear:
    """``x W^T + bias``, or ``x W^T + add``, for the words of one teacher-forced pass.

    Every word's output takes ``anchor`` as an input, so autograd asks for the weight's
    gradient (``take``) after every word's backward pass (grad_anchor.py).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        device = weight.device.type
        amp = torch.is_autocast_enabled(device)
        self.device = device
        self.dtype = torch.get_autocast_dtype(device) if amp else weight.dtype
        self.weight = weight.detach().to(self.dtype)  # (out, in)
        self.bias = None if bias is None else bias.detach().to(self.dtype)  # (out,)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # each word's x, grad of y
        self.dtypes = weight.dtype, None if bias is None else bias.dtype
        trained = weight.requires_grad or (bias is not None and bias.requires_grad)
        needed = torch.is_grad_enabled() and trained
        self.anchor = Anchor.apply(self, weight, bias) if needed else None  # (0,)

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """(N, in) -> (N, out); ``add`` (N, out) in place of the bias."""
        if add is not None and self.bias is not None:
            raise ValueError("DeferredLinear adds either its bias or `add`, not both")
        if self.anchor is None:
            return self.forward(x.to(self.dtype), add)
        return _Word.apply(x, add, self.anchor, self)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weight's and the bias's gradients: one product over every word's rows."""
        pairs, self.pairs = self.pairs, []
        if not pairs:  # no word's output reached the loss
            return None, None
        x = torch.cat([x for x, _ in pairs])  # (T x B, in), the words in any order
        grad_y = torch.cat([g for _, g in pairs])  # (T x B, out), the same order
        weight_dtype, bias_dtype = self.dtypes
        grad_w = torch.mm(grad_y.t(), x).to(weight_dtype)  # (out, in)
        return grad_w, None if bias_dtype is None else grad_y.sum(0).to(bias_dtype)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        base = self.bias if add is None else add.to(self.dtype)
        with torch.autocast(self.device, enabled=False):  # already in autocast's dtype
            if base is None:
                return torch.mm(x, self.weight.t())
            return torch.addmm(base, x, self.weight.t())


class _Word(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, add, anchor, linear: DeferredLinear):
        x = x.to(linear.dtype)
        ctx.save_for_backward(x)
        ctx.linear = linear
        return linear.forward(x, add)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):  # (N, out)
        (x,) = ctx.saved_tensors
        linear: DeferredLinear = ctx.linear
        linear.pairs.append((x, grad_y))
        grad_x = torch.mm(grad_y, linear.weight) if ctx.needs_input_grad[0] else None
        grad_add = grad_y if ctx.needs_input_grad[1] else None
        return grad_x, grad_add, None, None
