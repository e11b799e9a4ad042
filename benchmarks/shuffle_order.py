"""What a rank pays for the shuffled order of a training split: ember's computed permutation
(`ember.data.shuffle.Permutation`) against the stored index a loader would otherwise draw
(`numpy.random.Generator.permutation`, what ember's loader did before), side by side.

    PYTHONPATH=src python benchmarks/shuffle_order.py \
        --out benchmarks/results/DATE-shuffle-order-cpu.txt

For each split size: the seconds and the bytes (tracemalloc's peak) to get the rows of one
rank's batch (4,096 positions in the middle of the epoch), which is what a step, a resume or
an epoch change needs. The stored index pays its whole size up front, the computed one only
the batch. Both are CPU figures of this machine; no GPU is involved in either.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from ember.data.shuffle import Permutation

BATCH = 4096


def measure(draw) -> tuple[float, int]:
    tracemalloc.start()
    start = time.perf_counter()
    rows = draw()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(rows) == BATCH and len(set(rows.tolist())) == BATCH
    return seconds, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7, 10**8],
                        help="rows in the split (the stored index needs 8 bytes each)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    lines = [f"# shuffled order of a split, one rank's batch of {BATCH:,} rows "
             f"({platform.processor() or platform.machine()}, numpy {np.__version__}, CPU)",
             f"{'rows':>14} {'stored s':>9} {'stored MB':>10} {'computed s':>11} {'computed MB':>12} "
             f"{'time ratio':>11} {'memory ratio':>13}"]
    for n in args.sizes:
        positions = np.arange(n // 2, n // 2 + BATCH)
        stored = measure(lambda: np.random.default_rng((0, 0)).permutation(n)[positions])
        computed = measure(lambda: Permutation(n, 0, 0)[positions])
        lines.append(f"{n:>14,} {stored[0]:>9.3f} {stored[1] / 1e6:>10.1f} {computed[0]:>11.4f} "
                     f"{computed[1] / 1e6:>12.2f} {stored[0] / computed[0]:>10.0f}x {stored[1] / computed[1]:>12.0f}x")
    full = 3_662_109_375  # 15T tokens in rows of 4,096: only the computed order is measured
    positions = np.arange(full // 2, full // 2 + BATCH)
    seconds, peak = measure(lambda: Permutation(full, 0, 0)[positions])
    lines.append(f"{full:>14,} {'-':>9} {8 * full / 1e6:>10.0f} {seconds:>11.4f} {peak / 1e6:>12.2f} "
                 f"{'':>11} {'':>13}  (stored: 8 bytes a row, not drawn)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
