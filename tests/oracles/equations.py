"""A plain, per-step implementation of the Show-Attend-Tell decoder equations.

Written as directly as possible from the paper, reading the weights of a ``Decoder``: every step
recomputes W_a a_i, runs every caption of the batch (padding masked), and applies the output
layer step by step. An oracle, not used by the library: the tests check the optimised decoder
against it. Device-clean: every tensor it makes is on the device of the grids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from showattendtell.network.decoder import Decoder


def _weights(dec: Decoder):
    H, A = dec.config.hidden_dim, dec.config.attention_dim
    W = dec.hidden_proj.weight
    if dec.config.attend == "after":
        W_att = dec.attend_proj.weight
        return W, W_att[:A], W_att[-1]
    return W[: 4 * H], W[4 * H : 4 * H + A], W[-1]


def _attend(dec: Decoder, h, a, U_a, w_beta):
    att = dec.attention
    e = torch.tanh(att.annotation_proj(a) + (h @ U_a.T).unsqueeze(1))  # recomputed every step
    alpha = F.softmax(e @ att.score.weight.squeeze(0), dim=1)
    context = (alpha.unsqueeze(2) * a).sum(1)
    beta = torch.sigmoid(h @ w_beta + dec.beta_bias)
    return beta.unsqueeze(1) * context, alpha


def _lstm(gates, c):
    i, f, o, g = gates.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def reference_step(dec: Decoder, y_prev, h, c, a):
    """One word with soft attention: returns logits, h, c, alpha. Attend "before": from
    h_{t-1}, z_t into the LSTM; "after": the LSTM reads mean_i a_i, then z_t from h_t."""
    W_hh, U_a, w_beta = _weights(dec)
    emb = dec.embedding(y_prev)
    gates = emb @ dec.gate_embed.weight.T + dec.gate_embed.bias + h @ W_hh.T
    if dec.config.attend == "after":
        h, c = _lstm(gates + a.mean(1) @ dec.gate_context.weight.T, c)
        z, alpha = _attend(dec, h, a, U_a, w_beta)
    else:
        z, alpha = _attend(dec, h, a, U_a, w_beta)
        h, c = _lstm(gates + z @ dec.gate_context.weight.T, c)
    deep = emb + dec.out_hidden(h) + dec.out_context(z)
    return dec.out_vocab(dec.dropout(deep)), h, c, alpha


def reference_soft_loss(dec: Decoder, a, captions, lengths, lam: float = 1.0):
    """Mean over captions of -log p(y|a) + lam * sum_i (1 - sum_t alpha_ti)^2."""
    B = a.size(0)
    T = int(lengths.max())
    mean = a.mean(1)
    h, c = dec.init_h(mean), dec.init_c(mean)
    nll = a.new_zeros(B)
    alpha_sum = a.new_zeros(B, a.size(1))
    for t in range(T):
        logits, h_new, c_new, alpha = reference_step(dec, captions[:, t], h, c, a)
        live = (t < lengths).float()
        nll = nll + live * F.cross_entropy(logits, captions[:, t + 1], reduction="none")
        alpha_sum = alpha_sum + live.unsqueeze(1) * alpha
        m = live.unsqueeze(1)
        h, c = m * h_new + (1 - m) * h, m * c_new + (1 - m) * c
    return (nll + lam * ((1 - alpha_sum) ** 2).sum(1)).mean()


@torch.no_grad()
def reference_greedy(dec: Decoder, a, max_length: int = 20) -> list[list[int]]:
    """Greedy captions, one image at a time (<pad>, <start> and <unk> never emitted)."""
    out = []
    for x in a:
        x = x.unsqueeze(0)
        mean = x.mean(1)
        h, c = dec.init_h(mean), dec.init_c(mean)
        y, words = torch.tensor([1], device=a.device), []
        for t in range(max_length + 1):
            logits, h, c, _ = reference_step(dec, y, h, c, x)
            logits[0, :2] = float("-inf")
            logits[0, 3] = float("-inf")
            if t == max_length:
                break
            y = logits.argmax(1)
            if int(y) == 2:
                break
            words.append(int(y))
        out.append(words)
    return out
