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

    def weights(
        self, projected: torch.Tensor, hidden_proj: torch.Tensor, beams: int = 1
    ) -> torch.Tensor:
        """alpha_t (N, L) from W_a a + b (N / beams, L, A) and U_a h_{t-1} (N, A). Rows come in
        groups of ``beams`` per image (beam search): broadcast over each image's grid instead
        of K copies of it.

        The scores are computed as 2 w^T sigmoid(2 x_i) for x_i = W_a a_i + U_a h + b: since
        tanh(x) = 2 sigmoid(2x) - 1, that is w^T tanh(x_i) + sum(w), and a softmax ignores a
        shift shared by all L scores, so alpha and its gradients are the same. Why: on a CPU
        torch's tanh is far slower than its sigmoid, and this form makes 2 fewer passes over
        the (N, L, A) tensor than 2 sigmoid(2x) - 1; at inference on a CPU the images are also
        taken a few at a time (``CPU_SCORE_BYTES``), so that the tensor stays in the cache
        (faster than torch.tanh for a beam-3 step: benchmarks/README.md).
        """
        G, L, A = projected.shape
        u = hidden_proj.view(G, beams, 1, A)
        w2 = 2 * self.score.weight.view(A)
        per_piece = G
        if projected.device.type == "cpu" and not torch.is_grad_enabled():  # training: in
            # pieces, the backward pass's many small matmuls cost more than the cache saves
            per_piece = max(1, CPU_SCORE_BYTES // (beams * L * A * projected.element_size()))

        def scores(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # (n, L, A), (n, beams, 1, A)
            return torch.sigmoid((p.unsqueeze(1) + h).mul_(2)) @ w2  # (n, beams, L)

        if per_piece >= G:  # one piece (training, a GPU): neither slices nor a concatenation,
            e = scores(projected, u)  # whose backward passes would zero-fill and copy
        else:
            e = torch.cat(
                [
                    scores(projected[g : g + per_piece], u[g : g + per_piece])
                    for g in range(0, G, per_piece)
                ]
            )
        return F.softmax(e.view(G * beams, L), dim=1)  # (G, beams, L) -> (N, L)


CPU_SCORE_BYTES = 2 * 2**20  # one piece of the scores: the L2 cache of a core, typically


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
