"""What `sat train` checks before any work: each bad setting one error line (exit 2) instead
of a traceback from deep in Lightning or torch, seconds or hours later; and the run folder's
checkpoints, which a new run must not mix with and a resume names.

The top of this module stays import-light (no torch, no Lightning): scripts import it too.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from showattendtell.data.datasets import (
    check_split_name,
    check_split_ratio_taken,
    folder_hint,
    list_datasets,
)
from showattendtell.data.own_captions import check_split_ratio
from showattendtell.errors import UsageError
from showattendtell.evaluation.metrics import VALIDATION_SCORES
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER, TokenizerError, get_tokenizer


def check_config_files(args: list[str]) -> None:
    """A missing --config is one line, not jsonargparse's 60 lines of usage before it."""
    for i, arg in enumerate(args):
        value = None
        if arg == "--config" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        if value is None or Path(value).is_file():
            continue
        what = "is a folder, not a config file" if Path(value).is_dir() else "no such file"
        raise UsageError(
            f"--config {value}: {what} (the configs are in "
            "configs/, e.g. configs/flickr8k_lite2_soft.yaml)"
        )


def check_before_imports(args: list[str]) -> None:
    """What `sat train` / `sat features` can check from the command line and its config files
    alone, before Lightning and torch are imported (seconds): the config files are there, and
    the dataset folder typed (--data.root) is a folder. The same checks
    run again once LightningCLI has parsed everything; these only answer sooner."""
    from showattendtell.training.config_files import expand_bases

    if any(
        a in ("-h", "--help", "--print_config") or a.startswith("--print_config=") for a in args
    ):
        return
    check_config_files(args)
    data: dict = {}
    typed_root = None
    for option, value in _options(expand_bases(args)):
        if option == "--config":
            data.update(_yaml_data(Path(value)))
        elif option in ("--data.root", "--data.dataset"):
            data[option.split(".", 1)[1]] = value
            typed_root = value if option == "--data.root" else typed_root
    # only a root typed on the command line (a config's is checked after the full parse, which
    # says first what else is wrong with the command)
    if typed_root:
        check_dataset_root("--data.root", typed_root, data.get("dataset") or "flickr8k")


def _options(args: list[str]) -> list[tuple[str, str]]:
    """(option, value) of ``--option value`` and ``--option=value``, in order."""
    found = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            found.append(tuple(arg.split("=", 1)))
        elif i + 1 < len(args):
            found.append((arg, args[i + 1]))
    return found


def _yaml_data(path: Path) -> dict:
    """The ``data:`` section of a config file ({} where it has none or cannot be read: the
    full parse says why)."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    data = config.get("data") if isinstance(config, dict) else None
    return (
        {k: v for k, v in data.items() if k in ("root", "dataset")}
        if isinstance(data, dict)
        else {}
    )


# Data settings that torch would refuse only once training starts (DataLoader's batch size),
# or that would fail there with a misleading message, checked before anything is built.
_POSITIVE_DATA_SETTINGS = ("batch_size", "val_batch_size", "extract_batch_size")
_NON_NEGATIVE_DATA_SETTINGS = ("num_workers", "extract_workers")


def check_data_settings(data) -> None:
    """The data settings checked before the model and the data are built (``data``: the parsed
    ``data`` section)."""
    for name in _POSITIVE_DATA_SETTINGS:
        value = data.get(name)
        if value is not None and value < 1:
            raise UsageError(f"--data.{name} {value}: must be 1 or more")
    for name in _NON_NEGATIVE_DATA_SETTINGS:
        value = data.get(name)
        if value is not None and value < 0:
            raise UsageError(f"--data.{name} {value}: must be 0 (no extra processes) or more")
    try:
        get_tokenizer(data.get("tokenizer") or DEFAULT_TOKENIZER)
    except TokenizerError as e:
        raise TokenizerError(f"--data.tokenizer: {e}") from None
    if data.get("split_ratio") is not None and data.get("dataset") in list_datasets():
        check_split_ratio_taken(data["dataset"])
        check_split_ratio(data["split_ratio"])
    root = data.get("root")
    if root:
        check_dataset_root("--data.root", root, data.get("dataset"))
        check_split_names(data)


def check_split_names(data) -> None:
    """--data.train_split and --data.val_split name splits of the dataset in --data.root, said
    before any work: load_split would refuse a bogus one only once the data is read, after the
    model is built. The names are the ones `sat evaluate --split` takes (check_split_name):
    Flickr8k's, Karpathy's, or COCO's official train and val without dataset_coco.json. An
    unknown --data.dataset is left to the reader."""
    dataset = data.get("dataset")
    if dataset not in list_datasets():
        return

    for option in ("train_split", "val_split"):
        split = data.get(option)
        if split is not None:
            check_split_name(f"--data.{option}", dataset, data["root"], split)


def check_dataset_root(option: str, root: str | Path, dataset: str | None) -> None:
    """A dataset folder (``option``: --data.root, --root, --consensus-root) that is not there or
    is a file is a mistyped command, said before any work: the dataset readers would refuse it
    only after a model is built or a checkpoint read, as a failure (exit status 1). The line
    says what the folder of ``dataset`` holds, and for COCO how to download it."""
    path = Path(root)
    if path.is_dir():
        return
    what = "is a file, not a folder" if path.exists() else "no such folder"
    target = "DIR" if path.exists() else shlex.quote(str(root))
    raise UsageError(f"{option} {root}: {what}: give {folder_hint(dataset, target)}")


# the validation scores CaptionModule logs (higher is better: the callbacks' mode is max)
MONITORS = tuple(f"val/{key}" for key in VALIDATION_SCORES)


def check_run_settings(run) -> None:
    """``run`` settings that Lightning's callbacks would refuse only at the first validation
    (a score not logged) or in a traceback (a negative count)."""
    if run.monitor not in MONITORS:
        raise UsageError(f"--run.monitor {run.monitor}: choose one of {', '.join(MONITORS)}")
    for name in ("patience", "save_every_n_steps"):
        value = run.get(name)
        if value is not None and value < 0:
            raise UsageError(f"--run.{name} {value}: must be 0 or more (or null)")
    threads = run.get("threads")
    if threads is not None and threads < 1:
        raise UsageError(f"--run.threads {threads}: must be 1 or more (or null: chosen)")


def named_checkpoint(ckpt_path: str, run_dir: Path) -> Path | None:
    """The file Lightning resumes from for ``--ckpt_path last`` or ``hpc`` (its names, no such
    files): the newest last*.ckpt of the run's checkpoints, or the highest hpc_ckpt_N.ckpt of
    the run folder (a SLURM requeue's); None when there is none (``last``: Lightning then
    starts afresh, as a requeue script that always passes it expects)."""
    if ckpt_path == "last":
        found = [
            p
            for p in (run_dir / "checkpoints").glob("last*.ckpt")
            if re.fullmatch(r"last(-v\d+)?\.ckpt", p.name)
        ]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None
    numbered = [
        (int(m.group(1)), p)
        for p in run_dir.glob("hpc_ckpt_*.ckpt")
        if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name))
    ]
    return max(numbered)[1] if numbered else None


def check_resume_checkpoint(ckpt_path: str | None, run_dir: Path) -> Path | None:
    """``--ckpt_path`` names a checkpoint of sat train, said in one line before any work; the
    file it names is returned (for ``last`` and ``hpc``, Lightning's names, the one Lightning
    will read: named_checkpoint), None for none. Read as `sat export` reads one: never running
    code the file names (read_checkpoint); Lightning's own reading goes the same way
    (training.checkpoint_io), whatever the name or the environment."""
    if ckpt_path is None:
        return None
    path = Path(ckpt_path)
    if ckpt_path in ("last", "hpc"):  # Lightning's names, even where such a file is
        found = named_checkpoint(ckpt_path, run_dir)
        if found is None and ckpt_path == "hpc":
            raise UsageError(
                f"--ckpt_path hpc: {run_dir} holds no hpc_ckpt_N.ckpt (a SLURM requeue's): "
                "give the checkpoint to resume from (e.g. last)"
            )
        if found is None:
            return None
        path = found
    from showattendtell.model_file import ModelFileError
    from showattendtell.training.lit_module import read_checkpoint

    try:
        read_checkpoint(path, "--ckpt_path", mmap=True)
    except ModelFileError as e:
        raise UsageError(str(e)) from None
    return path


def check_new_run(run_dir: Path, command_line: list[str] | None) -> None:
    """A new run (no ``--ckpt_path``) in a folder that holds another run's checkpoints is
    refused. Lightning would write its checkpoints beside them as last-v1.ckpt and
    best-...-v1.ckpt, so that last.ckpt, the one a resume names, stays the old run's; and the
    new run's Ctrl-C would replace the old run's interrupted.ckpt, and its end remove it."""
    newest = resumable_checkpoint(run_dir)
    if newest is None or any(run_dir.glob("hpc_ckpt_*.ckpt")):  # SLURM requeue: Lightning resumes
        return
    resume = (
        resume_command(command_line, newest)
        if command_line is not None
        else f"sat train ... --ckpt_path {shlex.quote(str(newest))}"
    )
    raise UsageError(
        f"--run.dir {run_dir} already holds the checkpoints of a run: continue it with "
        f"`{resume}` (past its end: raise --trainer.max_epochs), or give another --run.dir "
        "for a new run"
    )


def resumable_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint that continues the run in ``run_dir`` (last, steps or interrupted): the
    newest that is not a best-*, which is kept for its score, not its recency; None when the
    run has none."""
    found = list((run_dir / "checkpoints").glob("*.ckpt"))
    if not found:
        return None
    return max(found, key=lambda p: (not p.name.startswith("best-"), p.stat().st_mtime))


# how a wrong value's expected type is said; a type not here keeps jsonargparse's message
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false"}


def short_type_error(message: str) -> str | None:
    """jsonargparse's 8-line account of a value of the wrong type (``--trainer.max_epochs
    two``: the union's subtypes, each one's complaint, the value's Python type) as
    '--trainer.max_epochs two: expected a whole number'; None for any other message."""
    keys = re.findall(r'Parser key "([^"]+)":', message)
    kinds = [k for k in re.findall(r"Expected a <class '(\w+)'>", message) if k != "NoneType"]
    got = re.search(r"Got value: (.*)", message) or re.search(r"Given value: (.*)", message)
    if not keys or not kinds or got is None or any(k not in _TYPE_WORDS for k in kinds):
        return None
    expected = " or ".join(dict.fromkeys(_TYPE_WORDS[k] for k in kinds))
    return f"--{'.'.join(keys)} {got.group(1).strip()}: expected {expected}"


def resume_command(args: list[str], checkpoint: Path) -> str:
    """The `sat train` command line that continues from ``checkpoint``."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["sat", "train", *kept, "--ckpt_path", str(checkpoint)])
