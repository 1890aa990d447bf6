"""How many pixels a process decodes at once, whatever the number of threads asking.

One photo's pixel limit (files.MAX_PIXELS) bounds a file, not a process: the web service
decodes as many uploads at once as it has workers, and a small PNG can ask for 64 million
pixels. Decoding holds several copies of the pixels for a moment (the file's own mode, the
conversion, RGB), so the budget is what a process decodes at once; a photo over it decodes alone.

After a large decode the freed memory is handed back to the system (glibc's ``malloc_trim``):
glibc keeps freed heap memory, above all in the arenas of the threads that decoded, for reuse,
and a service that decoded four such uploads once stayed gigabytes larger for good.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

# two photos of the largest size accepted (files.MAX_PIXELS) at once; SAT_DECODE_PIXELS sets it
DEFAULT_PIXELS = 128_000_000
# a decode of this many pixels or more hands its memory back once no other decode runs
TRIM_AFTER_PIXELS = 8_000_000


def malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: the free memory of every arena back to the system. Nothing
    elsewhere (musl, macOS, Windows: no such call), where this is looked up once, when first
    needed (not at import: `sat caption` starts without it)."""
    global _trim
    if _trim is None:
        import ctypes

        try:  # the symbols the process has loaded: glibc's, where it runs on glibc
            found = getattr(ctypes.CDLL(None), "malloc_trim", None)
        except OSError:
            found = None
        if found is not None:
            found.argtypes, found.restype = [ctypes.c_size_t], ctypes.c_int
        _trim = found or False
    if _trim:
        _trim(0)


_trim = None  # malloc_trim's function once looked up; False where there is none


class PixelBudget:
    """A semaphore weighted by pixels: ``with budget.decoding(n):`` waits until ``n`` more
    pixels fit (or none are being decoded: a photo over the budget decodes alone)."""

    def __init__(self, pixels: int, trim: Callable[[], object] | None = None) -> None:
        self.pixels = pixels
        self.in_use = 0
        self.peak = 0  # the most pixels decoded at once so far
        self.waiting = 0
        self._trim = trim
        self._trim_due = False
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def decoding(self, pixels: int) -> Iterator[None]:
        with self._changed:
            self.waiting += 1
            try:
                self._changed.wait_for(
                    lambda: self.in_use == 0 or self.in_use + pixels <= self.pixels
                )
            finally:
                self.waiting -= 1
            self.in_use += pixels
            self.peak = max(self.peak, self.in_use)
        try:
            yield
        finally:
            with self._changed:
                self.in_use -= pixels
                self._trim_due |= pixels >= TRIM_AFTER_PIXELS
                trim = self._trim_due and self.in_use == 0 and self._trim is not None
                if trim:
                    self._trim_due = False
                self._changed.notify_all()
            if trim:
                self._trim()


def _default_pixels() -> int:
    value = os.environ.get("SAT_DECODE_PIXELS", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_PIXELS


DECODE_BUDGET = PixelBudget(_default_pixels(), trim=malloc_trim)
