"""Training objectives as objects, chosen once from the config (see ``make_objective``).

Each is called as ``objective(model, annotations, batch) -> (loss, logs)``: it picks the passes
it needs (teacher forcing with the expected context or sampled locations, sampled captions),
keeps its own state (the REINFORCE baseline, the reward's references) and returns the loss to
minimise and what is worth logging ("loss" only where its value means something). The formulas
themselves are in losses.py. After ruotianluo/ImageCaptioning.pytorch's loss wrapper.

    MaximumLikelihood        soft attention: -log p(y|a) + lambda sum_i (1 - sum_t alpha_ti)^2
    HardAttentionReinforce   hard attention: the variational lower bound of Xu et al. eq. 12
    SelfCritical             Rennie et al. 2017, with the mean-of-others baseline (Luo 2020)

All their settings are one ``ObjectiveConfig`` (``model.objective`` in a training config),
checked once. Maximum likelihood and hard attention can add attention supervision
(``ObjectiveConfig.grounding``): the attention of each word that names a person is pulled toward
where the photo's person mask lies (Liu et al., AAAI 2017).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from showattendtell.errors import UsageError
from showattendtell.evaluation.metrics import CiderDReward, MeteorReward
from showattendtell.model import CaptionModel
from showattendtell.network.decoder import TeacherForcedOutput
from showattendtell.network.vocab import tokenize
from showattendtell.search.decoding import banned_tokens, sample_captions
from showattendtell.training.losses import (
    attention_entropy_per_caption,
    hard_attention_loss,
    self_critical_loss,
    soft_attention_loss,
    update_baseline,
)

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


@dataclass
class GroundingConfig:
    """Attention supervision for the words that name people (Liu et al., AAAI 2017).

    For each such word y_t of a training caption whose photo has a person mask (``data.
    person_masks``, from ``scripts/label_person_masks.py``), the loss adds
    ``weight * KL(q || alpha_t)`` with the target q_i proportional to coverage_i ** sharpness
    (coverage_i: the share of cell i the mask covers). Hard attention: alpha_t is the location
    distribution the locations are sampled from. Which words name people is attention
    correctness's map (``attention_correctness.category_words``), so training and the measure
    agree. ``sharpness`` > 1 puts the target on the cells the mask fills most, where a noisy
    segmenter is most often right."""

    weight: float = 0.0  # mu; 0: off
    sharpness: float = 1.0


@dataclass
class ObjectiveConfig:
    """What a run minimises (``model.objective``); ``check`` refuses what does not combine."""

    doubly_stochastic: float = 1.0  # lambda of sum_i (1 - sum_t alpha_ti)^2 (soft attention)
    # weight of sum_t H(alpha_t) added to soft or self-critical training: sharper attention
    attention_entropy: float = 0.0
    label_smoothing: float = 0.0  # eps of maximum likelihood's smoothed targets
    # K >= 2: self-critical training with K captions sampled per image; 0: maximum likelihood
    self_critical: int = 0
    self_critical_meteor: float = 0.0  # w: reward = CIDEr-D + w * METEOR
    hard: HardAttentionConfig = field(default_factory=HardAttentionConfig)
    grounding: GroundingConfig = field(default_factory=GroundingConfig)

    @classmethod
    def of(cls, value: ObjectiveConfig | dict | None) -> ObjectiveConfig:
        """From a config object or its dict (checkpoints store the dict)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        value = dict(value)
        hard, grounding = value.pop("hard", None), value.pop("grounding", None)
        return cls(
            **value,
            hard=HardAttentionConfig(**(hard or {})),
            grounding=GroundingConfig(**(grounding or {})),
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, attention: str) -> None:
        """Raise TrainingConfigError for a setting out of range or one that does not apply to
        ``attention`` ("soft" or "hard") with this objective."""
        hard = attention == "hard"
        if self.self_critical == 1 or self.self_critical < 0:
            raise TrainingConfigError(
                "model.objective.self_critical must be 0 (maximum likelihood) or K >= 2 "
                "(captions sampled per image; each one's baseline is the others' mean reward), "
                f"not {self.self_critical}"
            )
        if self.self_critical_meteor < 0:
            raise TrainingConfigError(
                "model.objective.self_critical_meteor is the weight of "
                f"METEOR in the reward: 0 or more, not "
                f"{self.self_critical_meteor}"
            )
        if self.attention_entropy < 0:
            raise TrainingConfigError(
                "model.objective.attention_entropy is a penalty weight: "
                f"0 or more, not {self.attention_entropy}"
            )
        if self.attention_entropy and hard and not self.self_critical:
            raise TrainingConfigError(
                "model.objective.attention_entropy sharpens the attention of soft or "
                "self-critical training; hard attention's REINFORCE has its own entropy term, "
                "model.objective.hard.entropy_weight"
            )
        if not 0 <= self.label_smoothing < 1:
            raise TrainingConfigError(
                "model.objective.label_smoothing is the share of each target spread over the "
                f"vocabulary: 0 <= eps < 1, not {self.label_smoothing}"
            )
        if self.label_smoothing and (self.self_critical or hard):
            raise TrainingConfigError(
                "model.objective.label_smoothing applies to soft attention's maximum-likelihood "
                "training; set it to 0 for hard attention or self-critical training"
            )
        if self.hard.location_samples < 1:
            raise TrainingConfigError(
                "model.objective.hard.location_samples must be 1 (the moving-average baseline) "
                f"or K >= 2 (the mean of the other K - 1), not {self.hard.location_samples}"
            )
        g = self.grounding
        if g.weight < 0 or g.sharpness <= 0:
            raise TrainingConfigError(
                "model.objective.grounding: weight must be 0 (off) or more and sharpness more "
                f"than 0, not {g.weight} and {g.sharpness}"
            )
        if g.weight and self.self_critical:
            raise TrainingConfigError(
                "model.objective.grounding supervises the attention of maximum-likelihood or "
                "hard-attention training; set its weight to 0 for self-critical training"
            )


class TrainingConfigError(UsageError, ValueError):
    """A training setting out of range; `sat train` prints the message, not a traceback."""


def grounding_loss(
    alphas: torch.Tensor, target: torch.Tensor, words: torch.Tensor, sharpness: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over each caption's supervised words of KL(q || alpha_t), (B,); their count).

    alphas (B, T, L): the attention (or location distribution) of each predicted word; target
    (B, L): the mask's coverage of each cell of the caption's photo; words (B, T) bool: which
    predicted words are supervised (a person word of a photo with a non-empty mask). KL and the
    cross-entropy -sum_i q_i log alpha_ti differ by H(q), which does not depend on the model:
    the gradient is the cross-entropy's, and the value logged is 0 when alpha_t = q.
    """
    T = min(alphas.size(1), words.size(1))  # a batch's words are padded to its longest caption
    words = words[:, :T]
    q = target.clamp_min(0) ** sharpness
    total = q.sum(1, keepdim=True)
    words = words & (total > 0)
    q = q / total.clamp_min(1e-12)  # (B, L)
    log_alpha = alphas[:, :T].clamp_min(1e-12).log()  # (B, T, L)
    kl = (q.unsqueeze(1) * (q.clamp_min(1e-12).log().unsqueeze(1) - log_alpha)).sum(2)
    return (kl * words).sum(1), words.sum()


def _with_grounding(
    loss: torch.Tensor,
    logs: Logs,
    out: TeacherForcedOutput,
    batch: dict,
    config: GroundingConfig,
    repeat: int = 1,
) -> torch.Tensor:
    """loss + weight * the batch's mean per-caption grounding KL (no-op when it is off or the
    batch carries no person targets); logs the mean KL per supervised word."""
    if not config.weight or "person_target" not in batch:
        return loss
    target, words = batch["person_target"], batch["person_words"]
    if repeat > 1:  # K sampled location sequences per caption
        target, words = target.repeat_interleave(repeat, 0), words.repeat_interleave(repeat, 0)
    kl, count = grounding_loss(out.alphas, target, words, config.sharpness)
    logs["grounding_kl"] = kl.sum().detach() / count.clamp_min(1)
    logs["grounded_words"] = count.float()
    return loss + config.weight * kl.mean()


class Objective(nn.Module):
    """``(model, annotations (B, L, D), batch) -> (loss, logs)``; batch as the DataModule gives
    it: captions (B, T+1), lengths (B,), index (B,) of the images in the training split."""

    def forward(
        self, model: CaptionModel, annotations: torch.Tensor, batch: dict
    ) -> tuple[torch.Tensor, Logs]:
        raise NotImplementedError

    def migrate_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Map a checkpoint of an older version (objective state at the module's top level)."""
        state.pop("baseline", None)


class MaximumLikelihood(Objective):
    """Soft attention (paper eq. 14): the captions' negative log-likelihood plus the doubly
    stochastic penalty, which pushes every location to get attention over the caption; with
    ``grounding``, plus the attention supervision of the words that name people."""

    def __init__(
        self,
        doubly_stochastic: float = 1.0,
        attention_entropy: float = 0.0,
        label_smoothing: float = 0.0,
        grounding: GroundingConfig | None = None,
    ):
        super().__init__()
        self.doubly_stochastic, self.attention_entropy = doubly_stochastic, attention_entropy
        self.label_smoothing = label_smoothing
        self.grounding = grounding or GroundingConfig()

    def forward(self, model, annotations, batch):
        out = model.decoder(annotations, batch["captions"], batch["lengths"], mode="expectation")
        terms = soft_attention_loss(
            out,
            annotations.size(0),
            self.doubly_stochastic,
            self.attention_entropy,
            self.label_smoothing,
        )
        logs = {
            "nll": terms.nll,
            "caption_nll": -terms.log_likelihood.mean(),
            "attention_entropy": _mean_word_entropy(out),
        }
        loss = _with_grounding(terms.loss, logs, out, batch, self.grounding)
        return loss, {"loss": loss, **logs}


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

    def __init__(
        self, config: HardAttentionConfig | None = None, grounding: GroundingConfig | None = None
    ):
        super().__init__()
        self.config = config or HardAttentionConfig()
        self.grounding = grounding or GroundingConfig()
        self.register_buffer("baseline", torch.zeros(()))  # saved in checkpoints

    def forward(self, model, annotations, batch):
        cfg, B = self.config, annotations.size(0)
        if random.random() < cfg.expectation_prob:  # the soft pass of the same network
            out = model.decoder(
                annotations, batch["captions"], batch["lengths"], mode="expectation"
            )
            terms = soft_attention_loss(out, B, 0.0)
            self._move_baseline(None, annotations.device)
            logs = {"nll": terms.nll, "caption_nll": -terms.log_likelihood.mean()}
            return _with_grounding(terms.loss, logs, out, batch, self.grounding), logs
        K = cfg.location_samples
        if K > 1:  # K sampled passes per caption, each against the mean of the other K - 1
            out = model.decoder(
                annotations.repeat_interleave(K, 0),
                batch["captions"].repeat_interleave(K, 0),
                batch["lengths"].repeat_interleave(K, 0),
                mode="sample",
            )
            terms = hard_attention_loss(
                out, B * K, None, cfg.reward_scale, cfg.entropy_weight, samples=K
            )
            self._move_baseline(None, annotations.device)  # the other processes' all_reduce
            logs = {"nll": terms.nll, "caption_nll": -terms.log_likelihood.mean()}
            return _with_grounding(terms.loss, logs, out, batch, self.grounding, K), logs
        out = model.decoder(annotations, batch["captions"], batch["lengths"], mode="sample")
        terms = hard_attention_loss(
            out, B, float(self.baseline), cfg.reward_scale, cfg.entropy_weight
        )
        self._move_baseline(terms.log_likelihood, annotations.device)
        # the surrogate's value means nothing (only its gradient does): the logs carry the
        # captions' negative log-likelihood, comparable with the expected-context batches
        logs = {
            "nll": terms.nll,
            "baseline": self.baseline.clone(),
            "caption_nll": -terms.log_likelihood.mean(),
        }
        return _with_grounding(terms.loss, logs, out, batch, self.grounding), logs

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
            self.baseline.fill_(
                update_baseline(
                    float(self.baseline), torch.tensor([total / count]), self.config.baseline_decay
                )
            )

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

    def __init__(
        self,
        samples: int,
        meteor_weight: float = 0.0,
        max_length: int = 20,
        attention_entropy: float = 0.0,
    ):
        super().__init__()
        self.samples, self.meteor_weight, self.max_length = samples, meteor_weight, max_length
        self.attention_entropy = attention_entropy
        self.references: list[list[str]] = []
        self.cider = self.meteor = None

    def set_references(
        self, captions: list[list[str]], split: Callable[[str], list[str]] = tokenize
    ) -> None:
        """The references of every training image, in the training split's order, as the
        model's tokenizer splits them (``split``; default English PTB)."""
        self.references = [[" ".join(split(c)) for c in caps] for caps in captions]
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
            out = dec(
                a,
                sampled.captions,
                sampled.lengths,
                mode="forced" if hard else "expectation",
                locations=sampled.locations,
            )
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
        terms = self_critical_loss(
            out,
            a.size(0),
            reward,
            baseline,
            banned_tokens(dec.vocab_size, a.device),
            self.attention_entropy,
        )
        return terms.loss, {
            "nll": terms.nll,
            "reward": reward.mean(),
            "attention_entropy": _mean_word_entropy(out),
            **logs,
        }


def _mean_word_entropy(out: TeacherForcedOutput) -> torch.Tensor:
    """Mean H(alpha_t) over the words of a batch (one attention map per target token): logged,
    so that a run shows how sharp its attention is (log L = uniform)."""
    return attention_entropy_per_caption(out.alphas.detach()).sum() / out.n_tokens


def make_objective(config: ObjectiveConfig, attention: str, max_length: int) -> Objective:
    """The one objective a run trains with (``config`` checked for ``attention`` first);
    ``max_length``: of the captions self-critical training samples."""
    config.check(attention)
    if config.self_critical:
        return SelfCritical(
            config.self_critical, config.self_critical_meteor, max_length, config.attention_entropy
        )
    if attention == "hard":
        return HardAttentionReinforce(config.hard, config.grounding)
    return MaximumLikelihood(
        config.doubly_stochastic, config.attention_entropy, config.label_smoothing, config.grounding
    )
