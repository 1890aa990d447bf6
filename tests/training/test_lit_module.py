"""The LightningModule: the objective chosen once from the config, the closed-form schedule."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.training.lit_module import CaptionModule, OptimizerConfig
from showattendtell.training.losses import soft_attention_loss
from showattendtell.training.objectives import (
    HardAttentionReinforce,
    MaximumLikelihood,
    ObjectiveConfig,
    SelfCritical,
)

VOCAB = ["<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(26)]]
ENCODER = EncoderConfig(backbone="resnet50", weights=None, input_size=64)


def module(attention="soft", optimizer=None, **objective) -> CaptionModule:
    return CaptionModule(
        VOCAB,
        ENCODER,
        DecoderConfig(attention, 8, 10, 6, 0.0),
        ObjectiveConfig(**objective),
        optimizer,
    )


@pytest.mark.parametrize(
    "attention,kw,kind",
    [
        ("soft", {}, MaximumLikelihood),
        ("hard", {}, HardAttentionReinforce),
        ("soft", {"self_critical": 3}, SelfCritical),
        ("hard", {"self_critical": 2}, SelfCritical),
    ],
)
def test_the_objective_is_chosen_once_from_the_config(attention, kw, kind):
    assert type(module(attention, **kw).objective) is kind


def test_maximum_likelihood_is_the_soft_loss_with_the_doubly_stochastic_term():
    m = module(doubly_stochastic=0.7)
    a, caps, lengths = make_batch(D=2048, V=len(VOCAB))
    loss, logs = m.compute_loss({"inputs": a, "captions": caps, "lengths": lengths})
    expected = soft_attention_loss(m.model.decoder(a, caps, lengths), a.size(0), 0.7).loss
    torch.testing.assert_close(loss, expected)
    assert set(logs) == {"loss", "nll", "caption_nll", "attention_entropy"}


def test_the_learning_rate_is_a_closed_form_of_the_epoch():
    cfg = OptimizerConfig(lr=2e-4, lr_decay=0.2, lr_decay_every=6)
    assert [cfg.lr_factor(e) for e in (0, 5, 6, 11, 12)] == pytest.approx([1, 1, 0.2, 0.2, 0.04])
    assert OptimizerConfig().lr_factor(100) == 1.0  # no decay unless asked


def test_bad_settings_are_config_errors():
    from showattendtell.training.lit_module import TrainingConfigError

    with pytest.raises(TrainingConfigError, match="self_critical_meteor"):
        module(self_critical=2, self_critical_meteor=-1.0)
    with pytest.raises(ValueError, match="adam or rmsprop"):
        module(optimizer=OptimizerConfig(name="sgd")).configure_optimizers()


def test_train_only_trains_the_named_decoder_parameters_and_refuses_names_that_match_none():
    from showattendtell.training.lit_module import TrainingConfigError

    m = module(optimizer=OptimizerConfig(train_only=["attention."]))
    (group,) = m.configure_optimizers().param_groups
    trained = {n for n, p in m.model.decoder.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in m.model.decoder.attention.named_parameters(prefix="attention")}
    assert len(group["params"]) == len(trained)
    everything = module().configure_optimizers().param_groups[0]["params"]
    assert len(everything) == len(list(m.model.decoder.parameters()))
    with pytest.raises(TrainingConfigError, match="names no decoder parameter"):
        module(optimizer=OptimizerConfig(train_only=["lstm."])).configure_optimizers()


def test_adam_is_fused_except_with_a_gradient_scaler(monkeypatch):
    """One pass over the parameters per step, bf16-mixed included; float16 mixed precision's
    scaler must unscale the gradients before clipping, which a fused Adam does in its step, so
    there it is the loop form."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    m = module()
    assert m.configure_optimizers().defaults["fused"] is True
    scaler = torch.amp.GradScaler("cpu")
    for plugin, fused in (
        (Precision(), True),
        (MixedPrecision("bf16-mixed", "cpu"), True),
        (MixedPrecision("16-mixed", "cpu", scaler), None),
    ):
        monkeypatch.setattr(m, "_trainer", type("T", (), {"precision_plugin": plugin})())
        assert m.configure_optimizers().defaults["fused"] is fused


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_bf16_mixed_clips_the_gradients_of_the_fused_adam(tmp_path, algorithm):
    """Lightning refuses to clip for a fused optimiser under mixed precision (a float16 scaler's
    gradients are still scaled then); bf16-mixed has no scaler, and its step clips as float32's
    does."""
    import lightning as L

    clip = 1e-3
    seen: list[torch.Tensor] = []

    class Recorded(CaptionModule):
        def optimizer_step(self, *args, **kwargs) -> None:  # the gradients the step used
            super().optimizer_step(*args, **kwargs)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if algorithm == "norm":
                seen.append(torch.stack([g.norm() for g in grads]).norm())
            else:
                seen.append(torch.stack([g.abs().max() for g in grads]).max())

    m = Recorded(VOCAB, ENCODER, DecoderConfig("soft", 8, 10, 6, 0.0), ObjectiveConfig())
    a, caps, lengths = make_batch(D=2048, V=len(VOCAB))
    batch = {"inputs": a, "captions": caps, "lengths": lengths}
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=1,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(m, torch.utils.data.DataLoader([batch], batch_size=None))
    assert trainer.optimizers[0].defaults["fused"] is True
    assert len(seen) == 1 and seen[0] <= clip * 1.001, seen
