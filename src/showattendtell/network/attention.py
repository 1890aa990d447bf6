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

from showattendtell.kernels import fused_scores
from showattendtell.kernels.fused_scores import FusedKeys
from showattendtell.kernels.piecewise_scores import SharedKeys, piecewise_scores, whole_scores


class AdditiveAttention(nn.Module):
    def __init__(self, feature_dim: int, attention_dim: int):
        super().__init__()
        self.annotation_proj = nn.Linear(feature_dim, attention_dim)  # W_a, b
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def project_annotations(self, annotations: torch.Tensor) -> torch.Tensor:
        """W_a a_i + b for all locations: (B, L, D) -> (B, L, A). Once per image."""
        return self.annotation_proj(annotations)

    def shared_keys(self, projected: torch.Tensor) -> torch.Tensor | SharedKeys | FusedKeys:
        """W_a a + b as every word of one training pass reads it: on a CPU, SharedKeys (one
        gradient buffer for all words, piecewise_scores.py); on a GPU, FusedKeys (one kernel
        for all words' gradients, fused_scores.py); elsewhere the tensor itself."""
        if not torch.is_grad_enabled():
            return projected
        if _piecewise(projected):
            return SharedKeys(projected)
        if fused_scores.applies(projected):
            return FusedKeys(projected, self.score.weight)
        return projected

    def weights(
        self,
        projected: torch.Tensor | SharedKeys | FusedKeys,
        hidden_proj: torch.Tensor,
        beams: int = 1,
    ) -> torch.Tensor:
        """alpha_t (N, L) from W_a a + b (N / beams, L, A) and U_a h_{t-1} (N, A). Rows come in
        groups of ``beams`` per image (beam search): broadcast over each image's grid instead
        of K copies of it. ``projected`` may be ``shared_keys(W_a a + b)``: the keys of every
        word of one teacher-forced pass, with one gradient buffer.

        On a CPU the scores are computed as 2 w^T sigmoid(2 x_i) for x_i = W_a a_i + U_a h + b:
        since tanh(x) = 2 sigmoid(2x) - 1, that is w^T tanh(x_i) + sum(w), and a softmax ignores
        a shift shared by all L scores, so alpha and its gradients are the same. Why: there
        torch's tanh is far slower than its sigmoid, and this form makes 2 fewer passes over
        the (N, L, A) tensor than 2 sigmoid(2x) - 1. On a CPU the images are also taken a few
        at a time (``CPU_SCORE_BYTES``), forward and backward, so that the tensor stays in the
        cache (piecewise_scores.py; faster than torch.tanh for a beam-3 step:
        benchmarks/README.md). On a GPU, Triton kernels that read the keys once a word each
        way (fused_scores.py). Elsewhere (torch.compile, or where the kernels do not run)
        by autograd: w^T tanh(x_i) itself, except on devices in ``SLOW_TANH``.
        """
        G, L, A = projected.shape
        w = self.score.weight.view(A)
        u = hidden_proj.view(G, beams, 1, A)
        if _piecewise(projected):
            # in pieces of images that stay in the cache, forward and backward
            per_piece = max(1, CPU_SCORE_BYTES // (beams * L * A * projected.element_size()))
            e = piecewise_scores(projected, u, w, per_piece)
        elif fused_scores.applies(projected):
            e = fused_scores.scores(projected, hidden_proj, w, beams)  # (N, L)
        else:  # torch.compile (which fuses these operations itself), autocast on a CPU
            e = whole_scores(projected, u, w, tanh=projected.device.type not in SLOW_TANH)
        return F.softmax(e.view(G * beams, L), dim=1)  # (G, beams, L) -> (N, L)


def _piecewise(projected: torch.Tensor | SharedKeys | FusedKeys) -> bool:
    """Scores in pieces of images: on a CPU, except where torch.compile fuses the operations
    itself or autocast picks their precision."""
    if isinstance(projected, SharedKeys):
        return True
    if isinstance(projected, FusedKeys):
        return False
    cpu = projected.device.type == "cpu" and PIECEWISE_ON_CPU
    return cpu and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")


PIECEWISE_ON_CPU = True  # False: the scores whole, by autograd, as on a GPU (for comparisons)

SLOW_TANH = {"cpu"}  # devices whose whole scores take the sigmoid form (see weights())


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
