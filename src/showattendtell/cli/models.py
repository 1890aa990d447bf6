"""`sat models`: the models --model NAME can name, with what each is and decodes by default."""

from __future__ import annotations

import argparse
import json
import sys

from showattendtell.captioning.catalog import (
    ModelNotFound,
    default_model_path,
    env_model,
    named_models,
)
from showattendtell.search.options import DECODING_OPTIONS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "models",
        help="list the models --model can name (bundled, $SAT_MODEL)",
        description="List the bundled models and the one $SAT_MODEL points to, "
        "with attention type, encoder, grid, vocabulary size and "
        "stored decoding settings. Any of these names works as "
        "--model NAME.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The table (or JSON lines). A $SAT_MODEL that names no model file, missing or not a
    model, is a warning here and left out: the list is what a user reads to mend it."""
    from showattendtell.model_file import ModelFileError, describe_model

    default = None
    try:
        default = default_model_path()
    except (ModelNotFound, ModelFileError) as e:
        print(f"warning: {e}", file=sys.stderr)
    rows = []
    for name, path in named_models().items():
        try:
            d = describe_model(path)
        except ModelFileError:
            if path == env_model():  # warned about above
                continue
            raise
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
        decoding = stored_decoding(d) + (
            f"; consensus index of {d['consensus_photos']} photos" if d["consensus_photos"] else ""
        )
        g = d["grid"]
        table.append(
            (
                d["name"] + (" (default)" if d["default"] else ""),
                d["attention"],
                f"{d['encoder']} {d['input_size']} px",
                f"{g}x{g}x{d['feature_dim']}",
                f"{d['vocab_size']} words",
                decoding,
                d["path"],
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def stored_decoding(described: dict) -> str:
    """A model's stored decoding, every option of the table by its label, in the table's order
    (so a new option shows here without a line of its own); an option the model does not use is
    left out (the hard-attention mode of a soft model, reranking without a consensus index)."""
    uses = {"": True, "hard": described["attention"] == "hard"}
    uses["consensus"] = bool(described["consensus_photos"])
    stored = described["decoding"]
    return ", ".join(
        f"{opt.label} {stored[name]:g}"
        if isinstance(stored[name], float)
        else f"{opt.label} {stored[name]}"
        for name, opt in DECODING_OPTIONS.items()
        if name in stored and uses.get(opt.needs, True)
    )
