"""What tests that start processes share: a free local port, Ctrl-C as a terminal has it,
`sat` started as a child process, and waiting for the records it writes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


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


def wait_for_records(path: Path, n: int, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until ``path`` holds ``n`` lines (records) that ``proc`` wrote; a test failure when
    ``proc`` ends first (with its standard error) or after ``timeout`` seconds (``proc``
    killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"sat caption ended before {n} records: {proc.communicate()[1]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no {n} records in {timeout} s")
