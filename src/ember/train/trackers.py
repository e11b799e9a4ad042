"""Experiment trackers beside metrics.jsonl: every record the run logs also goes to the
trackers named in `train.trackers`, from rank 0 only.

TensorBoard (`torch.utils.tensorboard`, the `tensorboard` extra) writes event files to
RUN/tensorboard: each numeric field of a record is a scalar at its step, and the resolved
config is a text entry. A resumed run (or a rollback) continues the same event files from
its step, with the steps after it dropped (`purge_step`). Weights & Biases (`wandb`, the `wandb` extra) logs
every record against ember's step (its own step counter only ever grows, so a rollback's
repeated steps plot where they belong), with the resolved config as the run's config. It
runs offline (a folder under RUN/wandb that `wandb sync` uploads later) unless WANDB_MODE
says otherwise or an API key is configured; the run id is kept in RUN/wandb_id, so a
resumed run continues the same W&B run. Trackio (`trackio`, the `trackio` extra), which is
local-first, writes its SQLite database to RUN/trackio (unless TRACKIO_DIR names another
folder; `trackio show --project ember` with TRACKIO_DIR=RUN/trackio opens the dashboard),
logging every record at ember's step in a run named after the run folder; a resumed run
continues it. A tracker that is not installed
or fails to start is a one-line warning; training goes on without it.
"""

from __future__ import annotations

import math
import os
import secrets
import tomllib
import warnings
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "wandb", "trackio")


class TensorBoard:
    def __init__(self, run_dir: Path, config_toml: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.folder = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(str(self.folder), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self.writer.add_text("config", "```toml\n" + config_toml + "\n```", 0)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        # Tokens and time come with each training record; an evaluation's copies of them at
        # the same step would be second points on those curves.
        skip = {"step"} if "loss" in record else {"step", "tokens", "elapsed_s"}
        for key, value in _numbers(record).items():
            if key not in skip:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.folder), purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class WandB:
    def __init__(self, run_dir: Path, config_toml: str, resume_step: int | None):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        logged_in = os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()
        mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ember"), id=run_id, resume="allow",
                              dir=str(run_dir), mode=mode, name=run_dir.name, config=tomllib.loads(config_toml))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_numbers(record))

    def rewind(self, step: int) -> None:
        pass  # records carry ember's step, so the repeated steps of a rollback plot in place

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, run_dir: Path, config_toml: str, resume_step: int | None):
        # trackio reads its folder once, when first imported: a training process has one run.
        os.environ.setdefault("TRACKIO_DIR", str(Path(run_dir).resolve() / "trackio"))
        import trackio

        self.folder = Path(os.environ["TRACKIO_DIR"])
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "ember"), name=Path(run_dir).name,
                                config=tomllib.loads(config_toml), resume="allow", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, record: dict[str, Any]) -> None:
        numbers = _numbers(record)
        step = int(numbers.pop("step", 0))
        self.run.log(numbers, step=step)

    def rewind(self, step: int) -> None:
        pass  # records carry ember's step, so a rollback's repeated steps plot in place

    def close(self) -> None:
        self.run.finish()


_CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


def open_trackers(names: list[str], run_dir: Path, config_toml: str, resume_step: int | None) -> list:
    """The trackers that started; the others are a warning each."""
    opened = []
    for name in names:
        try:
            opened.append(_CLASSES[name](run_dir, config_toml, resume_step))
        except Exception as err:  # noqa: BLE001 - a tracker must never end a training run
            warnings.warn(f"ember: the {name} tracker did not start ({type(err).__name__}: {err}); training goes on "
                          f"without it (pip install 'ember[{name}]').", stacklevel=2)
    return opened
