"""Where a command writes: an output it may create (``check_new_output``), a folder it may fill
(``prepare_folder``), a lock that keeps two runs off one file (``OutputLock``), and a path as a
user can read it back (``printable_path``). Every writing command and the downloader use these."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from showattendtell.errors import UsageError


class OutputError(UsageError):
    """The output file cannot be written or resumed; the message says what to do."""


def printable_path(text: str) -> str:
    """A file name (or a message holding one) as it goes into an output: valid Unicode, so that
    every JSON Lines and CSV file is UTF-8 and strict JSON. A name whose bytes are not UTF-8
    (Linux allows any bytes; Python holds them as surrogate escapes, os.fsdecode) has each such
    byte written as the four characters ``\\xNN``, as Python's ``backslashreplace`` does:
    the file b"caf\\xe9.jpg" is recorded as ``caf\\xe9.jpg`` (in JSON: "caf\\\\xe9.jpg").
    ``--resume`` compares paths in this form."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte: \udXXX
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OutputLock:
    """An exclusive lock on the output file for the whole run, so that a second `sat caption`
    given the same ``--output`` stops with one line instead of interleaving its records with the
    first's (two writers append both sets, and each run's --resume plan goes stale). `sat
    evaluate` holds one on its partial captions the same way, with its own words (``busy``,
    and ``name`` for the file in the "cannot write" line).

    ``fcntl.flock`` on the file itself (advisory, released by the kernel when the process ends,
    however it ends: no stale lock file to clean up). Taken before ``--resume`` reads the file.
    The file locked must still be the one at ``path``: a run that removed it between this one's
    open and its lock (`sat evaluate` removes its partial file at the end) leaves a new file
    there to lock anew. A file this creates to hold the lock is removed again by ``release`` if
    nothing was written to it, so a run that stops before captioning (a bad model file) leaves
    no empty output behind. Where ``fcntl`` is missing (Windows) or the output is not a regular
    file (a FIFO, /dev/null), nothing is locked.
    """

    def __init__(self, path: Path, busy: str | None = None, name: str | None = None):
        self.path, self.fd, self.created = path, None, False
        try:
            import fcntl
        except ImportError:  # Windows: no flock
            return
        if path.exists() and not path.is_file():
            return
        for _ in range(5):
            self.created = not path.exists()
            try:
                self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise OutputError(
                    f"cannot write {name or f'--output {path}'}: {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            except OSError:  # a file system without locks (some network mounts): go on unlocked
                return
            if _same_file(self.fd, path):
                return
            os.close(self.fd)
            self.fd = None
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.created = None, False
        raise OutputError(
            busy
            or f"--output {path} is being written by another `sat caption` run; wait for it to "
            "finish (then --resume adds what it left out), or give another --output"
        ) from None

    def release(self) -> None:
        """Drop the lock; remove the file if this lock made it, nothing was written to it and
        it is still the file at ``path`` (one put there since is another run's)."""
        if self.fd is None:
            return
        try:
            if self.created and os.fstat(self.fd).st_size == 0 and _same_file(self.fd, self.path):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor releases the lock
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    """``fd`` is the file at ``path`` (not one removed from there since it was opened)."""
    try:
        now, held = path.stat(), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def prepare_folder(option: str, folder: Path) -> None:
    """Create an output folder now, before any work, or say in one line why it cannot be.

    Whether files can be made in it is tried with a real (removed) file, not ``os.access``:
    for root ``access`` says yes to any folder, and it cannot know about read-only mounts,
    quotas or network folders that refuse new files."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(
            f"cannot create the folder for {option} ({folder}): a file of that name is in the way"
        ) from None
    except OSError as e:
        raise OutputError(
            f"cannot create the folder for {option} ({folder}): {e.strerror or e}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".sat-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(
            f"cannot write into the folder for {option} ({folder}): {e.strerror or e}"
        ) from None


def check_new_output(option: str, path: Path, overwrite: bool, resume: bool = False) -> None:
    """Before any work: ``path`` can be written, and an existing non-empty file there is
    replaced only when the user said so (``--overwrite``), so that a notes file or the output
    of an interrupted run is never lost to a typo. ``resume``: the command also has --resume
    (continue the file), which the message then offers first."""
    if path.is_dir():
        raise OutputError(f"{option} {path} is a folder; give a file name")
    if not overwrite and path.is_file() and path.stat().st_size > 0:
        keep = "add --resume to continue it, " if resume else ""
        raise OutputError(
            f"{option} {path} already exists ({path.stat().st_size:,} bytes); "
            f"{keep}add --overwrite to replace it, or give another {option}"
        )
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: written as they are
        return
    if path.exists():
        try:  # opened to append, nothing written: is the file itself writable?
            with open(path, "ab"):
                pass
        except OSError as e:
            raise OutputError(f"cannot write {option} {path}: {e.strerror or e}") from None
    prepare_folder(option, path.parent)
