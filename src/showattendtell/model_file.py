"""The exported model file: one self-describing, pickle-free ``.safetensors`` file.

Tensors are the CaptionModel's state dict (encoder included, so no download is needed at load
time); the header's string metadata holds the format tag, the architecture (JSON), the default
decoding settings (JSON) and the vocabulary (JSON word list). A model with a consensus index
(consensus.py) adds its tensors under ``consensus.`` and its captions as JSON; a model with a
confidence fit (confidence.py, scripts/confidence_study.py) adds it as JSON under ``confidence``.
The bundled model files, written before confidence existed, carry theirs beside them
(``bundled/confidence.json``): ``read_model`` gives a bundled file those.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from showattendtell.errors import UsageError, UserError
from showattendtell.model import CaptionModel
from showattendtell.network.decoder import Decoder, DecoderConfig
from showattendtell.network.encoder import EncoderConfig
from showattendtell.network.vocab import Vocabulary
from showattendtell.search import confidence
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig

FORMAT = "showattendtell/caption-model"
VERSION = "1"
CONSENSUS_PREFIX = "consensus."


class ModelFileError(UserError, ValueError):
    """Not a model file we can load; the message says what it is and what to do."""


class NotAModelFile(ModelFileError, UsageError):
    """The file given as a model is something else (a photo, a text, a checkpoint, another
    program's safetensors): a bad argument, exit status 2 like an unknown model name. A model
    file of ours that is damaged (cut short, diverged weights) stays a ModelFileError (1)."""


GIVE_A_MODEL = "give a model file (.safetensors) or the name of a model (`sat models` lists them)"


def save_model(
    model: CaptionModel,
    path: str | Path,
    decoding: DecodingConfig | None = None,
    half: bool = False,
    info: dict | None = None,
) -> Path:
    """Write ``model`` to ``path`` (atomically). ``half`` stores weights as float16, except
    tensors that would overflow (e.g. BatchNorm variances of converted Caffe weights)."""
    path = Path(path)
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu().contiguous()
        if half and v.is_floating_point():
            v16 = v.half()
            v = v16 if bool(torch.isfinite(v16).all()) and "running_" not in k else v
        state[k] = v
    enc = asdict(model.encoder.config)
    enc["weights"] = None  # the weights are in this file
    enc["fine_tune_stages"] = 0
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "encoder": json.dumps(enc),
        "decoder": json.dumps(asdict(model.decoder.config)),
        "decoding": json.dumps(asdict(decoding or DecodingConfig())),
        "vocab": model.vocab.to_json(),
        "info": json.dumps(info or {}),
    }
    if model.consensus is not None:
        tensors, description = model.consensus.to_file()
        state.update({CONSENSUS_PREFIX + k: v for k, v in tensors.items()})
        meta["consensus"] = json.dumps(description)
    fits = getattr(model, "confidence", None)
    if fits is not None:
        meta["confidence"] = fits.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(state, str(tmp), metadata=meta)
    except SafetensorError as e:  # its I/O errors (a full disk) are this, not an OSError
        tmp.unlink(missing_ok=True)
        raise _as_os_error(e, tmp) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # readable like any other file (installed as package data)
    tmp.replace(path)
    return path


def _as_os_error(e: SafetensorError, path: Path) -> OSError:
    """safetensors' error for a failed write ("I/O error: No space left on device (os error 28)")
    as the OSError it wraps, so that callers handle a full disk as any other write error."""
    found = re.search(r"(?:os error|code:) (\d+)", str(e))
    if found is None:
        return OSError(f"safetensors could not write {path}: {str(e)[:200]}")
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def _read_header(path: Path) -> dict[str, str]:
    """The string metadata of a model file, checked to be ours (the weights are not read)."""
    if path.is_dir():
        raise NotAModelFile(f"{path} is a folder: {GIVE_A_MODEL}")
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    if path.suffix == ".ckpt":
        raise NotAModelFile(
            f"{path} is a training checkpoint: export it first with `sat export {path} MODEL`"
        )
    other = _other_format(path)
    if other is not None:
        raise NotAModelFile(other)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(
            f"{path} is not a valid model file (truncated or another format): {e}"
        ) from None
    if meta.get("format") != FORMAT:
        raise NotAModelFile(
            f"{path} is a safetensors file but not a showattendtell model: {GIVE_A_MODEL}"
        )
    if meta.get("version") != VERSION:
        raise ModelFileError(
            f"{path} has model-file version {meta.get('version')}; this showattendtell "
            f"reads version {VERSION}: upgrade the package"
        )
    return meta


def _tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from the safetensors header (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(
            f"{path} is not a valid model file (truncated or another format): {e}"
        ) from None


_IMAGE_STARTS = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")
_IMAGE_BRANDS = (b"heic", b"heix", b"mif1", b"msf1", b"avif")  # HEIF/AVIF: ftyp at byte 4
_PICKLE_STARTS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # protocols 2-5


def _other_format(path: Path) -> str | None:
    """The error line for a file that cannot be a safetensors file, from its first bytes (None:
    it may be one, as it starts with the header's 8-byte length and the header's "{"). So a
    photo or a README given as --model is a usage error naming what it is, not a safetensors
    parse error ("header too large"). Nothing is decoded or unpickled."""
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return None  # safe_open says why
    if len(head) >= 9 and head[8:9] == b"{":
        return None
    if head[:4] == b"PK\x03\x04" or head[:2] in _PICKLE_STARTS:  # torch.save: zip, or pickle
        return (
            f"{path} is a PyTorch or zip file, not a model file: if it is a checkpoint of sat "
            f"train, export it first with `sat export {path} MODEL.safetensors`"
        )
    if not head:
        what = "an empty file"
    elif head.startswith(_IMAGE_STARTS) or (head[4:8] == b"ftyp" and head[8:12] in _IMAGE_BRANDS):
        what = "an image"
    elif _is_text(head):
        what = "a text file"
    else:
        what = "another kind of file (not safetensors)"
    return f"{path} is {what}, not a model file: {GIVE_A_MODEL}"


def _is_text(head: bytes) -> bool:
    """UTF-8 without NUL bytes (the last character may be cut off where ``head`` ends)."""
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


def _parse_header(path: Path, meta: dict[str, str]):
    """(EncoderConfig, DecoderConfig, DecodingConfig, Vocabulary, info) from a file's header."""
    try:
        encoder = EncoderConfig(**json.loads(meta["encoder"]))
        decoder = DecoderConfig(**json.loads(meta["decoder"]))
        decoding = DecodingConfig(**json.loads(meta["decoding"]))
        vocab = Vocabulary.from_json(meta["vocab"])
        info = json.loads(meta.get("info", "{}"))
    except (KeyError, TypeError, ValueError) as e:  # DecodingError is a ValueError too
        raise ModelFileError(f"{path}: damaged model description ({e})") from None
    return encoder, decoder, decoding, vocab, info


# Sizes of the description that no tensor of the file bounds (no weights depend on them), kept
# to what a caption model can use: an image side of 4096 px is 200 MB a photo as float32.
_MAX_INPUT_SIZE = 4096
_MAX_GRID_SIZE = 64


def _check_sizes(path: Path, encoder: EncoderConfig, decoder: DecoderConfig) -> None:
    """The description's sizes are whole numbers in range (a string or a float would fail deep
    in torch, a huge image side at the first photo), said in one line."""
    wanted = {
        "encoder.input_size": (encoder.input_size, 1, _MAX_INPUT_SIZE),
        "encoder.grid_size": (encoder.grid_size, 1, _MAX_GRID_SIZE),
        "decoder.embed_dim": (decoder.embed_dim, 1, None),
        "decoder.hidden_dim": (decoder.hidden_dim, 1, None),
        "decoder.attention_dim": (decoder.attention_dim, 1, None),
    }
    for name, (value, low, high) in wanted.items():
        if value is None and name == "encoder.grid_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelFileError(
                f"{path}: damaged model description ({name} is {value!r}, not a whole number)"
            )
        if value < low or (high is not None and value > high):
            limit = f"{low}..{high}" if high is not None else f"{low} or more"
            raise ModelFileError(
                f"{path}: damaged model description ({name} {value}: must be {limit})"
            )
    dropout = decoder.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ModelFileError(f"{path}: damaged model description (decoder.dropout {dropout!r})")


def _finite(v: torch.Tensor) -> bool:
    """No NaN or Inf in ``v``: its sum in float64 is finite exactly then (NaN and Inf carry
    through a sum, and float16/32 values cannot add up past float64's range), one pass without
    the boolean copy that ``isfinite(v).all()`` makes (a quarter of its time)."""
    return bool(torch.sum(v, dtype=torch.float64).isfinite())


class _SkipInit(TorchFunctionMode):
    """The layers' initialisations skipped (torch.nn.init's functions give their tensor back
    untouched) where every weight is read from the file next, or only shapes are wanted: on
    the meta device some of them run torch's reference implementations, whose first call
    imports torch._dynamo (2 s of `sat caption`'s start), and a ResNet-50's random weights take
    seconds to draw. A mode, so per thread: other threads keep initialising as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def _check_decoder_shapes(
    path: Path, encoder: EncoderConfig, decoder: DecoderConfig, vocab: Vocabulary, shapes: dict
) -> None:
    """The decoder the description asks for has the shapes of the file's tensors (``shapes``:
    name -> shape, from the safetensors header), checked before anything is allocated: the
    decoder is built on torch's meta device (shapes, no memory). safetensors has checked that
    the file holds every tensor's bytes, so a description that asks for more than the file
    holds (a hidden size of 200,000 in a 2 MB file) is refused here, not after gigabytes were
    allocated. The encoder is a named backbone of fixed size (grid_size pools, no weights)."""
    with torch.device("meta"), _SkipInit():
        ours = Decoder(len(vocab), encoder.feature_dim, decoder).state_dict()
    for key, tensor in ours.items():
        theirs = shapes.get("decoder." + key)
        if theirs is None or tuple(theirs) != tuple(tensor.shape):
            said = "missing" if theirs is None else str(tuple(theirs))
            raise ModelFileError(
                f"{path}: the weights do not match the model it describes (decoder.{key}: "
                f"{said} in the file, {tuple(tensor.shape)} described)"
            )


def describe_model(path: str | Path) -> dict:
    """What `sat models` shows, from the header alone (fast: no weights are read)."""
    path = Path(path)
    meta = _read_header(path)
    encoder, decoder, decoding, vocab, info = _parse_header(path, meta)
    consensus = json.loads(meta["consensus"]) if "consensus" in meta else None
    return {
        "attention": decoder.attention,
        "encoder": encoder.backbone,
        "input_size": encoder.input_size,
        "grid": encoder.grid,
        "feature_dim": encoder.feature_dim,
        "hidden_dim": decoder.hidden_dim,
        "vocab_size": len(vocab),
        "decoding": decoding.to_dict(),
        "info": info,
        "consensus_photos": len(consensus["references"]) if consensus else 0,
    }


def read_model(path: str | Path) -> tuple[CaptionModel, DecodingConfig, dict]:
    """Load a model file written by ``save_model`` (float32 on the CPU, in eval mode)."""
    path = Path(path)
    meta = _read_header(path)
    encoder, decoder, decoding, vocab, info = _parse_header(path, meta)
    _check_sizes(path, encoder, decoder)
    _check_decoder_shapes(path, encoder, decoder, vocab, _tensor_shapes(path))
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(
            f"{path} is not a valid model file (truncated or another format): {e}"
        ) from None
    with _SkipInit():  # every weight is the file's: load_state_dict below checks the keys
        model = CaptionModel(vocab, encoder, decoder, load_encoder_weights=False)
    index = {
        k[len(CONSENSUS_PREFIX) :]: state.pop(k)
        for k in list(state)
        if k.startswith(CONSENSUS_PREFIX)
    }
    if index or "consensus" in meta:
        try:
            model.consensus = ConsensusIndex.from_file(index, json.loads(meta["consensus"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(f"{path}: damaged consensus index ({e})") from None
    try:
        model.confidence = (
            confidence.ConfidenceFits.from_json(meta["confidence"])
            if "confidence" in meta
            else confidence.bundled_fits(path)
        )
    except confidence.ConfidenceFitError as e:
        raise ModelFileError(f"{path}: {e}") from None
    expected = model.state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in state):
        raise ModelFileError(f"{path}: the weights do not match the model it describes")
    bad = [k for k, v in state.items() if v.is_floating_point() and not _finite(v)]
    if bad:  # a diverged run: every caption would be empty or NaN-scored
        raise ModelFileError(
            f"{path}: {len(bad)} weight tensors hold NaN or Inf values (e.g. "
            f"{bad[0]}): the training run diverged; export an earlier checkpoint"
        )
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval(), decoding, info
