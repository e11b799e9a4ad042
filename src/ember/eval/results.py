"""Where an evaluation's numbers go, checked before any compute is spent.

A results file lives in the run's `eval/` folder (the default) or outside the run: anywhere
else in the run it could replace part of the run (its weights, its summary) or, as a file
the run does not know, make `ember train --resume` refuse the folder. A file already at the
target is replaced only by the same evaluation of the same weights: GLUE results keep the
tasks not run again when the fine-tuning setup matches, and held-out scores are replaced only
for the same data, over at least as many sequences. Any other file is left as it is and the evaluation refused.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ember.config import ConfigError

# What marks a file as written by each verb.
_MARKS = {"glue": ("checkpoint", "weights", "tasks", "convention"), "lm": ("checkpoint", "weights", "perplexity")}
# A GLUE results file gains tasks only from a run that differs in none of these.
GLUE_SETUP = ("weights", "weights_stamp", "tokenizer", "objective", "pooling", "protocol", "seeds", "glue_dir")


def _same_path(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def weights_stamp(path: Path) -> str:
    """Which version of the weights at `path` these are: bytes and newest modification
    time. `ember train --resume` rewrites a run's model.safetensors at the same path, and
    results of the old weights must not be merged with scores of the new ones."""
    path = Path(path)
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    return f"{sum(st.st_size for st in stats)} bytes, {max((st.st_mtime_ns for st in stats), default=0)}"


def claim(path: Path, run_dir: Path, verb: str) -> dict | None:
    """Check that `ember eval <verb>` may write its results to `path`, creating its folder;
    return the results of that verb already there, or None."""
    path, run_dir = Path(path), Path(run_dir).resolve()
    where = path.resolve()
    if where.is_relative_to(run_dir) and not where.is_relative_to(run_dir / "eval"):
        raise ConfigError(f"--out {path} lies inside the run {run_dir} but outside its eval/ folder; "
                          "write the results there or outside the run.")
    if path.is_dir():
        raise ConfigError(f"--out {path} is a folder; give a .json file for the results.")
    old = None
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            old = None
        if not isinstance(old, dict) or any(key not in old for key in _MARKS[verb]):
            raise ConfigError(f"--out {path} exists and is not a results file of `ember eval {verb}`; "
                              "choose another file.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write the results to {path} ({err.strerror or err}).") from None
    try:  # a file made and removed: permission bits alone say nothing to root or of special folders
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write the results to {path} ({err.strerror or err}).") from None
    return old


def check_glue_setup(path: Path, old: dict, new: dict) -> None:
    """Refuse to add tasks to results fine-tuned differently: the average would mix setups."""
    new = json.loads(json.dumps(new))  # as it would be read back: tuples become lists
    same = {key: _same_path if key in ("weights", "tokenizer") else (lambda a, b: a == b) for key in GLUE_SETUP}
    same["weights_stamp"] = lambda a, b: a is None or a == b  # files of older embers have none
    same["glue_dir"] = lambda a, b: a is None or _same_path(a, b)  # tasks of other GLUE files never average
    differs = [key for key in GLUE_SETUP if not same[key](old.get(key), new[key])]
    if differs == ["weights_stamp"]:
        raise ConfigError(f"{path} holds GLUE results of earlier weights at {new['weights']} (the run was "
                          "trained further since); pass --out another file, or move the old one away.")
    if differs:
        raise ConfigError(f"{path} holds GLUE results of another setup (its {', '.join(differs)} differ); "
                          "pass --out another file to keep both.")
    tasks = old["tasks"]
    if not (isinstance(tasks, dict) and all(_scored(task) for task in tasks.values())):
        # Found now, not after fine-tuning: the kept tasks are merged into the new file.
        raise ConfigError(f"{path} is damaged (its tasks are not GLUE results); pass --out another file.")


def _scored(task) -> bool:
    metrics = task.get("metrics") if isinstance(task, dict) else None
    return isinstance(metrics, dict) and all(
        isinstance(m, dict) and m and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in m.values())
        for m in metrics.values())


def check_lm_data(path: Path, old: dict, weights: Path, data_dir: Path, sequences: int) -> None:
    """Held-out scores are replaced only by scores of the same weights on the same data, over
    at least as many of its sequences: a quick look at the first batches never replaces a
    whole split's numbers."""
    if not (_same_path(old.get("weights"), str(weights)) and _same_path(old.get("data"), str(data_dir))):
        raise ConfigError(f"{path} holds the scores of {old.get('weights')} on {old.get('data')}; "
                          "pass --out another file to keep both.")
    if isinstance(old.get("sequences"), int) and old["sequences"] > sequences:
        raise ConfigError(f"{path} holds the scores of {old['sequences']:,} held-out sequences and this scores "
                          f"{sequences:,}; pass --out another file to keep both.")
