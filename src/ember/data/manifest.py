"""Load a prepared folder's manifest.json and check that its shards are really there."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ember.data.errors import DataError

FORMAT = "ember-shards/1"
_REQUIRED = ("vocab_size", "seq_len", "dtype", "special_tokens", "splits")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def tokenizer_sha256(path: Path) -> str:
    """The manifest hashes the tokenizer's text; a copy of the file hashes the same."""
    return hashlib.sha256(Path(path).read_text(encoding="utf-8").encode("utf-8")).hexdigest()


def check_tokenizer(data_dir: Path, manifest: dict) -> None:
    """The data's tokenizer file is the one its shards were made with: a run copies it, and
    evaluation and export read that copy."""
    path = Path(data_dir) / manifest.get("tokenizer_file", "tokenizer.json")
    expected = manifest.get("tokenizer_sha256")
    if not expected:
        return  # data prepared without one to check against
    try:
        found = tokenizer_sha256(path)
    except FileNotFoundError:
        raise DataError(f"{path} is missing; the data's shards were made with it, so restore it "
                        "or prepare the data again.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path} ({getattr(err, 'strerror', None) or err}).") from None
    if found != expected:
        raise DataError(f"{path} is not the tokenizer the data's shards were made with (its sha256 differs "
                        "from manifest.json's); restore it or prepare the data again.")


def _check_shard(data_dir: Path, shard: dict, seq_len: int, dtype: str) -> None:
    path = data_dir / shard["file"]
    if not path.is_file():
        raise DataError(f"shard {path} is missing; prepare the data again.")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except PermissionError:
        raise  # the file is fine, its permissions are not: the caller names it
    except (ValueError, OSError) as err:
        raise DataError(f"shard {path} is not a readable .npy file ({err}); prepare the data again.") from None
    if array.shape != (shard["sequences"], seq_len) or array.dtype != np.dtype(dtype):
        raise DataError(f"shard {path} holds {array.dtype} {array.shape}, not the {dtype} "
                        f"({shard['sequences']}, {seq_len}) the manifest names; prepare the data again.")
    if "doc_boundaries" in shard and not (data_dir / shard["doc_boundaries"]["file"]).is_file():
        raise DataError(f"document boundaries {data_dir / shard['doc_boundaries']['file']} are missing; "
                        "prepare the data again.")


def _listed_files(manifest: dict, splits: tuple[str, ...] | None = None) -> list[tuple[str, dict]]:
    """(what, entry) for every file the manifest lists with a sha256 (in `splits`, or all), shards first."""
    files = []
    for name, split in manifest["splits"].items():
        if splits is not None and name not in splits:
            continue
        for shard in split["shards"]:
            files.append(("shard", shard))
            if "doc_boundaries" in shard:
                files.append(("document boundaries", shard["doc_boundaries"]))
        if "curriculum" in split:
            files.append(("curriculum keys", split["curriculum"]))
    return files


def verify_checksums(data_dir: Path, manifest: dict, part: int = 0, parts: int = 1,
                     splits: tuple[str, ...] | None = None) -> None:
    """Hash the listed files (all of them, or every `parts`-th from `part`: under torchrun
    each rank reads its share, so the data is read once in all) and refuse a damaged one."""
    for what, entry in list(_listed_files(manifest, splits))[part::parts]:
        path = Path(data_dir) / entry["file"]
        if file_sha256(path) != entry["sha256"]:
            raise DataError(f"{what} {path} does not match its checksum in manifest.json; it is damaged, "
                            "prepare the data again.")


def load_manifest(data_dir: Path, verify: bool = False) -> dict:
    """The manifest of a prepared folder, after checking every shard's shape (and, with
    `verify`, the sha256 of every shard and of the files that go with them)."""
    data_dir = Path(data_dir)
    path = data_dir / "manifest.json"
    if not path.is_file():  # also when the folder itself is missing
        raise DataError(f"{data_dir} has no manifest.json; run `ember data prepare` first.")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise DataError(f"{path} is not valid JSON; prepare the data again.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path} has format {found!r}, not {FORMAT!r}; prepare the data again with this ember.")
    missing = [key for key in _REQUIRED if key not in manifest]
    if missing or not all(split in manifest["splits"] for split in ("train", "val")):
        raise DataError(f"{path} lacks {', '.join(missing) or 'a train or val split'}; prepare the data again.")
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            _check_shard(data_dir, shard, int(manifest["seq_len"]), manifest["dtype"])
        if "curriculum" in split and not (data_dir / split["curriculum"]["file"]).is_file():
            raise DataError(f"curriculum keys {data_dir / split['curriculum']['file']} are missing; "
                            "prepare the data again.")
    if verify:
        verify_checksums(data_dir, manifest)
    return manifest


def has_document_boundaries(manifest: dict) -> bool:
    """Whether every shard lists its document starts (prepared with --doc-boundaries)."""
    return all("doc_boundaries" in shard for split in manifest["splits"].values() for shard in split["shards"])
