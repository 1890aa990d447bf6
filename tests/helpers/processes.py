"""What tests that start processes share: a free local port, Ctrl-C as a terminal has it, and
`sat` started as a child process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_sigint() -> None:
    """``preexec_fn`` for a child that must stop on Ctrl-C as in a terminal.

    A shell's background job (``nohup``, ``cmd &``) starts with SIGINT ignored, an ignored signal
    is inherited through exec, and Python then installs no KeyboardInterrupt handler: the child
    would never stop. This gives it back the default handler.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_sat(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    """`sat ARGS` in ``cwd`` as a child with its output in pipes (text) and Ctrl-C as in a
    terminal (``default_sigint``); ``popen``: more of subprocess.Popen's arguments."""
    return subprocess.Popen(
        [sys.executable, "-m", "showattendtell.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
        **popen,
    )
