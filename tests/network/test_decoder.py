"""The decoder's inference shortcuts (decoder.py): each must compute what the plain step does."""

import pytest
import torch
from helpers import CountOperations, feats, make_batch, small_decoder

from showattendtell.network.vocab import PAD
from showattendtell.search.decoding import START


def test_word_gate_table_gives_the_steps_of_the_matmul():
    dec, a = small_decoder(seed=3).eval(), feats(B=4)
    words = torch.tensor([START, 5, 7, 29])
    with torch.inference_mode():
        plain = dec.step(words, dec.start(a))
        table = dec.step(words, dec.start(a, word_gates=True))
    assert dec.start(a, word_gates=True).word_gates.shape == (30, 4 * 10)
    for x, y in (
        (plain.log_probs, table.log_probs),
        (plain.alpha, table.alpha),
        (plain.state.h, table.state.h),
        (plain.state.c, table.state.c),
    ):
        assert torch.allclose(x, y, atol=1e-6)


def test_word_gate_table_follows_the_weights():
    dec = small_decoder(seed=3)
    first = dec.word_gates()
    assert dec.word_gates() is first  # kept while the weights stay
    opt = torch.optim.SGD(dec.parameters(), lr=0.1)
    dec.gate_embed(dec.embedding.weight).sum().backward()
    opt.step()  # an in-place update, as in training between two validations
    again = dec.word_gates()
    assert again is not first
    assert torch.allclose(again, dec.gate_embed(dec.embedding.weight).detach(), atol=1e-6)


def test_no_word_gate_table_when_too_large_or_under_autocast(monkeypatch):
    dec = small_decoder()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dec.word_gates() is None
    monkeypatch.setattr(type(dec), "WORD_GATES_MAX_BYTES", 30 * 40 * 4 - 1)
    assert dec.word_gates() is None


def test_grouped_beams_attend_as_rows_with_their_own_grid_copies():
    """DecoderState.beams: K rows per image share one grid; the step equals K copies'."""
    for attention, mode, attend in (
        ("soft", "argmax", "before"),
        ("hard", "argmax", "before"),
        ("soft", "argmax", "after"),
        ("hard", "argmax", "after"),
    ):
        dec, a = small_decoder(attention=attention, seed=5, attend=attend).eval(), feats(B=3)
        K = 4
        words = torch.randint(4, 30, (3 * K,), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            start = dec.start(a)
            h = torch.randn(3 * K, 10, generator=torch.Generator().manual_seed(1))
            grouped = start.regroup(torch.arange(3).repeat_interleave(K), K)
            grouped.h, grouped.c = h, h.flip(1)
            copied = grouped.select(torch.arange(3 * K))  # one grid copy per row, beams 1
            assert copied.beams == 1 and copied.projected.shape[0] == 3 * K
            x, y = dec.step(words, grouped, mode), dec.step(words, copied, mode)
        assert torch.allclose(x.log_probs, y.log_probs, atol=1e-6)
        assert torch.allclose(x.alpha, y.alpha, atol=1e-6)
        if attention == "hard":
            assert torch.equal(x.location, y.location)


def test_fixed_shape_training_gives_the_shrinking_batch_values_and_gradients():
    """Decoder.forward's two recurrences, hard attention with forced locations and both
    attends: the same losses' terms, alphas, locations and gradients; the fixed one also with
    the captions padded to a longer length (as CUDA graphs get them: graphed.pad_captions)."""
    from showattendtell.kernels.graphed import pad_captions
    from showattendtell.training.losses import hard_attention_loss, soft_attention_loss

    a, caps, lengths = make_batch(B=6, T=9, L=7, D=12)
    locs = torch.randint(0, 7, (6, 13), generator=torch.Generator().manual_seed(3))
    for attention, attend in (("hard", "before"), ("hard", "after"), ("soft", "before")):
        dec = small_decoder(attention=attention, attend=attend, seed=7)
        outs, grads = [], []
        for fixed, tokens in ((False, 10), (True, 10), (True, 14)):
            out = dec(
                a,
                pad_captions(caps, tokens, PAD),
                lengths,
                mode="forced" if attention == "hard" else "expectation",
                locations=locs,
                fixed_shape=fixed,
            )
            terms = (
                hard_attention_loss(out, 6, 0.1)
                if attention == "hard"
                else soft_attention_loss(out, 6, lam=1.0, entropy=0.1, label_smoothing=0.1)
            )
            outs.append((out, terms))
            grads.append(torch.autograd.grad(terms.loss, list(dec.parameters())))
        x, lx = outs[0]
        for (y, ly), g in zip(outs[1:], grads[1:], strict=True):
            assert torch.allclose(lx.loss, ly.loss, atol=1e-6)
            assert torch.allclose(lx.nll, ly.nll, atol=1e-6)
            assert torch.allclose(lx.log_likelihood, ly.log_likelihood, atol=1e-5)
            assert torch.allclose(x.alphas, y.alphas[:, : x.alphas.size(1)], atol=1e-6)
            if attention == "hard":
                assert torch.equal(x.locations, y.locations[:, : x.locations.size(1)])
                assert torch.allclose(x.location_log_prob, y.location_log_prob, atol=1e-5)
                assert torch.allclose(x.entropy, y.entropy, atol=1e-5)
            for (name, _), gx, gy in zip(dec.named_parameters(), grads[0], g, strict=True):
                assert torch.allclose(gx, gy, rtol=1e-4, atol=1e-6), name


def test_cpu_training_scores_in_pieces_give_the_plain_values_and_gradients(monkeypatch):
    """On a CPU the training pass takes the attention scores a few images at a time, with one
    gradient buffer for W_a a shared by all words (piecewise_scores.py). Both recurrences, both
    attends, soft and hard: the same losses and gradients as the scores computed whole by
    autograd, in the sigmoid form (a CPU's) and with tanh itself (a GPU's)."""
    from showattendtell.network import attention
    from showattendtell.training.losses import hard_attention_loss, soft_attention_loss

    a, caps, lengths = make_batch(B=7, T=9, L=5, D=12)
    a = a.double()
    locs = torch.randint(0, 5, (7, 9), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(attention, "CPU_SCORE_BYTES", 2 * 5 * 6 * 8)  # 2 images per piece
    for kind, attend in (("hard", "before"), ("soft", "after"), ("soft", "before")):
        dec = small_decoder(attention=kind, attend=attend, seed=7).double()
        for fixed in (False, True):
            results = []
            for scores in ("pieces", "sigmoid", "tanh"):
                with monkeypatch.context() as m:
                    if scores != "pieces":
                        m.setattr(attention, "PIECEWISE_ON_CPU", False)
                    if scores == "tanh":
                        m.setattr(attention, "SLOW_TANH", set())
                    mode = "forced" if kind == "hard" else "expectation"
                    out = dec(a, caps, lengths, mode=mode, locations=locs, fixed_shape=fixed)
                terms = (
                    hard_attention_loss(out, 7, 0.1)
                    if kind == "hard"
                    else soft_attention_loss(out, 7, lam=1.0)
                )
                grads = torch.autograd.grad(terms.loss, list(dec.parameters()))
                results.append((terms.loss, grads))
            (lp, gp), *others = results
            for lw, gw in others:
                torch.testing.assert_close(lp, lw, rtol=0, atol=1e-12)
                for (name, _), x, y in zip(dec.named_parameters(), gp, gw, strict=True):
                    torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=name)


def test_shared_keys_give_no_gradient_to_rows_no_word_read():
    """keys[:n] (the shrinking batch) reads the first n images only: the others' gradient is 0."""
    from showattendtell.kernels.piecewise_scores import SharedKeys
    from showattendtell.network.attention import AdditiveAttention

    torch.manual_seed(0)
    att = AdditiveAttention(6, 8).double()
    projected = torch.randn(5, 4, 8, dtype=torch.float64, requires_grad=True)
    keys = SharedKeys(projected)
    hidden = torch.randn(3, 8, dtype=torch.float64)
    (grad,) = torch.autograd.grad(att.weights(keys[:3], hidden)[:, 0].sum(), projected)
    assert grad[:3].abs().sum() > 0
    assert torch.equal(grad[3:], torch.zeros_like(grad[3:]))


@pytest.mark.parametrize(
    ("attention", "bf16", "most"), [("soft", False, 44), ("hard", False, 42), ("soft", True, 46)]
)
def test_the_fixed_shape_pass_takes_few_operations_per_word(monkeypatch, attention, bf16, most):
    """A GPU runs a training step of small per-word tensors at the pace of its kernel launches.
    The operations one more word adds to the fixed-shape pass (the GPU's: scores whole, tanh
    itself), forward and backward: at most ``most``. By autograd alone (each word's own weight
    gradients, not deferred_linear.py; autograd's LSTM cell, not lstm_cell.py; f_beta's bias
    added apart; the sigmoid form) soft attention takes 59. Under bf16 autocast without its
    cache (as in a CUDA graph, graphed.py) only the score vector w is cast a word, both ways:
    not the weights, not the grid."""
    from showattendtell.network import attention as attention_module
    from showattendtell.training.losses import hard_attention_loss, soft_attention_loss

    monkeypatch.setattr(attention_module, "PIECEWISE_ON_CPU", False)
    monkeypatch.setattr(attention_module, "SLOW_TANH", set())
    a, caps, lengths = make_batch(B=6, T=9, L=5, D=12)
    dec = small_decoder(attention=attention).train()
    mode = "expectation" if attention == "soft" else "sample"
    per_length = []
    for T in (8, 9):
        with CountOperations() as ops:
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16, cache_enabled=False):
                out = dec(a, caps[:, : T + 1], lengths.clamp_max(T), mode=mode, fixed_shape=True)
                terms = (
                    soft_attention_loss(out, 6)
                    if attention == "soft"
                    else hard_attention_loss(out, 6, 0.1)
                )
            torch.autograd.grad(terms.loss, list(dec.parameters()))
        per_length.append(ops.counts)
    per_word = per_length[1] - per_length[0]
    assert 0 < per_word.total() <= most, per_word
    assert per_word["_to_copy"] == (2 if bf16 else 0), per_word
