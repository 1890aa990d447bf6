"""Training configs as a base plus overlays: a config may name the config it builds on.

A YAML file under ``configs/`` holds only what differs from its base, named by a top-level
``_base_:`` key (a path relative to the file)::

    _base_: flickr8k_lite2_soft.yaml
    run: {dir: runs/flickr8k_lite2_soft_scst}
    model: {self_critical: 5}

``sat train --config OVERLAY`` then means ``--config BASE --config OVERLAY``: jsonargparse merges
several ``--config`` files in order, key by key (a nested ``model.decoder.attention`` replaces
that one value, not the whole ``decoder``), which is why bases are expanded here into separate
``--config`` arguments rather than included inside the file (jsonargparse's own ``config:`` key
in a file replaces whole dataclass sections). Bases may have bases of their own.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from showattendtell.errors import UsageError

BASE_KEY = "_base_"
MAX_DEPTH = 8  # a chain longer than this is a loop


def config_chain(path: Path) -> list[Path]:
    """The files ``--config path`` stands for, base first, ``path`` last."""
    chain: list[Path] = [path]
    while True:
        base = read_base(chain[0])
        if base is None:
            return chain
        if base.resolve() in {p.resolve() for p in chain} or len(chain) > MAX_DEPTH:
            raise UsageError(f"--config {path}: its {BASE_KEY} chain loops back to {base}")
        chain.insert(0, base)


def read_base(path: Path) -> Path | None:
    """The base ``path`` names (relative to ``path``'s folder), or None."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get(BASE_KEY) is None:
        return None
    name = data[BASE_KEY]
    if not isinstance(name, str):
        raise UsageError(f"--config {path}: {BASE_KEY} must be the path of a config file")
    base = path.parent / name
    if not base.is_file():
        raise UsageError(f"--config {path}: its {BASE_KEY} {name} is not a file ({base})")
    return base


def expand_bases(args: list[str]) -> list[str]:
    """``args`` with every ``--config FILE`` preceded by ``--config`` of each of its bases.

    Arguments that are not an existing config file (a missing one, a YAML string) are left as
    they are, for the caller's own checks."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        value = None
        if arg == "--config" and i + 1 < len(args):
            value, i = args[i + 1], i + 2
        elif arg.startswith("--config="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        try:
            is_file = Path(value).is_file()
        except OSError:  # a YAML string too long to be a file name
            is_file = False
        chain = config_chain(Path(value)) if is_file else [value]
        for item in chain[:-1]:
            out += ["--config", str(item)]
        out += ["--config", value]
    return out
