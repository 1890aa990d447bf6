"""The training LSTM cell's written-out backward pass gives autograd's gradients."""

import torch

from showattendtell.kernels.lstm_cell import lstm_cell


def _plain(gates, c):
    i, f, o, g = gates.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def test_values_and_gradients_of_the_plain_equations():
    g = torch.Generator().manual_seed(0)
    gates = torch.randn(5, 12, dtype=torch.float64, generator=g, requires_grad=True)
    c = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.randn(2, 5, 3, dtype=torch.float64, generator=g)
    results = []
    for cell in (lstm_cell, _plain):
        h1, c1 = cell(gates, c)
        h2, c2 = cell(gates * 0.5 + 0.1, c1)  # a second word: c_t's gradient flows back
        loss = (h1 * weights[0]).sum() + (h2 * weights[1]).sum() + c2.sum()
        results.append(((h1, c1, h2, c2), torch.autograd.grad(loss, [gates, c])))
    for got, want in zip(*(values + grads for values, grads in results), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lstm_cell, (gates, c))


def test_without_gradients_the_same_values():
    gates, c = torch.randn(4, 8), torch.randn(4, 2)
    with torch.no_grad():
        for got, want in zip(lstm_cell(gates, c), _plain(gates, c), strict=True):
            torch.testing.assert_close(got, want)
