"""Long stages' progress where a person watches: draftline's log lines, and in a terminal a rich bar per stage.

Library code marks a log line as a progress step with `extra=progress_step(what, done, total)`; under Prefect the
line goes to the run's log like any other (tasks/common.relay_library_logs), and the command line shows it through
`terminal_progress()`: a bar per `what` (done/total, elapsed, remaining) with the lines printed above it when stderr
is a terminal, the lines alone otherwise.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

PROGRESS = "draftline_progress"  # the LogRecord attribute: (what, done, total)
_FORMAT = "%(asctime)s %(message)s"


def progress_step(what: str, done: int, total: int) -> dict:
    """`extra` for a log call that also reports `done` of `total` steps of `what` ("training", "traces")."""
    return {PROGRESS: (what, int(done), int(total))}


class TerminalProgress(logging.Handler):
    """Prints each record above rich bars and moves the bar its progress step names."""

    def __init__(self, console) -> None:
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )

        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("remaining"), TimeRemainingColumn(), console=console)
        self.tasks: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            step = getattr(record, PROGRESS, None)
            if step is not None:  # moved first, so the bars drawn under this line show it
                what, done, total = step
                if what not in self.tasks:
                    self.tasks[what] = self.bars.add_task(what, total=total, completed=done)
                self.bars.update(self.tasks[what], completed=done, total=total)
            self.bars.console.print(self.format(record), markup=False, highlight=False)
        except Exception:  # noqa: BLE001 - a display problem must never stop the stage
            self.handleError(record)


@contextlib.contextmanager
def terminal_progress(stream=None, force_terminal: bool | None = None) -> Iterator[logging.Handler]:
    """Show draftline's INFO lines on `stream` (stderr) while the block runs, with bars when it is a terminal."""
    stream = stream or sys.stderr
    tty = stream.isatty() if force_terminal is None else force_terminal
    logger = logging.getLogger("draftline")
    level = logger.level
    if tty:
        from rich.console import Console

        handler: logging.Handler = TerminalProgress(Console(file=stream, force_terminal=True))
        handler.bars.start()
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if tty:
            handler.bars.stop()
