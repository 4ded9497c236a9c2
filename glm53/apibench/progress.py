"""Progress on the terminal while a run goes: a rich progress bar per suite on a terminal, one line
per request elsewhere (logs, CI), both on stderr so stdout keeps only the tables."""
from __future__ import annotations

import threading
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class SuiteProgress:
    """The requests of one suite; `step(note)` after each (from any thread)."""

    def __init__(self, display: "Display", name: str, total: int) -> None:
        self.display, self.name, self.total, self.done = display, name, total, 0
        self._lock = threading.Lock()
        self.task = display.bars.add_task(name, total=total) if display.bars is not None else None

    def step(self, note: str) -> None:
        with self._lock:
            self.done += 1
            if self.task is not None:
                self.display.bars.update(self.task, advance=1, description=f"{self.name}: {note}")
            else:
                self.display.say(f"{self.name} [{self.done}/{self.total}] {note}")


class Display:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.bars: Progress | None = None
        if self.console.is_terminal:
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)

    def suite(self, name: str, total: int) -> SuiteProgress:
        return SuiteProgress(self, name, total)

    def say(self, line: str) -> None:
        """A line as it is, never wrapped (logs and error messages stay greppable)."""
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def __enter__(self) -> "Display":
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.bars is not None:
            self.bars.stop()
