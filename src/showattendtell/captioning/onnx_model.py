"""A model folder written by `sat export MODEL OUT --format onnx` (onnx_export.py), run with
onnxruntime: ``pip install "showattendtell[onnx]"``.

The search (search/decoding.py) is the torch path's, unchanged: it talks to a decoder through
``start(annotations) -> state`` and ``step(words, state, hard_mode) -> Step``, with
``state.select`` / ``state.regroup`` to reorder rows. ``OnnxDecoder`` answers those two calls
with the exported graphs, and its state is network/decoder.py's ``DecoderState`` (h, c and each
image's grid, as torch tensors that share memory with onnxruntime's numpy arrays), so greedy and
beam search, n-gram blocking, the length penalty, consensus reranking and familiarity all run as
they do for a torch model. Everything runs on the CPU, float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from showattendtell.errors import UsageError
from showattendtell.model import CaptionModel
from showattendtell.model_file import ModelFileError
from showattendtell.network.decoder import DecoderConfig, DecoderState, Step
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.search.confidence import ConfidenceFits
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig, DecodingError

FORMAT = "showattendtell/onnx-model"
VERSION = "1"
CONFIG_FILE = "config.json"
VOCAB_FILE = "vocab.json"
ENCODER_FILE = "encoder.onnx"
START_FILE = "decoder_start.onnx"
STEP_FILE = "decoder_step.onnx"
GRAPH_FILES = (ENCODER_FILE, START_FILE, STEP_FILE)
CONSENSUS_FILE = "consensus.safetensors"
INSTALL = 'pip install "showattendtell[onnx]"'


class OnnxModelError(ModelFileError):
    """An ONNX model folder that cannot be run (onnxruntime missing, a file missing or
    damaged); the message says what to do."""


def onnxruntime():
    """The onnxruntime module, or an OnnxModelError that says how to install it."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise OnnxModelError(
            f"ONNX models run with onnxruntime, which is not installed: {INSTALL}"
        ) from None
    return ort


def _session(path: Path):
    """An onnxruntime session on the CPU with torch's thread count (what `sat caption
    --threads` and the processes sharing the cores set), so the two paths use the same cores."""
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # no busy-waiting between runs: the search runs a step graph, then torch's bookkeeping,
    # then the next step; onnxruntime's spinning threads would take the cores from torch (and
    # from the other processes of `sat caption`) in between
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own error types: a damaged or foreign file
        raise OnnxModelError(
            f"{path} cannot be loaded by onnxruntime ({str(e).splitlines()[0]}): export the "
            "model again with `sat export MODEL OUT --format onnx`"
        ) from None


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().contiguous().numpy()


class OnnxEncoder(nn.Module):
    """encoder.onnx as an Encoder: images (B, 3, S, S) -> annotation grids (B, L, D)."""

    def __init__(self, session, config: EncoderConfig):
        super().__init__()
        self.session, self.config = session, config

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        (grids,) = self.session.run(None, {"images": _numpy(images)})
        return torch.from_numpy(grids)


class OnnxDecoder(nn.Module):
    """decoder_start.onnx and decoder_step.onnx as the search's two calls (see the module
    docstring). Hard attention: ``hard_mode`` "argmax" (the most likely cell) or
    "expectation" (the expected context); "sample" draws cells with torch's random numbers,
    which a graph cannot take, so it is refused (``check_hard_mode``)."""

    def __init__(self, start, step, config: DecoderConfig, inputs: list[str]):
        super().__init__()
        self.start_session, self.step_session = start, step
        self.config = config
        self.inputs = inputs

    def start(self, annotations: torch.Tensor, word_gates: bool = False) -> DecoderState:
        grids = _numpy(annotations)
        h, c, projected, *gates = self.start_session.run(None, {"annotations": grids})
        return DecoderState(
            torch.from_numpy(h),
            torch.from_numpy(c),
            torch.from_numpy(projected),
            torch.from_numpy(grids),
            image_gates=torch.from_numpy(gates[0]) if gates else None,
        )

    def step(
        self, prev_words: torch.Tensor, state: DecoderState, hard_mode: str = "argmax"
    ) -> Step:
        feed = {
            "words": prev_words.cpu().numpy(),
            "h": state.h.numpy(),
            "c": state.c.numpy(),
            "projected": state.projected.numpy(),
            "annotations": state.annotations.numpy(),
        }
        if "image_gates" in self.inputs:
            feed["image_gates"] = state.image_gates.numpy()
        hard = self.config.attention == "hard"
        if hard:
            check_hard_mode(hard_mode)
            feed["argmax"] = np.array(hard_mode == "argmax")
        out = [torch.from_numpy(x) for x in self.step_session.run(None, feed)]
        if hard:
            log_probs, alpha, location, h, c = out
            location = location if hard_mode == "argmax" else None
        else:
            (log_probs, alpha, h, c), location = out, None
        return Step(
            log_probs,
            alpha,
            location,
            DecoderState(
                h, c, state.projected, state.annotations, state.beams, None, state.image_gates
            ),
        )


def check_hard_mode(hard_mode: str) -> None:
    if hard_mode == "sample":
        raise DecodingError(
            "--hard-mode sample is not available with an ONNX model (a graph cannot draw "
            "torch's random cells): use argmax or expectation, or the model file"
        )


class OnnxCaptionModel(CaptionModel):
    """A CaptionModel whose encoder and decoder are onnxruntime sessions: ``generate``,
    consensus reranking and the checks of decoding options are CaptionModel's own."""

    search_strategy = "shrink"  # the CPU's search: finished rows leave the batch
    cpu_only = True  # onnxruntime's CPU provider (Captioner keeps it, and its inputs, there)

    def __init__(
        self,
        vocab: Vocabulary,
        encoder: OnnxEncoder,
        decoder: OnnxDecoder,
        consensus: ConsensusIndex | None,
    ):
        nn.Module.__init__(self)
        self.vocab, self.encoder, self.decoder, self.consensus = vocab, encoder, decoder, consensus
        self.confidence: ConfidenceFits | None = None  # the exported model's own fits, if any

    def check_decoding(self, decoding: DecodingConfig) -> None:
        super().check_decoding(decoding)
        if self.decoder.config.attention == "hard":
            check_hard_mode(decoding.hard_mode)

    def interpolate_(self, other: CaptionModel, alpha: float) -> CaptionModel:
        raise UsageError("an ONNX model cannot be interpolated; interpolate the model files")


def read_onnx_folder(folder: Path) -> tuple[OnnxCaptionModel, DecodingConfig, tuple[Path, ...]]:
    """(model, stored decoding, the files read) of an ONNX model folder."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        if config.get("version") != VERSION:
            raise OnnxModelError(
                f"{folder} is an ONNX export of version {config.get('version')}; this "
                f"showattendtell reads version {VERSION}: upgrade the package or export again"
            )
        encoder = EncoderConfig(**config["encoder"])
        decoder = DecoderConfig(**config["decoder"])
        decoding = DecodingConfig(**config["decoding"])
        inputs = list(config["step_inputs"])
        vocab = Vocabulary.load(folder / VOCAB_FILE)
        fits = config.get("confidence")
        fits = None if fits is None else ConfidenceFits.from_json(json.dumps(fits))  # ValueErrors
    except OnnxModelError:
        raise
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise OnnxModelError(
            f"{folder}: damaged ONNX model description ({e}): export it again"
        ) from None
    missing = [name for name in GRAPH_FILES if not (folder / name).is_file()]
    if missing:
        raise OnnxModelError(
            f"{folder} has no {', '.join(missing)}: export the model again with "
            "`sat export MODEL OUT --format onnx`"
        )
    sessions = [_session(folder / name) for name in GRAPH_FILES]
    consensus, read = None, [folder / CONFIG_FILE, *(folder / n for n in GRAPH_FILES)]
    if (folder / CONSENSUS_FILE).is_file():
        consensus = _read_consensus(folder / CONSENSUS_FILE)
        read.append(folder / CONSENSUS_FILE)
    model = OnnxCaptionModel(
        vocab,
        OnnxEncoder(sessions[0], encoder),
        OnnxDecoder(sessions[1], sessions[2], decoder, inputs),
        consensus,
    )
    model.confidence = fits
    return model, decoding, tuple(read)


def _read_consensus(path: Path) -> ConsensusIndex:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            description = json.loads((f.metadata() or {})["consensus"])
        return ConsensusIndex.from_file(load_file(str(path)), description)
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as e:
        raise OnnxModelError(f"{path}: damaged consensus index ({e}): export again") from None
