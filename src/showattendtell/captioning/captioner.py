"""Captioning images with a trained model: what the CLI, batch captioning and the service call."""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from showattendtell.captioning import pretrained
from showattendtell.captioning.catalog import resolve_models
from showattendtell.ensemble import EnsembleModel
from showattendtell.errors import UsageError
from showattendtell.images.files import image_warning, open_image, preprocess
from showattendtell.model import CaptionModel
from showattendtell.model_file import read_model
from showattendtell.search import confidence, familiarity
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig, DecodingOption
from showattendtell.search.options import (
    DECODING_OPTIONS,
    DEVICES,
    ignored_decoding,
    is_device_name,
)


@dataclass
class CaptionResult:
    caption: str
    words: list[str]
    score: float  # the beam's score (log_prob, length-normalised when asked); beams are
    # ranked by it, or by their consensus with --rerank consensus (consensus.py)
    log_prob: float
    attention: np.ndarray  # (len(words), grid, grid): where the model looked for each word
    locations: list[tuple[int, int]] | None  # hard attention: (row, col) chosen for each word
    beams: list[tuple[str, float]]  # the beam's captions with their scores, best first
    warning: str | None = None  # e.g. a 1x1 photo, an unfamiliar one or an unsure caption
    familiarity: float | None = None  # 0..1, how much the photo looks like the training photos
    # (familiarity.py); None for a model without a consensus index
    consensus: list[float] | None = None  # each beam's consensus score, in ``beams``' order,
    # when they were reranked by it (the number that chose the caption); else None
    confidence: float | None = None  # 0..1, the probability that the caption is good
    # (confidence.py): of captions given 0.8, about 80 % are; None only without any fit
    signals: dict[str, float] | None = None  # the features the confidence was computed from

    def add_warning(self, text: str | None) -> None:
        """Add a warning beside any the result has (a photo can be both tiny and unfamiliar)."""
        if text:
            self.warning = f"{self.warning}; {text}" if self.warning else text

    def to_dict(self, with_attention: bool = False) -> dict:
        """The result as strict JSON (no NaN/Infinity: a non-finite score becomes null)."""
        d = {
            "caption": self.caption,
            "score": finite_or_none(self.score, 4),
            "log_prob": finite_or_none(self.log_prob, 4),
            "words": self.words,
            "familiarity": None if self.familiarity is None else round(self.familiarity, 4),
            "confidence": None if self.confidence is None else round(self.confidence, 4),
        }
        if self.warning:
            d["warning"] = self.warning
        if with_attention:
            # float64 first: float32 values print as 0.30799999833106995, not 0.308
            d["attention"] = np.round(self.attention.astype(np.float64), 5).tolist()
            if self.locations is not None:
                d["locations"] = [list(x) for x in self.locations]
        return d


def finite_or_none(x: float, digits: int) -> float | None:
    """``x`` rounded, or None when it is NaN or infinite (strict JSON has no such numbers)."""
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


class DeviceError(UsageError, ValueError):
    """A device that is not one of ``DEVICES``, or a GPU asked for where there is none."""


def resolve_device(device: str = "auto") -> torch.device:
    if not is_device_name(device):
        raise DeviceError(f"{device!r} is not a device: give {DEVICES}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(device)


PRECISIONS = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast type of ``--precision`` (None: float32); float16 needs a GPU."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "16" and device.type != "cuda":
        raise UsageError("--precision 16 needs a CUDA GPU; on a CPU use 32 (the default) or bf16")
    return PRECISIONS[precision]


class Captioner:
    """A loaded model on a device, with its default decoding settings.

    ``precision`` "bf16" or "16" runs the encoder and the search under autocast (mixed
    precision: a GPU's fast path); "32", the default, is float32 throughout.
    """

    def __init__(
        self,
        model: CaptionModel,
        decoding: DecodingConfig,
        device: str = "auto",
        name: str = "model",
        precision: str = "32",
        files: Sequence[Path] = (),
    ):
        if getattr(model, "cpu_only", False):  # an ONNX model: onnxruntime's CPU provider
            if device not in ("auto", "cpu") or precision != "32":
                raise DeviceError(
                    "an ONNX model runs on the CPU in float32 (onnxruntime): leave --device "
                    "and --precision out, or caption with the model file"
                )
            device = "cpu"
        self.device = resolve_device(device)
        self.files = tuple(files)  # the model files it was read from (none: built in memory)
        self.autocast = autocast_dtype(precision, self.device)
        self.precision = precision
        self.model = model.to(self.device).eval()
        if model.consensus is not None:  # not a module: moved by hand
            model.consensus.to(self.device)
        self.decoding, self.name = decoding, name
        # the model's own confidence fits (its file's, or a bundled model's), else the bundled
        # default model's, whose scales other models share only approximately (confidence.py)
        self.own_fits = getattr(model, "confidence", None) is not None
        self.confidence_fits = getattr(model, "confidence", None) or confidence.default_fits()

    @classmethod
    def from_pretrained(
        cls,
        name_or_folder: str | Path,
        device: str = "auto",
        precision: str = "32",
        *,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
    ) -> Captioner:
        """A ready Captioner from a model folder (``save_pretrained``'s, or an ONNX export), a
        model's name (`sat models`) or a Hugging Face Hub model ORG/NAME, read from
        huggingface_hub's cache when it is there (``HF_HUB_OFFLINE=1`` or ``local_files_only``:
        never from the network). ``revision``, ``cache_dir`` and ``token`` are
        huggingface_hub's."""
        spec, name = pretrained.locate(name_or_folder, revision, cache_dir, local_files_only, token)
        captioner = load_model(spec, device, precision)
        captioner.name = name or captioner.name
        return captioner

    def save_pretrained(
        self, folder: str | Path, *, half: bool = False, overwrite: bool = False
    ) -> Path:
        """Write this model as ``config.json`` + ``model.safetensors`` + ``vocab.json`` (the
        layout of Hugging Face's ``ModelHubMixin``: push the folder to a hub repository and it
        loads with ``Captioner.from_pretrained("ORG/NAME")``). The stored decoding is this
        Captioner's. ``half``: weights as float16 (half the size); files of those names are
        replaced only with ``overwrite``."""
        info = {"saved_from": self.name}
        return pretrained.save_folder(self.model, self.decoding, folder, info, half, overwrite)

    def _autocast(self):
        return torch.autocast(
            self.device.type, dtype=self.autocast, enabled=self.autocast is not None
        )

    @property
    def attention_type(self) -> str:
        return self.model.decoder.config.attention

    def applies(self, opt: DecodingOption) -> bool:
        """Whether a decoding option changes this model's captions: the hard-attention mode
        only for a hard-attention model, reranking only for a model with a consensus index."""
        if opt.needs == "hard":
            return self.attention_type == "hard"
        if opt.needs == "consensus":
            return self.model.consensus is not None
        return True

    def made_by(self, decoding: DecodingConfig | None = None) -> dict:
        """What makes this model's captions with ``decoding`` (None: its stored settings): its
        name and the decoding options that change its captions (``applies``), with the
        precision (bf16 changes some captions). `sat caption` writes it into every record, and
        ``--resume`` compares it with the file's, so that one file never mixes two models'
        captions."""
        cfg = decoding or self.decoding
        used = {k: v for k, v in cfg.to_dict().items() if self.applies(DECODING_OPTIONS[k])}
        made_by: dict = {"model": self.name}
        if self.sha256:
            made_by["model_sha256"] = self.sha256
        return {**made_by, "decoding": {**used, "precision": self.precision}}

    @functools.cached_property
    def sha256(self) -> str | None:
        """The SHA-256 of the model file ("A+B" for an ensemble's files), what tells two files
        of one name apart (two runs' best.safetensors); None for a model built in memory.
        Hashing a 40 MB file just read takes about 30 ms."""
        if not self.files:
            return None
        digests = []
        for path in self.files:
            with open(path, "rb") as f:
                digests.append(hashlib.file_digest(f, "sha256").hexdigest())
        return "+".join(digests)

    @property
    def input_size(self) -> int:
        return self.model.encoder.config.input_size

    @torch.inference_mode()
    def encode(self, batch: torch.Tensor) -> torch.Tensor:
        """Preprocessed images (B, 3, S, S) -> annotation grids (B, L, D)."""
        with self._autocast():
            return self.model.encoder(batch.to(self.device))

    def preprocess(self, image: str | Path | bytes | Image.Image) -> torch.Tensor:
        return preprocess(open_image(image, min_size=self.input_size), self.input_size)

    def check_decoding(self, **overrides) -> DecodingConfig:
        """The stored decoding with these overrides (None: keep the stored one), resolved once
        at an entry point and then passed down whole; a DecodingError if one is out of range
        or this model cannot decode with it (e.g. --rerank consensus without an index)."""
        cfg = self.decoding.with_overrides(**overrides)
        self.model.check_decoding(cfg)
        return cfg

    def prepare(self, decoding: DecodingConfig | None = None) -> None:
        """Start building now what the first caption would otherwise build, once per model: the
        familiarity calibration, here with all of torch's threads (the first caption's lane has
        only its share of them), and, when these decoding options rerank by consensus, the
        consensus tables, in a thread of their own (numpy, one core) while the calibration and
        the first batch run; the first reranking waits for them if it comes sooner.
        ``decoding``: a resolved config (``check_decoding``), None: the stored settings."""
        index = self.model.consensus
        if index is None:
            return
        if (decoding or self.decoding).reranks_by_consensus:
            threading.Thread(target=index.prepare, name="sat-consensus", daemon=True).start()
        familiarity.for_index(index).reference()

    @torch.inference_mode()
    def caption_annotations(
        self, annotations: torch.Tensor, decoding: DecodingConfig | None = None
    ) -> list[CaptionResult]:
        """Annotation grids (B, L, D) -> their results, each with its familiarity if the model
        has an index and its confidence (confidence.py), and a warning when the caption is
        likely wrong: by its confidence for a model with fits of its own; for one scored by
        the default model's fits (whose scales fit it only approximately), by familiarity's
        rule as before (familiarity.py; none without an index). ``decoding``: a resolved config
        (``check_decoding``), None: the stored settings."""
        cfg = decoding or self.decoding
        with self._autocast():
            hypotheses = self.model.generate(annotations, cfg)
        g = self.model.grid
        scorer = familiarity.for_index(self.model.consensus)
        captions = [[" ".join(self.model.words(h)) for h in hyps] for hyps in hypotheses]
        typicality, risks = None, None
        if scorer is not None:
            similarity = scorer.similarity(ConsensusIndex.pool(annotations))
            known = scorer.calibrate(similarity).tolist()
            typicality = scorer.typicality(similarity)
        else:
            known = [None] * len(hypotheses)
        signals, sure = self._confidence(annotations, hypotheses, captions, cfg, typicality)
        if scorer is not None:
            risks = scorer.risk(similarity, signals["log_prob_per_word"]).tolist()
        results = []
        for b, (hyps, fam) in enumerate(zip(hypotheses, known, strict=True)):
            best = hyps[0]
            words = self.model.words(best)
            locs = None
            if best.locations is not None:
                locs = [divmod(int(s), g) for s in best.locations]
            mine = {k: float(v[b]) for k, v in signals.items()}
            results.append(
                CaptionResult(
                    caption=self.model.vocab.detokenize(words),  # as its language writes
                    words=words,
                    score=best.score,
                    log_prob=best.log_prob,
                    attention=best.alphas.float().cpu().numpy().reshape(len(words), g, g),
                    locations=locs,
                    beams=[
                        (self.model.vocab.detokenize(self.model.words(h)), h.score) for h in hyps
                    ],
                    warning=self._warning(scorer, sure, b, fam, risks, mine),
                    familiarity=fam,
                    consensus=[h.consensus for h in hyps] if best.consensus is not None else None,
                    confidence=None if sure is None else float(sure[1][b]),
                    signals=mine,
                )
            )
        return results

    def _warning(self, scorer, sure, b: int, fam, risks, signals) -> str | None:
        """Photo ``b``'s warning: by its confidence with the model's own fits, else by
        familiarity's rule (None for a model without an index)."""
        per_word = signals["log_prob_per_word"]
        if self.own_fits and sure is not None:
            return confidence.warning(sure[0], float(sure[1][b]), fam, per_word)
        if scorer is None:
            return None
        return scorer.warning(fam, risks[b], per_word)

    def _confidence(self, annotations, hypotheses, captions, cfg, typicality):
        """(each photo's signals, (the fit used, each photo's confidence)); the second None
        when there is no fit at all (no bundled fits installed)."""
        with self._autocast():
            signals = confidence.signals(
                self.model.decoder,
                annotations,
                hypotheses,
                captions,
                cfg.hard_mode,
                self.model.consensus,
                typicality,
            )
        if self.confidence_fits is None:
            return signals, None
        fit = self.confidence_fits.for_features(list(signals))
        return signals, (fit, fit.confidence(signals))

    def caption_batch(
        self, images: torch.Tensor, decoding: DecodingConfig | None = None
    ) -> list[CaptionResult]:
        """Preprocessed images (B, 3, S, S) -> their results: the encode-and-decode step of the
        image pipeline (pipeline.py), also run by the web service on its own batches."""
        return self.caption_annotations(self.encode(images), decoding)

    def caption(self, images: list, **overrides) -> list[CaptionResult]:
        """Caption images (paths, bytes or PIL images) as one batch.

        Keyword overrides: any ``DecodingConfig`` field (beam_size, max_length, min_length,
        length_penalty, hard_mode, no_repeat_ngram, rerank).
        """
        decoding = self.check_decoding(**overrides)  # bad options fail before any work
        if isinstance(images, (str, Path, bytes, Image.Image)):  # one image, not its letters
            images = [images]
        if not images:
            return []
        decoded = [open_image(im, min_size=self.input_size) for im in images]
        batch = torch.stack([preprocess(im, self.input_size) for im in decoded])
        results = self.caption_batch(batch, decoding)
        for img, result in zip(decoded, results, strict=True):
            result.add_warning(image_warning(img))
        return results


def load_model(
    path: str | Path | Sequence[str | Path] | None = None,
    device: str = "auto",
    precision: str = "32",
) -> Captioner:
    """Load a model for captioning: a model file, a model folder (``Captioner.save_pretrained``'s
    layout or an ONNX export), a model's name (`sat models`), ``A+B`` or a list of them for an
    ensemble (decoded with the first one's stored settings), or None for
    the default model ($SAT_MODEL, else the bundled default). ``precision``: "32", "bf16" or
    "16" (mixed precision; "16" on a GPU only)."""
    specs = list(path) if isinstance(path, (list, tuple)) else [path]
    paths = [p for spec in specs or [None] for p in resolve_models(spec)]
    loaded = [_read(p) for p in paths]
    model, decoding, _ = loaded[0]
    if len(paths) > 1:
        model = EnsembleModel([m for m, _, _ in loaded], [p.stem for p in paths])
    name = "+".join(p.name if p.is_dir() else p.stem for p in paths)
    files = [f for _, _, fs in loaded for f in fs]
    return Captioner(model, decoding, device, name=name, precision=precision, files=files)


def _read(path: Path) -> tuple[CaptionModel, DecodingConfig, tuple[Path, ...]]:
    """(model, stored decoding, its files) of a model file or a model folder (pretrained.py)."""
    if path.is_dir():
        return pretrained.read_folder(path)
    model, decoding, _ = read_model(path)
    return model, decoding, (path,)


def caption_images(captioner: Captioner, images: list, **decoding) -> list[CaptionResult]:
    """Caption a list of images (paths, bytes or PIL images) with a loaded model. A decoding
    option this model ignores (``hard_mode`` for soft attention) is a UserWarning, once per
    call, as the CLI warns for its flag."""
    for message in ignored_decoding(decoding, captioner, api=True):
        warnings.warn(message, UserWarning, stacklevel=2)
    return captioner.caption(images, **decoding)
