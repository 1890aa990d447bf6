"""DeferredLinear: autograd's values and gradients, the weight's gradient one product after
every word."""

import pytest
import torch
import torch.nn.functional as F

from showattendtell.kernels.deferred_linear import DeferredLinear


def _recurrence(linear, W, b, xs, adds, dtype=torch.float64):
    """Words chained like a decoder's (each input depends on the last output), the batch
    shrinking as captions end; returns the loss."""
    g = torch.Generator().manual_seed(1)
    loss, carry = 0, 0
    for x, add in zip(xs, adds, strict=True):
        n = x.size(0)
        x = x + carry[:n] if torch.is_tensor(carry) else x
        y = linear(x, add) if add is not None else linear(x)  # (n, 7)
        loss = loss + (y.float() * torch.randn(y.shape, generator=g)).sum()
        carry = torch.tanh(y[:, :5]).to(x.dtype)
    return loss


def _plain(W, b):
    return lambda x, add=None: F.linear(x, W, b) if add is None else F.linear(x, W) + add


def _inputs(with_add: bool):
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()

    sizes = (6, 6, 4, 1)
    xs = [leaf(n, 5) for n in sizes]
    adds = [leaf(n, 7) for n in sizes] if with_add else [None] * len(sizes)
    return leaf(7, 5), None if with_add else leaf(7), xs, adds


@pytest.mark.parametrize("with_add", [False, True])
def test_the_values_and_gradients_of_autograd(with_add):
    W, b, xs, adds = _inputs(with_add)
    leaves = [t for t in (W, b, *xs, *adds) if t is not None]
    deferred = _recurrence(DeferredLinear(W, b), W, b, xs, adds)
    plain = _recurrence(_plain(W, b), W, b, xs, adds)
    torch.testing.assert_close(deferred, plain, rtol=0, atol=1e-12)
    for got, want in zip(
        torch.autograd.grad(deferred, leaves), torch.autograd.grad(plain, leaves), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_values_and_dtypes_of_autograd():
    """bf16 autocast: the words compute in bf16 as F.linear would, the weight once cast; the
    weight's and bias's gradients come back in their own dtype, float32."""
    W, b, xs, adds = _inputs(False)
    W, b = W.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    xs = [x.detach().float() for x in xs]
    results = []
    for linear in (DeferredLinear, _plain):
        with torch.autocast("cpu", torch.bfloat16):
            y = linear(W, b)(xs[0])
            loss = _recurrence(linear(W, b), W, b, xs, adds)
        assert y.dtype == torch.bfloat16
        results.append((y, torch.autograd.grad(loss, [W, b])))
    (y_d, (gw_d, gb_d)), (y_p, (gw_p, gb_p)) = results
    assert torch.equal(y_d, y_p)
    assert gw_d.dtype == gb_d.dtype == torch.float32
    torch.testing.assert_close(gw_d, gw_p, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gb_d, gb_p, rtol=2e-2, atol=2e-2)


def test_without_gradients_a_plain_matmul():
    W, b, xs, _ = _inputs(False)
    with torch.no_grad():
        linear = DeferredLinear(W, b)
        assert linear.anchor is None
        torch.testing.assert_close(linear(xs[0]), F.linear(xs[0], W, b))


def test_a_word_no_loss_reads_adds_nothing():
    W, b, xs, _ = _inputs(False)
    linear = DeferredLinear(W, b)
    used, _unused = linear(xs[0]), linear(xs[1])
    grad_w, grad_b = torch.autograd.grad(used.sum(), [W, b])
    torch.testing.assert_close(grad_w, torch.ones(7, 6, dtype=W.dtype) @ xs[0].detach())
    torch.testing.assert_close(grad_b, torch.full((7,), 6.0, dtype=W.dtype))


def test_bias_and_add_together_are_refused():
    W, b, xs, _ = _inputs(False)
    with pytest.raises(ValueError, match="either its bias or `add`"):
        DeferredLinear(W, b)(xs[0], torch.zeros(6, 7, dtype=W.dtype))
