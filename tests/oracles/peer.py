"""The peer the training benchmark compares with: the decoder of sgrvinod's "a PyTorch Tutorial
to Image Captioning" (``DecoderWithAttention``, the most used Show-Attend-Tell code in PyTorch),
written out with its step as that project trains it. Same equations as ours in spirit (additive
attention, a gate on the context, an LSTM cell fed [E y; z]), with its own choices kept: the
attention projection of the grid is recomputed at every word for the captions still running, a
ReLU in the scores, a per-dimension gate, and the vocabulary projection at every word.

Device-clean: every tensor is made on the device of the grids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence


class PeerAttention(nn.Module):
    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int):
        super().__init__()
        self.encoder_att = nn.Linear(encoder_dim, attention_dim)
        self.decoder_att = nn.Linear(decoder_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)

    def forward(self, encoder_out: torch.Tensor, h: torch.Tensor):
        att = self.full_att(
            F.relu(self.encoder_att(encoder_out) + self.decoder_att(h).unsqueeze(1))
        ).squeeze(2)
        alpha = F.softmax(att, dim=1)
        return (encoder_out * alpha.unsqueeze(2)).sum(1), alpha


class PeerDecoder(nn.Module):
    """sgrvinod's DecoderWithAttention (models.py), same layers and forward pass."""

    def __init__(
        self,
        attention_dim: int,
        embed_dim: int,
        decoder_dim: int,
        vocab_size: int,
        encoder_dim: int = 2048,
        dropout: float = 0.5,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.attention = PeerAttention(encoder_dim, decoder_dim, attention_dim)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.decode_step = nn.LSTMCell(embed_dim + encoder_dim, decoder_dim)
        self.init_h = nn.Linear(encoder_dim, decoder_dim)
        self.init_c = nn.Linear(encoder_dim, decoder_dim)
        self.f_beta = nn.Linear(decoder_dim, encoder_dim)
        self.fc = nn.Linear(decoder_dim, vocab_size)

    def forward(self, encoder_out: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor):
        """captions (B, T+1) from <start>; lengths (B,) predicted tokens per caption. Returns
        the scores (B, T, V), the sorted captions, the decode lengths, alphas and the order."""
        B, L, _ = encoder_out.shape
        lengths, order = lengths.sort(descending=True)
        encoder_out, captions = encoder_out[order], captions[order]
        embeddings = self.embedding(captions)
        mean = encoder_out.mean(1)
        h, c = self.init_h(mean), self.init_c(mean)
        decode_lengths = lengths.tolist()
        T = max(decode_lengths)
        predictions = encoder_out.new_zeros(B, T, self.vocab_size)
        alphas = encoder_out.new_zeros(B, T, L)
        for t in range(T):
            n = sum(length > t for length in decode_lengths)
            awe, alpha = self.attention(encoder_out[:n], h[:n])
            awe = torch.sigmoid(self.f_beta(h[:n])) * awe
            h, c = self.decode_step(torch.cat([embeddings[:n, t], awe], 1), (h[:n], c[:n]))
            predictions[:n, t] = self.fc(self.dropout(h))
            alphas[:n, t] = alpha
        return predictions, captions, decode_lengths, alphas, order


def peer_loss(
    peer: PeerDecoder,
    encoder_out: torch.Tensor,
    captions: torch.Tensor,
    lengths: torch.Tensor,
    alpha_c: float = 1.0,
) -> torch.Tensor:
    """The loss of sgrvinod's train.py: cross-entropy over the packed tokens plus alpha_c times
    the doubly stochastic penalty averaged over captions and locations."""
    scores, caps, decode_lengths, alphas, _ = peer(encoder_out, captions, lengths)
    targets = caps[:, 1:]
    scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
    targets = pack_padded_sequence(targets, decode_lengths, batch_first=True).data
    return F.cross_entropy(scores, targets) + alpha_c * ((1.0 - alphas.sum(1)) ** 2).mean()
