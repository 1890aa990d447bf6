"""The decoder step's Triton kernels (triton_kernels.py): the attention scores
(fused_scores.py) and the LSTM cell (lstm_cell.py), against autograd.

Without a GPU the kernels run in Triton's interpreter, on CPU tensors: the same kernels, the
same indexing and masks, executed with NumPy. tests/kernels/test_cuda.py runs them compiled on a
GPU.
"""

import warnings

import pytest
import torch

# without a GPU, conftest.py has chosen Triton's interpreter
pytest.importorskip("triton", reason="the fused scores are Triton kernels: pip install triton")

from helpers import make_batch, small_decoder, trained_like_decoder  # noqa: E402

from showattendtell.kernels import (
    fused_scores,
    gpu_kernels,  # noqa: E402
)
from showattendtell.kernels.piecewise_scores import whole_scores  # noqa: E402
from showattendtell.network import attention
from showattendtell.search.decoding import beam_search, greedy_decode  # noqa: E402
from showattendtell.training.losses import hard_attention_loss, soft_attention_loss  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fused(monkeypatch):
    """The kernels for this device's step (the interpreter's, on a CPU, without a GPU); where
    they are off, autograd's operations, as on a GPU without Triton (the scores whole, not a
    CPU's piecewise_scores.py)."""
    monkeypatch.setattr(gpu_kernels, "FUSED_DEVICES", {DEVICE})
    monkeypatch.setattr(attention, "PIECEWISE_ON_CPU", False)
    monkeypatch.setattr(attention, "SLOW_TANH", set())


def plain(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "FUSED_DEVICES", set())


def textbook(p, u, w, beams):
    """e (N, L) by autograd: w^T tanh(p_i + u)."""
    G, L, A = p.shape
    return whole_scores(p, u.reshape(G, beams, 1, A), w, tanh=True).reshape(G * beams, L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beams", [1, 3])
def test_the_kernels_give_autogrades_scores_and_gradients_over_many_words(fused, beams, dtype):
    """Several words read one image's keys (``FusedKeys``), with beams, with sizes that are no
    multiple of the kernels' tiles and over one tile (L 37 > 32, A 130 > 128), and U_a h a
    column slice of a wider tensor (as the decoder's split gives it): the scores, and the
    gradients of the keys, of U_a h and of w (one kernel after the last word), must be
    autograd's. bf16 inputs: sums in float32, each gradient in its input's dtype."""
    G, L, A, T = 2, 37, 130, 3
    gen = torch.Generator().manual_seed(beams)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    p = randn(G, L, A).requires_grad_()
    w = randn(A).requires_grad_()
    wide = [randn(G * beams, A + 5).requires_grad_() for _ in range(T)]
    probes = [randn(G * beams, L).float() for _ in range(T)]

    def loss(scores, p, w, us):
        return sum((scores(p, u, w) * probe).sum() for u, probe in zip(us, probes, strict=True))

    keys = fused_scores.FusedKeys(p, w)
    us = [x[:, 2 : A + 2] for x in wide]
    got = torch.autograd.grad(
        loss(lambda p, u, w: fused_scores.scores(keys, u, w, beams), p, w, us), [p, w, *wide]
    )
    # the reference in float64 from the same (rounded) inputs
    p64, w64 = p.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    wide64 = [x.detach().double().requires_grad_() for x in wide]
    us64 = [x[:, 2 : A + 2] for x in wide64]
    want = torch.autograd.grad(
        loss(lambda p, u, w: textbook(p, u, w, beams), p64, w64, us64), [p64, w64, *wide64]
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradients' own rounding
    for g, ref in zip(got, want, strict=True):
        assert g.dtype == dtype
        scale = ref.abs().max().item()
        torch.testing.assert_close(g.double(), ref, rtol=0, atol=tol * scale)
    with torch.no_grad():  # inference: the forward kernel alone
        e = fused_scores.scores(p, us[0], w, beams)
        torch.testing.assert_close(e.double(), textbook(p64, us64[0], w64, beams), **_close())


def _close():
    return {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize(
    ("kind", "attend"), [("soft", "before"), ("soft", "after"), ("hard", "before")]
)
def test_a_training_pass_with_the_kernels_gives_autogrades_loss_and_gradients(
    fused, monkeypatch, kind, attend, fixed
):
    """The decoder's teacher-forced pass (the GPU's fixed shape, and the shrinking batch whose
    later words read the first images' keys only), soft and hard attention: the loss and
    every parameter's gradient as with the scores by autograd."""
    a, caps, lengths = make_batch(B=5, T=6, L=7, D=12)
    a = a.to(DEVICE)
    locs = torch.randint(0, 7, (5, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dec = small_decoder(attention=kind, attend=attend, seed=7).to(DEVICE)
    results = []
    for use_kernels in (True, False):
        with monkeypatch.context() as m:
            if not use_kernels:
                plain(m)
            mode = "forced" if kind == "hard" else "expectation"
            out = dec(a, caps.to(DEVICE), lengths, mode=mode, locations=locs, fixed_shape=fixed)
            terms = (
                hard_attention_loss(out, 5, 0.1) if kind == "hard" else soft_attention_loss(out, 5)
            )
            grads = torch.autograd.grad(terms.loss, list(dec.parameters()))
        results.append((terms.loss, grads))
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (name, _), g, want in zip(dec.named_parameters(), grads, want_grads, strict=True):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["fixed", "shrink"])
def test_searches_with_the_kernels_give_the_same_captions(fused, monkeypatch, strategy):
    """Greedy and beam 3, where beams share their image's keys: the same words and nearly the
    same log-probabilities as with the scores by autograd."""
    dec, a = trained_like_decoder().to(DEVICE), torch.randn(4, 9, 12).to(DEVICE)
    runs = []
    for use_kernels in (True, False):
        with monkeypatch.context() as m:
            if not use_kernels:
                plain(m)
            runs.append(
                (
                    greedy_decode(dec, a, max_length=8, strategy=strategy),
                    beam_search(dec, a, beam_size=3, max_length=8, strategy=strategy),
                )
            )
    for fast, slow in zip(*runs, strict=True):
        for hyps_f, hyps_s in zip(fast, slow, strict=True):
            assert [h.tokens for h in hyps_f] == [h.tokens for h in hyps_s]
            for f, s in zip(hyps_f, hyps_s, strict=True):
                assert abs(f.log_prob - s.log_prob) < 1e-4


def test_where_the_kernels_do_not_run_autograd_steps_with_one_warning(fused, monkeypatch):
    """Triton missing or failing to compile: one warning for the device, then the plain step."""

    def broken():
        raise ImportError("no module named 'triton'")

    gpu_kernels._runs.cache_clear()
    monkeypatch.setattr(gpu_kernels, "_WARNED", set())
    monkeypatch.setattr(gpu_kernels, "kernels", broken)
    p = torch.randn(2, 3, 4, device=DEVICE)
    with pytest.warns(UserWarning, match="step by autograd on .* no module named"):
        assert not fused_scores.applies(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not fused_scores.applies(p)  # once a process
        att = attention.AdditiveAttention(5, 4).to(DEVICE)
        u = torch.randn(2, 4, device=DEVICE)
        with torch.no_grad():
            alpha = att.weights(p, u)
    want = torch.softmax(textbook(p, u, att.score.weight.view(4), 1), dim=1)
    torch.testing.assert_close(alpha, want)
    gpu_kernels._runs.cache_clear()


@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_the_cell_kernels_give_the_lstm_cells_values_and_gradients(fused, dtypes):
    """h_t, c_t and the gradients of the gates and c_{t-1}, for more units than one program
    takes (130 > 128); bf16 gates with a float32 c (autocast): h_t and c_t in the promoted
    dtype, each gradient in its input's dtype, as lstm_cell.py's own backward pass gives."""
    from showattendtell.kernels.lstm_cell import lstm_cell

    B, H = 3, 130
    gen = torch.Generator().manual_seed(5)
    gates = (torch.randn(B, 4 * H, generator=gen) * 2).to(DEVICE, dtypes[0]).requires_grad_()
    c = torch.randn(B, H, generator=gen).to(DEVICE, dtypes[1]).requires_grad_()
    probe_h, probe_c = torch.randn(2, B, H, generator=gen).to(DEVICE)
    h_t, c_t = lstm_cell(gates, c)
    assert h_t.dtype == c_t.dtype == torch.promote_types(*dtypes)
    got = torch.autograd.grad((h_t * probe_h).sum() + (c_t * probe_c).sum(), [gates, c])
    with torch.no_grad():  # the search's: the forward kernel alone
        torch.testing.assert_close(lstm_cell(gates, c), (h_t, c_t), rtol=0, atol=0)

    g64, c64 = gates.detach().double().requires_grad_(), c.detach().double().requires_grad_()
    ifo, g = g64.split([3 * H, H], dim=1)
    i, f, o = torch.sigmoid(ifo).chunk(3, 1)
    want_c = f * c64 + i * torch.tanh(g)
    want_h = o * torch.tanh(want_c)
    want = torch.autograd.grad((want_h * probe_h).sum() + (want_c * probe_c).sum(), [g64, c64])
    torch.testing.assert_close(h_t.double(), want_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(c_t.double(), want_c, rtol=0, atol=1e-6)
    for x, ref, dtype in zip(got, want, dtypes, strict=True):
        assert x.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(x.double(), ref, rtol=tol, atol=tol)


def test_sat_triton_0_turns_the_kernels_off():
    """The way out should the kernels misbehave on some GPU: SAT_TRITON=0, read at import."""
    import os
    import subprocess
    import sys

    code = (
        "from showattendtell.kernels import gpu_kernels; print(sorted(gpu_kernels.FUSED_DEVICES))"
    )
    for value, devices in (("0", "[]"), ("1", "['cuda']")):
        env = {**os.environ, "SAT_TRITON": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == devices, out.stderr
