"""`sat export MODEL OUT --format onnx`: a CaptionModel as three ONNX graphs in a folder, for
onnxruntime (onnx_model.py) or any serving stack that runs ONNX.

    encoder.onnx        images (B, 3, S, S), ImageNet-normalised -> annotations (B, L, D)
    decoder_start.onnx  annotations (G, L, D) -> h, c (G, H), projected (G, L, A)
                        [, image_gates (G, 4H): attend "after"]
    decoder_step.onnx   words (N,), h, c (N, H), projected (G, L, A), annotations (G, L, D)
                        [, image_gates (G, 4H)] [, argmax (): hard attention]
                        -> log_probs (N, V), alpha (N, L) [, location (N,)], h, c (N, H)

plus config.json (the architecture, the stored decoding, the file names and, for a model with
them, its confidence fits: search/confidence.py), vocab.json and, for a model with one,
consensus.safetensors (the consensus index of --rerank consensus and of the
familiarity score). Rows of a step come in N / G consecutive rows per image (beam search: the K
beams of an image), each image's grid given once, as DecoderState keeps them.

The step graph is the decoder's step (network/decoder.py) written with plain operators only: the
CPU and GPU kernels of the torch path (piecewise scores, Triton, the word-gates table) are
speed-ups of the same equations that a tracer would either freeze or not see through.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from showattendtell.captioning import onnx_model as files
from showattendtell.model import CaptionModel
from showattendtell.network.decoder import Decoder
from showattendtell.network.encoder import Encoder, SameConv2d
from showattendtell.search.decoding import DecodingConfig

OPSET = 17  # LayerNorm-free graphs: any onnxruntime of the last three years runs opset 17


class _EncoderGraph(nn.Module):
    def __init__(self, encoder: Encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # the whole batch at once: Encoder.forward's slicing into chunks is a CPU cache tweak
        return self.encoder.forward_top(self.encoder.forward_frozen(images))


@contextlib.contextmanager
def _static_padding(encoder: Encoder, images: torch.Tensor) -> Iterator[None]:
    """TensorFlow "same" padding (SameConv2d) as constants while the encoder is traced. It is
    computed from the input's size with a ceiling division, -(-x // s), which the tracer
    writes as ONNX's integer Div, which truncates: an odd size would get one pixel too few.
    The input size is fixed (the model's input_size), so the pads are measured once on
    ``images`` and each stride-2 convolution pads by those numbers."""
    convs = [m for m in encoder.modules() if isinstance(m, SameConv2d) and m.stride[0] > 1]
    sizes: dict[SameConv2d, tuple[int, int]] = {}

    def measure(conv: nn.Module, args: tuple) -> None:
        sizes[conv] = tuple(args[0].shape[-2:])

    hooks = [m.register_forward_pre_hook(measure) for m in convs]
    try:
        with torch.no_grad():
            encoder.forward_top(encoder.forward_frozen(images))
    finally:
        for hook in hooks:
            hook.remove()
    for m in convs:
        k, s = m.kernel_size[0], m.stride[0]
        ph, pw = (max((-(-n // s) - 1) * s + k - n, 0) for n in sizes[m])
        pads = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
        m.forward = functools.partial(_padded, m, pads)  # an instance attribute, deleted after
    try:
        yield
    finally:
        for m in convs:
            del m.forward


def _padded(conv: SameConv2d, pads: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    return nn.Conv2d.forward(conv, F.pad(x, pads))


class _StartGraph(nn.Module):
    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, annotations: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.decoder
        h, c = d.init_state(annotations)
        projected = d.attention.project_annotations(annotations)
        gates = d.image_gates(annotations)
        return (h, c, projected) if gates is None else (h, c, projected, gates)


class _StepGraph(nn.Module):
    """Decoder.step for rows in groups of N / G per image (see the module docstring)."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.d = decoder
        self.after = decoder.attend_proj is not None
        self.hard = decoder.config.attention == "hard"

    def forward(self, words, h, c, projected, annotations, *extra):
        d, cfg = self.d, self.d.config
        H, A = cfg.hidden_dim, cfg.attention_dim
        image_gates = extra[0] if self.after else None
        argmax = extra[-1] if self.hard else None
        G, L, D = annotations.shape
        emb = d.embedding(words)  # (N, E)
        gate_x = d.gate_embed(emb)  # (N, 4H)
        if image_gates is not None:
            gate_x = (gate_x.view(G, -1, 4 * H) + image_gates.unsqueeze(1)).view(-1, 4 * H)
        hp = d.hidden_proj(h)
        if self.after:
            h, c = self._cell(gate_x + hp, c, H)
            att_h, beta = d.attend_proj(h).split([A, 1], dim=1)
        else:
            recurrent, att_h, beta = hp.split([4 * H, A, 1], dim=1)
        # e = w^T tanh(W_a a + U_a h), the rows of each image against its grid (G, K, L)
        keys = torch.tanh(projected.unsqueeze(1) + att_h.view(G, -1, 1, A))
        alpha = F.softmax(d.attention.score(keys).squeeze(3), dim=2)  # (G, K, L)
        weights, location = alpha, None
        if self.hard:  # the one attended cell s_t as a one-hot row: the context is a_{s_t}
            location = alpha.argmax(2)  # (G, K)
            cells = torch.arange(L, device=alpha.device)
            onehot = (cells == location.unsqueeze(2)).to(alpha.dtype)
            weights = torch.where(argmax, onehot, alpha)  # argmax False: the expected context
        context = torch.bmm(weights, annotations).view(-1, D)  # (N, D)
        z = torch.sigmoid(beta + d.beta_bias) * context
        if not self.after:
            h, c = self._cell(gate_x + recurrent + d.gate_context(z), c, H)
        log_probs = F.log_softmax(d.out_vocab(emb + d.out_hidden(h) + d.out_context(z)), dim=-1)
        alpha = alpha.view(-1, L)
        if self.hard:
            return log_probs, alpha, location.view(-1), h, c
        return log_probs, alpha, h, c

    @staticmethod
    def _cell(gates: torch.Tensor, c: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kernels/lstm_cell.py's inference lines: gates in the order i f o g."""
        ifo, g = gates.split([3 * H, H], dim=1)
        i, f, o = torch.sigmoid(ifo).chunk(3, 1)
        c = f * c + i * torch.tanh(g)
        return o * torch.tanh(c), c


def _export(module: nn.Module, args: tuple, path: Path, inputs, outputs, dynamic) -> None:
    with warnings.catch_warnings():  # the tracer's notes on shapes read as Python numbers
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=list(inputs),
            output_names=list(outputs),
            dynamic_axes=dynamic,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,  # the TorchScript tracer: no onnxscript to install for a small graph
        )


def export_onnx(
    model: CaptionModel, decoding: DecodingConfig, folder: Path, info: dict | None = None
) -> Path:
    """Write ``model`` as an ONNX model folder (see the module docstring) at ``folder``: a new
    or empty folder, or an earlier export to replace (the caller checks which it may replace).
    Each graph is checked with ``onnx.checker``. Written in a new folder beside it and renamed
    into place: an export stopped halfway leaves nothing that looks like a model."""
    import onnx  # the optional extra [onnx]: imported only by an export

    model = model.float().cpu().eval()
    enc, dec = model.encoder, model.decoder
    S, L, D = enc.config.input_size, enc.config.grid**2, enc.config.feature_dim
    after = dec.attend_proj is not None
    hard = dec.config.attention == "hard"
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        images = torch.zeros(2, 3, S, S)
        grids = torch.rand(2, L, D)
        with _static_padding(enc, images):
            _export(
                _EncoderGraph(enc),
                (images,),
                tmp / files.ENCODER_FILE,
                ["images"],
                ["annotations"],
                {"images": {0: "batch"}, "annotations": {0: "batch"}},
            )
        start_out = ["h", "c", "projected", *(["image_gates"] if after else [])]
        _export(
            _StartGraph(dec),
            (grids,),
            tmp / files.START_FILE,
            ["annotations"],
            start_out,
            {name: {0: "images"} for name in ["annotations", *start_out]},
        )
        with torch.no_grad():
            h, c, projected, *gates = _StartGraph(dec)(grids)
        K = 3  # traced with 3 rows an image; any number runs (the shapes are symbolic)
        step_in = ["words", "h", "c", "projected", "annotations"]
        step_args: list = [torch.full((2 * K,), 5), h.repeat_interleave(K, 0)]
        step_args += [c.repeat_interleave(K, 0), projected, grids]
        if after:
            step_in.append("image_gates")
            step_args.append(gates[0])
        if hard:
            step_in.append("argmax")
            step_args.append(torch.tensor(True))
        step_out = ["log_probs", "alpha", *(["location"] if hard else []), "h_next", "c_next"]
        rows = {"words", "h", "c", *step_out}
        _export(
            _StepGraph(dec),
            tuple(step_args),
            tmp / files.STEP_FILE,
            step_in,
            step_out,
            {
                name: {0: "rows" if name in rows else "images"}
                for name in step_in + step_out
                if name != "argmax"
            },
        )
        for name in files.GRAPH_FILES:
            onnx.checker.check_model(str(tmp / name), full_check=True)
        if model.consensus is not None:
            tensors, description = model.consensus.to_file()
            save_file(
                tensors, str(tmp / files.CONSENSUS_FILE), {"consensus": json.dumps(description)}
            )
        config = {
            "format": files.FORMAT,
            "version": files.VERSION,
            "library_name": "showattendtell",
            "encoder": asdict(enc.config) | {"weights": None, "fine_tune_stages": 0},
            "decoder": asdict(dec.config),
            "decoding": decoding.to_dict(),
            "vocab_size": len(model.vocab),
            "opset": OPSET,
            "step_inputs": step_in,
            "step_outputs": step_out,
            "info": info or {},
        }
        fits = getattr(model, "confidence", None)
        if fits is not None:  # its own fits: an export is scored, and warned, as the model file
            config["confidence"] = json.loads(fits.to_json())
        (tmp / files.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        model.vocab.save(tmp / files.VOCAB_FILE)
        mask = _umask()  # mkdtemp's folder and safetensors' file are private: made like others
        for path in tmp.iterdir():
            path.chmod(0o666 & ~mask)
        tmp.chmod(0o777 & ~mask)
        _replace(folder, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _replace(folder: Path, new: Path) -> None:
    """``new`` renamed to ``folder``; an empty folder there is replaced, as is an earlier ONNX
    export (the caller checked that ``--overwrite`` was given for it), moved aside first so
    that one of the two exports is complete at every moment."""
    if not folder.exists():
        new.rename(folder)
    elif not any(folder.iterdir()):
        folder.rmdir()
        new.rename(folder)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
        old.rmdir()
        folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
