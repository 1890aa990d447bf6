"""A small but real trained model for tests of the entry points (CLI, batch, service).

A randomly initialised ResNet-50 (or ``backbone``: EfficientNet-Lite0 is a sixth of its size) at
64 px (2x2 grid) and a small decoder, trained for a few
seconds on the synthetic shapes task; it names colours and shapes, so its captions are checkable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from synthetic import make_example
from torch.nn.utils.rnn import pad_sequence

from showattendtell.images.files import preprocess
from showattendtell.model import CaptionModel, DecodingConfig
from showattendtell.model_file import save_model
from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.training.losses import soft_attention_loss


def train_tiny_model(
    path: Path,
    steps: int = 100,
    attention: str = "soft",
    seed: int = 0,
    attend: str = "before",
    backbone: str = "resnet50",
) -> Path:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    examples = [make_example(rng) for _ in range(96)]
    vocab = Vocabulary.build([c for _, c, _ in examples], min_count=1)
    enc = EncoderConfig(backbone=backbone, weights=None, input_size=64)
    model = CaptionModel(vocab, enc, DecoderConfig(attention, 32, 64, 32, 0.0, attend=attend))
    with torch.no_grad():
        feats = model.encoder(torch.stack([preprocess(img, 64) for img, _, _ in examples]))
    ids = [torch.tensor(vocab.encode(c)) for _, c, _ in examples]
    caps = pad_sequence(ids, batch_first=True)
    lengths = torch.tensor([len(i) - 1 for i in ids])
    opt = torch.optim.Adam(model.decoder.parameters(), lr=5e-3)
    for _ in range(steps):
        idx = torch.randint(0, len(examples), (32,))
        out = model.decoder(feats[idx], caps[idx], lengths[idx], mode="expectation")
        loss = soft_attention_loss(out, 32, 0.0).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model(model.eval(), path, DecodingConfig(beam_size=3, max_length=8))
