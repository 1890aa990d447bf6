"""The decoder's LSTM cell for training, with its backward pass written out.

    [i f o] = sigmoid(gates[:3H]),  g = tanh(gates[3H:]),  c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)

Why not autograd: autograd's backward pass of these lines keeps every product's two gradients
apart and joins the gates' gradients with two concatenations. Here each gate's gradient is
written into its place in one (B, 4H) tensor: 16 operations a word forward and backward where
autograd takes 19 (counted as tests/network/test_decoder.py counts a word's). On a GPU each is a
kernel
launch per word, what a training step of small tensors waits on; on a CPU the two are as fast.
(``torch._thnn_fused_lstm_cell`` would be one kernel each way, but it runs on CUDA only and
takes the gates in another order, i f g o.) On a GPU where Triton runs (gpu_kernels.py) the
cell is one kernel forward and one backward (triton_kernels.py), in training and in search.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from showattendtell.kernels import gpu_kernels
from showattendtell.kernels.gpu_kernels import kernels


def lstm_cell(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t, c_t (B, H) from the gates' pre-activations (B, 4H), in the order i f o g, and
    c_{t-1} (B, H). The three sigmoid gates lie side by side: one sigmoid covers them."""
    trained = torch.is_grad_enabled() and (gates.requires_grad or c.requires_grad)
    if gpu_kernels.applies(gates):
        gates, c = gates.contiguous(), c.contiguous()
        return _FusedCell.apply(gates, c) if trained else kernels().cell_forward(gates, c)
    if trained and not torch.compiler.is_compiling():  # torch.compile fuses the plain lines
        return _Cell.apply(gates, c)
    H = c.size(1)
    ifo, g = gates.split([3 * H, H], dim=1)
    i, f, o = torch.sigmoid(ifo).chunk(3, 1)
    c = f * c + i * torch.tanh(g)
    return o * torch.tanh(c), c


class _Cell(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates: torch.Tensor, c: torch.Tensor):
        H = c.size(1)
        act = torch.empty_like(gates)  # (B, 4H): i f o g after their nonlinearities
        torch.sigmoid(gates[:, : 3 * H], out=act[:, : 3 * H])
        torch.tanh(gates[:, 3 * H :], out=act[:, 3 * H :])
        i, f, o, g = act.split(H, 1)
        c_t = torch.addcmul(f * c, i, g)  # (B, H)
        tanh_c = torch.tanh(c_t)
        ctx.save_for_backward(act, c, tanh_c)
        return o * tanh_c, c_t

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h, grad_c):  # (B, H) each; grad_c from the next word (or zeros)
        act, c, tanh_c = ctx.saved_tensors
        H = c.size(1)
        i, f, o, g = act.split(H, 1)
        grad = torch.empty_like(act)  # (B, 4H), d loss / d gates
        d_i, d_f, d_o, d_g = grad.split(H, 1)
        torch.mul(grad_h, tanh_c, out=d_o)
        d_c = torch.ops.aten.tanh_backward(grad_h * o, tanh_c).add_(grad_c)  # d loss / d c_t
        torch.mul(d_c, g, out=d_i)
        torch.mul(d_c, c, out=d_f)
        torch.mul(d_c, i, out=d_g)
        torch.ops.aten.tanh_backward.grad_input(d_g, g, grad_input=d_g)
        d_ifo = grad[:, : 3 * H]
        torch.ops.aten.sigmoid_backward.grad_input(d_ifo, act[:, : 3 * H], grad_input=d_ifo)
        return grad, d_c * f


class _FusedCell(torch.autograd.Function):
    """The cell as two Triton kernels; the backward one recomputes the activations from the
    pre-activations, which are what it saves."""

    @staticmethod
    def forward(ctx, gates: torch.Tensor, c: torch.Tensor):
        ctx.save_for_backward(gates, c)
        return kernels().cell_forward(gates, c)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h, grad_c):  # (B, H) each
        gates, c = ctx.saved_tensors
        return kernels().cell_backward(gates, c, grad_h.contiguous(), grad_c.contiguous())
