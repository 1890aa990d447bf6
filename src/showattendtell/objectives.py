"""Training objectives as objects, chosen once from the config (see ``make_objective``).

Each is called as ``objective(model, annotations, batch) -> (loss, logs)``: it picks the passes
it needs (teacher forcing with the expected context or sampled locations, sampled captions),
keeps its own state (the REINFORCE baseline, the reward's references) and returns the loss to
minimise and what is worth logging ("loss" only where its value means something). The formulas
themselves are in losses.py. After ruotianluo/ImageCaptioning.pytorch's loss wrapper.

    MaximumLikelihood        soft attention: -log p(y|a) + lambda sum_i (1 - sum_t alpha_ti)^2
    HardAttentionReinforce   hard attention: the variational lower bound of Xu et al. eq. 12
    SelfCritical             Rennie et al. 2017, with the mean-of-others baseline (Luo 2020)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from showattendtell.decoder import TeacherForcedOutput
from showattendtell.decoding import banned_tokens, sample_captions
from showattendtell.losses import (
    attention_entropy_per_caption,
    hard_attention_loss,
    self_critical_loss,
    soft_attention_loss,
    update_baseline,
)
from showattendtell.model import CaptionModel
from showattendtell.vocab import tokenize

Logs = dict[str, torch.Tensor]


@dataclass
class HardAttentionConfig:
    """REINFORCE settings (Xu et al. section 4.1); used when decoder.attention is "hard"."""

    reward_scale: float = 1.0  # lambda_r
    entropy_weight: float = 0.002  # lambda_e
    expectation_prob: float = 0.5  # per batch, use the expected (soft) context instead
    baseline_decay: float = 0.9  # b <- 0.9 b + 0.1 log p(y | s, a)
    # K >= 2: draw K location sequences per caption, each rewarded against the mean of the
    # other K - 1 (a baseline per caption, no moving average); 1: the paper's moving average
    location_samples: int = 1


class Objective(nn.Module):
    """``(model, annotations (B, L, D), batch) -> (loss, logs)``; batch as the DataModule gives
    it: captions (B, T+1), lengths (B,), index (B,) of the images in the training split."""

    def forward(self, model: CaptionModel, annotations: torch.Tensor,
                batch: dict) -> tuple[torch.Tensor, Logs]:
        raise NotImplementedError

    def migrate_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Map a checkpoint of an older version (objective state at the module's top level)."""
        state.pop("baseline", None)


class MaximumLikelihood(Objective):
    """Soft attention (paper eq. 14): the captions' negative log-likelihood plus the doubly
    stochastic penalty, which pushes every location to get attention over the caption."""

    def __init__(self, doubly_stochastic: float = 1.0, attention_entropy: float = 0.0,
                 label_smoothing: float = 0.0):
        super().__init__()
        self.doubly_stochastic, self.attention_entropy = doubly_stochastic, attention_entropy
        self.label_smoothing = label_smoothing

    def forward(self, model, annotations, batch):
        out = model.decoder(annotations, batch["captions"], batch["lengths"], mode="soft")
        terms = soft_attention_loss(out, annotations.size(0), self.doubly_stochastic,
                                    self.attention_entropy, self.label_smoothing)
        return terms.loss, {"loss": terms.loss, "nll": terms.nll,
                            "caption_nll": -terms.log_likelihood.mean(),
                            "attention_entropy": _mean_word_entropy(out)}


class HardAttentionReinforce(Objective):
    """Hard attention (paper section 4.1): locations sampled from alpha, the gradient of the
    lower bound with the moving-average baseline b; with probability ``expectation_prob`` per
    batch the expected context instead (the paper's 0.5). With ``location_samples`` K >= 2, each
    caption is taught with K sampled location sequences and each one's baseline is the mean of
    the other K - 1 (no moving average, nothing to synchronise under DDP); with
    ``expectation_prob`` 0 the model then learns to caption from its own single locations.

    Under DDP every process draws its own batch, but b is one number for the whole run: each
    step the processes add up their sampled captions' log-likelihoods and counts (one
    all_reduce per step, on every process whichever branch it took, so none waits for another)
    and all move b by the mean over every sampled caption of the step, as one process with the
    whole global batch would. So b is the same on every process, and the checkpoint (rank 0's)
    holds the b that every process trained with.
    """

    def __init__(self, config: HardAttentionConfig | None = None):
        super().__init__()
        self.config = config or HardAttentionConfig()
        self.register_buffer("baseline", torch.zeros(()))  # saved in checkpoints

    def forward(self, model, annotations, batch):
        cfg, B = self.config, annotations.size(0)
        if random.random() < cfg.expectation_prob:  # the soft pass of the same network
            out = model.decoder(annotations, batch["captions"], batch["lengths"], mode="soft")
            terms = soft_attention_loss(out, B, 0.0)
            self._move_baseline(None, annotations.device)
            return terms.loss, {"nll": terms.nll, "caption_nll": -terms.log_likelihood.mean()}
        K = cfg.location_samples
        if K > 1:  # K sampled passes per caption, each against the mean of the other K - 1
            out = model.decoder(annotations.repeat_interleave(K, 0),
                                batch["captions"].repeat_interleave(K, 0),
                                batch["lengths"].repeat_interleave(K, 0), mode="sample")
            terms = hard_attention_loss(out, B * K, None, cfg.reward_scale,
                                        cfg.entropy_weight, samples=K)
            self._move_baseline(None, annotations.device)  # the other processes' all_reduce
            return terms.loss, {"nll": terms.nll, "caption_nll": -terms.log_likelihood.mean()}
        out = model.decoder(annotations, batch["captions"], batch["lengths"], mode="sample")
        terms = hard_attention_loss(out, B, float(self.baseline), cfg.reward_scale,
                                    cfg.entropy_weight)
        self._move_baseline(terms.log_likelihood, annotations.device)
        # the surrogate's value means nothing (only its gradient does): the logs carry the
        # captions' negative log-likelihood, comparable with the expected-context batches
        return terms.loss, {"nll": terms.nll, "baseline": self.baseline.clone(),
                            "caption_nll": -terms.log_likelihood.mean()}

    def _move_baseline(self, log_likelihood: torch.Tensor | None, device) -> None:
        """b <- decay b + (1 - decay) mean log p(y | s, a) over this step's sampled captions
        on all processes; unchanged when none sampled (expected-context batches)."""
        stats = torch.zeros(2, dtype=torch.float64, device=device)  # sum, count
        if log_likelihood is not None:
            ll = log_likelihood.detach().to(torch.float64)
            stats[0], stats[1] = ll.sum(), ll.numel()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        total, count = stats.tolist()
        if count:
            self.baseline.fill_(update_baseline(float(self.baseline),
                                                torch.tensor([total / count]),
                                                self.config.baseline_decay))

    def migrate_state(self, state, prefix):
        if "baseline" in state:
            state[prefix + "baseline"] = state.pop("baseline")


class SelfCritical(Objective):
    """Sample K captions per image and reward each with CIDEr-D (+ w * METEOR) against its
    references, less the mean reward of the image's other K-1 samples (the baseline of Luo 2020,
    "a better variant of self-critical sequence training": no greedy pass, unbiased).

    Dropout is off in both passes, so that the gradient is that of the distribution the
    captions were drawn from. Hard attention samples its locations as well. The references are
    set once before training (``set_references``), indexed by the batches' ``index``.
    """

    def __init__(self, samples: int, meteor_weight: float = 0.0, max_length: int = 20,
                 attention_entropy: float = 0.0):
        super().__init__()
        self.samples, self.meteor_weight, self.max_length = samples, meteor_weight, max_length
        self.attention_entropy = attention_entropy
        self.references: list[list[str]] = []
        self.cider = self.meteor = None

    def set_references(self, captions: list[list[str]]) -> None:
        """The references of every training image, in the training split's order."""
        from showattendtell.metrics import CiderDReward, MeteorReward

        self.references = [[" ".join(tokenize(c)) for c in caps] for caps in captions]
        self.cider = CiderDReward(self.references)
        self.meteor = MeteorReward() if self.meteor_weight else None

    def forward(self, model, annotations, batch):
        dec, K = model.decoder, self.samples
        hard = dec.config.attention == "hard"
        a = annotations.repeat_interleave(K, 0)  # (B*K, L, D)
        refs = [self.references[i] for i in batch["index"].repeat_interleave(K).tolist()]
        dec.eval()
        try:
            sampled = sample_captions(dec, a, self.max_length, hard_mode="sample")
            out = dec(a, sampled.captions, sampled.lengths, mode="forced" if hard else "soft",
                      locations=sampled.locations)
        finally:
            dec.train()
        itos = model.vocab.itos
        captions = [" ".join(itos[w] for w in sampled.words(b)) for b in range(a.size(0))]
        reward = torch.tensor(self.cider(captions, refs))  # (B*K,)
        logs = {"reward_cider": reward.mean()}
        if self.meteor is not None:
            meteor = torch.tensor(self.meteor(captions, refs))
            reward = reward + self.meteor_weight * meteor
            logs["reward_meteor"] = meteor.mean()
        per_image = reward.view(-1, K)  # (B, K)
        baseline = ((per_image.sum(1, keepdim=True) - per_image) / (K - 1)).view(-1)
        terms = self_critical_loss(out, a.size(0), reward, baseline,
                                   banned_tokens(dec.vocab_size, a.device), self.attention_entropy)
        return terms.loss, {"nll": terms.nll, "reward": reward.mean(),
                            "attention_entropy": _mean_word_entropy(out), **logs}


def _mean_word_entropy(out: TeacherForcedOutput) -> torch.Tensor:
    """Mean H(alpha_t) over the words of a batch (one attention map per target token): logged,
    so that a run shows how sharp its attention is (log L = uniform)."""
    return attention_entropy_per_caption(out.alphas.detach()).sum() / out.targets.numel()


def make_objective(attention: str, doubly_stochastic: float, hard: HardAttentionConfig,
                   self_critical: int, self_critical_meteor: float,
                   max_length: int, attention_entropy: float = 0.0,
                   label_smoothing: float = 0.0) -> Objective:
    """The one objective a run trains with."""
    if self_critical:
        return SelfCritical(self_critical, self_critical_meteor, max_length, attention_entropy)
    if attention == "hard":
        return HardAttentionReinforce(hard)
    return MaximumLikelihood(doubly_stochastic, attention_entropy, label_smoothing)
