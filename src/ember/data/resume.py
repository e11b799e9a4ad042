"""An interrupted preparation continues where it stopped instead of starting over.

Preparing a pretraining corpus (FineWeb-Edu, C4, a Wikipedia dump) takes hours, and a
killed job, a full disk or a lost connection to a streamed dataset should not cost them
again. After every batch that completed a shard, the packing pass saves its whole state
(`resume.npz`, written atomically): how many input documents it has consumed, the split
writers' unwritten rows and the shards they wrote, the deduplicator's memory and the
running counts: arrays and one JSON text, read with numpy's allow_pickle=False, so
continuing never runs code from a file. Run the same command again and `prepare` finds
the state, checks that it belongs to the same inputs and settings (a state saved with
other ones is refused in one sentence naming the difference, and the folder kept: a
changed flag must not silently cost the hours already spent; input files edited since
mean starting over, since no command could continue), keeps the tokenizer
and the shards the state lists (every later file is a leftover and removed), reads past
the documents already consumed without tokenizing them, and goes on. The result is the
folder an uninterrupted run would have written, byte for byte.

A resume re-reads the consumed documents (a streamed dataset streams them again), but
spends no tokenizer or packing work on them. The state file is deleted when the manifest
is written: a finished folder holds none.

Earlier versions saved the state as a pickle (`resume.pkl`), which is never read: such a
folder is refused in one sentence, keeping its shards for the version that wrote it. A
`resume.npz` that is damaged or of another state version cannot be continued and the
preparation starts over.
"""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ember.atomic import write_atomic
from ember.data.dedup import DedupConfig, Deduplicator
from ember.data.errors import DataError
from ember.data.packing import SplitWriter
from ember.data.pipeline import PassResult

STATE_FILE = "resume.npz"
PICKLED_STATE_FILE = "resume.pkl"  # earlier versions' state
# Made first in --out: a folder holding it is an unfinished preparation this command may continue.
STARTED = ".ember-prepare-started"
STATE_VERSION = 3  # 3: the settings themselves, not their hash, so that a difference can be named
_META = "meta.json"  # the array holding the JSON text of every plain value
# How a refusal names each setting: the command's flag for it.
_FLAGS = {"tokenizer": "--tokenizer", "tokenizer_file": "--tokenizer", "vocab_size": "--vocab-size",
          "seq_len": "--seq-len", "val_fraction": "--val-fraction", "seed": "--seed", "shard": "--shard-size",
          "text_field": "--text-field", "clean": "cleaning", "dedup": "--dedup", "boundaries": "--doc-boundaries",
          "stopping": "--stopping", "max_document_bytes": "max_document_bytes", "curriculum": "--curriculum",
          "tokenizer_documents": "--tokenizer-documents"}


def plain_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` as they read back from the state's JSON (tuples become lists, and so on)."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):  # a count or id that stayed a numpy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} has no place in a preparation's state")


def _flatten(state: dict[str, Any]) -> tuple[dict, dict[str, np.ndarray]]:
    out, deduper = state["out"], state["deduper"]
    meta = {"kind": state["kind"], "force_val": state["force_val"], "next_index": state["next_index"],
            "val_tokens": state["val_tokens"], "writers": {},
            "out": {"splits": out.splits, "entropy": out.entropy, "dropped": dict(out.dropped),
                    "changed": dict(out.changed), "per_source": out.per_source,
                    "documents_seen": out.documents_seen},
            "dedup": deduper.config.to_dict() if deduper is not None else None}
    arrays = {"out.histogram": out.histogram}
    for name, counts in zip(("docs", "tokens", "chars"), state["kept"]):
        arrays[f"kept.{name}"] = counts
    for split, writer in state["writers"].items():
        meta["writers"][split], parts = writer.snapshot()
        arrays.update({f"writer.{split}.{k}": v for k, v in parts.items()})
    if deduper is not None:
        arrays.update({f"dedup.{k}": v for k, v in deduper.snapshot().items()})
    return meta, arrays


def _unflatten(meta: dict, arrays: dict[str, np.ndarray], out_dir: Path) -> dict[str, Any]:
    def part(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

    out = PassResult(**{**meta["out"], "dropped": Counter(meta["out"]["dropped"]),
                        "changed": Counter(meta["out"]["changed"]), "histogram": arrays["out.histogram"]})
    writers = {split: SplitWriter.restore(out_dir, m, part(f"writer.{split}."))
               for split, m in meta["writers"].items()}
    deduper = (Deduplicator.restore(DedupConfig(**meta["dedup"]), part("dedup."))
               if meta["dedup"] is not None else None)
    return {"kind": meta["kind"], "force_val": meta["force_val"], "next_index": meta["next_index"],
            "val_tokens": meta["val_tokens"], "writers": writers, "deduper": deduper, "out": out,
            "kept": tuple(arrays[f"kept.{name}"] for name in ("docs", "tokens", "chars"))}


def save_state(out_dir: Path, settings: dict[str, Any], state: dict[str, Any]) -> None:
    meta, arrays = _flatten(state)
    meta |= {"version": STATE_VERSION, "settings": plain_settings(settings)}
    text = np.array(json.dumps(meta, default=_plain))
    # Given an open file (not a name, to which it would add ".npz"), np.savez writes into it.
    write_atomic(Path(out_dir) / STATE_FILE, lambda handle: np.savez(handle, **{_META: text}, **arrays))


def refuse_pickled_state(out_dir: Path) -> None:
    """An unfinished preparation of an earlier version is kept, not redone: its state is a
    pickle, which this version does not read."""
    if (Path(out_dir) / PICKLED_STATE_FILE).is_file():
        raise DataError(f"--out {out_dir} holds an unfinished preparation saved by an earlier ember "
                        f"({PICKLED_STATE_FILE}), which this version does not read; finish it with that "
                        f"version, or delete {PICKLED_STATE_FILE} to start over.")


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first setting that differs, as the command line would give it."""
    if old.get("sources") != new.get("sources"):
        return "other inputs or other weights"
    for name in sorted(set(old) | set(new)):
        was, now = old.get(name), new.get(name)
        if was == now or name == "files":
            continue
        flag = _FLAGS.get(name, name)
        if name == "tokenizer_file":
            return f"another {flag} file"
        if isinstance(was, dict) and isinstance(now, dict):
            keys = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
            was = ", ".join(f"{k}={was.get(k)}" for k in keys)
            now = ", ".join(f"{k}={now.get(k)}" for k in keys)
        return f"{flag} {was} (not {now})"
    return "other settings"


def _same_command(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return {k: v for k, v in old.items() if k != "files"} == {k: v for k, v in new.items() if k != "files"}


def load_state(out_dir: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The saved state of an interrupted preparation of the same inputs and settings, or
    None (no state, a damaged one, one of another version, or one of input files changed
    since: then the preparation starts over). A readable state saved by a command with other
    inputs or settings is refused, not discarded."""
    out_dir = Path(out_dir)
    path = out_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        meta = json.loads(str(arrays.pop(_META)))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # a damaged file: start over
        return None
    if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION or not isinstance(meta.get("settings"), dict):
        return None
    settings = plain_settings(settings)
    if meta["settings"] == settings:
        return _unflatten(meta, arrays, out_dir)
    if _same_command(meta["settings"], settings):
        # The same command over input files that changed since (edited, or more of them in a
        # folder): no command can continue that state, so the data as it is now is prepared.
        return None
    raise DataError(f"{out_dir} holds an unfinished preparation with {_difference(meta['settings'], settings)}; "
                    "run the command that started it to continue it, or delete the folder to start over.")


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
