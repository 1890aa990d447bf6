"""Callbacks that press Ctrl-C (raise KeyboardInterrupt) at a chosen point of `sat train`, so
that a test can stop training exactly there: ``--trainer.callbacks+=helpers.interrupts.NAME``."""

from __future__ import annotations

import lightning as L


class DuringValidation(L.Callback):
    """Ctrl-C during the validation that ends epoch 1: after the epoch's last step was logged,
    before Lightning counted it for the logger."""

    def on_validation_batch_start(self, trainer, *args) -> None:
        if trainer.current_epoch == 1 and not trainer.sanity_checking:
            raise KeyboardInterrupt


class BeforeOptimizerStep(L.Callback):
    """Ctrl-C in the middle of a step of epoch 1: its gradients computed, the weights not yet
    updated."""

    def on_before_optimizer_step(self, trainer, *args) -> None:
        if trainer.current_epoch == 1 and trainer.fit_loop.epoch_loop.batch_idx == 3:
            raise KeyboardInterrupt
