"""One progress bar (rich) for long jobs: shown on a terminal, silent when output is piped."""

from __future__ import annotations

import sys
from collections.abc import Callable

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class _ImagesPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} img/s" if speed else "- img/s")


class ProgressBar:
    """``with ProgressBar(total, "captions") as advance: advance(n)``."""

    def __init__(self, total: int, label: str, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.label = total, label
        self._progress: Progress | None = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        self._progress = Progress(
            TextColumn(self.label), BarColumn(), MofNCompleteColumn(), _ImagesPerSecond(),
            TimeRemainingColumn(), transient=False,
        )
        self._progress.start()
        task = self._progress.add_task(self.label, total=self.total)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
