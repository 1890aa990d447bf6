"""A disk that fills up, for the tests of what each writer does then (no tmpfs needed)."""

from __future__ import annotations

import errno
import io


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
