"""The base of every 'bad input' error: the CLI prints its one-line message, not a traceback.

Subclasses say what was wrong and what to do (a missing file, an undecodable image, a foreign
model file, a dataset folder laid out wrongly, no Java for the official metrics, ...).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class UserError(Exception):
    """Bad input or environment; ``exit_code`` 2 for usage errors, 1 for failures."""

    exit_code = 1


class UsageError(UserError):
    """A bad command line or setting (an option out of range, a missing config file, an output
    that cannot be written or resumed): exit status 2, before any work is lost."""

    exit_code = 2


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``, a scheduler's preemption) raised where the program is, so that a
    command stops as on Ctrl-C, keeping what it wrote and saying how to go on; exit 143
    (128 + SIGTERM) instead of Ctrl-C's 130. A KeyboardInterrupt, so that every place that
    already stops cleanly on Ctrl-C (DataLoader workers included) does so here too."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler (``signal.signal(signal.SIGTERM, raise_terminated)``)."""
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` while the block runs (where signals can be handled: the
    main thread), and the handler before it is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
