"""Captioning images with a trained model: what the CLI, batch captioning and the service call."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from showattendtell.images import open_image, preprocess
from showattendtell.model import CaptionModel, DecodingConfig
from showattendtell.model_file import ModelFileError, read_model

BUNDLED_DIR = Path(__file__).parent / "bundled"
DEFAULT_MODEL_ENV = "SAT_MODEL"
DEFAULT_BUNDLED = "flickr8k_lite2_soft.safetensors"


@dataclass
class CaptionResult:
    caption: str
    words: list[str]
    score: float  # what beams are ranked by (log_prob, length-normalised when asked)
    log_prob: float
    attention: np.ndarray  # (len(words), grid, grid): where the model looked for each word
    locations: list[tuple[int, int]] | None  # hard attention: (row, col) chosen for each word
    beams: list[tuple[str, float]]  # the top captions of the beam with their scores

    def to_dict(self, with_attention: bool = False) -> dict:
        d = {"caption": self.caption, "score": round(self.score, 4),
             "log_prob": round(self.log_prob, 4), "words": self.words}
        if with_attention:
            d["attention"] = np.round(self.attention, 5).tolist()
            if self.locations is not None:
                d["locations"] = [list(x) for x in self.locations]
        return d


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(device)


class Captioner:
    """A loaded model on a device, with its default decoding settings."""

    def __init__(self, model: CaptionModel, decoding: DecodingConfig, device: str = "auto",
                 name: str = "model", info: dict | None = None):
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.decoding, self.name, self.info = decoding, name, info or {}

    @property
    def attention_type(self) -> str:
        return self.model.decoder.config.attention

    @property
    def input_size(self) -> int:
        return self.model.encoder.config.input_size

    @torch.inference_mode()
    def encode(self, batch: torch.Tensor) -> torch.Tensor:
        """Preprocessed images (B, 3, S, S) -> annotation grids (B, L, D)."""
        return self.model.encoder(batch.to(self.device))

    def preprocess(self, image: str | Path | bytes | Image.Image) -> torch.Tensor:
        return preprocess(open_image(image), self.input_size)

    @torch.inference_mode()
    def caption_annotations(self, annotations: torch.Tensor, **decoding) -> list[CaptionResult]:
        cfg = replace(self.decoding, **{k: v for k, v in decoding.items() if v is not None})
        g = self.model.grid
        results = []
        for hyps in self.model.generate(annotations, cfg):
            best = hyps[0]
            words = self.model.words(best)
            locs = None
            if best.locations is not None:
                locs = [divmod(int(s), g) for s in best.locations]
            results.append(CaptionResult(
                caption=" ".join(words), words=words, score=best.score, log_prob=best.log_prob,
                attention=best.alphas.float().cpu().numpy().reshape(len(words), g, g),
                locations=locs,
                beams=[(" ".join(self.model.words(h)), h.score) for h in hyps],
            ))
        return results

    def caption(self, images: list, **decoding) -> list[CaptionResult]:
        """Caption images (paths, bytes or PIL images) as one batch.

        Keyword overrides: beam_size, max_length, length_penalty, hard_mode, no_repeat_ngram.
        """
        batch = torch.stack([self.preprocess(im) for im in images])
        return self.caption_annotations(self.encode(batch), **decoding)


def bundled_models() -> list[Path]:
    """Model files installed with the package, the default first."""
    found = sorted(BUNDLED_DIR.glob("*.safetensors"))
    return sorted(found, key=lambda p: p.name != DEFAULT_BUNDLED)


def default_model_path() -> Path:
    """$SAT_MODEL, else the bundled default model."""
    if os.environ.get(DEFAULT_MODEL_ENV):
        return Path(os.environ[DEFAULT_MODEL_ENV])
    bundled = bundled_models()
    if bundled:
        return bundled[0]
    raise ModelFileError(
        "no model given and no bundled model installed: pass --model MODEL.safetensors "
        f"(or set {DEFAULT_MODEL_ENV})"
    )


def load_model(path: str | Path | None = None, device: str = "auto") -> Captioner:
    """Load an exported model file (None: the default model) for captioning."""
    path = Path(path) if path else default_model_path()
    model, decoding, info = read_model(path)
    return Captioner(model, decoding, device, name=path.stem, info=info)


def caption_images(captioner: Captioner, images: list, **decoding) -> list[CaptionResult]:
    """Caption a list of images (paths, bytes or PIL images) with a loaded model."""
    return captioner.caption(images, **decoding)
