"""scripts/reproduce_flickr8k.py: its stages chain the configs the way the model card says."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def dry_run() -> list[list[str]]:
    """The sat commands the script runs (--dry-run), without its --overwrite (reruns)."""
    done = subprocess.run(
        [sys.executable, "scripts/reproduce_flickr8k.py", "--dry-run", "--root", "data/flickr8k"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [
        [w for w in shlex.split(line[2:]) if w != "--overwrite"]
        for line in done.stderr.splitlines()
        if line.startswith("+ sat")
    ]


def test_the_documented_recipe_is_what_the_script_runs():
    """The bundled models' recipe is written once, in docs/training.md, and it is the script's."""
    doc = (ROOT / "docs" / "training.md").read_text()
    block = re.search(r"## The bundled models' recipe\n\n```bash\n(.*?)```", doc, re.S)
    assert block, "docs/training.md: the recipe's section has moved"
    documented = [shlex.split(line) for line in block.group(1).replace("\\\n", " ").splitlines()]
    assert documented == dry_run()


def test_each_stage_starts_from_the_model_the_stage_before_exported():
    done = subprocess.run(
        [sys.executable, "scripts/reproduce_flickr8k.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    commands = [line[2:].split() for line in done.stderr.splitlines() if line.startswith("+ sat")]
    trains = [c[c.index("--config") + 1] for c in commands if c[1] == "train"]
    exports = [c for c in commands if c[1] == "export"]
    assert trains == [
        "configs/flickr8k_lite2_soft.yaml",
        "configs/flickr8k_lite2_soft_scst.yaml",
        "configs/flickr8k_lite2_hard_single.yaml",
    ]
    assert [e[3] for e in exports] == [
        "models/flickr8k_lite2_soft_mle.safetensors",
        "models/flickr8k_lite2_soft.safetensors",
        "models/flickr8k_lite2_hard.safetensors",
    ]
    previous = None
    for config, export in zip(trains, exports, strict=True):
        cfg = yaml.safe_load((ROOT / config).read_text())
        assert cfg["model"].get("init_from") == previous, config
        run_dir = cfg["run"]["dir"]
        assert export[2].startswith(f"{run_dir}/checkpoints/"), (config, export)
        if "scst" in config:  # self-critical: exported as an interpolation with its start
            assert export[export.index("--interpolate") + 1] == previous
        previous = export[3]
    # the hard model captions from its own single locations, never interpolated with the soft
    assert exports[-1][exports[-1].index("--hard-mode") + 1] == "argmax"
    assert "--interpolate" not in exports[-1]
    # the bundled models carry a consensus index of the training split and rerank with it
    for export in exports[1:]:
        assert export[export.index("--rerank") + 1] == "consensus"
        assert export[export.index("--consensus-root") + 1] == "data/flickr8k"
    # every training stage reads the data from the script's --root
    for c in commands:
        if c[1] in ("train", "features"):
            assert c[c.index("--data.root") + 1] == "data/flickr8k", c
