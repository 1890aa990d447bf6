"""What tests that start processes share: a free local port, and Ctrl-C as a terminal has it."""

from __future__ import annotations

import signal
import socket


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
