"""A bound on Gradio's cache folder, for a service that runs for weeks.

Gradio keeps every upload (and every image the UI sends back) in its cache folder
($GRADIO_TEMP_DIR, else <tmp>/gradio) until the server stops: a public service fills its disk.
:class:`CacheBound` sweeps the files Gradio recorded for the app (``Blocks.temp_file_sets``)
every few seconds: files older than ``max_age_s`` go, then the oldest until the rest fit in
``max_bytes``. It never removes the example photos, a file a request is captioning right now, or
a file younger than ``grace_s`` (an upload whose request may still be waiting in the queue).
A photo removed from the cache is uploaded again by the page or client that needs it.

Given the ``folder`` the service has to itself (`sat serve` gives it one), the bound also covers
the files in it that this app did not record: uploads and images of earlier runs, and what an
upload cut short by a full disk left behind. They go first once too old or over the bound,
oldest first, as this run's own do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REMEMBER_REMOVED = 10_000  # uploads a sweep removed, to tell a client to upload one again


@dataclass
class CacheUsage:
    """What a sweep found and did."""

    files: int = 0  # files left in the cache (examples included)
    bytes: int = 0
    removed: int = 0


class CacheBound:
    """Keeps Gradio's cache of one app under ``max_bytes`` and ``max_age_s`` (None: no limit)."""

    def __init__(
        self,
        max_bytes: int | None,
        max_age_s: float | None = None,
        grace_s: float = 30.0,
        interval_s: float = 2.0,
        folder: str | os.PathLike | None = None,
    ):
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.folder = None if folder is None else os.path.realpath(folder)
        self.grace_s, self.interval_s = grace_s, interval_s
        self.blocks: Any = None  # the app whose cache is swept
        self.pages: list[Any] = []  # every app serving this service: uploads to any are its
        self._in_use: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._removed: deque[str] = deque(maxlen=REMEMBER_REMOVED)

    def holds(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a file Gradio placed in the cache of one of the service's pages
        (an upload, an example, an image the page was sent). Only these may be read for a
        request: any other path a client names is refused unread. Without an app (the service
        used in-process, where the caller is the program itself) every path is the caller's to
        name."""
        pages = [p for p in (*self.pages, self.blocks) if p is not None]
        if not pages:
            return True
        wanted = os.path.abspath(path)
        return any(wanted in files for page in pages for files in list(page.temp_file_sets))

    def removed(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` was in the cache until a sweep removed it (the page still shows it)."""
        return os.path.abspath(path) in self._removed

    @contextmanager
    def using(self, path: str | None) -> Iterator[None]:
        """Hold ``path`` (an upload being captioned) in the cache while the block runs."""
        if not path:
            yield
            return
        with self._lock:
            self._in_use[path] += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_use[path] -= 1
                if self._in_use[path] <= 0:
                    del self._in_use[path]

    def start(self, blocks: Any) -> None:
        """Sweep ``blocks``' cache every ``interval_s`` seconds in a daemon thread."""
        self.blocks = blocks
        if blocks not in self.pages:
            self.pages.append(blocks)
        if self.max_bytes is None and self.max_age_s is None:
            return
        self._thread = threading.Thread(target=self._run, name="cache-bound", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:  # a sweep that fails must not end the service
                log.exception("sweeping Gradio's cache failed")

    def sweep(self, now: float | None = None) -> CacheUsage:
        """Remove what is too old, then the oldest until the rest fit; returns what is left."""
        now = time.time() if now is None else now
        keep = set()
        for block in self.blocks.blocks.values():
            keep.update(str(p) for p in getattr(block, "keep_in_cache", ()) or ())
        entries: dict[str, tuple[float, int, list]] = {}  # path: ctime, size, (set, element)s
        kept: dict[str, int] = {}
        for files in list(self.blocks.temp_file_sets):
            for f in list(files):
                if str(f) in entries:  # one file in several sets (an upload and an input's)
                    entries[str(f)][2].append((files, f))
                    continue
                try:
                    st = os.lstat(f)
                except FileNotFoundError:
                    files.discard(f)  # gone: Gradio's set need not remember it
                    continue
                if str(f) in keep:
                    kept[str(f)] = st.st_size
                else:
                    entries[str(f)] = (st.st_ctime, st.st_size, [(files, f)])
        for f, st in self.unrecorded(set(entries) | set(kept) | keep):
            entries[f] = (st.st_ctime, st.st_size, [])
        ordered = sorted(entries.items(), key=lambda e: e[1][0])  # oldest first
        kept_files, kept_bytes = len(kept), sum(kept.values())
        total = kept_bytes + sum(size for _, size, _ in entries.values())
        usage = CacheUsage(kept_files + len(entries), total)
        with self._lock:
            in_use = set(self._in_use)
        for f, (ctime, size, listed) in ordered:
            age = now - ctime
            too_old = self.max_age_s is not None and age > self.max_age_s
            too_big = self.max_bytes is not None and usage.bytes > self.max_bytes
            if not (too_old or too_big):
                break  # the rest are newer and fit
            if age < self.grace_s or str(f) in in_use:
                continue
            if remove(f):
                self._removed.append(os.path.abspath(f))
                for files, element in listed:
                    files.discard(element)
                usage.files, usage.bytes, usage.removed = (
                    usage.files - 1,
                    usage.bytes - size,
                    usage.removed + 1,
                )
        return usage

    def unrecorded(self, known: set[str]) -> Iterator[tuple[str, os.stat_result]]:
        """The files in ``folder`` (none without one) that are not in ``known``: left by
        earlier runs, or by uploads cut short. Only regular files this user owns."""
        if self.folder is None:
            return
        uid = os.getuid() if hasattr(os, "getuid") else None
        known = {os.path.realpath(k) for k in known}  # Gradio's paths may go through a link
        for root, _, names in os.walk(self.folder):
            for name in names:
                f = os.path.join(root, name)
                if f in known:
                    continue
                try:
                    st = os.lstat(f)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid):
                    yield f, st


def remove(path: str | Path) -> bool:
    """Delete a cached file and its folder when that is left empty (Gradio gives each upload a
    folder of its own); False if it could not be removed."""
    p = Path(path)
    try:
        p.unlink()
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("cannot remove %s from Gradio's cache: %s", p, e)
        return False
    with contextlib.suppress(OSError):
        p.parent.rmdir()  # only when empty
    return True
