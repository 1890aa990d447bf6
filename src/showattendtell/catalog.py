"""The models a user can name, and `sat models`, which lists them.

``--model`` (every command that reads a model) and ``load_model()`` accept a path to a model file,
or the name of a bundled model (its file stem, e.g. ``flickr8k_lite2_hard``) or of the file
``$SAT_MODEL`` points to. After ``pip install`` the bundled files live in site-packages, so a
name, not a path, is the interface. An existing path wins over a name.

The top of this module stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from showattendtell.errors import UsageError

BUNDLED_DIR = Path(__file__).parent / "bundled"
DEFAULT_MODEL_ENV = "SAT_MODEL"
DEFAULT_BUNDLED = "flickr8k_lite2_soft.safetensors"
MODEL_SUFFIX = ".safetensors"


class ModelNotFound(UsageError, ValueError):
    """--model names no file and no known model; the message lists the names there are."""


def bundled_models() -> list[Path]:
    """Model files installed with the package, the default first."""
    found = sorted(BUNDLED_DIR.glob(f"*{MODEL_SUFFIX}"))
    return sorted(found, key=lambda p: p.name != DEFAULT_BUNDLED)


def env_model() -> Path | None:
    value = os.environ.get(DEFAULT_MODEL_ENV)
    return Path(value) if value else None


def default_model_path() -> Path:
    """$SAT_MODEL, else the bundled default model."""
    env = env_model()
    if env is not None:
        if not env.is_file():
            raise ModelNotFound(f"${DEFAULT_MODEL_ENV} is {env}, which is not a file: point it "
                                "at a model file or unset it")
        return env
    bundled = bundled_models()
    if bundled:
        return bundled[0]
    raise ModelNotFound("no model given and no bundled model installed: pass --model "
                        f"MODEL.safetensors (or set {DEFAULT_MODEL_ENV})")


def named_models() -> dict[str, Path]:
    """Name -> file of every model that can be named: $SAT_MODEL's first, then the bundled."""
    named: dict[str, Path] = {}
    env = env_model()
    if env is not None and env.is_file():
        named[env.stem] = env
    for p in bundled_models():
        named.setdefault(p.stem, p)
    return named


def resolve_model(spec: str | Path | None) -> Path:
    """The model file that ``spec`` means: None -> the default; a file path; or a model name."""
    if spec is None or str(spec) == "":
        return default_model_path()
    path = Path(spec)
    if path.is_dir():
        raise ModelNotFound(f"--model {spec} is a folder: give a model file (.safetensors) or "
                            "the name of a model (`sat models` lists them)")
    if path.is_file():
        return path
    name = str(spec).removesuffix(MODEL_SUFFIX)
    named = named_models()
    if name in named:
        return named[name]
    known = ", ".join(named) or "none installed"
    raise ModelNotFound(f"--model {spec}: no such file, and no model of that name (models: "
                        f"{known}; `sat models` lists them)")


# --------------------------------------------------------------------------- `sat models`


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the models --model can name (bundled, $SAT_MODEL)",
                       description="List the bundled models and the one $SAT_MODEL points to, "
                                   "with attention type, encoder, grid, vocabulary size and "
                                   "stored decoding settings. Any of these names works as "
                                   "--model NAME.")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from showattendtell.model_file import describe_model

    default = None
    try:
        default = default_model_path()
    except ModelNotFound as e:
        print(f"warning: {e}", file=sys.stderr)
    rows = []
    for name, path in named_models().items():
        d = describe_model(path)
        d = {"name": name, "default": path == default, **d, "path": str(path)}
        rows.append(d)
    if args.json:
        for d in rows:
            print(json.dumps(d))
        return 0
    if not rows:
        print("no models installed; pass --model FILE or set $SAT_MODEL", file=sys.stderr)
        return 1
    table = [("name", "attention", "encoder", "grid", "vocabulary", "stored decoding", "path")]
    for d in rows:
        dec = d["decoding"]
        decoding = (f"beam {dec['beam_size']}, max {dec['max_length']} words"
                    + (f", hard mode {dec['hard_mode']}" if d["attention"] == "hard" else "")
                    + (f", length penalty {dec['length_penalty']:g}"
                       if dec["length_penalty"] else "")
                    + (f", no repeated {dec['no_repeat_ngram']}-grams"
                       if dec["no_repeat_ngram"] else ""))
        g = d["grid"]
        table.append((d["name"] + (" (default)" if d["default"] else ""), d["attention"],
                      f"{d['encoder']} {d['input_size']} px", f"{g}x{g}x{d['feature_dim']}",
                      f"{d['vocab_size']} words", decoding, d["path"]))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0
