"""The optimised decoder computes exactly the equations of the plain reference implementation."""

import pytest
import torch
from helpers import make_batch, small_decoder
from oracles.equations import reference_greedy, reference_soft_loss

from showattendtell.search.decoding import greedy_decode
from showattendtell.training.losses import soft_attention_loss


@pytest.mark.parametrize("fixed_shape", [False, True])
@pytest.mark.parametrize("attend", ["before", "after"])
def test_same_loss_and_gradients_as_the_reference(attend, fixed_shape):
    """Both training recurrences (captions leaving the batch; all T steps with a loss mask)."""
    a, caps, lengths = make_batch(B=6, T=9, L=7, D=12)
    dec = small_decoder(attend=attend)
    fast = soft_attention_loss(dec(a, caps, lengths, fixed_shape=fixed_shape), 6, lam=1.0).loss
    slow = reference_soft_loss(dec, a, caps, lengths, lam=1.0)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)
    g_fast = torch.autograd.grad(fast, list(dec.parameters()))
    g_slow = torch.autograd.grad(slow, list(dec.parameters()))
    for (name, _), gf, gs in zip(dec.named_parameters(), g_fast, g_slow, strict=True):
        assert torch.allclose(gf, gs, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("attend", ["before", "after"])
def test_same_captions_as_the_reference(attend):
    dec = small_decoder(seed=4, attend=attend).eval()
    with torch.no_grad():
        dec.out_vocab.bias[2] += 1.5  # let captions end at different lengths
    a = torch.randn(6, 7, 12, generator=torch.Generator().manual_seed(1))
    fast = [h[0].tokens for h in greedy_decode(dec, a, max_length=10)]
    assert fast == reference_greedy(dec, a, max_length=10)
