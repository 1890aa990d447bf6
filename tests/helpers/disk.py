"""A disk that fills up, for the tests of what each writer does then (no tmpfs needed), and a
folder that cannot be listed."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path


class FillingFile(io.FileIO):
    """A file on a disk that fills up after ``whole`` more writes: the next write is cut short
    after 10 bytes (as write(2) does at the limit), and the one after fails with ENOSPC."""

    whole = 10**9
    cut = 10

    def write(self, data) -> int:
        if self.whole > 0:
            self.whole -= 1
            return super().write(data)
        if self.cut <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = super().write(bytes(data)[: self.cut])
        self.cut -= n
        return n


def filling(monkeypatch, module, whole: int) -> None:
    """``module.open_output`` opens a FillingFile that takes ``whole`` more writes."""
    from showattendtell.captioning import records

    real = records.open_output

    def open_output(path, resume):
        real(path, resume).close()  # what it cuts and checks, as before
        stream = FillingFile(path, "ab")
        stream.whole = whole
        return stream

    monkeypatch.setattr(module, "open_output", open_output)


def refuse_listing(monkeypatch, folder: Path) -> None:
    """``folder`` cannot be listed, as for a folder without read permission (chmod does not
    stop root, and the tests may run as root): os.scandir (os.walk) and os.listdir
    (Path.iterdir) say EACCES for it."""
    scandir, listdir = os.scandir, os.listdir

    def check(path) -> None:
        if Path(os.fsdecode(path)).resolve() == folder.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))

    def scandir_refusing(path="."):
        check(path)
        return scandir(path)

    def listdir_refusing(path="."):
        check(path)
        return listdir(path)

    monkeypatch.setattr(os, "scandir", scandir_refusing)
    monkeypatch.setattr(os, "listdir", listdir_refusing)
