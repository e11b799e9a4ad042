"""Per-file checksums of a checkpoint, so that a damaged file (a flipped bit on disk, a
copy cut short) is named before it is loaded instead of training on from wrong numbers.

Every rank hashes an equal share of the folder's files (every world-th, by sorted name),
so the work per rank does not grow with the world size: a checkpoint is read back once in
all, right after it is written, while its pages are still in the host's cache. Rank 0
writes the list as `checksums.json`; a load checks its share the same way, and every rank
learns the first damaged file. A checkpoint records in its layout file that it has a list,
so one that lost it is damaged; only those written before checkpoints had lists, with no
such record, load unchecked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from ember.data.manifest import file_sha256

FILE = "checksums.json"


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(item, group) -> list:
    if not dist.is_initialized():
        return [item]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, item, group=group)
    return out


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != FILE)


def write(folder: Path, group=None) -> None:
    """Hash this rank's share of the complete folder; rank 0 writes the whole list.
    Every rank of `group` calls it, after every rank's files are written."""
    rank, world = _rank_world(group)
    names = _files(folder)
    mine = {name: file_sha256(folder / name) for name in names[rank::world]}
    every = _gather(mine, group)
    if rank == 0:
        found = {name: digest for part in every for name, digest in part.items()}
        (folder / FILE).write_text(json.dumps(dict(sorted(found.items())), indent=1))


def first_damaged(folder: Path, listed: bool = True) -> str | None:
    """The first file (by name) that is missing or does not match its checksum, as every
    rank sees it; None when all match, or when the folder has no list and was not written
    with one (`listed` False). Every rank calls it."""
    try:
        expected = json.loads((folder / FILE).read_text()) if (folder / FILE).is_file() or listed else {}
    except (OSError, ValueError):
        expected = None
    if not isinstance(expected, dict):  # a damaged list names itself
        expected = {FILE: ""}
    rank, world = _rank_world(None)
    bad = None
    for name in sorted(expected)[rank::world]:
        path = folder / name
        if name == FILE or not path.is_file() or file_sha256(path) != expected[name]:
            bad = name
            break
    damaged = [b for b in _gather(bad, None) if b is not None]
    return min(damaged) if damaged else None
