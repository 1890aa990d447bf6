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
from torch.autograd.function import once_differentiable


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
        the (N, L, A) tensor than 2 sigmoid(2x) - 1. On a CPU the images are also taken a few
        at a time (``CPU_SCORE_BYTES``), forward and backward, so that the tensor stays in the
        cache (``PiecewiseScores``; faster than torch.tanh for a beam-3 step:
        benchmarks/README.md).
        """
        G, L, A = projected.shape
        u = hidden_proj.view(G, beams, 1, A)
        w2 = 2 * self.score.weight.view(A)
        cpu = projected.device.type == "cpu"
        if cpu and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu"):
            # in pieces of images that stay in the cache, forward and backward (PiecewiseScores)
            per_piece = max(1, CPU_SCORE_BYTES // (beams * L * A * projected.element_size()))
            e = PiecewiseScores.apply(projected, u, w2, per_piece)
        else:  # a GPU, torch.compile (which fuses these operations itself), autocast: whole
            e = _scores(projected, u, w2)
        return F.softmax(e.view(G * beams, L), dim=1)  # (G, beams, L) -> (N, L)


def _scores(p: torch.Tensor, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """2 w^T sigmoid(2 (p_i + u)): (n, L, A), (n, beams, 1, A), (A,) -> (n, beams, L)."""
    return torch.sigmoid((p.unsqueeze(1) + u).mul_(2)) @ w2


class PiecewiseScores(torch.autograd.Function):
    """The scores a few images at a time, and their gradients the same way.

    Why not autograd over ``_scores``: on a CPU each of its operations (add, scale, sigmoid,
    product with w, and in the backward pass their gradients) is a pass over a (B, L, A) tensor
    in memory (25 MB per word at batch 64), and these passes took a third of a training step.
    Here a piece of images stays in the core's cache from the add to the scores, and the
    backward pass recomputes the piece's sigmoid rather than storing it: one read of W_a a per
    word forward, one read and one write backward, and no (B, L, A) tensor kept per word.
    The values are those of ``_scores`` (tests/test_attention.py).
    """

    @staticmethod
    def forward(ctx, projected, u, w2, per_piece: int):  # (G, L, A), (G, beams, 1, A), (A,)
        ctx.save_for_backward(projected, u, w2)
        ctx.per_piece = per_piece
        G, L, _ = projected.shape
        e = projected.new_empty(G, u.size(1), L)  # (G, beams, L)
        for g in range(0, G, per_piece):
            rows = slice(g, g + per_piece)
            torch.matmul(_sigmoids(projected[rows], u[rows]), w2, out=e[rows])
        return e

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_e):  # (G, beams, L)
        projected, u, w2 = ctx.saved_tensors
        G, L, A = projected.shape
        grad_e = grad_e.contiguous()
        grad_p = torch.empty_like(projected)  # (G, L, A)
        grad_u = torch.empty_like(u)  # (G, beams, 1, A)
        grad_w2 = torch.zeros_like(w2)  # (A,)
        w4 = 2 * w2  # d e / d s, times d(2x) / dx
        for g in range(0, G, ctx.per_piece):
            rows = slice(g, g + ctx.per_piece)
            s = _sigmoids(projected[rows], u[rows])  # (n, beams, L, A), recomputed
            ge = grad_e[rows]  # (n, beams, L)
            grad_w2.addmv_(s.view(-1, A).t(), ge.reshape(-1))
            grad_x = ge.unsqueeze(3) * w4  # (n, beams, L, A), then d e / d(p + u) in place:
            torch.ops.aten.sigmoid_backward.grad_input(grad_x, s, grad_input=grad_x)
            # the beams of an image share its p (a reduction's out= would zero-fill first)
            grad_p[rows] = grad_x.squeeze(1) if u.size(1) == 1 else grad_x.sum(1)
            grad_u[rows] = grad_x.sum(2, keepdim=True)
        return grad_p, grad_u, grad_w2, None


def _sigmoids(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sigmoid(2 (p_i + u)), (n, L, A), (n, beams, 1, A) -> (n, beams, L, A), in place."""
    return torch.add(p.unsqueeze(1), u).mul_(2).sigmoid_()


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
