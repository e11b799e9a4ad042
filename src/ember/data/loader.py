"""Batches: sequences from memory-mapped shards in a seeded order that resumes exactly.

The state is one integer, the number of *global* sequences consumed. Sequence order is
a permutation of the whole split drawn from (seed, epoch) and computed per row where it
is read (`data/shuffle.py`), never stored; each rank takes its contiguous slice of every
global batch. So a run can stop and resume on another number of ranks and still see the
same sequences in the same order, and what a rank holds does not grow with the split:
shards are memory-mapped when a batch first reads them, a bounded number at a time.

With `documents`, every batch comes with per-row document ids (equal ids = one document),
read from the `*.docs.npz` starts that `ember data prepare --doc-boundaries` writes, for
attention that stays inside each document.

With `order="curriculum"` the first epoch visits rows in ascending order of the key the
preparation recorded (`--curriculum`), ties in file order; later epochs shuffle as
usual. The first epoch's order is a pure function of the data, so the position integer
still identifies every row, and resume and rank slicing are unchanged. (That order is held
whole, 8 bytes a row: a curriculum suits the cramming-sized splits it was made for.)
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ember.data.errors import DataError
from ember.data.shuffle import Permutation

ORDERS = ("shuffle", "curriculum")
OPEN_SHARDS = 64  # memory maps (and document starts) kept open: far below vm.max_map_count
SHUFFLE = "feistel"  # how the state's order is drawn; states without it used numpy's permutation


class Batch(NamedTuple):
    """Token rows [rows, seq_len], and with `Batches(documents=True)` each token's document
    id within its row (None otherwise)."""

    ids: torch.Tensor
    documents: torch.Tensor | None


class Batches:
    def __init__(self, data_dir: Path, manifest: dict, split: str = "train", seed: int = 0,
                 rank: int = 0, world: int = 1, documents: bool = False, order: str = "shuffle"):
        if order not in ORDERS:
            raise ValueError(f"order {order!r} must be one of {', '.join(ORDERS)}.")
        if split not in manifest["splits"]:
            raise DataError(f"the data has no {split!r} split; it has {', '.join(manifest['splits'])}.")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} must lie in [0, world={world}).")
        self.split, self.seed, self.rank, self.world = split, seed, rank, world
        self.data_dir, self.seq_len = Path(data_dir), int(manifest["seq_len"])
        self.entries = manifest["splits"][split]["shards"]
        self.starts = np.cumsum([0] + [int(s["sequences"]) for s in self.entries], dtype=np.int64)
        self.size = int(self.starts[-1])  # first global index of each shard, then the total
        self.documents = documents
        if documents:
            missing = next((s["file"] for s in self.entries if "doc_boundaries" not in s), None)
            if missing is not None:
                raise DataError(f"shard {self.data_dir / missing} has no document boundaries; prepare the data "
                                "again with --doc-boundaries.")
        self._open: dict[int, tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]] = {}
        self.position = 0
        self.legacy = False  # a state saved before orders were computed per row
        self._orders: dict[int, Permutation | np.ndarray] = {}
        self._curriculum = (curriculum_order(self.data_dir, manifest, split, self.size)
                            if order == "curriculum" else None)

    def __len__(self) -> int:
        return self.size

    @property
    def epoch(self) -> int:
        return self.position // self.size if self.size else 0

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # Keep only the epochs a batch can touch: this one and the next.
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            if epoch == 0 and self._curriculum is not None:
                self._orders[epoch] = self._curriculum
            elif self.legacy:
                self._orders[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.size)
            else:
                self._orders[epoch] = Permutation(self.size, self.seed, epoch)
        return self._orders[epoch]

    def _shard(self, shard: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """Shard `shard`'s rows (memory-mapped) and document starts, opened on first use; the
        least recently used is closed beyond OPEN_SHARDS."""
        if shard in self._open:
            self._open[shard] = self._open.pop(shard)  # most recently used last
            return self._open[shard]
        entry = self.entries[shard]
        path = self.data_dir / entry["file"]
        try:
            rows = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read shard {path} ({err}); prepare the data again.") from None
        if rows.ndim != 2 or rows.shape != (int(entry["sequences"]), self.seq_len):
            raise DataError(f"shard {path} holds {rows.shape} tokens where the manifest lists "
                            f"{entry['sequences']} rows of {self.seq_len}; prepare the data again.")
        starts = _load_starts(self.data_dir, entry, self.seq_len) if self.documents else None
        if len(self._open) >= OPEN_SHARDS:
            del self._open[next(iter(self._open))]
        self._open[shard] = (rows, starts)
        return self._open[shard]

    def _indices(self, start: int, count: int) -> np.ndarray:
        """Sequence indices at global positions start .. start+count-1, across epochs."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.size)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._order(int(epoch))[offsets[where]]
        return out

    def _gather(self, indices: np.ndarray) -> "Batch":
        """Rows at `indices` (and their document ids), read in ascending order per shard
        for memmap locality."""
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        begins = np.zeros(out.shape, dtype=bool) if self.documents else None
        order = np.argsort(indices, kind="stable")
        sorted_idx = indices[order]
        shard_of = np.searchsorted(self.starts, sorted_idx, side="right") - 1
        for shard in np.unique(shard_of):
            where = shard_of == shard
            local = sorted_idx[where] - self.starts[shard]
            rows, starts = self._shard(int(shard))
            out[order[where]] = rows[local]
            if begins is not None:
                begins[order[where]] = self._begins(starts, local)
        if begins is None:
            return Batch(torch.from_numpy(out), None)
        # A document's id is the number of starts before it in the row; a row that begins
        # mid-document numbers that one 0 as well.
        ids = np.cumsum(begins, axis=1, dtype=np.int32)
        ids -= ids[:, :1]
        return Batch(torch.from_numpy(out), torch.from_numpy(ids))

    def _begins(self, boundaries: tuple[np.ndarray, np.ndarray], rows: np.ndarray) -> np.ndarray:
        """[len(rows), seq_len] booleans, True where a document starts in those rows."""
        starts, indptr = boundaries
        first, counts = indptr[rows], indptr[rows + 1] - indptr[rows]
        row_of = np.repeat(np.arange(len(rows)), counts)
        # Position in `starts` of each listed start: its row's first, plus its rank in the row.
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        out = np.zeros((len(rows), self.seq_len), dtype=bool)
        out[row_of, starts[np.repeat(first, counts) + offsets]] = True
        return out

    def next(self, global_n: int) -> "Batch":
        """This rank's share, (global_n // world, seq_len), of the next global batch."""
        if global_n < 1 or global_n % self.world:
            raise ValueError(f"global batch {global_n} must be a positive multiple of world size {self.world}.")
        if self.size == 0:
            raise DataError(f"the {self.split} split holds no sequences; prepare more text or a lower --seq-len.")
        k = global_n // self.world
        rows = self._gather(self._indices(self.position + self.rank * k, k))
        self.position += global_n
        return rows

    def fixed(self, n: int) -> "Batch":
        """The first `n` sequences in file order (all if fewer): a fixed evaluation set."""
        n = min(n, self.size)
        return self._gather(np.arange(n, dtype=np.int64))

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed} | ({} if self.legacy else {"shuffle": SHUFFLE})

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        # A run saved before orders were computed per row goes on in the order it began.
        self.legacy = state.get("shuffle") != SHUFFLE
        self._orders = {}


def _load_starts(data_dir: Path, shard: dict, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A shard's document starts in CSR form (starts, indptr), checked against the shard."""
    path = data_dir / shard["doc_boundaries"]["file"]
    try:
        with np.load(path, allow_pickle=False) as npz:
            starts, indptr = npz["starts"].astype(np.int64), npz["indptr"].astype(np.int64)
    except (OSError, ValueError, KeyError) as err:
        raise DataError(f"{path} is not a readable document-boundary file ({err}); "
                        f"prepare the data again.") from None
    if (len(indptr) != shard["sequences"] + 1 or indptr[-1] != len(starts)
            or (len(starts) and (starts.min() < 0 or starts.max() >= seq_len))):
        raise DataError(f"{path} does not match the rows of {shard['file']}; prepare the data again.")
    return starts, indptr


def curriculum_order(data_dir: Path, manifest: dict, split: str, size: int) -> np.ndarray:
    """Row indices in ascending order of the split's curriculum key (a stable sort, so
    equal keys keep file order)."""
    entry = manifest["splits"][split].get("curriculum")
    if entry is None:
        raise DataError(f"the data in {data_dir} was prepared without a curriculum key; prepare it again with "
                        "--curriculum sentence-length or set data.order = \"shuffle\".")
    path = data_dir / entry["file"]
    if not path.is_file():
        raise DataError(f"curriculum keys {path} are missing; prepare the data again.")
    keys = np.load(path, allow_pickle=False)
    if keys.shape != (size,):
        raise DataError(f"{data_dir / entry['file']} holds {keys.shape[0] if keys.ndim else 0} keys for "
                        f"{size} {split} rows; prepare the data again.")
    return np.argsort(keys, kind="stable")
