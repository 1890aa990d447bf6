"""Training objectives (Xu et al. 2015, sections 4.1 and 4.2). All are means over captions."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from showattendtell.network.attention import attention_entropy
from showattendtell.network.decoder import TeacherForcedOutput


def _per_caption(
    out: TeacherForcedOutput, batch_size: int, token_values: torch.Tensor
) -> torch.Tensor:
    """Sums of per-token values (N,) by caption, (B,): padding never enters."""
    if out.token_mask is not None:  # all positions of a fixed-shape pass: drop the padding's
        token_values = token_values.masked_fill(~out.token_mask, 0.0)
    return torch.zeros(batch_size, device=token_values.device).index_add(
        0, out.caption_index, token_values
    )


def caption_log_likelihood(out: TeacherForcedOutput, batch_size: int) -> torch.Tensor:
    """log p(y | a) (or log p(y | s, a)) per caption, (B,): padding never enters."""
    token_logp = -F.cross_entropy(out.logits.float(), out.targets, reduction="none")
    return _per_caption(out, batch_size, token_logp)


def smoothed_log_likelihood(
    out: TeacherForcedOutput, batch_size: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(y | a), the smoothed targets' negative cross-entropy) per caption, (B,) each, from
    one log-softmax: each word's target is (1 - eps) on the word + eps spread evenly over the
    vocabulary (Szegedy et al. 2016), what F.cross_entropy's label_smoothing computes."""
    logp = F.log_softmax(out.logits.float(), -1)  # (N, V)
    word = logp.gather(1, out.targets.unsqueeze(1)).squeeze(1)  # (N,)
    smoothed = (1 - eps) * word + eps * logp.mean(1)
    return _per_caption(out, batch_size, word), _per_caption(out, batch_size, smoothed)


def doubly_stochastic_penalty(alphas: torch.Tensor) -> torch.Tensor:
    """sum_i (1 - sum_t alpha_ti)^2 per caption; alphas (B, T, L) are zero after the end."""
    return ((1.0 - alphas.sum(1)) ** 2).sum(1)


def attention_entropy_per_caption(alphas: torch.Tensor) -> torch.Tensor:
    """sum_t H(alpha_t) = -sum_t sum_i alpha_ti log alpha_ti per caption, (B,); alphas (B, T, L)
    are zero after the end, where the terms vanish. Penalised, it sharpens the attention."""
    return attention_entropy(alphas.flatten(0, 1)).view(alphas.shape[:2]).sum(1)


@dataclass
class LossTerms:
    loss: torch.Tensor  # what is minimised
    nll: torch.Tensor  # mean per-token negative log-likelihood, for logging / perplexity
    log_likelihood: torch.Tensor  # (B,) log p(y | s, a) per caption


def soft_attention_loss(
    out: TeacherForcedOutput,
    batch_size: int,
    lam: float = 1.0,
    entropy: float = 0.0,
    label_smoothing: float = 0.0,
) -> LossTerms:
    """-log p(y|a) + lambda * sum_i (1 - sum_t alpha_ti)^2 [+ entropy * sum_t H(alpha_t)],
    averaged over captions; with ``label_smoothing`` the first term is the smoothed targets'
    cross-entropy (the logged nll and log_likelihood stay the plain ones)."""
    if label_smoothing:
        ll, target = smoothed_log_likelihood(out, batch_size, label_smoothing)
    else:
        ll = target = caption_log_likelihood(out, batch_size)
    loss = -target.mean()
    if lam:
        loss = loss + lam * doubly_stochastic_penalty(out.alphas).mean()
    if entropy:
        loss = loss + entropy * attention_entropy_per_caption(out.alphas).mean()
    return LossTerms(loss, -ll.sum() / out.n_tokens, ll)


def hard_attention_loss(
    out: TeacherForcedOutput,
    batch_size: int,
    baseline: float | None,
    reward_scale: float = 1.0,
    entropy_weight: float = 0.002,
    samples: int = 1,
) -> LossTerms:
    """Surrogate whose gradient is the paper's eq. 12 (the variational lower bound L_s):

        d/dW [log p(y|s,a)] + lambda_r (log p(y|s,a) - b) d/dW [log p(s|a)] + lambda_e d/dW H[s]

    with s sampled from the attention. (log p(y|s,a) - b) is a constant reward (detached), so the
    REINFORCE term is unbiased for any baseline b that does not depend on s: the moving average
    (``baseline``), or with ``samples`` K >= 2 location sequences drawn for each caption (rows
    k*K .. k*K + K - 1 are caption k) and ``baseline`` None, the mean log p(y|s',a) of the
    caption's other K - 1 samples: a baseline per caption, as self-critical training's.
    """
    if out.location_log_prob is None:
        raise ValueError("hard_attention_loss needs a pass with sampled locations")
    ll = caption_log_likelihood(out, batch_size)
    if baseline is None:
        if samples < 2:
            raise ValueError("the mean-of-others baseline needs 2 or more samples per caption")
        baseline = leave_one_out_mean(ll.detach(), samples)
    reward = (ll.detach() - baseline) * reward_scale
    objective = ll + reward * out.location_log_prob + entropy_weight * out.entropy
    return LossTerms(-objective.mean(), -ll.sum() / out.n_tokens, ll)


def leave_one_out_mean(values: torch.Tensor, k: int) -> torch.Tensor:
    """For (N*k,) values in groups of k consecutive rows: each row's mean over the k - 1 other
    rows of its group, (N*k,)."""
    groups = values.view(-1, k)
    return ((groups.sum(1, keepdim=True) - groups) / (k - 1)).view(-1)


def update_baseline(baseline: float, log_likelihood: torch.Tensor, decay: float = 0.9) -> float:
    """b_k = 0.9 b_{k-1} + 0.1 log p(y | s_k, a), the batch mean of the sampled likelihoods."""
    return decay * baseline + (1.0 - decay) * float(log_likelihood.detach().mean())


def self_critical_loss(
    out: TeacherForcedOutput,
    batch_size: int,
    reward: torch.Tensor,
    baseline: torch.Tensor,
    banned: torch.Tensor,
    entropy: float = 0.0,
) -> LossTerms:
    """Self-critical sequence training (Rennie et al. 2017), the REINFORCE gradient

        -(r(w^s) - b) d/dW log p(w^s | a)

    for captions w^s sampled from the model, rewarded (CIDEr-D) against the model's own
    performance b (here the mean reward of the image's other samples), [+ entropy * sum_t
    H(alpha_t) of the sampled captions' attention, which sharpens it]. For hard attention the
    sampled locations share the reward: log p(w^s, s | a) = log p(w^s | s, a) + log p(s | a).

    The words' probabilities are those the captions were drawn from: renormalised without the
    ``banned`` tokens (V,). With the full softmax, pushing sampled words down would feed
    probability to tokens that are never sampled (so never pushed down) until they hold it all.
    """
    out = replace(out, logits=out.logits.masked_fill(banned, float("-inf")))
    ll = caption_log_likelihood(out, batch_size)
    log_prob = ll if out.location_log_prob is None else ll + out.location_log_prob
    advantage = (reward - baseline).to(log_prob)
    loss = -(advantage * log_prob).mean()
    if entropy:
        loss = loss + entropy * attention_entropy_per_caption(out.alphas).mean()
    return LossTerms(loss, -ll.sum() / out.n_tokens, ll)
