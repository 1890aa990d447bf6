"""Self-critical sequence training: the CIDEr-D reward, the sampler and learning from them."""

import pytest
import torch
from helpers import encode_captions
from helpers.marks import needs_java
from synthetic import make_dataset

from showattendtell.evaluation.metrics import CiderDReward, MeteorReward
from showattendtell.model import DecodingConfig
from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.search.decoding import END, PAD, START, UNK, sample_captions
from showattendtell.training.lit_module import CaptionModule
from showattendtell.training.losses import soft_attention_loss
from showattendtell.training.objectives import ObjectiveConfig

REFS = [
    ["a dog runs on the grass", "a brown dog running", "the dog plays outside"],
    ["a man rides a bike", "a cyclist on a road", "man riding a bicycle down the street"],
    ["two kids play in water", "children splash in a pool", "kids swimming"],
]
CANDS = ["a dog runs on grass", "a man riding a bike on the road", "kids play in the pool"]


def test_cider_reward_is_the_toolkit_cider_with_the_corpus_idf():
    from pycocoevalcap.cider.cider import Cider

    reward = CiderDReward(REFS)
    _, official = Cider().compute_score(
        dict(enumerate(REFS)), {i: [c] for i, c in enumerate(CANDS)}
    )
    assert reward(CANDS, REFS) == list(map(float, official))  # the batch is the whole corpus
    # scored alone, a caption keeps the corpus's idf (the toolkit would compute it from 1 image)
    assert reward(CANDS[1:2], REFS[1:2]) == [float(official[1])]
    alone = Cider().compute_score({0: REFS[1]}, {0: [CANDS[1]]})[0]
    assert abs(alone - official[1]) > 0.1


@needs_java
def test_meteor_reward_scores_each_caption_against_its_own_references():
    reward = MeteorReward()
    own = reward(CANDS, REFS)
    others = reward(CANDS, REFS[1:] + REFS[:1])  # each caption against another image's
    assert all(0.0 < o <= 1.0 for o in own)
    assert all(m > n for m, n in zip(own, others, strict=True)), (own, others)
    assert reward(CANDS[1:2], REFS[1:2]) == own[1:2]  # per caption, not per batch


def shapes_module(attention="soft", max_length=6, meteor=0.0):
    feats, captions, _, _ = make_dataset(512, seed=0)
    feats = torch.nn.functional.pad(feats, (0, 2048 - feats.size(2)))  # the encoder's width
    vocab = Vocabulary.build(captions, min_count=1)
    torch.manual_seed(0)
    module = CaptionModule(
        vocab.itos,
        EncoderConfig(backbone="resnet50", weights=None, input_size=64),
        DecoderConfig(attention, 32, 64, 32, dropout=0.0),
        ObjectiveConfig(self_critical=5, self_critical_meteor=meteor),
        val_decoding=DecodingConfig(beam_size=1, max_length=max_length, hard_mode="argmax"),
    )
    return module, feats, captions, vocab


def test_sampled_captions_are_well_formed():
    for attention in ("soft", "hard"):
        module, feats, _, _ = shapes_module(attention)
        with torch.no_grad():  # <end> unlikely: some captions run to max_length and are cut
            module.model.decoder.out_vocab.bias[END] -= 2.0
        s = sample_captions(module.model.decoder, feats[:64], max_length=6)
        assert (s.captions[:, 0] == START).all()
        cut = 0
        for b in range(64):
            n = int(s.lengths[b])  # predicted tokens: the words, and <end> unless cut
            words = s.captions[b, 1 : n + 1].tolist()
            assert (s.captions[b, n + 1 :] == PAD).all()
            if words[-1] == END:
                assert s.words(b) == words[:-1] and len(words) <= 7
            else:
                assert len(words) == 6 and s.words(b) == words  # cut, never a forced <end>
                cut += 1
            assert not {PAD, START, END, UNK} & set(s.words(b))
            if attention == "hard":
                assert (s.locations[b, :n] >= 0).all() and (s.locations[b, n:] == -1).all()
        assert 0 < cut < 64
        assert (s.locations is None) == (attention == "soft")


def expected_reward(module, feats, captions, samples=4) -> float:
    """The mean CIDEr-D of captions sampled from the model: what self-critical training raises."""
    torch.manual_seed(1)
    a = feats.repeat_interleave(samples, 0)
    s = sample_captions(module.model.decoder.eval(), a, module.val_decoding.max_length)
    module.train()
    itos = module.model.vocab.itos
    cands = [" ".join(itos[w] for w in s.words(b)) for b in range(a.size(0))]
    refs = [[c] for c in captions for _ in range(samples)]
    return sum(module.objective.cider(cands, refs)) / len(cands)


@pytest.mark.slow
def test_self_critical_training_raises_the_expected_reward():
    module, feats, captions, vocab = shapes_module()
    module.objective.set_references([[c] for c in captions])
    caps, lengths = encode_captions(vocab, captions)
    dec = module.model.decoder
    opt = torch.optim.Adam(dec.parameters(), lr=3e-3)
    for _ in range(40):  # a weak start: a few maximum-likelihood steps
        idx = torch.randint(0, 512, (64,))
        loss = soft_attention_loss(dec(feats[idx], caps[idx], lengths[idx]), 64, 0.0).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    before = expected_reward(module, feats[:256], captions[:256])
    opt = torch.optim.Adam(dec.parameters(), lr=1e-3)
    module.train()
    for _ in range(50):
        idx = torch.randint(0, 512, (16,))
        loss, logs = module.compute_loss(
            {"inputs": feats[idx], "captions": caps[idx], "lengths": lengths[idx], "index": idx}
        )
        assert set(logs) == {"nll", "reward", "reward_cider", "attention_entropy"}
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = expected_reward(module, feats[:256], captions[:256])
    assert after > before + 0.1, (before, after)


def test_self_critical_log_prob_is_that_of_the_sampling_distribution(monkeypatch):
    """The gradient must be that of the distribution sampled from: without <pad>, <start>, <unk>
    (the test decoder favours <unk>, so the full softmax would differ a lot)."""
    from helpers import feats, trained_like_decoder

    from showattendtell.search.decoding import banned_tokens
    from showattendtell.training.losses import self_critical_loss

    dec, a = trained_like_decoder(), feats(B=16)
    drawn = []
    multinomial = torch.multinomial

    def recording(p, n):
        w = multinomial(p, n)
        drawn.append((p / p.sum(1, keepdim=True)).gather(1, w).log().squeeze(1))
        return w

    monkeypatch.setattr(torch, "multinomial", recording)
    s = sample_captions(dec, a, max_length=8)
    monkeypatch.undo()
    steps = torch.stack(drawn, 1)
    sampled_log_prob = (steps * (s.captions[:, 1 : steps.size(1) + 1] != PAD)).sum(1)
    out = dec(a, s.captions, s.lengths)
    ones = torch.ones(16)
    # with advantage 1 the loss is minus the mean log-probability of the sampled captions
    loss = self_critical_loss(out, 16, ones, 0 * ones, banned_tokens(dec.vocab_size, "cpu")).loss
    assert torch.allclose(-loss, sampled_log_prob.mean(), atol=1e-4)


@needs_java
def test_self_critical_reward_adds_the_weighted_meteor():
    module, feats, captions, vocab = shapes_module(meteor=2.0)
    module.objective.set_references([[c] for c in captions])
    caps, lengths = encode_captions(vocab, captions)
    idx = torch.arange(8)
    module.train()
    _, logs = module.compute_loss(
        {"inputs": feats[idx], "captions": caps[idx], "lengths": lengths[idx], "index": idx}
    )
    assert set(logs) == {"nll", "reward", "reward_cider", "reward_meteor", "attention_entropy"}
    assert 0.0 < float(logs["reward_meteor"]) <= 1.0
    assert torch.isclose(logs["reward"], logs["reward_cider"] + 2.0 * logs["reward_meteor"])
    with pytest.raises(ValueError, match="self_critical_meteor"):
        shapes_module(meteor=-1.0)


def test_self_critical_needs_two_samples_per_image():
    for k in (1, -2):
        with pytest.raises(ValueError, match="self_critical must be 0"):
            CaptionModule(
                ["<pad>", "<start>", "<end>", "<unk>", "a"],
                EncoderConfig(backbone="resnet50", weights=None, input_size=64),
                DecoderConfig("soft", 8, 8, 8, 0.0),
                ObjectiveConfig(self_critical=k),
            )
