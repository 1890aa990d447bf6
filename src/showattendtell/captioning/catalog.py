"""The models a user can name (`sat models` lists them: commands/models.py).

``--model`` (every command that reads a model) and ``load_model()`` accept a path to a model file,
or the name of a bundled model (its file stem, e.g. ``flickr8k_lite2_hard``) or of the file
``$SAT_MODEL`` points to, or a model folder (a ``config.json`` beside the model: the layout of
``Captioner.save_pretrained``, or an ONNX export). After ``pip install`` the bundled files live
in site-packages, so a name, not a path, is the interface. An existing path wins over a name.
``A+B`` names an ensemble of models A and B (ensemble.py).

The top of this module stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import os
from pathlib import Path

from showattendtell.errors import UsageError

BUNDLED_DIR = Path(__file__).parents[1] / "bundled"  # shipped in the package root
DEFAULT_MODEL_ENV = "SAT_MODEL"
DEFAULT_BUNDLED = "flickr8k_lite2_soft.safetensors"
MODEL_SUFFIX = ".safetensors"
FOLDER_CONFIG = "config.json"  # what makes a folder a model (pretrained.CONFIG_NAME)
# what to do about a $SAT_MODEL that names no model file
POINT_IT = "point it at a model file, give a bundled model's name, or unset it"


class ModelNotFound(UsageError, ValueError):
    """--model names no file and no known model; the message lists the names there are."""


def bundled_models() -> list[Path]:
    """Model files installed with the package, the default first."""
    found = sorted(BUNDLED_DIR.glob(f"*{MODEL_SUFFIX}"))
    return sorted(found, key=lambda p: p.name != DEFAULT_BUNDLED)


def env_model() -> Path | None:
    """$SAT_MODEL's file: a path, or a bundled model's name (as --model takes)."""
    value = os.environ.get(DEFAULT_MODEL_ENV)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        bundled = {p.stem: p for p in bundled_models()}
        path = bundled.get(value.removesuffix(MODEL_SUFFIX), path)
    return path


def default_model_path() -> Path:
    """$SAT_MODEL, else the bundled default model."""
    env = env_model()
    if env is not None:
        if env.is_dir():
            raise ModelNotFound(f"${DEFAULT_MODEL_ENV} is {env}, a folder: {POINT_IT}")
        if not env.is_file():
            raise ModelNotFound(
                f"${DEFAULT_MODEL_ENV} is {env}: no such file, and no bundled model of that "
                f"name: {POINT_IT}"
            )
        _check_env_model(env)
        return env
    bundled = bundled_models()
    if bundled:
        return bundled[0]
    raise ModelNotFound(
        "no model given and no bundled model installed: pass --model "
        f"MODEL.safetensors (or set {DEFAULT_MODEL_ENV})"
    )


def _check_env_model(path: Path) -> None:
    """$SAT_MODEL's file is read as a model now, from its header (milliseconds; no weights):
    the model file's own error line names the file but not where it came from, and a user who
    typed no --model would look for the mistake in the command line."""
    from showattendtell.model_file import GIVE_A_MODEL, ModelFileError, describe_model

    try:
        describe_model(path)
    except ModelFileError as e:
        message = str(e).removesuffix(f": {GIVE_A_MODEL}")
        point = f": {POINT_IT}" if message != str(e) else ""
        raise type(e)(f"${DEFAULT_MODEL_ENV}: {message}{point}") from None


def named_models() -> dict[str, Path]:
    """Name -> file of every model that can be named: $SAT_MODEL's first, then the bundled."""
    named: dict[str, Path] = {}
    env = env_model()
    if env is not None and env.is_file():
        named[env.stem] = env
    for p in bundled_models():
        named.setdefault(p.stem, p)
    return named


def resolve_model(spec: str | Path | None, option: str = "--model") -> Path:
    """The model file that ``spec`` means: None -> the default; a file path; or a model name.
    ``option``: the command-line option ``spec`` came from, as the error lines name it."""
    if spec is None or str(spec) == "":
        return default_model_path()
    path = Path(spec)
    if path.is_dir():
        if (path / FOLDER_CONFIG).is_file():  # a model folder (pretrained.py, onnx_model.py)
            return path
        raise ModelNotFound(
            f"{option} {spec} is a folder: give a model file (.safetensors), a model folder "
            f"with a {FOLDER_CONFIG} (Captioner.save_pretrained, `sat export MODEL OUT --format "
            "onnx`) or the name of a model (`sat models` lists them)"
        )
    if path.is_file():
        return path
    name = str(spec).removesuffix(MODEL_SUFFIX)
    named = named_models()
    if name in named:
        return named[name]
    known = ", ".join(named) or "none installed"
    raise ModelNotFound(
        f"{option} {spec}: no such file, and no model of that name (models: "
        f"{known}; `sat models` lists them)"
    )


ENSEMBLE_SEPARATOR = "+"


def resolve_models(spec: str | Path | None) -> list[Path]:
    """The model files ``spec`` means: one, or several for an ensemble ``A+B`` (an existing file
    whose name holds a "+" is that file)."""
    text = "" if spec is None else str(spec)
    if ENSEMBLE_SEPARATOR not in text or Path(text).is_file():
        return [resolve_model(spec)]
    parts = text.split(ENSEMBLE_SEPARATOR)
    if any(not p.strip() for p in parts):
        raise ModelNotFound(
            f"--model {spec}: an ensemble is MODEL+MODEL[+...], each a model file or name"
        )
    return [resolve_model(p.strip()) for p in parts]
