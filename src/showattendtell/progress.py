"""One progress reporter for long jobs (captioning, feature extraction, evaluation, downloads).

On a terminal it draws a rich bar; without one (a log file, a batch job) it writes an INFO line
every ``every_s`` seconds with the count, the rate and the time left, and one at the end.
``unit="B"`` counts bytes (sizes in MB, MB/s).
"""

from __future__ import annotations

import logging
import sys
import time

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as _RichProgress
from rich.text import Text

log = logging.getLogger(__name__)


class _ImagesPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} img/s" if speed else "- img/s")


class Progress:
    """``with Progress(total, "captions") as progress: progress(n)``.

    enabled: None (default) picks the bar on a terminal and log lines otherwise; True forces
    the bar; False shows nothing (e.g. when the results themselves go to the terminal).
    """

    def __init__(
        self,
        total: int | None,
        label: str,
        unit: str = "img",
        enabled: bool | None = None,
        every_s: float = 60.0,
        done: int = 0,
    ):
        self.total, self.label, self.unit, self.every_s = total, label, unit, every_s
        self.bar = sys.stderr.isatty() if enabled is None else enabled
        self.lines = enabled is None and not self.bar
        self.done = self.start_done = done
        self.t0 = self.last = time.monotonic()
        self._rich: _RichProgress | None = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.bar:
            columns = (
                (DownloadColumn(), TransferSpeedColumn())
                if self.unit == "B"
                else (MofNCompleteColumn(), _ImagesPerSecond())
            )
            self._rich = _RichProgress(
                TextColumn(self.label),
                BarColumn(),
                *columns,
                TimeRemainingColumn(),
                transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task(self.label, total=self.total, completed=self.done)
        return self

    def __call__(self, n: int) -> None:
        """``n`` more done."""
        self.done += n
        if self._rich is not None:
            self._rich.advance(self._task, n)
        elif self.lines and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            log.info("%s", self._line())

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        speed = (self.done - self.start_done) / elapsed
        if self.unit == "B":
            of = f" of {self.total / 1e6:.0f}" if self.total else ""
            text = f"{self.label}: {self.done / 1e6:.0f}{of} MB, {speed / 1e6:.1f} MB/s"
        else:
            of = f"/{self.total}" if self.total else ""
            text = f"{self.label}: {self.done}{of} images, {speed:.1f} img/s"
        if self.total and speed > 0 and self.done < self.total:
            text += f", {(self.total - self.done) / speed / 60:.0f} min left"
        return text

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.lines and self.done > self.start_done:
            log.info("%s in %.0f s", self._line(), time.monotonic() - self.t0)
