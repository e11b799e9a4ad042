"""An interrupted preparation continues where it stopped instead of starting over.

Preparing a pretraining corpus (FineWeb-Edu, C4, a Wikipedia dump) takes hours, and a
killed job, a full disk or a lost connection to a streamed dataset should not cost them
again. After every batch that completed a shard, the packing pass saves its whole state
(`resume.pkl`, written atomically): how many input documents it has consumed, the split
writers' unwritten rows and the shards they wrote, the deduplicator's memory and the
running counts. Run the same command again and `prepare` finds the state, checks that it
belongs to the same inputs and settings, keeps the tokenizer and the shards the state
lists (every later file is a leftover and removed), reads past the documents already
consumed without tokenizing them, and goes on. The result is the folder an uninterrupted
run would have written, byte for byte.

A resume re-reads the consumed documents (a streamed dataset streams them again), but
spends no tokenizer or packing work on them. The state file is deleted when the manifest
is written: a finished folder holds none.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

from ember.atomic import write_atomic

STATE_FILE = "resume.pkl"
# Made first in --out: a folder holding it is an unfinished preparation this command may continue.
STARTED = ".ember-prepare-started"
STATE_VERSION = 1


def fingerprint(settings: dict[str, Any]) -> str:
    """What must be equal for a saved state to be continued: inputs and every setting that
    changes the shards (JSON of the values, hashed)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def save_state(out_dir: Path, key: str, state: dict[str, Any]) -> None:
    payload = {"version": STATE_VERSION, "fingerprint": key, **state}
    write_atomic(Path(out_dir) / STATE_FILE, lambda handle: pickle.dump(payload, handle, protocol=5))


def load_state(out_dir: Path, key: str) -> dict[str, Any] | None:
    """The saved state of an interrupted preparation of the same inputs and settings, or
    None (no state, another version, or other settings: then the preparation starts over)."""
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as handle:
            # Only ever a file this module wrote into the user's own output folder.
            state = pickle.load(handle)  # noqa: S301
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or state.get("fingerprint") != key:
        return None
    return state


def clear_state(out_dir: Path) -> None:
    (Path(out_dir) / STATE_FILE).unlink(missing_ok=True)


def written_files(state: dict[str, Any]) -> set[str]:
    """The shard files (and their document-boundary files) a saved state vouches for."""
    names = set()
    for writer in state["writers"].values():
        for shard in writer.shards:
            names.add(shard["file"])
            if "doc_boundaries" in shard:
                names.add(shard["doc_boundaries"]["file"])
    return names
