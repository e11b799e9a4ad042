"""Experiment trackers beside metrics.jsonl: every record the run logs also goes to the
trackers named in `train.trackers`, from rank 0 only.

TensorBoard (`torch.utils.tensorboard`, the `tensorboard` extra) writes event files to
RUN/tensorboard: each numeric field of a record is a scalar at its step, and the resolved
config is a text entry. A resumed run (or a rollback) continues the same event files from
its step, with the steps after it dropped (`purge_step`). A tracker that is not installed
or fails to start is a one-line warning; training goes on without it.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard",)


class TensorBoard:
    def __init__(self, run_dir: Path, config_toml: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.folder = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(str(self.folder), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self.writer.add_text("config", "```toml\n" + config_toml + "\n```", 0)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.folder), purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


def open_trackers(names: list[str], run_dir: Path, config_toml: str, resume_step: int | None) -> list:
    """The trackers that started; the others are a warning each."""
    opened = []
    for name in names:
        try:
            opened.append(TensorBoard(run_dir, config_toml, resume_step))
        except Exception as err:  # noqa: BLE001 - a tracker must never end a training run
            warnings.warn(f"ember: the {name} tracker did not start ({type(err).__name__}: {err}); training goes on "
                          f"without it (pip install 'ember[{name}]').", stacklevel=2)
    return opened
