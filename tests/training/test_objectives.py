"""REINFORCE for hard attention: an unbiased sampled gradient; the baseline moves as specified."""

import itertools

import torch
from helpers import make_batch, small_decoder

from showattendtell.training.losses import (
    caption_log_likelihood,
    hard_attention_loss,
    update_baseline,
)


def test_reinforce_gradient_is_unbiased():
    """Mean of sampled surrogate gradients ~= exact gradient of E_s[log p(y | s, a)].

    L = 3 locations and a 2-token caption give 9 location sequences, so the expectation is
    computed exactly by enumeration and differentiated by autograd.
    """
    L, T, D, V = 3, 2, 5, 12
    dec = small_decoder(V=V, D=D, attention="hard", seed=1)
    g = torch.Generator().manual_seed(3)
    a = 3 * torch.randn(1, L, D, generator=g)
    caps = torch.tensor([[1, 7, 2]])  # <start> w <end>: 2 predicted tokens
    lengths = torch.tensor([T])
    params = [dec.attention.annotation_proj.weight, dec.hidden_proj.weight]

    seqs = torch.tensor(list(itertools.product(range(L), repeat=T)))  # (9, T)
    n = len(seqs)
    out = dec(
        a.expand(n, -1, -1), caps.expand(n, -1), lengths.expand(n), mode="forced", locations=seqs
    )
    ll = caption_log_likelihood(out, n)
    exact = torch.autograd.grad((out.location_log_prob.exp() * ll).sum(), params)

    N = 60000
    torch.manual_seed(0)
    out = dec(a.expand(N, -1, -1), caps.expand(N, -1), lengths.expand(N), mode="sample")
    # any constant baseline keeps the estimate unbiased (E[log p(y|s,a)] is about -5.9 here)
    terms = hard_attention_loss(out, N, baseline=-5.0, reward_scale=1.0, entropy_weight=0.0)
    sampled = torch.autograd.grad(-terms.loss, params)  # mean over N samples

    e = torch.cat([x.flatten() for x in exact])
    s = torch.cat([x.flatten() for x in sampled])
    assert e.norm() > 1e-3
    assert (e - s).norm() < 0.05 * e.norm(), float((e - s).norm() / e.norm())


def test_reinforce_term_is_biased_without_the_score_function():
    """Sanity check that the test above can fail: dropping the REINFORCE term is biased."""
    L, T, D, V = 3, 2, 5, 12
    dec = small_decoder(V=V, D=D, attention="hard", seed=1)
    a = 3 * torch.randn(1, L, D, generator=torch.Generator().manual_seed(3))
    caps, lengths = torch.tensor([[1, 7, 2]]), torch.tensor([T])
    params = [dec.attention.score.weight]  # reaches log p(y|s,a) only through the sampling
    seqs = torch.tensor(list(itertools.product(range(L), repeat=T)))
    out = dec(
        a.expand(9, -1, -1), caps.expand(9, -1), lengths.expand(9), mode="forced", locations=seqs
    )
    exact = torch.autograd.grad(
        (out.location_log_prob.exp() * caption_log_likelihood(out, 9)).sum(), params
    )[0]
    N = 20000
    out = dec(a.expand(N, -1, -1), caps.expand(N, -1), lengths.expand(N), mode="sample")
    naive = torch.autograd.grad(caption_log_likelihood(out, N).mean(), params, allow_unused=True)[0]
    naive = torch.zeros_like(exact) if naive is None else naive
    assert exact.norm() > 1e-3
    assert (exact - naive).norm() > 0.5 * exact.norm()


def test_sampled_locations_follow_attention_and_stop_at_caption_end():
    a, caps, lengths = make_batch()
    out = small_decoder(attention="hard")(a, caps, lengths, mode="sample")
    for b, n in enumerate(lengths.tolist()):
        assert (out.locations[b, :n] >= 0).all() and (out.locations[b, n:] == -1).all()
    assert out.entropy.shape == out.location_log_prob.shape == (a.size(0),)


def test_baseline_updates_as_specified():
    assert abs(update_baseline(0.0, torch.tensor([-10.0, -20.0])) - -1.5) < 1e-9
    assert abs(update_baseline(-1.5, torch.tensor([-5.0])) - (0.9 * -1.5 + 0.1 * -5.0)) < 1e-9


def test_lightning_module_moves_baseline_only_on_sampled_batches():
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.training.lit_module import CaptionModule
    from showattendtell.training.objectives import HardAttentionConfig, ObjectiveConfig

    vocab = ["<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(26)]]
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64)
    module = CaptionModule(
        vocab,
        enc,
        DecoderConfig("hard", 8, 10, 6, 0.0),
        ObjectiveConfig(hard=HardAttentionConfig(expectation_prob=0.0)),
    )
    module.train()
    a, caps, lengths = make_batch(D=2048)
    batch = {"inputs": a, "captions": caps, "lengths": lengths}
    loss, logs = module.compute_loss(batch)
    b1 = float(module.objective.baseline)
    assert b1 < 0 and "baseline" in logs  # 0.9 * 0 + 0.1 * (negative log-likelihood)
    module.objective.config.expectation_prob = 1.0  # expected-context batches leave b alone
    module.compute_loss(batch)
    assert float(module.objective.baseline) == b1


def test_checkpoints_of_the_previous_layout_still_load():
    """Before objectives were objects the baseline was the LightningModule's own buffer."""
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.training.lit_module import CaptionModule

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a", "b"]
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64)
    for attention in ("hard", "soft"):
        module = CaptionModule(vocab, enc, DecoderConfig(attention, 8, 10, 6, 0.0))
        state = {k: v for k, v in module.state_dict().items() if not k.startswith("objective.")}
        state["baseline"] = torch.tensor(-3.5)
        checkpoint = {"state_dict": state}
        fresh = CaptionModule(vocab, enc, DecoderConfig(attention, 8, 10, 6, 0.0))
        fresh.on_load_checkpoint(checkpoint)
        fresh.load_state_dict(checkpoint["state_dict"])  # strict: no key left over or missing
        if attention == "hard":
            assert float(fresh.objective.baseline) == -3.5


def test_leave_one_out_baseline_per_caption():
    from showattendtell.training.losses import leave_one_out_mean

    v = torch.tensor([1.0, 2.0, 6.0, -3.0, -3.0, 0.0])  # two captions, 3 samples each
    torch.testing.assert_close(
        leave_one_out_mean(v, 3), torch.tensor([4.0, 3.5, 1.5, -1.5, -1.5, -3.0])
    )


def test_reinforce_with_the_mean_of_other_samples_is_unbiased():
    """K location samples per caption, each against the mean of the other K - 1: the sampled
    gradient still matches the exact one (enumerated as in the first test)."""
    L, T, D, V, K = 3, 2, 5, 12, 4
    dec = small_decoder(V=V, D=D, attention="hard", seed=1)
    a = 3 * torch.randn(1, L, D, generator=torch.Generator().manual_seed(3))
    caps, lengths = torch.tensor([[1, 7, 2]]), torch.tensor([T])
    params = [dec.attention.annotation_proj.weight, dec.hidden_proj.weight]
    seqs = torch.tensor(list(itertools.product(range(L), repeat=T)))
    out = dec(
        a.expand(9, -1, -1), caps.expand(9, -1), lengths.expand(9), mode="forced", locations=seqs
    )
    exact = torch.autograd.grad(
        (out.location_log_prob.exp() * caption_log_likelihood(out, 9)).sum(), params
    )
    N = 60000  # 15000 captions (the same one) x K samples
    torch.manual_seed(0)
    out = dec(a.expand(N, -1, -1), caps.expand(N, -1), lengths.expand(N), mode="sample")
    terms = hard_attention_loss(out, N, baseline=None, entropy_weight=0.0, samples=K)
    sampled = torch.autograd.grad(-terms.loss, params)
    e = torch.cat([x.flatten() for x in exact])
    s = torch.cat([x.flatten() for x in sampled])
    assert (e - s).norm() < 0.05 * e.norm(), float((e - s).norm() / e.norm())


def test_location_samples_teach_each_caption_k_times_and_leave_b_alone():
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.training.lit_module import CaptionModule, TrainingConfigError
    from showattendtell.training.objectives import HardAttentionConfig, ObjectiveConfig

    vocab = ["<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(26)]]
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64)
    module = CaptionModule(
        vocab,
        enc,
        DecoderConfig("hard", 8, 10, 6, 0.0),
        ObjectiveConfig(hard=HardAttentionConfig(expectation_prob=0.0, location_samples=3)),
    )
    module.train()
    a, caps, lengths = make_batch(D=2048)
    loss, logs = module.compute_loss({"inputs": a, "captions": caps, "lengths": lengths})
    loss.backward()
    assert torch.isfinite(loss) and "baseline" not in logs
    assert float(module.objective.baseline) == 0.0
    assert module.model.decoder.attention.score.weight.grad.abs().sum() > 0
    try:
        CaptionModule(
            vocab,
            enc,
            DecoderConfig("hard", 8, 10, 6, 0.0),
            ObjectiveConfig(hard=HardAttentionConfig(location_samples=0)),
        )
    except TrainingConfigError as e:
        assert "location_samples" in str(e)
    else:
        raise AssertionError("location_samples 0 was accepted")


def test_attention_entropy_penalty_counts_each_word_once_and_sharpens_the_attention():
    """sum_t H(alpha_t) per caption: log L a word for uniform attention, nothing after the end;
    training the soft-attention loss with the penalty sharpens the attention, without it not."""
    import math

    from showattendtell.training.losses import attention_entropy_per_caption, soft_attention_loss

    B, T, L = 2, 5, 9
    alphas = torch.full((B, T, L), 1.0 / L)
    alphas[1, 3:] = 0  # the second caption has 3 words
    assert torch.allclose(
        attention_entropy_per_caption(alphas), torch.tensor([5 * math.log(L), 3 * math.log(L)])
    )

    a, caps, lengths = make_batch()

    def mean_entropy(dec):
        with torch.no_grad():
            out = dec(a, caps, lengths, mode="expectation")
        return float(attention_entropy_per_caption(out.alphas).sum() / lengths.sum())

    def trained(entropy):
        dec = small_decoder(seed=4)
        opt = torch.optim.SGD(dec.parameters(), lr=0.1)
        for _ in range(30):
            out = dec(a, caps, lengths, mode="expectation")
            terms = soft_attention_loss(out, a.size(0), lam=0.0, entropy=entropy)
            opt.zero_grad()
            terms.loss.backward()
            opt.step()
        return dec

    start = mean_entropy(small_decoder(seed=4))
    out = small_decoder(seed=4)(a, caps, lengths, mode="expectation")
    plain = soft_attention_loss(out, a.size(0), lam=0.0)
    with_penalty = soft_attention_loss(out, a.size(0), lam=0.0, entropy=0.5)
    assert torch.allclose(
        with_penalty.loss - plain.loss, 0.5 * attention_entropy_per_caption(out.alphas).mean()
    )
    assert mean_entropy(trained(1.0)) < start - 0.3
    assert mean_entropy(trained(0.0)) > start - 0.1


def test_attention_entropy_is_refused_for_hard_attention_reinforce():
    import pytest

    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.training.lit_module import CaptionModule, TrainingConfigError
    from showattendtell.training.objectives import ObjectiveConfig as O

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a", "b"]
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64)
    with pytest.raises(TrainingConfigError, match="model.objective.hard.entropy_weight"):
        CaptionModule(vocab, enc, DecoderConfig("hard", 8, 10, 6, 0.0), O(attention_entropy=0.1))
    with pytest.raises(TrainingConfigError, match="0 or more"):
        CaptionModule(vocab, enc, DecoderConfig("soft", 8, 10, 6, 0.0), O(attention_entropy=-1))
    module = CaptionModule(
        vocab, enc, DecoderConfig("soft", 8, 10, 6, 0.0), O(attention_entropy=0.1)
    )
    assert module.objective.attention_entropy == 0.1


def test_label_smoothing_is_the_smoothed_targets_cross_entropy_and_leaves_the_likelihood():
    """eps: each word's target is (1 - eps) on the word + eps / V on every word; the logged
    nll and log-likelihood stay the plain model's (they score the model, not the target)."""
    import pytest

    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.training.lit_module import CaptionModule, TrainingConfigError
    from showattendtell.training.losses import soft_attention_loss
    from showattendtell.training.objectives import ObjectiveConfig as O

    a, caps, lengths = make_batch()
    out = small_decoder(seed=4)(a, caps, lengths, mode="expectation")
    plain = soft_attention_loss(out, a.size(0), lam=0.0)
    smoothed = soft_attention_loss(out, a.size(0), lam=0.0, label_smoothing=0.1)
    logp = torch.log_softmax(out.logits.float(), -1)  # (N, V) one row per target word
    word = logp.gather(1, out.targets[:, None])[:, 0]
    per_token = -(0.9 * word + 0.1 * logp.mean(1))
    expected = torch.zeros(a.size(0)).index_add(0, out.caption_index, per_token).mean()
    assert torch.allclose(smoothed.loss, expected, atol=1e-5)
    assert smoothed.loss > plain.loss  # the even share costs more than the word alone
    assert torch.equal(smoothed.nll, plain.nll)
    assert torch.equal(smoothed.log_likelihood, plain.log_likelihood)

    vocab = ["<pad>", "<start>", "<end>", "<unk>", "a", "b"]
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64)
    soft = DecoderConfig("soft", 8, 10, 6, 0.0)
    assert CaptionModule(vocab, enc, soft, O(label_smoothing=0.1)).objective.label_smoothing == 0.1
    with pytest.raises(TrainingConfigError, match="0 <= eps < 1"):
        CaptionModule(vocab, enc, soft, O(label_smoothing=1.0))
    with pytest.raises(TrainingConfigError, match="self-critical"):
        CaptionModule(vocab, enc, soft, O(label_smoothing=0.1, self_critical=5))
    with pytest.raises(TrainingConfigError, match="hard attention"):
        CaptionModule(vocab, enc, DecoderConfig("hard", 8, 10, 6, 0.0), O(label_smoothing=0.1))
