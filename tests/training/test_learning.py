"""Learning really happens: memorising real captioned photos; attention finding named objects."""

import random

import pytest
import torch
from helpers import encode_captions
from helpers.data import FLICKR8K, RESNET50_CAFFE, needs_flickr8k, needs_resnet50
from synthetic import GRID, make_dataset

from showattendtell.network.decoder import Decoder, DecoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.search.decoding import greedy_decode
from showattendtell.training.losses import hard_attention_loss, soft_attention_loss, update_baseline


@pytest.mark.slow
@needs_flickr8k
@needs_resnet50
def test_overfits_a_handful_of_real_photos():
    from showattendtell.data.datasets import load_flickr8k
    from showattendtell.images.files import open_image, preprocess
    from showattendtell.network.encoder import Encoder, EncoderConfig

    images = load_flickr8k(FLICKR8K, "train").images[:8]
    captions = [im.captions[0] for im in images]
    enc = Encoder(EncoderConfig(weights=str(RESNET50_CAFFE), caffe_style=True, input_size=224))
    with torch.no_grad():
        feats = enc(torch.stack([preprocess(open_image(im.path), 224) for im in images]))
    vocab = Vocabulary.build(captions, min_count=1)
    caps, lengths = encode_captions(vocab, captions)
    torch.manual_seed(0)
    dec = Decoder(len(vocab), 2048, DecoderConfig("soft", 128, 256, 128, dropout=0.0))
    opt = torch.optim.Adam(dec.parameters(), lr=2e-3)
    for _ in range(60):
        terms = soft_attention_loss(dec(feats, caps, lengths), len(images), lam=0.0)
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
    assert float(terms.nll.detach()) < 0.05  # per-token negative log-likelihood, near zero
    dec.eval()
    for hyp, caption in zip(greedy_decode(dec, feats, max_length=30), captions, strict=True):
        assert vocab.decode(hyp[0].tokens) == vocab.decode(vocab.encode(caption)[1:])


def train_on_shapes(attention: str, steps: int, attend: str = "before"):
    torch.manual_seed(0)
    random.seed(0)
    feats, captions, _, _ = make_dataset(512, seed=0)
    vocab = Vocabulary.build(captions, min_count=1)
    caps, lengths = encode_captions(vocab, captions)
    dec = Decoder(
        len(vocab), feats.size(2), DecoderConfig(attention, 32, 64, 32, dropout=0.0, attend=attend)
    )
    opt = torch.optim.Adam(dec.parameters(), lr=3e-3)
    baseline = 0.0
    for _ in range(steps):
        idx = torch.randint(0, len(captions), (64,))
        if attention == "hard" and random.random() < 0.5:  # sampled locations, REINFORCE
            out = dec(feats[idx], caps[idx], lengths[idx], mode="sample")
            terms = hard_attention_loss(out, 64, baseline, entropy_weight=0.002)
            baseline = update_baseline(baseline, terms.log_likelihood)
        else:  # soft attention, or the expected context for hard attention
            terms = soft_attention_loss(dec(feats[idx], caps[idx], lengths[idx]), 64, lam=0.0)
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
    return dec.eval(), vocab


def attention_hit_rate(dec, vocab) -> float:
    """How often the attention peak of a word naming an object lies in that object's cell."""
    feats, captions, cells, _ = make_dataset(200, seed=1)
    hits = total = 0
    for hyps, caption, word_cells in zip(
        greedy_decode(dec, feats, max_length=6), captions, cells, strict=True
    ):
        where = dict(zip(caption.split(), word_cells, strict=True))
        colours = caption.split()[0::2]
        for tok, alpha in zip(hyps[0].tokens, hyps[0].alphas, strict=True):
            word = vocab.itos[tok]
            if word in colours:
                total += 1
                hits += int(alpha.argmax()) == where[word]
    assert total > 200
    return hits / total


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention,steps,min_rate,attend",
    [("soft", 300, 0.5, "before"), ("hard", 400, 0.3, "before"), ("soft", 300, 0.5, "after")],
)
def test_attention_finds_the_named_object(attention, steps, min_rate, attend):
    chance = 1 / (GRID * GRID)
    rate = attention_hit_rate(*train_on_shapes(attention, steps, attend))
    assert rate > min_rate, (
        f"{attention}: attention on the named object {rate:.0%} (chance {chance:.0%})"
    )
