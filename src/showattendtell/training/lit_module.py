"""The LightningModule: losses, optimiser and schedule, validation by decoding and scoring."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from showattendtell.evaluation.metrics import VALIDATION_SCORES, score_captions
from showattendtell.kernels.graphed import GraphedObjective
from showattendtell.model import CaptionModel
from showattendtell.model_file import ModelFileError, read_model
from showattendtell.network.decoder import DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER
from showattendtell.network.vocab import PAD, Vocabulary
from showattendtell.search.decoding import DecodingConfig
from showattendtell.torch_files import TorchFileError, read_torch_file
from showattendtell.training.losses import soft_attention_loss
from showattendtell.training.objectives import (
    MaximumLikelihood,
    ObjectiveConfig,
    TrainingConfigError,
    make_objective,
)

__all__ = ["CaptionModule", "OptimizerConfig", "TrainingConfigError", "load_checkpoint"]

# the objective's settings, top-level hyperparameters in checkpoints of older versions
_FLAT_OBJECTIVE_KEYS = (
    "doubly_stochastic",
    "hard",
    "self_critical",
    "self_critical_meteor",
    "attention_entropy",
    "label_smoothing",
)


def migrate_hyperparameters(hparams: dict) -> dict:
    """A checkpoint's hyperparameters in this version's layout: the objective's settings of
    older checkpoints (top-level keys) move under ``objective``."""
    hparams = dict(hparams)
    flat = {k: hparams.pop(k) for k in _FLAT_OBJECTIVE_KEYS if k in hparams}
    if flat:
        hparams["objective"] = {**flat, **(hparams.get("objective") or {})}
    return hparams


@dataclass
class OptimizerConfig:
    name: str = "adam"  # adam or rmsprop
    lr: float = 2e-4
    encoder_lr: float = 1e-4  # for the fine-tuned encoder stages, if any
    weight_decay: float = 0.0
    lr_decay: float = 1.0  # multiply the learning rates by this ...
    lr_decay_every: int = 1  # ... every this many epochs
    # train only the decoder parameters whose names start with one of these (e.g. "attention.":
    # attention supervision that leaves the language model as it was); None: all of them
    train_only: list[str] | None = None

    def lr_factor(self, epoch: int) -> float:
        """The schedule in closed form (nanoGPT's get_lr): a function of the epoch alone, so a
        resumed run, or one resumed under a schedule it did not start with, gets the learning
        rate a run trained with this schedule from the start has at that epoch."""
        return self.lr_decay ** (epoch // self.lr_decay_every)


def read_checkpoint(path: str | Path, option: str = "checkpoint", *, mmap: bool = False) -> dict:
    """A training checkpoint of `sat train`, read without running any code it names
    (torch_files.read_torch_file); anything else is a one-line ModelFileError of our own.
    ``mmap``: map the tensors instead of reading them (a check that only looks at them)."""
    path = Path(path)
    hint = "give a .ckpt file that sat train wrote (e.g. runs/NAME/checkpoints/last.ckpt)"
    if path.is_dir():
        raise ModelFileError(f"{option}: {path} is a folder: {hint}")
    if not path.is_file():
        raise ModelFileError(f"{option}: {path} not found: {hint}")
    if path.stat().st_size == 0:
        raise ModelFileError(f"{option}: {path} is empty (0 bytes): {hint}")
    if path.suffix == ".safetensors":
        raise ModelFileError(
            f"{option}: {path} is an exported model file, not a training checkpoint: {hint}"
        )
    try:
        try:
            ckpt = read_torch_file(path, mmap=mmap)
        except TorchFileError:
            if not mmap:
                raise
            ckpt = read_torch_file(path)  # a legacy (not zip) file cannot be mapped
    except TorchFileError as e:
        raise ModelFileError(f"{option}: {path} is {e}: {hint}") from None
    if not (
        isinstance(ckpt, dict)
        and isinstance(ckpt.get("hyper_parameters"), dict)
        and "vocab" in ckpt["hyper_parameters"]
        and "state_dict" in ckpt
    ):
        raise ModelFileError(
            f"{option}: {path} is a PyTorch file but not a checkpoint of sat train: {hint}"
        )
    return ckpt


def check_state_fits(module: torch.nn.Module, state: dict, source: str) -> None:
    """A checkpoint's ``state`` (its module's tensors) fits ``module``: the same tensors with
    the same shapes; else a one-line ModelFileError that begins with ``source`` and names the
    first difference. A run resumed with other settings than it was trained with (a hidden
    size, another backbone) is the usual cause."""
    ours = module.state_dict()
    hint = "resume with the settings it was trained with (its run folder's config.yaml)"
    for key, value in state.items():
        mine = ours.get(key)
        if mine is not None and tuple(mine.shape) != tuple(value.shape):
            raise ModelFileError(
                f"{source} holds a model of other sizes ({key}: {tuple(value.shape)}, this "
                f"run's {tuple(mine.shape)}): {hint}"
            )
    missing = sorted(set(ours) - set(state))
    unexpected = sorted(set(state) - set(ours))
    if getattr(module, "strict_loading", True) and (missing or unexpected):
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which this run lacks"
        raise ModelFileError(f"{source} holds another model (it {what}): {hint}")


def init_weights(
    path: str, vocab: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The decoder's and the encoder's state dicts from a training checkpoint or a model file,
    checked to share ``vocab`` (word ids must mean the same words)."""
    if not Path(path).is_file():
        raise ModelFileError(
            f"init_from: {path} not found: train and export that model first, "
            "or pass --model.init_from null to start from scratch"
        )
    if str(path).endswith(".ckpt"):
        ckpt = read_checkpoint(path, "init_from")
        theirs, state = ckpt["hyper_parameters"]["vocab"], ckpt["state_dict"]
        decoder, encoder = (
            {k[len(p) :]: v for k, v in state.items() if k.startswith(p)}
            for p in ("model.decoder.", "model.encoder.")
        )
    else:
        model, _, _ = read_model(path)
        theirs = model.vocab.itos
        decoder, encoder = model.decoder.state_dict(), model.encoder.state_dict()
    if list(theirs) != list(vocab):
        raise ModelFileError(
            f"init_from: {path} has a different vocabulary "
            f"({len(theirs)} words, this run {len(vocab)}): train it on the "
            "same captions with the same min_word_count"
        )
    return decoder, encoder


def load_checkpoint(path: str | Path) -> CaptionModule:
    """The CaptionModule of a training checkpoint (for `sat export`); ``epoch`` is set from it."""
    ckpt = read_checkpoint(path)
    try:
        module = CaptionModule(**migrate_hyperparameters(ckpt["hyper_parameters"]))
        module.on_load_checkpoint(ckpt)
        module.load_state_dict(ckpt["state_dict"])
    except (TypeError, KeyError, RuntimeError) as e:
        raise ModelFileError(
            f"checkpoint: {path} does not match this version of "
            f"showattendtell ({str(e).splitlines()[0]})"
        ) from None
    module.checkpoint_epoch = int(ckpt.get("epoch", -1))
    return module


def _as(cls, value, **defaults):
    if value is None:
        return cls(**defaults)
    return cls(**value) if isinstance(value, dict) else value


class CaptionModule(L.LightningModule):
    """Trains a CaptionModel with soft (deterministic) or hard (REINFORCE) attention.

    Args:
        vocab: the vocabulary as a word list (the CLI links it from the DataModule).
        encoder / decoder: the model's architecture.
        objective: what training minimises (``objectives.ObjectiveConfig``: maximum likelihood
            with the doubly stochastic penalty, REINFORCE for hard attention, self-critical
            training, attention supervision of person words), checked once here.
        optimizer: optimiser and learning-rate schedule.
        val_decoding: how validation captions are generated (beam size 1 = greedy).
        init_from: start training from the decoder weights of another run (a ``.ckpt`` or an
            exported model file with the same vocabulary and encoder), e.g. hard attention from a
            trained soft-attention model; with ``encoder.fine_tune_stages`` N, from its weights
            of the encoder's top N stages as well (a fine-tuned encoder goes on from where it
            was; the frozen stages, whose output the feature cache holds, are never replaced).
            Ignored when resuming with ``--ckpt_path``.
        cuda_graphs: on one CUDA GPU, run the training step's forward and backward as CUDA
            graphs (graphed.py: the same values, 2-3x the speed, since launching the
            decoder's small kernels one by one is what takes the time there). Used for the
            maximum-likelihood objective without grounding, on a single device; anything
            else runs as before.
        tokenizer: the tokenizer of ``vocab``'s words (the CLI links it from the DataModule);
            the exported model stores it. Checkpoints without it are ``ptb``.
    """

    def __init__(
        self,
        vocab: list[str],
        encoder: EncoderConfig | None = None,
        decoder: DecoderConfig | None = None,
        objective: ObjectiveConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        val_decoding: DecodingConfig | None = None,
        init_from: str | None = None,
        cuda_graphs: bool = True,
        tokenizer: str = DEFAULT_TOKENIZER,
    ):
        super().__init__()
        # load_from_checkpoint passes the saved hyperparameters back as plain dicts
        encoder = _as(EncoderConfig, encoder)
        decoder = _as(DecoderConfig, decoder)
        self.objective_cfg = ObjectiveConfig.of(objective)
        self.opt_cfg = _as(OptimizerConfig, optimizer)
        self.val_decoding = _as(DecodingConfig, val_decoding, beam_size=1)
        self.objective = make_objective(
            self.objective_cfg, decoder.attention, self.val_decoding.max_length
        )
        self.save_hyperparameters(
            {
                "vocab": list(vocab),
                "encoder": asdict(encoder),
                "decoder": asdict(decoder),
                "objective": self.objective_cfg.as_dict(),
                "optimizer": asdict(self.opt_cfg),
                "val_decoding": asdict(self.val_decoding),
                "init_from": init_from,
                "cuda_graphs": cuda_graphs,
                "tokenizer": tokenizer,
            }
        )
        self.model = CaptionModel(Vocabulary(vocab, tokenizer), encoder, decoder)
        self._val_predictions: dict[str, str] = {}

    def setup(self, stage: str) -> None:
        # after a resume, Lightning restores the checkpoint's weights over these anyway
        if stage == "fit" and self.hparams.get("init_from") and not self.trainer.ckpt_path:
            decoder, encoder = init_weights(self.hparams.init_from, self.model.vocab.itos)
            enc = self.model.encoder
            top = tuple(f"stages.{i}." for i in range(enc.frozen_stages, len(enc.stages)))
            encoder = {k: v for k, v in encoder.items() if k.startswith(top)}
            try:
                self.model.decoder.load_state_dict(decoder)
                if encoder:  # the fine-tuned stages only: the frozen ones are the cache's
                    keys = enc.load_state_dict(encoder, strict=False)
                    missing = [k for k in keys.missing_keys if k.startswith(top)]
                    if missing or keys.unexpected_keys:
                        raise RuntimeError(
                            f"encoder stages differ\n{(missing or keys.unexpected_keys)[0]}"
                        )
            except RuntimeError as e:
                raise ModelFileError(
                    f"init_from: {self.hparams.init_from} has a different decoder or encoder "
                    f"size than this run: {str(e).splitlines()[-1].strip()}"
                ) from None

    def on_fit_start(self) -> None:
        if self.objective_cfg.grounding.weight and not getattr(
            self.trainer.datamodule, "person_masks", None
        ):
            raise TrainingConfigError(
                "model.objective.grounding.weight > 0 needs the photos' person masks: set "
                "data.person_masks to the file of scripts/label_person_masks.py"
            )
        if self.objective_cfg.self_critical_meteor and not self.model.vocab.english:
            raise TrainingConfigError(
                "model.objective.self_critical_meteor needs English captions (METEOR is "
                f"English-only; this run's tokenizer is {self.model.vocab.tokenizer}): set it to 0"
            )
        if hasattr(self.objective, "set_references"):  # self-critical: the training references
            self.objective.set_references(
                [im.captions for im in self.trainer.datamodule.train_set.images],
                self.model.vocab.tokenize,
            )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.check_checkpoint(checkpoint)

    def check_checkpoint(self, checkpoint: dict, path: str | Path | None = None) -> None:
        """Migrate ``checkpoint``'s state of an older version, and check that it fits this
        module: before Lightning's load_state_dict, whose size mismatch is a 40-line
        traceback; `sat train` checks the checkpoint it resumes from before any work too."""
        self.objective.migrate_state(checkpoint["state_dict"], "objective.")
        where = f"--ckpt_path: {path}" if path is not None else "--ckpt_path: the checkpoint"
        check_state_fits(self, checkpoint["state_dict"], where)

    @property
    def attention(self) -> str:
        return self.model.decoder.config.attention

    def annotations(self, inputs: torch.Tensor) -> torch.Tensor:
        """Cached features (B, L, D) pass through; images (B, 3, S, S) go through the encoder;
        the cached output of the frozen stages (B, C, H, W) goes through the fine-tuned top."""
        encoder = self.model.encoder
        if inputs.dim() == 3:
            return inputs
        frozen = inputs.size(1) != 3  # no backbone stage has 3 output channels
        with torch.set_grad_enabled(encoder.trainable and torch.is_grad_enabled()):
            return encoder.forward_top(inputs) if frozen else encoder(inputs)

    def compute_loss(
        self, batch: dict, graphs: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The run's objective on one batch: (loss, logs); ``graphs``: as CUDA graphs where
        the run allows them (``cuda_graphs``)."""
        annotations = self.annotations(batch["inputs"])
        graphed = self._graphed_objective if graphs else None
        if graphed is not None:
            return graphed(annotations, batch)
        return self.objective(self.model, annotations, batch)

    @functools.cached_property
    def _graphed_objective(self) -> GraphedObjective | None:
        """The objective as CUDA graphs, built at the first training step, when the run is one
        they suit (else None): one CUDA device, maximum likelihood without grounding."""
        if not (
            self.hparams.cuda_graphs
            and self.device.type == "cuda"
            and self.trainer.world_size == 1
            and isinstance(self.objective, MaximumLikelihood)
            and not self.objective_cfg.grounding.weight
        ):
            return None
        data = getattr(self.trainer, "datamodule", None)
        longest = getattr(data, "hparams", {}).get("max_caption_length")
        tokens = None if longest is None else longest + 2  # <start> .. <end>
        return GraphedObjective(self.objective, self.model, tokens, PAD)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        if batch is None:
            return None
        loss, logs = self.compute_loss(batch, graphs=True)
        B = batch["captions"].size(0)
        for k, v in logs.items():
            self.log(f"train/{k}", v, prog_bar=k in ("loss", "nll"), batch_size=B)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=B)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if batch is None:
            return
        a = self.annotations(batch["inputs"])
        B = a.size(0)
        out = self.model.decoder(a, batch["captions"], batch["lengths"], mode="expectation")
        self.log("val/nll", soft_attention_loss(out, B, 0.0).nll, batch_size=B, sync_dist=True)
        hyps = self.model.generate(a, self.val_decoding)
        ds = self.trainer.datamodule.val_set
        for i, h in zip(batch["index"].tolist(), hyps, strict=True):
            self._val_predictions[ds.pairs.images[i].image_id] = " ".join(self.model.words(h[0]))

    def on_validation_epoch_end(self) -> None:
        preds = self._val_predictions
        self._val_predictions = {}
        if dist.is_available() and dist.is_initialized():
            gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, preds)
            preds = {k: v for part in gathered for k, v in part.items()}
        if not preds:
            return
        refs = self.trainer.datamodule.references()
        scores = score_captions(preds, refs, official=False, tokenizer=self.model.vocab.tokenizer)
        # every rank gathered the same predictions, so every rank logs the same values (which
        # ModelCheckpoint and EarlyStopping monitor)
        for key, name in VALIDATION_SCORES.items():
            self.log(f"val/{key}", scores[name], prog_bar=key in ("bleu4", "cider"), sync_dist=True)
        # how many images were scored: under DDP, DistributedSampler pads the last batches with
        # repeated images, which keying the predictions by image id counts once
        self.log("val/images", float(len(preds)), sync_dist=True)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Set this epoch's learning rates from the config (not from a restored optimizer)."""
        cfg = self.opt_cfg
        factor = cfg.lr_factor(self.current_epoch)
        groups = self.trainer.optimizers[0].param_groups  # decoder, then the encoder's if any
        for group, base in zip(groups, (cfg.lr, cfg.encoder_lr), strict=False):
            group["lr"] = base * factor

    def _fused(self, groups: list[dict]) -> bool | None:
        """Adam in one pass over the parameters (the loop form makes a dozen: 56 ms against 11 ms
        a step for 21M parameters on 2 CPU cores), on a GPU and a CPU alike, bf16-mixed
        included; not with a gradient scaler (float16 mixed precision), which must unscale the
        gradients before they are clipped, where a fused Adam unscales them in its step."""
        trainer = self._trainer
        if trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None:
            return None
        return all(p.device.type in ("cuda", "cpu") for g in groups for p in g["params"]) or None

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, also for the fused Adam under bf16-mixed. Lightning's
        mixed-precision plugin refuses to clip for an optimiser that unscales gradients in its
        own step, because under float16 the gradients are still scaled when clipping runs.
        bf16-mixed has no scaler, its gradients are the true ones, and the plain plugin's
        clipping is right for them."""
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None and gradient_clip_val:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        cfg = self.opt_cfg
        decoder = list(self.model.decoder.named_parameters())
        if cfg.train_only is not None:
            prefixes = tuple(cfg.train_only)
            for name, p in decoder:
                p.requires_grad_(name.startswith(prefixes))
            if not any(p.requires_grad for _, p in decoder):
                raise TrainingConfigError(
                    f"model.optimizer.train_only {list(prefixes)} names no decoder parameter "
                    f"(they are {sorted({n.split('.')[0] for n, _ in decoder})})"
                )
        groups = [{"params": [p for _, p in decoder if p.requires_grad], "lr": cfg.lr}]
        enc = [p for p in self.model.encoder.parameters() if p.requires_grad]
        if enc:
            groups.append({"params": enc, "lr": cfg.encoder_lr})
        if cfg.name == "adam":
            opt = torch.optim.Adam(groups, weight_decay=cfg.weight_decay, fused=self._fused(groups))
        elif cfg.name == "rmsprop":
            opt = torch.optim.RMSprop(groups, weight_decay=cfg.weight_decay)
        else:
            raise ValueError(f"optimizer.name must be adam or rmsprop, not {cfg.name!r}")
        return opt
