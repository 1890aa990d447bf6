import pytest
import torch
from helpers import make_batch, small_decoder

from showattendtell.training.losses import doubly_stochastic_penalty, soft_attention_loss


def test_attention_weights_sum_to_one_at_every_step():
    a, caps, lengths = make_batch()
    out = small_decoder()(a, caps, lengths)
    sums = out.alphas.sum(2)  # (B, T)
    for b, n in enumerate(lengths.tolist()):
        assert torch.allclose(sums[b, :n], torch.ones(n), atol=1e-5)
        assert torch.all(sums[b, n:] == 0)  # nothing after the caption ends
    assert (out.alphas >= 0).all()


def test_padding_never_reaches_the_loss():
    a, caps, lengths = make_batch()
    dec = small_decoder()
    loss1 = soft_attention_loss(dec(a, caps, lengths), 4).loss
    grads1 = torch.autograd.grad(loss1, list(dec.parameters()))
    noisy = caps.clone()
    for b, n in enumerate(lengths.tolist()):
        noisy[b, n + 1 :] = torch.randint(4, 30, (caps.size(1) - n - 1,))  # garbage as padding
    loss2 = soft_attention_loss(dec(a, noisy, lengths), 4).loss
    grads2 = torch.autograd.grad(loss2, list(dec.parameters()))
    assert torch.allclose(loss1, loss2)
    for g1, g2 in zip(grads1, grads2, strict=True):
        assert torch.allclose(g1, g2, atol=1e-6)


def test_doubly_stochastic_penalty_matches_hand_computation():
    # one caption, 2 steps, 3 locations: sum_t alpha = (0.7, 0.9, 0.4)
    alphas = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.6, 0.2]]])
    expected = (1 - 0.7) ** 2 + (1 - 0.9) ** 2 + (1 - 0.4) ** 2
    assert torch.allclose(doubly_stochastic_penalty(alphas), torch.tensor([expected]))


def test_soft_loss_is_nll_plus_lambda_times_penalty():
    a, caps, lengths = make_batch()
    out = small_decoder()(a, caps, lengths)
    plain = soft_attention_loss(out, 4, lam=0.0)
    reg = soft_attention_loss(out, 4, lam=1.0)
    expected = plain.loss + doubly_stochastic_penalty(out.alphas).mean()
    assert torch.allclose(reg.loss, expected)
    # the per-token NLL counts the real tokens only
    assert torch.allclose(plain.nll * lengths.sum(), -plain.log_likelihood.sum())


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("per_piece", [1, 3, 7])  # images per piece, of 7
def test_attention_weights_are_the_tanh_scores_softmax_with_their_gradients(
    monkeypatch, per_piece, beams
):
    """AdditiveAttention.weights computes the scores as 2 w^T sigmoid(2x), on a CPU in pieces
    of images, forward and backward (PiecewiseScores): alpha and every gradient must be those
    of softmax(w^T tanh(x))."""
    from showattendtell.network import attention

    G, L, A = 7, 5, 8
    monkeypatch.setattr(attention, "CPU_SCORE_BYTES", per_piece * beams * L * A * 8)  # float64
    torch.manual_seed(0)
    att = attention.AdditiveAttention(6, A).double()
    projected = att.project_annotations(torch.randn(G, L, 6, dtype=torch.float64))
    projected = projected.detach().requires_grad_()
    hidden = torch.randn(G * beams, 8, dtype=torch.float64, requires_grad=True)

    def textbook(p, h):
        x = p.repeat_interleave(beams, 0) + h.unsqueeze(1)  # (N, L, A): a copy per beam
        return torch.softmax(torch.tanh(x) @ att.score.weight.squeeze(0), dim=1)

    with torch.no_grad():  # inference: in pieces of images on a CPU
        alpha = att.weights(projected, hidden, beams)
        torch.testing.assert_close(alpha, textbook(projected, hidden), rtol=0, atol=1e-12)
    probe = torch.randn_like(alpha)
    inputs = (projected, hidden, att.score.weight)
    got = torch.autograd.grad((att.weights(projected, hidden, beams) * probe).sum(), inputs)
    want = torch.autograd.grad((textbook(projected, hidden) * probe).sum(), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert att.weights(projected[:0], hidden[:0], beams).shape == (0, L)
