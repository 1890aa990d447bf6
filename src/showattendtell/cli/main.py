"""The `sat` command line: one module per subcommand in commands/ (serve: service/serve.py)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from showattendtell.cli import caption, data, evaluate, export, models
from showattendtell.cli.common import pause_gc
from showattendtell.errors import Terminated, UserError
from showattendtell.service import serve

# Modules that add subcommands with ``add_parser(sub)``; `sat train` and `sat features` hand
# their arguments to LightningCLI (commands/train.py) before argparse sees them.
COMMAND_MODULES = (caption, evaluate, data, export, models, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sat", description="Show, Attend and Tell captioning.")
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print the version (and torch's, for bug reports) and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "train",
        add_help=False,
        help="train a model: sat train --config configs/NAME.yaml "
        "[--trainer.max_epochs N ...] [--ckpt_path last.ckpt]",
    )
    sub.add_parser(
        "features",
        add_help=False,
        help="fill the encoder-feature cache of a training config: "
        "sat features --config configs/NAME.yaml",
    )
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def version_line() -> str:
    """'sat 0.2.0 (torch 2.5.1+cpu, Python 3.11.7)': what a bug report needs, read from the
    installed packages' metadata without importing torch (``--help`` stays fast)."""
    import platform
    from importlib import metadata

    from showattendtell import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return f"sat {__version__} (torch {torch}, Python {platform.python_version()})"


class StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is then, not as it was when the handler was
    made: a stream captured then (a test's, a notebook cell's) may be closed or elsewhere by the
    time a record comes."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        """StreamHandler sets it; sys.stderr is read at each record instead."""


@contextlib.contextmanager
def _log_to_stderr(train: bool) -> Iterator[None]:
    """INFO lines on stderr for one `sat` command, put back as they were when it returns, so
    that calls of main([...]) in one process (a notebook, the tests) never stack handlers.

    Only the project's own lines (dataset counts, feature-extraction progress, the service's
    address): a library's INFO lines are noise a user cannot act on (`INFO: HTTP Request` from
    httpx in `sat serve`), and LightningCLI configures Lightning's loggers itself, whose lines a
    handler on the root logger would print twice. Libraries' warnings still reach stderr
    (logging's last-resort handler). A logger that has handlers already (an application's
    logging setup, pytest's capture) is left as it is. ``train``: kept for the callers."""
    logger = logging.getLogger("showattendtell")
    if logger.handlers:
        yield
        return
    handler, level = StderrHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, except that an option the command does not know is refused with
    the command's usage (`sat caption: ...`), not the top-level one, which lists no options."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # `sat` itself, not a test or a script calling main([...])
    argv = sys.argv[1:] if argv is None else argv
    if program and argv[:1] == ["caption"]:
        pause_gc()  # until the model is ready (commands/caption.py)
    train = bool(argv) and argv[0] in ("train", "features")
    with _log_to_stderr(train):
        return _run(argv, train)


def _run(argv: list[str], train: bool) -> int:
    """The command of ``argv``; a UserError, a too-long file name or Ctrl-C as one line and
    an exit status (main's)."""
    try:
        # train and features hand their arguments to LightningCLI (YAML configs, dotted overrides)
        if train:
            from showattendtell.cli.train_checks import check_before_imports

            check_before_imports(argv[1:])  # a mistyped path answers before the imports
            from showattendtell.cli import train as train_command

            run = train_command.train if argv[0] == "train" else train_command.extract_features
            return run(argv[1:])
        args = _parse(build_parser(), argv)
        args.command_line = list(argv)  # e.g. for the --resume command an interrupted run prints
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        # a path argument longer than the file system takes, wherever it is first opened
        if e.errno != errno.ENAMETOOLONG:
            raise
        print(f"error: a file name is too long for the file system: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("interrupted", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except RuntimeError as e:
        # torchvision's compiled operators register with the torch it was built for; with
        # another torch (pip's fallback to other wheels) its import fails deep in a traceback
        if "torchvision::" not in str(e):
            raise
        print(f"error: {torch_mismatch()}", file=sys.stderr)
        return 1


def torch_mismatch() -> str:
    """One line naming the installed torch and torchvision that do not belong together, and
    the command that installs a matching pair (read from the packages' metadata: importing
    torchvision is what fails)."""
    from importlib import metadata

    versions = {}
    for name in ("torch", "torchvision"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "(not installed)"
    torch = versions["torch"]
    release, _, local = torch.partition("+")
    major, minor = (release.split(".") + ["0", "0"])[:2]
    index = f" --index-url https://download.pytorch.org/whl/{local}" if local else ""
    pair = f"torch=={release} torchvision==0.{int(minor) + 15}.*" if major == "2" else ""
    return (
        f"torch {torch} and torchvision {versions['torchvision']} do not match (torchvision "
        f"was built for another torch); install a matching pair: pip install --force-reinstall "
        + (pair or "torch torchvision")
        + index
    )


if __name__ == "__main__":
    sys.exit(main())
