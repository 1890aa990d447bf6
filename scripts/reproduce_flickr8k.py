"""Reproduce the bundled models and their Flickr8k table: features, training, export, evaluation.

    python scripts/reproduce_flickr8k.py                       # everything, from scratch
    python scripts/reproduce_flickr8k.py --skip-train \\
        --models src/showattendtell/bundled/*.safetensors      # only score given model files
    python scripts/reproduce_flickr8k.py --dry-run             # print the training commands

Each step is a plain `sat` command (printed before it runs), so any of them can be re-run by
hand. Training resumes from a run folder's newest checkpoint when it has one; the feature cache is
reused when it exists. Scores are the official COCO caption toolkit's (`sat evaluate`, needs
Java); the table goes to stdout and to runs/flickr8k_table.md, the raw scores to
runs/flickr8k_table.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from showattendtell.cli.train_checks import resumable_checkpoint

# The bundled models' recipe, one stage per training config: (config, the model file its run is
# exported to, which checkpoint, export options). Each stage's config starts from the model file
# of the stage before it (model.init_from). The fine-tuning stages are exported as WiSE-FT
# interpolations with the model they started from (`sat export --interpolate`; the model card
# gives the measured alphas). Every export stores beam 3 as the default decoding unless its
# options name another --beam-size; the hard model captions from its own single
# most likely location per word (`--hard-mode argmax`) and is scored that way and with the
# expected context (see inference_modes). The bundled models also carry a consensus index of
# the training split (`--consensus-root`, "{root}" is this script's --root) and decode at beam 5
# with `--rerank consensus` (consensus.py; the model card has the measurements).
CONSENSUS = ["--consensus-root", "{root}", "--rerank", "consensus", "--beam-size", "5"]
STAGES = (
    # soft attention, maximum likelihood, 9 epochs: the best epoch by dev CIDEr
    ("configs/flickr8k_lite2_soft.yaml", "flickr8k_lite2_soft_mle", "best", []),
    # soft attention, self-critical (CIDEr-D + 5 METEOR), 188 steps; decoded without repeating
    # a word bigram (the model card: better on every dev metric, and no "on a bike on a bike")
    (
        "configs/flickr8k_lite2_soft_scst.yaml",
        "flickr8k_lite2_soft",
        "last",
        [
            "--interpolate",
            "models/flickr8k_lite2_soft_mle.safetensors",
            "--alpha",
            "0.4",
            "--no-repeat-ngram",
            "2",
            *CONSENSUS,
        ],
    ),
    # hard attention from its own sampled locations only (4 per caption, each against the mean
    # of the other 3), one epoch from the soft model, best dev CIDEr decoded with the argmax
    # location; decoded that way, without repeating a word bigram
    (
        "configs/flickr8k_lite2_hard_single.yaml",
        "flickr8k_lite2_hard",
        "best",
        ["--hard-mode", "argmax", "--no-repeat-ngram", "2", *CONSENSUS],
    ),
)
SCORED = ("flickr8k_lite2_soft", "flickr8k_lite2_hard")  # the models of the table
BEAMS = (1, 3, 5)
METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
# Xu et al. 2015, Table 1, Flickr8k test split
PAPER = {
    "paper, soft": {
        "Bleu_1": 67.0,
        "Bleu_2": 44.8,
        "Bleu_3": 29.9,
        "Bleu_4": 19.5,
        "METEOR": 18.93,
    },
    "paper, hard": {
        "Bleu_1": 67.0,
        "Bleu_2": 45.7,
        "Bleu_3": 31.4,
        "Bleu_4": 21.3,
        "METEOR": 20.30,
    },
}


DRY_RUN = False


def sat(*args: str) -> str:
    """Run `sat ARGS`, streaming its stderr; return its stdout. Stops the script on failure."""
    cmd = [sys.executable, "-m", "showattendtell.cli", *args]
    print("+ sat " + " ".join(args), file=sys.stderr, flush=True)
    if DRY_RUN:
        return ""
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"step failed (exit {done.returncode}): sat {' '.join(args)}")
    return done.stdout


def train_and_export(
    config: str, name: str, which: str, export: list[str], extra: list[str], root: str
) -> Path:
    """Features (cached), training (resumed if interrupted), export of the ``which`` checkpoint
    (best by dev CIDEr, or last) to models/NAME.safetensors."""
    run_dir = Path(yaml.safe_load(Path(config).read_text())["run"]["dir"])
    extra = ["--data.root", root, *extra]
    sat("features", "--config", config, *extra)
    resume = resumable_checkpoint(run_dir)  # an interrupted run's newest checkpoint
    sat("train", "--config", config, *extra, *(["--ckpt_path", str(resume)] if resume else []))
    last = run_dir / "checkpoints" / "last.ckpt"
    ckpts = sorted((run_dir / "checkpoints").glob("best-*.ckpt")) if which == "best" else [last]
    if not DRY_RUN and not (ckpts and ckpts[-1].exists()):
        sys.exit(f"no {which} checkpoint in {run_dir / 'checkpoints'}: did training run?")
    ckpt = ckpts[-1] if ckpts else run_dir / "checkpoints" / f"{which}-*.ckpt"
    model = Path("models") / f"{name}.safetensors"
    sat(
        "export",
        str(ckpt),
        str(model),
        "--overwrite",
        "--half",
        *([] if "--beam-size" in export else ["--beam-size", "3"]),
        *(a.replace("{root}", root) for a in export),
    )
    return model


def inference_modes(model: Path) -> list[str]:
    """How a model is scored: soft attention one way; hard attention with the most likely
    location (its own single location per word: `--hard-mode argmax`, the mode the bundled
    hard model stores and the web UI starts in) and with the expected context (`--hard-mode
    expectation`), the default of the authors' released sampler (arctic-captions
    generate_caps.py, sampling=False: alpha_sample = alpha), i.e. how the paper's hard-attention
    captions were most likely generated."""
    from showattendtell.model_file import read_model

    attention = read_model(model)[0].decoder.config.attention
    return ["argmax", "expectation"] if attention == "hard" else [""]


def evaluate(
    model: Path, dataset: str, root: str, split: str, beam: int, hard_mode: str = ""
) -> dict[str, float]:
    tag = f"-{hard_mode}" if hard_mode else ""
    out = Path("runs") / "eval" / f"{model.stem}-{dataset}-{split}-beam{beam}{tag}.json"
    mode = ["--hard-mode", hard_mode] if hard_mode else []
    stdout = sat(
        "evaluate",
        "--model",
        str(model),
        "--dataset",
        dataset,
        "--root",
        root,
        "--split",
        split,
        "--beam-size",
        str(beam),
        "--no-spice",
        "--output",
        str(out),
        "--overwrite",
        *mode,
    )
    scores = stdout.strip().splitlines()[-1]
    print(scores, file=sys.stderr, flush=True)  # progress, in the log
    return json.loads(scores)


def row_name(model: Path, beam: int, hard_mode: str) -> str:
    mode = {"argmax": ", argmax location", "expectation": ", expected context"}.get(hard_mode, "")
    return f"{model.stem}{mode}, beam {beam}"


def table(rows: dict[str, dict[str, float]], columns: tuple[str, ...]) -> str:
    head = (
        "| model | "
        + " | ".join(c.replace("_", "-").replace("Bleu", "BLEU") for c in columns)
        + " |"
    )
    lines = [head, "|" + " --- |" * (len(columns) + 1)]
    for name, scores in rows.items():
        cells = [
            f"{scores[c]:.{2 if c == 'METEOR' else 1}f}" if c in scores else "" for c in columns
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", nargs="+", default=None, help="with --skip-train: the model files to score"
    )
    p.add_argument("--skip-train", action="store_true", help="score --models only")
    p.add_argument("--root", default="data/flickr8k", help="Flickr8k folder (data/README.md)")
    p.add_argument(
        "--split", default="dev", help="Flickr8k split to score (dev; test if you have its images)"
    )
    p.add_argument(
        "--coco-root",
        default="",
        help="a COCO folder (official 2017 layout, val split) for an out-of-domain "
        "check (default: none)",
    )
    p.add_argument("--beams", type=int, nargs="+", default=list(BEAMS))
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the sat commands of the training stages without running them",
    )
    p.add_argument("train_args", nargs="*", help="extra `sat train` overrides, after --")
    args = p.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run

    if args.skip_train:
        if not args.models:
            p.error("--skip-train needs --models")
        models = [Path(m) for m in args.models]
    else:
        trained = [train_and_export(*stage, args.train_args, args.root) for stage in STAGES]
        if DRY_RUN:
            return
        models = [m for m in trained if m.stem in SCORED]

    modes = {model: inference_modes(model) for model in models}
    scores: dict[str, dict[str, float]] = {}
    rows: dict[str, dict[str, float]] = {}
    for model in models:
        for mode in modes[model]:
            for beam in args.beams:
                s = evaluate(model, "flickr8k", args.root, args.split, beam, mode)
                scores[row_name(model, beam, mode)] = s
                rows[row_name(model, beam, mode)] = {k: 100 * v for k, v in s.items()}
    rows.update(PAPER)
    text = f"Flickr8k {args.split}\n\n" + table(rows, METRICS)

    if args.coco_root:
        coco_rows = {}
        for model in models:
            for mode in modes[model]:
                best_beam = 5 if 5 in args.beams else args.beams[-1]  # the models' default
                s = evaluate(model, "coco", args.coco_root, "val", best_beam, mode)
                scores[f"COCO subset: {row_name(model, best_beam, mode)}"] = s
                coco_rows[row_name(model, best_beam, mode)] = {k: 100 * v for k, v in s.items()}
        text += "\n\nCOCO val2017 subset (out of domain)\n\n" + table(coco_rows, METRICS)

    Path("runs").mkdir(exist_ok=True)
    Path("runs/flickr8k_table.json").write_text(json.dumps(scores, indent=1))
    Path("runs/flickr8k_table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
