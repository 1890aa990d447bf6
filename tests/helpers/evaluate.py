"""`sat evaluate`'s command line as the tests build it."""

from __future__ import annotations

from pathlib import Path


def evaluate_argv(
    dataset: str,
    root: Path | str,
    split: str | None = None,
    *extra: str,
    model: Path | str | None = None,
    output: Path | str | None = None,
) -> list[str]:
    """The arguments of `sat evaluate` on ``split`` of ``dataset`` at ``root`` (None: the
    dataset's default split), then ``extra`` as given; --model and --output where given."""
    argv = ["evaluate", "--dataset", dataset, "--root", str(root)]
    if split is not None:
        argv += ["--split", split]
    if model is not None:
        argv += ["--model", str(model)]
    argv += extra
    if output is not None:
        argv += ["--output", str(output)]
    return argv
