"""The attention equations of Show, Attend and Tell (Xu et al. 2015, sections 3.1.2 and 4).

    e_ti     = w^T tanh(W_a a_i + U_a h_{t-1} + b)          additive (Bahdanau) scores
    alpha_t  = softmax_i(e_ti)                               over the L grid locations
    beta_t   = sigmoid(f_beta(h_{t-1}))                      gating scalar
    soft:  z_t = beta_t * sum_i alpha_ti a_i                 expected context
    hard:  s_t ~ Multinoulli(alpha_t),  z_t = beta_t * a_{s_t}

W_a a_i does not depend on t, so it is computed once per image (``project_annotations``);
U_a h_{t-1} and f_beta(h_{t-1}) are fused with the LSTM's recurrent matmul by the decoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdditiveAttention(nn.Module):
    def __init__(self, feature_dim: int, attention_dim: int):
        super().__init__()
        self.annotation_proj = nn.Linear(feature_dim, attention_dim)  # W_a, b
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def project_annotations(self, annotations: torch.Tensor) -> torch.Tensor:
        """W_a a_i + b for all locations: (B, L, D) -> (B, L, A). Once per image."""
        return self.annotation_proj(annotations)

    def weights(self, projected: torch.Tensor, hidden_proj: torch.Tensor,
                beams: int = 1) -> torch.Tensor:
        """alpha_t (N, L) from W_a a + b (N / beams, L, A) and U_a h_{t-1} (N, A). Rows come in
        groups of ``beams`` per image (beam search): broadcast over each image's grid instead
        of K copies of it."""
        G, L, A = projected.shape
        e = self.score(tanh(projected.unsqueeze(1) + hidden_proj.view(G, beams, 1, A)))
        return F.softmax(e.view(G * beams, L), dim=1)  # (G, beams, L, 1) -> (N, L)


class _SigmoidTanh(torch.autograd.Function):
    """tanh(x) = 2 sigmoid(2x) - 1, with tanh's own gradient 1 - tanh(x)^2."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x * 2).mul_(2).sub_(1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh, computed as 2 sigmoid(2x) - 1 on a CPU: the same values to float32 rounding, and
    torch's CPU tanh is far slower than its sigmoid. Measured on this project's CPU (AVX-512,
    torch 2.14), one thread, the (16, 3, 81, 512) scores of a beam-3 step: torch.tanh 5.0 ms,
    this 1.4 ms; the tanh was the largest single cost of a decoder step (the three gate and
    vocabulary matmuls together: 6.0 ms)."""
    if x.device.type != "cpu":
        return torch.tanh(x)
    return _SigmoidTanh.apply(x)


def expected_context(alpha: torch.Tensor, annotations: torch.Tensor) -> torch.Tensor:
    """sum_i alpha_ti a_i as one batched matmul: (B, L), (B, L, D) -> (B, D)."""
    return torch.bmm(alpha.unsqueeze(1), annotations).squeeze(1)


def sample_locations(alpha: torch.Tensor) -> torch.Tensor:
    """s_t ~ Multinoulli(alpha_t): (B, L) -> (B,) location indices."""
    return torch.multinomial(alpha, 1).squeeze(1)


def gather_locations(annotations: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """a_{s_t}: (B, L, D), (B,) -> (B, D)."""
    idx = locations.view(-1, 1, 1).expand(-1, 1, annotations.size(2))
    return annotations.gather(1, idx).squeeze(1)


def attention_entropy(alpha: torch.Tensor) -> torch.Tensor:
    """H[s_t] = -sum_i alpha_ti log alpha_ti, per row: (B, L) -> (B,)."""
    return -(alpha * torch.log(alpha.clamp_min(1e-12))).sum(1)
