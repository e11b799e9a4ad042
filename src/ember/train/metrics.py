"""What a run tells its user: `metrics.jsonl` (one JSON object per logged step) and a
`rich` progress bar with loss, tokens/s, MFU and time left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ember.atomic import write_text

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLog:
    """Appends one line per record and flushes it, so a killed run keeps its history; each
    record also goes to the experiment trackers (`ember.train.trackers`)."""

    def __init__(self, path: Path, resume_step: int | None = None, trackers: list | None = None):
        self.trackers = trackers or []
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        """Lines logged after the checkpoint we resume from will be logged again; events
        (loss spikes and what was done about them) happened whatever runs again, and stay."""
        kept = [record for record in read_metrics(self.path) if record.get("step", 0) <= step or "event" in record]
        write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(record)

    def rewind(self, step: int) -> None:
        """Drop the records after `step` (a rollback runs those steps again)."""
        self._file.close()
        self._truncate_after(step)
        self._file = open(self.path, "a")
        for tracker in self.trackers:
            tracker.rewind(step)

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.close()


class NoLog:
    """The metrics log of ranks other than 0."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A line that is not a JSON object (the last line cut by
    a crash in mid-write, or damage) is left out rather than failing the reader."""
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class ProgressBar:
    """The budget as a bar: 0..1 of steps, tokens or seconds, whichever the run was given."""

    def __init__(self, enabled: bool, description: str):
        self.console = Console(stderr=True)
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.percentage:>5.1f}%"),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task(description, total=1.0, stats="")
            self._progress.start()

    def update(self, fraction: float, stats: dict[str, Any] | None = None) -> None:
        if self._progress is None:
            return
        fields = {}
        if stats:
            fields["stats"] = "  ".join(f"{k} {v}" for k, v in stats.items())
        self._progress.update(self._task, completed=fraction, **fields)

    def print(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
