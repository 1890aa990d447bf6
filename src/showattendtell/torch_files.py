"""Reading PyTorch files (training checkpoints, encoder weights) without running their code.

A ``.ckpt`` or ``.pt`` file is a pickle: unpickled as is, a hostile one runs any code it names.
Every PyTorch file this project reads goes through ``read_torch_file``: ``torch.load`` with
``weights_only=True`` passed explicitly, which no environment variable overrides
(``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` only changes the default of a call that does not pass it),
and only the few plain types below allowed beyond torch's own (tensors, containers, numbers,
strings). torch 2.6 or later is required: before it, ``weights_only=True`` itself could be
bypassed by a crafted file (CVE-2025-32434).

Errors are our own, without torch's text: torch's message advises retrying with
``weights_only=False``, which would run the file's code.
"""

from __future__ import annotations

import pathlib
import pickle
import warnings
from pathlib import Path

import torch

# Beyond torch's default allow-list, what a Lightning checkpoint of `sat train` may hold: a
# path a callback or a hyperparameter was given as a pathlib object. Each is rebuilt from
# strings by its constructor, which reads no file and runs nothing else.
CHECKPOINT_SAFE_GLOBALS: list = [
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.WindowsPath,
    pathlib.PureWindowsPath,
]


class TorchFileError(ValueError):
    """A file that is not a plain PyTorch file of tensors and containers: not a torch file, cut
    short, or naming code to run. The message is ours (the caller says what to give instead)."""


def read_torch_file(path: str | Path, *, mmap: bool = False) -> object:
    """The contents of the PyTorch file at ``path`` on the CPU, loaded with ``weights_only=True``
    and ``CHECKPOINT_SAFE_GLOBALS``; ``mmap``: map the tensors' bytes instead of reading them
    (a file of torch.save's zip format only). Raises TorchFileError (reason only) for anything
    else, and OSError for a file that cannot be read."""
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, KeyError, IndexError):
        # torch says which; its words end with the advice to run the file's code: not passed on
        raise TorchFileError(
            "not a plain PyTorch file of tensors (not a torch file, cut short, or it names code "
            "to run, which is never run)"
        ) from None
