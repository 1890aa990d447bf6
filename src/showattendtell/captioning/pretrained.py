"""Model folders in the layout of Hugging Face's ``ModelHubMixin``: ``config.json`` (what the
model is), ``model.safetensors`` (the model file of model_file.py, unchanged: pickle-free, with
its own description in the header) and ``vocab.json`` (the word list, for tools that read the
vocabulary without safetensors). A folder pushed to the Hugging Face Hub as it is loads with one
``Captioner.from_pretrained("ORG/NAME")``; a folder on disk, or a bundled model's name, loads
the same way.

Why not ``ModelHubMixin`` itself: it builds the object from config.json's entries as
constructor arguments, while a Captioner is built from the model file, which already describes
itself; and it needs huggingface_hub imported for a local folder too. Downloads and the cache
(``models--ORG--NAME/snapshots/REV/``, ``HF_HUB_OFFLINE=1``, ``local_files_only``) are
huggingface_hub's own ``snapshot_download``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from showattendtell.captioning import onnx_model
from showattendtell.captioning.catalog import named_models
from showattendtell.ensemble import EnsembleModel
from showattendtell.errors import UsageError
from showattendtell.model_file import FORMAT, ModelFileError, read_model, save_model
from showattendtell.network.vocab import Vocabulary

if TYPE_CHECKING:
    from showattendtell.model import CaptionModel
    from showattendtell.search.decoding import DecodingConfig

CONFIG_NAME = "config.json"  # huggingface_hub.constants.CONFIG_NAME
WEIGHTS_NAME = "model.safetensors"  # huggingface_hub.constants.SAFETENSORS_SINGLE_FILE
VOCAB_NAME = "vocab.json"
HUB_FILES = (CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME)
LIBRARY_NAME = "showattendtell"
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable
WHAT_A_FOLDER_HOLDS = (
    f"a model folder holds {CONFIG_NAME}, {WEIGHTS_NAME} and {VOCAB_NAME} "
    "(Captioner.save_pretrained) or an ONNX export (sat export MODEL OUT --format onnx)"
)


class PretrainedError(ModelFileError, UsageError):
    """A folder or hub name that holds no model we can load; the message says what to do."""


def folder_format(folder: Path) -> str:
    """The ``format`` tag of a model folder's config.json (model_file.FORMAT for this layout,
    onnx_model.FORMAT for an ONNX export); a PretrainedError for any other folder."""
    config = folder / CONFIG_NAME
    if not config.is_file():
        raise PretrainedError(f"{folder} has no {CONFIG_NAME}: {WHAT_A_FOLDER_HOLDS}")
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
        return str(meta["format"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PretrainedError(
            f"{config} is not a showattendtell model description ({e}): {WHAT_A_FOLDER_HOLDS}"
        ) from None


def read_folder(folder: str | Path) -> tuple[CaptionModel, DecodingConfig, tuple[Path, ...]]:
    """(model, stored decoding, the files it was read from) of a model folder: this layout or
    an ONNX export (onnx_model.py, which needs ``pip install "showattendtell[onnx]"``)."""
    folder = Path(folder)
    fmt = folder_format(folder)
    if fmt != FORMAT:
        if fmt == onnx_model.FORMAT:
            return onnx_model.read_onnx_folder(folder)
        raise PretrainedError(
            f"{folder / CONFIG_NAME} describes a {fmt!r} model, not a showattendtell one: "
            f"{WHAT_A_FOLDER_HOLDS}"
        )
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise PretrainedError(f"{folder} has {CONFIG_NAME} but no {WEIGHTS_NAME}: copy it there")
    model, decoding, _ = read_model(weights)
    vocab_file = folder / VOCAB_NAME
    if vocab_file.is_file():  # a vocabulary edited beside the weights would mislabel words
        try:
            words = Vocabulary.load(vocab_file).itos
        except (OSError, ValueError) as e:
            raise PretrainedError(f"{vocab_file} is not a word list ({e})") from None
        if words != model.vocab.itos:
            raise PretrainedError(
                f"{vocab_file} is not the vocabulary of {weights}: put back the {VOCAB_NAME} "
                "that save_pretrained wrote, or delete it (the model file holds its own)"
            )
    return model, decoding, (weights,)


def save_folder(
    model: CaptionModel,
    decoding: DecodingConfig,
    folder: str | Path,
    info: dict | None = None,
    half: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as config.json + model.safetensors + vocab.json in ``folder`` (made if
    need be). Files of those names are replaced only with ``overwrite``; other files in the
    folder (a README model card, .gitattributes) are left as they are."""
    if isinstance(model, EnsembleModel):
        raise UsageError(
            "an ensemble cannot be saved as one model folder: save each member's Captioner"
        )
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} is a file: give a folder to save the model in")
    existing = [name for name in HUB_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise UsageError(
            f"{folder} already holds {', '.join(existing)}: pass overwrite=True to replace "
            "them, or give another folder"
        )
    save_model(model, folder / WEIGHTS_NAME, decoding, half=half, info=info)
    config = {
        "format": FORMAT,
        "library_name": LIBRARY_NAME,
        "encoder": asdict(model.encoder.config) | {"weights": None, "fine_tune_stages": 0},
        "decoder": asdict(model.decoder.config),
        "decoding": decoding.to_dict(),
        "vocab_size": len(model.vocab),
        "consensus_photos": 0 if model.consensus is None else len(model.consensus.references),
    }
    _write_text(folder / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    _write_text(folder / VOCAB_NAME, model.vocab.to_json())
    return folder


def _write_text(path: Path, text: str) -> None:
    """Atomically, as save_model writes the weights: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def looks_like_repo_id(name: str) -> bool:
    """ORG/NAME (or NAME) that is no path on disk: what to ask huggingface_hub for."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))


def download(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Path:
    """The folder of ``repo_id``'s model files at ``revision``: from huggingface_hub's cache
    (``models--ORG--NAME/snapshots/REV/``), downloading what is missing unless offline
    (``HF_HUB_OFFLINE=1`` or ``local_files_only``)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise PretrainedError(
            f"{repo_id} is no folder and no model name here, and loading from the Hugging Face "
            "Hub needs huggingface_hub (installed with gradio): pip install huggingface_hub"
        ) from None
    # read here, not only at huggingface_hub's import: it may have been imported before the
    # variable was set (gradio imports it)
    offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=offline,
                token=token,
                allow_patterns=list(HUB_FILES),
                library_name=LIBRARY_NAME,
            )
        )
    except HFValidationError as e:
        raise PretrainedError(f"{repo_id} is not a model name, folder or hub name: {e}") from None
    except Exception as e:  # huggingface_hub's errors: not found, offline, no access, network
        where = "in the local hub cache" if offline else "on the Hugging Face Hub"
        raise PretrainedError(
            f"{repo_id}: no model {where} ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "give a model folder, a model name (`sat models`) or ORG/NAME of a hub model"
        ) from None


def locate(
    name_or_folder: str | Path,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> tuple[str | Path, str | None]:
    """What ``load_model`` loads for ``Captioner.from_pretrained(name_or_folder)``, and the
    model's name where it is not the folder's (None): a model folder, a model file or name
    (`sat models`) as they are; a Hugging Face Hub name ORG/NAME as its folder in
    huggingface_hub's cache (``download``)."""
    spec = str(name_or_folder)
    if Path(spec).exists() or spec.removesuffix(".safetensors") in named_models():
        return spec, None
    if not looks_like_repo_id(spec):
        raise PretrainedError(f"{spec}: no such folder or file; {WHAT_A_FOLDER_HOLDS}")
    return download(spec, revision, cache_dir, local_files_only, token), spec.rsplit("/", 1)[-1]
