"""A rich progress line for tokenizing: documents, documents/s and MB/s of text."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if elapsed <= 0:
            return Text("")
        docs = task.completed / elapsed
        mb = task.fields.get("bytes", 0) / elapsed / 1e6
        return Text(f"{docs:,.0f} documents/s  {mb:.2f} MB/s", style="progress.data.speed")


class DocumentProgress:
    """Context manager; `advance(documents, bytes)` after each batch. Does nothing when
    disabled, so callers need no branches. Draws on stderr: stdout is for results."""

    def __init__(self, enabled: bool = True, description: str = "tokenizing"):
        self.enabled = enabled
        self.bytes = 0
        self._progress = None
        if enabled:
            self._progress = Progress(SpinnerColumn(), TextColumn(description),
                                      TextColumn("{task.completed:,.0f} documents"),
                                      _RateColumn(), TimeElapsedColumn(),
                                      console=Console(stderr=True))
            self._task = self._progress.add_task(description, total=None, bytes=0)

    def __enter__(self) -> DocumentProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def advance(self, documents: int, n_bytes: int) -> None:
        self.bytes += n_bytes
        if self._progress is not None:
            self._progress.update(self._task, advance=documents, bytes=self.bytes)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
